//! The chat template engine's unit tests.

use super::*;

fn render(source: &str, messages: &[ChatMessage]) -> Result<String> {
    ChatTemplate::new(source)?.render(messages, false, &BTreeMap::new())
}

/// `source` rendered without messages.
fn render_plain(source: &str) -> String {
    render(source, &[]).unwrap()
}

#[test]
fn python_style_output() {
    let out = render_plain(
        "{{ none }}|{{ true }}|{{ [1, 'a', none] }}|{{ 1.5 }}|{{ 2.0 }}|{{ {'a': 1} }}",
    );
    assert_eq!(out, "None|True|[1, 'a', None]|1.5|2.0|{'a': 1}");
}

#[test]
fn float_repr() {
    assert_eq!(python_float_repr(0.0001), "0.0001");
    assert_eq!(python_float_repr(0.00001), "1e-05");
    assert_eq!(python_float_repr(1e16), "1e+16");
    assert_eq!(python_float_repr(1e15), "1000000000000000.0");
    assert_eq!(python_float_repr(-2.5e-7), "-2.5e-07");
    assert_eq!(python_float_repr(123.456), "123.456");
}

#[test]
fn tojson_matches_python() {
    let out = render_plain("{{ {'b': 'é<\"x\">', 'a': [1, 2.5, none, true]}|tojson }}\n{{ {'k': []}|tojson(indent=2) }}");
    assert_eq!(
        out,
        "{\"b\": \"é<\\\"x\\\">\", \"a\": [1, 2.5, null, true]}\n{\n  \"k\": []\n}"
    );
    let out = render_plain("{{ {'b': 1, 'a': 'é'}|tojson(sort_keys=true, ensure_ascii=true) }}");
    assert_eq!(out, "{\"a\": \"\\u00e9\", \"b\": 1}");
}

#[test]
fn raise_exception_carries_message() {
    let err = render("{{ raise_exception('roles must alternate') }}", &[]).unwrap_err();
    match err {
        DataError::TemplateException { message } => assert_eq!(message, "roles must alternate"),
        other => panic!("unexpected error {other}"),
    }
}

#[test]
fn string_methods() {
    let out = render(
        "{{ '  a b  c '.split() }}{{ 'a,b,,c'.split(',', 1) }}{{ ' x\x1c'.strip() }}|{{ 'é-x'.find('x') }}\
         {{ 'a.b.c'.rsplit('.', 1) }}{{ \"they're 2nd\".title() }}|{{ 'hello world-wide'|title }}",
        &[],
    )
    .unwrap();
    assert_eq!(
        out,
        "['a', 'b', 'c']['a', 'b,,c']x|2['a.b', 'c']They'Re 2Nd|Hello World-Wide"
    );
}

#[test]
fn trim_blocks_and_generation_tags() {
    let source = "{% for m in messages %}\n  {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}";
    let out = render(
        source,
        &[ChatMessage::user("hi"), ChatMessage::assistant("yo")],
    )
    .unwrap();
    assert_eq!(out, "hiyo"); // as Jinja2 renders it (checked with transformers)
}

#[test]
fn namespace_loop_controls_and_dict_methods() {
    let source = "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index0 == 1 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}{% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{% endfor %}{{ {'a': 1}.get('b', 'none') }}";
    let out = render(source, &[ChatMessage::user("a"), ChatMessage::user("b")]).unwrap();
    assert_eq!(out, "1a=1none");
}

#[test]
fn strftime_now_formats_local_time() {
    let out = render("{% if not date_string is defined %}{% set date_string = strftime_now('%d %b %Y') %}{% endif %}{{ date_string }}", &[])
        .unwrap();
    assert_eq!(out, chrono::Local::now().format("%d %b %Y").to_string());
    assert!(render("{{ strftime_now('%Q') }}", &[]).is_err());
}

#[test]
fn syntax_error_is_an_error() {
    let err = ChatTemplate::new("{% for x in %}").unwrap_err();
    assert!(matches!(err, DataError::Template { .. }), "{err}");
}

/// minijinja 2.24 panics reversing an empty list (`messages[::-1]`, as Qwen3's template does, with
/// no messages): found by ferrotune-fuzz. A panic of the engine is an error naming the template.
#[test]
fn an_engine_panic_is_an_error() {
    let source = "{% for m in messages[::-1] %}{{ m.content }}{% endfor %}";
    let err = ChatTemplate::from_origin(source, "tokenizer_config.json")
        .unwrap()
        .render(&[], false, &BTreeMap::new())
        .unwrap_err()
        .to_string();
    assert!(err.contains("tokenizer_config.json"), "{err}");
    assert!(err.contains("index out of bounds"), "{err}");
    let one = [ChatMessage::user("hi")];
    assert_eq!(render(source, &one).unwrap(), "hi");
}

/// Fuel counts steps, not bytes: 300 steps writing 1 MB each rendered 300 MB before (found by
/// ferrotune-fuzz: a mutated ChatML template repeating 10 MB strings reached its 2 GiB cap).
#[test]
fn output_past_the_cap_is_an_error() {
    let source = "{% for i in range(300) %}{{ 'x' * 1000000 }}{% endfor %}";
    let err = ChatTemplate::from_origin(source, "tokenizer_config.json")
        .unwrap()
        .render(&[], false, &BTreeMap::new())
        .unwrap_err()
        .to_string();
    assert!(err.contains("tokenizer_config.json"), "{err}");
    assert!(err.contains("more than 256 MiB"), "{err}");
}

/// Messages reach the template as transformers 5.24 hands them over: `None`-valued keys dropped
/// (nested ones kept), the reasoning copied to `thinking` (first) and `reasoning_content`, the
/// other keys in order; `tools` as given. Expected text: transformers' `render_jinja_template`
/// over `_normalize_chat_messages` of the same messages.
#[test]
fn messages_and_tools_as_transformers_hands_them_over() {
    let with = |role: &str, content: &str, extra: &[(&str, Value)]| {
        let mut m = ChatMessage::new(role, content);
        for (k, v) in extra {
            m.extra.insert(k.to_string(), v.clone());
        }
        m
    };
    let call: Value = serde_json::from_str(
        r#"[{"type": "function", "function": {"name": "f", "arguments": {"b": 1, "a": null}}}]"#,
    )
    .unwrap();
    let messages = [
        with(
            "assistant",
            "x",
            &[
                ("reasoning_content", Value::from("r")),
                ("name", Value::from(())),
            ],
        ),
        with(
            "assistant",
            "y",
            &[
                ("thinking", Value::from("t")),
                ("reasoning_content", Value::from("r2")),
            ],
        ),
        with(
            "assistant",
            "z",
            &[("reasoning", Value::from("q")), ("tool_calls", call)],
        ),
    ];
    let source = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}";
    let out = render(source, &messages).unwrap();
    assert_eq!(
        out,
        "{\"thinking\": \"r\", \"role\": \"assistant\", \"content\": \"x\", \"reasoning_content\": \"r\"}\n\
         {\"thinking\": \"t\", \"role\": \"assistant\", \"content\": \"y\", \"reasoning_content\": \"r2\"}\n\
         {\"thinking\": \"q\", \"role\": \"assistant\", \"content\": \"z\", \"reasoning\": \"q\", \
         \"tool_calls\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"arguments\": \
         {\"b\": 1, \"a\": null}}}], \"reasoning_content\": \"q\"}\n"
    );
    // No content: no `content` key. Tools: as given, `None` without.
    let bare = [ChatMessage::without_content("assistant")];
    let template = ChatTemplate::new("{{ messages[0] | tojson }}|{{ tools | tojson }}").unwrap();
    let tools: Value = serde_json::from_str(r#"[{"type": "function"}]"#).unwrap();
    let out = template
        .render_with_tools(&bare, Some(&tools), false, &BTreeMap::new())
        .unwrap();
    assert_eq!(out, "{\"role\": \"assistant\"}|[{\"type\": \"function\"}]");
    let out = template
        .render_with_tools(&bare, None, false, &BTreeMap::new())
        .unwrap();
    assert_eq!(out, "{\"role\": \"assistant\"}|null");
}
