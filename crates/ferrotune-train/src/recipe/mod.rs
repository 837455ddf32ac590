//! The recipes `ferrotune run` starts, as torchtune names them.

pub mod eleuther_eval;
pub mod eval;
pub mod finetune;
pub mod generate;
pub mod ppo;
pub mod quantize;
pub mod setup;
pub mod state;

use anyhow::{bail, Result};

use crate::config::{nearest, Config, RECIPES};

/// Runs recipe `name` with a loaded, overridden and resolved config.
pub fn run(name: &str, cfg: &Config) -> Result<()> {
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
        "quantize" => quantize::run(cfg).map(|_| ()),
        "generate" => generate::run(cfg),
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
