//! ferrotune-cli's integration tests, one binary (the stack is linked once, not once per file): a
//! module per area, and the helpers they share in `common`.

mod bounds;
mod cli;
mod common;
mod device_map;
mod distributed;
mod distributed_quant;
mod download;
mod early_exit;
mod eleuther_eval;
mod env;
mod fp8;
mod gpt_oss_experts;
mod gpt_oss_mxfp4;
mod grpo;
mod grpo_rewards;
mod hub_server;
mod knobs;
mod kto;
mod merge;
mod optim_quant;
mod orpo_trainer;
mod plot;
mod ppo;
mod quantize;
mod recipe_checks;
mod recipes;
mod reward_model;
mod run_identity;
mod stuck_rank;
mod template_worker;
mod tool_calls;
mod trackers;
mod upload;
