//! A quantized AdamW's state over sharded parameters: which pieces of which parameters each
//! rank's flat shard holds, and the state dict ([`crate::optim_quant`]'s packed one, per unit)
//! turned into the single-device one (per parameter) and back.
//!
//! Every trainable parameter starts on a block boundary of its unit's flat buffer and every chunk
//! is whole blocks ([`ShardedModel::with_quant_state`]), so a rank holds whole blocks of each
//! parameter: its codes and scales are a run of the single-device ones, and the ranks' together
//! are all of them. Whether a parameter is quantized is its whole size's matter, as on one device.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Result};
use candle_core::{DType, Device, Tensor};

use super::{Flat, ShardedModel};
use crate::optim_quant::{Piece, QuantAdamWConfig};

/// The two moments' names.
const MOMENTS: [&str; 2] = ["exp_avg", "exp_avg_sq"];

impl Flat {
    /// The pieces of the slots that shard `rank`'s chunk holds: (slot index, piece).
    fn pieces(&self, rank: usize) -> Vec<(usize, Piece)> {
        let (lo, hi) = (rank * self.chunk, (rank + 1) * self.chunk);
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let (a, b) = (s.offset.max(lo), (s.offset + s.numel).min(hi));
                (a < b).then(|| {
                    let piece = Piece {
                        numel: s.numel,
                        start: a - s.offset,
                        at: a - lo,
                        len: b - a,
                    };
                    (i, piece)
                })
            })
            .collect()
    }

    /// How many values of shard `rank` keep f32 moments under `q`.
    fn f32_values(&self, rank: usize, q: &QuantAdamWConfig) -> usize {
        self.pieces(rank)
            .iter()
            .filter(|(_, p)| !q.quantizes(p.numel))
            .map(|(_, p)| p.len)
            .sum()
    }
}

/// A state tensor's values on the host, flattened.
fn host<T: candle_core::WithDType>(t: &Tensor, dtype: DType) -> Result<Vec<T>> {
    Ok(t.flatten_all()?
        .to_device(&Device::Cpu)?
        .to_dtype(dtype)?
        .to_vec1::<T>()?)
}

impl ShardedModel {
    /// The pieces of parameters each of [`ShardedModel::optimizer_params`] holds, for
    /// [`crate::optim_quant::QuantAdamW::with_pieces`] (under `none`, each parameter whole).
    pub fn optimizer_pieces(&self) -> Vec<Vec<Piece>> {
        let mut out = Vec::new();
        for st in &self.units {
            if st.trainable.slots.is_empty() {
                continue;
            }
            match &st.shard {
                Some(_) => out.push(
                    st.trainable
                        .pieces(self.shard_index)
                        .into_iter()
                        .map(|(_, p)| p)
                        .collect(),
                ),
                None => out.extend(st.trainable.slots.iter().map(|s| {
                    vec![Piece {
                        numel: s.numel,
                        start: 0,
                        at: 0,
                        len: s.numel,
                    }]
                })),
            }
        }
        out
    }

    /// The single-device state dict from every rank's packed one (every rank calls it).
    pub(super) fn full_quant_state(
        &self,
        q: &QuantAdamWConfig,
        state: Vec<(String, Tensor)>,
    ) -> Result<Vec<(String, Tensor)>> {
        let (bits, bs) = (q.kind.bits(), q.block_size);
        let mut state: HashMap<String, Tensor> = state.into_iter().collect();
        let mut out = Vec::new();
        for st in &self.units {
            let flat = &st.trainable;
            if flat.slots.is_empty() {
                continue;
            }
            let unit = st.unit.name();
            // Every rank has stepped every unit as often: the same units have state everywhere.
            let Some(step) = state.remove(&format!("{unit}.step")) else {
                continue;
            };
            for s in &flat.slots {
                out.push((format!("{}.step", s.name), step.clone()));
            }
            let dev = step.device().clone();
            for moment in MOMENTS {
                let mut take = |suffix: &str| {
                    let key = format!("{unit}.{moment}{suffix}");
                    state
                        .remove(&key)
                        .ok_or_else(|| anyhow!("internal: no optimizer state '{key}'"))
                };
                let codes = self.queue.all_gather(&take("_codes")?)?;
                let scales = self.queue.all_gather(&take("_absmax")?)?;
                // The f32 values: each rank's count follows from the layout; the all-gather
                // takes the same count from each, so every rank pads to the largest.
                let mine: Vec<f32> = host(&take("")?, DType::F32)?;
                let width = (0..self.shards)
                    .map(|r| flat.f32_values(r, q))
                    .max()
                    .unwrap_or(0)
                    .max(1);
                let mut padded = mine;
                padded.resize(width, 0.0);
                let all = Tensor::from_vec(padded, width, &self.device)?;
                let all: Vec<f32> = host(&self.queue.all_gather(&all)?, DType::F32)?;
                let mut values: HashMap<usize, Vec<f32>> = HashMap::new();
                for r in 0..self.shards {
                    let mut k = r * width;
                    for (i, p) in flat.pieces(r) {
                        if q.quantizes(p.numel) {
                            continue;
                        }
                        let v = values.entry(i).or_insert_with(|| vec![0.0; p.numel]);
                        v[p.start..p.start + p.len].copy_from_slice(&all[k..k + p.len]);
                        k += p.len;
                    }
                }
                for (i, s) in flat.slots.iter().enumerate() {
                    if q.quantizes(s.numel) {
                        let (c, n) = (s.offset * bits / 8, s.numel * bits / 8);
                        let part = codes.narrow(0, c, n)?.force_contiguous()?;
                        out.push((format!("{}.{moment}_codes", s.name), part.to_device(&dev)?));
                        let (a, n) = (s.offset / bs, s.numel.div_ceil(bs));
                        let part = scales.narrow(0, a, n)?.force_contiguous()?;
                        out.push((format!("{}.{moment}_absmax", s.name), part.to_device(&dev)?));
                    } else {
                        let v = values.remove(&i).unwrap_or_else(|| vec![0.0; s.numel]);
                        let n = v.len();
                        out.push((
                            format!("{}.{moment}", s.name),
                            Tensor::from_vec(v, n, &dev)?,
                        ));
                    }
                }
            }
        }
        if let Some(key) = state.keys().next() {
            bail!("internal: optimizer state key '{key}' names no unit");
        }
        Ok(out)
    }

    /// This rank's packed state from a single-device state dict (of any world size).
    pub(super) fn shard_quant_state(
        &self,
        q: &QuantAdamWConfig,
        full: &HashMap<String, Tensor>,
    ) -> Result<HashMap<String, Tensor>> {
        let (bits, bs) = (q.kind.bits(), q.block_size);
        let mut out = HashMap::new();
        for st in &self.units {
            let flat = &st.trainable;
            let Some(first) = flat.slots.first() else {
                continue;
            };
            let Some(step) = full.get(&format!("{}.step", first.name)) else {
                continue;
            };
            let unit = st.unit.name();
            let dev = step.device().clone();
            out.insert(format!("{unit}.step"), step.clone());
            let pieces = flat.pieces(self.shard_index);
            for moment in MOMENTS {
                let mut codes = vec![0u8; flat.chunk * bits / 8];
                let mut scales = vec![0f32; flat.chunk.div_ceil(bs)];
                let mut values = Vec::new();
                for (i, p) in &pieces {
                    let s = &flat.slots[*i];
                    let get = |suffix: &str| {
                        let key = format!("{}.{moment}{suffix}", s.name);
                        full.get(&key).ok_or_else(|| {
                            anyhow!(
                                "the optimizer state has no '{key}' (saved by another optimizer \
                                 or block size?)"
                            )
                        })
                    };
                    if q.quantizes(s.numel) {
                        let c: Vec<u8> = host(get("_codes")?, DType::U8)?;
                        let a: Vec<f32> = host(get("_absmax")?, DType::F32)?;
                        if c.len() != s.numel * bits / 8 || a.len() != s.numel.div_ceil(bs) {
                            bail!(
                                "optimizer state {}.{moment}: {} codes and {} scales do not fit \
                                 {} values in {bits}-bit blocks of {bs}",
                                s.name,
                                c.len(),
                                a.len(),
                                s.numel
                            );
                        }
                        let (from, to, n) = (p.start * bits / 8, p.at * bits / 8, p.len * bits / 8);
                        codes[to..to + n].copy_from_slice(&c[from..from + n]);
                        let (from, to, n) = (p.start / bs, p.at / bs, p.len.div_ceil(bs));
                        scales[to..to + n].copy_from_slice(&a[from..from + n]);
                    } else {
                        let v: Vec<f32> = host(get("")?, DType::F32)?;
                        if v.len() != s.numel {
                            bail!(
                                "optimizer state {}.{moment}: {} values, parameter {}",
                                s.name,
                                v.len(),
                                s.numel
                            );
                        }
                        values.extend_from_slice(&v[p.start..p.start + p.len]);
                    }
                }
                let (nc, ns, nv) = (codes.len(), scales.len(), values.len());
                let key = format!("{unit}.{moment}");
                out.insert(format!("{key}_codes"), Tensor::from_vec(codes, nc, &dev)?);
                out.insert(format!("{key}_absmax"), Tensor::from_vec(scales, ns, &dev)?);
                out.insert(key, Tensor::from_vec(values, nv, &dev)?);
            }
        }
        Ok(out)
    }
}
