//! Every `FERROTUNE_*` environment variable ferrotune reads, in one table ([`KNOBS`]): its name,
//! meaning, default and kind, with typed accessors. Code reads a knob only through its entry here
//! (`tests/it/knobs.rs` finds any other `FERROTUNE_` name in the crates' sources), and
//! `docs/src/environment.md` is this table (the same test checks it).
//!
//! Test hooks ([`Knob::test_hook`]) are listed here too, so that they are documented, but the
//! code that reads them compiles only with the `test-hooks` feature of the crate that holds it,
//! which the test suite turns on: a release binary ignores them.
//!
//! [`EnvSwitch`] keeps a switch knob's value for the whole process, so that a fast path can be
//! turned off (by its variable, or by a benchmark timing both) and a slower reference path timed
//! or used instead.

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU8, Ordering};

/// What a knob's value is, which says which accessor reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KnobKind {
    /// On unless the value is `0` ([`Knob::on`], or an [`EnvSwitch`]).
    Switch,
    /// A whole number ([`Knob::count`]); anything else counts as unset.
    Count,
    /// A positive number of seconds (read by its user, which refuses anything else).
    Seconds,
    /// One word of a few ([`Knob::is`], [`Knob::value`]).
    Word,
    /// A folder ([`Knob::path`]).
    Folder,
    /// A program to run, by path or by name on `PATH` ([`Knob::value_os`]).
    Program,
    /// A list in its own syntax ([`Knob::value`]), parsed by its user.
    Spec,
    /// Set by a build script for the compiler, not read at run time.
    Build,
}

impl KnobKind {
    /// The kind's name in the documentation.
    pub fn name(self) -> &'static str {
        match self {
            Self::Switch => "switch",
            Self::Count => "count",
            Self::Seconds => "seconds",
            Self::Word => "word",
            Self::Folder => "folder",
            Self::Program => "program",
            Self::Spec => "list",
            Self::Build => "build time",
        }
    }
}

/// One `FERROTUNE_*` environment variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Knob {
    /// The variable's name.
    pub name: &'static str,
    /// What it does, in one or two sentences (Markdown).
    pub meaning: &'static str,
    /// What happens when it is unset (Markdown).
    pub default: &'static str,
    /// Its kind of value.
    pub kind: KnobKind,
    /// A hook for the tests, not a user setting: read only in builds with the `test-hooks`
    /// feature.
    pub test_hook: bool,
}

impl Knob {
    /// The value, if the variable is set (to valid Unicode).
    pub fn value(&self) -> Option<String> {
        std::env::var(self.name).ok()
    }

    /// The value as the OS holds it, if the variable is set and not empty.
    pub fn value_os(&self) -> Option<OsString> {
        std::env::var_os(self.name).filter(|v| !v.is_empty())
    }

    /// The folder it names, if set and not empty.
    pub fn path(&self) -> Option<PathBuf> {
        self.value_os().map(PathBuf::from)
    }

    /// The whole number it holds; `None` when unset or not a number.
    pub fn count(&self) -> Option<usize> {
        self.value()?.parse().ok()
    }

    /// Whether a switch is on: unless the value is `0` (spaces around it ignored).
    pub fn on(&self) -> bool {
        self.value().is_none_or(|v| v.trim() != "0")
    }

    /// Whether the value is `word`, ignoring ASCII case.
    pub fn is(&self, word: &str) -> bool {
        self.value().is_some_and(|v| v.eq_ignore_ascii_case(word))
    }
}

/// The folder of real tokenizers and models the tests read.
pub const ASSETS: Knob = Knob {
    name: "FERROTUNE_ASSETS",
    meaning: "The folder `scripts/fetch-assets.sh` fills with the real tokenizers and models the \
              tests read (the scripts use it too).",
    default: "`$XDG_CACHE_HOME/ferrotune/assets`, else `~/.cache/ferrotune/assets`",
    kind: KnobKind::Folder,
    test_hook: false,
};

/// The Python that runs the W&B and Comet clients for `WandBLogger` and `CometLogger`.
pub const PYTHON: Knob = Knob {
    name: "FERROTUNE_PYTHON",
    meaning: "The Python interpreter `WandBLogger` and `CometLogger` start to run the official \
              `wandb` or `comet_ml` client (a path, or a name on `PATH`), e.g. a virtual \
              environment's `bin/python`.",
    default: "`python3`",
    kind: KnobKind::Program,
    test_hook: false,
};

/// The collectives backend of distributed runs.
pub const DIST_BACKEND: Knob = Knob {
    name: "FERROTUNE_DIST_BACKEND",
    meaning: "The collectives backend of distributed recipes: `tcp` (also for CUDA tensors, \
              through host memory) or `nccl` (CUDA devices, builds with feature `nccl`). Set, a \
              `_distributed` recipe run as one process runs that backend's collectives instead \
              of taking the single-device path.",
    default: "NCCL between several GPUs in a build with `nccl`, else TCP",
    kind: KnobKind::Word,
    test_hook: false,
};

/// How long distributed waits may block.
pub const DIST_TIMEOUT: Knob = Knob {
    name: "FERROTUNE_DIST_TIMEOUT",
    meaning: "Seconds a collective or a wait on the rendezvous store may block without progress \
              before the rank stops with an error.",
    default: "1800 (as torch.distributed)",
    kind: KnobKind::Seconds,
    test_hook: false,
};

/// How long a rank may be silent before the others stop the run.
pub const DIST_WATCHDOG: Knob = Knob {
    name: "FERROTUNE_DIST_WATCHDOG",
    meaning: "Seconds a rank of a distributed run may send no heartbeat (a stopped, frozen or \
              unreachable process) before the others stop with an error naming it; the config \
              key `dist_watchdog_timeout` takes precedence. The launcher then exits within 11 s \
              more (docs/src/reliability.md).",
    default: "60",
    kind: KnobKind::Seconds,
    test_hook: false,
};

/// The GPU decode kernels.
pub const DECODE_KERNELS: Knob = Knob {
    name: "FERROTUNE_DECODE_KERNELS",
    meaning: "`0` turns the GPU decode kernels off: decoding runs the forward pass's ops (cuBLAS \
              GEMMs, a concatenated KV cache), for comparison.",
    default: "on",
    kind: KnobKind::Switch,
    test_hook: false,
};

/// CUDA graphs of decode steps.
pub const CUDA_GRAPHS: Knob = Knob {
    name: "FERROTUNE_CUDA_GRAPHS",
    meaning: "`0` turns CUDA graphs off: each decode step's kernels are launched one by one.",
    default: "on",
    kind: KnobKind::Switch,
    test_hook: false,
};

/// Programmatic dependent launch of the decode kernels.
pub const PDL: Knob = Knob {
    name: "FERROTUNE_PDL",
    meaning: "`0` turns programmatic dependent launch of the decode kernels off (it applies only \
              when the kernels' PTX targets compute capability 9.0 or later).",
    default: "on",
    kind: KnobKind::Switch,
    test_hook: false,
};

/// The fused CPU gated delta rule.
pub const DELTA_RULE: Knob = Knob {
    name: "FERROTUNE_DELTA_RULE",
    meaning: "`0` turns the fused CPU gated delta rule (Qwen3.5's and Qwen3-Next's linear \
              attention) off: it runs as candle ops with their autograd (the chunked form, the \
              recurrent one for packed rows), for comparison.",
    default: "on",
    kind: KnobKind::Switch,
    test_hook: false,
};

/// The GPU attention's form.
pub const ATTN: Knob = Knob {
    name: "FERROTUNE_ATTN",
    meaning: "`chunked` makes the GPU attention take its chunked form (cuBLAS products over \
              chunks of query rows) where the flash kernels would apply, for measuring one \
              against the other.",
    default: "the flash kernels where they apply",
    kind: KnobKind::Word,
    test_hook: false,
};

/// Query rows per chunk of the chunked GPU attention.
pub const ATTN_CHUNK_ROWS: Knob = Knob {
    name: "FERROTUNE_ATTN_CHUNK_ROWS",
    meaning: "Query rows per chunk of the chunked GPU attention, for measuring the trade-off \
              between skipped causal keys and per-chunk work.",
    default: "chosen from the shape, at most 512",
    kind: KnobKind::Count,
    test_hook: false,
};

/// Rows per chunk of the GPU output head with cross-entropy.
pub const CE_CHUNK_ROWS: Knob = Knob {
    name: "FERROTUNE_CE_CHUNK_ROWS",
    meaning: "Rows per chunk of the GPU output head fused with cross-entropy (the GPU tests set \
              it to cover several chunks with a small vocabulary).",
    default: "2²⁸ logits (512 MiB in bf16) divided by the vocabulary size",
    kind: KnobKind::Count,
    test_hook: false,
};

/// The compute capability the CUDA kernels are built for.
pub const CUDA_CAP: Knob = Knob {
    name: "FERROTUNE_CUDA_CAP",
    meaning: "The compute capability the CUDA kernels' PTX targets, which picks the flash \
              attention (8.0 or later) and programmatic dependent launch (9.0 or later). Set by \
              ferrotune-core's build script from `CUDA_COMPUTE_CAP`: set that one, not this.",
    default: "80 (CUDA builds only)",
    kind: KnobKind::Build,
    test_hook: false,
};

/// Kills the process after a step.
pub const KILL_AFTER_STEP: Knob = Knob {
    name: "FERROTUNE_KILL_AFTER_STEP",
    meaning: "`N`: the process sends itself SIGKILL right after training step N is logged, how \
              the tests interrupt a run at a known point to check that resuming is step-exact.",
    default: "never",
    kind: KnobKind::Count,
    test_hook: true,
};

/// Which rank [`KILL_AFTER_STEP`] kills.
pub const KILL_RANK: Knob = Knob {
    name: "FERROTUNE_KILL_RANK",
    meaning: "`R`: only rank R is killed by `FERROTUNE_KILL_AFTER_STEP` (the others must notice).",
    default: "every rank",
    kind: KnobKind::Count,
    test_hook: true,
};

/// Fake devices for `--device-map`.
pub const DEVICE_MAP_FAKE: Knob = Knob {
    name: "FERROTUNE_DEVICE_MAP_FAKE",
    meaning: "`cpu:BYTES,cpu:BYTES,...`: `--device-map` sees that many CPU \"devices\" with those \
              capacities (bytes, or sizes such as `2MiB`) instead of the visible GPUs, so that \
              planning, dispatch and the multi-device forward run without a GPU.",
    default: "the visible GPUs",
    kind: KnobKind::Spec,
    test_hook: true,
};

/// gpt-oss's MXFP4 experts kept packed under QLoRA.
pub const MXFP4_PACKED: Knob = Knob {
    name: "FERROTUNE_MXFP4_PACKED",
    meaning: "`0` dequantizes a gpt-oss checkpoint's MXFP4 experts when it is read for QLoRA \
              (`model.quantize_base`), as in every other run, instead of holding them packed \
              and dequantizing each routed expert for its product (transformers' \
              `Mxfp4Config(dequantize=True)` against `False`), for comparison.",
    default: "on",
    kind: KnobKind::Switch,
    test_hook: false,
};

/// Every knob, in the order `docs/src/environment.md` lists them.
pub const KNOBS: &[Knob] = &[
    ASSETS,
    PYTHON,
    DIST_BACKEND,
    DIST_TIMEOUT,
    DIST_WATCHDOG,
    DECODE_KERNELS,
    CUDA_GRAPHS,
    PDL,
    DELTA_RULE,
    ATTN,
    ATTN_CHUNK_ROWS,
    CE_CHUNK_ROWS,
    MXFP4_PACKED,
    CUDA_CAP,
    KILL_AFTER_STEP,
    KILL_RANK,
    DEVICE_MAP_FAKE,
];

/// [`CUDA_CAP`]'s value in this build: the compute capability times ten (`80`), 0 if unreadable.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_cap() -> u32 {
    env!("FERROTUNE_CUDA_CAP").parse().unwrap_or(0)
}

/// [`KNOBS`] as the Markdown table `docs/src/environment.md` holds.
pub fn markdown_table() -> String {
    let mut out = String::from(
        "| Variable | Kind | Meaning | Default | Test hook |\n| --- | --- | --- | --- | --- |\n",
    );
    for k in KNOBS {
        out.push_str(&format!(
            "| `{}` | {} | {} | {} | {} |\n",
            k.name,
            k.kind.name(),
            k.meaning,
            k.default,
            if k.test_hook { "yes" } else { "no" }
        ));
    }
    out
}

/// The knobs users set at run time (test hooks and the build-time one left out), each with its
/// meaning and default wrapped under it, for `ferrotune --help`.
pub fn help_text() -> String {
    const INDENT: &str = "          ";
    const WIDTH: usize = 100;
    let mut out = String::from("Environment variables (docs/src/environment.md):\n");
    for k in KNOBS
        .iter()
        .filter(|k| !k.test_hook && k.kind != KnobKind::Build)
    {
        out.push_str(&format!("  {}\n", k.name));
        let text = format!("{} Default: {}.", k.meaning, k.default).replace('`', "");
        let mut line = String::from(INDENT);
        for word in text.split_whitespace() {
            if line.len() > INDENT.len() && line.len() + 1 + word.len() > WIDTH {
                out.push_str(line.trim_end());
                out.push('\n');
                line = String::from(INDENT);
            }
            if line.len() > INDENT.len() {
                line.push(' ');
            }
            line.push_str(word);
        }
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// A [`KnobKind::Switch`] knob's value kept for the whole process: on unless its environment
/// variable is `0`, until [`EnvSwitch::set`] says otherwise.
pub struct EnvSwitch {
    knob: &'static Knob,
    /// 0 = not yet read from the environment, 1 = on, 2 = off.
    state: AtomicU8,
}

impl EnvSwitch {
    /// A switch read from `knob`'s variable on first use.
    pub const fn new(knob: &'static Knob) -> Self {
        Self {
            knob,
            state: AtomicU8::new(0),
        }
    }

    /// Whether the switch is on.
    pub fn get(&self) -> bool {
        match self.state.load(Ordering::Relaxed) {
            1 => true,
            2 => false,
            _ => {
                let on = self.knob.on();
                self.set(on);
                on
            }
        }
    }

    /// Turns the switch on or off for the whole process.
    pub fn set(&self, on: bool) {
        self.state.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::{EnvSwitch, Knob, KnobKind};

    const fn switch(name: &'static str) -> Knob {
        Knob {
            name,
            meaning: "",
            default: "on",
            kind: KnobKind::Switch,
            test_hook: false,
        }
    }

    #[test]
    fn on_unless_the_variable_is_zero_until_set() {
        static UNSET_KNOB: Knob = switch("FERROTUNE_TEST_SWITCH_NEVER_SET");
        static UNSET: EnvSwitch = EnvSwitch::new(&UNSET_KNOB);
        assert!(UNSET.get());
        UNSET.set(false);
        assert!(!UNSET.get());
        // Read once, on first use.
        std::env::set_var("FERROTUNE_TEST_SWITCH_ZERO", "0");
        static ZERO_KNOB: Knob = switch("FERROTUNE_TEST_SWITCH_ZERO");
        static ZERO: EnvSwitch = EnvSwitch::new(&ZERO_KNOB);
        assert!(!ZERO.get());
        std::env::set_var("FERROTUNE_TEST_SWITCH_ZERO", "1");
        assert!(!ZERO.get());
        ZERO.set(true);
        assert!(ZERO.get());
    }
}
