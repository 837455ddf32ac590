//! `eval`: perplexity of a model (optionally with an adapter) on a dataset.
//!
//! Keys: the checkpointer/tokenizer/dataset sections of the training configs, `batch_size`,
//! `max_steps_per_epoch` (a cap on batches), `device`, `dtype`. Prints the mean cross-entropy over
//! target tokens and its exponential.

use std::time::Instant;

use anyhow::Result;
use candle_core::DType;
use ferrotune_data::dataset::{collate, Row};
use ferrotune_infer::{load_for_inference, pad_id};

use crate::config::Config;
use crate::loss::causal_lm_loss;
use crate::recipe::generate::load_options;
use crate::recipe::setup;
use crate::step::MicroBatch;

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

/// The mean cross-entropy over the target tokens of `rows` (in batches of `batch_size`, at most
/// `cap` batches), and the number of target tokens: the whole set's token-weighted mean, as
/// torchtune's validation computes it. NaN without targets.
pub fn mean_target_loss(
    model: &ferrotune_models::CausalLm,
    rows: &[Row],
    batch_size: usize,
    cap: Option<usize>,
    pad: u32,
    device: &candle_core::Device,
) -> Result<(f64, usize)> {
    let (sum, targets) = target_loss_sum(model, rows, batch_size, cap, pad, device)?;
    let mean = if targets > 0 {
        sum / targets as f64
    } else {
        f64::NAN
    };
    Ok((mean, targets))
}

/// The summed cross-entropy over the target tokens of `rows` (in batches of `batch_size`, at
/// most `cap` batches) and the number of target tokens: what ranks add up before dividing.
pub fn target_loss_sum(
    model: &ferrotune_models::CausalLm,
    rows: &[Row],
    batch_size: usize,
    cap: Option<usize>,
    pad: u32,
    device: &candle_core::Device,
) -> Result<(f64, usize)> {
    target_loss_sum_by(rows, batch_size, cap, pad, device, |batch| {
        let logits = model.forward(&batch.input_ids, &batch.layout, None)?;
        let loss = causal_lm_loss(&logits, &batch.labels, true)?;
        Ok((
            loss.sum.to_dtype(DType::F64)?.to_scalar::<f64>()?,
            loss.count,
        ))
    })
}

/// [`target_loss_sum`] with each batch's (loss sum, target count) from `score`: how a sharded
/// model scores batches one unit at a time.
pub fn target_loss_sum_by(
    rows: &[Row],
    batch_size: usize,
    cap: Option<usize>,
    pad: u32,
    device: &candle_core::Device,
    mut score: impl FnMut(&MicroBatch) -> Result<(f64, usize)>,
) -> Result<(f64, usize)> {
    let (mut sum, mut targets) = (0f64, 0usize);
    for (i, chunk) in rows.chunks(batch_size.max(1)).enumerate() {
        if cap.is_some_and(|c| i >= c) {
            break;
        }
        let picked: Vec<&Row> = chunk.iter().collect();
        let batch = MicroBatch::from_batch(&collate(&picked, pad), device)?;
        let (s, n) = score(&batch)?;
        sum += s;
        targets += n;
    }
    Ok((sum, targets))
}

/// The validation rows of `rank` out of `world`, as torchtune's distributed recipes take them: a
/// `DistributedSampler` without shuffling (the row list padded with its first rows up to a
/// multiple of `world`, then every `world`-th row from `rank`), in batches of `batch_size` with
/// the last incomplete batch dropped (`drop_last=True`). Returns the rows and how many batches.
pub fn rank_validation_rows(
    rows: &[Row],
    batch_size: usize,
    rank: usize,
    world: usize,
) -> (Vec<Row>, usize) {
    let n = rows.len();
    if n == 0 || world == 0 {
        return (Vec::new(), 0);
    }
    let per_rank = n.div_ceil(world);
    let mine: Vec<Row> = (0..per_rank)
        .map(|i| rows[(rank + i * world) % n].clone())
        .collect();
    let batches = mine.len() / batch_size.max(1);
    (mine, batches)
}

/// Runs the evaluation recipe and prints its result (also as a JSON line).
pub fn run(cfg: &Config) -> Result<EvalResult> {
    let device = setup::device(cfg)?;
    let dtype = setup::dtype(cfg)?;
    let location = setup::checkpoint_path(cfg)?;
    let path = location.path.clone();
    let tok = setup::tokenizer(cfg, &path)?;
    let opts = load_options(cfg, &location, dtype, device.clone())?;
    let model = load_for_inference(&path, &opts, |model| {
        setup::check_model_component(cfg, &model.config)
    })?;
    let rows = setup::dataset(cfg, &tok)?.rows;
    let batch_size = cfg.usize("batch_size")?.unwrap_or(1).max(1);
    let cap = cfg.usize("max_steps_per_epoch")?;
    let pad = pad_id(&tok, &model.config);
    let t0 = Instant::now();
    let (mean, targets) = mean_target_loss(&model, &rows, batch_size, cap, pad, &device)?;
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
