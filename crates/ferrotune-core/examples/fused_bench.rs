//! Times each fused training op against the composite candle formula it replaces, forward and
//! forward + backward, at SmolLM2-135M training sizes (batch 4 × 256 tokens, f32, CPU).
//!
//! `cargo run --release -p ferrotune-core --example fused_bench [-- --runs N]`
//!
//! Each cell is the best of N runs (default 5) after one warm-up, so that other load on the
//! machine inflates the numbers as little as possible. The backward is seeded by a tiny custom op
//! (`Σ out · probe`, whose gradient is `probe`), the same for both columns.

use std::time::Instant;

use candle_core::{CpuStorage, CustomOp1, Device, Layout, Result, Shape, Tensor, Var, D};
use ferrotune_core::fused::{self, GatedAct};
use ferrotune_core::ops;
use rayon::prelude::*;

const B: usize = 4;
const T: usize = 256;
const HIDDEN: usize = 576;
const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const MLP: usize = 1536;
const VOCAB: usize = 49152;

/// `Σ x · probe` as a scalar, with `probe` as the gradient: seeds a backward pass for free.
struct Probe(Tensor);

impl CustomOp1 for Probe {
    fn name(&self) -> &'static str {
        "probe"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = storage.as_slice::<f32>()?;
        let (a, b) = layout
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("probe: strided input".into()))?;
        let (guard, p_layout) = self.0.storage_and_layout();
        let candle_core::Storage::Cpu(p) = &*guard else {
            candle_core::bail!("probe: not on the CPU")
        };
        let p = &p.as_slice::<f32>()?[p_layout.start_offset()..];
        // Parallel, so that seeding the backward costs next to nothing in either column.
        let s: f32 = x[a..b]
            .par_chunks(1 << 14)
            .zip(p.par_chunks(1 << 14))
            .map(|(x, p)| x.iter().zip(p).map(|(x, p)| x * p).sum::<f32>())
            .sum();
        Ok((CpuStorage::F32(vec![s]), Shape::from(())))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, _grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.0.clone()))
    }
}

fn probe_loss(out: &Tensor, probe: &Tensor) -> Result<Tensor> {
    out.contiguous()?.apply_op1(Probe(probe.contiguous()?))
}

struct Rng(u64);

impl Rng {
    fn tensor(&mut self, shape: &[usize], amp: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = (0..n)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                ((self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
            })
            .collect();
        Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
    }
}

/// Best wall time in milliseconds of `runs` calls after one warm-up.
fn best_ms(runs: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        let t0 = Instant::now();
        f()?;
        best = best.min(t0.elapsed().as_secs_f64() * 1e3);
    }
    Ok(best)
}

/// Times forward and forward+backward of `f` over variables made from `inputs`.
fn time_op(
    runs: usize,
    inputs: &[Tensor],
    probe: Option<&Tensor>,
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<(f64, f64)> {
    let vars: Vec<Var> = inputs.iter().map(Var::from_tensor).collect::<Result<_>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let fwd = best_ms(runs, || f(&ts).map(|_| ()))?;
    let both = best_ms(runs, || {
        let out = f(&ts)?;
        let loss = match probe {
            Some(p) => probe_loss(&out, p)?,
            None => out,
        };
        loss.backward().map(|_| ())
    })?;
    Ok((fwd, both))
}

/// Additive causal mask `[B, 1, T, T]` with `f32::MIN` at masked places, as the decoder builds it.
fn causal_mask() -> Result<Tensor> {
    let data: Vec<f32> = (0..B * T * T)
        .map(|i| {
            let (q, k) = ((i / T) % T, i % T);
            if k <= q {
                0.0
            } else {
                f32::MIN
            }
        })
        .collect();
    Tensor::from_vec(data, (B, 1, T, T), &Device::Cpu)
}

/// The decoder's composite attention (query heads of a group stacked along the rows).
fn composite_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let groups = HEADS / KV_HEADS;
    let q = q.reshape((B, KV_HEADS, groups * T, HEAD_DIM))?;
    let scores = (q.matmul(&k.t()?)? * (HEAD_DIM as f64).powf(-0.5))?
        .reshape((B, KV_HEADS, groups, T, T))?
        .broadcast_add(&mask.unsqueeze(1)?)?
        .reshape((B, KV_HEADS, groups * T, T))?;
    ops::softmax_last_dim(&scores)?
        .matmul(v)?
        .reshape((B, HEADS, T, HEAD_DIM))
}

/// The training loss's composite cross-entropy sum (every row counted).
fn composite_cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let z = logits.broadcast_sub(&max)?;
    let lse = z.exp()?.sum_keepdim(D::Minus1)?.log()?;
    (lse - z.gather(targets, D::Minus1)?)?.sum_all()
}

fn main() -> Result<()> {
    ferrotune_core::init_cpu_threads();
    let args: Vec<String> = std::env::args().collect();
    let runs = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let rows = B * T;

    type OpFn<'a> = Box<dyn Fn(&[Tensor]) -> Result<Tensor> + 'a>;
    struct Case<'a> {
        name: &'static str,
        inputs: Vec<Tensor>,
        probe: Option<Tensor>,
        composite: OpFn<'a>,
        fused: OpFn<'a>,
    }

    let mask = causal_mask()?;
    let cos = rng.tensor(&[B, 1, T, HEAD_DIM], 1.0);
    let sin = rng.tensor(&[B, 1, T, HEAD_DIM], 1.0);
    let norm_w = (rng.tensor(&[HIDDEN], 0.1) + 1.0)?;
    let target_ids: Vec<i64> = (0..rows).map(|i| ((i * 7919) % VOCAB) as i64).collect();
    let target_t = Tensor::from_vec(
        target_ids.iter().map(|&t| t as u32).collect::<Vec<_>>(),
        (rows, 1),
        &Device::Cpu,
    )?;
    let (m, c, s, w, tg, tt) = (&mask, &cos, &sin, &norm_w, &target_ids, &target_t);
    let cases = vec![
        Case {
            name: "attention (causal, GQA 9/3)",
            inputs: vec![
                rng.tensor(&[B, HEADS, T, HEAD_DIM], 2.0),
                rng.tensor(&[B, KV_HEADS, T, HEAD_DIM], 2.0),
                rng.tensor(&[B, KV_HEADS, T, HEAD_DIM], 1.0),
            ],
            probe: Some(rng.tensor(&[B, HEADS, T, HEAD_DIM], 1.0)),
            composite: Box::new(move |x| composite_attention(&x[0], &x[1], &x[2], m)),
            fused: Box::new(move |x| {
                fused::attention(&x[0], &x[1], &x[2], Some(m), (HEAD_DIM as f64).powf(-0.5))
            }),
        },
        Case {
            name: "cross-entropy [1024, 49152]",
            inputs: vec![rng.tensor(&[rows, VOCAB], 8.0)],
            probe: None,
            composite: Box::new(move |x| composite_cross_entropy(&x[0], tt)),
            fused: Box::new(move |x| Ok(fused::cross_entropy_sum(&x[0], tg, -100)?.0)),
        },
        Case {
            name: "rms_norm [4, 256, 576]",
            inputs: vec![rng.tensor(&[B, T, HIDDEN], 2.0)],
            probe: Some(rng.tensor(&[B, T, HIDDEN], 1.0)),
            composite: Box::new(move |x| ops::rms_norm(&x[0], w, 1e-5, false)),
            fused: Box::new(move |x| fused::rms_norm(&x[0], w, 1e-5, false)),
        },
        Case {
            name: "rope q [4, 9, 256, 64]",
            inputs: vec![rng.tensor(&[B, HEADS, T, HEAD_DIM], 2.0)],
            probe: Some(rng.tensor(&[B, HEADS, T, HEAD_DIM], 1.0)),
            composite: Box::new(move |x| ops::apply_rope(&x[0], c, s)),
            fused: Box::new(move |x| fused::rope(&x[0], c, s)),
        },
        Case {
            name: "swiglu silu [4, 256, 1536]",
            inputs: vec![rng.tensor(&[B, T, MLP], 4.0), rng.tensor(&[B, T, MLP], 2.0)],
            probe: Some(rng.tensor(&[B, T, MLP], 1.0)),
            composite: Box::new(|x| x[0].silu()? * &x[1]),
            fused: Box::new(|x| fused::swiglu(&x[0], &x[1], GatedAct::Silu)),
        },
    ];

    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_default();
    println!("best of {runs} runs, {threads} threads, ms");
    println!(
        "| op | composite fwd | composite fwd+bwd | fused fwd | fused fwd+bwd | speed-up fwd+bwd |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for case in &cases {
        let (cf, cb) = time_op(runs, &case.inputs, case.probe.as_ref(), &*case.composite)?;
        let (ff, fb) = time_op(runs, &case.inputs, case.probe.as_ref(), &*case.fused)?;
        println!(
            "| {} | {cf:.2} | {cb:.2} | {ff:.2} | {fb:.2} | {:.1}× |",
            case.name,
            cb / fb
        );
    }
    Ok(())
}
