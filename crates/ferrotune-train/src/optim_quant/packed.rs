//! The state dict of a [`QuantAdamW`] over flat shards ([`QuantAdamW::with_pieces`]): per
//! variable `"{var}.step"`, and per moment the state laid out like the variable, so that the
//! ranks' tensors concatenate (after an all-gather) into the single-device state:
//! `"{var}.{moment}_codes"` (u8, the codes of the variable's values: one a byte, or two a byte in
//! 4 bits, zero where no quantized piece lies), `"{var}.{moment}_absmax"` (f32, one per block of
//! the variable) and `"{var}.{moment}"` (f32, the values of the pieces kept in f32, one after the
//! other). `crate::dist::fsdp` turns it into the single-device names and back.

use std::collections::HashMap;

use candle_core::{bail, DType, Device, Result, Tensor};

use super::{Moment, PieceState, QState, QuantAdamW};
use crate::optim::{step_from_tensor, step_tensor};

/// The two moments' names.
const MOMENTS: [&str; 2] = ["exp_avg", "exp_avg_sq"];

/// A state tensor's values on the host, flattened.
fn host<T: candle_core::WithDType>(t: &Tensor, dtype: DType) -> Result<Vec<T>> {
    t.flatten_all()?
        .to_device(&Device::Cpu)?
        .to_dtype(dtype)?
        .to_vec1::<T>()
}

impl QuantAdamW {
    /// The packed state dict (see the module's documentation).
    pub(super) fn packed_state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let (bits, bs) = (self.cfg.kind.bits(), self.cfg.block_size);
        let mut out = Vec::new();
        let vars = self.params.iter().zip(&self.pieces);
        for (((name, var), pieces), st) in vars.zip(&self.state) {
            let Some(st) = st else { continue };
            let (dev, n) = (var.device(), var.elem_count());
            out.push((
                format!("{name}.step"),
                step_tensor(st.step, var.as_tensor())?,
            ));
            for (k, moment) in MOMENTS.iter().enumerate() {
                let mut codes = vec![0u8; n * bits / 8];
                let mut scales = vec![0f32; n.div_ceil(bs)];
                let mut values = Vec::new();
                for (pc, ps) in pieces.iter().zip(&st.pieces) {
                    let m = if k == 0 { &ps.exp_avg } else { &ps.exp_avg_sq };
                    match m {
                        Moment::F32(v) => values.extend_from_slice(v),
                        Moment::Quant { codes: c, absmax } => {
                            let at = pc.at * bits / 8;
                            codes[at..at + c.len()].copy_from_slice(c);
                            let at = pc.at / bs;
                            scales[at..at + absmax.len()].copy_from_slice(absmax);
                        }
                    }
                }
                out.push((
                    format!("{name}.{moment}_codes"),
                    Tensor::from_vec(codes, n * bits / 8, dev)?,
                ));
                out.push((
                    format!("{name}.{moment}_absmax"),
                    Tensor::from_vec(scales, n.div_ceil(bs), dev)?,
                ));
                let len = values.len();
                out.push((
                    format!("{name}.{moment}"),
                    Tensor::from_vec(values, len, dev)?,
                ));
            }
        }
        Ok(out)
    }

    /// Loads a packed state dict (its keys already checked).
    pub(super) fn load_packed(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        let cfg = self.cfg;
        let (bits, bs) = (cfg.kind.bits(), cfg.block_size);
        let vars = self.params.iter().zip(&self.pieces);
        for (((name, var), pieces), st) in vars.zip(self.state.iter_mut()) {
            let Some(step) = state.get(&format!("{name}.step")) else {
                if state.keys().any(|k| k.starts_with(&format!("{name}."))) {
                    bail!("AdamW state for {name}: step, exp_avg and exp_avg_sq go together");
                }
                *st = None;
                continue;
            };
            let n = var.elem_count();
            let mut moments: [Vec<Moment>; 2] = [Vec::new(), Vec::new()];
            for (k, moment) in MOMENTS.iter().enumerate() {
                let get = |suffix: &str| {
                    let key = format!("{name}.{moment}{suffix}");
                    state
                        .get(&key)
                        .ok_or_else(|| candle_core::Error::Msg(format!("no optimizer state {key}")))
                };
                let codes: Vec<u8> = host(get("_codes")?, DType::U8)?;
                let scales: Vec<f32> = host(get("_absmax")?, DType::F32)?;
                let values: Vec<f32> = host(get("")?, DType::F32)?;
                if codes.len() != n * bits / 8 || scales.len() != n.div_ceil(bs) {
                    bail!(
                        "optimizer state {name}.{moment}: {} codes and {} scales do not fit {n} \
                         values in {bits}-bit blocks of {bs}",
                        codes.len(),
                        scales.len()
                    );
                }
                let mut used = 0;
                for pc in pieces {
                    moments[k].push(if cfg.quantizes(pc.numel) {
                        let at = pc.at * bits / 8;
                        let b = pc.at / bs;
                        Moment::Quant {
                            codes: codes[at..at + pc.len * bits / 8].to_vec(),
                            absmax: scales[b..b + pc.len.div_ceil(bs)].to_vec(),
                        }
                    } else {
                        let Some(v) = values.get(used..used + pc.len) else {
                            bail!("optimizer state {name}.{moment}: too few f32 values");
                        };
                        used += pc.len;
                        Moment::F32(v.to_vec())
                    });
                }
                if used != values.len() {
                    bail!(
                        "optimizer state {name}.{moment}: {} f32 values, the pieces hold {used}",
                        values.len()
                    );
                }
            }
            let [m, v] = moments;
            *st = Some(QState {
                step: step_from_tensor(step)?,
                pieces: m
                    .into_iter()
                    .zip(v)
                    .map(|(exp_avg, exp_avg_sq)| PieceState {
                        exp_avg,
                        exp_avg_sq,
                    })
                    .collect(),
            });
        }
        Ok(())
    }
}
