#!/usr/bin/env bash
# Chat with SmolLM2-135M-Instruct, set-up included: fetch the model (cached), build ferrotune, generate.
# Usage: scripts/chat.sh ["your question"]   (extra ferrotune generate flags may follow the question)
set -euo pipefail
cd "$(dirname "$0")/.."
assets=$(scripts/fetch-assets.sh)
cargo build --release --quiet -p ferrotune-cli
prompt=${1:-"What are three tips for staying focused while studying?"}
shift || true
exec ./target/release/ferrotune generate --model "$assets/SmolLM2-135M-Instruct.Q4_1.gguf" \
  --chat --prompt "$prompt" --max-new-tokens 200 "$@"
