#!/usr/bin/env bash
# Builds the manual (docs/, an mdBook) into docs/book/ and checks its internal links and the
# README's links into it (scripts/check_links.py); scripts/test.sh runs this.
# mdbook comes from crates.io at a pinned version, installed once into a cache folder, as
# scripts/fetch-assets.sh caches the assets: ~/.cache/ferrotune/tools, or $FERROTUNE_TOOLS.
# Usage: scripts/book.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MDBOOK_VERSION=0.5.4
TOOLS=${FERROTUNE_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrotune/tools}
root="$TOOLS/mdbook-$MDBOOK_VERSION"
mdbook="$root/bin/mdbook"
if [ ! -x "$mdbook" ]; then
  # Without the default features: serve/watch/search are for writing at a desk, not for
  # building the book, and they would only lengthen the first install.
  echo "installing mdbook $MDBOOK_VERSION from crates.io into $root (once)..." >&2
  cargo install mdbook --locked --version "$MDBOOK_VERSION" --no-default-features \
    --root "$root" --quiet
fi
"$mdbook" build docs
python3 scripts/check_links.py
