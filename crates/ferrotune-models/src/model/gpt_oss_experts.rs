//! How gpt-oss's fused expert weights are held and fetched ([`ExpertWeight`]): dense, or kept as
//! the checkpoint's MXFP4 blocks (QLoRA's frozen base, [`Mxfp4Experts`]) and dequantized per
//! expert, only for the experts a batch routes to, in the forward and again in the backward.

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::{DType, Result as CResult, Tensor};
use ferrotune_core::frozen;

use super::{CausalLm, FeedForward};
use crate::mxfp4::Mxfp4Experts;

/// One of gpt-oss's fused expert weights `[experts, in, out]` (`mlp.experts.gate_up_proj`,
/// `mlp.experts.down_proj`).
#[derive(Debug, Clone)]
pub enum ExpertWeight {
    /// The dense parameter in the model's dtype (trainable in full fine-tuning).
    Dense(Tensor),
    /// The checkpoint's MXFP4 blocks and scales, frozen: as transformers'
    /// `Mxfp4Config(dequantize=False)` keeps them, each expert expanded for its product.
    Mxfp4(Arc<Mxfp4Experts>),
}

impl ExpertWeight {
    /// The dense parameter, when the weight is one.
    pub fn as_dense(&self) -> Option<&Tensor> {
        match self {
            Self::Dense(w) => Some(w),
            Self::Mxfp4(_) => None,
        }
    }

    /// As [`ExpertWeight::as_dense`], mutable.
    pub fn as_dense_mut(&mut self) -> Option<&mut Tensor> {
        match self {
            Self::Dense(w) => Some(w),
            Self::Mxfp4(_) => None,
        }
    }

    /// The whole weight `[experts, in, out]` as a dense tensor (an MXFP4 one dequantized, a new
    /// tensor each call).
    pub fn dense(&self) -> CResult<Cow<'_, Tensor>> {
        match self {
            Self::Dense(w) => Ok(Cow::Borrowed(w)),
            Self::Mxfp4(q) => Ok(Cow::Owned(q.dense()?)),
        }
    }

    /// `(experts, in, out)`.
    pub fn dims3(&self) -> CResult<(usize, usize, usize)> {
        match self {
            Self::Dense(w) => w.dims3(),
            Self::Mxfp4(q) => Ok(q.dims3()),
        }
    }

    /// The dtype of the values.
    pub fn dtype(&self) -> DType {
        match self {
            Self::Dense(w) => w.dtype(),
            Self::Mxfp4(q) => q.dtype(),
        }
    }

    /// Bytes held.
    pub fn size_in_bytes(&self) -> usize {
        match self {
            Self::Dense(w) => w.elem_count() * w.dtype().size_in_bytes(),
            Self::Mxfp4(q) => q.size_in_bytes(),
        }
    }

    /// Expert `e`'s dense weight `[in, out]`.
    pub fn expert(&self, e: usize) -> CResult<Tensor> {
        match self {
            Self::Dense(w) => w.get(e),
            Self::Mxfp4(q) => q.expert_rows(e)?.t(),
        }
    }

    /// `rows · W_e` for expert `e`'s rows `[m, in]`. A trained dense weight's product is an
    /// ordinary one (its gradient reaches the parameter), a frozen one's takes no gradient for
    /// the weight; an MXFP4 expert is dequantized for the product and
    /// again for the input's gradient, and the graph keeps only the packed bytes.
    pub fn matmul(&self, rows: &Tensor, e: usize) -> CResult<Tensor> {
        match self {
            // A frozen weight under trained rows (LoRA) goes through `frozen_matmul`, read in
            // place: candle's matmul would also compute (and hold until the step's end) a
            // gradient for the weight that nothing uses.
            Self::Dense(w) => {
                let w = w.get(e)?;
                if rows.track_op() && !w.track_op() {
                    frozen::frozen_matmul(rows, &w.t()?)
                } else {
                    rows.matmul(&w)
                }
            }
            Self::Mxfp4(q) => {
                let q = q.clone();
                frozen::frozen_matmul_made(rows, Arc::new(move || q.expert_rows(e)))
            }
        }
    }
}

/// What a model holds as MXFP4 experts ([`CausalLm::mxfp4_experts`]); displays as "N gpt-oss
/// expert weights kept as MXFP4 (X MB, Y MB dequantized)".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mxfp4Summary {
    /// Fused expert weights held packed.
    pub weights: usize,
    /// Their blocks' and scales' bytes.
    pub packed_bytes: usize,
    /// Their bytes dequantized into the model's dtype.
    pub dense_bytes: usize,
}

impl std::fmt::Display for Mxfp4Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} gpt-oss expert weights kept as MXFP4 ({:.1} MB, {:.1} MB dequantized)",
            self.weights,
            self.packed_bytes as f64 / 1e6,
            self.dense_bytes as f64 / 1e6
        )
    }
}

impl CausalLm {
    /// The gpt-oss expert weights held as MXFP4 ([`ExpertWeight::Mxfp4`]), counted.
    pub fn mxfp4_experts(&self) -> Mxfp4Summary {
        let mut s = Mxfp4Summary {
            weights: 0,
            packed_bytes: 0,
            dense_bytes: 0,
        };
        for layer in &self.layers {
            if let FeedForward::GptOss(moe) = &layer.mlp {
                for (_, w) in moe.packed_experts() {
                    if let ExpertWeight::Mxfp4(q) = w {
                        s.weights += 1;
                        s.packed_bytes += q.size_in_bytes();
                        s.dense_bytes += q.dense_bytes();
                    }
                }
            }
        }
        s
    }
}
