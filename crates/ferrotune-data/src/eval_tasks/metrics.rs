//! Scoring: a document's metrics from its scores or generated response, a task's aggregate
//! metrics with their standard errors, and a group's metrics from its tasks'.

use std::collections::BTreeMap;

use minijinja::Environment;
use serde_json::{Map, Value};

use super::docs::{doc_str, TextOrIndex};
use super::functions::{py_word_count, template_env, truthfulqa_mc2};
use super::registry::{AggregateSpec, Selection};
use super::{metric_key, MetricResult, MetricSpec, OutputType, Scored, Target, TaskSpec};
use crate::error::{DataError, Result};

impl TaskSpec {
    /// The per-document metric values from the scores of its requests (in request order).
    pub fn doc_metrics(
        &self,
        doc: &Map<String, Value>,
        scores: &[Scored],
    ) -> Result<BTreeMap<String, f64>> {
        let env = template_env();
        let mut out = BTreeMap::new();
        match self.output_type {
            OutputType::GenerateUntil | OutputType::LoglikelihoodRolling => {
                return Err(DataError::Dataset(
                    "generate_until and loglikelihood_rolling tasks are scored by \
                     generated_metrics and rolling_metrics"
                        .into(),
                ))
            }
            OutputType::Loglikelihood => {
                let s = scores
                    .first()
                    .ok_or_else(|| DataError::Dataset("no score".into()))?;
                for m in &self.metrics {
                    let v = match m.name.as_str() {
                        "perplexity" => s.loglikelihood,
                        _ => f64::from(u8::from(s.is_greedy)),
                    };
                    out.insert(m.name.clone(), v);
                }
            }
            OutputType::MultipleChoice => {
                let lls: Vec<f64> = scores.iter().map(|s| s.loglikelihood).collect();
                if self.process_results.as_deref() == Some("truthfulqa.process_results_mc2") {
                    out.insert("acc".into(), truthfulqa_mc2(doc, &lls)?);
                    return Ok(out);
                }
                let choices = self.choices_of(env, doc)?;
                if choices.len() != lls.len() {
                    return Err(DataError::Dataset(format!(
                        "{} scores for {} choices",
                        lls.len(),
                        choices.len()
                    )));
                }
                let pred = argmax(&lls);
                let normed: Vec<f64> = lls
                    .iter()
                    .zip(&choices)
                    .map(|(ll, c)| ll / c.chars().count() as f64)
                    .collect();
                let pred_norm = argmax(&normed);
                let gold = match self.text_of(env, doc)? {
                    TextOrIndex::Index(i) => Target::Index(i),
                    TextOrIndex::Text(_) => self.target_of(env, doc)?,
                };
                let golds: Vec<i64> = match gold {
                    Target::Index(i) => vec![i],
                    Target::Indices(v) => v,
                    Target::Text(t) => vec![choices
                        .iter()
                        .position(|c| *c == t)
                        .map_or(-100, |p| p as i64)],
                    Target::Texts(v) => v
                        .iter()
                        .map(|t| {
                            choices
                                .iter()
                                .position(|c| c == t)
                                .map_or(-100, |p| p as i64)
                        })
                        .collect(),
                };
                let hit = |p: usize| f64::from(u8::from(golds.contains(&(p as i64))));
                for m in &self.metrics {
                    let v = if m.name == "acc_norm" {
                        hit(pred_norm)
                    } else {
                        hit(pred)
                    };
                    out.insert(m.name.clone(), v);
                }
            }
        }
        Ok(out)
    }

    /// A generate_until document's metrics from its response (cut at the stop strings): each
    /// filter's answer against the reference, keyed `metric,filter` (`metric` for filter
    /// `none`).
    pub fn generated_metrics(
        &self,
        doc: &Map<String, Value>,
        response: &str,
    ) -> Result<BTreeMap<String, f64>> {
        let env = template_env();
        let references = match self.target_of(env, doc)? {
            Target::Text(t) => vec![t],
            Target::Index(i) => vec![match &self.doc_to_choice {
                Some(_) => self
                    .choices_of(env, doc)?
                    .get(i as usize)
                    .cloned()
                    .unwrap_or_default(),
                None => i.to_string(),
            }],
            Target::Indices(v) => vec![v.first().map(i64::to_string).unwrap_or_default()],
            // The harness scores a list target as a hit when any answer matches.
            Target::Texts(v) => v,
        };
        let mut out = BTreeMap::new();
        for f in &self.filters {
            let answer = f.apply(response);
            let score = references
                .iter()
                .map(|r| self.exact_match.score(&answer, r))
                .fold(0.0, f64::max);
            for m in &self.metrics {
                out.insert(metric_key(&m.name, &f.name), score);
            }
        }
        Ok(out)
    }

    pub(super) fn rolling_text(
        &self,
        env: &Environment,
        doc: &Map<String, Value>,
    ) -> Result<String> {
        match self.target_of(env, doc)? {
            Target::Text(t) => Ok(t),
            other => Err(DataError::Dataset(format!(
                "a loglikelihood_rolling task's doc_to_target must be a text, got {other:?}"
            ))),
        }
    }

    /// A loglikelihood_rolling document's values from the log-likelihood of its whole text:
    /// the log-likelihood under each metric, and the word and byte counts they are divided by
    /// (`_words`, `_bytes`; of the original page for WikiText, as the harness counts them).
    pub fn rolling_metrics(
        &self,
        doc: &Map<String, Value>,
        loglikelihood: f64,
    ) -> Result<BTreeMap<String, f64>> {
        let counted = if self.process_results.as_deref() == Some("wikitext.process_results") {
            doc_str(doc, "page")?
        } else {
            self.rolling_text(template_env(), doc)?
        };
        let mut out = BTreeMap::new();
        for m in &self.metrics {
            out.insert(m.name.clone(), loglikelihood);
        }
        out.insert("_words".into(), py_word_count(&counted) as f64);
        out.insert("_bytes".into(), counted.len() as f64);
        Ok(out)
    }

    /// (metric, filter) pairs the task reports.
    fn metric_filters(&self) -> Vec<(&MetricSpec, &str)> {
        match self.output_type {
            OutputType::GenerateUntil => self
                .filters
                .iter()
                .flat_map(|f| self.metrics.iter().map(move |m| (m, f.name.as_str())))
                .collect(),
            _ => self.metrics.iter().map(|m| (m, "none")).collect(),
        }
    }

    /// The task's [`Outcome`]: [`TaskSpec::aggregate`] over its documents' values.
    pub fn outcome(&self, per_doc: &[BTreeMap<String, f64>]) -> Outcome {
        Outcome {
            metrics: self.aggregate(per_doc),
            docs: per_doc.len(),
        }
    }

    /// The task's metrics over all documents (`per_doc` from [`TaskSpec::doc_metrics`] or
    /// [`TaskSpec::generated_metrics`]).
    pub fn aggregate(&self, per_doc: &[BTreeMap<String, f64>]) -> Vec<MetricResult> {
        self.metric_filters()
            .into_iter()
            .map(|(m, filter)| {
                let key = metric_key(&m.name, filter);
                let values: Vec<f64> = per_doc
                    .iter()
                    .filter_map(|d| d.get(&key).copied())
                    .collect();
                let n = values.len() as f64;
                let mean = values.iter().sum::<f64>() / n;
                if self.output_type == OutputType::LoglikelihoodRolling {
                    // The harness's weighted means (its errors are bootstrapped: not run).
                    let total = |k: &str| per_doc.iter().filter_map(|d| d.get(k)).sum::<f64>();
                    let ll = values.iter().sum::<f64>();
                    let value = match m.name.as_str() {
                        "word_perplexity" => (-ll / total("_words")).exp(),
                        "byte_perplexity" => (-ll / total("_bytes")).exp(),
                        _ => -ll / total("_bytes") / std::f64::consts::LN_2,
                    };
                    return MetricResult {
                        name: m.name.clone(),
                        filter: filter.to_string(),
                        value,
                        stderr: None,
                        higher_is_better: m.higher_is_better,
                    };
                }
                if m.name == "perplexity" {
                    // The harness reports exp(-mean log-likelihood) and bootstraps its error.
                    return MetricResult {
                        name: m.name.clone(),
                        filter: filter.to_string(),
                        value: (-mean).exp(),
                        stderr: None,
                        higher_is_better: m.higher_is_better,
                    };
                }
                let stderr = (values.len() > 1).then(|| {
                    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
                    (var / n).sqrt()
                });
                MetricResult {
                    name: m.name.clone(),
                    filter: filter.to_string(),
                    value: mean,
                    stderr,
                    higher_is_better: m.higher_is_better,
                }
            })
            .collect()
    }
}

pub(super) fn argmax(values: &[f64]) -> usize {
    // numpy's argmax: the first of equal maxima.
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best
}

/// A task's or group's results: its metrics and how many documents they cover.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The metrics.
    pub metrics: Vec<MetricResult>,
    /// Documents evaluated (a group: of all its tasks).
    pub docs: usize,
}

/// Every group's metrics from its tasks' (`tasks`: task name → outcome), as the harness
/// aggregates them: each `aggregate_metric_list` metric the mean of the tasks' values weighted by
/// their document counts (or not, `weight_by_size: false`), the standard error pooled from the
/// tasks' (or `√Σse²/k` unweighted).
pub fn aggregate_groups(
    sel: &Selection,
    tasks: &BTreeMap<String, Outcome>,
) -> BTreeMap<String, Outcome> {
    let mut out = BTreeMap::new();
    for group in &sel.groups {
        let leaves: Vec<&Outcome> = sel
            .leaves(&group.name)
            .iter()
            .filter_map(|l| tasks.get(l))
            .collect();
        let docs = leaves.iter().map(|o| o.docs).sum();
        let mut metrics = Vec::new();
        for agg in &group.aggregate {
            // Each filter the tasks report this metric under (the harness discovers them).
            let mut filters: Vec<&str> = leaves
                .iter()
                .flat_map(|o| o.metrics.iter())
                .filter(|m| m.name == agg.metric)
                .map(|m| m.filter.as_str())
                .collect();
            filters.sort_unstable();
            filters.dedup();
            for filter in filters {
                if let Some(m) = aggregate_metric(agg, filter, &leaves) {
                    metrics.push(m);
                }
            }
        }
        out.insert(group.name.clone(), Outcome { metrics, docs });
    }
    out
}

/// One group metric over its tasks' `(metric, filter)` values.
fn aggregate_metric(
    agg: &AggregateSpec,
    filter: &str,
    leaves: &[&Outcome],
) -> Option<MetricResult> {
    let found: Vec<(&MetricResult, usize)> = leaves
        .iter()
        .filter_map(|o| {
            o.metrics
                .iter()
                .find(|m| m.name == agg.metric && m.filter == filter)
                .map(|m| (m, o.docs))
        })
        .collect();
    if found.is_empty() {
        return None;
    }
    let weight = |n: usize| if agg.weight_by_size { n as f64 } else { 1.0 };
    let total: f64 = found.iter().map(|(_, n)| weight(*n)).sum();
    let value = found.iter().map(|(m, n)| m.value * weight(*n)).sum::<f64>() / total;
    let stderrs: Option<Vec<f64>> = found.iter().map(|(m, _)| m.stderr).collect();
    let stderr = stderrs.and_then(|se| {
        let k = se.len() as f64;
        if agg.weight_by_size {
            let n_all: f64 = found.iter().map(|(_, n)| *n as f64).sum();
            let pooled: f64 = found
                .iter()
                .zip(&se)
                .map(|((_, n), e)| (*n as f64 - 1.0) * e * e * *n as f64)
                .sum::<f64>()
                / (n_all - k);
            let v = (pooled / n_all).sqrt();
            v.is_finite().then_some(v)
        } else {
            Some(se.iter().map(|e| e * e).sum::<f64>().sqrt() / k)
        }
    });
    Some(MetricResult {
        name: agg.metric.clone(),
        filter: filter.to_string(),
        value,
        stderr,
        higher_is_better: found[0].0.higher_is_better,
    })
}
