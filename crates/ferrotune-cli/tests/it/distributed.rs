//! Distributed recipes end to end on 2 CPU ranks (the launcher, TCP collectives, sharding): each
//! `fsdp_sharding` mode gives the loss of every step and the checkpoint of the single-device
//! recipe at the same global batch; a checkpoint resumes on another world size; `kill -9` of one
//! rank stops the others with an error naming it.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use candle_core::Tensor;

use common::{fixtures, load, metrics_lines, text, write_config};

fn ferrotune(args: &[String], cwd: &Path, env: &[(&str, &str)]) -> Output {
    // The ranks of a test share the machine with other tests: one thread each.
    let env: Vec<(&str, &str)> = std::iter::once(("RAYON_NUM_THREADS", "1"))
        .chain(env.iter().copied())
        .collect();
    common::ferrotune(args, cwd, &env)
}

fn tmpdir(name: &str) -> PathBuf {
    common::tmpdir("dist", name)
}

/// The (step, loss, lr) of every logged step.
pub(crate) fn losses(metrics: &Path) -> Vec<(u64, f64, f64)> {
    common::losses(&metrics_lines(metrics))
}

/// (relative L2 distance, largest absolute difference) of two tensors.
fn distance(a: &Tensor, b: &Tensor) -> (f32, f32) {
    let diff = (a - b).unwrap();
    let largest = diff
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    (common::rel_l2(a, b), largest)
}

/// 16 rows of different lengths (so padding and per-rank target counts differ), some with
/// labels masked, as pre-tokenized JSONL.
/// Token ids run from 3 to `vocab - 1`.
fn write_rows(path: &Path, vocab: u32) {
    let mut lines = Vec::new();
    for i in 0..16u32 {
        let len = 6 + (i * 5) % 9;
        let ids: Vec<u32> = (0..len)
            .map(|j| (i * 37 + j * 11) % (vocab - 3) + 3)
            .collect();
        let labels: Vec<i64> = ids
            .iter()
            .enumerate()
            .map(|(j, &t)| if j < (i as usize % 3) { -100 } else { t as i64 })
            .collect();
        lines.push(serde_json::json!({"input_ids": ids, "labels": labels}).to_string());
    }
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

const CONFIG: &str = "
output_dir: OUT
model:
  lora_attn_modules: [q_proj, k_proj, v_proj, output_proj]
  apply_lora_to_mlp: true
  lora_rank: 4
  lora_alpha: 8
  lora_dropout: 0.0
tokenizer:
  path: MODEL
checkpointer:
  checkpoint_dir: MODEL
  output_dir: ${output_dir}
dataset:
  _component_: torchtune.datasets.tokenized_dataset
  source: json
  data_files: DATA
seed: 11
shuffle: true
batch_size: 2
epochs: 2
gradient_accumulation_steps: 2
clip_grad_norm: 0.5
optimizer:
  _component_: torch.optim.AdamW
  lr: 2e-3
  weight_decay: 0.01
lr_scheduler:
  _component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup
  num_warmup_steps: 1
loss:
  _component_: torch.nn.CrossEntropyLoss
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: ${output_dir}/logs
log_every_n_steps: 1
device: cpu
dtype: fp32
";

pub(crate) struct Case {
    pub(crate) dir: PathBuf,
    cfg: PathBuf,
}

impl Case {
    pub(crate) fn new(name: &str, family: &str) -> Self {
        Self::with_vocab(name, family, 503)
    }

    /// A case whose rows' ids stay below `vocab`.
    fn with_vocab(name: &str, family: &str, vocab: u32) -> Self {
        let dir = tmpdir(name);
        let data = dir.join("rows.jsonl");
        write_rows(&data, vocab);
        let cfg = write_config(CONFIG, &dir, family, &data);
        Self { dir, cfg }
    }

    /// Runs `recipe` on one device with the global batch of 2 ranks × `batch_size: 2` into
    /// `dir/single`, and returns that folder and its losses (the reference every test compares to).
    fn single_device_reference(&self, recipe: &str) -> (PathBuf, Vec<(u64, f64, f64)>) {
        self.single_device_reference_with(recipe, &[])
    }

    /// [`Case::single_device_reference`] with `extra` overrides.
    pub(crate) fn single_device_reference_with(
        &self,
        recipe: &str,
        extra: &[&str],
    ) -> (PathBuf, Vec<(u64, f64, f64)>) {
        let single = self.dir.join("single");
        let o = self.run(
            1,
            recipe,
            &single,
            &[extra, &["batch_size=4"]].concat(),
            &[],
        );
        assert!(o.status.success(), "{}", text(&o));
        let want = losses(&single.join("logs/metrics.jsonl"));
        (single, want)
    }

    /// `ferrotune run [--nproc-per-node N] RECIPE --config CFG output_dir=OUT extra...`.
    pub(crate) fn run(
        &self,
        nproc: usize,
        recipe: &str,
        out: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Output {
        let mut args = vec!["run".to_string()];
        if nproc > 1 {
            args.extend(["--nproc-per-node".to_string(), nproc.to_string()]);
        }
        args.extend([
            recipe.to_string(),
            "--config".into(),
            self.cfg.display().to_string(),
            format!("output_dir={}", out.display()),
        ]);
        args.extend(extra.iter().map(|s| s.to_string()));
        ferrotune(&args, &self.dir, env)
    }
}

pub(crate) fn assert_same_losses(got: &[(u64, f64, f64)], want: &[(u64, f64, f64)], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: number of logged steps");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.0, w.0, "{what}: step numbers");
        let rel = (g.1 - w.1).abs() / w.1.abs().max(1e-12);
        assert!(
            rel <= 1e-5,
            "{what}: step {}: loss {} vs {} (rel {rel:e})",
            g.0,
            g.1,
            w.1
        );
        assert!(
            (g.2 - w.2).abs() <= 1e-12 * w.2.abs().max(1.0),
            "{what}: lr at step {}",
            g.0
        );
    }
}

/// Each tensor within `tol` relative L2 of the reference, or within 1e-5 absolute: the updates
/// of a parameter whose gradient is mathematically zero (a key bias: softmax ignores a shift
/// shared by all keys) are AdamW-normalised rounding noise, different for any change of
/// summation order, but far below one real update (lr 2e-3).
pub(crate) fn assert_same_tensors(got: &Path, want: &Path, tol: f32, what: &str) {
    let a = load(got);
    let b = load(want);
    assert_eq!(
        a.keys().collect::<std::collections::BTreeSet<_>>(),
        b.keys().collect::<std::collections::BTreeSet<_>>(),
        "{what}: tensor names"
    );
    for (k, t) in &b {
        assert_eq!(a[k].dims(), t.dims(), "{what}: {k} shape");
        let (rel, abs) = distance(&a[k], t);
        assert!(
            rel <= tol || abs <= 1e-5,
            "{what}: {k} differs by {rel:e} (relative L2), {abs:e} at most"
        );
    }
}

/// Full fine-tuning, each sharding mode, 2 ranks × batch 2 against one device × batch 4; both
/// with 2 accumulation steps, clipping, weight decay, a schedule and shuffling over 2 epochs.
#[test]
fn full_finetune_on_two_ranks_equals_one_device_in_every_sharding_mode() {
    let case = Case::new("full", "qwen2");
    let (single, want) = case.single_device_reference("full_finetune_single_device");
    assert_eq!(
        want.len(),
        4,
        "16 rows / (4 × 2 accumulation) = 2 steps × 2 epochs"
    );
    for mode in ["full", "grad_op", "none"] {
        let out = case.dir.join(format!("dist-{mode}"));
        let o = case.run(
            2,
            "full_finetune_distributed",
            &out,
            &[&format!("fsdp_sharding={mode}")],
            &[],
        );
        let log = text(&o);
        assert!(o.status.success(), "{mode}: {log}");
        assert_same_losses(&losses(&out.join("logs/metrics.jsonl")), &want, mode);
        assert_same_tensors(
            &out.join("epoch_1/model.safetensors"),
            &single.join("epoch_1/model.safetensors"),
            1e-4,
            mode,
        );
        // The optimizer state is saved whole, under the single-device names.
        assert_same_tensors(
            &out.join("epoch_1/recipe_state/optimizer.safetensors"),
            &single.join("epoch_1/recipe_state/optimizer.safetensors"),
            1e-3,
            mode,
        );
        // Only rank 0 writes: one checkpoint, no per-rank copies.
        let entries: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            entries.iter().all(|e| !e.starts_with('.')),
            "{mode}: leftovers {entries:?}"
        );
        if mode == "full" {
            // Each rank holds about half of what one device holds.
            for line in log
                .lines()
                .filter(|l| l.starts_with("rank ") && l.contains("one device"))
            {
                let nums: Vec<f64> = line
                    .split(|c: char| !(c.is_ascii_digit() || c == '.'))
                    .filter_map(|w| w.parse().ok())
                    .collect();
                // rank, params, grads, opt, total, one: params, grads, opt, total
                let (total, one) = (nums[4], nums[8]);
                assert!(
                    (total / one - 0.5).abs() < 0.05,
                    "per-rank memory {total} MB vs one device {one} MB: {line}"
                );
            }
            assert!(log.contains("rank 1: parameters"), "{log}");
        }
    }
}

/// `lora_finetune_distributed` on 2 ranks in each FSDP sharding `mode`, with the `extra`
/// overrides, logs the losses and saves the adapter and merged model of one device.
fn assert_lora_on_two_ranks_equals_one_device(case: &Case, extra: &[&str], modes: &[&str]) {
    let (single, want) = case.single_device_reference_with("lora_finetune_single_device", extra);
    for mode in modes {
        let out = case.dir.join(format!("dist-{mode}"));
        let sharding = format!("fsdp_sharding={mode}");
        let o = case.run(
            2,
            "lora_finetune_distributed",
            &out,
            &[extra, &[sharding.as_str()]].concat(),
            &[],
        );
        assert!(o.status.success(), "{mode}: {}", text(&o));
        assert_same_losses(&losses(&out.join("logs/metrics.jsonl")), &want, mode);
        for f in ["adapter_model.safetensors", "merged/model.safetensors"] {
            assert_same_tensors(
                &out.join("epoch_1").join(f),
                &single.join("epoch_1").join(f),
                1e-4,
                &format!("{mode}: {f}"),
            );
        }
    }
}

/// LoRA on the fused-LoRA path, sharded and replicated, against one device.
#[test]
fn lora_finetune_on_two_ranks_equals_one_device() {
    let case = Case::new("lora", "llama3");
    assert_lora_on_two_ranks_equals_one_device(&case, &[], &["full", "grad_op", "none"]);
}

/// DeepSeek-V3 (latent attention, group-limited routing, shared experts): LoRA on every MLA
/// projection, the MLPs and the experts trains on 2 ranks as on one device, sharded or not.
#[test]
fn deepseek_lora_on_two_ranks_equals_one_device() {
    let case = Case::with_vocab("deepseek", "models/deepseek_v3", 512);
    assert_lora_on_two_ranks_equals_one_device(&case, &[], &["full", "none"]);
}

/// Qwen3.5 (Gated DeltaNet layers beside gated full attention): LoRA on the full-attention
/// projections, every DeltaNet projection and every MLP trains on 2 ranks as on one device,
/// sharded or not.
#[test]
fn qwen3_5_lora_on_two_ranks_equals_one_device() {
    let case = Case::with_vocab("qwen3_5", "models/qwen3_5", 512);
    let modules = "model.lora_attn_modules=[q_proj,k_proj,v_proj,output_proj,in_proj_qkv,\
                   in_proj_z,in_proj_b,in_proj_a,out_proj]";
    assert_lora_on_two_ranks_equals_one_device(&case, &[modules], &["full", "none"]);
}

/// Qwen3.5's MoE (fused routed experts, the sigmoid-gated shared expert): LoRA on the
/// attention and the MLPs trains on 2 ranks as on one device, sharded or not.
#[test]
fn qwen3_5_moe_lora_on_two_ranks_equals_one_device() {
    let case = Case::with_vocab("qwen3_5_moe", "models/qwen3_5_moe", 512);
    assert_lora_on_two_ranks_equals_one_device(&case, &[], &["full", "none"]);
}

/// gpt-oss (attention sinks, sliding and full layers, biased q/k/v/o): LoRA on the attention
/// trains on 2 ranks as on one device, sharded or not.
#[test]
fn gpt_oss_lora_on_two_ranks_equals_one_device() {
    let case = Case::with_vocab("gpt_oss", "models/gpt_oss", 512);
    assert_lora_on_two_ranks_equals_one_device(&case, &[], &["full", "none"]);
}

/// gpt-oss with adapters on its fused experts too (`model.target_parameters`, PEFT's fused
/// `lora_A` / `lora_B`): trains on 2 ranks as on one device, sharded or not.
#[test]
fn gpt_oss_expert_adapters_on_two_ranks_equal_one_device() {
    let case = Case::with_vocab("gpt_oss_experts", "models/gpt_oss", 512);
    assert_lora_on_two_ranks_equals_one_device(
        &case,
        &["model.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"],
        &["full", "none"],
    );
}

/// QLoRA (`model.quantize_base`) on Qwen3.5-MoE (DeltaNet projections and experts in NF4) and
/// gpt-oss (q/k/v/o in NF4, dense experts and sinks) on 2 ranks, the NF4 base sharded or
/// replicated, equals one device.
#[test]
fn new_families_qlora_on_two_ranks_equals_one_device() {
    for family in ["qwen3_5_moe", "gpt_oss"] {
        let case = Case::with_vocab(&format!("qlora-{family}"), &format!("models/{family}"), 512);
        assert_lora_on_two_ranks_equals_one_device(
            &case,
            &["model.quantize_base=true"],
            &["full", "none"],
        );
    }
}

/// QLoRA on gpt-oss with OpenAI's MXFP4 experts (tests/fixtures/gpt_oss_mxfp4): one device holds
/// them packed, 2 ranks dequantize them on load, and the two runs equal each other.
#[test]
fn gpt_oss_mxfp4_qlora_on_two_ranks_equals_one_device_packed() {
    let case = Case::with_vocab("qlora-gpt-oss-mxfp4", "gpt_oss_mxfp4", 512);
    assert_lora_on_two_ranks_equals_one_device(&case, &["model.quantize_base=true"], &["full"]);
}

/// Full fine-tuning of each 2026 family (Qwen3-Next too) on 2 ranks, sharded and replicated, equals one device:
/// every parameter (DeltaNet's `A_log`, `dt_bias`, `conv1d` and gated norm, fused experts,
/// attention sinks, MLA's projections) is sharded, gathered and reduced as one device updates it.
#[test]
fn new_families_full_finetune_on_two_ranks_equals_one_device() {
    for family in [
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
        "gpt_oss",
        "deepseek_v3",
    ] {
        let case = Case::with_vocab(&format!("full-{family}"), &format!("models/{family}"), 512);
        let (single, want) = case.single_device_reference("full_finetune_single_device");
        assert_eq!(want.len(), 4, "{family}: 2 steps × 2 epochs");
        for mode in ["full", "none"] {
            let out = case.dir.join(format!("dist-{mode}"));
            let o = case.run(
                2,
                "full_finetune_distributed",
                &out,
                &[&format!("fsdp_sharding={mode}")],
                &[],
            );
            let what = format!("{family} {mode}");
            assert!(o.status.success(), "{what}: {}", text(&o));
            assert_same_losses(&losses(&out.join("logs/metrics.jsonl")), &want, &what);
            assert_same_tensors(
                &out.join("epoch_1/model.safetensors"),
                &single.join("epoch_1/model.safetensors"),
                1e-4,
                &what,
            );
        }
    }
}

/// Adapters on the token embedding and on the head of a model that ties them (Qwen2, untied
/// by the adapters) train on 2 ranks as on one device, sharded or not.
#[test]
fn embedding_and_head_adapters_on_two_ranks_equal_one_device() {
    let case = Case::new("lora-embed", "qwen2");
    let extra = [
        "model.apply_lora_to_embeddings=true",
        "model.apply_lora_to_output=true",
    ];
    assert_lora_on_two_ranks_equals_one_device(&case, &extra, &["full", "none"]);
}

/// LoRA biases (`lora_bias`, on Qwen2's biased q/k/v so that the merged model is written too)
/// train on 2 ranks as on one device: the biases are sharded and reduced with the adapters.
#[test]
fn lora_biases_on_two_ranks_equal_one_device() {
    let case = Case::new("lora-bias", "qwen2");
    let extra = [
        "model.lora_bias=true",
        "model.lora_attn_modules=[q_proj,k_proj,v_proj]",
        "model.apply_lora_to_mlp=false",
    ];
    assert_lora_on_two_ranks_equals_one_device(&case, &extra, &["full", "none"]);
}

/// `modules_to_save` (the embedding and head of tied Qwen2 trained in full beside the adapters,
/// untied) train on 2 ranks as on one device, sharded or not.
#[test]
fn modules_to_save_on_two_ranks_equal_one_device() {
    let case = Case::new("lora-modules-to-save", "qwen2");
    let extra = ["model.modules_to_save=[embed_tokens,lm_head]"];
    assert_lora_on_two_ranks_equals_one_device(&case, &extra, &["full", "none"]);
}

/// QLoRA on 2 ranks (the NF4 base sharded with the rest, its bytes gathered around each layer)
/// equals one device.
#[test]
fn qlora_on_two_ranks_equals_one_device() {
    let case = Case::with_vocab("qlora", "nf4/qlora", 256);
    let qlora = "model._component_=torchtune.models.llama3_1.qlora_llama3_1_8b";
    let single = case.dir.join("single");
    let o = case.run(
        1,
        "lora_finetune_single_device",
        &single,
        &["batch_size=4", qlora],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("QLoRA: 14 linear layers"), "{}", text(&o));
    let want = losses(&single.join("logs/metrics.jsonl"));
    let out = case.dir.join("dist");
    let o = case.run(2, "lora_finetune_distributed", &out, &[qlora], &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert_same_losses(&losses(&out.join("logs/metrics.jsonl")), &want, "qlora");
    for f in ["adapter_model.safetensors", "merged/model.safetensors"] {
        assert_same_tensors(
            &out.join("epoch_1").join(f),
            &single.join("epoch_1").join(f),
            1e-4,
            &format!("qlora: {f}"),
        );
    }
}

/// Knowledge distillation on 2 ranks (each with the whole teacher) equals one device.
#[test]
fn distillation_on_two_ranks_equals_one_device() {
    let case = Case::new("kd", "llama3");
    let teacher = fixtures().join("kd/teacher");
    let teacher = format!("teacher_checkpointer.checkpoint_dir={}", teacher.display());
    let kd = [teacher.as_str(), "kd_ratio=0.4"];
    let single = case.dir.join("single");
    let mut args = vec!["batch_size=4"];
    args.extend(kd);
    let o = case.run(
        1,
        "knowledge_distillation_single_device",
        &single,
        &args,
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    let want = losses(&single.join("logs/metrics.jsonl"));
    let out = case.dir.join("dist");
    let o = case.run(2, "knowledge_distillation_distributed", &out, &kd, &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert_same_losses(&losses(&out.join("logs/metrics.jsonl")), &want, "kd");
    assert_same_tensors(
        &out.join("epoch_1/adapter_model.safetensors"),
        &single.join("epoch_1/adapter_model.safetensors"),
        1e-4,
        "kd: adapter",
    );
}

/// 16 preference pairs of different lengths: a shared prompt (no labels), then two different
/// responses, as pre-tokenized JSONL. Token ids run from 3 to `vocab - 1`.
fn write_pairs(path: &Path, vocab: u32) {
    let ids = |seed: u32, len: u32| -> Vec<u32> {
        (0..len)
            .map(|j| (seed * 37 + j * 11) % (vocab - 3) + 3)
            .collect()
    };
    let mut lines = Vec::new();
    for i in 0..16u32 {
        let prompt = ids(i, 3 + i % 4);
        let side = |seed: u32, len: u32| {
            let response = ids(seed, len);
            let input: Vec<u32> = prompt.iter().chain(&response).copied().collect();
            let labels: Vec<i64> = std::iter::repeat_n(-100, prompt.len())
                .chain(response.iter().map(|&t| t as i64))
                .collect();
            (input, labels)
        };
        let (ci, cl) = side(i + 100, 4 + (i * 3) % 7);
        let (ri, rl) = side(i + 200, 3 + (i * 5) % 8);
        lines.push(
            serde_json::json!({
                "chosen_input_ids": ci, "chosen_labels": cl,
                "rejected_input_ids": ri, "rejected_labels": rl,
            })
            .to_string(),
        );
    }
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

/// DPO on 2 ranks equals one device at the same global batch: LoRA (the reference is the model
/// with its adapters disabled, gathered from the shards) and full (a frozen reference model on
/// every rank, the policy's weights sharded).
#[test]
fn dpo_on_two_ranks_equals_one_device() {
    let case = Case::new("dpo", "llama3");
    let data = case.dir.join("pairs.jsonl");
    write_pairs(&data, 503);
    let data = format!("dataset.data_files={}", data.display());
    let dpo = [
        data.as_str(),
        "loss._component_=torchtune.rlhf.loss.DPOLoss",
        "loss.beta=0.5",
    ];
    for (single_recipe, recipe, weights) in [
        (
            "lora_dpo_single_device",
            "lora_dpo_distributed",
            "adapter_model.safetensors",
        ),
        (
            "full_dpo_distributed",
            "full_dpo_distributed",
            "model.safetensors",
        ),
    ] {
        let single = case.dir.join(format!("single-{recipe}"));
        let mut args = vec!["batch_size=4"];
        args.extend(dpo);
        let o = case.run(1, single_recipe, &single, &args, &[]);
        assert!(o.status.success(), "{}", text(&o));
        let want = losses(&single.join("logs/metrics.jsonl"));
        assert_eq!(want.len(), 4, "16 pairs / (4 × 2 accumulation) × 2 epochs");
        let out = case.dir.join(format!("dist-{recipe}"));
        let o = case.run(2, recipe, &out, &dpo, &[]);
        assert!(o.status.success(), "{}", text(&o));
        assert_same_losses(&losses(&out.join("logs/metrics.jsonl")), &want, recipe);
        let (got, want) = (
            &metrics_lines(&out.join("logs/metrics.jsonl"))[3],
            &metrics_lines(&single.join("logs/metrics.jsonl"))[3],
        );
        for key in ["rewards/chosen", "rewards/margins", "log_probs/rejected"] {
            let (g, w) = (got[key].as_f64().unwrap(), want[key].as_f64().unwrap());
            assert!(
                (g - w).abs() <= 1e-4 * w.abs().max(1e-2),
                "{recipe}: {key} {g} vs {w}"
            );
        }
        assert_same_tensors(
            &out.join("epoch_1").join(weights),
            &single.join("epoch_1").join(weights),
            1e-4,
            recipe,
        );
    }
}

/// TRL's IPO and (reference-free) SimPO losses on 2 ranks equal one device at the same global
/// batch, LoRA and full; with SimPO no reference model is loaded on any rank. (Both are sums over
/// pairs; ORPO's and CPO's cross-entropy term is a mean over each micro-batch's tokens, as in
/// TRL, so they equal one device only at equal micro-batches.)
#[test]
fn trl_preference_losses_on_two_ranks_equal_one_device() {
    let case = Case::new("prefloss", "llama3");
    let data = case.dir.join("pairs.jsonl");
    write_pairs(&data, 509);
    let data = format!("dataset.data_files={}", data.display());
    for (loss, reference_free) in [
        ("torchtune.rlhf.loss.IPOLoss", false),
        ("torchtune.rlhf.loss.SimPOLoss", true),
    ] {
        let component = format!("loss._component_={loss}");
        let overrides = [data.as_str(), component.as_str(), "loss.beta=0.5"];
        for (single_recipe, recipe, weights) in [
            (
                "lora_dpo_single_device",
                "lora_dpo_distributed",
                "adapter_model.safetensors",
            ),
            (
                "full_dpo_distributed",
                "full_dpo_distributed",
                "model.safetensors",
            ),
        ] {
            let name = format!("{recipe} {loss}");
            let tag = if reference_free { "simpo" } else { "ipo" };
            let single = case.dir.join(format!("single-{recipe}-{tag}"));
            let mut args = vec!["batch_size=4"];
            args.extend(overrides);
            let o = case.run(1, single_recipe, &single, &args, &[]);
            assert!(o.status.success(), "{}", text(&o));
            assert_eq!(text(&o).contains("no reference model"), reference_free);
            let want = losses(&single.join("logs/metrics.jsonl"));
            let out = case.dir.join(format!("dist-{recipe}-{tag}"));
            let o = case.run(2, recipe, &out, &overrides, &[]);
            assert!(o.status.success(), "{}", text(&o));
            assert_eq!(text(&o).contains("no reference model"), reference_free);
            assert_same_losses(&losses(&out.join("logs/metrics.jsonl")), &want, &name);
            let (got, want) = (
                &metrics_lines(&out.join("logs/metrics.jsonl"))[3],
                &metrics_lines(&single.join("logs/metrics.jsonl"))[3],
            );
            for key in ["rewards/chosen", "rewards/margins", "log_probs/rejected"] {
                let (g, w) = (got[key].as_f64().unwrap(), want[key].as_f64().unwrap());
                assert!(
                    (g - w).abs() <= 1e-4 * w.abs().max(1e-2),
                    "{name}: {key} {g} vs {w}"
                );
            }
            assert_same_tensors(
                &out.join("epoch_1").join(weights),
                &single.join("epoch_1").join(weights),
                1e-4,
                &name,
            );
        }
    }
}

/// A mixture-of-experts model trained with the router's load-balancing loss
/// (`output_router_logits`) on 2 sharded ranks equals one device whose micro-batches hold the
/// rows each rank's do (the auxiliary loss is not additive over rows, so micro-batches must
/// match): the loss is weighed against every rank's targets and `aux_loss` is the mean over all
/// micro-batches.
#[test]
fn router_aux_loss_on_two_ranks_equals_one_device() {
    let case = Case::with_vocab("moe-aux", "models/qwen2_moe", 512);
    let model = case.dir.join("model");
    common::copy_model_with_config(&fixtures().join("models/qwen2_moe/model"), &model, |c| {
        c["output_router_logits"] = serde_json::Value::Bool(true);
        c["router_aux_loss_coef"] = serde_json::json!(0.1);
    });
    // Unshuffled, rank r's micro-batch m of a step takes rows 4m + r and 4m + r + 2 of its block
    // of 8; one device with batch 2 takes consecutive rows, so its file lists them in that order.
    let rows: Vec<String> = std::fs::read_to_string(case.dir.join("rows.jsonl"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    let order = [0, 2, 1, 3];
    let single_rows: Vec<&str> = (0..rows.len())
        .map(|i| rows[i / 4 * 4 + order[i % 4]].as_str())
        .collect();
    let single_data = case.dir.join("rows-single.jsonl");
    std::fs::write(&single_data, single_rows.join("\n") + "\n").unwrap();
    let ckpt = format!("checkpointer.checkpoint_dir={}", model.display());
    let tok = format!("tokenizer.path={}", model.display());
    let moe = [ckpt.as_str(), tok.as_str(), "shuffle=false"];
    let single = case.dir.join("single");
    let data = format!("dataset.data_files={}", single_data.display());
    let mut args = vec![
        "batch_size=2",
        "gradient_accumulation_steps=4",
        data.as_str(),
    ];
    args.extend(moe);
    let o = case.run(1, "full_finetune_single_device", &single, &args, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let want = losses(&single.join("logs/metrics.jsonl"));
    let out = case.dir.join("dist");
    let o = case.run(2, "full_finetune_distributed", &out, &moe, &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert_same_losses(&losses(&out.join("logs/metrics.jsonl")), &want, "moe aux");
    for step in 0..want.len() {
        let (got, want) = (
            &metrics_lines(&out.join("logs/metrics.jsonl"))[step],
            &metrics_lines(&single.join("logs/metrics.jsonl"))[step],
        );
        let (g, w) = (
            got["aux_loss"].as_f64().unwrap(),
            want["aux_loss"].as_f64().unwrap(),
        );
        assert!(
            (g - w).abs() <= 1e-5 * w,
            "step {step}: aux_loss {g} vs {w}"
        );
    }
    assert_same_tensors(
        &out.join("epoch_1/model.safetensors"),
        &single.join("epoch_1/model.safetensors"),
        1e-4,
        "moe aux",
    );
}

/// QAT on 2 sharded ranks equals one process (the fake quantization rides on each layer through
/// every gather): full (`qat_distributed`) and LoRA (`qat_lora_finetune_distributed`), one
/// optimizer step of 2 accumulated micro-batches. One step: rounding to int4 is discontinuous, so
/// after the ranks' differently ordered gradient sums have moved a weight by an ulp, a later
/// step may see it cross a rounding boundary that one process's does not.
#[test]
fn qat_on_two_ranks_equals_one_process() {
    let case = Case::new("qat", "llama3");
    let settings = [
        "quantizer._component_=torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer",
        "quantizer.groupsize=32",
        "epochs=1",
        "max_steps_per_epoch=1",
    ];
    for (recipe, weights) in [
        ("qat_distributed", "model.safetensors"),
        ("qat_lora_finetune_distributed", "adapter_model.safetensors"),
    ] {
        let single = case.dir.join(format!("single-{recipe}"));
        let mut args = vec!["batch_size=4"];
        args.extend(settings);
        let o = case.run(1, recipe, &single, &args, &[]);
        assert!(o.status.success(), "{}", text(&o));
        assert!(text(&o).contains("QAT: "), "{}", text(&o));
        let want = losses(&single.join("logs/metrics.jsonl"));
        let out = case.dir.join(format!("dist-{recipe}"));
        let o = case.run(2, recipe, &out, &settings, &[]);
        assert!(o.status.success(), "{}", text(&o));
        assert_same_losses(&losses(&out.join("logs/metrics.jsonl")), &want, recipe);
        assert_same_tensors(
            &out.join("epoch_0").join(weights),
            &single.join("epoch_0").join(weights),
            1e-4,
            recipe,
        );
    }
}

/// The early-exit recipe (LayerSkip) on 2 sharded ranks equals one process with the same global
/// batch: the rotating exits reach the same hidden states, the exits' head gradients are reduced
/// with the root's, and the last layer (above the highest exit) gets no gradient on any rank. With
/// layer dropout every rank draws the same rows (so a layer skipped for all of them is skipped, its
/// reduction left out, on every rank alike) and the run completes.
#[test]
fn early_exit_on_two_ranks_equals_one_process() {
    let case = Case::new("early_exit", "llama3");
    let exits = [
        "early_exit_loss.layers=0",
        "early_exit_loss.curriculum=torchtune.modules.early_exit_loss.RotationalEarlyExitCurriculum",
        "early_exit_loss.scale=0.5",
    ];
    let recipe = "dev/early_exit_finetune_distributed";
    let single = case.dir.join("single");
    let mut args = vec!["batch_size=4"];
    args.extend(exits);
    let o = case.run(1, recipe, &single, &args, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let want = losses(&single.join("logs/metrics.jsonl"));
    let out = case.dir.join("dist");
    let o = case.run(2, recipe, &out, &exits, &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert_same_losses(&losses(&out.join("logs/metrics.jsonl")), &want, recipe);
    assert_same_tensors(
        &out.join("epoch_1/model.safetensors"),
        &single.join("epoch_1/model.safetensors"),
        1e-4,
        recipe,
    );

    let dropout = case.dir.join("dropout");
    let o = case.run(
        2,
        recipe,
        &dropout,
        &[
            "layer_dropout.prob=0.9",
            "layer_dropout.layers_scale=uniform",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        losses(&dropout.join("logs/metrics.jsonl")).len(),
        want.len()
    );
}

/// A checkpoint written by 2 ranks resumes on one device (the global batch kept), and the run
/// ends where an uninterrupted single-device run ends.
#[test]
fn a_two_rank_checkpoint_resumes_on_one_device() {
    let case = Case::new("resume", "llama3");
    let (single, want) = case.single_device_reference("full_finetune_single_device");

    let out = case.dir.join("mixed");
    // Two ranks for the first epoch (killed by the end of step 3, after epoch_0 is saved)…
    let o = case.run(
        2,
        "full_finetune_distributed",
        &out,
        &[],
        &[("FERROTUNE_KILL_AFTER_STEP", "3")],
    );
    assert!(!o.status.success(), "the run should have been killed");
    assert!(out.join("epoch_0/recipe_state/state.json").is_file());
    // …then one device from epoch_0 on.
    let o = case.run(
        1,
        "full_finetune_single_device",
        &out,
        &["batch_size=4", "resume_from_checkpoint=true"],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_same_losses(&losses(&out.join("logs/metrics.jsonl")), &want, "resumed");
    assert_same_tensors(
        &out.join("epoch_1/model.safetensors"),
        &single.join("epoch_1/model.safetensors"),
        1e-4,
        "resumed",
    );
}

/// The other way: a single-device run killed mid-epoch resumes on 2 ranks, step-exactly.
#[test]
fn a_one_device_checkpoint_resumes_on_two_ranks() {
    let case = Case::new("resume-up", "qwen2");
    let (single, want) = case.single_device_reference("lora_finetune_single_device");

    let out = case.dir.join("mixed");
    let o = case.run(
        1,
        "lora_finetune_single_device",
        &out,
        &["batch_size=4", "save_every_n_steps=1"],
        &[("FERROTUNE_KILL_AFTER_STEP", "4")],
    );
    assert!(!o.status.success(), "the run should have been killed");
    // Step 3 is mid-epoch 1 (2 steps per epoch); killed before step 4's epoch-end save.
    assert!(out.join("step_3/recipe_state/state.json").is_file());
    assert!(!out.join("epoch_1").exists());
    for mode in ["full", "none"] {
        let o = case.run(
            2,
            "lora_finetune_distributed",
            &out,
            &[
                "resume_from_checkpoint=true",
                &format!("fsdp_sharding={mode}"),
            ],
            &[],
        );
        assert!(o.status.success(), "{mode}: {}", text(&o));
        assert_same_losses(&losses(&out.join("logs/metrics.jsonl")), &want, mode);
        assert_same_tensors(
            &out.join("epoch_1/adapter_model.safetensors"),
            &single.join("epoch_1/adapter_model.safetensors"),
            1e-4,
            mode,
        );
        // Back to the step-3 checkpoint for the next mode.
        std::fs::remove_dir_all(out.join("epoch_1")).unwrap();
    }
}

/// `kill -9` of rank 1 mid-run: rank 0 and the launcher stop with an error naming rank 1, well
/// within 60 s.
#[test]
fn a_killed_rank_stops_the_others_with_an_error_naming_it() {
    let case = Case::new("kill", "llama3");
    let out = case.dir.join("out");
    let t0 = Instant::now();
    let o = case.run(
        2,
        "full_finetune_distributed",
        &out,
        &["epochs=20"],
        &[
            ("FERROTUNE_KILL_AFTER_STEP", "2"),
            ("FERROTUNE_KILL_RANK", "1"),
        ],
    );
    let took = t0.elapsed();
    let log = text(&o);
    assert!(!o.status.success(), "{log}");
    assert!(took < Duration::from_secs(60), "took {took:?}");
    assert!(log.contains("rank 1"), "the lost rank is named: {log}");
    assert!(!out.join("epoch_19").exists());
}

/// A single-device recipe refuses to run as one of several processes, naming the distributed
/// one; `cp` copies the distributed recipe's source.
#[test]
fn single_device_recipes_refuse_several_processes() {
    let case = Case::new("refuse", "llama3");
    let out = case.dir.join("out");
    let o = case.run(2, "lora_finetune_single_device", &out, &[], &[]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("lora_finetune_distributed"),
        "{}",
        text(&o)
    );
    // `cp` hands out the distributed recipes' source like the others'.
    let dest = case.dir.join("recipe.rs");
    let args = [
        "cp".to_string(),
        "full_finetune_distributed".into(),
        dest.display().to_string(),
    ];
    let o = ferrotune(&args, &case.dir, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let source = std::fs::read_to_string(&dest).unwrap();
    assert!(source.contains("forward_backward_sharded"));
}

/// `val_loss` of every step from a log.
fn val_losses(metrics: &Path) -> Vec<f64> {
    metrics_lines(metrics)
        .iter()
        .filter_map(|v| v.get("val_loss").and_then(serde_json::Value::as_f64))
        .collect()
}

/// Validation in the distributed recipes deals `dataset_val` as torchtune's does: a sampler
/// without shuffling pads the 7 rows to 8 with row 0, rank 0 takes rows 0, 2, 4, 6 and rank 1
/// rows 1, 3, 5, 0, and each rank's last incomplete batch of `batch_size_val: 3` is dropped (rows
/// 6 and 0): the ranks together score rows 0..6, their token-weighted mean all-reduced. So every
/// step's `val_loss` equals one device's over the first 6 rows, along the same training.
#[test]
fn validation_on_two_ranks_scores_the_rows_torchtunes_sampler_deals() {
    let case = Case::new("validation", "llama3");
    let rows = std::fs::read_to_string(case.dir.join("rows.jsonl")).unwrap();
    let first = |n: usize| rows.lines().take(n).collect::<Vec<_>>().join("\n") + "\n";
    std::fs::write(case.dir.join("val7.jsonl"), first(7)).unwrap();
    std::fs::write(case.dir.join("val6.jsonl"), first(6)).unwrap();
    let val = |file: &str, batch: usize| -> Vec<String> {
        vec![
            "run_val_every_n_steps=1".into(),
            "dataset_val._component_=torchtune.datasets.tokenized_dataset".into(),
            "dataset_val.source=json".into(),
            format!("dataset_val.data_files={}", case.dir.join(file).display()),
            format!("batch_size_val={batch}"),
        ]
    };
    let single = case.dir.join("single");
    let mut extra = vec!["batch_size=4".to_string()];
    extra.extend(val("val6.jsonl", 2));
    let extra_refs: Vec<&str> = extra.iter().map(String::as_str).collect();
    let o = case.run(1, "lora_finetune_single_device", &single, &extra_refs, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let want = val_losses(&single.join("logs/metrics.jsonl"));
    assert!(want.len() >= 4, "{want:?}");

    let out = case.dir.join("dist");
    let mut extra = vec!["fsdp_sharding=full".to_string()];
    extra.extend(val("val7.jsonl", 3));
    let extra_refs: Vec<&str> = extra.iter().map(String::as_str).collect();
    let o = case.run(2, "lora_finetune_distributed", &out, &extra_refs, &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        text(&o).matches("Validation loss:").count(),
        want.len(),
        "printed once a step, by rank 0: {}",
        text(&o)
    );
    let got = val_losses(&out.join("logs/metrics.jsonl"));
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            ((g - w) / w).abs() <= 1e-5,
            "step {}: val_loss {g} vs one device's {w}",
            step + 1
        );
    }
}
