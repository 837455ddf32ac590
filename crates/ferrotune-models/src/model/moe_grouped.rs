//! Group-limited routing of a mixture of experts (DeepSeek-V2/V3, [`GroupedRouting`]), as
//! transformers 5.24's `DeepseekV3TopkRouter` / `DeepseekV2TopkRouter` route: the router's logits
//! in f32, scored by a sigmoid (V3) or a softmax (V2); the experts fall into `n_group` groups, a
//! token keeps its `topk_group` best groups (V3: a group's two best scores plus
//! `e_score_correction_bias`, summed; V2: its best score) and picks its `top_k` experts among
//! them (V3: by score plus bias). The routing weights are the chosen scores without the bias,
//! renormalized (V3's `norm_topk_prob`, the sum plus 1e-20) and times `routed_scaling_factor`;
//! the shared experts are added as they are.

use candle_core::{DType, Result as CResult, Tensor};
use ferrotune_core::ops;

use super::moe::gather_routes;
use super::{CausalLm, Moe};
use crate::config::{GroupedRouting, RouterScoring};

/// A mixture of experts' group-limited router beside its `gate` weight.
#[derive(Debug, Clone)]
pub struct GroupedRouter {
    /// How it scores and picks.
    pub routing: GroupedRouting,
    /// DeepSeek-V3's `mlp.gate.e_score_correction_bias` (`[experts]`): a buffer of the
    /// checkpoint, added to the scores only to pick the experts; never trained.
    pub correction_bias: Option<Tensor>,
}

/// Each token's experts under `routing` from its `scores` (`scores[token][expert]`) and the
/// correction `bias` (or zeros): `top_k` per token, best first, ties to the lower index (as
/// `torch.topk`; transformers' unsorted top-k sums the same experts whatever their order).
fn route(scores: &[Vec<f32>], bias: &[f32], routing: &GroupedRouting, top_k: usize) -> Vec<u32> {
    let experts = scores.first().map_or(0, Vec::len);
    let groups = routing.n_group.max(1);
    let per_group = experts / groups;
    let mut out = Vec::with_capacity(scores.len() * top_k);
    let mut choice = vec![0f32; experts];
    let mut group_order: Vec<usize> = (0..groups).collect();
    let mut expert_order: Vec<usize> = (0..experts).collect();
    let mut group_score = vec![0f32; groups];
    let mut in_group = Vec::with_capacity(per_group);
    for row in scores {
        for (e, c) in choice.iter_mut().enumerate() {
            *c = row[e] + bias.get(e).copied().unwrap_or(0.0);
        }
        for (g, score) in group_score.iter_mut().enumerate() {
            in_group.clear();
            in_group.extend_from_slice(&choice[g * per_group..(g + 1) * per_group]);
            in_group.sort_by(|a, b| b.total_cmp(a));
            *score = if routing.group_sum_top2 {
                in_group[0] + in_group[1]
            } else {
                in_group[0]
            };
        }
        group_order.sort_by(|&a, &b| group_score[b].total_cmp(&group_score[a]).then(a.cmp(&b)));
        let kept = &group_order[..routing.topk_group];
        // Experts outside the kept groups: -inf (V3) or 0 (V2, whose scores are positive); the
        // checks on the config keep `top_k` within the kept groups' experts.
        let masked = |e: usize| {
            if kept.contains(&(e / per_group)) {
                choice[e]
            } else {
                f32::NEG_INFINITY
            }
        };
        expert_order.sort_by(|&a, &b| masked(b).total_cmp(&masked(a)).then(a.cmp(&b)));
        out.extend(expert_order[..top_k].iter().map(|&e| e as u32));
    }
    out
}

impl CausalLm {
    /// A mixture of experts with group-limited routing on `x` (`[b, t, hidden]`, `flat` its
    /// `[n, hidden]` rows): see the module's documentation. The routing weights stay
    /// differentiable (the router trains); the choice is made on the host. No load-balancing
    /// loss: transformers' DeepSeek models add none.
    pub(super) fn grouped_moe(
        &self,
        moe: &Moe,
        router: &GroupedRouter,
        x: &Tensor,
        flat: &Tensor,
    ) -> CResult<Tensor> {
        let (b, t, h) = x.dims3()?;
        let routing = &router.routing;
        // transformers keeps the router in f32 (`_keep_in_fp32_modules_strict`) and computes
        // its logits from the f32 hidden states.
        let logits = match (&moe.router.adapter, moe.router.weight.as_dense()) {
            (None, Some(w)) if flat.dtype() != DType::F32 => flat
                .to_dtype(DType::F32)?
                .matmul(&w.to_dtype(DType::F32)?.t()?)?,
            _ => moe.router.forward(flat)?.to_dtype(DType::F32)?,
        };
        let scores = match routing.scoring {
            // sigmoid(s) = 1 / (1 + e^−s), from differentiable ops.
            RouterScoring::Sigmoid => (logits.neg()?.exp()? + 1.0)?.recip()?,
            RouterScoring::Softmax => ops::softmax_last_dim(&logits)?,
        };
        let host: Vec<Vec<f32>> = scores.detach().to_vec2()?;
        let bias: Vec<f32> = match &router.correction_bias {
            Some(bias) => bias.to_dtype(DType::F32)?.to_vec1()?,
            None => Vec::new(),
        };
        let chosen = route(&host, &bias, routing, moe.top_k);
        let mut weights = gather_routes(&scores, &chosen)?;
        if routing.norm_topk_prob {
            weights = weights.broadcast_div(&(weights.sum_keepdim(1)? + 1e-20)?)?;
        }
        let weights = (weights * routing.routed_scaling_factor)?;
        let mut out = self.run_experts(moe, flat, &chosen, &weights)?;
        if let Some((shared, _)) = &moe.shared_expert {
            out = (out + self.mlp(shared, x)?.reshape((b * t, h))?)?;
        }
        out.reshape((b, t, h))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// V3's rule: groups by the sum of their two best scores plus bias, experts by score plus
    /// bias within the kept groups.
    #[test]
    fn groups_are_kept_by_their_two_best_then_experts_by_score_plus_bias() {
        let routing = GroupedRouting {
            scoring: RouterScoring::Sigmoid,
            n_group: 2,
            topk_group: 1,
            group_sum_top2: true,
            correction_bias: true,
            norm_topk_prob: true,
            routed_scaling_factor: 1.0,
        };
        // Group 0 (experts 0-2) holds the best expert, group 1 (3-5) the best pair.
        let scores = vec![vec![0.9f32, 0.1, 0.1, 0.6, 0.6, 0.1]];
        assert_eq!(route(&scores, &[], &routing, 2), [3, 4]);
        // A bias on expert 1 makes group 0's pair the best, then expert 1 the first pick.
        let bias = [0.0f32, 0.7, 0.0, 0.0, 0.0, 0.0];
        assert_eq!(route(&scores, &bias, &routing, 2), [0, 1]);
        let bias = [0.0f32, 1.0, 0.0, 0.0, 0.0, 0.0];
        assert_eq!(route(&scores, &bias, &routing, 2), [1, 0]);
        // V2's rule: a group's best score.
        let v2 = GroupedRouting {
            group_sum_top2: false,
            correction_bias: false,
            ..routing
        };
        assert_eq!(route(&scores, &[], &v2, 2), [0, 1]);
    }
}
