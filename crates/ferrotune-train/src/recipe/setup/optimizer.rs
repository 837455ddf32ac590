//! The optimizer a config names (`optimizer._component_`): torch's AdamW/SGD and the quantized
//! AdamW variants of torchao and bitsandbytes (over sharded parameters too: [`sharded_optimizer`]).

use anyhow::{anyhow, bail, Result};
use candle_core::Var;

use crate::config::Config;
use crate::dist::fsdp::ShardedModel;
use crate::optim::{AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
use crate::optim_quant::{QuantAdamW, QuantAdamWConfig, QuantKind};

/// The optimizer named by `optimizer._component_` over `params`.
pub fn optimizer(cfg: &Config, params: Vec<(String, Var)>) -> Result<Box<dyn Optimizer>> {
    let component = cfg
        .str("optimizer._component_")?
        .unwrap_or_else(|| "torch.optim.AdamW".into());
    let lr = learning_rate(cfg)?;
    refuse_amsgrad(cfg)?;
    // bitsandbytes' 32-bit AdamW classes run as AdamW, its and torchao's 8- and 4-bit ones as
    // `QuantAdamW` (see `adamw_variant`).
    let quant = QuantKind::from_component(&component);
    let class = match adamw_variant(&component) {
        Some(_) => "AdamW",
        None => component.rsplit('.').next().unwrap_or(""),
    };
    match class {
        "AdamW" => {
            let c = adamw_config(cfg, lr)?;
            if let Some(kind) = quant {
                return quant_optimizer(cfg, kind, c, params);
            }
            Ok(Box::new(
                AdamW::new(params, c).map_err(|e| anyhow!("{}: optimizer: {e}", cfg.origin))?,
            ))
        }
        "SGD" => {
            let c = SgdConfig {
                lr,
                momentum: cfg.f64("optimizer.momentum")?.unwrap_or(0.0),
                dampening: cfg.f64("optimizer.dampening")?.unwrap_or(0.0),
                weight_decay: cfg.f64("optimizer.weight_decay")?.unwrap_or(0.0),
                nesterov: cfg.bool("optimizer.nesterov")?.unwrap_or(false),
            };
            Ok(Box::new(
                Sgd::new(params, c).map_err(|e| anyhow!("{}: optimizer: {e}", cfg.origin))?,
            ))
        }
        _ => bail!(
            "{}: optimizer._component_ '{component}' is not supported (torch.optim.AdamW or \
             torch.optim.SGD, bitsandbytes' AdamW classes, torchao's AdamW8bit and AdamW4bit)",
            cfg.origin
        ),
    }
}

/// Refuses `optimizer.amsgrad` and `optimizer.maximize`.
fn refuse_amsgrad(cfg: &Config) -> Result<()> {
    if cfg.bool("optimizer.amsgrad")?.unwrap_or(false)
        || cfg.bool("optimizer.maximize")?.unwrap_or(false)
    {
        bail!(
            "{}: optimizer.amsgrad and optimizer.maximize are not supported",
            cfg.origin
        );
    }
    Ok(())
}

/// `optimizer.lr`, which every optimizer needs.
fn learning_rate(cfg: &Config) -> Result<f64> {
    cfg.f64("optimizer.lr")?
        .ok_or_else(|| anyhow!("{}: 'optimizer.lr' is required", cfg.origin))
}

/// AdamW's hyperparameters at learning rate `lr` (torch's defaults where the config is silent).
fn adamw_config(cfg: &Config, lr: f64) -> Result<AdamWConfig> {
    let mut c = AdamWConfig {
        lr,
        ..AdamWConfig::default()
    };
    if let Some(wd) = cfg.f64("optimizer.weight_decay")? {
        c.weight_decay = wd;
    }
    if let Some(eps) = cfg.f64("optimizer.eps")? {
        c.eps = eps;
    }
    if let Some(b) = cfg.f64_list("optimizer.betas")? {
        if b.len() != 2 {
            bail!("{}: optimizer.betas must have two numbers", cfg.origin);
        }
        c.beta1 = b[0];
        c.beta2 = b[1];
    }
    Ok(c)
}

/// The settings of the quantized AdamW that `optimizer._component_` names, if it names one
/// (what [`ShardedModel::with_quant_state`] lays the shards out for).
pub fn quant_config(cfg: &Config) -> Result<Option<QuantAdamWConfig>> {
    let component = cfg.str("optimizer._component_")?.unwrap_or_default();
    let Some(kind) = QuantKind::from_component(&component) else {
        return Ok(None);
    };
    let adamw = adamw_config(cfg, learning_rate(cfg)?)?;
    quant_settings(cfg, kind, adamw).map(Some)
}

/// The optimizer over `params`, those of a model sharded by `sm` (its
/// [`ShardedModel::optimizer_params`]) when there is one: a quantized AdamW over the pieces of
/// parameters each shard holds when `sm` is laid out for one, else [`optimizer`].
pub fn sharded_optimizer(
    cfg: &Config,
    params: Vec<(String, Var)>,
    sm: Option<&ShardedModel>,
) -> Result<Box<dyn Optimizer>> {
    let Some((sm, q)) = sm.and_then(|sm| sm.quant().map(|q| (sm, q))) else {
        return optimizer(cfg, params);
    };
    refuse_amsgrad(cfg)?;
    let numel = sm.trainable_numel();
    let opt = QuantAdamW::with_pieces(params, sm.optimizer_pieces(), *q)
        .map_err(|e| anyhow!("{}: optimizer: {e}", cfg.origin))?;
    say_state_size(&opt, numel, "this rank's share; ");
    Ok(Box::new(opt))
}

/// Prints what the quantized state of `opt` will take against f32 AdamW's over `numel` values.
fn say_state_size(opt: &QuantAdamW, numel: usize, whose: &str) {
    if numel > 0 {
        let q = opt.config();
        let mb = |b: usize| b as f64 / 1e6;
        eprintln!(
            "Optimizer state: {:.2} MB in {}-bit blocks of {} ({whose}{:.2} MB as f32 AdamW)",
            mb(opt.planned_state_bytes()),
            q.kind.bits(),
            q.block_size,
            mb(8 * numel)
        );
    }
}

/// torchao's `AdamW8bit` / `AdamW4bit` or bitsandbytes' `AdamW8bit` / `PagedAdamW8bit` over
/// `params` with AdamW's hyperparameters `adamw` ([`quant_settings`]). Says, once there are
/// parameters, what the state will take against f32 AdamW's.
fn quant_optimizer(
    cfg: &Config,
    kind: QuantKind,
    adamw: AdamWConfig,
    params: Vec<(String, Var)>,
) -> Result<Box<dyn Optimizer>> {
    let q = quant_settings(cfg, kind, adamw)?;
    let numel: usize = params.iter().map(|(_, v)| v.elem_count()).sum();
    let opt = QuantAdamW::new(params, q).map_err(|e| anyhow!("{}: optimizer: {e}", cfg.origin))?;
    say_state_size(&opt, numel, "");
    Ok(Box::new(opt))
}

/// A quantized AdamW's settings with AdamW's hyperparameters `adamw`, and their own keys:
/// torchao's `block_size`, bitsandbytes' `min_8bit_size`; `bf16_stochastic_round: true`,
/// bitsandbytes' `percentile_clipping` below 100 and `optim_bits` other than 8 are refused.
fn quant_settings(cfg: &Config, kind: QuantKind, adamw: AdamWConfig) -> Result<QuantAdamWConfig> {
    let mut q = QuantAdamWConfig::new(kind, adamw);
    let torchao = kind != QuantKind::Bnb8bit;
    if let Some(b) = cfg.usize("optimizer.block_size")? {
        if !torchao {
            bail!(
                "{}: optimizer.block_size is torchao's key (bitsandbytes fixes 256)",
                cfg.origin
            );
        }
        if b == 0 {
            bail!("{}: optimizer.block_size must be positive", cfg.origin);
        }
        q.block_size = b;
    }
    if let Some(m) = cfg.usize("optimizer.min_8bit_size")? {
        if torchao {
            bail!(
                "{}: optimizer.min_8bit_size is bitsandbytes' key (torchao fixes 4096)",
                cfg.origin
            );
        }
        q.min_quant_size = m;
    }
    if cfg
        .bool("optimizer.bf16_stochastic_round")?
        .unwrap_or(false)
    {
        bail!(
            "{}: optimizer.bf16_stochastic_round is not supported (bf16 parameters are rounded to \
             nearest after each update)",
            cfg.origin
        );
    }
    if cfg
        .f64("optimizer.percentile_clipping")?
        .is_some_and(|p| p != 100.0)
    {
        bail!(
            "{}: optimizer.percentile_clipping is not supported (100: none)",
            cfg.origin
        );
    }
    if cfg.usize("optimizer.optim_bits")?.is_some_and(|b| b != 8) {
        bail!(
            "{}: optimizer.optim_bits must be 8 for an 8-bit optimizer",
            cfg.origin
        );
    }
    Ok(q)
}

/// How an AdamW class of another library maps onto ferrotune's optimizers: `Some(true)` AdamW
/// exactly (torch's, and bitsandbytes' 32-bit ones, whose paging only moves the state in
/// memory), `Some(false)` AdamW with quantized moments ([`QuantAdamW`]: the 8- and 4-bit ones),
/// `None` for anything else. torchtune's single-device full fine-tuning configs name
/// bitsandbytes'.
fn adamw_variant(component: &str) -> Option<bool> {
    match component.rsplit('.').next().unwrap_or("") {
        "AdamW" | "PagedAdamW" | "AdamW32bit" | "PagedAdamW32bit" => Some(true),
        "AdamW8bit" | "PagedAdamW8bit" | "AdamW4bit" => Some(false),
        _ => None,
    }
}

/// What to tell the user about a low-precision `optimizer._component_`: whose quantization its
/// moments follow, what stays f32, and where the state lives. An information line (the recipes
/// print it as is): the quantized state is what the user asked for, not a fallback.
pub fn optimizer_note(cfg: &Config) -> Result<Option<String>> {
    let Some(component) = cfg.str("optimizer._component_")? else {
        return Ok(None);
    };
    Ok(QuantKind::from_component(&component).map(|kind| {
        let whose = match kind {
            QuantKind::Bnb8bit => "bitsandbytes'",
            _ => "torchao's",
        };
        format!(
            "optimizer._component_ '{component}': AdamW with its moments in {}-bit blocks as \
             {whose} (tensors under 4096 values keep f32 moments); the state is kept in host \
             memory, a CUDA parameter's update goes through the host",
            kind.bits()
        )
    }))
}
