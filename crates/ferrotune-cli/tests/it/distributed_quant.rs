//! The quantized AdamW optimizers (torchao's 8- and 4-bit, bitsandbytes' 8-bit) on 2 CPU ranks:
//! unsharded (`fsdp_sharding: none`) and sharded (`full`, `grad_op`), each rank quantizing whole
//! blocks of the parameters its shard holds, so that every step's loss and the final weights are
//! one device's, the checkpoint's optimizer state has the single-device format (and nearly every
//! code equal), each rank holds about half of one device's state, and a 2-rank checkpoint resumes
//! on 2 ranks bit for bit and on one device to one device's run. With `fsdp_cpu_offload` (on CPU
//! ranks, where the device is the host) the run says there is nothing to move and is the run
//! without it bit for bit.

use crate::common;
use crate::distributed::{assert_same_losses, assert_same_tensors, losses, Case};

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Tensor};

use common::{load, metrics_lines, text};

/// The `optimizer_state_mb` logged at the last step (rank 0's on several ranks).
fn state_mb(out: &Path) -> f64 {
    let lines = metrics_lines(&out.join("logs/metrics.jsonl"));
    lines.last().unwrap()["optimizer_state_mb"]
        .as_f64()
        .unwrap()
}

/// A tensor's values as f64 (codes, scales and moments alike).
fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The same names, dtypes and shapes in both state dicts; returns the share of equal codes.
fn same_format(got: &HashMap<String, Tensor>, want: &HashMap<String, Tensor>, what: &str) -> f64 {
    let mut keys: Vec<&String> = got.keys().collect();
    keys.sort();
    let mut want_keys: Vec<&String> = want.keys().collect();
    want_keys.sort();
    assert_eq!(keys, want_keys, "{what}: optimizer state names");
    let (mut same, mut all) = (0usize, 0usize);
    for k in keys {
        let (a, b) = (&got[k], &want[k]);
        assert_eq!(a.dtype(), b.dtype(), "{what}: {k} dtype");
        assert_eq!(a.dims(), b.dims(), "{what}: {k} shape");
        if k.ends_with("_codes") {
            let (a, b) = (values(a), values(b));
            same += a.iter().zip(&b).filter(|(x, y)| x == y).count();
            all += a.len();
        }
    }
    assert!(all > 0, "{what}: no quantized moments");
    same as f64 / all as f64
}

/// Every tensor of the two files bit for bit equal.
fn identical(got: &Path, want: &Path, what: &str) {
    let (a, b) = (load(got), load(want));
    assert_eq!(a.len(), b.len(), "{what}: tensor count");
    for (k, t) in &b {
        assert_eq!(a[k].dtype(), t.dtype(), "{what}: {k} dtype");
        assert_eq!(values(&a[k]), values(t), "{what}: {k}");
    }
}

/// Copies the folder `src` to `dst` (a killed run's output, to resume it twice).
fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let to = dst.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to);
        } else {
            std::fs::copy(e.path(), to).unwrap();
        }
    }
}

/// `optimizer` (its overrides) on 2 sharded ranks in `full` and `grad_op` against one device:
/// the same losses, weights and optimizer-state format, rank 0 holding about half of one
/// device's state (half to 2% when `balanced`: every tensor quantized); then a 2-rank run killed after step 3 resumes from its step-2 checkpoint on 2
/// ranks to the uninterrupted run bit for bit, and on one device to one device's run.
fn sharded_equals_one_device(name: &str, optimizer: &[&str], balanced: bool) {
    let case = Case::new(&format!("quant-{name}"), "qwen2");
    let extra = [optimizer, &["log_peak_memory_stats=true"]].concat();
    let (single, want) = case.single_device_reference_with("full_finetune_single_device", &extra);
    let one_mb = state_mb(&single);
    let single_state = load(&single.join("epoch_1/recipe_state/optimizer.safetensors"));
    for mode in ["full", "grad_op"] {
        let what = format!("{name} {mode}");
        let out = case.dir.join(format!("dist-{mode}"));
        let mode_key = format!("fsdp_sharding={mode}");
        let o = case.run(
            2,
            "full_finetune_distributed",
            &out,
            &[&extra[..], &[mode_key.as_str()]].concat(),
            &[],
        );
        let log = text(&o);
        assert!(o.status.success(), "{what}: {log}");
        assert_same_losses(&losses(&out.join("logs/metrics.jsonl")), &want, &what);
        assert_same_tensors(
            &out.join("epoch_1/model.safetensors"),
            &single.join("epoch_1/model.safetensors"),
            1e-4,
            &what,
        );
        let state = load(&out.join("epoch_1/recipe_state/optimizer.safetensors"));
        let same = same_format(&state, &single_state, &what);
        let rank_mb = state_mb(&out);
        eprintln!(
            "{what}: {:.4} of the codes equal one device's; optimizer state {rank_mb:.4} MB on \
             rank 0, {one_mb:.4} MB on one device",
            same
        );
        assert!(same >= 0.99, "{what}: only {same} of the codes equal");
        // The shards split the values in two, not the bytes: with every tensor quantized rank 0
        // holds half of the state, but the tensors kept in f32 (k and v, 1024 values each; q
        // and o too under min_8bit_size 5000) all lie in rank 0's first half of each layer
        // (0.55 of one device's state in torchao's 8 bits, 0.61 in 4, 0.68 in bitsandbytes').
        let (mid, tol) = if balanced { (0.5, 0.02) } else { (0.55, 0.15) };
        assert!(
            (rank_mb / one_mb - mid).abs() < tol,
            "{what}: rank 0 holds {rank_mb} MB of optimizer state, one device {one_mb} MB"
        );
    }

    // Killed after step 3: epoch_0 (step 2) is the checkpoint.
    let killed = case.dir.join("killed");
    let o = case.run(
        2,
        "full_finetune_distributed",
        &killed,
        &extra,
        &[("FERROTUNE_KILL_AFTER_STEP", "3")],
    );
    assert!(
        !o.status.success(),
        "{name}: the run should have been killed"
    );
    assert!(killed
        .join("epoch_0/recipe_state/optimizer.safetensors")
        .is_file());
    let on_one = case.dir.join("killed-one");
    copy_dir(&killed, &on_one);
    // …resumed on 2 ranks: the uninterrupted 2-rank run, bit for bit.
    let o = case.run(
        2,
        "full_finetune_distributed",
        &killed,
        &[&extra[..], &["resume_from_checkpoint=true"]].concat(),
        &[],
    );
    assert!(o.status.success(), "{name}: {}", text(&o));
    let full = case.dir.join("dist-full");
    let (got, uninterrupted) = (
        losses(&killed.join("logs/metrics.jsonl")),
        losses(&full.join("logs/metrics.jsonl")),
    );
    assert_eq!(got, uninterrupted, "{name}: resumed on 2 ranks");
    for file in ["model.safetensors", "recipe_state/optimizer.safetensors"] {
        identical(
            &killed.join("epoch_1").join(file),
            &full.join("epoch_1").join(file),
            &format!("{name}: resumed on 2 ranks, {file}"),
        );
    }
    // …and on one device (the global batch kept): one device's run.
    let o = case.run(
        1,
        "full_finetune_single_device",
        &on_one,
        &[&extra[..], &["batch_size=4", "resume_from_checkpoint=true"]].concat(),
        &[],
    );
    assert!(o.status.success(), "{name}: {}", text(&o));
    let what = format!("{name}: resumed on one device");
    assert_same_losses(&losses(&on_one.join("logs/metrics.jsonl")), &want, &what);
    assert_same_tensors(
        &on_one.join("epoch_1/model.safetensors"),
        &single.join("epoch_1/model.safetensors"),
        1e-4,
        &what,
    );
}

#[test]
fn torchao_adamw8bit_sharded_equals_one_device() {
    let optimizer = ["optimizer._component_=torchao.optim.AdamW8bit"];
    sharded_equals_one_device("torchao8", &optimizer, false);
}

#[test]
fn torchao_adamw4bit_sharded_equals_one_device() {
    let optimizer = ["optimizer._component_=torchao.optim.AdamW4bit"];
    sharded_equals_one_device("torchao4", &optimizer, false);
}

/// bitsandbytes' `min_8bit_size` goes by the whole parameter: at 5000, the MLP's matrices (8192
/// values) are quantized though a rank may hold fewer of their values, and the attention's
/// (4096) are not.
#[test]
fn bitsandbytes_adamw8bit_sharded_equals_one_device() {
    sharded_equals_one_device(
        "bnb8",
        &[
            "optimizer._component_=bitsandbytes.optim.AdamW8bit",
            "optimizer.min_8bit_size=5000",
        ],
        false,
    );
}

/// bitsandbytes with `min_8bit_size: 16`: biases and norms (16 and 64 values) quantized in one
/// partial block each.
#[test]
fn bitsandbytes_partial_blocks_sharded_equal_one_device() {
    sharded_equals_one_device(
        "bnb8-small",
        &[
            "optimizer._component_=bitsandbytes.optim.PagedAdamW8bit",
            "optimizer.min_8bit_size=16",
        ],
        true,
    );
}

/// On 2 unsharded ranks (`fsdp_sharding: none`) every rank holds the whole state: one device's
/// losses.
#[test]
fn quantized_adamw_on_unsharded_ranks_equals_one_device() {
    let case = Case::new("quant-adamw", "qwen2");
    let quant = "optimizer._component_=torchao.optim.AdamW8bit";
    let (_, want) = case.single_device_reference_with("full_finetune_single_device", &[quant]);
    let out = case.dir.join("dist-none");
    let o = case.run(
        2,
        "full_finetune_distributed",
        &out,
        &[quant, "fsdp_sharding=none"],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_same_losses(&losses(&out.join("logs/metrics.jsonl")), &want, "none");
}

/// `fsdp_cpu_offload: true` with a quantized AdamW keeps the trainable shards, their gradients
/// and the quantized state in host memory, where the optimizer steps (torchtune's FSDP2
/// `CPUOffloadPolicy` under torchao's optimizers). On CPU ranks the device is the host, so there
/// is nothing to move: the run says so, and it is the 2-rank run without offload bit for bit —
/// one device's losses and weights.
#[test]
fn quantized_adamw_with_cpu_offload_equals_one_device() {
    let optimizers: [(&str, &[&str]); 2] = [
        (
            "torchao8",
            &["optimizer._component_=torchao.optim.AdamW8bit"],
        ),
        (
            "paged-bnb8",
            &["optimizer._component_=bitsandbytes.optim.PagedAdamW8bit"],
        ),
    ];
    for (name, optimizer) in optimizers {
        let case = Case::new(&format!("quant-offload-{name}"), "qwen2");
        let (single, want) =
            case.single_device_reference_with("full_finetune_single_device", optimizer);
        let plain = case.dir.join("dist");
        let o = case.run(2, "full_finetune_distributed", &plain, optimizer, &[]);
        assert!(o.status.success(), "{name}: {}", text(&o));
        let offloaded = case.dir.join("dist-offload");
        let extra = [optimizer, &["fsdp_cpu_offload=true"]].concat();
        let o = case.run(2, "full_finetune_distributed", &offloaded, &extra, &[]);
        let log = text(&o);
        assert!(o.status.success(), "{name}: {log}");
        assert!(
            log.contains("fsdp_cpu_offload: the device is the CPU"),
            "{name}: {log}"
        );
        let what = format!("{name} offloaded");
        assert_same_losses(&losses(&offloaded.join("logs/metrics.jsonl")), &want, &what);
        assert_same_tensors(
            &offloaded.join("epoch_1/model.safetensors"),
            &single.join("epoch_1/model.safetensors"),
            1e-4,
            &what,
        );
        for file in ["model.safetensors", "recipe_state/optimizer.safetensors"] {
            identical(
                &offloaded.join("epoch_1").join(file),
                &plain.join("epoch_1").join(file),
                &format!("{what}: {file} against the run without offload"),
            );
        }
    }
}
