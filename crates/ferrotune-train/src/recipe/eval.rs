//! `eval`: perplexity of a model (optionally with an adapter) on a dataset.
//!
//! Keys: the checkpointer/tokenizer/dataset sections of the training configs, `batch_size`,
//! `max_steps_per_epoch` (a cap on batches), `device`, `dtype`. Prints the mean cross-entropy over
//! target tokens and its exponential.

use std::time::Instant;

use anyhow::Result;
use ferrotune_infer::{load_for_inference, pad_id};

use crate::config::Config;
use crate::recipe::kit::model::load_options;
use crate::recipe::kit::validation::target_loss_sum;
use crate::recipe::setup;

/// The result of an evaluation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalResult {
    /// Mean cross-entropy per target token.
    pub loss: f64,
    /// `exp(loss)`.
    pub perplexity: f64,
    /// Target tokens scored.
    pub targets: usize,
}

/// The recipe's own keys, read and checked once before anything is loaded (what `validate`
/// checks too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// `batch_size` (default 1, at least 1).
    pub batch_size: usize,
    /// `max_steps_per_epoch`: at most this many batches.
    pub cap: Option<usize>,
}

impl Settings {
    /// Reads the settings from `cfg`.
    pub fn parse(cfg: &Config) -> Result<Settings> {
        Ok(Settings {
            batch_size: cfg.usize("batch_size")?.unwrap_or(1).max(1),
            cap: cfg.usize("max_steps_per_epoch")?,
        })
    }
}

/// Checks the recipe's own keys without loading anything (for `validate`).
pub fn check(cfg: &Config) -> Result<()> {
    Settings::parse(cfg).map(|_| ())
}

/// Runs the evaluation recipe and prints its result (also as a JSON line).
pub fn run(cfg: &Config) -> Result<EvalResult> {
    let Settings { batch_size, cap } = Settings::parse(cfg)?;
    let device = setup::device(cfg)?;
    let dtype = setup::dtype(cfg)?;
    let location = setup::checkpoint_path(cfg)?;
    let path = location.path.clone();
    let mut tok = setup::tokenizer(cfg, &path)?;
    let opts = load_options(cfg, &location, dtype, device.clone())?;
    let model = load_for_inference(&path, &opts, |model| {
        setup::check_model_component(cfg, &model.config)
    })?;
    tok.feed_model(model.config.vocab_size);
    let rows = setup::dataset(cfg, &tok, model.config.position_limit())?.rows;
    let pad = pad_id(&tok, &model.config);
    let t0 = Instant::now();
    let (sum, targets) = target_loss_sum(&model, &rows, batch_size, cap, pad, &device)?;
    // The whole set's token-weighted mean, as torchtune's validation computes it; NaN without
    // targets.
    let mean = if targets > 0 {
        sum / targets as f64
    } else {
        f64::NAN
    };
    let result = EvalResult {
        loss: mean,
        perplexity: mean.exp(),
        targets,
    };
    eprintln!(
        "Evaluated {targets} target tokens in {:.1}s",
        t0.elapsed().as_secs_f64()
    );
    println!(
        "loss: {:.6}  perplexity: {:.4}",
        result.loss, result.perplexity
    );
    println!(
        "{}",
        serde_json::json!({"loss": result.loss, "perplexity": result.perplexity, "target_tokens": targets})
    );
    Ok(result)
}
