//! 4-bit NormalFloat (NF4) weights for QLoRA, built exactly as torchao's `to_nf4` builds them
//! (torchtune's `qlora_*` models quantize their frozen base with it).
//!
//! A weight is flattened and cut into blocks of 64; each value is divided by its block's absolute
//! maximum and replaced by the index of the nearest of 16 NF4 levels (two indices per byte, the
//! first in the high nibble). The block maxima are themselves quantized ("double quantization"):
//! their mean is subtracted, and each group of 256 of them is scaled by `256 / (2 · absmax)`,
//! rounded and stored as an `i8`, with one scale factor per group. Dequantizing gives
//! `level[code] · (q / factor + mean)`.
//!
//! Every step rounds to the weight's dtype as torch does (its bf16/f16 arithmetic computes in f32
//! and rounds each result), so the dequantized weight equals torchao's value for value — the
//! tests compare them bit for bit. Two generalizations, which leave every shape torchao accepts
//! unchanged: torchao requires the element count to be a multiple of 64 × 256; here a last, shorter
//! block (of values, or of block maxima) takes the maximum over what it has. Small models
//! (SmolLM2-135M's 576-wide layers) can then be trained with QLoRA as well.
//!
//! Written here rather than taken from a crate: no Rust crate implements torchao's NF4 (bitsandbytes'
//! NF4 differs in its levels and its scale quantization).

use candle_core::{bail, DType, Device, Result, Tensor};
use rayon::prelude::*;

/// torchao's block size: values per absmax scale.
pub const BLOCK_SIZE: usize = 64;
/// torchao's scaler block size: block scales per double-quantization factor.
pub const SCALER_BLOCK_SIZE: usize = 256;

/// The 16 NF4 levels as torchao lists them (rounded to the weight's dtype before use).
const LEVELS: [f32; 16] = [
    -1.0000, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0000, 0.0796, 0.1609, 0.2461,
    0.3379, 0.4407, 0.5626, 0.7230, 1.0000,
];

/// An NF4-quantized matrix `[rows, cols]` (a frozen linear weight `[out, in]`): one or more row
/// segments, each quantized as its own tensor. A fused projection (Phi-3's `qkv_proj` and
/// `gate_up_proj`) is several: torchtune splits those into q/k/v (gate/up) on load and quantizes
/// each apart, which changes the block maxima's mean and the groups' boundaries.
#[derive(Debug)]
pub struct Nf4Matrix {
    rows: usize,
    cols: usize,
    /// The dtype the weight had: every step of quantizing and dequantizing rounds to it, and
    /// dequantizing returns it.
    dtype: DType,
    /// Where the dequantized weight is wanted.
    device: Device,
    /// Row ranges in order, together `rows` rows.
    segments: Vec<Nf4Segment>,
}

/// The shape of an [`Nf4Matrix`] without its blocks: `[rows, cols]`, the dtype, and per row
/// segment (rows, code bytes, scalers, factors).
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4Layout {
    pub rows: usize,
    pub cols: usize,
    pub dtype: DType,
    pub segments: Vec<(usize, usize, usize, usize)>,
}

impl Nf4Layout {
    /// The length of [`Nf4Matrix::to_bytes`].
    pub fn byte_len(&self) -> usize {
        self.segments
            .iter()
            .map(|&(_, codes, scalers, factors)| codes + scalers + 4 * factors + 4)
            .sum()
    }
}

/// One tensor as torchao's `NF4Tensor` holds it.
#[derive(Debug)]
pub struct Nf4Segment {
    rows: usize,
    /// Two 4-bit level indices per byte, element `2j` in the high nibble of byte `j`.
    codes: Vec<u8>,
    /// One per block of [`BLOCK_SIZE`] values: the block's absmax minus the mean, quantized.
    quantized_scalers: Vec<i8>,
    /// One per group of [`SCALER_BLOCK_SIZE`] blocks: `256 / (2 · absmax)` of the group.
    quantization_factor: Vec<f32>,
    /// The mean of all block absmaxes.
    scaler_mean: f32,
    /// On a GPU, the blocks uploaded once: the weight is expanded there by a kernel.
    #[cfg(feature = "cuda")]
    gpu: Option<crate::cuda::nf4::DeviceNf4>,
}

impl Nf4Segment {
    /// The packed level indices (two per byte, the first in the high nibble), as torchao's
    /// `quantized_data`.
    pub fn codes(&self) -> &[u8] {
        &self.codes
    }

    /// The quantized block scales, as torchao's `quantized_scalers`.
    pub fn quantized_scalers(&self) -> &[i8] {
        &self.quantized_scalers
    }

    /// The per-group factors, as torchao's `quantization_factor`.
    pub fn quantization_factor(&self) -> &[f32] {
        &self.quantization_factor
    }

    /// The mean of the block absmaxes, as torchao's `scaler_mean`.
    pub fn scaler_mean(&self) -> f32 {
        self.scaler_mean
    }

    /// Bytes held: half a byte per value, one per block, four per group.
    fn size_in_bytes(&self) -> usize {
        self.codes.len() + self.quantized_scalers.len() + 4 * self.quantization_factor.len()
    }

    /// A copy without the GPU upload.
    fn host_copy(&self) -> Self {
        Self::from_parts(
            self.rows,
            self.codes.clone(),
            self.quantized_scalers.clone(),
            self.quantization_factor.clone(),
            self.scaler_mean,
        )
    }

    /// Quantizes `values` (row-major, `rows` rows), all arithmetic rounded to `dtype`.
    fn quantize(values: &[f32], rows: usize, dtype: DType) -> Self {
        let levels = levels(dtype);
        // Block absmaxes, their mean (f64 sum, then the dtype: torch accumulates reduced types in
        // f32 and rounds the result), and the maxima minus the mean.
        let block_max: Vec<f32> = values.chunks(BLOCK_SIZE).map(absmax).collect();
        let sum: f64 = block_max.iter().map(|&v| v as f64).sum();
        let scaler_mean = round_to(dtype, (sum / block_max.len().max(1) as f64) as f32);
        let centred: Vec<f32> = block_max
            .iter()
            .map(|&s| round_to(dtype, s - scaler_mean))
            .collect();
        let mut quantized_scalers = Vec::with_capacity(centred.len());
        let mut quantization_factor = Vec::new();
        for group in centred.chunks(SCALER_BLOCK_SIZE) {
            let factor = round_to(dtype, 256.0 / round_to(dtype, 2.0 * absmax(group)));
            quantization_factor.push(factor);
            quantized_scalers.extend(group.iter().map(|&s| to_i8(round_to(dtype, s * factor))));
        }
        // Level indices: each value divided by its block's (unquantized) absmax.
        let indices: Vec<u8> = values
            .par_chunks(BLOCK_SIZE)
            .zip(block_max.par_iter())
            .flat_map_iter(|(block, &max)| {
                block
                    .iter()
                    .map(move |&v| nearest_level(dtype, &levels, round_to(dtype, v / max)))
            })
            .collect();
        let codes = indices
            .chunks(2)
            .map(|pair| pair[0] << 4 | pair.get(1).copied().unwrap_or(0))
            .collect();
        Self::from_parts(
            rows,
            codes,
            quantized_scalers,
            quantization_factor,
            scaler_mean,
        )
    }

    /// A segment of host blocks (not yet uploaded to a GPU).
    fn from_parts(
        rows: usize,
        codes: Vec<u8>,
        quantized_scalers: Vec<i8>,
        quantization_factor: Vec<f32>,
        scaler_mean: f32,
    ) -> Self {
        Self {
            rows,
            codes,
            quantized_scalers,
            quantization_factor,
            scaler_mean,
            #[cfg(feature = "cuda")]
            gpu: None,
        }
    }

    /// Writes the dequantized values into `out` (this segment's part of the matrix).
    fn dequantize_into(&self, dtype: DType, out: &mut [f32]) {
        let levels = levels(dtype);
        out.par_chunks_mut(BLOCK_SIZE)
            .enumerate()
            .for_each(|(block, values)| {
                let factor = self.quantization_factor[block / SCALER_BLOCK_SIZE];
                let q = self.quantized_scalers[block] as f32;
                let scaler = round_to(dtype, round_to(dtype, q / factor) + self.scaler_mean);
                // The block's 16 possible values, then a lookup per code.
                let table = levels.map(|l| round_to(dtype, l * scaler));
                // Blocks hold an even count (64), so a block starts at a byte boundary.
                let start = block * BLOCK_SIZE / 2;
                for (pair, &byte) in values.chunks_mut(2).zip(&self.codes[start..]) {
                    pair[0] = table[(byte >> 4) as usize];
                    if let Some(second) = pair.get_mut(1) {
                        *second = table[(byte & 0x0f) as usize];
                    }
                }
            });
    }
}

/// `x` rounded to `dtype` (round to nearest even, as torch converts f32 results).
fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
        DType::F16 => half::f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// The 16 levels as `dtype` holds them (torchao builds its table in the weight's dtype).
fn levels(dtype: DType) -> [f32; 16] {
    LEVELS.map(|l| round_to(dtype, l))
}

/// The maximum of `|v|` over `values` (NaN if any value is NaN, as torch's `max` propagates it).
fn absmax(values: &[f32]) -> f32 {
    values.iter().fold(0f32, |m, v| {
        if m.is_nan() || v.is_nan() {
            f32::NAN
        } else {
            m.max(v.abs())
        }
    })
}

/// The index of the level nearest to `scaled`, with torch's `min(dim).indices` tie and NaN rules:
/// the first of equal distances wins, and a NaN distance counts as the minimum.
fn nearest_level(dtype: DType, levels: &[f32; 16], scaled: f32) -> u8 {
    let mut best = round_to(dtype, scaled - levels[0]).abs();
    let mut index = 0u8;
    for (i, level) in levels.iter().enumerate().skip(1) {
        if best.is_nan() {
            break;
        }
        let d = round_to(dtype, scaled - level).abs();
        if d.is_nan() || d < best {
            best = d;
            index = i as u8;
        }
    }
    index
}

/// An `i8` from a rounded, clamped value; NaN (a group whose maxima are all equal to the mean
/// gives `0 · ∞`) becomes 0, as torch's conversion does on the CPU.
fn to_i8(x: f32) -> i8 {
    if x.is_nan() {
        0
    } else {
        x.round_ties_even().clamp(-128.0, 127.0) as i8
    }
}

impl Nf4Matrix {
    /// Quantizes a 2-D weight as one tensor (any float dtype; the arithmetic follows that dtype).
    pub fn quantize(weight: &Tensor) -> Result<Self> {
        let rows = weight.dims2()?.0;
        Self::quantize_rows(weight, &[rows])
    }

    /// Quantizes a 2-D weight as consecutive row ranges of `split` rows, each its own tensor (a
    /// fused projection whose parts torchtune quantizes apart).
    pub fn quantize_rows(weight: &Tensor, split: &[usize]) -> Result<Self> {
        let (rows, cols) = weight.dims2()?;
        let dtype = weight.dtype();
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            bail!("NF4 quantizes f32, bf16 or f16 weights, not {dtype:?}");
        }
        if split.iter().sum::<usize>() != rows || split.contains(&0) {
            bail!("NF4: row split {split:?} does not cover the {rows} rows");
        }
        let device = weight.device().clone();
        let values = weight
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        let mut segments = Vec::with_capacity(split.len());
        let mut start = 0;
        for &r in split {
            let part = &values[start * cols..(start + r) * cols];
            segments.push(Nf4Segment::quantize(part, r, dtype));
            start += r;
        }
        Self {
            rows,
            cols,
            dtype,
            device: Device::Cpu,
            segments,
        }
        .placed_on(&device)
    }

    /// This matrix dequantizing onto `device` (its blocks uploaded there when it is a GPU whose
    /// kernel serves the dtype).
    fn placed_on(mut self, device: &Device) -> Result<Self> {
        self.device = device.clone();
        #[cfg(feature = "cuda")]
        for segment in &mut self.segments {
            segment.gpu = None;
            if device.is_cuda() && matches!(self.dtype, DType::F32 | DType::BF16) {
                let levels = levels(self.dtype);
                segment.gpu = Some(crate::cuda::nf4::DeviceNf4::upload(
                    &segment.codes,
                    &segment.quantized_scalers,
                    &segment.quantization_factor,
                    levels,
                    device,
                )?);
            }
        }
        Ok(self)
    }

    /// `[rows, cols]`.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// The dtype the weight was quantized from, and dequantizes to.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device dequantized weights are placed on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The row segments, each quantized as its own tensor (one unless built by
    /// [`Nf4Matrix::quantize_rows`]).
    pub fn segments(&self) -> &[Nf4Segment] {
        &self.segments
    }

    /// The same quantized weight, dequantizing onto `device`.
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        Self {
            rows: self.rows,
            cols: self.cols,
            dtype: self.dtype,
            device: Device::Cpu,
            segments: self.segments.iter().map(Nf4Segment::host_copy).collect(),
        }
        .placed_on(device)
    }

    /// What rebuilding this matrix from [`Nf4Matrix::to_bytes`] needs besides the bytes.
    pub fn layout(&self) -> Nf4Layout {
        Nf4Layout {
            rows: self.rows,
            cols: self.cols,
            dtype: self.dtype,
            segments: self
                .segments
                .iter()
                .map(|s| {
                    (
                        s.rows,
                        s.codes.len(),
                        s.quantized_scalers.len(),
                        s.quantization_factor.len(),
                    )
                })
                .collect(),
        }
    }

    /// The blocks as bytes (per segment: codes, scalers, factors and the mean, the floats
    /// little-endian): what sharded training splits over ranks and gathers back, exactly.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.layout().byte_len());
        for s in &self.segments {
            out.extend_from_slice(&s.codes);
            out.extend(s.quantized_scalers.iter().map(|&q| q as u8));
            for f in &s.quantization_factor {
                out.extend_from_slice(&f.to_le_bytes());
            }
            out.extend_from_slice(&s.scaler_mean.to_le_bytes());
        }
        out
    }

    /// The matrix [`Nf4Matrix::to_bytes`] wrote, dequantizing onto `device`.
    pub fn from_bytes(layout: &Nf4Layout, bytes: &[u8], device: &Device) -> Result<Self> {
        if bytes.len() != layout.byte_len() {
            bail!(
                "NF4: {} bytes for a {}x{} matrix that takes {}",
                bytes.len(),
                layout.rows,
                layout.cols,
                layout.byte_len()
            );
        }
        let mut rest = bytes;
        let mut take = |n: usize| {
            let (head, tail) = rest.split_at(n);
            rest = tail;
            head
        };
        let f32s = |b: &[u8]| -> Vec<f32> {
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let mut segments = Vec::with_capacity(layout.segments.len());
        for &(rows, codes, scalers, factors) in &layout.segments {
            let codes = take(codes).to_vec();
            let quantized_scalers = take(scalers).iter().map(|&b| b as i8).collect();
            let quantization_factor = f32s(take(4 * factors));
            let scaler_mean = f32s(take(4))[0];
            segments.push(Nf4Segment::from_parts(
                rows,
                codes,
                quantized_scalers,
                quantization_factor,
                scaler_mean,
            ));
        }
        Self {
            rows: layout.rows,
            cols: layout.cols,
            dtype: layout.dtype,
            device: Device::Cpu,
            segments,
        }
        .placed_on(device)
    }

    /// A stand-in with this layout's shape and no blocks, for a weight whose blocks are not on
    /// this rank right now (sharded training); dequantizing it is an error.
    pub fn placeholder(layout: &Nf4Layout, device: &Device) -> Self {
        Self {
            rows: layout.rows,
            cols: layout.cols,
            dtype: layout.dtype,
            device: device.clone(),
            segments: Vec::new(),
        }
    }

    /// Bytes held: half a byte per value, one per block, four per group.
    pub fn size_in_bytes(&self) -> usize {
        self.segments.iter().map(Nf4Segment::size_in_bytes).sum()
    }

    /// The dequantized values, row-major, each exactly representable in [`Nf4Matrix::dtype`].
    pub fn dequantize_values(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        let mut rest = out.as_mut_slice();
        for segment in &self.segments {
            let (part, tail) = rest.split_at_mut(segment.rows * self.cols);
            segment.dequantize_into(self.dtype, part);
            rest = tail;
        }
        out
    }

    /// The dequantized weight `[rows, cols]` in its dtype, on its device.
    pub fn dequantize(&self) -> Result<Tensor> {
        if self.segments.is_empty() && self.rows * self.cols > 0 {
            bail!("NF4: this weight's blocks are not on this rank (a sharded placeholder)");
        }
        #[cfg(feature = "cuda")]
        {
            let on_gpu: Option<Vec<_>> = self
                .segments
                .iter()
                .map(|s| {
                    s.gpu
                        .as_ref()
                        .map(|g| (g, s.rows * self.cols, s.scaler_mean))
                })
                .collect();
            if let Some(parts) = on_gpu {
                return crate::cuda::nf4::dequantize(&parts, (self.rows, self.cols), self.dtype);
            }
        }
        Tensor::from_vec(
            self.dequantize_values(),
            (self.rows, self.cols),
            &Device::Cpu,
        )?
        .to_dtype(self.dtype)?
        .to_device(&self.device)
    }
}
