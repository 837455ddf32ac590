//! Helpers shared by the end-to-end tests that run the `ferrotune` binary on the fixtures.
// Each test file uses its own subset.
#![allow(dead_code)]

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_core::{Device, Tensor};
#[allow(unused_imports)]
pub use ferrotune_testing::rel_l2;
use serde_json::Value;

/// The repository's `tests/fixtures`.
pub use ferrotune_testing::fixtures;

/// Runs `ferrotune args...` in `cwd` with `env` added (later pairs win). The caller's `RUST_LOG`
/// is not passed on, so what a run reports does not depend on the shell the tests run from.
pub fn ferrotune(args: &[impl AsRef<OsStr>], cwd: &Path, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrotune"));
    cmd.args(args).current_dir(cwd).env_remove("RUST_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run ferrotune")
}

/// `ferrotune run RECIPE --config CFG output_dir=OUT EXTRA...` in `cwd` with `env` added.
pub fn run_recipe(
    recipe: &str,
    cfg: &Path,
    out: &Path,
    extra: &[&str],
    cwd: &Path,
    env: &[(&str, &str)],
) -> Output {
    let mut args = vec![
        "run".to_string(),
        recipe.to_string(),
        "--config".into(),
        cfg.display().to_string(),
        format!("output_dir={}", out.display()),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    ferrotune(&args, cwd, env)
}

/// stdout then stderr, for assertion messages.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A fresh, empty `ferrotune-{group}-{name}-{pid}` folder under the temp dir.
pub fn tmpdir(group: &str, name: &str) -> PathBuf {
    ferrotune_testing::fresh_dir(&format!("ferrotune-{group}-{name}-{}", std::process::id()))
}

/// Every tensor of a safetensors file.
pub fn load(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The objects of a `metrics.jsonl`.
pub fn metrics_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The (step, loss, lr) of each logged step (the other values are timings).
pub fn losses(lines: &[Value]) -> Vec<(u64, f64, f64)> {
    lines
        .iter()
        .map(|v| {
            (
                v["step"].as_u64().unwrap(),
                v["loss"].as_f64().unwrap(),
                v["lr"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// A LoRA fine-tuning config on a tiny fixture model (`MODEL`, `DATA` and `OUT` filled in by
/// [`write_config`]): AdamW at lr 1e-3, batch 2, one epoch, unshuffled, metrics in `OUT/logs`.
pub const TINY_LORA: &str = "
output_dir: OUT
model:
  lora_attn_modules: [q_proj, v_proj]
  lora_rank: 4
  lora_alpha: 8
tokenizer:
  path: MODEL
checkpointer:
  checkpoint_dir: MODEL
  output_dir: ${output_dir}
dataset:
  _component_: torchtune.datasets.tokenized_dataset
  source: json
  data_files: DATA
seed: 7
shuffle: false
batch_size: 2
epochs: 1
optimizer:
  _component_: torch.optim.AdamW
  lr: 1e-3
lr_scheduler: null
loss:
  _component_: torch.nn.CrossEntropyLoss
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: ${output_dir}/logs
log_every_n_steps: 1
device: cpu
dtype: fp32
";

/// Writes `template` with `OUT` (`dir/out`), `MODEL` (the `family` fixture's model folder) and
/// `DATA` (`data`) filled in, as `dir/config.yaml`, and returns that path.
pub fn write_config(template: &str, dir: &Path, family: &str, data: &Path) -> PathBuf {
    let model = fixtures().join(family).join("model");
    let yaml = template
        .replace("OUT", &dir.join("out").display().to_string())
        .replace("MODEL", &model.display().to_string())
        .replace("DATA", &data.display().to_string());
    let path = dir.join("config.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

/// A copy of the model folder `src` in `dst` with `edit` applied to its `config.json` (a
/// checkpoint whose config asks for something the fixture's does not).
#[allow(dead_code)]
pub fn copy_model_with_config(src: &Path, dst: &Path, edit: impl FnOnce(&mut Value)) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
    }
    let path = dst.join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
}

/// A JSON file's value (a golden, a saved config), the path named when it cannot be read.
pub fn read_json(path: impl AsRef<Path>) -> Value {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}
