#!/usr/bin/env bash
# Make a Python 3.11 base image from Debian packages, for machines that reach no container
# registry (k8s/Dockerfile's default PYTHON_IMAGE, python:3.11-slim, cannot be pulled there).
#
#   bash k8s/base-image.sh            # prints the tag, e.g. user-activity-base:bookworm-3f2a9c1e0b7d
#
# mmdebstrap makes a bookworm root filesystem with python3.11 (+ venv/ensurepip), passwd
# (useradd) and what python:3.11-slim carries besides Python: ca-certificates, netbase and tzdata
# (without it, psycopg cannot read the server's TimeZone and falls back to UTC, with a warning);
# `docker import` turns it into an image. The machine's CA bundle
# ($PIP_CERT / $SSL_CERT_FILE: PyPI may be reached through a TLS-inspecting proxy) is copied in as
# /etc/ssl/certs/build-ca-bundle.crt and named by PIP_CERT, so `pip install` in the build works.
# The tag carries a hash of this recipe and of that bundle: a second run with the same recipe
# reuses the image (33-158 s and 170 MB saved); a changed recipe or CA makes a new one.
# Needs root, mmdebstrap, a running Docker engine and Debian's mirror (deb.debian.org).
set -euo pipefail
DOCKER="${DOCKER:-docker}"
SUITE="${BASE_SUITE:-bookworm}"
MIRROR="${BASE_MIRROR:-http://deb.debian.org/debian}"
PACKAGES="python3.11,python3.11-venv,passwd,ca-certificates,netbase,tzdata"
CA_BUNDLE="${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
[ -r "$CA_BUNDLE" ] || { echo "base-image: no CA bundle at $CA_BUNDLE" >&2; exit 1; }

# The recipe: this script without its comment lines, the suite, mirror, packages and the CA.
recipe_hash="$( { grep -v '^ *#' "${BASH_SOURCE[0]}"; echo "$SUITE $MIRROR $PACKAGES"
  cat "$CA_BUNDLE"; } | sha256sum | cut -c1-12)"
tag="user-activity-base:$SUITE-$recipe_hash"
if "$DOCKER" image inspect "$tag" >/dev/null 2>&1; then
  echo "base-image: $tag exists, reused" >&2
  echo "$tag"
  exit 0
fi

echo "base-image: building $tag with mmdebstrap ($PACKAGES)" >&2
started=$SECONDS
# Docs, man pages and locales other than C are left out (they are most of the size otherwise).
mmdebstrap --quiet --variant=apt --include="$PACKAGES" \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
  --customize-hook='ln -sf python3.11 "$1/usr/bin/python"' \
  --customize-hook='ln -sf python3.11 "$1/usr/bin/python3"' \
  --customize-hook="cp '$CA_BUNDLE' \"\$1/etc/ssl/certs/build-ca-bundle.crt\"" \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
  "$SUITE" - "$MIRROR" \
  | "$DOCKER" import \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'ENV LANG=C.UTF-8' \
      --change 'ENV PIP_CERT=/etc/ssl/certs/build-ca-bundle.crt' \
      --change 'CMD ["python"]' \
      --message "mmdebstrap $SUITE $PACKAGES" - "$tag" >/dev/null
echo "base-image: $tag built in $((SECONDS - started)) s" >&2
echo "$tag"
