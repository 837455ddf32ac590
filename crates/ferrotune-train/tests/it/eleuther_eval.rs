//! `eleuther_eval` against EleutherAI's lm-evaluation-harness (scripts/make_eleuther_fixtures.py):
//! the built-in tasks make the harness's requests from the same documents, and SmolLM2-135M
//! scores them as the harness's Hugging Face backend does (same log-likelihoods, greedy flags and
//! metrics).

use crate::common;

use std::path::PathBuf;

use candle_core::{DType, Device};
use ferrotune_data::eval_tasks::{select, Scored, Selection, TaskRegistry};
use ferrotune_data::Tokenizer;
use ferrotune_models::CausalLm;
use ferrotune_train::recipe::eleuther_eval::{
    evaluate, rolling_windows, score_encoded, score_requests,
};
use ferrotune_train::recipe::setup::pad_id;
use serde_json::Value;

/// (task, fixture file stem, the split the harness evaluates).
const TASKS: &[(&str, &str, &str)] = &[
    ("truthfulqa_mc1", "truthfulqa_mc", "validation"),
    ("truthfulqa_mc2", "truthfulqa_mc", "validation"),
    ("hellaswag", "hellaswag", "validation"),
    ("arc_easy", "arc_easy", "test"),
    ("arc_challenge", "arc_challenge", "test"),
    ("piqa", "piqa", "validation"),
    ("sciq", "sciq", "test"),
    ("openbookqa", "openbookqa", "test"),
    ("winogrande", "winogrande", "validation"),
    ("lambada_openai", "lambada_openai", "test"),
    ("boolq", "boolq", "validation"),
    ("copa", "copa", "validation"),
    ("rte", "rte", "validation"),
    ("social_iqa", "social_iqa", "validation"),
    ("commonsense_qa", "commonsense_qa", "validation"),
    ("logiqa", "logiqa", "test"),
    ("mathqa", "mathqa", "test"),
    ("lambada_standard", "lambada_standard", "test"),
];

/// The zero-shot generation tasks with list targets: (task, data file stem, split).
const GEN_TASKS: &[(&str, &str, &str)] = &[
    ("triviaqa", "triviaqa", "validation"),
    ("nq_open", "nq_open", "validation"),
];

/// SmolLM2-135M-Instruct from its GGUF in f32, its tokenizer, and the pad id.
fn smollm2() -> (Tokenizer, CausalLm, u32) {
    let path = ferrotune_data::asset_path("SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
    let tok = Tokenizer::from_gguf(&path, ferrotune_models::family::gguf_vocab_style).unwrap();
    let (model, _) = ferrotune_models::load_model(&path, DType::F32, &Device::Cpu).unwrap();
    let pad = pad_id(&tok, &model.config);
    (tok, model, pad)
}

fn golden() -> Value {
    let path = common::workspace_fixture("eleuther/golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// An include_path folder with one task per built-in task: the built-in definition included
/// unchanged, its documents read from the fixture JSONL (as the fixture script points the
/// harness's own task files at them); MMLU's subjects likewise, grouped as `local_mmlu` the way
/// the built-in `mmlu` group is.
fn local_tasks() -> (PathBuf, Selection) {
    let dir = std::env::temp_dir().join(format!("ferrotune-eleuther-tasks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let data = common::workspace_fixture("eleuther/data");
    write_local_tasks(&dir, TASKS);
    let g = golden();
    for (subject, category) in g["mmlu_subjects"].as_object().unwrap() {
        let category = category.as_str().unwrap();
        let yaml = format!(
            "include: mmlu_{subject}\ntask: local_mmlu_{subject}\ntag: local_mmlu_{category}_tasks\n\
             dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\n",
            data.join(format!("mmlu_{category}.jsonl")).display()
        );
        std::fs::write(dir.join(format!("local_mmlu_{subject}.yaml")), yaml).unwrap();
    }
    let aggregate = "aggregate_metric_list:\n  - metric: acc\n    weight_by_size: True\nmetadata:\n  version: 2\n";
    for (category, alias) in [
        ("stem", "stem"),
        ("other", "other"),
        ("social_sciences", "social sciences"),
        ("humanities", "humanities"),
    ] {
        let yaml = format!(
            "group: local_mmlu_{category}\ngroup_alias: {alias}\ntask:\n  - local_mmlu_{category}_tasks\n{aggregate}"
        );
        std::fs::write(dir.join(format!("_local_mmlu_{category}.yaml")), yaml).unwrap();
    }
    let yaml = format!(
        "group: local_mmlu\ntask:\n  - local_mmlu_stem\n  - local_mmlu_other\n  - local_mmlu_social_sciences\n  - local_mmlu_humanities\n{aggregate}"
    );
    std::fs::write(dir.join("_local_mmlu.yaml"), yaml).unwrap();
    let registry = TaskRegistry::new(Some(&dir)).unwrap();
    let mut names: Vec<String> = TASKS.iter().map(|(t, _, _)| format!("local_{t}")).collect();
    names.push("local_mmlu".into());
    (dir, select(&registry, &names).unwrap())
}

/// Writes `local_<task>.yaml` for each (task, stem, split): the built-in task included unchanged,
/// its evaluated split read from the fixture's `<stem>.jsonl`.
fn write_local_tasks(dir: &std::path::Path, tasks: &[(&str, &str, &str)]) {
    let data = common::workspace_fixture("eleuther/data");
    for (task, stem, split) in tasks {
        let other = if *split == "test" {
            "validation"
        } else {
            "test"
        };
        let yaml = format!(
            "include: {task}\ntask: local_{task}\ntag: []\ndataset_path: json\ndataset_name: null\n\
             dataset_kwargs:\n  data_files:\n    {split}: {}\n{other}_split: null\n{split}_split: {split}\n",
            data.join(format!("{stem}.jsonl")).display()
        );
        std::fs::write(dir.join(format!("local_{task}.yaml")), yaml).unwrap();
    }
}

fn requests_of(sample: &Value) -> Vec<(String, String)> {
    sample["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r[0].as_str().unwrap().to_string(),
                r[1].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn builtin_tasks_make_the_harness_requests() {
    let g = golden();
    let (dir, sel) = local_tasks();
    let specs = &sel.tasks;
    // MMLU's requests: the built-in template and description, document by document.
    let mmlu = specs
        .iter()
        .find(|t| t.name == "local_mmlu_abstract_algebra")
        .unwrap();
    let docs = mmlu.load_docs(&dir, None).unwrap();
    let ours = mmlu.requests(&docs, &[]).unwrap();
    let want = g["mmlu_samples"].as_array().unwrap();
    assert_eq!(ours.len(), want.len());
    for (o, s) in ours.iter().zip(want) {
        assert_eq!(o.requests, requests_of(s), "mmlu document {}", o.doc_id);
    }
    assert_eq!(sel.tasks.len(), TASKS.len() + 57);
    assert_eq!(sel.groups.len(), 5);
    for ((task, _, _), spec) in TASKS.iter().zip(specs) {
        let docs = spec.load_docs(&dir, None).unwrap();
        let fewshot = spec.load_fewshot_docs(&dir).unwrap();
        let ours = spec.requests(&docs, &fewshot).unwrap();
        let samples = g["tasks"][task]["samples"].as_array().unwrap();
        assert_eq!(ours.len(), samples.len(), "{task}: documents");
        for (o, s) in ours.iter().zip(samples) {
            assert_eq!(o.requests, requests_of(s), "{task} document {}", o.doc_id);
        }
        let version = &g["tasks"][task]["version"];
        let want = match version.as_f64() {
            Some(v) => format!("{v:.1}"),
            None => version.as_str().unwrap().to_string(),
        };
        assert_eq!(spec.version, want, "{task}: version");
    }
    // `limit` keeps the first documents.
    let docs = specs[0].load_docs(&dir, Some(2.0)).unwrap();
    assert_eq!(docs.len(), 2);
    let docs = specs[0].load_docs(&dir, Some(0.5)).unwrap();
    assert_eq!(docs.len(), 2);
}

#[test]
fn smollm2_scores_and_metrics_match_lm_eval() {
    let g = golden();
    let (tok, model, pad) = smollm2();
    let (_dir, sel) = local_tasks();

    // Every request's log-likelihood and greedy flag, batched (batch 5 pads rows of unequal
    // lengths together).
    let mut requests = Vec::new();
    let mut want: Vec<(f64, bool)> = Vec::new();
    for (task, _, _) in TASKS {
        for s in g["tasks"][task]["samples"].as_array().unwrap() {
            requests.extend(requests_of(s));
            let lls = s["loglikelihoods"].as_array().unwrap();
            let greedy = s["is_greedy"].as_array().unwrap();
            for (l, gr) in lls.iter().zip(greedy) {
                want.push((l.as_f64().unwrap(), gr.as_bool().unwrap()));
            }
        }
    }
    let got: Vec<Scored> = score_requests(&model, &tok, &requests, 4096, 5, pad, |_| {}).unwrap();
    assert_eq!(got.len(), want.len());
    let mut worst = 0f64;
    for (i, (s, (ll, greedy))) in got.iter().zip(&want).enumerate() {
        let diff = (s.loglikelihood - ll).abs();
        worst = worst.max(diff / ll.abs().max(1.0));
        assert!(
            diff <= 1e-4 * ll.abs().max(1.0),
            "request {i} {:?}: log-likelihood {} vs lm-eval {ll}",
            requests[i],
            s.loglikelihood
        );
        assert_eq!(s.is_greedy, *greedy, "request {i}: greedy flag");
    }
    eprintln!("worst relative log-likelihood difference: {worst:.2e}");

    // The recipe's aggregation, task by task and group by group, against the harness's values,
    // and the table torchtune's recipe prints, character for character.
    let report = evaluate(&model, &tok, &sel, None, 4096, 8, pad).unwrap();
    let mut checked = 0;
    let expected = TASKS
        .iter()
        .map(|(t, _, _)| (format!("local_{t}"), &g["tasks"][t]["metrics"]))
        .chain(
            g["mmlu"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (format!("local_{k}"), v)),
        );
    for (name, metrics) in expected {
        let outcome = report
            .tasks
            .get(&name)
            .or_else(|| report.groups.get(&name))
            .unwrap_or_else(|| panic!("{name}: no result"));
        for m in &outcome.metrics {
            let want = metrics[&m.name].as_f64().unwrap();
            let tol = if m.name == "perplexity" {
                1e-3 * want
            } else {
                1e-5
            };
            assert!(
                (m.value - want).abs() <= tol,
                "{name} {}: {} vs lm-eval {want}",
                m.name,
                m.value
            );
            if m.name != "perplexity" {
                let se = metrics[format!("{}_stderr", m.name)].as_f64().unwrap();
                assert!(
                    (m.stderr.unwrap() - se).abs() < 1e-5,
                    "{name} {} stderr: {:?} vs {se}",
                    m.name,
                    m.stderr
                );
            }
        }
        assert_eq!(
            outcome.metrics.len(),
            metrics.as_object().unwrap().len() / 2,
            "{name}: the harness's metrics"
        );
        checked += 1;
    }
    assert_eq!(checked, TASKS.len() + 57 + 5);
    // Perplexity is exp of a sum of f32 log-likelihoods: its 4th decimal may differ (checked
    // to 1e-3 relative above); every other cell must be identical.
    let ours = report.table();
    let theirs = g["table"].as_str().unwrap();
    assert_eq!(ours.lines().count(), theirs.lines().count(), "{ours}");
    for (a, b) in ours.lines().zip(theirs.lines()) {
        if a.contains("|perplexity|") {
            let (mut x, mut y): (Vec<&str>, Vec<&str>) =
                (a.split('|').collect(), b.split('|').collect());
            x[7] = "";
            y[7] = "";
            assert_eq!(x, y);
        } else {
            assert_eq!(a, b, "table row");
        }
    }
}

#[test]
fn a_shorter_max_length_keeps_the_last_tokens() {
    // Truncated from the left to max_length + 1 tokens minus the last: the continuation keeps
    // its tokens and loses context, so its log-likelihood changes but stays finite.
    let (tok, model, pad) = smollm2();
    let req = vec![(
        "The capital of France is Paris. The capital of Italy is".to_string(),
        " Rome".to_string(),
    )];
    let full = score_requests(&model, &tok, &req, 4096, 1, pad, |_| {}).unwrap()[0];
    let short = score_requests(&model, &tok, &req, 3, 1, pad, |_| {}).unwrap()[0];
    // With 3 tokens of room the input is the last 3 context tokens: the same as scoring them.
    let (ctx, cont) =
        ferrotune_train::recipe::eleuther_eval::encode_request(&tok, &req[0].0, &req[0].1).unwrap();
    assert_eq!(cont.len(), 1);
    let tail = tok.decode(&ctx[ctx.len() - 3..], false).unwrap();
    let direct = score_requests(
        &model,
        &tok,
        &[(tail, " Rome".into())],
        4096,
        1,
        pad,
        |_| {},
    )
    .unwrap()[0];
    assert!((short.loglikelihood - direct.loglikelihood).abs() < 1e-4);
    assert!((full.loglikelihood - short.loglikelihood).abs() > 1e-2);
}

/// The few-shot and generation tasks of the fixture: GSM8K (the built-in definition, 5 drawn
/// examples, greedy generation, two filters), ARC-Easy with 2 drawn examples, an MMLU subject with
/// 2 first examples of its dev split.
fn fewshot_tasks() -> (PathBuf, Selection) {
    let dir =
        std::env::temp_dir().join(format!("ferrotune-eleuther-fewshot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let data = common::workspace_fixture("eleuther/data");
    let file = |stem: &str| data.join(format!("{stem}.jsonl")).display().to_string();
    let write =
        |name: &str, text: String| std::fs::write(dir.join(format!("{name}.yaml")), text).unwrap();
    write(
        "local_gsm8k",
        format!(
            "include: gsm8k\ntask: local_gsm8k\ntag: []\ndataset_path: json\ndataset_name: null\n\
             dataset_kwargs:\n  data_files:\n    train: {}\n    test: {}\n",
            file("gsm8k_train"),
            file("gsm8k_test")
        ),
    );
    write(
        "local_arc_easy_2shot",
        format!(
            "include: arc_easy\ntask: local_arc_easy_2shot\ntag: []\ndataset_path: json\ndataset_name: null\n\
             num_fewshot: 2\nvalidation_split: null\ndataset_kwargs:\n  data_files:\n    train: {}\n    test: {}\n",
            file("arc_challenge"),
            file("arc_easy")
        ),
    );
    write(
        "local_mmlu_2shot",
        format!(
            "include: mmlu_astronomy\ntask: local_mmlu_2shot\ntag: []\ndataset_path: json\nnum_fewshot: 2\n\
             dataset_kwargs:\n  data_files:\n    dev: {}\n    test: {}\n",
            file("mmlu_humanities"),
            file("mmlu_stem")
        ),
    );
    let registry = TaskRegistry::new(Some(&dir)).unwrap();
    let names = ["local_gsm8k", "local_arc_easy_2shot", "local_mmlu_2shot"].map(String::from);
    (dir, select(&registry, &names).unwrap())
}

#[test]
fn fewshot_examples_are_drawn_as_the_harness_draws_them() {
    let g = golden();
    let (dir, sel) = fewshot_tasks();
    for spec in &sel.tasks[1..] {
        let docs = spec.load_docs(&dir, None).unwrap();
        let fewshot = spec.load_fewshot_docs(&dir).unwrap();
        let ours = spec.requests(&docs, &fewshot).unwrap();
        let want = g[&spec.name]["requests"].as_array().unwrap();
        assert_eq!(ours.len(), want.len(), "{}", spec.name);
        for (o, w) in ours.iter().zip(want) {
            let w: Vec<(String, String)> = w
                .as_array()
                .unwrap()
                .iter()
                .map(|r| (r[0].as_str().unwrap().into(), r[1].as_str().unwrap().into()))
                .collect();
            assert_eq!(o.requests, w, "{} document {}", spec.name, o.doc_id);
        }
    }
    // GSM8K's five examples from the train split, drawn per document.
    let gsm8k = &sel.tasks[0];
    let docs = gsm8k.load_docs(&dir, None).unwrap();
    let fewshot = gsm8k.load_fewshot_docs(&dir).unwrap();
    let ours = gsm8k.requests(&docs, &fewshot).unwrap();
    let samples = g["gsm8k"]["samples"].as_array().unwrap();
    for (o, s) in ours.iter().zip(samples) {
        assert_eq!(
            o.requests[0].0,
            s["context"].as_str().unwrap(),
            "gsm8k document {}",
            o.doc_id
        );
    }
}

#[test]
fn smollm2_generates_and_scores_gsm8k_as_lm_eval() {
    let g = golden();
    let (tok, model, pad) = smollm2();
    let (_dir, sel) = fewshot_tasks();
    // One document per batch, as the fixture ran the harness.
    let report = evaluate(&model, &tok, &sel, None, 4096, 1, pad).unwrap();

    // The responses themselves, cut at the stop strings.
    let gsm8k = &sel.tasks[0];
    let spec = gsm8k.generation.as_ref().unwrap();
    let samples = g["gsm8k"]["samples"].as_array().unwrap();
    let contexts: Vec<String> = samples[..3]
        .iter()
        .map(|s| s["context"].as_str().unwrap().into())
        .collect();
    let responses = ferrotune_train::recipe::eleuther_eval::generate_until(
        &model, &tok, &contexts, spec, 4096, 1, pad,
    )
    .unwrap();
    for (r, s) in responses.iter().zip(samples) {
        assert_eq!(r, s["response"].as_str().unwrap());
    }
    // Each filter's answer, as the harness extracted it.
    for s in samples {
        let filter = gsm8k
            .filters
            .iter()
            .find(|f| f.name == s["filter"].as_str().unwrap())
            .unwrap();
        assert_eq!(
            filter.apply(s["response"].as_str().unwrap()),
            s["filtered"][0].as_str().unwrap()
        );
    }
    // Metrics per filter, and the table row by row.
    let outcome = &report.tasks["local_gsm8k"];
    let want = g["gsm8k"]["metrics"].as_object().unwrap();
    assert_eq!(outcome.metrics.len(), 2);
    for m in &outcome.metrics {
        let key = format!("{},{}", m.name, m.filter);
        assert!(
            (m.value - want[&key].as_f64().unwrap()).abs() < 1e-9,
            "{key}"
        );
        let se = want[&format!("{}_stderr,{}", m.name, m.filter)]
            .as_f64()
            .unwrap();
        assert!((m.stderr.unwrap() - se).abs() < 1e-9, "{key} stderr");
    }
    let only_gsm8k = Selection {
        tasks: vec![gsm8k.clone()],
        groups: Vec::new(),
    };
    let table = ferrotune_data::eval_tasks::results_table(
        &only_gsm8k,
        &report.tasks,
        &std::collections::BTreeMap::new(),
    );
    assert_eq!(
        table.trim_end(),
        g["gsm8k"]["table"].as_str().unwrap().trim_end()
    );

    // The few-shot log-likelihood tasks' metrics.
    for name in ["local_arc_easy_2shot", "local_mmlu_2shot"] {
        let want = &g[name]["metrics"];
        for m in &report.tasks[name].metrics {
            let v = want[&m.name].as_f64().unwrap();
            assert!(
                (m.value - v).abs() < 1e-9,
                "{name} {}: {} vs {v}",
                m.name,
                m.value
            );
        }
    }
}

#[test]
fn smollm2_wikitext_rolls_windows_as_lm_eval() {
    let g = golden();
    let (tok, model, pad) = smollm2();
    let dir = std::env::temp_dir().join(format!(
        "ferrotune-eleuther-wikitext-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let data = common::workspace_fixture("eleuther/data/wikitext.jsonl");
    std::fs::write(
        dir.join("local_wikitext.yaml"),
        format!(
            "include: wikitext\ntask: local_wikitext\ndataset_path: json\ndataset_name: null\n\
             training_split: null\nvalidation_split: null\ndataset_kwargs:\n  data_files:\n    test: {}\n",
            data.display()
        ),
    )
    .unwrap();
    let registry = TaskRegistry::new(Some(&dir)).unwrap();
    let sel = select(&registry, &["local_wikitext".into()]).unwrap();
    let max_length = g["wikitext"]["max_length"].as_u64().unwrap() as usize;

    // Each document's log-likelihood: its windows' summed.
    let task = &sel.tasks[0];
    let docs = task.load_docs(&dir, None).unwrap();
    let reqs = task.requests(&docs, &[]).unwrap();
    let prefix = tok.bos_id().or(tok.eos_ids().first().copied()).unwrap();
    let want = g["wikitext"]["loglikelihoods"].as_array().unwrap();
    let mut rolled = false;
    for (r, w) in reqs.iter().zip(want) {
        let tokens = tok.encode(&r.requests[0].1, false).unwrap();
        let windows = rolling_windows(&tokens, prefix, max_length);
        assert_eq!(windows.len(), tokens.len().div_ceil(max_length));
        rolled |= windows.len() > 2;
        // Every token scored exactly once, each window's context ending where its tokens start.
        let scored: Vec<u32> = windows.iter().flat_map(|(_, t)| t.clone()).collect();
        assert_eq!(scored, tokens);
        let ll: f64 = score_encoded(&model, &windows, max_length, 4, pad, |_| {})
            .unwrap()
            .iter()
            .map(|s| s.loglikelihood)
            .sum();
        let w = w.as_f64().unwrap();
        assert!((ll - w).abs() < 1e-4 * w.abs(), "{ll} vs lm-eval {w}");
    }

    assert!(rolled, "a document rolls over more than two windows");
    let report = evaluate(&model, &tok, &sel, None, max_length, 4, pad).unwrap();
    let metrics = &g["wikitext"]["metrics"];
    for m in &report.tasks["local_wikitext"].metrics {
        let want = metrics[&m.name].as_f64().unwrap();
        assert!(
            (m.value - want).abs() < 1e-4 * want,
            "{}: {} vs {want}",
            m.name,
            m.value
        );
        assert_eq!(m.stderr, None);
    }
    assert_eq!(report.tasks["local_wikitext"].metrics.len(), 3);
}

/// TriviaQA and Natural Questions (3 drawn examples): SmolLM2's greedy answers cut at "\n", "." or ",",
/// whitespace-stripped, a hit when they match any of the reference answers (case and punctuation
/// ignored; NQ drops articles too), with lm-eval's responses, per-document scores, metrics and
/// table.
#[test]
fn smollm2_answers_list_target_questions_as_lm_eval() {
    let g = golden();
    let (tok, model, pad) = smollm2();
    let dir = std::env::temp_dir().join(format!("ferrotune-eleuther-gen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let data = common::workspace_fixture("eleuther/data");
    for (task, stem, split) in GEN_TASKS {
        let file = |stem: &str| data.join(format!("{stem}.jsonl")).display().to_string();
        let yaml = format!(
            "include: {task}\ntask: local_{task}\ntag: []\ndataset_path: json\ndataset_name: null\n\
             training_split: train\nnum_fewshot: 3\ndataset_kwargs:\n  data_files:\n    {split}: {}\n\
             \x20   train: {}\n",
            file(stem),
            file(&format!("{stem}_train"))
        );
        std::fs::write(dir.join(format!("local_{task}.yaml")), yaml).unwrap();
    }
    let registry = TaskRegistry::new(Some(&dir)).unwrap();
    let names: Vec<String> = GEN_TASKS
        .iter()
        .map(|(t, _, _)| format!("local_{t}"))
        .collect();
    let sel = select(&registry, &names).unwrap();
    let report = evaluate(&model, &tok, &sel, None, 4096, 1, pad).unwrap();
    let mut hits = 0.0;
    for ((task, _, _), spec) in GEN_TASKS.iter().zip(&sel.tasks) {
        let want = &g["generation_tasks"][task];
        let samples = want["samples"].as_array().unwrap();
        let docs = spec.load_docs(&dir, None).unwrap();
        let fewshot = spec.load_fewshot_docs(&dir).unwrap();
        let requests = spec.requests(&docs, &fewshot).unwrap();
        let contexts: Vec<String> = requests.iter().map(|r| r.requests[0].0.clone()).collect();
        for (c, s) in contexts.iter().zip(samples) {
            assert_eq!(c, s["context"].as_str().unwrap(), "{task}: context");
        }
        let responses = ferrotune_train::recipe::eleuther_eval::generate_until(
            &model,
            &tok,
            &contexts,
            spec.generation.as_ref().unwrap(),
            4096,
            1,
            pad,
        )
        .unwrap();
        for ((doc, response), s) in docs.iter().zip(&responses).zip(samples) {
            assert_eq!(
                response,
                s["response"].as_str().unwrap(),
                "{task}: response"
            );
            let scored = spec.generated_metrics(doc, response).unwrap();
            let em = s["exact_match"].as_f64().unwrap();
            assert_eq!(
                scored["exact_match,remove_whitespace"], em,
                "{task}: {response:?}"
            );
            hits += em;
        }
        let outcome = &report.tasks[&format!("local_{task}")];
        let metrics = want["metrics"].as_object().unwrap();
        for m in &outcome.metrics {
            let key = format!("{},{}", m.name, m.filter);
            let v = metrics[&key].as_f64().unwrap();
            assert!(
                (m.value - v).abs() < 1e-9,
                "{task} {key}: {} vs {v}",
                m.value
            );
            let se = metrics[&format!("{}_stderr,{}", m.name, m.filter)]
                .as_f64()
                .unwrap();
            assert!((m.stderr.unwrap() - se).abs() < 1e-9, "{task} {key} stderr");
        }
    }
    // The fixture's questions are easy enough that some answers match (and some need an alias).
    assert!(hits >= 2.0, "{hits}");
    let table = ferrotune_data::eval_tasks::results_table(
        &sel,
        &report.tasks,
        &std::collections::BTreeMap::new(),
    );
    assert_eq!(
        table.trim_end(),
        g["generation_tasks_table"].as_str().unwrap().trim_end()
    );
}
