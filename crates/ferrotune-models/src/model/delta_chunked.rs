//! The gated delta rule in its chunked form (what transformers 5.24's
//! `torch_chunk_gated_delta_rule` computes, and FLA's kernels): the positions in chunks of 64,
//! each chunk's updates condensed into a few matrix products (the UT transform), and a scan over
//! the chunks only. Equal to the recurrent form up to rounding; its sequential depth is the
//! number of chunks instead of the number of positions, so training and prefill take it.
//!
//! The UT transform solves a unit lower-triangular system per chunk. transformers calls a
//! triangular solver; here the inverse of `I − A` (`A` strictly lower triangular, so `A^64 = 0`)
//! is the product `(I + A)(I + A²)(I + A⁴)…(I + A³²)`: eleven matrix products of candle ops,
//! which have their backward.

use candle_core::{DType, Result as CResult, Tensor};

/// Positions per chunk, as transformers' and FLA's.
pub(super) const CHUNK: usize = 64;

/// The gated delta rule over `q`, `k` `[b, h, t, dk]` (queries already scaled), `v` `[b, h, t,
/// dv]`, the log decays `g` and `beta` `[b, h, t]`, all f32, from `state` `[b, h, dk, dv]`
/// (zeros when `None`): the output `[b, h, t, dv]` and the state after the last position.
pub(super) fn chunked_delta_rule(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: Option<Tensor>,
) -> CResult<(Tensor, Tensor)> {
    let (b, h, t, dk) = q.dims4()?;
    let dv = v.dim(3)?;
    let device = q.device();
    // Zeros after the last position up to a whole chunk: no key, no value, no decay (exp 0 = 1),
    // so they leave the state as it is.
    let pad = (CHUNK - t % CHUNK) % CHUNK;
    let padded = |x: &Tensor| -> CResult<Tensor> {
        match pad {
            0 => Ok(x.clone()),
            _ => x.pad_with_zeros(2, 0, pad),
        }
    };
    let n = (t + pad) / CHUNK;
    // Every (row, head, chunk) is one batch entry of the chunk-local products: `[b·h·n, C, d]`
    // (contiguous: candle's matmul wants plain strides).
    let m = b * h * n;
    let chunks = |x: Tensor, d: usize| x.reshape((m, CHUNK, d))?.contiguous();
    let (q, k, v) = (padded(q)?, padded(k)?, padded(v)?);
    let (g, beta) = (padded(g)?, padded(beta)?);
    let beta = beta.unsqueeze(3)?;
    let v_beta = chunks(v.broadcast_mul(&beta)?, dv)?;
    let k_beta = chunks(k.broadcast_mul(&beta)?, dk)?;
    let (q, k) = (chunks(q, dk)?, chunks(k, dk)?);
    // The decay from each chunk's start to each of its positions (log space): `[m, C]`.
    let cum = g.reshape((m, CHUNK))?.cumsum(1)?;
    // exp(cum_i − cum_j) where j ≤ i, 0 above the diagonal (masked before the exp, which would
    // overflow there).
    let lower: Vec<u8> = (0..CHUNK * CHUNK)
        .map(|x| u8::from(x % CHUNK <= x / CHUNK))
        .collect();
    let lower = Tensor::from_vec(lower, (1, CHUNK, CHUNK), device)?;
    let diff = cum.unsqueeze(2)?.broadcast_sub(&cum.unsqueeze(1)?)?; // [m, C, C]
    let masked = lower.broadcast_as(diff.shape())?.where_cond(
        &diff,
        &Tensor::full(f32::NEG_INFINITY, diff.shape(), device)?,
    )?;
    let pairwise = masked.exp()?;
    let kt = k.transpose(1, 2)?.contiguous()?;
    let system = k_beta.matmul(&kt)?.mul(&pairwise)?;
    let intra = q.matmul(&kt)?.mul(&pairwise)?;
    let cum_exp = cum.exp()?.unsqueeze(2)?; // [m, C, 1]
    let decayed_k_beta = k_beta.broadcast_mul(&cum_exp)?;
    // Solve (I + L) x = rhs for L the system's strictly lower part (its diagonal is taken as
    // 1, as transformers' `unitriangular=True`): x = (I − A)⁻¹ rhs with A = −L.
    let strict: Vec<f32> = (0..CHUNK * CHUNK)
        .map(|x| if x % CHUNK < x / CHUNK { -1.0 } else { 0.0 })
        .collect();
    let strict = Tensor::from_vec(strict, (1, CHUNK, CHUNK), device)?;
    let a = system.broadcast_mul(&strict)?;
    let eye = Tensor::eye(CHUNK, DType::F32, device)?.unsqueeze(0)?;
    let mut inverse = a.broadcast_add(&eye)?;
    let mut power = a;
    let mut span = 2;
    while span < CHUNK {
        power = power.matmul(&power)?;
        inverse = inverse.matmul(&power.broadcast_add(&eye)?)?;
        span *= 2;
    }
    // Back to `[b·h, n, C, d]` for the scan over the chunks.
    let scan = |x: Tensor, d: usize| x.reshape((b * h, n, CHUNK, d));
    let new_values = scan(inverse.matmul(&v_beta)?, dv)?;
    let k_cumdecay = scan(inverse.matmul(&decayed_k_beta)?, dk)?;
    let last = cum.narrow(1, CHUNK - 1, 1)?; // [m, 1]
    let q = scan(q.broadcast_mul(&cum_exp)?, dk)?;
    let k = scan(
        k.broadcast_mul(&last.broadcast_sub(&cum)?.exp()?.unsqueeze(2)?)?,
        dk,
    )?;
    let intra = scan(intra, CHUNK)?;
    let chunk_decay = last.exp()?.reshape((b * h, n, 1, 1))?;
    let mut state = match state {
        Some(s) => s.reshape((b * h, dk, dv))?,
        None => Tensor::zeros((b * h, dk, dv), DType::F32, device)?,
    };
    let mut outs = Vec::with_capacity(n);
    let at = |x: &Tensor, i: usize| x.narrow(1, i, 1)?.squeeze(1)?.contiguous();
    for i in 0..n {
        let v_new = (at(&new_values, i)? - at(&k_cumdecay, i)?.matmul(&state)?)?;
        let out = (at(&q, i)?.matmul(&state)? + at(&intra, i)?.matmul(&v_new)?)?;
        outs.push(out);
        let k_i = at(&k, i)?.transpose(1, 2)?.contiguous()?;
        state = (state.broadcast_mul(&at(&chunk_decay, i)?)? + k_i.matmul(&v_new)?)?;
    }
    let out = Tensor::cat(&outs, 1)?.reshape((b, h, n * CHUNK, dv))?; // [b, h, n · C, dv]
    Ok((out.narrow(2, 0, t)?, state.reshape((b, h, dk, dv))?))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle_core::{Device, Var};

    use super::*;

    fn golden() -> HashMap<String, Tensor> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/delta_rule/golden.safetensors");
        candle_core::safetensors::load(path, &Device::Cpu).unwrap()
    }

    fn rel_l2(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().sqr().unwrap().sum_all().unwrap();
        let n = b.sqr().unwrap().sum_all().unwrap();
        (d.to_scalar::<f32>().unwrap() / n.to_scalar::<f32>().unwrap()).sqrt()
    }

    /// Both forms on transformers' inputs (scaled and laid out as the layer does), with their
    /// outputs, final states and every gradient against transformers' chunked and recurrent
    /// functions under torch autograd.
    #[test]
    fn both_forms_equal_transformers_with_their_gradients() {
        let gold = golden();
        let heads_first = |t: &Tensor| t.transpose(1, 2).unwrap().contiguous().unwrap();
        for form in ["chunk", "recurrent"] {
            let vars: Vec<(&str, Var)> = ["q", "k", "v", "g", "beta", "state0"]
                .into_iter()
                .map(|n| (n, Var::from_tensor(&gold[n]).unwrap()))
                .collect();
            let x = |n: &str| vars.iter().find(|(m, _)| *m == n).unwrap().1.as_tensor();
            let dk = x("q").dim(3).unwrap();
            let q = (heads_first(x("q")) * (dk as f64).powf(-0.5)).unwrap();
            let (k, v) = (heads_first(x("k")), heads_first(x("v")));
            let (g, beta) = (heads_first(x("g")), heads_first(x("beta")));
            let state0 = Some(x("state0").clone());
            let (out, state) = match form {
                "chunk" => chunked_delta_rule(&q, &k, &v, &g, &beta, state0),
                _ => super::super::delta_net::recurrent_delta_rule(
                    &q,
                    &k,
                    &v,
                    &g.exp().unwrap(),
                    &beta,
                    state0,
                ),
            }
            .unwrap();
            let out = heads_first(&out);
            let err = rel_l2(&out, &gold[&format!("{form}_out")]);
            assert!(err <= 1e-5, "{form}: output relative L2 {err}");
            let err = rel_l2(&state, &gold[&format!("{form}_state")]);
            assert!(err <= 1e-5, "{form}: state relative L2 {err}");
            let loss = ((out * &gold["w_out"]).unwrap().sum_all().unwrap()
                + (state * &gold["w_state"]).unwrap().sum_all().unwrap())
            .unwrap();
            let grads = loss.backward().unwrap();
            for (name, var) in &vars {
                let got = grads.get(var).unwrap();
                let err = rel_l2(got, &gold[&format!("{form}_grad_{name}")]);
                assert!(err <= 1e-4, "{form}: d/d{name} relative L2 {err}");
            }
        }
    }

    /// Both forms agree on a sequence whose decays leave almost nothing of the state between
    /// chunks and on one under a chunk (one padded chunk).
    #[test]
    fn short_sequences_take_one_padded_chunk() {
        let gold = golden();
        let heads_first = |t: &Tensor| t.transpose(1, 2).unwrap().contiguous().unwrap();
        let cut = |t: &Tensor| t.narrow(1, 0, 5).unwrap();
        let q = (heads_first(&cut(&gold["q"])) * 0.25).unwrap();
        let k = heads_first(&cut(&gold["k"]));
        let v = heads_first(&cut(&gold["v"]));
        let g = heads_first(&cut(&gold["g"]));
        let beta = heads_first(&cut(&gold["beta"]));
        let (a, sa) = chunked_delta_rule(&q, &k, &v, &g, &beta, None).unwrap();
        let (r, sr) = super::super::delta_net::recurrent_delta_rule(
            &q,
            &k,
            &v,
            &g.exp().unwrap(),
            &beta,
            None,
        )
        .unwrap();
        assert!(rel_l2(&a, &r) <= 1e-5 && rel_l2(&sa, &sr) <= 1e-5);
        assert_eq!(a.dims(), [1, 2, 5, 12]);
    }
}
