//! The messages a template sees, as transformers hands them over (`_normalize_chat_messages` and
//! `_alias_reasoning_fields` in transformers' `chat_template_utils.py` and
//! `tokenization_utils_base.py`): each message's keys whose value is `None` dropped, and a
//! message's reasoning (`reasoning_content`, `thinking` or `reasoning`, the first not `None`)
//! given to the template as both `thinking` and `reasoning_content`.

use minijinja::Value;

use super::ChatMessage;

/// The names a message's reasoning is passed under, in transformers' order of preference.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// `messages` as the list of maps the template iterates over.
pub(super) fn template_messages(messages: &[ChatMessage]) -> Value {
    Value::from(messages.iter().map(template_message).collect::<Vec<_>>())
}

/// One message: `role`, `content` (unless it has none), then its other keys in order (those
/// holding `None` left out);
/// with a reasoning `r`, `{"thinking": r, **message, "reasoning_content": r}` as transformers builds
/// it (`thinking` first, keeping the message's own value if it has one; `reasoning_content` in its
/// place if the message has one, last otherwise).
fn template_message(message: &ChatMessage) -> Value {
    let mut entries: Vec<(String, Value)> = Vec::with_capacity(message.extra.len() + 3);
    entries.push(("role".into(), Value::from(message.role.as_str())));
    if message.has_content() {
        entries.push(("content".into(), Value::from(message.content.as_str())));
    }
    for (key, value) in &message.extra {
        if key == "role" || key == "content" || value.is_none() {
            continue;
        }
        entries.push((key.clone(), value.clone()));
    }
    let reasoning = REASONING_FIELDS.iter().find_map(|name| {
        entries
            .iter()
            .find(|(key, value)| key == name && !value.is_none())
            .map(|(_, value)| value.clone())
    });
    if let Some(reasoning) = reasoning {
        // `"thinking"` comes first, holding the message's own value when it has one.
        let thinking = match entries.iter().position(|(key, _)| key == "thinking") {
            Some(at) => entries.remove(at),
            None => ("thinking".into(), reasoning.clone()),
        };
        entries.insert(0, thinking);
        match entries
            .iter_mut()
            .find(|(key, _)| key == "reasoning_content")
        {
            Some(entry) => entry.1 = reasoning,
            None => entries.push(("reasoning_content".into(), reasoning)),
        }
    }
    Value::from_iter(entries)
}
