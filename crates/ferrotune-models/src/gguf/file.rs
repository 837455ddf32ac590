//! An open GGUF file: its header, typed metadata and tensor reads.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value as GgufValue};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::error::ModelError;
use crate::family::gguf::GgufMetadata;

use super::*;

/// An open GGUF file with its parsed header.
pub(super) struct GgufFile<'a> {
    pub(super) path: &'a Path,
    pub(super) reader: BufReader<File>,
    pub(super) len: u64,
    pub(super) content: Content,
    /// The tensors of type MXFP4 (GGML 39), which candle's reader was shown as F32 and which are
    /// read here ([`super::mxfp4`]).
    pub(super) mxfp4: HashSet<String>,
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
    pub(super) fn open(path: &'a Path) -> Result<Self, ModelError> {
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
        // candle knows no MXFP4: its type fields are shown to it as F32.
        let (mxfp4, fields) = super::mxfp4::mxfp4_tensors(&mut reader).unwrap_or_default();
        reader
            .seek(SeekFrom::Start(0))
            .map_err(|e| err(format!("cannot read GGUF file: {e}")))?;
        // candle's header reader bounds every length by the file size, but divides by
        // `general.alignment` unchecked: a corrupt file with alignment 0 would panic. That is the one
        // panic we know of; catching it (the last resort) keeps a bad file an error, not a crash.
        let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if fields.is_empty() {
                Content::read(&mut reader)
            } else {
                Content::read(&mut super::mxfp4::AsF32 {
                    inner: &mut reader,
                    fields: &fields,
                })
            }
        }));
        let content = match read {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(err(header_error_message(&e.to_string()))),
            Err(_) => {
                return Err(err(
                    "corrupt GGUF header (e.g. general.alignment is 0)".into()
                ))
            }
        };
        if let Some(twice) = name_given_twice(&mut reader, &content) {
            return Err(err(format!("corrupt GGUF header: {twice}")));
        }
        if let Some(v) = content.metadata.get("general.alignment") {
            if !matches!(v, GgufValue::U32(a) if *a > 0) {
                return Err(err(format!(
                    "corrupt GGUF header: general.alignment is {v:?}"
                )));
            }
        }
        let file = Self {
            path,
            reader,
            len,
            content,
            mxfp4,
        };
        file.check_layout()?;
        Ok(file)
    }

    pub(super) fn err(&self, msg: impl Into<String>) -> ModelError {
        ModelError::file(self.path, msg)
    }

    pub(super) fn tensor_err(&self, name: &str, msg: impl std::fmt::Display) -> ModelError {
        self.err(format!("tensor '{name}' {msg}"))
    }

    /// Tensor `name` (already dequantized to `t`) in `dtype` on `device`, a failure named after it.
    pub(super) fn convert(
        &self,
        name: &str,
        t: Tensor,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor, ModelError> {
        t.to_dtype(dtype)
            .and_then(|t| t.to_device(device))
            .map_err(|e| {
                self.tensor_err(
                    name,
                    format!("cannot be converted to {dtype:?} on {device:?}: {e}"),
                )
            })
    }

    pub(super) fn meta(&self, key: &str) -> Option<&GgufValue> {
        self.content.metadata.get(key)
    }

    pub(super) fn uint(&self, key: &str) -> Result<Option<u64>, ModelError> {
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

    pub(super) fn req_uint(&self, key: &str) -> Result<u64, ModelError> {
        self.uint(key)?
            .ok_or_else(|| self.err(format!("missing metadata key '{key}'")))
    }

    /// A count that must be positive and usable as a tensor dimension.
    pub(super) fn req_count(&self, key: &str) -> Result<usize, ModelError> {
        let n = self.req_uint(key)?;
        if n == 0 || n > (1 << 32) {
            return Err(self.err(format!(
                "metadata key '{key}' has the implausible value {n}"
            )));
        }
        Ok(n as usize)
    }

    pub(super) fn float(&self, key: &str) -> Result<Option<f64>, ModelError> {
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

    /// A number that must be positive when given (a base frequency, a scale factor).
    pub(super) fn positive_float(&self, key: &str) -> Result<Option<f64>, ModelError> {
        match self.float(key)? {
            Some(x) if x <= 0.0 => Err(self.err(format!(
                "metadata key '{key}' must be a positive number, found {x}"
            ))),
            other => Ok(other),
        }
    }

    pub(super) fn string(&self, key: &str) -> Result<Option<&str>, ModelError> {
        match self.meta(key) {
            None => Ok(None),
            Some(GgufValue::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.err(format!(
                "metadata key '{key}' must be a string, found {}",
                show(v)
            ))),
        }
    }

    pub(super) fn token_id(&self, key: &str) -> Result<Option<u32>, ModelError> {
        match self.uint(key)? {
            None => Ok(None),
            Some(n) => u32::try_from(n)
                .map(Some)
                .map_err(|_| self.err(format!("metadata key '{key}' is not a token id ({n})"))),
        }
    }

    /// Checks that the tensors tile the data section as llama.cpp's reader (gguf.cpp) requires:
    /// each starts where the one before it ends, padded to the alignment, and the last ends where
    /// the file does. A tensor relabelled with another type or shape (an F32 tensor labelled
    /// Q4_0) changes its size, so it shows up here instead of being read as garbage.
    fn check_layout(&self) -> Result<(), ModelError> {
        let align = match self.meta("general.alignment") {
            Some(GgufValue::U32(a)) => u64::from(*a),
            _ => 32,
        };
        // candle keeps the tensors in a map; their order in the file is the order of offsets.
        let mut infos: Vec<_> = self.content.tensor_infos.iter().collect();
        infos.sort_by_key(|(name, info)| (info.offset, name.as_str()));
        let mut expected = 0u64;
        let mut before: Option<(&str, GgmlDType, &[usize])> = None;
        for (name, info) in infos {
            if info.offset != expected {
                let after = match before {
                    Some((prev, t, dims)) => {
                        format!(
                            "where the tensor before it, '{prev}' ({t:?}, shape {dims:?}), ends"
                        )
                    }
                    None => "at the start of the data".to_string(),
                };
                return Err(self.tensor_err(
                    name,
                    format!(
                        "({:?}, shape {:?}) is at data offset {} but should be at offset \
                         {expected}, {after} (padded to {align} bytes): a tensor's type or \
                         shape is wrong, or the file is corrupt",
                        info.ggml_dtype,
                        info.shape.dims(),
                        info.offset
                    ),
                ));
            }
            let bytes = self.tensor_bytes(name)?;
            self.data_end(name, bytes)?;
            // Within the file (just checked), so this cannot overflow.
            expected = (info.offset + bytes).next_multiple_of(align);
            before = Some((name, info.ggml_dtype, info.shape.dims()));
        }
        // Padding after the last tensor is optional; more than that is data no tensor accounts for.
        let data_len = self.len.saturating_sub(self.content.tensor_data_offset);
        if let Some((last, t, dims)) = before {
            if data_len > expected {
                return Err(self.err(format!(
                    "the file holds {} bytes after its last tensor, '{last}' ({t:?}, shape \
                     {dims:?}), which no tensor accounts for: a tensor's type or shape is \
                     wrong, or the file is corrupt",
                    data_len - expected
                )));
            }
        }
        Ok(())
    }

    /// The bytes of a tensor's data, from its type and shape.
    fn tensor_bytes(&self, name: &str) -> Result<u64, ModelError> {
        let info = &self.content.tensor_infos[name];
        let t = info.ggml_dtype;
        let dims = info.shape.dims();
        let elems = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        let inner = dims.last().copied().unwrap_or(1);
        let (block, size) = if self.mxfp4.contains(name) {
            (super::MXFP4_BLOCK, super::MXFP4_BLOCK_BYTES)
        } else {
            (t.block_size(), t.type_size())
        };
        let bytes = elems
            .filter(|_| inner % block == 0)
            .and_then(|n| (n / block).checked_mul(size));
        bytes.map(|b| b as u64).ok_or_else(|| {
            self.tensor_err(
                name,
                format!(
                    "has shape {dims:?}, impossible for type {t:?} (blocks of {})",
                    t.block_size()
                ),
            )
        })
    }

    /// Where a tensor of `bytes` bytes ends in the file; an error when that is past its end.
    fn data_end(&self, name: &str, bytes: u64) -> Result<u64, ModelError> {
        let info = &self.content.tensor_infos[name];
        let start = self.content.tensor_data_offset.checked_add(info.offset);
        let end = start.and_then(|s| s.checked_add(bytes));
        match (start, end) {
            (Some(_), Some(end)) if end <= self.len => Ok(end),
            (start, _) => Err(self.err(format!(
                "the GGUF file is truncated: tensor '{name}' needs {bytes} bytes at offset {} but the file has {} bytes",
                start.map_or_else(|| "(overflow)".to_string(), |s| s.to_string()),
                self.len
            ))),
        }
    }

    /// Checks that a tensor's type is one we dequantize and that its bytes lie inside the file.
    pub(super) fn check_tensor_data(&self, name: &str) -> Result<(), ModelError> {
        let t = self.content.tensor_infos[name].ggml_dtype;
        if matches!(t, GgmlDType::Q8_1 | GgmlDType::Q8K) {
            return Err(self.tensor_err(
                name,
                format!("has type {t:?}, which ferrotune cannot dequantize (supported: {SUPPORTED_TYPES})"),
            ));
        }
        let bytes = self.tensor_bytes(name)?;
        self.data_end(name, bytes).map(|_| ())
    }

    /// Reads a tensor's blocks (CPU), in PyTorch dimension order.
    pub(super) fn read_qtensor(&mut self, name: &str) -> Result<QTensor, ModelError> {
        if self.mxfp4.contains(name) {
            return Err(self.tensor_err(
                name,
                "has type MXFP4, which ferrotune reads for gpt-oss's experts only",
            ));
        }
        self.content
            .tensor(&mut self.reader, name, &Device::Cpu)
            .map_err(|e| ModelError::file(self.path, format!("cannot read tensor '{name}': {e}")))
    }

    /// Dequantizes a tensor's blocks to f32 on the CPU.
    pub(super) fn dequantize_blocks(&self, name: &str, q: &QTensor) -> Result<Tensor, ModelError> {
        q.dequantize(&Device::Cpu).map_err(|e| {
            ModelError::file(self.path, format!("cannot dequantize tensor '{name}': {e}"))
        })
    }

    /// Reads and dequantizes a tensor to f32 on the CPU, in PyTorch dimension order (MXFP4 as
    /// ggml dequantizes it).
    pub(super) fn dequantize(&mut self, name: &str) -> Result<Tensor, ModelError> {
        if self.mxfp4.contains(name) {
            let bytes = self.tensor_bytes(name)?;
            let info = &self.content.tensor_infos[name];
            let start = self.content.tensor_data_offset + info.offset;
            let shape = info.shape.clone();
            let mut data = vec![0u8; bytes as usize];
            self.reader
                .seek(SeekFrom::Start(start))
                .and_then(|_| self.reader.read_exact(&mut data))
                .map_err(|e| self.tensor_err(name, format!("cannot be read: {e}")))?;
            let values = super::dequantize_mxfp4(&data);
            return Tensor::from_vec(values, shape, &Device::Cpu)
                .map_err(|e| self.tensor_err(name, e));
        }
        let q = self.read_qtensor(name)?;
        self.dequantize_blocks(name, &q)
    }

    /// A small F32 vector tensor (rotary factors), if present.
    pub(super) fn small_vector(&mut self, name: &str) -> Result<Option<Vec<f32>>, ModelError> {
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
}

/// The first metadata key or tensor name the header gives twice, said as an error. candle's reader
/// keeps the last of each in a map, so a duplicate would otherwise surface as some other tensor
/// missing. The header is walked again only when the map holds fewer entries than it declares.
fn name_given_twice(reader: &mut BufReader<File>, content: &Content) -> Option<String> {
    fn u32_of(r: &mut BufReader<File>) -> Option<u32> {
        let mut b = [0u8; 4];
        r.read_exact(&mut b).ok()?;
        Some(u32::from_le_bytes(b))
    }
    fn u64_of(r: &mut BufReader<File>) -> Option<u64> {
        let mut b = [0u8; 8];
        r.read_exact(&mut b).ok()?;
        Some(u64::from_le_bytes(b))
    }
    fn skip(r: &mut BufReader<File>, bytes: u64) -> Option<()> {
        r.seek_relative(i64::try_from(bytes).ok()?).ok()
    }
    // As candle reads a name: lossy UTF-8, trailing NULs dropped (its bounds already held).
    fn name(r: &mut BufReader<File>) -> Option<String> {
        let len = u64_of(r)?;
        let mut bytes = Vec::new();
        r.by_ref().take(len).read_to_end(&mut bytes).ok()?;
        let text = String::from_utf8_lossy(&bytes);
        Some(text.trim_end_matches('\0').to_string())
    }
    // GGUF value types 0..=12; 8 is a string, 9 an array (element type, count, elements).
    fn skip_value(r: &mut BufReader<File>, ty: u32) -> Option<()> {
        const SIZES: [u64; 13] = [1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8];
        match ty {
            8 => {
                let len = u64_of(r)?;
                skip(r, len)
            }
            9 => {
                let (elem, count) = (u32_of(r)?, u64_of(r)?);
                match SIZES.get(elem as usize)? {
                    0 => (0..count).try_for_each(|_| skip_value(r, elem)),
                    size => skip(r, count.checked_mul(*size)?),
                }
            }
            _ => skip(r, *SIZES.get(ty as usize)?),
        }
    }
    reader.seek(SeekFrom::Start(8)).ok()?;
    let (tensors, keys) = (u64_of(reader)?, u64_of(reader)?);
    if tensors == content.tensor_infos.len() as u64 && keys == content.metadata.len() as u64 {
        return None;
    }
    let mut seen = std::collections::HashSet::new();
    for _ in 0..keys {
        let key = name(reader)?;
        if !seen.insert(key.clone()) {
            return Some(format!("metadata key '{key}' appears twice"));
        }
        let ty = u32_of(reader)?;
        skip_value(reader, ty)?;
    }
    seen.clear();
    for _ in 0..tensors {
        let tensor = name(reader)?;
        if !seen.insert(tensor.clone()) {
            return Some(format!("tensor '{tensor}' appears twice"));
        }
        let dims = u32_of(reader)?;
        // The dimensions, the type and the offset.
        skip(reader, 8 * u64::from(dims) + 4 + 8)?;
    }
    None
}

/// Reads as many bytes as are available, up to `buf.len()`.
pub(super) fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
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
pub(super) fn header_error_message(candle_msg: &str) -> String {
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

pub(super) fn show(v: &GgufValue) -> String {
    match v {
        GgufValue::Array(a) => format!("an array of {} values", a.len()),
        GgufValue::String(s) => format!("the string {s:?}"),
        v => format!("{v:?}"),
    }
}
