//! Rows far longer than `max_seq_len` (issue 44: one 50 MB instruct row reached 12 GiB of memory
//! with `max_seq_len: 64`, tokenized whole before truncation): the texts are cut before
//! tokenizing, and the rows equal tokenizing them whole and truncating.

use std::path::{Path, PathBuf};

use crate::common::real_tokenizer;
use ferrotune_data::dataset::{build_dataset, build_dataset_within, Row};
use ferrotune_data::tokenizer::Tokenizer;
use serde_json::{json, Value};

/// Deterministic text of about `bytes` bytes: words, punctuation, digits, newlines, accented
/// and CJK characters, and runs without spaces (where a cut falls inside a word).
fn text(bytes: usize) -> String {
    const WORDS: [&str; 12] = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "über",
        "naïve",
        "日本語の",
        "1234567",
        "supercalifragilisticexpialidocious",
        "\n\n",
        "...",
    ];
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut s = String::with_capacity(bytes + 64);
    while s.len() < bytes {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
        if !x.is_multiple_of(5) {
            s.push(' ');
        }
    }
    s
}

fn folder(test: &str, rows: &[Value]) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("ferrotune-long-rows-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let lines: Vec<String> = rows.iter().map(Value::to_string).collect();
    std::fs::write(dir.join("rows.jsonl"), lines.join("\n") + "\n").unwrap();
    dir
}

fn rows(section: &Value, tok: &Tokenizer, dir: &Path) -> Vec<Row> {
    build_dataset(section, tok, dir)
        .unwrap_or_else(|e| panic!("{section}: {e}"))
        .rows
}

/// torchtune's truncation of a conversation, on rows tokenized whole.
fn truncate_sft(row: &Row, max: usize, eos: Option<u32>) -> (Vec<u32>, Vec<i64>) {
    let (mut ids, mut labels) = (row.input_ids.clone(), row.labels.clone());
    if ids.len() > max {
        ids.truncate(max);
        labels.truncate(max);
        if let Some(eos) = eos {
            ids[max - 1] = eos;
            if labels[max - 1] != -100 {
                labels[max - 1] = eos as i64;
            }
        }
    }
    (ids, labels)
}

/// Each builder kind (text completion, instruct with and without a chat template, chat) cuts a
/// long row as tokenizing it whole and truncating does, for short limits and long ones.
#[test]
fn cut_rows_equal_tokenizing_whole_then_truncating() {
    let long = text(60_000);
    let rows_in = vec![
        json!({"instruction": "Summarize.", "input": long, "output": "Short.", "text": long,
               "messages": [{"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": long}]}),
        json!({"instruction": long, "input": "", "output": "x", "text": "A short row.",
               "messages": [{"role": "user", "content": long},
                            {"role": "assistant", "content": "ok"}]}),
    ];
    let dir = folder("equal", &rows_in);
    for tok_name in ["qwen3", "llama2"] {
        let tok = real_tokenizer(tok_name);
        let eos = tok.eos_ids().first().copied();
        for component in ["alpaca_dataset", "text_completion_dataset", "chat_dataset"] {
            let mut section = json!({"_component_": component, "source": "json",
                                     "data_files": "rows.jsonl"});
            if component == "chat_dataset" {
                section["conversation_style"] = json!("openai");
                section["conversation_column"] = json!("messages");
            }
            let whole = rows(&section, &tok, &dir);
            for max in [2, 7, 64, 1000] {
                section["max_seq_len"] = json!(max);
                let cut = rows(&section, &tok, &dir);
                for (i, (c, w)) in cut.iter().zip(&whole).enumerate() {
                    let want = if component == "text_completion_dataset" {
                        let keep = w.input_ids.len().min(max - 1);
                        (w.input_ids[..keep].to_vec(), w.labels[..keep].to_vec())
                    } else {
                        truncate_sft(w, max, eos)
                    };
                    assert_eq!(
                        (c.input_ids.clone(), c.labels.clone()),
                        want,
                        "{tok_name} {component} max_seq_len {max} row {i}"
                    );
                }
            }
        }
    }
}

/// An 8 MB row with `max_seq_len: 64` gives the same 64 tokens as its first 60 kB do: only the
/// start of it is tokenized (tokenizing it whole takes gigabytes and tens of seconds).
#[test]
fn a_multi_megabyte_row_is_cut_before_tokenizing() {
    let long = text(60_000);
    let mut huge = long.clone();
    huge.push_str(&text(8 << 20));
    let section = |source: &str| {
        json!({"_component_": "alpaca_dataset", "source": "json", "data_files": source,
               "max_seq_len": 64})
    };
    let row = |input: &str| json!({"instruction": "Summarize.", "input": input, "output": "x"});
    let dir = folder("huge", &[row(&huge)]);
    std::fs::write(dir.join("short.jsonl"), row(&long).to_string() + "\n").unwrap();
    let tok = real_tokenizer("qwen3");
    // What is tokenized: a prefix proportional to the limit, not the 8 MB.
    let kept = tok.prefix_for_tokens(&huge, 65).unwrap();
    assert!(
        kept.len() < 1 << 20 && huge.starts_with(kept),
        "{}",
        kept.len()
    );
    let from_huge = rows(&section("rows.jsonl"), &tok, &dir);
    let from_start = rows(&section("short.jsonl"), &tok, &dir);
    assert_eq!(from_huge[0].input_ids.len(), 64);
    assert_eq!(from_huge, from_start);
}

/// A row longer than the model's positions with no `max_seq_len` is an error naming its file
/// and row; with `max_seq_len` it is cut as usual.
#[test]
fn rows_past_the_model_positions_need_max_seq_len() {
    let long = text(20_000);
    let dir = folder(
        "positions",
        &[
            json!({"instruction": "Hi", "input": "", "output": "Hello"}),
            json!({"instruction": "Summarize.", "input": long, "output": "x"}),
        ],
    );
    let tok = real_tokenizer("qwen3");
    let mut section = json!({"_component_": "alpaca_dataset", "source": "json",
                             "data_files": "rows.jsonl"});
    let err = build_dataset_within(&section, &tok, &dir, Some(512))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rows.jsonl")
            && err.contains("512 positions")
            && err.contains("tokenizer.max_seq_len"),
        "{err}"
    );
    section["max_seq_len"] = json!(512);
    let built = build_dataset_within(&section, &tok, &dir, Some(512)).unwrap();
    assert_eq!(built.rows[1].input_ids.len(), 512);
}
