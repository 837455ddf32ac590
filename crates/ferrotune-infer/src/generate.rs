//! The generation loop: prefill the prompts (left-padded into one batch), then decode one token per
//! step through the KV cache until every row has stopped.

use std::time::Instant;

use candle_core::{DType, Result, Tensor};
use ferrotune_models::{AttentionLayout, CausalLm, KvCache};

use crate::sampling::{Sampler, SamplingOptions};

/// What to generate and when to stop.
#[derive(Debug, Clone)]
pub struct GenerationOptions {
    pub max_new_tokens: usize,
    pub sampling: SamplingOptions,
    /// Any of these ends a row (the eos token is kept in the output ids).
    pub eos_token_ids: Vec<u32>,
    /// Decoded text containing any of these ends a row.
    pub stop_strings: Vec<String>,
    /// Keep going past eos (benchmarks, fixed-length references).
    pub ignore_eos: bool,
    /// Token used to left-pad shorter prompts in a batch.
    pub pad_token_id: u32,
}

/// The result of [`generate`].
#[derive(Debug, Clone)]
pub struct GenerationOutput {
    /// New tokens per prompt (up to and including a stopping eos).
    pub new_token_ids: Vec<Vec<u32>>,
    /// Prompt tokens (all rows, padding excluded) per second of prefill.
    pub prefill_tokens_per_s: f64,
    /// Tokens produced by decode steps (all rows) per second of decoding.
    pub decode_tokens_per_s: f64,
}

/// Generates continuations of `prompts`. `on_token(row, id)` is called for every new token of a
/// row still running; `decode` renders ids to text (used only for stop strings).
pub fn generate(
    model: &CausalLm,
    prompts: &[Vec<u32>],
    opts: &GenerationOptions,
    decode: &dyn Fn(&[u32]) -> String,
    on_token: &mut dyn FnMut(usize, u32),
) -> Result<GenerationOutput> {
    let batch = prompts.len();
    let device = model.device().clone();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    if batch == 0 || longest == 0 {
        candle_core::bail!("generation needs at least one non-empty prompt");
    }
    // Left padding: every row ends at the same column, so each step appends one column.
    let mut ids = Vec::with_capacity(batch * longest);
    let mut key_valid = Vec::with_capacity(batch);
    let mut positions = Vec::with_capacity(batch);
    for p in prompts {
        let pad = longest - p.len();
        ids.extend(std::iter::repeat_n(opts.pad_token_id, pad));
        ids.extend_from_slice(p);
        let mut valid = vec![false; pad];
        valid.extend(std::iter::repeat_n(true, p.len()));
        key_valid.push(valid);
        // Positions count real tokens only (transformers: cumsum(attention_mask) - 1, pads at 1).
        let mut pos: Vec<u32> = vec![1; pad];
        pos.extend(0..p.len() as u32);
        positions.push(pos);
    }
    let input = Tensor::from_vec(ids.clone(), (batch, longest), &device)?;
    // Every column so far (ids and positions), for recomputing the cache.
    let mut all_ids: Vec<Vec<u32>> = ids.chunks(longest).map(<[u32]>::to_vec).collect();
    let mut all_positions = positions.clone();
    let mut cache = KvCache::new(model.layers.len());
    let mut layout = AttentionLayout {
        positions,
        key_valid,
        segments: None,
    };
    let mut sampler = Sampler::new(opts.sampling.clone());
    let mut history: Vec<Vec<u32>> = prompts.to_vec();
    let mut new_tokens: Vec<Vec<u32>> = vec![Vec::new(); batch];
    let mut running = vec![true; batch];

    let start = Instant::now();
    let hidden = model.forward_hidden(&input, &layout, Some(&mut cache))?;
    let mut logits = model.logits(&hidden.narrow(1, longest - 1, 1)?)?;
    let prefill_s = start.elapsed().as_secs_f64();
    let decode_start = Instant::now();
    let mut decode_steps = 0usize;
    for step in 0..opts.max_new_tokens {
        let rows: Vec<Vec<f32>> = logits.squeeze(1)?.to_dtype(DType::F32)?.to_vec2()?;
        let mut next = Vec::with_capacity(batch);
        for (r, mut row) in rows.into_iter().enumerate() {
            if !running[r] {
                next.push(opts.pad_token_id);
                continue;
            }
            let tok = sampler.next(&mut row, &history[r]);
            history[r].push(tok);
            new_tokens[r].push(tok);
            on_token(r, tok);
            let hit_eos = !opts.ignore_eos && opts.eos_token_ids.contains(&tok);
            let hit_stop = !opts.stop_strings.is_empty() && {
                let text = decode(&new_tokens[r]);
                opts.stop_strings.iter().any(|s| text.contains(s.as_str()))
            };
            if hit_eos || hit_stop {
                running[r] = false;
            }
            next.push(tok);
        }
        if !running.iter().any(|&r| r) || step + 1 == opts.max_new_tokens {
            break;
        }
        for (r, &tok) in next.iter().enumerate() {
            all_ids[r].push(tok);
            let last = layout.positions[r].last().copied().unwrap_or(0);
            // A row whose prompt was all padding has no real position yet: its first token is 0.
            let pos = if layout.key_valid[r].iter().any(|&v| v) {
                last + 1
            } else {
                0
            };
            layout.positions[r] = vec![pos];
            all_positions[r].push(pos);
            layout.key_valid[r].push(true);
        }
        debug_assert_eq!(layout.key_valid[0].len(), cache.len() + 1);
        if model.rope_switch_length() == Some(cache.len()) {
            // The sequence outgrows the short rotary embedding with this token: the cached keys
            // were rotated for the short one, so transformers (Phi-3, Phi-3.5-MoE) drops the
            // cache and runs the whole sequence again, and so do we.
            cache = KvCache::new(model.layers.len());
            let width = all_ids[0].len();
            let ids = Tensor::from_vec(all_ids.concat(), (batch, width), &device)?;
            let full = AttentionLayout {
                positions: all_positions.clone(),
                key_valid: layout.key_valid.clone(),
                segments: None,
            };
            let hidden = model.forward_hidden(&ids, &full, Some(&mut cache))?;
            logits = model.logits(&hidden.narrow(1, width - 1, 1)?)?;
        } else {
            let step_ids = Tensor::from_vec(next, (batch, 1), &device)?;
            logits = model.forward(&step_ids, &layout, Some(&mut cache))?;
        }
        decode_steps += 1;
    }
    let decode_s = decode_start.elapsed().as_secs_f64();
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    Ok(GenerationOutput {
        new_token_ids: new_tokens,
        prefill_tokens_per_s: prompt_tokens as f64 / prefill_s.max(1e-9),
        decode_tokens_per_s: (decode_steps * batch) as f64 / decode_s.max(1e-9),
    })
}
