//! `ferrotune generate`: load a model, encode the prompt(s), stream the continuation.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use ferrotune_core::{parse_device, parse_dtype};
use ferrotune_data::ChatMessage;
use ferrotune_infer::{
    generate, load_for_inference, pad_id, stop_ids, GenerationOptions, LoadOptions,
    SamplingOptions, TextStream,
};
use ferrotune_models::DeviceMapMode;

use crate::model_io::{flag, tokenizer_for};

#[derive(Args)]
pub struct GenerateArgs {
    /// An HF checkpoint folder or a .gguf file.
    #[arg(long)]
    model: PathBuf,
    /// A LoRA/DoRA adapter, applied without merging: a PEFT folder (adapter_config.json +
    /// adapter_model.safetensors), or torchtune's adapter_model.pt (the file or its folder).
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// The alpha of a torchtune adapter_model.pt with no adapter_config.json beside it (Phi-3:
    /// torchtune writes none); the `model.lora_alpha` it was trained with.
    #[arg(long)]
    lora_alpha: Option<f64>,
    /// Tokenizer folder or .gguf, if not the model's own (or the adapter folder's, when it has a
    /// tokenizer.json).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Prompt text; repeat for a batch (left-padded).
    #[arg(
        long,
        required_unless_present = "prompt_ids",
        conflicts_with = "prompt_ids"
    )]
    prompt: Vec<String>,
    /// Prompt as token ids, comma-separated (used as is: no template, no BOS added).
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Wrap the prompt as a user message in the model's chat template, with the generation prompt.
    #[arg(long)]
    chat: bool,
    /// System message (with --chat).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    top_p: Option<f64>,
    /// Penalty for tokens already present (1.0 = off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Stop when the generated text contains this string (repeatable).
    #[arg(long = "stop")]
    stop_strings: Vec<String>,
    /// Do not stop at end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Compute dtype: f32 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Spread the decoder layers over all visible GPUs, as HF Accelerate's device_map: auto or
    /// balanced (even split), balanced_low_0 (GPU 0 only takes what does not fit on the others),
    /// sequential (fill GPU 0 first, then GPU 1, ...).
    #[arg(long, conflicts_with = "device")]
    device_map: Option<String>,
    /// Print one JSON object last: prompt_ids, new_token_ids, text, prefill/decode tokens per second.
    #[arg(long)]
    json: bool,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let dtype = flag("--dtype", parse_dtype(&args.dtype))?;
    let device_map = flag(
        "--device-map",
        args.device_map
            .as_deref()
            .map(DeviceMapMode::parse)
            .transpose(),
    )?;
    // With a device map, --device keeps its default (the two conflict) and is not used.
    let device = flag("--device", parse_device(&args.device))?;
    if args.temperature < 0.0 {
        bail!(
            "--temperature must be >= 0 (0 = greedy), got {}",
            args.temperature
        );
    }
    if let Some(p) = args.top_p {
        if !(p > 0.0 && p <= 1.0) {
            bail!("--top-p must be in (0, 1], got {p}");
        }
    }
    if !args.model.exists() {
        bail!(
            "{}: no such file or directory (--model)",
            args.model.display()
        );
    }
    if args.model.join("adapter_config.json").is_file() && !args.model.join("config.json").is_file()
    {
        bail!(
            "{}: {}",
            args.model.display(),
            ferrotune_models::checkpoint::adapter_folder_hint(&args.model)
        );
    }
    // An adapter folder with its own tokenizer (tokens added for it, saved beside it as PEFT
    // users do) speaks for the adapted model, as `AutoTokenizer.from_pretrained(adapter)`.
    let adapter_tokenizer = args
        .adapter
        .as_ref()
        .filter(|dir| dir.join("tokenizer.json").is_file());
    let tok = tokenizer_for(
        args.tokenizer
            .as_ref()
            .or(adapter_tokenizer)
            .unwrap_or(&args.model),
    )?;
    let prompts: Vec<Vec<u32>> = match &args.prompt_ids {
        Some(ids) => vec![ids.clone()],
        None => args
            .prompt
            .iter()
            .map(|p| {
                if args.chat {
                    let mut msgs = Vec::new();
                    if let Some(s) = &args.system {
                        msgs.push(ChatMessage::system(s.clone()));
                    }
                    msgs.push(ChatMessage::user(p.clone()));
                    tok.encode_chat(&msgs, true)
                } else {
                    tok.encode(p, true)
                }
            })
            .collect::<Result<_, _>>()?,
    };
    if prompts.iter().any(Vec::is_empty) {
        bail!("the prompt encodes to no tokens");
    }
    let load = LoadOptions {
        files: Vec::new(),
        dtype,
        device,
        quantize_base: false,
        adapter: args.adapter.clone(),
        lora_alpha: args.lora_alpha,
        device_map: device_map.map(|mode| (mode, "--device-map".into())),
    };
    let model = load_for_inference(&args.model, &load, |_| Ok(()))?;
    let vocab = model.config.vocab_size as u32;
    if let Some(bad) = prompts.iter().flatten().find(|&&id| id >= vocab) {
        bail!("prompt token id {bad} is outside the model's vocabulary (size {vocab})");
    }
    let eos = stop_ids(&tok, &model.config);
    let pad = pad_id(&tok, &model.config);
    let opts = GenerationOptions {
        max_new_tokens: args.max_new_tokens,
        sampling: SamplingOptions {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            repetition_penalty: args.repetition_penalty,
            seed: args.seed,
        },
        eos_token_ids: eos.clone(),
        stop_strings: args.stop_strings.clone(),
        ignore_eos: args.ignore_eos,
        pad_token_id: pad,
    };
    let decode = |ids: &[u32]| tok.decode(ids, false).unwrap_or_default();
    // Stream the single prompt's text as it grows; eos tokens end the stream without being printed.
    let streaming = prompts.len() == 1;
    let mut stream = TextStream::new(&tok, &eos);
    let mut on_token = |_row: usize, id: u32| {
        if streaming {
            stream.push(id);
        }
    };
    let out = generate(&model, &prompts, &opts, &decode, &mut on_token)?;
    let texts: Vec<String> = out
        .new_token_ids
        .iter()
        .map(|ids| tok.decode(ids, false))
        .collect::<Result<_, _>>()?;
    if streaming {
        println!();
    } else {
        // One line per prompt (newlines shown as \n), so the listing stays one answer a line.
        for (i, ids) in out.new_token_ids.iter().enumerate() {
            println!("[{i}] {}", tok.decode(ids, true)?.replace('\n', "\\n"));
        }
    }
    if args.json {
        let one = prompts.len() == 1;
        let json = serde_json::json!({
            "prompt_ids": if one { serde_json::json!(prompts[0]) } else { serde_json::json!(prompts) },
            "new_token_ids": if one { serde_json::json!(out.new_token_ids[0]) } else { serde_json::json!(out.new_token_ids) },
            "text": if one { serde_json::json!(texts[0]) } else { serde_json::json!(texts) },
            "prefill_tokens_per_s": out.prefill_tokens_per_s,
            "decode_tokens_per_s": out.decode_tokens_per_s,
        });
        println!("{json}");
    } else {
        eprintln!(
            "prefill {:.1} tok/s, decode {:.1} tok/s",
            out.prefill_tokens_per_s, out.decode_tokens_per_s
        );
    }
    Ok(())
}
