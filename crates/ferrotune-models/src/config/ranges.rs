//! The value ranges every [`ModelConfig`] must keep, whatever it was read from (a `config.json`
//! of any family, or GGUF metadata through one): a size of zero, a rope factor of zero or a
//! negative epsilon would otherwise load and compute NaN or divide by zero later.

use super::{ModelConfig, RopeConfig, RopeScaling};

/// A positive, finite number, or an error naming `key`.
fn positive(key: &str, v: f64) -> Result<(), String> {
    if v > 0.0 && v.is_finite() {
        Ok(())
    } else {
        Err(format!("'{key}' must be a positive number, found {v}"))
    }
}

/// A count of at least 1, or an error naming `key`.
fn at_least_one(key: &str, n: usize) -> Result<(), String> {
    if n == 0 {
        Err(format!("'{key}' must be at least 1, found 0"))
    } else {
        Ok(())
    }
}

impl ModelConfig {
    /// Checks every size, epsilon and rotary setting is in range; the error names the key.
    pub(crate) fn check_ranges(&self) -> Result<(), String> {
        at_least_one("vocab_size", self.vocab_size)?;
        at_least_one("hidden_size", self.hidden_size)?;
        at_least_one("num_hidden_layers", self.num_hidden_layers)?;
        at_least_one("num_attention_heads", self.num_attention_heads)?;
        at_least_one("num_key_value_heads", self.num_key_value_heads)?;
        at_least_one("head_dim", self.head_dim)?;
        at_least_one("max_position_embeddings", self.max_position_embeddings)?;
        if !(self.rms_norm_eps >= 0.0 && self.rms_norm_eps.is_finite()) {
            return Err(format!(
                "'rms_norm_eps' must be a non-negative number, found {}",
                self.rms_norm_eps
            ));
        }
        self.rope.check("rope_theta")?;
        if let Some(local) = &self.local_rope {
            local
                .check("rope_local_base_freq")
                .map_err(|e| format!("the sliding layers' rope: {e}"))?;
        }
        Ok(())
    }
}

impl RopeConfig {
    /// Checks the base frequency (named `theta_key`) and the scaling's factors.
    fn check(&self, theta_key: &str) -> Result<(), String> {
        positive(theta_key, self.theta)?;
        let p = self.partial_rotary_factor;
        if !(p > 0.0 && p <= 1.0) {
            return Err(format!(
                "'partial_rotary_factor' must be in (0, 1], found {p}"
            ));
        }
        // The scaling's keys, under `rope_scaling` (transformers 4) or `rope_parameters` (5).
        let key = |k: &str| format!("rope_scaling.{k}");
        let original = |n: usize| at_least_one(&key("original_max_position_embeddings"), n);
        match &self.scaling {
            RopeScaling::Default => {}
            RopeScaling::Linear { factor } | RopeScaling::Proportional { factor } => {
                positive(&key("factor"), *factor)?
            }
            RopeScaling::Dynamic {
                factor,
                original_max_position_embeddings,
            } => {
                positive(&key("factor"), *factor)?;
                original(*original_max_position_embeddings)?;
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                positive(&key("factor"), *factor)?;
                positive(&key("low_freq_factor"), *low_freq_factor)?;
                // Equal factors are valid (Llama 4's): the band between them is then empty.
                positive(&key("high_freq_factor"), *high_freq_factor)?;
                original(*original_max_position_embeddings)?;
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                attention_factor,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                truncate: _,
            } => {
                positive(&key("factor"), *factor)?;
                original(*original_max_position_embeddings)?;
                positive(&key("beta_fast"), *beta_fast)?;
                positive(&key("beta_slow"), *beta_slow)?;
                if let Some(a) = attention_factor {
                    positive(&key("attention_factor"), *a)?;
                }
                for (k, v) in [("mscale", mscale), ("mscale_all_dim", mscale_all_dim)] {
                    if let Some(v) = v {
                        if !v.is_finite() {
                            return Err(format!("'{}' must be finite, found {v}", key(k)));
                        }
                    }
                }
            }
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                factor: _,
                original_max_position_embeddings,
                attention_factor,
                mscales,
            } => {
                for (k, list) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                    if let Some(v) = list.iter().find(|v| !(**v > 0.0 && v.is_finite())) {
                        return Err(format!(
                            "'{}' must hold positive numbers, found {v}",
                            key(k)
                        ));
                    }
                }
                original(*original_max_position_embeddings)?;
                if let Some(a) = attention_factor {
                    positive(&key("attention_factor"), *a)?;
                }
                if let Some((short, long)) = mscales {
                    positive(&key("short_mscale"), *short)?;
                    positive(&key("long_mscale"), *long)?;
                }
            }
        }
        Ok(())
    }
}
