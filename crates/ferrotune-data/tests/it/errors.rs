//! Bad input is an error naming the file and the problem, never a panic.

use crate::common;

use common::{fixtures_dir, real_asset};
use ferrotune_data::{ChatMessage, DataError, GgufVocabStyle, Tokenizer};

fn temp_dir(name: &str) -> std::path::PathBuf {
    ferrotune_testing::fresh_dir(&format!(
        "ferrotune-data-errors-{}-{name}",
        std::process::id()
    ))
}

#[test]
fn missing_folder() {
    let dir = std::env::temp_dir().join("ferrotune-data-no-such-folder");
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(matches!(err, DataError::NotFound { .. }), "{err}");
    assert!(
        err.to_string().contains("ferrotune-data-no-such-folder"),
        "{err}"
    );
}

#[test]
fn folder_without_tokenizer_json() {
    let dir = temp_dir("empty");
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains(&dir.join("tokenizer.json").display().to_string()),
        "{message}"
    );
    assert!(message.contains("does not exist"), "{message}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn corrupt_tokenizer_json() {
    let dir = temp_dir("corrupt");
    std::fs::write(
        dir.join("tokenizer.json"),
        "{\"version\": \"1.0\", \"model\": {",
    )
    .unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains(&dir.join("tokenizer.json").display().to_string()),
        "{message}"
    );
    assert!(message.contains("not valid JSON"), "{message}");

    // valid JSON, but not a tokenizer
    std::fs::write(dir.join("tokenizer.json"), "{\"hello\": 1}").unwrap();
    let message = Tokenizer::from_dir(&dir).unwrap_err().to_string();
    assert!(
        message.contains("tokenizer.json") && message.contains("not a tokenizers definition"),
        "{message}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn corrupt_tokenizer_config() {
    let dir = temp_dir("config");
    std::fs::copy(
        fixtures_dir().join("tiny_tokenizer/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), "{ not json").unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(matches!(err, DataError::Json { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn truncated_gguf() {
    let real = real_asset("SmolLM2-135M-Instruct.Q4_1.gguf");
    let bytes = std::fs::read(&real).unwrap();
    let dir = temp_dir("gguf");
    // cut inside the metadata, and cut inside the tensor data
    for (name, len) in [
        ("head.gguf", 4096),
        ("body.gguf", bytes.len() / 2),
        ("magic.gguf", 3),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, &bytes[..len]).unwrap();
        let err = Tokenizer::from_gguf(&path, |_| GgufVocabStyle::Llama).unwrap_err();
        assert!(matches!(err, DataError::Gguf { .. }), "{err}");
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
    }
    let err = Tokenizer::from_gguf(dir.join("body.gguf"), |_| GgufVocabStyle::Llama).unwrap_err();
    assert!(err.to_string().contains("truncated"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn not_a_gguf_and_missing_gguf() {
    let dir = temp_dir("notgguf");
    let path = dir.join("model.gguf");
    std::fs::write(&path, b"this is not a gguf file at all, just text").unwrap();
    let err = Tokenizer::from_gguf(&path, |_| GgufVocabStyle::Llama).unwrap_err();
    assert!(
        err.to_string().contains("model.gguf") && err.to_string().contains("not a GGUF file"),
        "{err}"
    );
    let err =
        Tokenizer::from_gguf(dir.join("missing.gguf"), |_| GgufVocabStyle::Llama).unwrap_err();
    assert!(
        matches!(err, DataError::NotFound { .. }) && err.to_string().contains("missing.gguf"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn template_errors_are_errors() {
    let dir = temp_dir("badtemplate");
    std::fs::copy(
        fixtures_dir().join("tiny_tokenizer/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{% for m in messages %}{{ m.content }",
    )
    .unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let err = tok
        .apply_chat_template(&[ChatMessage::user("x")], false)
        .unwrap_err();
    assert!(matches!(err, DataError::Template { .. }), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A `config.json` (read for its EOS ids) holding an array is the file's problem, said as such:
/// not an "invalid tokenizer".
#[test]
fn json_file_that_is_not_an_object() {
    let dir = temp_dir("array-config");
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(
            fixtures_dir().join("tiny_tokenizer").join(file),
            dir.join(file),
        )
        .unwrap();
    }
    std::fs::write(dir.join("config.json"), "[1, 2]").unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err().to_string();
    let file = dir.join("config.json").display().to_string();
    assert!(
        err.contains(&file) && err.contains("top level must be a JSON object, found an array"),
        "{err}"
    );
    assert!(!err.contains("invalid tokenizer"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
