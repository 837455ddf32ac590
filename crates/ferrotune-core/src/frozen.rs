//! `x @ weight.T` for a frozen weight, as an autograd op whose backward gives only `dx`.
//!
//! candle's built-in matmul backward always computes the gradient of *both* operands. For LoRA
//! that means a full `[out, in]` gradient buffer (and a second GEMM of the same size) for every
//! frozen base weight in every step — twice the backward work and gigabytes of memory on an 8B
//! model. This op records only the input in the graph: backward is `dx = dy @ weight`, and the
//! weight never gets a gradient buffer.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Storage, Tensor};

use crate::nf4::Nf4Matrix;
use crate::weight::BaseWeight;

/// Makes a frozen weight `[out, in]` each time the op needs it ([`frozen_matmul_made`]).
pub type MakeWeight = Arc<dyn Fn() -> Result<Tensor> + Send + Sync>;

/// Where the op's weight comes from.
enum Source {
    /// A layer's base weight (an NF4 one is dequantized for each use).
    Base(BaseWeight),
    /// Made for each use (a packed weight the caller knows how to expand).
    Made(MakeWeight),
}

impl Source {
    fn dense(&self) -> Result<std::borrow::Cow<'_, Tensor>> {
        match self {
            Self::Base(w) => w.dense(),
            Self::Made(make) => Ok(std::borrow::Cow::Owned(make()?)),
        }
    }
}

/// The op; holds the weight.
struct FrozenMatmul {
    weight: Source,
}

/// `(m, n, k)` and the transposed weight layout for an `[m, k]` input and a weight `[n, k]`.
fn dims(weight: &Tensor, layout: &Layout) -> Result<((usize, usize, usize), Layout)> {
    let (m, k) = layout.shape().dims2()?;
    let (n, wk) = weight.dims2()?;
    if wk != k {
        candle_core::bail!("frozen matmul: input has {k} features, weight expects {wk}");
    }
    let (_, w_layout) = weight.storage_and_layout();
    Ok(((m, n, k), w_layout.transpose(0, 1)?))
}

impl FrozenMatmul {
    /// The product on the backend `S` the input is on: `weight_on` finds the weight's storage
    /// there (`None`: on another device, an error saying where the input is: `input_on`).
    fn forward<S: BackendStorage>(
        &self,
        storage: &S,
        layout: &Layout,
        weight_on: impl Fn(&Storage) -> Option<&S>,
        input_on: &str,
    ) -> Result<(S, Shape)> {
        let weight = self.weight.dense()?;
        let ((m, n, k), wt_layout) = dims(&weight, layout)?;
        let (w_storage, _) = weight.storage_and_layout();
        let Some(w) = weight_on(&w_storage) else {
            candle_core::bail!("frozen matmul: input {input_on}, weight elsewhere")
        };
        let out = storage.matmul(w, (1, m, n, k), layout, &wt_layout)?;
        Ok((out, Shape::from((m, n))))
    }
}

impl CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward(
            storage,
            layout,
            |s| match s {
                Storage::Cpu(w) => Some(w),
                _ => None,
            },
            "on the CPU",
        )
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.forward(
            storage,
            layout,
            |s| match s {
                Storage::Cuda(w) => Some(w),
                _ => None,
            },
            "on a GPU",
        )
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad_res.matmul(&*self.weight.dense()?)?))
    }
}

/// `rows @ weight.T` for `rows` `[m, in]` and a weight `[out, in]` that takes no gradient.
///
/// Use when `rows` is part of an autograd graph but `weight` is not: the result is the same as
/// `rows.matmul(&weight.t())`, and so is the gradient of `rows`. A weight stored inputs first
/// (`w.t()` of a contiguous `[in, out]`, as gpt-oss's experts) is used as it is, not copied: the
/// products read either layout.
pub fn frozen_matmul(rows: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let weight = if weight.rank() == 2 && weight.t()?.is_contiguous() {
        weight.clone()
    } else {
        weight.contiguous()?
    };
    let op = FrozenMatmul {
        weight: Source::Base(BaseWeight::Dense(weight)),
    };
    rows.contiguous()?.apply_op1_arc(Arc::new(Box::new(op)))
}

/// `rows @ weight.T` for an NF4 weight (QLoRA's frozen base), as torchao's `linear_nf4`: the weight
/// is dequantized to its dtype for the product and again for the backward (`dx = dy @ weight`),
/// never kept, and takes no gradient.
pub fn nf4_matmul(rows: &Tensor, weight: &Arc<Nf4Matrix>) -> Result<Tensor> {
    if !rows.track_op() {
        return rows.matmul(&weight.dequantize()?.t()?);
    }
    let op = FrozenMatmul {
        weight: Source::Base(BaseWeight::Nf4(weight.clone())),
    };
    rows.contiguous()?.apply_op1_arc(Arc::new(Box::new(op)))
}

/// `rows @ weight.T` for a frozen weight `[out, in]` that `make` expands from a packed form (a
/// contiguous tensor each call): expanded for the product and again for the backward
/// (`dx = dy @ weight`), never kept by the graph, and taking no gradient — as [`nf4_matmul`]
/// for any packing.
pub fn frozen_matmul_made(rows: &Tensor, make: MakeWeight) -> Result<Tensor> {
    if !rows.track_op() {
        return rows.matmul(&make()?.t()?);
    }
    let op = FrozenMatmul {
        weight: Source::Made(make),
    };
    rows.contiguous()?.apply_op1_arc(Arc::new(Box::new(op)))
}
