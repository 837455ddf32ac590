//! Unit tests of the dataset module: the hub configurations of the named builders.

use super::*;

fn name_for(component: &str, section: Value) -> Option<String> {
    let builder = Builder::parse(component).unwrap();
    let map = with_hub_configuration(builder, section.as_object().unwrap().clone()).unwrap();
    map.get("name").and_then(Value::as_str).map(str::to_string)
}

/// The hub configurations torchtune's builders pass to `load_dataset`.
#[test]
fn hub_configuration_of_the_named_builders() {
    let empty = serde_json::json!({});
    for (component, section, name) in [
        ("wikitext_dataset", empty.clone(), Some("wikitext-103-v1")),
        (
            "wikitext_dataset",
            serde_json::json!({"subset": "wikitext-2-raw-v1"}),
            Some("wikitext-2-raw-v1"),
        ),
        (
            "cnn_dailymail_articles_dataset",
            empty.clone(),
            Some("3.0.0"),
        ),
        (
            "cnn_dailymail_articles_dataset",
            serde_json::json!({"name": "2.0.0"}),
            Some("2.0.0"),
        ),
        ("text_completion_dataset", empty, None),
    ] {
        assert_eq!(name_for(component, section).as_deref(), name, "{component}");
    }
    assert_eq!(
        Builder::parse("slimorca_dataset").unwrap().default_source(),
        Some("Open-Orca/SlimOrca-Dedup")
    );
}
