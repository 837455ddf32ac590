//! ferrotune-train's integration tests, one binary (the stack is linked once, not once per file): a
//! module per area, and the helpers they share in `common`.

mod checkpoint_folders;
mod clip;
mod common;
mod dist_comm;
mod dpo;
mod early_exit;
mod eleuther_eval;
mod grpo;
mod grpo_trl;
mod kd;
mod kto;
mod loss;
mod metrics;
mod optim;
mod optim_quant;
mod optim_quant_pieces;
mod packing;
mod ppo;
mod prefloss;
mod qat;
mod reward_model;
mod rewards;
mod schedule;
mod step;
mod structure;
