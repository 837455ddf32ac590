//! Qwen3.5 (dense, MoE) and Qwen3-Next as llama.cpp's own convert_hf_to_gguf.py writes them
//! (`qwen35`, `qwen35moe`, `qwen3next`: tests/fixtures/gguf/{qwen3_5,qwen3_5_moe,qwen3_next}_tiny.gguf,
//! scripts/make_gguf_fixtures.py --qwen35-only) from the tiny checkpoints of tests/fixtures/models
//! (Qwen3-Next's made all sparse with renormalized top-k weights, as llama.cpp computes it): loaded,
//! they give those checkpoints' logits and greedy tokens in transformers.

use crate::common;

use candle_core::{DType, Device, Tensor, D};
use ferrotune_models::{load_model, AttentionLayout, CausalLm};

use common::{fixtures, max_abs_diff};

/// The `qwen3_5_*` reference of `kind`: input ids, logits, and the greedy sequence (prompt
/// and new tokens).
fn reference(kind: &str) -> (Tensor, Tensor, Vec<u32>) {
    let r = candle_core::safetensors::load(
        fixtures().join(format!("gguf/{kind}_tiny_reference.safetensors")),
        &Device::Cpu,
    )
    .unwrap();
    let greedy = r["greedy"]
        .to_dtype(DType::U32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    (
        r["input_ids"].to_dtype(DType::U32).unwrap(),
        r["logits"].clone(),
        greedy,
    )
}

/// Greedy decoding of `new` tokens after `prompt`, each step a forward over the whole sequence.
fn greedy(model: &CausalLm, prompt: &[u32], new: usize) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    for _ in 0..new {
        let ids = Tensor::new(seq.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = model
            .forward(&ids, &AttentionLayout::causal(1, seq.len(), 0), None)
            .unwrap();
        let last = logits.get(0).unwrap().get(seq.len() - 1).unwrap();
        seq.push(last.argmax(D::Minus1).unwrap().to_scalar::<u32>().unwrap());
    }
    seq
}

/// The greedy reference's prompt length (scripts/make_gguf_fixtures.py's `QWEN35_PROMPT`).
const PROMPT: usize = 6;

#[test]
fn qwen35_ggufs_from_llama_cpps_converter_give_the_source_models_logits_and_tokens() {
    for (kind, model_type, experts) in [
        ("qwen3_5", "qwen3_5_text", 0),
        ("qwen3_5_moe", "qwen3_5_moe_text", 4),
        ("qwen3_next", "qwen3_next", 4),
    ] {
        let path = fixtures().join(format!("gguf/{kind}_tiny.gguf"));
        let (model, _) =
            load_model(&path, DType::F32, &Device::Cpu).unwrap_or_else(|e| panic!("{kind}: {e}"));
        let c = &model.config;
        assert_eq!(c.model_type, model_type);
        let dn = c.delta_net.as_ref().expect("linear attention");
        assert_eq!(dn.layers, vec![true, true, true, false], "{kind}");
        assert_eq!((dn.key_heads, dn.value_heads), (2, 4), "{kind}");
        assert_eq!((dn.key_head_dim, dn.value_head_dim), (8, 16), "{kind}");
        assert_eq!(c.rope.partial_rotary_factor, 0.25, "{kind}");
        assert_eq!(
            c.moe.as_ref().map_or(0, |m| m.num_experts),
            experts,
            "{kind}"
        );
        assert!(!c.tie_word_embeddings);
        let (ids, want, tokens) = reference(kind);
        let (b, t) = ids.dims2().unwrap();
        let logits = model
            .forward(&ids, &AttentionLayout::causal(b, t, 0), None)
            .unwrap();
        let err = max_abs_diff(&logits, &want);
        assert!(err <= 1e-4, "{kind}: logits differ by {err}");
        let got = greedy(&model, &tokens[..PROMPT], tokens.len() - PROMPT);
        assert_eq!(got, tokens, "{kind}: greedy tokens");
    }
}

/// The converter's Q8_0 file of dense Qwen3.5 (its matrices in 8-bit blocks; the conv, norms
/// and DeltaNet vectors f32) reads to the f32 file's tensors within Q8_0's rounding (half a step
/// of a block's scale, at most 1/254 of the tensor's largest value, with the f16 scale's own
/// rounding), every one reordered and renamed alike; the vectors exactly. (The tiny random
/// model's logits move by far more than its weights, so they are not compared.)
#[test]
fn qwen35_q8_0_gguf_reads_to_the_f32_files_tensors_within_its_rounding() {
    let read = |file: &str| {
        ferrotune_models::gguf::load_gguf(
            &fixtures().join(format!("gguf/{file}")),
            DType::F32,
            &Device::Cpu,
        )
        .unwrap()
    };
    let (c8, q8) = read("qwen3_5_q8_tiny.gguf");
    let (c32, f32s) = read("qwen3_5_tiny.gguf");
    assert_eq!(c8.delta_net, c32.delta_net);
    assert_eq!(q8.len(), f32s.len());
    let mut quantized = 0;
    for (name, want) in &f32s {
        let got = q8.get(name).unwrap_or_else(|| panic!("no {name}"));
        assert_eq!(got.dims(), want.dims(), "{name}");
        let err = max_abs_diff(got, want);
        let top = want
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        if want.rank() == 1 || name.contains("conv1d") {
            assert_eq!(err, 0.0, "{name}");
        } else {
            assert!(
                err <= top / 240.0,
                "{name}: differs by {err} (largest {top})"
            );
            quantized += usize::from(err > 0.0);
        }
    }
    assert!(quantized > 20, "only {quantized} tensors were quantized");
}

/// A `qwen3next` file's fused projection is put back together per key head: the GGUF's
/// `in_proj_qkvz` and `in_proj_ba` equal the source checkpoint's, as do Qwen3.5's DeltaNet
/// tensors after its value heads are put back in transformers' order and `A_log` recovered.
#[test]
fn qwen35_gguf_tensors_equal_the_checkpoints() {
    for (kind, names) in [
        (
            "qwen3_5",
            &[
                "linear_attn.in_proj_qkv.weight",
                "linear_attn.in_proj_z.weight",
                "linear_attn.in_proj_a.weight",
                "linear_attn.out_proj.weight",
                "linear_attn.conv1d.weight",
                "linear_attn.dt_bias",
                "input_layernorm.weight",
            ][..],
        ),
        (
            "qwen3_next",
            &[
                "linear_attn.in_proj_qkvz.weight",
                "linear_attn.in_proj_ba.weight",
                "linear_attn.out_proj.weight",
            ][..],
        ),
    ] {
        let (_, got) = ferrotune_models::gguf::load_gguf(
            &fixtures().join(format!("gguf/{kind}_tiny.gguf")),
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        let want = candle_core::safetensors::load(
            fixtures().join(format!("models/{kind}/model/model.safetensors")),
            &Device::Cpu,
        )
        .unwrap();
        for name in names {
            let n = format!("model.layers.0.{name}");
            let (a, b) = (&got[&n], &want[&n]);
            assert_eq!(a.dims(), b.dims(), "{kind}: {n}");
            let err = max_abs_diff(a, b);
            assert!(err <= 1e-6, "{kind}: {n} differs by {err}");
        }
        let a_log = "model.layers.0.linear_attn.A_log";
        let err = max_abs_diff(&got[a_log], &want[a_log]);
        assert!(err <= 1e-5, "{kind}: A_log differs by {err}");
    }
}

/// A file whose `ssm.*` sizes disagree with its tensors is an error naming the tensor, not a
/// panic or a wrong model: dense Qwen3.5 with `ssm.time_step_rank` 8 instead of 4 (its value heads
/// then 8 of 8 dimensions, still 64 in all) fails at the first per-head vector, `ssm_a`.
#[test]
fn qwen35_sizes_that_disagree_with_the_tensors_are_refused() {
    let src = std::fs::read(fixtures().join("gguf/qwen3_5_tiny.gguf")).unwrap();
    let key = b"qwen35.ssm.time_step_rank";
    let at = src
        .windows(key.len())
        .position(|w| w == key)
        .expect("time_step_rank in the file");
    let value = at + key.len() + 4; // the type (u32 = 4), then the value
    let mut bytes = src.clone();
    assert_eq!(&bytes[value..value + 4], &4u32.to_le_bytes());
    bytes[value..value + 4].copy_from_slice(&8u32.to_le_bytes());
    let dir = std::env::temp_dir().join(format!("ferrotune-qwen35-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sizes.gguf");
    std::fs::write(&path, bytes).unwrap();
    let err = ferrotune_models::gguf::load_gguf(&path, DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("blk.0.ssm_a"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
