//! Fake quantization against torchao's `Int8DynActInt4WeightQATQuantizer` fake quantizers
//! (scripts/make_qat_fixtures.py): int8 per-token activations and int4 per-group weights (group
//! 32), in f32 and bf16: the values bit for bit, and the gradients (the incoming one, masked where
//! the rounded value left the integer range).

use candle_core::{DType, Device, Tensor, Var};
use ferrotune_core::qat::{fake_quantize_per_group_int4, fake_quantize_per_token_int8};

#[test]
fn fake_quantization_matches_torchao() {
    let path = ferrotune_testing::fixtures().join("qat/ops.safetensors");
    let t = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    let bits = |x: &Tensor| -> Vec<f32> {
        x.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    for dtype in ["f32", "bf16"] {
        for key in ["x", "w"] {
            let input = Var::from_tensor(&t[&format!("{dtype}_{key}")]).unwrap();
            let fq = if key == "x" {
                fake_quantize_per_token_int8(input.as_tensor()).unwrap()
            } else {
                fake_quantize_per_group_int4(input.as_tensor(), 32).unwrap()
            };
            let want = &t[&format!("{dtype}_fq_{key}")];
            assert_eq!(fq.dtype(), want.dtype());
            assert_eq!(bits(&fq), bits(want), "{dtype} {key}: values");
            let probe = t[&format!("{dtype}_probe_{key}")]
                .to_dtype(DType::F32)
                .unwrap();
            let grads = (fq.to_dtype(DType::F32).unwrap() * probe)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let got = bits(grads.get(input.as_tensor()).unwrap());
            let want = bits(&t[&format!("{dtype}_grad_{key}")]);
            let worst = got
                .iter()
                .zip(&want)
                .map(|(g, w)| (g - w).abs() / w.abs().max(1e-6))
                .fold(0f32, f32::max);
            // torch multiplies the gradient by scale and then by 1/scale: an ulp of f32, which in
            // bf16 can flip one rounding (an ulp of bf16, 2^-7 relative).
            let tol = if dtype == "bf16" { 8e-3 } else { 1e-5 };
            assert!(worst < tol, "{dtype} {key}: gradient differs by {worst}");
            // Some elements are clamped (their gradient is 0) in the weights' groups.
            if key == "w" {
                assert!(want.contains(&0.0), "{dtype}: no clamped weight");
            }
        }
    }
}
