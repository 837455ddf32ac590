//! The early-exit recipe's settings: its `early_exit_loss` and `layer_dropout` sections, read
//! once before anything is loaded, and the layers they name resolved once the model is.

use anyhow::{anyhow, bail, Result};

use crate::config::Config;

/// `layer_dropout` of the early-exit recipe: the maximum probability, its scale across layers and
/// the layers it applies to.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerDropoutSettings {
    pub prob: f64,
    pub scale: crate::early_exit::DropoutScale,
    pub applies: Vec<bool>,
}

/// A section given and not empty (torchtune's `if cfg.get(key):`).
fn section_on(cfg: &Config, key: &str) -> bool {
    cfg.get(key).is_some_and(|v| match v {
        serde_json::Value::Object(m) => !m.is_empty(),
        _ => true,
    })
}

/// A layer selection (`"0::4"`, `"8,12,16"`, a single index, or a list of indices) at `key`, as
/// the slice text it stands for; `":"` (all) when absent. Which layers it names depends on the
/// model's depth ([`LayerSkipSettings::resolve`]).
fn layer_selection(cfg: &Config, key: &str) -> Result<LayerSelection> {
    let text = match cfg.get(key) {
        None => ":".to_string(),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Number(n)) => n.to_string(),
        Some(serde_json::Value::Array(items)) => items
            .iter()
            .map(|i| {
                i.as_u64()
                    .map(|n| n.to_string())
                    .ok_or_else(|| anyhow!("{}: '{key}' must list layer indices", cfg.origin))
            })
            .collect::<Result<Vec<_>>>()?
            .join(","),
        // `layers=4:` on the command line reads as YAML's mapping {4: null}: it meant the slice.
        Some(serde_json::Value::Object(m))
            if m.len() == 1 && m.values().all(serde_json::Value::is_null) =>
        {
            format!("{}:", m.keys().next().expect("one key"))
        }
        Some(other) => bail!(
            "{}: '{key}' must be a slice string such as \"0::4\" or layer indices, got {other}",
            cfg.origin
        ),
    };
    Ok(LayerSelection {
        key: key.to_string(),
        text,
    })
}

/// A layer selection as the config gives it: its key (for messages) and its slice text.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerSelection {
    key: String,
    text: String,
}

impl LayerSelection {
    /// The selection as a mask over `num_layers` layers.
    fn mask(&self, origin: &str, num_layers: usize) -> Result<Vec<bool>> {
        crate::early_exit::slice_str_to_array(&self.text, num_layers)
            .map_err(|e| anyhow!("{origin}: {}: {e}", self.key))
    }
}

/// The early-exit recipe's `early_exit_loss` section, read before the model is loaded.
#[derive(Debug, Clone, PartialEq)]
pub struct EarlyExitSettings {
    layers: LayerSelection,
    curriculum: crate::early_exit::Curriculum,
    scale_fn: crate::early_exit::ScaleFn,
    scale: f64,
    include_last_layer: bool,
}

/// The early-exit recipe's `layer_dropout` section, read before the model is loaded.
#[derive(Debug, Clone, PartialEq)]
pub struct DropoutSettings {
    prob: f64,
    scale: crate::early_exit::DropoutScale,
    layers: LayerSelection,
}

/// The early-exit recipe's `early_exit_loss` and `layer_dropout` sections (either may be null),
/// with torchtune's defaults (`layers: ":"`, `scale_fn: sum_l_loss_scale`, `scale: 1.0`,
/// `include_last_layer: true`; `prob: 0`, `layers_scale: uniform`). Which layers they name and
/// the curriculum's length wait for the model and the run's length ([`Self::resolve`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerSkipSettings {
    /// `early_exit_loss`, when given and not empty.
    pub early_exit: Option<EarlyExitSettings>,
    /// `layer_dropout`, when given and not empty.
    pub dropout: Option<DropoutSettings>,
}

impl LayerSkipSettings {
    /// Reads and checks both sections.
    pub fn parse(cfg: &Config) -> Result<LayerSkipSettings> {
        use crate::early_exit::{Curriculum, DropoutScale, ScaleFn};
        let at = |e: anyhow::Error, key: &str| anyhow!("{}: {key}: {e}", cfg.origin);
        let early_exit = if section_on(cfg, "early_exit_loss") {
            let scale_fn = cfg
                .str("early_exit_loss.scale_fn")?
                .unwrap_or_else(|| "torchtune.modules.early_exit_loss.sum_l_loss_scale".into());
            let curriculum = cfg.str("early_exit_loss.curriculum")?;
            let scale = cfg.f64("early_exit_loss.scale")?.unwrap_or(1.0);
            if !scale.is_finite() || scale < 0.0 {
                bail!(
                    "{}: early_exit_loss.scale must be a non-negative number, got {scale}",
                    cfg.origin
                );
            }
            Some(EarlyExitSettings {
                layers: layer_selection(cfg, "early_exit_loss.layers")?,
                curriculum: Curriculum::from_component(curriculum.as_deref())
                    .map_err(|e| at(e, "early_exit_loss.curriculum"))?,
                scale_fn: ScaleFn::from_component(&scale_fn)
                    .map_err(|e| at(e, "early_exit_loss.scale_fn"))?,
                scale,
                include_last_layer: cfg
                    .bool("early_exit_loss.include_last_layer")?
                    .unwrap_or(true),
            })
        } else {
            None
        };
        let dropout = if section_on(cfg, "layer_dropout") {
            let prob = cfg.f64("layer_dropout.prob")?.unwrap_or(0.0);
            if !(0.0..=1.0).contains(&prob) {
                bail!(
                    "{}: layer_dropout.prob must be in [0, 1], got {prob}",
                    cfg.origin
                );
            }
            let scale = cfg
                .str("layer_dropout.layers_scale")?
                .unwrap_or_else(|| "uniform".into());
            Some(DropoutSettings {
                prob,
                scale: DropoutScale::parse(&scale)
                    .map_err(|e| at(e, "layer_dropout.layers_scale"))?,
                layers: layer_selection(cfg, "layer_dropout.layers")?,
            })
        } else {
            None
        };
        Ok(LayerSkipSettings {
            early_exit,
            dropout,
        })
    }

    /// The early-exit loss and layer dropout for a model of `num_layers` layers trained for
    /// `max_steps` optimizer steps (`origin` names the config in messages).
    pub fn resolve(
        &self,
        origin: &str,
        num_layers: usize,
        max_steps: usize,
    ) -> Result<(
        Option<crate::early_exit::EarlyExitLoss>,
        Option<LayerDropoutSettings>,
    )> {
        let early_exit = match &self.early_exit {
            Some(e) => Some(crate::early_exit::EarlyExitLoss {
                chosen: e.layers.mask(origin, num_layers)?,
                curriculum: e.curriculum,
                scale_fn: e.scale_fn,
                scale: e.scale,
                include_last_layer: e.include_last_layer,
                max_steps,
            }),
            None => None,
        };
        let dropout = match &self.dropout {
            Some(d) => Some(LayerDropoutSettings {
                prob: d.prob,
                scale: d.scale,
                applies: d.layers.mask(origin, num_layers)?,
            }),
            None => None,
        };
        Ok((early_exit, dropout))
    }
}
