//! Parsing of the user-facing names for devices and compute dtypes.

use candle_core::{DType, Device};

/// Parses a compute dtype as users write it on the CLI or in a config (`f32`, `fp32`, `float32`,
/// `bf16`, `bfloat16`, `f16`, `fp16`, `float16`).
pub fn parse_dtype(name: &str) -> Result<DType, String> {
    match name.trim().to_ascii_lowercase().as_str() {
        "f32" | "fp32" | "float32" | "float" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "fp16" | "float16" | "half" => Ok(DType::F16),
        other => Err(format!(
            "unknown dtype '{other}': expected one of f32 (fp32), bf16, f16"
        )),
    }
}

/// Parses a device name: `cpu`, `cuda` (GPU 0) or `cuda:N`.
pub fn parse_device(name: &str) -> Result<Device, String> {
    let name = name.trim().to_ascii_lowercase();
    if name == "cpu" {
        return Ok(Device::Cpu);
    }
    let ordinal = if name == "cuda" {
        0
    } else if let Some(n) = name.strip_prefix("cuda:") {
        n.parse::<usize>()
            .map_err(|_| format!("invalid device '{name}': expected cuda:N with N a GPU index"))?
    } else {
        return Err(format!(
            "unknown device '{name}': expected cpu, cuda or cuda:N"
        ));
    };
    Device::new_cuda(ordinal).map_err(|e| {
        format!("device '{name}' is not available: {e} (this binary needs the `cuda` feature and a GPU)")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtypes_parse_and_unknown_is_an_error() {
        assert_eq!(parse_dtype("bf16").unwrap(), DType::BF16);
        assert_eq!(parse_dtype("FP32").unwrap(), DType::F32);
        let err = parse_dtype("int3").unwrap_err();
        assert!(err.contains("int3") && err.contains("bf16"), "{err}");
    }

    #[test]
    fn devices_parse() {
        assert!(parse_device("cpu").unwrap().is_cpu());
        assert!(parse_device("tpu").unwrap_err().contains("tpu"));
        assert!(parse_device("cuda:x").unwrap_err().contains("cuda:N"));
    }
}
