#!/usr/bin/env bash
# Creates, once, the Python virtual environment with the quantized optimizers ferrotune's 8- and
# 4-bit AdamW are checked against: torchao (torchao.optim.AdamW8bit / AdamW4bit) and bitsandbytes
# (bnb.optim.AdamW8bit), pinned below. Only scripts/make_optim8bit_fixtures.py needs it (the
# goldens it writes are committed; the tests do not run Python). --system-site-packages reuses the
# system's torch. Re-running is a no-op once the venv holds these pins.
# Usage: scripts/fetch-optim-refs.sh   (prints the venv's folder last; FERROTUNE_OPTIM_VENV
# overrides it)
set -euo pipefail
PINS="torchao==0.18.0 bitsandbytes==0.50.2"
VENV=${FERROTUNE_OPTIM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrotune/optim-venv}
stamp="$VENV/.ferrotune-pins"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$PINS" ]; then
  echo "creating the optimizer references' venv in $VENV ($PINS)..." >&2
  rm -rf "$VENV"
  python3 -m venv --system-site-packages "$VENV"
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps $PINS >&2
  echo "$PINS" > "$stamp"
fi
echo "$VENV"
