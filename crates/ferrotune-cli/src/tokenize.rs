//! `ferrotune tokenize`: shows the exact ids (and rendered chat template) a model is fed.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use ferrotune_data::ChatMessage;

use crate::model_io::tokenizer_for;

#[derive(Args)]
pub struct TokenizeArgs {
    /// A folder with tokenizer.json (and tokenizer_config.json), or a .gguf file.
    #[arg(long)]
    tokenizer: PathBuf,
    /// Text to encode.
    #[arg(
        long,
        conflicts_with = "messages",
        required_unless_present = "messages"
    )]
    text: Option<String>,
    /// A JSON file with a list of {"role", "content"} messages, rendered with the chat template.
    #[arg(long)]
    messages: Option<PathBuf>,
    /// Append the template's assistant prompt (with --messages).
    #[arg(long)]
    add_generation_prompt: bool,
    /// A JSON file with the tools (a list of JSON schemas) the template renders the messages
    /// with, as transformers' `apply_chat_template(messages, tools=tools)` (with --messages).
    #[arg(long, requires = "messages")]
    tools: Option<PathBuf>,
    /// Do not add special tokens such as BOS (with --text).
    #[arg(long)]
    no_special_tokens: bool,
    /// Print {"ids": [...], "text": "..."} instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: TokenizeArgs) -> Result<()> {
    let tok = tokenizer_for(&args.tokenizer)?;
    let (text, ids) = match (&args.text, &args.messages) {
        (Some(text), _) => (text.clone(), tok.encode(text, !args.no_special_tokens)?),
        (None, Some(file)) => {
            let raw = std::fs::read_to_string(file)
                .with_context(|| format!("{}: cannot read", file.display()))?;
            let messages: Vec<ChatMessage> = serde_json::from_str(&raw).with_context(|| {
                format!(
                    "{}: expected a JSON list of {{\"role\", \"content\"}} messages",
                    file.display()
                )
            })?;
            // Parsed straight into a template value: the schemas keep their keys' file order,
            // which the template's `tojson` writes them in.
            let tools: Option<minijinja::Value> = match &args.tools {
                Some(path) => {
                    let raw = std::fs::read_to_string(path)
                        .with_context(|| format!("{}: cannot read", path.display()))?;
                    let tools: minijinja::Value =
                        serde_json::from_str(&raw).with_context(|| {
                            format!("{}: expected a JSON list of tool schemas", path.display())
                        })?;
                    if tools.kind() != minijinja::value::ValueKind::Seq {
                        anyhow::bail!("{}: expected a JSON list of tool schemas", path.display());
                    }
                    Some(tools)
                }
                None => None,
            };
            let rendered = tok.apply_chat_template_with_tools(
                &messages,
                tools.as_ref(),
                args.add_generation_prompt,
            )?;
            let ids = tok.encode(&rendered, false)?;
            (rendered, ids)
        }
        (None, None) => unreachable!("clap requires --text or --messages"),
    };
    if args.json {
        println!("{}", serde_json::json!({ "ids": ids, "text": text }));
    } else {
        if args.messages.is_some() {
            println!("{text}");
            println!("---");
        }
        for id in &ids {
            let piece = tok.id_to_token(*id).unwrap_or_default();
            println!("{id}\t{piece:?}");
        }
        println!("{} tokens", ids.len());
    }
    Ok(())
}
