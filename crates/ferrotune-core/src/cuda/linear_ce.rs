//! The output head and the summed cross-entropy on the GPU, in chunks of rows: for each chunk the
//! logits are one cuBLAS GEMM, a kernel turns them in place into the per-row loss and
//! `softmax − onehot`, and two (three with a trained head) more GEMMs give the gradients. As on the
//! CPU, the loss is the graph's last node, so its gradients are formed in the forward pass and the
//! backward only scales them; no `[tokens, vocab]` logits exist beyond one chunk.

use std::sync::{Arc, Mutex};

use candle_core::cuda::CudaStorage;
use candle_core::{bail, DType, Layout, Result, Shape, Tensor};

use super::{clone_storage, cuda_device, empty, launch, ptr, stride_grid, suffix, Arg, Forward};
// `Grads` here names the head's saved gradients.
use crate::custom_op::{Cuda, CudaOp, Grads as InputGrads};

/// Logit elements per chunk (`rows × vocab`): 2²⁸ is 512 MiB in bf16.
const CHUNK_LOGITS: usize = 1 << 28;

/// Rows per chunk; `FERROTUNE_CE_CHUNK_ROWS` overrides it (the tests use it to cover several
/// chunks with a small vocabulary).
fn chunk_rows(vocab: usize) -> usize {
    crate::switch::CE_CHUNK_ROWS
        .count()
        .unwrap_or(CHUNK_LOGITS / vocab.max(1))
}

/// [`crate::fused::linear_cross_entropy_sum`] for CUDA tensors: `hidden` `[n, h]`, `weight`
/// `[vocab, h]`, and the `(row, target)` pairs that count (validated by the caller).
pub(crate) fn linear_cross_entropy_sum(
    hidden: &Tensor,
    weight: &Tensor,
    rows: &[(usize, usize)],
) -> Result<Tensor> {
    let dev = cuda_device(hidden)?;
    let (n, h) = hidden.dims2()?;
    let (vocab, _) = weight.dims2()?;
    let dtype = hidden.dtype();
    let trained = weight.track_op();
    let m = rows.len();
    if m == 0 {
        return Tensor::zeros((), DType::F32, hidden.device());
    }
    let x = hidden.detach().contiguous()?;
    let w = weight.detach().contiguous()?;
    // Few rows without a target (the last position of each sequence): run the head over all rows
    // and let the kernel zero those rows. Many (masked prompts): gather the rows with a target.
    let dense = (n - m) * 4 <= n;
    let (xs, target_ids) = if dense {
        let mut t = vec![u32::MAX; n];
        for &(i, tg) in rows {
            t[i] = tg as u32;
        }
        (x.clone(), t)
    } else {
        let index = Tensor::from_vec(
            rows.iter().map(|&(i, _)| i as u32).collect::<Vec<_>>(),
            m,
            hidden.device(),
        )?;
        (
            x.index_select(&index, 0)?,
            rows.iter().map(|&(_, t)| t as u32).collect(),
        )
    };
    let m = target_ids.len();
    let targets = Tensor::from_vec(target_ids, m, hidden.device())?;
    let losses = empty(&dev, DType::F32, m)?;
    let dw = if trained {
        Some(Tensor::zeros((vocab, h), DType::F32, hidden.device())?)
    } else {
        None
    };
    let chunk = chunk_rows(vocab).clamp(1, m);
    let mut dxs = Vec::with_capacity(m.div_ceil(chunk));
    for c0 in (0..m).step_by(chunk) {
        let c = chunk.min(m - c0);
        let xc = xs.narrow(0, c0, c)?;
        let logits = xc.matmul(&w.t()?)?;
        launch(
            &dev,
            &format!("ce_fwd_bwd_{}", suffix(dtype)?),
            (c as u32, 1),
            1024,
            0,
            &[
                Arg::Ptr(ptr(&logits)?),
                Arg::Ptr(ptr(&targets)? + (c0 * 4) as u64),
                Arg::Ptr(ptr(&losses)? + (c0 * 4) as u64),
                Arg::I32(vocab as i32),
            ],
        )?;
        // `logits` now holds d(sum)/d(logits).
        dxs.push(logits.matmul(&w)?);
        if let Some(dw) = &dw {
            let part = logits.t()?.matmul(&xc)?;
            launch(
                &dev,
                &format!("add_rows_{}", suffix(dtype)?),
                (stride_grid(vocab * h), 1),
                256,
                0,
                &[
                    Arg::Ptr(ptr(dw)?),
                    Arg::Ptr(ptr(&part)?),
                    Arg::I32(1),
                    Arg::I64((vocab * h) as i64),
                    Arg::I64(0),
                    Arg::I64(0),
                ],
            )?;
        }
    }
    let loss = losses.sum_all()?;
    let dxs = if dxs.len() == 1 {
        dxs.remove(0)
    } else {
        Tensor::cat(&dxs, 0)?
    };
    let dx = if dense {
        dxs
    } else {
        let dx = Tensor::zeros((n, h), dtype, hidden.device())?;
        let index = Tensor::from_vec(
            rows.iter().map(|&(i, _)| i as u32).collect::<Vec<_>>(),
            rows.len(),
            hidden.device(),
        )?;
        launch(
            &dev,
            &format!("scatter_rows_{}", suffix(dtype)?),
            (stride_grid(m * h), 1),
            256,
            0,
            &[
                Arg::Ptr(ptr(&dx)?),
                Arg::Ptr(ptr(&dxs)?),
                Arg::Ptr(ptr(&index)?),
                Arg::I64(m as i64),
                Arg::I32(h as i32),
            ],
        )?;
        dx
    };
    if !hidden.track_op() && !trained {
        return Ok(loss);
    }
    let grads = Grads {
        loss: Mutex::new(Some(loss)),
        dx,
        dw: dw.map(|t| t.to_dtype(weight.dtype())).transpose()?,
    };
    if trained {
        hidden.apply_op2_arc(weight, Arc::new(Box::new(Cuda(TrainedHead(grads)))))
    } else {
        hidden.apply_op1_arc(Arc::new(Box::new(Cuda(FrozenHead(grads)))))
    }
}

/// The loss (handed over by `cuda_fwd`) and its gradients for a unit upstream gradient.
struct Grads {
    loss: Mutex<Option<Tensor>>,
    dx: Tensor,
    dw: Option<Tensor>,
}

impl Grads {
    fn take_loss(&self) -> Result<(CudaStorage, Shape)> {
        let loss = self.loss.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(loss) = loss else {
            bail!("linear_cross_entropy_sum: forward ran twice")
        };
        Ok((clone_storage(&loss)?, Shape::from(())))
    }

    /// `g · t` for the scalar upstream gradient `g`, without a host round trip.
    fn scaled(t: &Tensor, grad: &Tensor) -> Result<Tensor> {
        t.broadcast_mul(&grad.to_dtype(t.dtype())?)
    }
}

struct FrozenHead(Grads);

impl CudaOp<1> for FrozenHead {
    const NAME: &'static str = "cuda-linear-cross-entropy";
    const WHAT: &'static str = "linear_cross_entropy_sum";

    fn forward(&self, _: [&CudaStorage; 1], _: [&Layout; 1]) -> Forward {
        self.0.take_loss()
    }

    fn backward(&self, _: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> InputGrads<1> {
        Ok([Some(Grads::scaled(&self.0.dx, grad)?)])
    }
}

struct TrainedHead(Grads);

impl CudaOp<2> for TrainedHead {
    const NAME: &'static str = "cuda-trained-linear-cross-entropy";
    const WHAT: &'static str = "linear_cross_entropy_sum";

    fn forward(&self, _: [&CudaStorage; 2], _: [&Layout; 2]) -> Forward {
        self.0.take_loss()
    }

    fn backward(&self, _: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> InputGrads<2> {
        let dw = self
            .0
            .dw
            .as_ref()
            .map(|t| Grads::scaled(t, grad))
            .transpose()?;
        Ok([Some(Grads::scaled(&self.0.dx, grad)?), dw])
    }
}
