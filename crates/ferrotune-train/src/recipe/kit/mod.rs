//! The machinery the recipes share, and which imports no recipe: each recipe file reads as
//! setup → loop → checkpoint over these parts.
//!
//! - [`crate::recipe::setup`]: the config's components read into typed values (device, dtype,
//!   checkpoints and model loading, tokenizer, LoRA settings, optimizer, LR schedule, losses,
//!   datasets, seed);
//! - [`crate::recipe::state`]: checkpoint folders and the recipe state that makes resuming
//!   step-exact;
//! - [`session`]: rank, world, device and dtype of a run's process;
//! - [`model`]: model setup beyond loading (adapters, QAT, a teacher, a DPO reference);
//! - [`data`]: training examples and their micro-batches;
//! - [`checkpoint`]: the checkpointer every training recipe saves with;
//! - [`rollout`]: what PPO and GRPO share around a rollout: settings, batching, sampling, passes,
//!   the trajectory core, the backward, step statistics and metrics;
//! - [`ranks`]: gradients averaged over data-parallel ranks, and statistics over the ranks;
//! - [`settings`]: the fine-tuning recipes' settings, read once before anything is loaded;
//! - [`trainer`]: what the fine-tuning recipes share around what each really does: start, model
//!   loading, the plan of the run, the optimizer, the epochs' steps (micro-batches, forward and
//!   backward, sums over the ranks, normalise, clip, step, log, validate) and their checkpoints;
//! - [`validation`]: the loss over a held-out dataset, and each rank's rows of it;
//! - [`report`]: the progress bar, memory reports, ignored keys, the kill-after-step test hook;
//! - [`reward`]: the reward-model recipes' classifier and preference pairs.

pub mod checkpoint;
pub mod data;
pub mod model;
pub mod push;
pub mod ranks;
pub mod report;
pub mod reward;
pub mod rollout;
pub mod session;
pub mod settings;
pub mod trainer;
pub mod unpaired;
pub mod validation;
