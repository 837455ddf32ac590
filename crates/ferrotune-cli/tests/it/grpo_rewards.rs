//! GRPO with rewards users write, through `ferrotune run dev/grpo_full_finetune_distributed` on
//! the tiny Llama with TRL's DAPO loss and β 0 (no reference): a Python file of two functions
//! with TRL's signature (a regex match and a length penalty, weighted) run in the reward worker,
//! under which the policy learns (the mean reward goes up); a function that raises, one that
//! answers the wrong number of rewards and one that hangs each stop the run with one error
//! naming the function (and the row, for the raise), the hang within its timeout; and an HTTP
//! endpoint (a loopback server in the test) given the same JSON.

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use common::{fixtures, metrics_lines, run_recipe, text, tmpdir};
use serde_json::Value;

/// A config over four GSM8K-style rows with `rewards` (the YAML of `reward_funcs` and
/// `reward_weights`) and `steps` batches.
fn write_config(dir: &Path, rewards: &str, steps: usize, lr: f64) -> PathBuf {
    let rows: Vec<String> = (0..4)
        .map(|i| {
            serde_json::json!({
                "question": format!("What is {i} plus {i}?"),
                "answer": format!("{i} + {i} = {}\n#### {}", 2 * i, 2 * i),
            })
            .to_string()
        })
        .collect();
    std::fs::write(dir.join("gsm.jsonl"), rows.join("\n") + "\n").unwrap();
    let yaml = format!(
        r#"output_dir: {out}
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  path: {policy}
dataset:
  _component_: torchtune.dev.grpo.gsm8k.gsm8k_dataset
  source: json
  data_files: gsm.jsonl
seed: 5
shuffle: false
model:
  _component_: torchtune.models.llama3_2.llama3_2_1b
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: {policy}
  output_dir: ${{output_dir}}
{rewards}
batch_size: 2
grpo_samples: 4
max_generated_tokens: 8
temperature: 1.0
num_iterations: 1
num_steps: {steps}
epochs: 100
save_every_n_epochs: 1000
optimizer:
  _component_: torch.optim.AdamW
  lr: {lr}
loss:
  loss_type: dapo
scale_rewards: group
device: cpu
dtype: fp32
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: ${{output_dir}}/logs
log_every_n_steps: 1
"#,
        out = dir.join("out").display(),
        policy = fixtures().join("llama3/model").display(),
    );
    let path = dir.join("grpo.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

fn run(dir: &Path, cfg: &Path) -> std::process::Output {
    run_recipe(
        "dev/grpo_full_finetune_distributed",
        cfg,
        &dir.join("out"),
        &[],
        dir,
        &[],
    )
}

const REWARDS_PY: &str = r#"
import re
import time

def vowels(prompts, completions, **kwargs):
    """The share of the completion's characters that are vowels (a regex)."""
    return [len(re.findall(r"[aeiouAEIOU]", c)) / max(1, len(c)) for c in completions]

def brevity(prompts, completions, completion_ids, **kwargs):
    """Minus the completion's token count over 8."""
    return [-len(ids) / 8 for ids in completion_ids]

def boom(prompts, completions, question, **kwargs):
    out = []
    for q in question:
        if "1 plus 1" in q:
            raise ValueError("cannot score " + q)
        out.append(0.0)
    return out

def short(prompts, completions, **kwargs):
    return [1.0]

def slow(prompts, completions, **kwargs):
    time.sleep(120)
    return [0.0] * len(completions)
"#;

#[test]
fn grpo_learns_from_a_user_reward_file() {
    let dir = tmpdir("grpo_rewards", "learns");
    std::fs::write(dir.join("rewards.py"), REWARDS_PY).unwrap();
    let rewards = "reward_funcs:\n  - python: rewards.py\n    function: vowels\n  - python: \
                   rewards.py\n    function: brevity\nreward_weights: [1.0, 0.1]";
    let cfg = write_config(&dir, rewards, 24, 2e-2);
    let o = run(&dir, &cfg);
    let log = text(&o);
    assert!(o.status.success(), "{log}");
    let lines = metrics_lines(&dir.join("out/logs/metrics.jsonl"));
    assert_eq!(lines.len(), 24, "{log}");
    let get = |l: &Value, k: &str| l[k].as_f64().unwrap_or_else(|| panic!("{k} in {l}"));
    // Each function's mean is logged; the total is their weighted sum.
    for l in &lines {
        let want = get(l, "rewards/vowels") + 0.1 * get(l, "rewards/brevity");
        assert!((get(l, "rewards") - want).abs() < 1e-5, "{l}");
    }
    let mean =
        |ls: &[Value]| ls.iter().map(|l| get(l, "rewards/vowels")).sum::<f64>() / ls.len() as f64;
    let (first, last) = (mean(&lines[..6]), mean(&lines[18..]));
    assert!(
        last > first + 0.1,
        "the vowel share did not go up: {first:.3} over the first 6 batches, {last:.3} over the \
         last 6\n{log}"
    );
}

#[test]
fn failing_rewards_stop_the_run_naming_the_function() {
    let dir = tmpdir("grpo_rewards", "fails");
    std::fs::write(dir.join("rewards.py"), REWARDS_PY).unwrap();
    // Rows 4..8 are the second prompt's ("What is 1 plus 1?"): row 4 is the first to raise.
    let raise = "reward_funcs:\n  - python: rewards.py\n    function: boom";
    let o = run(&dir, &write_config(&dir, raise, 2, 1e-3));
    let log = text(&o);
    assert!(!o.status.success(), "{log}");
    assert!(
        log.contains("reward function 'boom' failed at row 4 (prompt 1, completion 0): ValueError: cannot score"),
        "{log}"
    );
    let wrong = "reward_funcs:\n  - python: rewards.py\n    function: short";
    let o = run(&dir, &write_config(&dir, wrong, 2, 1e-3));
    let log = text(&o);
    assert!(
        !o.status.success()
            && log.contains("reward function 'short' returned 1 rewards for 8 completions"),
        "{log}"
    );
    let hang = "reward_funcs:\n  - python: rewards.py\n    function: slow\n    timeout: 2";
    let t = Instant::now();
    let o = run(&dir, &write_config(&dir, hang, 2, 1e-3));
    let log = text(&o);
    assert!(
        !o.status.success()
            && log.contains("reward function 'slow'")
            && log.contains("no answer within 2.000 s"),
        "{log}"
    );
    assert!(
        t.elapsed().as_secs() < 60,
        "the hang took {:?}",
        t.elapsed()
    );
}

/// One request of the loopback server: the JSON body.
fn read_request(stream: &mut std::net::TcpStream) -> Value {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut len = 0;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if line == "\r\n" || line.is_empty() {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap();
        }
    }
    let mut body = vec![0; len];
    reader.read_exact(&mut body).unwrap();
    serde_json::from_slice(&body).unwrap()
}

#[test]
fn an_http_endpoint_gets_the_batch_and_gives_the_rewards() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen: Arc<Mutex<Vec<Value>>> = Arc::default();
    let server_seen = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let mut stream = stream.unwrap();
            let req = read_request(&mut stream);
            // The reward: the completion's length in characters, over 10.
            let rewards: Vec<f64> = req["completions"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c.as_str().unwrap().chars().count() as f64 / 10.0)
                .collect();
            server_seen.lock().unwrap().push(req);
            let body = serde_json::json!({ "rewards": rewards }).to_string();
            write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
        }
    });
    let dir = tmpdir("grpo_rewards", "http");
    let rewards = format!(
        "reward_funcs:\n  - http: http://127.0.0.1:{port}/score\n    name: chars\n    timeout: 10"
    );
    let o = run(&dir, &write_config(&dir, &rewards, 2, 1e-3));
    let log = text(&o);
    assert!(o.status.success(), "{log}");
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2, "one request a batch");
    let req = &seen[0];
    assert_eq!(req["function"], "chars");
    assert_eq!(req["completions"].as_array().unwrap().len(), 8);
    assert_eq!(req["completion_ids"].as_array().unwrap().len(), 8);
    // The dataset's columns, one value per row, and the prompt's text.
    assert_eq!(req["columns"]["question"][4], "What is 1 plus 1?");
    assert!(req["prompts"][0]
        .as_str()
        .unwrap()
        .contains("What is 0 plus 0?"));
    let lines = metrics_lines(&dir.join("out/logs/metrics.jsonl"));
    for (l, req) in lines.iter().zip(seen.iter()) {
        let chars: Vec<f64> = req["completions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap().chars().count() as f64 / 10.0)
            .collect();
        let want = chars.iter().sum::<f64>() / chars.len() as f64;
        assert!(
            (l["rewards"].as_f64().unwrap() - want).abs() < 1e-5,
            "{l} vs {want}"
        );
    }
}

/// TRL's DAPO loss with `scale_rewards: batch` and a reward file on two ranks (each with its own
/// worker) trains what one process trains: DAPO's normaliser is every rank's kept tokens over the
/// ranks, and the batch's deviation is over every rank's rewards (TRL gathers them), so the
/// averaged gradients are one process's — sharded (grad_op) and DDP.
#[test]
fn trl_losses_on_two_ranks_train_what_one_process_trains() {
    let dir = tmpdir("grpo_rewards", "ranks");
    std::fs::write(dir.join("rewards.py"), REWARDS_PY).unwrap();
    let rewards = "reward_funcs:\n  - python: rewards.py\n    function: vowels\n  - python: \
                   rewards.py\n    function: brevity\nreward_weights: [1.0, 0.1]";
    let cfg = write_config(&dir, rewards, 2, 1e-3);
    for (name, extra) in [("sharded", None), ("ddp", Some("fsdp_sharding=none"))] {
        // Many stop tokens, so that completions end at different lengths and the ranks keep
        // different numbers of tokens; SGD, whose step is the gradient's scale.
        let common_args = [
            "scale_rewards=batch",
            "forward_batch_size=1",
            "stop_token_ids=[2,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39]",
            "optimizer._component_=torch.optim.SGD",
            "optimizer.lr=0.5",
        ];
        let single = dir.join(format!("{name}-single"));
        let mut args: Vec<&str> = common_args.to_vec();
        args.extend(extra);
        let o = run_recipe(
            "dev/grpo_full_finetune_distributed",
            &cfg,
            &single,
            &args,
            &dir,
            &[],
        );
        assert!(o.status.success(), "{}", text(&o));
        let ranks = dir.join(format!("{name}-ranks"));
        let mut cmd = vec![
            "run".to_string(),
            "--nproc-per-node".into(),
            "2".into(),
            "dev/grpo_full_finetune_distributed".into(),
            "--config".into(),
            cfg.display().to_string(),
            format!("output_dir={}", ranks.display()),
            "batch_size=1".into(),
        ];
        cmd.extend(args.iter().map(|s| s.to_string()));
        let o = common::ferrotune(&cmd, &dir, &[]);
        let log = text(&o);
        assert!(
            o.status.success() && log.contains("Distributed: 2 ranks"),
            "{log}"
        );
        let want = metrics_lines(&single.join("logs/metrics.jsonl"));
        let got = metrics_lines(&ranks.join("logs/metrics.jsonl"));
        assert_eq!(got.len(), want.len(), "{name}: {log}");
        // Some completions stopped early (the ranks' token counts differ).
        assert!(
            want.iter()
                .any(|l| l["num_stop_tokens"].as_f64().unwrap() > 0.0),
            "{want:?}"
        );
        for (g, w) in got.iter().zip(&want) {
            let (g, w) = (
                g["rewards"].as_f64().unwrap(),
                w["rewards"].as_f64().unwrap(),
            );
            assert!((g - w).abs() <= 1e-6, "{name} rewards: {g} vs {w}");
        }
        let a = common::load(&ranks.join("epoch_0/model.safetensors"));
        let b = common::load(&single.join("epoch_0/model.safetensors"));
        let start = common::load(&fixtures().join("llama3/model/model.safetensors"));
        for (key, t) in &b {
            let moved = ferrotune_testing::max_abs_diff(t, &start[key]);
            let apart = ferrotune_testing::max_abs_diff(t, &a[key]);
            assert!(
                apart <= 1e-4 * moved.max(1e-3),
                "{name} {key}: {apart} apart, moved {moved}"
            );
        }
    }
}

const CHAT_PY: &str = r#"
def polite(prompts, completions, level, **kwargs):
    # Conversational rows: the prompt's messages, the completion as one assistant message.
    assert prompts[0][-1]["role"] == "user", prompts[0]
    assert completions[0][0]["role"] == "assistant", completions[0]
    assert level[0] in ("easy", "hard"), level
    return [float("a" in c[0]["content"]) for c in completions]
"#;

/// TRL's prompt-only rows (`prompt_dataset`) with conversational prompts: rendered with the chat
/// template's generation prompt, and the reward file gets prompts and completions as messages
/// and the other columns by name.
#[test]
fn conversational_prompts_reach_the_reward_as_messages() {
    let dir = tmpdir("grpo_rewards", "chat");
    std::fs::write(dir.join("chat.py"), CHAT_PY).unwrap();
    let rows: Vec<String> = (0..4)
        .map(|i| {
            serde_json::json!({
                "prompt": [{"role": "user", "content": format!("Say {i}.")}],
                "level": if i % 2 == 0 { "easy" } else { "hard" },
            })
            .to_string()
        })
        .collect();
    std::fs::write(dir.join("chat.jsonl"), rows.join("\n") + "\n").unwrap();
    let cfg = write_config(
        &dir,
        "reward_funcs:\n  - python: chat.py\n    function: polite",
        2,
        1e-3,
    );
    let yaml = std::fs::read_to_string(&cfg).unwrap().replace(
        "  _component_: torchtune.dev.grpo.gsm8k.gsm8k_dataset\n  source: json\n  data_files: gsm.jsonl",
        "  _component_: prompt_dataset\n  source: json\n  data_files: chat.jsonl",
    );
    assert!(yaml.contains("chat.jsonl"));
    std::fs::write(&cfg, yaml).unwrap();
    let o = run(&dir, &cfg);
    let log = text(&o);
    assert!(o.status.success(), "{log}");
    assert_eq!(
        metrics_lines(&dir.join("out/logs/metrics.jsonl")).len(),
        2,
        "{log}"
    );
}
