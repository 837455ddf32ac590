//! `ferrotune run/validate/ls/cp` end to end through the binary, on the tiny fixture models:
//! one SGD step from a PEFT adapter saves `start − gradient` (PEFT's gradients), resuming after a
//! `kill -9` is step-exact, validation names bad keys, `ls` and `cp` work on the built-in configs.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::Value;

use common::{fixtures, load, losses, metrics_lines, read_json, rel_l2, text};

fn ferrotune(args: &[&str], cwd: &Path, env: &[(&str, &str)]) -> Output {
    common::ferrotune(args, cwd, env)
}

fn tmpdir(name: &str) -> PathBuf {
    common::tmpdir("recipes", name)
}

/// The golden batch as pre-tokenized JSONL rows.
fn write_golden_rows(family: &str, path: &Path) {
    let g: Value = read_json(fixtures().join(family).join("golden.json"));
    let ids = g["input_ids"].as_array().unwrap();
    let labels = g["labels"].as_array().unwrap();
    let lines: Vec<String> = ids
        .iter()
        .zip(labels)
        .map(|(i, l)| serde_json::json!({"input_ids": i, "labels": l}).to_string())
        .collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

/// Overrides for one plain SGD step with lr 1 (the saved weights are then `start − gradient`).
const ONE_SGD_STEP: [&str; 5] = [
    "optimizer._component_=torch.optim.SGD",
    "optimizer.lr=1.0",
    "optimizer.weight_decay=0.0",
    "clip_grad_norm=null",
    "max_steps_per_epoch=1",
];

/// Every tensor of `start` (an adapter file) minus its gradient in `grads` is in `saved`, within
/// 1e-4 relative L2.
fn assert_start_minus_gradient(saved: &Path, start: &Path, grads: &Path) {
    let (saved, start, grads) = (load(saved), load(start), load(grads));
    assert_eq!(saved.len(), start.len());
    for (key, s) in &start {
        let e = rel_l2(&saved[key], &(s - &grads[key]).unwrap());
        assert!(e <= 1e-4, "{key}: relative L2 {e}");
    }
}

/// `ferrotune run eval` of `adapter` with config `cfg` and `extra` overrides: its JSON result line.
fn eval_result(dir: &Path, cfg: &Path, adapter: &Path, extra: &[&str]) -> Value {
    let adapter = format!("checkpointer.adapter_checkpoint={}", adapter.display());
    let mut args = vec!["run", "eval", "--config", cfg.to_str().unwrap(), &adapter];
    args.extend(extra);
    let out = ferrotune(&args, dir, &[]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

fn write_config(dir: &Path, family: &str, data: &Path) -> PathBuf {
    common::write_config(common::TINY_LORA, dir, family, data)
}

/// One SGD step (lr 1) from a PEFT adapter logs PEFT's loss and saves `start − gradient`, with
/// PEFT's gradients: LoRA, DoRA, adapters on the token embedding, LoRA biases (`lora_bias`;
/// where the base layers have no bias to merge them into, no merged model is written), and
/// `modules_to_save` (the embedding and head trained in full; Qwen2's tied head keeps the base
/// weights while the embedding trains).
#[test]
fn one_sgd_step_from_a_peft_adapter_saves_start_minus_gradient() {
    // (base model, adapter case, the fixture whose golden.json holds the batch)
    let cases = [
        ("llama3", "llama3", "llama3"),
        ("qwen2", "qwen2", "qwen2"),
        ("llama3", "llama3/variants/dora", "llama3"),
        // Adapters on the token embedding; Qwen2's head is tied to it.
        (
            "qwen2",
            "embedding_lora/qwen2_tied",
            "embedding_lora/qwen2_tied",
        ),
        (
            "llama3",
            "embedding_lora/llama3_dora",
            "embedding_lora/llama3_dora",
        ),
        ("qwen2", "lora_bias/qwen2_qkv", "lora_bias/qwen2_qkv"),
        ("models/phi2", "lora_bias/phi2_all", "lora_bias/phi2_all"),
        (
            "llama3",
            "lora_bias/llama3_unmergeable",
            "lora_bias/llama3_unmergeable",
        ),
        (
            "llama3",
            "modules_to_save_training/llama3_embed_head",
            "modules_to_save_training/llama3_embed_head",
        ),
        (
            "qwen2",
            "modules_to_save_training/qwen2_tied_embed",
            "modules_to_save_training/qwen2_tied_embed",
        ),
    ];
    for (family, case, rows) in cases {
        let case = fixtures().join(case);
        let dir = tmpdir(&format!(
            "sgd-{family}-{}",
            case.file_name().unwrap().to_string_lossy()
        ));
        let data = dir.join("batch.jsonl");
        write_golden_rows(rows, &data);
        let cfg = write_config(&dir, family, &data);
        let adapter = case.join("adapter");
        let out = ferrotune(
            &[
                "run",
                "lora_finetune_single_device",
                "--config",
                cfg.to_str().unwrap(),
                &format!("checkpointer.adapter_checkpoint={}", adapter.display()),
                "optimizer._component_=torch.optim.SGD",
                "optimizer.lr=1.0",
                "optimizer.weight_decay=0.0",
                "lr_scheduler=null",
                "clip_grad_norm=null",
                "max_steps_per_epoch=1",
                "shuffle=false",
            ],
            &dir,
            &[],
        );
        assert!(out.status.success(), "{}", text(&out));
        let saved_dir = dir.join("out/epoch_0");
        let saved = load(&saved_dir.join("adapter_model.safetensors"));
        let start = load(&adapter.join("adapter_model.safetensors"));
        let grads = load(&case.join("lora_grads.safetensors"));
        assert_eq!(
            saved.len(),
            start.len(),
            "{case:?}: same tensors as the start adapter"
        );
        for (key, s) in &start {
            if key.contains(".base_layer.") {
                // The frozen base weights PEFT saves beside an adapted embedding: as read.
                assert_eq!(rel_l2(&saved[key], s), 0.0, "{case:?}: {key}");
                continue;
            }
            // Gradients use parameter names: the DoRA magnitude's has a `.weight` suffix, a
            // saved module's weight is its trained copy's (`.modules_to_save.weight`).
            let gname = if key.ends_with("lora_magnitude_vector") {
                format!("{key}.weight")
            } else if !key.contains(".lora_") {
                key.replacen(".weight", ".modules_to_save.weight", 1)
            } else {
                key.clone()
            };
            let want = (s - &grads[&gname]).unwrap();
            let e = rel_l2(&saved[key], &want);
            assert!(e <= 1e-4, "{case:?}: {key}: relative L2 {e}");
        }
        let g: Value = read_json(case.join("golden.json"));
        // The folder is a PEFT adapter plus a merged HF checkpoint with tokenizer files and state.
        let mergeable = g.get("merge_error").is_none();
        for f in [
            "adapter_config.json",
            "tokenizer.json",
            "merged/config.json",
            "merged/model.safetensors",
            "merged/tokenizer.json",
            "recipe_state/state.json",
            "recipe_state/optimizer.safetensors",
        ] {
            let expected = mergeable || !f.starts_with("merged/");
            assert_eq!(saved_dir.join(f).is_file(), expected, "{case:?}: {f}");
        }
        if !mergeable {
            assert!(text(&out).contains("no merged/ model"), "{}", text(&out));
        }
        if rows.starts_with("embedding_lora") {
            // The merged checkpoint of a tied model unties its head (which keeps the base
            // weights), so that it runs as the adapter does.
            let config: Value = read_json(saved_dir.join("merged/config.json"));
            let merged = load(&saved_dir.join("merged/model.safetensors"));
            assert!(merged.contains_key("lm_head.weight"), "{case:?}");
            assert_ne!(config["tie_word_embeddings"], Value::Bool(true), "{case:?}");
        }
        let metrics = std::fs::read_to_string(dir.join("out/logs/metrics.jsonl")).unwrap();
        let first: Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
        let want_loss = g["lora_loss"].as_f64().unwrap();
        let got_loss = first["loss"].as_f64().unwrap();
        assert!(
            ((got_loss - want_loss) / want_loss).abs() < 1e-5,
            "{case:?}: logged loss {got_loss} vs PEFT {want_loss}"
        );
        for key in [
            "step",
            "epoch",
            "loss",
            "lr",
            "tokens_per_second",
            "tokens_per_second_per_gpu",
        ] {
            assert!(
                first.get(key).is_some(),
                "metrics line lacks {key}: {first}"
            );
        }
    }
}

/// One AdamW step of LoRA on the `family` fixture with `settings`, under torchtune's HF
/// checkpointer, for adapters torchtune's `adapter_model.pt` cannot hold: the run says so and
/// writes none. Returns the saved folder and its `adapter_config.json`.
fn one_lora_step_without_torchtune_adapter(
    name: &str,
    family: &str,
    settings: &[&str],
) -> (PathBuf, Value) {
    let dir = tmpdir(name);
    let torchtune = "checkpointer._component_=torchtune.training.FullModelHFCheckpointer";
    let out = one_lora_step(&dir, family, &[&[torchtune], settings].concat());
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("no adapter_model.pt"), "{}", text(&out));
    let saved_dir = dir.join("out/epoch_0");
    assert!(!saved_dir.join("adapter_model.pt").exists());
    let config: Value = read_json(saved_dir.join("adapter_config.json"));
    (saved_dir, config)
}

/// Runs one step of `lora_finetune_single_device` in `dir` on the golden rows of the `family`
/// fixture, with `settings`.
fn one_lora_step(dir: &Path, family: &str, settings: &[&str]) -> Output {
    let data = dir.join("batch.jsonl");
    write_golden_rows(family, &data);
    let cfg = write_config(dir, family, &data);
    let mut args = vec![
        "run",
        "lora_finetune_single_device",
        "--config",
        cfg.to_str().unwrap(),
        "max_steps_per_epoch=1",
    ];
    args.extend_from_slice(settings);
    ferrotune(&args, dir, &[])
}

/// A pre-tokenized row holding an id past the model's vocabulary stops the run before training,
/// naming the file, the line, the id and the vocabulary size (issue 44; before, the embedding
/// lookup failed on an index out of range, naming neither).
#[test]
fn token_ids_past_the_models_vocabulary_stop_the_run_naming_file_and_line() {
    let dir = tmpdir("ids-past-vocab");
    let data = dir.join("rows.jsonl");
    std::fs::write(
        &data,
        "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4, 5, 6]}\n\n{\"input_ids\": [7, 512, 9]}\n",
    )
    .unwrap();
    let cfg = write_config(&dir, "llama3", &data);
    let out = ferrotune(
        &[
            "run",
            "lora_finetune_single_device",
            "--config",
            cfg.to_str().unwrap(),
        ],
        &dir,
        &[],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains(
            "rows.jsonl:4: 'input_ids' holds the id 512 (position 2), past the model's \
             vocabulary of 512 tokens"
        ),
        "{}",
        text(&out)
    );
    assert!(!dir.join("out").join("epoch_0").exists());
}

/// `model.apply_lora_to_embeddings` adds PEFT's embedding adapter (A zeros, B normal): one AdamW
/// step moves A's columns of the batch's tokens (those before a scored label) and no other, the adapter is saved under PEFT's
/// names with `embed_tokens` among the targets, and a torchtune checkpointer skips the
/// `adapter_model.pt` it cannot hold, saying so.
#[test]
fn apply_lora_to_embeddings_trains_an_embedding_adapter() {
    let (saved_dir, config) = one_lora_step_without_torchtune_adapter(
        "embed-lora",
        "qwen2",
        &["model.apply_lora_to_embeddings=true"],
    );
    assert!(
        config["target_modules"]
            .to_string()
            .contains("embed_tokens"),
        "{config}"
    );
    let saved = load(&saved_dir.join("adapter_model.safetensors"));
    let a = &saved["base_model.model.model.embed_tokens.lora_embedding_A"];
    let b = &saved["base_model.model.model.embed_tokens.lora_embedding_B"];
    assert_eq!(a.dims(), &[4, 512]);
    assert_eq!(b.dims(), &[64, 4]);
    let g: Value = read_json(fixtures().join("qwen2/golden.json"));
    let used: std::collections::HashSet<usize> = g["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| {
            // The last token predicts nothing that is scored: its embedding gets no gradient.
            let row = row.as_array().unwrap();
            row[..row.len() - 1].iter()
        })
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let columns: Vec<Vec<f32>> = a.t().unwrap().to_vec2().unwrap();
    for (token, column) in columns.iter().enumerate() {
        let moved = column.iter().any(|&v| v != 0.0);
        assert_eq!(
            moved,
            used.contains(&token),
            "token {token}: A's column moved {moved}"
        );
    }
}

/// `model.modules_to_save` trains the token embedding and output head in full beside the
/// adapters (PEFT's `modules_to_save`): both move, are saved under PEFT's names with the key in
/// `adapter_config.json`, and the merged model holds them; torchtune's `adapter_model.pt`, which
/// cannot hold them, is skipped with a note. Another module there, or the LoRA DPO
/// recipe (whose reference disables the adapters), is refused by name.
#[test]
fn modules_to_save_trains_the_embedding_and_head_in_full() {
    let (saved_dir, config) = one_lora_step_without_torchtune_adapter(
        "modules-to-save",
        "llama3",
        &["model.modules_to_save=[embed_tokens,lm_head]"],
    );
    assert_eq!(
        config["modules_to_save"],
        serde_json::json!(["embed_tokens", "lm_head"])
    );
    let saved = load(&saved_dir.join("adapter_model.safetensors"));
    let base = load(&fixtures().join("llama3/model/model.safetensors"));
    let merged = load(&saved_dir.join("merged/model.safetensors"));
    for (key, base_key) in [
        (
            "base_model.model.model.embed_tokens.weight",
            "model.embed_tokens.weight",
        ),
        ("base_model.model.lm_head.weight", "lm_head.weight"),
    ] {
        let moved = ferrotune_testing::max_abs_diff(&saved[key], &base[base_key]);
        assert!(moved > 1e-4, "{key} did not train ({moved})");
        assert_eq!(
            ferrotune_testing::max_abs_diff(&saved[key], &merged[base_key]),
            0.0,
            "{key}: merged"
        );
    }
    let dir = tmpdir("modules-to-save-refused");
    for (extra, needles) in [
        (
            &["model.modules_to_save=[q_proj]"][..],
            &["modules_to_save", "q_proj"][..],
        ),
        (
            &[
                "model.modules_to_save=[embed_tokens]",
                "model.apply_lora_to_embeddings=true",
            ][..],
            &["modules_to_save", "adapter"][..],
        ),
    ] {
        let out = one_lora_step(&dir, "llama3", extra);
        assert!(!out.status.success());
        for n in needles {
            assert!(text(&out).contains(n), "{extra:?}: {}", text(&out));
        }
    }
}

/// `model.lora_bias` gives every adapter PEFT's `lora_B.bias` (zero at first, trained like B):
/// the saved adapter holds moved biases under PEFT's names with `lora_bias: true`, the merged
/// model's biases are the base's plus the scaled LoRA biases, and a torchtune checkpointer skips
/// the `adapter_model.pt` it cannot hold, saying so.
#[test]
fn lora_bias_trains_biases_on_the_adapters() {
    let (saved_dir, config) =
        one_lora_step_without_torchtune_adapter("lora-bias", "qwen2", &["model.lora_bias=true"]);
    assert_eq!(config["lora_bias"], Value::Bool(true));
    let saved = load(&saved_dir.join("adapter_model.safetensors"));
    let merged = load(&saved_dir.join("merged/model.safetensors"));
    let base = load(&fixtures().join("qwen2/model/model.safetensors"));
    let scale = 8.0 / 4.0;
    for layer in 0..2 {
        for proj in ["q_proj", "v_proj"] {
            let module = format!("model.layers.{layer}.self_attn.{proj}");
            let bias = &saved[&format!("base_model.model.{module}.lora_B.bias")];
            let moved = bias.abs().unwrap().max_all().unwrap();
            assert!(moved.to_scalar::<f32>().unwrap() > 0.0, "{module}");
            let key = format!("{module}.bias");
            let want = (&base[&key] + (bias * scale).unwrap()).unwrap();
            assert!(rel_l2(&merged[&key], &want) <= 1e-6, "{key}");
        }
    }
}

/// LoRA on a mixture of experts' MLPs (Qwen2-MoE: experts, shared expert) also writes the adapter
/// as PEFT holds it on transformers 5 (`transformers5/`: fused experts as `target_parameters`),
/// and ferrotune generates the same tokens from either folder.
#[test]
fn expert_adapters_are_also_written_for_transformers_5() {
    let family = "models/qwen2_moe";
    let dir = tmpdir("lora-moe-t5");
    let data = dir.join("batch.jsonl");
    write_golden_rows(family, &data);
    let cfg = write_config(&dir, family, &data);
    let out = ferrotune(
        &[
            "run",
            "lora_finetune_single_device",
            "--config",
            cfg.to_str().unwrap(),
            "model.apply_lora_to_mlp=true",
            "optimizer.lr=0.05",
            "max_steps_per_epoch=1",
        ],
        &dir,
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
    let saved = dir.join("out/epoch_0");
    let t5 = saved.join("transformers5");
    let config: Value = read_json(t5.join("adapter_config.json"));
    let params = config["target_parameters"].to_string();
    assert!(params.contains("experts.gate_up_proj"), "{params}");
    assert!(params.contains("shared_expert.up_proj.weight"), "{params}");
    let model = fixtures().join(family).join("model");
    let tokens = |adapter: &Path| -> Value {
        let out = ferrotune(
            &[
                "generate",
                "--model",
                model.to_str().unwrap(),
                "--adapter",
                adapter.to_str().unwrap(),
                "--prompt-ids",
                "5,6,7,8",
                "--max-new-tokens",
                "12",
                "--json",
            ],
            &dir,
            &[],
        );
        assert!(out.status.success(), "{}", text(&out));
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let last = stdout.lines().last().unwrap().to_string();
        serde_json::from_str::<Value>(&last).unwrap()["new_token_ids"].clone()
    };
    assert_eq!(tokens(&saved), tokens(&t5));
}

/// Gemma 2, VaultGemma, Gemma 3, Gemma 4, Phi-2 and the MoE families (Phi-3.5-MoE's sparsemixer and Llama 4's fused experts included) end to end: one full fine-tuning SGD step (lr 1) from the tiny
/// fixtures logs transformers' loss and saves, under the checkpoint's own names, weights that
/// moved by exactly PyTorch's gradient (softcapped scores and logits, sandwich norms, q/k norms,
/// the local rope, LayerNorm, the parallel block all in the backward).
#[test]
fn one_full_sgd_step_on_gemma_2_3_and_phi_2_moves_every_weight_by_the_torch_gradient() {
    // (fixture, the text case whose gradients apply): a multimodal Gemma 3 trains its text model.
    for (family, text_case) in [
        ("models/gemma2", "models/gemma2"),
        ("models/vaultgemma", "models/vaultgemma"),
        ("models/gemma3", "models/gemma3"),
        ("models/gemma3_multimodal", "models/gemma3"),
        ("models/phi2", "models/phi2"),
        // A tied head with its own bias: the bias trains, the embedding gets both gradients.
        ("models/phi2_tied", "models/phi2_tied"),
        ("models/mixtral", "models/mixtral"),
        ("models/qwen2_moe", "models/qwen2_moe"),
        ("models/phimoe", "models/phimoe"),
        // Llama 4: saved with its experts fused again (`feed_forward.experts.gate_up_proj`).
        ("models/llama4", "models/llama4"),
        ("models/llama4_multimodal", "models/llama4"),
        // Gemma 4: the dense shape, and the E-model shape (per-layer embeddings, shared keys and
        // values: the whole graph kept although the config checkpoints activations) also from
        // the multimodal checkpoint; the layer_scalar buffers are saved back untrained.
        ("models/gemma4", "models/gemma4"),
        ("models/gemma4_e2b_like", "models/gemma4_e2b_like"),
        ("models/gemma4_multimodal", "models/gemma4_e2b_like"),
        // Gemma 4's mixture of experts: saved with its experts fused again
        // (`experts.gate_up_proj`); the router's scales train.
        ("models/gemma4_moe", "models/gemma4_moe"),
        ("models/gemma4_moe_multimodal", "models/gemma4_moe"),
        // DeepSeek: latent attention and group-limited routing; V3's e_score_correction_bias
        // buffers are saved back untrained.
        ("models/deepseek_v3", "models/deepseek_v3"),
        ("models/deepseek_v2", "models/deepseek_v2"),
    ] {
        let dir = tmpdir(&format!("full-sgd-{}", family.replace('/', "-")));
        let data = dir.join("batch.jsonl");
        write_golden_rows(family, &data);
        let cfg = write_config(&dir, family, &data);
        // Gemma 4 asked to checkpoint activations: the E-model shape warns and keeps the graph.
        let checkpointing = format!(
            "enable_activation_checkpointing={}",
            family.contains("gemma4")
        );
        let out = ferrotune(
            &[
                "run",
                "full_finetune_single_device",
                "--config",
                cfg.to_str().unwrap(),
                "optimizer._component_=torch.optim.SGD",
                "optimizer.lr=1.0",
                "optimizer.weight_decay=0.0",
                "clip_grad_norm=null",
                "max_steps_per_epoch=1",
                &checkpointing,
            ],
            &dir,
            &[],
        );
        assert!(out.status.success(), "{family}: {}", text(&out));
        if family.contains("gemma4_") && !family.contains("moe") {
            assert!(
                text(&out).contains("enable_activation_checkpointing is not applied"),
                "{family}: {}",
                text(&out)
            );
        }
        let saved = load(&dir.join("out/epoch_0/model.safetensors"));
        let start = load(&fixtures().join(text_case).join("model/model.safetensors"));
        let grads = load(&fixtures().join(text_case).join("grads.safetensors"));
        assert_eq!(saved.len(), start.len(), "{family}: saved tensor set");
        for (key, s) in &start {
            let moved = (s - &saved[key]).unwrap();
            match grads.get(key) {
                Some(grad) => {
                    let e = rel_l2(&moved, grad);
                    assert!(e <= 1e-4, "{family}: {key}: relative L2 {e}");
                }
                // A buffer (Gemma 4's layer_scalar): saved as it was.
                None => {
                    let most = moved.abs().unwrap().max_all().unwrap();
                    assert_eq!(
                        most.to_scalar::<f32>().unwrap(),
                        0.0,
                        "{family}: {key} moved"
                    );
                }
            }
        }
        // What is saved is the text model, as transformers' Gemma3ForCausalLM / Gemma2ForCausalLM.
        let saved_config: Value = read_json(dir.join("out/epoch_0/config.json"));
        let want_type = match family {
            "models/gemma2" => "gemma2",
            "models/vaultgemma" => "vaultgemma",
            "models/phi2" | "models/phi2_tied" => "phi",
            "models/mixtral" => "mixtral",
            "models/qwen2_moe" => "qwen2_moe",
            "models/phimoe" => "phimoe",
            "models/llama4" | "models/llama4_multimodal" => "llama4_text",
            "models/gemma4"
            | "models/gemma4_e2b_like"
            | "models/gemma4_multimodal"
            | "models/gemma4_moe"
            | "models/gemma4_moe_multimodal" => "gemma4_text",
            "models/deepseek_v3" => "deepseek_v3",
            "models/deepseek_v2" => "deepseek_v2",
            _ => "gemma3_text",
        };
        assert_eq!(saved_config["model_type"], want_type, "{family}");
        let metrics = std::fs::read_to_string(dir.join("out/logs/metrics.jsonl")).unwrap();
        let first: Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
        let g: Value = read_json(fixtures().join(text_case).join("golden.json"));
        let (got, want) = (first["loss"].as_f64().unwrap(), g["loss"].as_f64().unwrap());
        assert!(
            ((got - want) / want).abs() < 1e-5,
            "{family}: logged loss {got} vs transformers {want}"
        );
    }
}

#[test]
fn resume_after_kill_is_step_exact() {
    // LoRA also with the embedding and head trained in full beside it (`modules_to_save`).
    let cases: [(&str, &[&str]); 3] = [
        ("lora_finetune_single_device", &[]),
        (
            "lora_finetune_single_device",
            &["model.modules_to_save=[embed_tokens,lm_head]"],
        ),
        ("full_finetune_single_device", &[]),
    ];
    for (case, (recipe, settings)) in cases.into_iter().enumerate() {
        let dir = tmpdir(&format!("resume-{case}-{recipe}"));
        // 12 rows, batch 2 → 6 steps per epoch, 2 epochs; shuffled, with dropout and a schedule so
        // that data order, RNG and scheduler state all matter.
        let data = dir.join("rows.jsonl");
        let mut lines = Vec::new();
        for i in 0..12u32 {
            let ids: Vec<u32> = (0..10).map(|j| (i * 31 + j * 7) % 500 + 3).collect();
            lines.push(serde_json::json!({"input_ids": ids}).to_string());
        }
        std::fs::write(&data, lines.join("\n")).unwrap();
        let cfg = write_config(&dir, "llama3", &data);
        let common = [
            "shuffle=true",
            "epochs=2",
            "model.lora_dropout=0.1",
            "lr_scheduler._component_=torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "lr_scheduler.num_warmup_steps=2",
            "save_every_n_steps=4",
        ];
        let run = |out_dir: &Path, extra: &[&str], env: &[(&str, &str)]| -> Output {
            let mut args = vec![
                "run".to_string(),
                recipe.to_string(),
                "--config".into(),
                cfg.display().to_string(),
                format!("output_dir={}", out_dir.display()),
            ];
            args.extend(common.iter().map(|s| s.to_string()));
            args.extend(settings.iter().map(|s| s.to_string()));
            args.extend(extra.iter().map(|s| s.to_string()));
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            ferrotune(&refs, &dir, env)
        };
        let straight = dir.join("straight");
        let o = run(&straight, &[], &[]);
        assert!(o.status.success(), "{}", text(&o));
        let want = metrics_lines(&straight.join("logs/metrics.jsonl"));
        assert_eq!(want.len(), 12, "{recipe}: 12 steps logged");

        // Killed with SIGKILL right after step 7 (after the step-4 checkpoint, mid-epoch 2).
        let killed = dir.join("killed");
        let o = run(&killed, &[], &[("FERROTUNE_KILL_AFTER_STEP", "7")]);
        assert!(
            !o.status.success(),
            "{recipe}: the run should have been killed"
        );
        assert!(killed.join("step_4/recipe_state/state.json").is_file());
        let o = run(&killed, &["resume_from_checkpoint=true"], &[]);
        assert!(o.status.success(), "{}", text(&o));
        let got = metrics_lines(&killed.join("logs/metrics.jsonl"));
        assert_eq!(losses(&got), losses(&want), "{recipe}: resumed run differs");
        // The final checkpoints agree too.
        let files: &[&str] = if recipe.starts_with("lora") {
            &["adapter_model.safetensors", "merged/model.safetensors"]
        } else {
            &["model.safetensors"]
        };
        for f in files {
            let a = load(&straight.join("epoch_1").join(f));
            let b = load(&killed.join("epoch_1").join(f));
            for (k, t) in &a {
                let d = (t - &b[k])
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert_eq!(d, 0.0, "{recipe}: {f}: {k} differs after resume");
            }
        }
    }
}

#[test]
fn validate_names_bad_keys_and_types() {
    let dir = tmpdir("validate");
    let cases = [
        ("lr_shceduler:\n  num_warmup_steps: 3\n", "lr_scheduler"),
        ("batch_sise: 4\n", "batch_size"),
        ("optimizer:\n  lrr: 0.1\n", "optimizer.lr"),
        ("batch_size: many\n", "must be an integer"),
        ("dataset:\n  packed: maybe\n", "must be a boolean"),
        // Components are resolved as torchtune's validate resolves them, without any file.
        (
            "optimizer:\n  _component_: torch.optim.Adamw\n  lr: 0.1\n",
            "'torch.optim.Adamw' is not supported",
        ),
        (
            "dataset:\n  _component_: torchtune.datasets.alpaca_datset\n",
            "unknown dataset _component_ 'torchtune.datasets.alpaca_datset'",
        ),
        (
            "dataset:\n  - _component_: alpaca_dataset\n  - _component_: chat_dataset\n    conversation_style: json\n",
            "dataset 2: dataset conversation_style 'json'",
        ),
        ("dataset:\n  _component_: alpaca_dataset\n  split: train[:x]\n", "bad split 'train[:x]'"),
        ("loss:\n  _component_: torch.nn.MSELoss\n", "'torch.nn.MSELoss' is not supported"),
        ("lr_scheduler:\n  _component_: cosine\n", "'cosine' is not supported"),
        (
            "metric_logger:\n  _component_: torchtune.training.metric_logging.WandBLogger\n  tracking_uri: x\n",
            "metric_logger.tracking_uri: not an option of WandBLogger",
        ),
        ("device: tpu\n", "unknown device 'tpu'"),
        ("dtype: fp16\n", "fp16 training is not supported"),
    ];
    for (yaml, expect) in cases {
        let path = dir.join("bad.yaml");
        std::fs::write(&path, format!("output_dir: /tmp/x\n{yaml}")).unwrap();
        let out = ferrotune(&["validate", path.to_str().unwrap()], &dir, &[]);
        assert_eq!(out.status.code(), Some(1), "{yaml}: {}", text(&out));
        let t = text(&out);
        assert!(t.contains(expect), "{yaml}: expected '{expect}' in: {t}");
        assert!(!t.contains("panicked"), "{t}");
    }
    // What torchtune's own configs name validates: bitsandbytes' optimizers, DPO's loss, a GPU.
    let fine = dir.join("fine.yaml");
    std::fs::write(
        &fine,
        "output_dir: /tmp/x\ndevice: cuda:1\ndtype: bf16\noptimizer:\n  _component_: \
         bitsandbytes.optim.PagedAdamW8bit\n  lr: 2e-5\nloss:\n  _component_: \
         torchtune.rlhf.loss.DPOLoss\ndataset:\n  _component_: torchtune.datasets.slimorca_dataset\n",
    )
    .unwrap();
    let out = ferrotune(&["validate", fine.to_str().unwrap()], &dir, &[]);
    assert!(out.status.success(), "{}", text(&out));
    // torchtune's tensor-parallel keys validate; a dimension above 1 is refused when run.
    let tp = dir.join("tp.yaml");
    std::fs::write(
        &tp,
        "output_dir: /tmp/x\ntensor_parallel_dim: 2\ntensor_parallel_plan:\n  \
         _component_: torchtune.models.llama3.base_llama_tp_plan\n",
    )
    .unwrap();
    let out = ferrotune(&["validate", tp.to_str().unwrap()], &dir, &[]);
    assert!(out.status.success(), "{}", text(&out));
    let out = ferrotune(
        &[
            "run",
            "full_finetune_single_device",
            "--config",
            tp.to_str().unwrap(),
        ],
        &dir,
        &[],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out).contains("tensor_parallel_dim: 2 is not supported"),
        "{}",
        text(&out)
    );
    // Every built-in config validates.
    let out = ferrotune(&["ls"], &dir, &[]);
    assert!(out.status.success());
    let listing = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(listing.starts_with("RECIPE"));
    let mut n = 0;
    for line in listing.lines().skip(1) {
        let Some(name) = line.split_whitespace().last() else {
            continue;
        };
        if !name.contains('/') && !name.starts_with("generation") {
            continue;
        }
        let out = ferrotune(&["validate", name], &dir, &[]);
        assert!(out.status.success(), "{name}: {}", text(&out));
        n += 1;
    }
    assert!(n >= 20, "only {n} built-in configs listed");
}

/// `validate` refuses what `run` refuses in a recipe's own settings, with `run`'s message: a
/// negative `batch_size` or `max_steps_per_epoch` (integers to the key check, but not counts),
/// and an empty file (no `output_dir`). With `--recipe`, the named recipe's settings are checked.
#[test]
fn validate_refuses_what_run_refuses() {
    let dir = tmpdir("validate-run");
    let data = dir.join("rows.jsonl");
    write_golden_rows("llama3", &data);
    let cfg = std::fs::read_to_string(write_config(&dir, "llama3", &data)).unwrap();
    let cases = [
        ("batch_size", cfg.replace("batch_size: 2", "batch_size: -1")),
        ("max_steps", format!("{cfg}max_steps_per_epoch: -5\n")),
        ("empty", String::new()),
    ];
    for (case, yaml) in cases {
        let path = dir.join(format!("{case}.yaml"));
        std::fs::write(&path, yaml).unwrap();
        let path = path.to_str().unwrap();
        let run = ferrotune(
            &["run", "lora_finetune_single_device", "--config", path],
            &dir,
            &[],
        );
        assert_eq!(run.status.code(), Some(1), "{case}: {}", text(&run));
        let run_text = text(&run);
        let message = run_text
            .lines()
            .find_map(|l| l.strip_prefix("error: "))
            .unwrap_or_else(|| panic!("{case}: no error line in {run_text}"));
        for args in [
            vec!["validate", path],
            vec!["validate", path, "--recipe", "lora_finetune_single_device"],
        ] {
            let out = ferrotune(&args, &dir, &[]);
            assert_eq!(out.status.code(), Some(1), "{case}: {}", text(&out));
            assert!(
                text(&out).contains(message),
                "{case}: validate should say '{message}': {}",
                text(&out)
            );
        }
    }
    let out = ferrotune(
        &[
            "validate",
            "generation",
            "--recipe",
            "lora_finetune_singel_device",
        ],
        &dir,
        &[],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out).contains("did you mean 'lora_finetune_single_device'?"),
        "{}",
        text(&out)
    );
}

#[test]
fn cp_copies_a_builtin_config_that_runs_with_overrides() {
    let dir = tmpdir("cp");
    let out = ferrotune(
        &["cp", "smollm2/135M_lora_single_device", "mine.yaml"],
        &dir,
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
    let copied = std::fs::read_to_string(dir.join("mine.yaml")).unwrap();
    assert!(copied.contains("lora_finetune_single_device"));
    let out = ferrotune(&["validate", "mine.yaml"], &dir, &[]);
    assert!(out.status.success(), "{}", text(&out));
    let out = ferrotune(
        &["cp", "smollm2/135M_lora_single_devic", "x.yaml"],
        &dir,
        &[],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("did you mean 'smollm2/135M_lora_single_device'"));
    let out = ferrotune(
        &[
            "run",
            "--nproc-per-node",
            "2",
            "lora_finetune_distributed",
            "--config",
            "mine.yaml",
        ],
        &dir,
        &[],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("distributed"), "{}", text(&out));
    // A one-process recipe is refused before any rank starts (each would repeat the whole run).
    let out = ferrotune(
        &[
            "run",
            "--nproc-per-node",
            "2",
            "generate",
            "--config",
            "mine.yaml",
        ],
        &dir,
        &[],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out).contains("recipe generate runs as one process, but 2 were asked for"),
        "{}",
        text(&out)
    );
}

#[test]
fn eval_recipe_reports_the_peft_loss_and_generate_recipe_matches_the_generate_verb() {
    let dir = tmpdir("eval-generate");
    let data = dir.join("batch.jsonl");
    write_golden_rows("llama3", &data);
    let cfg = write_config(&dir, "llama3", &data);
    let adapter = fixtures().join("llama3/adapter");
    let v = eval_result(&dir, &cfg, &adapter, &[]);
    let g: Value = read_json(fixtures().join("llama3/golden.json"));
    let want = g["lora_loss"].as_f64().unwrap();
    let got = v["loss"].as_f64().unwrap();
    assert!(
        ((got - want) / want).abs() < 1e-5,
        "eval loss {got} vs PEFT {want}"
    );
    assert!((v["perplexity"].as_f64().unwrap() - want.exp()).abs() / want.exp() < 1e-5);

    // A generation recipe with the prompt override `prompt`, greedy, 8 new tokens.
    let run_greedy = |recipe: &str, prompt: &str| {
        let out = ferrotune(
            &[
                "run",
                recipe,
                "--config",
                cfg.to_str().unwrap(),
                prompt,
                "temperature=0",
                "max_new_tokens=8",
            ],
            &dir,
            &[],
        );
        assert!(out.status.success(), "{recipe} {prompt}: {}", text(&out));
        out
    };

    // `run generate` with a string prompt, greedy, equals the generate verb's continuation.
    let model = fixtures().join("llama3/model");
    let out = run_greedy("generate", "prompt=Hello there");
    let recipe_text = String::from_utf8_lossy(&out.stdout).trim_end().to_string();
    let out = ferrotune(
        &[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "Hello there",
            "--max-new-tokens",
            "8",
        ],
        &dir,
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
    let verb_text = String::from_utf8_lossy(&out.stdout).trim_end().to_string();
    assert!(
        recipe_text.starts_with("Hello there") && recipe_text.ends_with(&verb_text),
        "recipe printed {recipe_text:?}, generate printed {verb_text:?}"
    );

    // A chat prompt, with the user turn as a string or as generate_v2's `{text: ...}`.
    let chat =
        |prompt: &str| String::from_utf8_lossy(&run_greedy("generate", prompt).stdout).to_string();
    let plain = chat("prompt={system: Be brief., user: Hello there}");
    assert!(plain.contains("Hello there"), "{plain}");
    assert_eq!(
        chat("prompt={system: Be brief., user: {text: Hello there}}"),
        plain
    );

    // dev/generate_v2 (and its one-process distributed form) print the response alone, the
    // continuation `generate` printed after the prompt, and log the bandwidth achieved.
    for recipe in ["dev/generate_v2", "dev/generate_v2_distributed"] {
        let out = run_greedy(recipe, "prompt=Hello there");
        let response = String::from_utf8_lossy(&out.stdout).trim_end().to_string();
        assert!(
            !response.is_empty() && !response.contains("Hello there"),
            "{recipe} printed {response:?}"
        );
        assert!(
            recipe_text.ends_with(&response),
            "{recipe} printed {response:?}, generate {recipe_text:?}"
        );
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(log.contains("Bandwidth achieved: "), "{log}");
    }
}

/// torchtune's `log_level` key: INFO shows the tokenizer line torchtune users see, ERROR hides it,
/// `RUST_LOG` overrides the config, and an unknown level is an error naming the key.
#[test]
fn log_level_sets_what_the_run_reports() {
    let dir = tmpdir("log-level");
    let data = dir.join("batch.jsonl");
    write_golden_rows("llama3", &data);
    let cfg = write_config(&dir, "llama3", &data);
    let run = |level: &str, env: &[(&str, &str)]| -> Output {
        ferrotune(
            &[
                "run",
                "lora_finetune_single_device",
                "--config",
                cfg.to_str().unwrap(),
                &format!("log_level={level}"),
                "max_steps_per_epoch=1",
                // Each run starts afresh in the same folder.
                "overwrite_output_dir=true",
            ],
            &dir,
            env,
        )
    };
    let line = "Tokenizer is initialized from";
    let o = run("INFO", &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains(line), "{}", text(&o));
    let o = run("ERROR", &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains(line), "{}", text(&o));
    let o = run("INFO", &[("RUST_LOG", "error")]);
    assert!(!text(&o).contains(line), "RUST_LOG decides: {}", text(&o));
    let o = run("LOUD", &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("log_level"), "{}", text(&o));
}

/// torchtune's validation keys: with `run_val_every_n_steps` every N optimizer steps the model is
/// scored on `dataset_val` (in `batch_size_val` rows) and `val_loss` is logged. From a PEFT
/// adapter with a zero learning rate that is PEFT's loss on the same rows; without
/// `dataset_val` the run stops with torchtune's message.
#[test]
fn validation_every_n_steps_logs_the_val_loss() {
    let dir = tmpdir("validation");
    let data = dir.join("batch.jsonl");
    write_golden_rows("llama3", &data);
    let cfg = write_config(&dir, "llama3", &data);
    let adapter = fixtures().join("llama3/adapter");
    let args = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "run",
            "lora_finetune_single_device",
            "--config",
            cfg.to_str().unwrap(),
            "optimizer._component_=torch.optim.SGD",
            "optimizer.lr=0.0",
            "optimizer.weight_decay=0.0",
            "batch_size=1",
            "run_val_every_n_steps=1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.push(format!(
            "checkpointer.adapter_checkpoint={}",
            adapter.display()
        ));
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let val = [
        "dataset_val._component_=torchtune.datasets.tokenized_dataset".to_string(),
        "dataset_val.source=json".to_string(),
        format!("dataset_val.data_files={}", data.display()),
        "batch_size_val=2".to_string(),
    ];
    let with_val: Vec<&str> = val.iter().map(String::as_str).collect();
    let o = common::ferrotune(&args(&with_val), &dir, &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("Validation loss:"), "{}", text(&o));
    let metrics = std::fs::read_to_string(dir.join("out/logs/metrics.jsonl")).unwrap();
    let vals: Vec<f64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter_map(|v| v.get("val_loss").and_then(Value::as_f64))
        .collect();
    assert_eq!(vals.len(), 2, "one val_loss per step (2 steps): {metrics}");
    let g: Value = read_json(fixtures().join("llama3/golden.json"));
    let want = g["lora_loss"].as_f64().unwrap();
    for v in vals {
        assert!(
            ((v - want) / want).abs() < 1e-5,
            "val_loss {v} vs PEFT {want}"
        );
    }
    let o = common::ferrotune(&args(&[]), &dir, &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).contains("run_val_every_n_steps is set but dataset_val is not configured"),
        "{}",
        text(&o)
    );
}

/// torchtune's `checkpointer.keep_last_n_checkpoints`: after each save only the newest N
/// `epoch_*` folders stay (other folders untouched); 0 is an error naming the key.
#[test]
fn keep_last_n_checkpoints_prunes_older_epochs() {
    let dir = tmpdir("keep-last");
    let data = dir.join("batch.jsonl");
    write_golden_rows("llama3", &data);
    let cfg = write_config(&dir, "llama3", &data);
    std::fs::create_dir_all(dir.join("out/notes")).unwrap();
    let run = |keep: &str| -> Output {
        ferrotune(
            &[
                "run",
                "lora_finetune_single_device",
                "--config",
                cfg.to_str().unwrap(),
                "epochs=3",
                &format!("checkpointer.keep_last_n_checkpoints={keep}"),
            ],
            &dir,
            &[],
        )
    };
    let o = run("2");
    assert!(o.status.success(), "{}", text(&o));
    let mut left: Vec<String> = std::fs::read_dir(dir.join("out"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        ["config.yaml", "epoch_1", "epoch_2", "logs", "notes"],
        "{left:?}"
    );
    let o = run("0");
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("keep_last_n_checkpoints"), "{}", text(&o));
}

/// QLoRA through the recipe: a `qlora_*` builder quantizes every decoder-layer linear to NF4
/// (torchao's format); one SGD step (lr 1) from a PEFT adapter then logs the loss of the torchao +
/// PEFT reference and saves `start − gradient` with the reference's gradients; the merged
/// checkpoint holds the dequantized base (plus the adapter's delta where there is one).
#[test]
fn qlora_builder_trains_on_an_nf4_base_as_torchao_and_peft() {
    let case = fixtures().join("nf4/qlora");
    let dir = tmpdir("qlora-sgd");
    let data = dir.join("batch.jsonl");
    write_golden_rows("nf4/qlora", &data);
    let cfg = write_config(&dir, "nf4/qlora", &data);
    let adapter = case.join("adapter");
    let out = ferrotune(
        &[
            "run",
            "lora_finetune_single_device",
            "--config",
            cfg.to_str().unwrap(),
            "model._component_=torchtune.models.llama3_1.qlora_llama3_1_8b",
            &format!("checkpointer.adapter_checkpoint={}", adapter.display()),
        ]
        .into_iter()
        .chain(ONE_SGD_STEP)
        .collect::<Vec<_>>(),
        &dir,
        &[],
    );
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("QLoRA: 14 linear layers quantized to NF4"),
        "{log}"
    );
    let g: Value = read_json(case.join("golden.json"));
    let want_loss = g["loss"].as_f64().unwrap();
    let got_loss = losses(&metrics_lines(&dir.join("out/logs/metrics.jsonl")))[0].1;
    assert!(
        ((got_loss - want_loss) / want_loss).abs() < 1e-5,
        "logged loss {got_loss} vs torchao + PEFT {want_loss}"
    );
    // The eval recipe with the same builder scores the adapter on the NF4 base too.
    let qlora = "model._component_=torchtune.models.llama3_1.qlora_llama3_1_8b";
    let eval_loss = eval_result(&dir, &cfg, &adapter, &[qlora])["loss"]
        .as_f64()
        .unwrap();
    assert!(
        ((eval_loss - want_loss) / want_loss).abs() < 1e-5,
        "eval loss {eval_loss} vs torchao + PEFT {want_loss}"
    );
    let saved_dir = dir.join("out/epoch_0");
    assert_start_minus_gradient(
        &saved_dir.join("adapter_model.safetensors"),
        &adapter.join("adapter_model.safetensors"),
        &case.join("lora_grads.safetensors"),
    );
    // The merged k_proj (no adapter) is the NF4 round trip of the base: not the base, but close.
    let merged = load(&saved_dir.join("merged/model.safetensors"));
    let base = load(&case.join("model/model.safetensors"));
    let key = "model.layers.0.self_attn.k_proj.weight";
    let base_k = base[key].to_dtype(candle_core::DType::F32).unwrap();
    let diff = rel_l2(&merged[key], &base_k);
    assert!(
        diff > 1e-3 && diff < 0.2,
        "NF4 round trip moved k_proj by {diff}"
    );
    assert_eq!(
        merged["lm_head.weight"].to_vec2::<f32>().unwrap(),
        base["lm_head.weight"]
            .to_dtype(candle_core::DType::F32)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap()
    );
}

/// torchtune's `knowledge_distillation_single_device`: a LoRA student learns from the labels and a
/// frozen teacher (kd_ratio 0.3, forward KL). One SGD step (lr 1) from a PEFT adapter logs the
/// reference's loss, class_loss and kd_loss, and saves `start − gradient` with the gradient of the
/// mixed loss computed with PyTorch + PEFT (scripts/make_kd_fixtures.py).
#[test]
fn knowledge_distillation_step_matches_torchtunes_losses_and_gradients() {
    let dir = tmpdir("kd-sgd");
    let data = dir.join("batch.jsonl");
    write_golden_rows("llama3", &data);
    let cfg = write_config(&dir, "llama3", &data);
    let adapter = fixtures().join("llama3/adapter");
    let teacher = fixtures().join("kd/teacher");
    let out = ferrotune(
        &[
            "run",
            "knowledge_distillation_single_device",
            "--config",
            cfg.to_str().unwrap(),
            &format!("checkpointer.adapter_checkpoint={}", adapter.display()),
            "teacher_model._component_=torchtune.models.llama3_2.llama3_2_1b",
            &format!("teacher_checkpointer.checkpoint_dir={}", teacher.display()),
            "kd_loss._component_=torchtune.modules.loss.ForwardKLWithChunkedOutputLoss",
            "kd_ratio=0.3",
        ]
        .into_iter()
        .chain(ONE_SGD_STEP)
        .collect::<Vec<_>>(),
        &dir,
        &[],
    );
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("Teacher "), "{log}");
    let want: Value = read_json(fixtures().join("kd/golden.json"));
    let first = &metrics_lines(&dir.join("out/logs/metrics.jsonl"))[0];
    for key in ["loss", "class_loss", "kd_loss"] {
        let (got, w) = (
            first[key].as_f64().unwrap(),
            want["forward"][key].as_f64().unwrap(),
        );
        assert!(((got - w) / w).abs() < 1e-5, "{key}: {got} vs {w}");
    }
    assert_start_minus_gradient(
        &dir.join("out/epoch_0/adapter_model.safetensors"),
        &adapter.join("adapter_model.safetensors"),
        &fixtures().join("kd/forward_grads.safetensors"),
    );
    // A teacher of another vocabulary is refused, naming both sizes.
    let out = ferrotune(
        &[
            "run",
            "knowledge_distillation_single_device",
            "--config",
            cfg.to_str().unwrap(),
            &format!(
                "teacher_checkpointer.checkpoint_dir={}",
                fixtures().join("nf4/qlora/model").display()
            ),
            "max_steps_per_epoch=1",
            "overwrite_output_dir=true",
        ],
        &dir,
        &[],
    );
    assert!(!out.status.success());
    assert!(
        text(&out).contains("vocabulary of 256 tokens, the student 512"),
        "{}",
        text(&out)
    );
}

/// torchtune's `lora_dpo_single_device`: the policy is the model with its LoRA adapter, the
/// reference the same model with the adapter disabled. One SGD step (lr 1) from a PEFT adapter on
/// two pre-tokenized pairs logs the loss and torchtune's reward/log-prob/logit metrics computed
/// with PyTorch + PEFT (scripts/make_dpo_fixtures.py) and saves `start − gradient`; one pair per
/// micro-batch with 2 accumulation steps gives the same step; RSOLoss likewise.
#[test]
fn lora_dpo_step_matches_torchtunes_loss_metrics_and_gradients() {
    let dir = tmpdir("dpo-sgd");
    let data = fixtures().join("dpo/pairs.jsonl");
    let cfg = write_config(&dir, "llama3", &data);
    let adapter = fixtures().join("llama3/adapter");
    let want: Value = read_json(fixtures().join("dpo/golden.json"));
    let cases: [(&str, &[&str], &[&str]); 3] = [
        (
            "dpo",
            &[
                "loss._component_=torchtune.rlhf.loss.DPOLoss",
                "loss.beta=0.3",
                "loss.label_smoothing=0.2",
            ],
            &[],
        ),
        (
            "dpo",
            &[
                "loss._component_=torchtune.rlhf.loss.DPOLoss",
                "loss.beta=0.3",
                "loss.label_smoothing=0.2",
            ],
            &["batch_size=1", "gradient_accumulation_steps=2"],
        ),
        (
            "rso",
            &[
                "loss._component_=torchtune.rlhf.loss.RSOLoss",
                "loss.gamma=0.4",
            ],
            &[],
        ),
    ];
    for (i, (name, loss, batching)) in cases.into_iter().enumerate() {
        let out_dir = dir.join(format!("out{i}"));
        let mut args = vec![
            "run".to_string(),
            "lora_dpo_single_device".into(),
            "--config".into(),
            cfg.display().to_string(),
            format!("output_dir={}", out_dir.display()),
            format!("checkpointer.adapter_checkpoint={}", adapter.display()),
        ];
        args.extend(
            loss.iter()
                .chain(&ONE_SGD_STEP)
                .chain(batching)
                .map(|s| s.to_string()),
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = ferrotune(&args, &dir, &[]);
        let log = text(&out);
        assert!(out.status.success(), "{log}");
        let first = &metrics_lines(&out_dir.join("logs/metrics.jsonl"))[0];
        for (key, tol) in [
            ("loss", 1e-5),
            ("log_probs/chosen", 1e-5),
            ("log_probs/rejected", 1e-5),
            ("logits/chosen", 1e-3),
            ("logits/rejected", 1e-3),
        ] {
            if key.starts_with("logits/") && !batching.is_empty() {
                // The mean logit covers padding positions, which one pair per batch has none of.
                continue;
            }
            let (got, w) = (
                first[key].as_f64().unwrap(),
                want[name][key].as_f64().unwrap(),
            );
            assert!(
                ((got - w) / w).abs() < tol,
                "{name} {batching:?}: {key} {got} vs {w}"
            );
        }
        for key in [
            "rewards/chosen",
            "rewards/rejected",
            "rewards/margins",
            "rewards/accuracies",
        ] {
            let (got, w) = (
                first[key].as_f64().unwrap(),
                want[name][key].as_f64().unwrap(),
            );
            // Scaled differences of f32 sums near -85: a few of their ulps (7.6e-6).
            assert!(
                (got - w).abs() < 2e-5,
                "{name} {batching:?}: {key} {got} vs {w}"
            );
        }
        assert_start_minus_gradient(
            &out_dir.join("epoch_0/adapter_model.safetensors"),
            &adapter.join("adapter_model.safetensors"),
            &fixtures().join(format!("dpo/{name}_grads.safetensors")),
        );
    }

    // Single sequences are refused by the DPO recipes, preference losses by the SFT recipes.
    let rows = dir.join("rows.jsonl");
    write_golden_rows("llama3", &rows);
    let refused = |recipe: &str, overrides: &[&str], needle: &str| {
        let mut args = vec!["run", recipe, "--config", cfg.to_str().unwrap()];
        args.extend(overrides);
        let out = ferrotune(&args, &dir, &[]);
        assert!(!out.status.success(), "{recipe} {overrides:?}");
        assert!(text(&out).contains(needle), "{}", text(&out));
    };
    let dpo_loss = "loss._component_=torchtune.rlhf.loss.DPOLoss";
    refused(
        "lora_dpo_single_device",
        &[&format!("dataset.data_files={}", rows.display()), dpo_loss],
        "the rows are single sequences",
    );
    refused(
        "lora_finetune_single_device",
        &[dpo_loss],
        "is a preference loss",
    );
    refused(
        "lora_finetune_single_device",
        &[],
        "which only the DPO recipes train on",
    );
}

/// TRL's ORPO, SimPO, CPO (reference-free) and IPO losses in `lora_dpo_single_device`: one SGD
/// step (lr 1) from the PEFT adapter on the DPO fixture pairs logs the loss and TRL's metrics
/// (scripts/make_prefloss_fixtures.py, TRL 1.16.0's formulas) and saves `start − gradient`; the
/// reference-free losses say they load no reference model. A parameter the loss does not take,
/// and an unknown loss, are refused naming the key.
#[test]
fn lora_trl_preference_losses_step_as_trl() {
    let dir = tmpdir("prefloss-sgd");
    let data = fixtures().join("dpo/pairs.jsonl");
    let cfg = write_config(&dir, "llama3", &data);
    let adapter = fixtures().join("llama3/adapter");
    let want: Value = read_json(fixtures().join("prefloss/golden.json"));
    let cases = [
        ("orpo", "ORPOLoss", &["beta"][..], true),
        (
            "simpo",
            "SimPOLoss",
            &["beta", "simpo_gamma", "label_smoothing", "cpo_alpha"][..],
            true,
        ),
        (
            "cpo",
            "CPOLoss",
            &["beta", "label_smoothing", "cpo_alpha"][..],
            true,
        ),
        ("ipo", "IPOLoss", &["beta"][..], false),
    ];
    for (name, component, params, reference_free) in cases {
        let out_dir = dir.join(name);
        let mut args = vec![
            "run".to_string(),
            "lora_dpo_single_device".into(),
            "--config".into(),
            cfg.display().to_string(),
            format!("output_dir={}", out_dir.display()),
            format!("checkpointer.adapter_checkpoint={}", adapter.display()),
            format!("loss._component_=torchtune.rlhf.loss.{component}"),
        ];
        args.extend(params.iter().map(|p| format!("loss.{p}={}", want[name][p])));
        args.extend(ONE_SGD_STEP.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = ferrotune(&args, &dir, &[]);
        let log = text(&out);
        assert!(out.status.success(), "{log}");
        assert_eq!(log.contains("no reference model"), reference_free, "{log}");
        let first = &metrics_lines(&out_dir.join("logs/metrics.jsonl"))[0];
        let extra: &[&str] = match name {
            "orpo" => &["nll_loss", "log_odds_ratio", "log_odds_chosen"],
            "ipo" => &[],
            _ => &["nll_loss"],
        };
        for key in ["loss"].iter().chain(extra) {
            let (got, w) = (
                first[key].as_f64().unwrap(),
                want[name][key].as_f64().unwrap(),
            );
            // The log odds: a difference of f32 averaged log probabilities near -6.
            let tol = if *key == "log_odds_chosen" {
                2e-6
            } else {
                1e-5 * w.abs()
            };
            assert!((got - w).abs() < tol, "{name}: {key} {got} vs {w}");
        }
        for key in [
            "rewards/chosen",
            "rewards/rejected",
            "rewards/margins",
            "rewards/accuracies",
        ] {
            let (got, w) = (
                first[key].as_f64().unwrap(),
                want[name][key].as_f64().unwrap(),
            );
            assert!((got - w).abs() < 2e-5, "{name}: {key} {got} vs {w}");
        }
        assert_start_minus_gradient(
            &out_dir.join("epoch_0/adapter_model.safetensors"),
            &adapter.join("adapter_model.safetensors"),
            &fixtures().join(format!("prefloss/{name}_grads.safetensors")),
        );
    }
    let refused = |overrides: &[&str], needle: &str| {
        let mut args = vec![
            "run",
            "lora_dpo_single_device",
            "--config",
            cfg.to_str().unwrap(),
        ];
        args.extend(overrides);
        let out = ferrotune(&args, &dir, &[]);
        assert!(!out.status.success(), "{overrides:?}");
        assert!(text(&out).contains(needle), "{}", text(&out));
    };
    refused(
        &[
            "loss._component_=torchtune.rlhf.loss.ORPOLoss",
            "loss.cpo_alpha=0.5",
        ],
        "loss.cpo_alpha is not a parameter of torchtune.rlhf.loss.ORPOLoss",
    );
    refused(
        &[
            "loss._component_=torchtune.rlhf.loss.IPOLoss",
            "loss.label_smoothing=0.1",
        ],
        "loss.label_smoothing is not a parameter",
    );
    refused(
        &["loss._component_=torchtune.rlhf.loss.FooLoss"],
        "loss._component_ 'torchtune.rlhf.loss.FooLoss'",
    );
}

/// A mixture-of-experts checkpoint whose config sets `output_router_logits` trains with the
/// router's load-balancing loss, as transformers does: one full fine-tuning SGD step (lr 1) of
/// Qwen3-MoE (one dense layer, one sparse) on the golden batch with a shorter second row logs
/// transformers' loss and `aux_loss` and moves every weight by exactly its gradient
/// (scripts/make_moe_aux_fixtures.py).
#[test]
fn moe_router_aux_loss_trains_as_transformers_adds_it() {
    let dir = tmpdir("moe-aux");
    let want: Value = read_json(fixtures().join("moe_aux/golden.json"));
    let pad = want["padding"].as_u64().unwrap() as usize;
    // The fixture model with the config asking for the auxiliary loss.
    let model = dir.join("model");
    common::copy_model_with_config(&fixtures().join("models/qwen3_moe/model"), &model, |c| {
        c["output_router_logits"] = Value::Bool(true);
        c["router_aux_loss_coef"] = want["router_aux_loss_coef"].clone();
    });
    // The golden rows, the second without its last `pad` tokens (collation pads it back).
    let g: Value = read_json(fixtures().join("models/qwen3_moe/golden.json"));
    let rows: Vec<String> = (0..2)
        .map(|r| {
            let ids = g["input_ids"][r].as_array().unwrap();
            let labels = g["labels"][r].as_array().unwrap();
            let keep = if r == 1 { ids.len() - pad } else { ids.len() };
            serde_json::json!({"input_ids": &ids[..keep], "labels": &labels[..keep]}).to_string()
        })
        .collect();
    let data = dir.join("batch.jsonl");
    std::fs::write(&data, rows.join("\n") + "\n").unwrap();
    let cfg = write_config(&dir, "models/qwen3_moe", &data);
    let out = ferrotune(
        &[
            "run",
            "full_finetune_single_device",
            "--config",
            cfg.to_str().unwrap(),
            &format!("checkpointer.checkpoint_dir={}", model.display()),
            &format!("tokenizer.path={}", model.display()),
        ]
        .into_iter()
        .chain(ONE_SGD_STEP)
        .collect::<Vec<_>>(),
        &dir,
        &[],
    );
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("Router load-balancing loss added with weight 0.05"),
        "{log}"
    );
    let first = &metrics_lines(&dir.join("out/logs/metrics.jsonl"))[0];
    for key in ["loss", "aux_loss"] {
        let (got, w) = (
            first[key].as_f64().unwrap(),
            want["qwen3_moe"][key].as_f64().unwrap(),
        );
        assert!(
            ((got - w) / w).abs() < 1e-5,
            "{key}: {got} vs transformers {w}"
        );
    }
    let saved = load(&dir.join("out/epoch_0/model.safetensors"));
    let start = load(&model.join("model.safetensors"));
    let grads = load(&fixtures().join("moe_aux/qwen3_moe_grads.safetensors"));
    for (key, s) in &start {
        let e = rel_l2(&(s - &saved[key]).unwrap(), &grads[key]);
        assert!(e <= 1e-4, "{key}: relative L2 {e}");
    }
}

/// torchtune's QAT recipes with `Int8DynActInt4WeightQATQuantizer` (group 32): one SGD step at
/// lr 1 logs torchao's loss and saves `start − gradient` (scripts/make_qat_fixtures.py), for
/// `qat_distributed` (every weight, every linear fake-quantized) and
/// `qat_lora_finetune_distributed` (a PEFT adapter, the adapted layers' base fake-quantized);
/// `fake_quant_after_n_steps: 1` makes the first step a plain one (transformers' loss).
#[test]
fn qat_steps_match_torchao() {
    let dir = tmpdir("qat");
    let data = dir.join("batch.jsonl");
    write_golden_rows("llama3", &data);
    let cfg = write_config(&dir, "llama3", &data);
    let want: Value = read_json(fixtures().join("qat/golden.json"));
    let adapter = fixtures().join("llama3/adapter");
    let model = fixtures().join("llama3/model");
    let quantizer = [
        "quantizer._component_=torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer",
        "quantizer.groupsize=32",
    ];
    let run = |recipe: &str, out: &Path, extra: &[&str]| {
        let mut args = vec![
            "run".to_string(),
            recipe.to_string(),
            "--config".into(),
            cfg.display().to_string(),
            format!("output_dir={}", out.display()),
        ];
        args.extend(
            quantizer
                .iter()
                .chain(&ONE_SGD_STEP)
                .chain(extra)
                .map(|s| s.to_string()),
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = ferrotune(&args, &dir, &[]);
        assert!(o.status.success(), "{recipe}: {}", text(&o));
        assert!(text(&o).contains("QAT: "), "{}", text(&o));
        metrics_lines(&out.join("logs/metrics.jsonl"))[0]["loss"]
            .as_f64()
            .unwrap()
    };
    let close = |got: f64, w: f64, what: &str| {
        assert!(((got - w) / w).abs() < 1e-5, "{what}: loss {got} vs {w}");
    };

    let out = dir.join("full");
    let loss = run("qat_distributed", &out, &[]);
    close(
        loss,
        want["full"]["loss"].as_f64().unwrap(),
        "qat_distributed",
    );
    let saved = load(&out.join("epoch_0/model.safetensors"));
    let start = load(&model.join("model.safetensors"));
    let grads = load(&fixtures().join("qat/full_grads.safetensors"));
    for (key, s) in &start {
        let e = rel_l2(&(s - &saved[key]).unwrap(), &grads[key]);
        assert!(e <= 1e-4, "qat_distributed: {key}: relative L2 {e}");
    }

    let out = dir.join("lora");
    let adapter_arg = format!("checkpointer.adapter_checkpoint={}", adapter.display());
    let loss = run("qat_lora_finetune_distributed", &out, &[&adapter_arg]);
    close(
        loss,
        want["lora"]["loss"].as_f64().unwrap(),
        "qat_lora_finetune_distributed",
    );
    assert_start_minus_gradient(
        &out.join("epoch_0/adapter_model.safetensors"),
        &adapter.join("adapter_model.safetensors"),
        &fixtures().join("qat/lora_grads.safetensors"),
    );

    // The first step without fake quantization is transformers' plain step.
    let g: Value = read_json(fixtures().join("llama3/golden.json"));
    let loss = run(
        "qat_distributed",
        &dir.join("delayed"),
        &["fake_quant_after_n_steps=1"],
    );
    close(
        loss,
        g["loss"].as_f64().unwrap(),
        "fake_quant_after_n_steps",
    );
}

#[test]
fn pytorch_and_meta_checkpoints_train_from_the_listed_files_and_save_hf_folders() {
    // llama2's weights as HF `.bin` shards and as Meta's consolidated.00.pth + params.json. Each
    // folder also holds a decoy model.safetensors (another model): `checkpoint_files` decides what
    // is loaded, as in torchtune, so the logged loss must be llama2's.
    let golden: Value = read_json(fixtures().join("models/llama2/golden.json"));
    let want_loss = golden["loss"].as_f64().unwrap();
    let start = load(&fixtures().join("models/llama2/model/model.safetensors"));
    for (case, files) in [
        (
            "llama2_bin",
            "[pytorch_model-00001-of-00002.bin, pytorch_model-00002-of-00002.bin]",
        ),
        ("llama2_meta", "[consolidated.00.pth]"),
    ] {
        let dir = tmpdir(&format!("pickle-{case}"));
        let model = dir.join("model");
        std::fs::create_dir_all(&model).unwrap();
        let src = fixtures().join("models").join(case).join("model");
        for entry in std::fs::read_dir(&src).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), model.join(entry.file_name())).unwrap();
        }
        std::fs::copy(
            fixtures().join("models/llama3_2/model/model.safetensors"),
            model.join("model.safetensors"),
        )
        .unwrap();
        let data = dir.join("batch.jsonl");
        write_golden_rows("models/llama2", &data);
        let yaml = common::TINY_LORA
            .replace("OUT", &dir.join("out").display().to_string())
            .replace("MODEL", &model.display().to_string())
            .replace("DATA", &data.display().to_string());
        let cfg = dir.join("config.yaml");
        std::fs::write(&cfg, yaml).unwrap();
        let listed = format!("checkpointer.checkpoint_files={files}");
        let out = ferrotune(
            &[
                "run",
                "full_finetune_single_device",
                "--config",
                cfg.to_str().unwrap(),
                &listed,
                "optimizer._component_=torch.optim.SGD",
                "optimizer.lr=0.0",
                "optimizer.weight_decay=0.0",
                "max_steps_per_epoch=1",
            ],
            &dir,
            &[],
        );
        assert!(out.status.success(), "{case}: {}", text(&out));
        let metrics = std::fs::read_to_string(dir.join("out/logs/metrics.jsonl")).unwrap();
        let first: Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
        let got = first["loss"].as_f64().unwrap();
        assert!(
            ((got - want_loss) / want_loss).abs() < 1e-5,
            "{case}: logged loss {got} vs transformers {want_loss}"
        );
        // Saved as an HF folder: llama2's own tensors (lr 0), q/k rows in HF's layout, and a
        // config.json transformers reads as that model.
        let saved = load(&dir.join("out/epoch_0/model.safetensors"));
        assert_eq!(saved.len(), start.len(), "{case}: saved tensor set");
        for (key, s) in &start {
            let e = rel_l2(&saved[key], s);
            assert!(e == 0.0, "{case}: {key}: relative L2 {e}");
        }
        let config: Value = read_json(dir.join("out/epoch_0/config.json"));
        let want: Value = read_json(fixtures().join("models/llama2/model/config.json"));
        for key in [
            "model_type",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "num_hidden_layers",
            "vocab_size",
            "tie_word_embeddings",
        ] {
            assert_eq!(config[key], want[key], "{case}: config.json {key}");
        }
        assert!(
            dir.join("out/epoch_0/tokenizer.json").is_file(),
            "{case}: tokenizer saved"
        );
    }
}

#[test]
fn meta_checkpointer_saves_metas_format_as_torchtune_does() {
    // torchtune's FullModelMetaCheckpointer writes `epoch_N/model-00001-of-00001.bin` (Meta's
    // names, q/k rows interleaved, Llama 3.2's tied head as `output.weight`) beside copies of the
    // checkpoint folder's other files. With lr 0 every saved tensor must be the source's, byte
    // for byte, and the saved folder must load back as the same model.
    use ferrotune_models::torch_pickle::read_torch_file;
    for case in ["llama2_meta", "llama3_1_meta", "llama3_2_meta"] {
        let dir = tmpdir(&format!("meta-out-{case}"));
        let model = dir.join("model");
        std::fs::create_dir_all(model.join("notes")).unwrap();
        let src = fixtures().join("models").join(case).join("model");
        for entry in std::fs::read_dir(&src).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), model.join(entry.file_name())).unwrap();
        }
        // torchtune's copy_files keeps sub-folders and skips hidden files.
        std::fs::write(model.join("notes/README.txt"), "kept").unwrap();
        std::fs::write(model.join(".cache"), "hidden").unwrap();
        let golden: Value = read_json(fixtures().join("models").join(case).join("golden.json"));
        let want_loss = golden["loss"].as_f64().unwrap();
        let data = dir.join("batch.jsonl");
        write_golden_rows(&format!("models/{case}"), &data);
        let cfg = dir.join("config.yaml");
        std::fs::write(
            &cfg,
            common::TINY_LORA
                .replace("OUT", &dir.join("out").display().to_string())
                .replace("MODEL", &model.display().to_string())
                .replace("DATA", &data.display().to_string()),
        )
        .unwrap();
        let run = |recipe: &str, out: &str, extra: &[&str]| {
            let out_dir = format!("output_dir={}", dir.join(out).display());
            let mut args = vec![
                "run",
                recipe,
                "--config",
                cfg.to_str().unwrap(),
                "checkpointer._component_=torchtune.training.FullModelMetaCheckpointer",
                &out_dir,
                "optimizer._component_=torch.optim.SGD",
                "optimizer.lr=0.0",
                "optimizer.weight_decay=0.0",
                "max_steps_per_epoch=1",
            ];
            args.extend_from_slice(extra);
            let o = ferrotune(&args, &dir, &[]);
            assert!(o.status.success(), "{case} {recipe}: {}", text(&o));
            let metrics =
                std::fs::read_to_string(dir.join(out).join("logs/metrics.jsonl")).unwrap();
            let first: Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
            let got = first["loss"].as_f64().unwrap();
            assert!(
                ((got - want_loss) / want_loss).abs() < 1e-5,
                "{case} {recipe} into {out}: logged loss {got} vs transformers {want_loss}"
            );
        };
        let source = read_torch_file(&model.join("consolidated.00.pth")).unwrap();
        let embed = source
            .iter()
            .find(|(n, _)| n == "tok_embeddings.weight")
            .unwrap()
            .1
            .clone();
        let check_saved = |folder: &Path| {
            let saved = read_torch_file(&folder.join("model-00001-of-00001.bin")).unwrap();
            // Meta's names: the source's, less Llama 2's precomputed `rope.freqs`, with the head.
            let mut want: Vec<(String, _)> = source
                .iter()
                .filter(|(n, _)| n != "rope.freqs")
                .cloned()
                .collect();
            if !want.iter().any(|(n, _)| n == "output.weight") {
                want.push(("output.weight".into(), embed.clone()));
            }
            want.sort_by(|a, b| a.0.cmp(&b.0));
            let mut got = saved.clone();
            got.sort_by(|a, b| a.0.cmp(&b.0));
            let names = |v: &[(String, _)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
            assert_eq!(names(&got), names(&want), "{case}: saved names");
            for ((name, g), (_, w)) in got.iter().zip(&want) {
                assert!(g == w, "{case}: {name} differs from the source");
            }
            for f in ["params.json", "notes/README.txt"] {
                assert_eq!(
                    std::fs::read(folder.join(f)).unwrap(),
                    std::fs::read(model.join(f)).unwrap(),
                    "{case}: {f} copied"
                );
            }
            for absent in [
                ".cache",
                "consolidated.00.pth",
                "config.json",
                "model.safetensors",
            ] {
                assert!(
                    !folder.join(absent).exists(),
                    "{case}: {absent} not in the saved folder"
                );
            }
            assert!(folder.join("tokenizer.json").is_file(), "{case}: tokenizer");
        };
        let listed = "checkpointer.checkpoint_files=[consolidated.00.pth]";
        run("full_finetune_single_device", "full", &[listed]);
        check_saved(&dir.join("full/epoch_0"));
        // The saved folder is a checkpoint again, without naming its file.
        let again = format!(
            "checkpointer.checkpoint_dir={}",
            dir.join("full/epoch_0").display()
        );
        run("full_finetune_single_device", "again", &[&again]);
        check_saved(&dir.join("again/epoch_0"));
        // A listed file that is not there: the error says what the folder holds.
        let wrong = ferrotune(
            &[
                "run",
                "full_finetune_single_device",
                "--config",
                cfg.to_str().unwrap(),
                &again,
                "checkpointer.checkpoint_files=[model-00001-of-00002.bin]",
            ],
            &dir,
            &[],
        );
        let err = text(&wrong);
        assert!(!wrong.status.success());
        assert!(
            err.contains("model-00001-of-00002.bin does not exist")
                && err.contains("holds model-00001-of-00001.bin:"),
            "{case}: {err}"
        );
        // Training (AdamW, lr 1e-3, bf16) killed after its second of three epochs resumes from
        // the Meta folder to the uninterrupted run's file, byte for byte.
        let train = |out: &str, env: &[(&str, &str)], extra: &[&str]| {
            let out_dir = format!("output_dir={}", dir.join(out).display());
            let mut args = vec![
                "run",
                "full_finetune_single_device",
                "--config",
                cfg.to_str().unwrap(),
                "checkpointer._component_=torchtune.training.FullModelMetaCheckpointer",
                listed,
                &out_dir,
                "epochs=3",
                "dtype=bf16",
            ];
            args.extend_from_slice(extra);
            ferrotune(&args, &dir, env)
        };
        let whole = train("whole", &[], &[]);
        assert!(whole.status.success(), "{case}: {}", text(&whole));
        let killed = train("resumed", &[("FERROTUNE_KILL_AFTER_STEP", "2")], &[]);
        assert!(!killed.status.success(), "{case}: the run was to be killed");
        let resumed = train("resumed", &[], &["resume_from_checkpoint=true"]);
        assert!(resumed.status.success(), "{case}: {}", text(&resumed));
        let file = |out: &str| {
            std::fs::read(dir.join(out).join("epoch_2/model-00001-of-00001.bin")).unwrap()
        };
        assert!(
            file("whole") == file("resumed"),
            "{case}: resumed run's weights"
        );
        // LoRA: the PEFT adapter, and the merged model (B = 0 at the start) in Meta's format one
        // folder down.
        run("lora_finetune_single_device", "lora", &[listed]);
        assert!(dir.join("lora/epoch_0/adapter_config.json").is_file());
        check_saved(&dir.join("lora/epoch_0/merged"));
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// One LoRA SGD step (lr 1) of `model` from the PEFT adapter `vl_lora/{case}/adapter` on its
/// golden rows: the run's folder and output (checked to have succeeded).
fn one_sgd_step_from_the_adapter_of(case: &str, model: &str) -> (PathBuf, Output) {
    let dir = tmpdir(&format!("sgd-{case}"));
    let data = dir.join("batch.jsonl");
    write_golden_rows(&format!("vl_lora/{case}"), &data);
    let cfg = write_config(&dir, model, &data);
    let adapter = format!(
        "checkpointer.adapter_checkpoint={}",
        fixtures()
            .join("vl_lora")
            .join(case)
            .join("adapter")
            .display()
    );
    let mut args = vec![
        "run",
        "lora_finetune_single_device",
        "--config",
        cfg.to_str().unwrap(),
        &adapter,
    ];
    args.extend(ONE_SGD_STEP);
    let out = ferrotune(&args, &dir, &[]);
    assert!(out.status.success(), "{}", text(&out));
    (dir, out)
}

/// The run in `dir` logged PEFT's loss of the adapter fixture `case` (`lora_loss`) first.
fn assert_first_loss_is_pefts(dir: &Path, case: &Path) {
    let first = &metrics_lines(&dir.join("out/logs/metrics.jsonl"))[0];
    let golden: Value = read_json(case.join("golden.json"));
    let (got, want) = (
        first["loss"].as_f64().unwrap(),
        golden["lora_loss"].as_f64().unwrap(),
    );
    assert!(
        ((got - want) / want).abs() < 1e-5,
        "loss {got} vs PEFT {want}"
    );
}

/// Llama 3.2 Vision: one SGD step (lr 1) from PEFT's adapter of the whole model, whose targets
/// reach the cross-attention layers and the vision tower too (text alone never runs them), logs
/// PEFT's loss and saves, under the checkpoint's names, the text layers' adapters moved by exactly
/// PEFT's gradient; the others are left out with a warning, and the saved config keeps PEFT off
/// them (`exclude_modules`).
#[test]
fn one_sgd_step_on_llama_3_2_vision_from_a_peft_adapter_of_the_whole_model() {
    let case = fixtures().join("vl_lora/mllama");
    let (dir, out) = one_sgd_step_from_the_adapter_of("mllama", "models/mllama_multimodal");
    assert!(
        text(&out).contains("cross-attention layers left out"),
        "{}",
        text(&out)
    );
    let saved_dir = dir.join("out/epoch_0");
    let saved = load(&saved_dir.join("adapter_model.safetensors"));
    let start = load(&case.join("adapter/adapter_model.safetensors"));
    let grads = load(&case.join("lora_grads.safetensors"));
    let mut names: Vec<&String> = saved.keys().collect();
    names.sort();
    let mut want: Vec<&String> = grads.keys().collect();
    want.sort();
    assert_eq!(names, want);
    for (key, g) in &grads {
        let e = rel_l2(&saved[key], &(&start[key] - g).unwrap());
        assert!(e <= 1e-4, "{key}: relative L2 {e}");
    }
    let config: Value = read_json(saved_dir.join("adapter_config.json"));
    assert_eq!(
        config["exclude_modules"],
        r"model\.language_model\.layers\.(?:0|2)\..*|model\.vision_model\..*"
    );
    assert_first_loss_is_pefts(&dir, &case);
    // The merged model is the Llama text model.
    let merged: Value = read_json(saved_dir.join("merged/config.json"));
    assert_eq!(merged["architectures"][0], "LlamaForCausalLM");
    std::fs::remove_dir_all(&dir).ok();
}

/// Llama 4: one SGD step (lr 1) from PEFT's adapter of the whole `Llama4ForConditionalGeneration`
/// (every projection name: the attention, dense MLPs and shared experts of the text model, and the
/// vision tower's attention) logs PEFT's loss and saves the text model's adapters, under the text
/// model's checkpoint names (`feed_forward.*`), moved by exactly PEFT's gradient; the merged model
/// is `Llama4ForCausalLM` with its experts fused.
#[test]
fn one_sgd_step_on_llama_4_from_a_peft_adapter_of_the_whole_model() {
    let case = fixtures().join("vl_lora/llama4");
    let (dir, _) = one_sgd_step_from_the_adapter_of("llama4", "models/llama4_multimodal");
    let saved_dir = dir.join("out/epoch_0");
    let saved = load(&saved_dir.join("adapter_model.safetensors"));
    let start = load(&case.join("adapter/adapter_model.safetensors"));
    let grads = load(&case.join("lora_grads.safetensors"));
    // PEFT's whole-model names without the vision tower's, as the text model names them.
    let text_key = |key: &str| -> Option<String> {
        let module = key.strip_prefix("base_model.model.").unwrap();
        let text = ferrotune_models::checkpoint::text_model_tensor(module)?;
        Some(format!("base_model.model.{text}"))
    };
    let mut names: Vec<&String> = saved.keys().collect();
    names.sort();
    let mut want: Vec<String> = grads.keys().filter_map(|k| text_key(k)).collect();
    want.sort();
    assert_eq!(names, want.iter().collect::<Vec<_>>());
    assert!(want
        .iter()
        .any(|k| k.contains("feed_forward.shared_expert.down_proj")));
    for (key, g) in &grads {
        let Some(text) = text_key(key) else {
            continue;
        };
        let e = rel_l2(&saved[&text], &(&start[key] - g).unwrap());
        assert!(e <= 1e-4, "{key}: relative L2 {e}");
    }
    assert_first_loss_is_pefts(&dir, &case);
    let merged: Value = read_json(saved_dir.join("merged/config.json"));
    assert_eq!(merged["architectures"][0], "Llama4ForCausalLM");
    let weights = load(&saved_dir.join("merged/model.safetensors"));
    assert_eq!(
        weights["model.layers.1.feed_forward.experts.gate_up_proj"].dims(),
        [4, 32, 48]
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Adapters PEFT trains beside (or instead of) LoRA on modules: trainable token rows, adapters
/// on parameters (fused experts). Training further is refused, naming the key (whole modules,
/// `modules_to_save`, train further: see `one_sgd_step_from_a_peft_adapter_...`).
#[test]
fn adapters_with_trainable_tokens_or_parameter_targets_are_not_trained_further() {
    let cases = [
        (
            "llama3",
            "embedding_lora/tokens_llama3",
            "trainable_token_indices",
        ),
        (
            "models/mixtral",
            "target_parameters/mixtral",
            "target_parameters",
        ),
    ];
    for (family, case, key) in cases {
        let dir = tmpdir(&format!("mts-train-{key}"));
        let adapter = format!(
            "checkpointer.adapter_checkpoint={}",
            fixtures().join(case).join("adapter").display()
        );
        let out = one_lora_step(&dir, family, &[&adapter]);
        assert!(!out.status.success());
        let log = text(&out);
        assert!(
            log.contains(key) && log.contains("ferrotune merge"),
            "{log}"
        );
    }
}

/// Mean cross-entropy of `logits` ([b, t, v]) over `labels`' shifted non-ignored targets, in f64.
fn shifted_cross_entropy(logits: &candle_core::Tensor, labels: &Value) -> f64 {
    let logits: Vec<Vec<Vec<f32>>> = logits.to_vec3().unwrap();
    let labels: Vec<Vec<i64>> = serde_json::from_value(labels.clone()).unwrap();
    let (mut sum, mut n) = (0.0f64, 0usize);
    for (row, lab) in logits.iter().zip(&labels) {
        for t in 0..row.len() - 1 {
            let target = lab[t + 1];
            if target < 0 {
                continue;
            }
            let l = &row[t];
            let max = l.iter().fold(f32::MIN, |m, &x| m.max(x)) as f64;
            let lse = max + l.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
            sum += lse - l[target as usize] as f64;
            n += 1;
        }
    }
    sum / n as f64
}

/// torchtune's own adapter file both ways: a run continues torchtune's Phi-3 `adapter_model.pt`
/// (separate q/k/v adapters, no adapter_config.json: the alpha comes from `model.lora_alpha`)
/// from torchtune's loss, and under a torchtune checkpointer saves `adapter_model.pt` again
/// beside the PEFT adapter; `merge` and `generate` take the file with `--lora-alpha`.
#[test]
fn torchtune_adapter_files_are_read_and_written() {
    use ferrotune_models::torch_pickle::read_torch_file;
    let dir = tmpdir("torchtune-adapter");
    let family = "models/phi3";
    let data = dir.join("batch.jsonl");
    write_golden_rows(family, &data);
    let cfg = write_config(&dir, family, &data);
    let case = fixtures().join("torchtune_adapter/phi3");
    let adapter = case.join("adapter_model.pt");
    let golden: Value = read_json(fixtures().join(family).join("golden.json"));
    let base = |args: &[&str]| {
        let mut all = vec![
            "run",
            "lora_finetune_single_device",
            "--config",
            cfg.to_str().unwrap(),
            "checkpointer._component_=torchtune.training.FullModelHFCheckpointer",
            "optimizer.lr=0.0",
            "max_steps_per_epoch=1",
        ];
        all.extend_from_slice(args);
        ferrotune(&all, &dir, &[])
    };
    let adapter_arg = format!("checkpointer.adapter_checkpoint={}", adapter.display());

    // Without an alpha anywhere the run stops, naming the key.
    let out = base(&[&adapter_arg, "model.lora_alpha=null"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("model.lora_alpha"), "{}", text(&out));

    let out = base(&[&adapter_arg, "model.lora_alpha=8"]);
    assert!(out.status.success(), "{}", text(&out));
    let torchtune_logits = load(&case.join("golden.safetensors"))
        .remove("logits")
        .unwrap();
    let want = shifted_cross_entropy(&torchtune_logits, &golden["labels"]);
    let lines = metrics_lines(&dir.join("out/logs/metrics.jsonl"));
    let got = lines[0]["loss"].as_f64().unwrap();
    assert!(
        ((got - want) / want).abs() < 1e-5,
        "first loss {got} vs torchtune's model with its adapter {want}"
    );
    // lr 0: the adapter is saved as it was read, in torchtune's file and (fused) in PEFT's.
    let saved = dir.join("out/epoch_0");
    let read = |p: &Path| -> Vec<(String, Vec<f32>)> {
        read_torch_file(p)
            .unwrap()
            .into_iter()
            .map(|(n, t)| {
                let v = t
                    .to_tensor(candle_core::DType::F32, &candle_core::Device::Cpu)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                (n, v)
            })
            .collect()
    };
    let mut a = read(&saved.join("adapter_model.pt"));
    let mut b = read(&adapter);
    a.sort_by(|x, y| x.0.cmp(&y.0));
    b.sort_by(|x, y| x.0.cmp(&y.0));
    assert!(a == b, "adapter_model.pt differs from the one read");
    let peft: Value = read_json(saved.join("adapter_config.json"));
    assert!(
        peft["rank_pattern"].to_string().contains("qkv_proj"),
        "{peft}"
    );

    // Without a torchtune checkpointer no adapter_model.pt is written.
    let out = base(&[
        &adapter_arg,
        "model.lora_alpha=8",
        "checkpointer._component_=null",
        "output_dir=plain",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(dir
        .join("plain/epoch_0/adapter_model.safetensors")
        .is_file());
    assert!(!dir.join("plain/epoch_0/adapter_model.pt").exists());

    // merge: --lora-alpha is needed for this file, and gives the merged model.
    let model = fixtures().join(family).join("model");
    let merged = dir.join("merged");
    let merge = |extra: &[&str]| {
        let mut args = vec![
            "merge".to_string(),
            "--model".into(),
            model.display().to_string(),
            "--adapter".into(),
            adapter.display().to_string(),
            "--output".into(),
            merged.display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        common::ferrotune(&args, &dir, &[])
    };
    let out = merge(&[]);
    assert!(!out.status.success());
    assert!(text(&out).contains("--lora-alpha"), "{}", text(&out));
    let out = merge(&["--lora-alpha", "8"]);
    assert!(out.status.success(), "{}", text(&out));
    // The merged model's loss is torchtune's too.
    let out = ferrotune(
        &[
            "run",
            "lora_finetune_single_device",
            "--config",
            cfg.to_str().unwrap(),
            &format!("checkpointer.checkpoint_dir={}", merged.display()),
            "optimizer.lr=0.0",
            "max_steps_per_epoch=1",
            "output_dir=from_merged",
        ],
        &dir,
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
    let lines = metrics_lines(&dir.join("from_merged/logs/metrics.jsonl"));
    let got = lines[0]["loss"].as_f64().unwrap();
    assert!(
        ((got - want) / want).abs() < 1e-5,
        "merged model's loss {got} vs torchtune's {want}"
    );
}
