//! Python literals (`ast.literal_eval`) as JSON values: how the harness turns a rendered
//! `doc_to_choice` (`['a', 'b']`, Python's repr of a list) back into a list. Written here because
//! it is a few dozen lines and no crate parses Python literals.

use serde_json::{Map, Number, Value};

/// Parses a Python literal: lists, tuples (as lists), dicts, strings (single or double quotes,
/// with escapes), integers, floats, `True`, `False`, `None`.
pub fn parse_python_literal(text: &str) -> Result<Value, String> {
    let mut p = Parser {
        chars: text.chars().collect(),
        at: 0,
    };
    let v = p.value()?;
    p.skip_space();
    if p.at != p.chars.len() {
        return Err(format!("unexpected text after a literal in {text:?}"));
    }
    Ok(v)
}

struct Parser {
    chars: Vec<char>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.at).copied()
    }

    fn skip_space(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.at += 1;
        }
    }

    fn value(&mut self) -> Result<Value, String> {
        self.skip_space();
        match self.peek() {
            Some('[') => self.sequence(']'),
            Some('(') => self.sequence(')'),
            Some('{') => self.dict(),
            Some(q @ ('\'' | '"')) => self.string(q).map(Value::String),
            Some(c) if c.is_ascii_digit() || c == '-' || c == '+' || c == '.' => self.number(),
            Some(c) if c.is_alphabetic() => {
                let start = self.at;
                while self.peek().is_some_and(|c| c.is_alphanumeric() || c == '_') {
                    self.at += 1;
                }
                let word: String = self.chars[start..self.at].iter().collect();
                match word.as_str() {
                    "True" => Ok(Value::Bool(true)),
                    "False" => Ok(Value::Bool(false)),
                    "None" => Ok(Value::Null),
                    other => Err(format!("'{other}' is not a literal")),
                }
            }
            Some(c) => Err(format!("unexpected '{c}'")),
            None => Err("an empty literal".into()),
        }
    }

    fn sequence(&mut self, close: char) -> Result<Value, String> {
        self.at += 1;
        let mut items = Vec::new();
        loop {
            self.skip_space();
            if self.peek() == Some(close) {
                self.at += 1;
                return Ok(Value::Array(items));
            }
            items.push(self.value()?);
            self.skip_space();
            match self.peek() {
                Some(',') => self.at += 1,
                Some(c) if c == close => {}
                _ => return Err(format!("expected ',' or '{close}' in a list")),
            }
        }
    }

    fn dict(&mut self) -> Result<Value, String> {
        self.at += 1;
        let mut map = Map::new();
        loop {
            self.skip_space();
            if self.peek() == Some('}') {
                self.at += 1;
                return Ok(Value::Object(map));
            }
            let key = match self.value()? {
                Value::String(s) => s,
                other => other.to_string(),
            };
            self.skip_space();
            if self.peek() != Some(':') {
                return Err("expected ':' in a dict".into());
            }
            self.at += 1;
            let v = self.value()?;
            map.insert(key, v);
            self.skip_space();
            match self.peek() {
                Some(',') => self.at += 1,
                Some('}') => {}
                _ => return Err("expected ',' or '}' in a dict".into()),
            }
        }
    }

    fn string(&mut self, quote: char) -> Result<String, String> {
        self.at += 1;
        let mut out = String::new();
        loop {
            let c = self.peek().ok_or("an unterminated string")?;
            self.at += 1;
            if c == quote {
                return Ok(out);
            }
            if c != '\\' {
                out.push(c);
                continue;
            }
            let e = self.peek().ok_or("an unterminated escape")?;
            self.at += 1;
            match e {
                'n' => out.push('\n'),
                't' => out.push('\t'),
                'r' => out.push('\r'),
                '0' => out.push('\0'),
                'a' => out.push('\u{7}'),
                'b' => out.push('\u{8}'),
                'f' => out.push('\u{c}'),
                'v' => out.push('\u{b}'),
                '\\' | '\'' | '"' => out.push(e),
                '\n' => {}
                'x' | 'u' | 'U' => {
                    let len = match e {
                        'x' => 2,
                        'u' => 4,
                        _ => 8,
                    };
                    let hex: String = self
                        .chars
                        .get(self.at..self.at + len)
                        .ok_or("a short escape")?
                        .iter()
                        .collect();
                    self.at += len;
                    let code = u32::from_str_radix(&hex, 16)
                        .map_err(|_| format!("bad escape \\{e}{hex}"))?;
                    out.push(
                        char::from_u32(code).ok_or_else(|| format!("bad code point \\{e}{hex}"))?,
                    );
                }
                other => {
                    // Python keeps unknown escapes as written.
                    out.push('\\');
                    out.push(other);
                }
            }
        }
    }

    fn number(&mut self) -> Result<Value, String> {
        let start = self.at;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '+' | '_'))
        {
            self.at += 1;
        }
        let text: String = self.chars[start..self.at]
            .iter()
            .filter(|c| **c != '_')
            .collect();
        if let Ok(i) = text.parse::<i64>() {
            return Ok(Value::Number(i.into()));
        }
        text.parse::<f64>()
            .ok()
            .and_then(Number::from_f64)
            .map(Value::Number)
            .ok_or_else(|| format!("'{text}' is not a number"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_what_python_repr_writes() {
        assert_eq!(
            parse_python_literal(r#"['it\'s', "a \"b\"", 'c\nd', 3, -1.5, True, None, (1, 2)]"#)
                .unwrap(),
            json!(["it's", "a \"b\"", "c\nd", 3, -1.5, true, null, [1, 2]])
        );
        assert_eq!(
            parse_python_literal("{'a': [1], 'b': 'x'}").unwrap(),
            json!({"a": [1], "b": "x"})
        );
        assert_eq!(parse_python_literal("'\\xe9\\u00e9'").unwrap(), json!("éé"));
        assert!(parse_python_literal("[1, 2").is_err());
        assert!(parse_python_literal("['a'] x").is_err());
        assert!(parse_python_literal("foo").is_err());
    }
}
