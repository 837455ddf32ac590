//! The special token ids generation takes from a tokenizer and its model's config: which tokens
//! end a generated row, which one pads a batch.

use ferrotune_data::Tokenizer;
use ferrotune_models::ModelConfig;

/// The tokens that end a generated row: the tokenizer's EOS tokens, then the model config's
/// (generation_config.json) that the tokenizer does not name.
pub fn stop_ids(tok: &Tokenizer, model: &ModelConfig) -> Vec<u32> {
    let mut eos = tok.eos_ids().to_vec();
    for id in &model.eos_token_ids {
        if !eos.contains(id) {
            eos.push(*id);
        }
    }
    eos
}

/// The token used to pad batches.
pub fn pad_id(tok: &Tokenizer, model: &ModelConfig) -> u32 {
    tok.pad_id()
        .or(model.pad_token_id)
        .or(tok.eos_ids().first().copied())
        .unwrap_or(0)
}
