//! Tool-calling rows (a `tools` column, assistant `tool_calls`, `tool` messages) against
//! transformers' `apply_chat_template(messages, tools=tools)`:
//! `tests/fixtures/datasets/tool_chat_expected.json` (scripts/make_tool_chat_fixtures.py) holds,
//! for Qwen3's template, Meta's Llama 3.1 template and the llama3_1 tokenizer's own template (which
//! ignores tools), each row's text, ids and labels, and the GRPO prompts' text and ids.

use serde_json::{json, Value};

use crate::common::{fixture_json, fixtures_dir, ids, real_tokenizer};
use ferrotune_data::dataset::{build_dataset, build_reasoning_dataset};
use ferrotune_data::{ChatMessage, DataError, Tokenizer};

fn tokenizer_for(template: &Value) -> Tokenizer {
    let mut tok = real_tokenizer(template["tokenizer"].as_str().unwrap());
    if let Some(source) = template["chat_template"].as_str() {
        tok.set_chat_template(Some(source.to_string()));
    }
    tok
}

fn labels(value: &Value) -> Vec<i64> {
    serde_json::from_value(value.clone()).unwrap()
}

/// The rows of a JSON Lines fixture, their objects' keys in file order.
fn rows(name: &str) -> Vec<minijinja::Value> {
    std::fs::read_to_string(fixtures_dir().join("datasets").join(name))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A row's messages as a caller of the library builds them (a null content: no content).
fn messages(row: &minijinja::Value) -> Vec<ChatMessage> {
    let list = row.get_attr("messages").unwrap();
    list.try_iter()
        .unwrap()
        .map(|m| {
            let role = m.get_attr("role").unwrap().to_string();
            let content = m.get_attr("content").unwrap();
            let mut message = match content.as_str() {
                Some(text) => ChatMessage::new(role, text),
                None => ChatMessage::without_content(role),
            };
            for key in m.try_iter().unwrap() {
                let name = key.as_str().unwrap();
                if name != "role" && name != "content" {
                    message
                        .extra
                        .insert(name.to_string(), m.get_item(&key).unwrap());
                }
            }
            message
        })
        .collect()
}

/// A row's tools as TRL hands them to the template: JSON text parsed, a list as it is.
fn tools(row: &minijinja::Value) -> Option<minijinja::Value> {
    let tools = row.get_attr("tools").unwrap();
    match tools.as_str() {
        _ if tools.is_none() => None,
        Some(text) => Some(serde_json::from_str(text).unwrap()),
        None => Some(tools),
    }
}

/// The template's error where transformers raised: the same message for `raise_exception`, a
/// template error for Jinja2's `UndefinedError`.
fn assert_same_error(err: &DataError, expected: &str, what: &str) {
    match expected.split_once(": ") {
        Some(("TemplateError", message)) => {
            assert!(
                matches!(err, DataError::TemplateException { message: m } if m == message),
                "{what}: expected the template's exception {message:?}, got {err}"
            );
        }
        _ => assert!(
            matches!(err, DataError::Template { .. }),
            "{what}: expected a template error ({expected}), got {err}"
        ),
    }
}

/// Each row rendered with its tools: the same text as transformers (objects' keys in file order,
/// `tojson` with and without indent, parallel calls, tool results), the same ids, and labels on
/// the assistant turns (tool calls included) or, with `train_on_input`, after the system message.
#[test]
fn tool_rows_match_transformers() {
    let fixture = fixture_json("datasets/tool_chat_expected.json");
    let data = rows("tool_chat.jsonl");
    for (name, template) in fixture["templates"].as_object().unwrap() {
        let tok = tokenizer_for(template);
        let cases = template["rows"].as_array().unwrap();
        assert_eq!(cases.len(), data.len());
        for (i, (case, row)) in cases.iter().zip(&data).enumerate() {
            let what = format!("{name} row {}", i + 1);
            let text =
                tok.apply_chat_template_with_tools(&messages(row), tools(row).as_ref(), false);
            for (key, train_on_input) in [("masked", false), ("train_on_input", true)] {
                let section = json!({
                    "_component_": "chat_dataset", "source": "tool_chat.jsonl",
                    "conversation_style": "openai", "split": format!("train[{i}:{}]", i + 1),
                    "train_on_input": train_on_input,
                });
                let built = build_dataset(&section, &tok, &fixtures_dir().join("datasets"));
                if let Some(expected) = case["error"].as_str() {
                    assert_same_error(&built.unwrap_err(), expected, &what);
                    continue;
                }
                let built = built.unwrap_or_else(|e| panic!("{what}: {e}"));
                let want = &case[key];
                assert_eq!(
                    built.rows[0].input_ids,
                    ids(&want["input_ids"]),
                    "{what} {key}"
                );
                assert_eq!(
                    built.rows[0].labels,
                    labels(&want["labels"]),
                    "{what} {key}"
                );
            }
            match case["error"].as_str() {
                Some(expected) => assert_same_error(&text.unwrap_err(), expected, &what),
                None => assert_eq!(text.unwrap(), case["text"].as_str().unwrap(), "{what}"),
            }
        }
    }
}

/// GRPO's prompt rows with a `tools` column: rendered with the tools and the generation prompt.
#[test]
fn tool_prompts_match_transformers() {
    let fixture = fixture_json("datasets/tool_chat_expected.json");
    for (name, template) in fixture["templates"].as_object().unwrap() {
        let tok = tokenizer_for(template);
        let section = json!({"_component_": "prompt_dataset", "source": "tool_prompts.jsonl"});
        let problems =
            build_reasoning_dataset(&section, &tok, &fixtures_dir().join("datasets")).unwrap();
        let want = template["prompts"].as_array().unwrap();
        assert_eq!(problems.len(), want.len());
        for (i, (got, want)) in problems.iter().zip(want).enumerate() {
            assert_eq!(
                got.prompt,
                want["text"].as_str().unwrap(),
                "{name} prompt {}",
                i + 1
            );
            assert_eq!(
                got.prompt_ids,
                ids(&want["input_ids"]),
                "{name} prompt {}",
                i + 1
            );
        }
    }
}

/// A `tools_column` the rows do not have is an error naming it; a tools cell that is not a list of
/// schemas is an error naming the row.
#[test]
fn tool_columns_are_checked() {
    let tok = real_tokenizer("qwen3");
    let dir = fixtures_dir().join("datasets");
    let err = build_dataset(
        &json!({"_component_": "chat_dataset", "source": "tool_chat.jsonl",
                "conversation_style": "openai", "tools_column": "functions"}),
        &tok,
        &dir,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("column 'functions' not found"), "{err}");
    let tmp = ferrotune_testing::fresh_dir(&format!(
        "ferrotune-data-tool-columns-{}",
        std::process::id()
    ));
    std::fs::write(
        tmp.join("bad.jsonl"),
        "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": \"b\"}], \"tools\": \"{not json\"}\n",
    )
    .unwrap();
    let err = build_dataset(
        &json!({"_component_": "chat_dataset", "source": "bad.jsonl", "conversation_style": "openai"}),
        &tok,
        &tmp,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("bad.jsonl:1") && err.contains("not JSON"),
        "{err}"
    );
}

/// A config's list of named templates: with tools, the one named `tool_use` renders (as
/// transformers' `get_chat_template(tools=...)` picks it), in `apply_chat_template_with_tools` and
/// in a dataset's rows with tools; without tools, `default`.
#[test]
fn named_tool_use_template_renders_rows_with_tools() {
    let dir = ferrotune_testing::fresh_dir(&format!(
        "ferrotune-data-tool-use-template-{}",
        std::process::id()
    ));
    std::fs::copy(
        fixtures_dir().join("tiny_tokenizer/tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    let config = json!({
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "tool_use", "template": "T{{ tools | length }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"},
            {"name": "default", "template": "D{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"}
        ]
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let msgs = [ChatMessage::user("hi")];
    let tools: minijinja::Value = serde_json::from_str(r#"[{"type": "function"}]"#).unwrap();
    let with = tok.apply_chat_template_with_tools(&msgs, Some(&tools), false);
    assert_eq!(with.unwrap(), "T1[user]hi");
    let without = tok.apply_chat_template_with_tools(&msgs, None, false);
    assert_eq!(without.unwrap(), "D[user]hi");
    std::fs::write(
        dir.join("rows.jsonl"),
        "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": \"b\"}], \"tools\": [{\"type\": \"function\"}, {\"type\": \"function\"}]}\n\
         {\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": \"b\"}], \"tools\": null}\n",
    )
    .unwrap();
    let section = json!({"_component_": "chat_dataset", "source": "rows.jsonl",
                         "conversation_style": "openai", "train_on_input": true});
    let built = build_dataset(&section, &tok, &dir).unwrap();
    let first = tok.encode("T2[user]a[assistant]b", false).unwrap();
    let second = tok.encode("D[user]a[assistant]b", false).unwrap();
    assert_eq!(built.rows[0].input_ids, first);
    assert_eq!(built.rows[1].input_ids, second);
}
