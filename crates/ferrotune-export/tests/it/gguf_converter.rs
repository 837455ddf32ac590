//! `export-gguf` of DeepSeek-V2/V3 (llama.cpp's `deepseek2`), gpt-oss (`gpt-oss`), Qwen3.5
//! (`qwen35`, `qwen35moe`) and Qwen3-Next (`qwen3next`), against what llama.cpp's own
//! convert_hf_to_gguf.py wrote for the same checkpoints
//! (tests/fixtures/gguf/{deepseek_v2,deepseek_v3,gpt_oss,qwen3_5,qwen3_5_moe,qwen3_next}_tiny.gguf,
//! scripts/make_gguf_fixtures.py)
//! and against transformers' logits of them.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Content;
use candle_core::{DType, Device, Tensor};
use ferrotune_export::gguf::{export_gguf, OutType};
use ferrotune_models::{load_model, AttentionLayout};
use serde_json::{json, Value};

/// A scratch folder of this test.
fn out_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "ferrotune-gguf-converter-{test}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A copy of fixture `kind`'s checkpoint in `dir`, its config changed as
/// scripts/make_gguf_fixtures.py's `DEEPSEEK2_EDITS` / `GPT_OSS_EDITS` change it (what a llama.cpp
/// file can say).
fn llama_cpp_expressible_copy(kind: &str, dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let src = common::workspace_fixture(&format!("models/{kind}/model"));
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    if kind == "gpt_oss" {
        // llama.cpp's fixed SwiGLU limit and rounded YaRN range.
        c["swiglu_limit"] = json!(7.0);
        c["swiglu_alpha"] = json!(1.702);
        c["rope_parameters"]["truncate"] = json!(true);
    } else if kind == "deepseek_v2" {
        c["topk_method"] = json!("greedy");
        c["n_group"] = json!(1);
        c["topk_group"] = json!(1);
    } else {
        c["scoring_func"] = json!("sigmoid");
        c["topk_method"] = json!("noaux_tc");
        let all_dim = c["rope_parameters"]["mscale_all_dim"].clone();
        c["rope_parameters"]["mscale"] = all_dim;
    }
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
}

/// Every tensor of a GGUF file, dequantized, by name, with its stored type.
fn tensors(path: &Path) -> HashMap<String, (String, Tensor)> {
    let mut f = std::fs::File::open(path).unwrap();
    let content = Content::read(&mut f).unwrap();
    let names: Vec<String> = content.tensor_infos.keys().cloned().collect();
    names
        .into_iter()
        .map(|n| {
            let q = content.tensor(&mut f, &n, &Device::Cpu).unwrap();
            let ty = format!("{:?}", q.dtype());
            (n, (ty, q.dequantize(&Device::Cpu).unwrap()))
        })
        .collect()
}

/// Both DeepSeek fixtures and the gpt-oss one, changed where llama.cpp's file cannot say what
/// transformers computes: exported in f32, every tensor equals what llama.cpp's converter wrote for the same
/// checkpoint (names, shapes, types, values: `kv_b_proj` split per head into `attn_k_b`,
/// transposed, and `attn_v_b`; stacked experts; `exp_probs_b`; gpt-oss's interleaved gate/up
/// split and transposed, its sinks and biases), and ferrotune reads the file back
/// to transformers' logits of the checkpoint.
#[test]
fn deepseek_and_gpt_oss_export_as_llama_cpps_converter_writes_them() {
    for (kind, arch) in [
        ("deepseek_v2", "deepseek2"),
        ("deepseek_v3", "deepseek2"),
        ("gpt_oss", "gpt-oss"),
    ] {
        let dir = out_dir(kind).join("model");
        llama_cpp_expressible_copy(kind, &dir);
        let ours = dir.join("ours.gguf");
        let done = export_gguf(&dir, &ours, OutType::F32).unwrap();
        assert_eq!(done.architecture, arch);
        let converter = common::workspace_fixture(&format!("gguf/{kind}_tiny.gguf"));
        let (a, b) = (tensors(&ours), tensors(&converter));
        let mut names: Vec<&String> = b.keys().collect();
        names.sort();
        assert_eq!(a.len(), b.len(), "{kind}: tensor count");
        for name in names {
            let (ty_a, t_a) = a.get(name).unwrap_or_else(|| panic!("{kind}: no {name}"));
            let (ty_b, t_b) = &b[name];
            assert_eq!(ty_a, ty_b, "{kind}: {name}");
            assert_eq!(t_a.dims(), t_b.dims(), "{kind}: {name}");
            let diff = (t_a - t_b)
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert_eq!(diff, 0.0, "{kind}: {name}");
        }
        let reference = candle_core::safetensors::load(
            common::workspace_fixture(&format!("gguf/{kind}_tiny_reference.safetensors")),
            &Device::Cpu,
        )
        .unwrap();
        let ids = reference["input_ids"].to_dtype(DType::U32).unwrap();
        let (bsz, t) = ids.dims2().unwrap();
        let (model, _) = load_model(&ours, DType::F32, &Device::Cpu).unwrap();
        let logits = model
            .forward(&ids, &AttentionLayout::causal(bsz, t, 0), None)
            .unwrap();
        let err = (logits - &reference["logits"])
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(err <= 1e-4, "{kind}: logits differ by {err}");
    }
}

/// What llama.cpp's `deepseek2` would compute otherwise is refused, naming the setting:
/// DeepSeek-V2's group-limited routing (llama.cpp ranks a group by its two best scores) and YaRN
/// whose `mscale` is not `mscale_all_dim`, gpt-oss's SwiGLU limit other than llama.cpp's 7 (the
/// unchanged fixtures have them).
#[test]
fn settings_llama_cpp_computes_otherwise_are_refused() {
    let out = out_dir("refused").join("refused.gguf");
    for (kind, says) in [
        ("deepseek_v2", "group_limited_greedy"),
        ("deepseek_v3", "mscale"),
        ("gpt_oss", "swiglu_limit"),
    ] {
        let dir = common::workspace_fixture(&format!("models/{kind}/model"));
        let err = export_gguf(&dir, &out, OutType::F32)
            .unwrap_err()
            .to_string();
        assert!(err.contains(says), "{kind}: {err}");
    }
}

/// Fixture `kind`'s Qwen3.5 / Qwen3-Next checkpoint as scripts/make_gguf_fixtures.py's
/// `qwen35_source` gives it to the converter: Qwen3-Next's copied into `dir`, every layer sparse
/// (the dense layer 1 takes layer 0's experts, router and shared expert) and its top-k weights
/// renormalized, as llama.cpp's `qwen3next` computes it; the others as they are. And
/// `qwen3_5_moe_fused`: the Qwen3.5-MoE fixture with its experts fused as transformers 5 holds
/// them (`mlp.experts.gate_up_proj` `[experts, 2 · inter, hidden]`, gate rows first, and
/// `mlp.experts.down_proj`), which the converter writes as it writes the per-expert ones.
fn qwen35_source(kind: &str, dir: &Path) -> PathBuf {
    if kind == "qwen3_5_moe_fused" {
        let src = common::workspace_fixture("models/qwen3_5_moe/model");
        std::fs::create_dir_all(dir).unwrap();
        for entry in std::fs::read_dir(&src).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
        }
        let file = dir.join("model.safetensors");
        let w = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
        let mut fused: HashMap<String, Tensor> = w
            .iter()
            .filter(|(n, _)| !n.contains(".mlp.experts."))
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect();
        for l in 0..4 {
            let p = format!("model.layers.{l}.mlp.experts.");
            let expert = |e: usize, m: &str| w[&format!("{p}{e}.{m}_proj.weight")].clone();
            let gate_up: Vec<Tensor> = (0..4)
                .map(|e| Tensor::cat(&[expert(e, "gate"), expert(e, "up")], 0).unwrap())
                .collect();
            let down: Vec<Tensor> = (0..4).map(|e| expert(e, "down")).collect();
            fused.insert(
                format!("{p}gate_up_proj"),
                Tensor::stack(&gate_up, 0).unwrap(),
            );
            fused.insert(format!("{p}down_proj"), Tensor::stack(&down, 0).unwrap());
        }
        candle_core::safetensors::save(&fused, &file).unwrap();
        return dir.to_path_buf();
    }
    let src = common::workspace_fixture(&format!("models/{kind}/model"));
    if kind != "qwen3_next" {
        return src;
    }
    std::fs::create_dir_all(dir).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    c["mlp_only_layers"] = json!([]);
    c["norm_topk_prob"] = json!(true);
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    let file = dir.join("model.safetensors");
    let mut w = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    w.retain(|n, _| !n.starts_with("model.layers.1.mlp."));
    let layer0: Vec<(String, Tensor)> = w
        .iter()
        .filter(|(n, _)| n.starts_with("model.layers.0.mlp."))
        .map(|(n, t)| (n.replace("model.layers.0.", "model.layers.1."), t.clone()))
        .collect();
    w.extend(layer0);
    candle_core::safetensors::save(&w, &file).unwrap();
    dir.to_path_buf()
}

/// The metadata keys each tool fills its own way: the model's name and size label, the
/// converter's `general.type`, and the pre-tokenizer (the fixtures' is unknown to llama.cpp; the
/// converter's run reports it as "default").
const OWN_KEYS: &[&str] = &[
    "general.name",
    "general.size_label",
    "general.type",
    "tokenizer.ggml.pre",
];

/// A GGUF file's metadata, each value as text.
fn metadata(path: &Path) -> HashMap<String, String> {
    let mut f = std::fs::File::open(path).unwrap();
    let content = Content::read(&mut f).unwrap();
    content
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), format!("{v:?}")))
        .collect()
}

/// Qwen3.5 (dense, MoE) and Qwen3-Next exported in f32 equal what llama.cpp's converter wrote for
/// the same checkpoints (tests/fixtures/gguf/{qwen3_5,qwen3_5_moe,qwen3_next}_tiny.gguf): the same
/// tensors (names, shapes, types, values: norms as 1 + w, `ssm_a = -exp(A_log)`, the conv
/// squeezed, Qwen3.5's value heads tiled, Qwen3-Next's `in_proj_qkvz` split into `attn_qkv` and
/// `attn_gate`, stacked experts) in the same order, and the same metadata key by key but for
/// [`OWN_KEYS`]; ferrotune reads the file back to transformers' logits of the checkpoint. The
/// multimodal Qwen3.5 fixture (its text model is the dense fixture's) writes its text model, the
/// vision tower left out with a note, as the converter writes it; Qwen3.5-MoE's experts fused
/// as transformers 5 holds them write as the per-expert ones.
#[test]
fn qwen35_and_qwen3_next_export_as_llama_cpps_converter_writes_them() {
    for (kind, converted, arch) in [
        ("qwen3_5", "qwen3_5", "qwen35"),
        ("qwen3_5_multimodal", "qwen3_5", "qwen35"),
        ("qwen3_5_moe", "qwen3_5_moe", "qwen35moe"),
        ("qwen3_5_moe_fused", "qwen3_5_moe", "qwen35moe"),
        ("qwen3_next", "qwen3_next", "qwen3next"),
    ] {
        let out = out_dir(kind);
        let dir = qwen35_source(kind, &out.join("model"));
        let ours = out.join("ours.gguf");
        let done = export_gguf(&dir, &ours, OutType::F32).unwrap();
        assert_eq!(done.architecture, arch);
        assert_eq!(
            done.notes.iter().any(|n| n.contains("vision tower")),
            kind == "qwen3_5_multimodal",
            "{kind}: {:?}",
            done.notes
        );
        let kind = converted;
        let converter = common::workspace_fixture(&format!("gguf/{kind}_tiny.gguf"));
        let (a, b) = (tensors(&ours), tensors(&converter));
        assert_eq!(a.len(), b.len(), "{kind}: tensor count");
        for (name, (ty_b, t_b)) in &b {
            let (ty_a, t_a) = a.get(name).unwrap_or_else(|| panic!("{kind}: no {name}"));
            assert_eq!(ty_a, ty_b, "{kind}: {name}");
            assert_eq!(t_a.dims(), t_b.dims(), "{kind}: {name}");
            let diff = (t_a - t_b)
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert_eq!(diff, 0.0, "{kind}: {name}");
        }
        let order = |p: &Path| {
            let mut f = std::fs::File::open(p).unwrap();
            let c = Content::read(&mut f).unwrap();
            let mut v: Vec<(u64, String)> = c
                .tensor_infos
                .iter()
                .map(|(n, i)| (i.offset, n.clone()))
                .collect();
            v.sort();
            v.into_iter().map(|(_, n)| n).collect::<Vec<_>>()
        };
        assert_eq!(order(&ours), order(&converter), "{kind}: tensor order");
        let (ma, mb) = (metadata(&ours), metadata(&converter));
        let mut keys: Vec<&String> = ma.keys().chain(mb.keys()).collect();
        keys.sort();
        keys.dedup();
        for key in keys {
            if OWN_KEYS.contains(&key.as_str()) {
                continue;
            }
            assert_eq!(ma.get(key), mb.get(key), "{kind}: metadata {key}");
        }
        let reference = candle_core::safetensors::load(
            common::workspace_fixture(&format!("gguf/{kind}_tiny_reference.safetensors")),
            &Device::Cpu,
        )
        .unwrap();
        let ids = reference["input_ids"].to_dtype(DType::U32).unwrap();
        let (bsz, t) = ids.dims2().unwrap();
        let (model, _) = load_model(&ours, DType::F32, &Device::Cpu).unwrap();
        let logits = model
            .forward(&ids, &AttentionLayout::causal(bsz, t, 0), None)
            .unwrap();
        let err = (logits - &reference["logits"])
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(err <= 1e-4, "{kind}: logits differ by {err}");
    }
}

/// What llama.cpp's `qwen3next` would compute otherwise is refused: the unchanged Qwen3-Next
/// fixture has a dense `mlp_only_layers` layer and `norm_topk_prob` false.
#[test]
fn qwen3_next_dense_layers_are_refused() {
    let out = out_dir("qwen3_next_refused").join("refused.gguf");
    let dir = common::workspace_fixture("models/qwen3_next/model");
    let err = export_gguf(&dir, &out, OutType::F32)
        .unwrap_err()
        .to_string();
    assert!(err.contains("mlp_only_layers"), "{err}");
}

/// A GGUF file's bytes read in order.
struct Bytes<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Bytes<'a> {
    fn take(&mut self, n: usize) -> &'a [u8] {
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        s
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().unwrap())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().unwrap())
    }
    fn string(&mut self) -> String {
        let n = self.u64() as usize;
        String::from_utf8(self.take(n).to_vec()).unwrap()
    }
    /// Skips one metadata value of type `ty`.
    fn skip(&mut self, ty: u32) {
        const SIZES: [usize; 13] = [1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8];
        match ty {
            8 => {
                self.string();
            }
            9 => {
                let elem = self.u32();
                for _ in 0..self.u64() {
                    self.skip(elem);
                }
            }
            t => {
                self.take(SIZES[t as usize]);
            }
        }
    }
}

/// A GGUF file's tensors as stored: by name, the GGML type id, the dims (innermost first) and the
/// data's bytes (types F32, F16, BF16, Q8_0 and MXFP4), read from the header directly (candle's
/// reader knows no MXFP4).
fn raw_tensors(path: &Path) -> HashMap<String, (u32, Vec<u64>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let mut r = Bytes {
        bytes: &bytes,
        at: 8,
    };
    let (count, keys) = (r.u64(), r.u64());
    let mut alignment = 32u64;
    for _ in 0..keys {
        let key = r.string();
        let ty = r.u32();
        if key == "general.alignment" && ty == 4 {
            alignment = u64::from(r.u32());
        } else {
            r.skip(ty);
        }
    }
    let mut infos = Vec::new();
    for _ in 0..count {
        let name = r.string();
        let rank = r.u32();
        let dims: Vec<u64> = (0..rank).map(|_| r.u64()).collect();
        let (ty, offset) = (r.u32(), r.u64());
        infos.push((name, ty, dims, offset));
    }
    let data = (r.at as u64).next_multiple_of(alignment) as usize;
    infos
        .into_iter()
        .map(|(name, ty, dims, offset)| {
            let numel: u64 = dims.iter().product();
            let len = match ty {
                0 => numel * 4,
                1 | 30 => numel * 2,
                8 => numel / 32 * 34,
                39 => numel / 32 * 17,
                other => panic!("{name}: type {other}"),
            } as usize;
            let start = data + offset as usize;
            (name, (ty, dims, bytes[start..start + len].to_vec()))
        })
        .collect()
}

/// gpt-oss with OpenAI's MXFP4 experts (tests/fixtures/gpt_oss_mxfp4, changed as the gpt-oss
/// fixture is for llama.cpp): exported, the experts are MXFP4 (GGML type 39, repacked from the
/// checkpoint's blocks and scales) and every tensor — name, type, dims, bytes — is what llama.cpp's
/// converter wrote for the same checkpoint (tests/fixtures/gguf/gpt_oss_mxfp4_tiny.gguf); read
/// back, the file gives transformers' logits of the checkpoint.
#[test]
fn gpt_oss_mxfp4_experts_export_byte_for_byte_as_llama_cpps_converter() {
    let dir = out_dir("mxfp4").join("model");
    std::fs::create_dir_all(&dir).unwrap();
    let src = common::workspace_fixture("gpt_oss_mxfp4/model");
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    c["swiglu_limit"] = json!(7.0);
    c["swiglu_alpha"] = json!(1.702);
    c["rope_parameters"]["truncate"] = json!(true);
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    let ours = dir.join("ours.gguf");
    let done = export_gguf(&dir, &ours, OutType::F32).unwrap();
    assert_eq!(done.architecture, "gpt-oss");
    let converter = common::workspace_fixture("gguf/gpt_oss_mxfp4_tiny.gguf");
    let (a, b) = (raw_tensors(&ours), raw_tensors(&converter));
    assert_eq!(a.len(), b.len(), "tensor count");
    let mut mxfp4 = 0;
    for (name, (ty, dims, raw)) in &b {
        let (ty_a, dims_a, raw_a) = a.get(name).unwrap_or_else(|| panic!("no {name}"));
        assert_eq!((ty_a, dims_a), (ty, dims), "{name}");
        assert!(raw_a == raw, "{name}: bytes differ");
        mxfp4 += usize::from(*ty == 39);
    }
    assert_eq!(mxfp4, 9, "three layers' gate, up and down experts");
    let reference = candle_core::safetensors::load(
        common::workspace_fixture("gguf/gpt_oss_mxfp4_tiny_reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let ids = reference["input_ids"].to_dtype(DType::U32).unwrap();
    let (bsz, t) = ids.dims2().unwrap();
    let (model, _) = load_model(&ours, DType::F32, &Device::Cpu).unwrap();
    let logits = model
        .forward(&ids, &AttentionLayout::causal(bsz, t, 0), None)
        .unwrap();
    let err = (logits - &reference["logits"])
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(err <= 1e-4, "logits differ by {err}");
}

/// `--outtype mxfp4_moe` (llama-quantize's MXFP4_MOE) of a gpt-oss checkpoint with float experts
/// (tests/fixtures/gpt_oss_mxfp4's, dequantized and saved plain, changed for llama.cpp): every
/// tensor's type and bytes equal gguf-py's quantizers applying llama.cpp's MXFP4_MOE rule to the
/// converter's f32 file of the same checkpoint (tests/fixtures/gguf/mxfp4_moe_reference.safetensors):
/// the experts MXFP4, the other matrices Q8_0 but the router; the file reads back near the
/// checkpoint's logits.
#[test]
fn mxfp4_moe_quantizes_float_experts_as_gguf_py() {
    let dir = out_dir("mxfp4-moe").join("model");
    let _ = std::fs::remove_dir_all(&dir);
    let src = common::workspace_fixture("gpt_oss_mxfp4/model");
    let (model, _) = load_model(&src, DType::F32, &Device::Cpu).unwrap();
    let tensors = ferrotune_models::peft::merged_tensors(&model).unwrap();
    ferrotune_models::save_hf_checkpoint(&dir, &model.config, None, &tensors, DType::F32, u64::MAX)
        .unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let path = f.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if name.starts_with("tokenizer") || name.ends_with(".jinja") {
            std::fs::copy(&path, dir.join(&name)).unwrap();
        }
    }
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    c["swiglu_limit"] = json!(7.0);
    c["swiglu_alpha"] = json!(1.702);
    c["rope_parameters"]["truncate"] = json!(true);
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    let ours = dir.join("mxfp4_moe.gguf");
    export_gguf(&dir, &ours, OutType::Mxfp4Moe).unwrap();
    let got = raw_tensors(&ours);
    let want = candle_core::safetensors::load(
        common::workspace_fixture("gguf/mxfp4_moe_reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(got.len() * 2, want.len(), "tensor count");
    let mut counts = HashMap::new();
    for (name, (ty, _, raw)) in &got {
        let want_ty = want[&format!("{name}.type")].to_vec1::<i32>().unwrap()[0] as u32;
        assert_eq!(*ty, want_ty, "{name}: type");
        let want_raw: Vec<u8> = want[name].to_vec1().unwrap();
        assert!(*raw == want_raw, "{name}: bytes differ");
        *counts.entry(*ty).or_insert(0) += 1;
    }
    assert_eq!(counts[&39], 9, "{counts:?}");
    assert!(counts[&8] > 0, "{counts:?}");
    // Read back: the quantized model's logits near the checkpoint's (transformers').
    let reference = candle_core::safetensors::load(
        common::workspace_fixture("gguf/gpt_oss_mxfp4_tiny_reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let ids = reference["input_ids"].to_dtype(DType::U32).unwrap();
    let (bsz, t) = ids.dims2().unwrap();
    let (model, _) = load_model(&ours, DType::F32, &Device::Cpu).unwrap();
    let logits = model
        .forward(&ids, &AttentionLayout::causal(bsz, t, 0), None)
        .unwrap();
    let want = &reference["logits"];
    let rel = ((&logits - want).unwrap().sqr().unwrap().sum_all().unwrap())
        .sqrt()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        / want
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .sqrt()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
    assert!(rel <= 0.1, "logits relative L2 {rel}");
}
