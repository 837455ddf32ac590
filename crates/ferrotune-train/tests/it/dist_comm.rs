//! `dist`: the environment contract, the rendezvous store and the TCP collectives, across real
//! processes on 127.0.0.1 (W = 2 and 3), including what happens when a rank dies.
//!
//! The multi-process tests start this test binary again as the ranks: `worker` is a test that
//! does nothing unless `FERROTUNE_DIST_TEST_ROLE` is set, and then plays that role with the
//! rank given by the usual torchrun variables.

use std::collections::HashMap;
use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use ferrotune_train::dist::{comm, DistEnv, Store};

const ROLE: &str = "FERROTUNE_DIST_TEST_ROLE";

// ---- the parent side ----

struct Finished {
    status: ExitStatus,
    /// Seconds from the start of the scenario.
    at: f64,
    stdout: String,
    stderr: String,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn drain(mut r: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = r.read_to_string(&mut s);
        s
    })
}

/// Runs `role` on `world` ranks and waits for all of them (at most 60 s, then kills them).
fn run_ranks(role: &str, world: usize, env: &[(&str, &str)]) -> Vec<Finished> {
    let port = free_port().to_string();
    // This module's `worker` test and nothing else, in the crate's one test binary.
    let worker = ferrotune_testing::test_path(module_path!(), "worker");
    let start = Instant::now();
    let mut procs: Vec<(Child, JoinHandle<String>, JoinHandle<String>)> = (0..world)
        .map(|rank| {
            let mut cmd = Command::new(std::env::current_exe().unwrap());
            cmd.args([
                "--exact",
                worker.as_str(),
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE, role)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .env("RAYON_NUM_THREADS", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
            for (k, v) in env {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn().expect("start a rank");
            let out = drain(child.stdout.take().unwrap());
            let err = drain(child.stderr.take().unwrap());
            (child, out, err)
        })
        .collect();
    let mut done: Vec<Option<(ExitStatus, f64)>> = vec![None; world];
    while done.iter().any(Option::is_none) {
        for (i, (child, _, _)) in procs.iter_mut().enumerate() {
            if done[i].is_none() {
                if let Some(status) = child.try_wait().unwrap() {
                    done[i] = Some((status, start.elapsed().as_secs_f64()));
                }
            }
        }
        // A rank that stopped itself (SIGSTOP) never ends on its own: once every other rank
        // has, it is killed.
        let running: Vec<usize> = (0..world).filter(|&i| done[i].is_none()).collect();
        if let [last] = running[..] {
            if is_stopped(procs[last].0.id()) {
                let _ = procs[last].0.kill();
            }
        }
        if start.elapsed() > Duration::from_secs(60) {
            for (child, _, _) in procs.iter_mut() {
                let _ = child.kill();
            }
            panic!("{role} on {world} ranks: still running after 60 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    procs
        .into_iter()
        .zip(done)
        .map(|((_, out, err), d)| {
            let (status, at) = d.unwrap();
            Finished {
                status,
                at,
                stdout: out.join().unwrap(),
                stderr: err.join().unwrap(),
            }
        })
        .collect()
}

/// Whether process `pid` is stopped (state `T` in `/proc/PID/stat`).
fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| Some(s.rsplit_once(')')?.1.trim_start().starts_with('T')))
        .unwrap_or(false)
}

fn assert_all_ok(role: &str, world: usize, results: &[Finished]) {
    for (rank, r) in results.iter().enumerate() {
        assert!(
            r.status.success(),
            "{role}, W={world}: rank {rank} failed ({}):\n{}\n{}",
            r.status,
            r.stdout,
            r.stderr
        );
        assert!(
            !r.stderr.contains("was lost"),
            "{role}, W={world}: rank {rank} reported a lost rank after a clean run:\n{}",
            r.stderr
        );
    }
}

/// The values a worker printed as `KEY value` lines.
fn reported(r: &Finished, key: &str) -> Vec<String> {
    r.stdout
        .lines()
        .filter_map(|l| l.strip_prefix(key)?.strip_prefix(' ').map(str::to_string))
        .collect()
}

#[test]
fn collectives_match_local_sums() {
    for world in [2, 3] {
        let results = run_ranks("collectives", world, &[]);
        assert_all_ok("collectives", world, &results);
        // Sums of inexact values: the same bits on every rank.
        let hashes: Vec<Vec<String>> = results.iter().map(|r| reported(r, "HASH")).collect();
        assert!(!hashes[0].is_empty());
        for (rank, h) in hashes.iter().enumerate() {
            assert_eq!(
                h, &hashes[0],
                "W={world}: rank {rank}'s all_reduce bits differ"
            );
        }
    }
}

#[test]
fn store_set_get_add_barrier() {
    for world in [2, 3] {
        let results = run_ranks("store", world, &[("FERROTUNE_DIST_TIMEOUT", "2")]);
        assert_all_ok("store", world, &results);
    }
}

#[test]
fn mismatched_collectives_fail_with_a_clear_error() {
    let results = run_ranks("mismatch", 2, &[]);
    assert_all_ok("mismatch", 2, &results);
}

#[test]
fn a_stuck_rank_times_out_with_an_error_naming_it() {
    let results = run_ranks("slow", 2, &[("FERROTUNE_DIST_TIMEOUT", "1")]);
    let e = &results[0].stderr;
    assert_eq!(results[0].status.code(), Some(1), "{e}");
    assert!(
        e.contains("rank 1 sent nothing for 1 s (FERROTUNE_DIST_TIMEOUT)"),
        "rank 0: {e}"
    );
}

#[test]
fn a_rank_that_never_joins_fails_the_rendezvous() {
    let results = run_ranks("never_joins", 3, &[("VICTIM", "2")]);
    assert_eq!(results[2].status.code(), Some(3));
    for r in &results[..2] {
        assert!(r.status.success(), "{}", r.stderr);
        assert!(r.at < 10.0);
    }
}

/// `victim` ends as `role` makes it; every other rank must exit with status 1 and name it.
fn check_lost(role: &str, world: usize, victim: usize) -> Vec<Finished> {
    let results = run_ranks(role, world, &[("VICTIM", &victim.to_string())]);
    for (rank, r) in results.iter().enumerate() {
        // Shown with --nocapture (or on failure).
        eprintln!(
            "{role} W={world} victim={victim}: rank {rank} ended at {:.2} s ({}): {}",
            r.at,
            r.status,
            r.stderr.trim()
        );
        if rank == victim {
            continue;
        }
        assert_eq!(
            r.status.code(),
            Some(1),
            "{role}, W={world}: rank {rank} should exit with 1, got {}:\n{}\n{}",
            r.status,
            r.stdout,
            r.stderr
        );
        assert!(
            r.stderr.contains(&format!("rank {victim} was lost"))
                || r.stderr
                    .contains(&format!("lost connection to rank {victim}")),
            "{role}, W={world}: rank {rank}'s error does not name rank {victim}:\n{}",
            r.stderr
        );
        assert!(r.at < 60.0, "{role}: rank {rank} took {} s to stop", r.at);
    }
    results
}

#[cfg(unix)]
#[test]
fn a_killed_rank_stops_the_others() {
    use std::os::unix::process::ExitStatusExt;
    for (role, world, victim) in [
        ("kill_in_barrier", 2, 1),
        ("kill_in_barrier", 3, 1),
        ("kill_in_barrier", 3, 0),
        ("kill_in_collective", 3, 1),
        ("kill_in_collective", 2, 0),
    ] {
        let results = check_lost(role, world, victim);
        assert_eq!(
            results[victim].status.signal(),
            Some(9),
            "{role}: the victim"
        );
    }
}

/// A rank that stops (SIGSTOP) keeps its sockets open: only the heartbeats tell. The others must
/// stop within the watchdog bound (2 s here) naming it, whether it is a plain rank or rank 0,
/// which serves the store.
#[cfg(target_os = "linux")]
#[test]
fn a_stopped_rank_stops_the_others_within_the_watchdog_bound() {
    for (world, victim) in [(3, 1), (2, 0)] {
        let results = check_lost("stop_self", world, victim);
        for (rank, r) in results.iter().enumerate() {
            if rank != victim {
                assert!(
                    r.stderr.contains("sent no heartbeat for 2 s"),
                    "W={world}: rank {rank} does not say why:\n{}",
                    r.stderr
                );
                assert!(r.at < 15.0, "W={world}: rank {rank} took {} s", r.at);
            }
        }
    }
}

#[test]
fn a_rank_failing_with_an_error_stops_the_others() {
    for world in [2, 3] {
        let results = check_lost("error_exit", world, 1);
        assert_eq!(results[1].status.code(), Some(3));
        // They hear of it when the store is dropped, not only when the process ends.
        for (rank, r) in results.iter().enumerate() {
            if rank != 1 {
                assert!(
                    r.at < results[1].at,
                    "rank {rank} stopped after the failing rank exited"
                );
            }
        }
    }
}

#[test]
fn single_process_needs_no_peers() -> Result<()> {
    let env = DistEnv::single();
    let store = Store::connect(&env, Duration::from_secs(10))?;
    store.set("a", b"x")?;
    assert_eq!(store.get("a")?, b"x");
    assert_eq!(store.add("n", 5)?, 5);
    store.barrier("b")?;
    store.barrier("b")?;
    let comm = comm::init(&env, &store, &Device::Cpu)?;
    assert_eq!(comm.backend(), "tcp");
    let t = Tensor::arange(0f32, 6., &Device::Cpu)?;
    for out in [
        comm.all_reduce_sum(&t)?,
        comm.reduce_scatter_sum(&t)?,
        comm.all_gather(&t)?,
        comm.broadcast(&t, 0)?,
    ] {
        assert_eq!(out.to_vec1::<f32>()?, t.to_vec1::<f32>()?);
    }
    comm.barrier()?;
    assert!(comm.broadcast(&t, 1).is_err());
    store.shutdown()
}

#[test]
fn dist_env_parsing() {
    let parse = |vars: &[(&str, &str)]| {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        DistEnv::from_lookup(|k| map.get(k).cloned())
    };
    let err = |vars: &[(&str, &str)]| format!("{:#}", parse(vars).unwrap_err());

    assert_eq!(parse(&[]).unwrap(), None);
    assert_eq!(parse(&[("RANK", "3")]).unwrap(), None);
    let one = parse(&[("WORLD_SIZE", "1")]).unwrap().unwrap();
    assert_eq!((one.rank, one.world_size, one.master_port), (0, 1, 0));
    assert_eq!(one.master_addr, "127.0.0.1");

    let full = [
        ("WORLD_SIZE", "4"),
        ("RANK", "3"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ];
    let e = parse(&full).unwrap().unwrap();
    assert_eq!(
        e,
        DistEnv {
            rank: 3,
            local_rank: 3,
            world_size: 4,
            local_world_size: 4,
            master_addr: "node0".into(),
            master_port: 29500,
        }
    );
    let mut local = full.to_vec();
    local.extend([("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2")]);
    let e = parse(&local).unwrap().unwrap();
    assert_eq!((e.local_rank, e.local_world_size), (1, 2));

    let with = |k: &'static str, v: &'static str| {
        let mut vars: Vec<(&str, &str)> = full.iter().copied().filter(|(n, _)| *n != k).collect();
        if !v.is_empty() {
            vars.push((k, v));
        }
        err(&vars)
    };
    assert!(with("WORLD_SIZE", "two").contains("WORLD_SIZE=\"two\""));
    assert!(with("WORLD_SIZE", "0").contains("WORLD_SIZE=0"));
    assert!(with("RANK", "4").contains("RANK=4"));
    assert!(with("RANK", "-1").contains("RANK=\"-1\""));
    assert!(with("RANK", "").contains("RANK is not set"));
    assert!(with("MASTER_ADDR", "").contains("MASTER_ADDR is not set"));
    assert!(with("MASTER_PORT", "").contains("MASTER_PORT is not set"));
    assert!(with("MASTER_PORT", "70000").contains("MASTER_PORT=\"70000\""));
    assert!(with("MASTER_PORT", "0").contains("MASTER_PORT=0"));
    let mut bad_local = full.to_vec();
    bad_local.push(("LOCAL_WORLD_SIZE", "5"));
    assert!(err(&bad_local).contains("LOCAL_WORLD_SIZE=5"));
    bad_local.pop();
    bad_local.extend([("LOCAL_WORLD_SIZE", "2"), ("LOCAL_RANK", "2")]);
    assert!(err(&bad_local).contains("LOCAL_RANK=2"));
}

// ---- the worker side ----

#[test]
fn worker() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    // As `ferrotune`'s main does: an error is one line on stderr and exit status 1.
    if let Err(e) = play(&role) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn play(role: &str) -> Result<()> {
    let env = DistEnv::from_env()?.context("WORLD_SIZE is not set")?;
    let victim: Option<usize> = std::env::var("VICTIM").ok().and_then(|v| v.parse().ok());
    if role == "never_joins" {
        if Some(env.rank) == victim {
            std::process::exit(3);
        }
        let e = Store::connect(&env, Duration::from_secs(2))
            .err()
            .context("joined")?;
        let e = format!("{e:#}");
        let w = env.world_size;
        ensure!(
            e.contains(&format!("only {} of {w} ranks joined", w - 1)),
            "{e}"
        );
        return Ok(());
    }
    let store = match role {
        // A short watchdog bound (rank 0's counts: the store hands it to the others).
        "stop_self" => {
            Store::connect_with_watchdog(&env, Duration::from_secs(30), Duration::from_secs(2))?
        }
        _ => Store::connect(&env, Duration::from_secs(30))?,
    };
    match role {
        "collectives" => collectives(&env, &store)?,
        "store" => store_ops(&env, &store)?,
        "mismatch" => mismatch(&env, &store)?,
        "kill_in_barrier" => {
            if Some(env.rank) == victim {
                die_soon();
            }
            store.barrier("never")?;
            anyhow::bail!("the barrier passed although a rank was killed");
        }
        "kill_in_collective" => {
            let comm = comm::init(&env, &store, &Device::Cpu)?;
            if Some(env.rank) == victim {
                die_soon();
            }
            let big = Tensor::ones(3_000_000, DType::F32, &Device::Cpu)?;
            comm.all_reduce_sum(&big)?;
            anyhow::bail!("the all-reduce finished although a rank was killed");
        }
        "stop_self" => {
            if Some(env.rank) == victim {
                std::thread::sleep(Duration::from_millis(300));
                // SAFETY: sending a signal to ourselves; the test kills the stopped process.
                unsafe {
                    libc::raise(libc::SIGSTOP);
                }
            }
            store.barrier("never")?;
            anyhow::bail!("the barrier passed although a rank was stopped");
        }
        "slow" => {
            let comm = comm::init(&env, &store, &Device::Cpu)?;
            if env.rank == 1 {
                std::thread::sleep(Duration::from_millis(2500));
            }
            comm.all_reduce_sum(&Tensor::ones(10, DType::F32, &Device::Cpu)?)?;
        }
        "error_exit" => {
            if Some(env.rank) == victim {
                std::thread::sleep(Duration::from_millis(300));
                // An error unwinds past the store (dropping it); the process lives on a little.
                drop(store);
                std::thread::sleep(Duration::from_secs(2));
                std::process::exit(3);
            }
            store.barrier("never")?;
            anyhow::bail!("the barrier passed although a rank failed");
        }
        other => anyhow::bail!("unknown role {other}"),
    }
    store.shutdown()
}

/// SIGKILLs this process after the others have had time to block.
fn die_soon() -> ! {
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: sending a signal to ourselves.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    unreachable!("SIGKILL did not end the process");
}

/// Rank `rank`'s input for a check: `scale * (rank + 1) * (i % 7 - 3)` — sums stay exact in
/// f32 and bf16 for the sizes used here.
fn exact_input(rank: usize, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| scale * (rank + 1) as f32 * ((i % 7) as f32 - 3.0))
        .collect()
}

fn exact_sum(world: usize, n: usize, scale: f32) -> Vec<f32> {
    let mut sum = vec![0f32; n];
    for r in 0..world {
        for (s, v) in sum.iter_mut().zip(exact_input(r, n, scale)) {
            *s += v;
        }
    }
    sum
}

fn as_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?)
}

fn collectives(env: &DistEnv, store: &Store) -> Result<()> {
    let comm = comm::init(env, store, &Device::Cpu)?;
    let (w, r) = (env.world_size, env.rank);
    ensure!(comm.rank() == r && comm.world_size() == w && comm.backend() == "tcp");
    let cpu = &Device::Cpu;

    // all_reduce_sum: sizes not divisible by W (and smaller than W), 2-D shapes, bf16, several
    // pieces per ring step.
    for (n, shape) in [
        (1usize, vec![1usize]),
        (11, vec![11]),
        (35, vec![5, 7]),
        (700_001, vec![700_001]),
    ] {
        for dtype in [DType::F32, DType::BF16] {
            let t =
                Tensor::from_vec(exact_input(r, n, 0.5), shape.clone(), cpu)?.to_dtype(dtype)?;
            let out = comm.all_reduce_sum(&t)?;
            ensure!(
                out.dims() == shape.as_slice() && out.dtype() == dtype,
                "all_reduce shape"
            );
            ensure!(
                as_f32(&out)? == exact_sum(w, n, 0.5),
                "all_reduce_sum {dtype:?} of {n} elements differs from the local sum"
            );
        }
    }
    // A non-contiguous input.
    let t = Tensor::from_vec(exact_input(r, 12, 1.0), (3, 4), cpu)?.t()?;
    let expected = Tensor::from_vec(exact_sum(w, 12, 1.0), (3, 4), cpu)?.t()?;
    ensure!(
        as_f32(&comm.all_reduce_sum(&t)?)? == as_f32(&expected)?,
        "transposed"
    );

    // Inexact sums: print the bits for the parent to compare across ranks.
    let noisy: Vec<f32> = (0..10_007)
        .map(|i| ((i * 7919 + r * 104_729) % 1000) as f32 / 37.0 - 13.1)
        .collect();
    for dtype in [DType::F32, DType::BF16] {
        let t = Tensor::from_vec(noisy.clone(), noisy.len(), cpu)?.to_dtype(dtype)?;
        let out = as_f32(&comm.all_reduce_sum(&t)?)?;
        let hash = out.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
            (h ^ v.to_bits() as u64).wrapping_mul(0x100_0000_01b3)
        });
        println!("HASH {dtype:?} {hash:016x}");
    }

    // reduce_scatter_sum: rank r gets chunk r of the sum.
    for k in [1usize, 5, 300_000] {
        for dtype in [DType::F32, DType::BF16] {
            let t = Tensor::from_vec(exact_input(r, w * k, 0.25), w * k, cpu)?.to_dtype(dtype)?;
            let out = comm.reduce_scatter_sum(&t)?;
            ensure!(
                out.dims() == [k] && out.dtype() == dtype,
                "reduce_scatter shape"
            );
            ensure!(
                as_f32(&out)? == exact_sum(w, w * k, 0.25)[r * k..(r + 1) * k],
                "reduce_scatter_sum {dtype:?} k={k}"
            );
        }
    }
    ensure!(comm
        .reduce_scatter_sum(&Tensor::zeros(w * 2 + 1, DType::F32, cpu)?)
        .is_err());

    // all_gather: rank r's data at r*k, in any dtype, bit for bit.
    for k in [1usize, 4, 400_000] {
        let mine: Vec<u32> = (0..k).map(|i| (r * 1_000_000 + i) as u32).collect();
        let out = comm.all_gather(&Tensor::from_vec(mine, k, cpu)?)?;
        let expected: Vec<u32> = (0..w)
            .flat_map(|q| (0..k).map(move |i| (q * 1_000_000 + i) as u32))
            .collect();
        ensure!(out.to_vec1::<u32>()? == expected, "all_gather u32 k={k}");
    }
    let mine = Tensor::from_vec(exact_input(r, 6, 0.125), 6, cpu)?.to_dtype(DType::BF16)?;
    let out = comm.all_gather(&mine)?;
    ensure!(out.dtype() == DType::BF16 && out.dims() == [w * 6]);
    let expected: Vec<f32> = (0..w).flat_map(|q| exact_input(q, 6, 0.125)).collect();
    ensure!(as_f32(&out)? == expected, "all_gather bf16");

    // broadcast from every root, f32 2-D and u32.
    for root in 0..w {
        let t = Tensor::from_vec(exact_input(r, 12, 1.5), (3, 4), cpu)?;
        let out = comm.broadcast(&t, root)?;
        ensure!(out.dims() == [3, 4], "broadcast shape");
        ensure!(
            as_f32(&out)? == exact_input(root, 12, 1.5),
            "broadcast f32 from {root}"
        );
        let big: Vec<u32> = (0..500_000).map(|i| (i * (r + 1)) as u32).collect();
        let out = comm.broadcast(&Tensor::from_vec(big, 500_000, cpu)?, root)?;
        let expected: Vec<u32> = (0..500_000).map(|i| (i * (root + 1)) as u32).collect();
        ensure!(
            out.to_vec1::<u32>()? == expected,
            "broadcast u32 from {root}"
        );
    }

    // Integer sums are exact.
    let t = Tensor::from_vec(vec![r as i64 + 1, 1 << 40], 2, cpu)?;
    let total = (w * (w + 1) / 2) as i64;
    ensure!(comm.all_reduce_sum(&t)?.to_vec1::<i64>()? == [total, (w as i64) << 40]);

    comm.barrier()?;
    comm.barrier()?;
    Ok(())
}

fn store_ops(env: &DistEnv, store: &Store) -> Result<()> {
    let (w, r) = (env.world_size, env.rank);
    ensure!(store.rank() == r && store.world_size() == w);
    store.set(&format!("key{r}"), format!("value of {r}").as_bytes())?;
    for q in 0..w {
        ensure!(store.get(&format!("key{q}"))? == format!("value of {q}").as_bytes());
    }
    store.add("counter", r as i64 + 1)?;
    // Repeated barriers with one name: after the i-th, every rank has counted phase i.
    for i in 0..3 {
        store.add(&format!("phase{i}"), 1)?;
        store.barrier("phase")?;
        ensure!(
            store.add(&format!("phase{i}"), 0)? == w as i64,
            "barrier {i} let a rank through early"
        );
    }
    ensure!(store.get("counter")? == (w * (w + 1) / 2).to_string().as_bytes());
    // A key no one sets: an error naming it after FERROTUNE_DIST_TIMEOUT (2 s here).
    let t = Instant::now();
    let e = format!("{:#}", store.get(&format!("missing{r}")).unwrap_err());
    ensure!(e.contains(&format!("missing{r}")), "timeout error: {e}");
    ensure!(t.elapsed() < Duration::from_secs(10));
    store.barrier("end")
}

fn mismatch(env: &DistEnv, store: &Store) -> Result<()> {
    let comm = comm::init(env, store, &Device::Cpu)?;
    let t = Tensor::ones(4, DType::F32, &Device::Cpu)?;
    let result = if env.rank == 0 {
        comm.all_reduce_sum(&t)
    } else {
        comm.all_gather(&t)
    };
    let e = format!("{:#}", result.unwrap_err());
    ensure!(e.contains("out of step"), "unexpected error: {e}");
    // The ring is unusable afterwards, but the store still works for a clean exit.
    ensure!(comm.barrier().is_err());
    store.barrier("after")
}
