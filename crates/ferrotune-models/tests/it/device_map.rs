//! Pipeline placement (`--device-map`): the planner's modes against Accelerate's meanings, and a
//! model dispatched over several CPU "devices" giving bit-identical logits and greedy tokens to the
//! same model left on one device, with and without a KV cache, LoRA adapters and packed GGUF copies.
//!
//! The build machine has no GPU: repeating `Device::Cpu` makes `to_device` a no-op, but the
//! dispatched code path (per-device layer inputs, moves between layers, the head's device) runs.

use crate::common;

use candle_core::{DType, Device, Tensor};
use ferrotune_models::device_map::{format_bytes, plan, usable_bytes};
use ferrotune_models::Placement;
use ferrotune_models::{
    load_adapter, load_model, AttentionLayout, CausalLm, DeviceMapMode, KvCache,
};

use common::fixtures;

const GIB: u64 = 1 << 30;

fn layers_on(p: &Placement, device: usize) -> usize {
    p.layers.iter().filter(|&&d| d == device).count()
}

/// Device indices never decrease along the model (embed, layers, head), so every device holds one
/// contiguous run, and no device holds more than planning may fill.
fn assert_valid(p: &Placement, layer_bytes: &[u64], root: (u64, u64), caps: &[u64]) {
    let order: Vec<usize> = std::iter::once(p.embed)
        .chain(p.layers.iter().copied())
        .chain(std::iter::once(p.head))
        .collect();
    assert!(order.windows(2).all(|w| w[0] <= w[1]), "{p:?}");
    assert_eq!(p.layers.len(), layer_bytes.len());
    let bytes = p.bytes_per_device(layer_bytes, root, caps.len());
    assert_eq!(bytes.len(), caps.len(), "{p:?}");
    for (d, (&b, &c)) in bytes.iter().zip(caps).enumerate() {
        assert!(
            b <= usable_bytes(c),
            "device {d}: {b} > {}: {p:?}",
            usable_bytes(c)
        );
    }
}

#[test]
fn modes_parse_and_unknown_names_all_four() {
    for (name, mode) in [
        ("auto", DeviceMapMode::Auto),
        ("balanced", DeviceMapMode::Balanced),
        ("balanced_low_0", DeviceMapMode::BalancedLow0),
        ("Sequential", DeviceMapMode::Sequential),
    ] {
        assert_eq!(DeviceMapMode::parse(name).unwrap(), mode);
        assert_eq!(DeviceMapMode::parse(mode.name()).unwrap(), mode);
    }
    let err = DeviceMapMode::parse("balanced_low_1").unwrap_err();
    for n in [
        "balanced_low_1",
        "auto",
        "balanced",
        "balanced_low_0",
        "sequential",
    ] {
        assert!(err.contains(n), "{err}");
    }
}

/// 16 layers of 1 GiB, embedding and head of 0.5 GiB each: 17 GiB on 4 GPUs of 10 GiB.
fn sixteen_layers() -> (Vec<u64>, (u64, u64), Vec<u64>) {
    (vec![GIB; 16], (GIB / 2, GIB / 2), vec![10 * GIB; 4])
}

#[test]
fn balanced_and_auto_split_evenly_over_all_gpus() {
    let (layers, root, caps) = sixteen_layers();
    for mode in [DeviceMapMode::Balanced, DeviceMapMode::Auto] {
        let p = plan(mode, &layers, root, &caps).unwrap();
        assert_valid(&p, &layers, root, &caps);
        assert_eq!((p.embed, p.head), (0, 3), "{p:?}");
        for d in 0..4 {
            assert_eq!(layers_on(&p, d), 4, "{mode:?}: {p:?}");
        }
        assert_eq!(p.describe(0), "embed, layers 0-3");
        assert_eq!(p.describe(3), "layers 12-15, norm + head");
    }
}

#[test]
fn balanced_evens_out_the_last_devices() {
    // Plain greedy filling under the best ceiling would give 3, 3, 3, 1.
    let layers = vec![GIB; 10];
    let caps = vec![100 * GIB; 4];
    let p = plan(DeviceMapMode::Balanced, &layers, (0, 0), &caps).unwrap();
    assert_valid(&p, &layers, (0, 0), &caps);
    let counts: Vec<usize> = (0..4).map(|d| layers_on(&p, d)).collect();
    assert_eq!(counts.iter().sum::<usize>(), 10);
    assert!(counts.iter().all(|&c| c == 2 || c == 3), "{counts:?}");
}

#[test]
fn balanced_respects_small_devices() {
    // GPU 1 is small: it gets what fits, the others share the rest.
    let layers = vec![GIB; 12];
    let caps = vec![10 * GIB, 2 * GIB, 10 * GIB];
    let p = plan(DeviceMapMode::Balanced, &layers, (0, 0), &caps).unwrap();
    assert_valid(&p, &layers, (0, 0), &caps);
    assert_eq!(layers_on(&p, 1), 1, "{p:?}");
    assert!(layers_on(&p, 0) >= 5 && layers_on(&p, 2) >= 5, "{p:?}");
}

#[test]
fn balanced_low_0_keeps_gpu_0_free() {
    let (layers, root, caps) = sixteen_layers();
    let p = plan(DeviceMapMode::BalancedLow0, &layers, root, &caps).unwrap();
    assert_valid(&p, &layers, root, &caps);
    assert!(!p.uses(0), "{p:?}");
    assert_eq!(p.describe(0), "nothing");
    assert_eq!((p.embed, p.head), (1, 3));
    for d in 1..4 {
        let n = layers_on(&p, d);
        assert!((5..=6).contains(&n), "{p:?}");
    }
}

#[test]
fn balanced_low_0_puts_only_the_overflow_on_gpu_0() {
    // 18 parts of 1 GiB; 6 GiB GPUs keep 5.4 GiB usable, so GPUs 1-3 hold 15 parts: GPU 0 takes
    // the first three (embed, layers 0-1) and nothing more.
    let layers = vec![GIB; 16];
    let caps = vec![6 * GIB; 4];
    let p = plan(DeviceMapMode::BalancedLow0, &layers, (GIB, GIB), &caps).unwrap();
    assert_valid(&p, &layers, (GIB, GIB), &caps);
    assert_eq!(p.embed, 0);
    assert_eq!(layers_on(&p, 0), 2, "{p:?}");
    assert_eq!(p.describe(0), "embed, layers 0-1");
    for d in 1..4 {
        assert_eq!(layers_on(&p, d) + usize::from(p.head == d), 5, "{p:?}");
    }
}

#[test]
fn balanced_low_0_on_one_gpu_uses_it() {
    let p = plan(
        DeviceMapMode::BalancedLow0,
        &[GIB; 4],
        (GIB, GIB),
        &[10 * GIB],
    )
    .unwrap();
    assert_eq!(p, Placement::single(4));
}

#[test]
fn sequential_fills_gpu_0_first_and_uses_only_what_it_needs() {
    let (layers, root, caps) = sixteen_layers();
    let p = plan(DeviceMapMode::Sequential, &layers, root, &caps).unwrap();
    assert_valid(&p, &layers, root, &caps);
    // 9 GiB usable per GPU: embed + 8 layers, then 8 layers + head; GPUs 2 and 3 stay unused.
    assert_eq!(p.describe(0), "embed, layers 0-7");
    assert_eq!(p.describe(1), "layers 8-15, norm + head");
    assert!(!p.uses(2) && !p.uses(3));
    assert_eq!(p.devices_needed(), 2);
    // A model that fits on GPU 0 stays there.
    let small = plan(DeviceMapMode::Sequential, &[GIB; 4], root, &caps).unwrap();
    assert_eq!(small, Placement::single(4));
}

#[test]
fn too_big_a_model_is_an_error_naming_the_shortfall() {
    // 16 × 3 GiB + 1 GiB = 49 GiB against 4 × 9 GiB usable.
    let layers = vec![3 * GIB; 16];
    let caps = vec![10 * GIB; 4];
    for mode in [
        DeviceMapMode::Auto,
        DeviceMapMode::Balanced,
        DeviceMapMode::BalancedLow0,
        DeviceMapMode::Sequential,
    ] {
        let err = plan(mode, &layers, (GIB / 2, GIB / 2), &caps).unwrap_err();
        for needle in [
            "does not fit on 4 device(s)",
            "49.00 GiB",
            "36.00 GiB",
            "short by 13.00 GiB",
            "from layer 11 on",
            "10%",
        ] {
            assert!(
                err.contains(needle),
                "{mode:?}: '{needle}' missing from: {err}"
            );
        }
    }
    // Enough bytes in total, but a part larger than any device's room.
    let err = plan(DeviceMapMode::Balanced, &[5 * GIB], (0, 0), &[5 * GIB; 2]).unwrap_err();
    assert!(
        err.contains("from layer 0 on") && err.contains("do not pack"),
        "{err}"
    );
    let err = plan(DeviceMapMode::Balanced, &[GIB], (0, 0), &[]).unwrap_err();
    assert!(err.contains("no device"), "{err}");
}

#[test]
fn every_mode_gives_valid_placements_for_uneven_models() {
    // A small deterministic generator: sizes and capacities vary, the invariants must not.
    let mut state = 0x1234_5678u64;
    let mut next = move |m: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % m
    };
    let mut placed = 0;
    for _ in 0..300 {
        let n_layers = 1 + next(40) as usize;
        let layers: Vec<u64> = (0..n_layers).map(|_| 1 + next(1000)).collect();
        let root = (next(3000), next(3000));
        let caps: Vec<u64> = (0..1 + next(6)).map(|_| next(20_000)).collect();
        let fits = plan(DeviceMapMode::Sequential, &layers, root, &caps).is_ok();
        for mode in [
            DeviceMapMode::Balanced,
            DeviceMapMode::BalancedLow0,
            DeviceMapMode::Sequential,
        ] {
            match plan(mode, &layers, root, &caps) {
                Ok(p) => {
                    assert!(fits);
                    assert_valid(&p, &layers, root, &caps);
                    placed += 1;
                }
                Err(e) => assert!(!fits && e.contains("does not fit"), "{e}"),
            }
        }
    }
    assert!(placed > 100, "too few cases fit: {placed}");
}

#[test]
fn bytes_read_for_people() {
    assert_eq!(format_bytes(512), "512 B");
    assert_eq!(format_bytes(3 << 20), "3.0 MiB");
    assert_eq!(format_bytes(3 * GIB / 2), "1.50 GiB");
    assert_eq!(usable_bytes(1000), 900);
}

// ---- a dispatched model against the same model on one device ----

fn load(family: &str) -> CausalLm {
    load_model(
        &fixtures().join(family).join("model"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap_or_else(|e| panic!("{family}: {e}"))
    .0
}

fn cpus(n: usize) -> Vec<Device> {
    vec![Device::Cpu; n]
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// A left-padded batch of two prompts: the masks see padding, the positions start per row.
fn padded_batch(vocab: u32) -> (Tensor, AttentionLayout) {
    let ids: Vec<u32> = [0, 0, 5, 17, 42, 7, 1, 2, 3, 4, 99, 250]
        .iter()
        .map(|&i| i % vocab)
        .collect();
    let layout = AttentionLayout {
        positions: vec![vec![1, 1, 0, 1, 2, 3], vec![0, 1, 2, 3, 4, 5]],
        key_valid: vec![vec![false, false, true, true, true, true], vec![true; 6]],
        segments: None,
    };
    (Tensor::from_vec(ids, (2, 6), &Device::Cpu).unwrap(), layout)
}

/// Greedy decoding of `steps` tokens through a KV cache; the logits of every step, as bits.
fn greedy(model: &CausalLm, prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<Vec<u32>>) {
    let mut cache = KvCache::new(model.layers.len());
    let input = Tensor::new(prompt, model.device())
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let mut layout = AttentionLayout::causal(1, prompt.len(), 0);
    let mut logits = model.forward(&input, &layout, Some(&mut cache)).unwrap();
    let (mut tokens, mut all) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let last = logits.narrow(1, logits.dim(1).unwrap() - 1, 1).unwrap();
        assert!(last.device().same_device(model.head_device()));
        all.push(bits(&last));
        let next = last
            .flatten_all()
            .unwrap()
            .argmax(0)
            .unwrap()
            .to_scalar::<u32>()
            .unwrap();
        tokens.push(next);
        let past = cache.len();
        layout = AttentionLayout::causal(1, 1, past);
        let step = Tensor::new(&[[next]], model.device()).unwrap();
        logits = model.forward(&step, &layout, Some(&mut cache)).unwrap();
    }
    (tokens, all)
}

/// Full-forward logits (padded batch, no cache) and greedy decoding (cache) of `dispatched` equal
/// `plain`'s bit for bit.
fn assert_same(plain: &CausalLm, dispatched: &CausalLm, what: &str) {
    let (ids, layout) = padded_batch(plain.config.vocab_size as u32);
    let want = plain.forward(&ids, &layout, None).unwrap();
    let got = dispatched.forward(&ids, &layout, None).unwrap();
    assert_eq!(want.dims(), got.dims(), "{what}");
    assert!(
        bits(&want) == bits(&got),
        "{what}: full-forward logits differ"
    );
    let prompt = [1u32, 5, 9, 2, 30];
    let (want_tokens, want_logits) = greedy(plain, &prompt, 6);
    let (got_tokens, got_logits) = greedy(dispatched, &prompt, 6);
    assert_eq!(want_tokens, got_tokens, "{what}: greedy tokens differ");
    assert!(want_logits == got_logits, "{what}: decode logits differ");
}

fn placements(num_layers: usize) -> Vec<Placement> {
    assert_eq!(num_layers, 2, "the fixtures have two layers");
    vec![
        // Every part on its own device but the head, which follows the last layer.
        Placement {
            embed: 0,
            layers: vec![1, 2],
            head: 2,
        },
        // The head away from the embedding (a tied head needs its own copy).
        Placement {
            embed: 0,
            layers: vec![0, 1],
            head: 2,
        },
        // Not monotone: dispatch accepts any placement, the planner never makes one.
        Placement {
            embed: 2,
            layers: vec![1, 0],
            head: 1,
        },
    ]
}

#[test]
fn dispatched_fixture_models_match_the_undispatched_ones_bit_for_bit() {
    for family in ["llama3", "qwen2"] {
        let plain = load(family);
        for p in placements(plain.layers.len()) {
            let mut spread = plain.clone();
            spread.dispatch(&p, &cpus(3)).unwrap();
            assert_eq!(spread.placement().unwrap().0, &p);
            assert_eq!(spread.placement().unwrap().1.len(), 3);
            assert_same(&plain, &spread, &format!("{family} {p:?}"));
        }
        // A planned placement: three fake devices, none large enough for the whole model.
        let (layers, root) = plain.part_bytes();
        let total: u64 = layers.iter().sum::<u64>() + root.0 + root.1;
        let caps = vec![total * 6 / 10; 3];
        for mode in [DeviceMapMode::Balanced, DeviceMapMode::Sequential] {
            let p = plan(mode, &layers, root, &caps).unwrap();
            assert!(p.devices_needed() >= 2, "{mode:?}: {p:?}");
            let mut spread = plain.clone();
            spread.dispatch(&p, &cpus(3)).unwrap();
            assert_same(&plain, &spread, &format!("{family} {mode:?} {p:?}"));
        }
    }
}

#[test]
fn dispatched_models_of_other_families_match() {
    // Gemma scales embeddings (the scale lives on the embedding's device), Phi-3 fuses projections,
    // Qwen3 has per-head norms.
    for family in ["gemma", "phi3", "qwen3"] {
        let dir = format!("models/{family}");
        let plain = load(&dir);
        let mut spread = plain.clone();
        spread
            .dispatch(
                &Placement {
                    embed: 0,
                    layers: vec![1, 2],
                    head: 2,
                },
                &cpus(3),
            )
            .unwrap();
        assert_same(&plain, &spread, &dir);
    }
}

#[test]
fn dispatched_adapters_move_with_their_layers() {
    // A LoRA adapter on the attention/MLP projections, and one on the output head.
    for (family, adapter) in [
        ("llama3", "llama3/adapter"),
        ("llama3", "lora_variants/lm_head/adapter"),
    ] {
        let mut plain = load(family);
        load_adapter(&mut plain, &fixtures().join(adapter)).unwrap();
        let mut spread = plain.clone();
        spread
            .dispatch(
                &Placement {
                    embed: 0,
                    layers: vec![1, 1],
                    head: 2,
                },
                &cpus(3),
            )
            .unwrap();
        assert!(spread.linears().iter().any(|(_, l)| l.adapter.is_some()));
        assert_same(&plain, &spread, adapter);
    }
}

#[test]
fn dispatch_rejects_a_placement_that_does_not_match() {
    let plain = load("llama3");
    let mut model = plain.clone();
    let err = model
        .dispatch(&Placement::single(3), &cpus(1))
        .unwrap_err()
        .to_string();
    assert!(err.contains("3 layers") && err.contains("has 2"), "{err}");
    let p = Placement {
        embed: 0,
        layers: vec![0, 3],
        head: 3,
    };
    let err = model.dispatch(&p, &cpus(3)).unwrap_err().to_string();
    assert!(err.contains("uses 4 devices, 3 given"), "{err}");
    assert!(model.placement().is_none());
    assert_same(&plain, &model, "after refused dispatches");
}

#[test]
fn part_bytes_add_up_to_the_weights() {
    let model = load("llama3");
    let (layers, (embed, head)) = model.part_bytes();
    let c = &model.config;
    let (h, v) = (c.hidden_size as u64, c.vocab_size as u64);
    assert_eq!(layers.len(), 2);
    assert_eq!(embed, v * h * 4);
    // Untied head: its own weight plus the final norm.
    assert_eq!(head, v * h * 4 + h * 4);
    assert!(layers.iter().all(|&b| b == layers[0] && b > 0));
}

/// SmolLM2 (30 layers, tied head) from GGUF keeps its packed block copies on CPU devices, so the
/// fast decode path and its results stay the same.
#[test]
fn dispatched_gguf_model_keeps_packed_copies_on_cpu_devices() {
    let path = ferrotune_data::asset_path("SmolLM2-135M-Instruct.Q4_1.gguf")
        .unwrap_or_else(|e| panic!("{e}"));
    let (plain, _) = load_model(&path, DType::F32, &Device::Cpu).unwrap();
    assert!(plain.linears().iter().all(|(_, l)| l.packed.is_some()));
    let (layers, root) = plain.part_bytes();
    let total: u64 = layers.iter().sum::<u64>() + root.0 + root.1;
    let p = plan(DeviceMapMode::Balanced, &layers, root, &[total / 2; 3]).unwrap();
    assert!((0..3).all(|d| p.uses(d)), "{p:?}");
    assert_ne!(p.embed, p.head);
    let mut spread = plain.clone();
    spread.dispatch(&p, &cpus(3)).unwrap();
    assert!(spread.linears().iter().all(|(_, l)| l.packed.is_some()));
    let prompt = [1u32, 9690, 28, 253, 2418];
    let (want_tokens, want_logits) = greedy(&plain, &prompt, 8);
    let (got_tokens, got_logits) = greedy(&spread, &prompt, 8);
    assert_eq!(want_tokens, got_tokens);
    assert!(want_logits == got_logits, "decode logits differ");
}
