//! Helpers shared by this crate's integration tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use ferrotune_data::Tokenizer;
use serde_json::Value;

/// The workspace's shared test data: `<repo>/tests/fixtures`.
pub use ferrotune_testing::fixtures as fixtures_dir;

/// A JSON fixture under `tests/fixtures`.
pub fn fixture_json(relative: &str) -> Value {
    let path = fixtures_dir().join(relative);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A real asset fetched by `scripts/fetch-assets.sh`; a missing one fails the test (it does not skip).
pub fn real_asset(relative: &str) -> PathBuf {
    ferrotune_data::asset_path(relative).unwrap_or_else(|e| panic!("{e}"))
}

/// One of the real tokenizer folders, loaded once per test binary (gemma3's is 33 MB).
pub fn real_tokenizer(name: &str) -> Tokenizer {
    static CACHE: OnceLock<Mutex<HashMap<String, Tokenizer>>> = OnceLock::new();
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    cache
        .entry(name.to_string())
        .or_insert_with(|| {
            let dir = real_asset(&format!("tokenizers/{name}"));
            Tokenizer::from_dir(&dir).unwrap_or_else(|e| panic!("{name}: {e}"))
        })
        .clone()
}

pub fn ids(value: &Value) -> Vec<u32> {
    serde_json::from_value(value.clone())
        .unwrap_or_else(|e| panic!("not a list of ids: {value}: {e}"))
}

pub fn messages(value: &Value) -> Vec<ferrotune_data::ChatMessage> {
    serde_json::from_value(value.clone())
        .unwrap_or_else(|e| panic!("not a list of messages: {value}: {e}"))
}

/// Checks `tok` against a reference written by `scripts/make_tokenizer_fixtures.py`: special tokens and
/// their ids, vocabulary size, a few id → token lookups, plain-text encode/decode, and chat renders.
pub fn check_against_reference(name: &str, tok: &Tokenizer, reference: &Value) {
    let expected_specials: std::collections::BTreeMap<String, String> =
        serde_json::from_value(reference["special_tokens"].clone()).unwrap();
    assert_eq!(
        tok.special_tokens(),
        &expected_specials,
        "{name}: special tokens"
    );
    let opt = |key: &str| reference[key].as_u64().map(|v| v as u32);
    assert_eq!(tok.bos_id(), opt("bos_token_id"), "{name}: bos id");
    assert_eq!(
        tok.eos_ids().first().copied(),
        opt("eos_token_id"),
        "{name}: eos id"
    );
    assert_eq!(tok.pad_id(), opt("pad_token_id"), "{name}: pad id");
    assert_eq!(tok.unk_id(), opt("unk_token_id"), "{name}: unk id");
    assert_eq!(
        tok.vocab_size() as u64,
        reference["len"].as_u64().unwrap(),
        "{name}: len(tokenizer)"
    );
    assert_eq!(
        tok.chat_template().is_some(),
        reference["has_chat_template"].as_bool().unwrap(),
        "{name}"
    );
    for (id, token) in reference["id_to_token"].as_object().unwrap() {
        let id: u32 = id.parse().unwrap();
        assert_eq!(
            tok.id_to_token(id).as_deref(),
            token.as_str(),
            "{name}: id_to_token({id})"
        );
        if let Some(token) = token.as_str() {
            assert_eq!(
                tok.token_to_id(token),
                Some(id),
                "{name}: token_to_id({token:?})"
            );
        }
    }

    for case in reference["texts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let with_special = tok.encode(text, true).unwrap();
        assert_eq!(
            with_special,
            ids(&case["ids_with_special"]),
            "{name}: encode({text:?}, true)"
        );
        let plain = tok.encode(text, false).unwrap();
        assert_eq!(
            plain,
            ids(&case["ids_plain"]),
            "{name}: encode({text:?}, false)"
        );
        assert_eq!(
            tok.decode(&plain, false).unwrap(),
            case["decoded_plain"].as_str().unwrap(),
            "{name}: decode(encode({text:?}))"
        );
        if let Some(skipped) = case.get("decoded_with_special_skipped") {
            assert_eq!(
                tok.decode(&with_special, true).unwrap(),
                skipped.as_str().unwrap(),
                "{name}: decode(.., skip_special_tokens=true) of {text:?}"
            );
        }
    }

    for chat in reference["chats"].as_array().unwrap() {
        let msgs = messages(&chat["messages"]);
        let add = chat["add_generation_prompt"].as_bool().unwrap();
        match chat["ids"].as_str() {
            Some(error) => {
                let ours = tok.apply_chat_template(&msgs, add);
                assert!(
                    ours.is_err(),
                    "{name}: transformers failed ({error}) but we rendered {ours:?}"
                );
            }
            None => {
                let text = tok.apply_chat_template(&msgs, add).unwrap();
                assert_eq!(
                    text,
                    chat["text"].as_str().unwrap(),
                    "{name}: chat text (add_generation_prompt={add})"
                );
                let ids_ = tok.encode_chat(&msgs, add).unwrap();
                assert_eq!(
                    ids_,
                    ids(&chat["ids"]),
                    "{name}: chat ids (add_generation_prompt={add})"
                );
            }
        }
    }
}
