//! `CausalLm::decode_step` (the fixed-capacity KV cache written in place, the step the CUDA decode
//! kernels run) against the forward pass with its concatenated cache, on the CPU where both are
//! made of the same ops: every family's tiny checkpoint, a left-padded batch, sliding windows,
//! the cache growing past its first capacity, and the forward taking over a fixed cache.

use crate::common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, D};
use ferrotune_models::{load_model, AttentionLayout, CausalLm, KvCache, ModelConfig};

use common::fixtures;

fn fixture_models() -> Vec<PathBuf> {
    let root = fixtures();
    let mut cases = vec![root.join("llama3/model"), root.join("qwen2/model")];
    for e in std::fs::read_dir(root.join("models")).unwrap() {
        let p = e.unwrap().path().join("model");
        if p.join("config.json").is_file() {
            cases.push(p);
        }
    }
    cases.sort();
    cases
}

/// Families the decode step refuses (Phi-2, mixtures of experts, gpt-oss's sinks and experts,
/// Gemma 4, OLMo 2's layers without pre-norms, Qwen3.5's Gated DeltaNet): the forward decodes
/// them.
fn decode_step_refuses(c: &ModelConfig) -> bool {
    c.layer_norm
        || c.moe.is_some()
        || c.gpt_oss_moe.is_some()
        || c.gemma4.is_some()
        || !c.pre_norms
        || c.delta_net.is_some()
}

/// A left-padded batch as generation builds it: ids `[batch, longest]` and its layout.
fn padded_batch(prompts: &[Vec<u32>]) -> (Tensor, AttentionLayout) {
    let longest = prompts.iter().map(Vec::len).max().unwrap();
    let mut ids = Vec::new();
    let mut layout = AttentionLayout {
        positions: vec![],
        key_valid: vec![],
        segments: None,
    };
    for p in prompts {
        let pad = longest - p.len();
        ids.extend(std::iter::repeat_n(0u32, pad));
        ids.extend_from_slice(p);
        let mut valid = vec![false; pad];
        valid.extend(std::iter::repeat_n(true, p.len()));
        layout.key_valid.push(valid);
        let mut pos: Vec<u32> = vec![1; pad];
        pos.extend(0..p.len() as u32);
        layout.positions.push(pos);
    }
    let t = Tensor::from_vec(ids, (prompts.len(), longest), &Device::Cpu).unwrap();
    (t, layout)
}

/// The layout of the next single-token step.
fn advance(layout: &mut AttentionLayout) {
    for r in 0..layout.positions.len() {
        let next = layout.positions[r].last().copied().unwrap() + 1;
        layout.positions[r] = vec![next];
        layout.key_valid[r].push(true);
    }
}

fn argmax_tokens(model: &CausalLm, hidden: &Tensor) -> Tensor {
    let last = hidden.dim(1).unwrap() - 1;
    let logits = model.logits(&hidden.narrow(1, last, 1).unwrap()).unwrap();
    logits
        .argmax(D::Minus1)
        .unwrap()
        .to_dtype(DType::U32)
        .unwrap()
}

fn max_rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs() / scale))
}

/// Decodes `steps` tokens of `prompts` twice (forward with its cache, decode_step with its own)
/// and checks every step's hidden states agree; greedy tokens from the forward drive both.
fn compare(model: &CausalLm, prompts: &[Vec<u32>], steps: usize, what: &str) {
    compare_with(model, prompts, steps, what, false);
}

/// [`compare`], with `replayed`: the steps go through the graph bookkeeping a GPU uses (the
/// first step on a buffer set eager, the next recorded, later ones replaying it with their inputs
/// copied into its buffers), each replay emulated by running the ops again with the recorded
/// position, so a step only comes out right if its position reaches the ops through the
/// device counters and every input through the refilled buffers.
fn compare_with(model: &CausalLm, prompts: &[Vec<u32>], steps: usize, what: &str, replayed: bool) {
    let (input, mut layout) = padded_batch(prompts);
    let mut forward_cache = KvCache::new(model.layers.len());
    let mut step_cache = KvCache::new(model.layers.len());
    if replayed {
        step_cache.emulate_graph_replay();
    }
    let hidden = model
        .forward_hidden(&input, &layout, Some(&mut forward_cache))
        .unwrap();
    model
        .forward_hidden(&input, &layout, Some(&mut step_cache))
        .unwrap();
    let mut next = argmax_tokens(model, &hidden);
    for step in 0..steps {
        advance(&mut layout);
        let want = model
            .forward_hidden(&next, &layout, Some(&mut forward_cache))
            .unwrap();
        let got = model.decode_step(&next, &layout, &mut step_cache).unwrap();
        assert_eq!(got.dims(), want.dims(), "{what} step {step}");
        let d = max_rel_diff(&got, &want);
        assert!(d <= 1e-5, "{what} step {step}: hidden states differ by {d}");
        assert_eq!(step_cache.len(), forward_cache.len(), "{what} step {step}");
        // Recorded from the second step on (and again after the cache grows).
        if replayed && (step == 1 || step + 1 == steps) {
            assert!(step_cache.has_recorded_step(), "{what} step {step}");
        }
        next = argmax_tokens(model, &want);
    }
}

fn load(path: &Path) -> CausalLm {
    load_model(path, DType::F32, &Device::Cpu).unwrap().0
}

#[test]
fn decode_step_equals_the_forward_for_every_family_on_a_padded_batch() {
    let cases = fixture_models();
    assert!(cases.len() >= 10);
    for case in cases {
        let model = load(&case);
        let c = &model.config;
        if decode_step_refuses(c) {
            // Phi-2, MoE, Gemma 4 and OLMo 2 models: the step refuses (the forward decodes those),
            // and says why.
            let one = Tensor::new(&[[1u32]], &Device::Cpu).unwrap();
            let mut cache = KvCache::new(model.layers.len());
            let err = model
                .decode_step(&one, &AttentionLayout::causal(1, 1, 0), &mut cache)
                .unwrap_err();
            let why = if c.layer_norm {
                "Phi-2"
            } else if c.gemma4.is_some() {
                "Gemma 4"
            } else if !c.pre_norms {
                "OLMo 2"
            } else if c.delta_net.is_some() {
                "Gated DeltaNet"
            } else {
                "mixture of experts"
            };
            assert!(err.to_string().contains(why), "{err}");
            continue;
        }
        let prompts = vec![vec![5, 9, 2, 7, 1, 3], vec![4, 8, 6], vec![11]];
        compare(&model, &prompts, 6, &case.display().to_string());
    }
}

/// Every dense family decodes the same through recorded and replayed steps (the CUDA graph path's
/// bookkeeping, replays emulated on the CPU), including Gemma 3's two ropes, SmolLM3's NoPE
/// layers, Ministral 3's query temperature and the cache growing past its first capacity (which
/// drops the recording and makes a new one).
#[test]
fn replayed_decode_steps_equal_the_forward() {
    for case in fixture_models() {
        let model = load(&case);
        let c = &model.config;
        if decode_step_refuses(c) {
            continue;
        }
        let prompts = vec![vec![5, 9, 2, 7, 1, 3], vec![4, 8, 6], vec![11]];
        compare_with(&model, &prompts, 6, &case.display().to_string(), true);
    }
    let model = load(&fixtures().join("models/llama3_2/model"));
    let prompt: Vec<u32> = (0..250).map(|i| (i * 7 + 3) % 100).collect();
    compare_with(&model, &[prompt, vec![1, 2]], 20, "growth", true);
}

#[test]
fn decode_step_honours_sliding_windows() {
    for family in ["mistral", "qwen3"] {
        let root = fixtures().join("models");
        let mut model = load(&root.join(family).join("model"));
        // Both layers windowed, one narrower than the prompt: keys drop out as the step advances.
        model.layers[0].sliding_window = Some(3);
        if let Some(l) = model.layers.get_mut(1) {
            l.sliding_window = Some(6);
        }
        compare(&model, &[vec![3, 1, 4, 1, 5, 9, 2], vec![6, 5]], 8, family);
    }
}

#[test]
fn the_fixed_cache_grows_past_its_first_capacity() {
    let root = fixtures().join("models");
    let model = load(&root.join("llama3_2/model"));
    // 250 prompt tokens + 20 steps: the first capacity (256 positions) fills and doubles.
    let prompt: Vec<u32> = (0..250).map(|i| (i * 7 + 3) % 100).collect();
    compare(&model, &[prompt, vec![1, 2]], 20, "growth");
}

#[test]
fn the_forward_takes_over_a_fixed_cache() {
    let root = fixtures().join("models");
    let model = load(&root.join("qwen2_5/model"));
    let (input, mut layout) = padded_batch(&[vec![7, 3, 9, 4], vec![2, 8]]);
    let mut a = KvCache::new(model.layers.len());
    let mut b = KvCache::new(model.layers.len());
    model.forward_hidden(&input, &layout, Some(&mut a)).unwrap();
    model.forward_hidden(&input, &layout, Some(&mut b)).unwrap();
    let ids = Tensor::new(&[[5u32], [6]], &Device::Cpu).unwrap();
    for _ in 0..2 {
        advance(&mut layout);
        model.forward_hidden(&ids, &layout, Some(&mut a)).unwrap();
        model.decode_step(&ids, &layout, &mut b).unwrap();
    }
    // Two more tokens at once through the forward: the fixed cache turns back into exact entries.
    let two = Tensor::new(&[[1u32, 2], [3, 4]], &Device::Cpu).unwrap();
    for r in 0..2 {
        let p = layout.positions[r][0];
        layout.positions[r] = vec![p + 1, p + 2];
        layout.key_valid[r].extend([true, true]);
    }
    let want = model.forward_hidden(&two, &layout, Some(&mut a)).unwrap();
    let got = model.forward_hidden(&two, &layout, Some(&mut b)).unwrap();
    assert!(max_rel_diff(&got, &want) <= 1e-5);
    assert_eq!(a.len(), b.len());
}

#[test]
fn decode_step_refuses_what_it_does_not_serve() {
    let root = fixtures().join("models");
    let model = load(&root.join("llama3_2/model"));
    let (input, layout) = padded_batch(&[vec![1, 2, 3]]);
    let mut cache = KvCache::new(model.layers.len());
    // Three tokens at once.
    let err = model.decode_step(&input, &layout, &mut cache).unwrap_err();
    assert!(err.to_string().contains("one token"), "{err}");
    // Packed samples.
    let mut packed = AttentionLayout::causal(1, 1, 0);
    packed.segments = Some(vec![vec![0]]);
    let one = Tensor::new(&[[1u32]], &Device::Cpu).unwrap();
    let err = model.decode_step(&one, &packed, &mut cache).unwrap_err();
    assert!(err.to_string().contains("packed"), "{err}");
    // A cache made for another model.
    let err = model
        .decode_step(
            &one,
            &AttentionLayout::causal(1, 1, 0),
            &mut KvCache::new(1),
        )
        .unwrap_err();
    assert!(err.to_string().contains("KV cache has 1 layers"), "{err}");
    // An unmerged LoRA adapter (the forward applies it; the decode step would not).
    let mut adapted = model.clone();
    let (_, o_proj) = adapted.linears_mut().into_iter().nth(3).unwrap();
    let (out, inp) = o_proj.weight.dims2().unwrap();
    o_proj.adapter = Some(ferrotune_models::LoraAdapter::new(
        Tensor::zeros((2, inp), DType::F32, &Device::Cpu).unwrap(),
        Tensor::zeros((out, 2), DType::F32, &Device::Cpu).unwrap(),
        1.0,
    ));
    let one_step = AttentionLayout::causal(1, 1, 0);
    let err = adapted
        .decode_step(&one, &one_step, &mut KvCache::new(model.layers.len()))
        .unwrap_err();
    assert!(
        err.to_string().contains("model.layers.0.self_attn.o_proj"),
        "{err}"
    );
}

/// The GPU, or `None` (and a note) where there is none.
#[cfg(feature = "cuda")]
fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("no GPU ({e}): skipped");
            None
        }
    }
}

/// Greedy decoding of `prompts` with `model` (on a GPU) through two caches side by side for
/// `steps` single-token steps, driven by `want`'s tokens: `want` steps with the decode kernels
/// off when `want_without_kernels`, `got` as configured; `check(step, largest relative
/// difference of the hidden states, got)` judges every step.
#[cfg(feature = "cuda")]
fn steps_side_by_side(
    model: &CausalLm,
    prompts: &[Vec<u32>],
    steps: usize,
    (mut want, mut got): (KvCache, KvCache),
    want_without_kernels: bool,
    check: impl Fn(usize, f32, &KvCache),
) {
    use ferrotune_core::decode::set_enabled;
    let device = model.device().clone();
    let (input, mut layout) = padded_batch(prompts);
    let input = input.to_device(&device).unwrap();
    let hidden = model
        .forward_hidden(&input, &layout, Some(&mut want))
        .unwrap();
    model
        .forward_hidden(&input, &layout, Some(&mut got))
        .unwrap();
    let mut next = argmax_tokens(model, &hidden);
    let f32 = |t: &Tensor| {
        t.to_dtype(DType::F32)
            .unwrap()
            .to_device(&Device::Cpu)
            .unwrap()
    };
    for step in 0..steps {
        advance(&mut layout);
        if want_without_kernels {
            set_enabled(false);
        }
        let wanted = model
            .forward_hidden(&next, &layout, Some(&mut want))
            .unwrap();
        if want_without_kernels {
            set_enabled(true);
        }
        let gotten = model
            .forward_hidden(&next, &layout, Some(&mut got))
            .unwrap();
        check(step, max_rel_diff(&f32(&gotten), &f32(&wanted)), &got);
        next = argmax_tokens(model, &wanted);
    }
}

/// On a GPU the forward sends single-token steps to `decode_step`, whose ops are then the CUDA
/// decode kernels: every family's generation with them against the forward's ops on the same GPU
/// (`decode::set_enabled(false)`), f32 and bf16, driven by the same greedy tokens. Passes without
/// checking anything where there is no GPU.
#[cfg(feature = "cuda")]
#[test]
fn decode_kernels_equal_the_forward_ops_on_a_gpu() {
    let Some(gpu) = gpu() else { return };
    for case in fixture_models() {
        for (dtype, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 2e-2)] {
            let model = load_model(&case, dtype, &gpu).unwrap().0;
            let caches = (
                KvCache::new(model.layers.len()),
                KvCache::new(model.layers.len()),
            );
            let prompts = [vec![5, 9, 2, 7, 1, 3], vec![4, 8, 6]];
            steps_side_by_side(&model, &prompts, 6, caches, true, |step, d, _| {
                assert!(
                    d <= tol,
                    "{} {dtype:?} step {step}: hidden states differ by {d}",
                    case.display()
                );
            });
            eprintln!("{} {dtype:?}: ok", case.display());
        }
    }
}

/// On a GPU decode steps are recorded as CUDA graphs and replayed: every dense family's greedy
/// steps through replays equal the same kernels launched one by one exactly (same kernels, same
/// order), f32 and bf16, across the cache growing past its first capacity (a new recording).
/// Fails if recording fails (graphs would turn off). Passes without checking anything where there
/// is no GPU.
#[cfg(feature = "cuda")]
#[test]
fn cuda_graph_replays_equal_kernel_launches_on_a_gpu() {
    let Some(gpu) = gpu() else { return };
    for case in fixture_models() {
        for dtype in [DType::F32, DType::BF16] {
            let model = load_model(&case, dtype, &gpu).unwrap().0;
            let c = &model.config;
            // Nothing is recorded for these.
            if decode_step_refuses(c) {
                continue;
            }
            let long: Vec<u32> = (0..250).map(|i| (i * 7 + 3) % 100).collect();
            let mut launched = KvCache::new(model.layers.len());
            launched.never_record_steps();
            let caches = (launched, KvCache::new(model.layers.len()));
            let prompts = [long, vec![4, 8, 6]];
            steps_side_by_side(&model, &prompts, 12, caches, false, |step, d, replayed| {
                assert!(
                    d == 0.0,
                    "{} {dtype:?} step {step}: replayed hidden states differ by {d}",
                    case.display()
                );
                if step == 2 || step == 11 {
                    assert!(
                        replayed.has_recorded_step(),
                        "{} {dtype:?} step {step}: no recorded step (did recording fail?)",
                        case.display()
                    );
                }
            });
            eprintln!("{} {dtype:?}: ok", case.display());
        }
    }
}
