//! GGML type 39, MXFP4, as llama.cpp's converter writes gpt-oss's experts: blocks of 32 values,
//! each one E8M0 scale byte then 16 bytes of nibbles (byte `j`: value `j` low, value `j + 16`
//! high), a value being `kvalues_mxfp4[nibble] · ggml_e8m0_to_fp32_half(scale)` (ggml's doubled
//! e2m1 table times half the power of two `2^(scale − 127)`; `ggml-common.h`, `ggml-impl.h`).
//!
//! candle's GGUF header reader knows no type 39, so the header is walked here first: the type
//! fields of MXFP4 tensors are shown to candle as F32 (its reader only parses the header), and
//! those tensors' bytes are read and dequantized here.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};

/// MXFP4's GGML type id.
pub const GGML_TYPE_MXFP4: u32 = 39;

/// Values per MXFP4 block.
pub const MXFP4_BLOCK: usize = 32;

/// Bytes per MXFP4 block: the scale and 16 bytes of nibbles.
pub const MXFP4_BLOCK_BYTES: usize = 17;

/// ggml's `kvalues_mxfp4`: e2m1 values, doubled.
const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// ggml's `ggml_e8m0_to_fp32_half`: `2^(x − 128)`, subnormal for `x < 2`.
fn e8m0_to_fp32_half(x: u8) -> f32 {
    let bits = if x < 2 {
        0x0020_0000u32 << x
    } else {
        (u32::from(x) - 1) << 23
    };
    f32::from_bits(bits)
}

/// ggml's `dequantize_row_mxfp4` of whole blocks (`bytes.len()` a multiple of 17): 32 values a
/// block.
pub fn dequantize_mxfp4(bytes: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(bytes.len() / MXFP4_BLOCK_BYTES * MXFP4_BLOCK);
    for block in bytes.chunks_exact(MXFP4_BLOCK_BYTES) {
        let d = e8m0_to_fp32_half(block[0]);
        let qs = &block[1..];
        out.extend(
            qs.iter()
                .map(|&q| f32::from(KVALUES[(q & 0x0F) as usize]) * d),
        );
        out.extend(
            qs.iter()
                .map(|&q| f32::from(KVALUES[(q >> 4) as usize]) * d),
        );
    }
    out
}

/// ggml's `quantize_row_mxfp4_ref` of whole blocks of 32 (`values.len()` a multiple of 32): each
/// block's scale `floor(log2(max |x|)) − 2 + 127` (0 for an all-zero block), each value the
/// first nearest of `kvalues_mxfp4 · ggml_e8m0_to_fp32_half(scale)`; values `j` and `j + 16` share
/// byte `j`. 17 bytes a block.
pub fn quantize_mxfp4(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() / MXFP4_BLOCK * MXFP4_BLOCK_BYTES);
    for block in values.chunks_exact(MXFP4_BLOCK) {
        let amax = block
            .iter()
            .fold(0f32, |m, v| if m < v.abs() { v.abs() } else { m });
        let e = if amax > 0.0 {
            (amax.log2().floor() - 2.0 + 127.0) as u8
        } else {
            0
        };
        let d = e8m0_to_fp32_half(e);
        let best = |x: f32| -> u8 {
            let mut best = (0u8, (f32::from(KVALUES[0]) * d - x).abs());
            for (i, &k) in KVALUES.iter().enumerate().skip(1) {
                let err = (f32::from(k) * d - x).abs();
                if err < best.1 {
                    best = (i as u8, err);
                }
            }
            best.0
        };
        out.push(e);
        out.extend((0..16).map(|j| best(block[j]) | (best(block[j + 16]) << 4)));
    }
    out
}

/// One MXFP4 block from OpenAI's checkpoint layout (as llama.cpp's converter repacks it): the
/// scale byte (the same E8M0 exponent) and the 16 bytes of a `*_blocks` group, which hold values
/// `2i` (low nibble) and `2i + 1` (high nibble) in byte `i`, rearranged to ggml's order.
pub fn mxfp4_block_from_openai(scale: u8, group: &[u8; 16]) -> [u8; MXFP4_BLOCK_BYTES] {
    let nibble = |v: usize| (group[v / 2] >> (4 * (v % 2))) & 0x0F;
    let mut out = [0u8; MXFP4_BLOCK_BYTES];
    out[0] = scale;
    for j in 0..16 {
        out[1 + j] = nibble(j) | (nibble(j + 16) << 4);
    }
    out
}

/// A GGUF header's tensors of type MXFP4: their names, and where each one's type field lies in
/// the file. `None` when the header cannot be walked (candle's reader then says why).
pub(super) fn mxfp4_tensors(r: &mut BufReader<File>) -> Option<(HashSet<String>, Vec<u64>)> {
    type R = BufReader<File>;
    fn u32_of(r: &mut impl Read) -> Option<u32> {
        let mut b = [0u8; 4];
        r.read_exact(&mut b).ok()?;
        Some(u32::from_le_bytes(b))
    }
    fn u64_of(r: &mut impl Read) -> Option<u64> {
        let mut b = [0u8; 8];
        r.read_exact(&mut b).ok()?;
        Some(u64::from_le_bytes(b))
    }
    fn skip(r: &mut R, bytes: u64) -> Option<()> {
        r.seek_relative(i64::try_from(bytes).ok()?).ok()
    }
    // GGUF value types 0..=12; 8 is a string, 9 an array (element type, count, elements).
    fn skip_value(r: &mut R, ty: u32, depth: u32) -> Option<()> {
        const SIZES: [u64; 13] = [1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8];
        match ty {
            8 => {
                let len = u64_of(r)?;
                skip(r, len)
            }
            9 if depth < 4 => {
                let (elem, count) = (u32_of(r)?, u64_of(r)?);
                match SIZES.get(elem as usize)? {
                    0 => (0..count).try_for_each(|_| skip_value(r, elem, depth + 1)),
                    size => skip(r, count.checked_mul(*size)?),
                }
            }
            9 => None,
            _ => skip(r, *SIZES.get(ty as usize)?),
        }
    }
    r.seek(SeekFrom::Start(8)).ok()?;
    let (tensors, keys) = (u64_of(r)?, u64_of(r)?);
    for _ in 0..keys {
        let len = u64_of(r)?;
        skip(r, len)?;
        let ty = u32_of(r)?;
        skip_value(r, ty, 0)?;
    }
    let (mut names, mut fields) = (HashSet::new(), Vec::new());
    for _ in 0..tensors {
        // Bounded before anything is read into memory: the header is not checked yet.
        let len = u64_of(r)?;
        if len > 1 << 16 {
            return None;
        }
        let mut name = Vec::new();
        r.by_ref().take(len).read_to_end(&mut name).ok()?;
        let dims = u32_of(r)?;
        if dims > 8 {
            return None;
        }
        skip(r, 8 * u64::from(dims))?;
        let at = r.stream_position().ok()?;
        if u32_of(r)? == GGML_TYPE_MXFP4 {
            // As candle reads a name: lossy UTF-8, trailing NULs dropped.
            let name = String::from_utf8_lossy(&name);
            names.insert(name.trim_end_matches('\0').to_string());
            fields.push(at);
        }
        skip(r, 8)?;
    }
    Some((names, fields))
}

/// A reader showing candle's header parser the file with each MXFP4 type field (at `fields`)
/// read as F32 (type 0): candle parses the header only; the MXFP4 tensors are read here.
pub(super) struct AsF32<'a, R> {
    pub(super) inner: &'a mut R,
    pub(super) fields: &'a [u64],
}

impl<R: Read + Seek> Read for AsF32<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let start = self.inner.stream_position()?;
        let n = self.inner.read(buf)?;
        let end = start + n as u64;
        for &field in self.fields {
            for k in 0..4u64 {
                let at = field + k;
                if at >= start && at < end {
                    buf[(at - start) as usize] = 0;
                }
            }
        }
        Ok(n)
    }
}

impl<R: Seek> Seek for AsF32<'_, R> {
    fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
        self.inner.seek(pos)
    }
}
