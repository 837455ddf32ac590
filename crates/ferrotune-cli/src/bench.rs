//! `ferrotune bench train`: LoRA training throughput (forward + backward + AdamW step) on a real
//! checkpoint or a synthetic model of a known shape, the numbers ../shared/bench/hf_lora.py
//! prints for HF + PEFT.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::{Args, Subcommand};
use ferrotune_models::peft::{self, LoraConfig, TargetModules};
use ferrotune_models::{AttentionLayout, CausalLm, ModelConfig};
use ferrotune_train::metrics::peak_rss_mb;
use ferrotune_train::optim::{AdamW, AdamWConfig, Optimizer};
use ferrotune_train::step::{empty_grads, forward_backward, MicroBatch};

#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchWhat,
}

#[derive(Subcommand)]
enum BenchWhat {
    /// Training steps (LoRA, or full with --full): tokens/s, step time and peak memory.
    Train(TrainBenchArgs),
}

#[derive(Args)]
struct TrainBenchArgs {
    /// A real model: an HF checkpoint folder or a .gguf file.
    #[arg(long, conflicts_with = "shape", required_unless_present = "shape")]
    model: Option<PathBuf>,
    /// A synthetic model with random weights: llama3_1_8b, llama3_2_1b or smollm2_135m.
    #[arg(long)]
    shape: Option<String>,
    /// Sequence length.
    #[arg(long, default_value_t = 256)]
    seq: usize,
    /// Batch size.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// LoRA rank (alpha = 2 × rank, on q, k, v, o, gate, up, down).
    #[arg(long, default_value_t = 8)]
    lora_rank: usize,
    /// Timed steps (after 2 warmup steps).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Full fine-tuning (every weight trains) instead of LoRA.
    #[arg(long)]
    full: bool,
    /// Recompute each decoder layer in backward instead of keeping its activations.
    #[arg(long)]
    activation_checkpointing: bool,
    /// Fraction of each row's leading tokens whose labels are -100, as the prompt of an
    /// instruction dataset with `train_on_input: false` (0 = every token is a target).
    #[arg(long, default_value_t = 0.0)]
    prompt_fraction: f64,
    /// Print one JSON object last: tokens_per_s, step_s, peak_mem_mb.
    #[arg(long)]
    json: bool,
}

/// Shapes of hf_lora.py: (hidden, intermediate, layers, heads, kv heads, vocab).
const SHAPES: &[(&str, [usize; 6])] = &[
    ("llama3_1_8b", [4096, 14336, 32, 32, 8, 128256]),
    ("llama3_2_1b", [2048, 8192, 16, 32, 8, 128256]),
    ("smollm2_135m", [576, 1536, 30, 9, 3, 49152]),
];

pub fn run(args: BenchArgs) -> Result<()> {
    match args.what {
        BenchWhat::Train(a) => train(a),
    }
}

fn synthetic(shape: &str, dtype: DType, device: &Device) -> Result<CausalLm> {
    let Some((_, [h, i, l, nh, kv, v])) = SHAPES.iter().find(|(n, _)| *n == shape) else {
        let names: Vec<&str> = SHAPES.iter().map(|(n, _)| *n).collect();
        bail!("--shape {shape}: unknown (known: {})", names.join(", "));
    };
    let (h, i, l, nh, kv, v) = (*h, *i, *l, *nh, *kv, *v);
    let tied = shape == "smollm2_135m";
    let json = serde_json::json!({
        "model_type": "llama", "hidden_size": h, "intermediate_size": i,
        "num_hidden_layers": l, "num_attention_heads": nh, "num_key_value_heads": kv,
        "vocab_size": v, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": tied, "hidden_act": "silu",
    });
    let config = ModelConfig::from_hf_json(&json).map_err(anyhow::Error::msg)?;
    let hd = h / nh;
    let mut t = HashMap::new();
    let rand = |shape: &[usize]| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 0.02, shape, device)?.to_dtype(dtype)?)
    };
    t.insert("model.embed_tokens.weight".into(), rand(&[v, h])?);
    if !tied {
        t.insert("lm_head.weight".into(), rand(&[v, h])?);
    }
    let ones = |n: usize| Tensor::ones(n, dtype, device);
    for li in 0..l {
        let p = format!("model.layers.{li}");
        t.insert(format!("{p}.self_attn.q_proj.weight"), rand(&[nh * hd, h])?);
        t.insert(format!("{p}.self_attn.k_proj.weight"), rand(&[kv * hd, h])?);
        t.insert(format!("{p}.self_attn.v_proj.weight"), rand(&[kv * hd, h])?);
        t.insert(format!("{p}.self_attn.o_proj.weight"), rand(&[h, nh * hd])?);
        t.insert(format!("{p}.mlp.gate_proj.weight"), rand(&[i, h])?);
        t.insert(format!("{p}.mlp.up_proj.weight"), rand(&[i, h])?);
        t.insert(format!("{p}.mlp.down_proj.weight"), rand(&[h, i])?);
        t.insert(format!("{p}.input_layernorm.weight"), ones(h)?);
        t.insert(format!("{p}.post_attention_layernorm.weight"), ones(h)?);
    }
    t.insert("model.norm.weight".into(), ones(h)?);
    Ok(CausalLm::from_tensors(config, t, shape)?)
}

fn train(a: TrainBenchArgs) -> Result<()> {
    let dtype = ferrotune_core::parse_dtype(&a.dtype)
        .map_err(anyhow::Error::msg)
        .context("--dtype")?;
    let device = ferrotune_core::parse_device(&a.device)
        .map_err(anyhow::Error::msg)
        .context("--device")?;
    if a.seq == 0 || a.batch == 0 || a.steps == 0 || a.lora_rank == 0 {
        bail!("--seq, --batch, --steps and --lora-rank must be at least 1");
    }
    let t0 = Instant::now();
    let (mut model, what) = match (&a.model, &a.shape) {
        (Some(path), _) => {
            let ckpt = ferrotune_models::read_checkpoint(path, dtype, &device)?;
            let m = CausalLm::from_tensors(ckpt.config, ckpt.tensors, &path.display().to_string())?;
            (m, path.display().to_string())
        }
        (None, Some(shape)) => (synthetic(shape, dtype, &device)?, format!("shape {shape}")),
        (None, None) => bail!("pass --model PATH or --shape NAME"),
    };
    eprintln!("loaded {what} in {:.1}s", t0.elapsed().as_secs_f64());
    let params = if a.full {
        model.make_all_trainable()?
    } else {
        let targets = [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ];
        let lc = LoraConfig::new(
            a.lora_rank,
            2.0 * a.lora_rank as f64,
            TargetModules::Names(targets.iter().map(|s| s.to_string()).collect()),
        );
        peft::add_adapter(&mut model, &lc, 0)?;
        ferrotune_models::lora::set_training(&mut model, true);
        peft::trainable_parameters(&mut model)?
    };
    let mut opt = AdamW::new(
        params.clone(),
        AdamWConfig {
            lr: 1e-4,
            ..AdamWConfig::default()
        },
    )?;
    // Random ids with labels = ids, as hf_lora.py.
    let vocab = model.config.vocab_size as u64;
    let mut rng = ferrotune_models::lora::SplitMix64::new(0);
    let ids: Vec<u32> = (0..a.batch * a.seq)
        .map(|_| (rng.next_u64() % vocab) as u32)
        .collect();
    if !(0.0..1.0).contains(&a.prompt_fraction) {
        bail!("--prompt-fraction must be in [0, 1)");
    }
    let prompt = (a.seq as f64 * a.prompt_fraction) as usize;
    let labels: Vec<i64> = ids
        .iter()
        .enumerate()
        .map(|(k, &i)| if k % a.seq < prompt { -100 } else { i as i64 })
        .collect();
    let batch = MicroBatch {
        input_ids: Tensor::from_vec(ids, (a.batch, a.seq), &device)?,
        labels: Tensor::from_vec(labels, (a.batch, a.seq), &device)?,
        layout: AttentionLayout::causal(a.batch, a.seq, 0),
        num_targets: a.batch * (a.seq - prompt.max(1)),
        num_tokens: a.batch * a.seq,
    };
    let mut step = |model: &CausalLm| -> Result<f64> {
        let mut grads = empty_grads()?;
        let loss = forward_backward(
            model,
            &batch,
            &params,
            &mut grads,
            a.activation_checkpointing,
        )?;
        opt.step_scaled(&grads, 1.0 / batch.num_targets as f64)?;
        Ok(loss / batch.num_targets as f64)
    };
    for _ in 0..2 {
        step(&model)?;
    }
    device.synchronize()?;
    let t = Instant::now();
    let mut last = 0.0;
    for _ in 0..a.steps {
        last = step(&model)?;
    }
    device.synchronize()?;
    let el = t.elapsed().as_secs_f64();
    let tokens_per_s = (a.batch * a.seq * a.steps) as f64 / el;
    let step_s = el / a.steps as f64;
    let peak = peak_rss_mb();
    println!(
        "bench train: {what}, seq {} batch {} {} ({:?} on {:?}{})",
        a.seq,
        a.batch,
        if a.full {
            "full fine-tuning".to_string()
        } else {
            format!("LoRA r={}", a.lora_rank)
        },
        dtype,
        device,
        if a.activation_checkpointing {
            ", activation checkpointing"
        } else {
            ""
        }
    );
    println!("  tokens/s   {tokens_per_s:.1}");
    println!("  step       {step_s:.3} s");
    println!("  peak RSS   {peak:.0} MB");
    println!("  last loss  {last:.4}");
    println!(
        "  threads    {}",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into())
    );
    if a.json {
        println!(
            "{}",
            serde_json::json!({"tokens_per_s": tokens_per_s, "step_s": step_s, "peak_mem_mb": peak})
        );
    }
    Ok(())
}
