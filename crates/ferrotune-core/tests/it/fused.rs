//! The fused CPU kernels against the composite candle formulas they replace: forward values and
//! every input gradient, on random inputs of awkward shapes, plus the fallback for other dtypes.

use candle_core::{DType, Device, Result, Tensor, Var, D};
use ferrotune_core::fused::{self, GatedAct};
use ferrotune_core::ops;

const TOL: f32 = 1e-5;

use crate::common;
use common::Rng;

/// `max |a − b| / max |b|`.
fn rel(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let a = a.to_dtype(DType::F32).unwrap();
    let b = b.to_dtype(DType::F32).unwrap();
    let diff = (&a - &b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let scale = b
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(diff.is_finite(), "non-finite difference");
    diff / scale.max(f32::MIN_POSITIVE)
}

pub(crate) fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f32) {
    let r = rel(got, want);
    assert!(r <= tol, "{what}: relative difference {r} > {tol}");
}

/// Runs `f` on fresh variables made from `inputs`, backpropagates `Σ out · probe`, and returns the
/// output with the gradient of each input (`None` where it has none).
fn run_with_grads(
    inputs: &[Tensor],
    probe: &Tensor,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> (Tensor, Vec<Option<Tensor>>) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&ts).unwrap();
    let loss = (out.to_dtype(DType::F32).unwrap() * probe)
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    let g = vars.iter().map(|v| grads.get(v).cloned()).collect();
    (out.detach(), g)
}

/// Compares a fused op with its composite reference on the same inputs, output and gradients.
pub(crate) fn compare(
    what: &str,
    inputs: &[Tensor],
    rng: &mut Rng,
    fused_fn: impl Fn(&[Tensor]) -> Result<Tensor>,
    reference: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    let want_out = reference(inputs).unwrap();
    let probe = rng.tensor(want_out.dims(), 1.0);
    let (out, grads) = run_with_grads(inputs, &probe, fused_fn);
    let (want, want_grads) = run_with_grads(inputs, &probe, reference);
    assert_close(&format!("{what} forward"), &out, &want, TOL);
    for (i, (g, w)) in grads.iter().zip(&want_grads).enumerate() {
        match (g, w) {
            (Some(g), Some(w)) => assert_close(&format!("{what} grad of input {i}"), g, w, TOL),
            (g, w) => panic!(
                "{what}: input {i} has a gradient: fused {}, reference {}",
                g.is_some(),
                w.is_some()
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------------------------

/// The textbook formula: K/V repeated per group, `softmax(q kᵀ·scale + mask) v`.
fn attention_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    softcapped_attention_reference(q, k, v, mask, scale, None)
}

/// [`attention_reference`] with transformers' Gemma 2 softcap (`cap · tanh(s / cap)` on the scaled
/// scores, before the mask), written out with candle's own tanh and autograd.
fn softcapped_attention_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    softcap: Option<f64>,
) -> Result<Tensor> {
    let (b, nh, _, hd) = q.dims4()?;
    let (_, nkv, s, _) = k.dims4()?;
    let groups = nh / nkv;
    let repeat = |x: &Tensor| -> Result<Tensor> {
        x.unsqueeze(2)?
            .broadcast_as((b, nkv, groups, s, hd))?
            .reshape((b, nh, s, hd))
    };
    let (k, v) = (repeat(k)?, repeat(v)?);
    let mut scores = (q.matmul(&k.t()?)? * scale)?;
    if let Some(cap) = softcap {
        scores = ((scores / cap)?.tanh()? * cap)?;
    }
    if let Some(m) = mask {
        scores = scores.broadcast_add(&m.to_dtype(scores.dtype())?)?;
    }
    ops::softmax_last_dim(&scores)?.matmul(&v)
}

/// How a batch row of the mask is built.
pub(crate) enum MaskKind {
    /// Causal, the first `pad` keys (and query rows) are padding (left-padded batch).
    CausalPadded(usize),
    /// Causal within consecutive packed samples of the given lengths.
    Packed(Vec<usize>),
    /// Every key visible except the given ones.
    Keys(Vec<usize>),
}

/// Additive `[rows.len(), 1, t, s]` mask (queries are the last `t` of `s` positions) with `fill`
/// at masked places.
pub(crate) fn build_mask(rows: &[MaskKind], t: usize, s: usize, fill: f32) -> Tensor {
    let past = s - t;
    let mut data = Vec::new();
    for kind in rows {
        for i in 0..t {
            let qpos = past + i;
            for j in 0..s {
                let ok = match kind {
                    MaskKind::CausalPadded(pad) => j <= qpos && j >= *pad,
                    MaskKind::Packed(lens) => {
                        let seg = |p: usize| {
                            let mut acc = 0;
                            lens.iter()
                                .position(|l| {
                                    acc += l;
                                    p < acc
                                })
                                .unwrap_or(lens.len())
                        };
                        j <= qpos && seg(j) == seg(qpos)
                    }
                    MaskKind::Keys(hidden) => !hidden.contains(&j),
                };
                data.push(if ok { 0.0 } else { fill });
            }
        }
    }
    Tensor::from_vec(data, (rows.len(), 1, t, s), &Device::Cpu).unwrap()
}

fn check_attention(
    rng: &mut Rng,
    (b, nh, nkv, t, s, hd): (usize, usize, usize, usize, usize, usize),
    mask: Option<Tensor>,
) {
    let q = rng.tensor(&[b, nh, t, hd], 2.0);
    let k = rng.tensor(&[b, nkv, s, hd], 2.0);
    let v = rng.tensor(&[b, nkv, s, hd], 1.0);
    let scale = 1.0 / (hd as f64).sqrt();
    let what = format!("attention b{b} nh{nh} nkv{nkv} t{t} s{s} hd{hd}");
    let m = mask.as_ref();
    compare(
        &what,
        &[q, k, v],
        rng,
        |x| fused::attention(&x[0], &x[1], &x[2], m, scale),
        |x| attention_reference(&x[0], &x[1], &x[2], m, scale),
    );
}

#[test]
fn attention_matches_the_composite_without_mask() {
    let mut rng = Rng(1);
    check_attention(&mut rng, (2, 3, 3, 5, 5, 8), None);
    check_attention(&mut rng, (1, 6, 2, 3, 7, 16), None);
}

#[test]
fn attention_matches_the_composite_with_causal_and_padding_masks() {
    let mut rng = Rng(2);
    // Row 1 is left-padded by 3: its first 3 query rows see no key at all (uniform weights).
    let mask = build_mask(
        &[MaskKind::CausalPadded(0), MaskKind::CausalPadded(3)],
        9,
        9,
        f32::MIN,
    );
    check_attention(&mut rng, (2, 3, 1, 9, 9, 8), Some(mask.clone()));
    check_attention(&mut rng, (2, 3, 3, 9, 9, 12), Some(mask));
    // Several row blocks (block = 64 rows), GQA groups of 3, odd head dim.
    let mask = build_mask(
        &[MaskKind::CausalPadded(5), MaskKind::CausalPadded(0)],
        150,
        150,
        f32::MIN,
    );
    check_attention(&mut rng, (2, 6, 2, 150, 150, 17), Some(mask));
    // Decode-like: 3 new queries after 70 cached keys, padding at the front.
    let mask = build_mask(&[MaskKind::CausalPadded(4)], 3, 73, f32::MIN);
    check_attention(&mut rng, (1, 6, 2, 3, 73, 8), Some(mask));
}

#[test]
fn attention_matches_the_composite_with_a_packed_block_diagonal_mask() {
    let mut rng = Rng(3);
    let mask = build_mask(
        &[
            MaskKind::Packed(vec![40, 30, 60, 3]),
            MaskKind::Packed(vec![100, 33]),
        ],
        133,
        133,
        f32::MIN,
    );
    check_attention(&mut rng, (2, 3, 1, 133, 133, 8), Some(mask.clone()));
    check_attention(&mut rng, (2, 3, 3, 133, 133, 8), Some(mask));
    // One mask broadcast over the batch, with holes in the middle of the key range.
    let mask = build_mask(&[MaskKind::Keys(vec![0, 2, 9, 10])], 7, 11, f32::MIN);
    check_attention(&mut rng, (3, 4, 2, 7, 11, 8), Some(mask));
}

#[test]
fn softcapped_attention_matches_the_composite_with_its_gradients() {
    let mut rng = Rng(41);
    // Scores of std ~4 against a cap of 2: most of them sit where tanh bends.
    for (shape, mask) in [
        (
            (2, 4, 2, 9, 9, 8),
            Some(build_mask(
                &[MaskKind::CausalPadded(0), MaskKind::CausalPadded(3)],
                9,
                9,
                f32::MIN,
            )),
        ),
        (
            (1, 2, 1, 70, 70, 16),
            Some(build_mask(
                &[MaskKind::Packed(vec![30, 40])],
                70,
                70,
                f32::MIN,
            )),
        ),
        ((2, 2, 2, 3, 7, 8), None),
    ] {
        let (b, nh, nkv, t, s, hd) = shape;
        let q = rng.tensor(&[b, nh, t, hd], 2.0);
        let k = rng.tensor(&[b, nkv, s, hd], 2.0);
        let v = rng.tensor(&[b, nkv, s, hd], 1.0);
        let m = mask.as_ref();
        let scale = 0.5;
        compare(
            &format!("softcapped attention {shape:?}"),
            &[q.clone(), k.clone(), v.clone()],
            &mut rng,
            |x| fused::attention_softcapped(&x[0], &x[1], &x[2], m, scale, Some(2.0)),
            |x| softcapped_attention_reference(&x[0], &x[1], &x[2], m, scale, Some(2.0)),
        );
        // The cap changes the result: a softcap the op ignored would fail here.
        let capped = fused::attention_softcapped(&q, &k, &v, m, scale, Some(2.0)).unwrap();
        let plain = fused::attention(&q, &k, &v, m, scale).unwrap();
        assert!(
            rel(&capped, &plain) > 1e-2,
            "the softcap made no difference"
        );
    }
    let q = rng.tensor(&[1, 1, 2, 4], 1.0);
    assert!(fused::attention_softcapped(&q, &q, &q, None, 1.0, Some(0.0)).is_err());
}

#[test]
fn attention_rows_masked_with_negative_infinity_are_zero_not_nan() {
    let mut rng = Rng(4);
    let mask = build_mask(&[MaskKind::CausalPadded(2)], 4, 4, f32::NEG_INFINITY);
    let q = Var::from_tensor(&rng.tensor(&[1, 2, 4, 8], 1.0)).unwrap();
    let k = Var::from_tensor(&rng.tensor(&[1, 1, 4, 8], 1.0)).unwrap();
    let v = Var::from_tensor(&rng.tensor(&[1, 1, 4, 8], 1.0)).unwrap();
    let out = fused::attention(&q, &k, &v, Some(&mask), 0.3).unwrap();
    let vals: Vec<f32> = out.flatten_all().unwrap().to_vec1().unwrap();
    assert!(vals.iter().all(|x| x.is_finite()));
    // Query rows 0 and 1 see no key: zeros; row 2 sees key 2 only: exactly v[2].
    let head0 = out.get(0).unwrap().get(0).unwrap();
    assert_eq!(
        head0
            .get(0)
            .unwrap()
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap(),
        0.0
    );
    assert_close(
        "row seeing one key",
        &head0.get(2).unwrap(),
        &v.get(0).unwrap().get(0).unwrap().get(2).unwrap(),
        1e-6,
    );
    let grads = out.sum_all().unwrap().backward().unwrap();
    for var in [&q, &k, &v] {
        let g: Vec<f32> = grads
            .get(var)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(g.iter().all(|x| x.is_finite()));
    }
}

#[test]
fn attention_rejects_inconsistent_shapes() {
    let mut rng = Rng(5);
    let q = rng.tensor(&[1, 4, 3, 8], 1.0);
    let k = rng.tensor(&[1, 3, 3, 8], 1.0);
    let err = fused::attention(&q, &k, &k, None, 1.0).unwrap_err();
    assert!(err.to_string().contains("not a multiple"), "{err}");
    let k = rng.tensor(&[1, 2, 3, 8], 1.0);
    let bad_mask = rng.tensor(&[1, 1, 3, 4], 1.0);
    let err = fused::attention(&q, &k, &k, Some(&bad_mask), 1.0).unwrap_err();
    assert!(err.to_string().contains("mask"), "{err}");
}

#[test]
fn mask_layout_finds_each_rows_interval_of_keys() {
    // Two batch rows of 3 queries over 4 keys: causal, batch row 1 with its first key padding,
    // so its query 0 sees nothing.
    let allowed: Vec<bool> = [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [0, 0, 0, 0],
        [0, 1, 0, 0],
        [0, 1, 1, 0],
    ]
    .concat()
    .iter()
    .map(|&a| a == 1)
    .collect();
    let masked = ops::additive_mask_min(DType::BF16);
    assert_eq!(masked, half::bf16::MIN.to_f32());
    let layout = fused::MaskLayout::from_allowed(&allowed, 3, 4, masked);
    assert_eq!(layout.rows, [(0, 4), (0, 2), (0, 3)]);
    let want = [(0, 1), (0, 2), (0, 3), (0, 0), (1, 2), (1, 3)];
    assert_eq!(layout.intervals.as_deref(), Some(&want[..]));
    // Read back from the mask's values, as the GPU path does for a mask nobody registered.
    let mask = ops::additive_mask(&allowed, (2, 1, 3, 4), DType::BF16, &Device::Cpu).unwrap();
    let values: Vec<f32> = mask
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(fused::MaskLayout::from_values(&values, 3, 4), layout);
}

#[test]
fn mask_layout_keeps_no_intervals_for_masks_they_would_not_reproduce() {
    let min = f32::MIN;
    let causal = [0.0, min, min, 0.0, 0.0, min];
    let layout = fused::MaskLayout::from_values(&causal, 2, 3);
    assert_eq!(layout.intervals.as_deref(), Some(&[(0, 1), (0, 2)][..]));
    assert_eq!(layout.masked, min);
    // A gap in a row's visible keys: the union of keys stays, the intervals go.
    let gap = [0.0, min, 0.0, 0.0, 0.0, min];
    let layout = fused::MaskLayout::from_values(&gap, 2, 3);
    assert_eq!(layout.rows, [(0, 3), (0, 2)]);
    assert_eq!(layout.intervals, None);
    // A visible key with a bias that is not 0, and two different masked values.
    for odd in [
        [0.0, min, min, -2.0, 0.0, min],
        [0.0, min, min, 0.0, 0.0, f32::NEG_INFINITY],
    ] {
        assert_eq!(fused::MaskLayout::from_values(&odd, 2, 3).intervals, None);
    }
    // −∞ throughout is kept (its rows with no key get zeros either way).
    let inf = f32::NEG_INFINITY;
    let layout = fused::MaskLayout::from_allowed(&[true, false, false, false], 2, 2, inf);
    assert_eq!(layout.rows, [(0, 1), (0, 2)]);
    assert_eq!(layout.intervals.as_deref(), Some(&[(0, 1), (0, 0)][..]));
    assert_eq!(
        fused::MaskLayout::from_values(&[0.0, inf, inf, inf], 2, 2),
        layout
    );
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy
// ---------------------------------------------------------------------------------------------

/// `Σ -log_softmax(x)[target]` over kept rows, from candle ops.
fn cross_entropy_reference(logits: &Tensor, targets: &[i64], ignore: i64) -> Result<Tensor> {
    let x = logits.to_dtype(DType::F32)?;
    let m = x.max_keepdim(D::Minus1)?;
    let z = x.broadcast_sub(&m)?;
    let logp = z.broadcast_sub(&z.exp()?.sum_keepdim(D::Minus1)?.log()?)?;
    let mut total = Tensor::zeros((), DType::F32, &Device::Cpu)?;
    for (i, &t) in targets.iter().enumerate() {
        if t != ignore {
            total = (total - logp.get(i)?.get(t as usize)?)?;
        }
    }
    Ok(total)
}

#[test]
fn cross_entropy_matches_the_composite() {
    let mut rng = Rng(6);
    for &(n, vocab, amp) in &[(7usize, 13usize, 3.0f32), (33, 1000, 8.0), (5, 4099, 20.0)] {
        let logits = rng.tensor(&[n, vocab], amp);
        let targets: Vec<i64> = (0..n)
            .map(|i| {
                if i % 4 == 1 {
                    -100
                } else {
                    (rng.uniform() * vocab as f32) as i64
                }
            })
            .collect();
        let kept = targets.iter().filter(|&&t| t != -100).count();
        let var = Var::from_tensor(&logits).unwrap();
        let (sum, count) = fused::cross_entropy_sum(&var, &targets, -100).unwrap();
        assert_eq!(count, kept);
        assert_eq!(sum.dims(), &[] as &[usize]);
        let rvar = Var::from_tensor(&logits).unwrap();
        let want = cross_entropy_reference(&rvar, &targets, -100).unwrap();
        assert_close("cross-entropy sum", &sum, &want, TOL);
        // A scaled loss, as after dividing by the token count.
        let g = (sum * 0.37).unwrap().backward().unwrap();
        let rg = (want * 0.37).unwrap().backward().unwrap();
        let (g, rg) = (g.get(&var).unwrap(), rg.get(&rvar).unwrap());
        assert_close("cross-entropy gradient", g, rg, TOL);
        // Ignored rows get exactly no gradient.
        let row: Vec<f32> = g.get(1).unwrap().to_vec1().unwrap();
        assert!(row.iter().all(|&x| x == 0.0));
    }
}

#[test]
fn cross_entropy_rejects_bad_targets() {
    let logits = Rng(7).tensor(&[2, 5], 1.0);
    let err = fused::cross_entropy_sum(&logits, &[1, 5], -100).unwrap_err();
    assert!(err.to_string().contains("target 5 outside"), "{err}");
    let err = fused::cross_entropy_sum(&logits, &[-3, 0], -100).unwrap_err();
    assert!(err.to_string().contains("target -3 outside"), "{err}");
    let err = fused::cross_entropy_sum(&logits, &[0], -100).unwrap_err();
    assert!(err.to_string().contains("1 targets for 2 rows"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// RMSNorm, RoPE, gated activation
// ---------------------------------------------------------------------------------------------

#[test]
fn rms_norm_matches_the_composite() {
    let mut rng = Rng(8);
    for shape in [vec![2usize, 3, 17], vec![37, 576], vec![1, 1, 5]] {
        for offset_one in [false, true] {
            let h = *shape.last().unwrap();
            let x = rng.tensor(&shape, 3.0);
            let w = (rng.tensor(&[h], 0.5) + 1.0).unwrap();
            compare(
                &format!("rms_norm {shape:?} offset_one={offset_one}"),
                &[x, w],
                &mut rng,
                |t| fused::rms_norm(&t[0], &t[1], 1e-6, offset_one),
                |t| ops::rms_norm(&t[0], &t[1], 1e-6, offset_one),
            );
        }
    }
}

#[test]
fn rms_norm_with_a_frozen_weight_gives_only_the_input_gradient() {
    let mut rng = Rng(9);
    let x = Var::from_tensor(&rng.tensor(&[4, 24], 2.0)).unwrap();
    let w = rng.tensor(&[24], 1.0);
    let probe = rng.tensor(&[4, 24], 1.0);
    let loss = |y: Tensor| (y * &probe).unwrap().sum_all().unwrap();
    let g = loss(fused::rms_norm(&x, &w, 1e-5, false).unwrap())
        .backward()
        .unwrap();
    let rg = loss(ops::rms_norm(&x, &w, 1e-5, false).unwrap())
        .backward()
        .unwrap();
    assert_close("dx", g.get(&x).unwrap(), rg.get(&x).unwrap(), TOL);
    assert!(g.get(&w).is_none());
}

#[test]
fn rope_matches_the_composite_including_partial_rotary() {
    let mut rng = Rng(10);
    // (x shape, rotary dim, cos batch)
    let cases = [
        ([2usize, 3, 5, 8], 8usize, 2usize),
        ([2, 2, 7, 12], 8, 2),
        ([3, 4, 6, 64], 64, 1),
        ([1, 3, 9, 96], 32, 1),
    ];
    for (shape, rot, cb) in cases {
        let x = rng.tensor(&shape, 2.0);
        let cos = rng.tensor(&[cb, 1, shape[2], rot], 1.0);
        let sin = rng.tensor(&[cb, 1, shape[2], rot], 1.0);
        let what = format!("rope {shape:?} rot {rot}");
        let (c, s) = (&cos, &sin);
        compare(
            &what,
            &[x],
            &mut rng,
            |t| fused::rope(&t[0], c, s),
            |t| ops::apply_rope(&t[0], c, s),
        );
    }
}

#[test]
fn rope_rejects_bad_tables() {
    let mut rng = Rng(11);
    let x = rng.tensor(&[1, 2, 3, 8], 1.0);
    let odd = rng.tensor(&[1, 1, 3, 5], 1.0);
    assert!(fused::rope(&x, &odd, &odd).is_err());
    let short = rng.tensor(&[1, 1, 2, 8], 1.0);
    assert!(fused::rope(&x, &short, &short).is_err());
}

#[test]
fn swiglu_matches_the_composite_for_every_activation() {
    let mut rng = Rng(12);
    for act in [GatedAct::Silu, GatedAct::GeluTanh, GatedAct::GeluErf] {
        for shape in [vec![3usize, 37], vec![2, 5, 1536]] {
            let gate = rng.tensor(&shape, 6.0);
            let up = rng.tensor(&shape, 2.0);
            compare(
                &format!("swiglu {act:?} {shape:?}"),
                &[gate, up],
                &mut rng,
                |t| fused::swiglu(&t[0], &t[1], act),
                |t| {
                    let a = match act {
                        GatedAct::Silu => t[0].silu()?,
                        GatedAct::GeluTanh => t[0].gelu()?,
                        GatedAct::GeluErf => t[0].gelu_erf()?,
                    };
                    a * &t[1]
                },
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Fallback for other dtypes
// ---------------------------------------------------------------------------------------------

#[test]
fn non_f32_inputs_use_the_composite_path() {
    let mut rng = Rng(13);
    let bf = |t: Tensor| t.to_dtype(DType::BF16).unwrap();
    let same = |what: &str, a: &Tensor, b: &Tensor| {
        assert_eq!(a.dtype(), DType::BF16, "{what}");
        assert_eq!(rel(a, b), 0.0, "{what}: differs from the composite");
    };

    let x = bf(rng.tensor(&[3, 16], 2.0));
    let w = bf(rng.tensor(&[16], 1.0));
    for offset_one in [false, true] {
        same(
            "rms_norm",
            &fused::rms_norm(&x, &w, 1e-6, offset_one).unwrap(),
            &ops::rms_norm(&x, &w, 1e-6, offset_one).unwrap(),
        );
    }

    let xr = bf(rng.tensor(&[1, 2, 3, 8], 2.0));
    let cos = bf(rng.tensor(&[1, 1, 3, 8], 1.0));
    let sin = bf(rng.tensor(&[1, 1, 3, 8], 1.0));
    same(
        "rope",
        &fused::rope(&xr, &cos, &sin).unwrap(),
        &ops::apply_rope(&xr, &cos, &sin).unwrap(),
    );

    let up = bf(rng.tensor(&[3, 16], 2.0));
    same(
        "swiglu",
        &fused::swiglu(&x, &up, GatedAct::Silu).unwrap(),
        &(x.silu().unwrap() * &up).unwrap(),
    );

    let logits = bf(rng.tensor(&[4, 50], 3.0));
    let targets = [3i64, -100, 49, 0];
    let (sum, count) = fused::cross_entropy_sum(&logits, &targets, -100).unwrap();
    assert_eq!((sum.dtype(), count), (DType::F32, 3));
    assert_close(
        "bf16 cross-entropy",
        &sum,
        &cross_entropy_reference(&logits, &targets, -100).unwrap(),
        1e-6,
    );

    // Attention in bf16: the composite's roundings, so compare loosely with the f32 reference.
    let q = rng.tensor(&[2, 4, 6, 8], 1.0);
    let k = rng.tensor(&[2, 2, 6, 8], 1.0);
    let v = rng.tensor(&[2, 2, 6, 8], 1.0);
    let mask = build_mask(
        &[MaskKind::CausalPadded(0), MaskKind::CausalPadded(2)],
        6,
        6,
        f32::MIN,
    );
    let qv = Var::from_tensor(&bf(q.clone())).unwrap();
    let out = fused::attention(
        &qv,
        &bf(k.clone()),
        &bf(v.clone()),
        Some(&bf(mask.clone())),
        0.35,
    )
    .unwrap();
    assert_eq!(out.dtype(), DType::BF16);
    let want = attention_reference(&q, &k, &v, Some(&mask), 0.35).unwrap();
    assert_close("bf16 attention", &out, &want, 2e-2);
    let g = out.sum_all().unwrap().backward().unwrap();
    assert_eq!(g.get(&qv).unwrap().dtype(), DType::BF16);
}

#[test]
fn strided_inputs_are_handled_and_get_their_gradients() {
    let mut rng = Rng(14);
    // gate/up as halves of one fused projection output, as the Phi-3 MLP produces them.
    let gate_up = rng.tensor(&[2, 3, 2 * 24], 3.0);
    compare(
        "swiglu on narrowed halves",
        &[gate_up],
        &mut rng,
        |t| {
            let (g, u) = (t[0].narrow(2, 0, 24)?, t[0].narrow(2, 24, 24)?);
            fused::swiglu(&g, &u, GatedAct::Silu)
        },
        |t| t[0].narrow(2, 0, 24)?.silu()? * t[0].narrow(2, 24, 24)?,
    );
    // q/k/v in `[b, t, heads, hd]` order, transposed (not copied) into place.
    let mask = build_mask(&[MaskKind::CausalPadded(1)], 6, 6, f32::MIN);
    let m = &mask;
    compare(
        "attention on transposed inputs",
        &[
            rng.tensor(&[1, 6, 4, 8], 1.0),
            rng.tensor(&[1, 6, 2, 8], 1.0),
            rng.tensor(&[1, 6, 2, 8], 1.0),
        ],
        &mut rng,
        |x| {
            let [q, k, v] = [0, 1, 2].map(|i| x[i].transpose(1, 2).unwrap());
            fused::attention(&q, &k, &v, Some(m), 0.4)
        },
        |x| {
            let [q, k, v] = [0, 1, 2].map(|i| x[i].transpose(1, 2).unwrap());
            attention_reference(&q, &k, &v, Some(m), 0.4)
        },
    );
}

#[test]
fn linear_cross_entropy_matches_logits_then_cross_entropy() {
    use candle_core::{Device, Tensor, Var};
    use ferrotune_core::fused::{cross_entropy_sum, linear_cross_entropy_sum};
    let dev = Device::Cpu;
    // 300 rows: more than two chunks; a third of them ignored.
    let (n, h, vocab) = (300usize, 24usize, 1001usize);
    let hidden = Tensor::randn(0f32, 1.0, (n, h), &dev).unwrap();
    let weight = Tensor::randn(0f32, 0.5, (vocab, h), &dev).unwrap();
    let targets: Vec<i64> = (0..n)
        .map(|i| {
            if i % 3 == 1 {
                -100
            } else {
                ((i * 37) % vocab) as i64
            }
        })
        .collect();
    let x1 = Var::from_tensor(&hidden).unwrap();
    let (s1, c1) = linear_cross_entropy_sum(x1.as_tensor(), &weight, &targets, -100).unwrap();
    let g1 = s1.backward().unwrap();
    let x2 = Var::from_tensor(&hidden).unwrap();
    let logits = x2.as_tensor().matmul(&weight.t().unwrap()).unwrap();
    let (s2, c2) = cross_entropy_sum(&logits, &targets, -100).unwrap();
    let g2 = s2.backward().unwrap();
    assert_eq!(c1, c2);
    let (v1, v2) = (
        s1.to_scalar::<f32>().unwrap(),
        s2.to_scalar::<f32>().unwrap(),
    );
    assert!((v1 - v2).abs() / v2.abs() < 1e-5, "sum {v1} vs {v2}");
    let (d1, d2) = (
        g1.get(x1.as_tensor()).unwrap(),
        g2.get(x2.as_tensor()).unwrap(),
    );
    let diff = (d1 - d2)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let scale = d2
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(
        diff / scale < 1e-5,
        "gradient differs: {diff} (scale {scale})"
    );
    // Ignored rows get no gradient at all.
    let row1 = d1.get(1).unwrap().abs().unwrap().max_all().unwrap();
    assert_eq!(row1.to_scalar::<f32>().unwrap(), 0.0);
}

#[test]
fn lora_linear_matches_the_composite_adapter_branch() {
    use candle_core::{Device, Tensor, Var};
    use ferrotune_core::fused::lora_linear;
    let dev = Device::Cpu;
    for (m, inp, out, r, bias) in [
        (37usize, 24usize, 40usize, 4usize, false),
        (130, 64, 48, 8, true),
        // Few rows (a distillation chunk, a decode step): the products' inner size is tiny.
        (1, 64, 512, 4, false),
        (5, 64, 512, 4, false),
    ] {
        let x0 = Tensor::randn(0f32, 1.0, (m, inp), &dev).unwrap();
        let w = Tensor::randn(0f32, 0.2, (out, inp), &dev).unwrap();
        let b0 = bias.then(|| Tensor::randn(0f32, 0.2, out, &dev).unwrap());
        let a0 = Tensor::randn(0f32, 0.2, (r, inp), &dev).unwrap();
        let bb0 = Tensor::randn(0f32, 0.2, (out, r), &dev).unwrap();
        let probe = Tensor::randn(0f32, 1.0, (m, out), &dev).unwrap();
        let run = |fused: bool| {
            let (x, a, b) = (
                Var::from_tensor(&x0).unwrap(),
                Var::from_tensor(&a0).unwrap(),
                Var::from_tensor(&bb0).unwrap(),
            );
            let y = if fused {
                lora_linear(
                    x.as_tensor(),
                    &w,
                    b0.as_ref(),
                    a.as_tensor(),
                    b.as_tensor(),
                    1.75,
                )
                .unwrap()
            } else {
                let base = x.as_tensor().matmul(&w.t().unwrap()).unwrap();
                let base = match &b0 {
                    Some(bias) => base.broadcast_add(bias).unwrap(),
                    None => base,
                };
                let l = x
                    .as_tensor()
                    .matmul(&a.as_tensor().t().unwrap())
                    .unwrap()
                    .matmul(&b.as_tensor().t().unwrap())
                    .unwrap();
                (base + (l * 1.75).unwrap()).unwrap()
            };
            let g = (&y * &probe)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let grads: Vec<Tensor> = [&x, &a, &b]
                .iter()
                .map(|v| g.get(v.as_tensor()).unwrap().clone())
                .collect();
            (y, grads)
        };
        let (yf, gf) = run(true);
        let (yc, gc) = run(false);
        let rel = |p: &Tensor, q: &Tensor| {
            let d = (p - q)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            d / q
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        assert!(rel(&yf, &yc) < 1e-5, "forward");
        for (i, (p, q)) in gf.iter().zip(&gc).enumerate() {
            assert!(rel(p, q) < 1e-5, "gradient {i} differs: {}", rel(p, q));
        }
    }
}

#[test]
fn trainable_linear_matches_candle_matmul_with_both_gradients() {
    let mut rng = Rng(0x7261_696e);
    for (m, inp, out) in [(1, 1, 1), (7, 13, 5), (64, 96, 160), (130, 33, 257)] {
        let x = rng.tensor(&[m, inp], 1.0);
        let w = rng.tensor(&[out, inp], 0.5);
        compare(
            &format!("trainable_linear {m}x{inp}x{out}"),
            &[x, w],
            &mut rng,
            |t| fused::trainable_linear(&t[0], &t[1]),
            |t| t[0].matmul(&t[1].t()?),
        );
    }
    // Through `ops::linear` with a bias and leading batch dimensions, as the decoder calls it.
    let x = rng.tensor(&[2, 5, 12], 1.0);
    let w = rng.tensor(&[9, 12], 0.5);
    let b = rng.tensor(&[9], 0.5);
    compare(
        "ops::linear with a trainable weight",
        &[x, w, b],
        &mut rng,
        |t| ops::linear(&t[0], &t[1], Some(&t[2])),
        |t| t[0].broadcast_matmul(&t[1].t()?)?.broadcast_add(&t[2]),
    );
}

#[test]
fn linear_cross_entropy_with_a_trained_head_gives_both_gradients() {
    use ferrotune_core::fused::{cross_entropy_sum, linear_cross_entropy_sum};
    let mut rng = Rng(0x6865_6164);
    // 1100 rows: three chunks, the last partial; every fourth row ignored, and a whole chunk's
    // worth of ignored rows at the start (prompt tokens).
    let (n, h, vocab) = (1100usize, 20usize, 301usize);
    let targets: Vec<i64> = (0..n)
        .map(|i| {
            if i < 520 && i % 2 == 0 || i % 4 == 1 {
                -100
            } else {
                ((i * 37) % vocab) as i64
            }
        })
        .collect();
    let hidden = rng.tensor(&[n, h], 1.0);
    let weight = rng.tensor(&[vocab, h], 0.5);
    // Scaled loss (as the recipe's normalisation would) so that the backward scale is exercised.
    let run = |fused: bool| {
        let x = Var::from_tensor(&hidden).unwrap();
        let w = Var::from_tensor(&weight).unwrap();
        let (sum, count) = if fused {
            linear_cross_entropy_sum(x.as_tensor(), w.as_tensor(), &targets, -100).unwrap()
        } else {
            let logits = x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
            cross_entropy_sum(&logits, &targets, -100).unwrap()
        };
        let loss = (sum.clone() * 0.37).unwrap();
        let g = loss.backward().unwrap();
        (
            sum,
            count,
            g.get(x.as_tensor()).unwrap().clone(),
            g.get(w.as_tensor()).unwrap().clone(),
        )
    };
    let (s1, c1, dx1, dw1) = run(true);
    let (s2, c2, dx2, dw2) = run(false);
    assert_eq!(c1, c2);
    assert_close("trained head loss", &s1, &s2, TOL);
    assert_close("trained head d hidden", &dx1, &dx2, TOL);
    assert_close("trained head d weight", &dw1, &dw2, TOL);
}

/// Distillation's soft-target cross-entropy `−Σ softmax(t) · log_softmax(s)`: the fused op's value
/// and student gradient equal the composite formula's; an infinite student logit sends the caller
/// to the composite form (which masks those terms, as torchtune does).
#[test]
fn soft_cross_entropy_matches_the_composite_formula() {
    let mut rng = Rng(41);
    let s0 = (rng.tensor(&[7, 301], 1.0) * 4.0).unwrap();
    let t = (rng.tensor(&[7, 301], 1.0) * 3.0).unwrap();
    let probe = 0.7f64;
    let log_softmax = |x: &Tensor| -> Tensor {
        let m = x.max_keepdim(D::Minus1).unwrap().detach();
        let z = x.broadcast_sub(&m).unwrap();
        let lse = z
            .exp()
            .unwrap()
            .sum_keepdim(D::Minus1)
            .unwrap()
            .log()
            .unwrap();
        z.broadcast_sub(&lse).unwrap()
    };
    assert!(fused::soft_cross_entropy_applies(&s0, &t).unwrap());
    let s = Var::from_tensor(&s0).unwrap();
    let fused_loss = fused::soft_cross_entropy_sum(s.as_tensor(), &t).unwrap();
    let g_fused = (&fused_loss * probe).unwrap().backward().unwrap();
    let s2 = Var::from_tensor(&s0).unwrap();
    let composite = (log_softmax(&t).exp().unwrap() * log_softmax(s2.as_tensor()))
        .unwrap()
        .sum_all()
        .unwrap()
        .neg()
        .unwrap();
    let g_comp = (&composite * probe).unwrap().backward().unwrap();
    assert_close("value", &fused_loss, &composite, TOL);
    assert_close(
        "student gradient",
        g_fused.get(s.as_tensor()).unwrap(),
        g_comp.get(s2.as_tensor()).unwrap(),
        TOL,
    );
    let mut with_inf = s0.to_vec2::<f32>().unwrap();
    with_inf[2][5] = f32::NEG_INFINITY;
    let with_inf = Tensor::new(with_inf, &Device::Cpu).unwrap();
    assert!(!fused::soft_cross_entropy_applies(&with_inf, &t).unwrap());
    assert!(!fused::soft_cross_entropy_applies(&s0.to_dtype(DType::BF16).unwrap(), &t).unwrap());
}
