//! Qwen3.5 (`qwen3_5_text`): full fine-tuning gradients through the Gated DeltaNet and the gated
//! attention equal transformers' (golden_models checks the fixture's logits, KV cache and bf16;
//! lora its PEFT adapter), and what is not supported yet is refused by name.

use crate::common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use ferrotune_models::{load_model, AttentionLayout, CausalLm};

use common::{fixtures, rel_l2};

fn dir() -> std::path::PathBuf {
    fixtures().join("models").join("qwen3_5")
}

fn golden() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("golden.json")).unwrap()).unwrap()
}

fn load() -> CausalLm {
    load_model(&dir().join("model"), DType::F32, &Device::Cpu)
        .unwrap()
        .0
}

/// Full fine-tuning gradients of the golden loss equal transformers' (`grads.safetensors`) for
/// every parameter: the DeltaNet's projections, conv1d, A_log, dt_bias and gated norm, the gated
/// attention's projections and q/k norms, the MLPs and the zero-centred norms.
#[test]
fn full_training_gradients_match_transformers() {
    let mut model = load();
    let params = model.make_all_trainable().unwrap();
    let rows: Vec<Vec<u32>> = serde_json::from_value(golden()["input_ids"].clone()).unwrap();
    let (b, t) = (rows.len(), rows[0].len());
    let ids = Tensor::from_vec(rows.concat(), (b, t), &Device::Cpu).unwrap();
    let logits = model
        .forward(&ids, &AttentionLayout::causal(b, t, 0), None)
        .unwrap();
    let l = common::causal_lm_loss(&logits, &golden()["labels"]);
    let want_loss = golden()["loss"].as_f64().unwrap();
    let got = l.to_scalar::<f32>().unwrap() as f64;
    assert!((got - want_loss).abs() <= 1e-4, "loss {got} vs {want_loss}");
    let grads = l.backward().unwrap();
    let want: HashMap<String, Tensor> =
        candle_core::safetensors::load(dir().join("grads.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = params.iter().map(|(n, _)| n).collect();
    names.sort();
    let mut want_names: Vec<&String> = want.keys().collect();
    want_names.sort();
    assert_eq!(names, want_names, "parameter names");
    for (name, var) in &params {
        let g = grads
            .get(var)
            .unwrap_or_else(|| panic!("{name}: no gradient"));
        let err = rel_l2(g, &want[name]);
        assert!(err <= 1e-4, "{name}: gradient relative L2 error {err}");
    }
}

/// Packed batches are refused with a clear error (the linear attention's state does not restart
/// at sample starts yet), not computed across samples.
#[test]
fn packed_batches_are_refused() {
    let model = load();
    let ids = Tensor::from_vec((4u32..12).collect::<Vec<_>>(), (1, 8), &Device::Cpu).unwrap();
    let mut layout = AttentionLayout::causal(1, 8, 0);
    layout.segments = Some(vec![vec![0, 0, 0, 0, 1, 1, 1, 1]]);
    layout.positions = vec![vec![0, 1, 2, 3, 0, 1, 2, 3]];
    let err = model.forward(&ids, &layout, None).unwrap_err().to_string();
    assert!(err.contains("packed"), "{err}");
}

/// A left-padded batch (as generation builds it) gives each row the logits of that row alone,
/// in the prefill and in cached decoding: the padding is zeroed before the linear attention, so
/// its state and convolution start clean at the first real token.
#[test]
fn left_padded_rows_equal_rows_alone() {
    let model = load();
    let prompts: [&[u32]; 2] = [&[5, 9, 2, 7, 1, 3], &[4, 8, 6]];
    let longest = 6;
    let mut ids = Vec::new();
    let mut layout = AttentionLayout::causal(2, longest, 0);
    for (row, p) in prompts.iter().enumerate() {
        let pad = longest - p.len();
        ids.extend(std::iter::repeat_n(0u32, pad));
        ids.extend_from_slice(p);
        layout.key_valid[row] = (0..longest).map(|i| i >= pad).collect();
        layout.positions[row] = (0..longest as u32)
            .map(|i| i.saturating_sub(pad as u32))
            .collect();
    }
    let ids = Tensor::from_vec(ids, (2, longest), &Device::Cpu).unwrap();
    let mut cache = ferrotune_models::KvCache::new(model.layers.len());
    let batch = model.forward(&ids, &layout, Some(&mut cache)).unwrap();
    // One more token per row through the cache.
    let next = Tensor::new(&[[17u32], [23]], &Device::Cpu).unwrap();
    let mut step = layout.clone();
    for row in 0..2 {
        step.key_valid[row].push(true);
        let last = *layout.positions[row].last().unwrap();
        step.positions[row] = vec![last + 1];
    }
    let stepped = model.forward(&next, &step, Some(&mut cache)).unwrap();
    for (row, p) in prompts.iter().enumerate() {
        let mut alone: Vec<u32> = p.to_vec();
        alone.push([17, 23][row]);
        let n = alone.len();
        let alone_ids = Tensor::from_vec(alone, (1, n), &Device::Cpu).unwrap();
        let want = model
            .forward(&alone_ids, &AttentionLayout::causal(1, n, 0), None)
            .unwrap();
        let got = batch.narrow(0, row, 1).unwrap();
        let got = got.narrow(1, longest - p.len(), p.len()).unwrap();
        let err = common::max_abs_diff(&got, &want.narrow(1, 0, p.len()).unwrap());
        assert!(err <= 1e-4, "row {row}: prefill differs by {err}");
        let got = stepped.narrow(0, row, 1).unwrap();
        let err = common::max_abs_diff(&got, &want.narrow(1, n - 1, 1).unwrap());
        assert!(err <= 1e-4, "row {row}: cached step differs by {err}");
    }
}

/// transformers' batched greedy generation from left-padded prompts of unequal lengths
/// (tests/fixtures/qwen3_5_generate, scripts/make_qwen3_5_generate_fixtures.py): prefill, then
/// one token per row at a time through the cache, as ferrotune-infer's generation lays the batch
/// out. Every step's logits equal `generate()`'s scores and the tokens its tokens; the linear
/// layers hold fixed-size states, only the full-attention layer keys and values.
pub(crate) fn check_batched_generation(case: &str) {
    let gdir = fixtures().join("qwen3_5_generate").join(case);
    let g: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(gdir.join("golden.json")).unwrap()).unwrap();
    let model = load_model(
        &fixtures().join(g["model"].as_str().unwrap()),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap()
    .0;
    let scores = candle_core::safetensors::load(gdir.join("scores.safetensors"), &Device::Cpu)
        .unwrap()
        .remove("scores")
        .unwrap();
    let prompts: Vec<Vec<u32>> = serde_json::from_value(g["prompts"].clone()).unwrap();
    let want: Vec<Vec<u32>> = serde_json::from_value(g["new_tokens"].clone()).unwrap();
    let pad = g["pad_token_id"].as_u64().unwrap() as u32;
    let rows = prompts.len();
    let longest = prompts.iter().map(Vec::len).max().unwrap();
    let mut ids = Vec::new();
    let mut layout = AttentionLayout::causal(rows, longest, 0);
    for (r, p) in prompts.iter().enumerate() {
        let n_pad = longest - p.len();
        ids.extend(std::iter::repeat_n(pad, n_pad));
        ids.extend_from_slice(p);
        layout.key_valid[r] = (0..longest).map(|i| i >= n_pad).collect();
        // Real tokens count from 0, pads sit at 1 (transformers' cumsum(mask) - 1).
        layout.positions[r] = (0..longest)
            .map(|i| if i < n_pad { 1 } else { (i - n_pad) as u32 })
            .collect();
    }
    let mut cache = ferrotune_models::KvCache::new(model.layers.len());
    let ids = Tensor::from_vec(ids, (rows, longest), &Device::Cpu).unwrap();
    let mut logits = model
        .forward(&ids, &layout, Some(&mut cache))
        .unwrap()
        .narrow(1, longest - 1, 1)
        .unwrap();
    let d = model.config.delta_net.clone().unwrap();
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); rows];
    for step in 0..want[0].len() {
        let last = logits.squeeze(1).unwrap();
        let err = common::max_abs_diff(&last, &scores.get(step).unwrap());
        assert!(err <= 1e-4, "{case}: step {step}: logits differ by {err}");
        let next: Vec<u32> = last.argmax(1).unwrap().to_vec1().unwrap();
        for (r, &t) in next.iter().enumerate() {
            got[r].push(t);
            let pos = *layout.positions[r].last().unwrap() + 1;
            layout.positions[r] = vec![pos];
            layout.key_valid[r].push(true);
        }
        let step_ids = Tensor::from_vec(next, (rows, 1), &Device::Cpu).unwrap();
        logits = model.forward(&step_ids, &layout, Some(&mut cache)).unwrap();
    }
    assert_eq!(got, want, "{case}: greedy tokens");
    assert_eq!(cache.len(), longest + want[0].len());
    // The linear layers' cache is two fixed-size states; only the attention layers' grows.
    let states = cache.linear_state_shapes();
    let kv = cache.layer_shapes();
    for (i, &linear) in d.layers.iter().enumerate() {
        if linear {
            let (conv, rec) = states[i].clone().expect("a linear layer's states");
            assert_eq!(conv, [rows, d.conv_kernel - 1, d.conv_dim()]);
            assert_eq!(rec, [rows, d.value_heads, d.key_head_dim, d.value_head_dim]);
            assert!(
                kv[i].is_none(),
                "layer {i}: keys and values in a linear layer"
            );
        } else {
            assert!(states[i].is_none() && kv[i].is_some(), "layer {i}");
        }
    }
}

#[test]
fn batched_left_padded_generation_matches_transformers() {
    check_batched_generation("qwen3_5");
}
