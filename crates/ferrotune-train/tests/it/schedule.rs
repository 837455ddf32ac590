//! LR schedules against torch's LambdaLR driving torchtune's cosine and Hugging Face's linear lambdas.

use crate::common;

use common::train_fixture;
use ferrotune_train::LrSchedule;
use serde_json::Value;

fn fixture() -> Value {
    let text = std::fs::read_to_string(train_fixture("schedule.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn check(schedule: LrSchedule, case: &Value) {
    let base = case["base_lr"].as_f64().unwrap();
    let lrs = case["lrs"].as_array().unwrap();
    assert!(!lrs.is_empty());
    for (step, want) in lrs.iter().enumerate() {
        let want = want.as_f64().unwrap();
        let got = schedule.lr(base, step);
        // Same f64 formula in the same order: equal up to libm's cos.
        assert!(
            (got - want).abs() <= 1e-15 * base,
            "{schedule:?} step {step}: {got} vs {want}"
        );
    }
}

#[test]
fn cosine_with_warmup_matches_torchtune() {
    let fx = fixture();
    for case in fx["cosine"].as_array().unwrap() {
        let warmup = case["warmup"].as_u64().unwrap() as usize;
        let total = case["total"].as_u64().unwrap() as usize;
        let num_cycles = case["num_cycles"].as_f64().unwrap();
        check(
            LrSchedule::Cosine {
                warmup,
                total,
                num_cycles,
            },
            case,
        );
    }
    assert_eq!(
        LrSchedule::cosine(10, 100),
        LrSchedule::Cosine {
            warmup: 10,
            total: 100,
            num_cycles: 0.5
        }
    );
}

#[test]
fn linear_with_warmup_matches_transformers() {
    let fx = fixture();
    for case in fx["linear"].as_array().unwrap() {
        let warmup = case["warmup"].as_u64().unwrap() as usize;
        let total = case["total"].as_u64().unwrap() as usize;
        check(LrSchedule::Linear { warmup, total }, case);
    }
}

#[test]
fn constant_schedules() {
    for step in [0, 1, 7, 1000] {
        assert_eq!(LrSchedule::Constant.multiplier(step), 1.0);
    }
    let s = LrSchedule::ConstantWithWarmup { warmup: 4 };
    let m: Vec<f64> = (0..7).map(|i| s.multiplier(i)).collect();
    assert_eq!(m, vec![0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]);
    assert_eq!(
        LrSchedule::ConstantWithWarmup { warmup: 0 }.multiplier(0),
        1.0
    );
}
