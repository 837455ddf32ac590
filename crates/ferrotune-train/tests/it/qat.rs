//! Quantization-aware training against torchao + transformers + PEFT
//! (scripts/make_qat_fixtures.py, `Int8DynActInt4WeightQATQuantizer`, group 32): the tiny Llama
//! with every linear fake-quantized (torchtune's `qat_distributed`): the loss and every
//! parameter's gradient; with its PEFT adapter and only the adapted layers' base product
//! fake-quantized (torchtune's `QATLoRALinear`, `qat_lora_finetune_distributed`): the loss and
//! every adapter gradient. With and without activation checkpointing.

use candle_core::{DType, Device, Tensor};
use ferrotune_models::{load_adapter, load_model, AttentionLayout, CausalLm, FakeQuant};
use ferrotune_train::step::{empty_grads, forward_backward, MicroBatch};

use crate::common;
use common::{json, rel_l2};

use ferrotune_testing::fixtures;

fn golden_batch() -> MicroBatch {
    let g = json(fixtures().join("llama3/golden.json"));
    let ids: Vec<Vec<u32>> = serde_json::from_value(g["input_ids"].clone()).unwrap();
    let labels: Vec<Vec<i64>> = serde_json::from_value(g["labels"].clone()).unwrap();
    let (b, t) = (ids.len(), ids[0].len());
    MicroBatch {
        input_ids: Tensor::from_vec(ids.concat(), (b, t), &Device::Cpu).unwrap(),
        num_targets: labels
            .iter()
            .map(|r| r.iter().skip(1).filter(|&&l| l != -100).count())
            .sum(),
        labels: Tensor::from_vec(labels.concat(), (b, t), &Device::Cpu).unwrap(),
        layout: AttentionLayout::causal(b, t, 0),
        num_tokens: b * t,
        distill: None,
        preference: None,
        aux_loss_weight: None,
        layer_skip: None,
        reward: None,
    }
}

fn fake_quantize(model: &mut CausalLm, only_adapted: bool, group_size: usize) -> usize {
    let mut n = 0;
    for (_, linear) in model.linears_mut() {
        if !only_adapted || linear.adapter.is_some() {
            linear.fake_quant = Some(FakeQuant {
                group_size,
                enabled: true,
                quantize_weight: true,
            });
            n += 1;
        }
    }
    n
}

#[test]
fn qat_losses_and_gradients_match_torchao() {
    let want = json(fixtures().join("qat/golden.json"));
    let group = want["group_size"].as_u64().unwrap() as usize;
    let batch = golden_batch();
    let n = batch.num_targets as f64;
    for (case, lora) in [("full", false), ("lora", true)] {
        let mut model = load_model(&fixtures().join("llama3/model"), DType::F32, &Device::Cpu)
            .unwrap()
            .0;
        let params = if lora {
            load_adapter(&mut model, &fixtures().join("llama3/adapter")).unwrap();
            ferrotune_models::lora::set_training(&mut model, true);
            ferrotune_models::peft::trainable_parameters(&mut model).unwrap()
        } else {
            model.make_all_trainable().unwrap()
        };
        let swapped = fake_quantize(&mut model, lora, group);
        if !lora {
            let names = want["full"]["fake_quantized"].as_array().unwrap();
            assert_eq!(swapped, names.len());
        }
        let ref_grads = candle_core::safetensors::load(
            fixtures().join(format!("qat/{case}_grads.safetensors")),
            &Device::Cpu,
        )
        .unwrap();
        for checkpointing in [false, true] {
            let mut grads = empty_grads().unwrap();
            let step =
                forward_backward(&model, &batch, &params, &mut grads, checkpointing).unwrap();
            let (got, w) = (step.sum / n, want[case]["loss"].as_f64().unwrap());
            assert!(
                ((got - w) / w).abs() < 1e-5,
                "{case} (checkpointing {checkpointing}): loss {got} vs {w}"
            );
            assert_eq!(params.len(), ref_grads.len(), "{case}: parameter count");
            for (name, var) in &params {
                let g = (grads.get(var.as_tensor()).unwrap() / n).unwrap();
                let e = rel_l2(&g, &ref_grads[name]);
                assert!(
                    e < 1e-4,
                    "{case} ckpt={checkpointing}: {name}: relative L2 {e}"
                );
            }
        }
    }
}
