//! The recipes `ferrotune run` starts, as torchtune names them.

pub mod eleuther_eval;
pub mod eval;
pub mod finetune;
pub mod generate;
pub mod grpo;
pub mod ppo;
pub mod quantize;
pub mod setup;
pub mod state;

use anyhow::{bail, Result};

use crate::config::{nearest, Config, RECIPES};

/// The recipes that run as one process: launched as several ranks, each would repeat the
/// whole run (and write the same files).
const ONE_PROCESS: &[&str] = &[
    "ppo_full_finetune_single_device",
    "dev/grpo_full_finetune_distributed",
    "quantize",
    "generate",
    "dev/generate_v2",
    "dev/generate_v2_distributed",
    "eval",
    "eleuther_eval",
];

/// The error of launching one-process recipe `name` as `world_size` ranks, if it is one.
pub fn check_world_size(name: &str, world_size: usize) -> Result<()> {
    if world_size > 1 && ONE_PROCESS.contains(&name) {
        bail!(
            "recipe {name} runs as one process, but {world_size} were asked for: launch it \
             without --nproc-per-node/--nnodes{}",
            if name == "dev/generate_v2_distributed" {
                " (with `device: cuda` it spreads the model over every visible GPU)"
            } else {
                ""
            }
        );
    }
    Ok(())
}

/// Runs recipe `name` with a loaded, overridden and resolved config.
pub fn run(name: &str, cfg: &Config) -> Result<()> {
    let env = crate::dist::env::DistEnv::from_env()?;
    check_world_size(name, env.map_or(1, |e| e.world_size))?;
    match name {
        "lora_finetune_single_device" => finetune::run(cfg, finetune::Mode::Lora, false),
        "full_finetune_single_device" => finetune::run(cfg, finetune::Mode::Full, false),
        "lora_finetune_distributed" => finetune::run(cfg, finetune::Mode::Lora, true),
        "full_finetune_distributed" => finetune::run(cfg, finetune::Mode::Full, true),
        "knowledge_distillation_single_device" => {
            finetune::run(cfg, finetune::Mode::Distill, false)
        }
        "knowledge_distillation_distributed" => finetune::run(cfg, finetune::Mode::Distill, true),
        "lora_dpo_single_device" => finetune::run(cfg, finetune::Mode::Dpo, false),
        "lora_dpo_distributed" => finetune::run(cfg, finetune::Mode::Dpo, true),
        "full_dpo_distributed" => finetune::run(cfg, finetune::Mode::FullDpo, true),
        "qat_distributed" => finetune::run(cfg, finetune::Mode::Qat, true),
        "qat_lora_finetune_distributed" => finetune::run(cfg, finetune::Mode::QatLora, true),
        "ppo_full_finetune_single_device" => ppo::run(cfg),
        "dev/grpo_full_finetune_distributed" => grpo::run(cfg),
        "quantize" => quantize::run(cfg).map(|_| ()),
        "generate" => generate::run(cfg, generate::Flavor::V1),
        "dev/generate_v2" => generate::run(cfg, generate::Flavor::V2),
        "dev/generate_v2_distributed" => generate::run(cfg, generate::Flavor::V2Distributed),
        "eval" => eval::run(cfg).map(|_| ()),
        "eleuther_eval" => eleuther_eval::run(cfg).map(|_| ()),
        other => {
            let hint = nearest(other, RECIPES.iter().copied())
                .map(|n| format!("; did you mean '{n}'?"))
                .unwrap_or_default();
            bail!(
                "unknown recipe '{other}'{hint} (recipes: {})",
                RECIPES.join(", ")
            )
        }
    }
}
