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
echo "== ruff" && .venv/bin/ruff check .
echo "== mypy" && .venv/bin/mypy .
echo "== import layers" && .venv/bin/lint-imports
echo "== schemas" && .venv/bin/python -m schemas.export --check
echo "== configuration reference" && .venv/bin/python -m cli.configuration_doc --check
# Workers with their own PostgreSQL and Kafka each (tests/workers.py); against external services
# one process, since tests that share a server must not run at the same time.
workers="${USER_ACTIVITY_TEST_WORKERS:-4}"
if [ -n "${USER_ACTIVITY_TEST_DATABASE_URL:-}${USER_ACTIVITY_TEST_KAFKA_BOOTSTRAP_SERVERS:-}" ]; then
  workers=0
fi
echo "== pytest ($workers workers)"
set +e
.venv/bin/pytest -p no:cacheprovider --durations=20 -n "$workers" --dist loadgroup \
  --no-loadscope-reorder "$@"
rc=$?
set -e
echo "suite took $(( $(date +%s) - start )) s"
if [ "$rc" = 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
