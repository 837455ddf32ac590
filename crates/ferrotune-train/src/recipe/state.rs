//! Checkpoint folders in torchtune's layout (`output_dir/epoch_{k}/`, and `step_{n}/` for
//! `save_every_n_steps`) and the recipe state that makes `resume_from_checkpoint` step-exact.
//!
//! A folder is written under a temporary name, its files and folders flushed to disk, and renamed
//! into place when complete, so a run killed mid-save (or a power loss) leaves either the previous
//! checkpoint or the new one, never half of one; what a killed save or prune left behind (the
//! temporary names) is cleared by the next save. The
//! recipe state (`recipe_state/state.json` + `recipe_state/optimizer.safetensors`) records where
//! the data order stands, the step count, the seed and the LoRA dropout generators.
//!
//! Every run carries an identity, its run id ([`new_run_id`]), saved in the recipe state and
//! written on each metrics line: a resume continues the checkpoints of one run only, and a fresh
//! run refuses an output folder holding an earlier run's outputs unless told to overwrite them
//! ([`claim_output`]), so two runs' checkpoints and logs never mix.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use ferrotune_models::save::{write_atomic, write_atomic_with};
use serde::{Deserialize, Serialize};

use crate::optim::Optimizer;

/// Where the run stands: enough to continue exactly where it was saved.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainState {
    /// The epoch to continue in (0-based).
    pub epoch: usize,
    /// Optimizer steps already taken in that epoch.
    pub step_in_epoch: usize,
    /// Optimizer steps taken since the start of training.
    pub global_step: usize,
    /// The run's seed (data order, adapter init, dropout).
    pub seed: u64,
    /// Rows in the dataset when saved (a different dataset cannot resume).
    pub dataset_rows: usize,
    /// Steps per epoch when saved.
    pub steps_per_epoch: usize,
    /// LoRA dropout generator states, in module order.
    pub dropout_states: Vec<u64>,
    /// The recipe that wrote it.
    pub recipe: String,
    /// Distributed runs: every rank's LoRA dropout generator states, in rank order (rank 0's are
    /// also `dropout_states`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rank_dropout_states: Vec<Vec<u64>>,
    /// The run's identity ([`new_run_id`]); empty in checkpoints written before runs had one.
    #[serde(default)]
    pub run_id: String,
}

impl TrainState {
    /// The state of a run that starts afresh.
    pub fn fresh(recipe: &str, seed: u64, dataset_rows: usize, steps_per_epoch: usize) -> Self {
        TrainState {
            epoch: 0,
            step_in_epoch: 0,
            global_step: 0,
            seed,
            dataset_rows,
            steps_per_epoch,
            dropout_states: Vec::new(),
            recipe: recipe.to_string(),
            rank_dropout_states: Vec::new(),
            run_id: new_run_id(),
        }
    }

    /// The state after epoch `epoch` (0-based) of this run, `global_step` steps in: where the
    /// next epoch starts.
    pub fn after_epoch(&self, epoch: usize, global_step: usize) -> TrainState {
        TrainState {
            epoch: epoch + 1,
            step_in_epoch: 0,
            global_step,
            ..self.clone()
        }
    }
}

/// Where a run writes: `output_dir` (required: logs, the config copy) and where its checkpoints
/// go (`checkpointer.output_dir`, else `output_dir`).
pub fn output_dirs(cfg: &crate::config::Config) -> Result<(PathBuf, PathBuf)> {
    let output_dir = cfg
        .path("output_dir")?
        .ok_or_else(|| anyhow::anyhow!("{}: 'output_dir' is required", cfg.origin))?;
    let checkpoints = cfg
        .path("checkpointer.output_dir")?
        .unwrap_or(output_dir.clone());
    Ok((output_dir, checkpoints))
}

/// A new run's identity: its start time (UTC) and 32 random bits, e.g. `20261129T011502-3fa9c2d1`
/// (sortable by start, unique among runs started in the same second).
pub fn new_run_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    // std's RandomState is seeded from the OS's randomness; hashing the clock and pid on top
    // separates two runs started at once.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(now.as_nanos());
    h.write_u32(std::process::id());
    let secs = now.as_secs();
    let (y, m, d) = civil_date(secs / 86_400);
    let t = secs % 86_400;
    format!(
        "{y:04}{m:02}{d:02}T{:02}{:02}{:02}-{:08x}",
        t / 3600,
        t / 60 % 60,
        t % 60,
        h.finish() as u32
    )
}

/// The (year, month, day) of `days` since 1970-01-01 in the proleptic Gregorian calendar
/// (Howard Hinnant's `civil_from_days`).
fn civil_date(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + u64::from(m <= 2), m, d)
}

/// The checkpoint folders (`epoch_N`, `step_N`) directly in `dir`, sorted by kind and number.
fn checkpoint_folders(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<(String, u64, PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            let (kind, n) = name.split_once('_')?;
            let is_kind = kind == "epoch" || kind == "step";
            let n = n.parse::<u64>().ok().filter(|_| is_kind)?;
            e.path().is_dir().then(|| (kind.to_string(), n, e.path()))
        })
        .collect();
    found.sort();
    found.into_iter().map(|(_, _, p)| p).collect()
}

/// Makes sure a fresh run (not a resume) does not mix with an earlier run's outputs: if
/// `checkpoint_dirs` hold checkpoint folders (`epoch_N`, `step_N`) or the metrics log
/// `metrics_file` holds lines, this refuses, naming what it found and the two ways on
/// (`resume_from_checkpoint` or `overwrite_output_dir`), unless `overwrite` is set; then the lead
/// rank deletes those checkpoint folders (the log is restarted when it opens). `origin` names the
/// config in errors.
pub fn claim_output(
    origin: &str,
    checkpoint_dirs: &[&Path],
    metrics_file: Option<&Path>,
    overwrite: bool,
    lead: bool,
) -> Result<()> {
    let mut dirs: Vec<&Path> = checkpoint_dirs.to_vec();
    dirs.sort();
    dirs.dedup();
    let folders: Vec<PathBuf> = dirs.iter().flat_map(|d| checkpoint_folders(d)).collect();
    let logged = metrics_file
        .and_then(|f| std::fs::read_to_string(f).ok())
        .map_or(0, |t| t.lines().filter(|l| !l.trim().is_empty()).count());
    if folders.is_empty() && logged == 0 {
        return Ok(());
    }
    let mut found = Vec::new();
    for dir in &dirs {
        let names: Vec<String> = folders
            .iter()
            .filter(|f| f.parent() == Some(*dir))
            .filter_map(|f| f.file_name()?.to_str().map(str::to_string))
            .collect();
        let runs: Vec<String> = folders
            .iter()
            .filter(|f| f.parent() == Some(*dir))
            .filter_map(|f| read_checkpoint_state(f).ok())
            .map(|s| s.state.run_id)
            .filter(|id| !id.is_empty())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        if !names.is_empty() {
            let shown = match names.len() {
                n if n > 4 => format!(
                    "{}, {}, … {} ({n} folders)",
                    names[0],
                    names[1],
                    names[n - 1]
                ),
                _ => names.join(", "),
            };
            let of = match runs.len() {
                0 => String::new(),
                1 => format!(" of run {}", runs[0]),
                _ => format!(" of runs {}", runs.join(", ")),
            };
            found.push(format!("checkpoints {shown} in {}{of}", dir.display()));
        }
    }
    if let (Some(f), true) = (metrics_file, logged > 0) {
        found.push(format!("{} with {logged} logged step(s)", f.display()));
    }
    if !overwrite {
        bail!(
            "{origin}: this fresh run's output folders hold an earlier run's outputs: {}. Set \
             resume_from_checkpoint=True to continue that run, or overwrite_output_dir=True to \
             delete them and start afresh",
            found.join("; ")
        );
    }
    if lead {
        eprintln!(
            "overwrite_output_dir: deleting an earlier run's outputs: {}",
            found.join("; ")
        );
        for folder in &folders {
            remove_checkpoint_folder(folder)?;
        }
    }
    Ok(())
}

/// Deletes checkpoint folder `folder`, renaming it first so a kill while deleting leaves a
/// temporary name the next save clears, never a half-deleted `step_N` that looks like a
/// checkpoint to resume.
fn remove_checkpoint_folder(folder: &Path) -> Result<()> {
    let name = folder
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    let doomed = folder.with_file_name(format!(".{name}.pruning"));
    std::fs::rename(folder, &doomed)
        .with_context(|| format!("{}: cannot remove", folder.display()))?;
    std::fs::remove_dir_all(&doomed).with_context(|| format!("{}: cannot remove", doomed.display()))
}

/// The checkpoint a run resumes: `recipe_checkpoint` (torchtune's
/// `checkpointer.recipe_checkpoint`: a checkpoint folder or a file in it), else the latest in
/// `output_dir`; `origin` names the config in errors.
pub fn resume_point(
    origin: &str,
    recipe_checkpoint: Option<&Path>,
    output_dir: &Path,
) -> Result<SavedCheckpoint> {
    match recipe_checkpoint {
        Some(p) if p.is_dir() => read_checkpoint_state(p),
        Some(p) => read_checkpoint_state(p.parent().unwrap_or(Path::new(""))),
        None => latest_to_resume(origin, output_dir),
    }
}

/// The run's seed: the resumed checkpoint's, else the config's ([`crate::recipe::setup::seed`]).
pub fn run_seed(cfg: &crate::config::Config, saved: Option<&SavedCheckpoint>) -> Result<u64> {
    match saved {
        Some(s) => Ok(s.state.seed),
        None => crate::recipe::setup::seed(cfg),
    }
}

const STATE_DIR: &str = "recipe_state";
const STATE_FILE: &str = "state.json";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// Writes a checkpoint folder `output_dir/name` through `fill` (which writes the model files
/// into the folder it is given), then the recipe state; atomically replaces an older folder of
/// the same name.
pub fn save_checkpoint(
    output_dir: &Path,
    name: &str,
    state: &TrainState,
    optimizer_state: Vec<(String, Tensor)>,
    fill: impl FnOnce(&Path) -> Result<()>,
) -> Result<PathBuf> {
    write_folder(output_dir, name, |tmp| {
        std::fs::create_dir_all(tmp.join(STATE_DIR))
            .with_context(|| format!("{}: cannot create", tmp.display()))?;
        fill(tmp)?;
        write_optimizer(&tmp.join(STATE_DIR).join(OPTIMIZER_FILE), optimizer_state)?;
        let json = serde_json::to_string_pretty(state).expect("state serializes");
        write_atomic(&tmp.join(STATE_DIR).join(STATE_FILE), json.as_bytes())?;
        Ok(())
    })
}

/// Writes folder `output_dir/name` through `fill` under a temporary name and renames it into
/// place when complete (replacing an older folder of the same name): a run killed mid-save
/// leaves the old folder or the new one, never half of one.
pub fn write_folder(
    output_dir: &Path,
    name: &str,
    fill: impl FnOnce(&Path) -> Result<()>,
) -> Result<PathBuf> {
    std::fs::create_dir_all(output_dir)
        .with_context(|| format!("{}: cannot create output_dir", output_dir.display()))?;
    clear_leftovers(output_dir)?;
    let final_dir = output_dir.join(name);
    let tmp = output_dir.join(format!(".{name}.partial{}", std::process::id()));
    std::fs::create_dir_all(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
    if let Err(e) = fill(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    // On disk before the rename publishes it: a power loss after the rename must not find the
    // folder's name pointing at unwritten files.
    sync_tree(&tmp)?;
    if final_dir.exists() {
        let old = output_dir.join(format!(".{name}.old{}", std::process::id()));
        std::fs::rename(&final_dir, &old)
            .with_context(|| format!("{}: cannot replace", final_dir.display()))?;
        std::fs::rename(&tmp, &final_dir)
            .with_context(|| format!("{}: cannot move into place", final_dir.display()))?;
        let _ = std::fs::remove_dir_all(&old);
    } else {
        std::fs::rename(&tmp, &final_dir)
            .with_context(|| format!("{}: cannot move into place", final_dir.display()))?;
    }
    sync_dir(output_dir)?;
    Ok(final_dir)
}

/// What a temporary name [`write_folder`] or [`prune_checkpoints`] gives a folder says of it.
#[derive(Debug, PartialEq)]
enum Leftover<'a> {
    /// `.{name}.partial{pid}` (a save not finished) or `.{name}.pruning` (a prune not finished).
    Unfinished,
    /// `.{name}.old{pid}`: checkpoint `name` as it was before a save replaced it.
    Replaced(&'a str),
}

/// The kind of temporary name `file_name` is, if it is one.
fn leftover(file_name: &str) -> Option<Leftover<'_>> {
    let rest = file_name.strip_prefix('.')?;
    let numbered = |suffix: &str| {
        rest.rsplit_once(suffix).filter(|(name, pid)| {
            !name.is_empty() && !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit())
        })
    };
    if numbered(".partial").is_some() || rest.ends_with(".pruning") {
        Some(Leftover::Unfinished)
    } else {
        numbered(".old").map(|(name, _)| Leftover::Replaced(name))
    }
}

/// Clears the folders a killed save or prune left under temporary names in `output_dir` (one
/// process writes a run's checkpoints, so none of them is still being written). A replaced
/// checkpoint whose replacement never took its name (a kill between [`write_folder`]'s two
/// renames) is the only copy: it gets its name back instead.
fn clear_leftovers(output_dir: &Path) -> Result<()> {
    let entries = std::fs::read_dir(output_dir)
        .with_context(|| format!("{}: cannot list", output_dir.display()))?;
    for entry in entries {
        let path = entry?.path();
        let Some(kind) = path.file_name().and_then(|n| n.to_str()).and_then(leftover) else {
            continue;
        };
        if !path.is_dir() {
            continue;
        }
        if let Leftover::Replaced(name) = kind {
            let checkpoint = output_dir.join(name);
            if !checkpoint.exists() {
                std::fs::rename(&path, &checkpoint).with_context(|| {
                    format!(
                        "{}: cannot restore as {}",
                        path.display(),
                        checkpoint.display()
                    )
                })?;
                continue;
            }
        }
        std::fs::remove_dir_all(&path).with_context(|| {
            format!("{}: cannot remove a killed save's leftover", path.display())
        })?;
    }
    Ok(())
}

/// Flushes every file and folder under `dir` (and `dir`) to disk.
fn sync_tree(dir: &Path) -> Result<()> {
    for entry in
        std::fs::read_dir(dir).with_context(|| format!("{}: cannot list", dir.display()))?
    {
        let path = entry?.path();
        if path.is_dir() {
            sync_tree(&path)?;
        } else {
            std::fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .with_context(|| format!("{}: cannot flush to disk", path.display()))?;
        }
    }
    sync_dir(dir)
}

/// Flushes folder `dir`'s entries (a rename into it, a new file) to disk. Windows cannot open a
/// folder as a file; there the rename's durability is left to the file system.
fn sync_dir(dir: &Path) -> Result<()> {
    if cfg!(windows) {
        return Ok(());
    }
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("{}: cannot flush to disk", dir.display()))
}

fn write_optimizer(path: &Path, state: Vec<(String, Tensor)>) -> Result<()> {
    let tensors: Vec<(String, Tensor)> = state
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_device(&Device::Cpu)?.contiguous()?)))
        .collect::<candle_core::Result<_>>()?;
    write_atomic_with(path, |tmp| {
        candle_core::safetensors::save(
            &tensors
                .iter()
                .map(|(k, t)| (k.clone(), t.clone()))
                .collect::<HashMap<_, _>>(),
            tmp,
        )
        .map_err(|e| e.to_string())
    })?;
    Ok(())
}

/// A saved checkpoint found in an output folder.
#[derive(Debug, Clone)]
pub struct SavedCheckpoint {
    /// The checkpoint folder (`epoch_k` or `step_n`).
    pub dir: PathBuf,
    /// Its recipe state.
    pub state: TrainState,
}

/// Reads the recipe state of checkpoint folder `dir`.
pub fn read_checkpoint_state(dir: &Path) -> Result<SavedCheckpoint> {
    let file = dir.join(STATE_DIR).join(STATE_FILE);
    let text = std::fs::read_to_string(&file)
        .with_context(|| format!("{}: cannot read the recipe state", file.display()))?;
    let state: TrainState = serde_json::from_str(&text)
        .with_context(|| format!("{}: invalid recipe state", file.display()))?;
    Ok(SavedCheckpoint {
        dir: dir.to_path_buf(),
        state,
    })
}

/// The most advanced complete checkpoint in `output_dir` (most optimizer steps; at equal steps
/// the epoch folder), if any; an error when the folder holds checkpoints of more than one run
/// (which one to continue is then the user's choice: `checkpointer.recipe_checkpoint`).
pub fn latest_checkpoint(output_dir: &Path) -> Result<Option<SavedCheckpoint>> {
    let mut best: Option<SavedCheckpoint> = None;
    // Each run's latest folder, to name them when there are several.
    let mut runs: std::collections::BTreeMap<String, PathBuf> = Default::default();
    for folder in checkpoint_folders(output_dir) {
        if !folder.join(STATE_DIR).join(STATE_FILE).is_file() {
            continue;
        }
        let found = read_checkpoint_state(&folder)?;
        runs.insert(found.state.run_id.clone(), folder);
        let better = match &best {
            None => true,
            Some(b) => {
                (found.state.global_step, found.state.epoch) > (b.state.global_step, b.state.epoch)
            }
        };
        if better {
            best = Some(found);
        }
    }
    if runs.len() > 1 {
        let listed: Vec<String> = runs
            .iter()
            .map(|(id, dir)| {
                let id = if id.is_empty() { "(no run id)" } else { id };
                format!("run {id} (e.g. {})", dir.display())
            })
            .collect();
        bail!(
            "{}: holds checkpoints of {} different runs: {}; name the checkpoint to continue with \
             checkpointer.recipe_checkpoint",
            output_dir.display(),
            runs.len(),
            listed.join(", ")
        );
    }
    Ok(best)
}

/// Removes all but the newest `keep` checkpoint folders of the kind `name` is (`epoch_N` or
/// `step_N`, newest = highest N) in `output_dir`. Only folders named exactly so are touched.
pub fn prune_checkpoints(output_dir: &Path, name: &str, keep: usize) -> Result<()> {
    let Some((kind, _)) = name.rsplit_once('_') else {
        return Ok(());
    };
    let prefix = format!("{kind}_");
    let mut found: Vec<(u64, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(output_dir)
        .with_context(|| format!("{}: cannot list", output_dir.display()))?
    {
        let path = entry?.path();
        let number = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix(&prefix))
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse::<u64>().ok());
        if let (Some(n), true) = (number, path.is_dir()) {
            found.push((n, path));
        }
    }
    found.sort_by_key(|(n, _)| std::cmp::Reverse(*n));
    for (_, old) in found.into_iter().skip(keep) {
        remove_checkpoint_folder(&old)?;
    }
    Ok(())
}

/// The optimizer state saved in checkpoint folder `dir`, as named tensors.
pub fn read_optimizer_state(dir: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    let file = dir.join(STATE_DIR).join(OPTIMIZER_FILE);
    candle_core::safetensors::load(&file, device)
        .with_context(|| format!("{}: cannot read the optimizer state", file.display()))
}

/// Restores `state` (read from checkpoint folder `dir`) into `optimizer`.
pub fn load_optimizer_state(
    dir: &Path,
    optimizer: &mut dyn Optimizer,
    state: &HashMap<String, Tensor>,
) -> Result<()> {
    let file = dir.join(STATE_DIR).join(OPTIMIZER_FILE);
    optimizer
        .load_state_dict(state)
        .with_context(|| format!("{}: optimizer state does not fit this run", file.display()))
}

/// The checkpoint `resume_from_checkpoint: true` continues from: the latest one with a recipe
/// state under `dir`, or an error (config `origin`) naming the folder searched.
pub fn latest_to_resume(origin: &str, dir: &Path) -> Result<SavedCheckpoint> {
    match latest_checkpoint(dir)? {
        Some(s) => Ok(s),
        None => bail!(
            "{origin}: resume_from_checkpoint is true but {} holds no checkpoint with a recipe state",
            dir.display()
        ),
    }
}

/// The state a PPO or GRPO run starts from: `fresh`, or `saved`'s after checking that it
/// continues this run (`fresh`'s recipe, dataset rows and steps per epoch) and loading its
/// optimizer state into `optimizer` (this rank's part of it when the model is `sharded`).
pub fn start_or_resume(
    fresh: TrainState,
    saved: Option<&SavedCheckpoint>,
    optimizer: &mut dyn Optimizer,
    sharded: Option<&crate::dist::fsdp::ShardedModel>,
    device: &Device,
) -> Result<TrainState> {
    let Some(sv) = saved else {
        return Ok(fresh);
    };
    check_resumable(sv, &fresh.recipe, fresh.dataset_rows, fresh.steps_per_epoch)?;
    let mut opt_state = read_optimizer_state(&sv.dir, device)?;
    if let Some(sm) = sharded {
        // The checkpoint holds the whole state under single-device names: this rank's part.
        opt_state = sm.shard_optimizer_state(opt_state)?;
    }
    load_optimizer_state(&sv.dir, optimizer, &opt_state)?;
    eprintln!(
        "Resuming from {} at epoch {} (optimizer step {})",
        sv.dir.display(),
        sv.state.epoch,
        sv.state.global_step
    );
    Ok(sv.state.clone())
}

/// What every run writes before its first step: the resolved config as `output_dir/config.yaml`
/// (and to the config's experiment tracker, if it names one), and the config's metric logger,
/// tagging each line with the run's id, with any line after `start.global_step` or of another
/// run dropped (resuming redoes the steps after the checkpoint; a fresh run starts a fresh log:
/// no line of an earlier run is left to be mistaken for this one's).
pub fn open_run_log(
    cfg: &crate::config::Config,
    output_dir: &Path,
    start: &TrainState,
) -> Result<crate::metrics::MetricLogger> {
    write_config_copy(output_dir, &cfg.to_yaml())?;
    let mut logger =
        crate::metrics::MetricLogger::from_config(cfg.get("metric_logger"), output_dir)
            .with_context(|| format!("{}: metric_logger", cfg.origin))?;
    logger.set_run_id(&start.run_id);
    logger.truncate_after(start.global_step as u64)?;
    logger.log_config(&cfg.root);
    Ok(logger)
}

/// The JSONL file the config's metric logger writes (`None` for loggers that write none).
pub fn metrics_file(cfg: &crate::config::Config, output_dir: &Path) -> Result<Option<PathBuf>> {
    crate::metrics::MetricLogger::file_for(cfg.get("metric_logger"), output_dir)
        .with_context(|| format!("{}: metric_logger", cfg.origin))
}

/// Checks that a saved state can continue this run.
pub fn check_resumable(
    saved: &SavedCheckpoint,
    recipe: &str,
    dataset_rows: usize,
    steps_per_epoch: usize,
) -> Result<()> {
    let s = &saved.state;
    // The single-device and distributed recipes of one kind save the same checkpoints.
    let kind = |r: &str| {
        r.trim_end_matches("_single_device")
            .trim_end_matches("_distributed")
            .to_string()
    };
    if kind(&s.recipe) != kind(recipe) {
        bail!(
            "{}: saved by {}, cannot resume it with {recipe}",
            saved.dir.display(),
            s.recipe
        );
    }
    if s.dataset_rows != dataset_rows || s.steps_per_epoch != steps_per_epoch {
        bail!(
            "{}: saved with {} dataset rows and {} steps per epoch, this run has {dataset_rows} and \
             {steps_per_epoch}: the data or batch settings changed, so it cannot resume step-exactly",
            saved.dir.display(),
            s.dataset_rows,
            s.steps_per_epoch
        );
    }
    Ok(())
}

/// Writes the resolved config beside the checkpoints (what the run was, for reproduction).
pub fn write_config_copy(output_dir: &Path, yaml: &str) -> Result<()> {
    std::fs::create_dir_all(output_dir)
        .with_context(|| format!("{}: cannot create output_dir", output_dir.display()))?;
    write_atomic(&output_dir.join("config.yaml"), yaml.as_bytes())?;
    Ok(())
}
