//! Jinja semantics chat templates rely on, against transformers' own template compiler
//! (tests/fixtures/chat_template_cases.json, from scripts/make_tokenizer_fixtures.py).

use crate::common;

use std::collections::BTreeMap;

use common::{fixture_json, messages};
use ferrotune_data::{ChatTemplate, DataError};

#[test]
fn templates_render_as_transformers_renders_them() {
    let fixture = fixture_json("chat_template_cases.json");
    let msgs = messages(&fixture["messages"]);
    let tokens: BTreeMap<String, String> =
        serde_json::from_value(fixture["special_tokens"].clone()).unwrap();
    let mut failures = Vec::new();
    for case in fixture["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let ours = ChatTemplate::new(case["template"].as_str().unwrap())
            .and_then(|t| t.render(&msgs, true, &tokens));
        match (case["rendered"].as_str(), ours) {
            (Some(expected), Ok(got)) if got == expected => {}
            (Some(expected), got) => failures.push(format!(
                "{name}:\n  expected {expected:?}\n  got      {got:?}"
            )),
            (None, Ok(got)) => failures.push(format!(
                "{name}: transformers raised {} but we rendered {got:?}",
                case["error"]
            )),
            (None, Err(err)) => {
                // raise_exception's message comes through as it is
                let expected = case["error"].as_str().unwrap();
                if let Some(message) = expected.strip_prefix("TemplateError: ") {
                    match err {
                        DataError::TemplateException { message: ours } if ours == message => {}
                        other => failures.push(format!(
                            "{name}: expected exception {message:?}, got {other}"
                        )),
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} case(s) differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
