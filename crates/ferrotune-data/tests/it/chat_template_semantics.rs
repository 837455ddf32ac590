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

/// A template that would loop 10^10 times stops at its step budget, quickly, and the error says
/// so, naming the file the template came from.
#[test]
fn a_runaway_template_stops_at_its_step_budget_naming_its_file() {
    let runaway = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}\
                   {% endfor %}";
    let start = std::time::Instant::now();
    let err = ChatTemplate::new(runaway)
        .unwrap()
        .render(&[], false, &BTreeMap::new())
        .unwrap_err();
    assert!(matches!(err, DataError::TemplateStepBudget { .. }), "{err}");
    assert!(
        err.to_string().contains("ran out of its step budget"),
        "{err}"
    );
    assert!(start.elapsed().as_secs() < 60, "took {:?}", start.elapsed());

    let dir = ferrotune_testing::fresh_dir(&format!("ferrotune-runaway-{}", std::process::id()));
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(
            common::fixtures_dir().join("tiny_tokenizer").join(file),
            dir.join(file),
        )
        .unwrap();
    }
    std::fs::write(dir.join("chat_template.jinja"), runaway).unwrap();
    let tok = ferrotune_data::Tokenizer::from_dir(&dir).unwrap();
    let err = tok
        .apply_chat_template(&msgs_one(), false)
        .unwrap_err()
        .to_string();
    let file = dir.join("chat_template.jinja").display().to_string();
    assert!(
        err.contains("ran out of its step budget") && err.contains(&file),
        "{err}"
    );
}

fn msgs_one() -> Vec<ferrotune_data::ChatMessage> {
    vec![ferrotune_data::ChatMessage::user("hi")]
}
