//! `clip_grad_norm` against `torch.nn.utils.clip_grad_norm_`.

use crate::common;

use candle_core::{DType, Device, Tensor, Var};
use common::{assert_close, load, train_fixture};
use ferrotune_train::clip_grad_norm;

const NAMES: [&str; 3] = ["a", "b", "c"];

/// Vars shaped like the fixture grads and a GradStore holding those grads (cast to `dtype`).
fn setup(dtype: DType) -> (Vec<Var>, candle_core::backprop::GradStore) {
    let fx = load(train_fixture("clip.safetensors"));
    let vars: Vec<Var> = NAMES
        .iter()
        .map(|n| Var::zeros(fx[&format!("{n}.grad")].shape(), dtype, &Device::Cpu).unwrap())
        .collect();
    let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
    for v in &vars {
        loss = (loss
            + v.as_tensor()
                .to_dtype(DType::F32)
                .unwrap()
                .sum_all()
                .unwrap())
        .unwrap();
    }
    let mut store = loss.backward().unwrap();
    for (n, v) in NAMES.iter().zip(&vars) {
        store.insert(
            v.as_tensor(),
            fx[&format!("{n}.grad")].to_dtype(dtype).unwrap(),
        );
    }
    (vars, store)
}

#[test]
fn clips_like_torch() {
    let fx = load(train_fixture("clip.safetensors"));
    for (case, max_norm) in [("clip", 1.0), ("noclip", 100.0)] {
        let (vars, mut grads) = setup(DType::F32);
        let total =
            clip_grad_norm(&mut grads, vars.iter().map(|v| v.as_tensor()), max_norm).unwrap();
        let want = fx[&format!("{case}.total_norm")].to_vec1::<f32>().unwrap()[0];
        assert!(
            (total as f32 - want).abs() <= 1e-6 * want,
            "{case}: norm {total} vs {want}"
        );
        for (n, v) in NAMES.iter().zip(&vars) {
            let g = grads.get(v.as_tensor()).unwrap();
            assert_close(
                &format!("{case} {n}"),
                g,
                &fx[&format!("{case}.{n}")],
                1e-6,
                1e-8,
            );
        }
    }
}

#[test]
fn params_without_grads_are_ignored_and_dtype_is_kept() {
    let fx = load(train_fixture("clip.safetensors"));
    let (vars, mut grads) = setup(DType::BF16);
    // Dropping b's grad: the norm covers a and c only.
    grads.remove(vars[1].as_tensor());
    let expected: f32 = ["a", "c"]
        .iter()
        .map(|n| {
            let g = fx[&format!("{n}.grad")]
                .to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            g.sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        })
        .sum::<f32>()
        .sqrt();
    let total = clip_grad_norm(&mut grads, vars.iter().map(|v| v.as_tensor()), 0.5).unwrap();
    assert!((total as f32 - expected).abs() <= 1e-5 * expected);
    assert!(grads.get(vars[1].as_tensor()).is_none());
    let mut sq = 0f32;
    for v in [&vars[0], &vars[2]] {
        let g = grads.get(v.as_tensor()).unwrap();
        assert_eq!(g.dtype(), DType::BF16);
        sq += g
            .to_dtype(DType::F32)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
    }
    // Clipped to max_norm, up to bf16 rounding.
    assert!((sq.sqrt() - 0.5).abs() < 5e-3, "clipped norm {}", sq.sqrt());
}

/// Non-finite norms scale like torch: by 0 for inf (`[0, nan, 0]`, `[0, 0, 0]`), by NaN for NaN.
#[test]
fn non_finite_norms_follow_torch() {
    let dev = Device::Cpu;
    let vars = [
        Var::zeros(3, DType::F32, &dev).unwrap(),
        Var::zeros(3, DType::F32, &dev).unwrap(),
    ];
    for bad in [f32::INFINITY, f32::NAN] {
        let loss = (vars[0].as_tensor().sum_all().unwrap()
            + vars[1].as_tensor().sum_all().unwrap())
        .unwrap();
        let mut grads = loss.backward().unwrap();
        grads.insert(
            vars[0].as_tensor(),
            Tensor::new(&[1f32, bad, 2.0], &dev).unwrap(),
        );
        grads.insert(
            vars[1].as_tensor(),
            Tensor::new(&[1f32, 2.0, 3.0], &dev).unwrap(),
        );
        let total = clip_grad_norm(&mut grads, vars.iter().map(|v| v.as_tensor()), 1.0).unwrap();
        let g0 = common::f32s(grads.get(vars[0].as_tensor()).unwrap());
        let g1 = common::f32s(grads.get(vars[1].as_tensor()).unwrap());
        if bad.is_infinite() {
            assert_eq!(total, f64::INFINITY);
            assert!(g0[0] == 0.0 && g0[1].is_nan() && g0[2] == 0.0, "{g0:?}");
            assert_eq!(g1, vec![0.0; 3]);
        } else {
            assert!(total.is_nan());
            assert!(g0.iter().chain(&g1).all(|x| x.is_nan()));
        }
    }
}
