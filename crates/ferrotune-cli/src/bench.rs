//! `ferrotune bench train`: LoRA training throughput (forward + backward + AdamW step) on a real
//! checkpoint or a synthetic model of a known shape, the numbers ../shared/bench/hf_lora.py
//! prints for HF + PEFT.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use clap::{Args, Subcommand};
use ferrotune_models::peft::{self, LoraConfig, TargetModules};
use ferrotune_models::{AttentionLayout, CausalLm, ModelConfig};
use ferrotune_train::metrics::peak_rss_mb;
use ferrotune_train::optim::{AdamW, AdamWConfig, Optimizer};
use ferrotune_train::step::{empty_grads, forward_backward, MicroBatch};

use crate::model_io::flag;

#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchWhat,
}

#[derive(Subcommand)]
enum BenchWhat {
    /// Training steps (LoRA, or full with --full): tokens/s, step time, peak memory and MFU.
    Train(TrainBenchArgs),
    /// Greedy decoding at batch 1 through the KV cache: tokens/s against the memory-bandwidth
    /// bound (weight bytes read per token ÷ the device's measured copy bandwidth).
    Decode(DecodeBenchArgs),
    /// Each kernel of a decoder layer alone, forward and forward + backward, at the shapes of
    /// Llama-3.1-8B with `--tokens` tokens (batch 2): where a training step's time goes.
    Ops(OpsBenchArgs),
}

#[derive(Args)]
struct OpsBenchArgs {
    /// Tokens per call (2 rows of tokens/2).
    #[arg(long, default_value_t = 4096)]
    tokens: usize,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Timed repetitions (after one warmup); the median is reported.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Only the ops whose name contains this text (e.g. `attention`), for a profiler.
    #[arg(long)]
    only: Option<String>,
}

#[derive(Args)]
struct DecodeBenchArgs {
    /// A real model: an HF checkpoint folder or a .gguf file.
    #[arg(long, conflicts_with = "shape", required_unless_present = "shape")]
    model: Option<PathBuf>,
    /// A synthetic model with random weights: llama3_1_8b, llama3_2_1b or smollm2_135m.
    #[arg(long)]
    shape: Option<String>,
    /// Prompt tokens (random ids) prefilled before decoding.
    #[arg(long, default_value_t = 128)]
    prompt: usize,
    /// New tokens decoded per run.
    #[arg(long, default_value_t = 128)]
    new_tokens: usize,
    /// Timed runs (after one warmup run); the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Print one JSON object last.
    #[arg(long)]
    json: bool,
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
    /// QLoRA: the decoder layers' frozen weights in NF4 (as a `qlora_*` builder).
    #[arg(long, conflicts_with = "full")]
    qlora: bool,
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
    /// Also time forward+backward and the optimizer step apart (synchronizing between them).
    #[arg(long)]
    profile: bool,
    /// With --shape: this many decoder layers instead of the shape's (to separate per-layer
    /// time from the embedding, head and optimizer).
    #[arg(long)]
    layers: Option<usize>,
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
        BenchWhat::Decode(a) => decode(a),
        BenchWhat::Ops(a) => ops(a),
    }
}

fn synthetic(
    shape: &str,
    dtype: DType,
    device: &Device,
    layers: Option<usize>,
) -> Result<CausalLm> {
    let Some((_, [h, i, l, nh, kv, v])) = SHAPES.iter().find(|(n, _)| *n == shape) else {
        let names: Vec<&str> = SHAPES.iter().map(|(n, _)| *n).collect();
        bail!("--shape {shape}: unknown (known: {})", names.join(", "));
    };
    let (h, i, nh, kv, v) = (*h, *i, *nh, *kv, *v);
    let l = layers.unwrap_or(*l);
    let tied = shape == "smollm2_135m";
    // `--layers` comes from the command line: the weights' size is checked against the machine
    // (overflow-checked) before the config's per-layer tables and the weights are allocated.
    let per_layer = (h * (h / nh) * (2 * nh + 2 * kv) + 3 * h * i) as u64;
    let params = (l as u64)
        .checked_mul(per_layer)
        .and_then(|p| p.checked_add((v * h * if tied { 1 } else { 2 }) as u64));
    let bytes =
        params.and_then(|p| ferrotune_core::memory::bytes_of(p, dtype.size_in_bytes() as u64));
    ferrotune_core::memory::check_fits(
        bytes,
        &format!("--layers {l}: the synthetic model"),
        device,
    )
    .map_err(anyhow::Error::msg)?;
    let params = params.unwrap_or(u64::MAX);
    let json = serde_json::json!({
        "model_type": ferrotune_models::family::llama::LLAMA, "hidden_size": h, "intermediate_size": i,
        "num_hidden_layers": l, "num_attention_heads": nh, "num_key_value_heads": kv,
        "vocab_size": v, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": tied, "hidden_act": "silu",
    });
    let config = ModelConfig::from_hf_json(&json).map_err(anyhow::Error::msg)?;
    let hd = h / nh;
    let mut t = HashMap::new();
    // Models up to 2B parameters get the same seeded weights on every device (so a GPU run's loss
    // can be checked against the CPU's); larger ones are drawn on the device, where speed is all
    // that is measured.
    let rng = std::cell::RefCell::new(ferrotune_models::lora::SplitMix64::new(42));
    let rand = |shape: &[usize]| -> Result<Tensor> {
        if params > 2_000_000_000 {
            return Ok(Tensor::randn(0f32, 0.02, shape, device)?.to_dtype(dtype)?);
        }
        let n: usize = shape.iter().product();
        let mut rng = rng.borrow_mut();
        // Uniform with standard deviation 0.02.
        let vals: Vec<f32> = (0..n)
            .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.0693)
            .collect();
        Ok(Tensor::from_vec(vals, shape, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)?)
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

/// `--device` and `--dtype` as the user wrote them.
fn device_and_dtype(device: &str, dtype: &str) -> Result<(Device, DType)> {
    let dtype = flag("--dtype", ferrotune_core::parse_dtype(dtype))?;
    let device = flag("--device", ferrotune_core::parse_device(device))?;
    Ok((device, dtype))
}

/// The model a bench runs on (`--model PATH` or `--shape NAME [--layers N]`) and how to name it.
fn load(
    model: &Option<PathBuf>,
    shape: &Option<String>,
    layers: Option<usize>,
    dtype: DType,
    device: &Device,
) -> Result<(CausalLm, String)> {
    match (model, shape) {
        (Some(path), _) => {
            let ckpt = ferrotune_models::read_checkpoint(path, dtype, device)?;
            let name = path.display().to_string();
            Ok((
                CausalLm::from_tensors(ckpt.config, ckpt.tensors, &name)?,
                name,
            ))
        }
        (None, Some(shape)) => Ok((
            synthetic(shape, dtype, device, layers)?,
            format!("shape {shape}"),
        )),
        (None, None) => bail!("pass --model PATH or --shape NAME"),
    }
}

fn train(a: TrainBenchArgs) -> Result<()> {
    let (device, dtype) = device_and_dtype(&a.device, &a.dtype)?;
    if a.seq == 0 || a.batch == 0 || a.steps == 0 || a.lora_rank == 0 {
        bail!("--seq, --batch, --steps and --lora-rank must be at least 1");
    }
    if a.layers.is_some() && a.shape.is_none() {
        bail!("--layers applies to a synthetic model (--shape) only");
    }
    let t0 = Instant::now();
    let (mut model, what) = load(&a.model, &a.shape, a.layers, dtype, &device)?;
    eprintln!("loaded {what} in {:.1}s", t0.elapsed().as_secs_f64());
    if a.qlora {
        eprintln!("QLoRA: {}", model.quantize_base_nf4()?);
    }
    let params = if a.full {
        model.make_all_trainable()?
    } else {
        // The attention and MLP projections, as hf_lora.py targets them.
        let targets = &peft::LORA_TARGET_NAMES[..7];
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
        distill: None,
        preference: None,
        aux_loss_weight: None,
        layer_skip: None,
        reward: None,
    };
    let (mut fb_s, mut opt_s) = (0.0f64, 0.0f64);
    let mut step = |model: &CausalLm, profile: bool| -> Result<f64> {
        let t0 = Instant::now();
        let mut grads = empty_grads()?;
        let loss = forward_backward(
            model,
            &batch,
            &params,
            &mut grads,
            a.activation_checkpointing,
        )?;
        if profile {
            device.synchronize()?;
            fb_s += t0.elapsed().as_secs_f64();
        }
        let t1 = Instant::now();
        opt.step_scaled(&grads, 1.0 / batch.num_targets as f64)?;
        if profile {
            device.synchronize()?;
            opt_s += t1.elapsed().as_secs_f64();
        }
        Ok(loss.sum / batch.num_targets as f64)
    };
    for _ in 0..2 {
        step(&model, false)?;
    }
    device.synchronize()?;
    ferrotune_core::reset_peak_memory(&device);
    let t = Instant::now();
    let mut last = 0.0;
    for _ in 0..a.steps {
        last = step(&model, false)?;
    }
    device.synchronize()?;
    let el = t.elapsed().as_secs_f64();
    let peak_gpu = ferrotune_core::peak_memory_bytes(&device);
    if a.profile {
        for _ in 0..a.steps {
            step(&model, true)?;
        }
    }
    let tokens_per_s = (a.batch * a.seq * a.steps) as f64 / el;
    let step_s = el / a.steps as f64;
    let peak = peak_rss_mb();
    println!(
        "bench train: {what}, seq {} batch {} {} ({:?} on {:?}{})",
        a.seq,
        a.batch,
        if a.full {
            "full fine-tuning".to_string()
        } else if a.qlora {
            format!("QLoRA (NF4 base) r={}", a.lora_rank)
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
    if let Some(bytes) = peak_gpu {
        println!("  peak GPU   {:.2} GiB", bytes as f64 / (1u64 << 30) as f64);
    }
    let flops = training_flops_per_token(&model.config, a.seq, a.full) * tokens_per_s;
    println!("  TFLOP/s    {:.1}", flops / 1e12);
    if let Some(peak_flops) = peak_flops(&device, dtype) {
        println!("  MFU        {:.1}%", 100.0 * flops / peak_flops);
    }
    if a.profile {
        let n = a.steps as f64;
        println!(
            "  profile    forward+backward {:.3} s, optimizer {:.3} s per step",
            fb_s / n,
            opt_s / n
        );
    }
    println!("  last loss  {last:.4}");
    println!(
        "  threads    {}",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into())
    );
    if a.json {
        println!(
            "{}",
            serde_json::json!({"tokens_per_s": tokens_per_s, "step_s": step_s, "peak_mem_mb": peak,
                "peak_gpu_mem_gb": peak_gpu.map(|b| b as f64 / (1u64 << 30) as f64), "loss": last})
        );
    }
    Ok(())
}

/// Parameters in the matmuls a token passes through: every projection of every layer and the
/// output head (the embedding is a lookup).
fn matmul_params(c: &ModelConfig) -> f64 {
    let (h, hd) = (c.hidden_size as f64, c.head_dim as f64);
    let attn = h * hd * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) as f64;
    let mlp = 3.0 * h * c.intermediate_size as f64;
    c.num_hidden_layers as f64 * (attn + mlp) + c.vocab_size as f64 * h
}

/// Training FLOPs per token: 4 × matmul parameters for LoRA (forward, and the input gradient in
/// backward; adapters are negligible), 6 × for full fine-tuning (plus the weight gradient), and
/// attention's `QKᵀ` and `PV` over the causal half of a `seq`-long context, three times over
/// (forward, and two GEMMs' worth in backward).
fn training_flops_per_token(c: &ModelConfig, seq: usize, full: bool) -> f64 {
    let per_param = if full { 6.0 } else { 4.0 };
    let attn_fwd = 2.0
        * 2.0
        * c.num_hidden_layers as f64
        * (c.num_attention_heads * c.head_dim) as f64
        * seq as f64
        / 2.0;
    per_param * matmul_params(c) + 3.0 * attn_fwd
}

/// Dense peak FLOP/s of known GPUs for the compute dtype (tensor cores for bf16/f16; f32 runs
/// without TF32), for the MFU line.
fn peak_flops(device: &Device, dtype: DType) -> Option<f64> {
    let name = ferrotune_core::device::gpu_name(device)?;
    let (half, single) = if name.contains("H100") || name.contains("H200") || name.contains("H800")
    {
        (989.4e12, 66.9e12)
    } else if name.contains("A100") || name.contains("A800") {
        (312e12, 19.5e12)
    } else {
        return None;
    };
    Some(if dtype == DType::F32 { single } else { half })
}

fn decode(a: DecodeBenchArgs) -> Result<()> {
    let (device, dtype) = device_and_dtype(&a.device, &a.dtype)?;
    if a.prompt == 0 || a.new_tokens < 2 || a.runs == 0 {
        bail!("--prompt and --runs must be at least 1, --new-tokens at least 2");
    }
    let (model, what) = load(&a.model, &a.shape, None, dtype, &device)?;
    let vocab = model.config.vocab_size as u64;
    let mut rng = ferrotune_models::lora::SplitMix64::new(1);
    let prompt: Vec<u32> = (0..a.prompt)
        .map(|_| (rng.next_u64() % vocab) as u32)
        .collect();
    let opts = ferrotune_infer::GenerationOptions {
        max_new_tokens: a.new_tokens,
        sampling: Default::default(),
        eos_token_ids: Vec::new(),
        stop_strings: Vec::new(),
        ignore_eos: true,
        pad_token_id: 0,
    };
    let run = || -> Result<ferrotune_infer::GenerationOutput> {
        Ok(ferrotune_infer::generate(
            &model,
            std::slice::from_ref(&prompt),
            &opts,
            &|_| String::new(),
            &mut |_, _| {},
        )?)
    };
    // Median tokens/s of `a.runs` runs after a warmup, and the greedy tokens of the last.
    let measure = || -> Result<(f64, f64, Vec<u32>)> {
        run()?;
        let (mut decode_tps, mut prefill_tps, mut tokens) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..a.runs {
            let out = run()?;
            decode_tps.push(out.decode_tokens_per_s);
            prefill_tps.push(out.prefill_tokens_per_s);
            tokens = out.new_token_ids.into_iter().next().unwrap_or_default();
        }
        Ok((median(&mut decode_tps), median(&mut prefill_tps), tokens))
    };
    let (decode_tps, prefill_tps, tokens) = measure()?;
    // Tokens/s with a fast path switched off by `set`, and how many leading greedy tokens agree
    // with the run above.
    let measure_without = |set: fn(bool)| -> Result<(f64, usize)> {
        set(false);
        let measured = measure();
        set(true);
        let (tps, _, other) = measured?;
        let same = tokens
            .iter()
            .zip(&other)
            .take_while(|(a, b)| a == b)
            .count();
        Ok((tps, same))
    };
    // The same kernels without CUDA graphs (each step's kernels launched one by one): the tokens
    // must be the same, every one.
    let no_graphs = if device.is_cuda()
        && ferrotune_core::decode::enabled()
        && ferrotune_core::graph::enabled()
    {
        Some(measure_without(ferrotune_core::graph::set_enabled)?)
    } else {
        None
    };
    if device.is_cuda() && !ferrotune_core::graph::enabled() {
        println!(
            "  note: CUDA graphs are off ({}=0, or recording failed: see the warning above)",
            ferrotune_core::switch::CUDA_GRAPHS.name
        );
    }
    if device.is_cuda() && !ferrotune_core::decode::enabled() {
        println!(
            "  note: the decode kernels are off ({}=0, or they failed: see the warning above)",
            ferrotune_core::switch::DECODE_KERNELS.name
        );
    }
    // On a GPU the decode kernels serve the steps; time the forward's ops beside them, and count
    // how many greedy tokens the two agree on before the first difference (bf16 sums in another
    // order may tip a near tie).
    let forward_ops = if device.is_cuda() && ferrotune_core::decode::enabled() {
        Some(measure_without(ferrotune_core::decode::set_enabled)?)
    } else {
        None
    };
    // Bytes of weights read per decoded token: every matmul weight (the head included) once.
    let weight_bytes = matmul_params(&model.config) * dtype.size_in_bytes() as f64;
    let bandwidth = copy_bandwidth(&device)?;
    let bound = bandwidth / weight_bytes;
    println!(
        "bench decode: {what}, prompt {} + {} new tokens, batch 1 ({dtype:?} on {device:?})",
        a.prompt, a.new_tokens
    );
    println!("  decode     {decode_tps:.1} tokens/s");
    if let Some((tps, same)) = no_graphs {
        println!(
            "  no graphs  {tps:.1} tokens/s with the decode kernels launched one by one ({}=0); greedy tokens agree on the first {same} of {}",
            ferrotune_core::switch::CUDA_GRAPHS.name,
            tokens.len()
        );
    }
    if let Some((tps, same)) = forward_ops {
        println!(
            "  forward    {tps:.1} tokens/s with the forward's ops ({}=0); greedy tokens agree on the first {same} of {}",
            ferrotune_core::switch::DECODE_KERNELS.name,
            tokens.len()
        );
    }
    println!("  prefill    {prefill_tps:.1} tokens/s");
    println!(
        "  bound      {bound:.1} tokens/s ({:.2} GB of weights per token, copy bandwidth {:.0} GB/s)",
        weight_bytes / 1e9,
        bandwidth / 1e9
    );
    println!("  of bound   {:.1}%", 100.0 * decode_tps / bound);
    if a.json {
        let mut j = serde_json::json!({"decode_tokens_per_s": decode_tps, "prefill_tokens_per_s": prefill_tps,
            "bound_tokens_per_s": bound, "copy_bandwidth_gb_s": bandwidth / 1e9});
        if let Some((tps, same)) = forward_ops {
            j["forward_ops_decode_tokens_per_s"] = tps.into();
            j["same_leading_greedy_tokens"] = same.into();
        }
        if let Some((tps, same)) = no_graphs {
            j["no_graphs_decode_tokens_per_s"] = tps.into();
            j["no_graphs_same_leading_greedy_tokens"] = same.into();
        }
        println!("{j}");
    }
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Device memory bandwidth as a copy measures it: bytes read plus bytes written per second,
/// median of 5 timed copies of 1 GiB (256 MiB on the CPU).
fn copy_bandwidth(device: &Device) -> Result<f64> {
    let n = if device.is_cpu() { 1 << 26 } else { 1 << 28 };
    let src = Tensor::ones(n, DType::F32, device)?;
    let mut times = Vec::new();
    for i in 0..7 {
        device.synchronize()?;
        let t = Instant::now();
        let dst = src.copy()?;
        device.synchronize()?;
        if i >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
        drop(dst);
    }
    times.sort_by(f64::total_cmp);
    Ok(2.0 * (n * 4) as f64 / times[times.len() / 2])
}

/// Median seconds of `f` over `reps` runs after one warmup, synchronizing around each.
fn median_time(device: &Device, reps: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        device.synchronize()?;
        let t = Instant::now();
        f()?;
        device.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn ops(a: OpsBenchArgs) -> Result<()> {
    use ferrotune_core::fused;
    let (device, dtype) = device_and_dtype(&a.device, &a.dtype)?;
    if a.tokens < 2 || !a.tokens.is_multiple_of(2) {
        bail!("--tokens must be even and at least 2");
    }
    let (n, t) = (a.tokens, a.tokens / 2);
    let (h, inter, nh, nkv, hd, vocab) = (4096, 14336, 32, 8, 128, 128256);
    let rand = |shape: &[usize], std: f64| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, std as f32, shape, &device)?.to_dtype(dtype)?)
    };
    let var = |shape: &[usize], std: f64| -> Result<candle_core::Var> {
        Ok(candle_core::Var::from_tensor(&rand(shape, std)?)?)
    };
    type OpFn<'a> = Box<dyn Fn() -> candle_core::Result<Tensor> + 'a>;
    let x = var(&[n, h], 1.0)?;
    let w_gate = rand(&[inter, h], 0.02)?;
    let norm_w = rand(&[h], 1.0)?;
    let (la, lb) = (var(&[8, h], 0.02)?, var(&[inter, 8], 0.02)?);
    let g = var(&[n, inter], 1.0)?;
    let u = var(&[n, inter], 1.0)?;
    let q = var(&[2, nh, t, hd], 1.0)?;
    let k = var(&[2, nkv, t, hd], 1.0)?;
    let v = var(&[2, nkv, t, hd], 1.0)?;
    let cos = rand(&[1, 1, t, hd], 1.0)?;
    let sin = rand(&[1, 1, t, hd], 1.0)?;
    let causal: Vec<f32> = (0..t * t)
        .map(|i| if i % t > i / t { f32::MIN } else { 0.0 })
        .collect();
    let mask = Tensor::from_vec(causal, (1, 1, t, t), &device)?.to_dtype(dtype)?;
    let head = rand(&[vocab, h], 0.02)?;
    let targets: Vec<i64> = (0..n).map(|i| ((i * 7919) % vocab) as i64).collect();
    let scale = 1.0 / (hd as f64).sqrt();
    let cases: Vec<(&str, f64, OpFn)> = vec![
        (
            "matmul (frozen) [n,4096]x[14336,4096]^T",
            2.0 * (n * h * inter) as f64,
            Box::new(|| ferrotune_core::ops::linear(x.as_tensor(), &w_gate, None)),
        ),
        (
            "lora_linear r=8 4096->14336",
            2.0 * (n * h * inter) as f64,
            Box::new(|| {
                fused::lora_linear(
                    x.as_tensor(),
                    &w_gate,
                    None,
                    la.as_tensor(),
                    lb.as_tensor(),
                    2.0,
                )
            }),
        ),
        (
            "rms_norm [n,4096]",
            0.0,
            Box::new(|| fused::rms_norm(x.as_tensor(), &norm_w, 1e-5, false)),
        ),
        (
            "swiglu [n,14336]",
            0.0,
            Box::new(|| fused::swiglu(g.as_tensor(), u.as_tensor(), fused::GatedAct::Silu)),
        ),
        (
            "rope q [2,32,t,128]",
            0.0,
            Box::new(|| fused::rope(q.as_tensor(), &cos, &sin)),
        ),
        (
            "attention causal [2,32|8,t,128]",
            2.0 * (2 * nh * t * t * hd) as f64,
            Box::new(|| {
                fused::attention(
                    q.as_tensor(),
                    k.as_tensor(),
                    v.as_tensor(),
                    Some(&mask),
                    scale,
                )
            }),
        ),
        (
            "head + cross-entropy [n,4096]x[128256,4096]",
            2.0 * (n * h * vocab) as f64,
            Box::new(|| {
                Ok(fused::linear_cross_entropy_sum(x.as_tensor(), &head, &targets, -100)?.0)
            }),
        ),
    ];
    println!(
        "bench ops: {n} tokens ({dtype:?} on {device:?}), median of {} runs",
        a.reps
    );
    println!(
        "  {:<46} {:>10} {:>14} {:>10}",
        "op", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s"
    );
    for (name, fwd_flops, f) in &cases {
        if a.only.as_ref().is_some_and(|o| !name.contains(o.as_str())) {
            continue;
        }
        let fwd = median_time(&device, a.reps, &mut || {
            f()?;
            Ok(())
        })?;
        let both = median_time(&device, a.reps, &mut || {
            let out = f()?;
            // Backward from a gradient of ones (no reduction kernel in the timing).
            out.backward()?;
            Ok(())
        })?;
        let tflops = if *fwd_flops > 0.0 {
            format!("{:.1}", fwd_flops / fwd / 1e12)
        } else {
            "-".into()
        };
        println!(
            "  {name:<46} {:>10.3} {:>14.3} {tflops:>10}",
            fwd * 1e3,
            both * 1e3
        );
    }
    Ok(())
}
