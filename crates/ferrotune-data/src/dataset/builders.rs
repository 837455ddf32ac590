//! torchtune's dataset builders: what each `_component_` turns a source row into.

use serde_json::{Map, Value};

use super::encode::Conversation;
use super::source::{Record, Table};
use super::tools::{self, OrderedCells};
use crate::chat_template::ChatMessage;
use crate::error::{DataError, Result};

/// torchtune 0.2's instruct templates (0.3+'s prompt templates produce the same text).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Template {
    Alpaca,
    Summarize,
    Grammar,
    QuestionAnswer,
}

impl Template {
    /// Accepts the class path (`torchtune.data.AlpacaInstructTemplate`) or the short name.
    pub fn parse(value: &Value) -> Result<Option<Template>> {
        let name = match value {
            Value::Null => return Ok(None),
            Value::String(s) => s.as_str(),
            other => {
                return Err(DataError::Dataset(format!(
                    "dataset 'template' must be a template name, got {other}"
                )))
            }
        };
        let short = name.rsplit('.').next().unwrap_or(name);
        Ok(Some(match short {
            "AlpacaInstructTemplate" | "Alpaca" | "alpaca" => Template::Alpaca,
            "SummarizeTemplate" | "Summarize" | "summarize" => Template::Summarize,
            "GrammarErrorCorrectionTemplate" | "Grammar" | "grammar" => Template::Grammar,
            "QuestionAnswerTemplate" | "QuestionAnswer" | "question_answer" => {
                Template::QuestionAnswer
            }
            "None" | "none" | "null" | "" => return Ok(None),
            _ => {
                return Err(DataError::Dataset(format!(
                    "unknown dataset template '{name}' (known: AlpacaInstructTemplate, \
                     SummarizeTemplate, GrammarErrorCorrectionTemplate, QuestionAnswerTemplate, \
                     or none)"
                )))
            }
        }))
    }

    /// The placeholder a single-field template fills.
    fn placeholder(self) -> &'static str {
        match self {
            Template::Alpaca => "instruction",
            Template::Summarize => "dialogue",
            Template::Grammar => "sentence",
            Template::QuestionAnswer => "question",
        }
    }

    fn wrap(self, text: &str) -> String {
        match self {
            Template::Summarize => format!("Summarize this dialogue:\n{text}\n---\nSummary:\n"),
            Template::Grammar => {
                format!("Correct this to standard English: {text}\n---\nCorrected: ")
            }
            Template::QuestionAnswer => format!("Question: {text}\n\nAnswer: "),
            Template::Alpaca => unreachable!("the Alpaca template has its own formatting"),
        }
    }
}

/// The text of a cell: strings as they are, numbers and booleans as Python's `str` writes them.
fn cell_text(
    table: &Table,
    record: &Record,
    column: &str,
    allow_null: bool,
) -> Result<Option<String>> {
    let bad = |what: &str| {
        DataError::Dataset(format!(
            "{}: column '{column}' {what}",
            table.locate(record)
        ))
    };
    match record.values.get(column) {
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Number(n)) => Ok(Some(n.to_string())),
        Some(Value::Bool(b)) => Ok(Some(if *b { "True" } else { "False" }.to_string())),
        None | Some(Value::Null) if allow_null => Ok(None),
        None | Some(Value::Null) => Err(bad("is empty (null) in this row")),
        Some(_) => Err(bad("must hold text, not a list or an object")),
    }
}

pub(crate) fn column_map(section: &Map<String, Value>) -> Result<Map<String, Value>> {
    match section.get("column_map") {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(Value::Object(m)) => {
            if let Some((k, v)) = m.iter().find(|(_, v)| !v.is_string()) {
                return Err(DataError::Dataset(format!(
                    "dataset column_map '{k}' must name a column, got {v}"
                )));
            }
            Ok(m.clone())
        }
        Some(other) => Err(DataError::Dataset(format!(
            "dataset 'column_map' must be a mapping, got {other}"
        ))),
    }
}

pub(crate) fn mapped<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a str> {
    map.get(key).and_then(Value::as_str)
}

pub(crate) fn get_bool(section: &Map<String, Value>, key: &str, default: bool) -> Result<bool> {
    match section.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(DataError::Dataset(format!(
            "dataset '{key}' must be true or false, got {other}"
        ))),
    }
}

pub(crate) fn get_str<'a>(section: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>> {
    match section.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(DataError::Dataset(format!(
            "dataset '{key}' must be a string, got {other}"
        ))),
    }
}

/// The prompt/response builders (`instruct_dataset`, `alpaca_dataset`, `samsum_dataset`,
/// `grammar_dataset`): one user prompt and one assistant response per row.
pub(crate) struct InstructSpec {
    pub template: Option<Template>,
    pub column_map: Map<String, Value>,
    pub train_on_input: bool,
    pub system: Option<String>,
}

impl InstructSpec {
    pub fn from_section(
        section: &Map<String, Value>,
        template: Option<Template>,
        default_columns: &[(&str, &str)],
        train_on_input_default: bool,
    ) -> Result<Self> {
        let mut column_map = column_map(section)?;
        if column_map.is_empty() {
            for (k, v) in default_columns {
                column_map.insert(k.to_string(), Value::String(v.to_string()));
            }
        }
        Ok(Self {
            template,
            column_map,
            train_on_input: get_bool(section, "train_on_input", train_on_input_default)?,
            system: get_str(section, "new_system_prompt")?.map(str::to_string),
        })
    }

    fn column(&self, key: &str) -> String {
        mapped(&self.column_map, key).unwrap_or(key).to_string()
    }

    /// The prompt column of a single-field template: its placeholder's mapping, else `input`'s.
    fn prompt_column(&self) -> String {
        match self.template {
            Some(t) if t != Template::Alpaca => mapped(&self.column_map, t.placeholder())
                .or_else(|| mapped(&self.column_map, "input"))
                .unwrap_or(t.placeholder())
                .to_string(),
            Some(_) => self.column("instruction"),
            None => self.column("input"),
        }
    }

    /// Checks the needed columns exist before any row is read.
    pub fn check(&self, table: &Table) -> Result<()> {
        table.require(&self.prompt_column())?;
        table.require(&self.column("output"))
    }

    pub fn conversation(&self, table: &Table, record: &Record) -> Result<Conversation> {
        let prompt = match self.template {
            Some(Template::Alpaca) => {
                let instruction = cell_text(table, record, &self.column("instruction"), false)?
                    .unwrap_or_default();
                // The input column is optional; an empty or missing input takes the no-input form.
                let input = cell_text(table, record, &self.column("input"), true)?
                    .filter(|s| !s.is_empty());
                match input {
                    Some(input) => format!(
                        "Below is an instruction that describes a task, paired with an input that \
                         provides further context. Write a response that appropriately completes \
                         the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n\
                         ### Response:\n"
                    ),
                    None => format!(
                        "Below is an instruction that describes a task. Write a response that \
                         appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n\
                         ### Response:\n"
                    ),
                }
            }
            Some(t) => {
                t.wrap(&cell_text(table, record, &self.prompt_column(), false)?.unwrap_or_default())
            }
            None => cell_text(table, record, &self.prompt_column(), false)?.unwrap_or_default(),
        };
        let response = cell_text(table, record, &self.column("output"), false)?.unwrap_or_default();
        let mut messages = Vec::new();
        if let Some(system) = &self.system {
            messages.push(ChatMessage::system(system.clone()));
        }
        messages.push(ChatMessage::new("user", prompt));
        messages.push(ChatMessage::new("assistant", response));
        Ok(Conversation {
            messages,
            train_on_input: self.train_on_input,
            tools: None,
        })
    }
}

/// Conversation styles of `chat_dataset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChatStyle {
    OpenAi,
    ShareGpt,
}

/// `chat_dataset`: one conversation per row.
pub(crate) struct ChatSpec {
    pub style: ChatStyle,
    pub column: String,
    pub train_on_input: bool,
    pub system: Option<String>,
    /// `tools_column`: the column of the row's tools, given (then required) or not (then `tools`
    /// when the rows have it).
    pub tools_column: Option<String>,
}

impl ChatSpec {
    pub fn from_section(section: &Map<String, Value>) -> Result<Self> {
        let style = match get_str(section, "conversation_style")? {
            Some("openai") => ChatStyle::OpenAi,
            Some("sharegpt") => ChatStyle::ShareGpt,
            Some(other) => {
                return Err(DataError::Dataset(format!(
                    "dataset conversation_style '{other}' must be 'openai' or 'sharegpt'"
                )))
            }
            None => {
                return Err(DataError::Dataset(
                    "chat_dataset needs 'conversation_style' (openai or sharegpt)".into(),
                ))
            }
        };
        let default_column = match style {
            ChatStyle::OpenAi => "messages",
            ChatStyle::ShareGpt => "conversations",
        };
        Ok(Self {
            style,
            column: get_str(section, "conversation_column")?
                .unwrap_or(default_column)
                .to_string(),
            train_on_input: get_bool(section, "train_on_input", false)?,
            system: get_str(section, "new_system_prompt")?.map(str::to_string),
            tools_column: get_str(section, "tools_column")?.map(str::to_string),
        })
    }

    /// [`ChatSpec::conversation`] with the row's tools ([`tools::tools_column`]) and, for
    /// openai-style messages, each message's keys beyond `role` and `content` (`tool_calls`,
    /// `name`, `tool_call_id`, ...), read in order from `cells`.
    pub fn conversation_with_tools(
        &self,
        table: &Table,
        record: &Record,
        cells: &mut OrderedCells,
    ) -> Result<Conversation> {
        let mut conv = self.conversation(table, record)?;
        if let Some(column) = tools::tools_column(self.tools_column.as_deref(), table)? {
            conv.tools = tools::row_tools(cells, table, record, column)?;
        }
        let Some(Value::Array(turns)) = record.values.get(&self.column) else {
            return Ok(conv);
        };
        if self.style != ChatStyle::OpenAi || !tools::any_extra_keys(turns) {
            return Ok(conv);
        }
        let kept: Vec<usize> = (0..turns.len())
            .filter(|&i| {
                !(self.system.is_some()
                    && turns[i].get("role").and_then(Value::as_str) == Some("system"))
            })
            .collect();
        let ordered = cells
            .cell(table, record, &self.column)?
            .expect("the conversation column exists");
        let first = usize::from(self.system.is_some());
        tools::fill_extra_keys(&mut conv.messages[first..], &ordered, &kept)?;
        Ok(conv)
    }

    /// `slimorca_dataset`: ShareGPT conversations in the column `column_map` names for
    /// `conversations` (default `conversations`), as torchtune's `ShareGPTToMessages`.
    pub fn slimorca(section: &Map<String, Value>) -> Result<Self> {
        let columns = column_map(section)?;
        if !columns.is_empty() && !columns.contains_key("conversations") {
            return Err(DataError::Dataset(format!(
                "slimorca_dataset column_map needs the key 'conversations' (the column of the \
                 conversation), got {}",
                columns.keys().cloned().collect::<Vec<_>>().join(", ")
            )));
        }
        Ok(Self {
            style: ChatStyle::ShareGpt,
            column: mapped(&columns, "conversations")
                .unwrap_or("conversations")
                .to_string(),
            train_on_input: get_bool(section, "train_on_input", false)?,
            system: get_str(section, "new_system_prompt")?.map(str::to_string),
            tools_column: None,
        })
    }

    pub fn conversation(&self, table: &Table, record: &Record) -> Result<Conversation> {
        let bad = |what: String| {
            DataError::Dataset(format!(
                "{}: column '{}' {what}",
                table.locate(record),
                self.column
            ))
        };
        let turns = match record.values.get(&self.column) {
            Some(Value::Array(turns)) => turns,
            Some(Value::String(s)) => {
                return Err(bad(format!(
                    "must hold a list of messages, got the text {:?}",
                    s.chars().take(40).collect::<String>()
                )))
            }
            _ => return Err(bad("must hold a list of messages".into())),
        };
        let mut messages = Vec::new();
        if let Some(system) = &self.system {
            messages.push(ChatMessage::system(system.clone()));
        }
        let (role_key, content_key) = match self.style {
            ChatStyle::OpenAi => ("role", "content"),
            ChatStyle::ShareGpt => ("from", "value"),
        };
        for (i, turn) in turns.iter().enumerate() {
            let field = |key: &str| turn.get(key);
            let role = field(role_key)
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("message {} has no text '{role_key}'", i + 1)))?;
            let role = match self.style {
                ChatStyle::OpenAi => role.to_string(),
                ChatStyle::ShareGpt => match role {
                    "system" => "system",
                    "human" => "user",
                    "gpt" => "assistant",
                    other => {
                        return Err(bad(format!(
                            "message {}: sharegpt 'from' must be system, human or gpt, got \
                             '{other}'",
                            i + 1
                        )))
                    }
                }
                .to_string(),
            };
            if role == "system" && self.system.is_some() {
                continue; // new_system_prompt replaces the row's own.
            }
            let content = match field(content_key) {
                Some(Value::String(s)) => s.clone(),
                // OpenAI content parts: the text parts, joined.
                Some(Value::Array(parts)) if self.style == ChatStyle::OpenAi => {
                    let mut text = String::new();
                    for part in parts {
                        match (part.get("type").and_then(Value::as_str), part.get("text")) {
                            (Some("text"), Some(Value::String(t))) => text.push_str(t),
                            _ => {
                                return Err(bad(format!(
                                    "message {}: only text content parts are supported, got {part}",
                                    i + 1
                                )))
                            }
                        }
                    }
                    text
                }
                // An assistant turn that only calls tools: no content for the template.
                None | Some(Value::Null)
                    if self.style == ChatStyle::OpenAi
                        && field("tool_calls").is_some_and(|v| !v.is_null()) =>
                {
                    messages.push(ChatMessage::without_content(role));
                    continue;
                }
                _ => {
                    return Err(bad(format!(
                        "message {} has no text '{content_key}'",
                        i + 1
                    )))
                }
            };
            messages.push(ChatMessage::new(role, content));
        }
        if !messages.iter().any(|m| m.role == "assistant") {
            return Err(bad("has no assistant message to learn from".into()));
        }
        Ok(Conversation {
            messages,
            train_on_input: self.train_on_input,
            tools: None,
        })
    }
}

/// `text_completion_dataset`'s text column of a row.
pub(crate) fn text_of(table: &Table, record: &Record, column: &str) -> Result<String> {
    Ok(cell_text(table, record, column, false)?.unwrap_or_default())
}

/// The preference builders' columns: two lists of messages (`preference_dataset`,
/// `hh_rlhf_helpful_dataset`: torchtune's `ChosenRejectedToMessages`), or one prompt and two
/// responses (`stack_exchange_paired_dataset`: `StackExchangePairedToMessages`).
pub(crate) enum PairSpec {
    Messages {
        chosen: ChatSpec,
        rejected: ChatSpec,
    },
    Texts {
        prompt: String,
        chosen: String,
        rejected: String,
        train_on_input: bool,
    },
}

impl PairSpec {
    /// Reads `column_map`, `train_on_input` (default false) and, for message lists,
    /// `new_system_prompt`.
    pub fn from_section(section: &Map<String, Value>, texts: bool) -> Result<Self> {
        let columns = column_map(section)?;
        let column =
            |key: &str, default: &str| mapped(&columns, key).unwrap_or(default).to_string();
        let train_on_input = get_bool(section, "train_on_input", false)?;
        if texts {
            return Ok(PairSpec::Texts {
                prompt: column("prompt", "question"),
                chosen: column("chosen", "response_j"),
                rejected: column("rejected", "response_k"),
                train_on_input,
            });
        }
        let system = get_str(section, "new_system_prompt")?.map(str::to_string);
        let tools_column = get_str(section, "tools_column")?.map(str::to_string);
        let side = |key: &str| ChatSpec {
            style: ChatStyle::OpenAi,
            column: column(key, key),
            train_on_input,
            system: system.clone(),
            tools_column: tools_column.clone(),
        };
        Ok(PairSpec::Messages {
            chosen: side("chosen"),
            rejected: side("rejected"),
        })
    }

    /// How many leading messages are the row's own prompt column (text rows: the question),
    /// `None` for message lists (the prompt is what chosen and rejected share).
    pub fn explicit_prompt(&self) -> Option<usize> {
        match self {
            PairSpec::Messages { .. } => None,
            PairSpec::Texts { .. } => Some(1),
        }
    }

    /// Checks the needed columns exist before any row is read.
    pub fn check(&self, table: &Table) -> Result<()> {
        match self {
            PairSpec::Messages { chosen, rejected } => {
                table.require(&chosen.column)?;
                table.require(&rejected.column)
            }
            PairSpec::Texts {
                prompt,
                chosen,
                rejected,
                ..
            } => {
                table.require(prompt)?;
                table.require(chosen)?;
                table.require(rejected)
            }
        }
    }

    /// The chosen and the rejected conversation of a row; message lists with the row's tools
    /// (`tools_column`, else a `tools` column) and their messages' other keys (`tool_calls`, ...),
    /// as [`ChatSpec::conversation_with_tools`].
    pub fn conversations(
        &self,
        table: &Table,
        record: &Record,
        cells: &mut OrderedCells,
    ) -> Result<(Conversation, Conversation)> {
        match self {
            PairSpec::Messages { chosen, rejected } => Ok((
                chosen.conversation_with_tools(table, record, cells)?,
                rejected.conversation_with_tools(table, record, cells)?,
            )),
            PairSpec::Texts {
                prompt,
                chosen,
                rejected,
                train_on_input,
            } => {
                let prompt = cell_text(table, record, prompt, false)?.unwrap_or_default();
                let side = |column: &str| -> Result<Conversation> {
                    let response = cell_text(table, record, column, false)?.unwrap_or_default();
                    Ok(Conversation {
                        messages: vec![
                            ChatMessage::new("user", prompt.clone()),
                            ChatMessage::new("assistant", response),
                        ],
                        train_on_input: *train_on_input,
                        tools: None,
                    })
                };
                Ok((side(chosen)?, side(rejected)?))
            }
        }
    }
}
