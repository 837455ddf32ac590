//! `ferrotune run quantize` end to end: the checkpoint torchtune's quantize recipe saves, tensor
//! for tensor and byte for byte, as torchao's Int8DynActInt4WeightQATQuantizer makes it from the
//! same tiny models (scripts/make_quantize_fixtures.py): torchtune's names (Llama's q/k rows
//! permuted, Qwen2's biases and tied head, Phi-3's fused projections split), int8 codes, float32
//! scales and zeros, linears the group size does not divide left as they were.

use crate::common;

use std::path::Path;

use common::{ferrotune, fixtures, text, tmpdir};
use ferrotune_models::torch_pickle::read_torch_file;

#[test]
fn quantize_writes_torchaos_8da4w_checkpoint() {
    for (case, model, dtype, groupsize) in [
        ("llama3_2_gs32", "llama3_2", "fp32", 32),
        ("llama3_2_bf16_gs64", "llama3_2", "bf16", 64),
        ("qwen2_5_gs32", "qwen2_5", "fp32", 32),
        ("qwen2_5_bf16_gs16", "qwen2_5", "bf16", 16),
        ("phi3_gs16", "phi3", "bf16", 16),
    ] {
        let dir = tmpdir("quantize", case);
        let yaml = format!(
            "output_dir: {out}\nmodel:\n  _component_: torchtune.models.{family}\ncheckpointer:\n  \
             _component_: torchtune.training.FullModelHFCheckpointer\n  checkpoint_dir: {model}\n  \
             output_dir: ${{output_dir}}\ndevice: cpu\ndtype: {dtype}\nseed: 1234\nquantizer:\n  \
             _component_: torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer\n  \
             groupsize: {groupsize}\n",
            out = dir.join("out").display(),
            family = match model {
                "llama3_2" => "llama3_2.llama3_2_1b",
                "qwen2_5" => "qwen2_5.qwen2_5_0_5b",
                _ => "phi3.phi3_mini",
            },
            model = fixtures().join("models").join(model).join("model").display(),
        );
        let cfg = dir.join("quantize.yaml");
        std::fs::write(&cfg, yaml).unwrap();
        let out = ferrotune(
            &["run", "quantize", "--config", cfg.to_str().unwrap()],
            &dir,
            &[],
        );
        assert!(out.status.success(), "{case}: {}", text(&out));
        let log = text(&out);
        assert!(log.contains("Time for quantization"), "{case}: {log}");
        let got = read_torch_file(&dir.join("out/model-8da4w.pt")).unwrap();
        let want =
            read_torch_file(&fixtures().join(format!("quantize/{case}/model/model-8da4w.pt")))
                .unwrap();
        let names = |v: &[(String, _)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(&got), names(&want), "{case}: tensor names");
        for ((name, g), (_, w)) in got.iter().zip(&want) {
            assert_eq!(g.dtype, w.dtype, "{case}: {name} dtype");
            assert_eq!(g.shape, w.shape, "{case}: {name} shape");
            assert!(g.data == w.data, "{case}: {name} values differ");
        }
        if groupsize == 64 {
            assert!(log.contains("stay unquantized"), "{case}: {log}");
        }
    }
}

/// `ferrotune run quantize` of `model` into `dir/out` (f32, CPU) with the `quantizer` section's
/// lines (YAML under `quantizer:`).
fn run_quantize(dir: &Path, model: &Path, quantizer: &str) -> std::process::Output {
    let cfg = dir.join("q.yaml");
    std::fs::write(
        &cfg,
        format!(
            "output_dir: {}\ncheckpointer:\n  checkpoint_dir: {}\ndevice: cpu\ndtype: fp32\n\
             quantizer:\n{quantizer}",
            dir.join("out").display(),
            model.display()
        ),
    )
    .unwrap();
    ferrotune(
        &["run", "quantize", "--config", cfg.to_str().unwrap()],
        dir,
        &[],
    )
}

#[test]
fn quantize_refuses_what_it_cannot_write() {
    let dir = tmpdir("quantize", "refusals");
    let model = fixtures().join("models/llama3_2/model");
    for (quantizer, expect) in [
        (
            "torchtune.training.quantization.Int4WeightOnlyQuantizer",
            "tinygemm",
        ),
        ("torchao.quantization.Float8Quantizer", "not supported"),
    ] {
        let out = run_quantize(&dir, &model, &format!("  _component_: {quantizer}\n"));
        assert!(!out.status.success(), "{quantizer}");
        assert!(text(&out).contains(expect), "{quantizer}: {}", text(&out));
    }
    // A family torchtune's checkpointer has no conversion for.
    let out = run_quantize(
        &dir,
        &fixtures().join("models/qwen3/model"),
        "  _component_: torchtune.training.quantization.Int8DynActInt4WeightQuantizer\n  \
         groupsize: 32\n",
    );
    assert!(!out.status.success());
    assert!(text(&out).contains("'qwen3'"), "{}", text(&out));
}

#[test]
fn generate_runs_the_quantized_checkpoint_and_refuses_mismatches() {
    let dir = tmpdir("quantize", "generate");
    let model = fixtures().join("models/llama3_2/model");
    let out = run_quantize(
        &dir,
        &model,
        "  _component_: torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer\n  \
         groupsize: 32\n",
    );
    let q = dir.join("q.yaml");
    assert!(out.status.success(), "{}", text(&out));
    assert!(dir.join("out/config.json").is_file());
    assert!(dir.join("out/tokenizer.json").is_file());

    let generation = |checkpoint_dir: &std::path::Path, files: &str, quantizer: &str| {
        let g = dir.join("g.yaml");
        std::fs::write(
            &g,
            format!(
                "output_dir: {out}\ncheckpointer:\n  checkpoint_dir: {ckpt}\n  checkpoint_files: \
                 {files}\ntokenizer:\n  path: {model}\ndevice: cpu\ndtype: fp32\nseed: 1\n\
                 prompt: hello there\nmax_new_tokens: 6\ntemperature: 0.0\nquantizer: {quantizer}\n",
                out = dir.join("gen").display(),
                ckpt = checkpoint_dir.display(),
                model = model.display(),
            ),
        )
        .unwrap();
        ferrotune(
            &["run", "generate", "--config", g.to_str().unwrap()],
            &dir,
            &[],
        )
    };
    let quantizer =
        "{_component_: torchtune.training.quantization.Int8DynActInt4WeightQuantizer, groupsize: 32}";
    // torchtune's flow: the quantized file with the quantizer set.
    let out = generation(&dir.join("out"), "[model-8da4w.pt]", quantizer);
    assert!(out.status.success(), "{}", text(&out));
    // A quantizer with a float checkpoint: torchtune could not load it either.
    let out = generation(&model, "[model.safetensors]", quantizer);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("not a quantized checkpoint"),
        "{}",
        text(&out)
    );
    // Training from a quantized file is refused.
    let t = dir.join("t.yaml");
    std::fs::write(
        &t,
        format!(
            "output_dir: {}\ncheckpointer:\n  checkpoint_dir: {}\n  checkpoint_files: \
             [model-8da4w.pt]\ntokenizer:\n  path: {}\ndataset:\n  _component_: \
             torchtune.datasets.text_completion_dataset\n  source: text\n  data_files: {}\n\
             device: cpu\ndtype: fp32\nbatch_size: 1\nepochs: 1\noptimizer:\n  _component_: \
             torch.optim.SGD\n  lr: 0.1\n",
            dir.join("train").display(),
            dir.join("out").display(),
            model.display(),
            q.display()
        ),
    )
    .unwrap();
    let out = ferrotune(
        &[
            "run",
            "full_finetune_single_device",
            "--config",
            t.to_str().unwrap(),
        ],
        &dir,
        &[],
    );
    assert!(!out.status.success());
    assert!(
        text(&out).contains("quantized checkpoint"),
        "{}",
        text(&out)
    );
}
