//! An NF4 weight expanded on the GPU (`nf4_dequant` in kernels.cu), so that QLoRA's base never
//! leaves the device: its 4-bit blocks are uploaded once and expanded for each product.

use candle_core::{DType, Device, Result, Tensor};

use super::{cuda_device, empty, launch, ptr, stride_grid, suffix, Arg};

/// The blocks of one NF4 weight on a GPU: bytes packed four to a `u32` word (candle has no `u8`
/// CUDA buffers the kernels can address).
#[derive(Debug)]
pub(crate) struct DeviceNf4 {
    codes: Tensor,
    scalers: Tensor,
    factors: Tensor,
    levels: Tensor,
}

/// `bytes` in little-endian `u32` words (the kernel reads them back as bytes).
fn words(bytes: &[u8], device: &Device) -> Result<Tensor> {
    let words: Vec<u32> = bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w)
        })
        .collect();
    let n = words.len();
    Tensor::from_vec(words, n, device)
}

impl DeviceNf4 {
    /// Uploads the blocks; `levels` are the 16 levels rounded to the weight's dtype.
    pub(crate) fn upload(
        codes: &[u8],
        scalers: &[i8],
        factors: &[f32],
        levels: [f32; 16],
        device: &Device,
    ) -> Result<Self> {
        let scaler_bytes: Vec<u8> = scalers.iter().map(|&s| s as u8).collect();
        Ok(Self {
            codes: words(codes, device)?,
            scalers: words(&scaler_bytes, device)?,
            factors: Tensor::from_slice(factors, factors.len(), device)?,
            levels: Tensor::from_slice(&levels, 16, device)?,
        })
    }
}

/// A weight `[rows, cols]` in `dtype` (f32 or bf16) from its row segments in order: each
/// `(blocks, element count, mean)` expands into its part of one output.
pub(crate) fn dequantize(
    segments: &[(&DeviceNf4, usize, f32)],
    (rows, cols): (usize, usize),
    dtype: DType,
) -> Result<Tensor> {
    let Some((first, _, _)) = segments.first() else {
        candle_core::bail!("NF4: a weight without segments")
    };
    let dev = cuda_device(&first.codes)?;
    let out = empty(&dev, dtype, (rows, cols))?;
    let base = ptr(&out)?;
    let mut offset = 0usize;
    for (blocks, n, mean) in segments {
        launch(
            &dev,
            &format!("nf4_dequant_{}", suffix(dtype)?),
            (stride_grid(n.div_ceil(2)), 1),
            256,
            0,
            &[
                Arg::Ptr(ptr(&blocks.codes)?),
                Arg::Ptr(ptr(&blocks.scalers)?),
                Arg::Ptr(ptr(&blocks.factors)?),
                Arg::Ptr(ptr(&blocks.levels)?),
                Arg::F32(*mean),
                Arg::Ptr(base + (offset * dtype.size_in_bytes()) as u64),
                Arg::I64(*n as i64),
            ],
        )?;
        offset += n;
    }
    Ok(out)
}
