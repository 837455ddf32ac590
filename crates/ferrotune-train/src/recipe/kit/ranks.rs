//! What a data-parallel RL recipe computes over its ranks: gradients averaged (DDP's
//! all-reduce) and statistics of values every rank holds part of.

use anyhow::Result;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use crate::dist::comm::Collectives;

/// Averages the gradients of `params` over the ranks (DDP's all-reduce, as one flat bucket):
/// each rank's loss is the mean over its rows, so with the same rows on every rank the average
/// is the gradient of the loss of all the ranks' rows. Every rank gets the same bits.
pub fn average_grads(
    comm: &dyn Collectives,
    params: &[(String, Var)],
    grads: &mut GradStore,
) -> Result<()> {
    let Some((_, first)) = params.first() else {
        return Ok(());
    };
    let device = first.device().clone();
    let flat: Vec<Tensor> = params
        .iter()
        .map(|(_, v)| match grads.get(v.as_tensor()) {
            Some(g) => Ok(g.flatten_all()?.to_dtype(DType::F32)?),
            // A parameter the loss did not reach contributes zeros, as in torch.
            None => Ok(Tensor::zeros(v.elem_count(), DType::F32, &device)?),
        })
        .collect::<Result<_>>()?;
    let summed = comm.all_reduce_sum(&Tensor::cat(&flat, 0)?)?;
    let mean = (summed / comm.world_size() as f64)?;
    let mut offset = 0;
    for (_, v) in params {
        let n = v.elem_count();
        let g = mean
            .narrow(0, offset, n)?
            .reshape(v.shape())?
            .to_dtype(v.dtype())?;
        grads.insert(v.as_tensor(), g);
        offset += n;
    }
    Ok(())
}

/// The standard deviation (Bessel's) of every rank's `rewards` together, NaN left out.
pub fn std_over_ranks(c: &dyn Collectives, rewards: &[f32], device: &Device) -> Result<f32> {
    let all_sum = |v: [f32; 2]| -> Result<Vec<f32>> {
        Ok(c.all_reduce_sum(&Tensor::new(&v[..], device)?)?
            .to_vec1::<f32>()?)
    };
    // NaN values (unscorable rows) are left out, as by TRL's `nanstd`.
    let kept = || rewards.iter().filter(|r| !r.is_nan());
    let sum = all_sum([kept().sum(), kept().count() as f32])?;
    let (n, mean) = (sum[1], sum[0] / sum[1]);
    let sq = all_sum([kept().map(|r| (r - mean).powi(2)).sum(), 0.0])?;
    Ok((sq[0] / (n - 1.0)).sqrt())
}
