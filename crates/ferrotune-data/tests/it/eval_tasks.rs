//! lm-evaluation-harness task files: names, tags, includes, the harness's `doc_to_*` semantics,
//! metrics, and one clear error for what ferrotune cannot run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ferrotune_data::eval_tasks::{resolve_tasks, Scored, TaskRegistry};

fn temp_dir(name: &str) -> PathBuf {
    ferrotune_testing::fresh_dir(&format!(
        "ferrotune-eval-tasks-{name}-{}",
        std::process::id()
    ))
}

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

fn names(registry: &TaskRegistry, name: &str) -> Vec<String> {
    registry
        .resolve(name)
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect()
}

fn error_of(dir: &Path, task: &str) -> String {
    let registry = TaskRegistry::new(Some(dir)).unwrap();
    registry.resolve(task).unwrap_err().to_string()
}

fn scored(lls: &[f64]) -> Vec<Scored> {
    lls.iter()
        .map(|&l| Scored {
            loglikelihood: l,
            is_greedy: false,
        })
        .collect()
}

#[test]
fn tags_name_their_tasks_and_unknown_names_list_the_known_ones() {
    let registry = TaskRegistry::new(None).unwrap();
    assert_eq!(names(&registry, "ai2_arc"), ["arc_challenge", "arc_easy"]);
    assert_eq!(
        names(&registry, "truthfulqa"),
        ["truthfulqa_mc1", "truthfulqa_mc2"]
    );
    let err = registry.resolve("hellaswg").unwrap_err().to_string();
    assert!(
        err.contains("unknown task 'hellaswg'") && err.contains("hellaswag"),
        "{err}"
    );
    // A tag and a task it covers give the task once.
    let specs = resolve_tasks(&registry, &["arc_easy".into(), "ai2_arc".into()]).unwrap();
    let got: Vec<&str> = specs.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(got, ["arc_easy", "arc_challenge"]);
    // Built-in tasks read the Hub datasets the harness reads.
    let arc = &registry.resolve("arc_challenge").unwrap()[0];
    assert_eq!(
        (
            arc.dataset_path.as_str(),
            arc.dataset_name.as_deref(),
            arc.split.as_str()
        ),
        ("allenai/ai2_arc", Some("ARC-Challenge"), "test")
    );
    let tqa = &registry.resolve("truthfulqa_mc2").unwrap()[0];
    assert_eq!(
        (
            tqa.dataset_path.as_str(),
            tqa.dataset_name.as_deref(),
            tqa.split.as_str()
        ),
        (
            "truthfulqa/truthful_qa",
            Some("multiple_choice"),
            "validation"
        )
    );
}

#[test]
fn a_custom_task_renders_templates_as_the_harness_does() {
    let dir = temp_dir("custom");
    write(
        &dir,
        "docs.jsonl",
        concat!(
            r#"{"q": "Is water wet?", "answer": "yes", "topic": "physics", "opts": {"label": ["a", "b"], "text": ["yes", "no"]}, "key": "b"}"#,
            "\n",
            r#"{"q": "Is fire cold?", "answer": "no", "topic": "chemistry", "opts": {"label": ["a", "b"], "text": ["yes", "no"]}, "key": "a"}"#,
            "\n"
        ),
    );
    // Shared keys in a file without `task`, included by relative path.
    write(
        &dir,
        "_base.yaml",
        "output_type: multiple_choice\ndataset_path: json\ntest_split: test\n\
         doc_to_choice: ['yes', 'no']\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
    );
    write(
        &dir,
        "yesno.yaml",
        &format!(
            "include: _base.yaml\ntask: yesno\ndataset_kwargs:\n  data_files:\n    test: {}\n\
             description: \"About {{{{topic}}}}:\\n\"\ndoc_to_text: \"Q: {{{{q.strip()}}}}\\nA:\"\n\
             doc_to_target: answer\nmetadata:\n  version: 2\n",
            dir.join("docs.jsonl").display()
        ),
    );
    // The gold as a rendered index (`list.index`), choices from a nested column.
    write(
        &dir,
        "indexed.yaml",
        &format!(
            "task: indexed\noutput_type: multiple_choice\ndataset_path: json\n\
             dataset_kwargs:\n  data_files: {}\ntest_split: train\ndoc_to_text: q\n\
             doc_to_target: \"{{{{opts.label.index(key)}}}}\"\ndoc_to_choice: \"{{{{opts.text}}}}\"\n\
             target_delimiter: \"\"\n",
            dir.join("docs.jsonl").display()
        ),
    );
    let registry = TaskRegistry::new(Some(&dir)).unwrap();
    let yesno = &registry.resolve("yesno").unwrap()[0];
    assert_eq!(yesno.version, "2");
    let docs = yesno.load_docs(&dir, None).unwrap();
    let reqs = yesno.requests(&docs, &[]).unwrap();
    assert_eq!(
        reqs[0].requests,
        [
            (
                "About physics:\nQ: Is water wet?\nA:".to_string(),
                " yes".to_string()
            ),
            (
                "About physics:\nQ: Is water wet?\nA:".to_string(),
                " no".to_string()
            ),
        ]
    );
    // The gold is the choice whose text the target column holds.
    let m = yesno.doc_metrics(&docs[1], &scored(&[-3.0, -1.0])).unwrap();
    assert_eq!(
        m,
        BTreeMap::from([("acc".into(), 1.0), ("acc_norm".into(), 1.0)])
    );
    // acc_norm divides by each choice's length in characters: -3/3 = -1.0 beats -2.5/2.
    let m = yesno.doc_metrics(&docs[0], &scored(&[-3.0, -2.5])).unwrap();
    assert_eq!(
        m,
        BTreeMap::from([("acc".into(), 0.0), ("acc_norm".into(), 1.0)])
    );
    let agg = yesno.aggregate(&[
        BTreeMap::from([("acc".into(), 1.0), ("acc_norm".into(), 1.0)]),
        BTreeMap::from([("acc".into(), 0.0), ("acc_norm".into(), 1.0)]),
    ]);
    assert_eq!(agg[0].value, 0.5);
    assert!((agg[0].stderr.unwrap() - 0.5).abs() < 1e-12);
    assert_eq!(agg[1].stderr, Some(0.0));

    let indexed = &registry.resolve("indexed").unwrap()[0];
    let docs = indexed.load_docs(&dir, None).unwrap();
    let reqs = indexed.requests(&docs, &[]).unwrap();
    assert_eq!(
        reqs[1].requests[0],
        ("Is fire cold?".to_string(), "yes".to_string())
    );
    let m = indexed
        .doc_metrics(&docs[0], &scored(&[-2.0, -1.0]))
        .unwrap();
    assert_eq!(m["acc"], 1.0, "gold index 1 ('b')");
    // Multiple-choice tasks report acc and acc_norm unless metric_list says otherwise.
    assert_eq!(indexed.metrics.len(), 2);
}

#[test]
fn what_cannot_run_is_refused_with_the_reason() {
    let dir = temp_dir("refused");
    let base = "output_type: multiple_choice\ndataset_path: json\ntest_split: test\n\
                doc_to_text: q\ndoc_to_target: 0\ndoc_to_choice: c\n";
    write(
        &dir,
        "py.yaml",
        &format!("task: py\n{base}process_docs: !function utils.process_docs\n"),
    );
    write(&dir, "gen.yaml", "task: gen\noutput_type: generate_until\ndataset_path: json\ntest_split: test\ndoc_to_text: q\ndoc_to_target: a\ngeneration_kwargs:\n  do_sample: true\n");
    write(&dir, "rolling.yaml", "task: rolling\noutput_type: loglikelihood_rolling\ndataset_path: json\ntest_split: test\ndoc_to_text: q\ndoc_to_target: a\nmetric_list:\n  - metric: acc\n");
    write(
        &dir,
        "shots.yaml",
        &format!("task: shots\n{base}num_fewshot: 5\nfewshot_config:\n  sampler: balanced\n"),
    );
    write(
        &dir,
        "typo.yaml",
        &format!("task: typo\n{base}doc_to_txt: q\n"),
    );
    write(
        &dir,
        "filters.yaml",
        &format!("task: filters\n{base}filter_list:\n  - name: x\n    filter:\n      - function: take_first\n"),
    );
    write(&dir, "nosplit.yaml", "task: nosplit\noutput_type: loglikelihood\ndataset_path: json\ndoc_to_text: q\ndoc_to_target: a\n");
    write(
        &dir,
        "badinc.yaml",
        &format!("task: badinc\ninclude: nothing_here\n{base}"),
    );
    write(
        &dir,
        "metric.yaml",
        &format!("task: metric\n{base}metric_list:\n  - metric: f1\n"),
    );
    let cases = [
        ("py", "Python functions cannot run"),
        ("gen", "only greedy decoding is supported"),
        (
            "rolling",
            "metric 'acc' is not supported for this output_type (word_perplexity",
        ),
        ("shots", "only sampler (default, first_n)"),
        ("typo", "unknown key 'doc_to_txt'"),
        ("filters", "filters apply to generate_until tasks only"),
        ("nosplit", "needs a test_split or validation_split"),
        ("badinc", "'include: nothing_here' is neither"),
        ("metric", "metric 'f1' is not supported"),
    ];
    for (task, needle) in cases {
        let err = error_of(&dir, task);
        assert!(err.contains(needle), "{task}: {err}");
        assert!(
            err.contains(&format!("{task}.yaml")),
            "{task}: names the file: {err}"
        );
    }
    // A missing include_path folder is named.
    let err = TaskRegistry::new(Some(&dir.join("missing")))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("missing") && err.contains("include_path"),
        "{err}"
    );
}

#[test]
fn groups_select_their_tasks_and_aggregate_as_the_harness() {
    use ferrotune_data::eval_tasks::{aggregate_groups, select, MetricResult, Outcome};

    let registry = TaskRegistry::new(None).unwrap();
    let mmlu = select(&registry, &["mmlu".into()]).unwrap();
    assert_eq!(mmlu.tasks.len(), 57);
    assert_eq!(mmlu.groups.len(), 5);
    assert_eq!(mmlu.leaves("mmlu_stem").len(), 19);
    let algebra = mmlu
        .tasks
        .iter()
        .find(|t| t.name == "mmlu_abstract_algebra")
        .unwrap();
    assert_eq!(
        (
            algebra.dataset_path.as_str(),
            algebra.dataset_name.as_deref(),
            algebra.split.as_str()
        ),
        ("cais/mmlu", Some("abstract_algebra"), "test")
    );
    assert_eq!(
        algebra.description,
        "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
    );

    let dir = temp_dir("groups");
    let task = |name: &str| {
        format!(
            "task: {name}\noutput_type: multiple_choice\ndataset_path: json\ntest_split: test\n\
             doc_to_text: q\ndoc_to_target: 0\ndoc_to_choice: c\n"
        )
    };
    write(&dir, "a.yaml", &task("a"));
    write(&dir, "b.yaml", &task("b"));
    write(
        &dir,
        "g.yaml",
        "group: plain\ngroup_alias: plain mean\ntask: [a, b]\naggregate_metric_list:\n  - metric: acc\n    weight_by_size: false\n",
    );
    write(
        &dir,
        "w.yaml",
        "group: weighted\ntask: [a, b]\naggregate_metric_list:\n  - metric: acc\n",
    );
    write(&dir, "bad.yaml", "group: bad\ntask: [a, nothing]\n");
    let registry = TaskRegistry::new(Some(&dir)).unwrap();
    let sel = select(&registry, &["plain".into(), "weighted".into()]).unwrap();
    assert_eq!(sel.tasks.len(), 2, "each task once");
    let outcome = |v: f64, se: f64, docs: usize| Outcome {
        metrics: vec![MetricResult {
            name: "acc".into(),
            filter: "none".into(),
            value: v,
            stderr: Some(se),
            higher_is_better: true,
        }],
        docs,
    };
    let tasks = BTreeMap::from([
        ("a".to_string(), outcome(1.0, 0.0, 2)),
        ("b".to_string(), outcome(0.25, 0.25, 4)),
    ]);
    let groups = aggregate_groups(&sel, &tasks);
    let plain = &groups["plain"].metrics[0];
    assert!((plain.value - 0.625).abs() < 1e-12);
    assert!(
        (plain.stderr.unwrap() - 0.125).abs() < 1e-12,
        "√(0² + 0.25²) / 2"
    );
    let weighted = &groups["weighted"].metrics[0];
    assert!((weighted.value - 0.5).abs() < 1e-12, "(2·1 + 4·0.25) / 6");
    // The pooled variance: Σ (n−1)·se²·n / (N − k), over N.
    let pooled = ((3.0 * 0.0625 * 4.0) / 4.0 / 6.0f64).sqrt();
    assert!((weighted.stderr.unwrap() - pooled).abs() < 1e-12);
    assert_eq!(groups["weighted"].docs, 6);

    let err = registry.resolve("bad").unwrap_err().to_string();
    assert!(err.contains("unknown task 'nothing'"), "{err}");
}

/// A `doc_to_text` template that would loop 10^10 times stops at the step budget all templates
/// share, with an error that says so.
#[test]
fn a_runaway_doc_template_stops_at_its_step_budget() {
    let dir = temp_dir("runaway");
    write(&dir, "docs.jsonl", "{\"q\": \"x\"}\n");
    write(
        &dir,
        "loop.yaml",
        &format!(
            "task: loop\noutput_type: generate_until\ndataset_path: json\n\
             dataset_kwargs:\n  data_files: {}\ntest_split: train\n\
             doc_to_text: \"{{% for i in range(100000) %}}{{% for j in range(100000) %}}\
             {{% endfor %}}{{% endfor %}}\"\ndoc_to_target: q\n",
            dir.join("docs.jsonl").display()
        ),
    );
    let registry = TaskRegistry::new(Some(&dir)).unwrap();
    let task = &registry.resolve("loop").unwrap()[0];
    let docs = task.load_docs(&dir, None).unwrap();
    let err = task.requests(&docs, &[]).unwrap_err().to_string();
    assert!(err.contains("ran out of its step budget"), "{err}");
}
