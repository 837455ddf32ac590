//! Bad checkpoints give one clear error naming the file and the problem, never a panic.

use std::path::Path;

use candle_core::{DType, Device};
use ferrotune_models::load_model;

fn fixture_model() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llama3/model")
}

fn copy_model(to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture_model().join(f), to.join(f)).unwrap();
    }
}

fn load_err(path: &Path) -> String {
    match load_model(path, DType::F32, &Device::Cpu) {
        Ok(_) => panic!("{} loaded but should not", path.display()),
        Err(e) => e.to_string(),
    }
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ferrotune-errors-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn missing_path() {
    let err = load_err(Path::new("/nonexistent/model"));
    assert!(
        err.contains("/nonexistent/model") && err.contains("no such file"),
        "{err}"
    );
}

#[test]
fn truncated_safetensors() {
    let d = tmp("trunc");
    copy_model(&d);
    let f = d.join("model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_err(&d);
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn corrupt_safetensors_header() {
    let d = tmp("corrupt");
    copy_model(&d);
    std::fs::write(
        d.join("model.safetensors"),
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all",
    )
    .unwrap();
    let err = load_err(&d);
    assert!(
        err.contains("model.safetensors") && err.contains("safetensors"),
        "{err}"
    );
}

#[test]
fn corrupt_config() {
    let d = tmp("config");
    copy_model(&d);
    std::fs::write(d.join("config.json"), "{\"model_type\": \"llama\",").unwrap();
    let err = load_err(&d);
    assert!(
        err.contains("config.json") && err.contains("invalid JSON"),
        "{err}"
    );
}

#[test]
fn unsupported_model_type() {
    let d = tmp("arch");
    copy_model(&d);
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("\"llama\"", "\"bloom\"");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    let err = load_err(&d);
    assert!(
        err.contains("bloom") && err.contains("supported model types"),
        "{err}"
    );
}

#[test]
fn wrong_shape_names_the_tensor() {
    let d = tmp("shape");
    copy_model(&d);
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("\"intermediate_size\": 160", "\"intermediate_size\": 161");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    let err = load_err(&d);
    assert!(err.contains("gate_proj") && err.contains("shape"), "{err}");
}

#[test]
fn missing_shard() {
    let d = tmp("shard");
    copy_model(&d);
    std::fs::write(
        d.join("model.safetensors.index.json"),
        r#"{"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let err = load_err(&d);
    assert!(
        err.contains("model-00002-of-00002.safetensors") && err.contains("missing"),
        "{err}"
    );
}

#[test]
fn index_naming_files_outside_the_model_folder_is_refused() {
    let d = tmp("index-escape");
    copy_model(&d);
    // A real file outside the folder (the model's own weights, one level up): an index naming it
    // by an absolute path or through `..` must not get it read.
    let outside = d.parent().unwrap().join(format!(
        "ferrotune-index-escape-{}.safetensors",
        std::process::id()
    ));
    std::fs::copy(d.join("model.safetensors"), &outside).unwrap();
    let relative = format!("../{}", outside.file_name().unwrap().to_str().unwrap());
    for named in [outside.to_str().unwrap(), relative.as_str()] {
        let index = serde_json::json!({"weight_map": {"model.norm.weight": named}});
        std::fs::write(d.join("model.safetensors.index.json"), index.to_string()).unwrap();
        let err = load_err(&d);
        assert!(
            err.contains("model.safetensors.index.json")
                && err.contains("not a file inside the model folder"),
            "{named}: {err}"
        );
    }
    std::fs::remove_file(&outside).unwrap();
}

fn pickle_fixture(case: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(case)
        .join("model")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

#[test]
fn bad_pytorch_checkpoints() {
    // Not a torch.save zip (a pre-1.6 pickle or anything else): named, with what is expected.
    let d = tmp("legacy-bin");
    copy_dir(&pickle_fixture("llama2_bin"), &d);
    std::fs::remove_file(d.join("pytorch_model.bin.index.json")).unwrap();
    for f in std::fs::read_dir(&d).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|e| e == "bin") {
            std::fs::remove_file(p).unwrap();
        }
    }
    std::fs::write(d.join("pytorch_model.bin"), b"\x80\x02legacy pickle").unwrap();
    let err = load_err(&d);
    assert!(
        err.contains("pytorch_model.bin") && err.contains("torch.save"),
        "{err}"
    );

    // A shard the index lists is missing.
    let d = tmp("missing-shard");
    copy_dir(&pickle_fixture("llama2_bin"), &d);
    std::fs::remove_file(d.join("pytorch_model-00002-of-00002.bin")).unwrap();
    let err = load_err(&d);
    assert!(
        err.contains("pytorch_model-00002-of-00002.bin") && err.contains("missing"),
        "{err}"
    );

    // Pickles with neither config.json nor params.json: no way to know the model.
    let d = tmp("no-config");
    copy_dir(&pickle_fixture("llama2_bin"), &d);
    std::fs::remove_file(d.join("config.json")).unwrap();
    let err = load_err(&d.join("pytorch_model-00001-of-00002.bin"));
    assert!(
        err.contains("config.json") && err.contains("params.json"),
        "{err}"
    );

    // Meta's model-parallel shards (70B ships eight): refused, not half-loaded.
    let d = tmp("meta-shards");
    copy_dir(&pickle_fixture("llama2_meta"), &d);
    std::fs::copy(d.join("consolidated.00.pth"), d.join("consolidated.01.pth")).unwrap();
    let err = load_err(&d);
    assert!(err.contains("2 Meta checkpoint files"), "{err}");

    // params.json disagreeing with the weights.
    let d = tmp("meta-params");
    copy_dir(&pickle_fixture("llama2_meta"), &d);
    let path = d.join("params.json");
    let mut params: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    params["n_layers"] = 3.into();
    std::fs::write(&path, params.to_string()).unwrap();
    let err = load_err(&d);
    assert!(
        err.contains("consolidated.00.pth") && err.contains("3 layers"),
        "{err}"
    );
}

/// Gemma 4 configurations ferrotune does not run are refused with the key and the reason: a
/// mixture-of-experts block without its sizes, bidirectional attention, `per_layer_config` overrides other than the
/// head size and key/value heads, and KV sharing with no unshared layer of a type.
#[test]
fn gemma4_configs_it_cannot_run_are_refused_by_key() {
    use ferrotune_models::ModelConfig;
    let base: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures/models/gemma4_e2b_like/model/config.json"),
        )
        .unwrap(),
    )
    .unwrap();
    assert!(ModelConfig::from_hf_json(&base).is_ok());
    let refused = |edit: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>)| -> String {
        let mut cfg = base.clone();
        edit(cfg.as_object_mut().unwrap());
        ModelConfig::from_hf_json(&cfg).expect_err("should be refused")
    };
    let err = refused(&|c| {
        c.insert("use_bidirectional_attention".into(), "all".into());
    });
    assert!(err.contains("use_bidirectional_attention"), "{err}");
    let err = refused(&|c| {
        c.insert(
            "per_layer_config".into(),
            serde_json::json!({"1": {"intermediate_size": 64}}),
        );
    });
    assert!(
        err.contains("per_layer_config.1") && err.contains("intermediate_size"),
        "{err}"
    );
    // Layers 0..3 unshared hold no full-attention layer when layer 1 is sliding too.
    let err = refused(&|c| {
        c.remove("per_layer_config");
        c.insert("num_kv_shared_layers".into(), 2.into());
        c.insert(
            "layer_types".into(),
            serde_json::json!([
                "sliding_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "full_attention"
            ]),
        );
    });
    assert!(err.contains("num_kv_shared_layers"), "{err}");
    // The MoE block needs its sizes, and no more experts per token than there are.
    let err = refused(&|c| {
        c.insert("enable_moe_block".into(), true.into());
        c.insert("num_experts".into(), 4.into());
        c.insert("moe_intermediate_size".into(), 16.into());
    });
    assert!(err.contains("top_k_experts"), "{err}");
    let err = refused(&|c| {
        c.insert("enable_moe_block".into(), true.into());
        c.insert("num_experts".into(), 4.into());
        c.insert("top_k_experts".into(), 5.into());
        c.insert("moe_intermediate_size".into(), 16.into());
    });
    assert!(
        err.contains("top_k_experts") && err.contains("num_experts"),
        "{err}"
    );
}

/// A Gemma 4 model whose layers read per-layer embeddings or share keys and values runs whole:
/// one layer alone, or a spread over devices, is refused with the reason (the recipes then keep
/// the whole graph instead of checkpointing layer by layer).
#[test]
fn gemma4_layers_that_depend_on_each_other_do_not_run_alone() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models/gemma4_e2b_like/model");
    let (model, _) = load_model(&dir, DType::F32, &Device::Cpu).unwrap();
    let why = model
        .layers_not_separable()
        .expect("E-model layers are not separable");
    assert!(
        why.contains("per-layer embeddings") && why.contains("shared"),
        "{why}"
    );
    let inputs = model
        .layer_inputs(&ferrotune_models::AttentionLayout::causal(1, 2, 0))
        .unwrap();
    let x = candle_core::Tensor::zeros((1, 2, model.config.hidden_size), DType::F32, &Device::Cpu)
        .unwrap();
    let err = model.layer(0, &x, &inputs).unwrap_err().to_string();
    assert!(err.contains("do not run one at a time"), "{err}");
    // The dense shape's layers stand alone.
    let dense = dir.join("../../gemma4/model");
    let (model, _) = load_model(&dense, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(model.layers_not_separable(), None);
}

/// A `config.json` holding an array says that its top level must be an object, naming it.
#[test]
fn config_json_that_is_not_an_object() {
    let dir = tmp("array-config");
    copy_model(&dir);
    std::fs::write(dir.join("config.json"), "[]").unwrap();
    let err = load_err(&dir);
    assert!(
        err.contains("config.json")
            && err.contains("top level must be a JSON object, found an array"),
        "{err}"
    );
}

/// A layer count beyond the checkpoint's (issue 44: `num_hidden_layers: 1000000000` aborted
/// allocating 1.2 TB) is an error naming the key, before anything is allocated for the layers.
#[test]
fn layer_count_beyond_the_checkpoint_is_refused() {
    for (layers, held) in [("1000000000", false), ("5", true)] {
        let d = tmp(&format!("layers-{layers}"));
        copy_model(&d);
        let cfg = std::fs::read_to_string(d.join("config.json"))
            .unwrap()
            .replace(
                "\"num_hidden_layers\": 2",
                &format!("\"num_hidden_layers\": {layers}"),
            );
        std::fs::write(d.join("config.json"), cfg).unwrap();
        let err = load_err(&d);
        assert!(
            err.contains("num_hidden_layers") && err.contains(layers),
            "{err}"
        );
        // Five layers always reach the checkpoint check; a billion may be refused first, by
        // the machine check, depending on the machine's memory.
        if held {
            assert!(err.contains("2 layers (0 to 1)"), "{err}");
        }
    }

    // Meta's params.json likewise, without counting a billion layers one by one.
    let d = tmp("meta-layers");
    copy_dir(&pickle_fixture("llama2_meta"), &d);
    let path = d.join("params.json");
    let mut params: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    params["n_layers"] = 1_000_000_000u64.into();
    std::fs::write(&path, params.to_string()).unwrap();
    let err = load_err(&d);
    assert!(err.contains("1000000000"), "{err}");
}
