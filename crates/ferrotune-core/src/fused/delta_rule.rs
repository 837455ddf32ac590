//! The gated delta rule (Qwen3.5's and Qwen3-Next's linear attention) as one fused CPU op with
//! its own backward: [`gated_delta_rule`].
//!
//! Per (batch row, head), the positions run in chunks of [`CHUNK`] (cut short where a packed
//! sample starts). Within a chunk of `r` positions, with `c` the running sum of the log decays
//! `g`, `Γᵢⱼ = exp(cᵢ − cⱼ)` (`j ≤ i`) and `S` the state entering the chunk, the updates `u`
//! (`β (v − kᵀS)` of each position, the state decayed and updated by the positions before it)
//! solve the unit lower-triangular system
//!
//! `(I + diag(β) A) u = β (v − diag(e^c) k S)`,  `Aᵢⱼ = (kᵢ·kⱼ) Γᵢⱼ` for `j < i`,
//!
//! by forward substitution (the UT transform, as transformers' `torch_chunk_gated_delta_rule`
//! and FLA compute it); the output is `diag(e^c) q S + P u` with `Pᵢⱼ = (qᵢ·kⱼ) Γᵢⱼ` (`j ≤ i`),
//! and the state after the chunk `e^{c_last} S + Σⱼ e^{c_last − cⱼ} kⱼ uⱼᵀ`.
//!
//! The forward keeps each chunk's entering state and the errors `e = u / β` (as large as `v`); the backward walks
//! the chunks in reverse with the state's gradient, recomputing the chunk's `r × r` products, and
//! gives the exact gradients of `q`, `k`, `v`, `g`, `β` and the initial state (the transposed
//! solve for `u`'s right-hand side, the decays' gradient summed back through the running sum).

use std::sync::Mutex;

use candle_core::{bail, DType, Device, Result, Shape, Tensor};
use rayon::prelude::*;

use super::kernels::{self, matmul_on_this_thread, Operands};
use super::{contiguous, fused_applies, guard_slices, Forward};
use crate::custom_op::{Fused, FusedOp, Grads};
use crate::switch::{EnvSwitch, DELTA_RULE};

/// Positions per chunk, as transformers' and FLA's.
pub const CHUNK: usize = 64;

/// [`DELTA_RULE`]'s value for the whole process.
static ENABLED: EnvSwitch = EnvSwitch::new(&DELTA_RULE);

/// Whether [`gated_delta_rule`] runs on these tensors: all f32 on the CPU, and the kernel not
/// turned off by `FERROTUNE_DELTA_RULE=0` (or [`set_delta_rule_enabled`]).
pub fn delta_rule_applies(tensors: &[&Tensor]) -> bool {
    ENABLED.get() && fused_applies(tensors)
}

/// Turns the fused delta rule on or off for the whole process (a benchmark timing both paths).
pub fn set_delta_rule_enabled(on: bool) {
    ENABLED.set(on);
}

/// The gated delta rule over `q`, `k` `[b, h, t, dk]` (queries already scaled), `v` `[b, h, t,
/// dv]`, the log decays `g` and `beta` `[b, h, t]`, all f32 on the CPU, from `state` `[b, h, dk,
/// dv]` (zeros when `None`): the output `[b, h, t, dv]` and the state after the last position,
/// differentiable with respect to every input.
///
/// `starts` (packed rows, `[b][t]`) marks the positions where a new sample starts: the state
/// is dropped before them (decayed by 0, as the recurrent form with a zero decay computes), so
/// nothing crosses from one sample into the next.
pub fn gated_delta_rule(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: Option<&Tensor>,
    starts: Option<&[Vec<bool>]>,
) -> Result<(Tensor, Tensor)> {
    let (b, h, t, dk) = q.dims4()?;
    let dv = v.dim(3)?;
    let dims = Dims { b, h, t, dk, dv };
    if k.dims() != [b, h, t, dk]
        || v.dims() != [b, h, t, dv]
        || g.dims() != [b, h, t]
        || beta.dims() != [b, h, t]
        || state.is_some_and(|s| s.dims() != [b, h, dk, dv])
    {
        bail!(
            "gated delta rule: q {:?}, k {:?}, v {:?}, g {:?}, beta {:?} and state {:?} do not \
             fit together",
            q.dims(),
            k.dims(),
            v.dims(),
            g.dims(),
            beta.dims(),
            state.map(Tensor::dims)
        );
    }
    let mut all = vec![q, k, v, g, beta];
    all.extend(state);
    if !fused_applies(&all) {
        bail!("gated delta rule: the fused kernel takes f32 CPU tensors");
    }
    if let Some(s) = starts {
        if s.len() != b || s.iter().any(|row| row.len() != t) {
            bail!("gated delta rule: `starts` is not [{b}][{t}]");
        }
    }
    let plan = (0..b)
        .map(|bi| chunks(t, starts.map(|s| s[bi].as_slice())))
        .collect();
    let zeros;
    let state = match state {
        Some(s) => s,
        None => {
            zeros = Tensor::zeros((b, h, dk, dv), DType::F32, &Device::Cpu)?;
            &zeros
        }
    };
    // One input (candle's custom ops take at most three): everything flattened end to end, in
    // the order of [`Dims::regions`]; the output likewise holds the output, then the final state.
    let parts = [q, k, v, g, beta, state].map(|x| x.flatten_all());
    let flat = Tensor::cat(&parts.into_iter().collect::<Result<Vec<_>>>()?, 0)?;
    let op = DeltaRule {
        dims,
        plan,
        save: flat.track_op(),
        saved: Mutex::new(Vec::new()),
    };
    let res = flat.apply_op1(Fused(op))?;
    let n_out = b * h * t * dv;
    Ok((
        res.narrow(0, 0, n_out)?.reshape((b, h, t, dv))?,
        res.narrow(0, n_out, b * h * dk * dv)?
            .reshape((b, h, dk, dv))?,
    ))
}

/// One chunk of a row's positions: `[start, start + len)`; `reset` when the state is dropped
/// before it (a packed sample starts at `start`).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Chunk {
    start: usize,
    len: usize,
    reset: bool,
}

/// A row's `t` positions in chunks of at most [`CHUNK`], a new one at each sample's start.
fn chunks(t: usize, starts: Option<&[bool]>) -> Vec<Chunk> {
    let mut out: Vec<Chunk> = Vec::with_capacity(t.div_ceil(CHUNK));
    for i in 0..t {
        let start = starts.is_some_and(|s| s[i]);
        match out.last_mut() {
            Some(c) if !start && c.len < CHUNK => c.len += 1,
            _ => out.push(Chunk {
                start: i,
                len: 1,
                reset: start,
            }),
        }
    }
    out
}

#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    h: usize,
    t: usize,
    dk: usize,
    dv: usize,
}

impl Dims {
    /// The sizes per head of `q`, `k`, `v`, `g`, `beta` and the state, in the order the flat
    /// input holds them (each `b · h` heads of that size).
    fn regions(&self) -> [usize; 6] {
        let Dims { t, dk, dv, .. } = *self;
        [t * dk, t * dk, t * dv, t, t, dk * dv]
    }

    /// The flat input cut into its six parts.
    fn split<'a>(&self, flat: &'a [f32]) -> [&'a [f32]; 6] {
        let heads = self.b * self.h;
        let mut rest = flat;
        self.regions().map(|n| {
            let (part, tail) = rest.split_at(n * heads);
            rest = tail;
            part
        })
    }
}

/// What one head's forward keeps for its backward: the state entering each chunk and each
/// position's error `e` (`[t, dv]`; the update is `β e`).
struct Saved {
    states: Vec<f32>,
    e: Vec<f32>,
}

struct DeltaRule {
    dims: Dims,
    /// Each batch row's chunks.
    plan: Vec<Vec<Chunk>>,
    /// Whether a backward may follow (the input is tracked), so the forward keeps [`Saved`].
    save: bool,
    /// Per head, from the forward.
    saved: Mutex<Vec<Saved>>,
}

/// `y += a · x`.
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// The `r × r` quantities of one chunk, shared by the forward and the backward.
struct ChunkTerms {
    /// Running sum of the log decays.
    c: Vec<f32>,
    /// `exp(cᵢ − cⱼ)`, `j ≤ i`, else 0.
    gam: Vec<f32>,
    /// `Aᵢⱼ = (kᵢ·kⱼ) Γᵢⱼ`, `j < i`, else 0.
    a: Vec<f32>,
    /// `Pᵢⱼ = (qᵢ·kⱼ) Γᵢⱼ`, `j ≤ i`, else 0.
    p: Vec<f32>,
    /// `e^{cᵢ} kᵢ`, `[r, dk]`.
    n: Vec<f32>,
    /// `e^{cᵢ} qᵢ`, `[r, dk]`.
    qd: Vec<f32>,
    /// `e^{c_last − cⱼ} kⱼ`, `[r, dk]`.
    kt: Vec<f32>,
}

impl ChunkTerms {
    fn new(q: &[f32], k: &[f32], g: &[f32], dk: usize) -> Self {
        let r = g.len();
        let mut c = Vec::with_capacity(r);
        let mut acc = 0f32;
        for &x in g {
            acc += x;
            c.push(acc);
        }
        let mut gam = vec![0f32; r * r];
        for i in 0..r {
            for j in 0..=i {
                gam[i * r + j] = (c[i] - c[j]).exp();
            }
        }
        let mut a = vec![0f32; r * r];
        matmul_on_this_thread(&mut a, (r, r, dk), false, Operands::Nt, k, k, 1.0);
        let mut p = vec![0f32; r * r];
        matmul_on_this_thread(&mut p, (r, r, dk), false, Operands::Nt, q, k, 1.0);
        for i in 0..r {
            for j in 0..r {
                let x = i * r + j;
                a[x] = if j < i { a[x] * gam[x] } else { 0.0 };
                p[x] *= gam[x];
            }
        }
        let last = c[r - 1];
        let mut n = vec![0f32; r * dk];
        let mut qd = vec![0f32; r * dk];
        let mut kt = vec![0f32; r * dk];
        for (i, &ci) in c.iter().enumerate() {
            let (e, el) = (ci.exp(), (last - ci).exp());
            for d in 0..dk {
                let x = i * dk + d;
                n[x] = e * k[x];
                qd[x] = e * q[x];
                kt[x] = el * k[x];
            }
        }
        Self {
            c,
            gam,
            a,
            p,
            n,
            qd,
            kt,
        }
    }
}

/// One head's inputs (its positions' rows) and sizes.
struct Head<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
    dk: usize,
    dv: usize,
}

impl Head<'_> {
    /// The chunk's inputs: `[q, k, v, g, beta]` rows of `[start, start + len)`.
    fn rows(&self, c: Chunk) -> [&[f32]; 5] {
        let (s, r, dk, dv) = (c.start, c.len, self.dk, self.dv);
        [
            &self.q[s * dk..][..r * dk],
            &self.k[s * dk..][..r * dk],
            &self.v[s * dv..][..r * dv],
            &self.g[s..][..r],
            &self.beta[s..][..r],
        ]
    }

    /// The forward from `state` (`[dk, dv]`, left as the final state): writes the output `[t,
    /// dv]` and, when `saved` is given, fills it for the backward.
    fn forward(
        &self,
        plan: &[Chunk],
        state: &mut [f32],
        out: &mut [f32],
        mut saved: Option<&mut Saved>,
    ) {
        let (dk, dv) = (self.dk, self.dv);
        let mut next = vec![0f32; dk * dv];
        for &chunk in plan {
            let [q, k, v, g, beta] = self.rows(chunk);
            let r = chunk.len;
            if chunk.reset {
                state.fill(0.0);
            }
            let terms = ChunkTerms::new(q, k, g, dk);
            // Each position's error `e = v − e^c kᵀS − Σⱼ Aᵢⱼ uⱼ` (what the state, decayed and
            // updated by the positions before, misses) and update `u = β e`, by forward
            // substitution: the UT transform's system `(I + diag(β) A) u = β (v − diag(e^c) k S)`.
            let mut e = v.to_vec();
            matmul_on_this_thread(
                &mut e,
                (r, dv, dk),
                true,
                Operands::Nn,
                &terms.n,
                state,
                -1.0,
            );
            let mut u = vec![0f32; r * dv];
            for i in 0..r {
                let (done, rest) = u.split_at_mut(i * dv);
                let ei = &mut e[i * dv..][..dv];
                for j in 0..i {
                    let aij = terms.a[i * r + j];
                    if aij != 0.0 {
                        axpy(ei, -aij, &done[j * dv..][..dv]);
                    }
                }
                for (x, &y) in rest[..dv].iter_mut().zip(ei.iter()) {
                    *x = beta[i] * y;
                }
            }
            let o = &mut out[chunk.start * dv..][..r * dv];
            matmul_on_this_thread(o, (r, dv, dk), false, Operands::Nn, &terms.qd, state, 1.0);
            matmul_on_this_thread(o, (r, dv, r), true, Operands::Nn, &terms.p, &u, 1.0);
            if let Some(s) = saved.as_deref_mut() {
                s.states.extend_from_slice(state);
                s.e[chunk.start * dv..][..r * dv].copy_from_slice(&e);
            }
            let decay = terms.c[r - 1].exp();
            for (n, s) in next.iter_mut().zip(state.iter()) {
                *n = decay * s;
            }
            matmul_on_this_thread(
                &mut next,
                (dk, dv, r),
                true,
                Operands::Tn,
                &terms.kt,
                &u,
                1.0,
            );
            state.copy_from_slice(&next);
        }
    }
}

/// One head's gradients: `q`, `k`, `v`, `g`, `beta`, the initial state.
type HeadGrads = [Vec<f32>; 6];

impl Head<'_> {
    /// The gradients from the output's (`d_out`, `[t, dv]`) and the final state's (`d_state`).
    fn backward(&self, plan: &[Chunk], saved: &Saved, d_out: &[f32], d_state: &[f32]) -> HeadGrads {
        let (dk, dv) = (self.dk, self.dv);
        let t = self.g.len();
        let (mut dq, mut dk_all) = (vec![0f32; t * dk], vec![0f32; t * dk]);
        let (mut dv_all, mut dg, mut db) = (vec![0f32; t * dv], vec![0f32; t], vec![0f32; t]);
        let mut ds = d_state.to_vec();
        let mut ds_prev = vec![0f32; dk * dv];
        for (ci, &chunk) in plan.iter().enumerate().rev() {
            let [q, k, _, g, beta] = self.rows(chunk);
            let (s0, r) = (chunk.start, chunk.len);
            let terms = ChunkTerms::new(q, k, g, dk);
            let state = &saved.states[ci * dk * dv..][..dk * dv];
            let e = &saved.e[s0 * dv..][..r * dv];
            let mut u = vec![0f32; r * dv];
            for i in 0..r {
                for d in 0..dv {
                    u[i * dv + d] = beta[i] * e[i * dv + d];
                }
            }
            let u = &u[..];
            let d_o = &d_out[s0 * dv..][..r * dv];
            let dq_c = &mut dq[s0 * dk..][..r * dk];
            let dk_c = &mut dk_all[s0 * dk..][..r * dk];
            // c's gradient: `dc` for the terms of one position (`e^{cᵢ}` factors), `pairs` for
            // those of a pair `cᵢ − cⱼ` (`j < i`), which reach g only between j and i.
            let mut dc = vec![0f32; r];
            let mut pairs = vec![0f32; r * r];
            let last = terms.c[r - 1];
            let e_last = last.exp();
            // The state after the chunk: e^{c_last} S + K̃ᵀ u.
            for (p, &x) in ds_prev.iter_mut().zip(&ds) {
                *p = e_last * x;
            }
            dc[r - 1] += e_last * kernels::dot(state, &ds);
            let mut dkt = vec![0f32; r * dk];
            matmul_on_this_thread(&mut dkt, (r, dk, dv), false, Operands::Nt, u, &ds, 1.0);
            let mut du = vec![0f32; r * dv];
            matmul_on_this_thread(
                &mut du,
                (r, dv, dk),
                false,
                Operands::Nn,
                &terms.kt,
                &ds,
                1.0,
            );
            for j in 0..r {
                let row = &dkt[j * dk..][..dk];
                pairs[(r - 1) * r + j] += kernels::dot(row, &terms.kt[j * dk..][..dk]);
                axpy(&mut dk_c[j * dk..][..dk], (last - terms.c[j]).exp(), row);
            }
            // The output: diag(e^c) q S + P u.
            matmul_on_this_thread(
                &mut ds_prev,
                (dk, dv, r),
                true,
                Operands::Tn,
                &terms.qd,
                d_o,
                1.0,
            );
            let mut dqd = vec![0f32; r * dk];
            matmul_on_this_thread(&mut dqd, (r, dk, dv), false, Operands::Nt, d_o, state, 1.0);
            for i in 0..r {
                let row = &dqd[i * dk..][..dk];
                axpy(&mut dq_c[i * dk..][..dk], terms.c[i].exp(), row);
                dc[i] += kernels::dot(&terms.qd[i * dk..][..dk], row);
            }
            let mut dp = vec![0f32; r * r];
            matmul_on_this_thread(&mut dp, (r, r, dv), false, Operands::Nt, d_o, u, 1.0);
            matmul_on_this_thread(&mut du, (r, dv, r), true, Operands::Tn, &terms.p, d_o, 1.0);
            for i in 0..r {
                for j in 0..r {
                    let x = i * r + j;
                    if j <= i {
                        pairs[x] += dp[x] * terms.p[x];
                        dp[x] *= terms.gam[x];
                    } else {
                        dp[x] = 0.0;
                    }
                }
            }
            matmul_on_this_thread(dq_c, (r, dk, r), true, Operands::Nn, &dp, k, 1.0);
            matmul_on_this_thread(dk_c, (r, dk, r), true, Operands::Tn, &dp, q, 1.0);
            // u = β e with e = v − N S − A u (N = diag(e^c) k): u's whole gradient `dr` by the
            // transposed solve, e's is β dr, β's e·dr (taken from e itself, not from its parts,
            // which nearly cancel where the state predicts v well).
            let mut dr = du;
            let mut de = vec![0f32; r * dv];
            for i in (0..r).rev() {
                let (before, rest) = dr.split_at_mut(i * dv);
                let dri = &rest[..dv];
                let dei = &mut de[i * dv..][..dv];
                for (x, &y) in dei.iter_mut().zip(dri) {
                    *x = beta[i] * y;
                }
                db[s0 + i] += kernels::dot(&e[i * dv..][..dv], dri);
                for j in 0..i {
                    let aij = terms.a[i * r + j];
                    if aij != 0.0 {
                        axpy(&mut before[j * dv..][..dv], -aij, dei);
                    }
                }
            }
            // dA = −de uᵀ (strictly lower), through kᵢ·kⱼ and Γᵢⱼ.
            let mut da = vec![0f32; r * r];
            matmul_on_this_thread(&mut da, (r, r, dv), false, Operands::Nt, &de, u, -1.0);
            for i in 0..r {
                for j in 0..r {
                    let x = i * r + j;
                    if j < i {
                        pairs[x] += da[x] * terms.a[x];
                        da[x] *= terms.gam[x];
                    } else {
                        da[x] = 0.0;
                    }
                }
            }
            matmul_on_this_thread(dk_c, (r, dk, r), true, Operands::Nn, &da, k, 1.0);
            matmul_on_this_thread(dk_c, (r, dk, r), true, Operands::Tn, &da, k, 1.0);
            // e's −N S.
            let mut dn = vec![0f32; r * dk];
            matmul_on_this_thread(&mut dn, (r, dk, dv), false, Operands::Nt, &de, state, -1.0);
            matmul_on_this_thread(
                &mut ds_prev,
                (dk, dv, r),
                true,
                Operands::Tn,
                &terms.n,
                &de,
                -1.0,
            );
            for i in 0..r {
                axpy(&mut dv_all[(s0 + i) * dv..][..dv], 1.0, &de[i * dv..][..dv]);
                let dni = &dn[i * dk..][..dk];
                axpy(&mut dk_c[i * dk..][..dk], terms.c[i].exp(), dni);
                dc[i] += kernels::dot(&terms.n[i * dk..][..dk], dni);
            }
            // c is the running sum of g: g's gradient is the reversed running sum of c's, where a
            // pair's term `x (cᵢ − cⱼ)` gives x to the positions in `(j, i]` (summed as such, not
            // as +x and −x that cancel: with strong decays those terms dwarf the result).
            let mut between = vec![0f32; r];
            for i in 1..r {
                let mut acc = 0f32;
                for m in 1..=i {
                    acc += pairs[i * r + m - 1];
                    between[m] += acc;
                }
            }
            let mut acc = 0f32;
            for i in (0..r).rev() {
                acc += dc[i];
                dg[s0 + i] = acc + between[i];
            }
            if chunk.reset {
                // The state entering was dropped: nothing reaches the one before, nor the first
                // position's decay (which multiplied it).
                dg[s0] = 0.0;
                ds.fill(0.0);
            } else {
                ds.copy_from_slice(&ds_prev);
            }
        }
        [dq, dk_all, dv_all, dg, db, ds]
    }
}

impl DeltaRule {
    fn head<'a>(&self, parts: &[&'a [f32]; 6], bh: usize) -> Head<'a> {
        let [nq, _, nv, nt, ..] = self.dims.regions();
        Head {
            q: &parts[0][bh * nq..][..nq],
            k: &parts[1][bh * nq..][..nq],
            v: &parts[2][bh * nv..][..nv],
            g: &parts[3][bh * nt..][..nt],
            beta: &parts[4][bh * nt..][..nt],
            dk: self.dims.dk,
            dv: self.dims.dv,
        }
    }
}

impl FusedOp<1> for DeltaRule {
    const NAME: &'static str = "fused-gated-delta-rule";
    const WHAT: &'static str = "gated delta rule";

    fn forward(&self, [flat]: [&[f32]; 1], _: [&Shape; 1]) -> Forward {
        let Dims { b, h, t, dk, dv } = self.dims;
        let parts = self.dims.split(flat);
        let n_out = b * h * t * dv;
        let mut res = vec![0f32; n_out + b * h * dk * dv];
        res[n_out..].copy_from_slice(parts[5]);
        let (out, state) = res.split_at_mut(n_out);
        let saved: Vec<Saved> = out
            .par_chunks_mut(t * dv)
            .zip(state.par_chunks_mut(dk * dv))
            .enumerate()
            .map(|(bh, (out, state))| {
                let plan = &self.plan[bh / h];
                let mut saved = self.save.then(|| Saved {
                    states: Vec::with_capacity(plan.len() * dk * dv),
                    e: vec![0f32; t * dv],
                });
                self.head(&parts, bh)
                    .forward(plan, state, out, saved.as_mut());
                saved.unwrap_or(Saved {
                    states: Vec::new(),
                    e: Vec::new(),
                })
            })
            .collect();
        if self.save {
            *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = saved;
        }
        let len = res.len();
        Ok((res, Shape::from(len)))
    }

    fn backward(&self, [flat]: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> Grads<1> {
        let Dims { b, h, t, dk, dv } = self.dims;
        let tensors = contiguous([flat, grad])?;
        let guards = tensors.each_ref().map(Tensor::storage_and_layout);
        let [flat_data, grad_data] = guard_slices(&guards, Self::WHAT)?;
        let saved = self.saved.lock().unwrap_or_else(|e| e.into_inner());
        if saved.len() != b * h {
            bail!("gated delta rule: backward without a forward that kept its states");
        }
        let parts = self.dims.split(flat_data);
        let n_out = b * h * t * dv;
        let (d_out, d_state) = grad_data.split_at(n_out);
        let grads: Vec<HeadGrads> = (0..b * h)
            .into_par_iter()
            .map(|bh| {
                self.head(&parts, bh).backward(
                    &self.plan[bh / h],
                    &saved[bh],
                    &d_out[bh * t * dv..][..t * dv],
                    &d_state[bh * dk * dv..][..dk * dv],
                )
            })
            .collect();
        let mut out = Vec::with_capacity(flat_data.len());
        for region in 0..6 {
            for g in &grads {
                out.extend_from_slice(&g[region]);
            }
        }
        Ok([Some(Tensor::from_vec(out, flat.shape(), &Device::Cpu)?)])
    }
}
