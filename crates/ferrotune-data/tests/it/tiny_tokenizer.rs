//! The workspace's tiny tokenizer (tests/fixtures/tiny_tokenizer), and folder-loading details.

use crate::common;

use std::path::Path;

use common::{check_against_reference, fixture_json, fixtures_dir};
use ferrotune_data::{ChatMessage, Tokenizer};

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    ferrotune_testing::fresh_dir(&format!("ferrotune-data-{}-{name}", std::process::id()))
}

#[test]
fn tiny_tokenizer_matches_transformers() {
    let tok = Tokenizer::from_dir(fixtures_dir().join("tiny_tokenizer")).unwrap();
    check_against_reference(
        "tiny_tokenizer",
        &tok,
        &fixture_json("tokenizer_texts.json")["tiny_tokenizer"],
    );
}

#[test]
fn eos_ids_union_generation_config_and_config() {
    let dir = temp_dir("eos");
    copy_dir(&fixtures_dir().join("tiny_tokenizer"), &dir);
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [0, 2], "pad_token_id": null}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"eos_token_id": 1, "bos_token_id": 0}"#,
    )
    .unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    // the tokenizer's own eos (<|im_end|> = 2) first, then generation_config, then config
    assert_eq!(tok.eos_ids(), &[2, 0, 1]);
    assert_eq!(tok.pad_id(), Some(3));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn chat_template_from_config_string_or_named_list() {
    let dir = temp_dir("template");
    std::fs::copy(
        fixtures_dir().join("tiny_tokenizer/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    let config = serde_json::json!({
        "bos_token": {"content": "<|endoftext|>", "special": true},
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}"}
        ]
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tok.bos_token(), Some("<|endoftext|>"));
    let text = tok
        .apply_chat_template(&[ChatMessage::user("hi")], false)
        .unwrap();
    assert_eq!(text, "<|endoftext|>[user]hi<|im_end|>");
    let ids = tok.encode_chat(&[ChatMessage::user("hi")], false).unwrap();
    assert_eq!(ids.first(), Some(&0));
    assert_eq!(ids.last(), Some(&2));

    // chat_template.jinja wins over the config
    std::fs::write(
        dir.join("chat_template.jinja"),
        "J{{ messages[0].content }}",
    )
    .unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(
        tok.apply_chat_template(&[ChatMessage::user("x")], false)
            .unwrap(),
        "Jx"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
