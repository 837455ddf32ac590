//! QLoRA: a model whose decoder-layer linears are NF4 (torchtune's `qlora_*` builders) against a
//! reference built with torchao and PEFT (scripts/make_nf4_fixtures.py): each of those weights
//! replaced by torchao's NF4 round trip, a LoRA adapter on some of them; loss and adapter
//! gradients must agree, and merged weights are the dequantized base plus the adapter's delta.

use crate::common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor, D};
use ferrotune_core::nf4::Nf4Matrix;
use ferrotune_models::lora::set_training;
use ferrotune_models::model::BaseWeight;
use ferrotune_models::peft::{merged_tensors, trainable_parameters};
use ferrotune_models::{load_adapter, load_model, AttentionLayout, CausalLm};
use serde_json::Value;

use common::{fixtures, max_abs_diff, rel_l2};

fn qlora_dir() -> std::path::PathBuf {
    fixtures().join("nf4").join("qlora")
}

fn base() -> CausalLm {
    load_model(&qlora_dir().join("model"), DType::F32, &Device::Cpu)
        .unwrap()
        .0
}

fn golden() -> Value {
    serde_json::from_str(&std::fs::read_to_string(qlora_dir().join("golden.json")).unwrap())
        .unwrap()
}

fn rows(v: &Value) -> Vec<Vec<i64>> {
    serde_json::from_value(v.clone()).unwrap()
}

/// Mean cross-entropy of `logits[:, :-1]` against `labels[:, 1:]`, -100 ignored.
fn loss(logits: &Tensor, labels: &[Vec<i64>]) -> Tensor {
    let (b, t, v) = logits.dims3().unwrap();
    let (mut picked, mut targets) = (Vec::new(), Vec::new());
    for (bi, row) in labels.iter().enumerate() {
        for ti in 0..t - 1 {
            if row[ti + 1] != -100 {
                picked.push((bi * t + ti) as u32);
                targets.push(row[ti + 1] as u32);
            }
        }
    }
    let n = picked.len();
    let flat = logits.reshape((b * t, v)).unwrap();
    let rows = flat
        .index_select(&Tensor::new(picked, &Device::Cpu).unwrap(), 0)
        .unwrap();
    let target = rows
        .gather(&Tensor::from_vec(targets, (n, 1), &Device::Cpu).unwrap(), 1)
        .unwrap()
        .squeeze(1)
        .unwrap();
    (rows.log_sum_exp(D::Minus1).unwrap() - target)
        .unwrap()
        .mean_all()
        .unwrap()
}

#[test]
fn qlora_loss_and_adapter_gradients_match_torchao_and_peft() {
    let mut model = base();
    let dense_bytes: usize = model
        .linears()
        .iter()
        .filter(|(n, _)| n.starts_with("model.layers."))
        .map(|(_, l)| l.weight.size_in_bytes())
        .sum();
    let summary = model.quantize_base_nf4().unwrap();
    let (count, before, bytes) = (summary.layers, summary.dense_bytes, summary.nf4_bytes);
    assert_eq!(before, dense_bytes);
    assert_eq!(count, 14, "2 layers × q, k, v, o, gate, up, down");
    // f32 → 4 bits plus a byte per 64 values and 4 bytes per 256 blocks: ~7.7× smaller.
    assert!(bytes * 7 < dense_bytes, "{bytes} vs {dense_bytes}");
    for (name, linear) in model.linears() {
        let nf4 = matches!(linear.weight, BaseWeight::Nf4(_));
        assert_eq!(nf4, name != "lm_head", "{name}");
    }
    load_adapter(&mut model, &qlora_dir().join("adapter")).unwrap();
    let params = trainable_parameters(&mut model).unwrap();
    set_training(&mut model, true);

    let g = golden();
    let ids: Vec<u32> = rows(&g["input_ids"])
        .concat()
        .iter()
        .map(|&v| v as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (2, 16), &Device::Cpu).unwrap();
    let logits = model
        .forward(&ids, &AttentionLayout::causal(2, 16, 0), None)
        .unwrap();
    let loss = loss(&logits, &rows(&g["labels"]));
    let got = loss.to_scalar::<f32>().unwrap() as f64;
    let want = g["loss"].as_f64().unwrap();
    assert!(((got - want) / want).abs() <= 1e-5, "loss {got} vs {want}");

    let grads = loss.backward().unwrap();
    let want: HashMap<String, Tensor> =
        candle_core::safetensors::load(qlora_dir().join("lora_grads.safetensors"), &Device::Cpu)
            .unwrap();
    assert_eq!(params.len(), want.len());
    assert_eq!(params.len(), 12, "2 layers × q, v, down × A, B");
    for (name, var) in &params {
        let g = grads
            .get(var)
            .unwrap_or_else(|| panic!("{name}: no gradient"));
        let w = &want[name];
        let scale = w
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let err = max_abs_diff(g, w);
        assert!(err <= 1e-4 * scale, "{name}: {err} (scale {scale})");
    }
}

#[test]
fn merged_weights_are_the_dequantized_base_plus_the_delta() {
    let plain = base();
    let mut model = base();
    model.quantize_base_nf4().unwrap();
    load_adapter(&mut model, &qlora_dir().join("adapter")).unwrap();
    let merged = merged_tensors(&model).unwrap();
    let original: HashMap<String, &Tensor> = plain
        .linears()
        .into_iter()
        .map(|(n, l)| (n, l.weight.as_dense().unwrap()))
        .collect();
    let linears: HashMap<String, _> = model.linears().into_iter().collect();
    for module in [
        "model.layers.1.self_attn.q_proj",
        "model.layers.0.mlp.up_proj",
    ] {
        let dequantized = Nf4Matrix::quantize(original[module])
            .unwrap()
            .dequantize()
            .unwrap();
        let want = match &linears[module].adapter {
            Some(adapter) => (&dequantized + adapter.delta_weight().unwrap()).unwrap(),
            None => dequantized,
        };
        let got = &merged[&format!("{module}.weight")];
        assert_eq!(got.dtype(), DType::F32);
        assert_eq!(max_abs_diff(got, &want), 0.0, "{module}");
    }
    assert!(linears["model.layers.1.self_attn.q_proj"].adapter.is_some());
    assert!(linears["model.layers.0.mlp.up_proj"].adapter.is_none());
    // The head keeps its weight exactly.
    let head = &merged["lm_head.weight"];
    assert_eq!(max_abs_diff(head, original["lm_head"]), 0.0);
}

/// Phi-3's fused projections are quantized part by part (torchtune splits q/k/v and gate/up on
/// load and quantizes each): the NF4 `qkv_proj` equals q, k and v quantized apart, stacked.
#[test]
fn fused_projections_are_quantized_part_by_part() {
    let dir = fixtures().join("models/phi3/model");
    let mut model = load_model(&dir, DType::F32, &Device::Cpu).unwrap().0;
    let dense: HashMap<String, Tensor> = model
        .linears()
        .into_iter()
        .map(|(n, l)| (n, l.weight.as_dense().unwrap().clone()))
        .collect();
    model.quantize_base_nf4().unwrap();
    let c = model.config.clone();
    let (q, kv) = (
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
    );
    let i = c.intermediate_size;
    let linears: HashMap<String, _> = model.linears().into_iter().collect();
    for (module, split) in [
        ("model.layers.0.self_attn.qkv_proj", vec![q, kv, kv]),
        ("model.layers.1.mlp.gate_up_proj", vec![i, i]),
    ] {
        let BaseWeight::Nf4(nf4) = &linears[module].weight else {
            panic!("{module} is not NF4")
        };
        assert_eq!(nf4.segments().len(), split.len(), "{module}");
        let mut parts = Vec::new();
        let mut start = 0;
        for rows in split {
            let part = dense[module].narrow(0, start, rows).unwrap();
            parts.push(Nf4Matrix::quantize(&part).unwrap().dequantize().unwrap());
            start += rows;
        }
        let want = Tensor::cat(&parts, 0).unwrap();
        assert_eq!(
            max_abs_diff(&nf4.dequantize().unwrap(), &want),
            0.0,
            "{module}"
        );
    }
}

/// (case folder under tests/fixtures, the `model.layers.*` linear layers QLoRA quantizes) of the
/// 2026 families, each with its PEFT adapter and transformers' f32 LoRA loss (`lora_loss`).
const FAMILY_CASES: &[(&str, usize)] = &[
    // 3 DeltaNet layers × in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj; one
    // full-attention layer × q, k, v, o; 4 MLPs × gate, up, down.
    ("qwen3_5_lora/qwen3_5", 31),
    // The same attention; each MoE layer's 4 experts × 3 and its shared expert × 3 (the router
    // and the shared expert's gate stay dense).
    ("qwen3_5_lora/qwen3_5_moe", 79),
    // 3 fused DeltaNet layers × in_proj_qkvz, in_proj_ba, out_proj; 3 MoE layers and a dense MLP.
    ("qwen3_5_lora/qwen3_next", 61),
    // q, k, v, o of 3 layers: gpt-oss's router and fused experts are no linear modules.
    ("gpt_oss_lora/all_linear", 12),
    // MLA's projections, the dense MLP, the experts and shared experts (the routers stay dense).
    ("deepseek_lora/deepseek_v3", 72),
];

/// The adapter's loss and gradients on `model` (the case's rows, training mode).
fn adapter_loss_and_grads(
    mut model: CausalLm,
    case: &Path,
    g: &Value,
) -> (f64, Vec<(String, Tensor)>) {
    load_adapter(&mut model, &case.join("adapter")).unwrap();
    let params = trainable_parameters(&mut model).unwrap();
    set_training(&mut model, true);
    let ids: Vec<Vec<u32>> = serde_json::from_value(g["input_ids"].clone()).unwrap();
    let (b, t) = (ids.len(), ids[0].len());
    let ids = Tensor::from_vec(ids.concat(), (b, t), &Device::Cpu).unwrap();
    let logits = model
        .forward(&ids, &AttentionLayout::causal(b, t, 0), None)
        .unwrap();
    let loss = loss(&logits, &rows(&g["labels"]));
    let grads = loss.backward().unwrap();
    let grads = params
        .iter()
        .map(|(n, v)| {
            (
                n.clone(),
                grads
                    .get(v)
                    .unwrap_or_else(|| panic!("{n}: no gradient"))
                    .clone(),
            )
        })
        .collect();
    (loss.to_scalar::<f32>().unwrap() as f64, grads)
}

/// QLoRA on Qwen3.5 (dense, MoE), Qwen3-Next, gpt-oss and DeepSeek-V3: every linear layer of
/// the decoder layers but the routers is NF4, experts held as linear layers included (the rule of
/// torchtune's `qlora_*` builders); what is no linear layer stays dense (the DeltaNet's `conv1d`,
/// `A_log`, `dt_bias` and norms; gpt-oss's router, fused experts and sinks), the adapter's loss and gradients on that base equal those on the dense model with
/// the same weights NF4-round-tripped (1e-5 / 1e-4 relative), and the loss stays within NF4's
/// quantization of transformers' f32 LoRA loss (different, by under 5% on these tiny random
/// weights: 0.6–2.7% measured).
#[test]
fn new_families_train_qlora_on_an_nf4_base() {
    for &(case, layers) in FAMILY_CASES {
        let dir = fixtures().join(case);
        let g: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
                .unwrap();
        let base = fixtures().join(g["base"].as_str().unwrap());
        let load = || load_model(&base, DType::F32, &Device::Cpu).unwrap().0;
        let mut nf4 = load();
        let summary = nf4.quantize_base_nf4().unwrap();
        let mut dense_left = Vec::new();
        let mut round_trip = load();
        {
            let quantized: HashMap<String, Tensor> = nf4
                .linears()
                .into_iter()
                .filter_map(|(n, l)| match &l.weight {
                    BaseWeight::Nf4(q) => Some((n, q.dequantize().unwrap())),
                    _ => {
                        if n.starts_with("model.layers.") {
                            dense_left.push(n);
                        }
                        None
                    }
                })
                .collect();
            for (n, l) in round_trip.linears_mut() {
                if let Some(w) = quantized.get(&n) {
                    l.weight = BaseWeight::Dense(w.clone());
                }
            }
        }
        let (got, got_grads) = adapter_loss_and_grads(nf4, &dir, &g);
        let (want, want_grads) = adapter_loss_and_grads(round_trip, &dir, &g);
        let f32_loss = g["lora_loss"].as_f64().unwrap();
        println!(
            "{case}: {} ({} left dense: {dense_left:?}); QLoRA loss {got:.6}, NF4-round-tripped \
             dense {want:.6}, transformers f32 LoRA {f32_loss:.6}",
            summary.layers,
            dense_left.len()
        );
        assert_eq!(summary.layers, layers, "{case}: layers quantized");
        assert!(
            dense_left
                .iter()
                .all(|n| n.ends_with(".gate") || n.ends_with(".shared_expert_gate")),
            "{case}: left dense {dense_left:?}"
        );
        assert!(
            ((got - want) / want).abs() <= 1e-5,
            "{case}: loss {got} vs {want}"
        );
        for ((n, a), (_, b)) in got_grads.iter().zip(&want_grads) {
            let rel = rel_l2(a, b);
            assert!(rel <= 1e-4, "{case}: {n} gradient {rel:e}");
        }
        let gap = ((got - f32_loss) / f32_loss).abs();
        assert!(
            gap > 0.0 && gap < 0.05,
            "{case}: NF4 loss {got} vs f32 {f32_loss}"
        );
    }
}
