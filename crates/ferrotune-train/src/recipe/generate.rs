//! `generate`: torchtune's config-driven generation recipe (`tune run generate --config ...`).
//!
//! Keys: `checkpointer.checkpoint_dir` (+ `checkpoint_files`, `adapter_checkpoint`),
//! `tokenizer.path`, `prompt` (a string, used as is, or `{system, user}` formatted with the
//! tokenizer's chat template), `max_new_tokens`, `temperature`, `top_k`, `top_p`, `seed`, `device`,
//! `dtype`, `enable_kv_cache` (ferrotune always caches: same tokens, less work), `quantizer`
//! (null, or torchao's 8da4w quantizer for a `quantize` recipe's checkpoint, which runs as
//! torchao's int8-activation / int4-weight layers).

use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use ferrotune_data::ChatMessage;
use ferrotune_infer::generate::{generate, GenerationOptions};
use ferrotune_infer::sampling::SamplingOptions;
use ferrotune_infer::TextStream;

use crate::config::Config;
use crate::metrics::peak_rss_mb;
use crate::recipe::setup;

/// Runs the generation recipe and prints the prompt and its continuation.
pub fn run(cfg: &Config) -> Result<()> {
    setup::quantizer_mode(cfg)?;
    let device = setup::device(cfg)?;
    let dtype = setup::dtype(cfg)?;
    let location = setup::checkpoint_path(cfg)?;
    let path = location.path.clone();
    let tok = setup::tokenizer(cfg, &path)?;
    let prompt_ids = match cfg.get("prompt") {
        None => bail!("{}: 'prompt' is required", cfg.origin),
        Some(serde_json::Value::String(text)) => tok.encode(text, true)?,
        Some(serde_json::Value::Object(m)) => {
            let mut msgs = Vec::new();
            if let Some(s) = m.get("system").and_then(|v| v.as_str()) {
                msgs.push(ChatMessage::system(s));
            }
            // A string, or torchtune's generate_v2 form `{text: ...}`.
            let user = m
                .get("user")
                .and_then(|v| {
                    v.as_str()
                        .or_else(|| v.get("text").and_then(|t| t.as_str()))
                })
                .ok_or_else(|| {
                    anyhow!(
                        "{}: prompt.user is required: a string or {{text: ...}}",
                        cfg.origin
                    )
                })?;
            if m.get("user").and_then(|u| u.get("image")).is_some() {
                bail!(
                    "{}: prompt.user.image: images are not supported (text models only)",
                    cfg.origin
                );
            }
            msgs.push(ChatMessage::user(user));
            tok.encode_chat(&msgs, true)?
        }
        Some(_) => bail!(
            "{}: 'prompt' must be a string or a mapping with system/user",
            cfg.origin
        ),
    };
    if prompt_ids.is_empty() {
        bail!("{}: the prompt encodes to no tokens", cfg.origin);
    }
    let t0 = Instant::now();
    let (mut model, _) = location.load(dtype, &device)?;
    model
        .config
        .require_language_model()
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    setup::check_model_component(cfg, &model.config)?;
    setup::check_quantized(cfg, &model, &path)?;
    // A QLoRA adapter is scored on the NF4 base it was trained on (the config's builder says).
    if let Some(line) = setup::quantize_base_if_asked(cfg, &mut model)? {
        eprintln!("{line}");
    }
    if let Some(dir) = cfg.path("checkpointer.adapter_checkpoint")? {
        ferrotune_models::peft::load_adapter(&mut model, &dir)?;
    }
    eprintln!("Model loaded in {:.1}s", t0.elapsed().as_secs_f64());
    let eos = setup::stop_ids(&tok, &model.config);
    let temperature = cfg.f64("temperature")?.unwrap_or(0.6);
    let opts = GenerationOptions {
        max_new_tokens: cfg.usize("max_new_tokens")?.unwrap_or(300),
        sampling: SamplingOptions {
            temperature,
            top_k: cfg.usize("top_k")?,
            top_p: cfg.f64("top_p")?,
            repetition_penalty: 1.0,
            seed: cfg.usize("seed")?.unwrap_or(0) as u64,
        },
        eos_token_ids: eos.clone(),
        stop_strings: Vec::new(),
        ignore_eos: false,
        pad_token_id: setup::pad_id(&tok, &model.config),
    };
    let decode = |ids: &[u32]| tok.decode(ids, false).unwrap_or_default();
    print!("{}", tok.decode(&prompt_ids, true)?);
    let mut stream = TextStream::new(&tok, &eos);
    let mut on_token = |_row: usize, id: u32| stream.push(id);
    let t1 = Instant::now();
    let out = generate(&model, &[prompt_ids], &opts, &decode, &mut on_token)?;
    println!();
    let secs = t1.elapsed().as_secs_f64();
    let n = out.new_token_ids[0].len();
    eprintln!(
        "Time for inference: {secs:.2} sec total, {:.2} tokens/sec",
        n as f64 / secs.max(1e-9)
    );
    eprintln!("Memory used: {:.2} GB", peak_rss_mb() / 1024.0);
    Ok(())
}
