//! Datasets: sources against HF `datasets`, split slicing against HF's `ReadInstruction`, every
//! builder's ids and labels against transformers (fixtures by scripts/make_dataset_fixtures.py),
//! packing, collation, shuffling and errors.

use crate::common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::{fixture_json, fixtures_dir, ids, real_tokenizer};
use ferrotune_data::dataset::{
    build_dataset, collate, default_pad_id, load_source, resolve_split, shuffled_order, Dataset,
    Row,
};
use ferrotune_data::ChatMessage;
use serde_json::{json, Value};

fn data_dir() -> PathBuf {
    fixtures_dir().join("datasets")
}

fn build(section: Value, tokenizer: &str) -> Dataset {
    build_dataset(&section, &real_tokenizer(tokenizer), &data_dir())
        .unwrap_or_else(|e| panic!("{section}: {e}"))
}

fn build_err(section: Value) -> String {
    match build_dataset(&section, &real_tokenizer("llama2"), &data_dir()) {
        Ok(d) => panic!("{section}: expected an error, got {} rows", d.rows.len()),
        Err(e) => e.to_string(),
    }
}

fn rows_of(section: Value) -> Vec<Value> {
    load_source(&section, &data_dir())
        .unwrap_or_else(|e| panic!("{section}: {e}"))
        .into_iter()
        .map(Value::Object)
        .collect()
}

fn as_rows(value: &Value) -> Vec<Value> {
    value.as_array().unwrap().clone()
}

/// Every source format and file layout reads the rows HF `load_dataset` reads.
#[test]
fn sources_read_what_hf_datasets_reads() {
    let hf = fixture_json("datasets/rows.json");
    let cases = [
        (
            "json_lines",
            json!({"source": "json", "data_files": "alpaca/data.jsonl"}),
        ),
        (
            "json_array",
            json!({"source": "json", "data_files": "alpaca/data_array.json"}),
        ),
        (
            "json_field",
            json!({"source": "json", "data_files": "alpaca/data_field.json", "field": "data"}),
        ),
        (
            "csv",
            json!({"source": "csv", "data_files": ["alpaca/data.csv"]}),
        ),
        ("parquet", json!({"source": "alpaca/data.parquet"})),
        ("text", json!({"source": "text", "data_files": "text.txt"})),
        (
            "mixed_parquet",
            json!({"source": "parquet", "data_files": "mixed.parquet"}),
        ),
        ("chat_parquet", json!({"source": "chat_openai.parquet"})),
        (
            "glob",
            json!({"source": "json", "data_files": "alpaca_parts/*.jsonl"}),
        ),
        ("folder", json!({"source": "alpaca_parts"})),
        (
            "split_folder",
            json!({"source": "alpaca_splits", "split": "validation"}),
        ),
        (
            "validation",
            json!({"source": "json", "split": "validation", "data_files": {
                "train": "alpaca_splits/train.jsonl", "validation": ["alpaca_splits/validation.jsonl"]}}),
        ),
        (
            "train+validation[:1]",
            json!({"source": "json", "split": "train + validation[:1]", "data_files": {
                "train": "alpaca_splits/train.jsonl", "validation": "alpaca_splits/validation.jsonl"}}),
        ),
    ];
    for (name, section) in cases {
        assert_eq!(rows_of(section), as_rows(&hf[name]), "{name}");
    }
    for (spec, expected) in hf["sliced"].as_object().unwrap() {
        let section = json!({"source": "json", "data_files": "alpaca/data.jsonl", "split": spec});
        assert_eq!(rows_of(section), as_rows(expected), "{spec}");
    }
    // The same data in every format: equal rows (CSV's empty field is null, as in HF).
    let jsonl = rows_of(json!({"source": "alpaca/data.jsonl"}));
    let csv = rows_of(json!({"source": "alpaca/data.csv"}));
    assert_eq!(jsonl.len(), 7);
    for (a, b) in jsonl.iter().zip(&csv) {
        for (k, v) in a.as_object().unwrap() {
            let expected = if v == "" { Value::Null } else { v.clone() };
            assert_eq!(b[k], expected, "{k}");
        }
    }
}

/// The same rows from every format and layout build the same token rows.
#[test]
fn every_format_builds_the_same_dataset() {
    let sources = [
        json!({"source": "json", "data_files": "alpaca/data.jsonl"}),
        json!({"source": "json", "data_files": "alpaca/data_array.json"}),
        json!({"source": "json", "data_files": "alpaca/data_field.json", "field": "data"}),
        json!({"source": "csv", "data_files": "alpaca/data.csv"}),
        json!({"source": "parquet", "data_files": "alpaca/data.parquet"}),
        json!({"source": "alpaca/data.parquet"}),
        json!({"source": "alpaca_parts"}),
        json!({"source": "json", "data_files": ["alpaca_parts/part-0.jsonl", "alpaca_parts/part-1.jsonl"]}),
        json!({"source": "json", "split": "train+validation",
               "data_files": {"train": "alpaca_splits/train.jsonl", "validation": "alpaca_splits/validation.jsonl"}}),
    ];
    for tok in ["llama2", "qwen3"] {
        let mut first: Option<Vec<Row>> = None;
        for source in &sources {
            let mut section = source.clone();
            section["_component_"] = json!("torchtune.datasets.alpaca_dataset");
            let rows = build(section, tok).rows;
            assert_eq!(rows.len(), 7, "{source}");
            match &first {
                None => first = Some(rows),
                Some(f) => assert_eq!(&rows, f, "{tok}: {source}"),
            }
        }
    }
}

/// Split strings resolve to HF `ReadInstruction.to_absolute` ranges, percent rounding included.
#[test]
fn split_slicing_matches_hf() {
    let cases = fixture_json("datasets/splits.json");
    let mut checked = 0;
    for case in cases.as_array().unwrap() {
        let spec = case["spec"].as_str().unwrap();
        let sizes: BTreeMap<String, usize> = serde_json::from_value(case["sizes"].clone()).unwrap();
        let ours = resolve_split(spec, &sizes);
        match &case["ranges"] {
            Value::String(hf_error) => {
                assert!(
                    ours.is_err(),
                    "{spec} {sizes:?}: HF fails ({hf_error}), we gave {ours:?}"
                )
            }
            ranges => {
                let ours = ours.unwrap_or_else(|e| panic!("{spec} {sizes:?}: {e}"));
                let expected: Vec<(String, usize, usize)> =
                    serde_json::from_value(ranges.clone()).unwrap();
                assert_eq!(ours.len(), expected.len(), "{spec}");
                for ((name, range), (hf_name, from, to)) in ours.iter().zip(&expected) {
                    assert_eq!(name, hf_name, "{spec}");
                    // HF keeps from > to (an empty slice); ours is the empty from..from.
                    assert_eq!(*range, *from..(*to).max(*from), "{spec} {sizes:?}");
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 150, "{checked}");
    // Python's round() ties to even: 25% of 10 is 2.5 → 2; 15% of 10 is 1.5 → 2; 5% of 10 → 0.
    let n = BTreeMap::from([("train".to_string(), 10usize)]);
    assert_eq!(resolve_split("train[:25%]", &n).unwrap()[0].1, 0..2);
    assert_eq!(resolve_split("train[:15%]", &n).unwrap()[0].1, 0..2);
    assert_eq!(resolve_split("train[:5%]", &n).unwrap()[0].1, 0..0);
    assert_eq!(resolve_split("train[35%:]", &n).unwrap()[0].1, 4..10);
}

/// Each builder's ids and labels against transformers' tokenizers and chat templates.
#[test]
fn builders_match_transformers() {
    let cases = fixture_json("datasets/expected.json");
    let mut checked = 0;
    for (case, spec) in cases.as_object().unwrap() {
        for (tok, expected) in spec["expected"].as_object().unwrap() {
            let rows = build(spec["section"].clone(), tok).rows;
            let expected = expected.as_array().unwrap();
            assert_eq!(rows.len(), expected.len(), "{case} {tok}");
            for (i, (row, want)) in rows.iter().zip(expected).enumerate() {
                assert_eq!(
                    row.input_ids,
                    ids(&want["input_ids"]),
                    "{case} {tok} row {i} ids"
                );
                let labels: Vec<i64> = serde_json::from_value(want["labels"].clone()).unwrap();
                assert_eq!(row.labels, labels, "{case} {tok} row {i} labels");
                assert!(row.seq_lens.is_empty() && row.padding == 0);
                checked += 1;
            }
        }
    }
    assert!(checked > 150, "{checked}");
    // The cases the brief names are all there, for both kinds of tokenizer.
    for case in [
        "alpaca_default",
        "alpaca_masked",
        "instruct_summarize_masked",
        "instruct_summarize_train_on_input",
        "chat_openai",
        "chat_sharegpt",
    ] {
        for tok in ["qwen3", "llama2"] {
            assert!(cases[case]["expected"][tok].is_array(), "{case} {tok}");
        }
    }
}

/// With a chat template, the prompt part (rendered with the generation prompt) and the labelled
/// rest concatenate to exactly the whole conversation's ids.
#[test]
fn prompt_and_response_concatenate_to_the_whole_conversation() {
    let samsum: Vec<Value> = std::fs::read_to_string(data_dir().join("samsum.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for name in ["qwen3", "llama3_1", "gemma3"] {
        let tok = real_tokenizer(name);
        let rows = build(
            json!({"_component_": "samsum_dataset", "source": "samsum.jsonl"}),
            name,
        )
        .rows;
        for (row, data) in rows.iter().zip(&samsum) {
            let prompt = format!(
                "Summarize this dialogue:\n{}\n---\nSummary:\n",
                data["dialogue"].as_str().unwrap()
            );
            let user = vec![ChatMessage::new("user", prompt)];
            let mut all = user.clone();
            all.push(ChatMessage::new(
                "assistant",
                data["summary"].as_str().unwrap(),
            ));
            let head = tok.encode_chat(&user, true).unwrap();
            let whole = tok.encode_chat(&all, false).unwrap();
            assert_eq!(row.input_ids, whole, "{name}");
            let n = row.labels.iter().take_while(|&&l| l == -100).count();
            assert_eq!(
                n,
                head.len(),
                "{name}: the labels start where the prompt ends"
            );
            assert_eq!(&whole[..n], &head[..], "{name}");
            let rest: Vec<i64> = whole[n..].iter().map(|&t| t as i64).collect();
            assert_eq!(&row.labels[n..], &rest[..], "{name}");
            let summary = data["summary"].as_str().unwrap();
            assert!(tok.decode(&whole[n..], false).unwrap().contains(summary));
        }
    }
}

/// Packed rows: exactly max_seq_len long, seq_lens summing to it, samples in order and equal to
/// the unpacked ones, the first label of each sample -100, padding with pad id and -100.
#[test]
fn packing_invariants() {
    for (tok_name, max) in [("llama2", 160usize), ("qwen3", 96)] {
        let tok = real_tokenizer(tok_name);
        let pad = default_pad_id(&tok);
        let base = json!({"_component_": "alpaca_dataset", "source": "alpaca/data.jsonl",
                          "max_seq_len": max});
        let unpacked = build(base.clone(), tok_name).rows;
        let mut packed_section = base.clone();
        packed_section["packed"] = json!(true);
        let packed = build(packed_section, tok_name).rows;
        assert!(packed.len() < unpacked.len(), "{tok_name}: packing packs");
        let mut samples = Vec::new();
        for row in &packed {
            assert_eq!(row.input_ids.len(), max);
            assert_eq!(row.labels.len(), max);
            assert_eq!(row.seq_lens.iter().sum::<usize>(), max);
            let real = row.seq_lens.len() - usize::from(row.padding > 0);
            if row.padding > 0 {
                assert_eq!(*row.seq_lens.last().unwrap(), row.padding);
                assert!(row.input_ids[max - row.padding..].iter().all(|&t| t == pad));
                assert!(row.labels[max - row.padding..].iter().all(|&l| l == -100));
            }
            let mut start = 0;
            for &len in &row.seq_lens[..real] {
                assert!(len > 0);
                // No target crosses into a sample from the one before it.
                assert_eq!(
                    row.labels[start], -100,
                    "{tok_name}: first label of a sample"
                );
                samples.push((
                    row.input_ids[start..start + len].to_vec(),
                    row.labels[start..start + len].to_vec(),
                ));
                start += len;
            }
        }
        // Greedy: a row is closed only when the next sample does not fit.
        let mut si = 0;
        for (r, row) in packed.iter().enumerate() {
            let real = row.seq_lens.len() - usize::from(row.padding > 0);
            si += real;
            if r + 1 < packed.len() {
                assert!(
                    row.padding < unpacked[si].input_ids.len(),
                    "{tok_name}: greedy"
                );
            }
        }
        assert_eq!(samples.len(), unpacked.len());
        for ((ids, labels), u) in samples.iter().zip(&unpacked) {
            assert_eq!(ids, &u.input_ids);
            assert_eq!(&labels[1..], &u.labels[1..]);
        }
        // Collation: positions restart at each sample, segments number samples, padding is
        // invalid and its own segment.
        let refs: Vec<&Row> = packed.iter().collect();
        let batch = collate(&refs, pad);
        let segments = batch.segments.as_ref().expect("packed rows have segments");
        for (b, row) in packed.iter().enumerate() {
            let mut t = 0;
            for (s, &len) in row.seq_lens.iter().enumerate() {
                for p in 0..len {
                    assert_eq!(batch.positions[b][t], p as u32);
                    assert_eq!(segments[b][t], s as u32);
                    let is_pad = row.padding > 0 && s == row.seq_lens.len() - 1;
                    assert_eq!(batch.valid[b][t], !is_pad);
                    t += 1;
                }
            }
            assert_eq!(t, max);
        }
    }
    // A sample longer than max_seq_len is truncated into a row of its own.
    let rows = build(
        json!({"_component_": "alpaca_dataset", "source": "alpaca/data.jsonl",
               "max_seq_len": 24, "packed": true}),
        "llama2",
    )
    .rows;
    assert_eq!(rows.len(), 7);
    assert!(rows
        .iter()
        .all(|r| r.seq_lens == vec![24] && r.padding == 0));
}

/// Collation of unpacked rows of different lengths.
#[test]
fn collate_pads_right() {
    let a = Row::new(vec![5, 6, 7], vec![-100, 6, 7]);
    let b = Row::new(vec![8], vec![8]);
    let batch = collate(&[&a, &b], 0);
    assert_eq!(batch.input_ids, vec![vec![5, 6, 7], vec![8, 0, 0]]);
    assert_eq!(batch.labels, vec![vec![-100, 6, 7], vec![8, -100, -100]]);
    assert_eq!(batch.positions, vec![vec![0, 1, 2], vec![0, 1, 2]]);
    assert_eq!(batch.segments, None);
    assert_eq!(batch.valid, vec![vec![true; 3], vec![true, false, false]]);

    // A packed row beside a shorter unpacked one: segments for both, padding its own segment.
    let packed = Row {
        input_ids: vec![1, 2, 3, 4, 9],
        labels: vec![-100, 2, -100, 4, -100],
        seq_lens: vec![2, 2, 1],
        padding: 1,
        start_position: 0,
    };
    let short = Row::new(vec![7, 8], vec![7, 8]);
    let batch = collate(&[&packed, &short], 9);
    // The unpacked row is one sample whose positions keep counting into its padding.
    assert_eq!(
        batch.positions,
        vec![vec![0, 1, 0, 1, 0], vec![0, 1, 2, 3, 4]]
    );
    assert_eq!(
        batch.segments,
        Some(vec![vec![0, 0, 1, 1, 2], vec![0, 0, 1, 1, 1]])
    );
    assert_eq!(
        batch.valid,
        vec![
            vec![true, true, true, true, false],
            vec![true, true, false, false, false]
        ]
    );
    assert_eq!(batch.input_ids[1], vec![7, 8, 9, 9, 9]);
    assert_eq!(batch.labels[1], vec![7, 8, -100, -100, -100]);
}

/// `tokenized_dataset`, split slicing and truncation on pre-tokenized rows; a list of sections
/// concatenates.
#[test]
fn tokenized_rows_and_concatenation() {
    let rows = build(
        json!({"_component_": "tokenized_dataset", "source": "json",
               "data_files": "tokenized.jsonl", "split": "train[1:]", "max_seq_len": 4}),
        "qwen3",
    )
    .rows;
    assert_eq!(
        rows,
        vec![
            Row::new(vec![5, 6], vec![5, 6]),
            Row::new(vec![7, 8, 9, 10], vec![-100, 8, 9, 10]),
        ]
    );
    let both = build(
        json!([
            {"_component_": "tokenized_dataset", "source": "tokenized.jsonl", "split": "train[:1]"},
            {"_component_": "tokenized_dataset", "source": "tokenized.jsonl", "split": "train[-1:]",
             "packed": true, "max_seq_len": 8},
        ]),
        "qwen3",
    )
    .rows;
    assert_eq!(both.len(), 2);
    assert_eq!(both[0], Row::new(vec![1, 2, 3, 4], vec![-100, -100, 3, 4]));
    let pad = default_pad_id(&real_tokenizer("qwen3"));
    assert_eq!(
        both[1],
        Row {
            input_ids: vec![7, 8, 9, 10, 11, 12, pad, pad],
            labels: vec![-100, 8, 9, 10, 11, 12, -100, -100],
            seq_lens: vec![6, 2],
            padding: 2,
            start_position: 0,
        }
    );
}

/// Token ids past the vocabulary of the model a tokenizer feeds are refused while the data is
/// read (issue 44): a pre-tokenized row names the file, the line, the id and the vocabulary
/// size; text whose tokens the model cannot embed names the token and both sizes. Before, the
/// rows loaded and failed as an index error in the embedding.
#[test]
fn ids_past_the_models_vocabulary_are_refused() {
    let mut tok = real_tokenizer("qwen3");
    let dir = temp_sources(&[(
        "past-vocab.jsonl",
        json!([{"input_ids": [1, 2]}, {"input_ids": [3, 4, 150000]}]),
    )]);
    let section = json!({"_component_": "tokenized_dataset", "source": "json",
                         "data_files": "past-vocab.jsonl"});
    assert_eq!(build_dataset(&section, &tok, &dir).unwrap().rows.len(), 2);
    tok.feed_model(150000);
    let err = build_dataset(&section, &tok, &dir).unwrap_err().to_string();
    assert!(
        err.contains(
            "past-vocab.jsonl:2: 'input_ids' holds the id 150000 (position 3), past \
                      the model's vocabulary of 150000 tokens"
        ),
        "{err}"
    );
    let text = "The quick brown fox jumps over the lazy dog";
    let ids = real_tokenizer("qwen3").encode(text, false).unwrap();
    let rows = *ids.iter().max().unwrap() as usize;
    tok.feed_model(rows + 1);
    assert_eq!(tok.encode(text, false).unwrap(), ids);
    tok.feed_model(rows);
    let err = tok.encode(text, false).unwrap_err().to_string();
    assert!(
        err.contains(&format!(
            "is past the model's vocabulary (vocab_size {rows})"
        )) && err.contains(&format!("the tokenizer has {} tokens", tok.vocab_size())),
        "{err}"
    );
}

/// The shuffle is a permutation, repeatable, different per epoch and seed, and unbiased enough.
#[test]
fn shuffled_order_is_a_seeded_permutation() {
    let order = shuffled_order(1000, 42, 0);
    let mut sorted = order.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
    assert_eq!(order, shuffled_order(1000, 42, 0));
    assert_ne!(order, shuffled_order(1000, 42, 1));
    assert_ne!(order, shuffled_order(1000, 43, 0));
    assert_ne!(order, (0..1000).collect::<Vec<_>>());
    assert!(shuffled_order(0, 1, 0).is_empty());
    assert_eq!(shuffled_order(1, 1, 0), vec![0]);
    // Where element 0 lands over many seeds: each of 4 slots about a quarter of the time.
    let mut counts = [0usize; 4];
    for seed in 0..4000 {
        counts[shuffled_order(4, seed, 0)
            .iter()
            .position(|&i| i == 0)
            .unwrap()] += 1;
    }
    assert!(
        counts.iter().all(|&c| (850..1150).contains(&c)),
        "{counts:?}"
    );
}

/// Bad configurations and data give one clear message naming what is wrong.
#[test]
fn errors_name_the_problem() {
    let cases = [
        (
            json!({"_component_": "instruct_dataset", "source": "json",
                   "data_files": "alpaca/data.jsonl", "column_map": {"input": "question", "output": "output"}}),
            vec![
                "column 'question'",
                "alpaca/data.jsonl",
                "input",
                "instruction",
                "output",
            ],
        ),
        (
            json!({"_component_": "samsum_dataset", "source": "alpaca/data.csv"}),
            vec!["column 'dialogue'", "alpaca/data.csv"],
        ),
        (
            json!({"_component_": "alpaca_dataset", "source": "alpaca/data.jsonl", "split": "train[:10"}),
            vec!["bad split 'train[:10'"],
        ),
        (
            json!({"_component_": "alpaca_dataset", "source": "alpaca/data.jsonl", "split": "train[a:b]"}),
            vec!["bad split", "'a'"],
        ),
        (
            json!({"_component_": "alpaca_dataset", "source": "alpaca/data.jsonl", "split": "train[:150%]"}),
            vec!["bad split", "percent"],
        ),
        (
            json!({"_component_": "alpaca_dataset", "source": "alpaca/data.jsonl", "split": "test"}),
            vec!["unknown split 'test'", "available: train"],
        ),
        (
            json!({"_component_": "alpaca_dataset", "source": "alpaca/data.jsonl", "packed": true}),
            vec!["packed", "max_seq_len"],
        ),
        (
            json!({"_component_": "alpaca_dataset", "source": "json", "data_files": "nope.jsonl"}),
            vec!["nope.jsonl", "does not exist"],
        ),
        (
            json!({"_component_": "torchtune.datasets.bogus_dataset", "source": "x.json"}),
            vec!["unknown dataset _component_ 'torchtune.datasets.bogus_dataset'"],
        ),
        (
            json!({"_component_": "chat_dataset", "source": "chat_openai.jsonl"}),
            vec!["conversation_style"],
        ),
        (
            json!({"_component_": "chat_dataset", "source": "chat_openai.jsonl",
                   "conversation_style": "sharegpt"}),
            vec!["column 'conversations'", "chat_openai.jsonl"],
        ),
        (
            json!({"_component_": "chat_dataset", "source": "chat_sharegpt.json",
                   "conversation_style": "sharegpt", "conversation_column": "conversations",
                   "split": "train", "filter_fn": "my.filter"}),
            vec!["filter_fn"],
        ),
        (
            json!({"_component_": "instruct_dataset", "source": "json", "data_files": "qa.jsonl",
                   "template": "torchtune.data.NoSuchTemplate"}),
            vec!["NoSuchTemplate"],
        ),
        (
            json!({"_component_": "text_completion_dataset", "source": "json",
                   "data_files": "alpaca/data.json"}),
            vec!["alpaca/data.json", "does not exist"],
        ),
        (
            json!({"_component_": "instruct_dataset", "source": "csv",
                   "data_files": "alpaca/data.csv",
                   "column_map": {"input": "instruction", "output": "input"}}),
            vec!["alpaca/data.csv:2", "column 'input'", "null"],
        ),
        (
            json!({"_component_": "text_completion_dataset", "source": "json",
                   "data_files": "tokenized.jsonl", "column": "input_ids"}),
            vec!["tokenized.jsonl:1", "column 'input_ids'", "text"],
        ),
    ];
    for (section, needles) in cases {
        let message = build_err(section.clone());
        for needle in needles {
            assert!(
                message.contains(needle),
                "{section}: {message:?} lacks {needle:?}"
            );
        }
    }
}

/// torchtune's preference builders tokenize each side exactly as the SFT builders tokenize the
/// same conversation (those are checked against transformers above): `preference_dataset`
/// (message lists, with `column_map` and `new_system_prompt`) as `chat_dataset`,
/// `stack_exchange_paired_dataset` (question / response_j / response_k) as `instruct_dataset`;
/// `max_seq_len` truncates alike. Pairs and sequences are refused by each other's builders.
#[test]
fn preference_builders_tokenize_each_side_as_the_sft_builders() {
    use ferrotune_data::dataset::build_preference_dataset;
    let dir = std::env::temp_dir().join(format!("ferrotune-pref-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let chats: Vec<Value> = std::fs::read_to_string(data_dir().join("chat_openai.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let worse = |conv: &Value| {
        let mut messages = conv["messages"].as_array().unwrap().clone();
        let last = messages.len() - 1;
        messages[last]["content"] = json!("I would rather not say.");
        json!({ "messages": messages })
    };
    let write = |name: &str, rows: Vec<Value>| {
        let path = dir.join(name);
        let text: Vec<String> = rows.iter().map(Value::to_string).collect();
        std::fs::write(&path, text.join("\n") + "\n").unwrap();
        path.display().to_string()
    };
    let pairs_file = write(
        "pairs.jsonl",
        chats
            .iter()
            .map(|c| json!({"good": c["messages"], "bad": worse(c)["messages"]}))
            .collect(),
    );
    let chosen_file = write("chosen.jsonl", chats.clone());
    let rejected_file = write("rejected.jsonl", chats.iter().map(worse).collect());
    for tok in ["qwen3", "llama2"] {
        let tokenizer = real_tokenizer(tok);
        for extra in [
            json!({}),
            json!({"max_seq_len": 12, "new_system_prompt": "Be kind."}),
        ] {
            let with = |mut section: Value| {
                for (k, v) in extra.as_object().unwrap() {
                    section[k] = v.clone();
                }
                section
            };
            let pairs = build_preference_dataset(
                &with(
                    json!({"_component_": "torchtune.datasets.preference_dataset",
                    "source": pairs_file, "column_map": {"chosen": "good", "rejected": "bad"}}),
                ),
                &tokenizer,
                &dir,
            )
            .unwrap();
            let chat = |file: &str| {
                build(
                    with(json!({"_component_": "chat_dataset", "source": file,
                        "conversation_style": "openai"})),
                    tok,
                )
                .rows
            };
            let (chosen, rejected) = (chat(&chosen_file), chat(&rejected_file));
            assert_eq!(pairs.len(), chats.len());
            for (i, pair) in pairs.iter().enumerate() {
                assert_eq!(pair.chosen, chosen[i], "{tok} {extra} pair {i} chosen");
                assert_eq!(
                    pair.rejected, rejected[i],
                    "{tok} {extra} pair {i} rejected"
                );
                if extra.get("max_seq_len").is_none() {
                    assert_ne!(pair.chosen.input_ids, pair.rejected.input_ids);
                }
            }
        }

        let qa = write(
            "stack.jsonl",
            vec![
                json!({"question": "Why is the sky blue?", "response_j": "Rayleigh scattering.",
                "response_k": "Because it is."}),
            ],
        );
        let pairs = build_preference_dataset(
            &json!({"_component_": "stack_exchange_paired_dataset", "source": qa}),
            &tokenizer,
            &dir,
        )
        .unwrap();
        for (side, column) in [
            (&pairs[0].chosen, "response_j"),
            (&pairs[0].rejected, "response_k"),
        ] {
            let want = build(
                json!({"_component_": "instruct_dataset", "source": qa,
                    "column_map": {"input": "question", "output": column}}),
                tok,
            )
            .rows;
            assert_eq!(side, &want[0], "{tok} stack_exchange_paired {column}");
        }
    }

    let tokenizer = real_tokenizer("llama2");
    let err = |section: Value| {
        build_preference_dataset(&section, &tokenizer, &dir)
            .unwrap_err()
            .to_string()
    };
    assert!(
        err(json!({"_component_": "chat_dataset", "source": chosen_file,
            "conversation_style": "openai"}))
        .contains("gives single sequences"),
    );
    assert!(err(
        json!({"_component_": "preference_dataset", "source": pairs_file,
        "packed": true})
    )
    .contains("packed"));
    assert!(
        err(json!({"_component_": "preference_dataset", "source": pairs_file}))
            .contains("'chosen'")
    );
    assert!(
        build_err(json!({"_component_": "preference_dataset", "source": pairs_file}))
            .contains("only the DPO recipes")
    );
}

/// Text completion against torchtune 0.6.1's own `text_completion_dataset` + `PackedDataset`
/// (scripts/make_packing_fixtures.py): a text keeps `max_seq_len - 1` tokens; packed rows have
/// torchtune's tokens, `seq_lens` and positions, with `split_across_pack` (the default) and
/// without. Labels are torchtune's except at the first token of each sample, which is -100 here
/// (transformers' `DataCollatorWithFlattening` convention: no target crosses between samples).
#[test]
fn text_completion_packing_matches_torchtune() {
    let cases = fixture_json("datasets/torchtune_packing.json");
    let mut packs_checked = 0;
    for (case, spec) in cases.as_object().unwrap() {
        for (tok_name, expected) in spec["expected"].as_object().unwrap() {
            let rows = build(spec["section"].clone(), tok_name).rows;
            let expected = expected.as_array().unwrap();
            assert_eq!(rows.len(), expected.len(), "{case} {tok_name}: rows");
            if !spec["section"]["packed"].as_bool().unwrap_or(false) {
                for (row, want) in rows.iter().zip(expected) {
                    assert_eq!(row.input_ids, ids(&want["tokens"]), "{case} {tok_name}");
                    let labels: Vec<i64> = serde_json::from_value(want["labels"].clone()).unwrap();
                    assert_eq!(row.labels, labels, "{case} {tok_name}");
                }
                continue;
            }
            let refs: Vec<&Row> = rows.iter().collect();
            let batch = collate(&refs, default_pad_id(&real_tokenizer(tok_name)));
            for (b, (row, want)) in rows.iter().zip(expected).enumerate() {
                let at = format!("{case} {tok_name} row {b}");
                let seq_lens: Vec<usize> =
                    serde_json::from_value(want["seq_lens"].clone()).unwrap();
                assert_eq!(row.seq_lens, seq_lens, "{at}: seq_lens");
                let real = row.input_ids.len() - row.padding;
                let tokens = ids(&want["tokens"]);
                assert_eq!(row.input_ids[..real], tokens[..real], "{at}: tokens");
                let labels: Vec<i64> = serde_json::from_value(want["labels"].clone()).unwrap();
                let input_pos: Vec<u32> =
                    serde_json::from_value(want["input_pos"].clone()).unwrap();
                assert_eq!(
                    batch.positions[b][..real],
                    input_pos[..real],
                    "{at}: positions"
                );
                for t in 0..row.input_ids.len() {
                    let want_label = if t < real && input_pos[t] == 0 {
                        -100
                    } else {
                        labels[t]
                    };
                    assert_eq!(row.labels[t], want_label, "{at}: label {t}");
                }
                packs_checked += 1;
            }
        }
    }
    assert!(packs_checked >= 12, "{packs_checked}");
    // The fixtures do split samples across rows (a row starting mid-sample).
    let split = build(cases["packed_split"]["section"].clone(), "llama2").rows;
    assert!(split.iter().any(|r| r.start_position > 0));
}

/// A folder of one-file sources for the builders whose default columns differ.
fn temp_sources(rows: &[(&str, Value)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotune-datasets-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, value) in rows {
        let lines: Vec<String> = value
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.to_string())
            .collect();
        std::fs::write(dir.join(name), lines.join("\n") + "\n").unwrap();
    }
    dir
}

/// `slimorca_dataset` is ShareGPT chat through `column_map`; `wikitext_dataset` and
/// `cnn_dailymail_articles_dataset` are text completion of the `page` / `article` column.
#[test]
fn slimorca_wikitext_and_cnn_builders() {
    let convs = json!([
        {"chat": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},
                  {"from": "gpt", "value": "Hello."}]},
        {"chat": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
    ]);
    let texts = json!([{"page": "One page of text.", "article": "An article."},
                       {"page": "Another page, longer than the first one.", "article": "News."}]);
    let dir = temp_sources(&[("chat.jsonl", convs), ("texts.jsonl", texts)]);
    let tok = real_tokenizer("qwen3");
    let build_in = |section: Value| {
        build_dataset(&section, &tok, &dir).unwrap_or_else(|e| panic!("{section}: {e}"))
    };
    for train_on_input in [false, true] {
        let slimorca = build_in(json!({"_component_": "torchtune.datasets.slimorca_dataset",
            "source": "chat.jsonl", "column_map": {"conversations": "chat"},
            "train_on_input": train_on_input}));
        let chat = build_in(
            json!({"_component_": "chat_dataset", "source": "chat.jsonl",
            "conversation_style": "sharegpt", "conversation_column": "chat",
            "train_on_input": train_on_input}),
        );
        assert_eq!(slimorca.rows, chat.rows);
        assert_eq!(slimorca.rows.len(), 2);
    }
    for (component, column) in [
        ("wikitext_dataset", "page"),
        ("cnn_dailymail_articles_dataset", "article"),
    ] {
        let built = build_in(json!({"_component_": component, "source": "texts.jsonl",
                                    "max_seq_len": 6}));
        let plain = build_in(json!({"_component_": "text_completion_dataset",
            "source": "texts.jsonl", "column": column, "max_seq_len": 6}));
        assert_eq!(built.rows, plain.rows, "{component}");
        assert!(built.rows.iter().all(|r| r.input_ids.len() <= 5));
        let first = tok
            .encode(
                if column == "page" {
                    "One page of text."
                } else {
                    "An article."
                },
                false,
            )
            .unwrap();
        assert_eq!(built.rows[0].input_ids[..3], first[..3], "{component}");
    }
    // Errors name the key.
    let err = |section: Value| match build_dataset(&section, &tok, &dir) {
        Ok(_) => panic!("{section}: expected an error"),
        Err(e) => e.to_string(),
    };
    let e = err(
        json!({"_component_": "slimorca_dataset", "source": "chat.jsonl",
                       "column_map": {"messages": "chat"}}),
    );
    assert!(e.contains("'conversations'"), "{e}");
    let e = err(
        json!({"_component_": "chat_dataset", "source": "chat.jsonl",
        "conversation_style": "sharegpt", "conversation_column": "chat", "packed": true,
        "max_seq_len": 64, "split_across_pack": true}),
    );
    assert!(
        e.contains("split_across_pack") && e.contains("chat_dataset"),
        "{e}"
    );
    let e = err(
        json!({"_component_": "text_completion_dataset", "source": "texts.jsonl",
                       "column": "page", "subset": "wikitext-2-v1"}),
    );
    assert!(e.contains("'subset'"), "{e}");
    let e = err(
        json!({"_component_": "wikitext_dataset", "source": "texts.jsonl",
                       "subset": "wikitext-2-v1", "name": "wikitext-2-v1"}),
    );
    assert!(e.contains("not both"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// torchtune's GSM8K builders (`torchtune.dev.grpo.gsm8k`) on six rows with `partition: 1-2/4`
/// (rows 1, 2 and 5 kept): the GRPO problems (prompt ids, final answers) and the SFT rows, against
/// torchtune's module run with the tiny Llama's tokenizer (scripts/make_grpo_fixtures.py).
#[test]
fn gsm8k_builders_match_torchtune() {
    use ferrotune_data::dataset::build_reasoning_dataset;
    let want = fixture_json("grpo/golden.json")["gsm8k"].clone();
    let tok = ferrotune_data::Tokenizer::from_dir(fixtures_dir().join("llama3/model")).unwrap();
    let dir = fixtures_dir().join("grpo");
    let section = |component: &str| {
        json!({"_component_": component, "source": "json", "data_files": "gsm8k.jsonl",
               "partition": want["partition"]})
    };
    let problems = build_reasoning_dataset(
        &section("torchtune.dev.grpo.gsm8k.gsm8k_dataset"),
        &tok,
        &dir,
    )
    .unwrap();
    let expected = want["problems"].as_array().unwrap();
    assert_eq!(problems.len(), expected.len());
    for (got, w) in problems.iter().zip(expected) {
        assert_eq!(got.prompt_ids, ids(&w["prompt_ids"]));
        assert_eq!(got.answer, w["answer"].as_str().unwrap());
    }
    let sft = build_dataset(&section("torchtune.dev.grpo.gsm8k.gsm8k_sft"), &tok, &dir).unwrap();
    let expected = want["sft"].as_array().unwrap();
    assert_eq!(sft.rows.len(), expected.len());
    for (got, w) in sft.rows.iter().zip(expected) {
        assert_eq!(got.input_ids, ids(&w["input_ids"]));
        let labels: Vec<i64> = serde_json::from_value(w["labels"].clone()).unwrap();
        assert_eq!(got.labels, labels);
    }
    // Each builder belongs to its recipe, and the partition and the answer's layout are checked.
    let err = build_dataset(&section("gsm8k_dataset"), &tok, &dir).unwrap_err();
    assert!(err.to_string().contains("only the GRPO recipe"), "{err}");
    let mut bad = section("gsm8k_dataset");
    bad["partition"] = json!("1-2");
    let err = build_reasoning_dataset(&bad, &tok, &dir).unwrap_err();
    assert!(
        err.to_string().contains("expected start-end/total"),
        "{err}"
    );
    let err = build_reasoning_dataset(
        &json!({"_component_": "gsm8k_dataset", "source": "json",
                "data_files": "../datasets/qa.jsonl"}),
        &tok,
        &dir,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("qa.jsonl") && err.to_string().contains("'#### ' once"),
        "{err}"
    );
}

/// `prompt_dataset` (TRL's prompt-only rows for GRPO): a text prompt encoded as transformers'
/// tokenizer encodes it (its prefix, no EOS), a conversational one as
/// `apply_chat_template(messages, add_generation_prompt=True)` tokenizes it (ids from
/// transformers 5.24 on the tiny Llama's tokenizer); the other columns kept for the rewards, the
/// reference from `answer`.
#[test]
fn prompt_dataset_gives_text_and_chat_prompts_as_transformers() {
    use ferrotune_data::dataset::build_reasoning_dataset;
    let dir = ferrotune_testing::fresh_dir(&format!("ferrotune-prompts-{}", std::process::id()));
    let rows = [
        json!({"prompt": "Count to 3:", "answer": 3, "level": "easy"}),
        json!({"prompt": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Say hi."}], "answer": "hi"}),
    ];
    let text: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
    std::fs::write(dir.join("p.jsonl"), text.join("\n")).unwrap();
    let tok = ferrotune_data::Tokenizer::from_dir(fixtures_dir().join("llama3/model")).unwrap();
    let section =
        json!({"_component_": "prompt_dataset", "source": "json", "data_files": "p.jsonl"});
    let p = build_reasoning_dataset(&section, &tok, &dir).unwrap();
    assert_eq!(p[0].prompt_ids, vec![38, 279, 81, 87, 292, 224, 22, 29]);
    assert_eq!(
        p[1].prompt_ids,
        vec![
            1, 86, 92, 342, 72, 80, 202, 37, 72, 304, 305, 72, 73, 17, 2, 202, 1, 88, 86, 263, 202,
            54, 68, 92, 388, 76, 17, 2, 202, 1, 435, 86, 362, 401, 202
        ]
    );
    assert_eq!((p[0].answer.as_str(), p[1].answer.as_str()), ("3", "hi"));
    assert_eq!(p[0].messages, None);
    assert_eq!(p[1].messages, Some(rows[1]["prompt"].clone()));
    assert!(p[0].columns.get("prompt").is_none() && p[0].columns["level"] == "easy");
    let bad = json!({"_component_": "prompt_dataset", "source": "json", "data_files": "p.jsonl",
                     "column": "answer"});
    let e = build_reasoning_dataset(&bad, &tok, &dir)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("p.jsonl:1") && e.contains("text or its messages"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
