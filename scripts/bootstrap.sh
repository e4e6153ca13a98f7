#!/usr/bin/env bash
# Install what a fresh machine lacks: the venv with the project, Debian's postgresql and prometheus
# (promtool, server), the Kafka jars (Maven Central, cached in ~/.m2 and devenv/kafka/lib-*).
# Idempotent and quiet when done.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

fail() { echo "bootstrap: $*" >&2; exit 1; }

PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
"$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' \
  || fail "Python 3.11 is required (found: $("$PY" --version 2>&1))"

stamp=".venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "bootstrap: installing the Python environment (.venv)" >&2
  [ -x .venv/bin/python ] || "$PY" -m venv .venv || fail "cannot create .venv"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null || fail "pip upgrade failed (PyPI unreachable?)"
  .venv/bin/python -m pip install -q -e ".[dev]" || fail "pip install failed (PyPI unreachable?)"
  rm -f .venv/.installed-* && touch "$stamp"
fi

if [ -z "${USER_ACTIVITY_TEST_DATABASE_URL:-}${USER_ACTIVITY_SKIP_POSTGRES_INSTALL:-}" ] \
   && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  echo "bootstrap: installing Debian's postgresql" >&2
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq >/dev/null || fail "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql >/dev/null \
    || fail "apt-get install postgresql failed"
  # The package may start a system cluster; nothing here uses it.
  $SUDO service postgresql stop >/dev/null 2>&1 || true
fi

# promtool (the alert-rule unit tests) and the prometheus server (the e2e alert test).
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  echo "bootstrap: installing Debian's prometheus" >&2
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq >/dev/null || fail "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus \
    >/dev/null || fail "apt-get install prometheus failed"
  # The package may start and enable a system server; the tests start their own.
  $SUDO service prometheus stop >/dev/null 2>&1 || true
  $SUDO systemctl disable prometheus >/dev/null 2>&1 || $SUDO update-rc.d prometheus disable >/dev/null 2>&1 || true
fi

# iptables: the dead-connection test silences one TCP connection (as root; skipped otherwise).
if [ "$(id -u)" = 0 ] && ! command -v iptables >/dev/null 2>&1; then
  echo "bootstrap: installing Debian's iptables" >&2
  apt-get update -qq >/dev/null || fail "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iptables \
    >/dev/null || fail "apt-get install iptables failed"
fi

if [ -z "${USER_ACTIVITY_TEST_KAFKA_BOOTSTRAP_SERVERS:-}" ]; then
  command -v java >/dev/null 2>&1 || fail "Java 17+ is required for the local Kafka broker"
  .venv/bin/python -m devenv.kafka_broker fetch >/dev/null || fail "cannot fetch the Kafka jars (Maven Central unreachable?)"
fi
