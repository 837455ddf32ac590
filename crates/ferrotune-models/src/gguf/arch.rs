//! The architecture of a GGUF file and the hyperparameters its metadata gives.

use candle_core::quantized::gguf_file::Value as GgufValue;

use crate::error::ModelError;
use crate::family;
use crate::family::gguf::{GgufHParams, GgufMoe, GgufNames, GgufNaming, GgufReading};

use super::*;

/// Architecture-specific handling.
pub(super) struct Arch {
    /// `general.architecture`, the prefix of the architecture's metadata keys.
    pub(super) gguf: String,
    /// transformers' `model_type`.
    pub(super) model_type: &'static str,
    /// How the model type's files read.
    pub(super) reading: GgufReading,
    /// transformers' model class, for `architectures`.
    pub(super) hf_class: &'static str,
    /// llama.cpp permuted q/k rows for its RoPE layout.
    pub(super) permuted_qk: bool,
    /// llama.cpp stored norm weights as `1 + w`.
    pub(super) norm_plus_one: bool,
}

impl Arch {
    pub(super) fn from_metadata(g: &GgufFile) -> Result<Self, ModelError> {
        let gguf = g
            .string("general.architecture")?
            .ok_or_else(|| g.err("missing metadata key 'general.architecture'"))?
            .to_string();
        let name = g.string("general.name")?.unwrap_or("").to_ascii_lowercase();
        let experts = g.uint(&format!("{gguf}.expert_count"))?.unwrap_or(0);
        let Some(entry) = family::gguf_arch(&gguf) else {
            return Err(g.err(format!(
                "unsupported GGUF architecture '{gguf}': supported are {}",
                family::gguf_arch_names()
            )));
        };
        let model_type = entry.model_type_of(&name, experts);
        let (_, entry_type) = family::model_type(model_type)
            .expect("every GGUF architecture reads as a registered model_type");
        let hf_class = entry_type.causal_lm;
        let reading = entry_type.gguf_reading;
        // As transformers' TENSOR_PROCESSORS: the un-permutation keys on the GGUF architecture.
        let permuted_qk = entry.permuted_qk;
        let norm_plus_one = entry.norm_plus_one;
        Ok(Self {
            gguf,
            model_type,
            reading,
            hf_class,
            permuted_qk,
            norm_plus_one,
        })
    }
}

impl Arch {
    /// Gemma 2/3's four norms per layer.
    pub(super) fn sandwich_norms(&self) -> bool {
        self.reading.sandwich_norms
    }

    /// A sparse mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE).
    pub(super) fn is_moe(&self) -> bool {
        self.reading.moe.is_some()
    }

    /// What decides its tensors' HF names.
    pub(super) fn naming(&self) -> GgufNaming {
        self.reading.naming(self.sandwich_norms())
    }

    /// Phi-2's tensor names and LayerNorm.
    pub(super) fn phi2(&self) -> bool {
        self.reading.names == GgufNames::Phi2
    }

    /// The HF module (under `model.layers.N`) of an expert's gate, up or down projection
    /// (`expert` = None: the router), in transformers 4.x's per-expert names, which is what Hub
    /// checkpoints hold and what PEFT adapters target.
    pub(super) fn expert_module(&self, expert: Option<usize>, part: Kind) -> String {
        let mixtral = self.naming().mixtral_names;
        let block = if mixtral { "block_sparse_moe" } else { "mlp" };
        let Some(e) = expert else {
            return format!("{block}.gate");
        };
        let proj = match (part, mixtral) {
            (Kind::Gate, true) => "w1",
            (Kind::Up, true) => "w3",
            (Kind::Down, true) => "w2",
            (Kind::Gate, false) => "gate_proj",
            (Kind::Up, false) => "up_proj",
            _ => "down_proj",
        };
        format!("{block}.experts.{e}.{proj}")
    }
}

/// The hyperparameters read from metadata.
pub(super) type HParams = GgufHParams;

impl HParams {
    pub(super) fn read(g: &GgufFile, arch: &Arch) -> Result<Self, ModelError> {
        let a = &arch.gguf;
        let k = |s: &str| format!("{a}.{s}");
        let experts = g.uint(&k("expert_count"))?.unwrap_or(0) as usize;
        if experts > 0 && !arch.is_moe() {
            return Err(g.err(format!(
                "mixture-of-experts models ({a}.expert_count = {experts}) are only supported for llama (Mixtral), qwen2moe and qwen3moe"
            )));
        }
        if arch.is_moe() && experts == 0 {
            return Err(g.err(format!("missing metadata key '{}'", k("expert_count"))));
        }
        let hidden = g.req_count(&k("embedding_length"))?;
        let layers = g.req_count(&k("block_count"))?;
        // Checked before the per-layer tables below are sized by it: against the machine, and,
        // past what any real model has, against the blocks the file's tensors hold (a file
        // read for its metadata or some tensors alone may hold no block; whether a model's file
        // holds every block is checked when the model is built from it).
        let key = format!("metadata key '{}'", k("block_count"));
        crate::config::layers::check_layer_count(layers, &key).map_err(|m| g.err(m))?;
        let names = g.content.tensor_infos.keys().map(String::as_str);
        let held = crate::config::layers::layers_held(names, "blk.");
        crate::config::layers::check_unheld_layers(layers, held, &key).map_err(|m| g.err(m))?;
        let ffn = g.req_count(&k("feed_forward_length"))?;
        let heads = g.req_count(&k("attention.head_count"))?;
        let context = g.req_count(&k("context_length"))?;
        let kv_heads = match g.uint(&k("attention.head_count_kv"))? {
            Some(n) if n > 0 && n <= heads as u64 && (heads as u64).is_multiple_of(n) => n as usize,
            Some(n) => {
                return Err(g.err(format!(
                "metadata key '{}' is {n}, which does not divide {}.attention.head_count {heads}",
                k("attention.head_count_kv"),
                a
            )))
            }
            None => heads,
        };
        // Phi-2 normalizes with LayerNorm, the others with RMSNorm.
        let eps_key = if arch.phi2() {
            k("attention.layer_norm_epsilon")
        } else {
            k("attention.layer_norm_rms_epsilon")
        };
        let rms_eps = g
            .float(&eps_key)?
            .ok_or_else(|| g.err(format!("missing metadata key '{eps_key}'")))?;
        if rms_eps < 0.0 {
            return Err(g.err(format!(
                "metadata key '{eps_key}' must not be negative, found {rms_eps}"
            )));
        }
        let rope_theta = g.positive_float(&k("rope.freq_base"))?.unwrap_or(10000.0);
        let rope_dims = g.uint(&k("rope.dimension_count"))?.map(|n| n as usize);
        // Head size: `attention.key_length` when given; for llama transformers takes
        // `rope.dimension_count` (llama.cpp writes the head size there); else hidden / heads.
        let head_dim = match g.uint(&k("attention.key_length"))? {
            Some(n) => n as usize,
            None => match rope_dims {
                Some(d) if arch.reading.head_dim_from_rope => d,
                _ => {
                    if hidden % heads != 0 {
                        return Err(g.err(format!(
                            "{a}.embedding_length {hidden} is not divisible by {a}.attention.head_count {heads} and {a}.attention.key_length is missing"
                        )));
                    }
                    hidden / heads
                }
            },
        };
        if head_dim == 0 || head_dim > 1 << 16 {
            return Err(g.err(format!("implausible head dimension {head_dim}")));
        }
        let rope_dims = rope_dims.unwrap_or(head_dim);
        if rope_dims > head_dim || rope_dims % 2 != 0 {
            return Err(g.err(format!(
                "{a}.rope.dimension_count {rope_dims} does not fit the head dimension {head_dim}"
            )));
        }
        // As transformers: `{arch}.vocab_size`, else the tokenizer's token count; failing both,
        // the embedding matrix's row count.
        let vocab = match g.uint(&k("vocab_size"))? {
            Some(n) => n as usize,
            None => match g.meta("tokenizer.ggml.tokens") {
                Some(GgufValue::Array(t)) => t.len(),
                Some(v) => {
                    return Err(g.err(format!(
                        "metadata key 'tokenizer.ggml.tokens' must be an array, found {}",
                        show(v)
                    )))
                }
                None => match g.content.tensor_infos.get("token_embd.weight") {
                    Some(info) => info.shape.dims().first().copied().unwrap_or(0),
                    None => {
                        return Err(g.err(format!(
                            "missing metadata key '{}' (and tokenizer.ggml.tokens)",
                            k("vocab_size")
                        )))
                    }
                },
            },
        };
        if vocab == 0 {
            return Err(g.err("the vocabulary is empty"));
        }
        // A file with experts has a sparse reading (checked above).
        let (experts_used, expert_ffn, shared_ffn, sparse_layers) = match arch.reading.moe {
            Some(moe) if experts > 0 => Self::experts(g, &arch.gguf, moe, experts, ffn, layers)?,
            _ => (0, 0, None, vec![false; layers]),
        };
        Ok(Self {
            vocab,
            hidden,
            ffn,
            layers,
            heads,
            kv_heads,
            head_dim,
            rope_dims,
            context,
            rms_eps,
            rope_theta,
            experts,
            experts_used,
            expert_ffn,
            shared_ffn,
            sparse_layers,
        })
    }

    /// A mixture of experts' top-k, expert and shared-expert sizes and sparse layers. The sizes
    /// come from the metadata, else (files written before llama.cpp recorded them) from the
    /// tensors' shapes; Mixtral's experts are `feed_forward_length` wide.
    pub(super) fn experts(
        g: &GgufFile,
        a: &str,
        moe: GgufMoe,
        experts: usize,
        ffn: usize,
        layers: usize,
    ) -> Result<(usize, usize, Option<usize>, Vec<bool>), ModelError> {
        let k = |s: &str| format!("{a}.{s}");
        let used = g.req_count(&k("expert_used_count"))?;
        if used > experts {
            return Err(g.err(format!(
                "{a}.expert_used_count {used} is more than {a}.expert_count {experts}"
            )));
        }
        let infos = &g.content.tensor_infos;
        // Rows of the first tensor of a kind found in any layer (PyTorch order).
        let rows_of = |part: &str, dim: usize| -> Option<usize> {
            (0..layers).find_map(|i| {
                infos
                    .get(&format!("blk.{i}.{part}.weight"))
                    .and_then(|t| t.shape.dims().get(dim).copied())
            })
        };
        let expert_ffn = if moe.expert_ffn_is_ffn {
            ffn
        } else {
            match g.uint(&k("expert_feed_forward_length"))? {
                Some(n) if n > 0 => n as usize,
                _ => rows_of("ffn_gate_exps", 1)
                    .or_else(|| rows_of("ffn_gate.0", 0))
                    .ok_or_else(|| {
                        g.err(format!(
                            "missing metadata key '{}'",
                            k("expert_feed_forward_length")
                        ))
                    })?,
            }
        };
        let shared_ffn = if moe.shared_expert {
            Some(match g.uint(&k("expert_shared_feed_forward_length"))? {
                Some(n) if n > 0 => n as usize,
                _ => rows_of("ffn_gate_shexp", 0).ok_or_else(|| {
                    g.err(format!(
                        "missing metadata key '{}' (and no ffn_gate_shexp tensor)",
                        k("expert_shared_feed_forward_length")
                    ))
                })?,
            })
        } else {
            None
        };
        let sparse: Vec<bool> = (0..layers)
            .map(|i| infos.contains_key(&format!("blk.{i}.ffn_gate_inp.weight")))
            .collect();
        if moe.all_sparse {
            if let Some(i) = sparse.iter().position(|s| !s) {
                return Err(g.err(format!(
                    "layer {i} has no router (blk.{i}.ffn_gate_inp.weight): every Mixtral layer is a mixture of experts"
                )));
            }
        }
        Ok((used, expert_ffn, shared_ffn, sparse))
    }
}
