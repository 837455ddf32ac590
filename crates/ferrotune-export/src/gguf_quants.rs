//! llama.cpp's block quantizations for GGUF export, bit for bit as its reference quantizers
//! (`quantize_row_*_ref` in ggml, what `llama-quantize` runs without an importance matrix):
//! the legacy blocks of 32 Q4_0, Q4_1, Q5_0, Q5_1 (also the fallbacks for rows that are not whole
//! 256-value superblocks) and the k-quants Q4_K, Q5_K, Q6_K the k-quant mixes are made of.
//!
//! Written here because no Rust crate quantizes to these formats (candle dequantizes them, and
//! its quantizers are not llama.cpp's reference ones). Every operation is f32 in the reference's
//! order, so the bytes match; the tests compare them with ggml's own output.

use half::f16;

/// Values per k-quant superblock.
pub const QK_K: usize = 256;
/// Values per Q5_0 / Q5_1 block.
pub const QK5: usize = 32;
/// Scales this small count as zero (ggml's `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// Round to nearest, ties to even, through the float adder (ggml's `nearest_int`: valid for
/// `|x| < 2^22`, which every caller guarantees).
fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// f32 → f16 → f32, as a scale is stored and read back.
fn f16_round(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// The bytes of one block type per `values` (a multiple of the block size). Blocks are
/// independent, so runs of them are quantized on all cores; the bytes do not depend on it.
pub fn quantize(values: &[f32], kind: QuantKind) -> Vec<u8> {
    use rayon::prelude::*;
    let (block, bytes) = kind.block();
    debug_assert_eq!(values.len() % block, 0);
    // 64 superblocks (16k values) per task: enough work to outweigh the scheduling.
    let run = block * 64;
    let parts: Vec<Vec<u8>> = values
        .par_chunks(run)
        .map(|part| {
            let mut out = Vec::with_capacity(part.len() / block * bytes);
            for chunk in part.chunks_exact(block) {
                match kind {
                    QuantKind::Q4_0 => q4_0_block(chunk, &mut out),
                    QuantKind::Q4_1 => q4_1_block(chunk, &mut out),
                    QuantKind::Q5_0 => q5_0_block(chunk, &mut out),
                    QuantKind::Q5_1 => q5_1_block(chunk, &mut out),
                    QuantKind::Q4K => q4k_block(chunk, &mut out),
                    QuantKind::Q5K => q5k_block(chunk, &mut out),
                    QuantKind::Q6K => q6k_block(chunk, &mut out),
                }
            }
            out
        })
        .collect();
    parts.concat()
}

/// The block formats implemented here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantKind {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q4K,
    Q5K,
    Q6K,
}

impl QuantKind {
    /// (values, bytes) per block.
    pub fn block(self) -> (usize, usize) {
        match self {
            QuantKind::Q4_0 => (QK5, 18),
            QuantKind::Q4_1 => (QK5, 20),
            QuantKind::Q5_0 => (QK5, 22),
            QuantKind::Q5_1 => (QK5, 24),
            QuantKind::Q4K => (QK_K, 144),
            QuantKind::Q5K => (QK_K, 176),
            QuantKind::Q6K => (QK_K, 210),
        }
    }

    /// GGML's type id.
    pub fn ggml_id(self) -> u32 {
        match self {
            QuantKind::Q4_0 => 2,
            QuantKind::Q4_1 => 3,
            QuantKind::Q5_0 => 6,
            QuantKind::Q5_1 => 7,
            QuantKind::Q4K => 12,
            QuantKind::Q5K => 13,
            QuantKind::Q6K => 14,
        }
    }
}

/// The value of largest magnitude (the first of equals), as the reference blocks scan for it.
fn largest_magnitude(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// The minimum and maximum, as the reference blocks with an offset scan for them.
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        min = if v < min { v } else { min };
        max = if v > max { v } else { max };
    }
    (min, max)
}

/// Writes a block's scale `d` (f16) and returns its inverse (0 for a zero scale).
fn scale_header(d: f32, out: &mut Vec<u8>) -> f32 {
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16::from_f32(d).to_le_bytes());
    id
}

/// Writes an offset block's scale `(max − min) / levels` and offset `min` (f16 each); returns
/// `(min, 1 / scale)`.
fn offset_header(x: &[f32], levels: f32, out: &mut Vec<u8>) -> (f32, f32) {
    let (min, max) = min_max(x);
    let id = scale_header((max - min) / levels, out);
    out.extend(f16::from_f32(min).to_le_bytes());
    (min, id)
}

/// Packs the 4-bit codes `q(v)` of a block's values, elements `j` and `j + 16` in one byte.
fn pack_q4(x: &[f32], out: &mut Vec<u8>, q: impl Fn(f32) -> u8) {
    for j in 0..QK5 / 2 {
        let (x0, x1) = (q(x[j]), q(x[j + QK5 / 2]));
        out.push(x0 | (x1 << 4));
    }
}

/// Packs the 5-bit codes `q(v)` of a block's values: the fifth bits (`qh`, 32 bits), then the low
/// nibbles, elements `j` and `j + 16` in one byte.
fn pack_q5(x: &[f32], out: &mut Vec<u8>, q: impl Fn(f32) -> u8) {
    let mut qh = 0u32;
    let mut qs = [0u8; QK5 / 2];
    for j in 0..QK5 / 2 {
        let (x0, x1) = (q(x[j]), q(x[j + QK5 / 2]));
        qs[j] = (x0 & 0x0f) | ((x1 & 0x0f) << 4);
        qh |= (((x0 & 0x10) >> 4) as u32) << j;
        qh |= (((x1 & 0x10) >> 4) as u32) << (j + QK5 / 2);
    }
    out.extend(qh.to_le_bytes());
    out.extend(qs);
}

/// Q4_0: `d = max / -8` from the value of largest magnitude, 4-bit codes `x / d + 8`.
fn q4_0_block(x: &[f32], out: &mut Vec<u8>) {
    let id = scale_header(largest_magnitude(x) / -8.0, out);
    pack_q4(x, out, |v| ((v * id + 8.5) as i8).min(15) as u8);
}

/// Q4_1: scale `(max − min) / 15` and offset `min`, 4-bit codes `(x − min) / d`.
fn q4_1_block(x: &[f32], out: &mut Vec<u8>) {
    let (min, id) = offset_header(x, 15.0, out);
    pack_q4(x, out, |v| (((v - min) * id + 0.5) as i8).min(15) as u8);
}

/// Q5_0: `d = max / -16` from the value of largest magnitude, 5-bit codes `x / d + 16`.
fn q5_0_block(x: &[f32], out: &mut Vec<u8>) {
    let id = scale_header(largest_magnitude(x) / -16.0, out);
    pack_q5(x, out, |v| ((v * id + 16.5) as i8).min(31) as u8);
}

/// Q5_1: scale `(max − min) / 31` and offset `min`, 5-bit codes `(x − min) / d`.
fn q5_1_block(x: &[f32], out: &mut Vec<u8>) {
    let (min, id) = offset_header(x, 31.0, out);
    pack_q5(x, out, |v| ((v - min) * id + 0.5) as u8);
}

/// ggml's `make_qkx2_quants`: codes `0..=nmax` with a scale and a (non-positive) minimum for one
/// group, fitted by weighted least squares over a sweep of candidate scales. Returns
/// `(scale, -min)` and leaves the codes in `codes`.
#[allow(clippy::too_many_arguments)]
fn fit_scale_min(
    x: &[f32],
    weights: &[f32],
    nmax: i32,
    codes: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        codes.iter_mut().for_each(|c| *c = 0);
        return (0.0, -min);
    }
    let nmax_f = nmax as f32;
    let mut iscale = nmax_f / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        codes[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    let mut aux = vec![0u8; n];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax_f) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * aux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * (diff * diff);
            }
            if cur_error < best_error {
                codes.copy_from_slice(&aux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Packs the 6-bit scale and minimum codes of a Q4_K / Q5_K superblock's 8 groups into 12 bytes.
fn pack_scales_k4(ls: &[u8; 8], lm: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            s[j] = ls[j];
            s[j + 4] = lm[j];
        } else {
            s[j + 4] = (ls[j] & 0xf) | ((lm[j] & 0xf) << 4);
            s[j - 4] |= (ls[j] >> 4) << 6;
            s[j] |= (lm[j] >> 4) << 6;
        }
    }
    s
}

/// Group `j`'s (scale, min) codes back from the packed 12 bytes (ggml's `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The common part of Q4_K and Q5_K: 8 groups of 32 with a fitted scale and minimum each, both
/// quantized to 6 bits against the superblock's f16 `d` and `dmin`, then every value re-coded
/// against the stored scales. Returns `(d, dmin, packed scales, codes)`.
fn k_quant_groups(x: &[f32], nmax: i32, rmin: f32, nstep: i32) -> (f16, f16, [u8; 12], [u8; QK_K]) {
    let mut codes = [0u8; QK_K];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    let mut weights = [0f32; 32];
    for j in 0..8 {
        let group = &x[32 * j..32 * (j + 1)];
        let sum_x2 = group.iter().fold(0f32, |s, v| s + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, v) in weights.iter_mut().zip(group) {
            *w = av_x + v.abs();
        }
        let (scale, min) = fit_scale_min(
            group,
            &weights,
            nmax,
            &mut codes[32 * j..32 * (j + 1)],
            rmin,
            0.1,
            nstep,
        );
        scales[j] = scale;
        mins[j] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let (mut ls, mut lm) = ([0u8; 8], [0u8; 8]);
    for j in 0..8 {
        ls[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        lm[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
    }
    let packed = pack_scales_k4(&ls, &lm);
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &packed);
        let dj = d.to_f32() * sc as f32;
        if dj == 0.0 {
            continue;
        }
        let dm = dmin.to_f32() * m as f32;
        for ii in 0..32 {
            let l = nearest_int((x[32 * j + ii] + dm) / dj).clamp(0, nmax);
            codes[32 * j + ii] = l as u8;
        }
    }
    (d, dmin, packed, codes)
}

/// Q4_K: `d`, `dmin`, 12 bytes of 6-bit group scales and minimums, 128 bytes of 4-bit codes.
fn q4k_block(x: &[f32], out: &mut Vec<u8>) {
    let (d, dmin, scales, codes) = k_quant_groups(x, 15, -1.0, 20);
    out.extend(d.to_le_bytes());
    out.extend(dmin.to_le_bytes());
    out.extend(scales);
    for j in (0..QK_K).step_by(64) {
        out.extend((0..32).map(|l| codes[j + l] | (codes[j + l + 32] << 4)));
    }
}

/// Q5_K: as Q4_K with 5-bit codes, the fifth bits in 32 bytes of `qh`.
fn q5k_block(x: &[f32], out: &mut Vec<u8>) {
    let (d, dmin, scales, codes) = k_quant_groups(x, 31, -0.5, 15);
    out.extend(d.to_le_bytes());
    out.extend(dmin.to_le_bytes());
    out.extend(scales);
    let mut qh = [0u8; QK_K / 8];
    let mut ql = [0u8; QK_K / 2];
    let (mut m1, mut m2) = (1u8, 2u8);
    for (chunk, n) in (0..QK_K).step_by(64).enumerate() {
        for j in 0..32 {
            let mut l1 = codes[n + j];
            if l1 > 15 {
                l1 -= 16;
                qh[j] |= m1;
            }
            let mut l2 = codes[n + j + 32];
            if l2 > 15 {
                l2 -= 16;
                qh[j] |= m2;
            }
            ql[chunk * 32 + j] = l1 | (l2 << 4);
        }
        m1 <<= 2;
        m2 <<= 2;
    }
    out.extend(qh);
    out.extend(ql);
}

/// ggml's `make_qx_quants` with `rmse_type` 1 and no importance weights: signed codes in
/// `-nmax..nmax` for one group of 16, the scale fitted with weights `x²` over a sweep of 19
/// candidate scales. Returns the scale; `codes` get `code + nmax`.
fn fit_signed_scale(x: &[f32], nmax: i32, codes: &mut [i8]) -> f32 {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        codes.iter_mut().for_each(|c| *c = 0);
        return 0.0;
    }
    let nmax_f = nmax as f32;
    let mut iscale = -nmax_f / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (i, &v) in x.iter().enumerate() {
        let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        codes[i] = (l + nmax) as i8;
        let w = v * v;
        let lf = l as f32;
        sumlx += w * v * lf;
        suml2 += w * lf * lf;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9i32..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax_f + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (i, &v) in x.iter().enumerate() {
                let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
                codes[i] = (l + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 signed 8-bit group scales, then `d`.
fn q6k_block(x: &[f32], out: &mut Vec<u8>) {
    let mut codes = [0i8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
    for ib in 0..QK_K / 16 {
        let scale = fit_signed_scale(
            &x[16 * ib..16 * (ib + 1)],
            32,
            &mut codes[16 * ib..16 * (ib + 1)],
        );
        scales[ib] = scale;
        if scale.abs() > max_abs_scale {
            max_abs_scale = scale.abs();
            max_scale = scale;
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        out.extend([0u8; 210]);
        return;
    }
    let iscale = -128.0 / max_scale;
    let d = f16::from_f32(1.0 / iscale);
    let mut group_scales = [0i8; QK_K / 16];
    for ib in 0..QK_K / 16 {
        group_scales[ib] = nearest_int(iscale * scales[ib]).min(127) as i8;
    }
    let mut l_codes = [0u8; QK_K];
    for j in 0..QK_K / 16 {
        let dj = f16_round(d.to_f32()) * group_scales[j] as f32;
        if dj == 0.0 {
            // The reference leaves the first pass's codes of an all-zero group in place.
            for ii in 0..16 {
                l_codes[16 * j + ii] = codes[16 * j + ii] as u8;
            }
            continue;
        }
        for ii in 0..16 {
            let l = nearest_int(x[16 * j + ii] / dj).clamp(-32, 31);
            l_codes[16 * j + ii] = (l + 32) as u8;
        }
    }
    let mut ql = [0u8; QK_K / 2];
    let mut qh = [0u8; QK_K / 4];
    for (half, j) in (0..QK_K).step_by(128).enumerate() {
        let (ql, qh) = (&mut ql[half * 64..], &mut qh[half * 32..]);
        for l in 0..32 {
            let q1 = l_codes[j + l] & 0xf;
            let q2 = l_codes[j + l + 32] & 0xf;
            let q3 = l_codes[j + l + 64] & 0xf;
            let q4 = l_codes[j + l + 96] & 0xf;
            ql[l] = q1 | (q3 << 4);
            ql[l + 32] = q2 | (q4 << 4);
            qh[l] = (l_codes[j + l] >> 4)
                | ((l_codes[j + l + 32] >> 4) << 2)
                | ((l_codes[j + l + 64] >> 4) << 4)
                | ((l_codes[j + l + 96] >> 4) << 6);
        }
    }
    out.extend(ql);
    out.extend(qh);
    out.extend(group_scales.iter().map(|&s| s as u8));
    out.extend(d.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(-1.5), -2);
        assert_eq!(nearest_int(-0.4), 0);
        assert_eq!(nearest_int(1000.7), 1001);
    }

    #[test]
    fn k4_scales_pack_and_unpack() {
        let ls = [1, 2, 63, 4, 17, 33, 63, 0];
        let lm = [5, 0, 7, 63, 48, 1, 62, 31];
        let packed = pack_scales_k4(&ls, &lm);
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &packed), (ls[j], lm[j]), "group {j}");
        }
    }
}
