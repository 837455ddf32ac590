//! torchtune's own adapter file, `adapter_model.pt`: the LoRA/DoRA parameters of torchtune's
//! model under its module names (`layers.0.attn.q_proj.lora_a.weight`, `...lora_b.weight`,
//! DoRA's `...magnitude`; `output.*` for the head), in the row layout of torchtune's weights.
//! torchtune 0.6.1's checkpointers write it beside (or, for Phi-3 and Meta checkpoints, instead
//! of) a PEFT adapter, and read it back to resume.
//!
//! The conversion is torchtune's, done exactly: for Llama, Mistral and Gemma (1 and 2) the q/k
//! `lora_b` rows and DoRA magnitudes are in torchtune's interleaved rotary layout (its weights'
//! rows are); Qwen2 keeps HF's rows. torchtune splits Phi-3's fused `qkv_proj` and
//! `gate_up_proj` into q/k/v and w1/w3, each with its own adapter: written out, every part gets
//! the fused adapter's A and its rows of B; read in, parts that share one A fuse back into one
//! adapter of the same rank, and parts with their own A's become one block-diagonal adapter
//! (A stacked, B placed block by block: rank × parts, its alpha scaled alike so that
//! `alpha / r` is unchanged) that computes the same outputs.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::family::{self, TorchtuneLayout};
use crate::model::lora::weight_norm;
use crate::model::CausalLm;
use crate::peft::{attach_adapter, LoraConfig, TargetModules, PEFT_PREFIX};
use crate::torch_pickle::{
    permute_rotary_to_pairs, read_torch_file, unpermute_rotary, write_torch_tensors,
};

/// The file torchtune's checkpointers save adapters to.
pub const TORCHTUNE_ADAPTER_FILE: &str = "adapter_model.pt";

/// How torchtune lays out a model type's adapters.
type Layout = TorchtuneLayout;

/// The layout for a model type torchtune's checkpointer converts (a multimodal checkpoint's
/// text model is none of them).
fn layout(config: &ModelConfig) -> Option<Layout> {
    if config.text_of_multimodal {
        return None;
    }
    family::model_type(&config.model_type).and_then(|(_, t)| t.torchtune_adapters)
}

/// Whether torchtune has adapter names for this model type (the types its checkpointer converts:
/// Llama, Mistral, Gemma, Gemma 2, Qwen2, Phi-3).
pub fn supports(config: &ModelConfig) -> bool {
    layout(config).is_some()
}

/// Why a model has no torchtune adapter names.
fn unsupported(config: &ModelConfig) -> String {
    format!(
        "torchtune has no adapter names for model type '{}' (it converts {} checkpoints)",
        config.model_type,
        family::and_list(&family::torchtune_model_types(true))
    )
}

/// HF module (inside a layer) → torchtune module, for modules that are one module on both sides.
const MODULES: &[(&str, &str)] = &[
    ("self_attn.q_proj", "attn.q_proj"),
    ("self_attn.k_proj", "attn.k_proj"),
    ("self_attn.v_proj", "attn.v_proj"),
    ("self_attn.o_proj", "attn.output_proj"),
    ("mlp.gate_proj", "mlp.w1"),
    ("mlp.up_proj", "mlp.w3"),
    ("mlp.down_proj", "mlp.w2"),
];

/// Phi-3's fused HF modules and torchtune's parts of them, in row order.
const FUSED: &[(&str, &[&str])] = &[
    (
        "self_attn.qkv_proj",
        &["attn.q_proj", "attn.k_proj", "attn.v_proj"],
    ),
    ("mlp.gate_up_proj", &["mlp.w1", "mlp.w3"]),
];

/// Rows of each part of a fused module, in order.
fn part_rows(config: &ModelConfig, fused: &str, out: usize) -> Vec<usize> {
    if fused == "self_attn.qkv_proj" {
        let (q, kv) = (
            config.num_attention_heads * config.head_dim,
            config.num_key_value_heads * config.head_dim,
        );
        vec![q, kv, kv]
    } else {
        vec![out / 2, out / 2]
    }
}

/// Heads whose rotary rows torchtune interleaves in `tt_module`, if any.
fn permuted_heads(config: &ModelConfig, tt_module: &str) -> Option<usize> {
    if tt_module.ends_with("attn.q_proj") {
        Some(config.num_attention_heads)
    } else if tt_module.ends_with("attn.k_proj") {
        Some(config.num_key_value_heads)
    } else {
        None
    }
}

/// Rows `[out, ...]` (or a vector `[out]`) from HF's rotary halves into torchtune's pairs
/// (`to_pairs`) or back.
fn permute_rows(
    t: &Tensor,
    heads: usize,
    head_dim: usize,
    to_pairs: bool,
) -> candle_core::Result<Tensor> {
    let vector = t.rank() == 1;
    let m = if vector { t.unsqueeze(1)? } else { t.clone() };
    let p = if to_pairs {
        permute_rotary_to_pairs(&m, heads, head_dim)?
    } else {
        unpermute_rotary(&m, heads, head_dim, m.dim(1)?)?
    };
    if vector {
        p.squeeze(1)
    } else {
        Ok(p)
    }
}

/// Why `model`'s adapters do not fit torchtune's `adapter_model.pt`, whose LoRA layers adapt
/// linear layers only and have no bias on `lora_b`; `None` when they fit.
pub fn unfit_adapter(model: &CausalLm) -> Option<&'static str> {
    if model.embed_adapter.is_some() {
        return Some("the token embedding has an adapter (torchtune adapts linear layers only)");
    }
    if !super::gpt_oss_params::tensors(model).is_empty() {
        return Some("gpt-oss's fused experts have adapters (target_parameters), which torchtune's LoRA layers lack");
    }
    let biased = model
        .linears()
        .iter()
        .any(|(_, l)| l.adapter.as_ref().is_some_and(|a| a.bias.is_some()));
    biased.then_some("the adapters have a bias (lora_bias), which torchtune's LoRA layers lack")
}

/// `model`'s adapters under torchtune's names and layout (what `adapter_model.pt` holds), in f32
/// on the CPU.
pub fn torchtune_adapter_tensors(model: &CausalLm) -> Result<Vec<(String, Tensor)>, ModelError> {
    let config = &model.config;
    let lay = layout(config).ok_or_else(|| ModelError::Msg(unsupported(config)))?;
    if let Some(why) = unfit_adapter(model) {
        return Err(ModelError::Msg(format!(
            "torchtune's adapter_model.pt cannot hold these adapters: {why}; use the PEFT \
             adapter files"
        )));
    }
    let cpu = |t: &Tensor| -> candle_core::Result<Tensor> {
        t.to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .contiguous()
    };
    let mut out = Vec::new();
    let mut push = |module: String, a: Tensor, b: Tensor, m: Option<Tensor>| {
        out.push((format!("{module}.lora_a.weight"), a));
        out.push((format!("{module}.lora_b.weight"), b));
        if let Some(m) = m {
            out.push((format!("{module}.magnitude"), m));
        }
    };
    for (name, linear) in model.linears() {
        let Some(adapter) = &linear.adapter else {
            continue;
        };
        let (a, b) = (cpu(&adapter.a)?, cpu(&adapter.b)?);
        let m = adapter.dora_magnitude.as_ref().map(cpu).transpose()?;
        if name == "lm_head" {
            push("output".into(), a, b, m);
            continue;
        }
        let unknown = || {
            ModelError::Msg(format!(
                "module '{name}' has an adapter but no torchtune name for model type '{}'",
                config.model_type
            ))
        };
        let rest = name.strip_prefix("model.layers.").ok_or_else(unknown)?;
        let (layer, tail) = rest.split_once('.').ok_or_else(unknown)?;
        if let Some((_, parts)) = FUSED.iter().find(|(f, _)| *f == tail) {
            if lay != Layout::SplitFused {
                return Err(unknown());
            }
            let rows = part_rows(config, tail, b.dim(0)?);
            let mut pieces = Vec::with_capacity(rows.len());
            let mut start = 0;
            for n in rows {
                let bp = b.narrow(0, start, n)?;
                let mp = m.as_ref().map(|m| m.narrow(0, start, n)).transpose()?;
                // The columns of B this part uses: a block-diagonal adapter read from torchtune
                // goes back as the parts it came from.
                let used = used_columns(&bp)?;
                pieces.push((bp, mp, used));
                start += n;
            }
            // A part none of whose B is used had no adapter in torchtune (unless no part uses
            // any column yet: a fresh adapter, B all zeros, is written whole).
            let any_used = pieces.iter().any(|(_, _, used)| !used.is_empty());
            for (part, (bp, mp, used)) in parts.iter().zip(pieces) {
                if any_used && used.is_empty() {
                    continue;
                }
                let (ap, bp) = if used.is_empty() || used.len() == bp.dim(1)? {
                    (a.clone(), bp)
                } else {
                    let idx = Tensor::new(used.as_slice(), &Device::Cpu)?;
                    (
                        a.index_select(&idx, 0)?.contiguous()?,
                        bp.index_select(&idx, 1)?.contiguous()?,
                    )
                };
                push(
                    format!("layers.{layer}.{part}"),
                    ap,
                    bp.contiguous()?,
                    mp.map(|m| m.contiguous()).transpose()?,
                );
            }
            continue;
        }
        let tt = MODULES
            .iter()
            .find(|(hf, _)| *hf == tail)
            .map(|(_, tt)| *tt)
            .ok_or_else(unknown)?;
        let (b, m) = match (lay, permuted_heads(config, tt)) {
            (Layout::Permuted, Some(heads)) => (
                permute_rows(&b, heads, config.head_dim, true)?,
                m.map(|m| permute_rows(&m, heads, config.head_dim, true))
                    .transpose()?,
            ),
            _ => (b, m),
        };
        push(format!("layers.{layer}.{tt}"), a, b, m);
    }
    if out.is_empty() {
        return Err(ModelError::Msg("the model has no adapters to save".into()));
    }
    Ok(out)
}

/// The column indices of `b` ([rows, r]) with any non-zero entry.
fn used_columns(b: &Tensor) -> candle_core::Result<Vec<u32>> {
    let any = b.abs()?.max(0)?.to_vec1::<f32>()?;
    Ok(any
        .iter()
        .enumerate()
        .filter(|(_, v)| **v != 0.0)
        .map(|(i, _)| i as u32)
        .collect())
}

/// Whether `a` and `b` hold the same values, element for element (`b` taken to `a`'s dtype
/// and device).
pub(crate) fn same_values(a: &Tensor, b: &Tensor) -> bool {
    a.dims() == b.dims()
        && b.to_dtype(a.dtype())
            .and_then(|b| b.to_device(a.device()))
            .and_then(|b| {
                a.eq(&b)?
                    .to_dtype(DType::F32)?
                    .min_all()?
                    .to_scalar::<f32>()
            })
            .is_ok_and(|v| v == 1.0)
}

/// Writes `model`'s adapters to `dir/adapter_model.pt` as torchtune saves them.
pub fn save_torchtune_adapter(model: &CausalLm, dir: &Path) -> Result<(), ModelError> {
    let tensors = torchtune_adapter_tensors(model)?;
    write_torch_tensors(&dir.join(TORCHTUNE_ADAPTER_FILE), &tensors)
}

/// One torchtune module's adapter tensors.
#[derive(Default)]
struct Parts {
    a: Option<Tensor>,
    b: Option<Tensor>,
    magnitude: Option<Tensor>,
}

/// Reads torchtune's `adapter_model.pt` (`file`) and attaches it to `model` with `lora_alpha`
/// (torchtune's file holds no alpha: it comes from the run's `model.lora_alpha`, or from the
/// `adapter_config.json` torchtune writes beside it). Returns the equivalent PEFT config.
pub fn load_torchtune_adapter(
    model: &mut CausalLm,
    file: &Path,
    lora_alpha: f64,
) -> Result<LoraConfig, ModelError> {
    let (lc, peft) = read_torchtune_adapter(model, file, lora_alpha)?;
    attach_adapter(model, &lc, peft, &file.display().to_string())?;
    Ok(lc)
}

/// torchtune's `adapter_model.pt` (`file`) for `model` as a PEFT config and PEFT-named tensors
/// (f32, CPU), without attaching them.
pub fn read_torchtune_adapter(
    model: &CausalLm,
    file: &Path,
    lora_alpha: f64,
) -> Result<(LoraConfig, HashMap<String, Tensor>), ModelError> {
    let err = |msg: String| ModelError::file(file, msg);
    let config = model.config.clone();
    let lay = layout(&config).ok_or_else(|| err(unsupported(&config)))?;
    let mut modules: BTreeMap<String, Parts> = BTreeMap::new();
    for (name, t) in read_torch_file(file)? {
        let t = t.to_weight(file, &name, Some(DType::F32), &Device::Cpu)?;
        let (module, slot) = if let Some(m) = name.strip_suffix(".lora_a.weight") {
            (m, 0)
        } else if let Some(m) = name.strip_suffix(".lora_b.weight") {
            (m, 1)
        } else if let Some(m) = name.strip_suffix(".magnitude") {
            (m, 2)
        } else {
            return Err(err(format!(
                "tensor '{name}' is not a torchtune adapter tensor (`*.lora_a.weight`, \
                 `*.lora_b.weight`, `*.magnitude`)"
            )));
        };
        let parts = modules.entry(module.to_string()).or_default();
        match slot {
            0 => parts.a = Some(t),
            1 => parts.b = Some(t),
            _ => parts.magnitude = Some(t),
        }
    }
    if modules.is_empty() {
        return Err(err("holds no adapter tensors".into()));
    }
    let dora = modules.values().any(|p| p.magnitude.is_some());
    // torchtune module → (HF module, part index within a fused module).
    let mut by_hf: BTreeMap<String, Vec<(usize, String, Parts)>> = BTreeMap::new();
    for (tt, parts) in modules {
        if parts.a.is_none() || parts.b.is_none() || parts.magnitude.is_some() != dora {
            return Err(err(format!(
                "module '{tt}' lacks its lora_a, lora_b{} tensor",
                if dora { " or magnitude" } else { "" }
            )));
        }
        let unknown = || {
            err(format!(
                "'{tt}' is not a torchtune module name of a {} model",
                config.model_type
            ))
        };
        let (hf, index) = if tt == "output" {
            ("lm_head".to_string(), 0)
        } else {
            let rest = tt.strip_prefix("layers.").ok_or_else(unknown)?;
            let (layer, tail) = rest.split_once('.').ok_or_else(unknown)?;
            let fused = FUSED
                .iter()
                .find_map(|(f, ps)| ps.iter().position(|p| *p == tail).map(|i| (*f, i)));
            match fused {
                Some((f, i)) if lay == Layout::SplitFused => {
                    (format!("model.layers.{layer}.{f}"), i)
                }
                _ => {
                    let hf = MODULES
                        .iter()
                        .find(|(_, t)| *t == tail)
                        .map(|(hf, _)| *hf)
                        .ok_or_else(unknown)?;
                    (format!("model.layers.{layer}.{hf}"), 0)
                }
            }
        };
        by_hf.entry(hf).or_default().push((index, tt, parts));
    }

    let weights: HashMap<String, Tensor> = model
        .linears()
        .into_iter()
        .map(|(n, l)| {
            Ok((
                n,
                l.weight
                    .dense()?
                    .to_dtype(DType::F32)?
                    .to_device(&Device::Cpu)?,
            ))
        })
        .collect::<Result<_, ModelError>>()?;
    let mut peft: HashMap<String, Tensor> = HashMap::new();
    let mut ranks: Vec<(String, usize)> = Vec::new();
    for (hf, mut parts) in by_hf {
        let weight = weights.get(&hf).ok_or_else(|| {
            err(format!(
                "module '{}' has no layer '{hf}' in this model",
                parts[0].1
            ))
        })?;
        let tail = hf.split('.').skip(3).collect::<Vec<_>>().join(".");
        let fused = FUSED
            .iter()
            .find(|(f, _)| *f == tail && lay == Layout::SplitFused);
        let (a, b, m) = match fused {
            None => {
                let (_, tt, p) = parts.pop().expect("one part");
                let (a, b) = (p.a.expect("checked"), p.b.expect("checked"));
                match (lay, permuted_heads(&config, &tt)) {
                    (Layout::Permuted, Some(heads)) => {
                        let unpermute = |t: &Tensor| {
                            permute_rows(t, heads, config.head_dim, false)
                                .map_err(|e| err(format!("'{tt}': {e}")))
                        };
                        let m = p.magnitude.as_ref().map(unpermute).transpose()?;
                        (a, unpermute(&b)?, m)
                    }
                    _ => (a, b, p.magnitude),
                }
            }
            Some((_, names)) => {
                parts.sort_by_key(|(i, _, _)| *i);
                fuse_parts(&config, &tail, names.len(), weight, parts, dora, lora_alpha)
                    .map_err(|e| err(format!("module '{hf}': {e}")))?
            }
        };
        ranks.push((hf.clone(), a.dim(0)?));
        let p = format!("{PEFT_PREFIX}{hf}");
        peft.insert(format!("{p}.lora_A.weight"), a);
        peft.insert(format!("{p}.lora_B.weight"), b);
        if let Some(m) = m {
            peft.insert(format!("{p}.lora_magnitude_vector"), m);
        }
    }

    // torchtune has one rank for every module; a block-diagonal fused module has a multiple.
    let mut counts: BTreeMap<usize, usize> = BTreeMap::new();
    for (_, r) in &ranks {
        *counts.entry(*r).or_default() += 1;
    }
    let r = counts
        .iter()
        .max_by_key(|(r, n)| (**n, std::cmp::Reverse(**r)))
        .map(|(r, _)| *r)
        .expect("modules");
    let mut names: Vec<String> = ranks
        .iter()
        .map(|(m, _)| m.rsplit('.').next().unwrap_or(m).to_string())
        .collect();
    names.sort();
    names.dedup();
    let mut lc = LoraConfig::new(r, lora_alpha, TargetModules::Names(names));
    lc.use_dora = dora;
    for (module, rank) in ranks.iter().filter(|(_, rank)| *rank != r) {
        lc.rank_pattern.push((module.clone(), *rank));
        lc.alpha_pattern
            .push((module.clone(), lora_alpha * *rank as f64 / r as f64));
    }
    Ok((lc, peft))
}

/// One adapter on a fused module from its torchtune parts (`parts`: index, name, tensors; some
/// parts may be missing), computing what the parts compute: one shared A when every present
/// part has the same A, else the A's stacked with B block-diagonal. Rows of missing parts get
/// zero B and, under DoRA, their weight rows' norms as magnitude (a factor of one).
fn fuse_parts(
    config: &ModelConfig,
    tail: &str,
    n_parts: usize,
    weight: &Tensor,
    parts: Vec<(usize, String, Parts)>,
    dora: bool,
    lora_alpha: f64,
) -> Result<(Tensor, Tensor, Option<Tensor>), String> {
    let e = |x: candle_core::Error| x.to_string();
    let (out, _) = weight.dims2().map_err(e)?;
    let rows = part_rows(config, tail, out);
    let starts: Vec<usize> = rows
        .iter()
        .scan(0, |s, n| {
            let start = *s;
            *s += n;
            Some(start)
        })
        .collect();
    let a0 = parts[0].2.a.as_ref().expect("checked");
    let shared = parts
        .iter()
        .all(|(_, _, p)| same_values(p.a.as_ref().expect("checked"), a0));
    let a = if shared {
        a0.clone()
    } else {
        let a_parts: Vec<&Tensor> = parts
            .iter()
            .map(|(_, _, p)| p.a.as_ref().expect("checked"))
            .collect();
        Tensor::cat(&a_parts, 0).map_err(e)?
    };
    let rank = a.dim(0).map_err(e)?;
    let mut b_rows: Vec<Tensor> = Vec::with_capacity(n_parts);
    let mut m_rows: Vec<Tensor> = Vec::with_capacity(n_parts);
    let mut col = 0;
    for i in 0..n_parts {
        let present = parts.iter().find(|(j, _, _)| *j == i).map(|(_, _, p)| p);
        match present {
            Some(p) => {
                let b = p.b.as_ref().expect("checked");
                if b.dim(0).map_err(e)? != rows[i] {
                    return Err(format!(
                        "part {i} has {} rows of lora_b, the model {}",
                        b.dim(0).map_err(e)?,
                        rows[i]
                    ));
                }
                let placed = if shared {
                    b.clone()
                } else {
                    let r = b.dim(1).map_err(e)?;
                    let left =
                        Tensor::zeros((rows[i], col), DType::F32, &Device::Cpu).map_err(e)?;
                    let right = Tensor::zeros((rows[i], rank - col - r), DType::F32, &Device::Cpu)
                        .map_err(e)?;
                    col += r;
                    Tensor::cat(&[&left, b, &right], 1).map_err(e)?
                };
                b_rows.push(placed);
                if let Some(m) = &p.magnitude {
                    m_rows.push(m.clone());
                }
            }
            None => {
                b_rows.push(Tensor::zeros((rows[i], rank), DType::F32, &Device::Cpu).map_err(e)?);
                if dora {
                    let w = weight.narrow(0, starts[i], rows[i]).map_err(e)?;
                    let zero = w.zeros_like().map_err(e)?;
                    m_rows.push(weight_norm(&w, &zero, lora_alpha).map_err(e)?);
                }
            }
        }
    }
    let b = Tensor::cat(&b_rows, 0).map_err(e)?;
    let m = if dora {
        Some(Tensor::cat(&m_rows, 0).map_err(e)?)
    } else {
        None
    };
    Ok((a, b, m))
}
