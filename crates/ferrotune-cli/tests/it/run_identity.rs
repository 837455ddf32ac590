//! Runs never mix (issue 44, item 6): every run carries a run id (in its recipe state and on
//! each metrics line); a fresh run refuses an output folder holding an earlier run's outputs
//! unless told to overwrite them; a resume continues the checkpoints of one run only.

use crate::common;

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

use common::{metrics_lines, read_json, run_recipe, text, tmpdir};

const RECIPE: &str = "lora_finetune_single_device";

/// The run id in checkpoint folder `dir`'s recipe state.
fn run_id_of(dir: &Path) -> String {
    let file = dir.join("recipe_state/state.json");
    let state: Value = read_json(&file);
    state["run_id"].as_str().unwrap_or_default().to_string()
}

/// `cp -r src dst` (a folder copied whole, as a user moving runs around would).
fn copy_tree(src: &Path, dst: &Path) {
    let ok = Command::new("cp")
        .arg("-r")
        .arg(src)
        .arg(dst)
        .status()
        .unwrap();
    assert!(ok.success(), "cp -r {} {}", src.display(), dst.display());
}

#[test]
fn a_fresh_run_refuses_an_earlier_runs_outputs_and_a_resume_continues_its_own_run() {
    let dir = tmpdir("identity", "runs");
    // 12 rows, batch 2: 6 steps, a checkpoint every 2.
    let data = dir.join("rows.jsonl");
    let rows: Vec<String> = (0..12u32)
        .map(|i| {
            let ids: Vec<u32> = (0..10).map(|j| (i * 31 + j * 7) % 500 + 3).collect();
            serde_json::json!({"input_ids": ids}).to_string()
        })
        .collect();
    std::fs::write(&data, rows.join("\n")).unwrap();
    let cfg = common::write_config(common::TINY_LORA, &dir, "llama3", &data);
    let run = |out: &Path, extra: &[&str], env: &[(&str, &str)]| -> Output {
        // Shuffled (the seed matters), a checkpoint every 2 steps.
        let mut args = vec!["shuffle=true", "save_every_n_steps=2"];
        args.extend_from_slice(extra);
        run_recipe(RECIPE, &cfg, out, &args, &dir, env)
    };

    // An earlier run (lr 1e-3, seed 7), complete: its checkpoints and log.
    let earlier = dir.join("earlier");
    let o = run(&earlier, &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let earlier_id = run_id_of(&earlier.join("step_4"));
    assert!(!earlier_id.is_empty(), "the recipe state holds the run id");
    for line in metrics_lines(&earlier.join("logs/metrics.jsonl")) {
        assert_eq!(line["run_id"].as_str(), Some(earlier_id.as_str()), "{line}");
    }

    // Its outputs where a new run (other lr, other seed) is pointed: refused, naming them.
    let out = dir.join("out");
    copy_tree(&earlier, &out);
    let other = ["optimizer.lr=3e-4", "seed=11"];
    let o = run(&out, &other, &[]);
    assert!(
        !o.status.success(),
        "a fresh run mixed with an earlier run's outputs"
    );
    let msg = text(&o);
    for want in [
        "epoch_0",
        "step_2",
        "step_4",
        earlier_id.as_str(),
        "metrics.jsonl with 6 logged step(s)",
        "resume_from_checkpoint=True",
        "overwrite_output_dir=True",
    ] {
        assert!(msg.contains(want), "message lacks {want:?}: {msg}");
    }
    assert!(out.join("step_4").is_dir(), "a refused run deletes nothing");

    // Told to overwrite, and killed after its third step (its step_2 saved).
    let kill = [("FERROTUNE_KILL_AFTER_STEP", "3")];
    let overwrite: Vec<&str> = other
        .iter()
        .copied()
        .chain(["overwrite_output_dir=true"])
        .collect();
    let o = run(&out, &overwrite, &kill);
    assert!(
        !o.status.success(),
        "the run was to be killed: {}",
        text(&o)
    );
    let id = run_id_of(&out.join("step_2"));
    assert_ne!(id, earlier_id);
    for gone in ["step_4", "epoch_0"] {
        assert!(!out.join(gone).exists(), "the earlier run's {gone} is left");
    }

    // The resume continues this run from its step 2, not the earlier run's later steps: one
    // line per step, all this run's.
    let resumed: Vec<&str> = other
        .iter()
        .copied()
        .chain(["resume_from_checkpoint=true"])
        .collect();
    let o = run(&out, &resumed, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let lines = metrics_lines(&out.join("logs/metrics.jsonl"));
    let steps: Vec<u64> = lines.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6]);
    for line in &lines {
        assert_eq!(line["run_id"].as_str(), Some(id.as_str()), "{line}");
    }
    assert_eq!(run_id_of(&out.join("epoch_0")), id);

    // A checkpoint of another run beside this run's: which to continue is the user's call.
    std::fs::remove_dir_all(out.join("epoch_0")).unwrap();
    copy_tree(&earlier.join("epoch_0"), &out.join("epoch_0"));
    assert_eq!(run_id_of(&out.join("epoch_0")), earlier_id);
    let o = run(&out, &resumed, &[]);
    assert!(!o.status.success(), "resumed across runs: {}", text(&o));
    let msg = text(&o);
    for want in [
        earlier_id.as_str(),
        id.as_str(),
        "checkpointer.recipe_checkpoint",
    ] {
        assert!(msg.contains(want), "message lacks {want:?}: {msg}");
    }
    // Named, it continues.
    let step_4 = format!(
        "checkpointer.recipe_checkpoint={}",
        out.join("step_4").display()
    );
    let named: Vec<&str> = resumed.iter().copied().chain([step_4.as_str()]).collect();
    let o = run(&out, &named, &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("step_4"), "{}", text(&o));
}
