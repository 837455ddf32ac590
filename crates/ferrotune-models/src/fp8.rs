//! FP8 block-quantized weights (transformers' `FineGrainedFP8Config`, `quant_method` `fp8`: the
//! format DeepSeek-V3 / R1, Kimi-K2 and Qwen3's `-FP8` releases ship), dequantized on reading as
//! transformers does when it loads them with `dequantize=True`
//! (`integrations/finegrained_fp8.py`): a quantized linear's `weight` is stored `F8_E4M3` beside
//! a float `weight_scale_inv` `[ceil(out / b0), ceil(in / b1)]` for blocks
//! `weight_block_size` `[b0, b1]` (the last blocks of a row or column partial), and its value is
//! the e4m3 number (exact in f32) times its block's `scale_inv`, in f32, then cast to the compute
//! dtype. Weights without a scale (the embedding, the head, routers: transformers'
//! `modules_to_not_convert`) are stored as floats and read as such. What the model then holds
//! and saves is a plain bf16/f32 checkpoint: the config loses its `quantization_config`.
//!
//! Refused, with the reason: a `fmt` other than `e4m3` and weights stored `F8_E5M2` (transformers
//! quantizes to `float8_e4m3fn` only), `activation_scheme` `static` (its activation scales would
//! be dropped), `expert_dtype` `fp4`, scales stored as anything but a float type wider than 8 bits,
//! an FP8 weight without its scale (or a scale without its weight), and a scale grid that does not
//! fit the weight's shape and blocks.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use serde_json::{Map, Value};

use crate::error::ModelError;

/// The suffix a weight's block scales add to its name (`x.weight` → `x.weight_scale_inv`).
pub(crate) const SCALE_SUFFIX: &str = "_scale_inv";

/// How a checkpoint's FP8 weights are quantized (its `quantization_config`, `quant_method` `fp8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Blocks {
    /// `weight_block_size` `[rows, columns]` of one scale's block; `None` (written `null`): one
    /// scale per tensor.
    pub block: Option<[usize; 2]>,
}

/// The FP8 scheme a config's `quantization_config` declares: `None` when there is none or it is
/// another method; an error for an FP8 variant not read here.
pub fn from_config(obj: &Map<String, Value>) -> Result<Option<Fp8Blocks>, String> {
    let Some(q) = obj.get("quantization_config") else {
        return Ok(None);
    };
    let Some(q) = q.as_object() else {
        return Err("'quantization_config' must be an object".into());
    };
    if q.get("quant_method").and_then(Value::as_str) != Some("fp8") {
        return Ok(None);
    }
    let text = |key: &str| q.get(key).and_then(Value::as_str).map(str::to_lowercase);
    let refuse = |what: String| Err(format!("FP8 checkpoint (quantization_config): {what}"));
    match text("activation_scheme").as_deref() {
        None | Some("dynamic") => {}
        Some("static") => {
            return refuse(
                "activation_scheme 'static' is not read (its per-tensor activation scales would \
                 be dropped); only 'dynamic' checkpoints are"
                    .into(),
            )
        }
        Some(other) => return refuse(format!("activation_scheme '{other}' is not supported")),
    }
    if let Some(fmt) = text("fmt").filter(|f| f != "e4m3") {
        return refuse(format!(
            "fmt '{fmt}' is not read: transformers' FP8 weights are e4m3 (float8_e4m3fn)"
        ));
    }
    if let Some(s) = text("scale_fmt").filter(|s| s != "float" && s != "ue8m0") {
        return refuse(format!("scale_fmt '{s}' is not 'float' or 'ue8m0'"));
    }
    if let Some(e) = text("expert_dtype").filter(|e| e != "fp8") {
        return refuse(format!(
            "expert_dtype '{e}' is not read (only FP8 experts are)"
        ));
    }
    let block = match q.get("weight_block_size") {
        // FineGrainedFP8Config's default.
        None => Some([128, 128]),
        Some(Value::Null) => None,
        Some(Value::Array(v)) => {
            let sizes: Vec<usize> = v
                .iter()
                .filter_map(Value::as_u64)
                .filter(|&n| n > 0)
                .map(|n| n as usize)
                .collect();
            match sizes[..] {
                [b0, b1] if v.len() == 2 => Some([b0, b1]),
                _ => {
                    return refuse(format!(
                        "weight_block_size {v:?} is not two positive integers"
                    ))
                }
            }
        }
        Some(other) => {
            return refuse(format!(
                "weight_block_size {other} is not two positive integers"
            ))
        }
    };
    Ok(Some(Fp8Blocks { block }))
}

/// The value of an FP8 e4m3 (`float8_e4m3fn`) byte, exactly: no infinities, `0x7F` / `0xFF` NaN,
/// subnormals `m · 2^-9`, normals `(1 + m/8) · 2^(e − 7)`.
pub fn e4m3_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, mant) = ((byte >> 3) & 0x0F, byte & 0x07);
    if exp == 0x0F && mant == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        return sign * mant as f32 * 2f32.powi(-9);
    }
    // Exact: the exponent stays far inside f32's range, the mantissa has 3 bits.
    f32::from_bits(((exp as u32 + 120) << 23) | ((mant as u32) << 20)) * sign
}

/// The dequantized f32 weight of FP8 e4m3 `bytes` (row-major, shape `dims`, at least 2-D: the
/// last two axes are the matrix, any leading ones stacked matrices) and its scales `scale_inv`
/// (`dims[..-2]` + `[ceil(rows / b0), ceil(cols / b1)]` for `blocks`, one value a matrix for
/// per-tensor scales): each value times its block's scale in f32, as transformers computes it. `name` names
/// the weight in errors.
pub fn dequantize(
    bytes: &[u8],
    dims: &[usize],
    scale_inv: &Tensor,
    blocks: Fp8Blocks,
    name: &str,
) -> Result<Tensor, ModelError> {
    let err = |m: String| ModelError::Msg(format!("FP8 weight '{name}': {m}"));
    if dims.len() < 2 || bytes.len() != dims.iter().product::<usize>() {
        return Err(err(format!(
            "{} bytes do not make a matrix of shape {dims:?}",
            bytes.len()
        )));
    }
    let (rows, cols) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let stacked: usize = dims[..dims.len() - 2].iter().product();
    let [b0, b1] = match blocks.block {
        Some(b) => b,
        None => [rows.max(1), cols.max(1)],
    };
    let (sr, sc) = (rows.div_ceil(b0), cols.div_ceil(b1));
    let fits = match blocks.block {
        Some(_) => {
            let mut want = dims[..dims.len() - 2].to_vec();
            want.extend([sr, sc]);
            scale_inv.dims() == want
        }
        None => scale_inv.elem_count() == stacked,
    };
    if !fits {
        return Err(err(format!(
            "its weight_scale_inv {:?} does not fit the weight {dims:?} in blocks {:?}",
            scale_inv.dims(),
            blocks.block
        )));
    }
    let scales = scale_inv
        .to_dtype(DType::F32)
        .and_then(|s| s.flatten_all())
        .and_then(|s| s.to_vec1::<f32>())
        .map_err(|e| err(e.to_string()))?;
    let table: [f32; 256] = std::array::from_fn(|b| e4m3_to_f32(b as u8));
    let mut out = Vec::with_capacity(bytes.len());
    for m in 0..stacked {
        let grid = &scales[m * sr * sc..(m + 1) * sr * sc];
        for r in 0..rows {
            let row = &bytes[(m * rows + r) * cols..(m * rows + r + 1) * cols];
            let scale_row = &grid[(r / b0) * sc..(r / b0 + 1) * sc];
            out.extend(
                row.iter()
                    .enumerate()
                    .map(|(c, &b)| table[b as usize] * scale_row[c / b1]),
            );
        }
    }
    Tensor::from_vec(out, dims, &Device::Cpu).map_err(|e| err(e.to_string()))
}

/// An FP8 weight read from a checkpoint: the file it came from, its shape and its bytes.
pub(crate) type RawFp8 = (PathBuf, Vec<usize>, Vec<u8>);

/// The FP8 weights and scales met while reading a checkpoint: each weight is dequantized (in
/// `dtype`, `None`: bf16, what the weights were quantized from, on `device`) as soon as both its
/// parts have been read, so that the whole model's FP8 bytes are never held beside its
/// dequantized weights.
pub(crate) struct Pending {
    blocks: Fp8Blocks,
    dtype: Option<DType>,
    device: Device,
    weights: HashMap<String, RawFp8>,
    scales: HashMap<String, (PathBuf, Tensor)>,
    done: usize,
}

impl Pending {
    /// Nothing read yet, for weights in `blocks`.
    pub(crate) fn new(blocks: Fp8Blocks, dtype: Option<DType>, device: &Device) -> Self {
        Self {
            blocks,
            dtype,
            device: device.clone(),
            weights: HashMap::new(),
            scales: HashMap::new(),
            done: 0,
        }
    }

    /// The FP8 weight `name`: dequantized into `out` if its scale was read, else kept.
    pub(crate) fn add_weight(
        &mut self,
        name: String,
        raw: RawFp8,
        out: &mut HashMap<String, Tensor>,
    ) -> Result<(), ModelError> {
        match self.scales.remove(&name) {
            Some((_, scale)) => self.dequantize_into(name, raw, &scale, out),
            None => {
                self.weights.insert(name, raw);
                Ok(())
            }
        }
    }

    /// The scales of the FP8 weight `weight`: that weight dequantized into `out` if it was
    /// read, else kept.
    pub(crate) fn add_scale(
        &mut self,
        weight: String,
        scale: (PathBuf, Tensor),
        out: &mut HashMap<String, Tensor>,
    ) -> Result<(), ModelError> {
        match self.weights.remove(&weight) {
            Some(raw) => self.dequantize_into(weight, raw, &scale.1, out),
            None => {
                self.scales.insert(weight, scale);
                Ok(())
            }
        }
    }

    fn dequantize_into(
        &mut self,
        name: String,
        (file, dims, bytes): RawFp8,
        scale: &Tensor,
        out: &mut HashMap<String, Tensor>,
    ) -> Result<(), ModelError> {
        let w = dequantize(&bytes, &dims, scale, self.blocks, &name)
            .map_err(|e| ModelError::file(&file, e.to_string()))?
            .to_dtype(self.dtype.unwrap_or(DType::BF16))
            .and_then(|t| t.to_device(&self.device))
            .map_err(|e| ModelError::file(&file, format!("tensor '{name}': {e}")))?;
        crate::weight_checks::finite(&file, &name, &w, Some(DType::F32))?;
        out.insert(name, w);
        self.done += 1;
        Ok(())
    }

    /// Refuses a weight left without its scale, or a scale without its weight, naming it;
    /// otherwise notes what was dequantized.
    pub(crate) fn finish(self) -> Result<(), ModelError> {
        let mut weights: Vec<_> = self.weights.into_iter().collect();
        weights.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some((name, (file, _, _))) = weights.into_iter().next() {
            return Err(ModelError::file(
                &file,
                format!("tensor '{name}' is stored as FP8 without its '{name}{SCALE_SUFFIX}'"),
            ));
        }
        let mut scales: Vec<_> = self.scales.into_iter().collect();
        scales.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some((name, (file, _))) = scales.into_iter().next() {
            return Err(ModelError::file(
                &file,
                format!("tensor '{name}{SCALE_SUFFIX}' has no FP8 weight '{name}' beside it"),
            ));
        }
        if self.done > 0 {
            let to = self.dtype.unwrap_or(DType::BF16);
            tracing::info!(
                "{} FP8 weights (blocks {:?}) dequantized to {to:?} as transformers dequantizes \
                 them: the model is a plain one, and what it saves is a plain {to:?} checkpoint \
                 without quantization_config",
                self.done,
                self.blocks.block
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(q: Value) -> Result<Option<Fp8Blocks>, String> {
        let obj = serde_json::json!({ "quantization_config": q });
        from_config(obj.as_object().unwrap())
    }

    #[test]
    fn configs_read_and_refused() {
        let deepseek = serde_json::json!({"quant_method": "fp8", "fmt": "e4m3",
            "weight_block_size": [128, 128], "activation_scheme": "dynamic"});
        assert_eq!(
            config(deepseek).unwrap(),
            Some(Fp8Blocks {
                block: Some([128, 128])
            })
        );
        let per_tensor = serde_json::json!({"quant_method": "fp8", "weight_block_size": null});
        assert_eq!(config(per_tensor).unwrap(), Some(Fp8Blocks { block: None }));
        assert_eq!(
            config(serde_json::json!({"quant_method": "mxfp4"})),
            Ok(None)
        );
        for (q, needle) in [
            (
                serde_json::json!({"quant_method": "fp8", "activation_scheme": "static"}),
                "static",
            ),
            (
                serde_json::json!({"quant_method": "fp8", "fmt": "e5m2"}),
                "e5m2",
            ),
            (
                serde_json::json!({"quant_method": "fp8", "weight_block_size": [128]}),
                "weight_block_size",
            ),
            (
                serde_json::json!({"quant_method": "fp8", "weight_block_size": [0, 128]}),
                "weight_block_size",
            ),
            (
                serde_json::json!({"quant_method": "fp8", "expert_dtype": "fp4"}),
                "fp4",
            ),
        ] {
            let e = config(q).unwrap_err();
            assert!(e.contains(needle), "{e}");
        }
    }

    /// `weight_block_size: null`: one scale for the whole matrix (a 0-dim tensor, as
    /// transformers' `FP8Linear` holds it).
    #[test]
    fn a_per_tensor_scale_scales_every_value() {
        let scale = Tensor::new(0.25f32, &Device::Cpu).unwrap();
        let w = dequantize(
            &[0x38, 0x40, 0xB8, 0x30],
            &[2, 2],
            &scale,
            Fp8Blocks { block: None },
            "w",
        )
        .unwrap();
        let got = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got, [0.25, 0.5, -0.25, 0.125]);
    }

    #[test]
    fn a_scale_grid_that_does_not_fit_is_refused() {
        let scale = Tensor::ones((2, 2), DType::F32, &Device::Cpu).unwrap();
        let blocks = Fp8Blocks {
            block: Some([16, 16]),
        };
        // 40 × 20 in blocks of 16 needs a [3, 2] grid.
        let e = dequantize(&[0; 800], &[40, 20], &scale, blocks, "w")
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not fit"), "{e}");
        let ok = Tensor::ones((3, 2), DType::F32, &Device::Cpu).unwrap();
        assert!(dequantize(&[0; 800], &[40, 20], &ok, blocks, "w").is_ok());
    }
}
