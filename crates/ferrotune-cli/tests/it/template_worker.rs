//! Chat templates render in a worker process with a memory cap and a time limit
//! (`ferrotune_data::chat_template::isolate`): hostile templates end in one clear error, and real
//! ones render exactly as transformers renders them, through the worker.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::common::{fixtures, read_json, tmpdir};
use ferrotune_data::chat_template::isolate;
use ferrotune_data::{ChatMessage, ChatTemplate, DataError};

/// A template that doubles a 100 MB string twelve times: 400 GB asked for in a few dozen steps,
/// well inside the step budget and writing nothing until the end.
const DOUBLING: &str = "{% set ns = namespace(a='x' * 100000000) %}{% for i in range(12) %}\
                        {% set ns.a = ns.a ~ ns.a %}{% endfor %}{{ ns.a | length }}";

/// A template whose compiling takes 3 GB: minijinja folds constant expressions while compiling,
/// building each `'x' * 100000000` argument then.
fn folding_at_compile_time() -> String {
    "{{ raise_exception('x' * 100000000) }}".repeat(30)
}

/// A template whose every step copies 200 MB: 100,000 steps, under the step budget, hours long.
const SLOW_STEPS: &str = "{% set a = 'x' * 100000000 %}{% for i in range(100000) %}\
                          {% set b = a ~ a %}{% endfor %}{{ 'done' }}";

/// `ferrotune tokenize` of one message with `template` as the tiny tokenizer's chat template,
/// under a 4 GiB address-space cap so that a template the worker does not stop cannot take the
/// test machine with it (it aborts instead).
fn tokenize_with_template(dir: &Path, template: &str) -> (Output, Duration) {
    let tok = dir.join("tokenizer");
    std::fs::create_dir_all(&tok).unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixtures().join("tiny_tokenizer").join(file), tok.join(file)).unwrap();
    }
    std::fs::write(tok.join("chat_template.jinja"), template).unwrap();
    let messages = dir.join("messages.json");
    std::fs::write(&messages, r#"[{"role": "user", "content": "hi"}]"#).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrotune"));
    cmd.arg("tokenize")
        .arg("--tokenizer")
        .arg(&tok)
        .arg("--messages")
        .arg(&messages)
        .env_remove("RUST_LOG");
    // SAFETY: setrlimit is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 4 << 30,
                rlim_max: 4 << 30,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let start = Instant::now();
    let out = cmd.output().expect("run ferrotune");
    (out, start.elapsed())
}

fn assert_one_error_line(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    for needle in needles {
        assert!(stderr.contains(needle), "{needle:?} not in: {stderr}");
    }
}

#[test]
fn a_template_that_builds_gigabytes_stops_at_the_workers_memory_cap() {
    let dir = tmpdir("template-worker", "memory");
    let (out, took) = tokenize_with_template(&dir, DOUBLING);
    let file = dir.join("tokenizer/chat_template.jinja");
    assert_one_error_line(
        &out,
        &[
            "needed more than 1024 MiB of memory to render",
            &file.display().to_string(),
        ],
    );
    assert!(took < Duration::from_secs(60), "took {took:?}");

    let (out, took) = tokenize_with_template(&dir, &folding_at_compile_time());
    assert_one_error_line(
        &out,
        &[
            "needed more than 1024 MiB of memory to compile",
            &file.display().to_string(),
        ],
    );
    assert!(took < Duration::from_secs(60), "took {took:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_template_with_slow_steps_stops_at_the_render_time_limit() {
    let dir = tmpdir("template-worker", "time");
    let (out, took) = tokenize_with_template(&dir, SLOW_STEPS);
    assert_one_error_line(&out, &["took more than 20 s to render"]);
    assert!(
        took >= Duration::from_secs(isolate::RENDER_SECONDS) && took < Duration::from_secs(60),
        "took {took:?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// The Jinja semantics cases against transformers (the ones `ferrotune-data` checks in-process),
/// rendered through the worker that the binary uses: the context crosses the process boundary as
/// JSON and must come back as the same render, `raise_exception` messages included.
#[test]
fn templates_render_through_the_worker_as_transformers_renders_them() {
    isolate::use_worker(
        env!("CARGO_BIN_EXE_ferrotune").into(),
        vec![isolate::WORKER_VERB.into()],
    );
    let fixture: serde_json::Value = read_json(fixtures().join("chat_template_cases.json"));
    let msgs: Vec<ChatMessage> = serde_json::from_value(fixture["messages"].clone()).unwrap();
    let tokens: BTreeMap<String, String> =
        serde_json::from_value(fixture["special_tokens"].clone()).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 20, "{} cases", cases.len());
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let ours = ChatTemplate::new(case["template"].as_str().unwrap())
            .and_then(|t| t.render(&msgs, true, &tokens));
        match (case["rendered"].as_str(), ours) {
            (Some(expected), Ok(got)) => assert_eq!(got, expected, "{name}"),
            (Some(_), Err(err)) => panic!("{name}: {err}"),
            (None, Ok(got)) => panic!("{name}: transformers raised, we rendered {got:?}"),
            (None, Err(err)) => {
                let expected = case["error"].as_str().unwrap();
                if let Some(message) = expected.strip_prefix("TemplateError: ") {
                    assert!(
                        matches!(&err, DataError::TemplateException { message: m } if m == message),
                        "{name}: expected exception {message:?}, got {err}"
                    );
                }
            }
        }
    }
    // The step budget is reported as such from the worker, naming the template's file.
    let runaway = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}\
                   {% endfor %}";
    let err = ChatTemplate::from_origin(runaway, "runaway.jinja")
        .unwrap()
        .render(&msgs, false, &tokens)
        .unwrap_err();
    assert!(
        matches!(&err, DataError::TemplateStepBudget { origin: Some(o), .. } if o == "runaway.jinja"),
        "{err}"
    );
}
