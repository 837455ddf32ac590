#!/usr/bin/env bash
# Creates, once, the Python virtual environment with the experiment trackers' official clients the
# metric-logger tests talk to: mlflow (its `mlflow server`), wandb and comet_ml, pinned below.
# It leaves the system Python untouched (a venv; --system-site-packages only reuses what is
# already installed, e.g. numpy). Re-running is a no-op once the venv holds these pins.
# Usage: scripts/fetch-trackers.sh   (prints the venv's folder last; FERROTUNE_TRACKERS_VENV
# overrides it)
set -euo pipefail
PINS="mlflow==3.17.2 wandb==0.31.0 comet_ml==3.58.8"
VENV=${FERROTUNE_TRACKERS_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrotune/trackers-venv}
stamp="$VENV/.ferrotune-pins"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$PINS" ]; then
  echo "creating the trackers' venv in $VENV ($PINS)..." >&2
  rm -rf "$VENV"
  python3 -m venv --system-site-packages "$VENV"
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check $PINS >&2
  echo "$PINS" > "$stamp"
fi
echo "$VENV"
