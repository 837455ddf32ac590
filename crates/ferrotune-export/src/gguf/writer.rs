//! What the writers share beyond the header: the outtype made concrete for a checkpoint, and the
//! file an architecture's own writer (DeepSeek's, gpt-oss's, Qwen3.5's) opens and finishes.

use super::*;

/// `outtype` made concrete for the checkpoint `weights`: `auto` is bf16 when the first matrix is
/// bf16 and f16 otherwise (llama.cpp's converter's `auto`); `mxfp4_moe` is refused unless the
/// architecture has MXFP4 experts (`mxfp4_experts`: gpt-oss).
pub(super) fn resolve_outtype(
    outtype: OutType,
    weights: &Weights,
    mxfp4_experts: bool,
) -> Result<OutType> {
    Ok(match outtype {
        OutType::Auto => match weights.first_matrix_dtype() {
            Some(Dtype::BF16) => OutType::Bf16,
            _ => OutType::F16,
        },
        OutType::Mxfp4Moe if !mxfp4_experts => bail!(
            "--outtype mxfp4_moe is written for gpt-oss's experts only (llama.cpp's 'gpt-oss')"
        ),
        other => other,
    })
}

/// A GGUF file that an architecture's own writer (DeepSeek's, gpt-oss's, Qwen3.5's) fills: its
/// metadata opened with the header keys, the checkpoint's tokenizer, the notes for the user.
pub(super) struct Opened {
    arch: &'static str,
    /// The metadata, opened with the header keys.
    pub(super) meta: Metadata,
    tokenizer: (Tokenizer, GgufVocab, String),
    /// What the file cannot carry, for the user to know.
    pub(super) notes: Vec<String>,
}

impl Opened {
    /// Reads the tokenizer of `model_dir` (a note into `notes` when llama.cpp does not name its
    /// pre-tokenizer) and opens the metadata with [`write_header_typed`]'s keys, the folder's
    /// name as `general.name`.
    pub(super) fn new(
        model_dir: &Path,
        arch: &'static str,
        file_type: u32,
        config: &ModelConfig,
        shape: HeaderShape,
        mut notes: Vec<String>,
    ) -> Result<Self> {
        let tokenizer = read_tokenizer(model_dir, config, &mut notes)?;
        let mut meta = Metadata::default();
        let name = folder_name(model_dir, "model");
        write_header_typed(&mut meta, arch, &name, file_type, config, shape);
        Ok(Self {
            arch,
            meta,
            tokenizer,
            notes,
        })
    }

    /// Ends the file: the tokenizer's keys after the architecture's, the types of
    /// `llama-quantize`'s mix for `outtype` (`mix`), the tensors of `plan` written to `out`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn finish(
        mut self,
        out: &Path,
        mut plan: Vec<Planned>,
        outtype: OutType,
        mix: MixModel,
        config: &ModelConfig,
        weights: &Weights,
    ) -> Result<GgufExport> {
        let (tok, vocab, pre) = self.tokenizer;
        write_tokenizer(&mut self.meta, &tok, &vocab, &pre, config);
        assign_mix_types(&mut plan, outtype, mix);
        let written = write_gguf(out, &plan, &self.meta, weights)?;
        Ok(GgufExport {
            architecture: self.arch.into(),
            tensors: plan.len(),
            bytes: written,
            pre_tokenizer: pre,
            notes: self.notes,
        })
    }
}
