//! Packed batches through the model: the loss and the gradients of a packed row equal those of
//! the same samples unpacked (block-causal attention, positions restarting per sample, no target
//! across a sample boundary).

use std::path::Path;

use candle_core::Device;
use ferrotune_data::dataset::{build_dataset, collate, Row};
use ferrotune_data::Tokenizer;
use ferrotune_models::peft;
use ferrotune_models::CausalLm;
use ferrotune_train::step::{empty_grads, forward_backward, MicroBatch};

use crate::common;
use common::rel_l2;

use ferrotune_testing::fixtures;

#[test]
fn packed_loss_and_gradients_equal_unpacked() {
    let model_dir = fixtures().join("llama3/model");
    let tok = Tokenizer::from_dir(&model_dir).unwrap();
    let dir = std::env::temp_dir().join(format!("ferrotune-packing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("chat.jsonl");
    let rows: Vec<String> = [
        ("What is two plus two?", "Four."),
        ("Name a colour.", "Blue, like the sky on a clear day."),
        ("Say hi.", "Hi!"),
        ("Count to five.", "One, two, three, four, five."),
        ("Which is larger, 3 or 7?", "Seven is larger."),
    ]
    .iter()
    .map(|(q, a)| serde_json::json!({"question": q, "answer": a}).to_string())
    .collect();
    std::fs::write(&data, rows.join("\n")).unwrap();
    let section = |packed: bool| {
        serde_json::json!({
            "_component_": "instruct_dataset",
            "source": "json",
            "data_files": data.display().to_string(),
            "column_map": {"input": "question", "output": "answer"},
            "max_seq_len": 96,
            "packed": packed,
        })
    };
    let unpacked = build_dataset(&section(false), &tok, Path::new("."))
        .unwrap()
        .rows;
    let packed = build_dataset(&section(true), &tok, Path::new("."))
        .unwrap()
        .rows;
    assert!(
        packed.len() < unpacked.len(),
        "samples were packed together"
    );
    assert!(
        packed.iter().any(|r| r.seq_lens.len() > 2),
        "a row holds several samples"
    );

    let ckpt = ferrotune_models::read_checkpoint(&model_dir, candle_core::DType::F32, &Device::Cpu)
        .unwrap();
    let mut model = CausalLm::from_tensors(ckpt.config, ckpt.tensors, "llama3").unwrap();
    peft::load_adapter(&mut model, &fixtures().join("llama3/adapter")).unwrap();
    let params = peft::trainable_parameters(&mut model).unwrap();
    let pad = ferrotune_data::dataset::default_pad_id(&tok);

    let run = |rows: &[Row], checkpointing: bool| {
        let picked: Vec<&Row> = rows.iter().collect();
        let batch = MicroBatch::from_batch(&collate(&picked, pad), &Device::Cpu).unwrap();
        let mut grads = empty_grads().unwrap();
        let sum = forward_backward(&model, &batch, &params, &mut grads, checkpointing)
            .unwrap()
            .sum;
        (sum, batch.num_targets, grads)
    };
    let (sum_u, n_u, g_u) = run(&unpacked, false);
    for checkpointing in [false, true] {
        let (sum_p, n_p, g_p) = run(&packed, checkpointing);
        assert_eq!(n_p, n_u, "same number of targets");
        assert!(
            ((sum_p - sum_u) / sum_u).abs() < 1e-5,
            "packed loss {sum_p} vs unpacked {sum_u}"
        );
        for (name, v) in &params {
            let (a, b) = (g_p.get(v.as_tensor()), g_u.get(v.as_tensor()));
            let e = rel_l2(a.unwrap(), b.unwrap());
            assert!(
                e < 1e-4,
                "{name}: gradient differs packed vs unpacked ({e})"
            );
        }
    }
}
