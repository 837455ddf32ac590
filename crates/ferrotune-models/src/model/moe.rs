//! Mixtures of experts: [`Moe`] (Mixtral, Qwen-MoE, Phi-3.5-MoE, Llama 4), Gemma 4's
//! [`ParallelMoe`], the routing (softmax top-k, the sparsemixer, Llama 4's sigmoid routing), the
//! experts' forward and the router records of the auxiliary loss ([`RouterRecord`]).

use candle_core::{DType, Result as CResult, Tensor};
use ferrotune_core::ops;

use super::{
    mlp_linears, mlp_linears_mut, weightless_rms_norm, CausalLm, GroupedRouter, Linear, Mlp,
};
use crate::config::SparseMixer;

/// A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks `top_k`
/// experts per token, whose outputs are summed with the routing weights.
#[derive(Debug, Clone)]
pub struct Moe {
    /// The router (`gate`, `[experts, hidden]`).
    pub router: Linear,
    /// Gated experts (gate / up / down).
    pub experts: Vec<Mlp>,
    /// The always-on shared expert, with Qwen2-MoE's gate (`[1, hidden]`, through a sigmoid);
    /// Llama 4's has no gate.
    pub shared_expert: Option<(Mlp, Option<Linear>)>,
    /// Llama 4's routing ([`crate::config::MoeConfig::sigmoid_input_routing`]).
    pub sigmoid_input_routing: bool,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    /// Mixtral keeps the routing weights in f32 when scaling expert outputs.
    pub f32_routing_weights: bool,
    /// Mixtral's module names (`block_sparse_moe.experts.N.w1`, ...) instead of Qwen's.
    pub mixtral_names: bool,
    /// Phi-3.5-MoE routes with the sparsemixer (two experts per token) instead of softmax top-k.
    pub sparse_mixer: Option<SparseMixer>,
    /// DeepSeek's group-limited routing (its shared experts, ungated, are `shared_experts`).
    pub grouped: Option<GroupedRouter>,
}

impl Moe {
    /// The block's module name inside the decoder layer: `block_sparse_moe` (Mixtral) or `mlp`.
    pub fn block_name(&self) -> &'static str {
        if self.mixtral_names {
            "block_sparse_moe"
        } else {
            "mlp"
        }
    }

    /// The router's module name in transformers 5's in-memory model: `router` for Phi-3.5-MoE,
    /// `gate` otherwise.
    pub fn transformers5_router_name(&self) -> &'static str {
        if self.sparse_mixer.is_some() {
            "router"
        } else {
            "gate"
        }
    }

    /// Each expert's gate, up and down projection names: `w1`, `w3`, `w2` (Mixtral) or
    /// `gate_proj`, `up_proj`, `down_proj`.
    pub fn projection_names(&self) -> [&'static str; 3] {
        if self.mixtral_names {
            ["w1", "w3", "w2"]
        } else {
            ["gate_proj", "up_proj", "down_proj"]
        }
    }

    /// The block's module names inside the decoder layer, in the order of [`Moe::linears`]:
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.0.w1` / `w3` / `w2`, ... (Mixtral) or
    /// `mlp.gate`, `mlp.experts.0.gate_proj` / `up_proj` / `down_proj`, ...,
    /// `mlp.shared_expert.*`, `mlp.shared_expert_gate` (Qwen).
    pub(super) fn names(&self) -> Vec<String> {
        let (block, projections) = (self.block_name(), self.projection_names());
        let mut out = vec![format!("{block}.gate")];
        let mut mlp = |prefix: String| {
            out.extend(projections.iter().map(|p| format!("{prefix}.{p}")));
        };
        for e in 0..self.experts.len() {
            mlp(format!("{block}.experts.{e}"));
        }
        if let Some((_, gate)) = &self.shared_expert {
            let shared = if self.grouped.is_some() {
                "shared_experts"
            } else {
                "shared_expert"
            };
            mlp(format!("{block}.{shared}"));
            if gate.is_some() {
                out.push(format!("{block}.shared_expert_gate"));
            }
        }
        out
    }

    /// The router, each expert's gate / up / down projections, then the shared expert's and its
    /// gate. Experts are always separate gated MLPs (the loader builds them so).
    pub(super) fn linears(&self) -> Vec<&Linear> {
        let mut out = vec![&self.router];
        for e in &self.experts {
            out.extend(mlp_linears(e));
        }
        if let Some((shared, gate)) = &self.shared_expert {
            out.extend(mlp_linears(shared));
            out.extend(gate);
        }
        out
    }

    /// [`Moe::linears`], mutable.
    pub(super) fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut out = vec![&mut self.router];
        for e in self.experts.iter_mut() {
            out.extend(mlp_linears_mut(e));
        }
        if let Some((shared, gate)) = &mut self.shared_expert {
            out.extend(mlp_linears_mut(shared));
            out.extend(gate.as_mut());
        }
        out
    }
}

/// Gemma 4's mixture of experts beside the dense MLP (`enable_moe_block`, the 26B-A4B model):
/// on the MLP's residual input `x` the router scores `proj(rms(x) · scale / √hidden)` (a
/// weightless RMSNorm), softmax in f32, top-k renormalized and multiplied by the chosen experts'
/// `per_expert_scale`; the experts run on `pre_feedforward_layernorm_2(x)`. The layer's
/// feed-forward output is `post_feedforward_layernorm_1(mlp) + post_feedforward_layernorm_2(experts)`,
/// then `post_feedforward_layernorm` as in a dense layer.
///
/// The checkpoint holds the experts fused (`experts.gate_up_proj` `[experts, 2 · inter, hidden]`,
/// gate rows first, `experts.down_proj` `[experts, hidden, inter]`); the decoder keeps each as its
/// own gated MLP (named `experts.N.gate_proj`, ...) so that it trains, quantizes and merges as
/// any linear layer, and [`crate::checkpoint::to_saved_layout`] fuses them again.
#[derive(Debug, Clone)]
pub struct ParallelMoe {
    /// `router.proj` (`[experts, hidden]`) and the experts; `top_k` and f32 routing weights.
    pub moe: Moe,
    /// `router.scale` (`[hidden]`).
    pub router_scale: Tensor,
    /// `router.per_expert_scale` (`[experts]`).
    pub per_expert_scale: Tensor,
    /// `pre_feedforward_layernorm_2` (`[hidden]`): the experts' input norm.
    pub pre_norm: Tensor,
    /// `post_feedforward_layernorm_1` (`[hidden]`): the dense MLP's output norm.
    pub post_norm_mlp: Tensor,
    /// `post_feedforward_layernorm_2` (`[hidden]`): the experts' output norm.
    pub post_norm_experts: Tensor,
}

/// The parameter names, inside the decoder layer, of [`ParallelMoe`]'s tensors other than linear
/// layers, in the order [`ParallelMoe::parts_mut`] and [`ParallelMoe::small_tensors`] list them.
pub(super) const PARALLEL_MOE_TENSORS: [&str; 5] = [
    "router.scale",
    "router.per_expert_scale",
    "pre_feedforward_layernorm_2.weight",
    "post_feedforward_layernorm_1.weight",
    "post_feedforward_layernorm_2.weight",
];

impl ParallelMoe {
    /// The router and experts, and the block's tensors other than linear layers with their
    /// parameter names inside the decoder layer, borrowed apart.
    pub(super) fn parts_mut(&mut self) -> (&mut Moe, Vec<(&'static str, &mut Tensor)>) {
        let ParallelMoe {
            moe,
            router_scale,
            per_expert_scale,
            pre_norm,
            post_norm_mlp,
            post_norm_experts,
        } = self;
        let tensors = [
            router_scale,
            per_expert_scale,
            pre_norm,
            post_norm_mlp,
            post_norm_experts,
        ];
        (moe, PARALLEL_MOE_TENSORS.into_iter().zip(tensors).collect())
    }

    /// The block's tensors other than linear layers, with their parameter names inside the
    /// decoder layer.
    pub(super) fn small_tensors(&self) -> Vec<(&'static str, &Tensor)> {
        let tensors = [
            &self.router_scale,
            &self.per_expert_scale,
            &self.pre_norm,
            &self.post_norm_mlp,
            &self.post_norm_experts,
        ];
        PARALLEL_MOE_TENSORS.into_iter().zip(tensors).collect()
    }

    /// The module names of [`Moe::linears`] inside the decoder layer: `router.proj`, then
    /// `experts.N.gate_proj` / `up_proj` / `down_proj`.
    pub(super) fn names(&self) -> Vec<String> {
        let mut out = vec!["router.proj".to_string()];
        for e in 0..self.moe.experts.len() {
            out.extend(["gate_proj", "up_proj", "down_proj"].map(|p| format!("experts.{e}.{p}")));
        }
        out
    }
}

/// One sparse layer's routing of a batch, as the router's auxiliary loss needs it.
#[derive(Debug, Clone)]
pub struct RouterRecord {
    /// The router's softmax probabilities `[tokens, experts]` in f32 (differentiable).
    pub probs: Tensor,
    /// The experts each token was sent to, `top_k` per token in order (`[tokens * top_k]`).
    pub selected: Vec<u32>,
    /// `probs` as read on the host (row-major `[tokens, experts]`).
    pub host_probs: Vec<f32>,
}

impl CausalLm {
    /// Starts recording every sparse layer's routing (see [`RouterRecord`]) until
    /// [`CausalLm::take_router_records`].
    pub fn record_routers(&self) {
        *self.router_tape.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
    }

    /// The routing recorded since [`CausalLm::record_routers`], which stops recording.
    pub fn take_router_records(&self) -> Vec<RouterRecord> {
        self.router_tape
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_default()
    }

    /// A mixture-of-experts block on `x` (`[b, t, hidden]`), as transformers computes it: router
    /// logits, softmax in f32, the top-k experts per token (renormalized with
    /// `norm_topk_prob`), each expert on its tokens, outputs scaled by their weights and summed in
    /// expert order; plus Qwen2-MoE's gated shared expert. The routing weights stay
    /// differentiable (the router trains); the choice of experts is made on the host.
    pub(super) fn moe(&self, moe: &Moe, x: &Tensor) -> CResult<Tensor> {
        let (b, t, h) = x.dims3()?;
        let n = b * t;
        let flat = x.reshape((n, h))?;
        if let Some(router) = &moe.grouped {
            return self.grouped_moe(moe, router, x, &flat);
        }
        let logits = moe.router.forward(&flat)?;
        if moe.sigmoid_input_routing {
            return self.sigmoid_routed_moe(moe, x, &flat, &logits);
        }
        let k = moe.top_k;
        let recording = self
            .router_tape
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        // The softmax's top-k experts of each token: its route with softmax routing, and what
        // the router's auxiliary loss counts whatever the routing (the sparsemixer needs them for
        // that loss only).
        let softmax_top_k = if moe.sparse_mixer.is_none() || recording {
            let probs = ops::softmax_last_dim(&logits.to_dtype(DType::F32)?)?;
            let host: Vec<Vec<f32>> = probs.detach().to_vec2()?;
            let selected = top_k_experts(&host, k);
            if let Some(tape) = self
                .router_tape
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_mut()
            {
                tape.push(RouterRecord {
                    probs: probs.clone(),
                    selected: selected.clone(),
                    host_probs: host.concat(),
                });
            }
            Some((probs, selected))
        } else {
            None
        };
        // Each token's experts (`slots` per token) and their weights `[n, slots]`.
        let (route, top) = match (&moe.sparse_mixer, softmax_top_k) {
            (Some(mixer), _) => sparse_mixer_route(&logits, mixer)?,
            (None, top_k) => {
                let (probs, selected) = top_k.expect("computed for softmax routing");
                let top = gather_routes(&probs, &selected)?;
                let top = if moe.norm_topk_prob {
                    top.broadcast_div(&top.sum_keepdim(1)?)?
                } else {
                    top
                };
                (selected, top)
            }
        };
        let mut out = self.run_experts(moe, &flat, &route, &top)?;
        if let Some((shared, gate)) = &moe.shared_expert {
            let s = self.mlp(shared, x)?.reshape((n, h))?;
            out = match gate {
                // sigmoid(g) = 1 / (1 + e^−g), from differentiable ops.
                Some(gate) => {
                    let g = (gate.forward(&flat)?.neg()?.exp()? + 1.0)?.recip()?;
                    (out + s.broadcast_mul(&g)?)?
                }
                None => (out + s)?,
            };
        }
        out.reshape((b, t, h))
    }

    /// The experts of `moe` on the rows `flat` (`[n, hidden]`) they are routed to (`route`, the
    /// same number of experts per token, in order), each output scaled by its weight in `top`
    /// (`[n, slots]`) and summed in expert order, as transformers does.
    pub(super) fn run_experts(
        &self,
        moe: &Moe,
        flat: &Tensor,
        route: &[u32],
        top: &Tensor,
    ) -> CResult<Tensor> {
        let device = flat.device();
        let slots = route.len() / flat.dim(0)?.max(1);
        // Per expert, the tokens routed to it and where their weight sits in the `[n, slots]`
        // table, tokens in order.
        let mut routed: Vec<(Vec<u32>, Vec<u32>)> =
            vec![(Vec::new(), Vec::new()); moe.experts.len()];
        for (i, &e) in route.iter().enumerate() {
            routed[e as usize].0.push((i / slots) as u32);
            routed[e as usize].1.push(i as u32);
        }
        let weight_dtype = if moe.f32_routing_weights {
            DType::F32
        } else {
            self.dtype
        };
        let weights = top.to_dtype(weight_dtype)?.flatten_all()?;
        add_routed(flat, &moe.experts, routed, |expert, tokens, slots| {
            let m = slots.len();
            let rows = flat.index_select(tokens, 0)?.unsqueeze(0)?;
            let y = self.mlp(expert, &rows)?.squeeze(0)?;
            let w = weights
                .index_select(&Tensor::new(slots, device)?, 0)?
                .reshape((m, 1))?;
            y.to_dtype(weight_dtype)?
                .broadcast_mul(&w)?
                .to_dtype(self.dtype)
        })
    }

    /// Gemma 4's mixture of experts ([`ParallelMoe`]) on the MLP's residual input `x`
    /// (`[b, t, hidden]`): `post_feedforward_layernorm_2` of the experts' output. No load-balancing
    /// loss (the router is not recorded): `Gemma4ForCausalLM` adds none.
    pub(super) fn parallel_moe(&self, block: &ParallelMoe, x: &Tensor) -> CResult<Tensor> {
        let (b, t, h) = x.dims3()?;
        let flat = x.reshape((b * t, h))?;
        // transformers multiplies by the scale in the compute dtype, then by 1/√hidden as a
        // Python float (in f32, rounded once).
        let scaled = weightless_rms_norm(&flat, self.config.rms_norm_eps)?
            .broadcast_mul(&block.router_scale)?;
        let scaled =
            (scaled.to_dtype(DType::F32)? * (h as f64).powf(-0.5))?.to_dtype(flat.dtype())?;
        let logits = block.moe.router.forward(&scaled)?;
        let probs = ops::softmax_last_dim(&logits.to_dtype(DType::F32)?)?;
        let route = top_k_experts(&probs.detach().to_vec2()?, block.moe.top_k);
        let top = gather_routes(&probs, &route)?;
        let top = top.broadcast_div(&top.sum_keepdim(1)?)?;
        let scale = block
            .per_expert_scale
            .to_dtype(DType::F32)?
            .index_select(&Tensor::new(route.as_slice(), x.device())?, 0)?
            .reshape(top.shape())?;
        let experts_in = self.norm(&flat, &block.pre_norm, None)?;
        let out = self.run_experts(&block.moe, &experts_in, &route, &(top * scale)?)?;
        self.norm(&out, &block.post_norm_experts, None)?
            .reshape((b, t, h))
    }

    /// Llama 4's mixture of experts on `x` (`[b, t, hidden]`, `flat` its `[n, hidden]` rows) from
    /// the router's `logits`: each token's top-k logits (ties to the lower expert, as
    /// `torch.topk`), each through a sigmoid in f32, cast back and multiplied into the *input* of
    /// its expert; the experts' outputs summed, plus the shared expert's. transformers runs every
    /// expert on every token, with zero inputs where an expert is not chosen, which give exactly
    /// zero (no biases): only the chosen ones are computed here. No load-balancing loss (the
    /// router is not recorded): `Llama4ForCausalLM` adds none.
    fn sigmoid_routed_moe(
        &self,
        moe: &Moe,
        x: &Tensor,
        flat: &Tensor,
        logits: &Tensor,
    ) -> CResult<Tensor> {
        let (b, t, h) = x.dims3()?;
        let n = b * t;
        let (experts, k) = (moe.experts.len(), moe.top_k);
        let device = x.device();
        let host: Vec<Vec<f32>> = logits.detach().to_dtype(DType::F32)?.to_vec2()?;
        let mut order: Vec<usize> = (0..experts).collect();
        // Per expert, its tokens and their places in the flattened `[n, experts]` logits.
        let mut routed: Vec<(Vec<u32>, Vec<u32>)> = vec![(Vec::new(), Vec::new()); experts];
        for (i, row) in host.iter().enumerate() {
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            for &e in &order[..k] {
                routed[e].0.push(i as u32);
                routed[e].1.push((i * experts + e) as u32);
            }
        }
        let flat_logits = logits.flatten_all()?;
        let mut out = add_routed(flat, &moe.experts, routed, |expert, tokens, places| {
            let m = places.len();
            let score = flat_logits
                .index_select(&Tensor::new(places, device)?, 0)?
                .to_dtype(DType::F32)?;
            // sigmoid(s) = 1 / (1 + e^−s), from differentiable ops.
            let score = (score.neg()?.exp()? + 1.0)?
                .recip()?
                .to_dtype(self.dtype)?
                .reshape((m, 1))?;
            let rows = flat.index_select(tokens, 0)?.broadcast_mul(&score)?;
            self.mlp(expert, &rows.unsqueeze(0)?)?.squeeze(0)
        })?;
        if let Some((shared, _)) = &moe.shared_expert {
            let s = self.mlp(shared, x)?.reshape((n, h))?;
            out = (s + out)?;
        }
        out.reshape((b, t, h))
    }
}

/// The experts' outputs on the tokens routed to them, added into the rows of those tokens of a
/// zero tensor shaped as `flat` (`[n, hidden]`), in expert order. `routed[e]` holds expert `e`'s
/// tokens and their places in the routing table; `expert_out(expert, tokens, places)` gives its
/// output rows. Experts with no token are skipped.
fn add_routed(
    flat: &Tensor,
    experts: &[Mlp],
    routed: Vec<(Vec<u32>, Vec<u32>)>,
    mut expert_out: impl FnMut(&Mlp, &Tensor, Vec<u32>) -> CResult<Tensor>,
) -> CResult<Tensor> {
    let mut out = flat.zeros_like()?;
    for (expert, (tokens, places)) in experts.iter().zip(routed) {
        if tokens.is_empty() {
            continue;
        }
        let tokens = Tensor::new(tokens, flat.device())?;
        let y = expert_out(expert, &tokens, places)?;
        out = out.index_add(&tokens, &y, 0)?;
    }
    Ok(out)
}

/// Each token's `k` experts from its routing probabilities (`probs[token][expert]`), largest
/// first; equal probabilities keep the lower expert first, as `torch.topk`.
pub(super) fn top_k_experts(probs: &[Vec<f32>], k: usize) -> Vec<u32> {
    let mut selected = Vec::with_capacity(probs.len() * k);
    let mut order: Vec<usize> = (0..probs.first().map_or(0, Vec::len)).collect();
    for p in probs {
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        selected.extend(order[..k].iter().map(|&e| e as u32));
    }
    selected
}

/// The probabilities (`[n, experts]`) of each token's `selected` experts (the same number per
/// token, in order) as `[n, k]`, differentiable.
pub(super) fn gather_routes(probs: &Tensor, selected: &[u32]) -> CResult<Tensor> {
    let (n, experts) = probs.dims2()?;
    let k = selected.len() / n.max(1);
    let picked: Vec<u32> = selected
        .iter()
        .enumerate()
        .map(|(i, &e)| ((i / k) * experts) as u32 + e)
        .collect();
    probs
        .flatten_all()?
        .index_select(&Tensor::new(picked, probs.device())?, 0)?
        .reshape((n, k))
}

/// Phi-3.5-MoE's sparsemixer as transformers runs it in evaluation ([`SparseMixer`]): each
/// token's two experts (`[n * 2]`, first then second) and their weights `[n, 2]`, differentiable
/// through the router's `logits` (`[n, experts]`). The choices and masks are made on the host; a
/// weight is the softmax of the logits left unmasked, taken at its expert.
fn sparse_mixer_route(logits: &Tensor, mixer: &SparseMixer) -> CResult<(Vec<u32>, Tensor)> {
    let (n, experts) = logits.dims2()?;
    let host: Vec<Vec<f32>> = logits.detach().to_dtype(DType::F32)?.to_vec2()?;
    let threshold = (2.0 * mixer.jitter_eps) as f32;
    // The first largest logit (torch.max), skipping `skip`.
    let argmax = |s: &[f32], skip: Option<usize>| {
        let mut best: Option<usize> = None;
        for (e, &v) in s.iter().enumerate() {
            if Some(e) != skip && best.is_none_or(|b| v > s[b]) {
                best = Some(e);
            }
        }
        best.unwrap_or(0)
    };
    let mut masks = vec![0f32; n * 2 * experts];
    let mut route = Vec::with_capacity(n * 2);
    let mut picked = Vec::with_capacity(n * 2);
    for (row, s) in host.iter().enumerate() {
        let first = argmax(s, None);
        let second = argmax(s, Some(first));
        for (slot, (chosen, excluded)) in [(first, None), (second, Some(first))]
            .into_iter()
            .enumerate()
        {
            let top = s[chosen];
            let at = (row * 2 + slot) * experts;
            for (e, &v) in s.iter().enumerate() {
                // transformers: (top − v) / max(|v|, top) > 2·eps masks the logit.
                if Some(e) == excluded || (top - v) / v.abs().max(top) > threshold {
                    masks[at + e] = f32::NEG_INFINITY;
                }
            }
            route.push(chosen as u32);
            picked.push((at + chosen) as u32);
        }
    }
    let device = logits.device();
    let masks = Tensor::from_vec(masks, (n, 2, experts), device)?;
    let logits = logits.to_dtype(DType::F32)?.unsqueeze(1)?;
    let gates = ops::softmax_last_dim(&logits.broadcast_add(&masks)?)?;
    let top = gates
        .flatten_all()?
        .index_select(&Tensor::new(picked, device)?, 0)?
        .reshape((n, 2))?;
    Ok((route, top))
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// The sparsemixer against transformers 5.23's `sparsemixer(scores, 0.1, training=False)` on
    /// logits with negative maxima, near ties, exact ties (the lower expert first) and zeros.
    #[test]
    fn sparse_mixer_routes_as_transformers() {
        let rows = [
            [1.0f32, 0.5, 0.9, -2.0],
            [-1.0, -1.2, -3.0, -1.05],
            [0.3, 0.3, 0.1, 0.29],
            [0.0, 0.0, -0.5, 0.2],
            [2.0, -2.0, 1.0, 1.5],
        ];
        let logits = Tensor::from_vec(rows.concat(), (5, 4), &Device::Cpu).unwrap();
        let (route, weights) =
            sparse_mixer_route(&logits, &SparseMixer { jitter_eps: 0.1 }).unwrap();
        assert_eq!(route, [0, 2, 0, 3, 0, 1, 3, 0, 0, 3]);
        let want = [
            0.5249792f32,
            1.0,
            0.36101604,
            0.53742987,
            0.3344426,
            0.5025,
            1.0,
            0.5,
            1.0,
            1.0,
        ];
        let got = weights.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?}");
        }
    }
}
