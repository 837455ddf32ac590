//! Preference pairs tokenized for ORPO, CPO and SimPO ([`PairTokenization::Orpo`]) against the
//! batches TRL 1.16.0's `ORPOTrainer` and `CPOTrainer` collated in their own `train()` step
//! (tests/fixtures/orpo_trainer, scripts/make_orpo_trainer_fixtures.py): text rows
//! (`stack_exchange_paired_dataset`, a tokenizer without a chat template: BOS before the prompt,
//! EOS after each answer, a prompt whose last token merges into the answer) and conversational
//! rows (`preference_dataset` through the chat template, EOS after its end of turn): ids and
//! labels equal TRL's, unpadded. DPO's tokenization of the same rows stays as it was. IPO's
//! ([`PairTokenization::DpoTrainer`]) against `DPOTrainer`'s batches the same way.

use std::path::Path;

use crate::common;

use common::{fixture_json, fixtures_dir};
use ferrotune_data::dataset::{
    build_preference_dataset_as, build_preference_dataset_within, PairTokenization,
};
use ferrotune_data::Tokenizer;
use serde_json::{json, Value};

fn section(builder: &str, file: &str) -> Value {
    json!({
        "_component_": format!("torchtune.datasets.{builder}"),
        "source": "json",
        "data_files": fixtures_dir().join("orpo_trainer").join(file).display().to_string(),
    })
}

/// The tiny Llama's tokenizer without its chat template (TRL's text rows), in `dir`.
pub fn without_template(dir: &Path) -> Tokenizer {
    std::fs::create_dir_all(dir).unwrap();
    let model = fixtures_dir().join("llama3/model");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
        "generation_config.json",
    ] {
        std::fs::copy(model.join(f), dir.join(f)).unwrap();
    }
    let tok = Tokenizer::from_dir(dir).unwrap();
    assert!(tok.compiled_chat_template().unwrap().is_none());
    tok
}

/// TRL 1.16.0's batches (tests/fixtures/orpo_trainer/golden.json) and the tiny Llama's tokenizer
/// without its chat template (TRL's text rows; written into a fresh `ferrotune-trl-{name}`
/// folder) and with it.
fn trl_golden_and_tokenizers(name: &str) -> (Value, Tokenizer, Tokenizer) {
    let g = fixture_json("orpo_trainer/golden.json");
    assert_eq!(g["trl"], "1.16.0");
    let dir = ferrotune_testing::fresh_dir(&format!("ferrotune-trl-{name}-{}", std::process::id()));
    let plain = without_template(&dir.join("tok"));
    let chat = Tokenizer::from_dir(fixtures_dir().join("llama3/model")).unwrap();
    (g, plain, chat)
}

/// Rows `key` of a TRL batch with the padding (attention mask 0) left out.
fn unpadded(batch: &Value, side: &str, key: &str) -> Vec<Vec<i64>> {
    let rows: Vec<Vec<i64>> =
        serde_json::from_value(batch[format!("{side}_{key}")].clone()).unwrap();
    let mask: Vec<Vec<i64>> =
        serde_json::from_value(batch[format!("{side}_attention_mask")].clone()).unwrap();
    rows.iter()
        .zip(&mask)
        .map(|(r, m)| {
            r.iter()
                .zip(m)
                .filter(|(_, &m)| m == 1)
                .map(|(&t, _)| t)
                .collect()
        })
        .collect()
}

#[test]
fn orpo_pairs_are_the_ids_trl_orpo_and_cpo_trainers_collate() {
    let (g, plain, chat) = trl_golden_and_tokenizers("pairs");
    for (form, builder, tok) in [
        ("text", "stack_exchange_paired_dataset", &plain),
        ("chat", "preference_dataset", &chat),
    ] {
        let s = section(builder, &format!("{form}.jsonl"));
        let pairs =
            build_preference_dataset_as(&s, tok, &fixtures_dir(), None, PairTokenization::Orpo)
                .unwrap();
        // ORPOTrainer's and CPOTrainer's tokenization is the same code: every case's batch.
        for kind in ["orpo", "cpo", "simpo"] {
            let batch = &g[format!("{kind}_{form}")]["batch"];
            for side in ["chosen", "rejected"] {
                let ids = unpadded(batch, side, "input_ids");
                let labels = unpadded(batch, side, "labels");
                assert_eq!(ids.len(), pairs.len());
                for (i, p) in pairs.iter().enumerate() {
                    let row = if side == "chosen" {
                        &p.chosen
                    } else {
                        &p.rejected
                    };
                    let got: Vec<i64> = row.input_ids.iter().map(|&t| t as i64).collect();
                    assert_eq!(got, ids[i], "{kind} {form} {side} row {i}");
                    assert_eq!(row.labels, labels[i], "{kind} {form} {side} row {i} labels");
                }
            }
        }
        // TRL's max_length: each answer is cut to what the prompt leaves of it.
        let mut bounded = s.clone();
        bounded["max_seq_len"] = json!(14);
        let cut = build_preference_dataset_as(
            &bounded,
            tok,
            &fixtures_dir(),
            None,
            PairTokenization::Orpo,
        );
        if form == "text" {
            let cut = cut.unwrap();
            for (p, q) in cut.iter().zip(&pairs) {
                for (a, b) in [(&p.chosen, &q.chosen), (&p.rejected, &q.rejected)] {
                    let n = b.input_ids.len().min(14);
                    assert_eq!(a.input_ids, b.input_ids[..n], "{form}");
                    assert_eq!(a.labels, b.labels[..n], "{form}");
                }
            }
        } else {
            // The chat prompts are over 14 tokens: no answer token is left.
            let e = cut.unwrap_err().to_string();
            assert!(e.contains("the prompt alone fills max_seq_len"), "{e}");
        }
        // DPO's own tokenization of the same rows is unchanged: no EOS after the end of turn.
        let dpo = build_preference_dataset_within(&s, tok, &fixtures_dir(), None).unwrap();
        assert_ne!(dpo[0].chosen.input_ids, pairs[0].chosen.input_ids, "{form}");
    }
}

/// The conversational rows with real tokenizers and their own chat templates, as
/// `ORPOTrainer` prepared them (real_templates.json): qwen3 (no BOS token; EOS appended after the
/// newline that ends its turn) and llama3_1 (its template starts with BOS and ends each turn
/// with its EOS, so nothing is added).
#[test]
fn orpo_pairs_through_real_chat_templates_are_trl_orpo_trainers() {
    let g = fixture_json("orpo_trainer/real_templates.json");
    assert_eq!(g["trl"], "1.16.0");
    let s = section("preference_dataset", "chat.jsonl");
    for name in ["qwen3", "llama3_1"] {
        let tok = common::real_tokenizer(name);
        let pairs =
            build_preference_dataset_as(&s, &tok, &fixtures_dir(), None, PairTokenization::Orpo)
                .unwrap();
        let want =
            |key: &str| -> Vec<Vec<i64>> { serde_json::from_value(g[name][key].clone()).unwrap() };
        for side in ["chosen", "rejected"] {
            let (ids, labels) = (
                want(&format!("{side}_input_ids")),
                want(&format!("{side}_labels")),
            );
            assert_eq!(ids.len(), pairs.len(), "{name}");
            for (i, p) in pairs.iter().enumerate() {
                let row = if side == "chosen" {
                    &p.chosen
                } else {
                    &p.rejected
                };
                let got: Vec<i64> = row.input_ids.iter().map(|&t| t as i64).collect();
                assert_eq!(got, ids[i], "{name} {side} row {i}");
                assert_eq!(row.labels, labels[i], "{name} {side} row {i} labels");
            }
        }
    }
}

/// Preference rows with a `tools` column (JSON text) and assistant `tool_calls` / `tool` turns,
/// with the real qwen3 tokenizer (tools_golden.json): DPO's pairs are `DPOTrainer`'s prepared
/// prompt + chosen / rejected ids (the template given the row's tools), the answers labelled as
/// TRL labels them (torchtune's masking also labels an earlier assistant turn of the shared
/// prompt, which TRL's does not); ORPO's are `ORPOTrainer`'s rows, whose template is given no
/// tools.
#[test]
fn preference_rows_with_tools_are_tokenized_as_trl_trainers() {
    let g = fixture_json("orpo_trainer/tools_golden.json");
    assert_eq!(g["trl"], "1.16.0");
    let s = section("preference_dataset", "tools.jsonl");
    let tok = common::real_tokenizer("qwen3");
    let ids = |v: &Value| -> Vec<Vec<i64>> { serde_json::from_value(v.clone()).unwrap() };
    let dpo = build_preference_dataset_within(&s, &tok, &fixtures_dir(), None).unwrap();
    let prompts = ids(&g["dpo"]["prompt_ids"]);
    for side in ["chosen", "rejected"] {
        let answers = ids(&g["dpo"][format!("{side}_ids")]);
        for (i, p) in dpo.iter().enumerate() {
            let row = if side == "chosen" {
                &p.chosen
            } else {
                &p.rejected
            };
            let want: Vec<i64> = [prompts[i].clone(), answers[i].clone()].concat();
            let got: Vec<i64> = row.input_ids.iter().map(|&t| t as i64).collect();
            assert_eq!(got, want, "dpo {side} row {i}");
            // The answer is labelled as TRL labels it; within TRL's prompt, torchtune's masking
            // (the DPO builders') labels earlier assistant turns too (row 1's tool call), the
            // rest not.
            let n = prompts[i].len();
            assert_eq!(row.labels[n..], answers[i][..], "dpo {side} row {i} labels");
            let earlier = row.labels[..n].iter().filter(|&&l| l != -100).count();
            assert_eq!(earlier > 0, i == 1, "dpo {side} row {i} prompt labels");
        }
    }
    let orpo = build_preference_dataset_as(&s, &tok, &fixtures_dir(), None, PairTokenization::Orpo)
        .unwrap();
    for side in ["chosen", "rejected"] {
        let (want, labels) = (
            ids(&g["orpo"][format!("{side}_input_ids")]),
            ids(&g["orpo"][format!("{side}_labels")]),
        );
        for (i, p) in orpo.iter().enumerate() {
            let row = if side == "chosen" {
                &p.chosen
            } else {
                &p.rejected
            };
            let got: Vec<i64> = row.input_ids.iter().map(|&t| t as i64).collect();
            assert_eq!(got, want[i], "orpo {side} row {i}");
            assert_eq!(row.labels, labels[i], "orpo {side} row {i} labels");
        }
    }
}

/// Rows of a `DPOTrainer` batch (`DataCollatorForPreference`: every chosen row, then every
/// rejected row) unpadded: `(ids, labels)`, the labels being the ids where `completion_mask` is
/// 1 and -100 elsewhere.
fn dpo_trainer_rows(batch: &Value) -> Vec<(Vec<i64>, Vec<i64>)> {
    let get = |k: &str| -> Vec<Vec<i64>> { serde_json::from_value(batch[k].clone()).unwrap() };
    let (ids, mask, completion) = (
        get("input_ids"),
        get("attention_mask"),
        get("completion_mask"),
    );
    ids.iter()
        .zip(&mask)
        .zip(&completion)
        .map(|((r, m), c)| {
            let n = m.iter().filter(|&&m| m == 1).count();
            let labels = r[..n]
                .iter()
                .zip(c)
                .map(|(&t, &c)| if c == 1 { t } else { -100 })
                .collect();
            (r[..n].to_vec(), labels)
        })
        .collect()
}

/// IPO's pairs ([`PairTokenization::DpoTrainer`]) against the batches TRL 1.16.0's `DPOTrainer`
/// (loss_type ipo) collated in its own `train()` step: text rows (the prompt and prompt + answer +
/// EOS tokenized apart and split where they diverge: row 1's prompt ends with a space that merges
/// into its answer), single-turn and multi-turn conversational rows (no token of the shared
/// prompt labelled, its earlier assistant turn included, which torchtune's masking labels).
#[test]
fn dpo_trainer_pairs_are_the_ids_trl_dpo_trainer_collates() {
    let (g, plain, chat) = trl_golden_and_tokenizers("dpo");
    for (form, builder, file, tok) in [
        (
            "text",
            "stack_exchange_paired_dataset",
            "text.jsonl",
            &plain,
        ),
        ("chat", "preference_dataset", "chat.jsonl", &chat),
        ("multi", "preference_dataset", "chat_multi.jsonl", &chat),
    ] {
        let s = section(builder, file);
        let how = PairTokenization::DpoTrainer;
        let pairs = build_preference_dataset_as(&s, tok, &fixtures_dir(), None, how).unwrap();
        let want = dpo_trainer_rows(&g[format!("ipo_{form}")]["batch"]);
        assert_eq!(want.len(), 2 * pairs.len(), "{form}");
        let rows = pairs.iter().map(|p| &p.chosen);
        for (i, row) in rows.chain(pairs.iter().map(|p| &p.rejected)).enumerate() {
            let got: Vec<i64> = row.input_ids.iter().map(|&t| t as i64).collect();
            assert_eq!(got, want[i].0, "{form} row {i}");
            assert_eq!(row.labels, want[i].1, "{form} row {i} labels");
        }
        // torchtune's tokenization (DPO's) differs from DPOTrainer's on text rows (row 1's merge,
        // no EOS) and multi-turn rows (the earlier assistant turn labelled).
        let dpo = build_preference_dataset_within(&s, tok, &fixtures_dir(), None).unwrap();
        let same = |a: &ferrotune_data::dataset::PreferencePair,
                    b: &ferrotune_data::dataset::PreferencePair| {
            a.chosen.input_ids == b.chosen.input_ids && a.chosen.labels == b.chosen.labels
        };
        assert_eq!(
            dpo.iter().zip(&pairs).all(|(a, b)| same(a, b)),
            form == "chat",
            "{form}"
        );
        // TRL's max_length (keep_start): each side cut to its first tokens; a row whose prompt
        // alone fills it refused (TRL drops it).
        let mut bounded = s.clone();
        bounded["max_seq_len"] = json!(14);
        match build_preference_dataset_as(&bounded, tok, &fixtures_dir(), None, how) {
            Ok(cut) => {
                assert_eq!(form, "text");
                for (p, q) in cut.iter().zip(&pairs) {
                    for (a, b) in [(&p.chosen, &q.chosen), (&p.rejected, &q.rejected)] {
                        let n = b.input_ids.len().min(14);
                        assert_eq!(a.input_ids, b.input_ids[..n], "{form}");
                        assert_eq!(a.labels, b.labels[..n], "{form}");
                    }
                }
            }
            Err(e) => {
                assert_ne!(form, "text");
                let e = e.to_string();
                assert!(e.contains("the prompt alone fills max_seq_len"), "{e}");
            }
        }
    }
}

/// The rows with tools (tools_golden.json): `DPOTrainer`'s prepared prompt and answers, with the
/// real qwen3 tokenizer (the template given the row's tools), no token of the prompt labelled.
#[test]
fn dpo_trainer_pairs_with_tools_are_trl_dpo_trainers() {
    let g = fixture_json("orpo_trainer/tools_golden.json");
    assert_eq!(g["trl"], "1.16.0");
    let s = section("preference_dataset", "tools.jsonl");
    let tok = common::real_tokenizer("qwen3");
    let ids = |v: &Value| -> Vec<Vec<i64>> { serde_json::from_value(v.clone()).unwrap() };
    let how = PairTokenization::DpoTrainer;
    let pairs = build_preference_dataset_as(&s, &tok, &fixtures_dir(), None, how).unwrap();
    let prompts = ids(&g["dpo"]["prompt_ids"]);
    for side in ["chosen", "rejected"] {
        let answers = ids(&g["dpo"][format!("{side}_ids")]);
        assert_eq!(answers.len(), pairs.len());
        for (i, p) in pairs.iter().enumerate() {
            let row = if side == "chosen" {
                &p.chosen
            } else {
                &p.rejected
            };
            let got: Vec<i64> = row.input_ids.iter().map(|&t| t as i64).collect();
            assert_eq!(got, [prompts[i].clone(), answers[i].clone()].concat());
            let n = prompts[i].len();
            assert!(row.labels[..n].iter().all(|&l| l == -100), "{side} row {i}");
            assert_eq!(row.labels[n..], answers[i][..], "{side} row {i} labels");
        }
    }
}
