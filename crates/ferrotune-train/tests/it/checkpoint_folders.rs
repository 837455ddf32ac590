//! Checkpoint folders survive kills: what a killed save or prune leaves under a temporary name is
//! cleared by the next save, and pruning never leaves a half-deleted checkpoint folder.

use ferrotune_testing::fresh_dir;
use ferrotune_train::recipe::state::{prune_checkpoints, write_folder};

/// The names in `dir`, sorted.
fn names(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_save_clears_what_killed_saves_and_prunes_left() {
    let dir = fresh_dir("ckpt-leftovers");
    // A killed save of another process, a replaced copy of `step_2` (which has its name), a
    // killed prune; and what is not ours: a user's hidden folder and file, and a checkpoint.
    for leftover in [".step_3.partial4242", ".step_2.old77", ".step_1.pruning"] {
        std::fs::create_dir_all(dir.join(leftover).join("recipe_state")).unwrap();
        std::fs::write(dir.join(leftover).join("model.safetensors"), b"half").unwrap();
    }
    std::fs::create_dir_all(dir.join(".keep.partial")).unwrap();
    std::fs::write(dir.join(".step_9.partial12"), b"a file, not a folder").unwrap();
    std::fs::create_dir_all(dir.join("step_2")).unwrap();

    let written = write_folder(&dir, "step_5", |tmp| {
        std::fs::write(tmp.join("model.safetensors"), b"whole")?;
        Ok(())
    })
    .unwrap();
    assert_eq!(
        std::fs::read(written.join("model.safetensors")).unwrap(),
        b"whole"
    );
    assert_eq!(
        names(&dir),
        [".keep.partial", ".step_9.partial12", "step_2", "step_5"]
    );
}

#[test]
fn pruning_removes_older_checkpoints_through_a_temporary_name() {
    let dir = fresh_dir("ckpt-prune");
    for n in [1, 2, 3] {
        std::fs::create_dir_all(dir.join(format!("step_{n}")).join("recipe_state")).unwrap();
    }
    std::fs::create_dir_all(dir.join("epoch_0")).unwrap();
    prune_checkpoints(&dir, "step_3", 1).unwrap();
    assert_eq!(names(&dir), ["epoch_0", "step_3"]);
}

#[test]
fn a_checkpoint_whose_replacement_was_killed_gets_its_name_back() {
    let dir = fresh_dir("ckpt-restore");
    // Killed between the two renames of replacing `step_4`: the old copy is the only one.
    std::fs::create_dir_all(dir.join(".step_4.old4242")).unwrap();
    std::fs::write(
        dir.join(".step_4.old4242").join("model.safetensors"),
        b"step 4",
    )
    .unwrap();
    write_folder(&dir, "step_6", |_| Ok(())).unwrap();
    assert_eq!(names(&dir), ["step_4", "step_6"]);
    assert_eq!(
        std::fs::read(dir.join("step_4").join("model.safetensors")).unwrap(),
        b"step 4"
    );
}
