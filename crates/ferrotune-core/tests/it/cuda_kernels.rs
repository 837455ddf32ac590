//! The CUDA kernels against the CPU f32 implementation (itself tested against the composite candle
//! formulas in fused.rs): forward values and every input gradient, on fresh random inputs, in f32
//! (relative error ≤ 1e-5) and bf16 (≤ 1e-2). They need a GPU: built with `--features cuda`, and
//! on a machine without one each test says so and passes without checking anything (CI tests the
//! CPU path; these run on the GPU machine, see benchmarks/README.md). The decode-step kernels
//! (`ferrotune_core::decode`), forward only, are checked the same way at the end.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Result, Tensor, Var};
use ferrotune_core::fused::{self, GatedAct};

use crate::common;
use common::Rng;

fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("no GPU ({e}): skipped");
            None
        }
    }
}

/// `‖a − b‖ / ‖b‖` over all elements, in f64.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    let (a, b) = (ferrotune_testing::f32s(a), ferrotune_testing::f32s(b));
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(&b) {
        assert!(x.is_finite(), "non-finite value {x}");
        num += ((x - y) as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

fn tol(dtype: DType) -> f64 {
    if dtype == DType::F32 {
        1e-5
    } else {
        1e-2
    }
}

/// Runs `f` on CPU f32 inputs and on the same inputs on the GPU in `dtype`, each time taking
/// `Σ out ⊙ r` for a fixed random `r` as the loss, and compares the output and the gradients of
/// the inputs listed in `trained`.
fn check(
    name: &str,
    inputs: &[Tensor],
    trained: &[bool],
    dtype: DType,
    gpu: &Device,
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) {
    let run = |dev: &Device, dt: DType| -> (Tensor, Vec<Option<Tensor>>) {
        let vars: Vec<Option<Var>> = inputs
            .iter()
            .zip(trained)
            .map(|(t, &tr)| {
                tr.then(|| {
                    Var::from_tensor(&t.to_dtype(dt).unwrap().to_device(dev).unwrap()).unwrap()
                })
            })
            .collect();
        let ts: Vec<Tensor> = inputs
            .iter()
            .zip(&vars)
            .map(|(t, v)| match v {
                Some(v) => v.as_tensor().clone(),
                None => t.to_dtype(dt).unwrap().to_device(dev).unwrap(),
            })
            .collect();
        let out = f(&ts).unwrap();
        let r = Rng(99)
            .tensor(out.dims(), 1.0)
            .to_dtype(dt)
            .unwrap()
            .to_device(dev)
            .unwrap();
        let loss = (out.to_dtype(DType::F32).unwrap() * r.to_dtype(DType::F32).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        let g = vars
            .iter()
            .map(|v| {
                v.as_ref()
                    .map(|v| grads.get(v.as_tensor()).expect("gradient").clone())
            })
            .collect();
        (out, g)
    };
    let (want, want_g) = run(&Device::Cpu, DType::F32);
    let (got, got_g) = run(gpu, dtype);
    let e = rel(&got, &want);
    assert!(
        e <= tol(dtype),
        "{name} {dtype:?}: output relative error {e}"
    );
    for (i, (g, w)) in got_g.iter().zip(&want_g).enumerate() {
        if let (Some(g), Some(w)) = (g, w) {
            let e = rel(g, w);
            assert!(
                e <= tol(dtype),
                "{name} {dtype:?}: gradient {i} relative error {e}"
            );
        }
    }
    eprintln!("{name} {dtype:?}: ok");
}

const DTYPES: [DType; 2] = [DType::F32, DType::BF16];

#[test]
fn rms_norm_matches_cpu() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(1);
    for (shape, offset_one) in [
        (vec![3, 5, 96], false),
        (vec![64, 4096], false),
        (vec![7, 130], true),
    ] {
        let h = *shape.last().unwrap();
        let x = rng.tensor(&shape, 2.0);
        let w = (rng.tensor(&[h], 0.5) + 1.0).unwrap();
        for dtype in DTYPES {
            for train_w in [false, true] {
                check(
                    &format!("rms_norm {shape:?} offset_one={offset_one} train_w={train_w}"),
                    &[x.clone(), w.clone()],
                    &[true, train_w],
                    dtype,
                    &gpu,
                    &|t| fused::rms_norm(&t[0], &t[1], 1e-5, offset_one),
                );
            }
        }
    }
}

#[test]
fn gated_activations_match_cpu() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(2);
    let g = rng.tensor(&[4, 33, 70], 4.0);
    let u = rng.tensor(&[4, 33, 70], 2.0);
    for act in [GatedAct::Silu, GatedAct::GeluTanh, GatedAct::GeluErf] {
        for dtype in DTYPES {
            check(
                &format!("swiglu {act:?}"),
                &[g.clone(), u.clone()],
                &[true, true],
                dtype,
                &gpu,
                &|t| fused::swiglu(&t[0], &t[1], act),
            );
        }
    }
}

#[test]
fn rope_reads_transposed_input_in_place() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(7);
    // q as the projection lays it out, [b, t, heads, d], viewed as [b, heads, t, d].
    let x = rng.tensor(&[2, 7, 3, 16], 1.0);
    let cos = rng.tensor(&[1, 1, 7, 16], 1.0);
    let sin = rng.tensor(&[1, 1, 7, 16], 1.0);
    for dtype in DTYPES {
        check(
            "rope on a transposed view",
            &[x.clone(), cos.clone(), sin.clone()],
            &[true, false, false],
            dtype,
            &gpu,
            &|t| fused::rope(&t[0].transpose(1, 2)?, &t[1], &t[2]),
        );
    }
}

#[test]
fn rope_matches_cpu() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(3);
    // Full and partial rotary, cos/sin shared by the batch or per row.
    for (cb, rot) in [(1, 16), (2, 16), (1, 8), (2, 10)] {
        let x = rng.tensor(&[2, 3, 7, 16], 1.0);
        let cos = rng.tensor(&[cb, 1, 7, rot], 1.0);
        let sin = rng.tensor(&[cb, 1, 7, rot], 1.0);
        for dtype in DTYPES {
            check(
                &format!("rope cb={cb} rot={rot}"),
                &[x.clone(), cos.clone(), sin.clone()],
                &[true, false, false],
                dtype,
                &gpu,
                &|t| fused::rope(&t[0], &t[1], &t[2]),
            );
        }
    }
}

/// Additive causal mask `[b, 1, t, s]` (queries at the end of `s` keys), with `pad` leading keys
/// of batch row 1 masked as padding, and optionally packed documents of length `doc`. Masked
/// entries are −3e38, finite in bf16 too (as the decoder's dtype minimum is): f32::MIN would
/// round to −∞ in bf16, where rows with every key masked get zeros instead of uniform weights.
fn mask(b: usize, t: usize, s: usize, pad: usize, doc: Option<usize>) -> Tensor {
    let mut m = vec![0f32; b * t * s];
    for bi in 0..b {
        for q in 0..t {
            let qpos = s - t + q;
            for k in 0..s {
                let masked =
                    k > qpos || (bi == 1 && k < pad) || doc.is_some_and(|d| k / d != qpos / d);
                if masked {
                    m[(bi * t + q) * s + k] = -3.0e38;
                }
            }
        }
    }
    Tensor::from_vec(m, (b, 1, t, s), &Device::Cpu).unwrap()
}

/// `m` with key `key` masked for every query: a gap in the visible keys of the rows past it, so
/// the flash kernels read the mask rather than per-row key intervals.
fn with_masked_key(m: Tensor, key: usize) -> Tensor {
    let (b, _, t, s) = m.dims4().unwrap();
    let mut v: Vec<f32> = m.flatten_all().unwrap().to_vec1().unwrap();
    for row in v.chunks_exact_mut(s) {
        row[key] = -3.0e38;
    }
    Tensor::from_vec(v, (b, 1, t, s), &Device::Cpu).unwrap()
}

#[test]
fn attention_matches_cpu() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(4);
    // (b, nh, nkv, t, s, hd, mask, softcap): causal with padding; packed documents; several
    // chunks (t > 256 rows); no mask; a decode step (t = 1); Gemma 2's softcap (small enough to
    // bend the scores) with padding and over several chunks; the flash forward's head dims.
    type Case = (
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        Option<Tensor>,
        Option<f64>,
    );
    let cases: Vec<Case> = vec![
        (2, 4, 2, 37, 37, 16, Some(mask(2, 37, 37, 5, None)), None),
        (
            2,
            4,
            4,
            64,
            64,
            32,
            Some(mask(2, 64, 64, 0, Some(20))),
            None,
        ),
        (
            1,
            4,
            1,
            300,
            300,
            16,
            Some(mask(1, 300, 300, 0, None)),
            None,
        ),
        (2, 2, 1, 9, 9, 8, None, None),
        (2, 8, 2, 1, 20, 16, None, None),
        (
            2,
            4,
            2,
            37,
            37,
            16,
            Some(mask(2, 37, 37, 5, None)),
            Some(0.7),
        ),
        (
            1,
            4,
            1,
            300,
            300,
            16,
            Some(mask(1, 300, 300, 0, None)),
            Some(1.5),
        ),
        (2, 2, 1, 9, 9, 8, None, Some(0.5)),
        // Head dims the flash forward takes in bf16 (f32 stays chunked): two row blocks with
        // padding and GQA; packed documents over three blocks; one row and no mask; a mask with
        // a gap (read per score, not as intervals); softcap.
        (2, 4, 2, 70, 70, 64, Some(mask(2, 70, 70, 5, None)), None),
        (
            1,
            4,
            1,
            130,
            130,
            128,
            Some(mask(1, 130, 130, 0, Some(40))),
            None,
        ),
        (2, 4, 4, 1, 77, 96, None, None),
        (
            2,
            4,
            2,
            70,
            70,
            64,
            Some(with_masked_key(mask(2, 70, 70, 5, None), 3)),
            None,
        ),
        (
            2,
            2,
            1,
            20,
            150,
            64,
            Some(mask(2, 20, 150, 0, None)),
            Some(1.5),
        ),
    ];
    for (b, nh, nkv, t, s, hd, m, softcap) in cases {
        let q = rng.tensor(&[b, nh, t, hd], 1.0);
        let k = rng.tensor(&[b, nkv, s, hd], 1.0);
        let v = rng.tensor(&[b, nkv, s, hd], 1.0);
        for dtype in DTYPES {
            let m = m.clone();
            check(
                &format!(
                    "attention b={b} nh={nh} nkv={nkv} t={t} s={s} hd={hd} mask={} softcap={softcap:?}",
                    m.is_some()
                ),
                &[q.clone(), k.clone(), v.clone()],
                &[true, true, true],
                dtype,
                &gpu,
                &move |ts| {
                    let m = match &m {
                        Some(m) => Some(m.to_dtype(ts[0].dtype())?.to_device(ts[0].device())?),
                        None => None,
                    };
                    let scale = 1.0 / (hd as f64).sqrt();
                    fused::attention_softcapped(&ts[0], &ts[1], &ts[2], m.as_ref(), scale, softcap)
                },
            );
        }
    }
}

#[test]
fn linear_cross_entropy_matches_cpu() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(5);
    let (n, h, vocab) = (50, 32, 1000);
    let x = rng.tensor(&[n, h], 1.0);
    let w = rng.tensor(&[vocab, h], 0.5);
    let targets: Vec<i64> = (0..n)
        .map(|i| {
            if i % 7 == 3 {
                -100
            } else {
                ((i * 37) % vocab) as i64
            }
        })
        .collect();
    // Three chunks of rows with targets, and one chunk holding them all.
    for chunk in ["16", "100000"] {
        // Process-wide, but only the CUDA cross entropy (this module's) reads it.
        std::env::set_var("FERROTUNE_CE_CHUNK_ROWS", chunk);
        for dtype in DTYPES {
            for train_w in [false, true] {
                let targets = targets.clone();
                check(
                    &format!("linear_cross_entropy chunk={chunk} train_w={train_w}"),
                    &[x.clone(), w.clone()],
                    &[true, train_w],
                    dtype,
                    &gpu,
                    &move |t| {
                        let (sum, count) =
                            fused::linear_cross_entropy_sum(&t[0], &t[1], &targets, -100)?;
                        assert_eq!(count, targets.iter().filter(|&&t| t != -100).count());
                        sum.reshape(1)
                    },
                );
            }
        }
    }
}

#[test]
fn peak_memory_is_reported() {
    let Some(gpu) = gpu() else { return };
    ferrotune_core::reset_peak_memory(&gpu);
    let t = Tensor::zeros(1 << 26, DType::F32, &gpu).unwrap();
    gpu.synchronize().unwrap();
    let peak = ferrotune_core::peak_memory_bytes(&gpu).expect("a GPU reports its peak");
    assert!(
        peak >= 1 << 28,
        "peak {peak} below the 256 MiB just allocated"
    );
    drop(t);
}

#[test]
fn lora_linear_matches_cpu() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(6);
    let (m, inp, out, r) = (37, 48, 80, 8);
    let x = rng.tensor(&[m, inp], 1.0);
    let w = rng.tensor(&[out, inp], 0.2);
    let bias = rng.tensor(&[out], 0.5);
    let a = rng.tensor(&[r, inp], 0.2);
    let b = rng.tensor(&[out, r], 0.2);
    for with_bias in [false, true] {
        for dtype in DTYPES {
            let (w, bias) = (w.clone(), bias.clone());
            check(
                &format!("lora_linear bias={with_bias}"),
                &[x.clone(), a.clone(), b.clone()],
                &[true, true, true],
                dtype,
                &gpu,
                &move |t| {
                    let w = w.to_dtype(t[0].dtype())?.to_device(t[0].device())?;
                    let bias = bias.to_dtype(t[0].dtype())?.to_device(t[0].device())?;
                    fused::lora_linear(&t[0], &w, with_bias.then_some(&bias), &t[1], &t[2], 2.0)
                },
            );
        }
    }
}

#[test]
fn gated_lora_matches_cpu() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(8);
    let (b, t, inp, inter, r) = (2, 9, 48, 80, 4);
    let x = rng.tensor(&[b, t, inp], 1.0);
    let (wg, wu) = (
        rng.tensor(&[inter, inp], 0.2),
        rng.tensor(&[inter, inp], 0.2),
    );
    let (ag, au) = (rng.tensor(&[r, inp], 0.2), rng.tensor(&[r, inp], 0.2));
    let (bg, bu) = (rng.tensor(&[inter, r], 0.2), rng.tensor(&[inter, r], 0.2));
    for act in [GatedAct::Silu, GatedAct::GeluTanh] {
        for dtype in DTYPES {
            let (wg, wu) = (wg.clone(), wu.clone());
            check(
                &format!("gated_lora {act:?}"),
                &[x.clone(), ag.clone(), bg.clone(), au.clone(), bu.clone()],
                &[true, true, true, true, true],
                dtype,
                &gpu,
                &move |t| {
                    let wg = wg.to_dtype(t[0].dtype())?.to_device(t[0].device())?;
                    let wu = wu.to_dtype(t[0].dtype())?.to_device(t[0].device())?;
                    let gate = fused::LoraProjection {
                        weight: &wg,
                        a: &t[1],
                        b: &t[2],
                        scale: 2.0,
                    };
                    let up = fused::LoraProjection {
                        weight: &wu,
                        a: &t[3],
                        b: &t[4],
                        scale: 0.5,
                    };
                    fused::gated_lora(&t[0], &gate, &up, act)
                },
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Decode-step kernels (ferrotune_core::decode): the GPU kernel against the same function on CPU
// f32, where it is the forward pass's own ops.

/// Runs `f` on CPU f32 copies of `inputs` and on GPU copies in `dtype`, and compares every tensor
/// it returns (outputs, and caches it wrote in place).
fn check_decode(
    name: &str,
    inputs: &[Tensor],
    dtype: DType,
    gpu: &Device,
    f: &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>,
) {
    let on = |dev: &Device, dt: DType| -> Vec<Tensor> {
        // Fresh storage each time: the caches are written in place.
        let ts: Vec<Tensor> = inputs
            .iter()
            .map(|t| {
                t.to_dtype(dt)
                    .unwrap()
                    .to_device(dev)
                    .unwrap()
                    .copy()
                    .unwrap()
            })
            .collect();
        f(&ts).unwrap()
    };
    let want = on(&Device::Cpu, DType::F32);
    let got = on(gpu, dtype);
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let e = rel(g, w);
        assert!(
            e <= tol(dtype),
            "{name} {dtype:?}: result {i} relative error {e}"
        );
    }
    eprintln!("{name} {dtype:?}: ok");
}

#[test]
fn decode_linear_rows_match_cpu() {
    use ferrotune_core::decode::{linear_rows, Projection};
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(21);
    // Widths that leave a partial 256-element chunk, 1 to 8 rows, 1 or 3 stacked matrices.
    for (rows, width, outs, bias, residual) in [
        (1, 1048, vec![40], false, false),
        (3, 776, vec![24, 8, 8], true, false),
        (8, 520, vec![9], true, true),
        (2, 4096, vec![64, 16, 16], false, true),
    ] {
        let mut inputs = vec![rng.tensor(&[rows, width], 1.0)];
        for &o in &outs {
            inputs.push(rng.tensor(&[o, width], 0.05));
            inputs.push(rng.tensor(&[o], 0.5));
        }
        let total: usize = outs.iter().sum();
        inputs.push(rng.tensor(&[rows, total], 1.0));
        let n = outs.len();
        for dtype in DTYPES {
            check_decode("linear_rows", &inputs, dtype, &gpu, &|t| {
                let projections: Vec<Projection> = (0..n)
                    .map(|i| Projection {
                        weight: &t[1 + 2 * i],
                        bias: bias.then(|| &t[2 + 2 * i]),
                    })
                    .collect();
                let r = residual.then(|| &t[1 + 2 * n]);
                Ok(vec![linear_rows(&t[0], &projections, r)?])
            });
        }
    }
}

#[test]
fn decode_gated_rows_match_cpu() {
    use ferrotune_core::decode::{gated_rows, Projection};
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(22);
    for (rows, width, out, act, bias) in [
        (1, 512, 20, GatedAct::Silu, false),
        (3, 264, 11, GatedAct::GeluTanh, true),
        (2, 1032, 5, GatedAct::GeluErf, false),
        (5, 1024, 9, GatedAct::Silu, true),
    ] {
        let inputs = vec![
            rng.tensor(&[rows, width], 1.0),
            rng.tensor(&[out, width], 0.1),
            rng.tensor(&[out], 0.5),
            rng.tensor(&[out, width], 0.1),
            rng.tensor(&[out], 0.5),
        ];
        for dtype in DTYPES {
            check_decode("gated_rows", &inputs, dtype, &gpu, &|t| {
                let gate = Projection {
                    weight: &t[1],
                    bias: bias.then(|| &t[2]),
                };
                let up = Projection {
                    weight: &t[3],
                    bias: bias.then(|| &t[4]),
                };
                Ok(vec![gated_rows(&t[0], gate, up, act)?])
            });
        }
    }
}

#[test]
fn decode_rope_into_cache_matches_cpu() {
    use ferrotune_core::decode::{rope_into_cache, Heads, QkNorm, StepPosition};
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(23);
    // (rows, heads, kv heads, head dim, rotated dims, per-head norms, Gemma's 1 + w, capacity,
    // slot, slot read from device counters as in a replayed CUDA graph — the host value is then
    // slot 0, which the kernel must ignore)
    for (rows, query, kv, dim, rot, norms, offset_one, cap, pos, counters) in [
        (1, 4, 2, 64, 64, false, false, 8, 3, false),
        (3, 6, 2, 48, 32, true, false, 5, 4, false),
        (2, 2, 1, 128, 128, true, true, 3, 0, false),
        (2, 4, 2, 64, 64, true, false, 9, 5, true),
    ] {
        let inputs = vec![
            rng.tensor(&[rows, (query + 2 * kv) * dim], 1.0),
            rng.tensor(&[rows, rot], 1.0),
            rng.tensor(&[rows, rot], 1.0),
            rng.tensor(&[dim], 1.0),
            rng.tensor(&[dim], 1.0),
            rng.tensor(&[rows, kv, cap, dim], 1.0),
            rng.tensor(&[rows, kv, cap, dim], 1.0),
        ];
        for dtype in DTYPES {
            check_decode("rope_into_cache", &inputs, dtype, &gpu, &|t| {
                let norm = norms.then(|| QkNorm {
                    q: &t[3],
                    k: &t[4],
                    eps: 1e-6,
                    offset_one,
                });
                let heads = Heads { query, kv, dim };
                let device_counters = counters
                    .then(|| Tensor::new(&[pos as u32, pos as u32 + 1], t[0].device()))
                    .transpose()?;
                let at = StepPosition {
                    len: if counters { 1 } else { pos + 1 },
                    counters: device_counters.as_ref(),
                };
                let q = rope_into_cache(&t[0], &t[1], &t[2], norm, heads, &t[5], &t[6], at)?;
                Ok(vec![q, t[5].clone(), t[6].clone()])
            });
        }
    }
}

#[test]
fn decode_cached_attention_matches_cpu() {
    use ferrotune_core::decode::{cached_attention, FirstKeys, StepPosition};
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(24);
    // (rows, heads, kv heads, head dim, capacity, keys, first key per row, window, softcap, keys
    // read from device counters as in a replayed CUDA graph — the host value is then the
    // capacity, which the kernel must ignore)
    for (rows, query, kv, dim, cap, len, first, window, softcap, counters) in [
        (1, 4, 2, 64, 16, 11, vec![0], None, None, false),
        (3, 6, 2, 128, 40, 37, vec![0, 5, 36], None, None, false),
        (2, 4, 4, 256, 24, 24, vec![2, 0], Some(7), None, false),
        (2, 8, 1, 32, 600, 555, vec![0, 100], None, None, false),
        (2, 4, 2, 64, 48, 45, vec![0, 9], Some(16), Some(0.5), false),
        (2, 4, 2, 64, 300, 123, vec![0, 7], None, None, true),
        // Capacities from 1024 on are attended in splits of 256 keys (dec_attention_part).
        (1, 8, 2, 128, 2048, 1900, vec![0], None, None, false),
        (
            2,
            4,
            2,
            64,
            1280,
            1000,
            vec![0, 300],
            Some(512),
            Some(0.5),
            true,
        ),
        (2, 4, 4, 256, 1024, 40, vec![3, 0], None, None, false),
    ] {
        let inputs = vec![
            rng.tensor(&[rows, query, dim], 1.0),
            rng.tensor(&[rows, kv, cap, dim], 1.0),
            rng.tensor(&[rows, kv, cap, dim], 1.0),
        ];
        for dtype in DTYPES {
            check_decode("cached_attention", &inputs, dtype, &gpu, &|t| {
                let first = FirstKeys::new(first.clone(), t[0].device())?;
                let scale = (dim as f64).powf(-0.5);
                let device_counters = counters
                    .then(|| Tensor::new(&[len as u32 - 1, len as u32], t[0].device()))
                    .transpose()?;
                let at = StepPosition {
                    len: if counters { cap } else { len },
                    counters: device_counters.as_ref(),
                };
                Ok(vec![cached_attention(
                    &t[0], &t[1], &t[2], at, &first, window, scale, softcap,
                )?])
            });
        }
    }
}

/// The NF4 expansion kernel gives the CPU's values bit for bit (f32 and bf16, a shape with a
/// shorter last block and scale group, row segments of odd sizes), and QLoRA's fused LoRA op on an NF4 base equals the same
/// op on the dequantized weight.
#[test]
fn nf4_dequantization_on_the_gpu_equals_the_cpu() {
    let Some(dev) = gpu() else { return };
    use ferrotune_core::nf4::Nf4Matrix;
    let mut rng = Rng(21);
    for dtype in [DType::F32, DType::BF16] {
        let w = rng.tensor(&[192, 576], 0.1).to_dtype(dtype).unwrap();
        let cpu = Nf4Matrix::quantize(&w).unwrap();
        let on_gpu = Nf4Matrix::quantize(&w.to_device(&dev).unwrap()).unwrap();
        assert_eq!(cpu.segments()[0].codes(), on_gpu.segments()[0].codes());
        let bits = |t: Tensor| -> Vec<u32> {
            let v: Vec<f32> = t
                .to_device(&Device::Cpu)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        };
        let g = on_gpu.dequantize().unwrap();
        assert!(g.device().is_cuda());
        assert!(bits(g) == bits(cpu.dequantize().unwrap()), "{dtype:?}");
        // Row segments (a fused projection) land at their offsets.
        let split = [97, 64, 31];
        let seg_cpu = Nf4Matrix::quantize_rows(&w, &split).unwrap();
        let seg_gpu = Nf4Matrix::quantize_rows(&w.to_device(&dev).unwrap(), &split).unwrap();
        let sg = seg_gpu.dequantize().unwrap();
        assert!(
            bits(sg) == bits(seg_cpu.dequantize().unwrap()),
            "{dtype:?}: segments"
        );

        let q = std::sync::Arc::new(on_gpu);
        let dense = q.dequantize().unwrap();
        let x = rng
            .tensor(&[3, 7, 576], 1.0)
            .to_dtype(dtype)
            .unwrap()
            .to_device(&dev)
            .unwrap();
        let a = rng
            .tensor(&[8, 576], 0.2)
            .to_dtype(dtype)
            .unwrap()
            .to_device(&dev)
            .unwrap();
        let b = rng
            .tensor(&[192, 8], 0.2)
            .to_dtype(dtype)
            .unwrap()
            .to_device(&dev)
            .unwrap();
        let y4 = fused::lora_linear(&x, &q, None, &a, &b, 2.0).unwrap();
        let yd = fused::lora_linear(&x, &dense, None, &a, &b, 2.0).unwrap();
        assert!(bits(y4) == bits(yd), "{dtype:?}: fused LoRA on NF4");
    }
}
