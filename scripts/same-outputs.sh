#!/usr/bin/env bash
# Same outputs before and after a restructure: every file the end-to-end tests write, byte for byte.
#
# The binary's tests (crates/ferrotune-cli/tests), the export crate's (GGUF and HF writers), the
# training crate's (steps) and the models crate's (loading, saving, adapters)
# run `generate`, `merge`, `export-gguf` (every outtype) and every recipe on the fixtures, each in
# its own folder under the temp dir, and leave what they wrote there. `capture` runs them with the
# temp dir set to DIR/tmp and writes DIR/manifest.txt: one line per file, its path with the process
# id taken out and the sha256 of its content. Before hashing, what differs from one run to the next
# by nature is normalized: the temp folder's and the checkout's own paths inside files, and
# wall-clock fields (times, throughputs, dates) in metrics and logs. `compare` diffs two manifests.
#
# Usage:
#   scripts/same-outputs.sh capture DIR      # on the old commit, then on the new one
#   scripts/same-outputs.sh compare DIR_OLD DIR_NEW
#   scripts/same-outputs.sh hash DIR         # hashes a capture again (after changing this script)
# Two captures of the same commit compare equal (check that first when normalization changes).
set -euo pipefail
cd "$(dirname "$0")/.."

manifest() { # $1: DIR; hashes every file under DIR/tmp, normalized
  python3 - "$1" "$(cat "$1/repo")" <<'PY'
import hashlib, json, os, re, sys
root = os.path.join(sys.argv[1], "tmp")
tmp_abs = os.path.realpath(root)
repo = sys.argv[2]
# Keys of metrics.jsonl / JSON results that measure the machine, not the computation.
TIMED = re.compile(r"(per_s(ec(ond)?)?|_per_second|tokens_per|_s$|seconds|time|elapsed|duration|wall|date|timestamp|throughput|tps|peak_memory|memory)", re.I)
# Files whose content depends on the clock or on when a process was killed: listed, not hashed.
VOLATILE = re.compile(r"(\.metadata$|tfevents|\.png$|kill)")
# A process id ends a temp folder's name (`ferrotune-recipes-lora-4242`) or follows its group
# (`ferrotune-errors-4242-arch`).
PID = re.compile(r"-\d+(?=/|$)|-\d{3,}(?=-)")
def norm_json(v):
    if isinstance(v, dict):
        return {k: ("<t>" if TIMED.search(k) else norm_json(x)) for k, x in v.items()}
    if isinstance(v, list):
        return [norm_json(x) for x in v]
    return v
def norm_text(s):
    s = re.sub(r'/[^"\s]*?/tests/fixtures', "<fixtures>", s)
    s = s.replace(tmp_abs, "<tmp>").replace(repo, "<repo>")
    s = re.sub(r"<tmp>/[^\s\"']*", lambda m: PID.sub("", m.group(0)), s)
    return s
lines = []
for d, _, files in os.walk(root):
    for f in files:
        p = os.path.join(d, f)
        rel = os.path.relpath(p, root)
        key = "/".join(PID.sub("", part) for part in rel.split("/"))
        if VOLATILE.search(rel):
            lines.append(f"{'-' * 64}  {re.sub(r'[0-9.]+', 'N', key)}")
            continue
        data = open(p, "rb").read()
        if f.endswith((".jsonl", ".json", ".log", ".txt", ".yaml", ".yml", ".md")):
            try:
                text = data.decode()
            except UnicodeDecodeError:
                text = None
            if text is not None:
                text = norm_text(text)
                if f.endswith(".jsonl"):
                    out = []
                    for line in text.splitlines():
                        try:
                            out.append(json.dumps(norm_json(json.loads(line)), sort_keys=True))
                        except ValueError:
                            out.append(line)
                    text = "\n".join(out)
                elif f.endswith(".json"):
                    try:
                        text = json.dumps(norm_json(json.loads(text)), sort_keys=True)
                    except ValueError:
                        pass
                else:
                    text = re.sub(r"\d+(\.\d+)?\s*(ms|s|µs|tokens/s|it/s|GiB|MiB)\b", "<t>", text)
                data = text.encode()
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {key}")
lines.sort(key=lambda l: l[66:])
open(os.path.join(sys.argv[1], "manifest.txt"), "w").write("\n".join(lines) + "\n")
print(f"{len(lines)} files -> {sys.argv[1]}/manifest.txt")
PY
}

case "${1:-}" in
  capture)
    dir=$(realpath -m "${2:?usage: capture DIR}")
    rm -rf "$dir/tmp"; mkdir -p "$dir/tmp"; pwd -P >"$dir/repo"
    scripts/fetch-assets.sh >/dev/null
    # The GGUF and HF writers' tests live in ferrotune-export (in ferrotune-train before it existed).
    packages=(-p ferrotune-cli -p ferrotune-train -p ferrotune-models)
    [ -d crates/ferrotune-export ] && packages+=(-p ferrotune-export)
    TMPDIR="$dir/tmp" cargo test --release "${packages[@]}" \
      >"$dir/test.log" 2>&1 || { echo "tests failed: see $dir/test.log" >&2; exit 1; }
    manifest "$dir"
    ;;
  hash) # hashes a capture's files again (after a change to the normalization)
    manifest "$(realpath "${2:?usage: hash DIR}")"
    ;;
  compare)
    a=${2:?usage: compare DIR_OLD DIR_NEW}; b=${3:?usage: compare DIR_OLD DIR_NEW}
    if diff <(cut -c67- "$a/manifest.txt") <(cut -c67- "$b/manifest.txt") >/dev/null \
       && diff "$a/manifest.txt" "$b/manifest.txt"; then
      echo "same outputs: $(wc -l <"$a/manifest.txt") files identical"
    else
      echo "outputs differ (< old, > new):"; diff "$a/manifest.txt" "$b/manifest.txt" | head -50; exit 1
    fi
    ;;
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
