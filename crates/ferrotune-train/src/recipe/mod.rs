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

/// The fine-tuning recipes, run by [`finetune::run`] with their mode and whether they may run as
/// several ranks.
fn finetune_recipe(name: &str) -> Option<(finetune::Mode, bool)> {
    use finetune::Mode;
    Some(match name {
        "lora_finetune_single_device" => (Mode::Lora, false),
        "full_finetune_single_device" => (Mode::Full, false),
        "lora_finetune_distributed" => (Mode::Lora, true),
        "full_finetune_distributed" => (Mode::Full, true),
        "knowledge_distillation_single_device" => (Mode::Distill, false),
        "knowledge_distillation_distributed" => (Mode::Distill, true),
        "lora_dpo_single_device" => (Mode::Dpo, false),
        "lora_dpo_distributed" => (Mode::Dpo, true),
        "full_dpo_distributed" => (Mode::FullDpo, true),
        "qat_distributed" => (Mode::Qat, true),
        "qat_lora_finetune_distributed" => (Mode::QatLora, true),
        "dev/early_exit_finetune_distributed" => (Mode::EarlyExit, true),
        _ => return None,
    })
}

/// The error of launching recipe `name` as `world_size` ranks when it runs as one process: every
/// recipe but the fine-tuning ones (whose single-device forms say so themselves) and GRPO, since
/// each rank would repeat the whole run and write the same files.
pub fn check_world_size(name: &str, world_size: usize) -> Result<()> {
    let several_ranks = finetune_recipe(name).is_some() || name == grpo::RECIPE;
    if world_size > 1 && RECIPES.contains(&name) && !several_ranks {
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
    if let Some((mode, distributed)) = finetune_recipe(name) {
        return finetune::run(cfg, mode, distributed);
    }
    match name {
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
