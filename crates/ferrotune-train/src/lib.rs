//! ferrotune-train: the optimizer-side pieces a fine-tuning recipe calls around candle's autograd.
//!
//! Everything here reproduces a PyTorch/torchtune reference numerically (the tests compare against
//! fixtures produced by `scripts/make_train_fixtures.py`):
//!
//! - [`loss`] — causal-LM cross-entropy returning the *sum* of token losses and the token count, so a
//!   recipe can normalise by the number of target tokens in the whole optimizer step.
//! - [`optim`] — `torch.optim.AdamW` and `torch.optim.SGD` (single-tensor path), with f32 state and
//!   f32 master weights for reduced-precision parameters, and named-tensor state export.
//! - [`optim_quant`] — torchao's `AdamW8bit` / `AdamW4bit` and bitsandbytes' `AdamW8bit` with
//!   their block-wise quantized moments (fixtures from `scripts/make_optim8bit_fixtures.py`).
//! - [`clip`] — `torch.nn.utils.clip_grad_norm_`, and gradient scaling for token normalisation.
//! - [`schedule`] — LambdaLR-style multipliers (constant, linear, torchtune's cosine with warmup).
//! - [`step`] — one micro-batch forward and backward, with activation checkpointing.
//! - [`config`] — torchtune-style YAML configs: built-ins, overrides, interpolation, validation.
//! - [`recipe`] — the recipes `ferrotune run` starts (fine-tuning, generation, evaluation).
//! - [`metrics`] — metric loggers (stdout, JSONL, TensorBoard) and experiment trackers (MLflow,
//!   W&B, Comet).

pub mod clip;
pub mod config;
pub mod dist;
pub mod early_exit;
pub mod grpo;
pub mod kto;
pub mod loss;
pub mod metrics;
pub mod optim;
pub mod optim_quant;
pub mod recipe;
pub mod reward;
pub mod reward_model;
pub mod rlhf;
pub mod schedule;
pub mod step;

pub use clip::{clip_grad_norm, scale_grads};
pub use loss::{causal_lm_loss, causal_lm_loss_mean, LossSum, IGNORE_INDEX};
pub use optim::{AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
pub use schedule::LrSchedule;
