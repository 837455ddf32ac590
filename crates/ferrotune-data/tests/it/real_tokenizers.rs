//! The real tokenizers (fetched by scripts/fetch-assets.sh) against transformers' outputs.

use crate::common;

use common::{check_against_reference, fixture_json, ids, messages, real_tokenizer};
use ferrotune_data::DataError;

/// `tests/fixtures/chat_templates.json`: chat renders and ids for llama3_1, qwen3 and gemma3 (both
/// `add_generation_prompt` values), plain-text references for all four tokenizers.
#[test]
fn chat_templates_fixture() {
    let fixture = fixture_json("chat_templates.json");
    for (name, cases) in fixture.as_object().unwrap() {
        let tok = real_tokenizer(name);
        for case in cases["texts"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            assert_eq!(
                tok.encode(text, true).unwrap(),
                ids(&case["ids_with_special"]),
                "{name}: {text:?}"
            );
            let plain = tok.encode(text, false).unwrap();
            assert_eq!(plain, ids(&case["ids_plain"]), "{name}: {text:?}");
            assert_eq!(
                tok.decode(&plain, false).unwrap(),
                case["decoded_plain"].as_str().unwrap(),
                "{name}"
            );
        }
        let convs = cases["convs"].as_array().unwrap();
        assert!(!convs.is_empty());
        for conv in convs {
            let msgs = messages(&conv["messages"]);
            let add = conv["add_generation_prompt"].as_bool().unwrap();
            if let Some(error) = conv["ids"].as_str() {
                // llama2 has no chat template: transformers raises, and so do we, clearly.
                assert!(error.contains("chat_template is not set"), "{error}");
                let err = tok.encode_chat(&msgs, add).unwrap_err();
                assert!(
                    matches!(err, DataError::NoChatTemplate { .. }),
                    "{name}: {err}"
                );
                let message = err.to_string();
                assert!(message.contains("has no chat template"), "{message}");
                assert!(message.contains(&format!("tokenizers/{name}")), "{message}");
                assert!(tok.apply_chat_template(&msgs, add).is_err());
                continue;
            }
            let text = tok.apply_chat_template(&msgs, add).unwrap();
            assert_eq!(
                text,
                conv["text"].as_str().unwrap(),
                "{name}: add_generation_prompt={add}"
            );
            assert_eq!(
                tok.encode_chat(&msgs, add).unwrap(),
                ids(&conv["ids"]),
                "{name}: add_generation_prompt={add}"
            );
        }
    }
}

/// `tests/fixtures/tokenizer_texts.json` (scripts/make_tokenizer_fixtures.py): unicode, runs of spaces,
/// digits, newlines, special tokens inside text, special tokens and ids, decode skipping specials.
#[test]
fn real_tokenizers_extra_texts() {
    let fixture = fixture_json("tokenizer_texts.json");
    for name in ["llama3_1", "qwen3", "gemma3", "llama2"] {
        check_against_reference(name, &real_tokenizer(name), &fixture[name]);
    }
}

#[test]
fn gemma3_model_specific_special_tokens_reach_the_template() {
    let tok = real_tokenizer("gemma3");
    assert_eq!(tok.special_token("image_token"), Some("<image_soft_token>"));
    assert_eq!(tok.bos_token(), Some("<bos>"));
    assert_eq!(tok.eos_token(), Some("<end_of_turn>"));
    assert!(tok.add_bos_token());
}

#[test]
fn gemma3_template_rejects_non_alternating_roles_with_its_message() {
    let tok = real_tokenizer("gemma3");
    let msgs = vec![
        ferrotune_data::ChatMessage::user("a"),
        ferrotune_data::ChatMessage::user("b"),
    ];
    match tok.apply_chat_template(&msgs, true).unwrap_err() {
        DataError::TemplateException { message } => {
            assert_eq!(
                message,
                "Conversation roles must alternate user/assistant/user/assistant/..."
            )
        }
        other => panic!("expected the template's exception, got {other}"),
    }
}
