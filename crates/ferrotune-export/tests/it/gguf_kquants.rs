//! `export-gguf`'s k-quant outputs against llama.cpp (scripts/make_kquant_fixtures.py): every
//! block format byte for byte as ggml's `ggml_quantize_chunk`, and whole Q4_K_M / Q5_K_M / Q6_K
//! files tensor for tensor (type and bytes) as `llama_model_quantize` makes them from ferrotune's
//! f32 export of the same model — a Llama with an untied head and rows that are not whole
//! superblocks, a Llama with tied embeddings, a Phi-3 with fused projections, the mixtures of
//! experts, and (from llama.cpp 0.3.36, also in Q4_K_S and Q4_0) the architectures of 2026:
//! Qwen3.5 and Qwen3.5-MoE (`qwen35`, `qwen35moe`: the DeltaNet's `attn_qkv`, `attn_gate`,
//! `ssm_*`), Qwen3-Next, gpt-oss (float experts, sinks, biases) and DeepSeek-V3 (8 experts) and
//! -V2 (`deepseek2`: `attn_k_b` / `attn_v_b`, `attn_kv_a_mqa`).

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::GgmlDType;
use ferrotune_export::gguf::{export_gguf, OutType};
use ferrotune_export::gguf_quants::{quantize, QuantKind};
use serde_json::Value;
use sha2::{Digest, Sha256};

use ferrotune_testing::fixtures;

fn golden() -> Value {
    let text = std::fs::read_to_string(fixtures().join("gguf_export/kquants.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn block_quantizers_match_ggml_byte_for_byte() {
    let g = golden();
    let blocks = &g["blocks"];
    let rows: Vec<Vec<f32>> = serde_json::from_value(blocks["values"].clone()).unwrap();
    for (key, kind) in [
        ("q4_0", QuantKind::Q4_0),
        ("q4_1", QuantKind::Q4_1),
        ("q5_0", QuantKind::Q5_0),
        ("q5_1", QuantKind::Q5_1),
        ("q4_k", QuantKind::Q4K),
        ("q5_k", QuantKind::Q5K),
        ("q6_k", QuantKind::Q6K),
    ] {
        let want: Vec<String> = serde_json::from_value(blocks[key].clone()).unwrap();
        for (r, (row, want)) in rows.iter().zip(&want).enumerate() {
            let got = hex(&quantize(row, kind));
            assert_eq!(got.len(), want.len(), "{key} row {r}: size");
            if &got != want {
                let (block, bytes) = kind.block();
                let first = (0..got.len() / 2)
                    .find(|&i| got[2 * i..2 * i + 2] != want[2 * i..2 * i + 2])
                    .unwrap();
                panic!(
                    "{key} row {r}: byte {first} differs (block {} of {block} values, {bytes} bytes each)",
                    first / bytes
                );
            }
        }
    }
}

/// The weights the fixture script wrote: a hash of the tensor name and index, uniform in ±0.1
/// times a per-row factor 1..5 (norms 1 + that), computed in f32 as numpy computes them.
fn tensor_values(name: &str, shape: &[usize]) -> Vec<f32> {
    const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut seed = 0xCBF2_9CE4_8422_2325u64;
    for b in name.bytes() {
        seed = (seed ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3);
    }
    let numel: usize = shape.iter().product();
    let cols = *shape.last().unwrap();
    (0..numel)
        .map(|i| {
            let mut z = (seed ^ (i as u64).wrapping_mul(GOLDEN)).wrapping_add(GOLDEN);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 40) as f32 / 16_777_216.0 - 0.5;
            let v = u * 0.2 * (1 + (i / cols) % 5) as f32;
            if name.ends_with("norm.weight") {
                v + 1.0
            } else {
                v
            }
        })
        .collect()
}

fn write_model(dir: &Path, spec: &Value) {
    std::fs::create_dir_all(dir).unwrap();
    let tensors: Vec<(String, Vec<usize>)> =
        serde_json::from_value(spec["tensors"].clone()).unwrap();
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, shape)| {
            let bytes = tensor_values(name, shape)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            (name.clone(), shape.clone(), bytes)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = data
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string(&spec["config"]).unwrap(),
    )
    .unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixtures().join("llama3/model").join(f), dir.join(f)).unwrap();
    }
}

/// Fixture model `name` with plain RoPE: the GGUF reader recovers Llama 3's scaling only for
/// the released settings, which these tiny configs do not have.
fn write_plain_rope_model(dir: &Path, g: &Value, name: &str) {
    let mut spec = g["mixes"][name].clone();
    spec["config"]["rope_parameters"] =
        serde_json::json!({"rope_theta": 10000.0, "rope_type": "default"});
    write_model(dir, &spec);
}

fn ggml_id(t: GgmlDType) -> u32 {
    match t {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q5_0 => 6,
        GgmlDType::Q5_1 => 7,
        GgmlDType::Q8_0 => 8,
        GgmlDType::Q4K => 12,
        GgmlDType::Q5K => 13,
        GgmlDType::Q6K => 14,
        GgmlDType::BF16 => 30,
        other => panic!("unexpected type {other:?}"),
    }
}

/// Every tensor of a GGUF file: (ggml type id, sha256 of its bytes).
fn gguf_tensors(path: &Path) -> HashMap<String, (u32, String)> {
    let mut f = std::fs::File::open(path).unwrap();
    let content = Content::read(&mut f).unwrap();
    let mut out = HashMap::new();
    for (name, info) in &content.tensor_infos {
        let numel = info.shape.elem_count();
        let size = numel / info.ggml_dtype.block_size() * info.ggml_dtype.type_size();
        let mut bytes = vec![0u8; size];
        f.seek(SeekFrom::Start(content.tensor_data_offset + info.offset))
            .unwrap();
        f.read_exact(&mut bytes).unwrap();
        let sha = hex(&Sha256::digest(&bytes));
        out.insert(name.clone(), (ggml_id(info.ggml_dtype), sha));
    }
    out
}

#[test]
fn k_quant_mixes_match_llama_quantize_tensor_for_tensor() {
    let g = golden();
    let work = std::env::temp_dir().join(format!("ferrotune-kquants-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    for (model, spec) in g["mixes"].as_object().unwrap() {
        let dir = work.join(model);
        write_model(&dir, spec);
        for (mix, want) in spec["quantized"].as_object().unwrap() {
            let out = work.join(format!("{model}.{mix}.gguf"));
            export_gguf(&dir, &out, OutType::parse(mix).unwrap()).unwrap();
            let got = gguf_tensors(&out);
            let want = want.as_object().unwrap();
            assert_eq!(got.len(), want.len(), "{model} {mix}: tensor count");
            for (name, w) in want {
                let (ty, sha) = got
                    .get(name)
                    .unwrap_or_else(|| panic!("{model} {mix}: no {name}"));
                assert_eq!(
                    *ty as u64,
                    w["type"].as_u64().unwrap(),
                    "{model} {mix} {name}: type"
                );
                assert_eq!(
                    sha,
                    w["sha256"].as_str().unwrap(),
                    "{model} {mix} {name}: bytes"
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&work);
}

/// gpt-oss with OpenAI's MXFP4 experts (the fixture, given llama.cpp's SwiGLU limit and a
/// rounded YaRN range): its Q4_K_M and Q6_K files as `llama_model_quantize --allow-requantize`
/// makes them from ferrotune's f32 export, where the experts are MXFP4 (dequantized, then
/// quantized to the mix's types), every tensor's type and bytes.
#[test]
fn mxfp4_experts_are_requantized_as_llama_quantize_does() {
    let g = golden();
    let work = std::env::temp_dir().join(format!("ferrotune-kquants-mx-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let dir = work.join("model");
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixtures().join("gpt_oss_mxfp4/model")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    c["swiglu_limit"] = serde_json::json!(7.0);
    c["swiglu_alpha"] = serde_json::json!(1.702);
    c["rope_parameters"]["truncate"] = serde_json::json!(true);
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    let mixes = g["gpt_oss_mxfp4"].as_object().unwrap();
    assert_eq!(mixes.len(), 2);
    for (mix, want) in mixes {
        let out = work.join(format!("{mix}.gguf"));
        export_gguf(&dir, &out, OutType::parse(mix).unwrap()).unwrap();
        let got = gguf_tensors(&out);
        let want = want.as_object().unwrap();
        assert_eq!(got.len(), want.len(), "{mix}: tensor count");
        for (name, w) in want {
            let (ty, sha) = got.get(name).unwrap_or_else(|| panic!("{mix}: no {name}"));
            assert_eq!(
                *ty as u64,
                w["type"].as_u64().unwrap(),
                "{mix} {name}: type"
            );
            assert_eq!(sha, w["sha256"].as_str().unwrap(), "{mix} {name}: bytes");
        }
    }
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn k_quant_files_load_back_close_to_the_weights() {
    use candle_core::{DType, Device, Tensor};
    use ferrotune_models::load_model;
    let g = golden();
    let work = std::env::temp_dir().join(format!("ferrotune-kquants-load-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let dir = work.join("llama_untied");
    write_plain_rope_model(&dir, &g, "llama_untied");
    let dev = Device::Cpu;
    let weight = |name: &str, shape: &[usize]| {
        Tensor::from_vec(tensor_values(&format!("{name}.weight"), shape), shape, &dev).unwrap()
    };
    // (module, shape, the block type it gets in Q4_K_M, and that type's error bound)
    let cases = [
        ("model.layers.0.self_attn.q_proj", [256, 256], "Q4_K", 0.06),
        ("model.layers.2.self_attn.v_proj", [128, 256], "Q6_K", 0.015),
        ("model.layers.0.mlp.down_proj", [256, 320], "Q5_0", 0.04),
        ("model.layers.3.mlp.down_proj", [256, 320], "Q8_0", 0.006),
        ("lm_head", [512, 256], "Q6_K", 0.015),
    ];
    let out = work.join("q4_k_m.gguf");
    export_gguf(&dir, &out, OutType::Q4KM).unwrap();
    let (model, _) = load_model(&out, DType::F32, &dev).unwrap();
    let linears = model.linears();
    for (name, shape, ty, bound) in cases {
        let linear = &linears.iter().find(|(n, _)| n == name).unwrap().1;
        let got = linear.weight.dense().unwrap().into_owned();
        let err = ferrotune_testing::rel_l2(&got, &weight(name, &shape));
        eprintln!("{name} ({ty}): rel L2 {err:.5}");
        assert!(err < bound, "{name} ({ty}): rel L2 {err} > {bound}");
    }
    let _ = std::fs::remove_dir_all(&work);
}

/// Gemma 3 (five sliding layers with a 4-token window, then a full one; linear scaling on the
/// global rope; tied embeddings), SmolLM3 (its fourth layer without RoPE) and the mixtures of
/// experts read back from their f32 export give
/// the checkpoint's logits (llama.cpp on the same files is within 2.4e-4 of transformers for Gemma
/// 3 — its GELU table — and 1.8e-6 for the mixtures of experts).
#[test]
fn gemma3_and_moe_exports_read_back_as_the_checkpoint() {
    use candle_core::{DType, Device, Tensor};
    use ferrotune_models::{load_model, AttentionLayout};
    let g = golden();
    let work = std::env::temp_dir().join(format!("ferrotune-kquants-rt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let dev = Device::Cpu;
    let ids = Tensor::new(&[[5u32, 40, 41, 42, 100, 7, 300, 12, 9, 77, 3, 64]], &dev).unwrap();
    let layout = AttentionLayout::causal(1, 12, 0);
    for name in ["gemma3", "smollm3", "mixtral", "qwen2_moe", "qwen3_moe"] {
        let dir = work.join(name);
        if name == "gemma3" || name == "smollm3" {
            write_model(&dir, &g["mixes"][name]);
        } else {
            write_plain_rope_model(&dir, &g, name);
        }
        let out = work.join(format!("{name}.gguf"));
        export_gguf(&dir, &out, OutType::F32).unwrap();
        let logits = |path: &Path| {
            let (m, _) = load_model(path, DType::F32, &dev).unwrap();
            m.forward(&ids, &layout, None).unwrap()
        };
        let err = ferrotune_testing::rel_l2(&logits(&out), &logits(&dir));
        assert!(
            err < 1e-5,
            "{name}: logits rel L2 {err} between the GGUF and the checkpoint"
        );
    }
    let _ = std::fs::remove_dir_all(&work);
}
