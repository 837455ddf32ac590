//! Spreading a model's decoder layers over the visible GPUs, as HF Accelerate's `device_map`
//! does (`ferrotune generate --device-map`, and the generation recipe torchtune runs over several
//! GPUs).

use anyhow::{Context, Result};
use candle_core::Device;
use ferrotune_models::device_map::{format_bytes, plan, usable_bytes};
use ferrotune_models::{CausalLm, DeviceMapMode};

/// Test hook, not a user setting: `FERROTUNE_DEVICE_MAP_FAKE="cpu:BYTES,cpu:BYTES,..."` makes
/// `--device-map` see that many CPU "devices" with those capacities (bytes, or sizes such as
/// `2MiB`) instead of the visible GPUs, so that planning, dispatch and the multi-device forward run
/// on machines without a GPU.
#[cfg(feature = "test-hooks")]
const FAKE_DEVICES_ENV: &str = ferrotune_core::switch::DEVICE_MAP_FAKE.name;

/// Capacity assumed for a GPU whose free memory cannot be read (the driver query failed).
const UNKNOWN_GPU_CAPACITY: u64 = 16 << 30;

/// A device `--device-map` may place parts on.
struct Target {
    name: String,
    device: Device,
    /// Free bytes when the plan is made.
    capacity: u64,
}

/// Plans `mode` over the visible GPUs, dispatches the model and prints one line per device. With
/// no GPU visible the model stays on the CPU, as Accelerate does.
pub fn spread_model(model: &mut CausalLm, mode: DeviceMapMode, what: &str) -> Result<()> {
    let targets = visible_targets()?;
    if targets.is_empty() {
        eprintln!(
            "note: {what} {}: no GPU visible, the whole model stays on the CPU",
            mode.name()
        );
        return Ok(());
    }
    let (layer_bytes, root_bytes) = model.part_bytes();
    let capacities: Vec<u64> = targets.iter().map(|t| t.capacity).collect();
    let placement = plan(mode, &layer_bytes, root_bytes, &capacities)
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("{what} {}", mode.name()))?;
    let devices: Vec<Device> = targets.iter().map(|t| t.device.clone()).collect();
    model.dispatch(&placement, &devices)?;
    let held = placement.bytes_per_device(&layer_bytes, root_bytes, targets.len());
    for (i, t) in targets.iter().enumerate() {
        eprintln!(
            "{}: {} ({} of {} usable)",
            t.name,
            placement.describe(i),
            format_bytes(held[i]),
            format_bytes(usable_bytes(t.capacity))
        );
    }
    Ok(())
}

/// The GPUs the driver shows (so CUDA_VISIBLE_DEVICES applies), or the fake CPU devices of the
/// test hook.
fn visible_targets() -> Result<Vec<Target>> {
    #[cfg(feature = "test-hooks")]
    if let Some(spec) = ferrotune_core::switch::DEVICE_MAP_FAKE.value() {
        return fake_targets(&spec);
    }
    let mut out = Vec::new();
    // A CUDA build without the CUDA libraries sees no GPU, and says which library is missing.
    #[cfg(feature = "cuda")]
    if let Err(why) = ferrotune_core::cuda_load::require_gpu_libraries() {
        eprintln!("note: no GPU usable: {why}");
        return Ok(out);
    }
    // Without the `cuda` feature the first attempt already fails.
    while let Ok(device) = ferrotune_core::cuda_load::new_cuda(out.len()) {
        let capacity = free_memory(&device).unwrap_or_else(|| {
            eprintln!(
                "note: free memory of cuda:{} unknown, assuming {}",
                out.len(),
                format_bytes(UNKNOWN_GPU_CAPACITY)
            );
            UNKNOWN_GPU_CAPACITY
        });
        out.push(Target {
            name: format!("cuda:{}", out.len()),
            device,
            capacity,
        });
    }
    Ok(out)
}

/// The devices of [`FAKE_DEVICES_ENV`].
#[cfg(feature = "test-hooks")]
fn fake_targets(spec: &str) -> Result<Vec<Target>> {
    spec.split(',')
        .enumerate()
        .map(|(i, entry)| {
            let size = entry.trim().strip_prefix("cpu:").with_context(|| {
                format!("{FAKE_DEVICES_ENV}: expected cpu:BYTES, got '{entry}'")
            })?;
            let capacity = ferrotune_models::parse_shard_size(size)
                .map_err(anyhow::Error::msg)
                .context(FAKE_DEVICES_ENV)?;
            Ok(Target {
                name: format!("cpu:{i}"),
                device: Device::Cpu,
                capacity,
            })
        })
        .collect()
}

/// Free bytes on a CUDA device, from the driver.
#[cfg(feature = "cuda")]
fn free_memory(device: &Device) -> Option<u64> {
    match device {
        Device::Cuda(cuda) => cuda
            .cuda_stream()
            .context()
            .mem_get_info()
            .ok()
            .map(|(free, _total)| free as u64),
        _ => None,
    }
}

/// Without the `cuda` feature no GPU is ever visible.
#[cfg(not(feature = "cuda"))]
fn free_memory(_device: &Device) -> Option<u64> {
    None
}
