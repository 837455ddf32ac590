//! Generation against transformers: greedy tokens of every tiny-model fixture and of the real
//! SmolLM2-135M-Instruct GGUF, plus batching, stop strings and seeded sampling.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use ferrotune_infer::{generate, GenerationOptions, SamplingOptions};
use ferrotune_models::{load_model, AttentionLayout, CausalLm};
use serde_json::Value;

use ferrotune_testing::fixtures;

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

fn greedy(max_new_tokens: usize, eos: Vec<u32>, ignore_eos: bool) -> GenerationOptions {
    GenerationOptions {
        max_new_tokens,
        sampling: SamplingOptions::default(),
        eos_token_ids: eos,
        stop_strings: vec![],
        ignore_eos,
        pad_token_id: 0,
    }
}

fn run(model: &CausalLm, prompts: &[Vec<u32>], opts: &GenerationOptions) -> Vec<Vec<u32>> {
    generate(model, prompts, opts, &|_| String::new(), &mut |_, _| {})
        .unwrap()
        .new_token_ids
}

fn all_cases() -> Vec<PathBuf> {
    let mut cases = vec![fixtures().join("llama3"), fixtures().join("qwen2")];
    for e in std::fs::read_dir(fixtures().join("models")).unwrap() {
        let p = e.unwrap().path();
        if p.join("golden.json").is_file() {
            cases.push(p);
        }
    }
    cases.sort();
    cases
}

#[test]
fn greedy_tokens_match_transformers_for_every_family() {
    let cases = all_cases();
    assert!(cases.len() >= 10);
    for case in cases {
        let g = json(&case.join("golden.json"));
        let (model, _) = load_model(&case.join("model"), DType::F32, &Device::Cpu).unwrap();
        let want = ids(&g["greedy_new_tokens"]);
        let got = run(
            &model,
            &[ids(&g["greedy_prompt"])],
            &greedy(want.len(), vec![], true),
        );
        assert_eq!(got[0], want, "{}", case.display());
    }
}

/// A prompt within LongRoPE's original context whose continuation outgrows it: transformers'
/// Phi-3 and Phi-3.5-MoE drop the KV cache at the switch and run the whole sequence with the long
/// embedding (long factors; Phi-3.5-MoE's long mscale), and so must we. Tokens from transformers
/// 5.23's `generate` (equal to its cache-free argmax loop, margins ≥ 0.011).
#[test]
fn generation_recomputes_the_cache_when_longrope_switches() {
    let cases: [(&str, &[u32], [u32; 10]); 2] = [
        (
            "phi3_longrope",
            &[5, 9, 33, 100, 7],
            [329, 432, 269, 329, 509, 358, 239, 243, 154, 205],
        ),
        (
            "phimoe",
            &[5, 9, 33, 100, 7, 8],
            [480, 399, 320, 276, 56, 189, 471, 172, 156, 276],
        ),
    ];
    for (case, prompt, want) in cases {
        let dir = fixtures().join("models").join(case).join("model");
        let (model, _) = load_model(&dir, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(model.rope_switch_length(), Some(6), "{case}");
        let got = run(&model, &[prompt.to_vec()], &greedy(10, vec![], true));
        assert_eq!(got[0], want, "{case}");
    }
}

#[test]
fn left_padded_batch_equals_one_prompt_at_a_time() {
    let case = fixtures().join("llama3");
    let g = json(&case.join("golden.json"));
    let (model, _) = load_model(&case.join("model"), DType::F32, &Device::Cpu).unwrap();
    let long = ids(&g["greedy_prompt"]);
    let short = long[3..].to_vec();
    let other: Vec<u32> = ids(&g["input_ids"][1])[..5].to_vec();
    let opts = greedy(12, vec![], true);
    let batch = run(&model, &[long.clone(), short.clone(), other.clone()], &opts);
    for (i, p) in [long, short, other].iter().enumerate() {
        assert_eq!(
            batch[i],
            run(&model, std::slice::from_ref(p), &opts)[0],
            "row {i}"
        );
    }
    assert_eq!(batch[0], ids(&g["greedy_new_tokens"])[..12]);
}

#[test]
fn stops_at_any_eos_and_at_stop_strings() {
    let case = fixtures().join("llama3");
    let g = json(&case.join("golden.json"));
    let (model, _) = load_model(&case.join("model"), DType::F32, &Device::Cpu).unwrap();
    let prompt = ids(&g["greedy_prompt"]);
    let full = ids(&g["greedy_new_tokens"]); // 165 116 330 35 332 179 ...
                                             // eos = the 4th generated token (listed second): generation keeps it and stops.
    let out = run(
        &model,
        std::slice::from_ref(&prompt),
        &greedy(16, vec![999, full[3]], false),
    );
    assert_eq!(out[0], full[..4]);
    // A stop string over the decoded ids: stop once token 330 has been produced.
    let mut opts = greedy(16, vec![], false);
    opts.stop_strings = vec!["<330>".into()];
    let decode = |ids: &[u32]| ids.iter().map(|i| format!("<{i}>")).collect::<String>();
    let out = generate(&model, &[prompt], &opts, &decode, &mut |_, _| {}).unwrap();
    assert_eq!(out.new_token_ids[0], full[..3]);
}

#[test]
fn sampling_is_reproducible_by_seed() {
    let case = fixtures().join("qwen2");
    let g = json(&case.join("golden.json"));
    let (model, _) = load_model(&case.join("model"), DType::F32, &Device::Cpu).unwrap();
    let prompt = vec![ids(&g["greedy_prompt"])];
    let sampled = |seed| {
        let mut o = greedy(20, vec![], true);
        o.sampling = SamplingOptions {
            temperature: 1.5,
            top_k: Some(50),
            top_p: Some(0.95),
            repetition_penalty: 1.1,
            seed,
        };
        let mut streamed = Vec::new();
        let out = generate(&model, &prompt, &o, &|_| String::new(), &mut |_, t| {
            streamed.push(t)
        })
        .unwrap();
        assert_eq!(
            streamed, out.new_token_ids[0],
            "every token is streamed, in order"
        );
        out.new_token_ids[0].clone()
    };
    assert_eq!(sampled(1), sampled(1));
    assert_ne!(sampled(1), sampled(2));
    // Sampling at temperature 1.5 leaves the greedy path.
    assert_ne!(sampled(1)[..16], ids(&g["greedy_new_tokens"])[..]);
}

/// The real model: SmolLM2-135M-Instruct from its Q4_1 GGUF, against transformers' f32 run.
#[test]
fn smollm2_gguf_logits_and_greedy_answer_match_transformers() {
    let gguf = ferrotune_data::asset_path("SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
    let golden = json(&fixtures().join("smollm2_golden.json"));
    let golden = &golden[0];
    let (model, _) = load_model(&gguf, DType::F32, &Device::Cpu).unwrap();
    let prompt = ids(&golden["prompt_ids"]);
    let input = Tensor::new(prompt.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits = model
        .forward(&input, &AttentionLayout::causal(1, prompt.len(), 0), None)
        .unwrap()
        .get(0)
        .unwrap()
        .get(prompt.len() - 1)
        .unwrap();
    let want =
        candle_core::safetensors::load(fixtures().join("smollm2_golden.safetensors"), &Device::Cpu)
            .unwrap();
    let want = &want["last_logits_0"];
    let rel = ferrotune_testing::rel_l2(&logits, want);
    eprintln!("SmolLM2 last-position logits relative L2 error: {rel:e}");
    assert!(rel <= 1e-3, "last-position logits relative L2 error {rel}");
    // The same logits through the packed (quantized-block) path: chunks of at most 32 rows.
    let mut cache = ferrotune_models::KvCache::new(model.layers.len());
    let mut last = None;
    for start in (0..prompt.len()).step_by(8) {
        let len = 8.min(prompt.len() - start);
        let chunk = input.narrow(1, start, len).unwrap();
        let out = model
            .forward(
                &chunk,
                &AttentionLayout::causal(1, len, start),
                Some(&mut cache),
            )
            .unwrap();
        last = Some(out.get(0).unwrap().get(len - 1).unwrap());
    }
    let packed_rel = ferrotune_testing::rel_l2(&last.unwrap(), want);
    eprintln!("SmolLM2 packed-path logits relative L2 error: {packed_rel:e}");
    assert!(
        packed_rel <= 1e-3,
        "packed path: relative L2 error {packed_rel}"
    );
    let want_tokens = ids(&golden["greedy_new_tokens"]);
    let got = run(&model, &[prompt], &greedy(32, vec![2], false));
    assert_eq!(got[0], want_tokens);
}

/// Decoding from a GGUF reads the quantized blocks directly: every matrix of SmolLM2 (Q4_1, and
/// the Q8_0 embedding serving as the tied head) has its packed copy attached.
#[test]
fn smollm2_gguf_keeps_packed_weights_for_decoding() {
    let gguf = ferrotune_data::asset_path("SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
    let (model, _) = load_model(&gguf, DType::F32, &Device::Cpu).unwrap();
    let linears = model.linears();
    assert_eq!(linears.len(), 30 * 7 + 1);
    for (name, linear) in linears {
        assert!(linear.packed.is_some(), "{name} has no packed weight");
    }
}
