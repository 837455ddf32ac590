//! The harness's generation tasks: `generation_kwargs`, answer-extraction filters
//! (`filter_list`) and `exact_match`, with Python's `re` semantics where they differ from Rust's.

use serde_yaml_ng::Value as Yaml;

/// How few-shot examples are picked (`fewshot_config.sampler`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FewshotSampler {
    /// The harness's default: drawn with CPython's `random.Random(1234).sample`, one draw per
    /// document in order (lm-eval's `fewshot_random_seed`).
    Random,
    /// The first `num_fewshot` examples of the split (MMLU's, GSM8K-CoT's).
    FirstN,
}

/// `generation_kwargs` of a generate_until task (greedy only, as torchtune's wrapper).
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationSpec {
    /// Stop strings; the response is cut at the first of them (the tokenizer's EOS text is added).
    pub until: Vec<String>,
    /// The most tokens generated (`max_gen_toks`, default 256).
    pub max_gen_toks: usize,
}

impl GenerationSpec {
    pub(crate) fn from_yaml(v: Option<&Yaml>) -> Result<Self, String> {
        let mut spec = GenerationSpec {
            until: Vec::new(),
            max_gen_toks: 256,
        };
        let Some(v) = v else { return Ok(spec) };
        let map = v.as_mapping().ok_or("must be a mapping")?;
        for (k, v) in map {
            let key = k.as_str().unwrap_or_default();
            match key {
                "until" => {
                    spec.until = match v {
                        Yaml::String(s) => vec![s.clone()],
                        Yaml::Sequence(items) => items
                            .iter()
                            .map(|i| i.as_str().map(str::to_string).ok_or("until: strings only"))
                            .collect::<Result<_, _>>()?,
                        Yaml::Null => Vec::new(),
                        _ => return Err("until must be a string or a list of strings".into()),
                    }
                }
                "max_gen_toks" | "max_new_tokens" | "max_tokens" | "max_completion_tokens" => {
                    spec.max_gen_toks = v
                        .as_u64()
                        .filter(|n| *n > 0)
                        .ok_or_else(|| format!("{key} must be a positive integer"))?
                        as usize;
                }
                "do_sample" => {
                    if v.as_bool() == Some(true) {
                        return Err(
                            "do_sample: only greedy decoding is supported (as torchtune)".into(),
                        );
                    }
                }
                "temperature" => {
                    if v.as_f64().is_some_and(|t| t != 0.0) {
                        return Err(
                            "temperature: only greedy decoding (0.0) is supported (as torchtune)"
                                .into(),
                        );
                    }
                }
                // Greedy decoding ignores these.
                "top_p" | "top_k" => {}
                other => return Err(format!("'{other}' is not supported")),
            }
        }
        Ok(spec)
    }
}

/// One named answer-extraction pipeline.
#[derive(Debug, Clone)]
pub struct FilterSpec {
    /// The filter's name (the table's Filter column).
    pub name: String,
    /// Its steps, in order.
    pub steps: Vec<FilterStep>,
}

/// One step of a filter pipeline.
#[derive(Debug, Clone)]
pub enum FilterStep {
    /// `regex`: Python's `re.findall(pattern, response)`, the `group_select`-th match (a tuple's
    /// first non-empty group), stripped; `fallback` when nothing matches.
    Regex {
        /// The compiled pattern.
        regex: fancy_regex::Regex,
        /// Which match (negative from the end).
        group_select: i64,
        /// Returned when nothing matches (default `[invalid]`).
        fallback: String,
    },
    /// `take_first`: the first response (one per request here).
    TakeFirst,
    /// `lowercase`.
    Lowercase,
    /// `uppercase`.
    Uppercase,
    /// `remove_whitespace`: leading whitespace removed.
    RemoveWhitespace,
}

impl FilterSpec {
    pub(crate) fn list_from_yaml(v: &Yaml) -> Result<Vec<FilterSpec>, String> {
        let items = v.as_sequence().ok_or("must be a list of {name, filter}")?;
        let mut out = Vec::new();
        for item in items {
            let name = item
                .get("name")
                .and_then(|n| n.as_str())
                .ok_or("every filter needs a name")?;
            let steps = item
                .get("filter")
                .and_then(|f| f.as_sequence())
                .ok_or_else(|| format!("filter '{name}' needs a 'filter' list"))?;
            let mut parsed = Vec::new();
            for step in steps {
                let function = step
                    .get("function")
                    .and_then(|f| f.as_str())
                    .ok_or_else(|| format!("filter '{name}': every step needs a 'function'"))?;
                parsed.push(match function {
                    "regex" => {
                        let pattern = step
                            .get("regex_pattern")
                            .and_then(|p| p.as_str())
                            .unwrap_or(r"#### (\-?[0-9\.\,]+)");
                        FilterStep::Regex {
                            regex: python_regex(pattern)?,
                            group_select: step
                                .get("group_select")
                                .and_then(|g| g.as_i64())
                                .unwrap_or(0),
                            fallback: step
                                .get("fallback")
                                .and_then(|f| f.as_str())
                                .unwrap_or("[invalid]")
                                .to_string(),
                        }
                    }
                    "take_first" => FilterStep::TakeFirst,
                    "lowercase" => FilterStep::Lowercase,
                    "uppercase" => FilterStep::Uppercase,
                    "remove_whitespace" => FilterStep::RemoveWhitespace,
                    other => {
                        return Err(format!(
                            "filter '{name}': function '{other}' is not supported (regex, \
                             take_first, lowercase, uppercase, remove_whitespace)"
                        ))
                    }
                });
            }
            out.push(FilterSpec {
                name: name.to_string(),
                steps: parsed,
            });
        }
        Ok(out)
    }

    /// The response after every step.
    pub fn apply(&self, response: &str) -> String {
        let mut text = response.to_string();
        for step in &self.steps {
            text = match step {
                FilterStep::TakeFirst => text,
                FilterStep::Lowercase => text.to_lowercase(),
                FilterStep::Uppercase => text.to_uppercase(),
                FilterStep::RemoveWhitespace => text.trim_start().to_string(),
                FilterStep::Regex {
                    regex,
                    group_select,
                    fallback,
                } => regex_select(regex, &text, *group_select).unwrap_or_else(|| fallback.clone()),
            };
        }
        text
    }
}

/// `re.findall(pattern, text)[group_select]` as the harness's regex filter reads it.
fn regex_select(regex: &fancy_regex::Regex, text: &str, group_select: i64) -> Option<String> {
    let groups = regex.captures_len() - 1;
    let mut found: Vec<String> = Vec::new();
    for caps in regex.captures_iter(text) {
        let caps = caps.ok()?;
        let item = match groups {
            0 => caps.get(0).map_or("", |m| m.as_str()).to_string(),
            1 => caps.get(1).map_or("", |m| m.as_str()).to_string(),
            // A tuple of groups: its first non-empty one (the fallback if none).
            _ => {
                let first = (1..=groups)
                    .filter_map(|g| caps.get(g).map(|m| m.as_str()))
                    .find(|s| !s.is_empty());
                match first {
                    Some(s) => s.to_string(),
                    None => return None,
                }
            }
        };
        found.push(item);
    }
    if found.is_empty() {
        return None;
    }
    let n = found.len() as i64;
    let index = if group_select < 0 {
        n + group_select
    } else {
        group_select
    };
    if !(0..n).contains(&index) {
        return None;
    }
    Some(found[index as usize].trim().to_string())
}

/// `exact_match`'s options (HF `evaluate`'s exact_match, as the harness calls it).
#[derive(Debug, Clone, Default)]
pub struct ExactMatchSpec {
    /// Removed from both texts first, in order (Python `re.sub(pattern, "", text)`).
    pub regexes_to_ignore: Vec<fancy_regex::Regex>,
    /// Compare lower-cased.
    pub ignore_case: bool,
    /// Drop ASCII punctuation (Python's `string.punctuation`).
    pub ignore_punctuation: bool,
    /// Drop digits.
    pub ignore_numbers: bool,
}

impl ExactMatchSpec {
    pub(crate) fn from_yaml(item: &Yaml) -> Result<Self, String> {
        let mut spec = ExactMatchSpec::default();
        let Some(map) = item.as_mapping() else {
            return Ok(spec);
        };
        for (k, v) in map {
            match k.as_str().unwrap_or_default() {
                "metric" | "aggregation" | "higher_is_better" => {}
                "ignore_case" => spec.ignore_case = v.as_bool().unwrap_or(false),
                "ignore_punctuation" => spec.ignore_punctuation = v.as_bool().unwrap_or(false),
                "ignore_numbers" => spec.ignore_numbers = v.as_bool().unwrap_or(false),
                "regexes_to_ignore" => {
                    for r in v.as_sequence().ok_or("regexes_to_ignore must be a list")? {
                        let r = r.as_str().ok_or("regexes_to_ignore: strings only")?;
                        spec.regexes_to_ignore.push(python_regex(r)?);
                    }
                }
                other => return Err(format!("'{other}' is not supported")),
            }
        }
        Ok(spec)
    }

    fn normalise(&self, text: &str) -> String {
        let mut t = text.to_string();
        for r in &self.regexes_to_ignore {
            t = r.replace_all(&t, "").into_owned();
        }
        if self.ignore_case {
            t = t.to_lowercase();
        }
        if self.ignore_punctuation {
            t.retain(|c| !c.is_ascii_punctuation());
        }
        if self.ignore_numbers {
            t.retain(|c| !c.is_ascii_digit());
        }
        t
    }

    /// 1.0 when the prediction equals the reference after normalisation, else 0.0.
    pub fn score(&self, prediction: &str, reference: &str) -> f64 {
        f64::from(u8::from(
            self.normalise(prediction) == self.normalise(reference),
        ))
    }
}

/// A Python `re` pattern for fancy-regex: where Python's `$` (outside a class, unescaped) also
/// matches before a final newline, Rust's does not, so it becomes `(?=\n?\z)`; `\Z` is `\z`.
pub(crate) fn python_regex(pattern: &str) -> Result<fancy_regex::Regex, String> {
    let mut out = String::with_capacity(pattern.len() + 8);
    let mut chars = pattern.chars().peekable();
    let mut in_class = false;
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some('Z') if !in_class => out.push_str(r"\z"),
                Some(n) => {
                    out.push('\\');
                    out.push(n);
                }
                None => out.push('\\'),
            },
            '[' if !in_class => {
                in_class = true;
                out.push(c);
                // `[]` and `[^]` start a class whose first member is `]`.
                if chars.peek() == Some(&'^') {
                    out.push(chars.next().unwrap_or('^'));
                }
                if chars.peek() == Some(&']') {
                    chars.next();
                    out.push_str(r"\]");
                }
            }
            ']' if in_class => {
                in_class = false;
                out.push(c);
            }
            '$' if !in_class => out.push_str(r"(?=\n?\z)"),
            _ => out.push(c),
        }
    }
    fancy_regex::Regex::new(&out).map_err(|e| format!("pattern {pattern:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter(pattern: &str, group_select: i64) -> FilterSpec {
        FilterSpec {
            name: "f".into(),
            steps: vec![
                FilterStep::Regex {
                    regex: python_regex(pattern).unwrap(),
                    group_select,
                    fallback: "[invalid]".into(),
                },
                FilterStep::TakeFirst,
            ],
        }
    }

    #[test]
    fn regex_filters_read_findall_as_python() {
        // GSM8K's two filters (the values Python's re.findall gives).
        let strict = filter(r"#### (\-?[0-9\.\,]+)", 0);
        assert_eq!(strict.apply("so 3 + 4 = 7.\n#### 7"), "7");
        assert_eq!(strict.apply("no marker 12"), "[invalid]");
        let flexible = filter(r"(-?[$0-9.,]{2,})|(-?[0-9]+)", -1);
        // findall gives tuples; each one's first non-empty group, the last match.
        assert_eq!(flexible.apply("costs $12 then 5 and 1,000."), "1,000.");
        assert_eq!(flexible.apply("it is 7"), "7");
        assert_eq!(flexible.apply("none here"), "[invalid]");
    }

    #[test]
    fn exact_match_normalises_as_the_harness() {
        let spec = ExactMatchSpec {
            regexes_to_ignore: [",", r"\$", "(?s).*#### ", r"\.$"]
                .iter()
                .map(|r| python_regex(r).unwrap())
                .collect(),
            ignore_case: true,
            ignore_punctuation: false,
            ignore_numbers: false,
        };
        assert_eq!(spec.score("$1,000.", "Work...\n#### 1000"), 1.0);
        assert_eq!(spec.score("72", "steps\n#### 72"), 1.0);
        assert_eq!(spec.score("71", "#### 72"), 0.0);
        // Python's `$` also matches before a final newline.
        assert_eq!(spec.score("5.\n", "5\n"), 1.0);
        let punct = ExactMatchSpec {
            ignore_punctuation: true,
            ignore_case: true,
            ..Default::default()
        };
        assert_eq!(punct.score("Paris!", "paris"), 1.0);
    }

    #[test]
    fn python_patterns_translate() {
        let r = python_regex(r"[$0-9]+$").unwrap();
        assert!(r.is_match("$12\n").unwrap());
        assert!(!r.is_match("12 x").unwrap());
        assert!(python_regex(r"a\Z").unwrap().is_match("a").unwrap());
    }
}
