//! `ferrotune-fuzz`: fuzzes ferrotune's parsers of untrusted files (see the library's docs).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use ferrotune_fuzz::driver::{fuzz, report, Options};
use ferrotune_fuzz::targets::{target, Scratch, TARGETS};
use ferrotune_fuzz::{crate_dir, worker};

#[derive(Parser)]
#[command(about = "Fuzz ferrotune's parsers of untrusted files")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Fuzz targets; exits 1 when an input panicked, aborted, ran out of memory or hung.
    Run {
        /// Comma-separated targets (default: all; `list` names them).
        #[arg(long, value_delimiter = ',')]
        targets: Vec<String>,
        /// CPU seconds per target.
        #[arg(long, default_value_t = 60.0)]
        cpu_secs: f64,
        /// Inputs per target (the seeds count), if fewer than the CPU budget allows.
        #[arg(long, default_value_t = u64::MAX)]
        execs: u64,
        /// Seed of the mutations.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// CPU seconds an input may take before it counts as a hang.
        #[arg(long, default_value_t = 30.0)]
        timeout_secs: f64,
        /// The workers' address-space cap, MiB.
        #[arg(long, default_value_t = 2048)]
        memory_mib: u64,
        /// The largest input made, bytes.
        #[arg(long, default_value_t = 1 << 20)]
        max_len: usize,
        /// Where to save findings (default: the crate's `crashes/`).
        #[arg(long)]
        crashes: Option<PathBuf>,
        /// No progress lines.
        #[arg(long)]
        quiet: bool,
    },
    /// Run saved inputs in this process, to reproduce or minimise a finding.
    Repro {
        /// The target.
        target: String,
        /// The input files.
        files: Vec<PathBuf>,
    },
    /// List the targets.
    List,
    /// Internal: the process chat templates render in, as in ferrotune itself.
    #[command(name = ferrotune_data::chat_template::isolate::WORKER_VERB, hide = true)]
    RenderTemplates,
    /// Internal: the worker process the driver starts.
    #[command(hide = true)]
    Worker {
        target: String,
        /// The address-space cap, MiB.
        #[arg(long)]
        memory_mib: Option<u64>,
    },
}

fn main() -> ExitCode {
    let command = Cli::parse().command;
    if matches!(command, Command::Worker { .. } | Command::Repro { .. }) {
        // Chat templates render as the ferrotune binary renders them: in a capped worker process.
        if let Ok(exe) = std::env::current_exe() {
            ferrotune_data::chat_template::isolate::use_worker(
                exe,
                vec![ferrotune_data::chat_template::isolate::WORKER_VERB.into()],
            );
        }
    }
    match command {
        Command::RenderTemplates => match ferrotune_data::chat_template::isolate::serve() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("template worker: {e}");
                ExitCode::from(2)
            }
        },
        Command::List => {
            for t in TARGETS {
                println!("{:<18} {}", t.name, t.about);
            }
            ExitCode::SUCCESS
        }
        Command::Worker {
            target: name,
            memory_mib,
        } => {
            let Some(t) = target(&name) else {
                eprintln!("unknown target {name}");
                return ExitCode::from(2);
            };
            match worker::worker_main(t, memory_mib) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("worker: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Repro {
            target: name,
            files,
        } => {
            let Some(t) = target(&name) else {
                eprintln!("unknown target {name} (`ferrotune-fuzz list`)");
                return ExitCode::from(2);
            };
            let dir = std::env::temp_dir().join(format!("ferrotune-fuzz-{}", std::process::id()));
            let scratch = Scratch::new(dir.clone()).expect("scratch folder");
            for f in files {
                let input = std::fs::read(&f).expect("readable input");
                t.run(&scratch, &input);
                println!("{}: ok", f.display());
            }
            let _ = std::fs::remove_dir_all(dir);
            ExitCode::SUCCESS
        }
        Command::Run {
            targets,
            cpu_secs,
            execs,
            seed,
            timeout_secs,
            memory_mib,
            max_len,
            crashes,
            quiet,
        } => {
            let chosen: Vec<_> = if targets.is_empty() {
                TARGETS.iter().collect()
            } else {
                let mut chosen = Vec::new();
                for name in &targets {
                    match target(name) {
                        Some(t) => chosen.push(t),
                        None => {
                            eprintln!("unknown target {name} (`ferrotune-fuzz list`)");
                            return ExitCode::from(2);
                        }
                    }
                }
                chosen
            };
            let opts = Options {
                cpu_secs,
                max_execs: execs,
                seed,
                timeout: Duration::from_secs_f64(timeout_secs),
                memory_mib,
                max_len,
                corpus: crate_dir().join("corpus"),
                regressions: crate_dir().join("regressions"),
                crashes: crashes.unwrap_or_else(|| crate_dir().join("crashes")),
                progress: (!quiet).then(|| Duration::from_secs(30)),
            };
            let mut all = Vec::new();
            for t in chosen {
                match fuzz(t, &opts) {
                    Ok(stats) => all.push(stats),
                    Err(e) => {
                        eprintln!("{}: cannot run: {e}", t.name);
                        return ExitCode::from(2);
                    }
                }
            }
            print!("{}", report(&all));
            let findings: usize = all.iter().map(|s| s.findings.len()).sum();
            if findings > 0 {
                for s in &all {
                    // One line per signature: how often, and the first input saved.
                    let mut seen: Vec<(&str, usize, Option<&PathBuf>)> = Vec::new();
                    for f in &s.findings {
                        match seen.iter_mut().find(|(sig, _, _)| *sig == f.signature) {
                            Some(entry) => entry.1 += 1,
                            None => seen.push((&f.signature, 1, f.saved.as_ref())),
                        }
                    }
                    for (sig, n, saved) in seen {
                        let saved = saved.map(|p| p.display().to_string());
                        println!(
                            "{}: {n} x {sig} (e.g. {})",
                            s.target,
                            saved.unwrap_or_else(|| "not saved".into())
                        );
                    }
                }
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
    }
}
