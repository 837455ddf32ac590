//! Differentiable building blocks of the decoder, composed from candle primitives with backward.
//!
//! Each follows the arithmetic of the corresponding transformers module (which dtype each step runs
//! in matters for bf16 parity), and every op used here has a gradient in candle's autograd.

use candle_core::{DType, Device, Result, Shape, Tensor, WithDType, D};

/// RMSNorm as transformers' `LlamaRMSNorm`: statistics in f32, `weight * normed.to(input_dtype)`.
///
/// With `offset_one` it is Gemma's variant: `normed * (1 + weight)` computed in f32, then cast back.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64, offset_one: bool) -> Result<Tensor> {
    let in_dtype = x.dtype();
    let xf = x.to_dtype(DType::F32)?;
    let variance = xf.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = xf.broadcast_mul(&(variance + eps)?.sqrt()?.recip()?)?;
    if offset_one {
        let scale = (weight.to_dtype(DType::F32)? + 1.0)?;
        normed.broadcast_mul(&scale)?.to_dtype(in_dtype)
    } else {
        normed.to_dtype(in_dtype)?.broadcast_mul(weight)
    }
}

/// Softmax over the last dimension, computed in f32 and cast back to the input dtype
/// (transformers' eager attention: `softmax(..., dtype=float32).to(query.dtype)`).
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let in_dtype = x.dtype();
    let xf = x.to_dtype(DType::F32)?;
    // The max is a constant shift: detaching it leaves the gradient unchanged and saves work.
    let max = xf.max_keepdim(D::Minus1)?.detach();
    let e = xf.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    e.broadcast_div(&sum)?.to_dtype(in_dtype)
}

/// LayerNorm over the last dimension, as `torch.nn.functional.layer_norm`: `(x − mean) /
/// √(var + eps) · weight + bias` with the biased variance, computed in f32 and cast back to `x`'s
/// dtype (PyTorch's kernels also accumulate half types in f32). Differentiable.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = x.to_dtype(DType::F32)?;
    let centered = xf.broadcast_sub(&xf.mean_keepdim(D::Minus1)?)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?;
    let out = normed.broadcast_mul(&weight.to_dtype(DType::F32)?)?;
    let out = match bias {
        Some(b) => out.broadcast_add(&b.to_dtype(DType::F32)?)?,
        None => out,
    };
    out.to_dtype(dtype)
}

/// `cap · tanh(x / cap)` in `x`'s dtype, differentiable: Gemma 2's softcapping of attention
/// scores and logits (transformers divides, applies tanh and multiplies in the same dtype).
pub fn softcap(x: &Tensor, cap: f64) -> Result<Tensor> {
    (x / cap)?.tanh()? * cap
}

/// `rotate_half` of transformers: `cat(-x2, x1)` over the last dimension.
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)
}

/// Applies rotary position embeddings (transformers' `apply_rotary_pos_emb`, half-split layout).
///
/// `x` is `[batch, heads, seq, head_dim]`; `cos`/`sin` are `[batch, 1, seq, rotary_dim]`. When
/// `rotary_dim < head_dim` (partial rotary, as in Phi-4-mini) only the leading part is rotated.
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let head_dim = x.dim(D::Minus1)?;
    let rot = cos.dim(D::Minus1)?;
    if rot == head_dim {
        return x.broadcast_mul(cos)? + rotate_half(x)?.broadcast_mul(sin)?;
    }
    let x_rot = x.narrow(D::Minus1, 0, rot)?;
    let x_pass = x.narrow(D::Minus1, rot, head_dim - rot)?;
    let rotated = (x_rot.broadcast_mul(cos)? + rotate_half(&x_rot)?.broadcast_mul(sin)?)?;
    Tensor::cat(&[&rotated, &x_pass], D::Minus1)
}

/// `x @ weight.T (+ bias)` for `x` of any rank `[..., in]` and `weight` `[out, in]` (PyTorch's
/// `nn.Linear` layout).
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    linear_with(x, weight.dim(0)?, bias, |rows| {
        if rows.track_op() && !weight.track_op() {
            // Training through a frozen layer: skip candle's weight gradient (see `frozen`).
            crate::frozen::frozen_matmul(rows, weight)
        } else if weight.track_op() {
            // A trained weight: both gradients from one op (see `fused::trainable_linear`).
            crate::fused::trainable_linear(rows, weight)
        } else {
            rows.matmul(&weight.t()?)
        }
    })
}

/// A linear layer whose product is computed by `matmul` (`[rows, in]` → `[rows, out_features]`):
/// flattens `x`'s leading dimensions into rows, adds `bias`, and restores them. Serves the dense
/// layer above and other weight layouts (quantized blocks) alike.
pub fn linear_with(
    x: &Tensor,
    out_features: usize,
    bias: Option<&Tensor>,
    matmul: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let dims = x.dims();
    let in_features = *dims
        .last()
        .expect("linear input has at least one dimension");
    let rows: usize = dims[..dims.len() - 1].iter().product();
    let out = matmul(&x.reshape((rows, in_features))?)?;
    let out = match bias {
        Some(b) => out.broadcast_add(b)?,
        None => out,
    };
    let mut out_dims = dims.to_vec();
    *out_dims.last_mut().expect("non-empty") = out_features;
    out.reshape(out_dims)
}

/// The value [`additive_mask`] gives masked entries in `dtype`, as f32 (exact: 16-bit minima are
/// f32 values).
pub fn additive_mask_min(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::MIN.to_f32(),
        DType::F16 => half::f16::MIN.to_f32(),
        _ => f32::MIN,
    }
}

/// An additive attention mask from `allowed` (row-major over `shape`): 0 where a query may attend,
/// elsewhere the dtype's finite minimum (transformers' `finfo(dtype).min`), built directly in
/// `dtype` (f32's minimum would round to −∞ in 16-bit types).
pub fn additive_mask(
    allowed: &[bool],
    shape: impl Into<Shape>,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    fn build<T: WithDType>(
        allowed: &[bool],
        (zero, min): (T, T),
        shape: Shape,
        device: &Device,
    ) -> Result<Tensor> {
        let data: Vec<T> = allowed
            .iter()
            .map(|&a| if a { zero } else { min })
            .collect();
        Tensor::from_vec(data, shape, device)
    }
    let shape = shape.into();
    match dtype {
        DType::BF16 => build(allowed, (half::bf16::ZERO, half::bf16::MIN), shape, device),
        DType::F16 => build(allowed, (half::f16::ZERO, half::f16::MIN), shape, device),
        _ => build(allowed, (0f32, f32::MIN), shape, device)?.to_dtype(dtype),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn close(a: &Tensor, b: &Tensor, tol: f32) {
        let d = (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d <= tol, "max abs diff {d} > {tol}");
    }

    #[test]
    fn softmax_rows_sum_to_one_and_match_direct_formula() {
        let x = Tensor::new(&[[1f32, 2.0, 3.0], [-1.0, 0.0, 100.0]], &Device::Cpu).unwrap();
        let s = softmax_last_dim(&x).unwrap();
        let row0: Vec<f32> = s.get(0).unwrap().to_vec1().unwrap();
        let z: f32 = [1f32, 2.0, 3.0].iter().map(|v| v.exp()).sum();
        assert!((row0[2] - 3f32.exp() / z).abs() < 1e-6);
        let row1: Vec<f32> = s.get(1).unwrap().to_vec1().unwrap();
        assert!((row1.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn rms_norm_matches_definition_and_gemma_offset() {
        let x = Tensor::new(&[[3f32, 4.0]], &Device::Cpu).unwrap();
        let w = Tensor::new(&[2f32, 0.5], &Device::Cpu).unwrap();
        // rms = sqrt((9 + 16) / 2)
        let rms = (12.5f32).sqrt();
        let y = rms_norm(&x, &w, 0.0, false).unwrap();
        close(
            &y,
            &Tensor::new(&[[6.0 / rms, 2.0 / rms]], &Device::Cpu).unwrap(),
            1e-6,
        );
        let y = rms_norm(&x, &w, 0.0, true).unwrap();
        close(
            &y,
            &Tensor::new(&[[9.0 / rms, 6.0 / rms]], &Device::Cpu).unwrap(),
            1e-6,
        );
    }

    /// The whole point of these ops: gradients flow. Checked against central finite differences.
    #[test]
    fn gradients_flow_through_norm_softmax_and_rope() {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 2, 3, 4), &dev).unwrap()).unwrap();
        let w = Var::from_tensor(&Tensor::randn(1f32, 0.1, 4, &dev).unwrap()).unwrap();
        let cos = Tensor::randn(0f32, 1.0, (1, 1, 3, 4), &dev).unwrap();
        let sin = Tensor::randn(0f32, 1.0, (1, 1, 3, 4), &dev).unwrap();
        let probe = Tensor::randn(0f32, 1.0, (1, 2, 3, 4), &dev).unwrap();
        let f = |x: &Tensor, w: &Tensor| -> Tensor {
            let h = rms_norm(x, w, 1e-6, false).unwrap();
            let h = apply_rope(&h, &cos, &sin).unwrap();
            let h = softmax_last_dim(&h).unwrap();
            (h * &probe).unwrap().sum_all().unwrap()
        };
        let loss = f(x.as_tensor(), w.as_tensor());
        let grads = loss.backward().unwrap();
        let gx: Vec<f32> = grads
            .get(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let gw: Vec<f32> = grads.get(&w).unwrap().to_vec1().unwrap();
        let xv: Vec<f32> = x.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let wv: Vec<f32> = w.as_tensor().to_vec1().unwrap();
        let eps = 1e-2f32;
        for i in [0usize, 5, 11, 23] {
            let mut p = xv.clone();
            p[i] += eps;
            let mut m = xv.clone();
            m[i] -= eps;
            let tp = Tensor::from_vec(p, (1, 2, 3, 4), &dev).unwrap();
            let tm = Tensor::from_vec(m, (1, 2, 3, 4), &dev).unwrap();
            let num = (f(&tp, w.as_tensor()).to_scalar::<f32>().unwrap()
                - f(&tm, w.as_tensor()).to_scalar::<f32>().unwrap())
                / (2.0 * eps);
            assert!(
                (num - gx[i]).abs() < 2e-2,
                "x[{i}]: numeric {num} vs {}",
                gx[i]
            );
        }
        for i in 0..4 {
            let mut p = wv.clone();
            p[i] += eps;
            let mut m = wv.clone();
            m[i] -= eps;
            let tp = Tensor::from_vec(p, 4, &dev).unwrap();
            let tm = Tensor::from_vec(m, 4, &dev).unwrap();
            let num = (f(x.as_tensor(), &tp).to_scalar::<f32>().unwrap()
                - f(x.as_tensor(), &tm).to_scalar::<f32>().unwrap())
                / (2.0 * eps);
            assert!(
                (num - gw[i]).abs() < 2e-2,
                "w[{i}]: numeric {num} vs {}",
                gw[i]
            );
        }
    }

    #[test]
    fn partial_rope_leaves_the_tail_untouched() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (1, 1, 2, 6), &dev).unwrap();
        let cos = Tensor::randn(0f32, 1.0, (1, 1, 2, 4), &dev).unwrap();
        let sin = Tensor::randn(0f32, 1.0, (1, 1, 2, 4), &dev).unwrap();
        let y = apply_rope(&x, &cos, &sin).unwrap();
        close(
            &y.narrow(3, 4, 2).unwrap(),
            &x.narrow(3, 4, 2).unwrap(),
            0.0,
        );
    }
}
