//! GGUF loading: the real SmolLM2 Q4_1 file against transformers' own GGUF loader, dequantization
//! of every supported type against the python `gguf` package, llama.cpp's q/k permutation, the
//! per-architecture tensor fixes, and clear errors (never panics) for bad files.
//!
//! Reference data: `scripts/make_gguf_fixtures.py` writes `tests/fixtures/gguf/`.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};
use ferrotune_models::config::ModelConfig;
use ferrotune_models::gguf::load_gguf;
use ferrotune_models::ModelError;

use common::max_abs_diff;

const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn assets_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("FERROTUNE_ASSETS") {
        return PathBuf::from(dir);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is not set")).join(".cache")
        });
    cache.join("ferrotune").join("assets")
}

fn real_gguf() -> PathBuf {
    let path = assets_dir().join(GGUF_NAME);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/fetch-assets.sh",
        path.display()
    );
    path
}

fn fixtures() -> PathBuf {
    common::fixtures().join("gguf")
}

/// A fresh scratch folder for one test, removed when dropped (the truncated copy of the real
/// model is ~100 MB).
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch(test: &str) -> Scratch {
    Scratch(ferrotune_testing::fresh_dir(&format!(
        "ferrotune-gguf-{}-{test}",
        std::process::id()
    )))
}

type Loaded = (ModelConfig, HashMap<String, Tensor>);

/// The real file, loaded once for all the tests that read it.
fn smollm2() -> &'static Loaded {
    static LOADED: OnceLock<Loaded> = OnceLock::new();
    LOADED.get_or_init(|| {
        let t = std::time::Instant::now();
        let loaded =
            load_gguf(&real_gguf(), DType::F32, &Device::Cpu).expect("loading the SmolLM2 GGUF");
        eprintln!("loaded {GGUF_NAME} in {:.2?}", t.elapsed());
        loaded
    })
}

fn reference_json() -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("smollm2_reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

#[test]
fn smollm2_config_matches_transformers() {
    let (c, _) = smollm2();
    let r = reference_json();
    assert_eq!(c.model_type, r["model_type"].as_str().unwrap());
    assert_eq!(c.model_type, "llama");
    let usize_of = |k: &str| r[k].as_u64().unwrap() as usize;
    assert_eq!(c.vocab_size, usize_of("vocab_size"));
    assert_eq!(c.hidden_size, usize_of("hidden_size"));
    assert_eq!(c.intermediate_size, usize_of("intermediate_size"));
    assert_eq!(c.num_hidden_layers, usize_of("num_hidden_layers"));
    assert_eq!(c.num_attention_heads, usize_of("num_attention_heads"));
    assert_eq!(c.num_key_value_heads, usize_of("num_key_value_heads"));
    assert_eq!(c.head_dim, usize_of("head_dim"));
    assert_eq!(
        c.max_position_embeddings,
        usize_of("max_position_embeddings")
    );
    assert_eq!(
        (c.vocab_size, c.hidden_size, c.num_hidden_layers),
        (49152, 576, 30)
    );
    assert_eq!((c.num_attention_heads, c.num_key_value_heads), (9, 3));
    // transformers widens the stored f32 exactly: 9.999999747378752e-06, not 1e-5.
    assert_eq!(c.rms_norm_eps, r["rms_norm_eps"].as_f64().unwrap());
    assert_eq!(c.rope.theta, r["rope_theta"].as_f64().unwrap());
    assert_eq!(r["rope_type"], "default");
    assert_eq!(
        c.rope.scaling,
        ferrotune_models::config::RopeScaling::Default
    );
    assert_eq!(
        c.tie_word_embeddings,
        r["tie_word_embeddings"].as_bool().unwrap()
    );
    assert!(c.tie_word_embeddings);
    assert_eq!(
        c.bos_token_id,
        Some(r["bos_token_id"].as_u64().unwrap() as u32)
    );
    assert_eq!(
        c.eos_token_ids,
        vec![r["eos_token_id"].as_u64().unwrap() as u32]
    );
    assert_eq!(
        c.pad_token_id,
        Some(r["pad_token_id"].as_u64().unwrap() as u32)
    );
    assert_eq!(r["hidden_act"], "silu");
    assert_eq!(c.activation, ferrotune_models::config::Activation::Silu);
    // `raw` is a config.json that reads back to the same config.
    let again = ModelConfig::from_hf_json(&c.raw).unwrap();
    assert_eq!(again.hidden_size, c.hidden_size);
    assert_eq!(again.rope, c.rope);
    assert_eq!(c.raw["architectures"][0], "LlamaForCausalLM");
}

#[test]
fn smollm2_tensor_names_match_transformers() {
    let (c, tensors) = smollm2();
    let r = reference_json();
    let mut theirs: Vec<String> = r["tensor_names"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    // transformers' state_dict lists the tied head; a tied checkpoint does not store it.
    assert!(c.tie_word_embeddings);
    theirs.retain(|n| n != "lm_head.weight");
    theirs.sort();
    let mut ours: Vec<String> = tensors.keys().cloned().collect();
    ours.sort();
    assert_eq!(ours, theirs);
    assert_eq!(tensors["model.embed_tokens.weight"].dims(), &[49152, 576]);
    assert_eq!(
        tensors["model.layers.0.self_attn.k_proj.weight"].dims(),
        &[192, 576]
    );
    assert_eq!(
        tensors["model.layers.0.mlp.down_proj.weight"].dims(),
        &[576, 1536]
    );
    assert_eq!(
        tensors["model.layers.0.mlp.up_proj.weight"].dims(),
        &[1536, 576]
    );
    assert_eq!(tensors["model.norm.weight"].dims(), &[576]);
    assert!(tensors.values().all(|t| t.dtype() == DType::F32));
}

#[test]
fn smollm2_weights_match_transformers() {
    let (_, tensors) = smollm2();
    let reference = candle_core::safetensors::load(
        fixtures().join("smollm2_reference.safetensors"),
        &Device::Cpu,
    )
    .expect("run scripts/make_gguf_fixtures.py");
    let (mut checked, mut worst) = (0, 0.0f32);
    for (name, expected) in &reference {
        if name.ends_with(".rows") {
            continue;
        }
        let ours = tensors
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing"));
        let ours = match reference.get(&format!("{name}.rows")) {
            Some(rows) => ours
                .index_select(&rows.to_dtype(DType::U32).unwrap(), 0)
                .unwrap(),
            None => ours.clone(),
        };
        let diff = max_abs_diff(&ours, expected);
        worst = worst.max(diff);
        assert!(diff <= 1e-6, "{name}: max |ours - transformers| = {diff}");
        checked += 1;
    }
    eprintln!("{checked} reference tensors, max |ours - transformers| = {worst:e}");
    // Q8_0 embeddings, Q4_1 projections (with q/k un-permuted), F32 norms.
    assert!(checked >= 20, "only {checked} reference tensors");
}

#[test]
fn smollm2_loads_in_bf16() {
    // The second full load; bf16 is f32 rounded once.
    let (_, f32s) = smollm2();
    let (_, bf16s) = load_gguf(&real_gguf(), DType::BF16, &Device::Cpu).unwrap();
    let name = "model.layers.3.self_attn.q_proj.weight";
    assert_eq!(bf16s[name].dtype(), DType::BF16);
    let rounded = f32s[name].to_dtype(DType::BF16).unwrap();
    assert_eq!(max_abs_diff(&bf16s[name], &rounded), 0.0);
}

// ---------------------------------------------------------------------------------------------
// Synthetic GGUF files, written byte by byte.

#[derive(Clone)]
enum Meta {
    U32(u32),
    I32(i32),
    F32(f32),
    Str(&'static str),
    Strs(Vec<&'static str>),
}

struct Spec {
    name: String,
    ggml_type: u32,
    /// PyTorch order (outermost first); written innermost first as GGUF does.
    dims: Vec<usize>,
    data: Vec<u8>,
}

fn f32_spec(name: &str, dims: &[usize], vals: &[f32]) -> Spec {
    assert_eq!(dims.iter().product::<usize>(), vals.len(), "{name}");
    Spec {
        name: name.into(),
        ggml_type: 0,
        dims: dims.to_vec(),
        data: vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn gguf_bytes(version: u32, meta: &[(String, Meta)], tensors: &[Spec]) -> Vec<u8> {
    const ALIGN: usize = 32;
    let mut out = b"GGUF".to_vec();
    out.extend(version.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((meta.len() as u64).to_le_bytes());
    for (key, value) in meta {
        put_str(&mut out, key);
        match value {
            Meta::U32(v) => {
                out.extend(4u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::I32(v) => {
                out.extend(5u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::F32(v) => {
                out.extend(6u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::Str(s) => {
                out.extend(8u32.to_le_bytes());
                put_str(&mut out, s);
            }
            Meta::Strs(list) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((list.len() as u64).to_le_bytes());
                for s in list {
                    put_str(&mut out, s);
                }
            }
        }
    }
    let mut offset = 0usize;
    for t in tensors {
        put_str(&mut out, &t.name);
        out.extend((t.dims.len() as u32).to_le_bytes());
        for d in t.dims.iter().rev() {
            out.extend((*d as u64).to_le_bytes());
        }
        out.extend(t.ggml_type.to_le_bytes());
        out.extend((offset as u64).to_le_bytes());
        offset += t.data.len().div_ceil(ALIGN) * ALIGN;
    }
    out.resize(out.len().div_ceil(ALIGN) * ALIGN, 0);
    for t in tensors {
        out.extend(&t.data);
        out.resize(out.len().div_ceil(ALIGN) * ALIGN, 0);
    }
    out
}

/// Hyperparameters of a synthetic model.
#[derive(Clone, Copy)]
struct Hp {
    vocab: usize,
    hidden: usize,
    ffn: usize,
    heads: usize,
    kv_heads: usize,
}

const TINY: Hp = Hp {
    vocab: 4,
    hidden: 8,
    ffn: 16,
    heads: 2,
    kv_heads: 1,
};

fn metadata(arch: &'static str, hp: Hp) -> Vec<(String, Meta)> {
    let k = |s: &str| format!("{arch}.{s}");
    vec![
        ("general.architecture".into(), Meta::Str(arch)),
        ("general.name".into(), Meta::Str("tiny test model")),
        (k("context_length"), Meta::U32(64)),
        (k("embedding_length"), Meta::U32(hp.hidden as u32)),
        (k("feed_forward_length"), Meta::U32(hp.ffn as u32)),
        (k("block_count"), Meta::U32(1)),
        (k("attention.head_count"), Meta::U32(hp.heads as u32)),
        (k("attention.head_count_kv"), Meta::U32(hp.kv_heads as u32)),
        (k("attention.layer_norm_rms_epsilon"), Meta::F32(1e-6)),
        (k("rope.freq_base"), Meta::F32(10000.0)),
        (k("vocab_size"), Meta::U32(hp.vocab as u32)),
        ("tokenizer.ggml.bos_token_id".into(), Meta::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Meta::U32(2)),
    ]
}

fn write(dir: &Path, file: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(file);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn ramp(n: usize, start: f32) -> Vec<f32> {
    (0..n).map(|i| start + i as f32 * 0.25).collect()
}

/// llama.cpp's `permute` (convert_hf_to_gguf.py): `w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2)`.
fn llama_cpp_permute(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    let half = rows / n_head / 2;
    let mut out = vec![0.0; w.len()];
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                // Output row (h, i, j) takes input row (h, j, i).
                let dst = h * 2 * half + i * 2 + j;
                let src = h * 2 * half + j * half + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Every tensor of a one-layer model, with HF values `hf` and the GGUF names.
fn full_model(arch: &str, hp: Hp, hf: &HashMap<&str, Vec<f32>>) -> Vec<Spec> {
    let hd = hp.hidden / hp.heads;
    let (q, kv) = (hp.heads * hd, hp.kv_heads * hd);
    let permute = arch == "llama";
    let mut specs = vec![
        f32_spec("token_embd.weight", &[hp.vocab, hp.hidden], &hf["embed"]),
        f32_spec("output_norm.weight", &[hp.hidden], &hf["norm"]),
        f32_spec("blk.0.attn_norm.weight", &[hp.hidden], &hf["attn_norm"]),
        f32_spec("blk.0.ffn_norm.weight", &[hp.hidden], &hf["ffn_norm"]),
        f32_spec("blk.0.attn_v.weight", &[kv, hp.hidden], &hf["v"]),
        f32_spec("blk.0.attn_output.weight", &[hp.hidden, q], &hf["o"]),
        f32_spec("blk.0.ffn_gate.weight", &[hp.ffn, hp.hidden], &hf["gate"]),
        f32_spec("blk.0.ffn_up.weight", &[hp.ffn, hp.hidden], &hf["up"]),
        f32_spec("blk.0.ffn_down.weight", &[hp.hidden, hp.ffn], &hf["down"]),
    ];
    let (qw, kw, qb, kb) = if permute {
        (
            llama_cpp_permute(&hf["q"], q, hp.hidden, hp.heads),
            llama_cpp_permute(&hf["k"], kv, hp.hidden, hp.kv_heads),
            llama_cpp_permute(&hf["q_bias"], q, 1, hp.heads),
            llama_cpp_permute(&hf["k_bias"], kv, 1, hp.kv_heads),
        )
    } else {
        (
            hf["q"].clone(),
            hf["k"].clone(),
            hf["q_bias"].clone(),
            hf["k_bias"].clone(),
        )
    };
    specs.push(f32_spec("blk.0.attn_q.weight", &[q, hp.hidden], &qw));
    specs.push(f32_spec("blk.0.attn_k.weight", &[kv, hp.hidden], &kw));
    specs.push(f32_spec("blk.0.attn_q.bias", &[q], &qb));
    specs.push(f32_spec("blk.0.attn_k.bias", &[kv], &kb));
    specs
}

fn hf_values(hp: Hp) -> HashMap<&'static str, Vec<f32>> {
    let hd = hp.hidden / hp.heads;
    let (q, kv, h, f) = (hp.heads * hd, hp.kv_heads * hd, hp.hidden, hp.ffn);
    HashMap::from([
        ("embed", ramp(hp.vocab * h, -3.0)),
        ("norm", ramp(h, 0.5)),
        ("attn_norm", ramp(h, 1.5)),
        ("ffn_norm", ramp(h, 2.5)),
        ("q", ramp(q * h, 0.0)),
        ("k", ramp(kv * h, 100.0)),
        ("v", ramp(kv * h, 200.0)),
        ("o", ramp(h * q, 300.0)),
        ("gate", ramp(f * h, 400.0)),
        ("up", ramp(f * h, 500.0)),
        ("down", ramp(h * f, 600.0)),
        ("q_bias", ramp(q, 700.0)),
        ("k_bias", ramp(kv, 800.0)),
    ])
}

#[test]
fn llama_q_k_permutation_is_undone() {
    let dir = scratch("permute");
    let hp = TINY;
    let hf = hf_values(hp);
    let path = write(
        &dir,
        "llama.gguf",
        &gguf_bytes(3, &metadata("llama", hp), &full_model("llama", hp, &hf)),
    );
    let (c, t) = load_gguf(&path, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(c.model_type, "llama");
    assert_eq!((c.head_dim, c.num_key_value_heads), (4, 1));
    assert!(c.tie_word_embeddings);
    assert_eq!(c.raw["attention_bias"], true);
    let p = "model.layers.0";
    for (name, key, dims) in [
        (format!("{p}.self_attn.q_proj.weight"), "q", vec![8, 8]),
        (format!("{p}.self_attn.k_proj.weight"), "k", vec![4, 8]),
        (format!("{p}.self_attn.q_proj.bias"), "q_bias", vec![8]),
        (format!("{p}.self_attn.k_proj.bias"), "k_bias", vec![4]),
        (format!("{p}.self_attn.v_proj.weight"), "v", vec![4, 8]),
        (format!("{p}.self_attn.o_proj.weight"), "o", vec![8, 8]),
        (format!("{p}.mlp.gate_proj.weight"), "gate", vec![16, 8]),
        (format!("{p}.mlp.up_proj.weight"), "up", vec![16, 8]),
        (format!("{p}.mlp.down_proj.weight"), "down", vec![8, 16]),
        (format!("{p}.input_layernorm.weight"), "attn_norm", vec![8]),
        (
            format!("{p}.post_attention_layernorm.weight"),
            "ffn_norm",
            vec![8],
        ),
        ("model.norm.weight".to_string(), "norm", vec![8]),
        ("model.embed_tokens.weight".to_string(), "embed", vec![4, 8]),
    ] {
        let got = t.get(&name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(got.dims(), dims.as_slice(), "{name}");
        assert_eq!(values(got), hf[key], "{name}");
    }
    assert_eq!(t.len(), 13);
    // The permutation is not the identity here, so the test would notice a missing un-permute.
    assert_ne!(llama_cpp_permute(&hf["q"], 8, 8, 2), hf["q"]);
}

#[test]
fn qwen2_is_not_permuted_and_keeps_biases() {
    let dir = scratch("qwen2");
    let hp = TINY;
    let hf = hf_values(hp);
    let mut specs = full_model("qwen2", hp, &hf);
    specs.push(f32_spec(
        "output.weight",
        &[hp.vocab, hp.hidden],
        &ramp(32, 9.0),
    ));
    let path = write(
        &dir,
        "qwen2.gguf",
        &gguf_bytes(3, &metadata("qwen2", hp), &specs),
    );
    let (c, t) = load_gguf(&path, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(c.model_type, "qwen2");
    assert!(!c.tie_word_embeddings);
    assert_eq!(
        values(&t["model.layers.0.self_attn.q_proj.weight"]),
        hf["q"]
    );
    assert_eq!(
        values(&t["model.layers.0.self_attn.k_proj.bias"]),
        hf["k_bias"]
    );
    assert_eq!(values(&t["lm_head.weight"]), ramp(32, 9.0));
}

#[test]
fn gemma_norms_lose_the_added_one() {
    let dir = scratch("gemma");
    let hp = Hp {
        vocab: 4,
        hidden: 8,
        ffn: 16,
        heads: 2,
        kv_heads: 1,
    };
    // Gemma's head size is not hidden / heads: llama.cpp writes it as attention.key_length.
    let hd = 6;
    let mut meta = metadata("gemma", hp);
    meta.push(("gemma.attention.key_length".into(), Meta::U32(hd as u32)));
    let norm = ramp(8, 1.0);
    let specs = vec![
        f32_spec("token_embd.weight", &[4, 8], &ramp(32, 0.0)),
        f32_spec("output_norm.weight", &[8], &norm),
        f32_spec("blk.0.attn_norm.weight", &[8], &norm),
        f32_spec("blk.0.ffn_norm.weight", &[8], &norm),
        f32_spec("blk.0.attn_q.weight", &[2 * hd, 8], &ramp(2 * hd * 8, 0.0)),
        f32_spec("blk.0.attn_k.weight", &[hd, 8], &ramp(hd * 8, 0.0)),
        f32_spec(
            "blk.0.attn_output.weight",
            &[8, 2 * hd],
            &ramp(2 * hd * 8, 0.0),
        ),
    ];
    let path = write(&dir, "gemma.gguf", &gguf_bytes(3, &meta, &specs));
    let (c, t) = load_gguf(&path, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(c.model_type, "gemma");
    assert_eq!(c.head_dim, hd);
    assert!(c.norm_weight_offset_one && c.tie_word_embeddings);
    assert_eq!(c.activation, ferrotune_models::config::Activation::GeluTanh);
    let minus_one: Vec<f32> = norm.iter().map(|x| x - 1.0).collect();
    for name in [
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
    ] {
        assert_eq!(values(&t[name]), minus_one, "{name}");
    }
    // No permutation for Gemma.
    assert_eq!(
        values(&t["model.layers.0.self_attn.q_proj.weight"]),
        ramp(2 * hd * 8, 0.0)
    );
}

#[test]
fn phi3_fused_projections_and_longrope() {
    let dir = scratch("phi3");
    let hp = Hp {
        vocab: 4,
        hidden: 8,
        ffn: 16,
        heads: 2,
        kv_heads: 2,
    };
    let mut meta = metadata("phi3", hp);
    meta.push(("phi3.rope.dimension_count".into(), Meta::U32(4)));
    meta.push((
        "phi3.rope.scaling.original_context_length".into(),
        Meta::U32(16),
    ));
    meta.push(("phi3.attention.sliding_window".into(), Meta::U32(32)));
    let specs = vec![
        f32_spec("token_embd.weight", &[4, 8], &ramp(32, 0.0)),
        f32_spec("blk.0.attn_qkv.weight", &[24, 8], &ramp(192, 0.0)),
        f32_spec("blk.0.ffn_up.weight", &[32, 8], &ramp(256, 0.0)),
        f32_spec("blk.0.ffn_down.weight", &[8, 16], &ramp(128, 0.0)),
        f32_spec("rope_factors_long.weight", &[2], &[1.5, 2.5]),
        f32_spec("rope_factors_short.weight", &[2], &[1.0, 1.25]),
    ];
    let path = write(&dir, "phi3.gguf", &gguf_bytes(3, &meta, &specs));
    let (c, t) = load_gguf(&path, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(c.model_type, "phi3");
    assert!(c.fused_projections);
    assert_eq!(c.rope.partial_rotary_factor, 1.0);
    assert_eq!(c.layer_sliding_windows, vec![Some(32)]);
    match &c.rope.scaling {
        ferrotune_models::config::RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            ..
        } => {
            assert_eq!(long_factor, &vec![1.5, 2.5]);
            assert_eq!(short_factor, &vec![1.0, 1.25]);
            assert_eq!(*original_max_position_embeddings, 16);
        }
        other => panic!("expected longrope, got {other:?}"),
    }
    assert_eq!(
        t["model.layers.0.self_attn.qkv_proj.weight"].dims(),
        &[24, 8]
    );
    assert_eq!(t["model.layers.0.mlp.gate_up_proj.weight"].dims(), &[32, 8]);
    assert_eq!(
        values(&t["model.layers.0.mlp.gate_up_proj.weight"]),
        ramp(256, 0.0)
    );
    assert!(
        !t.keys().any(|k| k.contains("rope")),
        "rotary factors are config, not weights"
    );
}

#[test]
fn qwen3_qk_norms_and_rope_scaling_keys() {
    let dir = scratch("qwen3");
    let hp = TINY;
    let mut meta = metadata("qwen3", hp);
    meta.push(("qwen3.attention.key_length".into(), Meta::U32(4)));
    meta.push(("qwen3.rope.scaling.type".into(), Meta::Str("yarn")));
    meta.push(("qwen3.rope.scaling.factor".into(), Meta::F32(4.0)));
    meta.push((
        "qwen3.rope.scaling.original_context_length".into(),
        Meta::U32(32),
    ));
    let specs = vec![
        f32_spec("blk.0.attn_q_norm.weight", &[4], &[1.0, 2.0, 3.0, 4.0]),
        f32_spec("blk.0.attn_k_norm.weight", &[4], &[5.0, 6.0, 7.0, 8.0]),
    ];
    let path = write(&dir, "qwen3.gguf", &gguf_bytes(2, &meta, &specs));
    let (c, t) = load_gguf(&path, DType::F32, &Device::Cpu).unwrap();
    assert!(c.qk_norm);
    match c.rope.scaling {
        ferrotune_models::config::RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            ..
        } => {
            assert_eq!((factor, original_max_position_embeddings), (4.0, 32));
        }
        ref other => panic!("expected yarn, got {other:?}"),
    }
    assert_eq!(
        values(&t["model.layers.0.self_attn.q_norm.weight"]),
        vec![1.0, 2.0, 3.0, 4.0]
    );
    assert_eq!(
        values(&t["model.layers.0.self_attn.k_norm.weight"]),
        vec![5.0, 6.0, 7.0, 8.0]
    );
}

#[test]
fn llama3_rope_freqs_become_llama3_scaling() {
    // What llama.cpp's LlamaModel.generate_extra_tensors writes for Llama 3.1 (factor 8).
    let (base, dim) = (500000.0f64, 64usize);
    let freqs: Vec<f32> = (0..dim / 2)
        .map(|i| {
            let wavelen = 2.0 * std::f64::consts::PI * base.powf((2 * i) as f64 / dim as f64);
            let (low, high, orig, factor) = (8192.0, 2048.0, 8192.0, 8.0);
            if wavelen < high {
                1.0
            } else if wavelen > low {
                factor as f32
            } else {
                let smooth = (orig / wavelen - 1.0) / 3.0;
                (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
            }
        })
        .collect();
    let dir = scratch("llama3");
    let hp = Hp {
        vocab: 4,
        hidden: 128,
        ffn: 16,
        heads: 2,
        kv_heads: 1,
    };
    let mut meta = metadata("llama", hp);
    meta.retain(|(k, _)| k != "llama.rope.freq_base");
    meta.push(("llama.rope.freq_base".into(), Meta::F32(base as f32)));
    meta.push(("llama.rope.dimension_count".into(), Meta::U32(dim as u32)));
    let specs = vec![f32_spec("rope_freqs.weight", &[dim / 2], &freqs)];
    let path = write(&dir, "llama3.gguf", &gguf_bytes(3, &meta, &specs));
    let (c, t) = load_gguf(&path, DType::F32, &Device::Cpu).unwrap();
    assert!(t.is_empty());
    assert_eq!(
        c.rope.scaling,
        ferrotune_models::config::RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        }
    );
}

#[test]
fn mistral_named_llama_file_is_mistral() {
    let dir = scratch("mistral");
    let mut meta = metadata("llama", TINY);
    meta.retain(|(k, _)| k != "general.name");
    meta.push(("general.name".into(), Meta::Str("Mistral-7B-Instruct-v0.3")));
    let path = write(&dir, "m.gguf", &gguf_bytes(3, &meta, &[]));
    let (c, _) = load_gguf(&path, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(c.model_type, "mistral");
    assert_eq!(c.layer_sliding_windows, vec![None]);
}

#[test]
fn every_supported_type_dequantizes_like_gguf_py() {
    let reference = candle_core::safetensors::load(
        fixtures().join("quant_reference.safetensors"),
        &Device::Cpu,
    )
    .expect("run scripts/make_gguf_fixtures.py");
    let dir = scratch("quants");
    let types = [
        ("F32", 0),
        ("F16", 1),
        ("Q4_0", 2),
        ("Q4_1", 3),
        ("Q5_0", 6),
        ("Q5_1", 7),
        ("Q8_0", 8),
        ("Q2_K", 10),
        ("Q3_K", 11),
        ("Q4_K", 12),
        ("Q5_K", 13),
        ("Q6_K", 14),
        ("BF16", 30),
    ];
    let hp = Hp {
        vocab: 4,
        hidden: 256,
        ffn: 16,
        heads: 2,
        kv_heads: 1,
    };
    for (name, id) in types {
        let raw = reference[&format!("{name}.raw")]
            .flatten_all()
            .unwrap()
            .to_vec1::<u8>()
            .unwrap();
        let expected = &reference[&format!("{name}.expected")];
        let spec = Spec {
            name: "token_embd.weight".into(),
            ggml_type: id,
            dims: vec![4, 256],
            data: raw,
        };
        let path = write(
            &dir,
            &format!("{name}.gguf"),
            &gguf_bytes(3, &metadata("llama", hp), &[spec]),
        );
        let (_, t) =
            load_gguf(&path, DType::F32, &Device::Cpu).unwrap_or_else(|e| panic!("{name}: {e}"));
        let got = &t["model.embed_tokens.weight"];
        assert_eq!(got.dims(), &[4, 256], "{name}");
        let (got, want) = (values(got), values(expected));
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0.0f32, f32::max);
        eprintln!("{name}: max |ours - gguf-py| = {worst:e}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{name}[{i}]: ours {g}, gguf-py {w}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Errors: each names the file and the problem; none panics.

fn load_err(path: &Path) -> String {
    let result = std::panic::catch_unwind(|| load_gguf(path, DType::F32, &Device::Cpu));
    match result {
        Err(_) => panic!("load_gguf panicked on {}", path.display()),
        Ok(Ok(_)) => panic!("load_gguf accepted {}", path.display()),
        Ok(Err(e)) => {
            assert!(matches!(e, ModelError::File { .. }), "{e:?}");
            let msg = e.to_string();
            eprintln!("error as expected: {msg}");
            let file = path.file_name().unwrap().to_str().unwrap();
            assert!(msg.contains(file), "message does not name the file: {msg}");
            msg
        }
    }
}

#[test]
fn error_missing_file() {
    let dir = scratch("missing");
    let path = dir.join("no-such-model.gguf");
    let msg = load_err(&path);
    assert!(msg.contains("cannot open"), "{msg}");
}

#[test]
fn error_random_bytes() {
    let dir = scratch("random");
    // A fixed xorshift stream: deterministic "random" bytes.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let bytes: Vec<u8> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let msg = load_err(&write(&dir, "random.gguf", &bytes));
    assert!(msg.contains("not a GGUF file"), "{msg}");
    let msg = load_err(&write(&dir, "empty.gguf", &[]));
    assert!(
        msg.contains("not a GGUF file") && msg.contains("empty"),
        "{msg}"
    );
    // The right magic followed by garbage.
    let mut garbage = b"GGUF".to_vec();
    garbage.extend(3u32.to_le_bytes());
    garbage.extend(&bytes);
    let msg = load_err(&write(&dir, "garbage.gguf", &garbage));
    assert!(
        msg.contains("corrupt") || msg.contains("truncated"),
        "{msg}"
    );
}

#[test]
fn error_truncated_real_file() {
    let dir = scratch("truncated");
    let mut bytes = std::fs::read(real_gguf()).unwrap();
    // Cut inside the header (the tokenizer metadata alone is over 1 MB) ...
    let path = write(&dir, "smollm2-1mb.gguf", &bytes[..1 << 20]);
    let msg = load_err(&path);
    assert!(msg.contains("truncated"), "{msg}");
    // ... and inside the tensor data.
    bytes.truncate(bytes.len() - 1000);
    let msg = load_err(&write(&dir, "smollm2-short.gguf", &bytes));
    assert!(
        msg.contains("truncated") && msg.contains("tensor '"),
        "{msg}"
    );
}

#[test]
fn error_unsupported_tensor_types() {
    let dir = scratch("types");
    let hp = Hp {
        vocab: 4,
        hidden: 256,
        ffn: 16,
        heads: 2,
        kv_heads: 1,
    };
    // IQ4_XS (23): a real llama.cpp type that candle does not know.
    let spec = Spec {
        name: "token_embd.weight".into(),
        ggml_type: 23,
        dims: vec![4, 256],
        data: vec![0; 4 * 136],
    };
    let msg = load_err(&write(
        &dir,
        "iq4xs.gguf",
        &gguf_bytes(3, &metadata("llama", hp), &[spec]),
    ));
    assert!(msg.contains("unsupported tensor type IQ4_XS"), "{msg}");
    // Q8_1 (9): known to candle, but only as an intermediate format.
    let spec = Spec {
        name: "token_embd.weight".into(),
        ggml_type: 9,
        dims: vec![4, 256],
        data: vec![0; 4 * 8 * 36],
    };
    let msg = load_err(&write(
        &dir,
        "q81.gguf",
        &gguf_bytes(3, &metadata("llama", hp), &[spec]),
    ));
    assert!(
        msg.contains("token_embd.weight") && msg.contains("Q8_1"),
        "{msg}"
    );
}

#[test]
fn error_missing_metadata() {
    let dir = scratch("meta");
    let mut meta = metadata("llama", TINY);
    meta.retain(|(k, _)| k != "llama.embedding_length");
    let msg = load_err(&write(&dir, "no-hidden.gguf", &gguf_bytes(3, &meta, &[])));
    assert!(
        msg.contains("missing metadata key 'llama.embedding_length'"),
        "{msg}"
    );

    let mut meta = metadata("llama", TINY);
    meta.retain(|(k, _)| k != "general.architecture");
    let msg = load_err(&write(&dir, "no-arch.gguf", &gguf_bytes(3, &meta, &[])));
    assert!(msg.contains("general.architecture"), "{msg}");

    let mut meta = metadata("llama", TINY);
    meta.retain(|(k, _)| k != "llama.block_count");
    meta.push(("llama.block_count".into(), Meta::Strs(vec!["x"])));
    let msg = load_err(&write(&dir, "bad-type.gguf", &gguf_bytes(3, &meta, &[])));
    assert!(msg.contains("llama.block_count"), "{msg}");

    let mut meta = metadata("llama", TINY);
    meta.retain(|(k, _)| k != "llama.attention.head_count_kv");
    meta.push(("llama.attention.head_count_kv".into(), Meta::I32(-1)));
    let msg = load_err(&write(&dir, "neg.gguf", &gguf_bytes(3, &meta, &[])));
    assert!(msg.contains("llama.attention.head_count_kv"), "{msg}");

    // `llama` with experts is Mixtral, which needs the top-k; other dense architectures with
    // experts are refused.
    let mut meta = metadata("llama", TINY);
    meta.push(("llama.expert_count".into(), Meta::U32(8)));
    let msg = load_err(&write(&dir, "moe.gguf", &gguf_bytes(3, &meta, &[])));
    assert!(
        msg.contains("missing metadata key 'llama.expert_used_count'"),
        "{msg}"
    );
    let mut meta = metadata("qwen2", TINY);
    meta.push(("qwen2.expert_count".into(), Meta::U32(8)));
    let msg = load_err(&write(&dir, "qwen2-moe.gguf", &gguf_bytes(3, &meta, &[])));
    assert!(
        msg.contains("mixture-of-experts") && msg.contains("qwen2moe"),
        "{msg}"
    );
    let mut meta = metadata("llama", TINY);
    meta.push(("llama.expert_count".into(), Meta::U32(2)));
    meta.push(("llama.expert_used_count".into(), Meta::U32(3)));
    let msg = load_err(&write(&dir, "topk.gguf", &gguf_bytes(3, &meta, &[])));
    assert!(msg.contains("expert_used_count 3 is more than"), "{msg}");

    let mut meta = metadata("gpt2", TINY);
    meta.truncate(3);
    let msg = load_err(&write(&dir, "gpt2.gguf", &gguf_bytes(3, &meta, &[])));
    assert!(
        msg.contains("unsupported GGUF architecture 'gpt2'"),
        "{msg}"
    );
}

/// A `block_count` beyond the file's layers (issue 44: a billion aborted allocating 1.2 TB)
/// is an error naming the key when a model is built from the file.
#[test]
fn error_block_count_beyond_the_tensors() {
    let dir = scratch("blocks");
    let hp = TINY;
    for (count, held) in [(1_000_000_000u32, false), (3, true)] {
        let mut meta = metadata("llama", hp);
        meta.retain(|(k, _)| k != "llama.block_count");
        meta.push(("llama.block_count".into(), Meta::U32(count)));
        let specs = full_model("llama", hp, &hf_values(hp));
        let path = write(&dir, "blocks.gguf", &gguf_bytes(3, &meta, &specs));
        let err = match ferrotune_models::load_model(&path, DType::F32, &Device::Cpu) {
            Ok(_) => panic!("a model with block_count {count} was built from one layer"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains("block_count")
                && err.contains(&count.to_string())
                && err.contains("blocks.gguf"),
            "{err}"
        );
        if held {
            assert!(err.contains("1 layer (layer 0)"), "{err}");
        }
    }
}

#[test]
fn error_shape_disagrees_with_metadata() {
    let dir = scratch("shape");
    let specs = vec![f32_spec("blk.0.attn_q.weight", &[8, 4], &ramp(32, 0.0))];
    let msg = load_err(&write(
        &dir,
        "q.gguf",
        &gguf_bytes(3, &metadata("llama", TINY), &specs),
    ));
    assert!(
        msg.contains("blk.0.attn_q.weight") && msg.contains("[8, 4]") && msg.contains("[8, 8]"),
        "{msg}"
    );

    let specs = vec![f32_spec("blk.7.attn_norm.weight", &[8], &ramp(8, 0.0))];
    let msg = load_err(&write(
        &dir,
        "layer.gguf",
        &gguf_bytes(3, &metadata("llama", TINY), &specs),
    ));
    assert!(
        msg.contains("blk.7.attn_norm.weight") && msg.contains("block_count"),
        "{msg}"
    );

    // Quantized blocks must not straddle rows.
    let spec = Spec {
        name: "token_embd.weight".into(),
        ggml_type: 8,
        dims: vec![4, 8],
        data: vec![0; 34],
    };
    let msg = load_err(&write(
        &dir,
        "blocks.gguf",
        &gguf_bytes(3, &metadata("llama", TINY), &[spec]),
    ));
    assert!(msg.contains("token_embd.weight"), "{msg}");
}

#[test]
fn error_corrupt_headers() {
    let dir = scratch("corrupt");
    // general.alignment = 0 (candle would divide by it).
    let mut meta = metadata("llama", TINY);
    meta.push(("general.alignment".into(), Meta::U32(0)));
    let msg = load_err(&write(&dir, "align0.gguf", &gguf_bytes(3, &meta, &[])));
    assert!(msg.contains("alignment"), "{msg}");

    // A string claiming 2^62 bytes.
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(3u32.to_le_bytes());
    bytes.extend(0u64.to_le_bytes());
    bytes.extend(1u64.to_le_bytes());
    bytes.extend((1u64 << 62).to_le_bytes());
    bytes.extend([b'x'; 64]);
    let msg = load_err(&write(&dir, "hugestring.gguf", &bytes));
    assert!(
        msg.contains("corrupt") || msg.contains("truncated"),
        "{msg}"
    );

    // Tensor dimensions whose product overflows.
    let spec = Spec {
        name: "token_embd.weight".into(),
        ggml_type: 0,
        dims: vec![1 << 40, 1 << 40],
        data: vec![],
    };
    let msg = load_err(&write(
        &dir,
        "overflow.gguf",
        &gguf_bytes(3, &metadata("llama", TINY), &[spec]),
    ));
    assert!(msg.contains("token_embd.weight"), "{msg}");

    // Tensor data past the end of the file.
    let mut bytes = gguf_bytes(
        3,
        &metadata("llama", TINY),
        &[f32_spec("output_norm.weight", &[8], &ramp(8, 0.0))],
    );
    bytes.truncate(bytes.len() - 16);
    let msg = load_err(&write(&dir, "short.gguf", &bytes));
    assert!(
        msg.contains("truncated") && msg.contains("output_norm.weight"),
        "{msg}"
    );

    // Versions other than 2 and 3.
    let mut bytes = gguf_bytes(3, &metadata("llama", TINY), &[]);
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    let msg = load_err(&write(&dir, "v1.gguf", &bytes));
    assert!(msg.contains("version 1"), "{msg}");
    bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
    let msg = load_err(&write(&dir, "be.gguf", &bytes));
    assert!(msg.contains("big-endian"), "{msg}");
}

/// A name the header gives twice is refused naming it (candle keeps one of the two, so a
/// duplicate tensor used to be reported as another tensor missing, e.g. attn_k).
#[test]
fn error_names_given_twice() {
    let dir = scratch("twice");
    let hp = TINY;
    let mut specs = full_model("llama", hp, &hf_values(hp));
    let k = specs
        .iter_mut()
        .find(|t| t.name == "blk.0.attn_k.weight")
        .unwrap();
    k.name = "blk.0.attn_v.weight".into();
    let msg = load_err(&write(
        &dir,
        "tensor.gguf",
        &gguf_bytes(3, &metadata("llama", hp), &specs),
    ));
    assert!(
        msg.contains("tensor 'blk.0.attn_v.weight' appears twice"),
        "{msg}"
    );

    let mut meta = metadata("llama", hp);
    // A string array before it, which the walk over the header skips.
    meta.push(("tokenizer.ggml.tokens".into(), Meta::Strs(vec!["a", "b"])));
    meta.push(("llama.block_count".into(), Meta::U32(7)));
    let specs = full_model("llama", hp, &hf_values(hp));
    let msg = load_err(&write(&dir, "key.gguf", &gguf_bytes(3, &meta, &specs)));
    assert!(
        msg.contains("metadata key 'llama.block_count' appears twice"),
        "{msg}"
    );
}

/// A tensor whose type label disagrees with its bytes (F32 data labelled Q4_0, which needs a
/// seventh of the bytes) is refused, as llama.cpp's reader refuses it: the next tensor is not
/// where the sizes put it, or, for the last tensor, bytes are left over. Before, the file loaded
/// with the bytes read as Q4_0 blocks.
#[test]
fn error_tensor_type_disagrees_with_its_bytes() {
    let dir = scratch("relabelled");
    let hp = Hp {
        vocab: 4,
        hidden: 32,
        ffn: 32,
        heads: 2,
        kv_heads: 1,
    };
    let relabelled = |name: &str, last: bool| {
        let mut specs = full_model("llama", hp, &hf_values(hp));
        let at = specs.iter().position(|t| t.name == name).unwrap();
        let mut spec = specs.remove(at);
        spec.ggml_type = 2;
        specs.insert(if last { specs.len() } else { at }, spec);
        gguf_bytes(3, &metadata("llama", hp), &specs)
    };
    // Sound as written.
    let file = write(
        &dir,
        "f32.gguf",
        &gguf_bytes(
            3,
            &metadata("llama", hp),
            &full_model("llama", hp, &hf_values(hp)),
        ),
    );
    load_gguf(&file, DType::F32, &Device::Cpu).unwrap();
    // A tensor in the middle: the one after it starts past where the labels put it.
    let msg = load_err(&write(
        &dir,
        "mid.gguf",
        &relabelled("token_embd.weight", false),
    ));
    assert!(
        msg.contains("'token_embd.weight' (Q4_0, shape [4, 32])")
            && msg.contains("should be at offset 96"),
        "{msg}"
    );
    // The last tensor: bytes no tensor accounts for.
    let msg = load_err(&write(
        &dir,
        "last.gguf",
        &relabelled("token_embd.weight", true),
    ));
    assert!(
        msg.contains("after its last tensor, 'token_embd.weight' (Q4_0"),
        "{msg}"
    );
}

/// NaN or ±Inf in a tensor (here F32; dequantized blocks are checked the same way) is refused
/// naming the GGUF tensor, as for every other format (`weight_checks.rs`).
#[test]
fn error_non_finite_weights() {
    let dir = scratch("nonfinite");
    let hp = TINY;
    for (case, v) in [("nan", f32::NAN), ("inf", f32::NEG_INFINITY)] {
        let mut specs = full_model("llama", hp, &hf_values(hp));
        let down = specs
            .iter_mut()
            .find(|t| t.name == "blk.0.ffn_down.weight")
            .unwrap();
        down.data[4..8].copy_from_slice(&v.to_le_bytes());
        let msg = load_err(&write(
            &dir,
            &format!("{case}.gguf"),
            &gguf_bytes(3, &metadata("llama", hp), &specs),
        ));
        assert!(
            msg.contains("tensor 'blk.0.ffn_down.weight' holds"),
            "{msg}"
        );
    }
}

/// Metadata values out of range are refused naming the GGUF key (issue 44: a rope factor of 0
/// loaded silently).
#[test]
fn error_metadata_out_of_range() {
    let dir = scratch("ranges");
    let cases: [(&str, Meta, &str); 4] = [
        (
            "llama.rope.freq_base",
            Meta::F32(0.0),
            "'llama.rope.freq_base' must be a positive",
        ),
        (
            "llama.rope.scale_linear",
            Meta::F32(0.0),
            "'llama.rope.scale_linear' must be a positive",
        ),
        (
            "llama.rope.scaling.factor",
            Meta::F32(-4.0),
            "'llama.rope.scaling.factor' must be a positive",
        ),
        (
            "llama.attention.layer_norm_rms_epsilon",
            Meta::F32(-1e-5),
            "'llama.attention.layer_norm_rms_epsilon' must not be negative",
        ),
    ];
    for (i, (key, value, needle)) in cases.into_iter().enumerate() {
        let mut meta = metadata("llama", TINY);
        meta.retain(|(k, _)| k != key);
        meta.push((key.into(), value));
        if key.contains("scaling.factor") {
            meta.push(("llama.rope.scaling.type".into(), Meta::Str("linear")));
        }
        let msg = load_err(&write(
            &dir,
            &format!("{i}.gguf"),
            &gguf_bytes(3, &meta, &[]),
        ));
        assert!(msg.contains(needle), "{key}: {msg}");
    }
}

/// Gemma 2 and Gemma 3 GGUF files as convert_hf_to_gguf.py writes them (scripts/make_gguf_fixtures.py):
/// loaded, they give the source checkpoint's logits (for Gemma 2 transformers' own GGUF load
/// agrees; for Gemma 3 it drops the rope scaling that llama.cpp and we apply).
#[test]
fn gemma2_and_gemma3_ggufs_give_the_source_models_logits() {
    for kind in ["gemma2", "gemma3"] {
        let path = fixtures().join(format!("{kind}_tiny.gguf"));
        let (model, _) = ferrotune_models::load_model(&path, DType::F32, &Device::Cpu)
            .unwrap_or_else(|e| panic!("{kind}: {e}"));
        let c = &model.config;
        assert!(c.sandwich_norms && c.norm_weight_offset_one, "{kind}");
        if kind == "gemma2" {
            assert_eq!(c.attn_logit_softcapping, Some(50.0));
            assert_eq!(c.final_logit_softcapping, Some(30.0));
            assert_eq!(c.layer_sliding_windows, vec![Some(5), None]);
        } else {
            assert!(c.qk_norm && c.local_rope.is_some());
            assert_eq!(
                c.local_rope_layers,
                vec![true, true, true, true, true, false]
            );
        }
        assert_reference_logits(&model, kind, kind);
    }
}

/// `model`'s logits for the `input_ids` of `{reference}_tiny_reference.safetensors` are that
/// file's `logits` within 1e-4.
fn assert_reference_logits(model: &ferrotune_models::CausalLm, what: &str, reference: &str) {
    let reference = candle_core::safetensors::load(
        fixtures().join(format!("{reference}_tiny_reference.safetensors")),
        &Device::Cpu,
    )
    .unwrap();
    let ids = reference["input_ids"].to_dtype(DType::U32).unwrap();
    let (b, t) = ids.dims2().unwrap();
    let logits = model
        .forward(
            &ids,
            &ferrotune_models::AttentionLayout::causal(b, t, 0),
            None,
        )
        .unwrap();
    let err = max_abs_diff(&logits, &reference["logits"]);
    assert!(err <= 1e-4, "{what}: logits differ by {err}");
}

/// Mixtral (`llama` with experts; stacked, per-expert and Q8_0 gate+up layouts), Qwen2-MoE
/// (shared expert), Qwen3-MoE (a dense `mlp_only_layers` layer), Phi-2 (separate and fused qkv)
/// and SmolLM3 (q/k permuted as llama's, NoPE every fourth layer) GGUF files as
/// convert_hf_to_gguf.py writes them (scripts/make_gguf_fixtures.py), from the tiny checkpoints
/// in tests/fixtures/models (SmolLM3: its own): loaded, they give the source checkpoint's logits.
#[test]
fn moe_phi2_and_smollm3_ggufs_give_the_source_models_logits() {
    for (file, reference) in [
        ("mixtral", "mixtral"),
        ("mixtral_legacy", "mixtral"),
        ("mixtral_q8", "mixtral_q8"),
        ("qwen2_moe", "qwen2_moe"),
        ("qwen3_moe", "qwen3_moe"),
        ("phi2", "phi2"),
        ("phi2_qkv", "phi2"),
        ("smollm3", "smollm3"),
    ] {
        let path = fixtures().join(format!("{file}_tiny.gguf"));
        let (model, _) = ferrotune_models::load_model(&path, DType::F32, &Device::Cpu)
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        let c = &model.config;
        if file == "smollm3" {
            // Its own 4-layer checkpoint (SmolLM3's default NoPE pattern, as llama.cpp assumes).
            assert_eq!(c.model_type, "smollm3");
            assert_eq!(c.rope_layers, vec![true, true, true, false]);
            assert!(c.tie_word_embeddings);
            assert_reference_logits(&model, file, reference);
            continue;
        }
        let source = ModelConfig::from_hf_json(
            &serde_json::from_str(
                &std::fs::read_to_string(
                    fixtures()
                        .join("../models")
                        .join(reference.trim_end_matches("_q8"))
                        .join("model/config.json"),
                )
                .unwrap(),
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(c.model_type, source.model_type, "{file}");
        assert_eq!(c.moe, source.moe, "{file}");
        assert_eq!(c.rope, source.rope, "{file}");
        assert_eq!(c.layer_norm, source.layer_norm, "{file}");
        assert_eq!(c.rms_norm_eps as f32, source.rms_norm_eps as f32, "{file}");
        assert_eq!(c.intermediate_size, source.intermediate_size, "{file}");
        assert_reference_logits(&model, file, reference);
    }
}

/// A quantized stacked expert tensor is kept packed per expert (for the CPU's fused kernels):
/// each expert's gate and up halves of `ffn_gate_up_exps` (Q8_0) become a packed matrix that
/// holds exactly the dequantized values (the logits test above runs them: few tokens reach each
/// expert, so the experts take their packed path).
#[test]
fn quantized_stacked_experts_are_packed_per_expert() {
    let path = fixtures().join("mixtral_q8_tiny.gguf");
    let (_, tensors, packed) =
        ferrotune_models::gguf::load_gguf_with_packed(&path, DType::F32, &Device::Cpu).unwrap();
    for layer in 0..2 {
        for e in 0..4 {
            for w in ["w1", "w3"] {
                let name = format!("model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight");
                let m = packed
                    .get(&name)
                    .unwrap_or_else(|| panic!("{name} is not packed"));
                assert_eq!((m.rows(), m.cols()), (48, 32), "{name}");
                let err = max_abs_diff(&m.dequantize(&Device::Cpu).unwrap(), &tensors[&name]);
                assert_eq!(err, 0.0, "{name}");
            }
        }
    }
    // Gate and up differ (the halves are not swapped or repeated).
    let w1 = &tensors["model.layers.0.block_sparse_moe.experts.1.w1.weight"];
    let w3 = &tensors["model.layers.0.block_sparse_moe.experts.1.w3.weight"];
    assert!(max_abs_diff(w1, w3) > 0.01);
}

/// A tied head's packed (Q4_1 block) copy is dropped when the embedding is replaced and the head
/// retied (trainable tokens, base weights saved beside an adapter): the head then computes with
/// the new embedding, not the old blocks.
#[test]
fn a_retied_head_drops_its_stale_packed_copy() {
    let (mut model, _) =
        ferrotune_models::load_model(&real_gguf(), DType::F32, &Device::Cpu).unwrap();
    assert!(model.config.tie_word_embeddings && model.lm_head.packed.is_some());
    model.retie_head();
    assert!(
        model.lm_head.packed.is_some(),
        "the same embedding keeps the copy"
    );
    model.embed_tokens = (&model.embed_tokens * 0.5).unwrap();
    model.retie_head();
    assert!(model.lm_head.packed.is_none());
    let h = Tensor::randn(0f32, 1.0, (1, model.config.hidden_size), &Device::Cpu).unwrap();
    let got = model.lm_head.forward(&h).unwrap();
    let want = h.matmul(&model.embed_tokens.t().unwrap()).unwrap();
    let err = max_abs_diff(&got, &want);
    assert!(
        err < 1e-4,
        "head output differs from the new embedding's by {err}"
    );
}

/// DeepSeek-V2 (q_proj, softmax routing) and -V3 (low-rank queries, sigmoid routing with
/// `exp_probs_b`, expert groups, YaRN with `mscale_all_dim`) as llama.cpp's own
/// convert_hf_to_gguf.py writes them (`deepseek2`: `kv_b_proj` split per head into `attn_k_b`,
/// transposed, and `attn_v_b`; stacked experts), from the tiny checkpoints in tests/fixtures/models
/// changed where the file cannot say what transformers computes (scripts/make_gguf_fixtures.py):
/// loaded, they give those checkpoints' logits in transformers.
#[test]
fn deepseek2_ggufs_from_llama_cpps_converter_give_the_source_models_logits() {
    for (kind, q_lora, yarn) in [
        ("deepseek_v2", None, false),
        ("deepseek_v3", Some(16), true),
    ] {
        let path = fixtures().join(format!("{kind}_tiny.gguf"));
        let (model, _) = ferrotune_models::load_model(&path, DType::F32, &Device::Cpu)
            .unwrap_or_else(|e| panic!("{kind}: {e}"));
        let c = &model.config;
        assert_eq!(c.model_type, kind);
        let mla = c.mla.as_ref().expect("MLA");
        assert_eq!(mla.q_lora_rank, q_lora, "{kind}");
        assert_eq!(
            c.raw["rope_parameters"]["rope_type"] == "yarn",
            yarn,
            "{kind}"
        );
        assert!(!c.tie_word_embeddings);
        assert_reference_logits(&model, kind, kind);
    }
}

/// A `deepseek2` file llama.cpp would route in a way no transformers DeepSeek does (softmax over
/// expert groups, ranked by their two best scores) is refused, naming the key.
#[test]
fn deepseek2_softmax_expert_groups_are_refused() {
    let dir = scratch("deepseek2_groups");
    let src = std::fs::read(fixtures().join("deepseek_v2_tiny.gguf")).unwrap();
    // The file's `expert_group_count` is 1; a copy with 2 differs in that one u32.
    let key = b"deepseek2.expert_group_count";
    let at = src
        .windows(key.len())
        .position(|w| w == key)
        .expect("expert_group_count in the file");
    let value = at + key.len() + 4; // the type (u32 = 4), then the value
    let mut bytes = src.clone();
    assert_eq!(&bytes[value..value + 4], &1u32.to_le_bytes());
    bytes[value..value + 4].copy_from_slice(&2u32.to_le_bytes());
    let path = write(&dir, "groups.gguf", &bytes);
    let err = load_gguf(&path, DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("deepseek2.expert_group_count"), "{err}");
}

/// gpt-oss as llama.cpp's own convert_hf_to_gguf.py writes it (`gpt-oss`: the fused interleaved
/// gate/up experts split into `ffn_gate_exps` / `ffn_up_exps`, transposed, sinks, biases), from the
/// tiny checkpoint with llama.cpp's fixed SwiGLU limit (7) and rounded YaRN range
/// (scripts/make_gguf_fixtures.py): loaded, it gives that checkpoint's logits in transformers.
#[test]
fn gpt_oss_gguf_from_llama_cpps_converter_gives_the_source_models_logits() {
    let path = fixtures().join("gpt_oss_tiny.gguf");
    let (model, _) = ferrotune_models::load_model(&path, DType::F32, &Device::Cpu)
        .unwrap_or_else(|e| panic!("gpt_oss: {e}"));
    let c = &model.config;
    assert_eq!(c.model_type, "gpt_oss");
    assert!(c.attention_sinks);
    assert_eq!(c.layer_sliding_windows, vec![Some(4), None, Some(4)]);
    assert_reference_logits(&model, "gpt_oss", "gpt_oss");
}
