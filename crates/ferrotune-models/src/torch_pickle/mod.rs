//! Reading PyTorch checkpoints written by `torch.save`: HF's `pytorch_model*.bin` (and torchtune's
//! `hf_model_*.pt`), which carry HF tensor names beside a `config.json`, and Meta's original
//! `consolidated.00.pth` + `params.json` (torchtune's `FullModelMetaCheckpointer`).
//!
//! The pickle opcodes are parsed by candle's unpickler (`candle_core::pickle::Stack`); walking the
//! state dict is ours, because candle's own loader skips (with a print) the storage types it does
//! not know — int8 codes among them — where we must fail loudly or read them. Writing is ours too
//! (no crate writes torch's format): a dict of tensors as `torch.save` lays it out. Also ours: the
//! Meta names and config, and the rotary layout of Meta's q/k rows. Lists of shards, in HF's or
//! torchtune's names, are read by [`crate::checkpoint::read_pickle_shards`].

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use candle_core::pickle::Object;
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use crate::config::ModelConfig;
use crate::error::ModelError;

mod guard;

/// Whether `path` names a PyTorch pickle checkpoint file (`.bin`, `.pt`, `.pth`).
pub fn is_pickle_file(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("bin" | "pt" | "pth")
    )
}

/// The element type of a torch storage (`torch.FloatStorage` and the like).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TorchDType {
    F32,
    F64,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl TorchDType {
    const ALL: [TorchDType; 10] = [
        Self::F32,
        Self::F64,
        Self::F16,
        Self::BF16,
        Self::I64,
        Self::I32,
        Self::I16,
        Self::I8,
        Self::U8,
        Self::Bool,
    ];

    /// The storage class `torch.save` names for this type.
    pub fn storage_class(self) -> &'static str {
        match self {
            Self::F32 => "FloatStorage",
            Self::F64 => "DoubleStorage",
            Self::F16 => "HalfStorage",
            Self::BF16 => "BFloat16Storage",
            Self::I64 => "LongStorage",
            Self::I32 => "IntStorage",
            Self::I16 => "ShortStorage",
            Self::I8 => "CharStorage",
            Self::U8 => "ByteStorage",
            Self::Bool => "BoolStorage",
        }
    }

    /// The candle type holding these values exactly (i8 and bool widened).
    pub fn candle(self) -> DType {
        match self {
            Self::F32 | Self::I8 => DType::F32,
            Self::F64 => DType::F64,
            Self::F16 => DType::F16,
            Self::BF16 => DType::BF16,
            Self::I64 => DType::I64,
            Self::I32 => DType::I32,
            Self::I16 => DType::I16,
            Self::U8 | Self::Bool => DType::U8,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F64 | Self::I64 => 8,
            Self::F32 | Self::I32 => 4,
            Self::F16 | Self::BF16 | Self::I16 => 2,
            Self::I8 | Self::U8 | Self::Bool => 1,
        }
    }
}

/// One tensor of a `torch.save` file: its type, shape and contiguous little-endian bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct TorchTensor {
    pub dtype: TorchDType,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl TorchTensor {
    /// An int8 tensor (torch's `CharStorage`), e.g. quantized codes.
    pub fn from_i8(shape: Vec<usize>, values: &[i8]) -> Self {
        Self {
            dtype: TorchDType::I8,
            shape,
            data: values.iter().map(|&v| v as u8).collect(),
        }
    }

    /// An int32 tensor.
    pub fn from_i32(shape: Vec<usize>, values: &[i32]) -> Self {
        Self {
            dtype: TorchDType::I32,
            shape,
            data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    /// A candle tensor's values in its dtype (f32, f64, f16, bf16, i64, i32, i16, u8).
    pub fn from_tensor(t: &Tensor) -> candle_core::Result<Self> {
        let flat = t.flatten_all()?.to_device(&Device::Cpu)?;
        let (dtype, data): (TorchDType, Vec<u8>) = match t.dtype() {
            DType::F32 => (TorchDType::F32, le(&flat, f32::to_le_bytes)?),
            DType::F64 => (TorchDType::F64, le(&flat, f64::to_le_bytes)?),
            DType::F16 => (TorchDType::F16, le(&flat, half::f16::to_le_bytes)?),
            DType::BF16 => (TorchDType::BF16, le(&flat, half::bf16::to_le_bytes)?),
            DType::I64 => (TorchDType::I64, le(&flat, i64::to_le_bytes)?),
            DType::I32 => (TorchDType::I32, le(&flat, i32::to_le_bytes)?),
            DType::I16 => (TorchDType::I16, le(&flat, i16::to_le_bytes)?),
            DType::U8 => (TorchDType::U8, flat.to_vec1::<u8>()?),
            other => candle_core::bail!("no torch storage for {other:?}"),
        };
        Ok(Self {
            dtype,
            shape: t.dims().to_vec(),
            data,
        })
    }

    /// A weight read from `file`: refused unless stored as a float type and holding only
    /// finite values (`weight_checks`); in `dtype` (`None`: as stored) on `device`.
    pub fn to_weight(
        &self,
        file: &Path,
        name: &str,
        dtype: Option<DType>,
        device: &Device,
    ) -> Result<Tensor, ModelError> {
        let float = matches!(
            self.dtype,
            TorchDType::F32 | TorchDType::F64 | TorchDType::F16 | TorchDType::BF16
        );
        crate::weight_checks::stored_as_float(file, name, self.dtype, float)?;
        let stored = self.dtype.candle();
        let t = self
            .to_tensor(dtype.unwrap_or(stored), device)
            .map_err(|e| ModelError::file(file, format!("tensor '{name}': {e}")))?;
        crate::weight_checks::finite(file, name, &t, Some(stored))?;
        Ok(t)
    }

    /// The values as a candle tensor in `dtype` (integers through f32/f64, exactly while they
    /// fit).
    pub fn to_tensor(&self, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
        let shape = self.shape.as_slice();
        let raw = |d: DType| Tensor::from_raw_buffer(&self.data, d, shape, &Device::Cpu);
        let t = match self.dtype {
            TorchDType::F32 => raw(DType::F32)?,
            TorchDType::F64 => raw(DType::F64)?,
            TorchDType::F16 => raw(DType::F16)?,
            TorchDType::BF16 => raw(DType::BF16)?,
            TorchDType::I64 => raw(DType::I64)?,
            TorchDType::I32 => raw(DType::I32)?,
            TorchDType::I16 => raw(DType::I16)?,
            TorchDType::U8 | TorchDType::Bool => raw(DType::U8)?,
            TorchDType::I8 => {
                let v: Vec<f32> = self.data.iter().map(|&b| b as i8 as f32).collect();
                Tensor::from_vec(v, shape, &Device::Cpu)?
            }
        };
        t.to_dtype(dtype)?.to_device(device)
    }
}

/// `flat`'s values as little-endian bytes, each through `f`.
fn le<T: candle_core::WithDType, const N: usize>(
    flat: &Tensor,
    f: fn(T) -> [u8; N],
) -> candle_core::Result<Vec<u8>> {
    Ok(flat.to_vec1::<T>()?.into_iter().flat_map(f).collect())
}

/// Where one tensor's bytes are in a `torch.save` file.
struct TensorRecord {
    name: String,
    dtype: TorchDType,
    shape: Vec<usize>,
    storage: String,
    offset: usize,
}

/// Reads every tensor of a `torch.save` file holding a state dict (a dict of tensors, as
/// `torch.save(model.state_dict())` writes it), sorted by name. Tensors sharing a storage (tied
/// weights) each get their own copy. Only what a state dict holds is accepted: another object, a
/// non-tensor value or a tensor subclass (torchao's quantized tensors) is an error naming it.
pub fn read_torch_file(file: &Path) -> Result<Vec<(String, TorchTensor)>, ModelError> {
    let ferr = |msg: String| ModelError::file(file, msg);
    let not_torch = |e: &dyn std::fmt::Display| {
        ferr(format!(
            "not a readable PyTorch checkpoint ({e}); expected a zip file written by torch.save \
             (PyTorch 1.6 or later) holding a state dict of tensors"
        ))
    };
    let f = std::fs::File::open(file).map_err(|e| ferr(format!("cannot open: {e}")))?;
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(f)).map_err(|e| not_torch(&e))?;
    let pkl = zip
        .file_names()
        .filter_map(|n| n.ok().map(|n| n.into_owned()))
        .find(|n| n.ends_with("data.pkl"))
        .ok_or_else(|| not_torch(&"no data.pkl inside"))?;
    let prefix = pkl.strip_suffix("data.pkl").unwrap_or("").to_string();
    let obj = {
        use std::io::Read;
        let mut bytes = Vec::new();
        zip.by_name(&pkl)
            .and_then(|mut entry| Ok(entry.read_to_end(&mut bytes)?))
            .map_err(|e| not_torch(&e))?;
        // candle's unpickler trusts the pickle's lengths and copies: checked first.
        guard::check(&bytes).map_err(|e| ferr(format!("{pkl}: {e}")))?;
        let mut stack = candle_core::pickle::Stack::empty();
        stack
            .read_loop(&mut &bytes[..])
            .map_err(|e| not_torch(&e))?;
        stack.finalize().map_err(|e| not_torch(&e))?
    };
    let entries = match obj {
        Object::Dict(entries) => entries,
        other => {
            return Err(ferr(format!(
                "holds {}, not a state dict of tensors",
                describe(&other)
            )))
        }
    };
    let mut records = Vec::with_capacity(entries.len());
    for (key, value) in entries {
        let name = match key {
            Object::Unicode(s) => s,
            other => return Err(ferr(format!("a state dict key is {}", describe(&other)))),
        };
        let record = tensor_record(value)
            .map_err(|msg| ferr(format!("'{name}': {msg}")))?
            .with_name(name);
        records.push(record);
    }
    // Each storage is read once, for all the tensors that view it.
    let mut by_storage: HashMap<String, Vec<usize>> = HashMap::new();
    for (i, r) in records.iter().enumerate() {
        by_storage.entry(r.storage.clone()).or_default().push(i);
    }
    let mut out: Vec<Option<TorchTensor>> = vec![None; records.len()];
    let mut storages: Vec<_> = by_storage.into_iter().collect();
    storages.sort();
    for (key, users) in storages {
        let path = format!("{prefix}data/{key}");
        let mut bytes = Vec::new();
        {
            use std::io::Read;
            let mut entry = zip
                .by_name(&path)
                .map_err(|e| ferr(format!("storage '{path}': {e}")))?;
            entry
                .read_to_end(&mut bytes)
                .map_err(|e| ferr(format!("storage '{path}': {e}")))?;
        }
        let single = users.len() == 1;
        for i in users {
            let r = &records[i];
            let numel: usize = r.shape.iter().product();
            let (start, len) = (r.offset * r.dtype.size(), numel * r.dtype.size());
            if start + len > bytes.len() {
                return Err(ferr(format!(
                    "'{}': {len} bytes at {start} are past its storage's {} bytes (truncated \
                     file?)",
                    r.name,
                    bytes.len()
                )));
            }
            // The usual case, one tensor over its whole storage, takes the bytes as they are
            // (no second copy of a large matrix).
            let data = if single && start == 0 {
                let mut whole = std::mem::take(&mut bytes);
                whole.truncate(len);
                whole
            } else {
                bytes[start..start + len].to_vec()
            };
            out[i] = Some(TorchTensor {
                dtype: r.dtype,
                shape: r.shape.clone(),
                data,
            });
        }
    }
    let mut tensors: Vec<(String, TorchTensor)> = records
        .into_iter()
        .zip(out)
        .map(|(r, t)| (r.name, t.expect("every record belongs to a storage")))
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(tensors)
}

impl TensorRecord {
    fn with_name(mut self, name: String) -> Self {
        self.name = name;
        self
    }
}

/// A short description of a pickled object for error messages.
fn describe(obj: &Object) -> String {
    match obj {
        Object::Reduce { callable, .. } | Object::Build { callable, .. } => match &**callable {
            Object::Class {
                module_name,
                class_name,
            } => format!("a {module_name}.{class_name} object"),
            _ => "an object".into(),
        },
        Object::Dict(_) => "a dict".into(),
        Object::Int(_) | Object::Long(_) => "an integer".into(),
        Object::Float(_) => "a float".into(),
        Object::Unicode(_) => "a string".into(),
        Object::List(_) => "a list".into(),
        Object::Tuple(_) => "a tuple".into(),
        Object::None => "None".into(),
        _ => "an unsupported object".into(),
    }
}

/// The tensor a state-dict value rebuilds (`torch._utils._rebuild_tensor_v2`, possibly inside
/// `_rebuild_parameter`).
fn tensor_record(value: Object) -> Result<TensorRecord, String> {
    let what = describe(&value);
    let (callable, args) = value
        .reduce()
        .map_err(|_| format!("{what}, not a tensor"))?;
    let Object::Class {
        module_name,
        class_name,
    } = callable
    else {
        return Err(format!("{what}, not a tensor"));
    };
    match (module_name.as_str(), class_name.as_str()) {
        ("torch._utils", "_rebuild_tensor_v2") => {}
        ("torch._utils", "_rebuild_parameter") => {
            let mut a = args
                .tuple()
                .map_err(|_| "malformed parameter".to_string())?;
            if a.is_empty() {
                return Err("malformed parameter".into());
            }
            return tensor_record(a.remove(0));
        }
        ("torch._tensor", "_rebuild_from_type_v2")
        | ("torch._utils", "_rebuild_wrapper_subclass") => {
            return Err(
                "a tensor subclass (e.g. torchao's quantized tensors), which only the \
                        library that made it can read"
                    .into(),
            )
        }
        (m, c) => return Err(format!("a {m}.{c} object, not a tensor")),
    }
    let malformed = |what: &str| format!("malformed tensor record ({what})");
    let mut a = args.tuple().map_err(|_| malformed("arguments"))?;
    if a.len() < 4 {
        return Err(malformed("arguments"));
    }
    let stride: Vec<usize> =
        Vec::<usize>::try_from(a.remove(3)).map_err(|_| malformed("stride"))?;
    let shape: Vec<usize> = Vec::<usize>::try_from(a.remove(2)).map_err(|_| malformed("size"))?;
    let offset = a
        .remove(1)
        .int_or_long()
        .map_err(|_| malformed("storage offset"))? as usize;
    let storage = a
        .remove(0)
        .persistent_load()
        .map_err(|_| malformed("storage"))?;
    let mut st = storage.tuple().map_err(|_| malformed("storage"))?;
    if st.len() < 5 {
        return Err(malformed("storage"));
    }
    let key = st
        .remove(2)
        .unicode()
        .map_err(|_| malformed("storage key"))?;
    let (_, class) = st
        .remove(1)
        .class()
        .map_err(|_| malformed("storage type"))?;
    let dtype = TorchDType::ALL
        .into_iter()
        .find(|d| d.storage_class() == class)
        .ok_or_else(|| format!("storage type {class} is not supported"))?;
    // Row-major strides (a dimension of size 1 may have any stride).
    let mut want = 1usize;
    for (d, (&n, &s)) in shape.iter().zip(&stride).enumerate().rev() {
        if n != 1 && s != want {
            return Err(format!(
                "non-contiguous tensor (size {shape:?}, stride {stride:?}, dimension {d}); save \
                 it with .contiguous()"
            ));
        }
        want *= n;
    }
    Ok(TensorRecord {
        name: String::new(),
        dtype,
        shape,
        storage: key,
        offset,
    })
}

/// Writes `tensors` as `torch.save` writes a state dict (a dict of tensors): a zip of
/// `data.pkl` (pickle protocol 2, read by `torch.load(..., weights_only=True)`), one storage per
/// tensor under `data/`, 64-byte aligned as torch aligns them, `byteorder` and `version`. The file
/// is written under a temporary name and renamed into place.
pub fn write_torch_file(file: &Path, tensors: &[(String, TorchTensor)]) -> Result<(), ModelError> {
    let entries: Vec<StateEntry> = tensors
        .iter()
        .enumerate()
        .map(|(i, (name, t))| StateEntry {
            name: name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            storage: i,
        })
        .collect();
    write_state_dict(file, &entries, tensors.len(), |i| {
        Ok(Cow::Borrowed(&tensors[i].1.data))
    })
}

/// [`write_torch_file`] of candle tensors, each converted to bytes only when its storage is
/// written (a model's worth of bytes is never held at once). Entries that are the same tensor
/// (a tied head and its embedding) share one storage, as `torch.save` writes them.
pub fn write_torch_tensors(file: &Path, tensors: &[(String, Tensor)]) -> Result<(), ModelError> {
    let mut owners: Vec<usize> = Vec::new(); // storage -> index of the tensor that owns it
    let mut entries = Vec::with_capacity(tensors.len());
    for (i, (name, t)) in tensors.iter().enumerate() {
        let dtype = torch_dtype(t.dtype()).ok_or_else(|| {
            ModelError::file(
                file,
                format!("tensor '{name}': no torch storage for {:?}", t.dtype()),
            )
        })?;
        let storage = match owners.iter().position(|&o| tensors[o].1.id() == t.id()) {
            Some(s) => s,
            None => {
                owners.push(i);
                owners.len() - 1
            }
        };
        entries.push(StateEntry {
            name: name.clone(),
            dtype,
            shape: t.dims().to_vec(),
            storage,
        });
    }
    write_state_dict(file, &entries, owners.len(), |s| {
        let (name, t) = &tensors[owners[s]];
        TorchTensor::from_tensor(t)
            .map(|t| Cow::Owned(t.data))
            .map_err(|e| format!("tensor '{name}': {e}"))
    })
}

/// The torch storage type of a candle dtype.
fn torch_dtype(dtype: DType) -> Option<TorchDType> {
    TorchDType::ALL
        .into_iter()
        .filter(|d| !matches!(d, TorchDType::I8 | TorchDType::Bool))
        .find(|d| d.candle() == dtype)
}

/// One name of a state dict being written: a contiguous tensor viewing storage `storage` whole.
struct StateEntry {
    name: String,
    dtype: TorchDType,
    shape: Vec<usize>,
    storage: usize,
}

/// Writes the zip `torch.save` writes for `entries`, asking `bytes` for each of the `storages`
/// storages' contents in turn (borrowed when already in memory, built on demand otherwise).
fn write_state_dict<'a>(
    file: &Path,
    entries: &[StateEntry],
    storages: usize,
    mut bytes: impl FnMut(usize) -> Result<Cow<'a, [u8]>, String>,
) -> Result<(), ModelError> {
    use std::io::Write;
    // The archive's folder name inside the zip (torch uses the file's stem).
    let stem = file
        .file_stem()
        .and_then(|s| s.to_str())
        .filter(|s| {
            s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "_-".contains(c))
        })
        .unwrap_or("archive")
        .to_string();
    crate::save::write_atomic_with(file, |tmp| {
        let err = |e: &dyn std::fmt::Display| e.to_string();
        let f = std::fs::File::create(tmp).map_err(|e| err(&e))?;
        let mut zip = zip::ZipWriter::new(std::io::BufWriter::new(f));
        let opts = |size: usize| {
            zip::write::SimpleFileOptions::default()
                .compression_method(zip::CompressionMethod::Stored)
                .with_alignment(64)
                .large_file(size as u64 >= u32::MAX as u64)
        };
        let mut put = |name: String, data: &[u8]| -> Result<(), String> {
            zip.start_file(name, opts(data.len()))
                .map_err(|e| err(&e))?;
            zip.write_all(data).map_err(|e| err(&e))
        };
        put(format!("{stem}/data.pkl"), &state_dict_pickle(entries))?;
        put(format!("{stem}/byteorder"), b"little")?;
        for s in 0..storages {
            put(format!("{stem}/data/{s}"), &bytes(s)?)?;
        }
        put(format!("{stem}/version"), b"3\n")?;
        let mut inner = zip.finish().map_err(|e| err(&e))?;
        inner.flush().map_err(|e| err(&e))?;
        inner
            .into_inner()
            .map_err(|e| e.error().to_string())?
            .sync_all()
            .map_err(|e| err(&e))
    })
}

/// The pickle (protocol 2) of a dict mapping each name to a tensor rebuilt by
/// `torch._utils._rebuild_tensor_v2` from its storage `data/<storage>`.
fn state_dict_pickle(entries: &[StateEntry]) -> Vec<u8> {
    let mut p = vec![0x80, 2]; // PROTO 2
    p.push(b'}'); // EMPTY_DICT
    for t in entries {
        p.push(b'('); // MARK
        unicode(&mut p, &t.name);
        global(&mut p, "torch._utils", "_rebuild_tensor_v2");
        p.push(b'('); // MARK: the arguments
        p.push(b'('); // MARK: the persistent id
        unicode(&mut p, "storage");
        global(&mut p, "torch", t.dtype.storage_class());
        unicode(&mut p, &t.storage.to_string());
        unicode(&mut p, "cpu");
        int(&mut p, t.shape.iter().product::<usize>());
        p.push(b't'); // TUPLE
        p.push(b'Q'); // BINPERSID
        int(&mut p, 0); // storage offset
        let mut strides = vec![1usize; t.shape.len()];
        for d in (0..t.shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * t.shape[d + 1];
        }
        for dims in [&t.shape, &strides] {
            p.push(b'(');
            for &n in dims.iter() {
                int(&mut p, n);
            }
            p.push(b't');
        }
        p.push(0x89); // NEWFALSE: requires_grad
        global(&mut p, "collections", "OrderedDict");
        p.push(b')'); // EMPTY_TUPLE
        p.push(b'R'); // REDUCE: backward hooks
        p.push(b't'); // TUPLE
        p.push(b'R'); // REDUCE: the tensor
        p.push(b'u'); // SETITEMS
    }
    p.push(b'.'); // STOP
    p
}

fn unicode(p: &mut Vec<u8>, s: &str) {
    p.push(b'X'); // BINUNICODE
    p.extend_from_slice(&(s.len() as u32).to_le_bytes());
    p.extend_from_slice(s.as_bytes());
}

fn global(p: &mut Vec<u8>, module: &str, name: &str) {
    p.push(b'c'); // GLOBAL
    p.extend_from_slice(module.as_bytes());
    p.push(b'\n');
    p.extend_from_slice(name.as_bytes());
    p.push(b'\n');
}

fn int(p: &mut Vec<u8>, n: usize) {
    if n < (1 << 31) {
        p.push(b'J'); // BININT
        p.extend_from_slice(&(n as i32).to_le_bytes());
    } else {
        p.push(0x8a); // LONG1
        p.push(8);
        p.extend_from_slice(&(n as i64).to_le_bytes());
    }
}

/// A Meta checkpoint (`consolidated.00.pth`, with `params.json` beside it) as an HF Llama model:
/// its config, and its tensors under HF names with the q/k rows in HF's rotary layout.
///
/// Meta's q/k rows hold each head's rotary pairs interleaved (`[x0, x1]` = one complex number);
/// transformers' Llama rotates halves, so its converter permutes the rows of every head from
/// `[pairs, 2]` to `[2, pairs]`, and so do we. Meta's `params.json` has no rope scaling factor:
/// Llama 3.1/3.3 use 8 and Llama 3.2 (the 1B/3B models, the only ones with the output tied to the
/// embeddings) 32, as transformers' configs and torchtune's builders do; `rope_scaling_factor` in
/// `params.json` wins when present. The tensors are read in `dtype`, or as stored when `None`.
pub fn read_meta(
    file: &Path,
    dtype: Option<DType>,
    device: &Device,
) -> Result<(ModelConfig, HashMap<String, Tensor>), ModelError> {
    let dir = file.parent().unwrap_or(Path::new("."));
    let params_path = dir.join("params.json");
    let text = std::fs::read_to_string(&params_path)
        .map_err(|e| ModelError::file(&params_path, format!("cannot read: {e}")))?;
    let params: Value = serde_json::from_str(&text)
        .map_err(|e| ModelError::file(&params_path, format!("invalid JSON: {e}")))?;
    let perr = |msg: String| ModelError::file(&params_path, msg);
    let int = |key: &str| -> Result<Option<usize>, ModelError> {
        match params.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| perr(format!("'{key}' must be a positive integer, got {v}"))),
        }
    };
    let float = |key: &str| -> Result<Option<f64>, ModelError> {
        match params.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| perr(format!("'{key}' must be a number, got {v}"))),
        }
    };
    let dim = int("dim")?.ok_or_else(|| perr("missing 'dim'".into()))?;
    let n_layers = int("n_layers")?.ok_or_else(|| perr("missing 'n_layers'".into()))?;
    let n_heads = int("n_heads")?.ok_or_else(|| perr("missing 'n_heads'".into()))?;
    let n_kv_heads = int("n_kv_heads")?.unwrap_or(n_heads);
    if n_heads == 0 || dim % n_heads != 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
        return Err(perr(format!(
            "dim {dim}, n_heads {n_heads}, n_kv_heads {n_kv_heads} do not split into heads"
        )));
    }
    let head_dim = dim / n_heads;
    let norm_eps = float("norm_eps")?.unwrap_or(1e-5);
    let rope_theta = float("rope_theta")?.unwrap_or(10000.0);
    let scaled_rope = params
        .get("use_scaled_rope")
        .and_then(Value::as_bool)
        .unwrap_or(false);

    let stored = read_torch_file(file)?;
    let find = |name: &str| stored.iter().find(|(n, _)| n == name).map(|(_, t)| t);
    let stored_dtype = find("tok_embeddings.weight").map(|t| t.dtype);
    // Tied when the head is absent or holds the embedding's bytes (compared as stored: no
    // full-size comparison tensors for a 128k-token vocabulary).
    let tied = match (find("output.weight"), find("tok_embeddings.weight")) {
        (None, _) => true,
        (Some(out), Some(embed)) => out == embed,
        (Some(_), None) => false,
    };
    let mut raw = HashMap::with_capacity(stored.len());
    for (name, t) in stored {
        let t = t.to_weight(file, &name, dtype, device)?;
        raw.insert(name, t);
    }
    let mut tensors = HashMap::with_capacity(raw.len());
    let mut output = None;
    for (name, t) in raw {
        if name == "rope.freqs" {
            // Llama 2's precomputed rotary frequencies: derived from rope_theta, not a weight.
            continue;
        }
        if name == "output.weight" {
            output = Some(t);
            continue;
        }
        let hf = meta_to_hf_name(&name).ok_or_else(|| {
            ModelError::file(
                file,
                format!("unexpected tensor '{name}' for a Meta Llama checkpoint"),
            )
        })?;
        let t = if name.ends_with("attention.wq.weight") {
            unpermute_rotary(&t, n_heads, head_dim, dim)
        } else if name.ends_with("attention.wk.weight") {
            unpermute_rotary(&t, n_kv_heads, head_dim, dim)
        } else {
            Ok(t)
        }
        .map_err(|e| ModelError::file(file, format!("tensor '{name}': {e}")))?;
        tensors.insert(hf, t);
    }
    let embed = tensors
        .get("model.embed_tokens.weight")
        .ok_or_else(|| ModelError::file(file, "missing tensor 'tok_embeddings.weight'"))?;
    let vocab = embed.dim(0)?;
    if let (Some(out), false) = (output, tied) {
        tensors.insert("lm_head.weight".into(), out);
    }
    let intermediate = tensors
        .get("model.layers.0.mlp.gate_proj.weight")
        .ok_or_else(|| ModelError::file(file, "missing tensor 'layers.0.feed_forward.w1.weight'"))?
        .dim(0)?;
    let rope_scaling = if scaled_rope {
        let factor = float("rope_scaling_factor")?.unwrap_or(if tied { 32.0 } else { 8.0 });
        json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        })
    } else {
        Value::Null
    };
    // Meta's files carry no context length: Llama 3.1+ (scaled rope) 131072, Llama 3 8192,
    // Llama 2 4096, as their HF configs say.
    let max_positions = if scaled_rope {
        131072
    } else if rope_theta >= 500000.0 {
        8192
    } else {
        4096
    };
    let stored = match stored_dtype {
        Some(TorchDType::BF16) => "bfloat16",
        Some(TorchDType::F16) => "float16",
        _ => "float32",
    };
    let (_, llama) = crate::family::model_type(crate::family::llama::META_FORMAT)
        .expect("the Llama family is registered");
    let config = json!({
        "architectures": [llama.causal_lm],
        "model_type": llama.name,
        "hidden_size": dim,
        "intermediate_size": intermediate,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": stored,
    });
    let config = ModelConfig::from_hf_json(&config).map_err(perr)?;
    // Before counting layer by layer: a billion promised layers would take minutes.
    let held =
        crate::config::layers::layers_held(tensors.keys().map(String::as_str), "model.layers.");
    crate::config::layers::check_layers_held(n_layers, held, "params.json's n_layers")
        .map_err(|m| ModelError::file(file, m))?;
    let present = (0..n_layers)
        .filter(|i| tensors.contains_key(&format!("model.layers.{i}.input_layernorm.weight")))
        .count();
    if present != n_layers {
        return Err(ModelError::file(
            file,
            format!("params.json says {n_layers} layers, the checkpoint holds {present}"),
        ));
    }
    Ok((config, tensors))
}

/// Meta's Llama tensor names in HF's form.
fn meta_to_hf_name(name: &str) -> Option<String> {
    match name {
        "tok_embeddings.weight" => return Some("model.embed_tokens.weight".into()),
        "norm.weight" => return Some("model.norm.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let hf = match tail {
        "attention.wq.weight" => "self_attn.q_proj.weight",
        "attention.wk.weight" => "self_attn.k_proj.weight",
        "attention.wv.weight" => "self_attn.v_proj.weight",
        "attention.wo.weight" => "self_attn.o_proj.weight",
        "feed_forward.w1.weight" => "mlp.gate_proj.weight",
        "feed_forward.w2.weight" => "mlp.down_proj.weight",
        "feed_forward.w3.weight" => "mlp.up_proj.weight",
        "attention_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// HF Llama tensors (as [`read_meta`] returns them) under Meta's names, in the order Meta's
/// model holds them, with the q/k rows back in Meta's interleaved rotary layout: what torchtune's
/// `FullModelMetaCheckpointer` saves. A tied head is written as `output.weight` holding the
/// embedding (the same tensor, so one storage in the file), as torchtune saves Llama 3.2.
pub fn hf_to_meta(
    config: &ModelConfig,
    tensors: &HashMap<String, Tensor>,
) -> Result<Vec<(String, Tensor)>, String> {
    const LAYER: &[(&str, &str)] = &[
        ("attention.wq.weight", "self_attn.q_proj.weight"),
        ("attention.wk.weight", "self_attn.k_proj.weight"),
        ("attention.wv.weight", "self_attn.v_proj.weight"),
        ("attention.wo.weight", "self_attn.o_proj.weight"),
        ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
        ("feed_forward.w2.weight", "mlp.down_proj.weight"),
        ("feed_forward.w3.weight", "mlp.up_proj.weight"),
        ("attention_norm.weight", "input_layernorm.weight"),
        ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ];
    if config.model_type != crate::family::llama::META_FORMAT {
        return Err(format!(
            "Meta's checkpoint format holds Llama models; this one is '{}'",
            config.model_type
        ));
    }
    let take = |hf: &str| {
        tensors
            .get(hf)
            .cloned()
            .ok_or_else(|| format!("missing tensor '{hf}'"))
    };
    let embed = take("model.embed_tokens.weight")?;
    let mut out = vec![("tok_embeddings.weight".to_string(), embed.clone())];
    let (heads, kv, head_dim) = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    );
    for layer in 0..config.num_hidden_layers {
        for (meta, hf) in LAYER {
            let hf = format!("model.layers.{layer}.{hf}");
            let t = take(&hf)?;
            let t = match *meta {
                "attention.wq.weight" => permute_rotary_to_pairs(&t, heads, head_dim),
                "attention.wk.weight" => permute_rotary_to_pairs(&t, kv, head_dim),
                _ => Ok(t),
            }
            .map_err(|e| format!("tensor '{hf}': {e}"))?;
            out.push((format!("layers.{layer}.{meta}"), t));
        }
    }
    out.push(("norm.weight".to_string(), take("model.norm.weight")?));
    let head = match tensors.get("lm_head.weight") {
        Some(t) => t.clone(),
        None if config.tie_word_embeddings => embed,
        None => return Err("missing tensor 'lm_head.weight'".into()),
    };
    out.push(("output.weight".to_string(), head));
    // Anything else (biases, extra layers) would be dropped silently: refuse instead.
    let placed = out.len() - 1 + usize::from(tensors.contains_key("lm_head.weight"));
    if tensors.len() != placed {
        let mut names: Vec<&String> = tensors.keys().collect();
        names.sort();
        let placed_name = |n: &str| {
            [
                "model.embed_tokens.weight",
                "model.norm.weight",
                "lm_head.weight",
            ]
            .contains(&n)
                || n.strip_prefix("model.layers.")
                    .and_then(|r| r.split_once('.'))
                    .is_some_and(|(layer, tail)| {
                        layer
                            .parse::<usize>()
                            .is_ok_and(|l| l < config.num_hidden_layers)
                            && LAYER.iter().any(|(_, hf)| *hf == tail)
                    })
        };
        let extra = names.into_iter().find(|n| !placed_name(n));
        return Err(format!(
            "tensor '{}' has no place in Meta's Llama format",
            extra.map_or("?", |n| n.as_str())
        ));
    }
    Ok(out)
}

/// Rows `[heads, pairs, 2, dim]` (Meta's and torchtune's interleaved rotary pairs) to
/// `[heads, 2, pairs, dim]` (HF's halves).
pub fn unpermute_rotary(
    t: &Tensor,
    heads: usize,
    head_dim: usize,
    dim: usize,
) -> candle_core::Result<Tensor> {
    if t.dims() != [heads * head_dim, dim] {
        candle_core::bail!(
            "shape {:?}, expected [{}, {dim}] ({heads} heads of {head_dim})",
            t.dims(),
            heads * head_dim
        );
    }
    t.reshape((heads, head_dim / 2, 2, dim))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((heads * head_dim, dim))
}

/// HF's q/k rows (`[heads, 2, pairs, in]`: rotary halves) in Meta's and torchtune's layout
/// (`[heads, pairs, 2, in]`: interleaved pairs); the inverse of the permutation Meta checkpoints
/// are read with.
pub fn permute_rotary_to_pairs(
    t: &Tensor,
    heads: usize,
    head_dim: usize,
) -> candle_core::Result<Tensor> {
    let (rows, cols) = t.dims2()?;
    if rows != heads * head_dim {
        candle_core::bail!("{rows} rows, expected {heads} heads of {head_dim}");
    }
    t.reshape((heads, 2, head_dim / 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))
}

#[cfg(test)]
mod tests;
