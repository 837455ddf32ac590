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

    /// Deterministic values in `[lo, hi)` (a small LCG: candle's CPU randn is not seeded).
    fn values(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                lo + (hi - lo) * ((x >> 40) as f32 / (1u64 << 24) as f32)
            })
            .collect()
    }

    /// The layer's inputs to the rule for one shape: L2-normalized keys and queries (the queries
    /// scaled by `dk^-½`), `g` in `g_range`, β in (0, 1), and a state when `with_state`.
    fn inputs(
        (b, h, t, dk, dv): (usize, usize, usize, usize, usize),
        g_range: (f32, f32),
        with_state: bool,
        seed: u64,
    ) -> Vec<Var> {
        let dev = Device::Cpu;
        let t4 = |d: usize, s: u64| {
            Tensor::from_vec(
                values(b * h * t * d, seed + s, -1.0, 1.0),
                (b, h, t, d),
                &dev,
            )
            .unwrap()
        };
        let l2 = |x: Tensor| {
            let n = x.sqr().unwrap().sum_keepdim(3).unwrap().sqrt().unwrap();
            x.broadcast_div(&n).unwrap()
        };
        let q = (l2(t4(dk, 1)) * (dk as f64).powf(-0.5)).unwrap();
        let k = l2(t4(dk, 2));
        let v = t4(dv, 3);
        let g = Tensor::from_vec(
            values(b * h * t, seed + 4, g_range.0, g_range.1),
            (b, h, t),
            &dev,
        )
        .unwrap();
        let beta =
            Tensor::from_vec(values(b * h * t, seed + 5, 0.05, 0.95), (b, h, t), &dev).unwrap();
        let mut out: Vec<Var> = [q, k, v, g, beta]
            .iter()
            .map(|x| Var::from_tensor(x).unwrap())
            .collect();
        if with_state {
            let s = Tensor::from_vec(
                values(b * h * dk * dv, seed + 6, -0.5, 0.5),
                (b, h, dk, dv),
                &dev,
            )
            .unwrap();
            out.push(Var::from_tensor(&s).unwrap());
        }
        out
    }

    /// Output, final state and every input's gradient under `sum(out ⊙ w) + sum(state ⊙ w')`.
    fn run(vars: &[Var], form: &str, starts: Option<&[Vec<bool>]>) -> Vec<Tensor> {
        let x: Vec<&Tensor> = vars.iter().map(Var::as_tensor).collect();
        let state = x.get(5).map(|s| (*s).clone());
        let (out, st) = match form {
            "fused" => ferrotune_core::fused::gated_delta_rule(
                x[0],
                x[1],
                x[2],
                x[3],
                x[4],
                state.as_ref(),
                starts,
            ),
            "chunk" => chunked_delta_rule(x[0], x[1], x[2], x[3], x[4], state),
            "recurrent64" => {
                let c = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
                let (b, h, _, dk) = x[0].dims4().unwrap();
                let dv = x[2].dim(3).unwrap();
                let zeros = || Tensor::zeros((b, h, dk, dv), DType::F64, &Device::Cpu).unwrap();
                let state = Some(state.as_ref().map_or_else(zeros, c));
                let (o, s) = super::super::delta_net::recurrent_delta_rule(
                    &c(x[0]),
                    &c(x[1]),
                    &c(x[2]),
                    &c(x[3]).exp().unwrap(),
                    &c(x[4]),
                    state,
                )
                .unwrap();
                Ok((
                    o.to_dtype(DType::F32).unwrap(),
                    s.to_dtype(DType::F32).unwrap(),
                ))
            }
            _ => {
                let mut decay = x[3].exp().unwrap();
                if let Some(s) = starts {
                    let keep: Vec<f32> = s
                        .iter()
                        .flatten()
                        .map(|&s| if s { 0.0 } else { 1.0 })
                        .collect();
                    let (b, _, t) = decay.dims3().unwrap();
                    let keep = Tensor::from_vec(keep, (b, 1, t), &Device::Cpu).unwrap();
                    decay = decay.broadcast_mul(&keep).unwrap();
                }
                super::super::delta_net::recurrent_delta_rule(x[0], x[1], x[2], &decay, x[4], state)
            }
        }
        .unwrap();
        let w_out = Tensor::from_vec(
            values(out.elem_count(), 99, -1.0, 1.0),
            out.shape(),
            &Device::Cpu,
        )
        .unwrap();
        let w_st = Tensor::from_vec(
            values(st.elem_count(), 98, -1.0, 1.0),
            st.shape(),
            &Device::Cpu,
        )
        .unwrap();
        let loss = ((&out * &w_out).unwrap().sum_all().unwrap()
            + (&st * &w_st).unwrap().sum_all().unwrap())
        .unwrap();
        let grads = loss.backward().unwrap();
        let mut res = vec![out, st];
        res.extend(vars.iter().map(|v| grads.get(v).unwrap().clone()));
        res
    }

    const NAMES: [&str; 8] = ["out", "state", "q", "k", "v", "g", "beta", "state0"];

    /// The fused CPU kernel (`ferrotune_core::fused::gated_delta_rule`) against this candle-op
    /// chunked form, the recurrent form and the recurrent form in float64: output, final state and every gradient, on shapes
    /// over several chunks with a partial last one, exactly one chunk, under a chunk, with and
    /// without an initial state, with mild and with strongly negative log decays.
    #[test]
    fn fused_kernel_equals_both_forms_with_gradients() {
        let cases = [
            ((2, 3, 150, 16, 12), (-1.0, 0.0), true),
            ((1, 2, 64, 8, 8), (-0.3, 0.0), false),
            ((1, 2, 40, 8, 16), (-1.0, 0.0), true),
            ((2, 1, 130, 8, 8), (-20.0, -5.0), true),
            ((1, 1, 7, 4, 4), (-2.0, 0.0), false),
        ];
        for (i, (shape, g_range, with_state)) in cases.into_iter().enumerate() {
            let vars = inputs(shape, g_range, with_state, 10 * i as u64);
            let fused = run(&vars, "fused", None);
            for form in ["chunk", "recurrent", "recurrent64"] {
                let other = run(&vars, form, None);
                for ((name, a), b) in NAMES.iter().zip(&fused).zip(&other) {
                    let err = rel_l2(a, b);
                    // The candle-op chunked form's own error in g's gradient under strong
                    // decays is 4.7e-5 from the float64 recurrent form (the fused kernel's 4e-6).
                    let bound = match (form, *name) {
                        ("chunk", "g") => 1e-4,
                        ("recurrent64", _) => 1e-5,
                        _ => 2e-5,
                    };
                    assert!(
                        err <= bound,
                        "{shape:?} {g_range:?}: {name} against {form}: {err}"
                    );
                }
            }
        }
    }

    /// Packed rows: the fused kernel restarting the state at each sample's start equals the
    /// recurrent form with a zero decay there, gradients included (the first position's decay
    /// of a sample gets none).
    #[test]
    fn fused_kernel_restarts_at_packed_samples() {
        let (b, t) = (2, 150);
        let vars = inputs((b, 2, t, 8, 8), (-1.0, 0.0), false, 7);
        let starts: Vec<Vec<bool>> = [vec![0, 30, 31, 100], vec![0, 64, 65]]
            .iter()
            .map(|s| (0..t).map(|i| s.contains(&i)).collect())
            .collect();
        let fused = run(&vars, "fused", Some(&starts));
        let other = run(&vars, "recurrent", Some(&starts));
        for ((name, a), b) in NAMES.iter().zip(&fused).zip(&other) {
            let err = rel_l2(a, b);
            assert!(err <= 2e-5, "packed: {name}: {err}");
        }
        // Nothing of the first sample reaches the second: its positions' gradients are those
        // of the second sample alone.
        let dg = fused[5].to_vec3::<f32>().unwrap();
        assert_eq!(dg[0][0][30], 0.0);
    }
}
