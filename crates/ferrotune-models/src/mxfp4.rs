//! MXFP4 weights (OpenAI's gpt-oss checkpoints: `mlp.experts.gate_up_proj_blocks` /
//! `_scales`, ...), dequantized on reading as transformers' `integrations/mxfp4.py` does when it
//! dequantizes: each byte of `*_blocks` `[experts, rows, groups, 16]` holds two FP4 (e2m1) values,
//! the low nibble first; every group of 32 values shares the power of two `2^(scale − 127)` of its
//! byte in `*_scales` `[experts, rows, groups]`; the `[experts, rows, groups · 32]` result is
//! transposed to `[experts, groups · 32, rows]`, the layout of the bf16 parameter it stands for.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};

use crate::error::ModelError;

/// FP4 (e2m1) values by nibble.
const FP4_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The suffixes of a quantized tensor's two parts.
const BLOCKS: &str = "_blocks";
const SCALES: &str = "_scales";

/// Whether a checkpoint tensor named `name`, stored as bytes, is a part of an MXFP4 weight.
pub(crate) fn is_part(name: &str) -> bool {
    name.ends_with(BLOCKS) || name.ends_with(SCALES)
}

/// The dequantized weight (f32, `[experts, groups · 32, rows]`) of MXFP4 `blocks` (u8
/// `[experts, rows, groups, 16]`) and `scales` (u8 `[experts, rows, groups]`), computed exactly
/// (every value is a small FP4 number times a power of two); `name` names the weight in errors.
pub fn dequantize(blocks: &Tensor, scales: &Tensor, name: &str) -> Result<Tensor, ModelError> {
    let err = |m: String| ModelError::Msg(format!("MXFP4 weight '{name}': {m}"));
    let (e, r, g, b) = blocks
        .dims4()
        .map_err(|_| err(format!("{name}{BLOCKS} {:?} is not 4-D", blocks.dims())))?;
    if scales.dims() != [e, r, g] {
        return Err(err(format!(
            "{name}{SCALES} {:?} does not fit {name}{BLOCKS} {:?}",
            scales.dims(),
            blocks.dims()
        )));
    }
    if b == 0 {
        // `chunks_exact(0)` panics; no real checkpoint has empty blocks.
        return Err(err(format!(
            "{name}{BLOCKS} {:?} has empty blocks",
            blocks.dims()
        )));
    }
    if blocks.dtype() != DType::U8 || scales.dtype() != DType::U8 {
        return Err(err("its blocks and scales must be stored as U8".into()));
    }
    let host = |t: &Tensor| -> Result<Vec<u8>, ModelError> {
        t.flatten_all()
            .and_then(|t| t.to_device(&Device::Cpu))
            .and_then(|t| t.to_vec1::<u8>())
            .map_err(|e| err(e.to_string()))
    };
    let (bytes, exps) = (host(blocks)?, host(scales)?);
    Tensor::from_vec(decode(&bytes, &exps, b), (e, r, g * b * 2), &Device::Cpu)
        .and_then(|t| t.transpose(1, 2)?.contiguous())
        .map_err(|e| err(e.to_string()))
}

/// The values of MXFP4 `bytes` (groups of `b` bytes, two FP4 values each, low nibble first), each
/// group scaled by its byte of `exps`: ldexp, exact in f64, then one rounding to f32 (only an
/// overflow rounds, to ±∞). Below scale byte 255 the f32 product is that same value: the scale
/// `2^(s − 127)` is an f32 (a subnormal for 0), and an FP4 value times it is exact or overflows.
fn decode(bytes: &[u8], exps: &[u8], b: usize) -> Vec<f32> {
    // Each byte's two values, low nibble first.
    let pairs: [[f32; 2]; 256] =
        std::array::from_fn(|i| [FP4_VALUES[i & 0x0F], FP4_VALUES[i >> 4]]);
    let mut out = vec![0f32; bytes.len() * 2];
    let groups = out.chunks_exact_mut(2 * b).zip(bytes.chunks_exact(b));
    for ((out, group), &s) in groups.zip(exps) {
        if s == 255 {
            let scale = 2f64.powi(s as i32 - 127);
            for (o, &byte) in out.chunks_exact_mut(2).zip(group) {
                o[0] = (FP4_VALUES[(byte & 0x0F) as usize] as f64 * scale) as f32;
                o[1] = (FP4_VALUES[(byte >> 4) as usize] as f64 * scale) as f32;
            }
            continue;
        }
        let scale = if s == 0 {
            f32::from_bits(1 << 22)
        } else {
            f32::from_bits((s as u32) << 23)
        };
        for (o, &byte) in out.chunks_exact_mut(2).zip(group) {
            let [lo, hi] = pairs[byte as usize];
            o[0] = lo * scale;
            o[1] = hi * scale;
        }
    }
    out
}

/// One of gpt-oss's fused expert weights kept as its MXFP4 blocks and scales (QLoRA's frozen
/// base, [`crate::model::ExpertWeight::Mxfp4`]): about a quarter of the bf16 bytes. Each expert
/// dequantizes on its own ([`Mxfp4Experts::expert_rows`]), to exactly the values [`dequantize`]
/// gives, in the dtype the dense weight would have. The bytes stay in host memory.
#[derive(Debug)]
pub struct Mxfp4Experts {
    /// `*_blocks` `[experts, rows, groups, bytes]`, flat.
    blocks: Vec<u8>,
    /// `*_scales` `[experts, rows, groups]`, flat.
    scales: Vec<u8>,
    /// `(experts, rows, groups, bytes per group)`.
    dims: (usize, usize, usize, usize),
    /// The dtype and device the dequantized experts are made in.
    dtype: DType,
    device: Device,
}

impl Mxfp4Experts {
    /// The packed weight `name` from its `blocks` (u8 `[experts, rows, groups, 16]`) and `scales`
    /// (u8 `[experts, rows, groups]`), to dequantize into `dtype` on `device`. Checked as
    /// [`dequantize`] checks them, and every value finite (as a dequantized weight is checked).
    pub fn new(
        blocks: &Tensor,
        scales: &Tensor,
        name: &str,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let err = |m: String| ModelError::Msg(format!("MXFP4 weight '{name}': {m}"));
        // The shape and type checks, on an empty slice of the experts.
        dequantize(&blocks.narrow(0, 0, 0)?, &scales.narrow(0, 0, 0)?, name)?;
        let dims = blocks.dims4()?;
        let host = |t: &Tensor| -> Result<Vec<u8>, ModelError> {
            t.flatten_all()
                .and_then(|t| t.to_device(&Device::Cpu))
                .and_then(|t| t.to_vec1::<u8>())
                .map_err(|e| err(e.to_string()))
        };
        let packed = Self {
            blocks: host(blocks)?,
            scales: host(scales)?,
            dims,
            dtype,
            device: device.clone(),
        };
        // 6 · 2^(252 − 127) < f32::MAX: only larger scale bytes can dequantize to ±∞.
        if packed.scales.iter().any(|&s| s > 252) {
            for e in 0..dims.0 {
                let w = packed.expert_rows(e)?;
                let sum = w
                    .to_dtype(DType::F32)?
                    .abs()?
                    .sum_all()?
                    .to_scalar::<f32>()?;
                if !sum.is_finite() {
                    return Err(err(format!(
                        "expert {e} dequantizes to a value that is not finite"
                    )));
                }
            }
        }
        Ok(packed)
    }

    /// `(experts, in, out)`: the dense weight's shape, `[experts, groups · 32, rows]`.
    pub fn dims3(&self) -> (usize, usize, usize) {
        let (e, r, g, b) = self.dims;
        (e, g * b * 2, r)
    }

    /// The dtype the experts dequantize to.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes held (blocks and scales).
    pub fn size_in_bytes(&self) -> usize {
        self.blocks.len() + self.scales.len()
    }

    /// Bytes the dense weight takes in its dtype.
    pub fn dense_bytes(&self) -> usize {
        let (e, i, o) = self.dims3();
        e * i * o * self.dtype.size_in_bytes()
    }

    /// Expert `e`'s weight as rows, `[out, in]` (the transpose of its `[in, out]` slice of the
    /// dense weight), dequantized exactly into the dtype on the device.
    pub fn expert_rows(&self, e: usize) -> candle_core::Result<Tensor> {
        let (experts, r, g, b) = self.dims;
        if e >= experts {
            candle_core::bail!("MXFP4 experts: expert {e} of {experts}");
        }
        let (bytes, groups) = (r * g * b, r * g);
        let values = decode(
            &self.blocks[e * bytes..(e + 1) * bytes],
            &self.scales[e * groups..(e + 1) * groups],
            b,
        );
        Tensor::from_vec(values, (r, g * b * 2), &Device::Cpu)?
            .to_dtype(self.dtype)?
            .to_device(&self.device)
    }

    /// The whole dense weight `[experts, in, out]`: what [`dequantize`] gives, in the dtype.
    pub fn dense(&self) -> candle_core::Result<Tensor> {
        let experts: Vec<Tensor> = (0..self.dims.0)
            .map(|e| self.expert_rows(e)?.t())
            .collect::<candle_core::Result<_>>()?;
        Tensor::stack(&experts, 0)?.contiguous()
    }
}

/// Replaces every pair `{name}_blocks` / `{name}_scales` of `parts` (read as bytes, with the file
/// each came from) by the weight `{name}` in `out`, in `dtype` (`None`: bf16, what the weight is
/// stored for) on `device`. A part without its other half is refused, naming it. With `keep`,
/// the pairs go into `out` as they are (u8, on the CPU), for the model to hold them packed
/// ([`Mxfp4Experts`]).
pub(crate) fn dequantize_parts(
    mut parts: HashMap<String, (PathBuf, Tensor)>,
    dtype: Option<DType>,
    device: &Device,
    out: &mut HashMap<String, Tensor>,
    keep: bool,
) -> Result<(), ModelError> {
    let mut names: Vec<String> = parts
        .keys()
        .filter_map(|n| n.strip_suffix(BLOCKS).map(str::to_string))
        .collect();
    names.sort();
    for name in names {
        let (file, blocks) = parts.remove(&format!("{name}{BLOCKS}")).expect("listed");
        let Some((_, scales)) = parts.remove(&format!("{name}{SCALES}")) else {
            return Err(ModelError::file(
                &file,
                format!("tensor '{name}{BLOCKS}' (MXFP4) has no '{name}{SCALES}' beside it"),
            ));
        };
        if keep {
            out.insert(format!("{name}{BLOCKS}"), blocks);
            out.insert(format!("{name}{SCALES}"), scales);
            continue;
        }
        let w = dequantize(&blocks, &scales, &name)?
            .to_dtype(dtype.unwrap_or(DType::BF16))
            .and_then(|t| t.to_device(device))
            .map_err(|e| ModelError::file(&file, format!("tensor '{name}': {e}")))?;
        crate::weight_checks::finite(&file, &name, &w, Some(DType::F32))?;
        out.insert(name, w);
    }
    if let Some((part, (file, _))) = parts.into_iter().next() {
        return Err(ModelError::file(
            &file,
            format!("tensor '{part}' is stored as U8 without its MXFP4 blocks beside it"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every scale byte (the subnormal 0, the overflowing 255) and every byte of nibbles gives
    /// the f64 ldexp rounded once to f32.
    #[test]
    fn decoding_is_ldexp_for_every_scale_and_byte() {
        let bytes: Vec<u8> = (0..=255u8).collect();
        for s in 0..=255u8 {
            let got = decode(&bytes, &[s], 256);
            for (i, &byte) in bytes.iter().enumerate() {
                for (k, nibble) in [byte & 0x0F, byte >> 4].into_iter().enumerate() {
                    let want =
                        (FP4_VALUES[nibble as usize] as f64 * 2f64.powi(s as i32 - 127)) as f32;
                    let g = got[2 * i + k];
                    assert!(
                        g.to_bits() == want.to_bits(),
                        "scale {s} byte {byte}: {g} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn empty_blocks_are_an_error_not_a_panic() {
        let blocks = Tensor::zeros((1, 2, 3, 0), DType::U8, &Device::Cpu).unwrap();
        let scales = Tensor::zeros((1, 2, 3), DType::U8, &Device::Cpu).unwrap();
        let e = dequantize(&blocks, &scales, "w").unwrap_err().to_string();
        assert!(e.contains("empty blocks"), "{e}");
    }
}
