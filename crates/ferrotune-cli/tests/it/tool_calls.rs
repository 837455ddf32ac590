//! `lora_finetune_single_device` on tool-calling rows: a `tools` column, assistant `tool_calls`
//! and `tool` results, rendered by a chat template that writes the tools and the calls.

use crate::common::{fixtures, metrics_lines, run_recipe, text, tmpdir, TINY_LORA};

/// A ChatML template with tools, in the manner of Qwen's: the tools' schemas in a system turn,
/// each call as `<tool_call>` JSON, tool results as their own turns.
const TOOL_TEMPLATE: &str = "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\
{%- for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}\
{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}\
{%- for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": \
{{ c.function.arguments if c.function.arguments is string else c.function.arguments | tojson }}}\
</tool_call>{% endfor %}<|im_end|>\n{% endfor %}\
{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

const ROWS: &str = r#"{"messages": [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, {"role": "tool", "name": "get_weather", "content": "22 C"}, {"role": "assistant", "content": "22 C in Paris."}], "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}
{"messages": [{"role": "user", "content": "Time in Oslo?"}, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_time", "arguments": "{\"zone\": \"Europe/Oslo\"}"}}]}, {"role": "tool", "content": "09:30"}, {"role": "assistant", "content": "It is 09:30."}], "tools": "[{\"type\": \"function\", \"function\": {\"name\": \"get_time\", \"parameters\": {\"type\": \"object\"}}}]"}
"#;

/// A LoRA run on a tiny dataset of tool calls starts, and logs a finite loss at each step.
#[test]
fn lora_trains_on_tool_calls() {
    let dir = tmpdir("tools", "lora");
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    for entry in std::fs::read_dir(fixtures().join("qwen2/model")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), model.join(entry.file_name())).unwrap();
    }
    std::fs::write(model.join("chat_template.jinja"), TOOL_TEMPLATE).unwrap();
    let data = dir.join("tools.jsonl");
    std::fs::write(&data, ROWS).unwrap();
    let dataset = format!(
        "dataset:\n  _component_: torchtune.datasets.chat_dataset\n  source: {}\n  \
         conversation_style: openai\n  tools_column: tools\n",
        data.display()
    );
    let start = TINY_LORA.find("dataset:").unwrap();
    let end = TINY_LORA.find("seed:").unwrap();
    let yaml = format!("{}{dataset}{}", &TINY_LORA[..start], &TINY_LORA[end..])
        .replace("OUT", &dir.join("out").display().to_string())
        .replace("MODEL", &model.display().to_string())
        .replace("batch_size: 2", "batch_size: 1");
    let cfg = dir.join("config.yaml");
    std::fs::write(&cfg, yaml).unwrap();
    let out = run_recipe(
        "lora_finetune_single_device",
        &cfg,
        &dir.join("out"),
        &[],
        &dir,
        &[],
    );
    assert!(out.status.success(), "{}", text(&out));
    let lines = metrics_lines(&dir.join("out/logs/metrics.jsonl"));
    assert_eq!(lines.len(), 2, "one logged step per row: {lines:?}");
    for line in &lines {
        let loss = line["loss"].as_f64().unwrap();
        assert!(loss.is_finite() && loss > 0.0, "{line}");
    }
}
