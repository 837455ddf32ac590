#!/usr/bin/env python3
"""Writes tests/fixtures/datasets/: small data files in every source format, and the references
the dataset tests check ferrotune against:

- rows.json: the rows HF `datasets.load_dataset` reads from each file (and with split slices);
- splits.json: HF `ReadInstruction` absolute ranges for split strings and split sizes;
- expected.json: token ids and labels of each builder case for the real tokenizers
  (transformers' AutoTokenizer / apply_chat_template), computed independently of ferrotune:
  assistant turns are located in the rendered chat by each template's own turn markers.

Needs: transformers, datasets, pyarrow; the tokenizers fetched by scripts/fetch-assets.sh.
"""

import csv
import json
import os
import re
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
from datasets.arrow_reader import ReadInstruction
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "datasets"
ASSETS = Path(os.environ.get("FERROTUNE_ASSETS") or Path.home() / ".cache/ferrotune/assets")
IGNORE = -100

datasets.disable_progress_bars()

ALPACA = [
    {"instruction": "Give three tips for staying healthy.", "input": "",
     "output": "1. Eat a balanced diet.\n2. Exercise regularly.\n3. Sleep well."},
    {"instruction": "Translate to French.", "input": "Good morning, my friend!",
     "output": "Bonjour, mon ami !"},
    {"instruction": "What is 12 * 7?", "input": "", "output": "84"},
    {"instruction": "Summarize the text.", "input": "Rust is a systems language focused on safety, speed and concurrency.",
     "output": "Rust: safe, fast, concurrent."},
    {"instruction": "Name a color.", "input": "", "output": "Blue"},
    {"instruction": "Fix the spelling: 'recieve'.", "input": "", "output": "receive"},
    {"instruction": "Write a haiku about rain.", "input": "",
     "output": "Soft rain on the roof\nwhispers to the sleeping town\npuddles hold the sky"},
]

SAMSUM = [
    {"id": "1", "dialogue": "Amanda: I baked cookies. Do you want some?\nJerry: Sure!\nAmanda: I'll bring you tomorrow :-)",
     "summary": "Amanda baked cookies and will bring Jerry some tomorrow."},
    {"id": "2", "dialogue": "Olivia: Who are you voting for?\nOliver: Liberals as always.\nOlivia: Me too!!",
     "summary": "Olivia and Olivier are voting for liberals in this election."},
]

GRAMMAR = [
    {"input": "He go to school every days.", "output": "He goes to school every day."},
    {"input": "Their is many reason for this.", "output": "There are many reasons for this."},
]

QA = [
    {"question": "What is the capital of Japan?", "answer": "Tokyo."},
    {"question": "How many legs does a spider have?", "answer": "Eight."},
]

CHATS_OPENAI = [
    {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
    ]},
    {"messages": [
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "Seven is prime."},
    ]},
]

CHATS_SHAREGPT = [
    {"conversations": [
        {"from": "human", "value": "Tell me a fun fact."},
        {"from": "gpt", "value": "Octopuses have three hearts."},
        {"from": "human", "value": "Another one?"},
        {"from": "gpt", "value": "Honey never spoils."},
    ]},
    {"conversations": [
        {"from": "system", "value": "Answer in one word."},
        {"from": "human", "value": "Opposite of hot?"},
        {"from": "gpt", "value": "Cold"},
    ]},
]

TEXT_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "Rust makes systems programming safer.",
    "",
    "Tokenizers split text into pieces called tokens.",
]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_sources():
    OUT.mkdir(parents=True, exist_ok=True)
    src = OUT / "alpaca"
    src.mkdir(exist_ok=True)
    write_jsonl(src / "data.jsonl", ALPACA)
    (src / "data_array.json").write_text(json.dumps(ALPACA, indent=1, ensure_ascii=False))
    (src / "data_field.json").write_text(json.dumps({"version": 1, "data": ALPACA}, ensure_ascii=False))
    with open(src / "data.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["instruction", "input", "output"])
        w.writeheader()
        w.writerows(ALPACA)
    pq.write_table(pa.Table.from_pylist(ALPACA), src / "data.parquet")
    # Two-file folder and a split mapping: the same rows cut in two.
    parts = OUT / "alpaca_parts"
    parts.mkdir(exist_ok=True)
    write_jsonl(parts / "part-0.jsonl", ALPACA[:3])
    write_jsonl(parts / "part-1.jsonl", ALPACA[3:])
    splits = OUT / "alpaca_splits"
    splits.mkdir(exist_ok=True)
    write_jsonl(splits / "train.jsonl", ALPACA[:5])
    write_jsonl(splits / "validation.jsonl", ALPACA[5:])

    write_jsonl(OUT / "samsum.jsonl", SAMSUM)
    write_jsonl(OUT / "grammar.jsonl", GRAMMAR)
    write_jsonl(OUT / "qa.jsonl", QA)
    write_jsonl(OUT / "chat_openai.jsonl", CHATS_OPENAI)
    (OUT / "chat_sharegpt.json").write_text(json.dumps(CHATS_SHAREGPT, indent=1))
    pq.write_table(pa.Table.from_pylist(CHATS_OPENAI), OUT / "chat_openai.parquet")
    (OUT / "text.txt").write_text("\n".join(TEXT_LINES) + "\n")

    # Parquet with every value kind the reader handles.
    mixed = pa.table({
        "text": pa.array(["a", None, "c"], pa.string()),
        "i32": pa.array([1, -2, None], pa.int32()),
        "i64": pa.array([10_000_000_000, 0, 7], pa.int64()),
        "f64": pa.array([0.5, -1.25, None], pa.float64()),
        "f32": pa.array([1.5, 2.0, 0.25], pa.float32()),
        "flag": pa.array([True, False, None], pa.bool_()),
        "tags": pa.array([["x", "y"], [], None], pa.list_(pa.string())),
        "ids": pa.array([[1, 2, 3], [4], [5, None]], pa.list_(pa.int64())),
        "meta": pa.array([{"k": "v", "n": 1}, None, {"k": "w", "n": 2}],
                         pa.struct([("k", pa.string()), ("n", pa.int64())])),
    })
    pq.write_table(mixed, OUT / "mixed.parquet")

    # Pre-tokenized rows.
    write_jsonl(OUT / "tokenized.jsonl", [
        {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]},
        {"input_ids": [5, 6]},
        {"input_ids": [7, 8, 9, 10, 11, 12], "labels": [-100, 8, 9, 10, 11, 12]},
    ])


def hf_rows(fmt, files, split="train", **kw):
    ds = datasets.load_dataset(fmt, data_files=files, split=split, **kw)
    return ds.to_list()


def write_rows():
    s = OUT / "alpaca"
    rows = {
        "json_lines": hf_rows("json", str(s / "data.jsonl")),
        "json_array": hf_rows("json", str(s / "data_array.json")),
        "json_field": hf_rows("json", str(s / "data_field.json"), field="data"),
        "csv": hf_rows("csv", str(s / "data.csv")),
        "parquet": hf_rows("parquet", str(s / "data.parquet")),
        "text": hf_rows("text", str(OUT / "text.txt")),
        "mixed_parquet": hf_rows("parquet", str(OUT / "mixed.parquet")),
        "chat_parquet": hf_rows("parquet", str(OUT / "chat_openai.parquet")),
        "glob": hf_rows("json", str(OUT / "alpaca_parts" / "*.jsonl")),
        "folder": datasets.load_dataset(str(OUT / "alpaca_parts"), split="train").to_list(),
        "split_folder": datasets.load_dataset(str(OUT / "alpaca_splits"), split="validation").to_list(),
        "sliced": {},
    }
    for spec in ["train[2:5]", "train[:40%]", "train[-3:]", "train[10%:45%]", "train[-50%:]",
                 "train[:1]+train[-1:]"]:
        rows["sliced"][spec] = hf_rows("json", str(s / "data.jsonl"), split=spec)
    files = {"train": str(OUT / "alpaca_splits/train.jsonl"),
             "validation": str(OUT / "alpaca_splits/validation.jsonl")}
    rows["validation"] = hf_rows("json", files, split="validation")
    rows["train+validation[:1]"] = hf_rows("json", files, split="train+validation[:1]")
    (OUT / "rows.json").write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n")


def write_splits():
    specs = ["train", "train[:2000]", "train[100:200]", "train[:1%]", "train[10%:20%]",
             "train[-10%:]", "train[:-5]", "train[-5:-2]", "train[33%:67%]", "train[:50%]",
             "train[1%:3%]", "train[50:10]", "train[5:1000000]", "train[-1000000:3]",
             "train[:25%](pct1_dropremainder)", "train[:-25%]", "train+validation",
             "train[:10%]+validation[-1:]", "train[1_0:2_0]"]
    sizes = [1, 3, 7, 10, 50, 101, 150, 250, 1001, 2345]
    cases = []
    for n in sizes:
        name2len = {"train": n, "validation": max(n // 3, 1)}
        for spec in specs:
            try:
                abs_instr = ReadInstruction.from_spec(spec).to_absolute(name2len)
                result = [[a.splitname, a.from_, a.to] for a in abs_instr]
            except ValueError as e:
                result = str(e)
            cases.append({"spec": spec, "sizes": name2len, "ranges": result})
    (OUT / "splits.json").write_text(json.dumps(cases, indent=1) + "\n")


# ---------------------------------------------------------------- tokenization reference

# Each template's assistant turn: the text before the content, and the end-of-turn text after it.
TURN_MARKERS = {
    "qwen3": ("<|im_start|>assistant\n", "<|im_end|>\n"),
    "llama3_1": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "gemma3": ("<start_of_turn>model\n", "<end_of_turn>\n"),
}


def load_tok(name):
    return AutoTokenizer.from_pretrained(str(ASSETS / "tokenizers" / name))


def bos_prefix(tok):
    with_ = tok("a")["input_ids"]
    without = tok("a", add_special_tokens=False)["input_ids"]
    assert with_[len(with_) - len(without):] == without
    return with_[: len(with_) - len(without)]


def chat_reference(name, tok, messages, train_on_input):
    """Labels: the tokens of each assistant turn (content + end-of-turn text), located by the
    template's turn markers; with train_on_input, everything after the leading system turn."""
    text = tok.apply_chat_template(messages, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    # The whole-conversation ids are what apply_chat_template tokenizes.
    assert ids == list(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    spans = []
    if train_on_input:
        start = 0
        if messages[0]["role"] == "system":
            sys_text = tok.apply_chat_template(messages[:1], tokenize=False)
            if text.startswith(sys_text):
                start = len(sys_text)
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
    return ids, labels


def plain_reference(tok, messages, train_on_input):
    """No chat template: per turn [bos] + tokens(message)...; eos after each assistant message."""
    prefix = bos_prefix(tok)
    ids, labels, turn_start = [], [], True
    for m in messages:
        if turn_start:
            ids += prefix
            labels += [IGNORE] * len(prefix)
        toks = tok(m["content"], add_special_tokens=False)["input_ids"]
        learn = m["role"] == "assistant" or (train_on_input and m["role"] != "system")
        ids += toks
        labels += toks if learn else [IGNORE] * len(toks)
        turn_start = m["role"] == "assistant"
        if m["role"] == "assistant":
            ids.append(tok.eos_token_id)
            labels.append(tok.eos_token_id)
    return ids, labels


def truncate(ids, labels, max_len, eos):
    """torchtune's truncate: keep max_len tokens; when cut, the last becomes EOS."""
    if len(ids) <= max_len:
        return ids, labels
    ids, labels = ids[:max_len], labels[:max_len]
    ids[-1] = eos
    if labels[-1] != IGNORE:
        labels[-1] = eos
    return ids, labels


def alpaca_prompt(row, icol="instruction", incol="input"):
    if row.get(incol):
        return ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n"
                f"### Instruction:\n{row[icol]}\n\n### Input:\n{row[incol]}\n\n### Response:\n")
    return ("Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request.\n\n"
            f"### Instruction:\n{row[icol]}\n\n### Response:\n")


def prompt_response(rows, prompt_fn, out_col, system=None):
    convs = []
    for r in rows:
        msgs = [{"role": "system", "content": system}] if system else []
        msgs += [{"role": "user", "content": prompt_fn(r)}, {"role": "assistant", "content": r[out_col]}]
        convs.append(msgs)
    return convs


def openai_convs(rows, system=None):
    out = []
    for r in rows:
        msgs = [{"role": "system", "content": system}] if system else []
        msgs += [m for m in r["messages"] if not (system and m["role"] == "system")]
        out.append(msgs)
    return out


def sharegpt_convs(rows):
    role = {"human": "user", "gpt": "assistant", "system": "system"}
    return [[{"role": role[m["from"]], "content": m["value"]} for m in r["conversations"]] for r in rows]


def sft_cases():
    summarize = lambda r: f"Summarize this dialogue:\n{r['dialogue']}\n---\nSummary:\n"
    grammar = lambda r: f"Correct this to standard English: {r['input']}\n---\nCorrected: "
    qa = lambda r: f"Question: {r['question']}\n\nAnswer: "
    return {
        "alpaca_default": (
            {"_component_": "torchtune.datasets.alpaca_dataset", "source": "json",
             "data_files": "alpaca/data.jsonl"},
            prompt_response(ALPACA, alpaca_prompt, "output"), True, None),
        "alpaca_masked": (
            {"_component_": "alpaca_cleaned_dataset", "source": "alpaca/data.parquet",
             "train_on_input": False},
            prompt_response(ALPACA, alpaca_prompt, "output"), False, None),
        "instruct_alpaca_template": (
            {"_component_": "instruct_dataset", "source": "json", "data_files": "alpaca/data.jsonl",
             "template": "torchtune.data.AlpacaInstructTemplate", "split": "train[1:4]"},
            prompt_response(ALPACA[1:4], alpaca_prompt, "output"), False, None),
        "instruct_alpaca_truncated": (
            {"_component_": "instruct_dataset", "source": "csv", "data_files": "alpaca/data.csv",
             "template": "AlpacaInstructTemplate", "max_seq_len": 40, "train_on_input": True},
            prompt_response(ALPACA, alpaca_prompt, "output"), True, 40),
        "samsum_default": (
            {"_component_": "torchtune.datasets.samsum_dataset", "source": "samsum.jsonl"},
            prompt_response(SAMSUM, summarize, "summary"), False, None),
        "instruct_summarize_train_on_input": (
            {"_component_": "instruct_dataset", "source": "json", "data_files": "samsum.jsonl",
             "template": "torchtune.data.SummarizeTemplate",
             "column_map": {"dialogue": "dialogue", "output": "summary"}, "train_on_input": True},
            prompt_response(SAMSUM, summarize, "summary"), True, None),
        "instruct_summarize_masked": (
            {"_component_": "instruct_dataset", "source": "json", "data_files": "samsum.jsonl",
             "template": "SummarizeTemplate",
             "column_map": {"input": "dialogue", "output": "summary"}},
            prompt_response(SAMSUM, summarize, "summary"), False, None),
        "grammar_default": (
            {"_component_": "grammar_dataset", "source": "json", "data_files": ["grammar.jsonl"]},
            prompt_response(GRAMMAR, grammar, "output"), False, None),
        "instruct_qa_system": (
            {"_component_": "instruct_dataset", "source": "qa.jsonl",
             "template": "torchtune.data.QuestionAnswerTemplate",
             "column_map": {"question": "question", "output": "answer"},
             "new_system_prompt": "Answer briefly."},
            prompt_response(QA, qa, "answer", system="Answer briefly."), False, None),
        "instruct_plain_system_train_on_input": (
            {"_component_": "instruct_dataset", "source": "qa.jsonl",
             "column_map": {"input": "question", "output": "answer"},
             "new_system_prompt": "Answer briefly.", "train_on_input": True},
            prompt_response(QA, lambda r: r["question"], "answer", system="Answer briefly."), True, None),
        "chat_openai": (
            {"_component_": "torchtune.datasets.chat_dataset", "source": "json",
             "data_files": "chat_openai.jsonl", "conversation_style": "openai"},
            openai_convs(CHATS_OPENAI), False, None),
        "chat_openai_parquet_new_system": (
            {"_component_": "chat_dataset", "source": "parquet", "data_files": "chat_openai.parquet",
             "conversation_style": "openai", "conversation_column": "messages",
             "new_system_prompt": "Be kind."},
            openai_convs(CHATS_OPENAI, system="Be kind."), False, None),
        "chat_sharegpt": (
            {"_component_": "chat_dataset", "source": "chat_sharegpt.json",
             "conversation_style": "sharegpt"},
            sharegpt_convs(CHATS_SHAREGPT), False, None),
        "chat_sharegpt_train_on_input": (
            {"_component_": "chat_dataset", "source": "json", "data_files": "chat_sharegpt.json",
             "conversation_style": "sharegpt", "train_on_input": True},
            sharegpt_convs(CHATS_SHAREGPT), True, None),
    }


def write_expected():
    names = ["qwen3", "llama2", "llama3_1", "gemma3"]
    toks = {n: load_tok(n) for n in names}
    cases = {}
    for case, (section, convs, train_on_input, max_len) in sft_cases().items():
        per_tok = {}
        for name, tok in toks.items():
            if name == "gemma3" and train_on_input and any(c[0]["role"] == "system" for c in convs):
                continue  # Gemma folds the system prompt into the user turn; covered elsewhere.
            rows = []
            for msgs in convs:
                if tok.chat_template is not None:
                    ids, labels = chat_reference(name, tok, msgs, train_on_input)
                else:
                    ids, labels = plain_reference(tok, msgs, train_on_input)
                if max_len is not None:
                    ids, labels = truncate(ids, labels, max_len, tok.eos_token_id)
                rows.append({"input_ids": ids, "labels": labels})
            per_tok[name] = rows
        cases[case] = {"section": section, "expected": per_tok}

    # Text completion: [bos if the tokenizer adds one] + tokens(text) [+ eos]; loss everywhere.
    for case, section, texts, add_eos, max_len in [
        ("text_completion_txt", {"_component_": "text_completion_dataset", "source": "text",
                                 "data_files": "text.txt"}, TEXT_LINES, True, None),
        ("text_completion_column_no_eos", {"_component_": "torchtune.datasets.text_completion_dataset",
                                           "source": "alpaca/data.jsonl", "column": "output",
                                           "add_eos": False, "max_seq_len": 12},
         [r["output"] for r in ALPACA], False, 12),
    ]:
        per_tok = {}
        for name, tok in toks.items():
            rows = []
            for t in texts:
                ids = bos_prefix(tok) + tok(t, add_special_tokens=False)["input_ids"]
                if add_eos:
                    ids.append(tok.eos_token_id)
                if max_len is not None:
                    # torchtune's TextCompletionDataset keeps max_seq_len - 1 tokens.
                    ids = ids[: max_len - 1]
                rows.append({"input_ids": ids, "labels": list(ids)})
            per_tok[name] = rows
        cases[case] = {"section": section, "expected": per_tok}

    # What each template renders, for the "concatenation = whole conversation" check.
    (OUT / "expected.json").write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    write_sources()
    write_rows()
    write_splits()
    write_expected()
    print("wrote", OUT)
