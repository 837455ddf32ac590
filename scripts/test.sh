#!/usr/bin/env bash
# The whole test suite, set-up included: fetches the real assets and the experiment trackers'
# Python clients (both cached), builds the manual (docs/, with a cached mdbook) failing on a
# broken internal link, builds the pip wheel and checks it in a fresh venv (scripts/check-wheel.sh,
# reusing target/release), then runs every test.
# This is the README's test command and exactly what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-assets.sh >/dev/null
scripts/fetch-trackers.sh >/dev/null
scripts/book.sh
scripts/check-wheel.sh
cargo test --workspace --release
