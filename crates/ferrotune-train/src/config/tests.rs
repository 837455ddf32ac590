//! Unit tests of config loading, overrides and interpolation.

use super::*;

fn cfg(yaml: &str) -> Config {
    Config {
        root: parse_yaml(yaml, "test").unwrap(),
        origin: "test".into(),
    }
}

#[test]
fn overrides_follow_torchtune() {
    let mut c = cfg("output_dir: /tmp/a\noptimizer:\n  _component_: torch.optim.AdamW\n  lr: 1e-3\ndataset:\n  _component_: alpaca_dataset\n  packed: false\nlr_scheduler:\n  num_warmup_steps: 3\n");
    c.apply_overrides(&[
        "optimizer.lr=3e-4".into(),
        "dataset.column_map.output=summary".into(),
        "model.lora_attn_modules=[q_proj,v_proj]".into(),
        "lr_scheduler=null".into(),
        "dataset=torchtune.datasets.instruct_dataset".into(),
        "batch_size=8".into(),
        "shuffle=False".into(),
        "~dataset.packed".into(),
    ])
    .unwrap();
    assert_eq!(c.f64("optimizer.lr").unwrap(), Some(3e-4));
    assert_eq!(
        c.str("dataset.column_map.output").unwrap().as_deref(),
        Some("summary")
    );
    assert_eq!(
        c.str_list("model.lora_attn_modules").unwrap(),
        Some(vec!["q_proj".to_string(), "v_proj".to_string()])
    );
    assert!(c.get("lr_scheduler").is_none());
    // A string given for a mapping replaces its builder and keeps its other keys.
    assert_eq!(
        c.str("dataset._component_").unwrap().as_deref(),
        Some("torchtune.datasets.instruct_dataset")
    );
    assert!(c.get("dataset.column_map").is_some());
    assert!(c.get("dataset.packed").is_none());
    assert_eq!(c.usize("batch_size").unwrap(), Some(8));
    assert_eq!(c.bool("shuffle").unwrap(), Some(false));
    assert!(apply_override(&mut c.root, "no_equals_sign").is_err());
    assert!(apply_override(&mut c.root, "a..b=1").is_err());
    assert!(apply_override(&mut c.root, "~missing.key").is_err());
    assert!(apply_override(&mut c.root, "output_dir.x=1").is_err());
}

#[test]
fn interpolation_resolves_keys_and_environment() {
    std::env::set_var("FERROTUNE_TEST_VAR", "/data");
    let mut c = cfg("output_dir: /tmp/run\nn: 4\nmetric_logger:\n  log_dir: ${output_dir}/logs\ncopy: ${n}\npath: ${oc.env:FERROTUNE_TEST_VAR}/x\nfallback: ${oc.env:FERROTUNE_UNSET_VAR,/d}\n");
    c.resolve().unwrap();
    assert_eq!(
        c.str("metric_logger.log_dir").unwrap().as_deref(),
        Some("/tmp/run/logs")
    );
    // A whole-string reference keeps the referenced value's type.
    assert_eq!(c.usize("copy").unwrap(), Some(4));
    assert_eq!(c.str("path").unwrap().as_deref(), Some("/data/x"));
    assert_eq!(c.str("fallback").unwrap().as_deref(), Some("/d"));
    let mut bad = cfg("a: ${missing}\n");
    assert!(bad.resolve().is_err());
    let mut cycle = cfg("a: ${b}\nb: ${a}\n");
    assert!(cycle.resolve().unwrap_err().0.contains("cycle"));
}

#[test]
fn interpolations_that_double_empty_strings_resolve_each_key_once() {
    // The doubling chain over an empty string stays under the byte bound but took 2^n
    // resolutions (found by ferrotune-fuzz: 40 keys ran past its 30 CPU seconds).
    let mut yaml = "k0: ''\n".to_string();
    for i in 1..64 {
        yaml += &format!("k{i}: ${{k{}}}${{k{}}}\n", i - 1, i - 1);
    }
    let mut c = cfg(&yaml);
    c.resolve().unwrap();
    assert_eq!(c.str("k63").unwrap().as_deref(), Some(""));
}

#[test]
fn interpolations_that_double_are_stopped() {
    // Each key twice the one before: 16 bytes become 256 MiB (found by ferrotune-fuzz, which
    // made 1 KiB of them abort on a failed allocation).
    let mut yaml = "k0: xxxxxxxxxxxxxxxx\n".to_string();
    for i in 1..25 {
        yaml += &format!("k{i}: ${{k{}}}${{k{}}}\n", i - 1, i - 1);
    }
    let e = cfg(&yaml).resolve().unwrap_err().0;
    assert!(e.contains("more than 64 MiB"), "{e}");
}

#[test]
fn validation_names_the_key_the_type_and_the_nearest_key() {
    let c = cfg("output_dir: /x\nlr_shceduler: null\nbatch_size: four\noptimizer:\n  lrr: 1\ndataset:\n  - source: a.json\n    packd: true\n");
    let problems = validate(&c.root, "c.yaml").unwrap_err();
    let all = problems.join("\n");
    assert!(
        all.contains("unknown key 'lr_shceduler'; did you mean 'lr_scheduler'?"),
        "{all}"
    );
    assert!(all.contains("'batch_size' must be an integer"), "{all}");
    assert!(all.contains("did you mean 'optimizer.lr'?"), "{all}");
    assert!(all.contains("did you mean 'dataset[0].packed'?"), "{all}");
    assert!(validate(&cfg("epochs: 3\nseed: null\n").root, "ok").is_ok());
    // torchtune's distributed QLoRA configs spell the offload `fsdp: {cpu_offload: ...}`.
    assert!(validate(&cfg("fsdp:\n  cpu_offload: False\n").root, "ok").is_ok());
    assert!(validate(&cfg("fsdp:\n  offload: False\n").root, "bad").is_err());
    // A top-level key others interpolate is the config's variable; one nobody uses is not,
    // and a known key stays type-checked when it is interpolated.
    let vars = "name: run1\noutput_dir: /tmp/${name}\nbase: /m\ncheckpointer:\n  checkpoint_dir: ${base.x}\n";
    assert!(validate(&cfg(vars).root, "ok").is_ok());
    assert!(validate(&cfg("name: run1\noutput_dir: /tmp/x\n").root, "bad").is_err());
    assert!(validate(&cfg("epochs: many\nlog_dir: ${epochs}\n").root, "bad").is_err());
}

/// YAML's NaN and infinities are refused naming the key, not read as absent ("is required").
#[test]
fn non_finite_numbers_name_their_key() {
    let e = parse_yaml("optimizer:\n  lr: .nan\n", "c.yaml")
        .unwrap_err()
        .0;
    assert!(
        e.contains("'optimizer.lr' is NaN") && e.contains("c.yaml"),
        "{e}"
    );
    let e = parse_yaml("a: [1, -.inf]\n", "c.yaml").unwrap_err().0;
    assert!(e.contains("'a[1]' is infinite"), "{e}");
    let mut root = parse_yaml("optimizer:\n  lr: 1.0\n", "c.yaml").unwrap();
    let e = apply_override(&mut root, "optimizer.lr=.NaN")
        .unwrap_err()
        .0;
    assert!(e.contains("'optimizer.lr' is NaN"), "{e}");
    // Strings that spell them are no numbers either.
    let c = cfg("lr: nan\nname: .nan_run\n");
    assert!(c
        .f64("lr")
        .unwrap_err()
        .0
        .contains("'lr' must be a finite number"));
}

#[test]
fn edit_distance_counts_transpositions_once() {
    assert_eq!(edit_distance("lr_shceduler", "lr_scheduler"), 1);
    assert_eq!(edit_distance("batch_sz", "batch_size"), 2);
    assert_eq!(edit_distance("", "abc"), 3);
}
