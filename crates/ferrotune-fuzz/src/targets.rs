//! The fuzz targets: one per parser of untrusted files, each calling the entry point the product
//! calls on such a file (writing the input where that takes a path). A target returns normally
//! whatever the parser answers, `Ok` or an error: only a panic, an abort, a hang or running out of
//! memory is a finding.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use ferrotune_data::{ChatMessage, ChatTemplate, Tokenizer};

/// One parser under test.
pub struct Target {
    /// The name on the command line and of its `corpus/` and `regressions/` folders.
    pub name: &'static str,
    /// What it reads, for the report.
    pub about: &'static str,
    /// Tokens the mutator inserts and swaps in (the format's keywords and delimiters).
    pub dictionary: &'static [&'static [u8]],
    /// Whether the format is text, where token-level mutations are worth more than byte ones.
    pub text: bool,
    run: fn(&Scratch, &[u8]),
}

impl Target {
    /// Feeds one input to the parser (in this process: the driver runs it in a worker).
    pub fn run(&self, scratch: &Scratch, input: &[u8]) {
        (self.run)(scratch, input)
    }
}

/// Every target, in the order a run takes them.
pub const TARGETS: &[Target] = &[
    Target {
        name: "safetensors",
        about: "a .safetensors file (header JSON, offsets, dtypes), read as checkpoints are",
        dictionary: &[
            b"\"dtype\"",
            b"\"F32\"",
            b"\"F16\"",
            b"\"BF16\"",
            b"\"I32\"",
            b"\"I64\"",
            b"\"F8_E4M3\"",
            b"\"U8\"",
            b"\"BOOL\"",
            b"\"F64\"",
            b"\"shape\"",
            b"\"data_offsets\"",
            b"\"__metadata__\"",
            b"[]",
            b"[0,0]",
            b"[18446744073709551615]",
            b"{}",
        ],
        text: false,
        run: safetensors,
    },
    Target {
        name: "safetensors_index",
        about: "model.safetensors.index.json beside config.json and two shards, loaded as a model",
        dictionary: &[
            b"\"weight_map\"",
            b"\"metadata\"",
            b"\"model-00001-of-00002.safetensors\"",
            b"\"model-00002-of-00002.safetensors\"",
            b"\"config.json\"",
            b"\"../x\"",
            b"\"/\"",
            b"\"\"",
            b"\"model.embed_tokens.weight\"",
            b"\"lm_head.weight\"",
            b"null",
            b"[]",
            b"{}",
            b"0",
        ],
        text: true,
        run: safetensors_index,
    },
    Target {
        name: "gguf",
        about: "a .gguf file, loaded as a model (dequantized and packed) and as a tokenizer",
        dictionary: &[
            b"general.alignment",
            b"general.architecture",
            b"llama",
            b"qwen2",
            b"gemma3",
            b"phi3",
            b"llama.block_count",
            b"llama.embedding_length",
            b"llama.attention.head_count",
            b"llama.attention.head_count_kv",
            b"llama.context_length",
            b"llama.vocab_size",
            b"llama.rope.dimension_count",
            b"llama.feed_forward_length",
            b"llama.expert_count",
            b"tokenizer.ggml.tokens",
            b"tokenizer.ggml.merges",
            b"tokenizer.ggml.model",
            b"gpt2",
            b"tokenizer.ggml.token_type",
            b"tokenizer.ggml.scores",
            b"tokenizer.ggml.pre",
            b"tokenizer.chat_template",
            b"token_embd.weight",
            b"output.weight",
            b"blk.0.attn_q.weight",
        ],
        text: false,
        run: gguf,
    },
    Target {
        name: "torch_pickle",
        about: "a torch.save zip (.pt/.bin) or, wrapped into one, a bare pickle",
        dictionary: &[
            b"\x80\x02",
            b"}",
            b"(",
            b"t",
            b"R",
            b"q\0",
            b"h\0",
            b"X\x01\0\0\0",
            b"]",
            b"e",
            b"s",
            b"u",
            b"K\xff",
            b"J\xff\xff\xff\x7f",
            b"M\xff\xff",
            b"N",
            b")",
            b".",
            b"\x85",
            b"\x86",
            b"\x87",
            b"\x88",
            b"\x89",
            b"Q",
            b"0",
            b"2",
            b"ctorch\nFloatStorage\n",
            b"ctorch\nBFloat16Storage\n",
            b"ctorch\nHalfStorage\n",
            b"ctorch\nLongStorage\n",
            b"ctorch._utils\n_rebuild_tensor_v2\n",
            b"ctorch._utils\n_rebuild_parameter\n",
            b"ccollections\nOrderedDict\n",
            b"cposix\nsystem\n",
            b"cbuiltins\neval\n",
        ],
        text: false,
        run: torch_pickle,
    },
    Target {
        name: "config",
        about: "a recipe config (YAML, ${...} interpolation, `#! key=value` lines as overrides)",
        dictionary: &[
            b"${",
            b"}",
            b"${name}",
            b"${tokenizer.max_seq_len}",
            b"${oc.env:HOME}",
            b"${oc.env:X,1}",
            b"${.x}",
            b"${..x}",
            b"\\${x}",
            b"???",
            b": ",
            b"- ",
            b"\n  ",
            b"&a ",
            b"*a",
            b"<<: *a",
            b"~",
            b"!!binary ",
            b"!!str ",
            b"!!int ",
            b"null",
            b"true",
            b"[",
            b"]",
            b"{",
            b",",
            b"'",
            b"\"",
            b"_component_: ",
            b"#! ",
            b"#! a.b=",
            b"#! ~",
            b"=",
            b"output_dir",
            b"model",
            b"tokenizer",
            b"max_seq_len",
            b"batch_size",
            b"epochs",
            b"lr",
            b"dataset",
            b"seed",
            b"checkpointer",
            b"optimizer",
            b"lora_rank",
            b"log_level",
            b"\t",
            b"\xef\xbb\xbf",
            b"|\n",
            b">\n",
            b"? ",
            b"%YAML 1.2\n",
            b"---\n",
            b"...\n",
        ],
        text: true,
        run: config,
    },
    Target {
        name: "tokenized_jsonl",
        about: "a pre-tokenized JSON Lines dataset (rows and preference pairs)",
        dictionary: &[
            b"{",
            b"}",
            b"[",
            b"]",
            b",",
            b":",
            b"\"input_ids\"",
            b"\"labels\"",
            b"\"chosen_input_ids\"",
            b"\"rejected_input_ids\"",
            b"\"chosen_labels\"",
            b"\"rejected_labels\"",
            b"-100",
            b"null",
            b"true",
            b"\"x\"",
            b"\n",
            b"1.5",
            b"[[1]]",
            b"{}",
            b"\"\\u0000\"",
            b"\"\\ud800\"",
            b"1e400",
        ],
        text: true,
        run: tokenized_jsonl,
    },
    Target {
        name: "chat_template",
        about: "a chat template (Jinja) compiled and rendered with a few conversations",
        dictionary: &[
            b"{{",
            b"}}",
            b"{%",
            b"%}",
            b"{#",
            b"#}",
            b"{%- ",
            b" -%}",
            b"{% for m in messages %}",
            b"{% endfor %}",
            b"{% if ",
            b"{% else %}",
            b"{% endif %}",
            b"{% set x = ",
            b"namespace(",
            b"range(100000)",
            b"loop.index",
            b"messages",
            b"message['content']",
            b"message.role",
            b"|tojson",
            b"|length",
            b"|trim",
            b"|join(",
            b"* 1000000",
            b"~",
            b"raise_exception('x')",
            b"{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}",
            b"recursive",
            b"loop(",
            b".split(",
            b".strip(",
            b".startswith(",
            b"[::-1]",
            b"[1:]",
            b"bos_token",
            b"eos_token",
            b"add_generation_prompt",
            b"tools",
            b"{% generation %}",
            b"{% endgeneration %}",
            b"'ab' * 100000000",
            b"'%s' % ",
            b"strftime_now(",
            b"|items",
            b"|dictsort",
            b"|map(",
            b"|selectattr(",
            b"is defined",
            b"none",
            b"|safe",
            b"{% filter upper %}",
            b"{% endfilter %}",
            b"{% include 'x' %}",
            b"{% extends 'x' %}",
            b"{% import 'x' as y %}",
            b"|indent(",
            b"|format(",
            b".format(",
            b"|replace(",
            b"|batch(",
            b"|slice(",
            b"|sum",
            b"|unique",
            b"|pprint",
        ],
        text: true,
        run: chat_template,
    },
];

/// A target by name.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

/// A worker's private folder, with the fixed files some targets read beside the input.
pub struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    /// Makes `dir` (removed first if left over) and copies the fixtures in.
    pub fn new(dir: PathBuf) -> std::io::Result<Self> {
        let _ = std::fs::remove_dir_all(&dir);
        let model = dir.join("index");
        std::fs::create_dir_all(&model)?;
        let fixtures = crate::crate_dir().join("fixtures").join("tiny_llama");
        for entry in std::fs::read_dir(fixtures)? {
            let entry = entry?;
            std::fs::copy(entry.path(), model.join(entry.file_name()))?;
        }
        Ok(Self { dir })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes `bytes` to `name` in the folder, returning its path.
    fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, bytes).expect("the worker's scratch folder is writable");
        path
    }
}

fn safetensors(s: &Scratch, input: &[u8]) {
    let path = s.write("model.safetensors", input);
    let _ = ferrotune_models::checkpoint::read_safetensors(&[path], DType::F32, &Device::Cpu);
}

fn safetensors_index(s: &Scratch, input: &[u8]) {
    let dir = s.dir().join("index");
    std::fs::write(dir.join("model.safetensors.index.json"), input)
        .expect("the worker's scratch folder is writable");
    let _ = ferrotune_models::load_model(&dir, DType::F32, &Device::Cpu);
}

fn gguf(s: &Scratch, input: &[u8]) {
    let path = s.write("model.gguf", input);
    let _ = ferrotune_models::load_model(&path, DType::F32, &Device::Cpu);
    let _ = Tokenizer::from_gguf(&path, ferrotune_models::family::gguf_vocab_style);
}

/// A zip input is the file; anything else is taken as the pickle of one, wrapped with the seed's
/// storages into a valid zip (the zip's CRCs would otherwise stop nearly every mutation of the
/// pickle before the unpickler sees it).
fn torch_pickle(s: &Scratch, input: &[u8]) {
    let bytes = if input.starts_with(b"PK") {
        input.to_vec()
    } else {
        wrap_pickle(input)
    };
    let path = s.write("model.pt", &bytes);
    let _ = ferrotune_models::torch_pickle::read_torch_file(&path);
}

/// A torch.save zip holding `pickle` as its data.pkl and the fixture storages.
pub fn wrap_pickle(pickle: &[u8]) -> Vec<u8> {
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    let storages = crate::crate_dir().join("fixtures").join("torch_storages");
    let mut put = |name: &str, data: &[u8]| {
        zip.start_file(name, opts).expect("zip in memory");
        zip.write_all(data).expect("zip in memory");
    };
    put("state/data.pkl", pickle);
    put("state/byteorder", b"little");
    let mut names: Vec<_> = std::fs::read_dir(&storages)
        .expect("fixtures/torch_storages")
        .map(|e| e.expect("fixture entry").file_name())
        .collect();
    names.sort();
    for name in names {
        let data = std::fs::read(storages.join(&name)).expect("fixture storage");
        put(&format!("state/data/{}", name.to_string_lossy()), &data);
    }
    put("state/version", b"3\n");
    zip.finish().expect("zip in memory").into_inner()
}

/// As `ferrotune run` takes a config: loaded from its file, overridden (here by the input's
/// `#! key=value` lines), validated, resolved, and printed back.
fn config(s: &Scratch, input: &[u8]) {
    use ferrotune_train::config;
    let path = s.write("config.yaml", input);
    let overrides: Vec<String> = String::from_utf8_lossy(input)
        .lines()
        .filter_map(|l| l.strip_prefix("#! ").map(str::to_string))
        .collect();
    let Ok(mut cfg) = config::load(&path.to_string_lossy()) else {
        return;
    };
    let original = cfg.root.clone();
    let _ = config::validate(&cfg.root, &cfg.origin);
    if cfg.apply_overrides(&overrides).is_err() {
        return;
    }
    let _ = config::validate_overridden(&original, &cfg.root, &cfg.origin);
    if cfg.resolve().is_ok() {
        let _ = cfg.to_yaml();
        for key in cfg.keys() {
            let _ = (
                cfg.str(&key),
                cfg.usize(&key),
                cfg.f64(&key),
                cfg.bool(&key),
            );
        }
    }
}

fn tokenized_jsonl(s: &Scratch, input: &[u8]) {
    let path = s.write("data.jsonl", input);
    let _ = ferrotune_data::tokenized::holds_pairs(&path);
    let _ = ferrotune_data::read_tokenized_jsonl(&path);
    let _ = ferrotune_data::tokenized::read_tokenized_pairs_jsonl(&path);
}

/// Compiles the input as a template and renders it as `apply_chat_template` would: a system,
/// user and assistant conversation, a lone user turn, and no messages, with and without the
/// generation prompt.
fn chat_template(_: &Scratch, input: &[u8]) {
    let Ok(source) = std::str::from_utf8(input) else {
        return;
    };
    let Ok(template) = ChatTemplate::from_origin(source, "fuzz input") else {
        return;
    };
    let special: BTreeMap<String, String> = [("bos_token", "<s>"), ("eos_token", "</s>")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let conversations = [
        vec![
            ChatMessage::system("You are terse."),
            ChatMessage::user("Hi {{ there }} <|im_end|>"),
            ChatMessage::assistant("Hello."),
        ],
        vec![ChatMessage::user("x")],
        vec![],
    ];
    for messages in &conversations {
        for generation_prompt in [false, true] {
            let _ = template.render(messages, generation_prompt, &special);
        }
    }
}
