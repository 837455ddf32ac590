//! GRPO's reward functions below the recipe: `reward_funcs` entries checked, a Python file's
//! functions in the worker (text and conversational completions, `None` as "not mine", the
//! dataset's columns as keyword arguments), and the weighted sum TRL takes (`nansum`).

use ferrotune_train::reward::{RewardBatch, RewardSet, RewardSpec};
use serde_json::{json, Value};

fn batch() -> RewardBatch {
    RewardBatch {
        prompts: vec!["p0".into(), "p0".into(), "p1".into(), "p1".into()],
        completions: vec!["ab".into(), "abcd".into(), "".into(), "xyz".into()],
        completion_ids: vec![vec![1, 2], vec![1, 2, 3, 4], vec![2], vec![5, 6, 2]],
        answers: vec!["4".into(), "4".into(), "2".into(), "2".into()],
        columns: (0..4)
            .map(|i| json!({"label": i}).as_object().unwrap().clone())
            .collect(),
    }
}

fn spec(entries: Value, weights: Option<Vec<f64>>) -> Result<RewardSpec, String> {
    let mut root = json!({ "reward_funcs": entries });
    if let Some(w) = weights {
        root["reward_weights"] = json!(w);
    }
    let mut cfg = ferrotune_train::config::load("dev/3B_full_grpo").unwrap();
    for (k, v) in root.as_object().unwrap() {
        cfg.apply_overrides(&[format!("{k}={v}")]).unwrap();
    }
    RewardSpec::parse(&cfg, 8).map_err(|e| e.to_string())
}

const FILE: &str = r#"
def chat_len(prompts, completions, label, **kwargs):
    # Conversational: the prompt's and the completion's messages.
    assert prompts[0][0]["role"] == "user" and completions[0][0]["role"] == "assistant"
    return [len(c[0]["content"]) + 10 * l for c, l in zip(completions, label)]

def only_even(prompts, completions, completion_ids, label, **kwargs):
    return [float(len(ids)) if l % 2 == 0 else None for ids, l in zip(completion_ids, label)]
"#;

#[test]
fn python_functions_get_trls_arguments_and_are_summed_as_trl_sums() {
    let dir = ferrotune_testing::fresh_dir(&format!("ferrotune-rewards-{}", std::process::id()));
    std::fs::write(dir.join("r.py"), FILE).unwrap();
    let file = dir.join("r.py").display().to_string();
    let s = spec(
        json!([
            {"python": file, "function": "chat_len", "conversational": true},
            {"python": file, "function": "only_even"},
            {"builtin": "exact_match", "column": "label"},
        ]),
        Some(vec![1.0, 0.5, 2.0]),
    )
    .unwrap();
    let mut set = RewardSet::start(&s, std::path::Path::new("."), 8, 2).unwrap();
    let scores = set.score(&batch()).unwrap();
    assert_eq!(scores.per_func[0], vec![2.0, 14.0, 20.0, 33.0]);
    assert_eq!(scores.per_func[1][0], 2.0);
    assert!(scores.per_func[1][1].is_nan());
    assert_eq!(scores.per_func[1][2], 1.0);
    // exact_match of the completion against the column's value (a number, as JSON).
    assert_eq!(scores.per_func[2], vec![0.0; 4]);
    // None (NaN) is left out of the weighted sum.
    assert_eq!(scores.total, vec![3.0, 14.0, 20.5, 33.0]);
    // The worker is long-lived: a second batch is answered alike.
    assert_eq!(set.score(&batch()).unwrap().total, scores.total);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn reward_entries_are_checked() {
    spec(json!([{"builtin": "gsm8k"}]), None).unwrap();
    for (entries, weights, says) in [
        (
            json!([{"builtin": "gsm8k"}]),
            Some(vec![1.0, 2.0]),
            "2 weights for 1 reward_funcs",
        ),
        (json!([{"builtin": "regex"}]), None, "needs 'pattern'"),
        (json!([{"python": "r.py"}]), None, "needs 'function'"),
        (
            json!([{"builtin": "gsm8k", "http": "http://x/"}]),
            None,
            "exactly one of",
        ),
        // https:// is served since reward/https.rs; another scheme is still refused.
        (json!([{"http": "ftp://x/"}]), None, "only http://"),
        (
            json!([{"http": "http://x/", "ca_cert": "ca.pem"}]),
            None,
            "ca_cert is for https://",
        ),
        (
            json!([{"builtin": "gsm8k", "timeout": 0}]),
            None,
            "positive number of seconds",
        ),
        (
            json!([{"builtin": "gsm8k", "colour": 1}]),
            None,
            "unknown key 'colour'",
        ),
        (json!([]), None, "is empty"),
    ] {
        let e = spec(entries.clone(), weights).unwrap_err();
        assert!(e.contains(says), "{entries}: {e}");
    }
}

/// An endpoint that reports an error for a row, and one that never answers: each an error
/// naming the function (and the row), the silent one within its timeout.
#[test]
fn http_errors_and_silence_name_the_function() {
    use std::io::Write;
    use std::net::TcpListener;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for (i, stream) in listener.incoming().enumerate() {
            let mut stream = stream.unwrap();
            read_whole_request(&mut stream);
            if i == 0 {
                let body = r#"{"error": "judge unavailable for this one", "row": 2}"#;
                write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                )
                .unwrap();
            } else {
                // Never answers.
                held.push(stream);
            }
        }
    });
    let url = format!("http://127.0.0.1:{port}/r");
    let s = spec(
        // 3 s, not less: the answering request must not time out on a loaded machine.
        json!([{"http": url, "name": "judge", "timeout": 3.0}]),
        None,
    )
    .unwrap();
    let mut set = RewardSet::start(&s, std::path::Path::new("."), 8, 2).unwrap();
    let e = set.score(&batch()).unwrap_err().to_string();
    assert!(
        e.contains(
            "reward function 'judge' failed at row 2 (prompt 1, completion 0): judge unavailable"
        ),
        "{e}"
    );
    let t = std::time::Instant::now();
    let e = set.score(&batch()).unwrap_err().to_string();
    assert!(
        e.contains("'judge'") && e.contains("no answer within 3.000 s"),
        "{e}"
    );
    assert!(t.elapsed().as_secs_f64() < 8.0, "{:?}", t.elapsed());
}

/// Reads one HTTP request to its end (headers, then `Content-Length` bytes of body): a server that
/// answers and closes with request bytes still unread makes the kernel reset the connection, and
/// the client may see the reset instead of the answer.
fn read_whole_request(stream: &mut std::net::TcpStream) {
    use std::io::Read;
    let mut got = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        let n = stream.read(&mut buf).unwrap();
        if n == 0 {
            return;
        }
        got.extend_from_slice(&buf[..n]);
        let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse().unwrap());
        if got.len() >= end + 4 + length {
            return;
        }
    }
}
