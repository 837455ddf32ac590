//! The model's tensors grouped into units that sharded (FSDP-style) training gathers and releases
//! together: one unit per decoder layer, and a root unit for the embedding, the final norm and the
//! output head (torchtune wraps each layer the same way).

use candle_core::Tensor;

use crate::model::final_norm_entries_mut;
use crate::peft::PEFT_PREFIX;
use crate::{CausalLm, Linear};

/// A group of tensors gathered and released together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    /// Embedding, final norm and output head.
    Root,
    /// Decoder layer `i`.
    Layer(usize),
}

impl Unit {
    /// A short stable name (`root`, `layer.3`), used to key per-unit state.
    pub fn name(self) -> String {
        match self {
            Unit::Root => "root".to_string(),
            Unit::Layer(i) => format!("layer.{i}"),
        }
    }
}

/// A linear layer's tensors under the names their trainable parameters carry: `{module}.weight`
/// (unless `with_weight` is false: a tied head's weight is the embedding) and `{module}.bias`
/// (full fine-tuning's HF names), adapter tensors under PEFT's parameter names.
fn linear_tensors_mut<'a>(
    module: &str,
    linear: &'a mut Linear,
    with_weight: bool,
    out: &mut Vec<(String, &'a mut Tensor)>,
) {
    // An NF4 base is not a tensor: it is frozen and never a slot.
    if let (true, Some(weight)) = (with_weight, linear.weight.as_dense_mut().ok()) {
        out.push((format!("{module}.weight"), weight));
    }
    if let Some(b) = &mut linear.bias {
        out.push((format!("{module}.bias"), b));
    }
    if let Some(adapter) = &mut linear.adapter {
        adapter_tensors_mut(module, ["lora_A.weight", "lora_B.weight"], adapter, out);
    }
}

/// An adapter's tensors under their PEFT parameter names: `a_b` are the names of A and B
/// (`lora_A.weight`, or the embedding's bare `lora_embedding_A`).
fn adapter_tensors_mut<'a>(
    module: &str,
    a_b: [&str; 2],
    adapter: &'a mut crate::model::lora::LoraAdapter,
    out: &mut Vec<(String, &'a mut Tensor)>,
) {
    out.push((format!("{PEFT_PREFIX}{module}.{}", a_b[0]), &mut adapter.a));
    out.push((format!("{PEFT_PREFIX}{module}.{}", a_b[1]), &mut adapter.b));
    if let Some(m) = &mut adapter.dora_magnitude {
        out.push((
            format!("{PEFT_PREFIX}{module}.lora_magnitude_vector.weight"),
            m,
        ));
    }
    if let Some(b) = &mut adapter.bias {
        out.push((format!("{PEFT_PREFIX}{module}.lora_B.bias"), b));
    }
}

impl CausalLm {
    /// Every unit: the root first, then the layers in order.
    pub fn units(&self) -> Vec<Unit> {
        std::iter::once(Unit::Root)
            .chain((0..self.layers.len()).map(Unit::Layer))
            .collect()
    }

    /// Every tensor of `unit`, mutable, under the name of the parameter it is (the names
    /// [`CausalLm::make_all_trainable`] and [`crate::peft::trainable_parameters`] return), in a
    /// fixed order. A tied output head is not listed: it is the embedding (see
    /// [`CausalLm::retie_head`]).
    pub fn unit_tensors_mut(&mut self, unit: Unit) -> Vec<(String, &mut Tensor)> {
        let head = self.head_name();
        let mut out = Vec::new();
        match unit {
            Unit::Root => {
                out.push((
                    "model.embed_tokens.weight".to_string(),
                    &mut self.embed_tokens,
                ));
                if let Some(adapter) = &mut self.embed_adapter {
                    let names = ["lora_embedding_A", "lora_embedding_B"];
                    adapter_tensors_mut(crate::peft::EMBED_MODULE, names, adapter, &mut out);
                }
                if let Some(ple) = &mut self.per_layer_embedding {
                    out.push((crate::model::PER_LAYER_TABLE.to_string(), &mut ple.table));
                    out.push((crate::model::PER_LAYER_NORM.to_string(), &mut ple.norm));
                    let module = crate::model::PER_LAYER_PROJECTION;
                    linear_tensors_mut(module, &mut ple.projection, true, &mut out);
                }
                out.extend(final_norm_entries_mut(
                    &self.config,
                    &mut self.norm,
                    self.norm_bias.as_mut(),
                ));
                // The shared weight of a tied head is listed once, as the embedding; an adapter
                // on the head still has its own tensors.
                let tied = self.config.tie_word_embeddings;
                linear_tensors_mut(head, &mut self.lm_head, !tied, &mut out);
            }
            Unit::Layer(i) => {
                let p = format!("model.layers.{i}");
                let parts = self.layers[i].parts_mut();
                for (name, norm) in parts.norms {
                    out.push((format!("{p}.{name}"), norm));
                }
                for (module, linear) in parts.linears {
                    linear_tensors_mut(&format!("{p}.{module}"), linear, true, &mut out);
                }
                for (name, t) in parts.adapters {
                    out.push((format!("{}{p}.{name}", crate::peft::PEFT_PREFIX), t));
                }
            }
        }
        out
    }

    /// The NF4 (QLoRA) base weights of `unit`, mutable, under their modules' weight names, in a
    /// fixed order: frozen weights that are not tensors, which sharded training splits apart.
    pub fn unit_nf4_mut(&mut self, unit: Unit) -> Vec<(String, &mut crate::model::BaseWeight)> {
        let linears: Vec<(String, &mut Linear)> = match unit {
            Unit::Root => vec![(self.head_name().to_string(), &mut self.lm_head)],
            Unit::Layer(i) => {
                let p = format!("model.layers.{i}");
                self.layers[i]
                    .parts_mut()
                    .linears
                    .into_iter()
                    .map(|(module, linear)| (format!("{p}.{module}"), linear))
                    .collect()
            }
        };
        linears
            .into_iter()
            .filter(|(_, l)| matches!(l.weight, crate::model::BaseWeight::Nf4(_)))
            .map(|(module, l)| (format!("{module}.weight"), &mut l.weight))
            .collect()
    }

    /// Points a tied output head at the (possibly replaced) embedding tensor again. A packed
    /// (GGUF block) copy of the head is dropped when the embedding was replaced: it holds the
    /// old values.
    pub fn retie_head(&mut self) {
        if self.config.tie_word_embeddings {
            let same = self
                .lm_head
                .weight
                .as_dense()
                .is_some_and(|w| w.id() == self.embed_tokens.id());
            if !same {
                self.lm_head.packed = None;
            }
            self.lm_head.weight = crate::model::BaseWeight::Dense(self.embed_tokens.clone());
        }
    }
}
