#!/usr/bin/env bash
# Create or reuse .venv in the repo root with Python 3.12, the pinned dependencies, megatron-ext
# (editable) and megatron-core: the release named by MEGATRON_CORE_VERSION (default 0.19.2), or,
# with MEGATRON_CORE_SOURCE set, the tree in that folder or .tar.gz archive (a Megatron-LM checkout,
# or one of ../shared/upstream/), installed from source so importlib.metadata agrees with the code.
# Idempotent and quiet when nothing changes: torch is installed once and kept across releases;
# switching megatron-core reinstalls only megatron-core (no dependencies).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
MCORE="${MEGATRON_CORE_VERSION:-0.19.2}"
SOURCE="${MEGATRON_CORE_SOURCE:-}"
SUPPORTED="0.17.0 0.17.1 0.18.0 0.18.2 0.19.0 0.19.2"

if [ -n "$SOURCE" ] && [ -n "${MEGATRON_CORE_VERSION:-}" ]; then
  echo "bootstrap: MEGATRON_CORE_VERSION and MEGATRON_CORE_SOURCE are both set; unset one (the release's wheel, or the tree)" >&2
  exit 2
fi
if [ -z "$SOURCE" ]; then
  case " $SUPPORTED " in
    *" $MCORE "*) ;;
    *) echo "bootstrap: MEGATRON_CORE_VERSION=$MCORE is not a supported release; use one of: $SUPPORTED, or MEGATRON_CORE_SOURCE=<Megatron-LM folder or .tar.gz> for a tree" >&2
       exit 2 ;;
  esac
elif [ -d "$SOURCE" ]; then
  [ -f "$SOURCE/megatron/core/package_info.py" ] || {
    echo "bootstrap: MEGATRON_CORE_SOURCE=$SOURCE has no megatron/core/package_info.py; point it at a Megatron-LM checkout's top folder" >&2
    exit 2; }
elif [ -f "$SOURCE" ]; then
  case "$SOURCE" in
    *.tar.gz|*.tgz) ;;
    *) echo "bootstrap: MEGATRON_CORE_SOURCE=$SOURCE is a file but not a .tar.gz archive; give a Megatron-LM folder or an archive such as ../shared/upstream/megatron-lm-2a75ac12c5.tar.gz" >&2
       exit 2 ;;
  esac
else
  echo "bootstrap: MEGATRON_CORE_SOURCE=$SOURCE does not exist; give a Megatron-LM folder or an archive such as ../shared/upstream/megatron-lm-2a75ac12c5.tar.gz" >&2
  exit 2
fi

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

# What megatron-core is installed, as "wheel <release>" or "source <sha256 of the tree's files>":
# a tree's version string ("0.20.0" for every main commit since 0.19) does not identify it.
mcore_stamp="$VENV/.megatron-ext-mcore"
mcore_version() { "$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("megatron-core"))' 2>/dev/null || true; }
if [ -z "$SOURCE" ]; then
  want="wheel $MCORE"
  have="$(mcore_version)"
  # a tree installed before may carry a release's version string: the stamp tells them apart
  if [ "$have" != "$MCORE" ] || [ "$(cat "$mcore_stamp" 2>/dev/null || echo "wheel $have")" != "$want" ]; then
    echo "bootstrap: installing megatron-core==$MCORE (was: ${have:-none})" >&2
    pip_quiet --no-deps --force-reinstall "megatron-core==$MCORE"
    have="$(mcore_version)"
    [ "$have" = "$MCORE" ] || { echo "bootstrap: megatron-core==$MCORE did not install (have $have)" >&2; exit 1; }
    echo "$want" > "$mcore_stamp"
  fi
else
  tree="$SOURCE"
  if [ -f "$SOURCE" ]; then  # an archive: unpacked once per content into the venv
    digest="$(sha256sum "$SOURCE" | cut -c1-16)"
    tree_root="$VENV/megatron-core-src/$digest"
    if [ ! -d "$tree_root" ]; then
      rm -rf "$tree_root.tmp"; mkdir -p "$tree_root.tmp"
      if ! tar xzf "$SOURCE" -C "$tree_root.tmp" 2>/dev/null; then
        rm -rf "$tree_root.tmp"
        echo "bootstrap: MEGATRON_CORE_SOURCE=$SOURCE is not a readable .tar.gz archive (tar failed); give a Megatron-LM folder or an archive such as ../shared/upstream/megatron-lm-2a75ac12c5.tar.gz" >&2
        exit 2
      fi
      mv "$tree_root.tmp" "$tree_root"
    fi
    tree="$(dirname "$(find "$tree_root" -path '*/megatron/core/package_info.py' | head -n 1)")"
    tree="${tree%/megatron/core}"
    [ -f "$tree/megatron/core/package_info.py" ] || {
      echo "bootstrap: MEGATRON_CORE_SOURCE=$SOURCE holds no megatron/core/package_info.py; give an archive of a Megatron-LM checkout" >&2
      exit 2; }
  fi
  want="source $(cd "$tree" && find megatron -name '*.py' -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)"
  if [ "$(cat "$mcore_stamp" 2>/dev/null)" != "$want" ] || [ -z "$(mcore_version)" ]; then
    echo "bootstrap: installing megatron-core from $SOURCE (was: $(cat "$mcore_stamp" 2>/dev/null || echo none))" >&2
    # setuptools and pybind11 (requirements/lock.txt) build it; NO_VCS_VERSION keeps the version
    # string free of this project's git hash
    NO_VCS_VERSION=1 pip_quiet --no-deps --no-build-isolation --force-reinstall "$tree"
    echo "$want" > "$mcore_stamp"
  fi
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
