//! Cross-entropy against `F.cross_entropy(..., ignore_index=-100)`: values and gradients.

use crate::common;

use candle_core::{DType, Device, Tensor, Var};
use common::{assert_close, load, train_fixture};
use ferrotune_train::{causal_lm_loss, causal_lm_loss_mean};

fn scalar(t: &Tensor) -> f32 {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()[0]
}

#[test]
fn shifted_loss_sum_mean_and_grads_match_torch() {
    let fx = load(train_fixture("loss.safetensors"));
    let logits = Var::from_tensor(&fx["logits"]).unwrap();
    let labels = &fx["labels"];

    let out = causal_lm_loss(logits.as_tensor(), labels, true).unwrap();
    assert_eq!(out.count as f32, scalar(&fx["shift_count"]));
    assert_close(
        "shift sum",
        &out.sum.reshape(1).unwrap(),
        &fx["shift_sum"],
        1e-6,
        1e-5,
    );
    let grads = out.sum.backward().unwrap();
    let g = grads.get(logits.as_tensor()).unwrap();
    assert_close("shift grad (sum)", g, &fx["shift_grad_sum"], 1e-5, 1e-7);

    let mean = out.mean().unwrap();
    assert_close(
        "shift mean",
        &mean.reshape(1).unwrap(),
        &fx["shift_mean"],
        1e-6,
        1e-6,
    );
    let grads = mean.backward().unwrap();
    let g = grads.get(logits.as_tensor()).unwrap();
    assert_close("shift grad (mean)", g, &fx["shift_grad_mean"], 1e-5, 1e-8);

    // The convenience wrapper is the same computation.
    let m2 = causal_lm_loss_mean(logits.as_tensor(), labels, true).unwrap();
    assert_eq!(scalar(&m2), scalar(&mean));
}

#[test]
fn unshifted_labels_match_torch() {
    let fx = load(train_fixture("loss.safetensors"));
    let logits = Var::from_tensor(&fx["logits"]).unwrap();
    let out = causal_lm_loss(logits.as_tensor(), &fx["labels"], false).unwrap();
    assert_eq!(out.count, 11);
    assert_close(
        "noshift sum",
        &out.sum.reshape(1).unwrap(),
        &fx["noshift_sum"],
        1e-6,
        1e-5,
    );
    let grads = out.sum.backward().unwrap();
    let g = grads.get(logits.as_tensor()).unwrap();
    assert_close("noshift grad", g, &fx["noshift_grad_sum"], 1e-5, 1e-7);
}

#[test]
fn bf16_logits_upcast_like_torchtune() {
    let fx = load(train_fixture("loss.safetensors"));
    let logits = Var::from_tensor(&fx["bf16_logits"]).unwrap();
    assert_eq!(logits.dtype(), DType::BF16);
    let out = causal_lm_loss(logits.as_tensor(), &fx["labels"], true).unwrap();
    assert_eq!(out.sum.dtype(), DType::F32);
    assert_close(
        "bf16 sum",
        &out.sum.reshape(1).unwrap(),
        &fx["bf16_shift_sum"],
        1e-6,
        1e-5,
    );
    let grads = out.sum.backward().unwrap();
    let g = grads.get(logits.as_tensor()).unwrap();
    assert_eq!(g.dtype(), DType::BF16);
    // Gradients are rounded to bf16 on both sides; allow one bf16 ulp for a rounding-boundary flip.
    assert_close("bf16 grad", g, &fx["bf16_shift_grad_sum"], 8e-3, 1e-6);
}

#[test]
fn u32_labels_and_bad_labels() {
    let fx = load(train_fixture("loss.safetensors"));
    let logits = &fx["logits"];
    // -100 stored in u32 reads as 4294967196 and is ignored just the same.
    let raw: Vec<u32> = fx["labels"]
        .flatten_all()
        .unwrap()
        .to_vec1::<i64>()
        .unwrap()
        .iter()
        .map(|&l| l as i32 as u32)
        .collect();
    let labels_u32 = Tensor::from_vec(raw, (2, 7), &Device::Cpu).unwrap();
    let a = causal_lm_loss(logits, &labels_u32, true).unwrap();
    let b = causal_lm_loss(logits, &fx["labels"], true).unwrap();
    assert_eq!(a.count, b.count);
    assert_eq!(scalar(&a.sum), scalar(&b.sum));

    let bad = Tensor::new(&[[0i64, 11], [1, 2]], &Device::Cpu).unwrap();
    assert!(causal_lm_loss(&logits.narrow(1, 0, 2).unwrap(), &bad, true).is_err());
}

/// Gradient accumulation identity: 4 micro-batches of 1, each normalised by the token count of the
/// whole step, accumulate to the gradient of one batch of 4 normalised by the same count.
#[test]
fn accumulation_over_micro_batches_equals_one_big_batch() {
    let dev = Device::Cpu;
    let (b, t, h, v) = (4usize, 9usize, 6usize, 13usize);
    let x = Tensor::randn(0f32, 1.0, (b, t, h), &dev).unwrap();
    let w = Var::from_tensor(&Tensor::randn(0f32, 0.5, (h, v), &dev).unwrap()).unwrap();
    // Labels with a different number of ignored positions per row, so per-micro-batch means would
    // differ from the global mean.
    let mut lab = vec![0i64; b * t];
    for (i, l) in lab.iter_mut().enumerate() {
        let (row, col) = (i / t, i % t);
        *l = if col < row * 2 {
            -100
        } else {
            ((i * 7) % v) as i64
        };
    }
    let labels = Tensor::from_vec(lab, (b, t), &dev).unwrap();
    let logits_of = |x: &Tensor| x.broadcast_matmul(w.as_tensor()).unwrap();

    let full = causal_lm_loss(&logits_of(&x), &labels, true).unwrap();
    let total = full.count;
    let g_full = full.normalized(total).unwrap().backward().unwrap();
    let g_full = g_full.get(w.as_tensor()).unwrap().clone();

    // Accumulate the way a recipe does: `GradStore::extend` sums entries with the same id.
    let mut counts = 0;
    let mut acc: Option<candle_core::backprop::GradStore> = None;
    for i in 0..b {
        let xi = x.narrow(0, i, 1).unwrap();
        let li = labels.narrow(0, i, 1).unwrap();
        let out = causal_lm_loss(&logits_of(&xi), &li, true).unwrap();
        counts += out.count;
        let g = out.normalized(total).unwrap().backward().unwrap();
        match acc.as_mut() {
            None => acc = Some(g),
            Some(a) => a.extend(g).unwrap(),
        }
    }
    let acc = acc.unwrap().get(w.as_tensor()).unwrap().clone();
    assert_eq!(counts, total);
    assert_close("accumulated grad", &acc, &g_full, 1e-6, 1e-6);
}

/// torchtune's way: backpropagate summed losses, then scale the accumulated gradient by
/// `1 / total_tokens` — the same gradient as normalising each micro-batch's loss.
#[test]
fn scaling_summed_grads_equals_normalised_losses() {
    let dev = Device::Cpu;
    let (t, h, v) = (6usize, 4usize, 9usize);
    let w = Var::from_tensor(&Tensor::randn(0f32, 0.5, (h, v), &dev).unwrap()).unwrap();
    let xs: Vec<Tensor> = (0..3)
        .map(|_| Tensor::randn(0f32, 1.0, (1, t, h), &dev).unwrap())
        .collect();
    let labels = Tensor::new(&[[1i64, -100, 3, 4, 5, 6]], &dev).unwrap();
    let total = 3 * 4;
    let mut summed: Option<candle_core::backprop::GradStore> = None;
    let mut normed: Option<candle_core::backprop::GradStore> = None;
    for x in &xs {
        let out =
            causal_lm_loss(&x.broadcast_matmul(w.as_tensor()).unwrap(), &labels, true).unwrap();
        assert_eq!(out.count, 4);
        let gs = out.sum.backward().unwrap();
        let gn = out.normalized(total).unwrap().backward().unwrap();
        match (summed.as_mut(), normed.as_mut()) {
            (Some(s), Some(n)) => {
                s.extend(gs).unwrap();
                n.extend(gn).unwrap();
            }
            _ => {
                summed = Some(gs);
                normed = Some(gn);
            }
        }
    }
    let mut summed = summed.unwrap();
    ferrotune_train::scale_grads(&mut summed, [w.as_tensor()], 1.0 / total as f64).unwrap();
    let a = summed.get(w.as_tensor()).unwrap();
    let b = normed.unwrap().get(w.as_tensor()).unwrap().clone();
    assert_close("scaled vs normalised", a, &b, 1e-6, 1e-7);
}
