//! FP8 block-quantized checkpoints (transformers' `FineGrainedFP8Config`: DeepSeek-V3 / R1,
//! Kimi-K2, Qwen3 `-FP8`), read dequantized as transformers 5.24 dequantizes them
//! (tests/fixtures/fp8, `scripts/make_fp8_fixtures.py`): the e4m3 values of all 256 bytes, the
//! f32 product and its bf16 cast bit for bit, the tiny DeepSeek-V3 (partial blocks) and Qwen3
//! checkpoints' logits, saved back plain, and what is refused.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use ferrotune_models::fp8::{dequantize, e4m3_to_f32, Fp8Blocks};
use ferrotune_models::peft::merged_tensors;
use ferrotune_models::{load_model, save_hf_checkpoint, AttentionLayout, CausalLm};
use serde_json::Value;

use common::{fixtures, max_abs_diff};

fn dir(case: &str) -> PathBuf {
    fixtures().join("fp8").join(case)
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn tensors(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn forward(model: &CausalLm, rows: &Value) -> Tensor {
    let rows: Vec<Vec<u32>> = serde_json::from_value(rows.clone()).unwrap();
    let ids = Tensor::new(rows, &Device::Cpu).unwrap();
    let (b, t) = ids.dims2().unwrap();
    model
        .forward(&ids, &AttentionLayout::causal(b, t, 0), None)
        .unwrap()
}

/// A copy of a fixture's model folder whose config.json is changed by `edit`.
fn edited_copy(case: &str, name: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let out = std::env::temp_dir().join(format!("ferrotune-fp8-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(dir(case).join("model").join(f), out.join(f)).unwrap();
    }
    let mut config = read_json(&out.join("config.json"));
    edit(&mut config);
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    out
}

/// Every byte's e4m3 value is torch's `float8_e4m3fn` reading of it, bit for bit (NaN where
/// torch's is NaN).
#[test]
fn e4m3_bytes_read_as_torch_reads_them() {
    let t = tensors(&dir("synthetic.safetensors"));
    let bytes = t["bytes"].to_vec1::<u8>().unwrap();
    let want = t["values"].to_vec1::<f32>().unwrap();
    assert_eq!(bytes.len(), 256);
    for (b, w) in bytes.iter().zip(&want) {
        let got = e4m3_to_f32(*b);
        assert!(
            got.to_bits() == w.to_bits() || (got.is_nan() && w.is_nan()),
            "byte {b:#04x}: {got} vs torch's {w}"
        );
    }
    assert_eq!(want.iter().filter(|v| v.is_nan()).count(), 2);
}

/// A [40, 50] weight in blocks [16, 24] (partial blocks on both axes): transformers' f32
/// product and its bf16 cast, bit for bit.
#[test]
fn partial_blocks_dequantize_as_transformers() {
    let path = dir("synthetic.safetensors");
    let file = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&file).unwrap();
    let weight = st.tensor("weight").unwrap();
    assert_eq!(weight.dtype(), safetensors::Dtype::F8_E4M3);
    let t = tensors(&path);
    let blocks = Fp8Blocks {
        block: Some([16, 24]),
    };
    let got = dequantize(weight.data(), weight.shape(), &t["scale_inv"], blocks, "w").unwrap();
    assert_eq!(got.dims(), [40, 50]);
    assert_eq!(max_abs_diff(&got, &t["want_f32"]), 0.0);
    let bf16 = got.to_dtype(DType::BF16).unwrap();
    let want = t["want_bf16"].to_dtype(DType::F32).unwrap();
    assert_eq!(
        max_abs_diff(&bf16.to_dtype(DType::F32).unwrap(), &want),
        0.0
    );
    // Blocks [24, 16] would make a [2, 4] grid, not the stored [3, 3]: refused.
    let swapped = Fp8Blocks {
        block: Some([24, 16]),
    };
    assert!(dequantize(weight.data(), weight.shape(), &t["scale_inv"], swapped, "w").is_err());
}

/// The tiny DeepSeek-V3 in FP8 blocks [16, 24] (partial blocks in most matrices; the embedding,
/// head and routers stored as floats) gives the logits of transformers' model holding its
/// dequantized weights; Qwen3 in blocks [16, 16] those of transformers loading it with
/// `FineGrainedFP8Config(dequantize=True)`. Saved, each is a plain checkpoint (no
/// `quantization_config`, no scales) that loads back to the same logits.
#[test]
fn fp8_checkpoints_give_transformers_logits_and_save_plain() {
    for case in ["deepseek_v3", "qwen3"] {
        let g = read_json(&dir(case).join("golden.json"));
        let model = load_model(&dir(case).join("model"), DType::F32, &Device::Cpu)
            .unwrap()
            .0;
        assert!(model.config.fp8.is_some(), "{case}");
        let logits = forward(&model, &g["input_ids"]);
        let err = max_abs_diff(
            &logits,
            &tensors(&dir(case).join("golden.safetensors"))["logits"],
        );
        eprintln!("{case}: logits max abs error {err:.3e} against transformers");
        assert!(err <= 1e-4, "{case}: logits max abs error {err}");
        assert!(model.config.raw.get("quantization_config").is_none());
        let saved = merged_tensors(&model).unwrap();
        assert!(!saved.keys().any(|k| k.ends_with("_scale_inv")), "{case}");
        assert!(saved.values().all(|t| t.dtype() == DType::F32), "{case}");
        let out = std::env::temp_dir().join(format!("ferrotune-fp8-{case}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        save_hf_checkpoint(&out, &model.config, None, &saved, DType::F32, u64::MAX).unwrap();
        let config = read_json(&out.join("config.json"));
        assert!(config.get("quantization_config").is_none(), "{config}");
        let back = load_model(&out, DType::F32, &Device::Cpu).unwrap().0;
        assert!(back.config.fp8.is_none());
        assert_eq!(max_abs_diff(&forward(&back, &g["input_ids"]), &logits), 0.0);
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// FP8 weights without a config saying how their scales apply, and FP8 variants transformers'
/// format does not hold (or that would lose their activation scales), are refused with the
/// reason; so is a scale grid that does not fit the declared blocks.
#[test]
fn what_is_not_this_format_is_refused() {
    type Case = (&'static str, fn(&mut Value), &'static [&'static str]);
    let cases: [Case; 4] = [
        (
            "no-config",
            |c| {
                c.as_object_mut().unwrap().remove("quantization_config");
            },
            &["F8_E4M3", "quantization_config"],
        ),
        (
            "static",
            |c| c["quantization_config"]["activation_scheme"] = "static".into(),
            &["activation_scheme", "static"],
        ),
        (
            "e5m2",
            |c| c["quantization_config"]["fmt"] = "e5m2".into(),
            &["e5m2", "e4m3"],
        ),
        (
            "blocks",
            |c| c["quantization_config"]["weight_block_size"] = serde_json::json!([16, 16]),
            &["weight_scale_inv", "does not fit"],
        ),
    ];
    for (name, edit, needles) in cases {
        let path = edited_copy("deepseek_v3", name, edit);
        let err = match load_model(&path, DType::F32, &Device::Cpu) {
            Ok(_) => panic!("{name}: loaded"),
            Err(e) => e.to_string(),
        };
        for n in needles {
            assert!(err.contains(n), "{name}: '{n}' missing from: {err}");
        }
        let _ = std::fs::remove_dir_all(&path);
    }
}

/// An FP8 weight whose scale is missing, or a scale whose weight is, is refused naming it.
#[test]
fn a_weight_or_scale_without_its_other_half_is_refused() {
    let name = "model.layers.0.self_attn.o_proj.weight";
    for (case, drop, needle) in [
        ("no-scale", format!("{name}_scale_inv"), "without its"),
        ("no-weight", name.to_string(), "has no FP8 weight"),
    ] {
        let path = edited_copy("deepseek_v3", case, |_| {});
        let file = path.join("model.safetensors");
        let mut t = tensors(&file);
        assert_eq!(t[name].dtype(), DType::F8E4M3);
        t.remove(&drop).unwrap();
        candle_core::safetensors::save(&t, &file).unwrap();
        let err = match load_model(&path, DType::F32, &Device::Cpu) {
            Ok(_) => panic!("{case}: loaded"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(needle) && err.contains(name), "{case}: {err}");
        let _ = std::fs::remove_dir_all(&path);
    }
}
