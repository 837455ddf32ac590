//! `export-gguf`: each supported fixture checkpoint written as GGUF (f32, f16, bf16, Q8_0) and
//! read back by ferrotune's GGUF loader (which follows transformers' GGUF conversion) gives
//! transformers' logits of the original checkpoint — exactly up to f32 rounding for f32, within
//! the storage's precision otherwise — and the same tokenizer; unsupported checkpoints are
//! refused naming the reason.

use crate::common;

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use ferrotune_data::Tokenizer;
use ferrotune_export::gguf::{export_gguf, GgufExport, OutType};
use ferrotune_models::{load_model, AttentionLayout};
use serde_json::Value;

fn model_dir(name: &str) -> PathBuf {
    common::workspace_fixture(&format!("models/{name}"))
}

/// A scratch folder of this test (tests run in parallel and each removes its own).
fn out_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "ferrotune-gguf-export-{test}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The logits of fixture `name`'s golden input through the model at `path`.
fn golden_logits(name: &str, path: &std::path::Path) -> Tensor {
    let g: Value = serde_json::from_str(
        &std::fs::read_to_string(model_dir(name).join("golden.json")).unwrap(),
    )
    .unwrap();
    let rows: Vec<Vec<u32>> = serde_json::from_value(g["input_ids"].clone()).unwrap();
    let (b, t) = (rows.len(), rows[0].len());
    let ids = Tensor::from_vec(rows.concat(), (b, t), &Device::Cpu).unwrap();
    let (model, _) = load_model(path, DType::F32, &Device::Cpu).unwrap();
    model
        .forward(&ids, &AttentionLayout::causal(b, t, 0), None)
        .unwrap()
}

/// Exports checkpoint folder `dir` (an edited copy of fixture `name`) as `dir/model.gguf` in f32
/// and returns what was written and the relative L2 distance between the logits ferrotune reads
/// from the GGUF and from the checkpoint, for fixture `name`'s golden input.
fn round_trip(name: &str, dir: &std::path::Path) -> (GgufExport, f32) {
    let gguf = dir.join("model.gguf");
    let done = export_gguf(dir, &gguf, OutType::F32).unwrap();
    let err = common::rel_l2(&golden_logits(name, &gguf), &golden_logits(name, dir));
    (done, err)
}

/// transformers' logits of fixture `name`'s golden input.
fn transformers_logits(name: &str) -> Tensor {
    candle_core::safetensors::load(model_dir(name).join("golden.safetensors"), &Device::Cpu)
        .unwrap()
        .remove("logits")
        .unwrap()
}

#[test]
fn exported_gguf_gives_transformers_logits() {
    let out = out_dir("logits");
    // Tied and untied heads, GQA, explicit head_dim, Qwen2's biases, Qwen3's q/k norms, Mistral
    // as llama.cpp's `llama`, Gemma's `1 + w` norms and scaled embeddings, Phi-3's fused
    // projections and LongRoPE factors with a partial rotary dimension, Mixtral's and
    // Qwen2-MoE's stacked experts, routers and shared expert, Phi-2's LayerNorm biases, parallel
    // block and partial rotary dimension. (Q8_0's tolerance is its
    // rounding on these tiny random models; its bytes are checked exactly below.)
    let names = [
        "llama2",
        "smollm2_like",
        "mistral",
        "qwen2_5",
        "qwen3",
        "gemma",
        "phi3",
        "phi3_longrope",
        "mixtral",
        "qwen2_moe",
        "phi2",
        // Phi-2 with a tied head and its own bias (llama.cpp's phi2 needs output.weight).
        "phi2_tied",
        // PyTorch `.bin` shards, and Meta's format (interleaved q/k rows, Llama 3.1's and
        // 3.2's scaled rope, a tied head).
        "llama2_bin",
        "llama2_meta",
        "llama3_1_meta",
        "llama3_2_meta",
    ];
    let only = std::env::var("ONLY").ok();
    for name in names
        .into_iter()
        .filter(|n| only.as_deref().is_none_or(|o| o == *n))
    {
        for (outtype, tol) in [
            (OutType::F32, 1e-5),
            (OutType::F16, 2e-3),
            (OutType::Bf16, 2.5e-2),
            // A mixture of experts turns rounding into other routing choices: llama.cpp on the
            // same Q8_0 file is as far from transformers (Mixtral 0.169, Qwen2-MoE 0.046).
            (
                OutType::Q8_0,
                if name.contains("moe") || name == "mixtral" {
                    0.2
                } else {
                    8e-2
                },
            ),
        ] {
            let path = out.join(format!("{name}-{outtype:?}.gguf"));
            let done = export_gguf(&model_dir(name).join("model"), &path, outtype).unwrap();
            assert!(done.bytes > 0 && path.is_file());
            let err = common::rel_l2(&golden_logits(name, &path), &transformers_logits(name));
            assert!(err <= tol, "{name} {outtype:?}: relative L2 {err} > {tol}");
            if outtype == OutType::F32 {
                // The GGUF's tokenizer encodes as the checkpoint's does.
                let hf = Tokenizer::from_dir(model_dir(name).join("model")).unwrap();
                let gguf = Tokenizer::from_gguf(&path, ferrotune_models::family::gguf_vocab_style)
                    .unwrap();
                for text in ["Hello, world! 12345", "<|im_start|>user\nhi<|im_end|>"] {
                    assert_eq!(
                        gguf.encode(text, true).unwrap(),
                        hf.encode(text, true).unwrap(),
                        "{name}: {text:?}"
                    );
                }
            }
        }
    }
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn unsupported_checkpoints_are_refused_with_the_reason() {
    let out = out_dir("refused").join("refused.gguf");
    let err = |name: &str| {
        export_gguf(&model_dir(name).join("model"), &out, OutType::F16)
            .unwrap_err()
            .to_string()
    };
    assert!(
        err("ministral3").contains("not 'ministral3'"),
        "{}",
        err("ministral3")
    );
    // This SmolLM3 drops RoPE in its second layer; llama.cpp's leaves out every fourth.
    assert!(
        err("smollm3").contains("no_rope_layers"),
        "{}",
        err("smollm3")
    );
    // llama.cpp's qwen3moe has no dense layers (this fixture's first layer is one).
    assert!(
        err("qwen3_moe").contains("dense layers"),
        "{}",
        err("qwen3_moe")
    );
    assert!(
        err("mistral_window").contains("sliding-window"),
        "{}",
        err("mistral_window")
    );
    // llama.cpp's Gemma always reads the embeddings as its output head.
    let untied = out.parent().unwrap().join("gemma_untied");
    edited_copy("gemma", &untied, |c| {
        c["tie_word_embeddings"] = Value::from(false)
    });
    let e = export_gguf(&untied, &out, OutType::F16)
        .unwrap_err()
        .to_string();
    assert!(e.contains("ties the output head"), "{e}");
    assert!(!out.exists());
    // llama.cpp's 'llama' sizes the q bias by the hidden size: heads × head_dim must be it.
    let narrow = out.parent().unwrap().join("llama_bias_narrow");
    edited_copy("llama_linear_bias", &narrow, |c| {
        c["head_dim"] = Value::from(4)
    });
    let e = export_gguf(&narrow, &out, OutType::F16)
        .unwrap_err()
        .to_string();
    assert!(e.contains("attention biases of the hidden size"), "{e}");
    assert!(OutType::parse("q4_k")
        .unwrap_err()
        .to_string()
        .contains("q8_0"));
    // A reward model (sequence classifier) is no language model for llama.cpp.
    let e = export_gguf(&common::workspace_fixture("ppo/reward"), &out, OutType::F16)
        .unwrap_err()
        .to_string();
    assert!(e.contains("sequence classifier"), "{e}");
    // A LoRA run's checkpoint folder (adapter + merged/): pointed at the merged model.
    let run = out.parent().unwrap().join("lora_run");
    std::fs::create_dir_all(run.join("merged")).unwrap();
    std::fs::write(run.join("adapter_config.json"), "{}").unwrap();
    std::fs::write(run.join("merged/config.json"), "{}").unwrap();
    let e = export_gguf(&run, &out, OutType::F16)
        .unwrap_err()
        .to_string();
    assert!(e.contains("PEFT adapter") && e.contains("merged"), "{e}");
    // A failure while writing (here a weight of integer type) leaves no file behind.
    let dir = out.parent().unwrap().join("ints");
    edited_copy("llama2", &dir, |_| {});
    let mut weights =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let norm = "model.layers.0.input_layernorm.weight".to_string();
    let ints = weights[&norm].to_dtype(DType::U32).unwrap();
    weights.insert(norm, ints);
    candle_core::safetensors::save(&weights, dir.join("model.safetensors")).unwrap();
    let e = export_gguf(&dir, &out, OutType::F32).unwrap_err();
    assert!(format!("{e:#}").contains("input_layernorm"), "{e:#}");
    assert!(!out.exists());
    assert!(!out.with_extension("gguf.partial").exists());
    std::fs::remove_dir_all(out.parent().unwrap()).ok();
}

/// Q8_0 blocks byte for byte as gguf-py (llama.cpp's Python package) writes them
/// (scripts/make_gguf_export_fixtures.py).
#[test]
fn q8_0_matches_gguf_py_byte_for_byte() {
    let f: Value = serde_json::from_str(
        &std::fs::read_to_string(common::workspace_fixture("gguf_export/q8_0.json")).unwrap(),
    )
    .unwrap();
    let values: Vec<f32> = serde_json::from_value(f["values"].clone()).unwrap();
    let want = f["q8_0_hex"].as_str().unwrap();
    let got: String = ferrotune_export::gguf::quantize_q8_0(&values)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(got, want);
}

/// Llama 3's RoPE scaling travels as llama.cpp's `rope_freqs` factors: a checkpoint with the
/// released models' settings (low 1, high 4, original context 8192) exported and read back gives
/// the logits of the checkpoint itself.
#[test]
fn llama3_rope_scaling_round_trips_through_rope_freqs() {
    let out = out_dir("llama3");
    edited_copy("llama3_2", &out, |config| {
        let rope = config.get_mut("rope_parameters").expect("a v5 config");
        rope["original_max_position_embeddings"] = 8192.into();
        rope["low_freq_factor"] = 1.0.into();
        rope["high_freq_factor"] = 4.0.into();
        rope["factor"] = 8.0.into();
    });
    let (_, err) = round_trip("llama3_2", &out);
    assert!(err <= 1e-5, "relative L2 {err}");
    std::fs::remove_dir_all(&out).ok();
}

/// Linear and YaRN scaling travel as llama.cpp's `rope.scaling.*` keys (llama.cpp on these files
/// is within 7.5e-7 of transformers over 16 tokens, twice YaRN's original context): read back,
/// the checkpoint's logits; YaRN with a custom attention factor is refused.
#[test]
fn linear_and_yarn_rope_scaling_round_trip() {
    let out = out_dir("rope_scalings");
    let cases: [(&str, Value); 2] = [
        (
            "linear",
            serde_json::json!({"rope_theta": 10000.0, "rope_type": "linear", "factor": 3.0}),
        ),
        (
            "yarn",
            serde_json::json!({"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 8}),
        ),
    ];
    for (name, rope) in cases {
        let dir = out.join(name);
        edited_copy("llama2", &dir, |config| {
            config["rope_parameters"] = rope.clone();
        });
        let (_, err) = round_trip("llama2", &dir);
        assert!(err <= 1e-5, "{name}: relative L2 {err}");
    }
    let dir = out.join("yarn_attention_factor");
    edited_copy("llama2", &dir, |config| {
        config["rope_parameters"] = serde_json::json!({"rope_theta": 10000.0, "rope_type": "yarn",
            "factor": 4.0, "original_max_position_embeddings": 8, "attention_factor": 0.5});
    });
    let err = export_gguf(&dir, &dir.join("model.gguf"), OutType::F32).unwrap_err();
    assert!(err.to_string().contains("YaRN"), "{err}");
    std::fs::remove_dir_all(&out).ok();
}

/// `--outtype auto` is llama.cpp's converter's: bf16 for a bf16 checkpoint, f16 otherwise.
#[test]
fn auto_outtype_follows_the_checkpoint_dtype() {
    use candle_core::quantized::{gguf_file::Content, GgmlDType};
    let out = out_dir("auto");
    for (name, want) in [("bf16_llama", GgmlDType::BF16), ("llama2", GgmlDType::F16)] {
        let path = out.join(format!("{name}.gguf"));
        export_gguf(&model_dir(name).join("model"), &path, OutType::Auto).unwrap();
        let mut f = std::fs::File::open(&path).unwrap();
        let content = Content::read(&mut f).unwrap();
        let ty = content.tensor_infos["blk.0.attn_q.weight"].ggml_dtype;
        assert_eq!(ty, want, "{name}");
        let norm = content.tensor_infos["blk.0.attn_norm.weight"].ggml_dtype;
        assert_eq!(norm, GgmlDType::F32, "{name}: vectors stay f32");
    }
    std::fs::remove_dir_all(&out).ok();
}

/// Meta's files in an HF download's `original/` folder (no tokenizer.json beside them), stored in
/// bf16: the tokenizer and the model's name come from the parent folder, `auto` keeps bf16, and
/// the logits read back are the checkpoint's.
#[test]
fn meta_original_folder_exports_in_its_stored_type() {
    use candle_core::quantized::{gguf_file::Content, GgmlDType};
    use ferrotune_models::torch_pickle::{read_torch_file, write_torch_file, TorchTensor};
    let hf = out_dir("meta_original").join("Llama-3.2-tiny");
    let original = hf.join("original");
    std::fs::create_dir_all(&original).unwrap();
    let src = model_dir("llama3_2_meta").join("model");
    std::fs::copy(src.join("params.json"), original.join("params.json")).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), hf.join(f)).unwrap();
    }
    let bf16: Vec<(String, TorchTensor)> = read_torch_file(&src.join("consolidated.00.pth"))
        .unwrap()
        .into_iter()
        .map(|(name, t)| {
            let t = t.to_tensor(DType::BF16, &Device::Cpu).unwrap();
            (name, TorchTensor::from_tensor(&t).unwrap())
        })
        .collect();
    write_torch_file(&original.join("consolidated.00.pth"), &bf16).unwrap();

    let path = hf.join("model.gguf");
    export_gguf(&original, &path, OutType::Auto).unwrap();
    let mut f = std::fs::File::open(&path).unwrap();
    let content = Content::read(&mut f).unwrap();
    let ty = content.tensor_infos["blk.0.attn_q.weight"].ggml_dtype;
    assert_eq!(ty, GgmlDType::BF16);
    let name = content.metadata["general.name"]
        .to_string()
        .unwrap()
        .clone();
    assert_eq!(name, "Llama-3.2-tiny");
    let err = common::rel_l2(
        &golden_logits("llama3_2_meta", &path),
        &golden_logits("llama3_2_meta", &original),
    );
    // The same bf16 weights on both sides: only f32 rounding apart.
    assert!(err <= 1e-5, "relative L2 {err}");
    std::fs::remove_dir_all(hf.parent().unwrap()).ok();
}

/// A multimodal Gemma 3 checkpoint (`Gemma3ForConditionalGeneration`, transformers 4.5x names)
/// exports its text model, the vision tower and projector left out: read back, the checkpoint's
/// text logits. (Its config edited to what llama.cpp computes: both layers sliding, as llama.cpp's
/// pattern of 6 has it, and the score scale the head size.)
#[test]
fn multimodal_gemma3_exports_its_text_model() {
    let dir = out_dir("gemma3_multimodal");
    edited_copy("gemma3_multimodal", &dir, |config| {
        let text = &mut config["text_config"];
        text["query_pre_attn_scalar"] = 16.into();
        text["layer_types"] = serde_json::json!(["sliding_attention", "sliding_attention"]);
    });
    let (done, err) = round_trip("gemma3_multimodal", &dir);
    assert_eq!(done.architecture, "gemma3");
    assert!(err <= 1e-5, "relative L2 {err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Llama 3.2 Vision (`MllamaForConditionalGeneration`, the Hub's 4.x names) exports its text
/// model as llama.cpp's `llama`: the self-attention layers renumbered, the cross-attention layers,
/// the tower and the embedding's image-token rows left out; read back, transformers' text logits.
#[test]
fn llama_3_2_vision_exports_its_text_model_as_llama() {
    use candle_core::quantized::gguf_file::Content;
    let dir = out_dir("mllama_multimodal");
    edited_copy("mllama_multimodal", &dir, |_| {});
    let (done, err) = round_trip("mllama_multimodal", &dir);
    assert_eq!(done.architecture, "llama");
    assert!(err <= 1e-5, "relative L2 {err}");
    let gguf = common::rel_l2(
        &golden_logits("mllama_multimodal", &dir.join("model.gguf")),
        &transformers_logits("mllama_multimodal"),
    );
    assert!(gguf <= 1e-5, "relative L2 to transformers {gguf}");
    let content = Content::read(&mut std::fs::File::open(dir.join("model.gguf")).unwrap()).unwrap();
    assert_eq!(content.metadata["llama.block_count"].to_u32().unwrap(), 2);
    assert_eq!(
        content.tensor_infos["token_embd.weight"].shape.dims(),
        [512, 32]
    );
    assert!(!content.tensor_infos.contains_key("blk.2.attn_q.weight"));
    std::fs::remove_dir_all(&dir).ok();
}

/// A SentencePiece-style vocabulary (Llama 2's real tokenizer, 32 000 tokens) travels as
/// llama.cpp's `llama` vocabulary (tokens, scores, types, and the merges for the readers that
/// take them): the GGUF's tokenizer encodes as the checkpoint's, and the logits are the
/// checkpoint's. The model is the llama2 fixture with its embeddings widened to 32 000 rows.
#[test]
fn sentencepiece_vocabulary_round_trips() {
    let dir = out_dir("spm");
    std::fs::create_dir_all(&dir).unwrap();
    let src = model_dir("llama2").join("model");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let vocab = 32000usize;
    config["vocab_size"] = vocab.into();
    config["bos_token_id"] = 1.into();
    config["eos_token_id"] = 2.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let tokenizers = ferrotune_data::asset_path("tokenizers/llama2").unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tokenizers.join(f), dir.join(f)).unwrap();
    }
    let mut weights =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    // Deterministic values for the new rows (an LCG; candle's RNG is unseeded).
    let mut state = 12345u64;
    let mut rows = |n: usize| {
        let v: Vec<f32> = (0..n * 32)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.4
            })
            .collect();
        Tensor::from_vec(v, (n, 32), &Device::Cpu).unwrap()
    };
    weights.insert("model.embed_tokens.weight".into(), rows(vocab));
    weights.insert("lm_head.weight".into(), rows(vocab));
    candle_core::safetensors::save(&weights, dir.join("model.safetensors")).unwrap();

    let gguf = dir.join("model.gguf");
    export_gguf(&dir, &gguf, OutType::F32).unwrap();
    let hf = Tokenizer::from_dir(&dir).unwrap();
    let from_gguf =
        Tokenizer::from_gguf(&gguf, ferrotune_models::family::gguf_vocab_style).unwrap();
    let mut ids = Vec::new();
    for text in [
        "Hello world",
        "The quick brown fox jumps over the lazy dog.",
        "Numbers 12345 and émojis 🙂 ünïcödé",
        "def f(x):\n    return x**2\n",
        "Ceci n'est pas une pipe. 你好，世界！",
    ] {
        let want = hf.encode(text, true).unwrap();
        assert_eq!(from_gguf.encode(text, true).unwrap(), want, "{text:?}");
        ids.push(want);
    }
    let row = &ids[1];
    let input = Tensor::from_vec(row.clone(), (1, row.len()), &Device::Cpu).unwrap();
    let forward = |path: &std::path::Path| {
        let (model, _) = load_model(path, DType::F32, &Device::Cpu).unwrap();
        model
            .forward(&input, &AttentionLayout::causal(1, row.len(), 0), None)
            .unwrap()
    };
    let err = common::rel_l2(&forward(&gguf), &forward(&dir));
    assert!(err <= 1e-5, "relative L2 {err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A copy of fixture `name`'s checkpoint with its config edited, in `dir`.
fn edited_copy(name: &str, dir: &std::path::Path, edit: impl FnOnce(&mut Value)) {
    std::fs::create_dir_all(dir).unwrap();
    let src = model_dir(name).join("model");
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

/// SmolLM2's tokenizer is written with the `tokenizer.ggml.pre` of SmolLM2's own GGUF (made by
/// llama.cpp's converter), `smollm`: read from that GGUF and written out as ferrotune writes a
/// GGUF's tokenizer (the reader builds the digit split the name stands for), and as SmolLM2's repo
/// ships it (`tokenizer_class` `GPT2Tokenizer`, whose own pre-tokenizer, GPT-2's split alone,
/// replaces the digit split of `tokenizer.json`: the name comes from the file's, as llama.cpp's
/// converter sees it). The GGUF's tokenizer encodes as the source GGUF's. The model is the
/// smollm2_like fixture with its (tied) embeddings widened to SmolLM2's 49 152 tokens.
#[test]
fn smollm2_tokenizer_gets_the_pre_tokenizer_name_of_smollm2s_gguf() {
    use candle_core::quantized::gguf_file::Content;
    let asset = ferrotune_data::asset_path("SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
    let pre_of = |path: &std::path::Path| {
        let content = Content::read(&mut std::fs::File::open(path).unwrap()).unwrap();
        content.metadata["tokenizer.ggml.pre"]
            .to_string()
            .unwrap()
            .clone()
    };
    let want = pre_of(&asset);
    let source = Tokenizer::from_gguf(&asset, ferrotune_models::family::gguf_vocab_style).unwrap();
    let vocab = source.vocab_size();
    let out = out_dir("smollm2-pre");
    for class in [None, Some("GPT2Tokenizer")] {
        let dir = out.join(class.unwrap_or("as-exported"));
        edited_copy("smollm2_like", &dir, |c| {
            c["vocab_size"] = vocab.into();
            c["bos_token_id"] = 1.into();
        });
        let mut weights =
            candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
        let rows: Vec<f32> = (0..vocab * 32)
            .map(|i| (i as f32 * 0.7548).sin() * 0.2)
            .collect();
        weights.insert(
            "model.embed_tokens.weight".into(),
            Tensor::from_vec(rows, (vocab, 32), &Device::Cpu).unwrap(),
        );
        candle_core::safetensors::save(&weights, dir.join("model.safetensors")).unwrap();
        ferrotune_export::hf::export_tokenizer(&source, &dir).unwrap();
        if let Some(class) = class {
            let path = dir.join("tokenizer_config.json");
            let mut config: Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            config["tokenizer_class"] = class.into();
            std::fs::write(&path, config.to_string()).unwrap();
        }
        let gguf = dir.join("model.gguf");
        export_gguf(&dir, &gguf, OutType::F32).unwrap();
        assert_eq!(pre_of(&gguf), want, "tokenizer_class {class:?}");
        let written =
            Tokenizer::from_gguf(&gguf, ferrotune_models::family::gguf_vocab_style).unwrap();
        for text in [
            "Digits 1234567 3.14159 2024-01-01 and 100,000!",
            "Hello, world",
        ] {
            assert_eq!(
                written.encode(text, false).unwrap(),
                source.encode(text, false).unwrap(),
                "{text:?}"
            );
        }
    }
    std::fs::remove_dir_all(&out).ok();
}

/// A Qwen2-MoE whose head is tied to the embedding: llama.cpp's `qwen2moe` (as its `phi2`) has
/// no fallback to the embedding, so the file holds `output.weight`, the embedding's copy, and
/// reads back to the checkpoint's logits.
#[test]
fn a_tied_qwen2_moe_head_is_written_as_output_weight() {
    use candle_core::quantized::gguf_file::Content;
    let out = out_dir("tied-moe");
    let dir = out.join("qwen2_moe");
    edited_copy("qwen2_moe", &dir, |c| {
        c["tie_word_embeddings"] = true.into()
    });
    let (_, err) = round_trip("qwen2_moe", &dir);
    assert!(err <= 1e-5, "relative L2 {err}");
    let mut f = std::fs::File::open(dir.join("model.gguf")).unwrap();
    let content = Content::read(&mut f).unwrap();
    let output = &content.tensor_infos["output.weight"];
    let embed = &content.tensor_infos["token_embd.weight"];
    assert_eq!(output.shape.dims(), embed.shape.dims());
    std::fs::remove_dir_all(&out).ok();
}

/// Gemma 2 (sandwich norms, both softcaps, a sliding window on every other layer) with the
/// score scale llama.cpp fixes (the head size): exported and read back, the checkpoint's own
/// logits. The fixture's own scale, and Gemma 3, are refused naming the reason.
#[test]
fn gemma2_round_trips_with_llama_cpps_settings() {
    let out = out_dir("gemma");
    let dir = out.join("gemma2");
    edited_copy("gemma2", &dir, |c| c["query_pre_attn_scalar"] = 16.into());
    let (_, err) = round_trip("gemma2", &dir);
    assert!(err <= 1e-5, "relative L2 {err}");
    let refused = |name: &str| {
        export_gguf(
            &model_dir(name).join("model"),
            &out.join("x.gguf"),
            OutType::F32,
        )
        .unwrap_err()
        .to_string()
    };
    assert!(refused("gemma2").contains("query_pre_attn_scalar 24"));
    // This Gemma 3 alternates sliding and full layers; llama.cpp's 'gemma3' has five sliding
    // layers to each full one.
    assert!(refused("gemma3").contains("five of every six for Gemma 3"));
    std::fs::remove_dir_all(&out).ok();
}

/// Every tensor of a GGUF file, dequantized to f32, in candle's (row-major) shapes.
fn gguf_tensors(path: &std::path::Path) -> (std::collections::HashMap<String, Tensor>, Value) {
    use candle_core::quantized::gguf_file;
    let mut f = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut meta = serde_json::Map::new();
    for (k, v) in &content.metadata {
        let v = match v {
            gguf_file::Value::String(s) => Value::from(s.clone()),
            gguf_file::Value::F32(x) => Value::from(*x as f64),
            gguf_file::Value::U32(x) => Value::from(*x),
            _ => continue,
        };
        meta.insert(k.clone(), v);
    }
    let names: Vec<String> = content.tensor_infos.keys().cloned().collect();
    let tensors = names
        .into_iter()
        .map(|n| {
            let t = content
                .tensor(&mut f, &n, &Device::Cpu)
                .unwrap()
                .dequantize(&Device::Cpu)
                .unwrap();
            (n, t)
        })
        .collect();
    (tensors, Value::Object(meta))
}

/// A PEFT adapter as llama.cpp's LoRA GGUF: applied the way llama.cpp applies it (every
/// `{name}.lora_a` / `.lora_b` pair adds `alpha / r · B·A` to the base GGUF's matrix `name`), it
/// gives the GGUF of the model PEFT merges — so names, shapes, llama.cpp's q/k row order and the
/// scale (rsLoRA and alpha patterns folded into B) are all llama.cpp's.
/// (`scripts/check_gguf_export.py --adapters` runs llama.cpp itself on these files.)
#[test]
fn lora_adapter_gguf_applies_as_peft_merges() {
    use ferrotune_export::gguf::export_gguf_adapter;
    let base = model_dir("../llama3/model");
    for (case, adapter) in [
        ("llama3", common::workspace_fixture("llama3/adapter")),
        (
            "rslora_patterns",
            common::workspace_fixture("lora_variants/rslora_patterns/adapter"),
        ),
        // The token embedding and the head adapted too (PEFT's default save, with their base
        // weights beside the adapter).
        (
            "embedding",
            common::workspace_fixture("embedding_lora/llama3/adapter"),
        ),
    ] {
        let dir = out_dir(&format!("adapter-{case}"));
        let adapter_gguf = dir.join("adapter.gguf");
        let done = export_gguf_adapter(&adapter, &base, &adapter_gguf, OutType::F32).unwrap();
        assert_eq!(done.architecture, "llama");
        // The merged model, through the same export.
        let (mut model, _) = load_model(&base, DType::F32, &Device::Cpu).unwrap();
        ferrotune_models::load_adapter(&mut model, &adapter).unwrap();
        let merged_dir = dir.join("merged");
        let merged = ferrotune_models::peft::merged_tensors(&model).unwrap();
        ferrotune_models::save_hf_checkpoint(
            &merged_dir,
            &model.config,
            None,
            &merged,
            DType::F32,
            u64::MAX,
        )
        .unwrap();
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(base.join(f), merged_dir.join(f)).unwrap();
        }
        export_gguf(&base, &dir.join("base.gguf"), OutType::F32).unwrap();
        export_gguf(&merged_dir, &dir.join("merged.gguf"), OutType::F32).unwrap();
        let (base_t, _) = gguf_tensors(&dir.join("base.gguf"));
        let (merged_t, _) = gguf_tensors(&dir.join("merged.gguf"));
        let (lora, meta) = gguf_tensors(&adapter_gguf);
        assert_eq!(meta["general.type"], "adapter", "{case}");
        assert_eq!(meta["adapter.type"], "lora", "{case}");
        assert_eq!(meta["general.architecture"], "llama", "{case}");
        let alpha = meta["adapter.lora.alpha"].as_f64().unwrap();
        let mut adapted = 0;
        for (name, w) in &base_t {
            let want = &merged_t[name];
            let got = match (
                lora.get(&format!("{name}.lora_a")),
                lora.get(&format!("{name}.lora_b")),
            ) {
                (Some(a), Some(b)) if name == "token_embd.weight" => {
                    // llama.cpp looks the embedding's lora_a `[vocab, r]` up by token and
                    // multiplies by lora_b `[hidden, r]`.
                    adapted += 1;
                    let r = a.dim(1).unwrap();
                    assert_eq!(b.dim(1).unwrap(), r, "{case} {name}");
                    let delta = (a.matmul(&b.t().unwrap()).unwrap() * (alpha / r as f64)).unwrap();
                    (w + delta).unwrap()
                }
                (Some(a), Some(b)) => {
                    adapted += 1;
                    let r = a.dim(0).unwrap();
                    assert_eq!(b.dim(1).unwrap(), r, "{case} {name}");
                    let delta = (b.matmul(a).unwrap() * (alpha / r as f64)).unwrap();
                    (w + delta).unwrap()
                }
                _ => w.clone(),
            };
            let err = common::rel_l2(&got, want);
            assert!(err <= 1e-6, "{case}: {name}: relative L2 {err}");
        }
        assert_eq!(
            adapted * 2,
            lora.len(),
            "{case}: every pair names a base matrix"
        );
        assert!(adapted > 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
