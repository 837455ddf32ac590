//! Tokenizers built from GGUF metadata against transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=...)`.

use crate::common;

use common::{
    check_against_reference, fixture_json, fixtures_dir, ids, messages, real_asset, real_tokenizer,
};
use ferrotune_data::{GgufVocabStyle, Tokenizer};

fn smollm2() -> Tokenizer {
    let path = real_asset("SmolLM2-135M-Instruct.Q4_1.gguf");
    Tokenizer::from_gguf(&path, |_| GgufVocabStyle::Llama).unwrap_or_else(|e| panic!("{e}"))
}

/// `prompt_ids` of smollm2_golden.json: transformers' GGUF tokenizer and the GGUF's chat template.
#[test]
fn smollm2_prompt_ids_match_transformers() {
    let golden = fixture_json("smollm2_golden.json");
    let case = &golden[0];
    let tok = smollm2();
    let ids_ = tok.encode_chat(&messages(&case["messages"]), true).unwrap();
    assert_eq!(ids_, ids(&case["prompt_ids"]));
    let expected_text = case["greedy_text"].as_str().unwrap();
    assert_eq!(
        tok.decode(&ids(&case["greedy_new_tokens"]), false).unwrap(),
        expected_text
    );
}

/// smollm2_tokenizer.json (scripts/make_tokenizer_fixtures.py): plain text, special tokens, chats.
#[test]
fn smollm2_matches_transformers_references() {
    let tok = smollm2();
    check_against_reference("smollm2", &tok, &fixture_json("smollm2_tokenizer.json"));
    assert_eq!(tok.eos_ids(), &[2]);
    assert!(!tok.add_bos_token());
}

/// Small GGUF files covering the other paths: SentencePiece BPE with merges derived from scores
/// (llama), Gemma's re-spelled whitespace tokens and order-derived merges, byte-level BPE with a
/// split regex picked by `tokenizer.ggml.pre`. The Gemma file's family says its vocabulary is
/// `GemmaTokenizer`'s (`ferrotune_models::family::gguf_vocab_style`, tested there).
#[test]
fn small_gguf_files_match_transformers() {
    for (name, style) in [
        ("spm_llama", GgufVocabStyle::Llama),
        ("spm_gemma", GgufVocabStyle::Gemma),
        ("bpe_qwen2", GgufVocabStyle::Llama),
    ] {
        let path = fixtures_dir().join(format!("gguf_tokenizers/{name}.gguf"));
        let tok = Tokenizer::from_gguf(&path, |_| style).unwrap_or_else(|e| panic!("{name}: {e}"));
        check_against_reference(
            name,
            &tok,
            &fixture_json(&format!("gguf_tokenizers/{name}.json")),
        );
    }
}

#[test]
fn llama_type_gguf_adds_bos_by_default() {
    let tok = Tokenizer::from_gguf(
        fixtures_dir().join("gguf_tokenizers/spm_llama.gguf"),
        |_| GgufVocabStyle::Llama,
    )
    .unwrap();
    assert!(tok.add_bos_token());
    assert_eq!(
        tok.encode("hi", true).unwrap().first().copied(),
        tok.bos_id()
    );
}

/// `gguf_vocab`'s `tokenizer.ggml.pre`, the name llama.cpp's converter writes: SmolLM2's tokenizer
/// read from its GGUF (which that converter wrote) gets the GGUF's own name back; Llama 3.1's
/// `llama-bpe`, Qwen 3's `qwen2`; the SentencePiece vocabularies of Llama 2 and Gemma 3 none
/// (llama.cpp's SentencePiece tokenizer has no pre-tokenizer: the writer puts `default`).
#[test]
fn gguf_vocab_names_the_pre_tokenizer_as_llama_cpp_does() {
    use candle_core::quantized::gguf_file::Content;
    use ferrotune_data::gguf_vocab;
    let path = real_asset("SmolLM2-135M-Instruct.Q4_1.gguf");
    let content = Content::read(&mut std::fs::File::open(&path).unwrap()).unwrap();
    let want = content.metadata["tokenizer.ggml.pre"].to_string().unwrap();
    let pre = |tok: &Tokenizer| gguf_vocab(tok, tok.vocab_size()).map(|v| (v.model, v.pre));
    assert_eq!(pre(&smollm2()), Ok(("gpt2", Some(want.as_str()))));
    assert_eq!(
        pre(&real_tokenizer("llama3_1")),
        Ok(("gpt2", Some("llama-bpe")))
    );
    assert_eq!(pre(&real_tokenizer("qwen3")), Ok(("gpt2", Some("qwen2"))));
    assert_eq!(pre(&real_tokenizer("llama2")), Ok(("llama", None)));
    assert_eq!(pre(&real_tokenizer("gemma3")), Ok(("llama", None)));
}
