#!/usr/bin/env bash
# Launch the functional suite on the hardware at hand.
#
#   scripts/run_functional_tests.sh                 CPU: single-rank functional_tests/ + the multi-rank
#                                                   torchrun cases (TP=2 per shipped case, PP=2, TP2xPP2)
#   scripts/run_functional_tests.sh --gpus N        GPU: the GPU variant (functional_tests/test_gpu_variant.py)
#                                                   on N visible CUDA devices; exits 1 at once if there are none
#   -k EXPR / -m MARKEXPR                           select cases by name / marker (passed to pytest), e.g.
#                                                   -k rl_rollouts, -k tp2, -m multirank, -m "not multirank"
#   --workers N                                     pytest-xdist workers for the CPU suite (test files are
#                                                   independent: --dist loadfile; each torchrun picks its own
#                                                   port). Default: one per 4 CPUs (a TP2xPP2 case uses 4
#                                                   ranks), so 1 (no xdist) on a small machine
#   --timeout S                                     hard limit for the whole run (default 3600 s); each
#                                                   torchrun also has its own (MEGATRON_EXT_MULTIRANK_TIMEOUT_S,
#                                                   default 420 s) and collectives time out after
#                                                   MEGATRON_EXT_DIST_TIMEOUT_S (default 120 s here)
#   --no-bootstrap                                  use .venv as it is (no install step)
#   -- ARGS                                         anything after -- goes to pytest
#
# Creates/reuses .venv like scripts/test.sh (scripts/bootstrap.sh, MEGATRON_CORE_VERSION). A rank
# that dies or hangs ends its torchrun with the rank named; a hung run is killed at the timeout.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$REPO/.venv/bin/python"

gpus=""; total_timeout=3600; bootstrap=1; pytest_args=(); workers=""
usage() { sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
die() { echo "run_functional_tests: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) [ $# -ge 2 ] || die "--gpus needs a number"; gpus="$2"; shift 2 ;;
    --gpus=*) gpus="${1#--gpus=}"; shift ;;
    -k|-m) [ $# -ge 2 ] || die "$1 needs an expression"; pytest_args+=("$1" "$2"); shift 2 ;;
    --timeout) [ $# -ge 2 ] || die "--timeout needs seconds"; total_timeout="$2"; shift 2 ;;
    --workers) [ $# -ge 2 ] || die "--workers needs a number"; workers="$2"; shift 2 ;;
    --no-bootstrap) bootstrap=0; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; pytest_args+=("$@"); break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ "$total_timeout" =~ ^[0-9]+$ ]] || die "--timeout must be whole seconds, got '$total_timeout'"
[ -z "$workers" ] && workers=$(( $(nproc) / 4 > 1 ? $(nproc) / 4 : 1 ))
[[ "$workers" =~ ^[1-9][0-9]*$ ]] || die "--workers must be a whole number >= 1, got '$workers'"

if [ "$bootstrap" = 1 ]; then
  "$REPO/scripts/bootstrap.sh"
fi
[ -x "$PY" ] || die "$PY not found: run without --no-bootstrap once"
cd "$REPO"

if [ -n "$gpus" ]; then
  [[ "$gpus" =~ ^[1-9][0-9]*$ ]] || die "--gpus needs a positive whole number, got '$gpus'"
  # ask torch (no CUDA context is kept); bounded so a broken driver cannot hang the script
  have="$(timeout 120 "$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
  if [ "${have:-0}" -lt 1 ]; then
    echo "run_functional_tests: --gpus $gpus: no CUDA device (torch.cuda.is_available() is false here); nothing run" >&2
    exit 1
  fi
  if [ "$have" -lt "$gpus" ]; then
    echo "run_functional_tests: --gpus $gpus: only $have CUDA device(s) visible" >&2
    exit 1
  fi
  if [ "$gpus" -gt 1 ]; then
    echo "run_functional_tests: note: the GPU variant is single-rank; multi-rank ab runs CPU ranks (gloo) only" >&2
  fi
  export MEGATRON_EXT_GPUS="$gpus"
  set +e
  timeout --kill-after=30 "$total_timeout" "$PY" -m pytest functional_tests/test_gpu_variant.py -m gpu "${pytest_args[@]}"
  rc=$?
else
  # CPU: the single-rank suite and the multi-rank torchrun cases in one pytest run
  export MEGATRON_EXT_MULTIRANK=1
  export MEGATRON_EXT_DIST_TIMEOUT_S="${MEGATRON_EXT_DIST_TIMEOUT_S:-120}"
  set +e
  xdist=()
  [ "$workers" -gt 1 ] && xdist=(-n "$workers" --dist loadfile)
  echo "run_functional_tests: CPU ranks, $workers pytest worker(s)" >&2
  timeout --kill-after=30 "$total_timeout" "$PY" -m pytest functional_tests "${xdist[@]}" "${pytest_args[@]}"
  rc=$?
fi
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  echo "run_functional_tests: stopped after --timeout $total_timeout s (a run hung or the limit is too small)" >&2
fi
exit "$rc"
