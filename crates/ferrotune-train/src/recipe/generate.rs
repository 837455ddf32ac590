//! `generate`: torchtune's config-driven generation recipe (`tune run generate --config ...`), and
//! its `dev/generate_v2` / `dev/generate_v2_distributed` successors.
//!
//! Keys: `checkpointer.checkpoint_dir` (+ `checkpoint_files`, `adapter_checkpoint`),
//! `tokenizer.path`, `prompt` (a string, used as is, or `{system, user}` formatted with the
//! tokenizer's chat template), `max_new_tokens`, `temperature`, `top_k`, `top_p`, `seed`, `device`,
//! `dtype`, `enable_kv_cache` (ferrotune always caches: same tokens, less work), `quantizer`
//! (null, or torchao's 8da4w quantizer for a `quantize` recipe's checkpoint, which runs as
//! torchao's int8-activation / int4-weight layers).
//!
//! `generate` prints the prompt and its continuation; the v2 recipes print the response alone
//! and log the time, tokens per second and the bandwidth achieved (the model's bytes times tokens
//! per second), as torchtune's `InferenceRecipe`. `dev/generate_v2_distributed` (torchtune's
//! tensor-parallel generation of 70B models over 8 GPUs) runs in one process here and, with
//! `device: cuda`, spreads the decoder layers over every visible GPU as Accelerate's
//! `device_map: auto` does.

use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use ferrotune_data::ChatMessage;
use ferrotune_infer::generate::{generate, GenerationOptions};
use ferrotune_infer::sampling::SamplingOptions;
use ferrotune_infer::{load_for_inference, pad_id, stop_ids, TextStream};
use ferrotune_models::DeviceMapMode;

use crate::config::Config;
use crate::metrics::peak_rss_mb;
use crate::recipe::kit::model::load_options;
use crate::recipe::setup;

/// Which of torchtune's generation recipes runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// `generate`: prints the prompt and its continuation.
    V1,
    /// `dev/generate_v2`: prints the response, logs time and bandwidth.
    V2,
    /// `dev/generate_v2_distributed`: V2 with the model spread over the visible GPUs.
    V2Distributed,
}

/// The prompt, as the config gives it.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// A string, encoded as is (with the tokenizer's BOS).
    Text(String),
    /// `{system, user}` messages, through the chat template with the generation prompt.
    Chat {
        system: Option<String>,
        user: String,
    },
}

/// The recipe's own keys, read and checked once before anything is loaded (what `validate`
/// checks too).
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// A `quantizer` is set: the checkpoint is a `quantize` recipe's output.
    pub quantizer: bool,
    /// `prompt`.
    pub prompt: Prompt,
    /// `max_new_tokens` (default 300).
    pub max_new_tokens: usize,
    /// `temperature` (default 0.6), `top_k`, `top_p` and `seed` (default 0).
    pub sampling: SamplingOptions,
}

impl Settings {
    /// Reads the settings from `cfg`, with run's messages: a `quantizer` a `quantize` checkpoint
    /// runs with (or none), and a prompt of a form the recipe takes.
    pub fn parse(cfg: &Config) -> Result<Settings> {
        let quantizer = setup::quantizer_mode(cfg)?;
        let prompt = match cfg.get("prompt") {
            None => bail!("{}: 'prompt' is required", cfg.origin),
            Some(serde_json::Value::String(text)) => Prompt::Text(text.clone()),
            Some(serde_json::Value::Object(m)) => {
                let system = m.get("system").and_then(|v| v.as_str()).map(str::to_owned);
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
                Prompt::Chat {
                    system,
                    user: user.to_owned(),
                }
            }
            Some(_) => bail!(
                "{}: 'prompt' must be a string or a mapping with system/user",
                cfg.origin
            ),
        };
        let temperature = cfg.f64("temperature")?.unwrap_or(0.6);
        Ok(Settings {
            quantizer,
            prompt,
            max_new_tokens: cfg.usize("max_new_tokens")?.unwrap_or(300),
            sampling: SamplingOptions {
                temperature,
                top_k: cfg.usize("top_k")?,
                top_p: cfg.f64("top_p")?,
                repetition_penalty: 1.0,
                seed: cfg.usize("seed")?.unwrap_or(0) as u64,
            },
        })
    }
}

/// Checks the recipe's own keys without loading anything (for `validate`).
pub fn check(cfg: &Config) -> Result<()> {
    Settings::parse(cfg).map(|_| ())
}

/// The prompt's token ids.
fn prompt_ids(cfg: &Config, prompt: &Prompt, tok: &ferrotune_data::Tokenizer) -> Result<Vec<u32>> {
    let ids = match prompt {
        Prompt::Text(text) => tok.encode(text, true)?,
        Prompt::Chat { system, user } => {
            let mut msgs = Vec::new();
            if let Some(s) = system {
                msgs.push(ChatMessage::system(s));
            }
            msgs.push(ChatMessage::user(user));
            tok.encode_chat(&msgs, true)?
        }
    };
    if ids.is_empty() {
        bail!("{}: the prompt encodes to no tokens", cfg.origin);
    }
    Ok(ids)
}

/// Runs the generation recipe `flavor`.
pub fn run(cfg: &Config, flavor: Flavor) -> Result<()> {
    let settings = Settings::parse(cfg)?;
    let device = setup::device(cfg)?;
    let dtype = setup::dtype(cfg)?;
    let location = setup::checkpoint_path(cfg)?;
    let path = location.path.clone();
    let tok = setup::tokenizer(cfg, &path)?;
    let prompt_ids = prompt_ids(cfg, &settings.prompt, &tok)?;
    let spread = flavor == Flavor::V2Distributed && device.is_cuda();
    let mut opts = load_options(cfg, &location, dtype, device)?;
    opts.device_map = spread.then(|| (DeviceMapMode::Auto, "device: cuda".into()));
    let t0 = Instant::now();
    let model = load_for_inference(&path, &opts, |model| {
        setup::check_model_component(cfg, &model.config)?;
        setup::check_quantized(cfg, settings.quantizer, model, &path)
    })?;
    eprintln!("Model loaded in {:.1}s", t0.elapsed().as_secs_f64());
    let eos = stop_ids(&tok, &model.config);
    let opts = GenerationOptions {
        max_new_tokens: settings.max_new_tokens,
        sampling: settings.sampling,
        eos_token_ids: eos.clone(),
        stop_strings: Vec::new(),
        ignore_eos: false,
        pad_token_id: pad_id(&tok, &model.config),
    };
    let decode = |ids: &[u32]| tok.decode(ids, false).unwrap_or_default();
    if flavor == Flavor::V1 {
        print!("{}", tok.decode(&prompt_ids, true)?);
    }
    let mut stream = TextStream::new(&tok, &eos);
    let mut on_token = |_row: usize, id: u32| stream.push(id);
    let t1 = Instant::now();
    let out = generate(&model, &[prompt_ids], &opts, &decode, &mut on_token)?;
    println!();
    let secs = t1.elapsed().as_secs_f64();
    let n = out.new_token_ids[0].len();
    let tokens_per_second = n as f64 / secs.max(1e-9);
    eprintln!("Time for inference: {secs:.2} sec total, {tokens_per_second:.2} tokens/sec");
    if flavor != Flavor::V1 {
        // torchtune sums the parameters once each: a tied head is the embedding.
        let (layers, (embedding, mut head)) = model.part_bytes();
        if model.config.tie_word_embeddings {
            head = head.saturating_sub(embedding);
        }
        let model_bytes = layers.iter().sum::<u64>() + embedding + head;
        eprintln!(
            "Bandwidth achieved: {:.2} GiB/s",
            model_bytes as f64 * tokens_per_second / (1u64 << 30) as f64
        );
    }
    eprintln!("Memory used: {:.2} GB", peak_rss_mb() / 1024.0);
    Ok(())
}
