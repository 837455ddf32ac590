//! The recipes `ferrotune run` starts, as torchtune names them.

pub mod eval;
pub mod finetune;
pub mod generate;
pub mod setup;
pub mod state;

use anyhow::{bail, Result};

use crate::config::{nearest, Config, RECIPES};

/// Runs recipe `name` with a loaded, overridden and resolved config.
pub fn run(name: &str, cfg: &Config) -> Result<()> {
    match name {
        "lora_finetune_single_device" => finetune::run(cfg, finetune::Mode::Lora),
        "full_finetune_single_device" => finetune::run(cfg, finetune::Mode::Full),
        "generate" => generate::run(cfg),
        "eval" | "eleuther_eval" => eval::run(cfg).map(|_| ()),
        "lora_finetune_distributed" | "full_finetune_distributed" => bail!(
            "recipe {name}: distributed training is not available yet (it needs several processes); \
             use the _single_device recipe"
        ),
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
