//! AdamW and SGD against `torch.optim` (foreach=False): several steps, skipped grads, state export.

use crate::common;

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use common::{assert_close, load, train_fixture, workspace_fixture};
use ferrotune_train::{AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};

const NAMES: [&str; 3] = ["a", "b", "c"];
const STEPS: usize = 5;

/// A GradStore holding `grads[name]` for each parameter that has one.
///
/// GradStore has no public constructor: backprop through the sum of the vars yields a store with
/// an entry for every var, and those entries are then overwritten or removed.
fn grad_store(params: &[(String, Var)], grads: &HashMap<&str, Tensor>) -> GradStore {
    let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
    for (_, v) in params {
        loss = (loss
            + v.as_tensor()
                .to_dtype(DType::F32)
                .unwrap()
                .sum_all()
                .unwrap())
        .unwrap();
    }
    let mut store = loss.backward().unwrap();
    for (name, v) in params {
        match grads.get(name.as_str()) {
            Some(g) => {
                store.insert(v.as_tensor(), g.to_dtype(v.dtype()).unwrap());
            }
            None => {
                store.remove(v.as_tensor());
            }
        }
    }
    store
}

fn params_from(fx: &HashMap<String, Tensor>) -> Vec<(String, Var)> {
    NAMES
        .iter()
        .map(|n| {
            (
                n.to_string(),
                Var::from_tensor(&fx[&format!("{n}.init")]).unwrap(),
            )
        })
        .collect()
}

fn grads_at(fx: &HashMap<String, Tensor>, step: usize) -> HashMap<&'static str, Tensor> {
    NAMES
        .iter()
        .filter_map(|n| fx.get(&format!("{n}.grad{step}")).map(|g| (*n, g.clone())))
        .collect::<HashMap<_, _>>()
}

/// Runs `opt` over the fixture's gradient sequence and compares every step with torch's `prefix`.
///
/// The small absolute tolerance is for near-zero entries: torch's CPU `sqrt` is not correctly
/// rounded (about a fifth of f32 inputs come out one ulp off IEEE), so AdamW denominators can differ
/// by one ulp; everything else follows torch's operation order and rounds identically.
fn run_and_compare(
    prefix: &str,
    params: &[(String, Var)],
    opt: &mut dyn Optimizer,
    fx: &HashMap<String, Tensor>,
) {
    for step in 0..STEPS {
        let store = grad_store(params, &grads_at(fx, step));
        opt.step(&store).unwrap();
        for (n, v) in params {
            let want = &fx[&format!("{prefix}.{n}.step{step}")];
            assert_close(
                &format!("{prefix} {n} step {step}"),
                v.as_tensor(),
                want,
                1e-6,
                1e-7,
            );
        }
    }
}

#[test]
fn adamw_matches_torch_over_several_steps() {
    let fx = load(train_fixture("optim.safetensors"));
    let params = params_from(&fx);
    let cfg = AdamWConfig {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut opt = AdamW::new(params.clone(), cfg).unwrap();
    run_and_compare("adamw", &params, &mut opt, &fx);

    // Exported state equals torch's optimizer.state (b skipped one step: step 4, not 5).
    let state: HashMap<String, Tensor> = opt.state_dict().unwrap().into_iter().collect();
    assert_eq!(state.len(), 9);
    for n in NAMES {
        for k in ["exp_avg", "exp_avg_sq"] {
            let want = &fx[&format!("adamw.{n}.state.{k}")];
            assert_close(
                &format!("{n}.{k}"),
                &state[&format!("{n}.{k}")],
                want,
                1e-6,
                1e-9,
            );
        }
        let step = state[&format!("{n}.step")].to_scalar::<f32>().unwrap();
        assert_eq!(
            step,
            fx[&format!("adamw.{n}.state.step")]
                .to_vec1::<f32>()
                .unwrap()[0]
        );
    }
}

#[test]
fn adamw_state_round_trip_resumes_identically() {
    let fx = load(train_fixture("optim.safetensors"));
    let cfg = AdamWConfig {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };

    // Uninterrupted run.
    let params = params_from(&fx);
    let mut opt = AdamW::new(params.clone(), cfg).unwrap();
    for step in 0..STEPS {
        opt.step(&grad_store(&params, &grads_at(&fx, step)))
            .unwrap();
    }

    // Two steps, save (through a safetensors file), new optimizer, load, three more steps.
    let resumed = params_from(&fx);
    let mut first = AdamW::new(resumed.clone(), cfg).unwrap();
    for step in 0..2 {
        first
            .step(&grad_store(&resumed, &grads_at(&fx, step)))
            .unwrap();
    }
    let dir = std::env::temp_dir().join(format!("ferrotune-train-optim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("optim.safetensors");
    let sd: HashMap<String, Tensor> = first.state_dict().unwrap().into_iter().collect();
    candle_core::safetensors::save(&sd, &path).unwrap();
    let loaded = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();

    let mut second = AdamW::new(resumed.clone(), cfg).unwrap();
    second.load_state_dict(&loaded).unwrap();
    for step in 2..STEPS {
        second
            .step(&grad_store(&resumed, &grads_at(&fx, step)))
            .unwrap();
    }
    for ((n, a), (_, b)) in params.iter().zip(&resumed) {
        assert_eq!(
            common::f32s(a.as_tensor()),
            common::f32s(b.as_tensor()),
            "{n}"
        );
    }

    // Keys naming no parameter are refused.
    let mut bogus = loaded.clone();
    bogus.insert(
        "zz.exp_avg".into(),
        Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap(),
    );
    assert!(second.load_state_dict(&bogus).is_err());
}

#[test]
fn sgd_momentum_dampening_matches_torch() {
    let fx = load(train_fixture("optim.safetensors"));
    let params = params_from(&fx);
    let cfg = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.1,
        weight_decay: 0.01,
        nesterov: false,
    };
    let mut opt = Sgd::new(params.clone(), cfg).unwrap();
    run_and_compare("sgd", &params, &mut opt, &fx);
    let state: HashMap<String, Tensor> = opt.state_dict().unwrap().into_iter().collect();
    for n in NAMES {
        let want = &fx[&format!("sgd.{n}.state.momentum_buffer")];
        assert_close(
            &format!("{n} momentum"),
            &state[&format!("{n}.momentum_buffer")],
            want,
            1e-6,
            1e-8,
        );
    }
}

#[test]
fn sgd_nesterov_and_plain_match_torch() {
    let fx = load(train_fixture("optim.safetensors"));
    let params = params_from(&fx);
    let cfg = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        dampening: 0.0,
        weight_decay: 0.01,
        nesterov: true,
    };
    let mut opt = Sgd::new(params.clone(), cfg).unwrap();
    run_and_compare("nesterov", &params, &mut opt, &fx);

    let params = params_from(&fx);
    let mut opt = Sgd::new(
        params.clone(),
        SgdConfig {
            lr: 0.1,
            ..SgdConfig::default()
        },
    )
    .unwrap();
    run_and_compare("plain", &params, &mut opt, &fx);
    assert!(opt.state_dict().unwrap().is_empty());

    let bad = SgdConfig {
        nesterov: true,
        dampening: 0.1,
        momentum: 0.9,
        ..SgdConfig::default()
    };
    assert!(Sgd::new(params_from(&fx), bad).is_err());
}

#[test]
fn bf16_params_keep_an_f32_master_copy() {
    let fx = load(train_fixture("optim.safetensors"));
    let cfg = AdamWConfig {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    // f32 reference run from bf16-representable initial values.
    let init: Vec<(String, Tensor)> = NAMES
        .iter()
        .map(|n| {
            let t = fx[&format!("{n}.init")].to_dtype(DType::BF16).unwrap();
            (n.to_string(), t)
        })
        .collect();
    let p32: Vec<(String, Var)> = init
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                Var::from_tensor(&t.to_dtype(DType::F32).unwrap()).unwrap(),
            )
        })
        .collect();
    let p16: Vec<(String, Var)> = init
        .iter()
        .map(|(n, t)| (n.clone(), Var::from_tensor(t).unwrap()))
        .collect();
    let mut o32 = AdamW::new(p32.clone(), cfg).unwrap();
    let mut o16 = AdamW::new(p16.clone(), cfg).unwrap();
    for step in 0..STEPS {
        o32.step(&grad_store(&p32, &grads_at(&fx, step))).unwrap();
        // The bf16 run sees the same gradients, rounded to bf16 as a bf16 backward would give them.
        o16.step(&grad_store(&p16, &grads_at(&fx, step))).unwrap();
    }
    let state: HashMap<String, Tensor> = o16.state_dict().unwrap().into_iter().collect();
    for ((n, a), (_, b)) in p32.iter().zip(&p16) {
        assert_eq!(b.dtype(), DType::BF16);
        let master = &state[&format!("{n}.master")];
        assert_eq!(master.dtype(), DType::F32);
        // The Var holds the master rounded to bf16.
        assert_eq!(
            common::f32s(b.as_tensor()),
            common::f32s(&master.to_dtype(DType::BF16).unwrap())
        );
        // The master tracks the f32 run up to the bf16 rounding of the gradients (3 significant digits).
        assert_close(&format!("{n} master"), master, a.as_tensor(), 1e-2, 1e-3);
        assert_eq!(state[&format!("{n}.exp_avg")].dtype(), DType::F32);
    }
}

/// One AdamW step on the LoRA adapters of the model fixtures, against torch's result.
fn lora_adamw_step(model: &str) {
    let adapter = load(workspace_fixture(&format!(
        "{model}/adapter/adapter_model.safetensors"
    )));
    let grads = load(workspace_fixture(&format!(
        "{model}/lora_grads.safetensors"
    )));
    let expected = load(workspace_fixture(&format!(
        "{model}/lora_after_adamw_step.safetensors"
    )));
    let mut names: Vec<&String> = adapter.keys().collect();
    names.sort();
    assert!(!names.is_empty());
    let params: Vec<(String, Var)> = names
        .iter()
        .map(|n| ((*n).clone(), Var::from_tensor(&adapter[*n]).unwrap()))
        .collect();
    let gmap: HashMap<&str, Tensor> = names
        .iter()
        .map(|n| (n.as_str(), grads[*n].clone()))
        .collect();
    let cfg = AdamWConfig {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let mut opt = AdamW::new(params.clone(), cfg).unwrap();
    opt.step(&grad_store(&params, &gmap)).unwrap();
    for (n, v) in &params {
        assert_close(
            &format!("{model} {n}"),
            v.as_tensor(),
            &expected[n],
            1e-6,
            1e-7,
        );
    }
}

#[test]
fn lora_adamw_step_llama3() {
    lora_adamw_step("llama3");
}

#[test]
fn lora_adamw_step_qwen2() {
    lora_adamw_step("qwen2");
}
