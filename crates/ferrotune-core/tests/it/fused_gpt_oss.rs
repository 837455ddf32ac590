//! gpt-oss's fused kernels against the candle-op formulas they replace: the attention with a sink
//! logit per head (forward values and the gradients of q, k, v and the sinks, with grouped-query
//! heads, cached keys, causal, padding and sliding-window masks) and the experts' clamped SwiGLU.

use candle_core::{DType, Device, Result, Tensor, D};
use ferrotune_core::fused;
use ferrotune_core::ops;

use crate::common::Rng;
use crate::fused::{assert_close, build_mask, compare, MaskKind};

/// gpt-oss's attention as the decoder built it from candle ops before the fused kernel (and as
/// transformers' eager `GptOssAttention`): the sink's logit concatenated to each row of scores,
/// softmaxed in f32, its column dropped.
fn reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    sinks: &Tensor,
) -> Result<Tensor> {
    let (b, nh, t, hd) = q.dims4()?;
    let (_, nkv, s, _) = k.dims4()?;
    let groups = nh / nkv;
    let q = q.contiguous()?.reshape((b, nkv, groups * t, hd))?;
    let scores = (q.matmul(&k.contiguous()?.t()?)? * scale)?.to_dtype(DType::F32)?;
    let scores = match mask {
        Some(m) => scores
            .reshape((b, nkv, groups, t, s))?
            .broadcast_add(&m.to_dtype(DType::F32)?.unsqueeze(1)?)?
            .reshape((b, nkv, groups * t, s))?,
        None => scores,
    };
    let sink = sinks
        .to_dtype(DType::F32)?
        .reshape((1, nkv, groups, 1, 1))?
        .broadcast_as((b, nkv, groups, t, 1))?
        .reshape((b, nkv, groups * t, 1))?;
    let probs = ops::softmax_last_dim(&Tensor::cat(&[&scores, &sink], D::Minus1)?)?;
    probs
        .narrow(D::Minus1, 0, s)?
        .to_dtype(v.dtype())?
        .matmul(&v.contiguous()?)?
        .reshape((b, nh, t, hd))
}

/// A `[rows, 1, t, s]` mask of causal sliding windows (queries the last `t` of `s` positions; a
/// key `window` or more positions back is masked), the first `pad[r]` keys of row `r` padding.
fn sliding_mask(pad: &[usize], t: usize, s: usize, window: usize) -> Tensor {
    let mut data = Vec::new();
    for &p in pad {
        for i in 0..t {
            let qpos = s - t + i;
            for j in 0..s {
                let ok = j <= qpos && qpos - j < window && j >= p;
                data.push(if ok { 0.0 } else { f32::MIN });
            }
        }
    }
    Tensor::from_vec(data, (pad.len(), 1, t, s), &Device::Cpu).unwrap()
}

fn check(
    rng: &mut Rng,
    (b, nh, nkv, t, s, hd): (usize, usize, usize, usize, usize, usize),
    mask: Option<Tensor>,
) {
    let q = rng.tensor(&[b, nh, t, hd], 2.0);
    let k = rng.tensor(&[b, nkv, s, hd], 2.0);
    let v = rng.tensor(&[b, nkv, s, hd], 1.0);
    // Sinks of the size of the scores, so that they take a real share of each row.
    let sinks = rng.tensor(&[nh], 3.0);
    let scale = 1.0 / (hd as f64).sqrt();
    let m = mask.as_ref();
    compare(
        &format!("attention with sinks b{b} nh{nh} nkv{nkv} t{t} s{s} hd{hd}"),
        &[q, k, v, sinks],
        rng,
        |x| fused::attention_with_sinks(&x[0], &x[1], &x[2], m, scale, &x[3]),
        |x| reference(&x[0], &x[1], &x[2], m, scale, &x[3]),
    );
}

/// As [`check`], the sinks frozen (a plain tensor, as under LoRA): the gradients of q, k and v.
fn check_frozen_sinks(
    rng: &mut Rng,
    (b, nh, nkv, t, s, hd): (usize, usize, usize, usize, usize, usize),
    mask: Option<Tensor>,
) {
    let q = rng.tensor(&[b, nh, t, hd], 2.0);
    let k = rng.tensor(&[b, nkv, s, hd], 2.0);
    let v = rng.tensor(&[b, nkv, s, hd], 1.0);
    let sinks = rng.tensor(&[nh], 3.0);
    let scale = 1.0 / (hd as f64).sqrt();
    let m = mask.as_ref();
    compare(
        &format!("attention with frozen sinks b{b} nh{nh} nkv{nkv} t{t} s{s} hd{hd}"),
        &[q, k, v],
        rng,
        |x| fused::attention_with_sinks(&x[0], &x[1], &x[2], m, scale, &sinks),
        |x| reference(&x[0], &x[1], &x[2], m, scale, &sinks),
    );
}

#[test]
fn frozen_sinks_match_the_candle_ops() {
    let mut rng = Rng(47);
    check_frozen_sinks(&mut rng, (1, 6, 2, 3, 7, 16), None);
    let mask = sliding_mask(&[0, 3], 150, 150, 128);
    check_frozen_sinks(&mut rng, (2, 4, 2, 150, 150, 8), Some(mask));
}

#[test]
fn sink_attention_matches_the_candle_ops_without_mask() {
    let mut rng = Rng(41);
    check(&mut rng, (2, 3, 3, 5, 5, 8), None);
    // t ≠ s, groups of 3.
    check(&mut rng, (1, 6, 2, 3, 7, 16), None);
}

#[test]
fn sink_attention_matches_the_candle_ops_with_causal_and_padding_masks() {
    let mut rng = Rng(42);
    // Row 1 is left-padded by 3: its first 3 query rows see no key (all weight on the sink).
    let mask = build_mask(
        &[MaskKind::CausalPadded(0), MaskKind::CausalPadded(3)],
        9,
        9,
        f32::MIN,
    );
    check(&mut rng, (2, 4, 2, 9, 9, 8), Some(mask));
    // Several row blocks (64 rows each), groups of 3, odd head dim.
    let mask = build_mask(
        &[MaskKind::CausalPadded(5), MaskKind::CausalPadded(0)],
        150,
        150,
        f32::MIN,
    );
    check(&mut rng, (2, 6, 2, 150, 150, 17), Some(mask));
    // Prefill after a cache: 3 new queries after 70 cached keys, one mask for the batch.
    let mask = build_mask(&[MaskKind::CausalPadded(4)], 3, 73, f32::MIN);
    check(&mut rng, (2, 6, 2, 3, 73, 8), Some(mask));
    // Packed samples (block-diagonal).
    let mask = build_mask(&[MaskKind::Packed(vec![40, 30, 3])], 73, 73, f32::MIN);
    check(&mut rng, (1, 4, 4, 73, 73, 8), Some(mask));
}

#[test]
fn sink_attention_matches_the_candle_ops_with_sliding_windows() {
    let mut rng = Rng(43);
    // gpt-oss's window, longer than a block of rows: blocks skip the keys before their window.
    let mask = sliding_mask(&[0, 7], 300, 300, 128);
    check(&mut rng, (2, 4, 2, 300, 300, 8), Some(mask));
    // A window shorter than a block, after cached keys.
    let mask = sliding_mask(&[2], 70, 90, 5);
    check(&mut rng, (1, 4, 1, 70, 90, 8), Some(mask));
}

#[test]
fn sinks_take_weight_and_fully_masked_rows_are_zero() {
    let mut rng = Rng(44);
    let (b, nh, nkv, t, hd) = (1, 2, 1, 4, 8);
    let q = rng.tensor(&[b, nh, t, hd], 2.0);
    let k = rng.tensor(&[b, nkv, t, hd], 2.0);
    let v = rng.tensor(&[b, nkv, t, hd], 1.0);
    let mask = build_mask(&[MaskKind::CausalPadded(0)], t, t, f32::MIN);
    // A very negative sink takes no weight: plain attention.
    let none = Tensor::new(&[-1e4f32, -1e4], &Device::Cpu).unwrap();
    let out = fused::attention_with_sinks(&q, &k, &v, Some(&mask), 0.3, &none).unwrap();
    let plain = fused::attention(&q, &k, &v, Some(&mask), 0.3).unwrap();
    assert_close("sinks of -1e4", &out, &plain, 1e-6);
    // A real sink scales each row's output down by 1 − p_sink.
    let sinks = Tensor::new(&[0.5f32, 2.0], &Device::Cpu).unwrap();
    let out = fused::attention_with_sinks(&q, &k, &v, Some(&mask), 0.3, &sinks).unwrap();
    let shrunk = (&out - &plain)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(shrunk > 1e-3, "the sinks changed nothing ({shrunk})");
    // Rows that see no key (−∞ or f32::MIN) put all their weight on the sink: zeros, not NaN.
    for fill in [f32::NEG_INFINITY, f32::MIN] {
        let mask = build_mask(&[MaskKind::CausalPadded(2)], t, t, fill);
        let out = fused::attention_with_sinks(&q, &k, &v, Some(&mask), 0.3, &sinks).unwrap();
        let rows: Vec<Vec<Vec<f32>>> = out.squeeze(0).unwrap().to_vec3().unwrap();
        for head in &rows {
            assert!(head[..2].iter().flatten().all(|&x| x == 0.0), "{fill}");
            assert!(head[2..].iter().flatten().all(|x| x.is_finite()), "{fill}");
        }
    }
}

#[test]
fn sink_attention_falls_back_to_the_candle_ops_for_bf16_and_checks_shapes() {
    let mut rng = Rng(45);
    let q = rng.tensor(&[1, 4, 6, 8], 2.0);
    let k = rng.tensor(&[1, 2, 6, 8], 2.0);
    let v = rng.tensor(&[1, 2, 6, 8], 1.0);
    let sinks = rng.tensor(&[4], 2.0);
    let mask = build_mask(&[MaskKind::CausalPadded(1)], 6, 6, f32::MIN);
    let want = reference(&q, &k, &v, Some(&mask), 0.35, &sinks).unwrap();
    let bf = |x: &Tensor| x.to_dtype(DType::BF16).unwrap();
    let out =
        fused::attention_with_sinks(&bf(&q), &bf(&k), &bf(&v), Some(&mask), 0.35, &sinks).unwrap();
    assert_eq!(out.dtype(), DType::BF16);
    assert_close("bf16 attention with sinks", &out, &want, 2e-2);
    let bad = rng.tensor(&[3], 1.0);
    let err = fused::attention_with_sinks(&q, &k, &v, None, 1.0, &bad).unwrap_err();
    assert!(err.to_string().contains("sinks"), "{err}");
}

/// gpt-oss's expert activation as the decoder built it from candle ops before the fused kernel.
fn clamped_glu_reference(gate_up: &Tensor, alpha: f64, limit: f64) -> Result<Tensor> {
    let (m, two_inter) = gate_up.dims2()?;
    let gate_up = gate_up.reshape((m, two_inter / 2, 2))?;
    let gate = gate_up.narrow(2, 0, 1)?.squeeze(2)?.minimum(limit)?;
    let up = gate_up.narrow(2, 1, 1)?.squeeze(2)?.clamp(-limit, limit)?;
    let sig = ((&gate * alpha)?.neg()?.exp()? + 1.0)?.recip()?;
    let glu = (&gate * sig)?;
    (up + 1.0)? * glu
}

#[test]
fn clamped_swiglu_matches_the_candle_ops_with_its_gradient() {
    let mut rng = Rng(46);
    // Values beyond the limit on both sides, so that both clamps cut.
    for (m, inter) in [(5, 3), (37, 100), (1, 9000)] {
        let gate_up = rng.tensor(&[m, 2 * inter], 10.0);
        compare(
            &format!("clamped swiglu {m}x{inter}"),
            &[gate_up],
            &mut rng,
            |x| fused::clamped_swiglu_interleaved(&x[0], 1.702, 7.0),
            |x| clamped_glu_reference(&x[0], 1.702, 7.0),
        );
    }
    // Leading dimensions are kept; other dtypes take the composite.
    let gate_up = rng.tensor(&[2, 3, 8], 10.0);
    let out = fused::clamped_swiglu_interleaved(&gate_up, 1.702, 7.0).unwrap();
    assert_eq!(out.dims(), [2, 3, 4]);
    let want = clamped_glu_reference(&gate_up.reshape((6, 8)).unwrap(), 1.702, 7.0).unwrap();
    assert_close("3-d", &out.reshape((6, 4)).unwrap(), &want, 1e-6);
    let bf = fused::clamped_swiglu_interleaved(&gate_up.to_dtype(DType::BF16).unwrap(), 1.702, 7.0)
        .unwrap();
    assert_eq!(bf.dtype(), DType::BF16);
    assert_close("bf16", &bf.reshape((6, 4)).unwrap(), &want, 2e-2);
    let odd = rng.tensor(&[2, 5], 1.0);
    assert!(fused::clamped_swiglu_interleaved(&odd, 1.702, 7.0).is_err());
}
