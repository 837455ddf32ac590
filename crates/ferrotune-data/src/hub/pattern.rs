//! Allow/ignore patterns of a snapshot download: Python's `fnmatch`, as `huggingface_hub` uses it.

/// Python `fnmatch.fnmatch` on POSIX, the matching `huggingface_hub` uses for allow/ignore patterns:
/// `*` matches any run of characters (`/` included), `?` one character, `[seq]` / `[!seq]` a
/// character in / not in `seq` (ranges `a-z` allowed); an unclosed `[` is a literal. Case-sensitive.
pub fn fnmatch(pattern: &str, name: &str) -> bool {
    let tokens = glob_tokens(pattern);
    let s: Vec<char> = name.chars().collect();
    // Classic single-star backtracking: every token other than `*` consumes exactly one char.
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        match tokens.get(pi) {
            Some(GlobToken::Star) => {
                star = Some((pi, si));
                pi += 1;
            }
            Some(t) if t.matches(s[si]) => {
                pi += 1;
                si += 1;
            }
            _ => match star {
                Some((sp, ss)) => {
                    pi = sp + 1;
                    si = ss + 1;
                    star = Some((sp, ss + 1));
                }
                None => return false,
            },
        }
    }
    tokens[pi..].iter().all(|t| matches!(t, GlobToken::Star))
}

/// `huggingface_hub`'s pattern rule: a pattern ending in `/` means everything under that folder.
pub(super) fn matches_pattern(pattern: &str, path: &str) -> bool {
    if pattern.ends_with('/') {
        fnmatch(&format!("{pattern}*"), path)
    } else {
        fnmatch(pattern, path)
    }
}

enum GlobToken {
    Star,
    Any,
    Char(char),
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
}

impl GlobToken {
    fn matches(&self, c: char) -> bool {
        match self {
            GlobToken::Star | GlobToken::Any => true,
            GlobToken::Char(x) => *x == c,
            GlobToken::Class { negated, ranges } => {
                ranges.iter().any(|&(lo, hi)| lo <= c && c <= hi) != *negated
            }
        }
    }
}

fn glob_tokens(pattern: &str) -> Vec<GlobToken> {
    let p: Vec<char> = pattern.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < p.len() {
        match p[i] {
            '*' => {
                if !matches!(out.last(), Some(GlobToken::Star)) {
                    out.push(GlobToken::Star);
                }
                i += 1;
            }
            '?' => {
                out.push(GlobToken::Any);
                i += 1;
            }
            '[' => {
                // Find the closing `]`; a `]` right after `[` or `[!` is a member, as in Python.
                let mut j = i + 1;
                if j < p.len() && p[j] == '!' {
                    j += 1;
                }
                if j < p.len() && p[j] == ']' {
                    j += 1;
                }
                while j < p.len() && p[j] != ']' {
                    j += 1;
                }
                if j >= p.len() {
                    out.push(GlobToken::Char('['));
                    i += 1;
                    continue;
                }
                let mut k = i + 1;
                let negated = p[k] == '!';
                if negated {
                    k += 1;
                }
                let mut ranges = Vec::new();
                while k < j {
                    if k + 2 < j && p[k + 1] == '-' {
                        ranges.push((p[k], p[k + 2]));
                        k += 3;
                    } else {
                        ranges.push((p[k], p[k]));
                        k += 1;
                    }
                }
                out.push(GlobToken::Class { negated, ranges });
                i = j + 1;
            }
            c => {
                out.push(GlobToken::Char(c));
                i += 1;
            }
        }
    }
    out
}
