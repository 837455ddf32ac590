//! The recipes `ferrotune run` starts, as torchtune names them, and their registry: the one list
//! of recipes that `run`, `validate`, `ls`, `cat` and `cp` read.

pub mod dpo;
pub mod early_exit_finetune;
pub mod eleuther_eval;
pub mod eval;
pub mod full_finetune;
pub mod generate;
pub mod grpo;
pub mod kit;
pub mod knowledge_distillation;
pub mod lora_finetune;
pub mod ppo;
pub mod qat;
pub mod quantize;
pub mod reward_model;
pub mod setup;
pub mod state;

use anyhow::{anyhow, bail, Result};

use crate::config::{nearest, Config};
use kit::settings::Mode;

/// How many processes a recipe runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ranks {
    /// One process: launching several is refused before any starts (each would repeat the whole
    /// run and write the same files).
    One,
    /// One device; launched as several ranks, each refuses and names the `_distributed` recipe.
    OneDevice,
    /// One rank of the group torchrun's environment describes (a world of one without it).
    Several,
}

/// One recipe: what `ferrotune run NAME` runs, what `ferrotune validate` checks a config with,
/// how many processes it may run as, and the source `ferrotune cp NAME` hands out.
pub struct Recipe {
    /// torchtune's name (`lora_finetune_single_device`, `dev/generate_v2`).
    pub name: &'static str,
    /// Runs the recipe (this entry) with a loaded, overridden and resolved config.
    pub run: fn(&Recipe, &Config) -> Result<()>,
    /// Checks the recipe's own settings without reading or writing anything: what `run` would
    /// refuse in them, with `run`'s message.
    pub check: fn(&Recipe, &Config) -> Result<()>,
    /// How many processes it runs as.
    pub ranks: Ranks,
    /// The recipe's source file.
    pub source: &'static str,
    /// The fine-tuning recipes' mode (which weights train, and against what).
    pub mode: Option<Mode>,
}

impl Recipe {
    /// A fine-tuning recipe of mode `mode`, `run` over the kit's trainer by the recipe file
    /// `source`; `validate` checks its settings as its trainer reads them.
    const fn finetune(
        name: &'static str,
        mode: Mode,
        ranks: Ranks,
        run: fn(&Recipe, &Config) -> Result<()>,
        source: &'static str,
    ) -> Recipe {
        Recipe {
            name,
            run,
            check: kit::settings::check,
            ranks,
            source,
            mode: Some(mode),
        }
    }

    /// A generation recipe, `run` by [`generate::run`].
    const fn generate(name: &'static str, run: fn(&Recipe, &Config) -> Result<()>) -> Recipe {
        Recipe {
            name,
            run,
            check: |_, c| generate::check(c),
            ranks: Ranks::One,
            source: include_str!("generate.rs"),
            mode: None,
        }
    }
}

/// The registry entry of fine-tuning recipe `$name`: its [`Mode`], its [`Ranks`], and the recipe
/// module (`src/recipe/$module.rs`) whose `run` it is and whose source `ferrotune cp` hands out.
macro_rules! finetune {
    ($name:literal, $mode:ident, $ranks:ident, $module:ident) => {
        Recipe::finetune(
            $name,
            Mode::$mode,
            Ranks::$ranks,
            $module::run,
            include_str!(concat!(stringify!($module), ".rs")),
        )
    };
}

/// The registry entry of recipe `$name`, which has its own `run` and `check` (`$check`) in
/// module `$module`, whose source `ferrotune cp` hands out is `src/recipe/$source`.
macro_rules! own {
    ($name:expr, $ranks:ident, $module:ident, $check:ident, $source:literal) => {
        Recipe {
            name: $name,
            // What a `run` returns beside success (a report) is for its callers, not the CLI.
            run: |_, c| $module::run(c).map(|_| ()),
            check: |_, c| $module::$check(c),
            ranks: Ranks::$ranks,
            source: include_str!($source),
            mode: None,
        }
    };
}

/// Every recipe, in the order `ferrotune ls` lists them. torchtune has no single-device full
/// DPO, QAT or early-exit recipes; one process is a world of one.
pub static RECIPES: &[Recipe] = &[
    finetune!(
        "full_finetune_single_device",
        Full,
        OneDevice,
        full_finetune
    ),
    finetune!("full_finetune_distributed", Full, Several, full_finetune),
    finetune!(
        "lora_finetune_single_device",
        Lora,
        OneDevice,
        lora_finetune
    ),
    finetune!("lora_finetune_distributed", Lora, Several, lora_finetune),
    finetune!(
        "knowledge_distillation_single_device",
        Distill,
        OneDevice,
        knowledge_distillation
    ),
    finetune!(
        "knowledge_distillation_distributed",
        Distill,
        Several,
        knowledge_distillation
    ),
    finetune!("lora_dpo_single_device", Dpo, OneDevice, dpo),
    finetune!("lora_dpo_distributed", Dpo, Several, dpo),
    finetune!("full_dpo_distributed", FullDpo, Several, dpo),
    finetune!(
        "lora_reward_model_single_device",
        RewardModel,
        OneDevice,
        reward_model
    ),
    finetune!(
        "full_reward_model_single_device",
        FullRewardModel,
        OneDevice,
        reward_model
    ),
    finetune!(
        "lora_reward_model_distributed",
        RewardModel,
        Several,
        reward_model
    ),
    finetune!(
        "full_reward_model_distributed",
        FullRewardModel,
        Several,
        reward_model
    ),
    finetune!("qat_distributed", Qat, Several, qat),
    finetune!("qat_lora_finetune_distributed", QatLora, Several, qat),
    own!(ppo::RECIPE, One, ppo, check_config, "ppo/mod.rs"),
    own!(grpo::RECIPE, Several, grpo, check_config, "grpo.rs"),
    finetune!(
        "dev/early_exit_finetune_distributed",
        EarlyExit,
        Several,
        early_exit_finetune
    ),
    own!(quantize::RECIPE, One, quantize, check, "quantize.rs"),
    Recipe::generate("generate", |_, c| generate::run(c, generate::Flavor::V1)),
    Recipe::generate("dev/generate_v2", |_, c| {
        generate::run(c, generate::Flavor::V2)
    }),
    Recipe::generate("dev/generate_v2_distributed", |_, c| {
        generate::run(c, generate::Flavor::V2Distributed)
    }),
    own!("eval", One, eval, check, "eval.rs"),
    own!(
        "eleuther_eval",
        One,
        eleuther_eval,
        check,
        "eleuther_eval.rs"
    ),
];

/// The recipe called `name`.
pub fn find(name: &str) -> Option<&'static Recipe> {
    RECIPES.iter().find(|r| r.name == name)
}

/// The recipes' names, in registry order.
pub fn names() -> impl Iterator<Item = &'static str> {
    RECIPES.iter().map(|r| r.name)
}

/// The recipe called `name`, or an error naming the nearest one.
pub fn lookup(name: &str) -> Result<&'static Recipe> {
    find(name).ok_or_else(|| {
        let hint = nearest(name, names())
            .map(|n| format!("; did you mean '{n}'?"))
            .unwrap_or_default();
        anyhow!(
            "unknown recipe '{name}'{hint} (recipes: {})",
            names().collect::<Vec<_>>().join(", ")
        )
    })
}

/// The recipe a config is for, as its recipe-specific sections say (for `validate` without a
/// recipe name): PPO's reward and value model or loss, GRPO's `grpo_samples` or loss,
/// `center_rewards_coefficient` (the reward-model recipes), a preference loss (DPO), else
/// fine-tuning. A loss no recipe takes is the error.
pub fn infer(cfg: &Config) -> Result<&'static Recipe> {
    let loss = cfg.str("loss._component_").ok().flatten();
    let ppo = cfg.get("reward_and_value_model").is_some()
        || loss.as_ref().is_some_and(|c| c.ends_with("PPOLoss"));
    let grpo = cfg.get("grpo_samples").is_some()
        || loss
            .as_ref()
            .is_some_and(|c| c.contains(".grpo.") || c.contains("GRPO"));
    let lora = cfg.get("model.lora_attn_modules").is_some();
    // The reward-model recipes' own key (their built-in configs carry it, null or not).
    let reward = cfg.root.get("center_rewards_coefficient").is_some();
    let name = if ppo {
        ppo::RECIPE
    } else if grpo {
        grpo::RECIPE
    } else if reward && lora {
        "lora_reward_model_single_device"
    } else if reward {
        "full_reward_model_single_device"
    } else {
        // The SFT recipes take a cross-entropy, the DPO ones a preference loss.
        let preference = match &loss {
            Some(component) if setup::check_loss(cfg).is_err() => {
                if crate::loss::PreferenceLoss::from_component(component, None, None, None)
                    .is_none()
                {
                    bail!(
                        "{}: loss._component_ '{component}' is not supported \
                         (torch.nn.CrossEntropyLoss, torchtune.modules.loss.CEWithChunkedOutputLoss \
                         or LinearCrossEntropyLoss; for the DPO recipes torchtune.rlhf.loss.DPOLoss, \
                         RSOLoss, ORPOLoss, SimPOLoss, CPOLoss, IPOLoss or KTOLoss)",
                        cfg.origin
                    );
                }
                true
            }
            _ => false,
        };
        match (preference, lora) {
            (true, true) => "lora_dpo_single_device",
            (true, false) => "full_dpo_distributed",
            (false, true) => "lora_finetune_single_device",
            (false, false) => "full_finetune_single_device",
        }
    };
    Ok(find(name).expect("a registered recipe"))
}

/// What `ferrotune validate` checks beyond keys and types: the components every recipe resolves
/// ([`setup::check_components`]), then the settings of recipe `name` (without one, of the recipe
/// [`infer`] finds) through its own `check`. Each problem is one message, as a run would give it.
pub fn check_config(cfg: &Config, name: Option<&str>) -> Vec<String> {
    let mut problems = setup::check_components(cfg);
    let recipe = match name {
        Some(n) => lookup(n),
        None => infer(cfg),
    };
    if let Err(e) = recipe.and_then(|r| (r.check)(r, cfg)) {
        problems.push(e.to_string());
    }
    problems
}

/// The error of launching recipe `name` as `world_size` ranks when it runs as one process: every
/// recipe but the fine-tuning ones (whose single-device forms say so themselves) and GRPO, since
/// each rank would repeat the whole run and write the same files.
pub fn check_world_size(name: &str, world_size: usize) -> Result<()> {
    if world_size > 1 && find(name).is_some_and(|r| r.ranks == Ranks::One) {
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
    let recipe = lookup(name)?;
    (recipe.run)(recipe, cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_recipe_can_be_copied() {
        for recipe in RECIPES {
            assert!(
                !recipe.source.is_empty(),
                "`ferrotune cp {}` has no source",
                recipe.name
            );
        }
    }

    #[test]
    fn every_listed_recipe_is_registered_once() {
        for (name, _) in crate::config::recipe_index() {
            assert!(find(&name).is_some(), "configs/index.yaml lists {name}");
        }
        for recipe in RECIPES {
            assert_eq!(names().filter(|n| *n == recipe.name).count(), 1);
        }
    }
}
