//! Matrix products straight from ggml's quantized blocks, with f32 arithmetic.
//!
//! Decoding from a GGUF used to mean dequantizing every weight to f32 up front and streaming the
//! f32 copy through each matvec: a small model then spends its time waiting on memory. Here the
//! weights stay in their ggml blocks (Q4_1 reads 5 bits per weight instead of 32) and each block is
//! expanded into registers just before use.
//!
//! The numbers must stay those of dequantize-then-f32-matmul, because transformers dequantizes GGUF
//! weights to f32 and our logits are compared against its. So every weight is rebuilt bit-for-bit
//! as ggml/candle's `dequantize_row_*` builds it, and only the order of the f32 summation
//! `acc += w * x` differs from an f32 gemm (the freedom any two gemm implementations already take).
//!
//! # Why the SIMD kernels may fuse `q * d + m`
//!
//! Rebuilding a Q4_1 weight as `fma(q, d, m)` rounds once where ggml's `q * d + m` rounds twice,
//! which in general gives a different float. Not here: the product is *exact* in f32, so its
//! rounding is a no-op and both forms round the same exact value `q * d + m` once. `d` is an f16
//! (11 significant bits; even f16 subnormals widen to normal f32s) and `q` a 4-bit integer, so
//! `q * d` needs at most 15 of f32's 24 significant bits. Q4_K's `d1 * q - m1` is the same case
//! (`d1 = d * sc` with a 6-bit `sc` is itself exact, 17 bits, times 4 bits: 21). The other formats
//! have no addition to fuse. Fusing saves an instruction per 8 weights (~11% at m = 1), and the
//! test `fused_kernels_rebuild_weights_exactly` checks the rebuilt weights bit-for-bit.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{bail, DType, Device, Result, Storage, Tensor};
use rayon::prelude::*;

/// The block formats this module can read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q6K,
}

impl Kind {
    fn from_ggml(kind: GgmlDType) -> Option<Self> {
        match kind {
            GgmlDType::Q4_0 => Some(Self::Q4_0),
            GgmlDType::Q4_1 => Some(Self::Q4_1),
            GgmlDType::Q8_0 => Some(Self::Q8_0),
            GgmlDType::Q4K => Some(Self::Q4K),
            GgmlDType::Q6K => Some(Self::Q6K),
            _ => None,
        }
    }

    fn ggml(self) -> GgmlDType {
        match self {
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q4_1 => GgmlDType::Q4_1,
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q4K => GgmlDType::Q4K,
            Self::Q6K => GgmlDType::Q6K,
        }
    }

    /// Weights per block.
    fn block_elems(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 | Self::Q8_0 => 32,
            Self::Q4K | Self::Q6K => 256,
        }
    }

    /// Bytes per block (the sizes of ggml's `block_q*` structs).
    fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q6K => 210,
        }
    }
}

/// From this many activation rows on, the weights are expanded to f32 (a row-block at a time) and
/// the product goes to candle's f32 gemm: with enough rows sharing each weight, gemm's register
/// blocking beats re-expanding the blocks once per group of rows. Measured with
/// `examples/quant_bench.rs` on the 2-core AVX2 EPYC: the fused kernel still won every SmolLM2
/// shape at m = 32, lost the 1536x576 and 49152x576 ones at m = 48 (by 15-35%), and all but the
/// smallest at m = 64 and beyond.
const DENSE_MIN_ROWS: usize = 40;

/// Fewest multiply-adds worth a rayon task in the fused path (~10 us of one core's work).
const MIN_TASK_MACS: usize = 1 << 17;

/// Largest f32 scratch (in elements) the dense path expands at once: 4 Mi floats = 16 MiB, so the
/// 49152-row embedding matrix never exists in f32 as a whole.
const DENSE_CHUNK_ELEMS: usize = 4 << 20;

/// A weight matrix `[rows, cols]` (PyTorch layout: rows = out features) kept in a ggml block format.
#[derive(Clone)]
pub struct QuantizedMatrix {
    kind: Kind,
    rows: usize,
    cols: usize,
    /// Raw ggml blocks, row-major: stored row `r` is `bytes[r * row_bytes..(r + 1) * row_bytes]`.
    bytes: Vec<u8>,
    /// Output row `i` is stored row `order[i]`.
    order: Vec<u32>,
}

impl std::fmt::Debug for QuantizedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "QuantizedMatrix[{:?}; {}x{}]",
            self.kind, self.rows, self.cols
        )
    }
}

impl QuantizedMatrix {
    /// From raw ggml block bytes, row-major (each row = cols / block_size blocks).
    ///
    /// Errors (not panics) on an unsupported kind (anything but Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), on
    /// `cols` not a multiple of the block size, or on a byte length that doesn't match the shape.
    pub fn from_ggml_bytes(
        kind: GgmlDType,
        rows: usize,
        cols: usize,
        bytes: Vec<u8>,
    ) -> Result<Self> {
        let Some(k) = Kind::from_ggml(kind) else {
            bail!("QuantizedMatrix: unsupported ggml type {kind:?} (supported: Q4_0, Q4_1, Q8_0, Q4K, Q6K)")
        };
        if !cols.is_multiple_of(k.block_elems()) {
            bail!(
                "QuantizedMatrix: {cols} columns is not a multiple of the {kind:?} block size {}",
                k.block_elems()
            )
        }
        if rows > u32::MAX as usize {
            bail!("QuantizedMatrix: {rows} rows do not fit the u32 row order")
        }
        let expected = rows
            .checked_mul(cols / k.block_elems())
            .and_then(|n| n.checked_mul(k.block_bytes()));
        if expected != Some(bytes.len()) {
            bail!(
                "QuantizedMatrix: {} bytes given, a {rows}x{cols} {kind:?} matrix needs {expected:?}",
                bytes.len()
            )
        }
        Ok(Self {
            kind: k,
            rows,
            cols,
            bytes,
            order: (0..rows as u32).collect(),
        })
    }

    /// Convenience: from a candle `QTensor` of shape `(rows, cols)` (its raw bytes are copied).
    pub fn from_qtensor(q: &QTensor) -> Result<Self> {
        let (rows, cols) = q.shape().dims2()?;
        let data = q.data()?;
        Self::from_ggml_bytes(q.dtype(), rows, cols, data.into_owned())
    }

    /// Output row `i` of every product is stored row `perm[i]` (used to undo llama.cpp's q/k row
    /// permutation without repacking the blocks).
    ///
    /// `perm` must be a permutation of `0..rows`. It replaces any earlier order (it indexes the
    /// stored rows, not the current output order).
    pub fn with_row_order(mut self, perm: Vec<u32>) -> Result<Self> {
        if perm.len() != self.rows {
            bail!(
                "QuantizedMatrix::with_row_order: {} indices for {} rows",
                perm.len(),
                self.rows
            )
        }
        let mut seen = vec![false; self.rows];
        for &p in &perm {
            let p = p as usize;
            if p >= self.rows || std::mem::replace(&mut seen[p], true) {
                bail!(
                    "QuantizedMatrix::with_row_order: not a permutation of 0..{} (index {p})",
                    self.rows
                )
            }
        }
        self.order = perm;
        Ok(self)
    }

    /// Number of rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The ggml block format the weights are kept in.
    pub fn ggml_dtype(&self) -> GgmlDType {
        self.kind.ggml()
    }

    /// Bytes of quantized weight data (what one full product streams from memory).
    pub fn storage_bytes(&self) -> usize {
        self.bytes.len()
    }

    fn row_bytes(&self) -> usize {
        self.cols / self.kind.block_elems() * self.kind.block_bytes()
    }

    fn stored_row(&self, out_row: usize) -> &[u8] {
        let rb = self.row_bytes();
        let r = self.order[out_row] as usize;
        &self.bytes[r * rb..(r + 1) * rb]
    }

    /// `x`: `[m, cols]` f32 (any leading dims flattened by the caller) → `[m, rows]` f32
    /// `= x @ dequantize().T`.
    ///
    /// On the CPU the weights are read in their quantized form; on another device this falls back
    /// to dequantize-then-matmul there.
    pub fn matmul(&self, x: &Tensor) -> Result<Tensor> {
        self.matmul_impl(x, simd_available())
    }

    /// [`Self::matmul`] restricted to the portable scalar kernel: what a CPU without AVX2+FMA runs.
    /// For tests and benchmarks of that path.
    #[doc(hidden)]
    pub fn matmul_portable(&self, x: &Tensor) -> Result<Tensor> {
        self.matmul_impl(x, false)
    }

    fn matmul_impl(&self, x: &Tensor, simd: bool) -> Result<Tensor> {
        let (m, k) = x.dims2()?;
        if k != self.cols {
            bail!(
                "QuantizedMatrix::matmul: x has {k} columns, the matrix {}x{}",
                self.rows,
                self.cols
            )
        }
        if x.dtype() != DType::F32 {
            bail!(
                "QuantizedMatrix::matmul: x must be f32, got {:?}",
                x.dtype()
            )
        }
        if !x.device().is_cpu() {
            return x.matmul(&self.dequantize(x.device())?.t()?);
        }
        if m == 0 || self.rows == 0 || self.cols == 0 {
            return Tensor::zeros((m, self.rows), DType::F32, x.device());
        }
        if m >= DENSE_MIN_ROWS {
            return self.matmul_dense(x, simd);
        }
        let x = x.contiguous()?;
        let (storage, layout) = x.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            bail!("QuantizedMatrix::matmul: expected CPU storage")
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("QuantizedMatrix::matmul: x is not contiguous")
        };
        let xs = &cpu.as_slice::<f32>()?[start..end];
        let out = self.fused(xs, m, simd);
        drop(storage);
        Tensor::from_vec(out, (m, self.rows), &Device::Cpu)
    }

    /// The fused path: returns `[m, rows]` row-major.
    fn fused(&self, xs: &[f32], m: usize, simd: bool) -> Vec<f32> {
        // Work is split over output rows; each task fills its rows of a transposed `[rows, m]`
        // buffer (a contiguous slice per task), transposed back at the end when m > 1.
        let mut out_t = vec![0f32; self.rows * m];
        let threads = rayon::current_num_threads().max(1);
        // A few tasks per thread so that an uneven split (or a busy core) balances out, but each
        // worth a fork-join: waking a worker costs microseconds, as much as a small matvec.
        let tasks = (self.rows * self.cols * m / MIN_TASK_MACS).clamp(1, threads * 4);
        if threads == 1 || tasks == 1 {
            self.fused_rows(0, &mut out_t, xs, m, simd);
        } else {
            let per_task = self.rows.div_ceil(tasks);
            out_t
                .par_chunks_mut(per_task * m)
                .enumerate()
                .for_each(|(t, chunk)| self.fused_rows(t * per_task, chunk, xs, m, simd));
        }
        if m == 1 {
            return out_t;
        }
        let mut out = vec![0f32; self.rows * m];
        for (r, vals) in out_t.chunks_exact(m).enumerate() {
            for (mi, v) in vals.iter().enumerate() {
                out[mi * self.rows + r] = *v;
            }
        }
        out
    }

    /// Output rows `first..first + out.len() / m` into `out` (`[n, m]`, row-major).
    fn fused_rows(&self, first: usize, out: &mut [f32], xs: &[f32], m: usize, simd: bool) {
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: `simd` is only true when `simd_available()` saw AVX2, FMA and F16C at runtime;
            // shapes were checked by `from_ggml_bytes` and `matmul_impl`.
            unsafe { avx2::fused_rows(self, first, out, xs, m) };
            return;
        }
        let _ = simd;
        let be = self.kind.block_elems();
        let mut buf = vec![0f32; be];
        let mut acc = vec![0f32; m];
        for (i, dst) in out.chunks_exact_mut(m).enumerate() {
            let row = self.stored_row(first + i);
            acc.fill(0.0);
            for (b, blk) in row.chunks_exact(self.kind.block_bytes()).enumerate() {
                dequantize_block(self.kind, blk, &mut buf);
                for (mi, a) in acc.iter_mut().enumerate() {
                    let x = &xs[mi * self.cols + b * be..][..be];
                    *a += buf.iter().zip(x).map(|(w, x)| w * x).sum::<f32>();
                }
            }
            dst.copy_from_slice(&acc);
        }
    }

    /// Many activation rows: expand row-blocks of the weights to f32 and use candle's gemm.
    fn matmul_dense(&self, x: &Tensor, simd: bool) -> Result<Tensor> {
        let chunk_rows = (DENSE_CHUNK_ELEMS / self.cols).clamp(1, self.rows);
        let mut parts = Vec::with_capacity(self.rows.div_ceil(chunk_rows));
        for start in (0..self.rows).step_by(chunk_rows) {
            let n = chunk_rows.min(self.rows - start);
            let w = self.dequantize_rows(start, n, simd);
            let w = Tensor::from_vec(w, (n, self.cols), &Device::Cpu)?;
            parts.push(x.matmul(&w.t()?)?);
        }
        if parts.len() == 1 {
            return Ok(parts.pop().expect("one part"));
        }
        Tensor::cat(&parts, 1)
    }

    /// Output rows `start..start + n` as f32, row-major (with the AVX2 kernels when `simd`).
    fn dequantize_rows(&self, start: usize, n: usize, simd: bool) -> Vec<f32> {
        let mut out = vec![0f32; n * self.cols];
        let be = self.kind.block_elems();
        let bb = self.kind.block_bytes();
        out.par_chunks_mut(self.cols)
            .with_min_len(16)
            .enumerate()
            .for_each(|(i, dst)| {
                let row = self.stored_row(start + i);
                #[cfg(target_arch = "x86_64")]
                if simd {
                    // SAFETY: `simd` means AVX2, FMA and F16C were detected; `row` holds whole
                    // blocks and `dst` their `cols` weights.
                    unsafe { avx2::dequantize_row(self.kind, row, dst) };
                    return;
                }
                let _ = simd;
                for (blk, y) in row.chunks_exact(bb).zip(dst.chunks_exact_mut(be)) {
                    dequantize_block(self.kind, blk, y);
                }
            });
        out
    }

    /// The f32 matrix `[rows, cols]` (in output order), bit-identical to candle's
    /// `QTensor::dequantize`.
    pub fn dequantize(&self, device: &Device) -> Result<Tensor> {
        let w = Tensor::from_vec(
            self.dequantize_rows(0, self.rows, simd_available()),
            (self.rows, self.cols),
            &Device::Cpu,
        )?;
        w.to_device(device)
    }
}

fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Q4_K's 6-bit (scale, min) pair `j` of 8 (candle's `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// One block to f32, with exactly the operations (and their order) of candle's `to_float`, which
/// are those of ggml's `dequantize_row_*`.
fn dequantize_block(kind: Kind, b: &[u8], y: &mut [f32]) {
    match kind {
        Kind::Q4_0 => {
            let d = f16_at(b, 0);
            let qs = &b[2..18];
            for j in 0..16 {
                let x0 = (qs[j] & 0x0F) as i16 - 8;
                let x1 = (qs[j] >> 4) as i16 - 8;
                y[j] = (x0 as f32) * d;
                y[j + 16] = (x1 as f32) * d;
            }
        }
        Kind::Q4_1 => {
            let d = f16_at(b, 0);
            let m = f16_at(b, 2);
            let qs = &b[4..20];
            for j in 0..16 {
                y[j] = ((qs[j] & 0x0F) as f32) * d + m;
                y[j + 16] = ((qs[j] >> 4) as f32) * d + m;
            }
        }
        Kind::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                y[j] = (b[2 + j] as i8) as f32 * d;
            }
        }
        Kind::Q4K => {
            let d = f16_at(b, 0);
            let min = f16_at(b, 2);
            let scales = &b[4..16];
            for g in 0..4 {
                let q = &b[16 + 32 * g..16 + 32 * g + 32];
                let (sc, m) = scale_min_k4(2 * g, scales);
                let d1 = d * sc as f32;
                let m1 = min * m as f32;
                let (sc, m) = scale_min_k4(2 * g + 1, scales);
                let d2 = d * sc as f32;
                let m2 = min * m as f32;
                let y = &mut y[64 * g..64 * g + 64];
                for (l, q) in q.iter().enumerate() {
                    y[l] = d1 * (q & 0xF) as f32 - m1;
                    y[l + 32] = d2 * (q >> 4) as f32 - m2;
                }
            }
        }
        Kind::Q6K => {
            let d = f16_at(b, 208);
            for half in 0..2 {
                let ql = &b[64 * half..];
                let qh = &b[128 + 32 * half..];
                let sc = &b[192 + 8 * half..];
                let y = &mut y[128 * half..];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                    y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The AVX2 kernels. Each block is expanded into 8-wide f32 vectors holding exactly the floats
    //! `dequantize_block` produces (see the module docs for why `fma(q, d, m)` is one of those
    //! ways), then multiplied into the activations with an FMA, the gemm accumulation.

    use super::{Kind, QuantizedMatrix};
    use std::arch::x86_64::*;

    /// Output rows per tile: a tile's weights (16 rows x 1536 cols of Q8_0 = 26 KB) stay in L1/L2
    /// while each group of activation rows is run over them, when m needs several groups.
    const TILE_ROWS: usize = 16;

    /// Most activation bytes a group of 8 rows may span (L1d is 32 KiB on the target cores).
    const GROUP8_MAX_X_BYTES: usize = 24 << 10;

    /// Where the expanded weight vectors of a block go.
    trait Sink {
        /// `w` holds the weights of elements `off..off + 8` of the current block.
        ///
        /// # Safety
        /// AVX2, FMA and F16C must be available; `off + 8` must not pass the block's end.
        unsafe fn put(&mut self, off: usize, w: __m256);
    }

    /// Multiply-accumulates into `A` independent accumulators per activation row, so that
    /// consecutive FMAs do not wait on each other's latency.
    struct Dot<const M: usize, const A: usize> {
        /// Each activation row, advanced to the current block's first column.
        x: [*const f32; M],
        acc: [[__m256; A]; M],
    }

    impl<const M: usize, const A: usize> Sink for Dot<M, A> {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn put(&mut self, off: usize, w: __m256) {
            let slot = (off / 8) % A;
            for mi in 0..M {
                // SAFETY: `self.x[mi]` points at the current block's columns of row `mi` and the
                // caller keeps `off + 8` within the block, hence within the row.
                let xv = unsafe { _mm256_loadu_ps(self.x[mi].add(off)) };
                self.acc[mi][slot] = _mm256_fmadd_ps(w, xv, self.acc[mi][slot]);
            }
        }
    }

    /// Widens the two f16s packed in `bits` (low half first) exactly, as `half::f16::to_f32` does,
    /// into lanes 0 and 1.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn f16x2_to_f32(bits: u32) -> __m128 {
        let v = _mm_cvtsi32_si128(bits as i32);
        let out: __m128;
        // The conversion is written as inline asm only to keep LLVM from seeing it: it otherwise
        // rewrites the convert-and-broadcast as a scalar f16 load (`vpinsrw`) merging into
        // whatever register is free, often a live accumulator, and that false dependency chains
        // successive blocks together (measured: the Q4_1 kernel ran at 60% speed).
        // SAFETY: `vcvtph2ps xmm, xmm` reads and writes registers only, and F16C is enabled in
        // this function.
        unsafe {
            std::arch::asm!(
                "vcvtph2ps {o}, {i}",
                i = in(xmm_reg) v,
                o = lateout(xmm_reg) out,
                options(pure, nomem, nostack, preserves_flags)
            );
        }
        out
    }

    /// The f16 at `p`, widened exactly into all 8 lanes.
    ///
    /// # Safety
    /// `p..p + 2` must be readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16_splat(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees two readable bytes; unaligned read.
        let bits = unsafe { p.cast::<u16>().read_unaligned() };
        _mm256_broadcastss_ps(f16x2_to_f32(bits as u32))
    }

    /// The f16 at `p`, widened exactly.
    ///
    /// # Safety
    /// `p..p + 2` must be readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16_at(p: *const u8) -> f32 {
        // SAFETY: the caller guarantees two readable bytes; unaligned read.
        let bits = unsafe { p.cast::<u16>().read_unaligned() };
        _mm_cvtss_f32(f16x2_to_f32(bits as u32))
    }

    /// 8 bytes at `p`, zero-extended to 8 i32 lanes.
    ///
    /// # Safety
    /// `p..p + 8` must be readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn u8x8(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 8 readable bytes; `_mm_loadl_epi64` reads exactly 8,
        // unaligned.
        _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(p.cast()) })
    }

    /// Expands one block at `b` into `sink`, 8 weights at a time.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available and `b` must point at a whole block of type `K`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block<const K: u8, S: Sink>(b: *const u8, sink: &mut S) {
        // SAFETY (whole body): every read is within the block's `block_bytes(K)` bytes, at the
        // offsets of ggml's block layout; every `put` offset is below `block_elems(K)`.
        unsafe {
            let nib = _mm256_set1_epi32(0x0F);
            match K {
                Q4_0 => {
                    let d = f16_splat(b);
                    let eight = _mm256_set1_epi32(8);
                    for h in 0..2 {
                        // Bytes 8h..8h+8: low nibbles are elements 8h.., high ones 16+8h...
                        let raw = u8x8(b.add(2 + 8 * h));
                        let lo = _mm256_sub_epi32(_mm256_and_si256(raw, nib), eight);
                        let hi = _mm256_sub_epi32(_mm256_srli_epi32(raw, 4), eight);
                        sink.put(8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(lo), d));
                        sink.put(16 + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(hi), d));
                    }
                }
                Q4_1 => {
                    // d and m are adjacent: one load and one conversion for both.
                    let dm = f16x2_to_f32(b.cast::<u32>().read_unaligned());
                    let d = _mm256_broadcastss_ps(dm);
                    let m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
                    for h in 0..2 {
                        let raw = u8x8(b.add(4 + 8 * h));
                        let lo = _mm256_cvtepi32_ps(_mm256_and_si256(raw, nib));
                        let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(raw, 4));
                        // ggml's `q * d + m`: fusing is exact because `q * d` is (module docs).
                        sink.put(8 * h, _mm256_fmadd_ps(lo, d, m));
                        sink.put(16 + 8 * h, _mm256_fmadd_ps(hi, d, m));
                    }
                }
                Q8_0 => {
                    let d = f16_splat(b);
                    for c in 0..4 {
                        let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(b.add(2 + 8 * c).cast()));
                        sink.put(8 * c, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
                    }
                }
                Q4K => {
                    let d = f16_at(b);
                    let min = f16_at(b.add(2));
                    let scales = std::slice::from_raw_parts(b.add(4), 12);
                    for g in 0..4 {
                        // Scalar f32 products, as candle forms `d1 = d * sc`, `m1 = min * m`.
                        let (sc, mn) = super::scale_min_k4(2 * g, scales);
                        let d1 = _mm256_set1_ps(d * sc as f32);
                        let m1 = _mm256_set1_ps(min * mn as f32);
                        let (sc, mn) = super::scale_min_k4(2 * g + 1, scales);
                        let d2 = _mm256_set1_ps(d * sc as f32);
                        let m2 = _mm256_set1_ps(min * mn as f32);
                        for c in 0..4 {
                            let raw = u8x8(b.add(16 + 32 * g + 8 * c));
                            let lo = _mm256_cvtepi32_ps(_mm256_and_si256(raw, nib));
                            let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(raw, 4));
                            // candle's `d1 * q - m1`, fused exactly as Q4_1's.
                            sink.put(64 * g + 8 * c, _mm256_fmsub_ps(d1, lo, m1));
                            sink.put(64 * g + 32 + 8 * c, _mm256_fmsub_ps(d2, hi, m2));
                        }
                    }
                }
                Q6K => {
                    let d = f16_at(b.add(208));
                    let mask = _mm256_set1_epi32(0x30);
                    let bias = _mm256_set1_epi32(32);
                    for half in 0..2 {
                        let ql = b.add(64 * half);
                        let qh = b.add(128 + 32 * half);
                        let sc = b.add(192 + 8 * half).cast::<i8>();
                        for l in (0..32).step_by(8) {
                            let is = l / 16;
                            let a = u8x8(ql.add(l));
                            let bb = u8x8(ql.add(l + 32));
                            let h = u8x8(qh.add(l));
                            // Bits 2k..2k+2 of qh become bits 4..6 of quant k.
                            let h1 = _mm256_and_si256(_mm256_slli_epi32(h, 4), mask);
                            let h2 = _mm256_and_si256(_mm256_slli_epi32(h, 2), mask);
                            let h3 = _mm256_and_si256(h, mask);
                            let h4 = _mm256_and_si256(_mm256_srli_epi32(h, 2), mask);
                            let q1 = _mm256_or_si256(_mm256_and_si256(a, nib), h1);
                            let q2 = _mm256_or_si256(_mm256_and_si256(bb, nib), h2);
                            let q3 = _mm256_or_si256(_mm256_srli_epi32(a, 4), h3);
                            let q4 = _mm256_or_si256(_mm256_srli_epi32(bb, 4), h4);
                            let base = 128 * half + l;
                            for (k, q) in [q1, q2, q3, q4].into_iter().enumerate() {
                                // candle: `d * sc as f32 * q as f32`, i.e. `(d * sc) * q`.
                                let ds = _mm256_set1_ps(d * *sc.add(is + 2 * k) as f32);
                                let qf = _mm256_cvtepi32_ps(_mm256_sub_epi32(q, bias));
                                sink.put(base + 32 * k, _mm256_mul_ps(ds, qf));
                            }
                        }
                    }
                }
                _ => unreachable!("unknown block kind {K}"),
            }
        }
    }

    const Q4_0: u8 = 0;
    const Q4_1: u8 = 1;
    const Q8_0: u8 = 2;
    const Q4K: u8 = 3;
    const Q6K: u8 = 4;

    /// Stores the expanded weights: dequantization to memory.
    struct Store {
        /// The current block's first weight.
        out: *mut f32,
    }

    impl Sink for Store {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn put(&mut self, off: usize, w: __m256) {
            // SAFETY: `self.out` points at a block's worth of floats and `off + 8` is within it.
            unsafe { _mm256_storeu_ps(self.out.add(off), w) }
        }
    }

    /// Monomorphised body of [`dequantize_row`].
    ///
    /// # Safety
    /// As [`dequantize_row`], with `K` the constant for `kind`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dequantize_row_k<const K: u8>(bb: usize, row: &[u8], dst: &mut [f32]) {
        let be = dst.len() / (row.len() / bb);
        for (b, y) in dst.chunks_exact_mut(be).enumerate() {
            let mut store = Store {
                out: y.as_mut_ptr(),
            };
            // SAFETY: block `b` of the row is whole (`row.len()` is a multiple of `bb`) and `y`
            // has room for its `be` weights.
            unsafe { block::<K, _>(row.as_ptr().add(b * bb), &mut store) };
        }
    }

    /// One stored row of `kind` blocks to f32, bit-identical to the scalar `dequantize_block`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; `row` must be whole blocks of `kind` and `dst` hold
    /// exactly their weights.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dequantize_row(kind: Kind, row: &[u8], dst: &mut [f32]) {
        let bb = kind.block_bytes();
        assert_eq!(row.len() % bb, 0);
        assert_eq!(dst.len(), row.len() / bb * kind.block_elems());
        if row.is_empty() {
            return;
        }
        // SAFETY: features guaranteed by the caller; shapes asserted above.
        unsafe {
            match kind {
                Kind::Q4_0 => dequantize_row_k::<Q4_0>(bb, row, dst),
                Kind::Q4_1 => dequantize_row_k::<Q4_1>(bb, row, dst),
                Kind::Q8_0 => dequantize_row_k::<Q8_0>(bb, row, dst),
                Kind::Q4K => dequantize_row_k::<Q4K>(bb, row, dst),
                Kind::Q6K => dequantize_row_k::<Q6K>(bb, row, dst),
            }
        }
    }

    /// Sum of the 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Rows `rows` (output indices) against activation rows `x0 .. x0 + M` (a `[M, cols]` block
    /// starting at `x`), each result `out[(i - first) * m + x0 + mi]`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; `x` must hold `M` rows of `q.cols` floats; `out` must
    /// hold the tile's rows at stride `m`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const K: u8, const M: usize, const A: usize>(
        q: &QuantizedMatrix,
        rows: std::ops::Range<usize>,
        first: usize,
        x: *const f32,
        out: &mut [f32],
        x0: usize,
        m: usize,
    ) {
        let be = q.kind.block_elems();
        let bb = q.kind.block_bytes();
        let nblocks = q.cols / be;
        for i in rows {
            let row = q.stored_row(i).as_ptr();
            let mut dot = Dot::<M, A> {
                x: std::array::from_fn(|mi| {
                    // SAFETY: row `mi` of the `M` activation rows starts `mi * cols` in.
                    unsafe { x.add(mi * q.cols) }
                }),
                acc: [[_mm256_setzero_ps(); A]; M],
            };
            for b in 0..nblocks {
                // SAFETY: block `b` of a row of `nblocks` blocks; the activation pointers advance
                // with it and cover that block's columns.
                unsafe {
                    block::<K, _>(row.add(b * bb), &mut dot);
                    for p in dot.x.iter_mut() {
                        *p = p.add(be);
                    }
                }
            }
            for (mi, acc) in dot.acc.iter().enumerate() {
                let mut s = acc[0];
                for a in &acc[1..] {
                    s = _mm256_add_ps(s, *a);
                }
                out[(i - first) * m + x0 + mi] = hsum(s);
            }
        }
    }

    /// Dispatches a tile on the number of activation rows `g` (1..=4 or 8).
    ///
    /// # Safety
    /// As [`tile`], with `x` holding `g` rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_dispatch<const K: u8>(
        q: &QuantizedMatrix,
        rows: std::ops::Range<usize>,
        first: usize,
        x: *const f32,
        out: &mut [f32],
        x0: usize,
        g: usize,
        m: usize,
    ) {
        // SAFETY: forwarded from the caller. M * A <= 8 accumulator registers, leaving 8 of the
        // 16 for the weights and constants; with few rows, several accumulators per row hide the
        // FMA latency, with 8 rows the rows themselves are independent chains.
        unsafe {
            match g {
                1 => tile::<K, 1, 4>(q, rows, first, x, out, x0, m),
                2 => tile::<K, 2, 4>(q, rows, first, x, out, x0, m),
                3 => tile::<K, 3, 2>(q, rows, first, x, out, x0, m),
                4 => tile::<K, 4, 2>(q, rows, first, x, out, x0, m),
                8 => tile::<K, 8, 1>(q, rows, first, x, out, x0, m),
                _ => unreachable!("activation group of {g} rows"),
            }
        }
    }

    /// The AVX2 counterpart of the scalar loop in `QuantizedMatrix::fused_rows`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; `xs` is `[m, q.cols]`; `out` is `[n, m]` with
    /// `first + n <= q.rows`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn fused_rows(
        q: &QuantizedMatrix,
        first: usize,
        out: &mut [f32],
        xs: &[f32],
        m: usize,
    ) {
        assert_eq!(xs.len(), m * q.cols);
        assert_eq!(out.len() % m, 0);
        let last = first + out.len() / m;
        assert!(last <= q.rows);
        for t0 in (first..last).step_by(TILE_ROWS) {
            let rows = t0..(t0 + TILE_ROWS).min(last);
            // Groups of 8 activation rows share each expanded weight vector the most, but only
            // pay while those rows stay in L1 (measured: at 1536 columns, 48 KB of activations,
            // groups of 8 were 20% slower than 4, at 576 columns 20% faster). The rest goes in
            // groups of up to 4.
            let mut x0 = 0;
            while x0 < m {
                let g = if m - x0 >= 8 && 8 * q.cols * 4 <= GROUP8_MAX_X_BYTES {
                    8
                } else {
                    (m - x0).min(4)
                };
                let x = xs[x0 * q.cols..].as_ptr();
                // SAFETY: features guaranteed by the caller; `x` has `g` full rows (asserted
                // above), `out` covers `rows` at stride `m`.
                unsafe {
                    let r = rows.clone();
                    match q.kind {
                        Kind::Q4_0 => tile_dispatch::<Q4_0>(q, r, first, x, out, x0, g, m),
                        Kind::Q4_1 => tile_dispatch::<Q4_1>(q, r, first, x, out, x0, g, m),
                        Kind::Q8_0 => tile_dispatch::<Q8_0>(q, r, first, x, out, x0, g, m),
                        Kind::Q4K => tile_dispatch::<Q4K>(q, r, first, x, out, x0, g, m),
                        Kind::Q6K => tile_dispatch::<Q6K>(q, r, first, x, out, x0, g, m),
                    }
                }
                x0 += g;
            }
        }
    }
}
