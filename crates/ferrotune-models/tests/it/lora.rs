//! LoRA/DoRA against HF PEFT 0.21: logits, loss and gradients with an adapter, merged weights and
//! logits, PEFT-format save/load, config errors, rsLoRA, rank/alpha patterns, lm_head adapters and
//! layers_to_transform (fixtures: tests/fixtures/README.md and scripts/make_lora_fixtures.py).

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use ferrotune_models::lora::set_training;
use ferrotune_models::peft::{
    adapter_tensors, add_adapter, merge_and_unload, merged_tensors, trainable_parameters,
    ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE,
};
use ferrotune_models::{
    load_adapter, load_model, save_adapter, AttentionLayout, CausalLm, LoraConfig, TargetModules,
};
use serde_json::Value;

use common::{causal_lm_loss, fixtures, max_abs_diff, rel_l2};

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn tensors(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn rows_tensor<T: serde::de::DeserializeOwned + candle_core::WithDType>(rows: &Value) -> Tensor {
    let rows: Vec<Vec<T>> = serde_json::from_value(rows.clone()).unwrap();
    let (b, t) = (rows.len(), rows[0].len());
    Tensor::from_vec(rows.concat(), (b, t), &Device::Cpu).unwrap()
}

fn base_model(family: &str) -> CausalLm {
    load_model_at(&fixtures().join(family).join("model"))
}

fn load_model_at(dir: &Path) -> CausalLm {
    load_model(dir, DType::F32, &Device::Cpu).unwrap().0
}

/// One adapter fixture: where the adapter lives and where its references are.
struct Case {
    /// The base model's folder.
    base: PathBuf,
    /// The JSON file with the `input_ids` and `labels` the references were computed on.
    inputs: PathBuf,
    /// Folder holding `adapter/`, `golden.json` (`lora_loss`), `golden.safetensors`
    /// (`lora_logits`) and `lora_grads.safetensors`.
    dir: PathBuf,
}

impl Case {
    fn new(family: &'static str, sub: &str) -> Self {
        Self {
            base: fixtures().join(family).join("model"),
            inputs: fixtures().join(family).join("golden.json"),
            dir: fixtures().join(sub),
        }
    }

    /// A case of tests/fixtures/embedding_lora: its golden.json names the base and holds the
    /// inputs (with the pad token among them).
    fn embedding(name: &str) -> Self {
        Self::made_with_base(fixtures().join("embedding_lora").join(name))
    }

    /// A case of tests/fixtures/lora_bias (the same layout as embedding_lora's).
    fn lora_bias(name: &str) -> Self {
        Self::made_with_base(fixtures().join("lora_bias").join(name))
    }

    /// A case of tests/fixtures/target_parameters (the same layout as embedding_lora's).
    fn target_parameters(name: &str) -> Self {
        Self::made_with_base(fixtures().join("target_parameters").join(name))
    }

    /// A case whose golden.json names its base model and holds its inputs.
    fn made_with_base(dir: PathBuf) -> Self {
        let g = read_json(&dir.join("golden.json"));
        Self {
            base: fixtures().join(g["base"].as_str().unwrap()),
            inputs: dir.join("golden.json"),
            dir,
        }
    }

    fn inputs(&self) -> (Tensor, Value) {
        let g = read_json(&self.inputs);
        (rows_tensor::<u32>(&g["input_ids"]), g["labels"].clone())
    }

    /// `model` gives the case's reference logits with the adapter (`lora_logits`) to 1e-4:
    /// what the adapter runs, and what its merge must keep. Returns the logits.
    fn assert_adapter_logits(&self, model: &CausalLm, what: &str) -> Tensor {
        let (ids, _) = self.inputs();
        let (b, t) = ids.dims2().unwrap();
        let logits = model
            .forward(&ids, &AttentionLayout::causal(b, t, 0), None)
            .unwrap();
        let golden = tensors(&self.dir.join("golden.safetensors"));
        let err = max_abs_diff(&logits, &golden["lora_logits"]);
        assert!(
            err <= 1e-4,
            "{} {what}: logits max abs error {err}",
            self.dir.display()
        );
        logits
    }

    /// `model` with its adapter gives PEFT's logits in inference and in training mode, and
    /// PEFT's loss (1e-5 relative); it is left in inference mode.
    fn assert_runs_as_peft(&self, model: &mut CausalLm) {
        self.assert_adapter_logits(model, "inference");
        set_training(model, true);
        let logits = self.assert_adapter_logits(model, "training");
        let (_, labels) = self.inputs();
        let loss = causal_lm_loss(&logits, &labels).to_scalar::<f32>().unwrap() as f64;
        let want = read_json(&self.dir.join("golden.json"))["lora_loss"]
            .as_f64()
            .unwrap();
        assert!(
            ((loss - want) / want).abs() <= 1e-5,
            "{}: loss {loss} vs {want}",
            self.dir.display()
        );
        set_training(model, false);
    }

    /// `model`'s merged weights are PEFT's `merge_and_unload` state dict (`merged.safetensors`):
    /// the same tensors, each to 1e-5.
    fn assert_merges_as_peft(&self, model: &CausalLm) {
        let merged = merged_tensors(model).unwrap();
        let want = tensors(&self.dir.join("merged.safetensors"));
        let at = format!("{}: merged", self.dir.display());
        assert_same_tensors(&merged, &want, 1e-5, &at);
    }

    fn model_with_adapter(&self) -> (CausalLm, LoraConfig) {
        let mut model = load_model_at(&self.base);
        let config = load_adapter(&mut model, &self.dir.join("adapter"))
            .unwrap_or_else(|e| panic!("{}: {e}", self.dir.display()));
        (model, config)
    }

    /// Logits ≤ 1e-4, loss ≤ 1e-5 relative, every gradient ≤ 1e-4 relative L2.
    fn check_forward_and_gradients(&self) {
        self.check_forward_and_gradients_to(1e-4);
    }

    /// As [`Case::check_forward_and_gradients`], every gradient to `grad_tol` relative L2.
    fn check_forward_and_gradients_to(&self, grad_tol: f32) {
        let (mut model, _) = self.model_with_adapter();
        let (_, labels) = self.inputs();
        let params = trainable_parameters(&mut model).unwrap();
        set_training(&mut model, true);
        let logits = self.assert_adapter_logits(&model, "training");

        let loss = causal_lm_loss(&logits, &labels);
        let want = read_json(&self.dir.join("golden.json"))["lora_loss"]
            .as_f64()
            .unwrap();
        let got = loss.to_scalar::<f32>().unwrap() as f64;
        assert!(
            ((got - want) / want).abs() <= 1e-5,
            "{}: lora loss {got} vs {want}",
            self.dir.display()
        );

        let grads = loss.backward().unwrap();
        // A vision-language model's adapter names its text model `model.language_model.*`.
        let want: HashMap<String, Tensor> = tensors(&self.dir.join("lora_grads.safetensors"))
            .into_iter()
            .map(|(k, v)| (in_text_model(&model.config, &k), v))
            .collect();
        let mut names: Vec<&String> = params.iter().map(|(n, _)| n).collect();
        names.sort();
        let mut want_names: Vec<&String> = want.keys().collect();
        want_names.sort();
        assert_eq!(names, want_names, "{}: parameter names", self.dir.display());
        for (name, var) in &params {
            let g = grads
                .get(var)
                .unwrap_or_else(|| panic!("{name}: no gradient"));
            let err = rel_l2(g, &want[name]);
            assert!(err <= grad_tol, "{name}: gradient relative L2 error {err}");
        }
    }
}

/// A PEFT name of the whole multimodal model's module as ferrotune's text model names it
/// (`base_model.model.model.language_model.layers.0...` → `base_model.model.model.layers.0...`;
/// Llama 3.2 Vision's layers renumbered past its cross-attention layers).
fn in_text_model(config: &ferrotune_models::ModelConfig, name: &str) -> String {
    let rest = name.strip_prefix("base_model.model.").unwrap_or(name);
    let text = config.text_model_name(rest).unwrap_or_else(|| rest.into());
    format!("base_model.model.{text}")
}

/// PEFT adapters trained on whole vision-language models (Qwen2.5-VL, Qwen3-VL with rsLoRA,
/// Llama 3.2 Vision, Llama 4; tests/fixtures/vl_lora) run on their text model: PEFT's logits, loss and
/// gradients; the adapters PEFT put on the vision tower and on Llama 3.2 Vision's
/// cross-attention layers (names that reach them too) are left out; merging gives PEFT's merged
/// text weights (Llama 3.2 Vision's embedding without its image-token rows).
#[test]
fn vision_language_adapters_run_on_the_text_model() {
    for name in ["qwen2_5_vl", "qwen3_vl", "mllama", "llama4"] {
        let case = Case::made_with_base(fixtures().join("vl_lora").join(name));
        case.check_forward_and_gradients();
        let (mut model, _) = case.model_with_adapter();
        assert!(model.config.text_of_multimodal, "{name}");
        merge_and_unload(&mut model).unwrap();
        case.assert_adapter_logits(&model, "merged");
        let got = merged_tensors(&model).unwrap();
        let want: HashMap<String, Tensor> = tensors(&case.dir.join("merged.safetensors"))
            .into_iter()
            .filter_map(|(k, v)| {
                // A merged model is saved in the checkpoint's layout: Llama 4's names and fused
                // experts stay as they are, other text models take the decoder's names.
                let k = if model.config.llama4_names {
                    ferrotune_models::checkpoint::text_model_tensor(&k)?
                } else {
                    model.config.text_model_name(&k)?
                };
                let rows = got[&k].dim(0).unwrap();
                Some((k, v.narrow(0, 0, rows).unwrap()))
            })
            .collect();
        assert_same_tensors(&got, &want, 1e-5, &format!("{name}: merged"));
    }
}

#[test]
fn llama3_lora_logits_loss_and_gradients() {
    Case::new("llama3", "llama3").check_forward_and_gradients();
}

#[test]
fn qwen2_lora_logits_loss_and_gradients() {
    Case::new("qwen2", "qwen2").check_forward_and_gradients();
}

#[test]
fn llama3_dora_logits_loss_and_gradients() {
    Case::new("llama3", "llama3/variants/dora").check_forward_and_gradients();
}

#[test]
fn rslora_with_regex_targets_and_rank_alpha_patterns() {
    let case = Case::new("llama3", "lora_variants/rslora_patterns");
    let (model, config) = case.model_with_adapter();
    assert!(config.use_rslora);
    assert_eq!(
        config.target_modules,
        TargetModules::Regex(r".*\.(q_proj|v_proj|down_proj)".into())
    );
    // q_proj: rank 2 from rank_pattern; layer 1 down_proj: rank 6, alpha 5 from "down_proj";
    // layer 0 v_proj: alpha 3 from the escaped full-name pattern.
    let ranks: HashMap<String, (usize, f64)> = model
        .linears()
        .into_iter()
        .filter_map(|(n, l)| l.adapter.as_ref().map(|a| (n, (a.rank(), a.scale))))
        .collect();
    assert_eq!(ranks.len(), 6);
    assert_eq!(
        ranks["model.layers.0.self_attn.q_proj"],
        (2, 8.0 / 2f64.sqrt())
    );
    assert_eq!(
        ranks["model.layers.1.mlp.down_proj"],
        (6, 5.0 / 6f64.sqrt())
    );
    assert_eq!(ranks["model.layers.0.mlp.down_proj"], (4, 5.0 / 2.0));
    assert_eq!(ranks["model.layers.0.self_attn.v_proj"], (4, 3.0 / 2.0));
    assert_eq!(ranks["model.layers.1.self_attn.v_proj"], (4, 8.0 / 2.0));
    case.check_forward_and_gradients();
}

#[test]
fn lm_head_adapter() {
    Case::new("llama3", "lora_variants/lm_head").check_forward_and_gradients();
}

/// The names of `model`'s linear layers that carry an adapter, in the model's order.
fn adapted_layers(model: &CausalLm) -> Vec<String> {
    model
        .linears()
        .into_iter()
        .filter(|(_, l)| l.adapter.is_some())
        .map(|(n, _)| n)
        .collect()
}

#[test]
fn layers_to_transform_limits_the_adapted_layers() {
    let case = Case::new("llama3", "lora_variants/layers_to_transform");
    let (model, _) = case.model_with_adapter();
    let adapted = adapted_layers(&model);
    assert_eq!(
        adapted,
        [
            "model.layers.1.self_attn.q_proj",
            "model.layers.1.mlp.up_proj"
        ]
    );
    case.check_forward_and_gradients();
}

/// Merged weights equal PEFT's `merge_and_unload()` checkpoint; the merged model's logits equal
/// transformers' on it.
fn check_merge(family: &'static str) {
    let case = Case::new(family, family);
    let (model, _) = case.model_with_adapter();
    let merged = merged_tensors(&model).unwrap();
    let want = tensors(&fixtures().join(family).join("merged/model.safetensors"));
    let mut got_names: Vec<&String> = merged.keys().collect();
    got_names.sort();
    let mut want_names: Vec<&String> = want.keys().collect();
    want_names.sort();
    assert_eq!(got_names, want_names);
    for (name, w) in &want {
        let err = max_abs_diff(&merged[name], w);
        assert!(err <= 1e-5, "{family}: merged '{name}' max abs error {err}");
    }
    let mut model = model;
    merge_and_unload(&mut model).unwrap();
    assert!(model.linears().iter().all(|(_, l)| l.adapter.is_none()));
    let (ids, _) = case.inputs();
    let (b, t) = ids.dims2().unwrap();
    let logits = model
        .forward(&ids, &AttentionLayout::causal(b, t, 0), None)
        .unwrap();
    let golden = tensors(&fixtures().join(family).join("golden.safetensors"));
    let err = max_abs_diff(&logits, &golden["merged_logits"]);
    assert!(err <= 1e-4, "{family}: merged logits max abs error {err}");
}

#[test]
fn llama3_merge_matches_peft() {
    check_merge("llama3");
}

#[test]
fn qwen2_merge_matches_peft() {
    check_merge("qwen2");
}

/// DoRA merging (PEFT's formula) gives the same model as the unmerged adapter.
#[test]
fn dora_merge_preserves_the_logits() {
    let case = Case::new("llama3", "llama3/variants/dora");
    let (mut model, _) = case.model_with_adapter();
    merge_and_unload(&mut model).unwrap();
    case.assert_adapter_logits(&model, "merged");
}

/// A family's golden batch: its golden.json (labels), the input ids, their causal layout and the
/// transformers references (golden.safetensors).
struct Golden {
    json: Value,
    ids: Tensor,
    layout: AttentionLayout,
    tensors: HashMap<String, Tensor>,
}

fn golden(family: &str) -> Golden {
    let json = read_json(&fixtures().join(family).join("golden.json"));
    let ids = rows_tensor::<u32>(&json["input_ids"]);
    let (b, t) = ids.dims2().unwrap();
    Golden {
        json,
        ids,
        layout: AttentionLayout::causal(b, t, 0),
        tensors: tensors(&fixtures().join(family).join("golden.safetensors")),
    }
}

/// Saves `model`'s adapter under `config` into a fresh folder and checks that it holds the
/// tensors of PEFT's own file in `peft_dir`, under the same names and with the same values;
/// returns the folder (the caller removes it).
fn assert_saves_as_peft(
    model: &CausalLm,
    config: &LoraConfig,
    peft_dir: &Path,
    label: &str,
) -> PathBuf {
    let dir = temp_dir(&format!("saved-{}", label.replace('/', "_")));
    save_adapter(model, config, &dir).unwrap();
    let saved = tensors(&dir.join(ADAPTER_WEIGHTS_FILE));
    let orig = tensors(&peft_dir.join(ADAPTER_WEIGHTS_FILE));
    assert_same_tensors(&saved, &orig, 0.0, label);
    dir
}

/// `got` holds exactly `want`'s tensor names, each within `tol` (max abs) of `want`'s.
fn assert_same_tensors(
    got: &HashMap<String, Tensor>,
    want: &HashMap<String, Tensor>,
    tol: f32,
    label: &str,
) {
    let mut names: Vec<&String> = got.keys().collect();
    names.sort();
    let mut want_names: Vec<&String> = want.keys().collect();
    want_names.sort();
    assert_eq!(names, want_names, "{label}");
    for (key, w) in want {
        let err = max_abs_diff(&got[key], w);
        assert!(err <= tol, "{label}: '{key}' max abs error {err}");
    }
}

fn temp_dir(name: &str) -> PathBuf {
    ferrotune_testing::fresh_dir(&format!("ferrotune-lora-{}-{name}", std::process::id()))
}

#[test]
fn save_then_load_round_trips_in_peft_format() {
    for sub in [
        "llama3",
        "llama3/variants/dora",
        "lora_variants/rslora_patterns",
    ] {
        let case = Case::new("llama3", sub);
        let (model, config) = case.model_with_adapter();
        // The same tensors PEFT wrote, with PEFT's metadata.
        let dir = assert_saves_as_peft(&model, &config, &case.dir.join("adapter"), sub);
        let bytes = std::fs::read(dir.join(ADAPTER_WEIGHTS_FILE)).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(
            meta.metadata()
                .as_ref()
                .and_then(|m| m.get("format"))
                .map(String::as_str),
            Some("pt")
        );
        let json = read_json(&dir.join(ADAPTER_CONFIG_FILE));
        assert_eq!(json["peft_type"], "LORA");
        assert_eq!(json["task_type"], "CAUSAL_LM");
        assert_eq!(json["bias"], "none");
        // Every key PEFT wrote is present, with the same value for the ones that matter.
        let orig_json = read_json(&case.dir.join("adapter").join(ADAPTER_CONFIG_FILE));
        for (k, v) in orig_json.as_object().unwrap() {
            assert!(json.get(k).is_some(), "{sub}: saved config lacks '{k}'");
            if [
                "r",
                "lora_alpha",
                "use_rslora",
                "use_dora",
                "rank_pattern",
                "alpha_pattern",
                "lora_dropout",
                "layers_to_transform",
                "peft_type",
                "task_type",
            ]
            .contains(&k.as_str())
            {
                assert_eq!(&json[k], v, "{sub}: '{k}'");
            }
        }

        let mut reloaded = base_model("llama3");
        let config2 = load_adapter(&mut reloaded, &dir).unwrap();
        assert_eq!(config2, config);
        let a = adapter_tensors(&model);
        let b = adapter_tensors(&reloaded);
        assert_eq!(a.len(), b.len());
        for (k, t) in &a {
            assert_eq!(max_abs_diff(t, &b[k]), 0.0, "{sub}: {k}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Writes an adapter folder with the fixture's weights and a modified config.
fn adapter_with_config(
    name: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, Value>),
) -> PathBuf {
    copy_adapter_with_config(&fixtures().join("llama3/adapter"), name, edit)
}

/// A copy of the adapter folder `src` in a fresh folder `name`, its config edited by `edit`.
fn copy_adapter_with_config(
    src: &Path,
    name: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, Value>),
) -> PathBuf {
    let dir = temp_dir(name);
    std::fs::copy(
        src.join(ADAPTER_WEIGHTS_FILE),
        dir.join(ADAPTER_WEIGHTS_FILE),
    )
    .unwrap();
    let mut json = read_json(&src.join(ADAPTER_CONFIG_FILE));
    edit(json.as_object_mut().unwrap());
    std::fs::write(dir.join(ADAPTER_CONFIG_FILE), json.to_string()).unwrap();
    dir
}

#[test]
fn unsupported_configs_are_clear_errors() {
    let cases: [(&str, &str, Value, &[&str]); 3] = [
        ("ia3", "peft_type", Value::from("IA3"), &["IA3", "LORA"]),
        ("bias", "bias", Value::from("all"), &["bias", "all"]),
        (
            "dora_missing",
            "use_dora",
            Value::from(true),
            &["lora_magnitude_vector"],
        ),
    ];
    for (name, key, value, needles) in cases {
        let dir = adapter_with_config(name, |m| {
            m.insert(key.to_string(), value);
        });
        let mut model = base_model("llama3");
        let err = load_adapter(&mut model, &dir).unwrap_err().to_string();
        for n in needles {
            assert!(
                err.contains(n),
                "{name}: error '{err}' should mention '{n}'"
            );
        }
        if key != "use_dora" {
            assert!(
                err.contains(ADAPTER_CONFIG_FILE),
                "{name}: '{err}' should name the file"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn missing_unexpected_and_misshaped_tensors_are_named() {
    let src = fixtures().join("llama3/adapter");
    let orig = tensors(&src.join(ADAPTER_WEIGHTS_FILE));
    let key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight";
    let write = |name: &str, map: &HashMap<String, Tensor>| {
        let dir = temp_dir(name);
        std::fs::copy(src.join(ADAPTER_CONFIG_FILE), dir.join(ADAPTER_CONFIG_FILE)).unwrap();
        candle_core::safetensors::save(map, dir.join(ADAPTER_WEIGHTS_FILE)).unwrap();
        dir
    };
    let load_err = |dir: &Path| {
        let mut model = base_model("llama3");
        load_adapter(&mut model, dir).unwrap_err().to_string()
    };

    let mut missing = orig.clone();
    missing.remove(key);
    let dir = write("missing", &missing);
    let err = load_err(&dir);
    assert!(err.contains(key) && err.contains("missing"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);

    let mut extra = orig.clone();
    let stray = "base_model.model.model.embed_tokens.lora_A.weight";
    extra.insert(
        stray.into(),
        Tensor::zeros((4, 64), DType::F32, &Device::Cpu).unwrap(),
    );
    let dir = write("extra", &extra);
    let err = load_err(&dir);
    assert!(err.contains(stray) && err.contains("unexpected"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);

    let mut shaped = orig.clone();
    shaped.insert(
        key.into(),
        Tensor::zeros((160, 3), DType::F32, &Device::Cpu).unwrap(),
    );
    let dir = write("shape", &shaped);
    let err = load_err(&dir);
    assert!(err.contains(key) && err.contains("[160, 3]"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Fresh adapters start as the base model (B = 0; DoRA magnitude = weight norms), train only
/// A/B(/magnitude), and save as a folder that loads back.
#[test]
fn fresh_adapters_start_as_the_base_model() {
    let batch = golden("llama3");
    let (g, ids, layout, golden) = (batch.json, batch.ids, batch.layout, batch.tensors);
    let names: Vec<String> = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "lm_head",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for use_dora in [false, true] {
        let mut config = LoraConfig::new(4, 8.0, TargetModules::Names(names.clone()));
        config.use_dora = use_dora;
        let mut model = base_model("llama3");
        assert_eq!(add_adapter(&mut model, &config, 42).unwrap(), 15);
        let params = trainable_parameters(&mut model).unwrap();
        assert_eq!(params.len(), 15 * if use_dora { 3 } else { 2 });
        let logits = model.forward(&ids, &layout, None).unwrap();
        let err = max_abs_diff(&logits, &golden["logits"]);
        assert!(
            err <= 1e-4,
            "fresh adapter (DoRA {use_dora}) changed logits by {err}"
        );
        let loss = causal_lm_loss(&logits, &g["labels"]);
        let grads = loss.backward().unwrap();
        // B gets a gradient (A does not yet, since B = 0 blocks it), base weights get none.
        let (_, b_var) = params
            .iter()
            .find(|(n, _)| n.ends_with("q_proj.lora_B.weight"))
            .unwrap();
        assert!(rel_l2(grads.get(b_var).unwrap(), &b_var.zeros_like().unwrap()) > 0.0);
        let (_, down) = model.layers[0]
            .linears()
            .into_iter()
            .find(|(n, _)| n == "mlp.down_proj")
            .unwrap();
        assert!(grads.get(down.weight.as_dense().unwrap()).is_none());
        let dir = temp_dir(&format!("fresh{use_dora}"));
        save_adapter(&model, &config, &dir).unwrap();
        let mut reloaded = base_model("llama3");
        load_adapter(&mut reloaded, &dir).unwrap();
        assert_eq!(adapter_tensors(&reloaded).len(), params.len());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Dropout acts only in training mode: in inference the adapter with `lora_dropout > 0` gives
/// PEFT's logits; in training the output changes but stays finite and gradients still reach A, B
/// and the DoRA magnitude.
#[test]
fn dropout_only_in_training() {
    for sub in ["llama3", "llama3/variants/dora"] {
        let case = Case::new("llama3", sub);
        let (mut model, _) = case.model_with_adapter();
        for (_, linear) in model.linears_mut() {
            if let Some(adapter) = &mut linear.adapter {
                adapter.dropout = 0.5;
            }
        }
        let (ids, labels) = case.inputs();
        let (b, t) = ids.dims2().unwrap();
        let layout = AttentionLayout::causal(b, t, 0);
        let golden = tensors(&case.dir.join("golden.safetensors"));
        let logits = model.forward(&ids, &layout, None).unwrap();
        assert!(
            max_abs_diff(&logits, &golden["lora_logits"]) <= 1e-4,
            "{sub}"
        );
        let params = trainable_parameters(&mut model).unwrap();
        set_training(&mut model, true);
        let logits = model.forward(&ids, &layout, None).unwrap();
        let diff = max_abs_diff(&logits, &golden["lora_logits"]);
        assert!(
            diff > 1e-3 && diff.is_finite(),
            "{sub}: dropout changed logits by {diff}"
        );
        let grads = causal_lm_loss(&logits, &labels).backward().unwrap();
        for (name, var) in &params {
            assert!(grads.get(var).is_some(), "{sub}: {name} has no gradient");
        }
    }
}

/// The adapter cases on the token embedding (tests/fixtures/embedding_lora).
const EMBEDDING_CASES: [&str; 7] = [
    "llama3",
    "llama3_dora",
    "llama3_regex_rslora",
    "qwen2_tied",
    "gemma",
    "gemma3_dora",
    "olmo2",
];

/// Adapters on `embed_tokens` (LoRA, DoRA, rsLoRA with a regex target; Gemma's scaled
/// embeddings; heads tied to the embedding; OLMo 2's every projection beside it) give PEFT's
/// logits, loss and gradients, the pad token's column of `lora_embedding_A` included (PEFT's
/// lookup keeps it out of the gradient).
#[test]
fn embedding_adapters_match_peft() {
    for name in EMBEDDING_CASES {
        let case = Case::embedding(name);
        let (model, _) = case.model_with_adapter();
        assert!(model.embed_adapter.is_some(), "{name}");
        case.check_forward_and_gradients();
    }
}

/// Merging an embedding adapter: PEFT's merged weights where PEFT's merge keeps the outputs;
/// where the head is tied to the embedding (PEFT's merge then changes the head too, and the
/// outputs), the merge unties the head, which keeps the base weights, so the merged model gives
/// the adapter's outputs. The merged model runs as the adapter does either way.
#[test]
fn embedding_adapters_merge() {
    for name in EMBEDDING_CASES {
        let case = Case::embedding(name);
        let (model, _) = case.model_with_adapter();
        let g = read_json(&case.dir.join("golden.json"));
        let merged = merged_tensors(&model).unwrap();
        let want = tensors(&case.dir.join("merged.safetensors"));
        let peft_merge_equal = g["merged_equals_adapter"].as_bool().unwrap();
        let head_adapted = model.lm_head.adapter.is_some();
        for (key, w) in &want {
            if !peft_merge_equal && head_adapted && key == "model.embed_tokens.weight" {
                // PEFT adds the head's delta to the shared weight too.
                continue;
            }
            let err = max_abs_diff(&merged[key], w);
            assert!(err <= 1e-5, "{name}: merged '{key}' max abs error {err}");
        }
        if peft_merge_equal {
            assert_eq!(merged.len(), want.len(), "{name}");
        } else {
            assert!(!model.config.tie_word_embeddings, "{name}");
            assert_eq!(merged.len(), want.len() + 1, "{name}");
            if !head_adapted {
                // The untied head keeps the base embedding.
                let base = load_model_at(&case.base);
                let err = max_abs_diff(&merged["lm_head.weight"], &base.embed_tokens);
                assert_eq!(err, 0.0, "{name}");
            }
        }
        let mut model = model;
        merge_and_unload(&mut model).unwrap();
        assert!(model.embed_adapter.is_none());
        case.assert_adapter_logits(&model, "merged");
    }
}

/// An embedding adapter saves under PEFT's names (`lora_embedding_A/B`, DoRA's
/// `lora_magnitude_vector`) and loads back to the same tensors.
#[test]
fn embedding_adapters_save_and_load_back() {
    for name in ["llama3_dora", "qwen2_tied"] {
        let case = Case::embedding(name);
        let (model, config) = case.model_with_adapter();
        let dir = assert_saves_as_peft(&model, &config, &case.dir.join("adapter"), name);
        let mut reloaded = load_model_at(&case.base);
        load_adapter(&mut reloaded, &dir).unwrap();
        assert!(reloaded.embed_adapter.is_some());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A fresh embedding adapter (PEFT's init: A zeros, B normal; DoRA's magnitude the norm of each
/// hidden unit's column) leaves the model as it was; its first gradient reaches A, not B.
#[test]
fn fresh_embedding_adapters_start_as_the_base_model() {
    let batch = golden("qwen2");
    let (g, ids, layout, golden) = (batch.json, batch.ids, batch.layout, batch.tensors);
    for use_dora in [false, true] {
        let mut config = LoraConfig::new(
            4,
            8.0,
            TargetModules::Names(vec!["embed_tokens".into(), "v_proj".into()]),
        );
        config.use_dora = use_dora;
        let mut model = base_model("qwen2");
        assert!(model.config.tie_word_embeddings);
        assert_eq!(add_adapter(&mut model, &config, 3).unwrap(), 3);
        let params = trainable_parameters(&mut model).unwrap();
        let logits = model.forward(&ids, &layout, None).unwrap();
        let err = max_abs_diff(&logits, &golden["logits"]);
        assert!(
            err <= 1e-4,
            "fresh embedding adapter (DoRA {use_dora}): {err}"
        );
        let grads = causal_lm_loss(&logits, &g["labels"]).backward().unwrap();
        let grad_max = |suffix: &str| {
            let (_, var) = params.iter().find(|(n, _)| n.ends_with(suffix)).unwrap();
            let g = grads.get(var).unwrap();
            max_abs_diff(g, &g.zeros_like().unwrap())
        };
        assert!(grad_max("embed_tokens.lora_embedding_A") > 0.0);
        assert_eq!(grad_max("embed_tokens.lora_embedding_B"), 0.0);
        // The tied head was untied and keeps the base weights.
        assert!(!model.config.tie_word_embeddings);
        let b_std = model
            .embed_adapter
            .as_ref()
            .unwrap()
            .b
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            .sqrt();
        assert!((b_std - 1.0).abs() < 0.2, "B's std {b_std}");
    }
}

/// `ensure_weight_tying` on a tied model: the head's adapter is the embedding's, transposed
/// (PEFT's tied adapter), giving PEFT's logits; merging keeps the two tied and the adapter's
/// outputs (PEFT's own merge adds the delta twice); the adapter saves back as PEFT wrote it;
/// training it further is refused by name.
#[test]
fn ensure_weight_tying_shares_the_embedding_adapter_with_the_head() {
    let case = Case::embedding("qwen2_tied_ensure");
    let (mut model, config) = case.model_with_adapter();
    assert!(config.ensure_weight_tying);
    assert!(model.config.tie_word_embeddings);
    assert!(model.lm_head.adapter.is_some());
    case.assert_adapter_logits(&model, "adapter");

    let dir = assert_saves_as_peft(&model, &config, &case.dir.join("adapter"), "ensure-tying");
    let _ = std::fs::remove_dir_all(&dir);

    let err = trainable_parameters(&mut model.clone())
        .unwrap_err()
        .to_string();
    assert!(err.contains("ensure_weight_tying"), "{err}");

    let merged = merged_tensors(&model).unwrap();
    assert!(!merged.contains_key("lm_head.weight"));
    merge_and_unload(&mut model).unwrap();
    assert!(model.config.tie_word_embeddings && model.lm_head.adapter.is_none());
    case.assert_adapter_logits(&model, "merged");
}

/// The base weights PEFT saves beside adapters on the embedding and head
/// (`*.base_layer.weight`) load into the base, as PEFT loads them; a head left with another
/// number of rows than the embedding is an error naming both.
#[test]
fn saved_base_layers_replace_the_base_weights() {
    let case = Case::embedding("llama3");
    let src = case.dir.join("adapter");
    let orig = tensors(&src.join(ADAPTER_WEIGHTS_FILE));
    let embed_key = "base_model.model.model.embed_tokens.base_layer.weight";
    let head_key = "base_model.model.lm_head.base_layer.weight";
    let write = |name: &str, map: &HashMap<String, Tensor>| {
        let dir = temp_dir(name);
        std::fs::copy(src.join(ADAPTER_CONFIG_FILE), dir.join(ADAPTER_CONFIG_FILE)).unwrap();
        candle_core::safetensors::save(map, dir.join(ADAPTER_WEIGHTS_FILE)).unwrap();
        dir
    };
    let mut edited = orig.clone();
    let halved = (&orig[head_key] * 0.5).unwrap();
    edited.insert(head_key.into(), halved.clone());
    let dir = write("base-layers", &edited);
    let mut model = load_model_at(&case.base);
    load_adapter(&mut model, &dir).unwrap();
    let head = model.lm_head.weight.as_dense().unwrap();
    assert_eq!(max_abs_diff(head, &halved), 0.0);
    assert_eq!(max_abs_diff(&model.embed_tokens, &orig[embed_key]), 0.0);
    let _ = std::fs::remove_dir_all(&dir);

    let mut resized = orig.clone();
    let extra = Tensor::zeros((2, 64), DType::F32, &Device::Cpu).unwrap();
    let rows = Tensor::cat(&[&orig[embed_key], &extra], 0).unwrap();
    resized.insert(embed_key.into(), rows);
    let dir = write("base-layers-rows", &resized);
    let mut model = load_model_at(&case.base);
    let err = load_adapter(&mut model, &dir).unwrap_err().to_string();
    assert!(err.contains("514 rows") && err.contains("512"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// An adapter on a head tied to the embedding unties it (the embedding keeps the base weights,
/// as under PEFT's adapter), so the merged model gives the adapter's outputs.
#[test]
fn a_tied_head_with_an_adapter_merges_untied() {
    let Golden { ids, layout, .. } = golden("qwen2");
    let config = LoraConfig::new(
        2,
        4.0,
        TargetModules::Names(vec!["lm_head".into(), "q_proj".into()]),
    );
    let mut model = base_model("qwen2");
    let base_embed = model.embed_tokens.clone();
    add_adapter(&mut model, &config, 5).unwrap();
    assert!(!model.config.tie_word_embeddings);
    let head = model.lm_head.adapter.as_mut().unwrap();
    head.b = Tensor::randn(0f32, 0.5, head.b.dims(), &Device::Cpu).unwrap();
    let adapted = model.forward(&ids, &layout, None).unwrap();
    let merged = merged_tensors(&model).unwrap();
    assert_eq!(
        max_abs_diff(&merged["model.embed_tokens.weight"], &base_embed),
        0.0
    );
    assert!(max_abs_diff(&merged["lm_head.weight"], &base_embed) > 1e-3);
    merge_and_unload(&mut model).unwrap();
    let logits = model.forward(&ids, &layout, None).unwrap();
    let err = max_abs_diff(&logits, &adapted);
    assert!(
        err <= 1e-4,
        "merged logits differ from the adapter's by {err}"
    );
}

/// PEFT's trainable tokens (`trainable_token_indices`, a list or `{"embed_tokens": [...]}`):
/// the rows are replaced by the saved values (the pad token's among them; a tied head uses the
/// same rows), giving PEFT's logits and its merged weights, and saved back under PEFT's name.
#[test]
fn trainable_tokens_match_peft() {
    for name in ["tokens_llama3", "tokens_qwen2_tied"] {
        let case = Case::embedding(name);
        let (model, config) = case.model_with_adapter();
        assert_eq!(config.trainable_token_indices.len(), 3, "{name}");
        case.assert_adapter_logits(&model, "trainable tokens");

        case.assert_merges_as_peft(&model);

        let dir = assert_saves_as_peft(&model, &config, &case.dir.join("adapter"), name);
        let json = read_json(&dir.join(ADAPTER_CONFIG_FILE));
        assert_eq!(json["trainable_token_indices"].as_array().unwrap().len(), 3);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A trainable-tokens adapter whose rows do not fit is an error naming the tensor.
#[test]
fn trainable_tokens_errors_are_named() {
    let case = Case::embedding("tokens_llama3");
    let src = case.dir.join("adapter");
    let key = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta";
    let mut json = read_json(&src.join(ADAPTER_CONFIG_FILE));
    json["trainable_token_indices"] = serde_json::json!([3, 17]);
    let dir = temp_dir("tokens-shape");
    std::fs::copy(
        src.join(ADAPTER_WEIGHTS_FILE),
        dir.join(ADAPTER_WEIGHTS_FILE),
    )
    .unwrap();
    std::fs::write(dir.join(ADAPTER_CONFIG_FILE), json.to_string()).unwrap();
    let mut model = load_model_at(&case.base);
    let err = load_adapter(&mut model, &dir).unwrap_err().to_string();
    assert!(err.contains(key) && err.contains("[2, 64]"), "{err}");
    json["trainable_token_indices"] = serde_json::json!({"lm_head": [3, 17, 300]});
    std::fs::write(dir.join(ADAPTER_CONFIG_FILE), json.to_string()).unwrap();
    let err = load_adapter(&mut model, &dir).unwrap_err().to_string();
    assert!(
        err.contains("lm_head") && err.contains("embed_tokens"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A vocabulary resized for the adapter (`resize_token_embeddings` before PEFT): PEFT saves the
/// whole embedding and head beside the adapter, which take the base's place with their new rows
/// (the inputs use a new token), tied or not; the merged model has the new vocabulary.
#[test]
fn a_resized_vocabulary_saved_beside_the_adapter_is_loaded() {
    for name in ["resized_llama3", "resized_qwen2_tied"] {
        let case = Case::embedding(name);
        let (model, _) = case.model_with_adapter();
        assert_eq!(model.config.vocab_size, 520, "{name}");
        assert_eq!(model.config.raw["vocab_size"], 520, "{name}");
        case.assert_adapter_logits(&model, "resized");
        case.assert_merges_as_peft(&model);
    }
}

/// An adapter on a resized vocabulary saves the whole embedding and head beside it, as PEFT
/// does when the vocabulary differs from the base's (`base_model_name_or_path`).
#[test]
fn a_resized_vocabulary_is_saved_beside_the_adapter() {
    let case = Case::embedding("resized_qwen2_tied");
    let (model, mut config) = case.model_with_adapter();
    config.base_model_name_or_path = Some(case.base.display().to_string());
    let dir = assert_saves_as_peft(&model, &config, &case.dir.join("adapter"), "resized");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The cases of tests/fixtures/lora_bias: Qwen2's biased q/k/v, Phi-2's every layer and its head
/// (rsLoRA), and Llama's bias-free layers (which PEFT cannot merge).
const LORA_BIAS_CASES: [&str; 3] = ["qwen2_qkv", "phi2_all", "llama3_unmergeable"];

/// PEFT's `lora_bias`: `lora_B.bias`, scaled with the product, gives PEFT's logits, loss and
/// gradients (the biases' included).
#[test]
fn lora_bias_matches_peft() {
    for name in LORA_BIAS_CASES {
        let case = Case::lora_bias(name);
        let (model, config) = case.model_with_adapter();
        assert!(config.lora_bias, "{name}");
        let biased = model
            .linears()
            .iter()
            .filter(|(_, l)| l.adapter.as_ref().is_some_and(|a| a.bias.is_some()))
            .count();
        assert!(biased >= 6, "{name}: {biased} adapters with a bias");
        case.check_forward_and_gradients();
    }
}

/// A LoRA bias merges into the base layer's bias (`bias + lora_B.bias * scaling`): PEFT's merged
/// state dict, and the merged model runs as the adapter. Where a base layer has no bias, both
/// merges are refused naming the layer (PEFT refuses too), and the model keeps its adapters.
#[test]
fn lora_bias_merges_into_the_base_bias() {
    for name in LORA_BIAS_CASES {
        let case = Case::lora_bias(name);
        let (mut model, _) = case.model_with_adapter();
        let g = read_json(&case.dir.join("golden.json"));
        if g.get("merge_error").is_some() {
            let err = merged_tensors(&model).unwrap_err().to_string();
            assert!(
                err.contains("model.layers.0.") && err.contains("lora_bias"),
                "{name}: {err}"
            );
            let err = merge_and_unload(&mut model).unwrap_err().to_string();
            assert!(err.contains("lora_bias"), "{name}: {err}");
            case.assert_adapter_logits(&model, "after a refused merge");
            continue;
        }
        case.assert_merges_as_peft(&model);
        merge_and_unload(&mut model).unwrap();
        assert!(model.linears().iter().all(|(_, l)| l.adapter.is_none()));
        case.assert_adapter_logits(&model, "merged");
    }
}

/// A LoRA bias saves as PEFT's `lora_B.bias` with `lora_bias: true`, and loads back.
#[test]
fn lora_bias_saves_as_peft() {
    let case = Case::lora_bias("phi2_all");
    let (model, config) = case.model_with_adapter();
    let dir = assert_saves_as_peft(&model, &config, &case.dir.join("adapter"), "lora_bias");
    let saved = read_json(&dir.join(ADAPTER_CONFIG_FILE));
    assert_eq!(saved["lora_bias"], Value::Bool(true));
    let mut reloaded = load_model_at(&case.base);
    load_adapter(&mut reloaded, &dir).unwrap();
    case.assert_adapter_logits(&reloaded, "reloaded");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fresh adapter with `lora_bias` starts with zero biases (PEFT's init), so the model is the
/// base; the biases are trainable and get the gradient of the scaled sum of the layer's output
/// gradients.
#[test]
fn fresh_lora_bias_starts_at_zero_and_trains() {
    let batch = golden("qwen2");
    let (g, ids, layout, golden) = (batch.json, batch.ids, batch.layout, batch.tensors);
    let targets = TargetModules::Names(vec!["q_proj".into(), "down_proj".into()]);
    let mut config = LoraConfig::new(2, 6.0, targets);
    config.lora_bias = true;
    let mut model = base_model("qwen2");
    let n = add_adapter(&mut model, &config, 9).unwrap();
    let params = trainable_parameters(&mut model).unwrap();
    assert_eq!(params.len(), 3 * n);
    let logits = model.forward(&ids, &layout, None).unwrap();
    let err = max_abs_diff(&logits, &golden["logits"]);
    assert!(err <= 1e-4, "a fresh LoRA bias changed logits by {err}");
    let grads = causal_lm_loss(&logits, &g["labels"]).backward().unwrap();
    for (name, var) in params.iter().filter(|(n, _)| n.ends_with("lora_B.bias")) {
        let grad = grads.get(var).unwrap();
        assert!(rel_l2(grad, &grad.zeros_like().unwrap()) > 0.0, "{name}");
    }
    // DoRA and an embedding adapter take no LoRA bias, as in PEFT.
    let dir = adapter_with_config("bias_dora", |m| {
        m.insert("lora_bias".into(), Value::Bool(true));
        m.insert("use_dora".into(), Value::Bool(true));
    });
    let err = load_adapter(&mut base_model("llama3"), &dir)
        .unwrap_err()
        .to_string();
    assert!(err.contains("lora_bias") && err.contains("DoRA"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
    let embed = TargetModules::Names(vec!["embed_tokens".into()]);
    let mut config = LoraConfig::new(2, 4.0, embed);
    config.lora_bias = true;
    let err = add_adapter(&mut base_model("qwen2"), &config, 1)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("lora_bias") && err.contains("embed_tokens"),
        "{err}"
    );
}

/// The cases of tests/fixtures/target_parameters: Mixtral's experts (both fused parameters,
/// nested, one with a rank pattern), router and q_proj; Qwen2-MoE's gate_up_proj beside its shared
/// expert (rsLoRA); Qwen3-MoE's down_proj and a dense layer's 2-D weight; and Qwen2-MoE adapted by
/// module names alone on transformers 5 (its shared expert, no expert: they are no modules there);
/// Phi-3.5-MoE's experts and its router (`mlp.router` there).
const TARGET_PARAMETERS_CASES: [&str; 5] = [
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "qwen2_moe_modules",
    "phimoe",
];

/// `merged` (ferrotune's names: one linear per expert, Mixtral's `block_sparse_moe`) in
/// transformers 5's in-memory names and layout, as PEFT's merged state dict holds it: Mixtral's
/// block is `mlp`, Phi-3.5-MoE's router `router` (`router` names it), and each sparse block's
/// experts are fused into `experts.gate_up_proj` (`[experts, 2 * inter, hidden]`, gate rows
/// first) and `experts.down_proj`.
fn in_transformers5_layout(
    merged: &HashMap<String, Tensor>,
    router: &str,
) -> HashMap<String, Tensor> {
    let mut out = HashMap::new();
    let mut experts: std::collections::BTreeMap<(String, usize), [Option<Tensor>; 3]> =
        Default::default();
    for (key, t) in merged {
        let key = key.replacen(".block_sparse_moe.", ".mlp.", 1);
        let key = match key.strip_suffix(".mlp.gate.weight") {
            Some(layer) => format!("{layer}.mlp.{router}.weight"),
            None => key,
        };
        let Some((block, rest)) = key.split_once(".experts.") else {
            out.insert(key, t.clone());
            continue;
        };
        let (e, proj) = rest.split_once('.').unwrap();
        let slot = match proj {
            "w1.weight" | "gate_proj.weight" => 0,
            "w3.weight" | "up_proj.weight" => 1,
            "w2.weight" | "down_proj.weight" => 2,
            other => panic!("{other}"),
        };
        experts
            .entry((block.to_string(), e.parse().unwrap()))
            .or_default()[slot] = Some(t.clone());
    }
    let mut fused: HashMap<String, (Vec<Tensor>, Vec<Tensor>)> = HashMap::new();
    for ((block, _), [gate, up, down]) in experts {
        let entry = fused.entry(block).or_default();
        let gate_up = Tensor::cat(&[gate.unwrap(), up.unwrap()], 0).unwrap();
        entry.0.push(gate_up);
        entry.1.push(down.unwrap());
    }
    for (block, (gate_up, down)) in fused {
        out.insert(
            format!("{block}.experts.gate_up_proj"),
            Tensor::stack(&gate_up, 0).unwrap(),
        );
        out.insert(
            format!("{block}.experts.down_proj"),
            Tensor::stack(&down, 0).unwrap(),
        );
    }
    out
}

/// PEFT's adapters on parameters (`target_parameters`: transformers 5's fused experts, its
/// router's bare weight, a 2-D weight) run as one LoRA per expert projection: PEFT's logits (in
/// training mode too) and loss, and merged weights equal to PEFT's merged state dict once fused
/// as transformers 5 holds them; the merged model gives the adapter's logits.
#[test]
fn target_parameters_match_peft() {
    for name in TARGET_PARAMETERS_CASES {
        let case = Case::target_parameters(name);
        let (mut model, config) = case.model_with_adapter();
        let experts_adapted = model
            .linears()
            .iter()
            .any(|(n, l)| n.contains(".experts.") && l.adapter.is_some());
        assert_eq!(
            experts_adapted,
            !config.target_parameters.is_empty(),
            "{name}"
        );
        case.assert_runs_as_peft(&mut model);

        let router = if name == "phimoe" { "router" } else { "gate" };
        let merged = in_transformers5_layout(&merged_tensors(&model).unwrap(), router);
        let want = tensors(&case.dir.join("merged.safetensors"));
        assert_same_tensors(&merged, &want, 1e-5, &format!("{name}: merged"));
        merge_and_unload(&mut model).unwrap();
        case.assert_adapter_logits(&model, "merged");
    }
}

/// DeepSeek-V3 and V2 (tests/fixtures/deepseek_lora, scripts/make_deepseek_lora_fixtures.py):
/// PEFT adapters on multi-head latent attention's projections (q_a_proj, q_b_proj or q_proj,
/// kv_a_proj_with_mqa, kv_b_proj, o_proj; DoRA on the latent ones) and, through the MLP
/// projections' names, on the fused routed experts (PEFT 0.21 on transformers 5 turns those into
/// `target_parameters`, leaving the dense MLP and the shared experts unadapted). PEFT's logits,
/// loss and every gradient to 1e-4 relative L2 (the experts' per expert: PEFT's fused gradients
/// read as an adapter file is read), merged weights and the merged model's logits.
#[test]
fn deepseek_adapters_match_peft() {
    for name in ["deepseek_v3", "deepseek_v2", "deepseek_v3_dora"] {
        let case = Case::made_with_base(fixtures().join("deepseek_lora").join(name));
        check_fused_experts_adapter(name, &case);
    }
}

/// Every module PEFT's `target_modules` names carries an adapter in `model` (`name`: the case).
fn assert_every_named_target_adapted(name: &str, model: &CausalLm, config: &LoraConfig) {
    let adapted = adapted_layers(model);
    let TargetModules::Names(modules) = &config.target_modules else {
        panic!("{name}: PEFT saved its targets as names");
    };
    for module in modules {
        assert!(
            adapted.iter().any(|n| n.ends_with(&format!(".{module}"))),
            "{name}: {module} not adapted: {adapted:?}"
        );
    }
}

/// What [`deepseek_adapters_match_peft`] checks of one case whose adapter reaches fused routed
/// experts: every module PEFT named adapted, PEFT's logits and loss, every gradient (the experts'
/// per expert), merged weights and the merged model's logits.
fn check_fused_experts_adapter(name: &str, case: &Case) {
    let (mut model, config) = case.model_with_adapter();
    assert_every_named_target_adapted(name, &model, &config);
    case.assert_runs_as_peft(&mut model);

    let params = trainable_parameters(&mut model).unwrap();
    set_training(&mut model, true);
    let (ids, labels) = case.inputs();
    let (b, t) = ids.dims2().unwrap();
    let logits = model
        .forward(&ids, &AttentionLayout::causal(b, t, 0), None)
        .unwrap();
    let grads = causal_lm_loss(&logits, &labels).backward().unwrap();
    set_training(&mut model, false);
    // PEFT's gradients carry its parameter names and fused experts: read as an adapter, they
    // land on ferrotune's parameters as PEFT's weights do.
    let dir = temp_dir(&format!("deepseek-grads-{name}"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        case.dir.join("adapter").join(ADAPTER_CONFIG_FILE),
        dir.join(ADAPTER_CONFIG_FILE),
    )
    .unwrap();
    std::fs::copy(
        case.dir.join("lora_grads.safetensors"),
        dir.join(ADAPTER_WEIGHTS_FILE),
    )
    .unwrap();
    let mut as_grads = load_model_at(&case.base);
    load_adapter(&mut as_grads, &dir).unwrap();
    let want: HashMap<String, Tensor> = trainable_parameters(&mut as_grads)
        .unwrap()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().clone()))
        .collect();
    assert_eq!(params.len(), want.len(), "{name}: parameters");
    let grad_of = |param: &str| {
        let (_, var) = params.iter().find(|(n, _)| n == param).unwrap();
        grads
            .get(var)
            .unwrap_or_else(|| panic!("{param}: no gradient"))
            .clone()
    };
    for (param, _) in &params {
        // An expert's gate and up share PEFT's lora_A of `gate_up_proj`: its gradient is the
        // sum of both copies'.
        let g = match param.contains(".experts.") && param.ends_with("lora_A.weight") {
            true if param.contains(".gate_proj.") || param.contains(".up_proj.") => {
                let gate = param.replace(".up_proj.", ".gate_proj.");
                let up = gate.replace(".gate_proj.", ".up_proj.");
                (grad_of(&gate) + grad_of(&up)).unwrap()
            }
            _ => grad_of(param),
        };
        let err = rel_l2(&g, &want[param]);
        assert!(
            err <= 1e-4,
            "{name}: {param}: gradient relative L2 error {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);

    let merged = in_transformers5_layout(&merged_tensors(&model).unwrap(), "gate");
    let want = tensors(&case.dir.join("merged.safetensors"));
    assert_same_tensors(&merged, &want, 1e-5, &format!("{name}: merged"));
    merge_and_unload(&mut model).unwrap();
    case.assert_adapter_logits(&model, "merged");
}

/// PEFT's `target_parameters` on Llama 4 (the text model, and the whole
/// `Llama4ForConditionalGeneration`), whose fused experts are `[experts, in, out]`: PEFT's factors
/// then trade roles (lora_A `[r * E, 2 * inter]` on `gate_up_proj`), and each expert's update is
/// the transposed weight's. PEFT's logits (inference and training), loss, merged weights in the
/// checkpoint's layout, and the merged model's logits.
#[test]
fn llama4_expert_parameters_match_peft() {
    for name in ["llama4", "llama4_multimodal"] {
        let case = Case::target_parameters(name);
        let (mut model, config) = case.model_with_adapter();
        assert!(model.config.llama4_names, "{name}");
        let adapted = adapted_layers(&model);
        // Every expert of both sparse layers: gate and up (and down for the text model).
        let experts = adapted.iter().filter(|n| n.contains(".experts.")).count();
        let per_expert = if name == "llama4" { 3 } else { 2 };
        assert_eq!(experts, 2 * 4 * per_expert, "{name}: {adapted:?}");
        assert!(!config.target_parameters.is_empty());
        case.assert_runs_as_peft(&mut model);
        merge_and_unload(&mut model).unwrap();
        case.assert_adapter_logits(&model, "merged");
        let got = merged_tensors(&model).unwrap();
        let want: HashMap<String, Tensor> = tensors(&case.dir.join("merged.safetensors"))
            .into_iter()
            .filter_map(|(k, v)| Some((ferrotune_models::checkpoint::text_model_tensor(&k)?, v)))
            .collect();
        assert_same_tensors(&got, &want, 1e-5, &format!("{name}: merged"));
    }
}

/// PEFT's `target_parameters` on Gemma 4's experts beside the dense MLP
/// (`model.layers.N.experts.gate_up_proj`, `[experts, 2 * inter, hidden]`), nested and with a rank
/// pattern, beside module targets on q_proj, the dense MLP's gate_proj (no expert reached by the
/// name) and the router's projection: PEFT's logits (inference and training), loss, merged
/// weights in the checkpoint's layout (experts fused again, buffers kept), and the merged model's
/// logits.
#[test]
fn gemma4_expert_parameters_match_peft() {
    let case = Case::target_parameters("gemma4_moe");
    let (mut model, _) = case.model_with_adapter();
    let adapted = adapted_layers(&model);
    // Three layers of 4 experts, each with gate, up and down; q_proj, mlp.gate_proj, router.proj.
    let experts = adapted.iter().filter(|n| n.contains(".experts.")).count();
    assert_eq!(experts, 3 * 4 * 3, "{adapted:?}");
    assert_eq!(adapted.len() - experts, 3 * 3, "{adapted:?}");
    assert!(
        adapted.iter().any(|n| n.ends_with("router.proj")),
        "{adapted:?}"
    );
    case.assert_runs_as_peft(&mut model);
    merge_and_unload(&mut model).unwrap();
    case.assert_adapter_logits(&model, "merged");
    let got = merged_tensors(&model).unwrap();
    let want = tensors(&case.dir.join("merged.safetensors"));
    assert_same_tensors(&got, &want, 1e-5, "gemma4_moe: merged");
}

/// Errors of `target_parameters` adapters name what is wrong: a tensor missing or mis-shaped, a
/// target matching no parameter, a layer targeted twice; saving one is refused (merge instead).
#[test]
fn target_parameters_errors_are_named() {
    let case = Case::target_parameters("qwen2_moe");
    let cases: [(&str, &str, Value, &[&str]); 4] = [
        (
            "tp_nothing",
            "target_parameters",
            serde_json::json!(["experts.up"]),
            &["target_parameters", "matches no parameter"],
        ),
        (
            "tp_rank",
            "r",
            Value::from(2),
            &[
                "model.layers.0.mlp.experts.lora_A.weight",
                "shape",
                "[8, 32]",
            ],
        ),
        (
            "tp_both",
            "target_parameters",
            serde_json::json!(["experts.gate_up_proj", "shared_expert.up_proj.weight"]),
            &["shared_expert.up_proj", "both"],
        ),
        (
            "tp_dora",
            "use_dora",
            Value::Bool(true),
            &["target_parameters", "use_dora"],
        ),
    ];
    for (label, key, value, needles) in cases {
        let dir = copy_adapter_with_config(&case.dir.join("adapter"), label, |m| {
            m.insert(key.into(), value);
        });
        let err = load_adapter(&mut load_model_at(&case.base), &dir)
            .unwrap_err()
            .to_string();
        for n in needles {
            assert!(err.contains(n), "{label}: '{err}' should mention '{n}'");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    let (model, config) = case.model_with_adapter();
    let dir = temp_dir("tp_save");
    let err = save_adapter(&model, &config, &dir).unwrap_err().to_string();
    assert!(err.contains("target_parameters"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
    // Llama 4 names its experts `feed_forward.experts`: transformers 5's `mlp.experts` of other
    // families matches nothing there, and the error shows the model's own names.
    let llama4 = Case::target_parameters("llama4");
    let dir = copy_adapter_with_config(&llama4.dir.join("adapter"), "tp_llama4", |m| {
        m.insert(
            "target_parameters".into(),
            serde_json::json!(["mlp.experts.gate_up_proj"]),
        );
    });
    let err = load_adapter(&mut load_model_at(&llama4.base), &dir)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("matches no parameter")
            && err.contains("'model.layers.1.feed_forward.experts.gate_up_proj'"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// ferrotune's per-expert adapters written as PEFT holds them on transformers 5
/// (`transformers5/`: fused experts and the router's weight as `target_parameters`) load back to
/// the same model: every expert, router, shared-expert and attention adapter, with ranks that
/// differ between gate and up (a rank pattern), rsLoRA or not.
#[test]
fn expert_adapters_written_for_transformers_5_load_back_the_same() {
    use ferrotune_models::peft_params::{save_transformers5_adapter, TRANSFORMERS5_DIR};
    let cases: [(&str, &[&str], bool); 4] = [
        (
            "models/mixtral",
            &["q_proj", "w1", "w2", "w3", "gate"],
            false,
        ),
        (
            "models/qwen2_moe",
            &[
                "v_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
                "gate",
                "shared_expert_gate",
            ],
            true,
        ),
        ("models/qwen3_moe", &["gate_proj", "down_proj"], false),
        ("models/phimoe", &["o_proj", "w1", "w2", "w3", "gate"], true),
    ];
    for (family, targets, rslora) in cases {
        let targets = TargetModules::Names(targets.iter().map(|t| t.to_string()).collect());
        let mut config = LoraConfig::new(2, 6.0, targets);
        config.use_rslora = rslora;
        config.rank_pattern = vec![("w3".into(), 3), ("up_proj".into(), 3)];
        config.alpha_pattern = vec![("down_proj".into(), 5.0)];
        let mut model = base_model(family);
        add_adapter(&mut model, &config, 5).unwrap();
        // Random B (and A) so that every adapter changes the outputs.
        let mut seed = 0u64;
        for (_, linear) in model.linears_mut() {
            if let Some(a) = &mut linear.adapter {
                seed += 1;
                let noise = |t: &Tensor, s: u64| {
                    let n = t.elem_count();
                    let v: Vec<f32> = (0..n)
                        .map(|i| {
                            (((i as u64 * 7919 + s * 104_729) % 1000) as f32 / 1000.0 - 0.5) * 0.4
                        })
                        .collect();
                    Tensor::from_vec(v, t.shape(), t.device()).unwrap()
                };
                a.a = noise(&a.a, seed);
                a.b = noise(&a.b, seed + 500);
            }
        }
        let batch = golden(family);
        let want = model.forward(&batch.ids, &batch.layout, None).unwrap();
        let dir = temp_dir(&format!("t5-{}", family.replace('/', "_")));
        assert!(
            save_transformers5_adapter(&model, &config, &dir).unwrap(),
            "{family}"
        );
        let folder = dir.join(TRANSFORMERS5_DIR);
        let written = read_json(&folder.join(ADAPTER_CONFIG_FILE));
        assert!(
            written["target_parameters"]
                .as_array()
                .is_some_and(|a| !a.is_empty()),
            "{family}: {written}"
        );
        assert_eq!(written["lora_dropout"], Value::from(0.0));
        // PEFT on transformers 5 would turn module targets named like expert projections or the
        // router into parameter targets of the experts (dropping a shared expert's or a dense
        // layer's adapter): none are left.
        for t in written["target_modules"].as_array().unwrap() {
            let t = t.as_str().unwrap();
            let renamed = [
                "w1",
                "w2",
                "w3",
                "gate",
                "gate_proj",
                "up_proj",
                "down_proj",
            ];
            assert!(
                !renamed.contains(&t),
                "{family}: target_modules keeps '{t}'"
            );
        }
        let mut reloaded = base_model(family);
        load_adapter(&mut reloaded, &folder).unwrap_or_else(|e| panic!("{family}: {e}"));
        let got = reloaded.forward(&batch.ids, &batch.layout, None).unwrap();
        let err = max_abs_diff(&got, &want);
        assert!(err <= 1e-5, "{family}: logits max abs error {err}");
        let moved = max_abs_diff(&want, &batch.tensors["logits"]);
        assert!(
            moved > 1e-2,
            "{family}: the adapters changed the logits by {moved}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
    // A model without adapters on experts writes nothing.
    let mut model = base_model("models/mixtral");
    let config = LoraConfig::new(2, 4.0, TargetModules::Names(vec!["q_proj".into()]));
    add_adapter(&mut model, &config, 1).unwrap();
    let dir = temp_dir("t5-none");
    assert!(!save_transformers5_adapter(&model, &config, &dir).unwrap());
    assert!(!dir.join(TRANSFORMERS5_DIR).exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rank no machine can hold (issue 44: `lora_rank: 1e11` aborted allocating 25.6 TB) is an
/// error naming the rank before any adapter is allocated; a rank above a layer's smaller side
/// (PEFT allows it) still trains.
#[test]
fn absurd_lora_rank_is_refused_before_allocating() {
    let names = vec!["q_proj".to_string(), "v_proj".to_string()];
    let mut model = base_model("llama3");
    let config = LoraConfig::new(100_000_000_000, 16.0, TargetModules::Names(names.clone()));
    let err = add_adapter(&mut model, &config, 1).unwrap_err().to_string();
    assert!(
        err.contains("rank 100000000000") && err.contains("lora_rank"),
        "{err}"
    );
    let config = LoraConfig::new(80, 16.0, TargetModules::Names(names));
    assert_eq!(add_adapter(&mut model, &config, 1).unwrap(), 4);
}

/// Qwen3.5 (tests/fixtures/qwen3_5_lora, scripts/make_qwen3_5_lora_fixtures.py): a PEFT adapter
/// on every linear module of the Gated DeltaNet (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a,
/// out_proj), the gated full attention (q_proj with its gate half, k/v/o_proj) and the MLP: PEFT's
/// logits, loss and every gradient to 1e-4 relative L2, merged weights to 1e-5.
#[test]
fn qwen3_5_adapter_matches_peft() {
    let case = Case::made_with_base(fixtures().join("qwen3_5_lora").join("qwen3_5"));
    let (mut model, config) = case.model_with_adapter();
    assert_every_named_target_adapted("qwen3_5", &model, &config);
    case.assert_runs_as_peft(&mut model);
    case.assert_merges_as_peft(&model);
    case.check_forward_and_gradients();
}

/// Qwen3.5 with DoRA (tests/fixtures/qwen3_5_lora/qwen3_5_dora) on the Gated DeltaNet's
/// in_proj_qkv, in_proj_z and out_proj, the gated attention's q_proj and the MLP's gate_proj:
/// PEFT's logits, loss and every gradient (magnitudes included; PEFT run in float64, its own
/// float32 logits being 8e-5 off), merged weights.
#[test]
fn qwen3_5_dora_adapter_matches_peft() {
    let case = Case::made_with_base(fixtures().join("qwen3_5_lora").join("qwen3_5_dora"));
    let (mut model, config) = case.model_with_adapter();
    assert_every_named_target_adapted("qwen3_5_dora", &model, &config);
    case.assert_runs_as_peft(&mut model);
    case.assert_merges_as_peft(&model);
    case.check_forward_and_gradients();
}

/// Qwen3.5 with DoRA on the Gated DeltaNet's in_proj_b alone (tests/fixtures/qwen3_5_lora/
/// qwen3_5_dora_in_proj_b: beta's projection, one output row per value head, through the sigmoid
/// into the delta rule), against PEFT run in float64 end to end (transformers' float32 casts in
/// the delta rule, the norms and RoPE made float64): logits, loss and merged weights to the usual
/// tolerances; the gradients to 2.5e-4, not 1e-4: layer 0's magnitude lands 1.7e-4 away (PyTorch's
/// own float32 2.0e-5), the error being in the gradient reaching in_proj_b's output (issue 41,
/// docs/src/models.md).
#[test]
fn qwen3_5_dora_on_in_proj_b_matches_float64_peft() {
    let dir = fixtures()
        .join("qwen3_5_lora")
        .join("qwen3_5_dora_in_proj_b");
    let case = Case::made_with_base(dir);
    let (mut model, config) = case.model_with_adapter();
    assert_every_named_target_adapted("qwen3_5_dora_in_proj_b", &model, &config);
    case.assert_runs_as_peft(&mut model);
    case.assert_merges_as_peft(&model);
    case.check_forward_and_gradients_to(2.5e-4);
}

/// Qwen3.5-MoE and Qwen3-Next (tests/fixtures/qwen3_5_lora/qwen3_5_moe, qwen3_next): a PEFT
/// adapter on the Gated DeltaNet (Qwen3-Next's fused in_proj_qkvz and in_proj_ba), the gated
/// attention, the shared expert and its gate, Qwen3-Next's dense MLP (modules), and through
/// `target_parameters` the fused routed experts and the router's weight: checked as DeepSeek's.
#[test]
fn qwen3_5_moe_adapters_match_peft() {
    for name in ["qwen3_5_moe", "qwen3_next"] {
        let case = Case::made_with_base(fixtures().join("qwen3_5_lora").join(name));
        check_fused_experts_adapter(name, &case);
    }
}
