//! Sizes from data bounded by the model (issue 44 item 3): a row longer than the model's
//! positions, with no `max_seq_len` to cut it, is refused naming the file and row (a 200k-token
//! row on a 512-position model aborted allocating an 80 GB mask); with `tokenizer.max_seq_len`
//! the same data trains.

use crate::common::{run_recipe, text, tmpdir, write_config, TINY_LORA};

/// The tiny LoRA config on instruct rows, one row a step, one step.
const SETTINGS: &[&str] = &[
    "dataset._component_=torchtune.datasets.alpaca_dataset",
    "batch_size=1",
    "max_steps_per_epoch=1",
];

#[test]
fn a_row_longer_than_the_model_needs_max_seq_len() {
    let dir = tmpdir("bounds", "positions");
    let data = dir.join("rows.jsonl");
    // The llama3 fixture has 512 positions (its llama3 rope scaling: 8 × 64).
    let long = "many words of input text ".repeat(400);
    let rows = [
        serde_json::json!({"instruction": "Say hi.", "input": "", "output": "Hi."}),
        serde_json::json!({"instruction": "Summarize.", "input": long, "output": "Words."}),
    ];
    let lines: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
    std::fs::write(&data, lines.join("\n") + "\n").unwrap();
    let cfg = write_config(TINY_LORA, &dir, "llama3", &data);
    let out = run_recipe(
        "lora_finetune_single_device",
        &cfg,
        &dir.join("out"),
        SETTINGS,
        &dir,
        &[],
    );
    let msg = text(&out);
    assert!(!out.status.success(), "{msg}");
    assert!(
        msg.contains("rows.jsonl")
            && msg.contains("512 positions")
            && msg.contains("tokenizer.max_seq_len"),
        "{msg}"
    );
    let out = run_recipe(
        "lora_finetune_single_device",
        &cfg,
        &dir.join("out2"),
        &[SETTINGS, &["tokenizer.max_seq_len=64"]].concat(),
        &dir,
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
}

/// A synthetic model (`bench --shape`) has no checkpoint to bound its layers: `--layers` goes
/// through the machine check before anything is allocated.
#[test]
fn bench_refuses_a_synthetic_model_no_machine_holds() {
    let dir = tmpdir("bounds", "bench");
    let out = crate::common::ferrotune(
        &[
            "bench",
            "train",
            "--shape",
            "smollm2_135m",
            "--layers",
            "1000000000",
            "--steps",
            "1",
        ],
        &dir,
        &[],
    );
    let msg = text(&out);
    assert!(!out.status.success(), "{msg}");
    assert!(
        msg.contains("--layers 1000000000") && msg.contains("more than this machine has"),
        "{msg}"
    );
}
