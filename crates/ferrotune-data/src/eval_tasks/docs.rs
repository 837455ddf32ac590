//! A task's documents and the requests they make: loading the split, few-shot examples, and
//! `doc_to_text`/`doc_to_target`/`doc_to_choice` for each document.

use std::path::Path;

use minijinja::Environment;
use serde_json::{Map, Value};

use super::functions::{hellaswag_doc, render, template_env, wikitext_detokenize};
use super::{
    limit_count, parse_python_literal, DocField, DocRequests, FewshotSampler, OutputType, PyRandom,
    Target, TaskSpec,
};
use crate::error::{texts, DataError, Result};

impl TaskSpec {
    /// The documents evaluated: the split's rows (relative `data_files` are resolved against
    /// `base_dir`), through `process_docs`, the first `limit` of them.
    pub fn load_docs(
        &self,
        base_dir: &Path,
        limit: Option<f64>,
    ) -> Result<Vec<Map<String, Value>>> {
        let rows = crate::dataset::load_source(&self.source_section(), base_dir)
            .map_err(|e| DataError::Dataset(format!("task '{}': {e}", self.name)))?;
        let mut docs = self.processed(rows)?;
        if let Some(n) = limit_count(limit, docs.len()) {
            docs.truncate(n);
        }
        Ok(docs)
    }

    /// The documents few-shot examples are drawn from (none without `num_fewshot`): the
    /// `fewshot_split`, else the training, validation or test split, through `process_docs`.
    pub fn load_fewshot_docs(&self, base_dir: &Path) -> Result<Vec<Map<String, Value>>> {
        if self.num_fewshot == 0 {
            return Ok(Vec::new());
        }
        let split = self
            .fewshot_split
            .clone()
            .or(self.training_split.clone())
            .or(self.validation_split.clone())
            .or(self.test_split.clone())
            .unwrap_or_else(|| self.split.clone());
        let mut section = self.source_section();
        section["split"] = Value::String(split.clone());
        let rows = crate::dataset::load_source(&section, base_dir).map_err(|e| {
            DataError::Dataset(format!(
                "task '{}': few-shot split '{split}': {e}",
                self.name
            ))
        })?;
        self.processed(rows)
    }

    /// `rows` through the task's `process_docs`.
    fn processed(&self, rows: Vec<Map<String, Value>>) -> Result<Vec<Map<String, Value>>> {
        match self.process_docs.as_deref() {
            Some("hellaswag.process_docs") => {
                rows.iter().map(|d| hellaswag_doc(d, &self.name)).collect()
            }
            _ => Ok(rows),
        }
    }

    /// The requests of every document: (context, continuation) pairs, or for generate_until
    /// one (context, "") each. With `num_fewshot`, each context starts with examples from
    /// `fewshot_docs` ([`TaskSpec::load_fewshot_docs`]) drawn as the harness draws them.
    pub fn requests(
        &self,
        docs: &[Map<String, Value>],
        fewshot_docs: &[Map<String, Value>],
    ) -> Result<Vec<DocRequests>> {
        let env = template_env();
        if self.num_fewshot > 0 && fewshot_docs.len() < self.num_fewshot {
            return Err(DataError::Dataset(format!(
                "task '{}': num_fewshot {} but the few-shot split has {} documents",
                self.name,
                self.num_fewshot,
                fewshot_docs.len()
            )));
        }
        // One generator per task, drawing for each document in order (the harness's sampler).
        let mut rng = PyRandom::new(1234);
        // An example equal to the document is left out when the examples come from its split.
        let exclude = self.fewshot_split == self.test_split;
        docs.iter()
            .enumerate()
            .map(|(doc_id, doc)| {
                let examples = self
                    .examples(env, doc, fewshot_docs, exclude, &mut rng)
                    .map_err(|e| self.doc_error(doc_id, e))?;
                let requests = self
                    .doc_requests(env, doc, &examples)
                    .map_err(|e| self.doc_error(doc_id, e))?;
                Ok(DocRequests { doc_id, requests })
            })
            .collect()
    }

    /// The few-shot text before `doc`'s question: each example's question, the target
    /// delimiter, its answer, then the few-shot delimiter.
    fn examples(
        &self,
        env: &Environment,
        doc: &Map<String, Value>,
        pool: &[Map<String, Value>],
        exclude: bool,
        rng: &mut PyRandom,
    ) -> Result<String> {
        let n = self.num_fewshot;
        if n == 0 {
            return Ok(String::new());
        }
        let picked: Vec<&Map<String, Value>> = match self.fewshot_sampler {
            FewshotSampler::FirstN => pool
                .iter()
                .filter(|d| !(exclude && *d == doc))
                .take(n)
                .collect(),
            FewshotSampler::Random => {
                let draw = if exclude { n + 1 } else { n };
                let mut chosen: Vec<&Map<String, Value>> = rng
                    .sample(pool.len(), draw.min(pool.len()))
                    .into_iter()
                    .map(|i| &pool[i])
                    .filter(|d| !(exclude && *d == doc))
                    .collect();
                chosen.truncate(n);
                chosen
            }
        };
        let mut out = String::new();
        for ex in picked {
            let choices = match &self.doc_to_choice {
                Some(_) => Some(self.choices_of(env, ex)?),
                None => None,
            };
            let question = match self.text_of(env, ex)? {
                TextOrIndex::Text(t) => t,
                TextOrIndex::Index(i) => choices
                    .as_ref()
                    .and_then(|c| c.get(i as usize).cloned())
                    .ok_or_else(|| {
                        DataError::Dataset(format!("example input index {i} out of range"))
                    })?,
            };
            let answer = match self.target_of(env, ex)? {
                Target::Text(t) => t,
                Target::Index(i) => match &choices {
                    Some(c) => c.get(i as usize).cloned().ok_or_else(|| {
                        DataError::Dataset(format!("example answer index {i} out of range"))
                    })?,
                    None => i.to_string(),
                },
                Target::Indices(v) => {
                    let i = v.first().copied().unwrap_or(0);
                    match &choices {
                        Some(c) => c.get(i as usize).cloned().unwrap_or_default(),
                        None => i.to_string(),
                    }
                }
                // The harness writes a list target's first answer.
                Target::Texts(v) => v.first().cloned().unwrap_or_default(),
            };
            out.push_str(&question);
            if !answer.is_empty() {
                out.push_str(&self.fewshot_target_delimiter);
                out.push_str(&answer);
                out.push_str(&self.fewshot_delimiter);
            }
        }
        Ok(out)
    }

    fn doc_error(&self, doc_id: usize, e: DataError) -> DataError {
        DataError::Dataset(format!("task '{}', document {doc_id}: {e}", self.name))
    }

    fn doc_requests(
        &self,
        env: &Environment,
        doc: &Map<String, Value>,
        examples: &str,
    ) -> Result<Vec<(String, String)>> {
        let description = format!("{}{examples}", render(env, &self.description, doc)?);
        let text = self.text_of(env, doc)?;
        match self.output_type {
            OutputType::GenerateUntil => {
                let TextOrIndex::Text(ctx) = text else {
                    return Err(DataError::Dataset("doc_to_text gave an index".into()));
                };
                Ok(vec![(format!("{description}{ctx}"), String::new())])
            }
            // The whole target is scored; the harness ignores the context here.
            OutputType::LoglikelihoodRolling => {
                Ok(vec![(String::new(), self.rolling_text(env, doc)?)])
            }
            OutputType::Loglikelihood => {
                let TextOrIndex::Text(ctx) = text else {
                    return Err(DataError::Dataset("doc_to_text gave an index".into()));
                };
                let cont = match self.target_of(env, doc)? {
                    Target::Text(t) => t,
                    Target::Index(i) => i.to_string(),
                    Target::Indices(_) | Target::Texts(_) => {
                        return Err(DataError::Dataset(
                            "a loglikelihood task's doc_to_target must be a text".into(),
                        ))
                    }
                };
                Ok(vec![(format!("{description}{ctx}"), cont)])
            }
            OutputType::MultipleChoice => {
                let choices = self.choices_of(env, doc)?;
                match text {
                    // Several inputs: each choice is a context; the target follows each.
                    TextOrIndex::Index(_) => {
                        let cont = match self.target_of(env, doc)? {
                            Target::Text(t) => t,
                            other => {
                                return Err(DataError::Dataset(format!(
                                    "with an index from doc_to_text, doc_to_target must be a text, got {other:?}"
                                )))
                            }
                        };
                        Ok(choices
                            .iter()
                            .map(|c| {
                                (
                                    format!("{description}{c}"),
                                    format!("{}{cont}", self.target_delimiter),
                                )
                            })
                            .collect())
                    }
                    TextOrIndex::Text(ctx) => Ok(choices
                        .iter()
                        .map(|c| {
                            (
                                format!("{description}{ctx}"),
                                format!("{}{c}", self.target_delimiter),
                            )
                        })
                        .collect()),
                }
            }
        }
    }

    pub(super) fn text_of(
        &self,
        env: &Environment,
        doc: &Map<String, Value>,
    ) -> Result<TextOrIndex> {
        match &self.doc_to_text {
            DocField::Int(i) => Ok(TextOrIndex::Index(*i)),
            DocField::Function(f) if f == "winogrande.doc_to_text" => {
                let answer = doc_str(doc, "answer")?;
                match answer.as_str() {
                    "1" => Ok(TextOrIndex::Index(0)),
                    "2" => Ok(TextOrIndex::Index(1)),
                    other => Err(DataError::Dataset(format!(
                        "winogrande: 'answer' must be \"1\" or \"2\", got {other:?}"
                    ))),
                }
            }
            DocField::Function(f) if f == "copa.doc_to_text" => {
                let connector = match doc_str(doc, "question")?.as_str() {
                    "cause" => "because",
                    "effect" => "therefore",
                    other => {
                        return Err(DataError::Dataset(format!(
                            "copa: 'question' must be \"cause\" or \"effect\", got {other:?}"
                        )))
                    }
                };
                // The premise without its final character (its period).
                let premise = doc_str(doc, "premise")?;
                let premise = crate::chat_template::py_strip(&premise, None, true, true);
                let mut chars = premise.chars();
                chars.next_back();
                Ok(TextOrIndex::Text(format!("{} {connector}", chars.as_str())))
            }
            DocField::Function(f) if f == "logiqa.doc_to_text" => {
                let mut prompt = format!(
                    "Passage: {}\nQuestion: {}\nChoices:\n",
                    doc_str(doc, "context")?,
                    doc_str(doc, "question")?
                );
                for (letter, option) in ["A", "B", "C", "D"].iter().zip(doc_strs(doc, "options")?) {
                    prompt.push_str(&format!("{letter}. {option}\n"));
                }
                prompt.push_str("Answer:");
                Ok(TextOrIndex::Text(prompt))
            }
            DocField::Function(f) => {
                Err(DataError::Dataset(format!("{f} cannot give doc_to_text")))
            }
            DocField::List(_) => Err(DataError::Dataset("doc_to_text cannot be a list".into())),
            DocField::Text(t) => {
                if let Some(v) = doc.get(t) {
                    return match v {
                        Value::String(s) => Ok(TextOrIndex::Text(s.clone())),
                        Value::Number(n) if n.is_i64() => {
                            Ok(TextOrIndex::Index(n.as_i64().unwrap_or(0)))
                        }
                        other => Err(DataError::Dataset(format!(
                            "doc_to_text: column '{t}' holds {other}, not a text"
                        ))),
                    };
                }
                let s = render(env, t, doc)?;
                if self.doc_to_choice.is_some() && is_py_digit(&s) {
                    return Ok(TextOrIndex::Index(parse_index(&s)?));
                }
                Ok(TextOrIndex::Text(s))
            }
        }
    }

    pub(super) fn target_of(&self, env: &Environment, doc: &Map<String, Value>) -> Result<Target> {
        match &self.doc_to_target {
            DocField::Int(i) => Ok(Target::Index(*i)),
            DocField::List(items) => Ok(Target::Text(items.first().cloned().unwrap_or_default())),
            DocField::Function(f) if f == "wikitext.detokenizer" => {
                Ok(Target::Text(wikitext_detokenize(&doc_str(doc, "page")?)))
            }
            DocField::Function(f) if f == "winogrande.doc_to_target" => {
                let sentence = doc_str(doc, "sentence")?;
                let idx = blank_index(&sentence)?;
                Ok(Target::Text(sentence[idx + 1..].trim().to_string()))
            }
            DocField::Function(f) if f == "copa.doc_to_target" => {
                let choice = match doc.get("label").and_then(Value::as_i64) {
                    Some(0) => doc_str(doc, "choice1")?,
                    _ => doc_str(doc, "choice2")?,
                };
                Ok(Target::Text(format!(" {}", copa_choice(&choice))))
            }
            DocField::Function(f) if f == "logiqa.doc_to_target" => {
                let label = doc_str(doc, "label")?;
                let index = ["a", "b", "c", "d"]
                    .iter()
                    .position(|l| *l == crate::chat_template::py_strip(&label, None, true, true))
                    .ok_or_else(|| {
                        DataError::Dataset(format!(
                            "logiqa: 'label' must be one of a, b, c, d, got {label:?}"
                        ))
                    })?;
                Ok(Target::Index(index as i64))
            }
            DocField::Function(f) => {
                Err(DataError::Dataset(format!("{f} cannot give doc_to_target")))
            }
            DocField::Text(t) => {
                if let Some(v) = doc.get(t) {
                    return match v {
                        Value::String(s) => Ok(Target::Text(s.clone())),
                        Value::Number(n) if n.is_i64() => {
                            Ok(Target::Index(n.as_i64().unwrap_or(0)))
                        }
                        Value::Bool(b) => Ok(Target::Index(i64::from(*b))),
                        Value::Array(items) if items.iter().all(Value::is_string) => {
                            Ok(Target::Texts(
                                items
                                    .iter()
                                    .filter_map(|v| v.as_str().map(str::to_string))
                                    .collect(),
                            ))
                        }
                        Value::Array(items) => Ok(Target::Indices(
                            items.iter().filter_map(Value::as_i64).collect(),
                        )),
                        other => Err(DataError::Dataset(format!(
                            "doc_to_target: column '{t}' holds {other}"
                        ))),
                    };
                }
                let s = render(env, t, doc)?;
                if self.doc_to_choice.is_some() && is_py_digit(&s) {
                    return Ok(Target::Index(parse_index(&s)?));
                }
                if s.len() >= 2 && s.starts_with('[') && s.ends_with(']') {
                    if let Ok(Value::Array(items)) = parse_python_literal(&s) {
                        if items.iter().all(Value::is_i64) {
                            return Ok(Target::Indices(
                                items.iter().filter_map(Value::as_i64).collect(),
                            ));
                        }
                        if items.iter().all(Value::is_string) {
                            return Ok(Target::Texts(
                                items
                                    .iter()
                                    .filter_map(|v| v.as_str().map(str::to_string))
                                    .collect(),
                            ));
                        }
                    }
                }
                Ok(Target::Text(s))
            }
        }
    }

    pub(super) fn choices_of(
        &self,
        env: &Environment,
        doc: &Map<String, Value>,
    ) -> Result<Vec<String>> {
        let Some(field) = &self.doc_to_choice else {
            return Err(DataError::Dataset("the task has no doc_to_choice".into()));
        };
        let value = match field {
            DocField::List(items) => return Ok(items.clone()),
            DocField::Int(_) => {
                return Err(DataError::Dataset(
                    "doc_to_choice cannot be a number".into(),
                ))
            }
            DocField::Function(f) if f == "winogrande.doc_to_choice" => {
                let sentence = doc_str(doc, "sentence")?;
                let idx = blank_index(&sentence)?;
                let head = &sentence[..idx];
                return Ok(vec![
                    format!("{head}{}", doc_str(doc, "option1")?),
                    format!("{head}{}", doc_str(doc, "option2")?),
                ]);
            }
            DocField::Function(f) if f == "copa.doc_to_choice" => {
                return Ok(vec![
                    format!(" {}", copa_choice(&doc_str(doc, "choice1")?)),
                    format!(" {}", copa_choice(&doc_str(doc, "choice2")?)),
                ]);
            }
            DocField::Function(f) if f == "mathqa.doc_to_choice" => {
                return Ok(mathqa_choices(&doc_str(doc, "options")?));
            }
            DocField::Function(f) => {
                return Err(DataError::Dataset(format!("{f} cannot give doc_to_choice")))
            }
            DocField::Text(t) => match doc.get(t) {
                Some(v) => v.clone(),
                None => parse_python_literal(&render(env, t, doc)?).map_err(|e| {
                    DataError::Dataset(format!("doc_to_choice did not render to a list: {e}"))
                })?,
            },
        };
        match value {
            Value::Array(items) => items
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    Value::Number(n) => Ok(n.to_string()),
                    other => Err(DataError::Dataset(format!(
                        "a choice is {other}, not a text"
                    ))),
                })
                .collect(),
            other => Err(DataError::Dataset(format!(
                "doc_to_choice gave {other}, not a list"
            ))),
        }
    }
}

pub(super) enum TextOrIndex {
    Text(String),
    Index(i64),
}

fn is_py_digit(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_ascii_digit())
}

fn parse_index(s: &str) -> Result<i64> {
    s.parse()
        .map_err(|_| DataError::Dataset(format!("'{s}' is not an index")))
}

pub(super) fn doc_str(doc: &Map<String, Value>, key: &str) -> Result<String> {
    match doc.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(DataError::Dataset(format!(
            "column '{key}' holds {other}, not a text"
        ))),
        None => Err(DataError::Dataset(format!(
            "the document has no column '{key}'"
        ))),
    }
}

/// A list-of-texts column.
fn doc_strs(doc: &Map<String, Value>, key: &str) -> Result<Vec<String>> {
    match doc.get(key) {
        Some(Value::Array(items)) => {
            texts(items, |v| format!("column '{key}' holds {v}, not a text"))
        }
        other => Err(DataError::Dataset(format!(
            "column '{key}' must be a list of texts, got {other:?}"
        ))),
    }
}

/// COPA's choice as the continuation of its premise: the first character lower-cased.
fn copa_choice(choice: &str) -> String {
    let mut chars = choice.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// MathQA's options string (`a ) 38 , b ) 27.675 , ... e ) none`) as its choices: the harness's
/// `re.findall(r"[abcd] \) .*?, |e \) .*?$", options)`, each without its `x ) ` head and trailing
/// spaces and commas.
fn mathqa_choices(options: &str) -> Vec<String> {
    static PATTERN: std::sync::OnceLock<fancy_regex::Regex> = std::sync::OnceLock::new();
    let pattern = PATTERN.get_or_init(|| {
        // Python's `$` also matches before a final newline; `.` never matches a newline.
        fancy_regex::Regex::new(r"[abcd] \) [^\n]*?, |e \) [^\n]*?(?=\n?\z)").expect("valid")
    });
    pattern
        .find_iter(options)
        .filter_map(|m| m.ok())
        .map(|m| {
            let text: String = m.as_str().chars().skip(4).collect();
            text.trim_end_matches([' ', ',']).to_string()
        })
        .collect()
}

fn blank_index(sentence: &str) -> Result<usize> {
    sentence
        .find('_')
        .ok_or_else(|| DataError::Dataset(format!("winogrande: no '_' blank in {sentence:?}")))
}
