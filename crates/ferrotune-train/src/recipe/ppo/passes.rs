//! PPO's passes over full sequences beyond the policy's log probabilities (the kit's
//! [`rollout`](crate::recipe::kit::rollout)): the value model's estimates and the reward model's
//! scores, and the trajectory built from them.

use anyhow::Result;
use candle_core::{DType, Tensor, D};
use ferrotune_models::CausalLm;

use crate::recipe::kit::rollout::{
    context_length, full_hidden, host, response_logprobs, response_positions, Rollout,
};
use crate::rlhf;

use super::{PpoModels, PpoSettings, Trajectory};

/// The value model's estimate at each response token (`[rows, response]`, f32) from its final
/// hidden states over the full sequences.
pub(super) fn values_from_hidden(model: &CausalLm, hidden: &Tensor, ctx: usize) -> Result<Tensor> {
    let out = model
        .logits(&response_positions(hidden, ctx)?)?
        .to_dtype(DType::F32)?;
    Ok(out.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?)
}

/// The value model's estimate at each response token (`[rows, response]`, f32).
pub fn response_values(
    model: &CausalLm,
    rows: &[Vec<u32>],
    ctx: usize,
    pad: u32,
) -> Result<Tensor> {
    values_from_hidden(model, &full_hidden(model, rows, pad)?, ctx)
}

/// Each row's score from the reward model at the token `at[row]` of the full sequence.
fn reward_scores(model: &CausalLm, rows: &[Vec<u32>], at: &[usize], pad: u32) -> Result<Vec<f32>> {
    let hidden = full_hidden(model, rows, pad)?;
    let picked = at
        .iter()
        .enumerate()
        .map(|(r, &i)| hidden.narrow(0, r, 1)?.narrow(1, i, 1))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let scores = model
        .logits(&Tensor::cat(&picked, 0)?)?
        .to_dtype(DType::F32)?;
    Ok(scores.flatten_all()?.to_vec1::<f32>()?)
}

/// Builds the trajectory of `responses` (as generated, `max_generated_tokens` each) to the
/// left-padded `prompts` (torchtune's `generate_trajectory` after its generation call): log
/// probabilities under the policy and the reference, values, responses cut at their first stop
/// token, scores with penalties, and the masks.
pub fn trajectory(
    models: PpoModels<'_>,
    prompts: &[Vec<u32>],
    responses: &[Vec<u32>],
    s: &PpoSettings,
) -> Result<Trajectory> {
    let ctx = context_length(prompts, "PPO")?;
    let query_responses: Vec<Vec<u32>> = prompts
        .iter()
        .zip(responses)
        .map(|(p, r)| [p.as_slice(), r].concat())
        .collect();
    let pad = s.rollout.pad_id;
    let logprobs = host(&response_logprobs(
        models.policy,
        &query_responses,
        ctx,
        pad,
        s.rollout.temperature,
    )?)?;
    let ref_logprobs = host(&response_logprobs(
        models.reference,
        &query_responses,
        ctx,
        pad,
        s.rollout.temperature,
    )?)?;
    let mut values = host(&response_values(models.value, &query_responses, ctx, pad)?)?;
    let rollout = Rollout::cut(
        query_responses,
        ctx,
        logprobs,
        ref_logprobs,
        &mut responses.to_vec(),
        &s.rollout,
    );
    let (response_padding, seq_lens) = (&rollout.response_padding, &rollout.seq_lens);
    // The reward model reads the sequence up to the last kept token; what follows it cannot
    // change that position's output (causal attention), so the uncut sequence serves.
    let at: Vec<usize> = seq_lens.iter().map(|l| l + ctx).collect();
    let mut scores = reward_scores(models.reward, &rollout.query_responses, &at, pad)?;
    if s.penalise_no_eos || s.min_response_length.is_some() {
        let penalised = rlhf::reward_penalty_mask(
            response_padding,
            seq_lens,
            s.penalise_no_eos,
            s.min_response_length,
        );
        for (score, p) in scores.iter_mut().zip(penalised) {
            if p {
                *score = s.reward_penalty;
            }
        }
    }
    let value_seq_idxs = rlhf::value_indices(seq_lens, s.rollout.max_generated_tokens);
    let mut value_padding = response_padding.clone();
    for (r, &i) in value_seq_idxs.iter().enumerate() {
        value_padding[r][i] = false;
        for (v, &m) in values[r].iter_mut().zip(&value_padding[r]) {
            if m {
                *v = 0.0;
            }
        }
    }
    Ok(Trajectory {
        rollout,
        values,
        value_padding,
        value_seq_idxs,
        scores,
    })
}
