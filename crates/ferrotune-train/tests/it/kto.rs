//! KTO against TRL 1.16.0's own `KTOTrainer` (scripts/make_kto_fixtures.py): the tiny Llama with
//! its PEFT adapter, the reference with the adapter disabled, four unpaired rows (two desirable,
//! two undesirable) in one batch with TRL's mismatched KL rows, one SGD step (lr 1, no clipping,
//! constant schedule). For `kto` (two weightings) and `apo_zero_unpaired`: TRL's logged loss and
//! metrics, and the adapter after the step.

use candle_core::{DType, Device, Tensor};
use ferrotune_data::dataset::{collate, Row};
use ferrotune_data::Tokenizer;
use ferrotune_models::{load_adapter, load_model};
use ferrotune_train::kto::{
    kl_clamped, kl_mean, kto_loss, kto_metrics, kto_terms, mismatched_rows, tokenize_unpaired,
    unpaired_order, KtoLoss, KtoLossType,
};
use ferrotune_train::step::{reference_log_probs, sequence_log_probs, MicroBatch};
use serde_json::Value;

use crate::common;
use common::{json, rel_l2};

use ferrotune_testing::fixtures;

/// TRL's collated rows: the real tokens, labelled where the completion mask is 1.
fn rows(batch: &Value, prefix: &str) -> Vec<Row> {
    let get = |k: &str| -> Vec<Vec<i64>> {
        serde_json::from_value(batch[format!("{prefix}{k}")].clone()).unwrap()
    };
    let (ids, mask, completion) = (
        get("input_ids"),
        get("attention_mask"),
        get("completion_mask"),
    );
    (0..ids.len())
        .map(|i| {
            let len = mask[i].iter().filter(|&&m| m == 1).count();
            let input: Vec<u32> = ids[i][..len].iter().map(|&t| t as u32).collect();
            let labels = (0..len)
                .map(|j| match completion[i][j] {
                    1 => ids[i][j],
                    _ => -100,
                })
                .collect();
            Row::new(input, labels)
        })
        .collect()
}

fn micro_batch(rows: &[Row], pad: u32) -> MicroBatch {
    let refs: Vec<&Row> = rows.iter().collect();
    MicroBatch::from_batch(&collate(&refs, pad), &Device::Cpu).unwrap()
}

#[test]
fn kto_loss_metrics_and_one_sgd_step_match_trl_kto_trainer() {
    let want = json(fixtures().join("kto/golden.json"));
    assert_eq!(want["trl"], "1.16.0");
    let pad = want["pad_token_id"].as_u64().unwrap() as u32;
    for case in ["kto", "kto_weighted", "apo_zero_unpaired"] {
        let w = &want[case];
        let loss = KtoLoss::from_params(
            w["beta"].as_f64(),
            w["desirable_weight"].as_f64(),
            w["undesirable_weight"].as_f64(),
            w["loss_type"].as_str(),
        )
        .unwrap();
        let main = rows(&w["batch"], "");
        let desirable: Vec<bool> = w["batch"]["label"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_bool().unwrap())
            .collect();
        let mut model = load_model(&fixtures().join("llama3/model"), DType::F32, &Device::Cpu)
            .unwrap()
            .0;
        load_adapter(&mut model, &fixtures().join("llama3/adapter")).unwrap();
        let params = ferrotune_models::peft::trainable_parameters(&mut model).unwrap();
        ferrotune_models::lora::set_training(&mut model, true);
        let batch = micro_batch(&main, pad);
        let reference = ferrotune_models::peft::with_adapters_disabled(&mut model, |m| {
            reference_log_probs(m, &batch)
        })
        .unwrap();
        let kl = match loss.calculate_kl() {
            true => {
                // TRL's KL rows, rebuilt from its (prompt, completion) split and checked
                // against what its collator gave.
                let split: Vec<(Vec<u32>, Vec<u32>)> = main
                    .iter()
                    .map(|r| {
                        let start = r.labels.iter().position(|&l| l != -100).unwrap();
                        (r.input_ids[..start].to_vec(), r.input_ids[start..].to_vec())
                    })
                    .collect();
                let kl_rows: Vec<Row> = mismatched_rows(&split)
                    .into_iter()
                    .map(|(p, c)| {
                        let labels = (0..p.len())
                            .map(|_| -100)
                            .chain(c.iter().map(|&t| t as i64))
                            .collect();
                        Row::new([p, c].concat(), labels)
                    })
                    .collect();
                let trl_kl = rows(&w["batch"], "KL_");
                for (a, b) in kl_rows.iter().zip(&trl_kl) {
                    assert_eq!((&a.input_ids, &a.labels), (&b.input_ids, &b.labels));
                }
                let kl_batch = micro_batch(&kl_rows, pad);
                let kl_ref = ferrotune_models::peft::with_adapters_disabled(&mut model, |m| {
                    reference_log_probs(m, &kl_batch)
                })
                .unwrap();
                let kl_policy = reference_log_probs(&model, &kl_batch).unwrap();
                kl_clamped(kl_mean(&kl_policy, &kl_ref).unwrap())
            }
            false => 0.0,
        };
        let hidden = model
            .forward_hidden(&batch.input_ids, &batch.layout, None)
            .unwrap();
        let policy = sequence_log_probs(&hidden, &model, &batch.labels).unwrap();
        let terms = kto_terms(&policy, &reference, &desirable, kl, loss).unwrap();
        let n = desirable.len() as f64;
        let mean = (&terms.total / n).unwrap();
        let got_loss = mean.to_scalar::<f32>().unwrap() as f64;
        let log = &w["log"];
        let wl = log["loss"].as_f64().unwrap();
        assert!(
            ((got_loss - wl) / wl).abs() < 1e-5,
            "{case}: loss {got_loss} vs {wl}"
        );
        for (key, got) in kto_metrics(terms.chosen, terms.rejected, kl) {
            let wv = log[key].as_f64().unwrap();
            // Rewards and the KL are differences of f32 log probabilities near -50 (an ulp is
            // 3.8e-6): a few of their ulps, scaled by β for the rewards.
            let tol = 2e-5 * wv.abs().max(1.0);
            assert!((got - wv).abs() <= tol, "{case}: {key} {got} vs {wv}");
        }
        // One SGD step, lr 1: the adapter minus the gradient equals TRL's adapter after its step.
        let grads = mean.backward().unwrap();
        let after = candle_core::safetensors::load(
            fixtures().join(format!("kto/{case}_adapter.safetensors")),
            &Device::Cpu,
        )
        .unwrap();
        assert_eq!(after.len(), params.len());
        let (mut worst, mut worst_step): (f32, f32) = (0.0, 0.0);
        for (pname, var) in &params {
            let grad = grads.get(var.as_tensor()).unwrap();
            let stepped: Tensor = (var.as_tensor() - grad).unwrap();
            let err = rel_l2(&stepped, &after[pname]);
            // The step moved the adapter by the gradient: compare the move too (TRL's, recovered
            // as before − after in f32, carries the rounding of that subtraction: ~2e-5).
            let moved = (var.as_tensor() - &after[pname]).unwrap();
            let gerr = rel_l2(grad, &moved);
            assert!(err < 1e-5, "{case}: {pname}: adapter relative L2 {err}");
            assert!(gerr < 1e-4, "{case}: {pname}: step relative L2 {gerr}");
            worst = worst.max(err);
            worst_step = worst_step.max(gerr);
        }
        eprintln!(
            "{case}: loss relative error {:.1e}, kl {kl}, worst adapter relative L2 {worst:.1e}, \
             worst step (gradient) relative L2 {worst_step:.1e}",
            ((got_loss - wl) / wl).abs()
        );
    }
}

#[test]
fn kto_loss_reads_trl_defaults_and_refuses_unknown_types() {
    let d = KtoLoss::from_params(None, None, None, None).unwrap();
    assert_eq!(d, KtoLoss::default());
    assert_eq!((d.beta, d.loss_type), (0.1, KtoLossType::Kto));
    assert!(d.calculate_kl());
    let apo = KtoLoss::from_params(None, None, None, Some("apo_zero_unpaired")).unwrap();
    assert!(!apo.calculate_kl());
    let err = KtoLoss::from_params(None, None, None, Some("bco")).unwrap_err();
    assert!(err.to_string().contains("bco"), "{err}");
    // TRL's rotation: row i takes row i - 1's completion, row 0 the last row's.
    let rows = vec![
        (vec![1], vec![10]),
        (vec![2], vec![20]),
        (vec![3], vec![30]),
    ];
    let m = mismatched_rows(&rows);
    assert_eq!(
        m,
        vec![
            (vec![1], vec![30]),
            (vec![2], vec![10]),
            (vec![3], vec![20])
        ]
    );
}

#[test]
fn unpaired_text_rows_tokenize_as_trl_kto_trainer() {
    let want = json(fixtures().join("kto/golden.json"));
    let tok = Tokenizer::from_dir(fixtures().join("llama3/model")).unwrap();
    let trl = rows(&want["kto"]["batch"], "");
    let text = &want["rows"];
    for (i, row) in trl.iter().enumerate() {
        let (prompt, completion) = tokenize_unpaired(
            &tok,
            text["prompt"][i].as_str().unwrap(),
            text["completion"][i].as_str().unwrap(),
        )
        .unwrap();
        let start = row.labels.iter().position(|&l| l != -100).unwrap();
        assert_eq!(prompt, row.input_ids[..start], "row {i}: prompt");
        assert_eq!(completion, row.input_ids[start..], "row {i}: completion");
    }
}

/// TRL's `unpair_preference_dataset` on 2,345 pairs (scripts/make_kto_unpair_fixture.py): per
/// 1000-pair map batch, its chosen rows then its rejected ones.
#[test]
fn unpaired_order_is_trls() {
    let want = json(fixtures().join("kto/unpair_order.json"));
    assert_eq!(want["trl_version"], "1.16.0");
    let pairs = want["pairs"].as_u64().unwrap() as usize;
    let rows: Vec<(usize, bool)> = serde_json::from_value(want["rows"].clone()).unwrap();
    assert_eq!(unpaired_order(pairs), rows);
    assert_eq!(unpaired_order(0), vec![]);
    assert_eq!(
        unpaired_order(2),
        vec![(0, true), (1, true), (0, false), (1, false)]
    );
}

/// `loss._component_: torchtune.rlhf.loss.KTOLoss` with TRL's keys and defaults; another loss is
/// not KTO; a key KTOLoss does not take, an unknown `loss_type` or a bad value is an error
/// naming it.
#[test]
fn kto_loss_section_parses_and_names_wrong_keys() {
    let cfg = |yaml: &str| ferrotune_train::config::Config {
        root: ferrotune_train::config::parse_yaml(yaml, "kto.yaml").unwrap(),
        origin: "kto.yaml".into(),
    };
    let parse = |yaml: &str| kto_loss(&cfg(yaml));
    let c = "loss:\n  _component_: torchtune.rlhf.loss.KTOLoss\n";
    assert_eq!(parse(c).unwrap(), Some(KtoLoss::default()));
    let all = format!(
        "{c}  beta: 0.5\n  desirable_weight: 1.5\n  undesirable_weight: 0.5\n  \
         loss_type: apo_zero_unpaired\n"
    );
    assert_eq!(
        parse(&all).unwrap(),
        Some(KtoLoss {
            beta: 0.5,
            desirable_weight: 1.5,
            undesirable_weight: 0.5,
            loss_type: KtoLossType::ApoZeroUnpaired,
        })
    );
    let modules = "loss:\n  _component_: torchtune.modules.rlhf.loss.KTOLoss\n";
    assert!(parse(modules).unwrap().is_some());
    assert_eq!(
        parse("loss:\n  _component_: torchtune.rlhf.loss.DPOLoss\n  beta: 0.1\n").unwrap(),
        None
    );
    assert_eq!(parse("output_dir: /tmp\n").unwrap(), None);
    let err = |yaml: String| parse(&yaml).unwrap_err().to_string();
    let e = err(format!("{c}  label_smoothing: 0.1\n"));
    assert!(
        e.contains("loss.label_smoothing") && e.contains("KTOLoss"),
        "{e}"
    );
    assert!(e.contains("desirable_weight"), "{e}");
    let e = err(format!("{c}  loss_type: sigmoid\n"));
    assert!(
        e.contains("sigmoid") && e.contains("apo_zero_unpaired"),
        "{e}"
    );
    assert!(err(format!("{c}  beta: 0\n")).contains("loss.beta"));
    assert!(err(format!("{c}  undesirable_weight: -1\n")).contains("loss.undesirable_weight"));
    assert!(err(format!("{c}  beta: fast\n")).contains("loss.beta"));
}

/// `ferrotune.datasets.unpaired_dataset` on TRL's conversational paired rows (prompt, chosen,
/// rejected as message lists): the rows `KTOTrainer` prepared (scripts/make_kto_fixtures.py) —
/// unpaired in TRL's order, each side through the chat template — and, in one batch, the KL rows
/// rotated by one; with `apo_zero_unpaired` no KL rows.
#[test]
fn unpaired_dataset_reads_conversational_pairs_as_trl() {
    use ferrotune_train::recipe::kit::unpaired::UnpairedData;
    let want = json(fixtures().join("kto/golden.json"));
    let conv = &want["conversational"];
    let dir = ferrotune_testing::fresh_dir(&format!("ferrotune-kto-conv-{}", std::process::id()));
    let rows = &conv["rows"];
    let lines: Vec<String> = (0..2)
        .map(|i| {
            serde_json::json!({
                "prompt": rows["prompt"][i],
                "chosen": rows["chosen"][i],
                "rejected": rows["rejected"][i],
            })
            .to_string()
        })
        .collect();
    let data = dir.join("pairs.jsonl");
    std::fs::write(&data, lines.join("\n") + "\n").unwrap();
    let yaml = format!(
        "tokenizer:\n  path: {}\ndataset:\n  _component_: ferrotune.datasets.unpaired_dataset\n  \
         source: json\n  data_files: {}\n",
        fixtures().join("llama3/model").display(),
        data.display()
    );
    let cfg = ferrotune_train::config::Config {
        root: ferrotune_train::config::parse_yaml(&yaml, "kto.yaml").unwrap(),
        origin: "kto.yaml".into(),
    };
    let tok = Tokenizer::from_dir(fixtures().join("llama3/model")).unwrap();
    let built = UnpairedData::build(&cfg, &tok, None, KtoLoss::default()).unwrap();
    let ids = |v: &Value| -> Vec<Vec<u32>> { serde_json::from_value(v.clone()).unwrap() };
    let (prompts, completions) = (ids(&conv["prompt_ids"]), ids(&conv["completion_ids"]));
    let labels: Vec<bool> = serde_json::from_value(conv["label"].clone()).unwrap();
    assert_eq!(built.rows.len(), 4);
    for (i, r) in built.rows.iter().enumerate() {
        assert_eq!(r.prompt, prompts[i], "row {i}: prompt");
        assert_eq!(r.completion, completions[i], "row {i}: completion");
        assert_eq!(r.desirable, labels[i], "row {i}: label");
    }
    let batch = built.micro_batch(0..4, 3, &Device::Cpu).unwrap();
    assert_eq!(batch.num_targets, 4);
    let p = batch.preference.as_ref().unwrap();
    let u = p.unpaired.as_ref().unwrap();
    assert_eq!(u.desirable, labels);
    let kl = u.kl_rows.as_ref().unwrap();
    let kl_ids: Vec<Vec<u32>> = kl.input_ids.to_vec2().unwrap();
    for i in 0..4 {
        let want = [prompts[i].clone(), completions[(i + 3) % 4].clone()].concat();
        assert_eq!(kl_ids[i][..want.len()], want[..], "KL row {i}");
    }
    let apo = KtoLoss {
        loss_type: KtoLossType::ApoZeroUnpaired,
        ..KtoLoss::default()
    };
    let built = UnpairedData::build(&cfg, &tok, None, apo).unwrap();
    let batch = built.micro_batch(0..4, 3, &Device::Cpu).unwrap();
    let p = batch.preference.unwrap();
    assert!(p.unpaired.unwrap().kl_rows.is_none());
    // TRL's `max_length`: rows whose prompt fills it are dropped (here the 20-token prompts), the
    // others cut to it.
    let cfg = ferrotune_train::config::Config {
        root: ferrotune_train::config::parse_yaml(
            &format!("{yaml}  max_seq_len: 20\n"),
            "kto.yaml",
        )
        .unwrap(),
        origin: "kto.yaml".into(),
    };
    let built = UnpairedData::build(&cfg, &tok, None, KtoLoss::default()).unwrap();
    let kept: Vec<usize> = (0..4).filter(|&i| prompts[i].len() < 20).collect();
    assert_eq!(kept.len(), 2);
    assert_eq!(built.rows.len(), 2);
    let batch = built.micro_batch(0..2, 3, &Device::Cpu).unwrap();
    let got: Vec<Vec<u32>> = batch.input_ids.to_vec2().unwrap();
    for (row, &i) in got.iter().zip(&kept) {
        let full = [prompts[i].clone(), completions[i].clone()].concat();
        assert_eq!(row[..], full[..20], "row {i}");
    }
}

/// Paired rows without a prompt column, text and conversational: the prompt is TRL's
/// `extract_prompt` (the common prefix; for text less the space before the first difference),
/// then the rows are unpaired and tokenized as `KTOTrainer` prepared them.
#[test]
fn unpaired_dataset_extracts_implicit_prompts_as_trl() {
    use ferrotune_train::recipe::kit::unpaired::UnpairedData;
    let want = json(fixtures().join("kto/golden.json"));
    let tok = Tokenizer::from_dir(fixtures().join("llama3/model")).unwrap();
    let dir =
        ferrotune_testing::fresh_dir(&format!("ferrotune-kto-implicit-{}", std::process::id()));
    for case in ["implicit_text", "implicit_conversational"] {
        let w = &want[case];
        let rows = &w["rows"];
        let lines: Vec<String> = (0..2)
            .map(|i| {
                serde_json::json!({"chosen": rows["chosen"][i], "rejected": rows["rejected"][i]})
                    .to_string()
            })
            .collect();
        let data = dir.join(format!("{case}.jsonl"));
        std::fs::write(&data, lines.join("\n") + "\n").unwrap();
        let yaml = format!(
            "dataset:\n  _component_: ferrotune.datasets.unpaired_dataset\n  source: json\n  \
             data_files: {}\n",
            data.display()
        );
        let cfg = ferrotune_train::config::Config {
            root: ferrotune_train::config::parse_yaml(&yaml, "kto.yaml").unwrap(),
            origin: "kto.yaml".into(),
        };
        let built = UnpairedData::build(&cfg, &tok, None, KtoLoss::default()).unwrap();
        let ids = |v: &Value| -> Vec<Vec<u32>> { serde_json::from_value(v.clone()).unwrap() };
        let (prompts, completions) = (ids(&w["prompt_ids"]), ids(&w["completion_ids"]));
        let labels: Vec<bool> = serde_json::from_value(w["label"].clone()).unwrap();
        assert_eq!(built.rows.len(), 4, "{case}");
        for (i, r) in built.rows.iter().enumerate() {
            assert_eq!(r.prompt, prompts[i], "{case} row {i}: prompt");
            assert_eq!(r.completion, completions[i], "{case} row {i}: completion");
            assert_eq!(r.desirable, labels[i], "{case} row {i}: label");
        }
    }
}

/// Paired conversational rows with a `tools` column (JSON text) and assistant `tool_calls` /
/// `tool` turns, with the real qwen3 tokenizer: unpaired and tokenized as TRL 1.16.0's
/// `KTOTrainer` prepared them, the template given each row's tools
/// (tests/fixtures/orpo_trainer/tools_golden.json, scripts/make_orpo_trainer_fixtures.py).
#[test]
fn unpaired_dataset_renders_tools_as_trl() {
    use ferrotune_train::recipe::kit::unpaired::UnpairedData;
    let want = json(fixtures().join("orpo_trainer/tools_golden.json"));
    assert_eq!(want["trl"], "1.16.0");
    let w = &want["kto"];
    let tok = Tokenizer::from_dir(ferrotune_data::asset_path("tokenizers/qwen3").unwrap()).unwrap();
    let yaml = format!(
        "dataset:\n  _component_: ferrotune.datasets.unpaired_dataset\n  source: json\n  \
         data_files: {}\n",
        fixtures().join("orpo_trainer/tools.jsonl").display()
    );
    let cfg = ferrotune_train::config::Config {
        root: ferrotune_train::config::parse_yaml(&yaml, "kto.yaml").unwrap(),
        origin: "kto.yaml".into(),
    };
    let built = UnpairedData::build(&cfg, &tok, None, KtoLoss::default()).unwrap();
    let ids = |v: &Value| -> Vec<Vec<u32>> { serde_json::from_value(v.clone()).unwrap() };
    let (prompts, completions) = (ids(&w["prompt_ids"]), ids(&w["completion_ids"]));
    let labels: Vec<bool> = serde_json::from_value(w["label"].clone()).unwrap();
    assert_eq!(built.rows.len(), 4);
    for (i, r) in built.rows.iter().enumerate() {
        assert_eq!(r.prompt, prompts[i], "row {i}: prompt");
        assert_eq!(r.completion, completions[i], "row {i}: completion");
        assert_eq!(r.desirable, labels[i], "row {i}: label");
    }
}
