//! Loading llama.cpp GGUF files (v2/v3) as HF-style checkpoints.
//!
//! The metadata becomes a [`ModelConfig`] (through a config.json-shaped object, so it can be saved
//! as one), and every tensor is dequantized and renamed as in HF checkpoints, undoing what
//! llama.cpp's `convert_hf_to_gguf.py` changed on the way in, as transformers' own GGUF loader
//! (`modeling_gguf_pytorch_utils.py`) does:
//!
//! - GGUF dimensions are stored innermost first; tensors come out in PyTorch order (`[out, in]`).
//! - llama (and Mistral, which llama.cpp writes as `llama`) query/key rows are permuted for
//!   llama.cpp's interleaved RoPE; they are permuted back.
//! - Gemma norm weights were stored as `1 + w`; the 1 is subtracted again.
//! - Mixture-of-experts tensors stacked over experts (`ffn_gate_exps`, ...) are split into
//!   transformers' per-expert tensors; Phi-2's fused `attn_qkv` (older files) into q, k and v.
//!
//! Beyond transformers (whose GGUF loader leaves these out), rotary scaling is recovered too:
//! `rope.scaling.*` keys (linear, YaRN), Phi-3 LongRoPE factors stored as tensors, and Llama 3.x
//! frequency scaling when the `rope_freqs` tensor matches it.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value as GgufValue};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use ferrotune_core::quant::QuantizedMatrix;
use serde_json::{json, Map, Value};

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::family;
use crate::family::gguf::{
    GgufHParams, GgufMetadata, GgufNames, GgufNaming, GgufReading, GgufRopeTensors,
};

/// Loads a llama.cpp GGUF (v2/v3) model: config from metadata, tensors dequantized to `dtype` on `device`, named as in HF checkpoints.
///
/// Supported architectures: `llama` (and Mistral, Mixtral), `qwen2`, `qwen2moe`, `qwen3`,
/// `qwen3moe`, `gemma`, `gemma2`, `gemma3`, `phi2`, `phi3`, `smollm3`; tensor
/// types F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K to Q6_K. Every problem with the
/// file (missing, not a GGUF, truncated, unsupported type, missing metadata, tensor shapes that
/// disagree with the metadata) is a [`ModelError::File`] naming the file and what is wrong.
pub fn load_gguf(
    path: &Path,
    dtype: DType,
    device: &Device,
) -> Result<(ModelConfig, HashMap<String, Tensor>), ModelError> {
    let (config, tensors, _) = read_gguf(path, dtype, device, false)?;
    Ok((config, tensors))
}

/// Matrix weights (HF names) kept in their GGUF block format, for fast inference.
pub type PackedWeights = HashMap<String, QuantizedMatrix>;

/// As [`load_gguf`], and also keeps every quantized matrix weight (projections, output head and —
/// it serves as the head when tied — the embedding) in its block format. The packed copies hold
/// exactly the dequantized values; the decoder uses them when reading 4–8-bit blocks instead of
/// f32 is what bounds speed (decoding).
pub fn load_gguf_with_packed(
    path: &Path,
    dtype: DType,
    device: &Device,
) -> Result<(ModelConfig, HashMap<String, Tensor>, PackedWeights), ModelError> {
    read_gguf(path, dtype, device, true)
}

fn read_gguf(
    path: &Path,
    dtype: DType,
    device: &Device,
    keep_packed: bool,
) -> Result<(ModelConfig, HashMap<String, Tensor>, PackedWeights), ModelError> {
    let mut gguf = GgufFile::open(path)?;
    let arch = Arch::from_metadata(&gguf)?;
    let hp = HParams::read(&gguf, &arch)?;
    let config_json = gguf.config_json(&arch, &hp, dtype)?;
    let config = ModelConfig::from_hf_json(&config_json)
        .map_err(|msg| gguf.err(format!("the metadata gives an invalid model config: {msg}")))?;

    // Decide every tensor's fate (and check its type, shape and place in the file) before
    // dequantizing anything, so that a bad file fails fast.
    let mut plan = Vec::new();
    let mut names: Vec<&String> = gguf.content.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let Some(role) = Role::parse(name) else {
            if !CONSUMED_TENSORS.contains(&name.as_str()) {
                tracing::warn!(
                    "{}: ignoring GGUF tensor '{name}' (no HF counterpart)",
                    path.display()
                );
            }
            continue;
        };
        let expected = role
            .expected_shape(&hp, &arch)
            .map_err(|msg| gguf.tensor_err(name, msg))?;
        let info = &gguf.content.tensor_infos[name];
        // Qwen2-MoE's shared-expert gate may be stored as `[1, hidden]` as well as `[hidden]`.
        let row_vector = role.kind == Kind::SharedRouter && info.shape.dims() == [1, hp.hidden];
        if info.shape.dims() != expected.as_slice() && !row_vector {
            return Err(gguf.tensor_err(
                name,
                format!(
                    "has shape {:?} but the metadata implies {:?} (PyTorch order)",
                    info.shape.dims(),
                    expected
                ),
            ));
        }
        gguf.check_tensor_data(name)?;
        plan.push((name.clone(), role));
    }

    let mut tensors = HashMap::with_capacity(plan.len());
    let mut packed = PackedWeights::new();
    for (name, role) in plan {
        let q = gguf.read_qtensor(&name)?;
        let parts = role.hf_parts(&arch, &hp);
        if keep_packed && device.is_cpu() && role.is_stacked() {
            // Each expert's rows are contiguous blocks of the stacked tensor.
            if let Ok(data) = q.data() {
                let per_expert = data.len() / hp.experts;
                let row_bytes = per_expert / q.shape().dims()[1];
                for part in &parts {
                    let start = part.index.unwrap_or(0) * per_expert + part.start * row_bytes;
                    let bytes = data[start..start + part.len * row_bytes].to_vec();
                    let cols = q.shape().dims()[2];
                    if let Ok(m) =
                        QuantizedMatrix::from_ggml_bytes(q.dtype(), part.len, cols, bytes)
                    {
                        packed.insert(part.name.clone(), m);
                    }
                }
            }
        }
        // Block types the fused kernel does not cover (and F32/F16) stay dense only.
        let kernel = (keep_packed && device.is_cpu() && role.is_matrix() && parts.len() == 1)
            .then(|| QuantizedMatrix::from_qtensor(&q).ok())
            .flatten();
        if let Some(mut m) = kernel {
            if arch.permuted_qk {
                let heads = match role.kind {
                    Kind::Q => Some(hp.heads),
                    Kind::K => Some(hp.kv_heads),
                    _ => None,
                };
                if let Some(heads) = heads {
                    let order = unpermuted_row_order(m.rows(), heads)
                        .map_err(|msg| gguf.tensor_err(&name, msg))?;
                    m = m
                        .with_row_order(order)
                        .map_err(|e| gguf.tensor_err(&name, e))?;
                }
            }
            packed.insert(parts[0].name.clone(), m);
        }
        let mut t = gguf.dequantize_blocks(&name, &q)?;
        if arch.permuted_qk {
            // convert_hf_to_gguf.py permutes q with n_head and k with n_head_kv.
            match role.kind {
                Kind::Q => {
                    t = unpermute_rows(&t, hp.heads).map_err(|m| gguf.tensor_err(&name, m))?
                }
                Kind::K => {
                    t = unpermute_rows(&t, hp.kv_heads).map_err(|m| gguf.tensor_err(&name, m))?
                }
                _ => {}
            }
        }
        let finish = |t: Tensor| -> candle_core::Result<Tensor> {
            let t = if arch.norm_plus_one && name.ends_with("norm.weight") {
                (t - 1.0)?
            } else {
                t
            };
            t.to_dtype(dtype)?.to_device(device)
        };
        let t = finish(t).map_err(|e| {
            gguf.tensor_err(
                &name,
                format!("cannot be converted to {dtype:?} on {device:?}: {e}"),
            )
        })?;
        if let [whole] = parts.as_slice() {
            let t = if role.kind == Kind::SharedRouter {
                // transformers' `shared_expert_gate` is a `[1, hidden]` linear layer.
                t.reshape((1, hp.hidden))
                    .map_err(|e| gguf.tensor_err(&name, e))?
            } else {
                t
            };
            tensors.insert(whole.name.clone(), t);
            continue;
        }
        for part in parts {
            let piece = match part.index {
                Some(e) => t.get(e),
                None => Ok(t.clone()),
            }
            .and_then(|p| p.narrow(0, part.start, part.len))
            .map_err(|e| gguf.tensor_err(&name, format!("cannot be split: {e}")))?;
            tensors.insert(part.name, piece);
        }
    }
    Ok((config, tensors, packed))
}

/// One HF tensor cut from a GGUF tensor (see [`Role::hf_parts`]).
struct HfPart {
    name: String,
    /// The expert (first dimension) of a stacked tensor.
    index: Option<usize>,
    /// Rows `start .. start + len` of it (`len` 0 with a single part: the whole tensor).
    start: usize,
    len: usize,
}

/// Tensors that feed the config (rotary factors) rather than the model.
const CONSUMED_TENSORS: &[&str] = &[
    "rope_freqs.weight",
    "rope_factors_long.weight",
    "rope_factors_short.weight",
];

/// ggml type ids and names (ggml.h), for messages about types we cannot read.
const GGML_TYPE_NAMES: &[(u32, &str)] = &[
    (0, "F32"),
    (1, "F16"),
    (2, "Q4_0"),
    (3, "Q4_1"),
    (6, "Q5_0"),
    (7, "Q5_1"),
    (8, "Q8_0"),
    (9, "Q8_1"),
    (10, "Q2_K"),
    (11, "Q3_K"),
    (12, "Q4_K"),
    (13, "Q5_K"),
    (14, "Q6_K"),
    (15, "Q8_K"),
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (20, "IQ4_NL"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (23, "IQ4_XS"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (30, "BF16"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (39, "MXFP4"),
    (40, "NVFP4"),
];

const SUPPORTED_TYPES: &str =
    "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K";

fn ggml_type_name(id: u32) -> String {
    GGML_TYPE_NAMES.iter().find(|(i, _)| *i == id).map_or_else(
        || format!("unknown type {id}"),
        |(_, n)| format!("{n} (ggml type {id})"),
    )
}

/// An open GGUF file with its parsed header.
struct GgufFile<'a> {
    path: &'a Path,
    reader: BufReader<File>,
    len: u64,
    content: Content,
}

/// What a family's [`GgufReading`] reads of the file.
impl GgufMetadata for GgufFile<'_> {
    fn arch(&self) -> &str {
        match self.meta("general.architecture") {
            Some(GgufValue::String(s)) => s,
            _ => "",
        }
    }

    fn uint(&self, key: &str) -> Result<Option<u64>, ModelError> {
        GgufFile::uint(self, key)
    }

    fn float(&self, key: &str) -> Result<Option<f64>, ModelError> {
        GgufFile::float(self, key)
    }

    fn flag(&self, key: &str) -> Option<bool> {
        match self.meta(key) {
            Some(GgufValue::Bool(b)) => Some(*b),
            _ => None,
        }
    }

    fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }
}

impl<'a> GgufFile<'a> {
    fn open(path: &'a Path) -> Result<Self, ModelError> {
        let err = |msg: String| ModelError::file(path, msg);
        let mut file = File::open(path).map_err(|e| err(format!("cannot open GGUF file: {e}")))?;
        let len = file
            .metadata()
            .map_err(|e| err(format!("cannot read GGUF file: {e}")))?
            .len();
        let mut head = [0u8; 8];
        let got = read_up_to(&mut file, &mut head)
            .map_err(|e| err(format!("cannot read GGUF file: {e}")))?;
        if got == 0 {
            return Err(err("not a GGUF file: the file is empty".into()));
        }
        if got < 4 || &head[..4] != b"GGUF" {
            return Err(err(format!(
                "not a GGUF file: it starts with {:02x?} instead of the magic \"GGUF\"",
                &head[..got.min(4)]
            )));
        }
        if got < 8 {
            return Err(err(
                "the GGUF file is truncated: it ends inside the header".into()
            ));
        }
        let version = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        match version {
            2 | 3 => {}
            1 => {
                return Err(err(
                    "GGUF version 1 is not supported (only v2 and v3): re-convert the model".into(),
                ))
            }
            v if matches!(v.swap_bytes(), 2 | 3) => {
                return Err(err("big-endian GGUF files are not supported".into()));
            }
            v => {
                return Err(err(format!(
                    "unsupported GGUF version {v} (only v2 and v3)"
                )))
            }
        }
        file.seek(SeekFrom::Start(0))
            .map_err(|e| err(format!("cannot read GGUF file: {e}")))?;
        let mut reader = BufReader::new(file);
        // candle's header reader bounds every length by the file size, but divides by
        // `general.alignment` unchecked: a corrupt file with alignment 0 would panic. That is the one
        // panic we know of; catching it (the last resort) keeps a bad file an error, not a crash.
        let read =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Content::read(&mut reader)));
        let content = match read {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(err(header_error_message(&e.to_string()))),
            Err(_) => {
                return Err(err(
                    "corrupt GGUF header (e.g. general.alignment is 0)".into()
                ))
            }
        };
        if let Some(v) = content.metadata.get("general.alignment") {
            if !matches!(v, GgufValue::U32(a) if *a > 0) {
                return Err(err(format!(
                    "corrupt GGUF header: general.alignment is {v:?}"
                )));
            }
        }
        Ok(Self {
            path,
            reader,
            len,
            content,
        })
    }

    fn err(&self, msg: impl Into<String>) -> ModelError {
        ModelError::file(self.path, msg)
    }

    fn tensor_err(&self, name: &str, msg: impl std::fmt::Display) -> ModelError {
        self.err(format!("tensor '{name}' {msg}"))
    }

    fn meta(&self, key: &str) -> Option<&GgufValue> {
        self.content.metadata.get(key)
    }

    fn uint(&self, key: &str) -> Result<Option<u64>, ModelError> {
        let Some(v) = self.meta(key) else {
            return Ok(None);
        };
        let n = match *v {
            GgufValue::U8(n) => Some(n as u64),
            GgufValue::U16(n) => Some(n as u64),
            GgufValue::U32(n) => Some(n as u64),
            GgufValue::U64(n) => Some(n),
            GgufValue::I8(n) => u64::try_from(n).ok(),
            GgufValue::I16(n) => u64::try_from(n).ok(),
            GgufValue::I32(n) => u64::try_from(n).ok(),
            GgufValue::I64(n) => u64::try_from(n).ok(),
            _ => None,
        };
        match n {
            Some(n) => Ok(Some(n)),
            None => Err(self.err(format!(
                "metadata key '{key}' must be a non-negative integer, found {}",
                show(v)
            ))),
        }
    }

    fn req_uint(&self, key: &str) -> Result<u64, ModelError> {
        self.uint(key)?
            .ok_or_else(|| self.err(format!("missing metadata key '{key}'")))
    }

    /// A count that must be positive and usable as a tensor dimension.
    fn req_count(&self, key: &str) -> Result<usize, ModelError> {
        let n = self.req_uint(key)?;
        if n == 0 || n > (1 << 32) {
            return Err(self.err(format!(
                "metadata key '{key}' has the implausible value {n}"
            )));
        }
        Ok(n as usize)
    }

    fn float(&self, key: &str) -> Result<Option<f64>, ModelError> {
        let Some(v) = self.meta(key) else {
            return Ok(None);
        };
        // f32 values widen exactly, as in transformers (1e-5 stored as f32 reads 9.999999747378752e-06).
        let x = match *v {
            GgufValue::F32(x) => x as f64,
            GgufValue::F64(x) => x,
            _ => match self.uint(key) {
                Ok(Some(n)) => n as f64,
                _ => {
                    return Err(self.err(format!(
                        "metadata key '{key}' must be a number, found {}",
                        show(v)
                    )))
                }
            },
        };
        if !x.is_finite() {
            return Err(self.err(format!("metadata key '{key}' is not finite ({x})")));
        }
        Ok(Some(x))
    }

    fn string(&self, key: &str) -> Result<Option<&str>, ModelError> {
        match self.meta(key) {
            None => Ok(None),
            Some(GgufValue::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.err(format!(
                "metadata key '{key}' must be a string, found {}",
                show(v)
            ))),
        }
    }

    fn token_id(&self, key: &str) -> Result<Option<u32>, ModelError> {
        match self.uint(key)? {
            None => Ok(None),
            Some(n) => u32::try_from(n)
                .map(Some)
                .map_err(|_| self.err(format!("metadata key '{key}' is not a token id ({n})"))),
        }
    }

    /// Checks that a tensor's type is one we dequantize and that its bytes lie inside the file.
    fn check_tensor_data(&self, name: &str) -> Result<(), ModelError> {
        let info = &self.content.tensor_infos[name];
        let t = info.ggml_dtype;
        if matches!(t, GgmlDType::Q8_1 | GgmlDType::Q8K) {
            return Err(self.tensor_err(
                name,
                format!("has type {t:?}, which ferrotune cannot dequantize (supported: {SUPPORTED_TYPES})"),
            ));
        }
        let dims = info.shape.dims();
        let elems = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        let inner = dims.last().copied().unwrap_or(1);
        let bytes = elems
            .filter(|_| inner % t.block_size() == 0)
            .and_then(|n| (n / t.block_size()).checked_mul(t.type_size()));
        let Some(bytes) = bytes else {
            return Err(self.tensor_err(
                name,
                format!(
                    "has shape {dims:?}, impossible for type {t:?} (blocks of {})",
                    t.block_size()
                ),
            ));
        };
        let start = self.content.tensor_data_offset.checked_add(info.offset);
        let end = start.and_then(|s| s.checked_add(bytes as u64));
        match (start, end) {
            (Some(_), Some(end)) if end <= self.len => Ok(()),
            (start, _) => Err(self.err(format!(
                "the GGUF file is truncated: tensor '{name}' needs {bytes} bytes at offset {} but the file has {} bytes",
                start.map_or_else(|| "(overflow)".to_string(), |s| s.to_string()),
                self.len
            ))),
        }
    }

    /// Reads a tensor's blocks (CPU), in PyTorch dimension order.
    fn read_qtensor(&mut self, name: &str) -> Result<QTensor, ModelError> {
        self.content
            .tensor(&mut self.reader, name, &Device::Cpu)
            .map_err(|e| ModelError::file(self.path, format!("cannot read tensor '{name}': {e}")))
    }

    /// Dequantizes a tensor's blocks to f32 on the CPU.
    fn dequantize_blocks(&self, name: &str, q: &QTensor) -> Result<Tensor, ModelError> {
        q.dequantize(&Device::Cpu).map_err(|e| {
            ModelError::file(self.path, format!("cannot dequantize tensor '{name}': {e}"))
        })
    }

    /// Reads and dequantizes a tensor to f32 on the CPU, in PyTorch dimension order.
    fn dequantize(&mut self, name: &str) -> Result<Tensor, ModelError> {
        let q = self.read_qtensor(name)?;
        self.dequantize_blocks(name, &q)
    }

    /// A small F32 vector tensor (rotary factors), if present.
    fn small_vector(&mut self, name: &str) -> Result<Option<Vec<f32>>, ModelError> {
        let Some(info) = self.content.tensor_infos.get(name) else {
            return Ok(None);
        };
        if info.shape.rank() != 1 || info.shape.elem_count() > 1 << 20 {
            return Err(self.tensor_err(
                name,
                format!("should be a vector, found shape {:?}", info.shape.dims()),
            ));
        }
        self.check_tensor_data(name)?;
        let v = self
            .dequantize(name)?
            .to_vec1::<f32>()
            .map_err(|e| self.tensor_err(name, e))?;
        Ok(Some(v))
    }

    /// Builds an HF `config.json`-shaped object from the metadata.
    fn config_json(
        &mut self,
        arch: &Arch,
        hp: &HParams,
        dtype: DType,
    ) -> Result<Value, ModelError> {
        let a = &arch.gguf;
        let mut c = Map::new();
        c.insert("architectures".into(), json!([arch.hf_class]));
        c.insert("model_type".into(), json!(arch.model_type));
        c.insert("vocab_size".into(), json!(hp.vocab));
        c.insert("hidden_size".into(), json!(hp.hidden));
        c.insert("intermediate_size".into(), json!(hp.ffn));
        c.insert("num_hidden_layers".into(), json!(hp.layers));
        c.insert("num_attention_heads".into(), json!(hp.heads));
        c.insert("num_key_value_heads".into(), json!(hp.kv_heads));
        c.insert("head_dim".into(), json!(hp.head_dim));
        c.insert("max_position_embeddings".into(), json!(hp.context));
        c.insert("rms_norm_eps".into(), json!(hp.rms_eps));
        c.insert("rope_theta".into(), json!(hp.rope_theta));
        if hp.rope_dims != hp.head_dim {
            if !arch.reading.partial_rotary {
                return Err(self.err(format!(
                    "{a}.rope.dimension_count is {} but the head dimension is {}: partial rotary embeddings are only supported for phi2 and phi3",
                    hp.rope_dims, hp.head_dim
                )));
            }
            c.insert(
                "partial_rotary_factor".into(),
                json!(hp.rope_dims as f64 / hp.head_dim as f64),
            );
        }
        if let Some(scaling) = self.rope_scaling(arch, hp)? {
            c.insert("rope_scaling".into(), scaling);
        }
        for (key, act) in arch.reading.activation {
            c.insert((*key).into(), json!(act));
        }
        // As transformers decides: tied exactly when there is no separate output matrix.
        let tied = !self.content.tensor_infos.contains_key("output.weight");
        c.insert("tie_word_embeddings".into(), json!(tied));
        (arch.reading.config_keys)(&*self, hp, &mut c)?;
        for (gguf_key, hf_key) in [
            ("tokenizer.ggml.bos_token_id", "bos_token_id"),
            ("tokenizer.ggml.eos_token_id", "eos_token_id"),
            ("tokenizer.ggml.padding_token_id", "pad_token_id"),
        ] {
            if let Some(id) = self.token_id(gguf_key)? {
                c.insert(hf_key.into(), json!(id));
            }
        }
        let dtype_name = match dtype {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F64 => "float64",
            _ => "float32",
        };
        c.insert("torch_dtype".into(), json!(dtype_name));
        if let Some(name) = self.string("general.name")? {
            c.insert("_name_or_path".into(), json!(name));
        }
        Ok(Value::Object(c))
    }

    /// The HF `rope_scaling` object, from `{arch}.rope.scaling.*` keys or the rotary-factor tensors.
    fn rope_scaling(&mut self, arch: &Arch, hp: &HParams) -> Result<Option<Value>, ModelError> {
        let a = arch.gguf.clone();
        let key = |k: &str| format!("{a}.rope.scaling.{k}");
        let factor = self.float(&key("factor"))?;
        let original = self.uint(&key("original_context_length"))?;
        let kind = match self.string(&key("type"))? {
            Some(t) => Some(t.to_ascii_lowercase()),
            // Older files: `{arch}.rope.scale_linear`.
            None => self
                .float(&format!("{a}.rope.scale_linear"))?
                .filter(|f| *f != 1.0)
                .map(|_| "linear".into()),
        };
        let need_factor = |this: &Self| {
            factor
                .or(this.float(&format!("{a}.rope.scale_linear")).ok().flatten())
                .ok_or_else(|| this.err(format!("missing metadata key '{}'", key("factor"))))
        };
        match kind.as_deref() {
            Some("linear") => {
                return Ok(Some(
                    json!({"rope_type": "linear", "factor": need_factor(self)?}),
                ))
            }
            Some("yarn") => {
                let mut m = Map::new();
                m.insert("rope_type".into(), json!("yarn"));
                m.insert("factor".into(), json!(need_factor(self)?));
                m.insert(
                    "original_max_position_embeddings".into(),
                    json!(original.unwrap_or(hp.context as u64)),
                );
                for (k, hf) in [
                    ("yarn_beta_fast", "beta_fast"),
                    ("yarn_beta_slow", "beta_slow"),
                ] {
                    if let Some(x) = self.float(&key(k))? {
                        m.insert(hf.into(), json!(x));
                    }
                }
                return Ok(Some(Value::Object(m)));
            }
            Some("none") | None => {}
            Some("longrope") | Some("su") => {}
            Some(other) => {
                return Err(self.err(format!(
                "unsupported rope scaling type '{other}' ({}): supported are none, linear, yarn",
                key("type")
            )))
            }
        }
        // Phi-3 LongRoPE: llama.cpp keeps the per-frequency factors as tensors.
        if arch.reading.rope_tensors == GgufRopeTensors::LongRopeFactors {
            let long = self.small_vector("rope_factors_long.weight")?;
            let short = self.small_vector("rope_factors_short.weight")?;
            if let (Some(long), Some(short)) = (long, short) {
                let half = hp.rope_dims / 2;
                if long.len() != half || short.len() != half {
                    return Err(self.err(format!(
                        "rope_factors_long/short have {} and {} entries but the rotary dimension {} needs {half}",
                        long.len(),
                        short.len(),
                        hp.rope_dims
                    )));
                }
                let orig = original.ok_or_else(|| {
                    self.err(format!(
                        "missing metadata key '{}'",
                        key("original_context_length")
                    ))
                })?;
                return Ok(Some(json!({
                    "rope_type": "longrope",
                    "long_factor": long.iter().map(|&x| x as f64).collect::<Vec<_>>(),
                    "short_factor": short.iter().map(|&x| x as f64).collect::<Vec<_>>(),
                    "original_max_position_embeddings": orig,
                })));
            }
        }
        // Llama 3.x: llama.cpp bakes the frequency scaling into a `rope_freqs` tensor.
        if arch.reading.rope_tensors == GgufRopeTensors::Llama3Freqs {
            if let Some(freqs) = self.small_vector("rope_freqs.weight")? {
                match fit_llama3(&freqs, hp.rope_theta, hp.rope_dims) {
                    Some(s) => return Ok(Some(s)),
                    None => tracing::warn!(
                        "{}: rope_freqs.weight does not match Llama 3 rotary scaling; it is ignored",
                        self.path.display()
                    ),
                }
            }
        }
        Ok(None)
    }
}

/// Recognises llama.cpp's `rope_freqs` factors for Llama 3.x rotary scaling (low 1, high 4,
/// original context 8192: every released Llama 3.1/3.2/3.3) and returns the HF `rope_scaling`.
fn fit_llama3(freqs: &[f32], base: f64, dims: usize) -> Option<Value> {
    if freqs.len() * 2 != dims || freqs.is_empty() {
        return None;
    }
    let max = freqs.iter().copied().fold(f32::MIN, f32::max) as f64;
    if max <= 1.0 {
        return None;
    }
    let factor = if (max - max.round()).abs() < 1e-4 {
        max.round()
    } else {
        max
    };
    let (low, high, orig) = (1.0f64, 4.0f64, 8192.0f64);
    let (low_wavelen, high_wavelen) = (orig / low, orig / high);
    let matches = freqs.iter().enumerate().all(|(i, &f)| {
        let inv_freq = 1.0 / base.powf((2 * i) as f64 / dims as f64);
        let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
        let expected = if wavelen < high_wavelen {
            1.0
        } else if wavelen > low_wavelen {
            factor
        } else {
            let smooth = (orig / wavelen - low) / (high - low);
            1.0 / ((1.0 - smooth) / factor + smooth)
        };
        (f as f64 - expected).abs() <= 1e-4 * expected.max(1.0)
    });
    matches.then(|| {
        json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": orig as u64})
    })
}

/// Reads as many bytes as are available, up to `buf.len()`.
fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Turns candle's header-reading errors into messages a user can act on.
fn header_error_message(candle_msg: &str) -> String {
    let first_line = candle_msg.lines().next().unwrap_or(candle_msg);
    if let Some(rest) = first_line.split("unknown dtype for tensor ").nth(1) {
        let id = rest
            .trim()
            .parse::<u32>()
            .map_or_else(|_| rest.trim().to_string(), ggml_type_name);
        return format!(
            "unsupported tensor type {id}: ferrotune dequantizes {SUPPORTED_TYPES}; convert the model to one of these"
        );
    }
    let truncated = first_line.contains("fill whole buffer")
        || first_line.contains("remaining")
        || first_line.contains("UnexpectedEof");
    if truncated {
        format!("the GGUF file is truncated or corrupt: its header ends early ({first_line})")
    } else {
        format!("corrupt GGUF header: {first_line}")
    }
}

fn show(v: &GgufValue) -> String {
    match v {
        GgufValue::Array(a) => format!("an array of {} values", a.len()),
        GgufValue::String(s) => format!("the string {s:?}"),
        v => format!("{v:?}"),
    }
}

/// Architecture-specific handling.
struct Arch {
    /// `general.architecture`, the prefix of the architecture's metadata keys.
    gguf: String,
    /// transformers' `model_type`.
    model_type: &'static str,
    /// How the model type's files read.
    reading: GgufReading,
    /// transformers' model class, for `architectures`.
    hf_class: &'static str,
    /// llama.cpp permuted q/k rows for its RoPE layout.
    permuted_qk: bool,
    /// llama.cpp stored norm weights as `1 + w`.
    norm_plus_one: bool,
}

impl Arch {
    fn from_metadata(g: &GgufFile) -> Result<Self, ModelError> {
        let gguf = g
            .string("general.architecture")?
            .ok_or_else(|| g.err("missing metadata key 'general.architecture'"))?
            .to_string();
        let name = g.string("general.name")?.unwrap_or("").to_ascii_lowercase();
        let experts = g.uint(&format!("{gguf}.expert_count"))?.unwrap_or(0);
        let Some(entry) = family::gguf_arch(&gguf) else {
            return Err(g.err(format!(
                "unsupported GGUF architecture '{gguf}': supported are {}",
                family::gguf_arch_names()
            )));
        };
        let model_type = entry.model_type_of(&name, experts);
        let (_, entry_type) = family::model_type(model_type)
            .expect("every GGUF architecture reads as a registered model_type");
        let hf_class = entry_type.causal_lm;
        let reading = entry_type.gguf_reading;
        // As transformers' TENSOR_PROCESSORS: the un-permutation keys on the GGUF architecture.
        let permuted_qk = entry.permuted_qk;
        let norm_plus_one = entry.norm_plus_one;
        Ok(Self {
            gguf,
            model_type,
            reading,
            hf_class,
            permuted_qk,
            norm_plus_one,
        })
    }
}

impl Arch {
    /// Gemma 2/3's four norms per layer.
    fn sandwich_norms(&self) -> bool {
        self.reading.sandwich_norms
    }

    /// A sparse mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE).
    fn is_moe(&self) -> bool {
        self.reading.moe.is_some()
    }

    /// Mixtral's expert names (`block_sparse_moe`, `w1`/`w3`/`w2`).
    fn mixtral_names(&self) -> bool {
        self.reading.moe.is_some_and(|m| m.mixtral_names)
    }

    /// What decides its tensors' HF names.
    fn naming(&self) -> GgufNaming {
        GgufNaming {
            names: self.reading.names,
            sandwich_norms: self.sandwich_norms(),
            mixtral_names: self.mixtral_names(),
        }
    }

    /// Phi-2's tensor names and LayerNorm.
    fn phi2(&self) -> bool {
        self.reading.names == GgufNames::Phi2
    }

    /// The HF module (under `model.layers.N`) of an expert's gate, up or down projection
    /// (`expert` = None: the router), in transformers 4.x's per-expert names, which is what Hub
    /// checkpoints hold and what PEFT adapters target.
    fn expert_module(&self, expert: Option<usize>, part: Kind) -> String {
        let mixtral = self.mixtral_names();
        let block = if mixtral { "block_sparse_moe" } else { "mlp" };
        let Some(e) = expert else {
            return format!("{block}.gate");
        };
        let proj = match (part, mixtral) {
            (Kind::Gate, true) => "w1",
            (Kind::Up, true) => "w3",
            (Kind::Down, true) => "w2",
            (Kind::Gate, false) => "gate_proj",
            (Kind::Up, false) => "up_proj",
            _ => "down_proj",
        };
        format!("{block}.experts.{e}.{proj}")
    }
}

/// The hyperparameters read from metadata.
type HParams = GgufHParams;

impl HParams {
    fn read(g: &GgufFile, arch: &Arch) -> Result<Self, ModelError> {
        let a = &arch.gguf;
        let k = |s: &str| format!("{a}.{s}");
        let experts = g.uint(&k("expert_count"))?.unwrap_or(0) as usize;
        if experts > 0 && !arch.is_moe() {
            return Err(g.err(format!(
                "mixture-of-experts models ({a}.expert_count = {experts}) are only supported for llama (Mixtral), qwen2moe and qwen3moe"
            )));
        }
        if arch.is_moe() && experts == 0 {
            return Err(g.err(format!("missing metadata key '{}'", k("expert_count"))));
        }
        let hidden = g.req_count(&k("embedding_length"))?;
        let layers = g.req_count(&k("block_count"))?;
        let ffn = g.req_count(&k("feed_forward_length"))?;
        let heads = g.req_count(&k("attention.head_count"))?;
        let context = g.req_count(&k("context_length"))?;
        let kv_heads = match g.uint(&k("attention.head_count_kv"))? {
            Some(n) if n > 0 && n <= heads as u64 && (heads as u64).is_multiple_of(n) => n as usize,
            Some(n) => {
                return Err(g.err(format!(
                "metadata key '{}' is {n}, which does not divide {}.attention.head_count {heads}",
                k("attention.head_count_kv"),
                a
            )))
            }
            None => heads,
        };
        // Phi-2 normalizes with LayerNorm, the others with RMSNorm.
        let eps_key = if arch.phi2() {
            k("attention.layer_norm_epsilon")
        } else {
            k("attention.layer_norm_rms_epsilon")
        };
        let rms_eps = g
            .float(&eps_key)?
            .ok_or_else(|| g.err(format!("missing metadata key '{eps_key}'")))?;
        let rope_theta = g.float(&k("rope.freq_base"))?.unwrap_or(10000.0);
        let rope_dims = g.uint(&k("rope.dimension_count"))?.map(|n| n as usize);
        // Head size: `attention.key_length` when given; for llama transformers takes
        // `rope.dimension_count` (llama.cpp writes the head size there); else hidden / heads.
        let head_dim = match g.uint(&k("attention.key_length"))? {
            Some(n) => n as usize,
            None => match rope_dims {
                Some(d) if arch.reading.head_dim_from_rope => d,
                _ => {
                    if hidden % heads != 0 {
                        return Err(g.err(format!(
                            "{a}.embedding_length {hidden} is not divisible by {a}.attention.head_count {heads} and {a}.attention.key_length is missing"
                        )));
                    }
                    hidden / heads
                }
            },
        };
        if head_dim == 0 || head_dim > 1 << 16 {
            return Err(g.err(format!("implausible head dimension {head_dim}")));
        }
        let rope_dims = rope_dims.unwrap_or(head_dim);
        if rope_dims > head_dim || rope_dims % 2 != 0 {
            return Err(g.err(format!(
                "{a}.rope.dimension_count {rope_dims} does not fit the head dimension {head_dim}"
            )));
        }
        // As transformers: `{arch}.vocab_size`, else the tokenizer's token count; failing both,
        // the embedding matrix's row count.
        let vocab = match g.uint(&k("vocab_size"))? {
            Some(n) => n as usize,
            None => match g.meta("tokenizer.ggml.tokens") {
                Some(GgufValue::Array(t)) => t.len(),
                Some(v) => {
                    return Err(g.err(format!(
                        "metadata key 'tokenizer.ggml.tokens' must be an array, found {}",
                        show(v)
                    )))
                }
                None => match g.content.tensor_infos.get("token_embd.weight") {
                    Some(info) => info.shape.dims().first().copied().unwrap_or(0),
                    None => {
                        return Err(g.err(format!(
                            "missing metadata key '{}' (and tokenizer.ggml.tokens)",
                            k("vocab_size")
                        )))
                    }
                },
            },
        };
        if vocab == 0 {
            return Err(g.err("the vocabulary is empty"));
        }
        let (experts_used, expert_ffn, shared_ffn, sparse_layers) = if experts > 0 {
            Self::experts(g, arch, experts, ffn, layers)?
        } else {
            (0, 0, None, vec![false; layers])
        };
        Ok(Self {
            vocab,
            hidden,
            ffn,
            layers,
            heads,
            kv_heads,
            head_dim,
            rope_dims,
            context,
            rms_eps,
            rope_theta,
            experts,
            experts_used,
            expert_ffn,
            shared_ffn,
            sparse_layers,
        })
    }

    /// A mixture of experts' top-k, expert and shared-expert sizes and sparse layers. The sizes
    /// come from the metadata, else (files written before llama.cpp recorded them) from the
    /// tensors' shapes; Mixtral's experts are `feed_forward_length` wide.
    fn experts(
        g: &GgufFile,
        arch: &Arch,
        experts: usize,
        ffn: usize,
        layers: usize,
    ) -> Result<(usize, usize, Option<usize>, Vec<bool>), ModelError> {
        let a = &arch.gguf;
        let k = |s: &str| format!("{a}.{s}");
        let used = g.req_count(&k("expert_used_count"))?;
        if used > experts {
            return Err(g.err(format!(
                "{a}.expert_used_count {used} is more than {a}.expert_count {experts}"
            )));
        }
        let infos = &g.content.tensor_infos;
        // Rows of the first tensor of a kind found in any layer (PyTorch order).
        let rows_of = |part: &str, dim: usize| -> Option<usize> {
            (0..layers).find_map(|i| {
                infos
                    .get(&format!("blk.{i}.{part}.weight"))
                    .and_then(|t| t.shape.dims().get(dim).copied())
            })
        };
        let moe = arch.reading.moe.unwrap_or(family::gguf::GgufMoe {
            mixtral_names: false,
            expert_ffn_is_ffn: false,
            shared_expert: false,
            all_sparse: false,
        });
        let expert_ffn = if moe.expert_ffn_is_ffn {
            ffn
        } else {
            match g.uint(&k("expert_feed_forward_length"))? {
                Some(n) if n > 0 => n as usize,
                _ => rows_of("ffn_gate_exps", 1)
                    .or_else(|| rows_of("ffn_gate.0", 0))
                    .ok_or_else(|| {
                        g.err(format!(
                            "missing metadata key '{}'",
                            k("expert_feed_forward_length")
                        ))
                    })?,
            }
        };
        let shared_ffn = if moe.shared_expert {
            Some(match g.uint(&k("expert_shared_feed_forward_length"))? {
                Some(n) if n > 0 => n as usize,
                _ => rows_of("ffn_gate_shexp", 0).ok_or_else(|| {
                    g.err(format!(
                        "missing metadata key '{}' (and no ffn_gate_shexp tensor)",
                        k("expert_shared_feed_forward_length")
                    ))
                })?,
            })
        } else {
            None
        };
        let sparse: Vec<bool> = (0..layers)
            .map(|i| infos.contains_key(&format!("blk.{i}.ffn_gate_inp.weight")))
            .collect();
        if moe.all_sparse {
            if let Some(i) = sparse.iter().position(|s| !s) {
                return Err(g.err(format!(
                    "layer {i} has no router (blk.{i}.ffn_gate_inp.weight): every Mixtral layer is a mixture of experts"
                )));
            }
        }
        Ok((used, expert_ffn, shared_ffn, sparse))
    }
}

/// What a GGUF tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Embed,
    Output,
    FinalNorm,
    AttnNorm,
    FfnNorm,
    /// Gemma 2/3: the norm of the attention's output (`post_attention_norm`).
    PostAttnNorm,
    /// Gemma 2/3: the norm of the MLP's output (`post_ffw_norm`).
    PostFfwNorm,
    Q,
    K,
    V,
    O,
    Qkv,
    QNorm,
    KNorm,
    Gate,
    Up,
    Down,
    /// A mixture of experts' router (`ffn_gate_inp`, `[experts, hidden]`).
    Router,
    /// Qwen2-MoE's shared expert's gate (`ffn_gate_inp_shexp`, `[hidden]` or `[1, hidden]`).
    SharedRouter,
    /// Every expert's gate / up / down projection stacked: `[experts, out, in]`.
    GateExps,
    UpExps,
    DownExps,
    /// Gate and up stacked per expert: `[experts, 2 · expert_ffn, hidden]`, gate rows first.
    GateUpExps,
    /// Qwen2-MoE's shared expert.
    SharedGate,
    SharedUp,
    SharedDown,
}

/// llama.cpp's top-level tensors, by kind.
const TOP_KINDS: &[(&str, Kind)] = &[
    ("token_embd", Kind::Embed),
    ("output", Kind::Output),
    ("output_norm", Kind::FinalNorm),
];

/// llama.cpp's tensors under `blk.N.`, by kind.
const LAYER_KINDS: &[(&str, Kind)] = &[
    ("attn_norm", Kind::AttnNorm),
    ("ffn_norm", Kind::FfnNorm),
    ("post_attention_norm", Kind::PostAttnNorm),
    ("post_ffw_norm", Kind::PostFfwNorm),
    ("attn_q", Kind::Q),
    ("attn_k", Kind::K),
    ("attn_v", Kind::V),
    ("attn_output", Kind::O),
    ("attn_qkv", Kind::Qkv),
    ("attn_q_norm", Kind::QNorm),
    ("attn_k_norm", Kind::KNorm),
    ("ffn_gate", Kind::Gate),
    ("ffn_up", Kind::Up),
    ("ffn_down", Kind::Down),
    ("ffn_gate_inp", Kind::Router),
    ("ffn_gate_inp_shexp", Kind::SharedRouter),
    ("ffn_gate_exps", Kind::GateExps),
    ("ffn_up_exps", Kind::UpExps),
    ("ffn_down_exps", Kind::DownExps),
    ("ffn_gate_up_exps", Kind::GateUpExps),
    ("ffn_gate_shexp", Kind::SharedGate),
    ("ffn_up_shexp", Kind::SharedUp),
    ("ffn_down_shexp", Kind::SharedDown),
];

impl Kind {
    /// llama.cpp's name of the kind (under `blk.N.` when `in_layer`).
    fn part(self, in_layer: bool) -> &'static str {
        let table = if in_layer { LAYER_KINDS } else { TOP_KINDS };
        table
            .iter()
            .find(|(_, k)| *k == self)
            .map_or("", |(part, _)| part)
    }
}

/// A GGUF tensor's kind, layer, expert (llama.cpp's older per-expert tensors `ffn_gate.E`) and
/// whether it is a bias.
#[derive(Debug, Clone, Copy)]
struct Role {
    kind: Kind,
    layer: Option<usize>,
    expert: Option<usize>,
    bias: bool,
}

impl Role {
    fn parse(name: &str) -> Option<Self> {
        let (stem, bias) = if let Some(s) = name.strip_suffix(".weight") {
            (s, false)
        } else {
            (name.strip_suffix(".bias")?, true)
        };
        let top = |kind| {
            Some(Self {
                kind,
                layer: None,
                expert: None,
                bias,
            })
        };
        if let Some(&(_, kind)) = TOP_KINDS.iter().find(|(part, _)| *part == stem) {
            return top(kind);
        }
        let rest = stem.strip_prefix("blk.")?;
        let (layer, part) = rest.split_once('.')?;
        if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let layer = layer.parse().ok()?;
        // Older Mixtral files: one tensor per expert, `ffn_gate.E` / `ffn_up.E` / `ffn_down.E`.
        let (part, expert) = match part.split_once('.') {
            Some((p, e)) if !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()) => {
                if !matches!(p, "ffn_gate" | "ffn_up" | "ffn_down") {
                    return None;
                }
                (p, Some(e.parse().ok()?))
            }
            Some(_) => return None,
            None => (part, None),
        };
        let &(_, kind) = LAYER_KINDS.iter().find(|(p, _)| *p == part)?;
        Some(Self {
            kind,
            layer: Some(layer),
            expert,
            bias,
        })
    }

    /// Stacked experts: one GGUF tensor for every expert of a layer.
    fn is_stacked(&self) -> bool {
        matches!(
            self.kind,
            Kind::GateExps | Kind::UpExps | Kind::DownExps | Kind::GateUpExps
        )
    }

    /// The HF tensors this GGUF tensor becomes, `(name, rows of this tensor)`: itself renamed, or
    /// its parts — each expert of a stacked tensor (`[experts, rows, in]`; gate and up halves of
    /// `ffn_gate_up_exps`) or Phi-2's fused `attn_qkv` split into q, k and v. Each part is
    /// `index` along the first dimension (stacked) and then rows `start .. start + len`.
    fn hf_parts(&self, arch: &Arch, hp: &HParams) -> Vec<HfPart> {
        let layer = self.layer.unwrap_or(0);
        let suffix = if self.bias { "bias" } else { "weight" };
        let named = |module: String| format!("model.layers.{layer}.{module}.{suffix}");
        if self.is_stacked() {
            let rows = match self.kind {
                Kind::DownExps => hp.hidden,
                _ => hp.expert_ffn,
            };
            let halves: &[(Kind, usize)] = match self.kind {
                Kind::GateExps => &[(Kind::Gate, 0)],
                Kind::UpExps => &[(Kind::Up, 0)],
                Kind::DownExps => &[(Kind::Down, 0)],
                _ => &[(Kind::Gate, 0), (Kind::Up, 1)],
            };
            return (0..hp.experts)
                .flat_map(|e| {
                    halves.iter().map(move |&(part, half)| HfPart {
                        name: named(arch.expert_module(Some(e), part)),
                        index: Some(e),
                        start: half * rows,
                        len: rows,
                    })
                })
                .collect();
        }
        if self.kind == Kind::Qkv && arch.phi2() {
            let (q, kv) = (hp.heads * hp.head_dim, hp.kv_heads * hp.head_dim);
            return [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)]
                .into_iter()
                .map(|(proj, start, len)| HfPart {
                    name: named(format!("self_attn.{proj}")),
                    index: None,
                    start,
                    len,
                })
                .collect();
        }
        vec![HfPart {
            name: self.hf_name(arch),
            index: None,
            start: 0,
            len: 0,
        }]
    }

    /// A weight matrix used as `x @ W.T` (projections, the head, and the embedding, which is the
    /// head when tied), kept whole under one HF name; stacked experts are matrices too, split
    /// per expert.
    fn is_matrix(&self) -> bool {
        !self.bias
            && matches!(
                self.kind,
                Kind::Embed
                    | Kind::Output
                    | Kind::Q
                    | Kind::K
                    | Kind::V
                    | Kind::O
                    | Kind::Qkv
                    | Kind::Gate
                    | Kind::Up
                    | Kind::Down
                    | Kind::SharedGate
                    | Kind::SharedUp
                    | Kind::SharedDown
            )
    }

    /// The HF name of a tensor that maps to one HF tensor (see [`Role::hf_parts`]), from the
    /// names table GGUF's reader and writer share ([`family::gguf::TENSOR_NAMES`]).
    fn hf_name(&self, arch: &Arch) -> String {
        let suffix = if self.bias { "bias" } else { "weight" };
        let layer = self.layer.unwrap_or(0);
        if matches!(self.kind, Kind::Gate | Kind::Up | Kind::Down) && self.expert.is_some() {
            let module = arch.expert_module(self.expert, self.kind);
            return format!("model.layers.{layer}.{module}.{suffix}");
        }
        let in_layer = self.layer.is_some();
        let part = self.kind.part(in_layer);
        let module = arch
            .naming()
            .hf_module(part, in_layer)
            .unwrap_or_else(|| unreachable!("'{part}' has an HF name (stacked experts are split)"));
        if in_layer {
            format!("model.layers.{layer}.{module}.{suffix}")
        } else {
            format!("{module}.{suffix}")
        }
    }

    /// The PyTorch shape the metadata implies.
    fn expected_shape(&self, hp: &HParams, arch: &Arch) -> Result<Vec<usize>, String> {
        if let Some(l) = self.layer {
            if l >= hp.layers {
                return Err(format!(
                    "belongs to layer {l} but {}.block_count is {}",
                    arch.gguf, hp.layers
                ));
            }
        }
        let h = hp.hidden;
        let q = hp.heads * hp.head_dim;
        let kv = hp.kv_heads * hp.head_dim;
        let up = if arch.reading.names == GgufNames::Phi3 {
            2 * hp.ffn
        } else {
            hp.ffn
        };
        let moe_part = matches!(
            self.kind,
            Kind::Router
                | Kind::SharedRouter
                | Kind::GateExps
                | Kind::UpExps
                | Kind::DownExps
                | Kind::GateUpExps
                | Kind::SharedGate
                | Kind::SharedUp
                | Kind::SharedDown
        ) || self.expert.is_some();
        if moe_part && hp.experts == 0 {
            return Err(format!(
                "is part of a mixture of experts but {}.expert_count is not set",
                arch.gguf
            ));
        }
        if let Some(e) = self.expert {
            if e >= hp.experts {
                return Err(format!(
                    "belongs to expert {e} but {}.expert_count is {}",
                    arch.gguf, hp.experts
                ));
            }
        }
        let (e, ffe) = (hp.experts, hp.expert_ffn);
        let shared = || {
            hp.shared_ffn.ok_or_else(|| {
                format!("is a shared expert, which {} models do not have", arch.gguf)
            })
        };
        if self.bias && moe_part {
            return Err("is a bias, which mixture-of-experts layers do not have".into());
        }
        let (out, inp) = match self.kind {
            Kind::Router => (e, h),
            Kind::SharedRouter => return Ok(vec![h]),
            Kind::GateExps | Kind::UpExps => return Ok(vec![e, ffe, h]),
            Kind::DownExps => return Ok(vec![e, h, ffe]),
            Kind::GateUpExps => return Ok(vec![e, 2 * ffe, h]),
            Kind::SharedGate | Kind::SharedUp => (shared()?, h),
            Kind::SharedDown => (h, shared()?),
            Kind::Gate | Kind::Up if self.expert.is_some() => (ffe, h),
            Kind::Down if self.expert.is_some() => (h, ffe),
            Kind::Embed | Kind::Output => (hp.vocab, h),
            Kind::FinalNorm
            | Kind::AttnNorm
            | Kind::FfnNorm
            | Kind::PostAttnNorm
            | Kind::PostFfwNorm => return Ok(vec![h]),
            Kind::QNorm | Kind::KNorm => return Ok(vec![hp.head_dim]),
            Kind::Q => (q, h),
            Kind::K | Kind::V => (kv, h),
            Kind::O => (h, q),
            Kind::Qkv => (q + 2 * kv, h),
            Kind::Gate => (hp.ffn, h),
            Kind::Up => (up, h),
            Kind::Down => (h, hp.ffn),
        };
        Ok(if self.bias { vec![out] } else { vec![out, inp] })
    }
}

/// The row order that [`unpermute_rows`] produces: HF row `r` is GGUF row `order[r]`.
fn unpermuted_row_order(rows: usize, n_head: usize) -> Result<Vec<u32>, String> {
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
        return Err(format!(
            "has {rows} rows, which cannot be split into {n_head} heads of (re, im) pairs"
        ));
    }
    let half = rows / n_head / 2;
    let mut order = Vec::with_capacity(rows);
    for h in 0..n_head {
        for j in 0..2 {
            for i in 0..half {
                order.push((h * 2 * half + i * 2 + j) as u32);
            }
        }
    }
    Ok(order)
}

/// Undoes convert_hf_to_gguf.py's `permute`: rows grouped per head as `(n_head, 2, half)` were
/// reordered to `(n_head, half, 2)` (interleaved RoPE pairs); this restores HF's half-split order.
fn unpermute_rows(t: &Tensor, n_head: usize) -> Result<Tensor, String> {
    let dims = t.dims().to_vec();
    let rows = dims[0];
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
        return Err(format!(
            "has {rows} rows, which cannot be split into {n_head} heads of (re, im) pairs"
        ));
    }
    let half = rows / n_head / 2;
    let rest: usize = dims[1..].iter().product();
    let un = || -> candle_core::Result<Tensor> {
        t.reshape((n_head, half, 2, rest))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape(dims.as_slice())
    };
    un().map_err(|e| format!("cannot be un-permuted: {e}"))
}
