//! The machine check: sizes that come from configs, model files and data are checked against
//! the machine's memory before anything that size is allocated, so that an absurd value (a
//! billion layers, a rank of 1e11) is an error naming what it was for rather than an allocation
//! that aborts the process.

use candle_core::Device;

/// Bytes of `count` elements of `elem_bytes` each, `None` when the product overflows: what a
/// size taken from input is computed with before it is checked.
pub fn bytes_of(count: u64, elem_bytes: u64) -> Option<u64> {
    count.checked_mul(elem_bytes)
}

/// The memory tensors on `device` can use at most: the machine's RAM and swap, plus the GPU's
/// own memory for a CUDA device. `None` where it cannot be known (no `/proc/meminfo`), which
/// turns the check off rather than refusing what might fit.
pub fn machine_memory_bytes(device: &Device) -> Option<u64> {
    let ram = ram_and_swap_bytes()?;
    Some(ram.saturating_add(gpu_total_bytes(device).unwrap_or(0)))
}

/// `MemTotal + SwapTotal` of `/proc/meminfo`.
fn ram_and_swap_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = |key: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        line[key.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()
    };
    let total = kib("MemTotal:")?;
    Some(total.saturating_add(kib("SwapTotal:").unwrap_or(0)) * 1024)
}

#[cfg(feature = "cuda")]
fn gpu_total_bytes(device: &Device) -> Option<u64> {
    match device {
        Device::Cuda(d) => d
            .cuda_stream()
            .context()
            .mem_get_info()
            .ok()
            .map(|(_, total)| total as u64),
        _ => None,
    }
}

#[cfg(not(feature = "cuda"))]
fn gpu_total_bytes(_device: &Device) -> Option<u64> {
    None
}

/// Refuses `bytes` (`None`: a size whose computation overflowed) of tensors on `device` when
/// they cannot fit in the machine's memory ([`machine_memory_bytes`]). `what` says what they
/// are for and which key or file set their size; the error names it.
pub fn check_fits(bytes: Option<u64>, what: &str, device: &Device) -> Result<(), String> {
    check_fits_in(bytes, what, machine_memory_bytes(device))
}

/// [`check_fits`] against a given memory size (`None`: unknown, nothing is refused).
pub fn check_fits_in(bytes: Option<u64>, what: &str, memory: Option<u64>) -> Result<(), String> {
    let Some(bytes) = bytes else {
        return Err(format!(
            "{what} would need more than 2^64 bytes of memory: the size is implausible"
        ));
    };
    match memory {
        Some(memory) if bytes > memory => Err(format!(
            "{what} would need {} of memory, more than this machine has ({})",
            human(bytes),
            human(memory)
        )),
        _ => Ok(()),
    }
}

/// `bytes` in GiB (or MiB below one GiB), for messages.
fn human(bytes: u64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    const MIB: f64 = (1u64 << 20) as f64;
    let b = bytes as f64;
    if b >= GIB {
        format!("{:.1} GiB", b / GIB)
    } else {
        format!("{:.1} MiB", b / MIB)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_what_cannot_fit_and_overflows() {
        let err = check_fits_in(
            Some(1 << 40),
            "LoRA adapters (model.lora_rank)",
            Some(1 << 30),
        )
        .unwrap_err();
        assert!(
            err.contains("model.lora_rank") && err.contains("1024.0 GiB"),
            "{err}"
        );
        let err = check_fits_in(bytes_of(u64::MAX, 2), "the mask", Some(1 << 30)).unwrap_err();
        assert!(err.contains("the mask") && err.contains("2^64"), "{err}");
        check_fits_in(Some(1 << 20), "small", Some(1 << 30)).unwrap();
        check_fits_in(Some(u64::MAX), "unknown memory", None).unwrap();
    }

    #[test]
    fn this_machine_has_some_memory() {
        let m = machine_memory_bytes(&Device::Cpu).expect("Linux has /proc/meminfo");
        assert!(m > 1 << 26, "{m}");
        check_fits(Some(1 << 50), "a petabyte", &Device::Cpu).unwrap_err();
    }
}
