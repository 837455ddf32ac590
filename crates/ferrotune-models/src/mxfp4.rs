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
    let mut out = Vec::with_capacity(bytes.len() * 2);
    for (group, &s) in bytes.chunks_exact(b).zip(&exps) {
        // ldexp: exact in f64, then one rounding to f32 (only an overflow rounds, to ±∞).
        let scale = 2f64.powi(s as i32 - 127);
        for &byte in group {
            out.push((FP4_VALUES[(byte & 0x0F) as usize] as f64 * scale) as f32);
            out.push((FP4_VALUES[(byte >> 4) as usize] as f64 * scale) as f32);
        }
    }
    Tensor::from_vec(out, (e, r, g * b * 2), &Device::Cpu)
        .and_then(|t| t.transpose(1, 2)?.contiguous())
        .map_err(|e| err(e.to_string()))
}

/// Replaces every pair `{name}_blocks` / `{name}_scales` of `parts` (read as bytes, with the file
/// each came from) by the weight `{name}` in `out`, in `dtype` (`None`: bf16, what the weight is
/// stored for) on `device`. A part without its other half is refused, naming it.
pub(crate) fn dequantize_parts(
    mut parts: HashMap<String, (PathBuf, Tensor)>,
    dtype: Option<DType>,
    device: &Device,
    out: &mut HashMap<String, Tensor>,
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

    #[test]
    fn empty_blocks_are_an_error_not_a_panic() {
        let blocks = Tensor::zeros((1, 2, 3, 0), DType::U8, &Device::Cpu).unwrap();
        let scales = Tensor::zeros((1, 2, 3), DType::U8, &Device::Cpu).unwrap();
        let e = dequantize(&blocks, &scales, "w").unwrap_err().to_string();
        assert!(e.contains("empty blocks"), "{e}");
    }
}
