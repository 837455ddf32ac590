//! How ferrotune's kernels become candle custom ops.
//!
//! A fused CPU kernel implements [`FusedOp`], a CUDA kernel [`CudaOp`]: each says only what it
//! computes (its forward on its inputs' data, its backward with the gradients as an array). The
//! wrappers [`Fused`] and [`Cuda`] implement candle's `CustomOp1`, `CustomOp2` and `CustomOp3` for
//! them, once: candle's signatures, taking a CPU input's data out of its storage, and the error a
//! CUDA kernel gives CPU tensors.

#[cfg(feature = "cuda")]
use candle_core::cuda::CudaStorage;
use candle_core::{CpuStorage, Layout, Result, Shape, Tensor};

use crate::fused::slice_of;

/// What an op's forward returns: the output (f32 data on the CPU, a storage on a GPU) and its
/// shape.
pub(crate) type Forward<S> = Result<(S, Shape)>;

/// What an op's backward returns: each input's gradient (`None` for none).
pub(crate) type Grads<const N: usize> = Result<[Option<Tensor>; N]>;

/// A fused CPU op of `N` f32 inputs, made a candle custom op by [`Fused`].
pub(crate) trait FusedOp<const N: usize>: Send + Sync {
    /// candle's name for the op.
    const NAME: &'static str;
    /// The public function's name, as errors give it.
    const WHAT: &'static str;
    /// The output's data and shape from the inputs' contiguous data and their shapes.
    fn forward(&self, inputs: [&[f32]; N], shapes: [&Shape; N]) -> Forward<Vec<f32>>;
    /// The inputs' gradients from the inputs, the output (`res`) and the output's gradient.
    fn backward(&self, inputs: [&Tensor; N], res: &Tensor, grad: &Tensor) -> Grads<N>;
}

/// A CUDA-only op of `N` inputs, made a candle custom op by [`Cuda`].
#[cfg(feature = "cuda")]
pub(crate) trait CudaOp<const N: usize>: Send + Sync {
    /// candle's name for the op.
    const NAME: &'static str;
    /// The public function's name, as errors give it.
    const WHAT: &'static str;
    /// The output's storage and shape from the inputs' storages and layouts.
    fn forward(&self, inputs: [&CudaStorage; N], layouts: [&Layout; N]) -> Forward<CudaStorage>;
    /// The inputs' gradients from the inputs, the output (`res`) and the output's gradient.
    fn backward(&self, inputs: [&Tensor; N], res: &Tensor, grad: &Tensor) -> Grads<N>;
}

/// A [`FusedOp`] as candle's custom op of as many inputs.
pub(crate) struct Fused<T>(pub T);

/// A [`CudaOp`] as candle's custom op of as many inputs.
#[cfg(feature = "cuda")]
pub(crate) struct Cuda<T>(pub T);

/// What the CPU side of a CUDA-only custom op returns: an error naming the op.
#[cfg(feature = "cuda")]
pub(crate) fn cpu_unsupported<T>(what: &str) -> Result<T> {
    candle_core::bail!("{what}: the CUDA kernel was given CPU tensors")
}

/// `name` and `bwd` of candle's custom-op traits, which both wrappers write alike: `bwd` hands
/// the inputs over as an array and returns the gradients as candle's tuple (for one input, the
/// gradient itself: the parentheses the macro writes are then no tuple).
macro_rules! name_and_bwd {
    ($grads:ty, $($input:ident),+) => {
        fn name(&self) -> &'static str {
            T::NAME
        }

        #[allow(unused_parens)]
        fn bwd(&self, $($input: &Tensor,)+ res: &Tensor, grad: &Tensor) -> Result<$grads> {
            let [$($input),+] = self.0.backward([$($input),+], res, grad)?;
            Ok(($($input),+))
        }
    };
}

/// Implements candle's `$op` for [`Fused`] and [`Cuda`] ops of one input per
/// `($storage, $layout, $input)`.
macro_rules! custom_op {
    ($op:ident, $n:literal, $grads:ty, $(($storage:ident, $layout:ident, $input:ident)),+) => {
        impl<T: FusedOp<$n>> candle_core::$op for Fused<T> {
            name_and_bwd!($grads, $($input),+);

            fn cpu_fwd(
                &self,
                $($storage: &CpuStorage, $layout: &Layout),+
            ) -> Result<(CpuStorage, Shape)> {
                let inputs = [$(slice_of($storage, $layout, T::WHAT)?),+];
                let (out, shape) = self.0.forward(inputs, [$($layout.shape()),+])?;
                Ok((CpuStorage::F32(out), shape))
            }
        }

        #[cfg(feature = "cuda")]
        impl<T: CudaOp<$n>> candle_core::$op for Cuda<T> {
            fn cuda_fwd(
                &self,
                $($storage: &CudaStorage, $layout: &Layout),+
            ) -> Forward<CudaStorage> {
                self.0.forward([$($storage),+], [$($layout),+])
            }

            // The inputs are named only to repeat once per input: the CPU side reads none.
            #[allow(unused_variables)]
            fn cpu_fwd(
                &self,
                $($storage: &CpuStorage, $layout: &Layout),+
            ) -> Result<(CpuStorage, Shape)> {
                cpu_unsupported(T::WHAT)
            }

            name_and_bwd!($grads, $($input),+);
        }
    };
}

custom_op!(CustomOp1, 1, Option<Tensor>, (s1, l1, x1));
custom_op!(
    CustomOp2,
    2,
    (Option<Tensor>, Option<Tensor>),
    (s1, l1, x1),
    (s2, l2, x2)
);
custom_op!(
    CustomOp3,
    3,
    (Option<Tensor>, Option<Tensor>, Option<Tensor>),
    (s1, l1, x1),
    (s2, l2, x2),
    (s3, l3, x3)
);
