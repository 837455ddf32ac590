//! A linear layer's base weight `[out, in]`: a dense tensor, or QLoRA's NF4 blocks. The model's
//! layers hold it, and the frozen-weight ops (`frozen`, `fused::lora_linear`) keep it for their
//! backward: an NF4 weight is expanded for each product and dropped after it, so an autograd graph
//! keeps only the 4-bit copy alive.

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::{bail, DType, Device, Result, Tensor};

use crate::nf4::Nf4Matrix;

/// A base weight, `[out, in]`.
#[derive(Debug, Clone)]
pub enum BaseWeight {
    /// A dense matrix in the model's dtype (trainable in full fine-tuning).
    Dense(Tensor),
    /// QLoRA's frozen base: 4-bit NF4 blocks (torchao's format), expanded to the dtype for each
    /// product and dropped after it.
    Nf4(Arc<Nf4Matrix>),
}

impl From<&Tensor> for BaseWeight {
    fn from(weight: &Tensor) -> Self {
        Self::Dense(weight.clone())
    }
}

impl From<&Arc<Nf4Matrix>> for BaseWeight {
    fn from(weight: &Arc<Nf4Matrix>) -> Self {
        Self::Nf4(weight.clone())
    }
}

impl BaseWeight {
    /// The dense matrix, when the weight is one.
    pub fn as_dense(&self) -> Option<&Tensor> {
        match self {
            Self::Dense(w) => Some(w),
            Self::Nf4(_) => None,
        }
    }

    /// The dense matrix to change in place; an NF4 weight is frozen and cannot be.
    pub fn as_dense_mut(&mut self) -> Result<&mut Tensor> {
        match self {
            Self::Dense(w) => Ok(w),
            Self::Nf4(_) => bail!("an NF4 (QLoRA) base weight is frozen"),
        }
    }

    /// The values as a dense tensor: the matrix itself, or the NF4 blocks dequantized (a new
    /// tensor each call).
    pub fn dense(&self) -> Result<Cow<'_, Tensor>> {
        match self {
            Self::Dense(w) => Ok(Cow::Borrowed(w)),
            Self::Nf4(q) => Ok(Cow::Owned(q.dequantize()?)),
        }
    }

    /// The same weight with a dense matrix made contiguous (as the ops read it).
    pub fn contiguous(self) -> Result<Self> {
        Ok(match self {
            Self::Dense(w) => Self::Dense(w.contiguous()?),
            nf4 => nf4,
        })
    }

    /// `(out, in)`.
    pub fn dims2(&self) -> Result<(usize, usize)> {
        match self {
            Self::Dense(w) => w.dims2(),
            Self::Nf4(q) => Ok(q.dims()),
        }
    }

    /// The dtype the values have (an NF4 weight dequantizes to the dtype it was quantized from).
    pub fn dtype(&self) -> DType {
        match self {
            Self::Dense(w) => w.dtype(),
            Self::Nf4(q) => q.dtype(),
        }
    }

    /// Where the values live.
    pub fn device(&self) -> &Device {
        match self {
            Self::Dense(w) => w.device(),
            Self::Nf4(q) => q.device(),
        }
    }

    /// Whether the weight is being trained (a `Var` of full fine-tuning); NF4 never is.
    pub fn track_op(&self) -> bool {
        self.as_dense().is_some_and(|w| w.track_op())
    }

    /// Bytes held.
    pub fn size_in_bytes(&self) -> usize {
        match self {
            Self::Dense(w) => w.elem_count() * w.dtype().size_in_bytes(),
            Self::Nf4(q) => q.size_in_bytes(),
        }
    }

    /// The same weight on `device`.
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        Ok(match self {
            Self::Dense(w) => Self::Dense(w.to_device(device)?),
            Self::Nf4(q) => Self::Nf4(Arc::new(q.to_device(device)?)),
        })
    }
}
