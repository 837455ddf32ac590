//! Small vectorizable building blocks shared by the fused ops, and GEMM on raw strided buffers.
//!
//! The workspace is built for baseline x86-64 (SSE2). Each hot loop is written once, branch-free,
//! and compiled twice by [`simd_fn`]: as is, and inside an `avx2,fma` function chosen at run time,
//! where LLVM vectorizes the same code eight lanes wide. Nothing uses `mul_add`: without hardware
//! FMA that would be a slow library call, so both builds compute the same roundings.

/// Defines `fn name(args) -> ret { body }` with an AVX2 build of the body picked at run time.
macro_rules! simd_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn generic($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    generic($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the running CPU has the features `avx2` is compiled for.
                    return unsafe { avx2($($arg),*) };
                }
            }
            generic($($arg),*)
        }
    };
}
pub(crate) use simd_fn;

/// `e^x` in f32, branch-free so that loops over it vectorize (Cephes' `expf` polynomial on a
/// range-reduced argument). Accurate to about 2 ulp; returns 0 below −87.33 (no subnormals), +∞
/// above 88.3, and NaN for NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2²³: adding it rounds to an integer, which then sits in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    const LO: f32 = -87.33;
    const HI: f32 = 88.3;
    let xc = if x > HI { HI } else { x };
    let xc = if xc < LO { LO } else { xc };
    let t = xc * std::f32::consts::LOG2_E + MAGIC;
    let n = t - MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let p = p * (r * r) + r + 1.0;
    let exponent = ((t.to_bits() as i32).wrapping_sub(0x4B40_0000) + 127) << 23;
    let y = p * f32::from_bits(exponent as u32);
    let y = if x < LO { 0.0 } else { y };
    if x > HI {
        f32::INFINITY
    } else {
        y
    }
}

/// Sum with eight independent accumulators (a plain `iter().sum()` cannot be vectorized).
#[inline(always)]
pub(crate) fn sum(xs: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for j in 0..8 {
            acc[j] += c[j];
        }
    }
    let tail: f32 = chunks.remainder().iter().sum();
    acc.iter().sum::<f32>() + tail
}

/// Dot product with eight accumulators.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    acc.iter().sum::<f32>() + tail
}

/// Largest element (−∞ for an empty slice; NaNs are skipped).
#[inline(always)]
pub(crate) fn max(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for j in 0..8 {
            acc[j] = if c[j] > acc[j] { c[j] } else { acc[j] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &v in acc.iter().chain(chunks.remainder()) {
        m = if v > m { v } else { m };
    }
    m
}

/// `xs[i] = exp(xs[i] − shift)`, returning the sum of the new values.
#[inline(always)]
pub(crate) fn exp_shift_inplace(xs: &mut [f32], shift: f32) -> f32 {
    for v in xs.iter_mut() {
        *v = exp(*v - shift);
    }
    sum(xs)
}

/// `Σ exp(xs[i] − shift)` without writing anything (the values go through a stack buffer).
#[inline(always)]
pub(crate) fn sum_exp_shift(xs: &[f32], shift: f32) -> f32 {
    let mut buf = [0f32; 256];
    let mut total = 0f32;
    for c in xs.chunks(256) {
        let b = &mut buf[..c.len()];
        for (d, &v) in b.iter_mut().zip(c) {
            *d = exp(v - shift);
        }
        total += sum(b);
    }
    total
}

/// Row-major `dst[m×n] (+)= beta · A[m×k] · B[k×n]`, with `A` and `B` given by strides.
///
/// `dst` has row stride `ld_dst`; `accumulate` adds to its contents instead of overwriting them.
/// Runs single-threaded: callers parallelize over independent blocks.
///
/// # Safety
/// Every element addressed through the pointers and strides must lie inside its allocation, and
/// `dst` must not overlap `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm(
    mnk: (usize, usize, usize),
    dst: *mut f32,
    ld_dst: usize,
    accumulate: bool,
    a: (*const f32, usize, usize),
    b: (*const f32, usize, usize),
    beta: f32,
) {
    gemm_with(
        mnk,
        dst,
        ld_dst,
        accumulate,
        a,
        b,
        beta,
        gemm::Parallelism::None,
    )
}

/// How the two row-major operands of [`matmul`] hold the product `dst[m×n]`.
#[derive(Clone, Copy)]
pub(crate) enum Operands {
    /// `a[m×k] · b[n×k]ᵀ`.
    Nt,
    /// `a[m×k] · b[k×n]`.
    Nn,
    /// `a[k×m]ᵀ · b[k×n]`.
    Tn,
}

/// Row-major `dst[m×n] (+)= beta · a · b`, each operand transposed as `operands` says, on all of
/// rayon's threads (for one large product rather than many small ones); `accumulate` adds to
/// `dst` instead of overwriting it. Panics if a buffer is smaller than its matrix.
pub(crate) fn matmul(
    dst: &mut [f32],
    mnk: (usize, usize, usize),
    accumulate: bool,
    operands: Operands,
    a: &[f32],
    b: &[f32],
    beta: f32,
) {
    let threads = rayon::current_num_threads().max(1);
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    matmul_with(dst, mnk, accumulate, operands, a, b, beta, par)
}

/// [`matmul`] on the calling thread only, for the many small products of a kernel that is
/// already parallel over its rows and heads.
pub(crate) fn matmul_on_this_thread(
    dst: &mut [f32],
    mnk: (usize, usize, usize),
    accumulate: bool,
    operands: Operands,
    a: &[f32],
    b: &[f32],
    beta: f32,
) {
    matmul_with(
        dst,
        mnk,
        accumulate,
        operands,
        a,
        b,
        beta,
        gemm::Parallelism::None,
    )
}

#[allow(clippy::too_many_arguments)]
fn matmul_with(
    dst: &mut [f32],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    operands: Operands,
    a: &[f32],
    b: &[f32],
    beta: f32,
    par: gemm::Parallelism,
) {
    // (row stride, column stride) of each operand as `gemm` reads it: A is m×k, B is k×n.
    let (a_strides, b_strides) = match operands {
        Operands::Nt => ((k, 1), (1, k)),
        Operands::Nn => ((k, 1), (n, 1)),
        Operands::Tn => ((1, m), (n, 1)),
    };
    assert!(
        dst.len() >= m * n && a.len() >= m * k && b.len() >= k * n,
        "matmul: buffers smaller than their {m}×{n}×{k} product"
    );
    // SAFETY: with the lengths just checked, every element the strides address lies inside its
    // slice; `dst` is borrowed mutably, so it cannot overlap `a` or `b`.
    unsafe {
        gemm_with(
            (m, n, k),
            dst.as_mut_ptr(),
            n,
            accumulate,
            (a.as_ptr(), a_strides.0, a_strides.1),
            (b.as_ptr(), b_strides.0, b_strides.1),
            beta,
            par,
        )
    }
}

#[allow(clippy::too_many_arguments)]
unsafe fn gemm_with(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    ld_dst: usize,
    accumulate: bool,
    a: (*const f32, usize, usize),
    b: (*const f32, usize, usize),
    beta: f32,
    parallelism: gemm::Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                std::slice::from_raw_parts_mut(dst.add(i * ld_dst), n).fill(0.0);
            }
        }
        return;
    }
    let (a_ptr, a_rs, a_cs) = a;
    let (b_ptr, b_rs, b_cs) = b;
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        ld_dst as isize,
        accumulate,
        a_ptr,
        a_cs as isize,
        a_rs as isize,
        b_ptr,
        b_cs as isize,
        b_rs as isize,
        1.0,
        beta,
        false,
        false,
        false,
        parallelism,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_a_few_ulp_of_f64() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let got = exp(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp(f32::MIN), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(100.0), f32::INFINITY);
    }

    #[test]
    fn reductions_match_plain_loops() {
        let xs: Vec<f32> = (0..37)
            .map(|i| ((i * 7919) % 101) as f32 / 13.0 - 3.0)
            .collect();
        let ys: Vec<f32> = (0..37)
            .map(|i| ((i * 104_729) % 89) as f32 / 7.0 - 5.0)
            .collect();
        let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 * b.abs().max(1.0);
        assert!(close(sum(&xs), xs.iter().sum()));
        assert!(close(
            dot(&xs, &ys),
            xs.iter().zip(&ys).map(|(a, b)| a * b).sum()
        ));
        assert_eq!(max(&xs), xs.iter().cloned().fold(f32::MIN, f32::max));
        let direct: f32 = xs.iter().map(|v| (v - 1.5).exp()).sum();
        assert!(close(sum_exp_shift(&xs, 1.5), direct));
        let mut ys2 = xs.clone();
        assert!(close(exp_shift_inplace(&mut ys2, 1.5), direct));
    }

    #[test]
    fn gemm_handles_transposed_operands_and_accumulation() {
        // A = 2×3, B = 3×2 given as Bᵀ (2×3 row-major) via strides.
        let a = [1f32, 2., 3., 4., 5., 6.];
        let bt = [1f32, 0., -1., 2., 1., 0.];
        let mut c = [1f32; 4];
        unsafe {
            gemm(
                (2, 2, 3),
                c.as_mut_ptr(),
                2,
                true,
                (a.as_ptr(), 3, 1),
                (bt.as_ptr(), 1, 3),
                2.0,
            )
        };
        // A·B = [[-2, 4], [-2, 13]]; times 2 plus 1.
        assert_eq!(c, [-3.0, 9.0, -3.0, 27.0]);
    }
}
