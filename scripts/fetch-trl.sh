#!/usr/bin/env bash
# Creates, once, the Python virtual environment with TRL, the reference the preference losses
# (ORPO/SimPO/CPO/IPO, KTO) and GRPO's loss family are checked against, pinned below. Only the
# fixture scripts need it (scripts/make_prefloss_fixtures.py, make_kto_fixtures.py,
# make_grpo_trl_fixtures.py; the goldens they write are committed, the tests do not run Python).
# --system-site-packages reuses the system's torch, transformers and peft; --no-deps keeps pip
# from replacing them. Re-running is a no-op once the venv holds these pins.
# Usage: scripts/fetch-trl.sh   (prints the venv's folder last; FERROTUNE_TRL_VENV overrides it)
set -euo pipefail
PINS="trl==1.16.0 pandas==3.1.1 datasets==5.2.0 pyarrow==26.0.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0"
VENV=${FERROTUNE_TRL_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrotune/trl-venv}
stamp="$VENV/.ferrotune-pins"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$PINS" ]; then
  echo "creating TRL's venv in $VENV ($PINS)..." >&2
  rm -rf "$VENV"
  python3 -m venv --system-site-packages "$VENV"
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps $PINS >&2
  echo "$PINS" > "$stamp"
fi
echo "$VENV"
