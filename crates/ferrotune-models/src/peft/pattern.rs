//! PEFT's module patterns, matched with the `regex` crate.
//!
//! PEFT matches `target_modules` (as a string), `exclude_modules`, `rank_pattern` and
//! `alpha_pattern` keys with Python's `re.fullmatch` against module names such as
//! `model.layers.0.self_attn.q_proj`. A pattern is compiled as `\A(?:PATTERN)\z` after
//! [`translate`] rewrites the few spellings whose meaning differs between Python's `re` and the
//! `regex` crate, and compiled patterns are cached: every module name of a model is matched
//! against the same few patterns.
//!
//! Differences from Python's `re` that remain (module names are ASCII and hold no newline, so
//! none changes which modules a PEFT pattern selects):
//! - `\d`, `\w`, `\s` are Unicode-aware in both, but their Unicode sets differ slightly (Python's
//!   `\s` also matches `\x1c`-`\x1f`; `\w` follows `str.isalnum`, the crate Unicode's word
//!   properties). The hand-written matcher this replaced took them as ASCII only.
//! - `$` matches only at the very end of the text (`\z`); Python's also matches before a final
//!   `\n`. `.` excludes `\n` in both.
//! - Look-around (`(?=`, `(?!`, `(?<=`, `(?<!`), back-references (`\1`, `(?P=name)`),
//!   conditionals and possessive or atomic repeats do not compile (the matcher before refused
//!   them too).
//! - Syntax the matcher before refused as unsupported is now the crate's to judge: `\b`, `\B`,
//!   `\A`, `\x41` and inline flags `(?i)` compile as in Python (the crate also takes a flag
//!   group mid-pattern, an error in Python 3.11+), `\pL` compiles (not Python), `\Z` does not.
//! - What the matcher before accepted and Python refuses is now refused too: a reversed class
//!   range (`[z-a]`), a repeat `{m,n}` with `m > n`, a group name that is not an identifier or is
//!   used twice. `{,n}` is Python's `{0,n}` but stays a literal brace here, as before; a repeat of
//!   a repeat (`a**`, Python's possessive `a*+`) stays refused.
//! - A repeat bound over the crate's size limit (thousands of repeats of a large group) does not
//!   compile.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use regex::Regex;

/// Compiles `src` (Python `re` syntax) to a regex that matches whole texts only.
pub(super) fn compile(src: &str) -> Result<Regex, String> {
    let translated = translate(src)?;
    Regex::new(&format!(r"\A(?:{translated})\z")).map_err(|e| e.to_string())
}

/// Python's `re.fullmatch(pattern, text) is not None`; a pattern that does not compile matches
/// nothing (patterns are checked when a config is read, see `LoraConfig::parse`).
pub(super) fn full_match(pattern: &str, text: &str) -> bool {
    cached(pattern).is_some_and(|re| re.is_match(text))
}

/// The compiled `pattern` (`None` when it does not compile), compiled once: a model's every
/// module name is matched against the same patterns, and compiling costs far more than a match.
/// Shared in an [`Arc`] rather than cloned, as a cloned [`Regex`] starts without the scratch
/// space its matches reuse.
fn cached(pattern: &str) -> Option<Arc<Regex>> {
    // Patterns come from adapter configs: a handful per process. The bound only keeps a program
    // that reads many configs from growing the cache without end.
    const MAX_CACHED: usize = 256;
    static CACHE: OnceLock<Mutex<HashMap<String, Option<Arc<Regex>>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(re) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(pattern) {
        return re.clone();
    }
    let re = compile(pattern).ok().map(Arc::new);
    let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
    if cache.len() >= MAX_CACHED {
        cache.clear();
    }
    cache.insert(pattern.to_string(), re.clone());
    re
}

/// `src` in the `regex` crate's syntax with Python's meaning where the two differ in spelling:
/// a `{` that does not start a repeat (`x{y`, `{,2}`, a `{` with nothing before it to repeat) is
/// a literal brace, as are stray `}` and `]`; an escaped non-alphanumeric character (`\<`, `\>`,
/// `\é`, `\ `) is that character; inside a character class `[`, `&&`, `--` and `~~` are
/// literal characters rather than the crate's nested classes and set operations. An unmatched
/// `)` is refused here, as the `(?:...)` wrapping would otherwise close it.
fn translate(src: &str) -> Result<String, String> {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len() + 8);
    let mut i = 0;
    // Whether the last token can take a repeat (an atom, not `(`, `|` or another repeat).
    let mut repeatable = false;
    let mut depth = 0usize;
    while i < c.len() {
        let ch = c[i];
        i += 1;
        match ch {
            '\\' => match c.get(i) {
                Some(&e) => {
                    i += 1;
                    push_escape(&mut out, e);
                    repeatable = true;
                }
                None => return Err("trailing backslash".to_string()),
            },
            '[' => {
                i = translate_class(&c, i, &mut out)?;
                repeatable = true;
            }
            '{' => match repeat_len(&c, i) {
                Some(n) if repeatable => {
                    out.push('{');
                    out.extend(&c[i..i + n]);
                    i += n;
                    i = push_lazy(&c, i, &mut out);
                    repeatable = false;
                }
                // Python reads a brace that is not a valid repeat as a literal.
                _ => {
                    out.push_str(r"\{");
                    repeatable = true;
                }
            },
            '}' | ']' => {
                out.push('\\');
                out.push(ch);
                repeatable = true;
            }
            '*' | '+' | '?' => {
                // Refused as Python refuses it (or, for `a*+`, reads it as a possessive repeat,
                // which the crate would take as a nested one).
                if !repeatable {
                    return Err(format!("nothing to repeat before '{ch}'"));
                }
                out.push(ch);
                i = push_lazy(&c, i, &mut out);
                repeatable = false;
            }
            '(' => {
                depth += 1;
                out.push('(');
                // The group's prefix (`?:`, `?P<name>`) is copied as it is; nothing in it repeats.
                if c.get(i) == Some(&'?') {
                    let end = match (c.get(i + 1), c.get(i + 2)) {
                        (Some(':'), _) => i + 2,
                        (Some('P'), Some('<')) => c[i..]
                            .iter()
                            .position(|&x| x == '>')
                            .map_or(c.len(), |p| i + p + 1),
                        _ => i + 1,
                    };
                    out.extend(&c[i..end]);
                    i = end;
                }
                repeatable = false;
            }
            ')' => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| format!("unbalanced ')' in pattern '{src}'"))?;
                out.push(')');
                repeatable = true;
            }
            '|' => {
                out.push('|');
                repeatable = false;
            }
            other => {
                out.push(other);
                repeatable = true;
            }
        }
    }
    Ok(out)
}

/// The escape `\e` outside a character class: a letter or digit keeps its meaning (`\d`, `\w`,
/// `\s`, their negations, `\n`, `\t`; others are the crate's to accept or refuse), any other
/// character stands for itself.
fn push_escape(out: &mut String, e: char) {
    if e.is_ascii_alphanumeric() {
        out.push('\\');
        out.push(e);
    } else {
        out.push_str(&regex::escape(e.encode_utf8(&mut [0; 4])));
    }
}

/// Copies the lazy marker `?` after a repeat, if there is one.
fn push_lazy(c: &[char], i: usize, out: &mut String) -> usize {
    if c.get(i) == Some(&'?') {
        out.push('?');
        return i + 1;
    }
    i
}

/// The length of the repeat bounds `m}`, `m,}` or `m,n}` at `c[i..]` (after the `{`), when there
/// is one, as Python reads them (`m` is required).
fn repeat_len(c: &[char], i: usize) -> Option<usize> {
    let digits = |from: usize| {
        let n = c[from..].iter().take_while(|d| d.is_ascii_digit()).count();
        let fits = c[from..from + n]
            .iter()
            .collect::<String>()
            .parse::<usize>()
            .is_ok();
        (n, fits)
    };
    let (m, fits) = digits(i);
    if m == 0 || !fits {
        return None;
    }
    let mut j = i + m;
    match c.get(j) {
        Some('}') => Some(j + 1 - i),
        Some(',') => {
            j += 1;
            let (n, fits) = digits(j);
            if n > 0 && !fits {
                return None;
            }
            j += n;
            (c.get(j) == Some(&'}')).then_some(j + 1 - i)
        }
        _ => None,
    }
}

/// Translates the character class whose `[` ends at `c[i]`, writing it to `out` with every
/// member spelled unambiguously for the crate, and returns the position after its `]`.
fn translate_class(c: &[char], mut i: usize, out: &mut String) -> Result<usize, String> {
    out.push('[');
    if c.get(i) == Some(&'^') {
        out.push('^');
        i += 1;
    }
    let mut first = true;
    // One member as a literal character.
    let lit =
        |out: &mut String, ch: char| out.push_str(&regex::escape(ch.encode_utf8(&mut [0; 4])));
    while let Some(&ch) = c.get(i) {
        i += 1;
        if ch == ']' && !first {
            out.push(']');
            return Ok(i);
        }
        first = false;
        let Some(lo) = class_member(c, &mut i, ch, out)? else {
            continue;
        };
        if c.get(i) == Some(&'-') && c.get(i + 1).is_some_and(|&n| n != ']') {
            let hi = c[i + 1];
            i += 2;
            lit(out, lo);
            out.push('-');
            let Some(hi) = class_member(c, &mut i, hi, out)? else {
                continue;
            };
            lit(out, hi);
        } else {
            lit(out, lo);
        }
    }
    Err("unterminated character class".to_string())
}

/// The class member that starts with `ch` (already read; an escape's second character is read at
/// `c[*i]`): the character it stands for, or `None` for a class escape, which goes to `out` as is.
fn class_member(
    c: &[char],
    i: &mut usize,
    ch: char,
    out: &mut String,
) -> Result<Option<char>, String> {
    if ch != '\\' {
        return Ok(Some(ch));
    }
    let &e = c.get(*i).ok_or("trailing backslash")?;
    *i += 1;
    Ok(match e {
        'n' => Some('\n'),
        't' => Some('\t'),
        // `\d`, `\w`, `\s` and their negations; others are the crate's to judge.
        e if e.is_ascii_alphanumeric() => {
            out.push('\\');
            out.push(e);
            None
        }
        e => Some(e),
    })
}

#[cfg(test)]
mod tests {
    use super::{compile, full_match};

    fn m(p: &str, s: &str) -> bool {
        compile(p).unwrap().is_match(s)
    }

    #[test]
    fn matches_like_python_fullmatch() {
        let key = "model.layers.0.self_attn.q_proj";
        assert!(m(r".*\.(q_proj|v_proj)", key));
        assert!(!m(r".*\.(k_proj|v_proj)", key));
        assert!(m(r"(.*\.)?(q_proj)", key));
        assert!(m(r"(.*\.)?(layers\.0\.self_attn\.q_proj)", key));
        assert!(!m(r"(.*\.)?(layers\.1\.self_attn\.q_proj)", key));
        assert!(m(r"model\.layers\.[0-3]\.self_attn\.\w+", key));
        assert!(m(r"^model.layers.\d+.self_attn.(?:q|k)_proj$", key));
        assert!(m(r"model.layers.\d{1,2}.*?q_proj", key));
        assert!(!m(r"q_proj", key));
        assert!(m(r"[^x]+", "abc") && !m(r"[^b]+", "abc"));
        assert!(m(r"a{2}b?", "aa") && !m(r"a{2}", "aaa"));
        assert!(m(r"(a*)*b", "aaab"));
        assert!(m(r"x{y", "x{y") && m(r"a+?b", "aab"));
        assert!(compile(r"(?=x)").is_err());
        assert!(compile(r"(ab").is_err());
    }

    /// Spellings the `regex` crate reads differently from Python's `re`, read as Python does.
    #[test]
    fn python_spellings_keep_their_meaning() {
        // Literal braces: not a repeat, or nothing to repeat.
        assert!(m(r"a{,2}", "a{,2}") && !m(r"a{,2}", "aa"));
        assert!(m(r"a{2}{3}", "aa{3}") && m(r"(?:{1})", "{1}") && m(r"a}", "a}"));
        assert!(m(r"a{1,}b", "aaab") && m(r"a{2,3}?", "aaa"));
        // Escaped punctuation is literal (`\<` is a word boundary in the crate).
        assert!(m(r"\<a\>", "<a>") && m(r"\-\ \é", "- é"));
        // Class members the crate would read as nested classes or set operations.
        assert!(
            m(r"[[]", "[") && m(r"[a&&b]+", "a&b") && m(r"[+--]+", "+,-") && m(r"[a~~]+", "a~")
        );
        assert!(m(r"[]a]+", "]a") && m(r"[a-]+", "a-") && m(r"[\]\\]+", r"]\"));
        assert!(m(r"[\d.]+", "1.2") && !m(r"[^\w]", "a") && m(r"[a-c-e]+", "b-e"));
        assert!(m(r"(?P<name>a)|b", "a") && m(r"a]", "a]"));
        // An unmatched `)` stays an error, which wrapping in `(?:...)` would otherwise hide.
        assert!(compile(r"a)|(b").is_err() && compile(r"a)").is_err());
        assert!(compile(r"\1").is_err() && compile(r"(?<=a)b").is_err());
        assert!(compile(r"a**").is_err() && compile(r"a*+").is_err() && compile(r"|*").is_err());
        assert!(full_match(r".*\.q_proj", "model.q_proj") && !full_match(r"(x", "(x"));
    }
}
