#!/usr/bin/env bash
# README's main-job command: see devenv/demo.py (local services + demo, or configured services).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/bootstrap.sh
exec .venv/bin/python -m devenv.demo "$@"
