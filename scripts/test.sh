#!/usr/bin/env bash
# The whole suite: lint, types, import layers, schema and docs drift, unit, integration (real
# PostgreSQL), e2e (real Kafka + PostgreSQL).
# Starts its own services on loopback (or uses USER_ACTIVITY_TEST_* ones) and stops them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/bootstrap.sh
export PYTHONDONTWRITEBYTECODE=1

start=$(date +%s)
# Bytecode of the project, as the image has it (k8s/Dockerfile): with PYTHONDONTWRITEBYTECODE
# every job and command the tests start compiled the modules it imports again (0.15 s of CPU).
.venv/bin/python -m compileall -q -j 0 schemas runtime sources sinks dataflows cli devenv bench \
  >/dev/null
echo "== ruff" && .venv/bin/ruff check .
echo "== mypy" && .venv/bin/mypy .
echo "== import layers" && .venv/bin/lint-imports
echo "== schemas" && .venv/bin/python -m schemas.export --check
echo "== configuration reference" && .venv/bin/python -m cli.configuration_doc --check
echo "== pytest"  # on xdist workers with their own services (tests/workers.py)
set +e
.venv/bin/pytest -p no:cacheprovider --durations=20 "$@"
rc=$?
set -e
echo "suite took $(( $(date +%s) - start )) s"
if [ "$rc" = 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
