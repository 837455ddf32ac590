//! The reward-model recipes' pairs against TRL 1.16.0's `RewardTrainer` tokenization
//! (tests/fixtures/reward_model, scripts/make_reward_model_fixtures.py): text rows with a prompt
//! and a margin (EOS appended, special tokens), conversational rows (the chat template), each
//! pair's ids exactly the rows TRL collated (unpadded); and `max_length` leaving pairs out.

use crate::common;

use common::fixtures_dir;
use ferrotune_data::dataset::build_reward_pairs_within;
use serde_json::{json, Value};

fn golden() -> Value {
    let path = fixtures_dir().join("reward_model/golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn section(file: &str) -> Value {
    json!({
        "_component_": "torchtune.datasets.preference_dataset",
        "source": "json",
        "data_files": fixtures_dir().join("reward_model").join(file).display().to_string(),
    })
}

#[test]
fn pairs_are_tokenized_as_trl_tokenizes_them() {
    let tok = ferrotune_data::Tokenizer::from_dir(fixtures_dir().join("llama3/model")).unwrap();
    let g = golden();
    for (case, file, margins) in [("full", "text.jsonl", true), ("lora", "chat.jsonl", false)] {
        let (pairs, dropped) =
            build_reward_pairs_within(&section(file), &tok, &fixtures_dir(), None).unwrap();
        assert_eq!(dropped, 0);
        let rows: Vec<Vec<u32>> =
            serde_json::from_value(g[case]["batch"]["input_ids"].clone()).unwrap();
        let mask: Vec<Vec<u32>> =
            serde_json::from_value(g[case]["batch"]["attention_mask"].clone()).unwrap();
        let unpadded: Vec<Vec<u32>> = rows
            .iter()
            .zip(&mask)
            .map(|(r, m)| {
                r.iter()
                    .zip(m)
                    .filter(|(_, &m)| m == 1)
                    .map(|(&t, _)| t)
                    .collect()
            })
            .collect();
        let n = pairs.len();
        assert_eq!(2 * n, unpadded.len(), "{case}");
        for (i, p) in pairs.iter().enumerate() {
            assert_eq!(p.chosen, unpadded[i], "{case}: pair {i} chosen");
            assert_eq!(p.rejected, unpadded[n + i], "{case}: pair {i} rejected");
            match margins {
                true => {
                    let want = g[case]["rows"]["margin"][i].as_f64().unwrap() as f32;
                    assert_eq!(p.margin, Some(want), "{case}: pair {i} margin");
                }
                false => assert_eq!(p.margin, None),
            }
        }
        // A bound below the longest side leaves those pairs out, as TRL's filter does.
        let longest = pairs.iter().map(|p| p.chosen.len().max(p.rejected.len()));
        let bound = longest.clone().max().unwrap() - 1;
        let mut bounded = section(file);
        bounded["max_length"] = json!(bound);
        let (kept, dropped) =
            build_reward_pairs_within(&bounded, &tok, &fixtures_dir(), None).unwrap();
        let over = longest.filter(|&l| l > bound).count();
        assert_eq!((kept.len(), dropped), (n - over, over), "{case}");
    }
}
