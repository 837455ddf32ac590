//! PPO's passes over full sequences: the attention layout of padded rows, the policy's log
//! probabilities, the value model's estimates and the reward model's scores, back-propagation
//! from the final hidden states, and the trajectory built from them.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use ferrotune_models::{AttentionLayout, CausalLm};

use crate::loss::log_softmax;
use crate::rlhf;
use crate::step::{absorb, checkpointed_backward};

use super::{PpoModels, PpoSettings, Trajectory};

/// The attention layout of full sequences in which `pad` marks padding (torchtune's causal mask
/// and position ids from the padding mask): pad keys are masked, positions count real tokens.
pub(crate) fn padded_layout(rows: &[Vec<u32>], pad: u32) -> AttentionLayout {
    let key_valid: Vec<Vec<bool>> = rows
        .iter()
        .map(|r| r.iter().map(|&t| t != pad).collect())
        .collect();
    let positions = key_valid
        .iter()
        .map(|valid| {
            let mut seen = 0u32;
            valid
                .iter()
                .map(|&v| {
                    seen += v as u32;
                    if v {
                        seen - 1
                    } else {
                        0
                    }
                })
                .collect()
        })
        .collect();
    AttentionLayout {
        positions,
        key_valid,
        segments: None,
    }
}

pub(crate) fn ids_tensor(rows: &[Vec<u32>], device: &Device) -> Result<Tensor> {
    let width = rows.first().map_or(0, Vec::len);
    Ok(Tensor::from_vec(
        rows.concat(),
        (rows.len(), width),
        device,
    )?)
}

/// The positions of full-sequence hidden states `[rows, seq, hidden]` that predict the response
/// tokens: `context_length - 1 ..`, without the last (torchtune's
/// `truncate_sequence_for_logprobs`).
fn response_positions(hidden: &Tensor, ctx: usize) -> Result<Tensor> {
    let total = hidden.dim(1)?;
    Ok(hidden.narrow(1, ctx - 1, total - ctx)?)
}

/// `log softmax(logits / temperature)` of each response token (`[rows, response]`, f32) from the
/// model's final hidden states over the full sequences (differentiable when they are).
pub(crate) fn logprobs_from_hidden(
    model: &CausalLm,
    hidden: &Tensor,
    rows: &[Vec<u32>],
    ctx: usize,
    temperature: f64,
) -> Result<Tensor> {
    let h = response_positions(hidden, ctx)?;
    let logits = (model.logits(&h)?.to_dtype(DType::F32)? / temperature)?;
    let logp = log_softmax(&logits)?;
    let targets: Vec<u32> = rows.iter().flat_map(|r| r[ctx..].iter().copied()).collect();
    let (b, len) = (rows.len(), rows[0].len() - ctx);
    let index = Tensor::from_vec(targets, (b, len, 1), hidden.device())?;
    Ok(logp.gather(&index, D::Minus1)?.squeeze(D::Minus1)?)
}

/// The value model's estimate at each response token (`[rows, response]`, f32) from its final
/// hidden states over the full sequences.
pub(super) fn values_from_hidden(model: &CausalLm, hidden: &Tensor, ctx: usize) -> Result<Tensor> {
    let out = model
        .logits(&response_positions(hidden, ctx)?)?
        .to_dtype(DType::F32)?;
    Ok(out.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?)
}

/// The final hidden states of `rows` (padding marked by `pad`).
fn full_hidden(model: &CausalLm, rows: &[Vec<u32>], pad: u32) -> Result<Tensor> {
    let ids = ids_tensor(rows, model.device())?;
    Ok(model.forward_hidden(&ids, &padded_layout(rows, pad), None)?)
}

/// `log softmax(logits / temperature)` of each response token (`[rows, response]`, f32;
/// differentiable when the model trains).
pub fn response_logprobs(
    model: &CausalLm,
    rows: &[Vec<u32>],
    ctx: usize,
    pad: u32,
    temperature: f64,
) -> Result<Tensor> {
    logprobs_from_hidden(
        model,
        &full_hidden(model, rows, pad)?,
        rows,
        ctx,
        temperature,
    )
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

/// Back-propagates the loss `head` computes from `model`'s final hidden states over `rows` into
/// `acc` for `params`, with activation checkpointing when asked.
pub(crate) fn backward_from_hidden(
    model: &CausalLm,
    rows: &[Vec<u32>],
    pad: u32,
    checkpointing: bool,
    params: &[(String, Var)],
    acc: &mut candle_core::backprop::GradStore,
    head: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<()> {
    if checkpointing {
        let ids = ids_tensor(rows, model.device())?;
        checkpointed_backward(model, &ids, &padded_layout(rows, pad), params, acc, head)?;
    } else {
        let loss = head(&full_hidden(model, rows, pad)?)?;
        absorb(acc, &loss.backward()?, params)?;
    }
    Ok(())
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

pub(crate) fn host(t: &Tensor) -> Result<Vec<Vec<f32>>> {
    Ok(t.detach().to_dtype(DType::F32)?.to_vec2()?)
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
    let ctx = prompts.first().map_or(0, Vec::len);
    if ctx == 0 || prompts.iter().any(|p| p.len() != ctx) {
        bail!("PPO: prompts must be left-padded to one non-zero length");
    }
    let query_responses: Vec<Vec<u32>> = prompts
        .iter()
        .zip(responses)
        .map(|(p, r)| [p.as_slice(), r].concat())
        .collect();
    let pad = s.pad_id;
    let mut logprobs = host(&response_logprobs(
        models.policy,
        &query_responses,
        ctx,
        pad,
        s.temperature,
    )?)?;
    let mut ref_logprobs = host(&response_logprobs(
        models.reference,
        &query_responses,
        ctx,
        pad,
        s.temperature,
    )?)?;
    let mut values = host(&response_values(models.value, &query_responses, ctx, pad)?)?;
    let mut cut = responses.to_vec();
    let response_padding = rlhf::truncate_at_first_stop(&mut cut, &s.stop_token_ids, pad);
    let seq_lens: Vec<usize> = response_padding
        .iter()
        .map(|p| rlhf::last_kept_index(p))
        .collect();
    // The reward model reads the sequence up to the last kept token; what follows it cannot
    // change that position's output (causal attention), so the uncut sequence serves.
    let at: Vec<usize> = seq_lens.iter().map(|l| l + ctx).collect();
    let mut scores = reward_scores(models.reward, &query_responses, &at, pad)?;
    if s.penalise_no_eos || s.min_response_length.is_some() {
        let penalised = rlhf::reward_penalty_mask(
            &response_padding,
            &seq_lens,
            s.penalise_no_eos,
            s.min_response_length,
        );
        for (score, p) in scores.iter_mut().zip(penalised) {
            if p {
                *score = s.reward_penalty;
            }
        }
    }
    for (r, mask) in response_padding.iter().enumerate() {
        for (i, &m) in mask.iter().enumerate() {
            if m {
                logprobs[r][i] = 1.0;
                ref_logprobs[r][i] = 1.0;
            }
        }
    }
    let value_seq_idxs = rlhf::value_indices(&seq_lens, s.max_generated_tokens);
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
        query_responses,
        context_length: ctx,
        logprobs,
        ref_logprobs,
        values,
        response_padding,
        value_padding,
        value_seq_idxs,
        scores,
        seq_lens,
    })
}
