//! `ferrotune --help` ends with the `FERROTUNE_*` variables users may set: every knob of the
//! registry (ferrotune-core's switch.rs) but the test hooks and the build-time one.

use std::process::Command;

use ferrotune_core::switch::{KnobKind, KNOBS};

#[test]
fn help_lists_the_user_knobs() {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotune"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    assert!(
        help.contains("Environment variables (docs/src/environment.md):"),
        "{help}"
    );
    for k in KNOBS {
        let user = !k.test_hook && k.kind != KnobKind::Build;
        assert_eq!(help.contains(k.name), user, "{}:\n{help}", k.name);
    }
}
