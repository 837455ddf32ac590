//! Writing the GGUF file: metadata, tensor data, and where the weights are read from.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use crate::gguf_quants::quantize;

use super::*;

/// Writes the GGUF file `out` under a temporary name, renamed into place when complete and
/// removed if anything fails; returns the file's size.
pub(super) fn write_gguf(
    out: &Path,
    plan: &[Planned],
    meta: &Metadata,
    weights: &Weights,
) -> Result<u64> {
    let partial = PathBuf::from(format!("{}.partial", out.display()));
    let written = write_gguf_data(&partial, plan, meta, weights).inspect_err(|_| {
        let _ = std::fs::remove_file(&partial);
    })?;
    std::fs::rename(&partial, out)
        .with_context(|| format!("moving {} into place", partial.display()))?;
    Ok(written)
}

/// Writes the header, the metadata, the tensor descriptions, then each tensor's data at its
/// aligned offset; returns the file's size.
pub(super) fn write_gguf_data(
    partial: &Path,
    plan: &[Planned],
    meta: &Metadata,
    weights: &Weights,
) -> Result<u64> {
    let mut w = BufWriter::new(
        File::create(partial).with_context(|| format!("creating {}", partial.display()))?,
    );
    w.write_all(b"GGUF")?;
    w.write_all(&3u32.to_le_bytes())?;
    w.write_all(&(plan.len() as u64).to_le_bytes())?;
    w.write_all(&(meta.count as u64).to_le_bytes())?;
    w.write_all(&meta.bytes)?;
    let mut offset = 0u64;
    let mut offsets = Vec::with_capacity(plan.len());
    let mut head_len = 4 + 4 + 8 + 8 + meta.bytes.len() as u64;
    for t in plan {
        let mut info = Vec::new();
        put_string(&mut info, &t.name);
        info.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            info.extend(d.to_le_bytes());
        }
        info.extend(t.ty.id().to_le_bytes());
        info.extend(offset.to_le_bytes());
        w.write_all(&info)?;
        head_len += info.len() as u64;
        offsets.push(offset);
        let numel: u64 = t.dims.iter().product();
        offset = (offset + t.ty.bytes(numel as usize)).next_multiple_of(ALIGNMENT);
    }
    pad_to(&mut w, head_len)?;
    let mut written = head_len.next_multiple_of(ALIGNMENT);
    let data_start = written;
    for (t, &off) in plan.iter().zip(&offsets) {
        pad_to(&mut w, written - data_start)?;
        written = data_start + off;
        let values = match &t.source {
            Source::Mxfp4 {
                blocks,
                scales,
                start,
                step,
            } => {
                let bytes = mxfp4_bytes(weights, blocks, scales, *start, *step)?;
                let numel = t.dims.iter().product::<u64>() as usize;
                if bytes.len() as u64 != GgmlType::Mxfp4.bytes(numel) {
                    bail!("{}: MXFP4 blocks do not fit its shape", t.name);
                }
                if t.ty == GgmlType::Mxfp4 {
                    w.write_all(&bytes)?;
                    written += bytes.len() as u64;
                    continue;
                }
                // A k-quant mix requantizes them, as llama-quantize does.
                ferrotune_models::gguf::dequantize_mxfp4(&bytes)
            }
            Source::Values(v) => v.clone(),
            Source::Stacked(parts) => {
                let mut values = Vec::new();
                for (file, name) in parts {
                    values.extend(weights.values(*file, name)?);
                }
                values
            }
            Source::Gather { file, name, index } => {
                let values = weights.values(*file, name)?;
                index.iter().map(|&i| values[i]).collect()
            }
            Source::Mapped {
                file,
                name,
                index,
                map,
            } => {
                let values = weights.values(*file, name)?;
                index.iter().map(|&i| map(values[i])).collect()
            }
            Source::Hf {
                file,
                name,
                rows,
                plus_one,
            } => {
                let mut values = weights.values(*file, name)?;
                if *plus_one {
                    values.iter_mut().for_each(|v| *v += 1.0);
                }
                match rows {
                    Some(order) => {
                        // A row holds the planned tensor's innermost dimension (1 for a vector).
                        let width = if t.dims.len() >= 2 {
                            t.dims[0] as usize
                        } else {
                            1
                        };
                        order
                            .iter()
                            .flat_map(|&r| values[r * width..(r + 1) * width].iter().copied())
                            .collect()
                    }
                    None => values,
                }
            }
        };
        let bytes = encode(&values, t.ty);
        w.write_all(&bytes)?;
        written += bytes.len() as u64;
    }
    w.flush()?;
    drop(w);
    Ok(written)
}

/// The MXFP4 blocks of rows `start, start + step, ...` of every expert of OpenAI's `blocks` (u8
/// `[experts, rows, groups, 16]`) and `scales` (u8 `[experts, rows, groups]`), as llama.cpp's
/// converter repacks them (`repack_mxfp4`): per group its scale byte, then its nibbles in ggml's
/// order.
fn mxfp4_bytes(
    weights: &Weights,
    blocks: &(usize, String),
    scales: &(usize, String),
    start: usize,
    step: usize,
) -> Result<Vec<u8>> {
    let (b, b_shape) = weights.bytes(blocks.0, &blocks.1)?;
    let (s, s_shape) = weights.bytes(scales.0, &scales.1)?;
    let [e, rows, groups, 16] = b_shape[..] else {
        bail!(
            "{}: shape {b_shape:?}, not [experts, rows, groups, 16]",
            blocks.1
        );
    };
    if s_shape != [e, rows, groups] || step == 0 {
        bail!("{}: shape {s_shape:?} does not fit {b_shape:?}", scales.1);
    }
    let mut out = Vec::with_capacity(e * rows.div_ceil(step) * groups * 17);
    for x in 0..e {
        for r in (start..rows).step_by(step) {
            for g in 0..groups {
                let i = (x * rows + r) * groups + g;
                let group: &[u8; 16] = b[i * 16..i * 16 + 16].try_into()?;
                out.extend(ferrotune_models::gguf::mxfp4_block_from_openai(s[i], group));
            }
        }
    }
    Ok(out)
}

/// Zero bytes up to the next multiple of the alignment after `len` bytes.
pub(super) fn pad_to(w: &mut impl Write, len: u64) -> Result<()> {
    let pad = len.next_multiple_of(ALIGNMENT) - len;
    w.write_all(&vec![0u8; pad as usize])?;
    Ok(())
}

/// The checkpoint's tensors as the export reads them.
pub(super) enum Weights<'a> {
    /// Memory-mapped safetensors files: a tensor's bytes are read when it is written, so the
    /// checkpoint is never held in memory.
    Mapped(Vec<SafeTensors<'a>>),
    /// PyTorch pickles or Meta's file under HF names, in their stored types: read whole, as a
    /// pickle's tensors are not laid out to be mapped one by one.
    Loaded(BTreeMap<String, Tensor>),
}

impl Weights<'_> {
    /// Every tensor as (file index, stored name, shape), each file's in name order.
    pub(super) fn list(&self) -> Vec<(usize, String, Vec<usize>)> {
        match self {
            Weights::Mapped(files) => files
                .iter()
                .enumerate()
                .flat_map(|(file, st)| {
                    let mut named: Vec<_> = st
                        .tensors()
                        .into_iter()
                        .map(|(name, view)| (file, name, view.shape().to_vec()))
                        .collect();
                    named.sort();
                    named
                })
                .collect(),
            Weights::Loaded(tensors) => tensors
                .iter()
                .map(|(name, t)| (0, name.clone(), t.dims().to_vec()))
                .collect(),
        }
    }

    /// The type of the first matrix stored.
    pub(super) fn first_matrix_dtype(&self) -> Option<Dtype> {
        match self {
            Weights::Mapped(files) => files
                .iter()
                .flat_map(|st| st.tensors())
                .find(|(_, v)| v.shape().len() >= 2)
                .map(|(_, v)| v.dtype()),
            Weights::Loaded(tensors) => {
                tensors
                    .values()
                    .find(|t| t.rank() >= 2)
                    .map(|t| match t.dtype() {
                        DType::BF16 => Dtype::BF16,
                        DType::F16 => Dtype::F16,
                        _ => Dtype::F32,
                    })
            }
        }
    }

    /// Whether a tensor is stored in f16 (llama.cpp's converter computes on f16 tensors in f16,
    /// on every other type in f32).
    pub(super) fn is_f16(&self, file: usize, name: &str) -> bool {
        match self {
            Weights::Mapped(files) => files[file]
                .tensor(name)
                .is_ok_and(|v| v.dtype() == Dtype::F16),
            Weights::Loaded(tensors) => tensors.get(name).is_some_and(|t| t.dtype() == DType::F16),
        }
    }

    /// One U8 tensor's bytes and shape (MXFP4 blocks and scales).
    pub(super) fn bytes(&self, file: usize, name: &str) -> Result<(Vec<u8>, Vec<usize>)> {
        match self {
            Weights::Mapped(files) => {
                let view = files[file].tensor(name)?;
                if view.dtype() != Dtype::U8 {
                    bail!("{name}: {:?}, not U8 MXFP4 bytes", view.dtype());
                }
                Ok((view.data().to_vec(), view.shape().to_vec()))
            }
            Weights::Loaded(tensors) => {
                let t = &tensors[name];
                if t.dtype() != DType::U8 {
                    bail!("{name}: {:?}, not U8 MXFP4 bytes", t.dtype());
                }
                Ok((t.flatten_all()?.to_vec1()?, t.dims().to_vec()))
            }
        }
    }

    /// One tensor's values as f32.
    pub(super) fn values(&self, file: usize, name: &str) -> Result<Vec<f32>> {
        match self {
            Weights::Mapped(files) => {
                let view = files[file].tensor(name)?;
                to_f32(view.dtype(), view.data())
                    .with_context(|| format!("{name}: {:?} weights", view.dtype()))
            }
            Weights::Loaded(tensors) => {
                let t = &tensors[name];
                if !t.dtype().is_float() {
                    bail!("{name}: {:?} weights cannot be exported", t.dtype());
                }
                Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?)
            }
        }
    }
}

/// A safetensors tensor's values as f32.
pub(super) fn to_f32(dtype: Dtype, data: &[u8]) -> Result<Vec<f32>> {
    Ok(match dtype {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => bail!("weights of type {other:?} cannot be exported"),
    })
}

/// Values in a GGML type's bytes.
pub(super) fn encode(values: &[f32], ty: GgmlType) -> Vec<u8> {
    match ty {
        GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::Bf16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::Q8_0 => quantize_q8_0(values),
        GgmlType::Quant(k) => quantize(values, k),
        GgmlType::Mxfp4 => ferrotune_models::gguf::quantize_mxfp4(values),
    }
}

/// Q8_0 as gguf-py's `quants.quantize` writes it: per block of 32 values the scale
/// `d = max|x| / 127` (stored as f16) and `round(x / d)` rounded half away from zero, computed
/// with the f32 scale.
pub fn quantize_q8_0(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() / Q8_0_BLOCK * (2 + Q8_0_BLOCK));
    for block in values.chunks_exact(Q8_0_BLOCK) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        out.extend(f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|&x| {
            let q = x * id;
            (q.signum() * (q.abs() + 0.5).floor()) as i8 as u8
        }));
    }
    out
}

/// GGUF key/value metadata, serialised as it is added.
#[derive(Default)]
pub(super) struct Metadata {
    pub(super) bytes: Vec<u8>,
    pub(super) count: usize,
}

/// GGUF's value types.
pub(super) const T_UINT32: u32 = 4;
pub(super) const T_INT32: u32 = 5;
pub(super) const T_FLOAT32: u32 = 6;
pub(super) const T_BOOL: u32 = 7;
pub(super) const T_STRING: u32 = 8;
pub(super) const T_ARRAY: u32 = 9;

pub(super) fn put_string(buf: &mut Vec<u8>, s: &str) {
    buf.extend((s.len() as u64).to_le_bytes());
    buf.extend(s.as_bytes());
}

impl Metadata {
    pub(super) fn key(&mut self, key: &str, ty: u32) {
        put_string(&mut self.bytes, key);
        self.bytes.extend(ty.to_le_bytes());
        self.count += 1;
    }

    pub(super) fn u32(&mut self, key: &str, v: u32) {
        self.key(key, T_UINT32);
        self.bytes.extend(v.to_le_bytes());
    }

    pub(super) fn f32(&mut self, key: &str, v: f32) {
        self.key(key, T_FLOAT32);
        self.bytes.extend(v.to_le_bytes());
    }

    pub(super) fn bool(&mut self, key: &str, v: bool) {
        self.key(key, T_BOOL);
        self.bytes.push(u8::from(v));
    }

    pub(super) fn string(&mut self, key: &str, v: &str) {
        self.key(key, T_STRING);
        put_string(&mut self.bytes, v);
    }

    /// An array: its element type, its length, then each element as `put` writes it.
    pub(super) fn array<T>(
        &mut self,
        key: &str,
        elem: u32,
        v: &[T],
        put: impl Fn(&mut Vec<u8>, &T),
    ) {
        self.key(key, T_ARRAY);
        self.bytes.extend(elem.to_le_bytes());
        self.bytes.extend((v.len() as u64).to_le_bytes());
        for x in v {
            put(&mut self.bytes, x);
        }
    }

    pub(super) fn strings(&mut self, key: &str, v: &[String]) {
        self.array(key, T_STRING, v, |b, s| put_string(b, s));
    }

    pub(super) fn f32s(&mut self, key: &str, v: &[f32]) {
        self.array(key, T_FLOAT32, v, |b, x| b.extend(x.to_le_bytes()));
    }

    pub(super) fn bools(&mut self, key: &str, v: &[bool]) {
        self.array(key, T_BOOL, v, |b, x| b.push(u8::from(*x)));
    }

    pub(super) fn i32s(&mut self, key: &str, v: &[i32]) {
        self.array(key, T_INT32, v, |b, x| b.extend(x.to_le_bytes()));
    }
}
