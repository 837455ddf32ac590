//! `QuantizedMatrix` against candle: dequantization bit-for-bit, products to f32-gemm accuracy.

use std::borrow::Cow;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Device, Result, Tensor};
use ferrotune_core::quant::QuantizedMatrix;

const KINDS: [GgmlDType; 5] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q8_0,
    GgmlDType::Q4K,
    GgmlDType::Q6K,
];

/// A small deterministic generator (xorshift64*), so the test needs no extra dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// A finite f16 of either sign spanning several binades, sometimes subnormal or zero: ggml
    /// scales are arbitrary f16s, and mins are stored negated, so every sign must work.
    fn f16_bits(&mut self) -> [u8; 2] {
        let sign = if self.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
        let v = match self.next_u64() % 32 {
            0 => 0.0,
            1 => self.uniform() * 1e-6, // f16 subnormal range
            2 => sign * 65504.0,        // f16 max
            3 => sign * 5.96e-8,        // smallest f16 subnormal
            _ => self.uniform() * 2f32.powi((self.next_u64() % 12) as i32 - 8),
        };
        half::f16::from_f32(v).to_bits().to_le_bytes()
    }
}

/// Offsets of the f16 fields in each block type (everything else is quant or scale bytes).
fn f16_fields(kind: GgmlDType) -> &'static [usize] {
    match kind {
        GgmlDType::Q4_0 | GgmlDType::Q8_0 => &[0],
        GgmlDType::Q4_1 | GgmlDType::Q4K => &[0, 2],
        GgmlDType::Q6K => &[208],
        _ => unreachable!(),
    }
}

/// Random blocks: random quant/scale bytes, random finite f16 factors.
fn random_bytes(rng: &mut Rng, kind: GgmlDType, rows: usize, cols: usize) -> Vec<u8> {
    let bb = kind.type_size();
    let n = rows * cols / kind.block_size();
    let mut bytes: Vec<u8> = (0..n * bb).map(|_| rng.next_u64() as u8).collect();
    for blk in bytes.chunks_exact_mut(bb) {
        for &at in f16_fields(kind) {
            blk[at..at + 2].copy_from_slice(&rng.f16_bits());
        }
    }
    bytes
}

fn candle_qtensor(kind: GgmlDType, rows: usize, cols: usize, bytes: &[u8]) -> Result<QTensor> {
    let storage = QStorage::from_data(Cow::Borrowed(bytes), &Device::Cpu, kind)?;
    QTensor::new(storage, (rows, cols))
}

fn random_x(rng: &mut Rng, m: usize, cols: usize) -> Result<Tensor> {
    let v: Vec<f32> = (0..m * cols).map(|_| rng.uniform() * 3.0).collect();
    Tensor::from_vec(v, (m, cols), &Device::Cpu)
}

fn assert_bit_identical(a: &Tensor, b: &Tensor, what: &str) -> Result<()> {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    let a = a.flatten_all()?.to_vec1::<f32>()?;
    let b = b.flatten_all()?.to_vec1::<f32>()?;
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}: element {i}: {x} vs {y}");
    }
    Ok(())
}

/// `got` against the f32 gemm `x @ w.T`: relative L2 error below 1e-5, and each element within
/// 1e-5 of `sum_j |w_ij x_j|` (the scale of the rounding error any summation order may make).
fn assert_matches_gemm(got: &Tensor, x: &Tensor, w: &Tensor, what: &str) -> Result<()> {
    let want = x.matmul(&w.t()?)?;
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let bound = x.abs()?.matmul(&w.abs()?.t()?)?.to_vec2::<f32>()?;
    let got = got.to_vec2::<f32>()?;
    let want = want.to_vec2::<f32>()?;
    let (mut err2, mut ref2) = (0f64, 0f64);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        for (j, (g, w)) in g.iter().zip(w).enumerate() {
            let d = (g - w).abs();
            assert!(
                d <= 1e-5 * bound[i][j] + 1e-30,
                "{what}: [{i}, {j}] {g} vs {w} (|w||x| = {})",
                bound[i][j]
            );
            err2 += (d as f64).powi(2);
            ref2 += (*w as f64).powi(2);
        }
    }
    let rel = (err2 / ref2.max(1e-300)).sqrt();
    assert!(rel <= 1e-5, "{what}: relative L2 error {rel}");
    Ok(())
}

#[test]
fn dequantize_is_bit_identical_to_candle() -> Result<()> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for kind in KINDS {
        for (rows, cols) in [(1, 256), (7, 512), (64, 768)] {
            let bytes = random_bytes(&mut rng, kind, rows, cols);
            let want = candle_qtensor(kind, rows, cols, &bytes)?.dequantize(&Device::Cpu)?;
            let q = QuantizedMatrix::from_ggml_bytes(kind, rows, cols, bytes)?;
            assert_eq!((q.rows(), q.cols()), (rows, cols));
            let got = q.dequantize(&Device::Cpu)?;
            assert_bit_identical(&got, &want, &format!("{kind:?} {rows}x{cols}"))?;
        }
    }
    Ok(())
}

#[test]
fn from_qtensor_matches_quantized_weights() -> Result<()> {
    let mut rng = Rng(7);
    for kind in KINDS {
        let (rows, cols) = (33, 512);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.uniform()).collect();
        let w = Tensor::from_vec(w, (rows, cols), &Device::Cpu)?;
        let qt = QTensor::quantize(&w, kind)?;
        let q = QuantizedMatrix::from_qtensor(&qt)?;
        let deq = qt.dequantize(&Device::Cpu)?;
        assert_bit_identical(&q.dequantize(&Device::Cpu)?, &deq, &format!("{kind:?}"))?;
        let x = random_x(&mut rng, 3, cols)?;
        assert_matches_gemm(&q.matmul(&x)?, &x, &deq, &format!("{kind:?} quantize()"))?;
    }
    Ok(())
}

#[test]
fn matmul_matches_f32_gemm() -> Result<()> {
    let mut rng = Rng(0xDEAD_BEEF);
    // 300 x 768 x m crosses the threshold where work is split over threads; m = 5, 12 and 17 mix
    // the 8- and 4-row kernels with remainders; m = 40 and 64 take the dequantize-and-gemm path.
    for kind in KINDS {
        for (rows, cols) in [(37, 256), (300, 768)] {
            let bytes = random_bytes(&mut rng, kind, rows, cols);
            let q = QuantizedMatrix::from_ggml_bytes(kind, rows, cols, bytes)?;
            let w = q.dequantize(&Device::Cpu)?;
            for m in [1, 2, 3, 5, 12, 17, 40, 64] {
                let x = random_x(&mut rng, m, cols)?;
                let what = format!("{kind:?} {rows}x{cols} m={m}");
                assert_matches_gemm(&q.matmul(&x)?, &x, &w, &what)?;
                if m <= 17 {
                    let what = format!("{what} (portable)");
                    assert_matches_gemm(&q.matmul_portable(&x)?, &x, &w, &what)?;
                }
            }
        }
    }
    Ok(())
}

/// With one-hot activations every product is `w * 1` plus exact zeros, so the fused kernels must
/// return the dequantized weights exactly: this checks the in-register weight reconstruction
/// (e.g. no fused multiply-add in `q * d + m`) bit-for-bit, which the gemm tolerance cannot.
#[test]
fn fused_kernels_rebuild_weights_exactly() -> Result<()> {
    let mut rng = Rng(0x1234_5678);
    for kind in KINDS {
        let (rows, cols) = (24, 512);
        let bytes = random_bytes(&mut rng, kind, rows, cols);
        let q = QuantizedMatrix::from_ggml_bytes(kind, rows, cols, bytes)?;
        let w = q.dequantize(&Device::Cpu)?.to_vec2::<f32>()?;
        // Batches of 16 one-hot rows keep the fused (not the dense) path.
        for c0 in (0..cols).step_by(16) {
            let mut x = vec![0f32; 16 * cols];
            for i in 0..16 {
                x[i * cols + c0 + i] = 1.0;
            }
            let x = Tensor::from_vec(x, (16, cols), &Device::Cpu)?;
            for (name, out) in [
                ("simd", q.matmul(&x)?),
                ("portable", q.matmul_portable(&x)?),
            ] {
                let out = out.to_vec2::<f32>()?;
                for i in 0..16 {
                    for (r, wr) in w.iter().enumerate() {
                        // `==`, not bits: an exact -0.0 weight plus +0.0 terms sums to +0.0.
                        assert!(
                            out[i][r] == wr[c0 + i],
                            "{kind:?} {name}: w[{r}, {}] = {} rebuilt as {}",
                            c0 + i,
                            wr[c0 + i],
                            out[i][r]
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

#[test]
fn matmul_accepts_strided_x_and_empty_batches() -> Result<()> {
    let mut rng = Rng(3);
    let (rows, cols) = (16, 64);
    let q = QuantizedMatrix::from_ggml_bytes(
        GgmlDType::Q4_1,
        rows,
        cols,
        random_bytes(&mut rng, GgmlDType::Q4_1, rows, cols),
    )?;
    let w = q.dequantize(&Device::Cpu)?;
    // A transposed view is not contiguous: it must be copied, not misread.
    let xt = random_x(&mut rng, cols, 2)?.t()?;
    assert_matches_gemm(&q.matmul(&xt)?, &xt, &w, "strided x")?;
    let empty = Tensor::zeros((0, cols), candle_core::DType::F32, &Device::Cpu)?;
    assert_eq!(q.matmul(&empty)?.dims(), &[0, rows]);
    Ok(())
}

#[test]
fn row_order_permutes_outputs() -> Result<()> {
    let mut rng = Rng(11);
    for kind in KINDS {
        let (rows, cols) = (48, 256);
        let bytes = random_bytes(&mut rng, kind, rows, cols);
        let plain = QuantizedMatrix::from_ggml_bytes(kind, rows, cols, bytes.clone())?;
        // llama.cpp's q/k permutation for 3 heads of 16: interleaved halves back to rotate-half.
        let perm: Vec<u32> = (0..rows as u32)
            .map(|i| {
                let (h, r) = (i / 16, i % 16);
                h * 16 + if r < 8 { 2 * r } else { 2 * (r - 8) + 1 }
            })
            .collect();
        let permuted = QuantizedMatrix::from_ggml_bytes(kind, rows, cols, bytes)?
            .with_row_order(perm.clone())?;
        let idx = Tensor::from_vec(perm.clone(), rows, &Device::Cpu)?;
        let deq = plain.dequantize(&Device::Cpu)?;
        assert_bit_identical(
            &permuted.dequantize(&Device::Cpu)?,
            &deq.index_select(&idx, 0)?,
            &format!("{kind:?} permuted dequantize"),
        )?;
        for m in [1, 3, 40] {
            let x = random_x(&mut rng, m, cols)?;
            // Each output row is the same computation on the same stored row: exact equality.
            let want = plain.matmul(&x)?.index_select(&idx, 1)?;
            assert_bit_identical(&permuted.matmul(&x)?, &want, &format!("{kind:?} m={m}"))?;
        }
    }
    Ok(())
}

#[test]
fn invalid_inputs_are_errors() -> Result<()> {
    let mut rng = Rng(5);
    let bytes = random_bytes(&mut rng, GgmlDType::Q4_1, 4, 64);
    assert_eq!(bytes.len(), 4 * 2 * 20);
    let ok = |b: Vec<u8>| QuantizedMatrix::from_ggml_bytes(GgmlDType::Q4_1, 4, 64, b);
    assert!(ok(bytes.clone()).is_ok());
    assert!(ok(bytes[..bytes.len() - 1].to_vec()).is_err(), "short");
    assert!(ok([bytes.clone(), vec![0]].concat()).is_err(), "long");
    assert!(ok(Vec::new()).is_err(), "empty");
    // 48 columns is not a whole number of 32-wide blocks (and 256 is needed for K-quants).
    assert!(QuantizedMatrix::from_ggml_bytes(GgmlDType::Q4_1, 4, 48, vec![0; 4 * 30]).is_err());
    assert!(QuantizedMatrix::from_ggml_bytes(GgmlDType::Q4K, 1, 128, vec![0; 72]).is_err());
    for kind in [
        GgmlDType::F32,
        GgmlDType::F16,
        GgmlDType::BF16,
        GgmlDType::Q5_0,
        GgmlDType::Q8K,
    ] {
        let n = 4 * 64 / kind.block_size() * kind.type_size();
        assert!(
            QuantizedMatrix::from_ggml_bytes(kind, 4, 64, vec![0; n]).is_err(),
            "{kind:?} accepted"
        );
    }
    let q = ok(bytes)?;
    assert!(
        q.clone().with_row_order(vec![0, 1, 2]).is_err(),
        "short perm"
    );
    assert!(
        q.clone().with_row_order(vec![0, 1, 1, 3]).is_err(),
        "repeat"
    );
    assert!(q.clone().with_row_order(vec![0, 1, 2, 4]).is_err(), "range");
    assert!(q.clone().with_row_order(vec![3, 2, 1, 0]).is_ok());
    let x = Tensor::zeros((2, 32), candle_core::DType::F32, &Device::Cpu)?;
    assert!(q.matmul(&x).is_err(), "wrong width");
    let x = Tensor::zeros((2, 64), candle_core::DType::F64, &Device::Cpu)?;
    assert!(q.matmul(&x).is_err(), "wrong dtype");
    let x = Tensor::zeros(64, candle_core::DType::F32, &Device::Cpu)?;
    assert!(q.matmul(&x).is_err(), "rank 1");
    Ok(())
}
