#!/usr/bin/env bash
# The test command: create/reuse .venv for MEGATRON_CORE_VERSION (default 0.19.2), then run the
# unit tests and the functional tests with pytest. Extra arguments go to pytest.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$REPO/scripts/bootstrap.sh"
cd "$REPO"
exec "$REPO/.venv/bin/python" -m pytest unit_tests functional_tests "$@"
