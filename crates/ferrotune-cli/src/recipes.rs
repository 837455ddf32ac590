//! torchtune's verbs over recipes and configs: `ls`, `cp`, `run`, `validate`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrotune_train::config::{self, Config};
use ferrotune_train::recipe;

#[derive(Args)]
pub struct LsArgs {}

/// `ferrotune ls`: recipes and their built-in configs, laid out as `tune ls` prints them.
pub fn ls(_args: LsArgs) -> Result<()> {
    let index = config::recipe_index();
    println!("{:<40} {:<40}", "RECIPE", "CONFIG");
    for recipe in recipe::names() {
        let configs: Vec<String> = index
            .iter()
            .find(|(r, _)| r == recipe)
            .map(|(_, c)| c.clone())
            .unwrap_or_default();
        match configs.split_first() {
            None => println!("{recipe:<40} "),
            Some((first, rest)) => {
                println!("{recipe:<40} {first:<40}");
                for c in rest {
                    println!("{:<40} {c:<40}", "");
                }
            }
        }
    }
    Ok(())
}

#[derive(Args)]
pub struct CpArgs {
    /// A built-in config (`llama3_1/8B_lora_single_device`) or a recipe name.
    file: String,
    /// Where to write the copy (a file, or an existing folder).
    destination: PathBuf,
    /// Create the destination's parent folders if missing.
    #[arg(long)]
    make_parents: bool,
}

/// `ferrotune cp`: copies a built-in config (or a recipe's source) to edit.
pub fn cp(args: CpArgs) -> Result<()> {
    let (text, ext) = if let Some(yaml) = config::builtin_yaml(&args.file) {
        (yaml, "yaml")
    } else if let Some(recipe) = recipe::find(&args.file) {
        (recipe.source, "rs")
    } else {
        let names: Vec<&str> = config::builtin_configs()
            .iter()
            .map(|(n, _)| *n)
            .chain(recipe::names())
            .collect();
        let hint = config::nearest(&args.file, names.into_iter())
            .map(|n| format!("; did you mean '{n}'?"))
            .unwrap_or_default();
        bail!(
            "'{}' is not a built-in config or recipe{hint} (`ferrotune ls` lists them)",
            args.file
        );
    };
    let mut dest = args.destination.clone();
    if dest.is_dir() {
        let base = args.file.rsplit('/').next().unwrap_or(&args.file);
        dest = dest.join(format!("{base}.{ext}"));
    } else if dest.extension().is_none() {
        dest.set_extension(ext);
    }
    let parent = dest.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(parent) = parent {
        if !parent.exists() {
            if args.make_parents {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("{}: cannot create", parent.display()))?;
            } else {
                bail!(
                    "{}: the destination folder does not exist (pass --make-parents to create it)",
                    parent.display()
                );
            }
        }
    }
    ferrotune_models::save::write_atomic(&dest, text.as_bytes())?;
    println!("Copied file to {}", dest.display());
    Ok(())
}

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    launch: crate::launch::LaunchArgs,
    /// The recipe: lora_finetune_single_device, full_finetune_single_device, generate, eval, ...
    recipe: String,
    /// A built-in config name or a YAML file.
    #[arg(long)]
    config: String,
    /// Overrides: dotted `key=value` (`optimizer.lr=3e-4`, `model.lora_attn_modules=[q_proj,v_proj]`,
    /// `lr_scheduler=null`), `~key` to delete a key.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    overrides: Vec<String>,
}

/// Loads, overrides, validates and resolves a config.
pub fn prepare_config(name: &str, overrides: &[String]) -> Result<Config> {
    let mut cfg = config::load(name)?;
    let original = cfg.root.clone();
    cfg.apply_overrides(overrides)?;
    if let Err(problems) = config::validate_overridden(&original, &cfg.root, &cfg.origin) {
        bail!("{}", problems.join("\n  "));
    }
    cfg.resolve()?;
    Ok(cfg)
}

/// `ferrotune run`: a recipe with a config and overrides.
pub fn run(args: RunArgs) -> Result<()> {
    if args.launch.world_size()? > 1 {
        // A config problem shows once here rather than once per rank. Whether a fine-tuning
        // recipe can run distributed is for the recipe to say, in the ranks.
        recipe::check_world_size(&args.recipe, args.launch.world_size()?)?;
        prepare_config(&args.config, &args.overrides)?;
        return crate::launch::launch(&args.launch);
    }
    let cfg = prepare_config(&args.config, &args.overrides)?;
    if let Some(level) = cfg.str("log_level")? {
        crate::logging::set_level(
            ferrotune_train::config::tracing_level(&level)
                .map_err(|e| anyhow::anyhow!("{}: log_level: {e}", cfg.origin))?,
        );
    }
    // One of several ranks: rank 0 alone prints (as it alone logs and saves).
    let rank = std::env::var("RANK")
        .ok()
        .and_then(|r| r.parse::<usize>().ok());
    if rank.unwrap_or(0) == 0 {
        eprintln!(
            "Running {} with resolved config:\n\n{}",
            args.recipe,
            cfg.to_yaml()
        );
    }
    recipe::run(&args.recipe, &cfg)
}

#[derive(Args)]
pub struct ValidateArgs {
    /// A built-in config name or a YAML file.
    config: String,
    /// The recipe the config is for (default: the recipe a built-in config is listed under, or
    /// the one the config's recipe-specific sections name).
    #[arg(long)]
    recipe: Option<String>,
}

/// `ferrotune validate`: checks a config without running anything.
pub fn validate(args: ValidateArgs) -> Result<()> {
    let cfg = config::load(&args.config)?;
    if let Err(problems) = config::validate(&cfg.root, &cfg.origin) {
        bail!("{}", problems.join("\n  "));
    }
    let mut resolved = cfg.clone();
    resolved.resolve()?;
    // A built-in config is its recipe's, as `ferrotune ls` lists it.
    let listed = config::builtin_yaml(&args.config).and_then(|_| {
        let name = args.config.strip_suffix(".yaml").unwrap_or(&args.config);
        config::recipe_index()
            .into_iter()
            .find(|(_, configs)| configs.iter().any(|c| c == name))
            .map(|(recipe, _)| recipe)
    });
    let name = args.recipe.clone().or(listed);
    let problems = recipe::check_config(&resolved, name.as_deref());
    if !problems.is_empty() {
        bail!("{}", problems.join("\n  "));
    }
    check_paths(&resolved);
    println!("Config is well-formed!");
    Ok(())
}

/// Mentions (without failing) paths that do not exist yet: the config may be meant for another
/// machine, or for after `ferrotune download`.
fn check_paths(cfg: &Config) {
    for key in ["checkpointer.checkpoint_dir", "tokenizer.path"] {
        if let Ok(Some(p)) = cfg.path(key) {
            if !Path::new(&p).exists() {
                eprintln!(
                    "note: {key}: {} does not exist on this machine",
                    p.display()
                );
            }
        }
    }
}
