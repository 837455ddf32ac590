//! `eleuther_eval`: torchtune's EleutherAI-harness evaluation recipe, with the harness's tasks
//! run natively (no Python): TruthfulQA, HellaSwag, ARC, PIQA, SciQ, OpenBookQA, WinoGrande,
//! LAMBADA, MMLU, and any log-likelihood task or group written in the harness's YAML under
//! `include_path`.
//!
//! Keys (torchtune's): `tasks` (names or tags), `limit` (documents per task: a count, or below
//! 1.0 a fraction), `max_seq_length` (requests longer than this keep their last tokens, default
//! 4096), `batch_size` (requests per forward pass, default 8), `include_path`, the model,
//! checkpointer (+ `adapter_checkpoint`) and tokenizer sections, `device`, `dtype`.
//! `enable_kv_cache` only matters to generation tasks, which are not supported; `quantizer` is
//! null, or torchao's 8da4w quantizer for a `quantize` recipe's checkpoint. Prints the harness's
//! results table and a JSON line of the metrics.
//!
//! Scoring follows the harness's Hugging Face backend as torchtune's wrapper drives it: texts are
//! encoded without BOS/EOS, a context's trailing whitespace moves to the continuation, the
//! continuation's tokens are those of `encode(context + continuation)` after the context's, and
//! the input is the last `max_seq_length + 1` tokens minus the final one. The log-likelihood is
//! the sum of the continuation tokens' log-softmax (f32), and a request is greedy when each of
//! them is the argmax there.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, IndexOp, Tensor};
use ferrotune_data::dataset::{collate, Row};
use ferrotune_data::eval_tasks::{
    self, DocRequests, GenerationSpec, Outcome, OutputType, Scored, Selection, TaskRegistry,
    TaskSpec,
};
use ferrotune_data::Tokenizer;
use ferrotune_infer::generate::{generate, GenerationOptions};
use ferrotune_infer::sampling::SamplingOptions;
use ferrotune_infer::{load_for_inference, pad_id, stop_ids};
use ferrotune_models::{AttentionLayout, CausalLm, KvCache};

use crate::config::Config;
use crate::metrics::peak_rss_mb;
use crate::recipe::kit::model::load_options;
use crate::recipe::setup;
use crate::step::MicroBatch;

/// What an evaluation found: each task's and each group's metrics.
#[derive(Debug, Clone)]
pub struct EvalReport {
    /// The tasks and groups evaluated.
    pub selection: Selection,
    /// Task name → metrics and document count.
    pub tasks: BTreeMap<String, Outcome>,
    /// Group name → metrics aggregated over its tasks.
    pub groups: BTreeMap<String, Outcome>,
}

impl EvalReport {
    /// The harness's results table.
    pub fn table(&self) -> String {
        eval_tasks::results_table(&self.selection, &self.tasks, &self.groups)
    }

    /// The metrics as one JSON object: name → {metric, metric_stderr, ..., samples}.
    pub fn to_json(&self) -> serde_json::Value {
        let mut all = serde_json::Map::new();
        for (name, o) in self.groups.iter().chain(&self.tasks) {
            let mut m = serde_json::Map::new();
            for r in &o.metrics {
                m.insert(eval_tasks::metric_key(&r.name, &r.filter), r.value.into());
                m.insert(
                    eval_tasks::metric_key(&format!("{}_stderr", r.name), &r.filter),
                    r.stderr.map_or(serde_json::Value::Null, Into::into),
                );
            }
            m.insert("samples".into(), o.docs.into());
            all.insert(name.clone(), serde_json::Value::Object(m));
        }
        serde_json::Value::Object(all)
    }
}

/// The token ids of a (context, continuation) request: `(context tokens, continuation tokens)`
/// as the harness splits them.
pub fn encode_request(
    tok: &Tokenizer,
    context: &str,
    continuation: &str,
) -> Result<(Vec<u32>, Vec<u32>)> {
    let trimmed = context.trim_end();
    let (context, continuation) = if trimmed.len() < context.len() {
        (
            trimmed,
            format!("{}{continuation}", &context[trimmed.len()..]),
        )
    } else {
        (context, continuation.to_string())
    };
    if context.is_empty() {
        return Ok((vec![prefix_token(tok)?], tok.encode(&continuation, false)?));
    }
    let whole = tok.encode(&format!("{context}{continuation}"), false)?;
    let ctx = tok.encode(context, false)?;
    let cont = whole.get(ctx.len()..).unwrap_or_default().to_vec();
    Ok((ctx, cont))
}

/// The token the harness starts an empty context (or a rolling text) with: BOS, else EOS.
fn prefix_token(tok: &Tokenizer) -> Result<u32> {
    tok.bos_id()
        .or_else(|| tok.eos_ids().first().copied())
        .context(
        "the tokenizer has neither BOS nor EOS to start an empty context or a rolling text with",
    )
}

/// Scores `requests` ((context, continuation) texts): each continuation's summed log-probability
/// and greedy flag.
///
/// Consecutive requests with the same context (a document's answer choices) share one pass over
/// it: the context runs once into a KV cache, and the continuations run as one batch after it
/// (`batch_size` at a time). The numbers are the harness's, which runs context + continuation
/// for every choice; for TruthfulQA's six-shot prompt that is most of the work saved. Requests
/// that stand alone, or that `max_length` truncates, run whole, `batch_size` per forward pass
/// (longest first, to pad little).
pub fn score_requests(
    model: &CausalLm,
    tok: &Tokenizer,
    requests: &[(String, String)],
    max_length: usize,
    batch_size: usize,
    pad: u32,
    progress: impl FnMut(usize),
) -> Result<Vec<Scored>> {
    let mut encoded = Vec::with_capacity(requests.len());
    for (ctx, cont) in requests {
        let (c, t) = encode_request(tok, ctx, cont)?;
        if t.is_empty() {
            bail!(
                "the continuation {cont:?} (after {:?}) encodes to no tokens",
                truncate(ctx)
            );
        }
        if t.len() > max_length {
            bail!(
                "the continuation {:?} is {} tokens, more than max_seq_length {max_length}",
                truncate(cont),
                t.len()
            );
        }
        encoded.push((c, t));
    }
    score_encoded(model, &encoded, max_length, batch_size, pad, progress)
}

/// [`score_requests`] on requests already encoded: (context tokens, continuation tokens).
pub fn score_encoded(
    model: &CausalLm,
    encoded: &[(Vec<u32>, Vec<u32>)],
    max_length: usize,
    batch_size: usize,
    pad: u32,
    mut progress: impl FnMut(usize),
) -> Result<Vec<Scored>> {
    let batch_size = batch_size.max(1);
    // A shared context is cached once; with LongRoPE (or Phi-3.5-MoE's mscales) that holds only
    // when the context and the whole input sit on the same side of the switch, the rotary
    // embedding depending on the longest position of each call.
    let same_rope = |i: usize| {
        let (c, t) = &encoded[i];
        model
            .rope_switch_length()
            .is_none_or(|orig| (c.len() + t.len()).saturating_sub(1) <= orig || c.len() > orig)
    };
    let fits = |i: usize| encoded[i].0.len() + encoded[i].1.len() <= max_length + 1 && same_rope(i);
    // Runs of requests sharing a context that fits whole; everything else runs on its own.
    let mut shared: Vec<Vec<usize>> = Vec::new();
    let mut alone: Vec<usize> = Vec::new();
    let mut i = 0;
    while i < encoded.len() {
        let mut j = i + 1;
        while j < encoded.len() && encoded[j].0 == encoded[i].0 {
            j += 1;
        }
        let (run, rest): (Vec<usize>, Vec<usize>) = (i..j).partition(|&k| fits(k));
        if run.len() >= 2 {
            shared.push(run);
            alone.extend(rest);
        } else {
            alone.extend((i..j).collect::<Vec<_>>());
        }
        i = j;
    }
    let mut out = vec![
        Scored {
            loglikelihood: 0.0,
            is_greedy: false
        };
        encoded.len()
    ];
    let mut done = 0;
    for run in &shared {
        score_shared_context(model, encoded, run, batch_size, pad, &mut out)?;
        done += run.len();
        progress(done);
    }

    let device = model.device().clone();
    // The harness's input: the last max_length + 1 tokens of context + continuation, minus the
    // final token.
    let inputs: Vec<Vec<u32>> = alone
        .iter()
        .map(|&i| {
            let (c, t) = &encoded[i];
            let mut all = c.clone();
            all.extend_from_slice(t);
            let start = all.len().saturating_sub(max_length + 1);
            let mut input = all[start..].to_vec();
            input.pop();
            input
        })
        .collect();
    let mut order: Vec<usize> = (0..alone.len()).collect();
    order.sort_by_key(|&k| std::cmp::Reverse(inputs[k].len()));
    for chunk in order.chunks(batch_size) {
        let rows: Vec<Row> = chunk
            .iter()
            .map(|&k| Row::new(inputs[k].clone(), vec![-100; inputs[k].len()]))
            .collect();
        let picked: Vec<&Row> = rows.iter().collect();
        let batch = MicroBatch::from_batch(&collate(&picked, pad), &device)?;
        let hidden = model.forward_hidden(&batch.input_ids, &batch.layout, None)?;
        for (r, &k) in chunk.iter().enumerate() {
            let i = alone[k];
            let cont = &encoded[i].1;
            let inplen = inputs[k].len();
            // Position p predicts token p + 1: the continuation is predicted from the last
            // `contlen` input positions.
            let states = hidden.i((r, inplen - cont.len()..inplen))?;
            out[i] = score_continuation(model, &states, cont)?;
        }
        done += chunk.len();
        progress(done);
    }
    Ok(out)
}

/// Scores the requests `run` (one context, several continuations): the context once into a KV
/// cache, then the continuations minus their last tokens as batches after it. The state that
/// predicts a continuation's first token is the context's last.
fn score_shared_context(
    model: &CausalLm,
    encoded: &[(Vec<u32>, Vec<u32>)],
    run: &[usize],
    batch_size: usize,
    pad: u32,
    out: &mut [Scored],
) -> Result<()> {
    let device = model.device().clone();
    let context = &encoded[run[0]].0;
    let past = context.len();
    let mut cache = KvCache::new(model.layers.len());
    let ids = Tensor::from_vec(context.clone(), (1, past), &device)?;
    let hidden =
        model.forward_hidden(&ids, &AttentionLayout::causal(1, past, 0), Some(&mut cache))?;
    let last = hidden.i((0, past - 1..past))?;
    // Continuations of one token need nothing past the context.
    let (single, longer): (Vec<usize>, Vec<usize>) =
        run.iter().partition(|&&i| encoded[i].1.len() == 1);
    for &i in &single {
        out[i] = score_continuation(model, &last, &encoded[i].1)?;
    }
    for chunk in longer.chunks(batch_size) {
        let width = chunk
            .iter()
            .map(|&i| encoded[i].1.len() - 1)
            .max()
            .unwrap_or(0);
        let mut ids = Vec::with_capacity(chunk.len() * width);
        let mut key_valid = Vec::with_capacity(chunk.len());
        for &i in chunk {
            let body = &encoded[i].1[..encoded[i].1.len() - 1];
            ids.extend_from_slice(body);
            ids.extend(std::iter::repeat_n(pad, width - body.len()));
            let mut valid = vec![true; past + body.len()];
            valid.resize(past + width, false);
            key_valid.push(valid);
        }
        let layout = AttentionLayout {
            positions: vec![(past as u32..(past + width) as u32).collect(); chunk.len()],
            key_valid,
            segments: None,
        };
        let mut rows_cache = cache.repeat_first_row(chunk.len())?;
        let ids = Tensor::from_vec(ids, (chunk.len(), width), &device)?;
        let hidden = model.forward_hidden(&ids, &layout, Some(&mut rows_cache))?;
        for (r, &i) in chunk.iter().enumerate() {
            let cont = &encoded[i].1;
            let states = Tensor::cat(&[&last, &hidden.i((r, ..cont.len() - 1))?], 0)?;
            out[i] = score_continuation(model, &states, cont)?;
        }
    }
    Ok(())
}

/// The summed log-probability of `cont` and its greedy flag, from the hidden states `[len, h]`
/// that predict its tokens.
fn score_continuation(model: &CausalLm, states: &Tensor, cont: &[u32]) -> Result<Scored> {
    let logits = model
        .logits(&states.unsqueeze(0)?)?
        .squeeze(0)?
        .to_dtype(DType::F32)?;
    let log_probs = log_softmax_rows(&logits)?;
    let targets = Tensor::from_vec(cont.to_vec(), (cont.len(), 1), log_probs.device())?;
    let picked = log_probs.gather(&targets, 1)?.squeeze(1)?;
    let ll: f32 = picked.sum_all()?.to_scalar()?;
    let greedy: Vec<u32> = logits.argmax(1)?.to_vec1()?;
    Ok(Scored {
        loglikelihood: f64::from(ll),
        is_greedy: greedy == cont,
    })
}

/// The harness's rolling windows over `tokens` (`get_rolling_token_windows` with context 1, then
/// `make_disjoint_window`): (context, tokens scored) pairs covering every token once, the first
/// conditioned on `prefix` alone, each later one on the `max_length` tokens before it.
pub fn rolling_windows(
    tokens: &[u32],
    prefix: u32,
    max_length: usize,
) -> Vec<(Vec<u32>, Vec<u32>)> {
    let mut out = Vec::new();
    if tokens.is_empty() || max_length == 0 {
        return out;
    }
    let first = max_length.min(tokens.len());
    out.push((vec![prefix], tokens[..first].to_vec()));
    let mut predicted = first;
    while predicted < tokens.len() {
        let len = (tokens.len() - predicted).min(max_length);
        let end = predicted + len;
        // The window's inputs are tokens[end - max_length - 1 .. end - 1]; the disjoint context
        // is what comes before the scored part.
        let start = end - max_length - 1;
        out.push((
            tokens[start..end - len].to_vec(),
            tokens[end - len..end].to_vec(),
        ));
        predicted = end;
    }
    out
}

/// Greedy continuations of `contexts` as the harness's generate_until gets them through
/// torchtune's wrapper: each context encoded without BOS and cut to its last
/// `max_length - max_gen_toks` tokens, at most `max_gen_toks` new tokens (EOS or a stop string
/// ends a row), decoded without special tokens and cut before the first stop string (the
/// EOS token's text included).
pub fn generate_until(
    model: &CausalLm,
    tok: &Tokenizer,
    contexts: &[String],
    spec: &GenerationSpec,
    max_length: usize,
    batch_size: usize,
    pad: u32,
) -> Result<Vec<String>> {
    if spec.max_gen_toks >= max_length {
        bail!(
            "max_gen_toks {} must be less than max_seq_length {max_length}",
            spec.max_gen_toks
        );
    }
    let max_ctx = max_length - spec.max_gen_toks;
    let eos = stop_ids(tok, &model.config);
    let mut until = spec.until.clone();
    if let Some(&first) = tok.eos_ids().first() {
        let text = tok.decode(&[first], false)?;
        if !text.is_empty() && !until.contains(&text) {
            until.push(text);
        }
    }
    let opts = GenerationOptions {
        max_new_tokens: spec.max_gen_toks,
        sampling: SamplingOptions::default(),
        eos_token_ids: eos,
        stop_strings: until.iter().filter(|u| !u.is_empty()).cloned().collect(),
        ignore_eos: false,
        pad_token_id: pad,
    };
    let decode = |ids: &[u32]| tok.decode(ids, true).unwrap_or_default();
    let mut out = Vec::with_capacity(contexts.len());
    for chunk in contexts.chunks(batch_size.max(1)) {
        let prompts: Vec<Vec<u32>> = chunk
            .iter()
            .map(|c| {
                let ids = tok.encode(c, false)?;
                let start = ids.len().saturating_sub(max_ctx);
                Ok(ids[start..].to_vec())
            })
            .collect::<Result<_>>()?;
        let generated = generate(model, &prompts, &opts, &decode, &mut |_, _| {})?;
        for ids in &generated.new_token_ids {
            let mut text = tok.decode(ids, true)?;
            for term in &until {
                if !term.is_empty() {
                    if let Some(at) = text.find(term.as_str()) {
                        text.truncate(at);
                    }
                }
            }
            out.push(text);
        }
    }
    Ok(out)
}

/// Row-wise log-softmax of f32 logits `[n, V]` (max-subtracted, as torch computes it).
fn log_softmax_rows(logits: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(1)?;
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(1)?.log()?;
    Ok(shifted.broadcast_sub(&lse)?)
}

fn truncate(s: &str) -> String {
    let head: String = s.chars().take(60).collect();
    if head.len() < s.len() {
        format!("{head}...")
    } else {
        head
    }
}

/// Evaluates the selected tasks on `model`: loads each task's documents (relative
/// `data_files` against the working directory), scores every request, and aggregates the
/// metrics of tasks and groups.
pub fn evaluate(
    model: &CausalLm,
    tok: &Tokenizer,
    selection: &Selection,
    limit: Option<f64>,
    max_length: usize,
    batch_size: usize,
    pad: u32,
) -> Result<EvalReport> {
    let prepared = prepare(selection, limit)?;
    evaluate_prepared(
        model, tok, selection, &prepared, max_length, batch_size, pad,
    )
}

/// One task's documents and the requests they make.
pub type PreparedTask = (
    TaskSpec,
    Vec<serde_json::Map<String, serde_json::Value>>,
    Vec<DocRequests>,
);

/// Loads every selected task's documents (and few-shot examples; relative `data_files` against
/// the working directory) and builds their requests: what can fail on the data fails here,
/// before a model is loaded.
pub fn prepare(selection: &Selection, limit: Option<f64>) -> Result<Vec<PreparedTask>> {
    let cwd = std::env::current_dir().context("the working directory")?;
    let mut loaded = Vec::new();
    for task in &selection.tasks {
        let docs = task.load_docs(&cwd, limit)?;
        if docs.is_empty() {
            bail!(
                "task '{}': no documents in split '{}'",
                task.name,
                task.split
            );
        }
        let fewshot = task.load_fewshot_docs(&cwd)?;
        let requests = task.requests(&docs, &fewshot)?;
        loaded.push((task.clone(), docs, requests));
    }
    Ok(loaded)
}

/// [`evaluate`] on tasks [`prepare`]d already.
pub fn evaluate_prepared(
    model: &CausalLm,
    tok: &Tokenizer,
    selection: &Selection,
    prepared: &[PreparedTask],
    max_length: usize,
    batch_size: usize,
    pad: u32,
) -> Result<EvalReport> {
    let (generating, rest): (Vec<_>, Vec<_>) = prepared
        .iter()
        .partition(|(t, _, _)| t.output_type == OutputType::GenerateUntil);
    let (rolling, scoring): (Vec<_>, Vec<_>) = rest
        .into_iter()
        .partition(|(t, _, _)| t.output_type == OutputType::LoglikelihoodRolling);
    let mut tasks = BTreeMap::new();

    // Whole texts: each scored in rolling windows, the windows' log-likelihoods summed.
    for (task, docs, reqs) in &rolling {
        let prefix = prefix_token(tok)?;
        let mut windows = Vec::new();
        let mut owner = Vec::new();
        for (d, r) in reqs.iter().enumerate() {
            let tokens = tok.encode(&r.requests[0].1, false)?;
            for w in rolling_windows(&tokens, prefix, max_length) {
                windows.push(w);
                owner.push(d);
            }
        }
        eprintln!(
            "Running {} rolling windows for task '{}'",
            windows.len(),
            task.name
        );
        let scores = score_encoded(model, &windows, max_length, batch_size, pad, |_| {})?;
        let mut lls = vec![0f64; docs.len()];
        for (s, d) in scores.iter().zip(&owner) {
            lls[*d] += s.loglikelihood;
        }
        let per_doc = docs
            .iter()
            .zip(&lls)
            .map(|(doc, ll)| task.rolling_metrics(doc, *ll))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        tasks.insert(task.name.clone(), task.outcome(&per_doc));
    }

    // Log-likelihood requests of every task, scored together.
    let all: Vec<(String, String)> = scoring
        .iter()
        .flat_map(|(_, _, reqs)| reqs.iter().flat_map(|d| d.requests.iter().cloned()))
        .collect();
    if !all.is_empty() {
        let total = all.len();
        eprintln!(
            "Running {total} log-likelihood requests for {} task(s)",
            scoring.len()
        );
        let t0 = Instant::now();
        let mut next_report = total / 10;
        let scores = score_requests(model, tok, &all, max_length, batch_size, pad, |done| {
            if done >= next_report && done < total {
                eprintln!(
                    "  {done}/{total} requests ({:.0}s)",
                    t0.elapsed().as_secs_f64()
                );
                next_report = done + total / 10;
            }
        })?;
        let mut at = 0;
        for (task, docs, reqs) in &scoring {
            let mut per_doc = Vec::with_capacity(docs.len());
            for (doc, r) in docs.iter().zip(reqs) {
                let n = r.requests.len();
                per_doc.push(
                    task.doc_metrics(doc, &scores[at..at + n])
                        .with_context(|| format!("task '{}', document {}", task.name, r.doc_id))?,
                );
                at += n;
            }
            tasks.insert(task.name.clone(), task.outcome(&per_doc));
        }
    }

    // Generation tasks: greedy continuations, cut at the stop strings, filtered and compared.
    for (task, docs, reqs) in &generating {
        let spec = task
            .generation
            .as_ref()
            .expect("generate_until tasks carry their kwargs");
        let contexts: Vec<String> = reqs.iter().map(|r| r.requests[0].0.clone()).collect();
        eprintln!(
            "Running {} generations for task '{}'",
            contexts.len(),
            task.name
        );
        let responses = generate_until(model, tok, &contexts, spec, max_length, batch_size, pad)?;
        let mut per_doc = Vec::with_capacity(docs.len());
        for (i, (doc, response)) in docs.iter().zip(&responses).enumerate() {
            per_doc.push(
                task.generated_metrics(doc, response)
                    .with_context(|| format!("task '{}', document {i}", task.name))?,
            );
        }
        tasks.insert(task.name.clone(), task.outcome(&per_doc));
    }
    let groups = eval_tasks::aggregate_groups(selection, &tasks);
    Ok(EvalReport {
        selection: selection.clone(),
        tasks,
        groups,
    })
}

/// The recipe's own keys, read and checked once before anything is loaded (what `validate`
/// checks too).
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// A `quantizer` is set: the checkpoint is a `quantize` recipe's output.
    pub quantizer: bool,
    /// `tasks`: the task and group names to run.
    pub tasks: Vec<String>,
    /// `limit`: documents per task (a fraction below 1), or every document.
    pub limit: Option<f64>,
    /// `max_seq_length` (default 4096).
    pub max_length: usize,
    /// `batch_size` (default 8, at least 1).
    pub batch_size: usize,
    /// `include_path`: a folder of more task definitions.
    pub include_path: Option<PathBuf>,
}

impl Settings {
    /// Reads the settings from `cfg`, with run's messages (a `quantizer` a `quantize` checkpoint
    /// runs with, or none, among them).
    pub fn parse(cfg: &Config) -> Result<Settings> {
        let quantizer = setup::quantizer_mode(cfg)?;
        let tasks = cfg
            .str_list("tasks")?
            .filter(|t| !t.is_empty())
            .with_context(|| {
                format!(
                    "{}: 'tasks' is required (for example [\"truthfulqa_mc2\"])",
                    cfg.origin
                )
            })?;
        let limit = cfg.f64("limit")?;
        if limit.is_some_and(|l| l <= 0.0) {
            bail!(
                "{}: limit must be positive (or null for every document)",
                cfg.origin
            );
        }
        let max_length = cfg.usize("max_seq_length")?.unwrap_or(4096);
        if max_length == 0 {
            bail!("{}: max_seq_length must be positive", cfg.origin);
        }
        Ok(Settings {
            quantizer,
            tasks,
            limit,
            max_length,
            batch_size: cfg.usize("batch_size")?.unwrap_or(8).max(1),
            include_path: cfg.path("include_path")?,
        })
    }
}

/// Checks the recipe's own keys without loading anything (for `validate`).
pub fn check(cfg: &Config) -> Result<()> {
    Settings::parse(cfg).map(|_| ())
}

/// Runs the recipe: prints the results table and a JSON line of the metrics.
pub fn run(cfg: &Config) -> Result<EvalReport> {
    let Settings {
        quantizer,
        tasks: names,
        limit,
        max_length,
        batch_size,
        include_path,
    } = Settings::parse(cfg)?;
    let registry = TaskRegistry::new(include_path.as_deref())?;
    let selection = eval_tasks::select(&registry, &names)?;
    // The data first: a missing dataset fails before a large model is loaded.
    let prepared = prepare(&selection, limit)?;

    let device = setup::device(cfg)?;
    let dtype = setup::dtype(cfg)?;
    let location = setup::checkpoint_path(cfg)?;
    let path = location.path.clone();
    let tok = setup::tokenizer(cfg, &path)?;
    let t0 = Instant::now();
    let opts = load_options(cfg, &location, dtype, device)?;
    let model = load_for_inference(&path, &opts, |model| {
        setup::check_model_component(cfg, &model.config)?;
        setup::check_quantized(cfg, quantizer, model, &path)
    })?;
    eprintln!(
        "Model is initialized with precision {dtype:?} ({:.1}s).",
        t0.elapsed().as_secs_f64()
    );
    let pad = pad_id(&tok, &model.config);
    let t1 = Instant::now();
    let report = evaluate_prepared(
        &model, &tok, &selection, &prepared, max_length, batch_size, pad,
    )?;
    eprintln!(
        "Eval completed in {:.2} seconds.",
        t1.elapsed().as_secs_f64()
    );
    eprintln!("Memory used: {:.2} GB", peak_rss_mb() / 1024.0);
    println!("{}", report.table());
    println!("{}", report.to_json());
    Ok(report)
}
