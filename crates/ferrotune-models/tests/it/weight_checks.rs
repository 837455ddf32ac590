//! Weights a reader refuses whatever the format (issue 44): a float parameter stored as an
//! integer type, and NaN or ±Inf values. Each error names the file and the tensor. (GGUF's
//! cases are in `gguf.rs`, beside its file builder.)

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use ferrotune_models::torch_pickle::{write_torch_file, write_torch_tensors, TorchTensor};
use ferrotune_models::{load_adapter, load_model};

fn fixture(part: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/llama3")
        .join(part)
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "ferrotune-weight-checks-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn load_err(path: &Path) -> String {
    match load_model(path, DType::F32, &Device::Cpu) {
        Ok(_) => panic!("{} loaded but should not", path.display()),
        Err(e) => e.to_string(),
    }
}

/// The fixture model's tensors, `edit`ed, saved in a fresh folder beside its config.
fn model_with(name: &str, edit: impl FnOnce(&mut HashMap<String, Tensor>)) -> PathBuf {
    let d = scratch(name);
    std::fs::copy(fixture("model/config.json"), d.join("config.json")).unwrap();
    let mut tensors =
        candle_core::safetensors::load(fixture("model/model.safetensors"), &Device::Cpu).unwrap();
    edit(&mut tensors);
    candle_core::safetensors::save(&tensors, d.join("model.safetensors")).unwrap();
    d
}

/// `tensor` with its first value replaced by `v`.
fn poisoned(tensor: &Tensor, v: f32) -> Tensor {
    let mut values = tensor.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    values[0] = v;
    Tensor::from_vec(values, tensor.shape(), &Device::Cpu).unwrap()
}

/// Rewrites a safetensors header, keeping the data: `edit` changes the tensors' entries.
fn relabel(file: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut header);
    let mut text = header.to_string().into_bytes();
    // safetensors writers pad the header to 8 bytes with spaces.
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(&bytes[8 + n..]);
    std::fs::write(file, out).unwrap();
}

#[test]
fn safetensors_integer_dtypes_are_refused() {
    const NORM: &str = "model.layers.1.input_layernorm.weight";
    // Same byte size: only the dtype check can tell (before, the bytes loaded as integers).
    for dtype in ["I32", "U32"] {
        let d = model_with(&format!("relabel-{dtype}"), |_| {});
        relabel(&d.join("model.safetensors"), |h| {
            h[NORM]["dtype"] = dtype.into()
        });
        let err = load_err(&d);
        assert!(
            err.contains("model.safetensors")
                && err.contains(&format!("tensor '{NORM}' is stored as {dtype}")),
            "{err}"
        );
    }
    // Other sizes: the safetensors crate's own size check (shape × dtype against the bytes).
    for dtype in ["F16", "I64", "BOOL"] {
        let d = model_with(&format!("resized-{dtype}"), |_| {});
        relabel(&d.join("model.safetensors"), |h| {
            h[NORM]["dtype"] = dtype.into()
        });
        let err = load_err(&d);
        assert!(err.contains("model.safetensors"), "{dtype}: {err}");
    }
    // A truncated file.
    let d = model_with("truncated", |_| {});
    let file = d.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 4]).unwrap();
    let err = load_err(&d);
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn non_finite_weights_are_refused_in_every_format() {
    const NORM: &str = "model.norm.weight";
    const Q: &str = "model.layers.0.self_attn.q_proj.weight";
    // Safetensors: NaN, +Inf, -Inf.
    for (case, v) in [
        ("nan", f32::NAN),
        ("inf", f32::INFINITY),
        ("ninf", f32::NEG_INFINITY),
    ] {
        let d = model_with(case, |t| {
            let q = poisoned(&t[Q], v);
            t.insert(Q.into(), q);
        });
        let err = load_err(&d);
        let (nan, inf) = if v.is_nan() { (1, 0) } else { (0, 1) };
        assert!(
            err.contains("model.safetensors")
                && err.contains(&format!("tensor '{Q}' holds {nan} NaN and {inf} infinite")),
            "{case}: {err}"
        );
    }
    // All NaN, loaded in bf16.
    let d = model_with("all-nan", |t| {
        let all = (t[NORM].ones_like().unwrap() * f64::NAN).unwrap();
        t.insert(NORM.into(), all);
    });
    let err = match load_model(&d, DType::BF16, &Device::Cpu) {
        Ok(_) => panic!("loaded"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains(&format!("tensor '{NORM}' holds 64 NaN")),
        "{err}"
    );
    // A value too large for F16 becomes +Inf when converted: said so.
    let d = model_with("f16-overflow", |t| {
        let big = poisoned(&t[Q], 1e6);
        t.insert(Q.into(), big);
    });
    let err = match load_model(&d, DType::F16, &Device::Cpu) {
        Ok(_) => panic!("loaded"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("1 infinite") && err.contains("converted from F32 to F16"),
        "{err}"
    );

    // torch.save (`pytorch_model.bin`): NaN, and a float parameter stored as int32.
    let tensors =
        candle_core::safetensors::load(fixture("model/model.safetensors"), &Device::Cpu).unwrap();
    let mut named: Vec<(String, Tensor)> = tensors.into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let d = scratch("bin-nan");
    std::fs::copy(fixture("model/config.json"), d.join("config.json")).unwrap();
    let with_nan: Vec<(String, Tensor)> = named
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                if n == Q {
                    poisoned(t, f32::NAN)
                } else {
                    t.clone()
                },
            )
        })
        .collect();
    write_torch_tensors(&d.join("pytorch_model.bin"), &with_nan).unwrap();
    let err = load_err(&d);
    assert!(
        err.contains("pytorch_model.bin") && err.contains(&format!("tensor '{Q}' holds 1 NaN")),
        "{err}"
    );
    let d = scratch("bin-int");
    std::fs::copy(fixture("model/config.json"), d.join("config.json")).unwrap();
    let as_int: Vec<(String, TorchTensor)> = named
        .iter()
        .map(|(n, t)| {
            let tt = if n == NORM {
                TorchTensor::from_i32(vec![64], &[1; 64])
            } else {
                TorchTensor::from_tensor(t).unwrap()
            };
            (n.clone(), tt)
        })
        .collect();
    write_torch_file(&d.join("pytorch_model.bin"), &as_int).unwrap();
    let err = load_err(&d);
    assert!(
        err.contains("pytorch_model.bin")
            && err.contains(&format!("tensor '{NORM}' is stored as I32")),
        "{err}"
    );

    // A PEFT adapter.
    let d = scratch("adapter");
    std::fs::copy(
        fixture("adapter/adapter_config.json"),
        d.join("adapter_config.json"),
    )
    .unwrap();
    let mut adapter =
        candle_core::safetensors::load(fixture("adapter/adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    let mut names: Vec<String> = adapter.keys().cloned().collect();
    names.sort();
    let b = names.iter().find(|n| n.contains("lora_B")).unwrap().clone();
    let bad = poisoned(&adapter[&b], f32::INFINITY);
    adapter.insert(b.clone(), bad);
    candle_core::safetensors::save(&adapter, d.join("adapter_model.safetensors")).unwrap();
    let (mut model, _) = load_model(&fixture("model"), DType::F32, &Device::Cpu).unwrap();
    let err = load_adapter(&mut model, &d).unwrap_err().to_string();
    assert!(
        err.contains("adapter_model.safetensors")
            && err.contains(&format!("tensor '{b}' holds 0 NaN and 1 infinite")),
        "{err}"
    );
}
