//! gpt-oss's own math: its mixture of experts ([`GptOssMoe`]), as transformers' `GptOssMLP`
//! computes it. Its attention with a learned sink logit per head is
//! [`ferrotune_core::fused::attention_with_sinks`].

use candle_core::{DType, Result as CResult, Tensor, Var};
use ferrotune_core::{fused, ops};

use super::gpt_oss_experts::ExpertWeight;
use super::moe::{gather_routes, top_k_experts};
use super::{CausalLm, RouterRecord};
use crate::config::GptOssMoeConfig;

/// gpt-oss's mixture of experts (`mlp`), its tensors as the checkpoint holds them: the router
/// (`mlp.router`, a bare weight and bias, no `nn.Linear`: PEFT's `target_modules` cannot reach
/// it, and neither does ferrotune's) and the fused experts. They train in full fine-tuning; LoRA
/// reaches the fused experts as PEFT's `target_parameters` does ([`ExpertsLora`]), not the
/// router or the biases.
#[derive(Debug, Clone)]
pub struct GptOssMoe {
    /// `mlp.router.weight` `[experts, hidden]`.
    pub router_weight: Tensor,
    /// `mlp.router.bias` `[experts]`.
    pub router_bias: Tensor,
    /// `mlp.experts.gate_up_proj` `[experts, hidden, 2 · inter]`, inputs first; gate and up
    /// columns interleaved (gate at even columns, up at odd ones). Dense, or MXFP4 for QLoRA.
    pub gate_up_proj: ExpertWeight,
    /// `mlp.experts.gate_up_proj_bias` `[experts, 2 · inter]`, interleaved as the columns.
    pub gate_up_proj_bias: Tensor,
    /// `mlp.experts.down_proj` `[experts, inter, hidden]`. Dense, or MXFP4 for QLoRA.
    pub down_proj: ExpertWeight,
    /// `mlp.experts.down_proj_bias` `[experts, hidden]`.
    pub down_proj_bias: Tensor,
    /// Experts per token, the SwiGLU's gain and clamp.
    pub config: GptOssMoeConfig,
    /// PEFT's adapter on `gate_up_proj` (`target_parameters`), if any.
    pub gate_up_lora: Option<ExpertsLora>,
    /// PEFT's adapter on `down_proj` (`target_parameters`), if any.
    pub down_lora: Option<ExpertsLora>,
}

/// PEFT's `lora.ParamWrapper` on one of gpt-oss's fused expert parameters `W` `[experts, in,
/// out]`. transformers marks gpt-oss's experts `is_transposed` (inputs first), so PEFT keeps the
/// factors' natural roles: `lora_A` `[r · experts, in]` (expert `e`'s rows `e·r ..`), `lora_B`
/// `[out, r · experts]` (expert `e`'s columns `e, e + E, e + 2E, ...`), and expert `e`'s weight is
/// `W_e + (B_e A_e)ᵀ · scaling`: `x W_e + scaling · (x A_eᵀ) B_eᵀ` on its tokens. The biases are
/// not adapted.
#[derive(Debug, Clone)]
pub struct ExpertsLora {
    /// `lora_A.weight` `[r · experts, in]`.
    pub a: Tensor,
    /// `lora_B.weight` `[out, r · experts]`.
    pub b: Tensor,
    /// The rank per expert.
    pub rank: usize,
    /// `lora_alpha / r` (or `/ √r` with rsLoRA).
    pub scale: f64,
}

impl ExpertsLora {
    /// Expert `e`'s factors: `A_e` `[r, in]` and `B_e` `[out, r]`.
    pub fn factors(&self, e: usize) -> CResult<(Tensor, Tensor)> {
        let experts = self.a.dim(0)? / self.rank.max(1);
        let a = self.a.narrow(0, e * self.rank, self.rank)?;
        let columns: Vec<u32> = (0..self.rank).map(|k| (k * experts + e) as u32).collect();
        let b = self
            .b
            .index_select(&Tensor::new(columns, self.b.device())?, 1)?;
        Ok((a, b))
    }

    /// `scaling · (x A_eᵀ) B_eᵀ` for expert `e`'s rows `x` `[m, in]`.
    fn apply(&self, x: &Tensor, e: usize) -> CResult<Tensor> {
        let (a, b) = self.factors(e)?;
        x.matmul(&a.t()?)?.matmul(&b.t()?)? * self.scale
    }

    /// The update PEFT's merge adds to the parameter: `[experts, in, out]`, expert `e`'s
    /// `(B_e A_e)ᵀ · scaling`.
    pub fn delta(&self) -> CResult<Tensor> {
        let experts = self.a.dim(0)? / self.rank.max(1);
        let per: Vec<Tensor> = (0..experts)
            .map(|e| {
                let (a, b) = self.factors(e)?;
                a.t()?.matmul(&b.t()?)? * self.scale
            })
            .collect::<CResult<_>>()?;
        Tensor::stack(&per, 0)
    }

    /// Makes `a` and `b` trainable: their [`Var`]s as `lora_A.weight` and `lora_B.weight`.
    pub fn make_trainable(&mut self) -> CResult<Vec<(&'static str, Var)>> {
        let a = Var::from_tensor(&self.a)?;
        let b = Var::from_tensor(&self.b)?;
        self.a = a.as_tensor().clone();
        self.b = b.as_tensor().clone();
        Ok(vec![("lora_A.weight", a), ("lora_B.weight", b)])
    }
}

/// The parameter names of [`GptOssMoe`]'s tensors inside the decoder layer, in the order
/// [`GptOssMoe::tensors`] and [`GptOssMoe::tensors_mut`] list them (the experts only when dense).
pub const GPT_OSS_MOE_TENSORS: [&str; 6] = [
    "mlp.router.weight",
    "mlp.router.bias",
    "mlp.experts.gate_up_proj",
    "mlp.experts.gate_up_proj_bias",
    "mlp.experts.down_proj",
    "mlp.experts.down_proj_bias",
];

impl GptOssMoe {
    /// The block's tensors with their parameter names inside the decoder layer; MXFP4 experts
    /// (a frozen packed base, [`GptOssMoe::packed_experts`]) are no tensors and are left out.
    pub fn tensors(&self) -> Vec<(&'static str, &Tensor)> {
        let tensors = [
            Some(&self.router_weight),
            Some(&self.router_bias),
            self.gate_up_proj.as_dense(),
            Some(&self.gate_up_proj_bias),
            self.down_proj.as_dense(),
            Some(&self.down_proj_bias),
        ];
        named(tensors)
    }

    /// The expert weights held as MXFP4 ([`ExpertWeight::Mxfp4`]) by their parameter names
    /// inside the decoder layer.
    pub fn packed_experts(&self) -> Vec<(&'static str, &ExpertWeight)> {
        [
            (GPT_OSS_MOE_TENSORS[2], &self.gate_up_proj),
            (GPT_OSS_MOE_TENSORS[4], &self.down_proj),
        ]
        .into_iter()
        .filter(|(_, w)| w.as_dense().is_none())
        .collect()
    }

    /// [`GptOssMoe::tensors_mut`] and the adapters' factors (`target_parameters`) by their
    /// names inside the decoder layer as PEFT's file has them (`gate_up_proj`'s wrapper nested
    /// under `.base_layer` when both parameters are adapted), borrowed apart.
    #[allow(clippy::type_complexity)]
    pub fn tensors_and_adapters_mut(
        &mut self,
    ) -> (
        Vec<(&'static str, &mut Tensor)>,
        Vec<(&'static str, &mut Tensor)>,
    ) {
        let GptOssMoe {
            router_weight,
            router_bias,
            gate_up_proj,
            gate_up_proj_bias,
            down_proj,
            down_proj_bias,
            gate_up_lora,
            down_lora,
            ..
        } = self;
        let both = gate_up_lora.is_some() && down_lora.is_some();
        let mut adapters = Vec::new();
        if let Some(l) = gate_up_lora {
            let (a, b) = if both {
                (
                    "mlp.experts.base_layer.lora_A.weight",
                    "mlp.experts.base_layer.lora_B.weight",
                )
            } else {
                ("mlp.experts.lora_A.weight", "mlp.experts.lora_B.weight")
            };
            adapters.push((a, &mut l.a));
            adapters.push((b, &mut l.b));
        }
        if let Some(l) = down_lora {
            adapters.push(("mlp.experts.lora_A.weight", &mut l.a));
            adapters.push(("mlp.experts.lora_B.weight", &mut l.b));
        }
        let tensors = [
            Some(router_weight),
            Some(router_bias),
            gate_up_proj.as_dense_mut(),
            Some(gate_up_proj_bias),
            down_proj.as_dense_mut(),
            Some(down_proj_bias),
        ];
        (named(tensors), adapters)
    }

    /// [`GptOssMoe::tensors`], mutable.
    pub fn tensors_mut(&mut self) -> Vec<(&'static str, &mut Tensor)> {
        self.tensors_and_adapters_mut().0
    }
}

/// The present ones of `tensors` (in [`GPT_OSS_MOE_TENSORS`]'s order) with their names.
fn named<T>(tensors: [Option<T>; 6]) -> Vec<(&'static str, T)> {
    GPT_OSS_MOE_TENSORS
        .into_iter()
        .zip(tensors)
        .filter_map(|(n, t)| t.map(|t| (n, t)))
        .collect()
}

/// `1 / (1 + e^−x)` from differentiable ops.
pub(super) fn sigmoid(x: &Tensor) -> CResult<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

impl CausalLm {
    /// gpt-oss's mixture of experts on `x` (`[b, t, hidden]`), as `GptOssMLP`: router logits
    /// (with bias), each token's top-k logits (ties to the lower expert, as `torch.topk`)
    /// softmaxed in the compute dtype; each chosen expert's `x · W_gate_up + b`, the clamped
    /// SwiGLU ([`fused::clamped_swiglu_interleaved`]), `· W_down + b`, scaled by its weight and
    /// added in expert order. The routing weights stay differentiable (the router trains); the
    /// choice of experts is made on the host. While recording ([`CausalLm::record_routers`]), the
    /// router's softmax over every expert is kept for the auxiliary loss, as `GptOssForCausalLM`
    /// computes it from the router logits.
    pub(super) fn gpt_oss_moe(&self, moe: &GptOssMoe, x: &Tensor) -> CResult<Tensor> {
        let (b, t, h) = x.dims3()?;
        let n = b * t;
        let flat = x.reshape((n, h))?;
        let logits = ops::linear(&flat, &moe.router_weight, Some(&moe.router_bias))?;
        let k = moe.config.top_k;
        let host: Vec<Vec<f32>> = logits.detach().to_dtype(DType::F32)?.to_vec2()?;
        let route = top_k_experts(&host, k);
        if let Some(tape) = self
            .router_tape
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            let probs = ops::softmax_last_dim(&logits.to_dtype(DType::F32)?)?;
            let host_probs = probs.detach().flatten_all()?.to_vec1()?;
            // The top-k of the logits are the top-k of their softmax, in the same order.
            tape.push(RouterRecord {
                probs,
                selected: route.clone(),
                host_probs,
            });
        }
        let weights = ops::softmax_last_dim(&gather_routes(&logits, &route)?)?.flatten_all()?;
        let device = x.device();
        let experts = moe.config.num_experts;
        // Per expert, its tokens and the places of their weights in the `[n, k]` table.
        let mut routed: Vec<(Vec<u32>, Vec<u32>)> = vec![(Vec::new(), Vec::new()); experts];
        for (i, &e) in route.iter().enumerate() {
            routed[e as usize].0.push((i / k) as u32);
            routed[e as usize].1.push(i as u32);
        }
        let (alpha, limit) = (moe.config.alpha, moe.config.limit);
        // Each expert's weighted rows and their tokens, in expert order, added into the output by
        // one `index_add` (which adds in index order, so in expert order as transformers does):
        // the graph holds them once rather than one `[n, hidden]` sum per expert.
        let (mut parts, mut all_tokens) = (Vec::new(), Vec::with_capacity(route.len()));
        for (e, (tokens, places)) in routed.into_iter().enumerate() {
            if tokens.is_empty() {
                continue;
            }
            let m = tokens.len();
            all_tokens.extend_from_slice(&tokens);
            let tokens = Tensor::new(tokens, device)?;
            let rows = flat.index_select(&tokens, 0)?;
            let mut gate_up = moe
                .gate_up_proj
                .matmul(&rows, e)?
                .broadcast_add(&moe.gate_up_proj_bias.get(e)?)?;
            if let Some(lora) = &moe.gate_up_lora {
                gate_up = (gate_up + lora.apply(&rows, e)?)?;
            }
            // One fused op on f32 CPU tensors, holding only `gate_up` for the backward.
            let h_e = fused::clamped_swiglu_interleaved(&gate_up, alpha, limit)?;
            let mut y = moe
                .down_proj
                .matmul(&h_e, e)?
                .broadcast_add(&moe.down_proj_bias.get(e)?)?;
            if let Some(lora) = &moe.down_lora {
                y = (y + lora.apply(&h_e, e)?)?;
            }
            let w = weights
                .index_select(&Tensor::new(places, device)?, 0)?
                .reshape((m, 1))?;
            parts.push(y.broadcast_mul(&w)?);
        }
        let out = flat.zeros_like()?;
        if parts.is_empty() {
            return out.reshape((b, t, h));
        }
        out.index_add(
            &Tensor::new(all_tokens, device)?,
            &Tensor::cat(&parts, 0)?,
            0,
        )?
        .reshape((b, t, h))
    }
}
