//! NF4 quantization against torchao's `to_nf4` (tests/fixtures/nf4/quantize.safetensors, written by
//! scripts/make_nf4_fixtures.py): the same packed codes, block scales, factors and mean, and the
//! same dequantized weight bit for bit in bf16 and f16 (to an ulp in f32); and the NF4 linear's values and
//! input gradient equal those of a dense matmul with the dequantized weight.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use ferrotune_core::frozen::nf4_matmul;
use ferrotune_core::nf4::Nf4Matrix;

use crate::common;

fn fixtures() -> HashMap<String, Tensor> {
    let path = ferrotune_testing::fixtures().join("nf4/quantize.safetensors");
    candle_core::safetensors::load(&path, &Device::Cpu).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn quantization_equals_torchao_bit_for_bit() {
    let f = fixtures();
    let mut cases: Vec<&str> = f.keys().filter_map(|k| k.strip_suffix(".weight")).collect();
    cases.sort();
    assert_eq!(cases.len(), 6, "{cases:?}");
    for case in cases {
        let get = |part: &str| &f[&format!("{case}.{part}")];
        let weight = get("weight");
        let q = Nf4Matrix::quantize(weight).unwrap();
        assert_eq!(q.dtype(), weight.dtype(), "{case}");
        assert_eq!(
            q.segments()[0].codes(),
            get("codes").to_vec1::<u8>().unwrap().as_slice(),
            "{case}: codes"
        );
        let scalers: Vec<i64> = q.segments()[0]
            .quantized_scalers()
            .iter()
            .map(|&s| s as i64)
            .collect();
        assert_eq!(scalers, get("scalers").to_vec1::<i64>().unwrap(), "{case}");
        let dq = q.dequantize().unwrap();
        assert_eq!(dq.dtype(), weight.dtype());
        assert_eq!(dq.dims(), weight.dims());
        let mut floats = vec![
            (
                "mean",
                vec![q.segments()[0].scaler_mean()],
                get("mean").clone(),
            ),
            (
                "factors",
                q.segments()[0].quantization_factor().to_vec(),
                get("factor").clone(),
            ),
        ];
        let dq32 = dq.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        floats.push((
            "dequantized",
            dq32.to_vec1().unwrap(),
            get("dequantized").clone(),
        ));
        for (what, ours, theirs) in floats {
            let theirs = theirs.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            let theirs = theirs.to_vec1::<f32>().unwrap();
            assert_eq!(ours.len(), theirs.len());
            if weight.dtype() == DType::F32 {
                // torch sums f32 in an order that depends on the CPU's vector width and thread
                // count, so its mean of the block maxima (and what follows from it) may be an ulp
                // from the correctly rounded one taken here.
                // (Dequantized values carry the mean's ulp, relative to the whole weight's scale.)
                let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (a, b) in ours.iter().zip(&theirs) {
                    let tol = 4.0 * f32::EPSILON * scale;
                    assert!((a - b).abs() <= tol, "{case} {what}: {a} {b}");
                }
            } else {
                let ours: Vec<u32> = ours.iter().map(|v| v.to_bits()).collect();
                let theirs: Vec<u32> = theirs.iter().map(|v| v.to_bits()).collect();
                assert!(ours == theirs, "{case}: {what}");
            }
        }
        // Sanity: NF4 is within half the widest level gap (0.28) of each block's maximum.
        let w32 = weight.to_dtype(DType::F32).unwrap();
        let max = |t: &Tensor| {
            t.abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        let err = max(&(dq.to_dtype(DType::F32).unwrap() - &w32).unwrap());
        assert!(err > 0.0 && err < 0.15 * max(&w32), "{case}: {err}");
    }
}

#[test]
fn shapes_torchao_refuses_quantize_with_shorter_last_blocks() {
    // 576 × 192 (SmolLM2-135M's k_proj): 1728 blocks, the last scale group has 192 of 256.
    let mut rng = common::Rng(11);
    let w = rng.tensor(&[192, 576], 0.1).to_dtype(DType::BF16).unwrap();
    let q = Nf4Matrix::quantize(&w).unwrap();
    assert_eq!(q.segments()[0].quantized_scalers().len(), 1728);
    assert_eq!(q.segments()[0].quantization_factor().len(), 7);
    // Every block's maximum is reproduced to within the scale quantization's error, and the last
    // group uses its own maximum (an all-zero tail group would blow up its factor).
    let dq = q.dequantize().unwrap().to_dtype(DType::F32).unwrap();
    let w32 = w.to_dtype(DType::F32).unwrap();
    let rel = ((dq - &w32).unwrap().abs().unwrap().max_all().unwrap())
        .to_scalar::<f32>()
        .unwrap()
        / 0.1;
    assert!(rel < 0.2, "{rel}");
    // An odd element count packs its last code into a high nibble.
    let odd = rng.tensor(&[3, 5], 1.0);
    let q = Nf4Matrix::quantize(&odd).unwrap();
    assert_eq!(q.segments()[0].codes().len(), 8);
    assert_eq!(q.dequantize().unwrap().dims(), &[3, 5]);
}

#[test]
fn nf4_linear_is_the_dense_product_with_the_dequantized_weight() {
    let mut rng = common::Rng(5);
    let w = rng.tensor(&[64, 256], 0.2);
    let q = Arc::new(Nf4Matrix::quantize(&w).unwrap());
    let dense = q.dequantize().unwrap();
    let x = Var::from_tensor(&rng.tensor(&[6, 256], 1.0)).unwrap();
    let probe = rng.tensor(&[6, 64], 1.0);

    let y = nf4_matmul(x.as_tensor(), &q).unwrap();
    let expect = x.as_tensor().matmul(&dense.t().unwrap()).unwrap();
    assert_eq!(bits(&y), bits(&expect));
    let grads = (&y * &probe)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let gx = grads.get(x.as_tensor()).unwrap();
    let expect_gx = probe.matmul(&dense).unwrap();
    assert_eq!(bits(gx), bits(&expect_gx));
    // Outside autograd it is the same product.
    let plain = nf4_matmul(&x.as_tensor().detach(), &q).unwrap();
    assert_eq!(bits(&plain), bits(&expect));
}

#[test]
fn fused_lora_on_nf4_equals_fused_lora_on_the_dequantized_weight() {
    let mut rng = common::Rng(9);
    let q = Arc::new(Nf4Matrix::quantize(&rng.tensor(&[48, 128], 0.2)).unwrap());
    let dense = q.dequantize().unwrap();
    let x0 = rng.tensor(&[2, 5, 128], 1.0);
    let a0 = rng.tensor(&[4, 128], 0.3);
    let b0 = rng.tensor(&[48, 4], 0.3);
    let bias = rng.tensor(&[48], 0.3);
    let probe = rng.tensor(&[2, 5, 48], 1.0);
    let run = |nf4: bool| {
        let (x, a, b) = (
            Var::from_tensor(&x0).unwrap(),
            Var::from_tensor(&a0).unwrap(),
            Var::from_tensor(&b0).unwrap(),
        );
        let (xt, at, bt) = (x.as_tensor(), a.as_tensor(), b.as_tensor());
        let y = if nf4 {
            ferrotune_core::fused::lora_linear(xt, &q, Some(&bias), at, bt, 2.0)
        } else {
            ferrotune_core::fused::lora_linear(xt, &dense, Some(&bias), at, bt, 2.0)
        }
        .unwrap();
        let grads = (&y * &probe)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g = |v: &Var| bits(grads.get(v.as_tensor()).unwrap());
        (bits(&y), g(&x), g(&a), g(&b))
    };
    assert!(run(true) == run(false));
}

#[test]
fn row_segments_quantize_as_separate_tensors() {
    // A fused [q; k; v] projection quantized as torchtune quantizes its split parts.
    let mut rng = common::Rng(17);
    // Parts of different scales (as q, k and v have): their block maxima's means differ.
    let w = Tensor::cat(
        &[
            rng.tensor(&[96, 128], 0.1),
            rng.tensor(&[32, 128], 0.4),
            rng.tensor(&[32, 128], 0.02),
        ],
        0,
    )
    .unwrap()
    .to_dtype(DType::BF16)
    .unwrap();
    let fused = Nf4Matrix::quantize_rows(&w, &[96, 32, 32]).unwrap();
    assert_eq!(fused.segments().len(), 3);
    let mut parts = Vec::new();
    let mut start = 0;
    for rows in [96, 32, 32] {
        let part = Nf4Matrix::quantize(&w.narrow(0, start, rows).unwrap()).unwrap();
        assert_eq!(
            part.segments()[0].codes(),
            fused.segments()[parts.len()].codes()
        );
        parts.push(part.dequantize().unwrap());
        start += rows;
    }
    let want = Tensor::cat(&parts, 0).unwrap();
    assert_eq!(bits(&fused.dequantize().unwrap()), bits(&want));
    // As one tensor the blocks' mean differs: so do the values.
    let whole = Nf4Matrix::quantize(&w).unwrap().dequantize().unwrap();
    assert!(
        bits(&whole) != bits(&want),
        "one tensor and three quantize alike"
    );
    assert!(Nf4Matrix::quantize_rows(&w, &[96, 32]).is_err());
}

/// The byte form sharded training splits and gathers rebuilds the same matrix (every segment's
/// codes, scalers, factors and mean; the same dequantized weight); a placeholder of its layout
/// has the shape and refuses to dequantize.
#[test]
fn nf4_bytes_round_trip_and_placeholders_refuse_to_dequantize() {
    use candle_core::{DType, Device, Tensor};
    use ferrotune_core::nf4::Nf4Matrix;
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 0.05, (40, 96), &dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let q = Nf4Matrix::quantize_rows(&w, &[16, 8, 16]).unwrap();
    let layout = q.layout();
    let bytes = q.to_bytes();
    assert_eq!(bytes.len(), layout.byte_len());
    let back = Nf4Matrix::from_bytes(&layout, &bytes, &dev).unwrap();
    assert_eq!(back.layout(), layout);
    for (a, b) in q.segments().iter().zip(back.segments()) {
        assert_eq!(a.codes(), b.codes());
        assert_eq!(a.quantized_scalers(), b.quantized_scalers());
        assert_eq!(a.quantization_factor(), b.quantization_factor());
        assert_eq!(a.scaler_mean(), b.scaler_mean());
    }
    assert_eq!(back.dequantize_values(), q.dequantize_values());
    assert!(Nf4Matrix::from_bytes(&layout, &bytes[1..], &dev).is_err());
    let stand_in = Nf4Matrix::placeholder(&layout, &dev);
    assert_eq!(stand_in.dims(), (40, 96));
    let err = stand_in.dequantize().unwrap_err().to_string();
    assert!(err.contains("not on this rank"), "{err}");
}
