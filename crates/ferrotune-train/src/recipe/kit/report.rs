//! What a training run reports besides its metrics: the progress bar, the memory a rank holds,
//! keys a recipe ignores; and the test hook that kills a run after a given step.

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};

use crate::config::Config;
use crate::dist::fsdp::ShardedModel;
use crate::optim::Optimizer;

/// Prints what this rank holds between steps against what one device would hold: the measure
/// of sharding.
pub fn report_memory(sm: &ShardedModel, optimizer: &dyn Optimizer, rank: usize) -> Result<()> {
    let (params, grads) = sm.resident_bytes();
    let (one_params, one_grads) = sm.single_device_bytes();
    let opt = optimizer.state_bytes()?;
    let held: usize = sm
        .optimizer_params()
        .iter()
        .map(|(_, v)| v.elem_count())
        .sum::<usize>()
        .max(1);
    let one_opt = (opt as f64 * sm.trainable_numel() as f64 / held as f64) as usize;
    let mb = |b: usize| b as f64 / 1e6;
    let line = format!(
        "rank {rank}: parameters {:.1} MB + gradients {:.1} MB + optimizer state {:.1} MB = {:.1} MB \
         (one device: {:.1} + {:.1} + {:.1} = {:.1} MB)",
        mb(params),
        mb(grads),
        mb(opt),
        mb(params + grads + opt),
        mb(one_params),
        mb(one_grads),
        mb(one_opt),
        mb(one_params + one_grads + one_opt)
    );
    // One write of the whole line: the ranks share the terminal, and `eprintln!` may write a
    // formatted line in pieces that interleave with another process's.
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
    Ok(())
}

/// Says which of `keys` the config sets although only the `family` recipes read them.
pub fn note_ignored_keys(cfg: &Config, keys: &[&str], family: &str, recipe: &str) {
    for key in keys {
        if cfg.get(key).is_some_and(|v| !v.is_null()) {
            eprintln!("note: '{key}' applies to the {family} recipes; {recipe} ignores it");
        }
    }
}

/// `FERROTUNE_KILL_AFTER_STEP=N` sends this process SIGKILL right after step N is logged: how the
/// tests interrupt a run at a known point to check that resuming is step-exact.
/// With `FERROTUNE_KILL_RANK=R` only rank R is killed (the others must notice).
/// A test hook: does nothing unless built with the `test-hooks` feature (the test suite's).
pub fn kill_if_asked(global_step: usize, rank: usize) {
    #[cfg(feature = "test-hooks")]
    {
        use ferrotune_core::switch::{KILL_AFTER_STEP, KILL_RANK};
        let rank_ok = KILL_RANK.count().is_none_or(|r| r == rank);
        if KILL_AFTER_STEP.count() == Some(global_step) && rank_ok {
            // SAFETY: kill(2) on our own pid with a valid signal number has no memory effects.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = (global_step, rank);
}

/// The progress bar of epoch `epoch` (0-based) over `len` steps, `pos` already taken.
pub fn progress_bar(len: usize, pos: usize, epoch: usize) -> ProgressBar {
    let bar = ProgressBar::new(len as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg}: {percent:>3}%|{bar:24}| {pos}/{len} [{elapsed_precise}<{eta_precise}]",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_position(pos as u64);
    bar.set_message(format!("{}|{}", epoch + 1, pos));
    bar
}
