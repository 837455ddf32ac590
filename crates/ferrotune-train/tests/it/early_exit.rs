//! LayerSkip (`dev/early_exit_finetune_distributed`) against torchtune's own pieces
//! (scripts/make_early_exit_fixtures.py: its TransformerDecoder with the same weights,
//! `prepare_layer_dropout`, the curricula, `early_exit_loss`, torch's AdamW, run as the recipe's
//! loop runs them). Per case and step: the exit layers the curriculum picks, the rows layer dropout
//! keeps (torch.bernoulli's draws from per-layer generators), the logged loss, and after the
//! optimizer step a few parameters; on the first step their gradients, and which parameters got
//! none (the layers above the highest exit, and a layer that skipped every row). With and without
//! activation checkpointing.

use candle_core::{DType, Device, Tensor};
use ferrotune_models::{load_model, AttentionLayout};
use ferrotune_train::early_exit::{
    slice_str_to_array, Curriculum, DropoutScale, EarlyExitLoss, LayerDropout, ScaleFn,
};
use ferrotune_train::optim::{AdamW, AdamWConfig, Optimizer};
use ferrotune_train::step::{empty_grads, forward_backward, LayerSkip, MicroBatch};
use serde_json::Value;

use crate::common;
use common::{load, rel_l2, workspace_fixture};

fn micro_batch(b: &Value) -> MicroBatch {
    let ids: Vec<Vec<u32>> = serde_json::from_value(b["input_ids"].clone()).unwrap();
    let labels: Vec<Vec<i64>> = serde_json::from_value(b["labels"].clone()).unwrap();
    let (rows, t) = (ids.len(), ids[0].len());
    // Right padding with id 0, which no row uses otherwise.
    let valid: Vec<Vec<bool>> = ids
        .iter()
        .map(|r| r.iter().map(|&x| x != 0).collect())
        .collect();
    let layout = AttentionLayout {
        key_valid: valid.clone(),
        ..AttentionLayout::causal(rows, t, 0)
    };
    MicroBatch {
        input_ids: Tensor::from_vec(ids.concat(), (rows, t), &Device::Cpu).unwrap(),
        num_targets: labels
            .iter()
            .map(|r| r.iter().skip(1).filter(|&&l| l != -100).count())
            .sum(),
        labels: Tensor::from_vec(labels.concat(), (rows, t), &Device::Cpu).unwrap(),
        layout,
        num_tokens: valid.iter().flatten().filter(|&&v| v).count(),
        distill: None,
        preference: None,
        aux_loss_weight: None,
        layer_skip: None,
        reward: None,
    }
}

/// torchtune's record of a micro-batch's kept rows (every row listed where none was skipped) in
/// ferrotune's form (`None` where a layer runs every row).
fn kept_rows(v: &Value, rows: usize) -> Vec<Option<Vec<usize>>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|k| match k {
            Value::Null => None,
            list => {
                let kept: Vec<usize> = serde_json::from_value(list.clone()).unwrap();
                (kept.len() < rows).then_some(kept)
            }
        })
        .collect()
}

fn run_case(golden: &Value, name: &str, checkpointing: bool) {
    let case = &golden["cases"][name];
    let what = format!("{name} (checkpointing {checkpointing})");
    let dir = workspace_fixture("early_exit");
    let model = load_model(&dir.join("model"), DType::F32, &Device::Cpu)
        .unwrap()
        .0;
    let mut model = model;
    let params = model.make_all_trainable().unwrap();
    let layers = model.layers.len();
    let initial: std::collections::HashMap<String, Tensor> = params
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().copy().unwrap()))
        .collect();
    let steps = case["steps_total"].as_u64().unwrap() as usize;
    let early_exit = case["early_exit"].as_object().map(|ee| EarlyExitLoss {
        chosen: slice_str_to_array(ee["layers"].as_str().unwrap(), layers).unwrap(),
        curriculum: Curriculum::from_component(ee["curriculum"].as_str()).unwrap(),
        scale_fn: ScaleFn::from_component(ee["scale_fn"].as_str().unwrap()).unwrap(),
        scale: ee["scale"].as_f64().unwrap(),
        include_last_layer: true,
        max_steps: steps,
    });
    let mut dropout = case["layer_dropout"].as_object().map(|d| {
        let applies = slice_str_to_array(d["layers"].as_str().unwrap(), layers).unwrap();
        let scale = DropoutScale::parse(d["layers_scale"].as_str().unwrap()).unwrap();
        LayerDropout::new(d["prob"].as_f64().unwrap(), scale, &applies, 0)
    });
    let mut opt = AdamW::new(
        params.clone(),
        AdamWConfig {
            lr: golden["lr"].as_f64().unwrap(),
            eps: golden["eps"].as_f64().unwrap(),
            weight_decay: golden["weight_decay"].as_f64().unwrap(),
            ..AdamWConfig::default()
        },
    )
    .unwrap();
    let watch: Vec<String> = serde_json::from_value(golden["watch"].clone()).unwrap();
    for (step, want) in case["steps"].as_array().unwrap().iter().enumerate() {
        let exits = early_exit
            .as_ref()
            .map(|e| e.exits_at(step, layers))
            .unwrap_or_default();
        let exit_layers: Vec<usize> = exits.iter().map(|&(l, _)| l).collect();
        let want_exits: Vec<usize> = serde_json::from_value(want["exits"].clone()).unwrap();
        assert_eq!(exit_layers, want_exits, "{what} step {step}: exit layers");
        let mut grads = empty_grads().unwrap();
        let (mut sum, mut targets) = (0.0, 0usize);
        for (m, b) in want["batches"].as_array().unwrap().iter().enumerate() {
            let mut batch = micro_batch(b);
            let rows = batch.input_ids.dim(0).unwrap();
            let kept = match dropout.as_mut() {
                Some(d) => d.draw(rows),
                None => vec![None; layers],
            };
            assert_eq!(
                kept,
                kept_rows(&want["kept"][m], rows),
                "{what} step {step} micro-batch {m}: kept rows"
            );
            batch.layer_skip = Some(LayerSkip {
                exits: exits.clone(),
                kept_rows: kept,
            });
            let loss =
                forward_backward(&model, &batch, &params, &mut grads, checkpointing).unwrap();
            sum += loss.sum;
            targets += batch.num_targets;
        }
        let loss = sum / targets as f64;
        let want_loss = want["loss"].as_f64().unwrap();
        assert!(
            ((loss - want_loss) / want_loss).abs() < 1e-5,
            "{what} step {step}: loss {loss} vs torchtune {want_loss}"
        );
        let scale = 1.0 / targets as f64;
        if step == 0 {
            let want_grads = load(dir.join(format!("grads_{name}.safetensors")));
            let no_grad: Vec<String> = serde_json::from_value(want["no_grad"].clone()).unwrap();
            for (pname, var) in &params {
                let got = grads.get(var.as_tensor());
                assert_eq!(
                    got.is_none(),
                    no_grad.contains(pname),
                    "{what}: {pname} has a gradient: {}",
                    got.is_some()
                );
                if let (Some(g), true) = (got, watch.contains(pname)) {
                    let e = rel_l2(&(g * scale).unwrap(), &want_grads[pname]);
                    assert!(e < 1e-4, "{what}: gradient of {pname}: relative L2 {e}");
                }
            }
        }
        opt.step_scaled(&grads, scale).unwrap();
        let want_params = load(dir.join(format!("params_{name}_step{}.safetensors", step + 1)));
        for pname in &watch {
            let var = &params.iter().find(|(n, _)| n == pname).unwrap().1;
            let got_update = (var.as_tensor() - &initial[pname]).unwrap();
            let want_update = (&want_params[pname] - &initial[pname]).unwrap();
            let norm = want_update
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            if norm == 0.0 {
                // Never given a gradient: not even weight decay moved it (torch skips it).
                let moved = got_update.abs().unwrap().max_all().unwrap();
                assert_eq!(
                    moved.to_scalar::<f32>().unwrap(),
                    0.0,
                    "{what}: {pname} moved"
                );
            } else {
                let e = rel_l2(&got_update, &want_update);
                assert!(
                    e < 1e-3,
                    "{what} step {}: update of {pname}: relative L2 {e}",
                    step + 1
                );
            }
        }
    }
}

fn golden() -> Value {
    let path = workspace_fixture("early_exit/golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn rotational_curriculum_with_layer_dropout_matches_torchtune() {
    let g = golden();
    run_case(&g, "rotational", false);
    run_case(&g, "rotational", true);
}

#[test]
fn gradual_curriculum_matches_torchtune() {
    let g = golden();
    run_case(&g, "gradual", false);
    run_case(&g, "gradual", true);
}

#[test]
fn layer_dropout_alone_matches_torchtune() {
    let g = golden();
    run_case(&g, "dropout", false);
    run_case(&g, "dropout", true);
}

/// Layer dropout on a packed batch: a layer run on some rows gives each row what running the rows
/// one at a time gives (row 0 skipping layers 0 and 2, row 1 skipping layer 1), with early exits
/// on top — the loss and every gradient. The rows are packs of two samples each (positions restart,
/// attention stays within a sample).
#[test]
fn packed_rows_skip_layers_as_if_run_alone() {
    let dir = workspace_fixture("early_exit");
    let mut model = load_model(&dir.join("model"), DType::F32, &Device::Cpu)
        .unwrap()
        .0;
    let params = model.make_all_trainable().unwrap();
    let ids: Vec<Vec<u32>> = vec![
        vec![5, 9, 14, 33, 7, 21, 40, 3],
        vec![11, 12, 13, 60, 61, 62, 63, 90],
    ];
    let labels: Vec<Vec<i64>> = vec![
        vec![-100, 9, 14, 33, -100, 21, 40, 3],
        vec![-100, -100, 13, 60, 61, -100, 63, 90],
    ];
    let positions = [vec![0, 1, 2, 3, 0, 1, 2, 3], vec![0, 1, 2, 0, 1, 2, 3, 4]];
    let segments = [vec![0, 0, 0, 0, 1, 1, 1, 1], vec![0, 0, 0, 1, 1, 1, 1, 1]];
    let batch_of = |rows: &[usize]| {
        let pick = |v: &Vec<Vec<u32>>| rows.iter().flat_map(|&r| v[r].clone()).collect::<Vec<_>>();
        let t = 8;
        MicroBatch {
            input_ids: Tensor::from_vec(pick(&ids), (rows.len(), t), &Device::Cpu).unwrap(),
            labels: Tensor::from_vec(
                rows.iter()
                    .flat_map(|&r| labels[r].clone())
                    .collect::<Vec<_>>(),
                (rows.len(), t),
                &Device::Cpu,
            )
            .unwrap(),
            layout: AttentionLayout {
                positions: rows.iter().map(|&r| positions[r].clone()).collect(),
                key_valid: vec![vec![true; t]; rows.len()],
                segments: Some(rows.iter().map(|&r| segments[r].clone()).collect()),
            },
            num_targets: rows
                .iter()
                .map(|&r| labels[r].iter().skip(1).filter(|&&l| l != -100).count())
                .sum(),
            num_tokens: rows.len() * t,
            distill: None,
            preference: None,
            aux_loss_weight: None,
            layer_skip: None,
            reward: None,
        }
    };
    let exits = vec![(1, 0.25), (3, 0.75)];
    for checkpointing in [false, true] {
        // Both rows at once: layer 0 runs row 1 only, layer 1 row 0 only, layer 2 row 1 only.
        let mut both = batch_of(&[0, 1]);
        both.layer_skip = Some(LayerSkip {
            exits: exits.clone(),
            kept_rows: vec![Some(vec![1]), Some(vec![0]), Some(vec![1]), None],
        });
        let mut together = empty_grads().unwrap();
        let a = forward_backward(&model, &both, &params, &mut together, checkpointing).unwrap();
        // One row at a time.
        let mut apart = empty_grads().unwrap();
        let mut sum = 0.0;
        for (row, kept) in [
            (0, vec![Some(vec![]), None, Some(vec![]), None]),
            (1, vec![None, Some(vec![]), None, None]),
        ] {
            let mut one = batch_of(&[row]);
            one.layer_skip = Some(LayerSkip {
                exits: exits.clone(),
                kept_rows: kept,
            });
            sum += forward_backward(&model, &one, &params, &mut apart, checkpointing)
                .unwrap()
                .sum;
        }
        assert!(
            ((a.sum - sum) / sum).abs() < 1e-5,
            "checkpointing {checkpointing}: loss {} vs rows apart {sum}",
            a.sum
        );
        for (name, var) in &params {
            match (together.get(var.as_tensor()), apart.get(var.as_tensor())) {
                (Some(g), Some(h)) => {
                    let e = rel_l2(g, h);
                    assert!(
                        e < 1e-5,
                        "checkpointing {checkpointing}: {name}: relative L2 {e}"
                    );
                }
                (None, None) => assert!(name.starts_with("model.layers.3."), "{name}: no gradient"),
                (g, h) => panic!(
                    "{name}: gradient together {} apart {}",
                    g.is_some(),
                    h.is_some()
                ),
            }
        }
    }
}
