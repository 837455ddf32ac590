#!/usr/bin/env python3
"""Writes the tokenizer references that crates/ferrotune-data/tests check ferrotune's tokenizers against.

All references come from HF transformers (AutoTokenizer), the reference stack.

  tests/fixtures/smollm2_tokenizer.json
      The tokenizer transformers builds from SmolLM2-135M-Instruct.Q4_1.gguf (from scripts/fetch-assets.sh):
      its special tokens and ids, plain-text encode/decode references and chat renders.
  tests/fixtures/tokenizer_texts.json
      Extra encode/decode references for the real tokenizer folders (llama3_1, qwen3, gemma3, llama2, from
      scripts/fetch-assets.sh) and for tests/fixtures/tiny_tokenizer.
  tests/fixtures/chat_template_cases.json
      Small templates exercising the Jinja features chat templates use (Python str() of values, string and
      dict methods, tojson, whitespace control, loop variables, namespace, raise_exception, ...), rendered by
      transformers' own template compiler (`_compile_jinja_template`) with `messages`, `add_generation_prompt`
      and a few special tokens.
  tests/fixtures/gguf_tokenizers/*.gguf + *.json
      Small GGUF files (no tensors) written here to exercise each GGUF tokenizer path transformers has:
      `spm_llama` (SentencePiece BPE, merges derived from scores, byte fallback, control and user-defined
      tokens, no add_bos flag), `spm_gemma` (Gemma: whitespace tokens re-spelled, merges from token order),
      `bpe_qwen2` (byte-level BPE with the qwen2 split regex, a mislabelled control token, a re-spelled token,
      add_bos_token set). Each .json holds what transformers makes of its .gguf.

Usage: python3 scripts/make_tokenizer_fixtures.py   (needs transformers, tokenizers, gguf, numpy; the real
assets come from scripts/fetch-assets.sh, FERROTUNE_ASSETS overrides their folder)
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Plain texts every tokenizer is checked on; `{specials}` is replaced by the tokenizer's own special tokens.
TEXTS = [
    "Hello world",
    "",
    " leading space, trailing space ",
    "  multiple   spaces\tand\ttabs\n\nnew lines\r\nand a   \n",
    "Unicode: héllo wörld — naïve café, 你好世界, Здравствуй, 🤖🚀 ñ",
    "Digits 1234567 3.14159 2024-01-01 and 100,000!",
    "don't can't I'm we're they'll you'd it's",
    "def f(x):\n    return x ** 2  # squared\n",
    "{specials}",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi  twice.\n"},
        {"role": "assistant", "content": "hi hi"},
        {"role": "user", "content": "Unicode? é 你好 🤖"},
    ],
]


# (name, template): rendered with TEMPLATE_MESSAGES, add_generation_prompt True, and TEMPLATE_TOKENS.
TEMPLATE_CASES = [
    ("python_str", "{{ none }}|{{ true }}|{{ false }}|{{ [1, 'a', none, 2.5] }}|{{ {'a': [true]} }}|{{ 7 / 2 }}|{{ 4 / 2 }}|{{ 7 // 2 }}|{{ 2 ** 10 }}|{{ 1e-7 }}|{{ 'x' * 3 }}"),
    ("print_messages", "{{ messages[0] }}|{{ messages | length }}|{{ messages[-1]['role'] }}|{{ messages[1:] | length }}"),
    ("reverse_loop", "{% for m in messages[::-1] %}{{ loop.index0 }}:{{ m.role }}{% if not loop.last %},{% endif %}{% endfor %}"),
    ("loop_vars", "{% for m in messages %}{{ loop.index }}/{{ loop.length }}/{{ loop.revindex0 }}{{ '[first]' if loop.first }}{{ loop.cycle('a', 'b') }} {% endfor %}"),
    ("whitespace", "{% for m in messages %}\n    {% if m.role == 'user' %}\n        U: {{ m.content }}\n    {% else %}\n        {{- m.role }}: {{ m.content -}}\n    {% endif %}\n{% endfor %}\n{%- if add_generation_prompt %}\n  GEN\n{% endif %}"),
    ("strip_methods", "{% for m in messages %}[{{ m.content.strip() }}][{{ m.content.lstrip() }}][{{ m.content.rstrip() }}][{{ m.content | trim }}][{{ m.content.strip(' .!') }}]{% endfor %}"),
    ("split_methods", "{% for m in messages %}{{ m.content.split() }}{{ m.content.split(' ') }}{{ m.content.split(' ', 1) }}{{ m.content.rsplit(None, 1) }}{{ m.content.splitlines() }}{% endfor %}"),
    ("string_methods", "{% for m in messages %}{{ m.content.upper() }}|{{ m.content.lower() }}|{{ m.content.title() }}|{{ m.content | title }}|{{ m.content | capitalize }}|{{ m.content.startswith('Hi') }}|{{ m.content.endswith(('!', '?')) }}|{{ m.content.find('o') }}|{{ m.content.replace('o', '0') }}|{{ m.content.count('o') }};{% endfor %}"),
    ("think_split", "{% for m in messages %}{% if '</think>' in m.content %}{{ m.content.split('</think>')[-1].lstrip('\\n') }}|{{ m.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}{% else %}{{ m.content }}{% endif %};{% endfor %}"),
    ("tojson", "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}|{{ {'b': 1, 'a': 'é\\n<>&\\''} | tojson(sort_keys=true) }}|{{ [1.5, none, true] | tojson(separators=(',', ':')) }}|{{ 'ü' | tojson(ensure_ascii=true) }}"),
    ("dict_methods", "{% set d = {'x': 1, 'y': [2]} %}{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{{ d.get('z', 'none') }}|{{ d.get('x') }}|{{ d.keys() | list }}|{{ d.values() | list }}|{{ d | length }}|{{ dict(a=1, b='c') }}"),
    ("namespace", "{% set ns = namespace(found=false, count=0, last='') %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.count = ns.count + 1 %}{% set ns.last = m.content %}{% endif %}{% if m.role == 'assistant' %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.found }}/{{ ns.count }}/{{ ns.last }}"),
    ("loop_controls", "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.role }}{% if m.role == 'assistant' %}{% break %}{% endif %},{% endfor %}"),
    ("filters", "{{ messages | map(attribute='role') | join(',') }}|{{ messages | selectattr('role', 'equalto', 'user') | list | length }}|{{ messages | rejectattr('role', 'eq', 'user') | map(attribute='role') | list }}|{{ (messages | first).role }}|{{ (messages | last).content | length }}|{{ range(3) | list }}|{{ [3, 1, 2] | sort }}|{{ ['a', 'b'] | reverse | list }}|{{ 'abc' | list }}|{{ undefined_thing | default('dflt') }}|{{ 5 | string }}{{ '3' | int + 1 }}|{{ [1, 2, 2] | unique | list }}"),
    ("tests", "{% for m in messages %}{{ m.content is string }}{{ m.tool_calls is defined }}{{ m.content is none }}{{ m is mapping }}{{ messages is iterable }}{{ loop.index is number }}{{ loop.index is even }};{% endfor %}"),
    ("tokens", "{{ bos_token }}{% for m in messages %}{{ m.role }}{{ eos_token }}{% endfor %}{{ pad_token }}|{{ unk_token }}|{{ mask_token is defined }}"),
    ("macro_and_set", "{% macro render(m) %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endmacro %}{% set sep = '\\n' %}{% for m in messages %}{{ render(m) }}{{ sep }}{% endfor %}{% set x %}block {{ 1 + 1 }}{% endset %}{{ x }}"),
    ("generation_tags", "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"),
    ("raise", "{% for m in messages %}{% if m.role == 'assistant' and loop.first %}{{ raise_exception('first message is from the assistant') }}{% endif %}{% endfor %}{{ raise_exception('Only user and assistant roles are supported!') }}"),
    ("undefined_attribute_error", "{{ messages[0].nothing.deeper }}"),
    ("string_concat_none", "{{ 'a' + none }}"),
    ("format", "{{ '%s-%d' | format('a', 3) }}|{{ '{} and {}'.format('x', 'y') }}"),
    ("slicing", "{{ messages[0].content[:5] }}|{{ messages[0].content[-3:] }}|{{ messages[0].content[::2] }}|{{ messages[:2] | map(attribute='role') | join }}"),
    ("comparisons", "{{ (messages | length) > 2 }}{{ messages[0].role != 'system' }}{{ 'a' < 'b' }}{{ 1 == 1.0 }}{{ none is none }}{{ not messages }}{{ [] | length == 0 }}"),
    ("inline_if", "{% for m in messages %}{{ 'model' if m.role == 'assistant' else m.role }}:{{ m.content if m.content else '<empty>' }};{% endfor %}"),
]
TEMPLATE_MESSAGES = [
    {"role": "system", "content": "  You are terse.  "},
    {"role": "user", "content": "Hi there,  how are you?!"},
    {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nFine thanks."},
    {"role": "user", "content": "ünïcode 你好 words\twith\ttabs\nand lines"},
]
TEMPLATE_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


def template_cases() -> list:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    out = []
    for name, source in TEMPLATE_CASES:
        try:
            rendered = _compile_jinja_template(source).render(
                messages=TEMPLATE_MESSAGES, tools=None, documents=None, add_generation_prompt=True, **TEMPLATE_TOKENS
            )
            error = None
        except Exception as e:
            rendered, error = None, f"{type(e).__name__}: {e}"
        out.append({"name": name, "template": source, "rendered": rendered, "error": error})
    return {"messages": TEMPLATE_MESSAGES, "special_tokens": TEMPLATE_TOKENS, "cases": out}


def assets_dir() -> Path:
    if os.environ.get("FERROTUNE_ASSETS"):
        return Path(os.environ["FERROTUNE_ASSETS"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "ferrotune" / "assets"


def special_text(tok) -> str:
    """A text with the tokenizer's special tokens inside words and lines."""
    tokens = [t for t in [tok.bos_token, tok.eos_token, tok.pad_token] if t]
    return "x" + " a".join(tokens) + "\nend" + (tokens[0] if tokens else "") + "!"


def text_refs(tok) -> list:
    out = []
    for text in TEXTS:
        text = text.replace("{specials}", special_text(tok))
        with_special = tok(text, add_special_tokens=True)["input_ids"]
        plain = tok(text, add_special_tokens=False)["input_ids"]
        out.append(
            {
                "text": text,
                "ids_with_special": with_special,
                "ids_plain": plain,
                "decoded_plain": tok.decode(plain, skip_special_tokens=False),
                "decoded_with_special_skipped": tok.decode(with_special, skip_special_tokens=True),
            }
        )
    return out


def chat_refs(tok) -> list:
    out = []
    if tok.chat_template is None:
        return out
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            try:
                text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
                ids = tok.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
                )
            except Exception as e:  # the template rejects this conversation: that is the reference too
                text, ids = None, f"{type(e).__name__}: {e}"
            out.append({"messages": messages, "add_generation_prompt": add_generation_prompt, "text": text, "ids": ids})
    return out


def describe(tok) -> dict:
    return {
        "special_tokens": tok.special_tokens_map,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "unk_token_id": tok.unk_token_id,
        "len": len(tok),
        "has_chat_template": tok.chat_template is not None,
        # a few ids around the edges of the vocabulary, and their token strings
        "id_to_token": {str(i): tok.convert_ids_to_tokens(i) for i in sorted({0, 1, 2, 3, len(tok) // 2, len(tok) - 1})},
    }


def gguf_refs(folder: Path, name: str) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return {**describe(tok), "texts": text_refs(tok), "chats": chat_refs(tok)}


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")


# --- small GGUF files -------------------------------------------------------------------------------------


def llama_config(writer, arch: str, vocab_size: int) -> None:
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch != "gemma3":
        writer.add_rope_dimension_count(16)
    writer.add_vocab_size(vocab_size)
    if arch == "gemma3":
        writer.add_key_length(16)
        writer.add_value_length(16)
        writer.add_sliding_window(64)


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def spm_pieces(llama2_json: Path, extra_chars: str) -> list:
    """The first 1200 merged pieces of the llama2 vocabulary, and the single characters needed for TEXTS."""
    vocab = json.loads(llama2_json.read_text())["model"]["vocab"]
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    merged = [t for t, i in by_id if 259 <= i < 1459 and len(t) > 1]
    chars = sorted({t for t, _ in by_id if len(t) == 1 and (t.isascii() or t in extra_chars or t == "\u2581")})
    return merged + [c for c in chars if c not in merged]


def write_spm_llama(path: Path, llama2_json: Path) -> None:
    import gguf

    pieces = spm_pieces(llama2_json, "éöïç—你好世界")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["<|im_start|>", "<tool>"]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0, 0.0]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [3, 4]
    w = gguf.GGUFWriter(str(path), "llama")
    llama_config(w, "llama", len(tokens))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(
        "{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | trim + eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    finish(w)


def write_spm_gemma(path: Path, llama2_json: Path) -> None:
    import gguf

    pieces = spm_pieces(llama2_json, "éöïç—你好世界")
    head = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    # Gemma files spell whitespace-only tokens with real spaces; "  " lands on the existing "▁▁".
    tokens = head + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["  ", "   ", "\t\t"]
    scores = [0.0] * (len(head) + 256) + [-float(i) for i in range(len(pieces) + 3)]
    types = [3, 3, 3, 2, 3, 3, 3] + [6] * 256 + [1] * (len(pieces) + 3)
    w = gguf.GGUFWriter(str(path), "gemma3")
    llama_config(w, "gemma3", len(tokens))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_pad_token_id(0)
    w.add_eos_token_id(6)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(
        "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
        "{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    )
    finish(w)


def write_bpe_qwen2(path: Path, tiny_json: Path) -> None:
    import gguf

    data = json.loads(tiny_json.read_text())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    # 512: user defined; 513: control but spelled outside the byte alphabet (skipped as a special token);
    # 514: a plain token spelled outside the byte alphabet (re-spelled through it).
    tokens += ["<think>", "<|ctrl with space|>", "你好"]
    types = [3 if i < 4 else 1 for i in range(len(vocab))] + [4, 3, 1]
    w = gguf.GGUFWriter(str(path), "qwen2")
    llama_config(w, "qwen2", len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_pad_token_id(3)
    w.add_add_bos_token(True)
    w.add_chat_template((tiny_json.parent / "chat_template.jinja").read_text())
    finish(w)


def main() -> None:
    from transformers import AutoTokenizer

    assets = assets_dir()
    gguf_path = assets / GGUF_NAME
    folders = {name: assets / "tokenizers" / name for name in ("llama3_1", "qwen3", "gemma3", "llama2")}
    missing = [p for p in [gguf_path, *folders.values()] if not p.exists()]
    if missing:
        sys.exit(f"{missing[0]} is missing: run scripts/fetch-assets.sh")

    write_json(FIXTURES / "chat_template_cases.json", template_cases())
    write_json(FIXTURES / "smollm2_tokenizer.json", gguf_refs(assets, GGUF_NAME))

    texts = {}
    for name, folder in {**folders, "tiny_tokenizer": FIXTURES / "tiny_tokenizer"}.items():
        tok = AutoTokenizer.from_pretrained(folder)
        texts[name] = {**describe(tok), "texts": text_refs(tok), "chats": chat_refs(tok)}
    write_json(FIXTURES / "tokenizer_texts.json", texts)

    out = FIXTURES / "gguf_tokenizers"
    out.mkdir(parents=True, exist_ok=True)
    writers = {
        "spm_llama": lambda p: write_spm_llama(p, folders["llama2"] / "tokenizer.json"),
        "spm_gemma": lambda p: write_spm_gemma(p, folders["llama2"] / "tokenizer.json"),
        "bpe_qwen2": lambda p: write_bpe_qwen2(p, FIXTURES / "tiny_tokenizer" / "tokenizer.json"),
    }
    for name, write in writers.items():
        with tempfile.TemporaryDirectory() as tmp:
            tmp_path = Path(tmp) / f"{name}.gguf"
            write(tmp_path)
            refs = gguf_refs(Path(tmp), tmp_path.name)
            shutil.copyfile(tmp_path, out / f"{name}.gguf")
        print(f"wrote {(out / f'{name}.gguf').relative_to(ROOT)} ({(out / f'{name}.gguf').stat().st_size} bytes)")
        write_json(out / f"{name}.json", refs)


if __name__ == "__main__":
    main()
