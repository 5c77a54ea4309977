#!/usr/bin/env bash
# Create or reuse .venv in the repo root with Python 3.12, the pinned dependencies, megatron-ext
# (editable) and the megatron-core release named by MEGATRON_CORE_VERSION (default 0.19.2).
# Idempotent and quiet when nothing changes: torch is installed once and kept across releases;
# switching releases reinstalls only the megatron-core wheel (no dependencies).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
MCORE="${MEGATRON_CORE_VERSION:-0.19.2}"
SUPPORTED="0.17.0 0.17.1 0.18.0 0.18.2 0.19.0 0.19.2"

case " $SUPPORTED " in
  *" $MCORE "*) ;;
  *) echo "bootstrap: MEGATRON_CORE_VERSION=$MCORE is not a supported release; use one of: $SUPPORTED" >&2
     exit 2 ;;
esac

find_python() {
  local candidate
  for candidate in "${PYTHON:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      command -v "$candidate"; return 0
    fi
  done
  echo "bootstrap: Python 3.12 not found (megatron-core 0.17+ ships cp312 wheels only); set PYTHON=/path/to/python3.12" >&2
  return 1
}

# pip install, silent on success; on failure its output (minus local-index noise) and exit 1.
pip_quiet() {
  local log; log="$(mktemp)"
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2; rm -f "$log"; return 1
  fi
  rm -f "$log"
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV" >&2
  "$(find_python)" -m venv "$VENV"
fi

stamp="$VENV/.megatron-ext-deps"
lock_hash="$(cat "$REPO/requirements/lock.txt" "$REPO/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$lock_hash" ]; then
  echo "bootstrap: installing pinned dependencies (torch is large: a few minutes the first time)" >&2
  pip_quiet -r "$REPO/requirements/lock.txt"
  pip_quiet --no-deps -e "$REPO"
  "$VENV/bin/python" -c 'import megatron_ext, torch, wrapt' || { echo "bootstrap: install failed" >&2; exit 1; }
  echo "$lock_hash" > "$stamp"
fi

have="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("megatron-core"))' 2>/dev/null || true)"
if [ "$have" != "$MCORE" ]; then
  echo "bootstrap: installing megatron-core==$MCORE (was: ${have:-none})" >&2
  pip_quiet --no-deps "megatron-core==$MCORE"
  have="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("megatron-core"))')"
  [ "$have" = "$MCORE" ] || { echo "bootstrap: megatron-core==$MCORE did not install (have $have)" >&2; exit 1; }
fi

# Mamba kernels for hybrid models (requirements/mamba.txt): source distributions, CUDA builds
# skipped (their compiled extensions are stood in for on the CPU); only when the pins change.
mamba_stamp="$VENV/.megatron-ext-mamba"
mamba_hash="$(sha256sum "$REPO/requirements/mamba.txt" | cut -d' ' -f1)"
if [ "$(cat "$mamba_stamp" 2>/dev/null)" != "$mamba_hash" ]; then
  echo "bootstrap: installing Mamba kernels from source (no CUDA build)" >&2
  MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE \
    CAUSAL_CONV1D_FORCE_BUILD=TRUE pip_quiet --no-deps --no-build-isolation \
    --no-binary mamba-ssm,causal-conv1d -r "$REPO/requirements/mamba.txt"
  echo "$mamba_hash" > "$mamba_stamp"
fi

# Bytecode for the modules MEGATRON_EXT_AUTO=1 runs at every interpreter start-up (as pip writes it
# for an installed wheel): an editable install under PYTHONDONTWRITEBYTECODE=1 would compile them
# at each start, about 1.5 ms of CPU. Cheap and idempotent (compileall skips up-to-date files).
"$VENV/bin/python" -m compileall -q "$REPO/megatron_ext/__init__.py" "$REPO/megatron_ext/_startup" >/dev/null || true
