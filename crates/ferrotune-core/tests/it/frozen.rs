//! The frozen-weight linear gives candle's matmul values and input gradients, and no weight
//! gradient.

use candle_core::{DType, Device, Tensor, Var};
use ferrotune_core::ops;

fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
    let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
    let scale = b.abs().unwrap().max_all().unwrap();
    diff.to_scalar::<f32>().unwrap() / scale.to_scalar::<f32>().unwrap().max(1e-12)
}

#[test]
fn frozen_linear_matches_plain_matmul_forward_and_backward() {
    let dev = Device::Cpu;
    let x0 = Tensor::randn(0f32, 1.0, (2, 5, 24), &dev).unwrap();
    let w = Tensor::randn(0f32, 0.3, (40, 24), &dev).unwrap();
    let b = Tensor::randn(0f32, 0.3, 40, &dev).unwrap();
    let probe = Tensor::randn(0f32, 1.0, (2, 5, 40), &dev).unwrap();

    // Through ops::linear: x tracked, w a plain tensor → the frozen op.
    let x = Var::from_tensor(&x0).unwrap();
    let y = ops::linear(x.as_tensor(), &w, Some(&b)).unwrap();
    let grads = (&y * &probe)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let gx = grads.get(x.as_tensor()).unwrap().clone();
    assert!(
        grads.get(&w).is_none(),
        "a frozen weight must get no gradient"
    );

    // Reference: candle's own matmul with both operands in the graph.
    let x2 = Var::from_tensor(&x0).unwrap();
    let wv = Var::from_tensor(&w).unwrap();
    let y2 = x2
        .as_tensor()
        .broadcast_matmul(&wv.as_tensor().t().unwrap())
        .unwrap()
        .broadcast_add(&b)
        .unwrap();
    let grads2 = (&y2 * &probe)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let gx2 = grads2.get(x2.as_tensor()).unwrap();

    assert!(max_rel(&y, &y2) < 1e-6, "forward differs");
    assert!(max_rel(&gx, gx2) < 1e-6, "input gradient differs");
    // The trainable-weight path still gets its gradient through ops::linear.
    let y3 = ops::linear(&x0, wv.as_tensor(), None).unwrap();
    let g3 = (&y3 * &probe)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(g3.get(wv.as_tensor()).is_some());
}

#[test]
fn frozen_linear_handles_non_contiguous_input_and_bf16() {
    let dev = Device::Cpu;
    let x0 = Tensor::randn(0f32, 1.0, (6, 16), &dev)
        .unwrap()
        .t()
        .unwrap(); // [16, 6], strided
    let w = Tensor::randn(0f32, 0.3, (8, 6), &dev).unwrap();
    let x = Var::from_tensor(&x0.contiguous().unwrap()).unwrap();
    let xt = (x.as_tensor() * 1.0).unwrap().t().unwrap().t().unwrap();
    let y = ops::linear(&xt, &w, None).unwrap();
    let want = x0.matmul(&w.t().unwrap()).unwrap();
    assert!(max_rel(&y, &want) < 1e-6);

    let xb = Var::from_tensor(&x0.to_dtype(DType::BF16).unwrap()).unwrap();
    let wb = w.to_dtype(DType::BF16).unwrap();
    let yb = ops::linear(xb.as_tensor(), &wb, None).unwrap();
    let wantb = xb.as_tensor().matmul(&wb.t().unwrap()).unwrap();
    let d = (yb.to_dtype(DType::F32).unwrap() - wantb.to_dtype(DType::F32).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(d, 0.0, "bf16 frozen matmul differs from candle's");
}

/// A weight stored inputs first (`[in, out]`, gpt-oss's experts), given as its transposed view:
/// the values and input gradient of `rows @ w`, and no gradient for the weight.
#[test]
fn frozen_matmul_takes_a_transposed_view_in_place() {
    let dev = Device::Cpu;
    let x0 = Tensor::randn(0f32, 1.0, (7, 24), &dev).unwrap();
    // Three experts `[3, in, out]`; expert 1's weight is a view at an offset.
    let experts = Tensor::randn(0f32, 0.3, (3, 24, 40), &dev).unwrap();
    let w = experts.get(1).unwrap();
    let probe = Tensor::randn(0f32, 1.0, (7, 40), &dev).unwrap();
    let x = Var::from_tensor(&x0).unwrap();
    let y = ferrotune_core::frozen::frozen_matmul(x.as_tensor(), &w.t().unwrap()).unwrap();
    let grads = (&y * &probe)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let gx = grads.get(x.as_tensor()).unwrap();
    assert!(grads.get(&w).is_none() && grads.get(&experts).is_none());
    let x2 = Var::from_tensor(&x0).unwrap();
    let y2 = x2.as_tensor().matmul(&w).unwrap();
    let grads2 = (&y2 * &probe)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(max_rel(&y, &y2) < 1e-6, "forward differs");
    assert!(
        max_rel(gx, grads2.get(x2.as_tensor()).unwrap()) < 1e-6,
        "input gradient differs"
    );
}
