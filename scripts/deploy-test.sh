#!/usr/bin/env bash
# The local deployment test of k8s/: build the image, run the manifests' pods as containers.
#
#   bash scripts/deploy-test.sh          # as root; 3 min with the images cached, 6-9 without
#
# 1. installs what is missing (Debian's docker.io and mmdebstrap; the project's .venv, PostgreSQL
#    and Kafka jars through scripts/bootstrap.sh) and starts a Docker engine of its own
#    (dockerd --storage-driver=vfs --bridge=none --iptables=false), stopped again at the end;
# 2. builds the base image from Debian packages if it is not cached (k8s/base-image.sh; no
#    container registry is needed) unless PYTHON_IMAGE is given, then the project image from
#    k8s/Dockerfile with BuildKit (the context is what k8s/Dockerfile.dockerignore lets in);
# 3. runs python -m devenv.deploy: local Kafka and PostgreSQL on loopback, the Jobs and
#    StatefulSets of k8s/*.yaml translated to `docker run --network host` calls
#    (devenv/deploy/pods.py), and the checks; prints the summary table (step, result, seconds).
# Exit status: 0 only when every step passed. Logs: .run/deploy-test/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RUN="$ROOT/.run/deploy-test"
IMAGE="${IMAGE:-user-activity-stream:deploy-test}"
mkdir -p "$RUN"

# Rows of the summary table: step, result, seconds, detail (tab-separated); the Python part
# adds its own and prints the whole table.
STEPS_FILE="$RUN/steps.tsv"
: > "$STEPS_FILE"
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >> "$STEPS_FILE"; }
print_table() {
  printf '\n%-36s%-8s%8s  %s\n' step result seconds detail
  while IFS=$'\t' read -r step result seconds detail; do
    printf '%-36s%-8s%8s  %s\n' "$step" "$result" "$seconds" "${detail:0:170}"
  done < "$STEPS_FILE"
}
fail() { echo "deploy-test: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "run as root (it installs Debian packages and starts dockerd)"

# ---- 1. packages, the Python environment, the Docker engine ----------------------------------
t=$SECONDS
missing=()
[ -x /usr/sbin/dockerd ] || missing+=(docker.io)
command -v mmdebstrap >/dev/null 2>&1 || [ -n "${PYTHON_IMAGE:-}" ] || missing+=(mmdebstrap)
if [ ${#missing[@]} -gt 0 ]; then
  echo "deploy-test: installing ${missing[*]}" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
bash scripts/bootstrap.sh
record "install: apt, .venv" ok $((SECONDS - t)) "${missing[*]:-nothing missing}"

# Debian's client (its docker build has the daemon's builtin BuildKit); another docker CLI on
# PATH may need the buildx plugin for DOCKER_BUILDKIT=1.
DOCKER="${DOCKER:-/usr/bin/docker}"
export DOCKER
DOCKERD_PID=""
SOCKET="$RUN/docker.sock"
stop_dockerd() {
  if [ -n "$DOCKERD_PID" ]; then
    kill "$DOCKERD_PID" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
  fi
}
trap stop_dockerd EXIT
t=$SECONDS
# Its own socket, data and exec roots: another engine on this machine is left alone. The data
# root keeps the cached base image and build cache between runs.
DATA_ROOT="${DOCKER_DATA_ROOT:-/var/lib/docker-deploy-test}"
/usr/sbin/dockerd --host "unix://$SOCKET" --data-root "$DATA_ROOT" \
  --exec-root /run/docker-deploy-test --pidfile /run/docker-deploy-test.pid \
  --storage-driver=vfs --bridge=none --iptables=false --ip-masq=false \
  >"$RUN/dockerd.log" 2>&1 &
DOCKERD_PID=$!
export DOCKER_HOST="unix://$SOCKET"
for _ in $(seq 1 60); do "$DOCKER" info >/dev/null 2>&1 && break; sleep 0.5; done
"$DOCKER" info >/dev/null 2>&1 || { tail -20 "$RUN/dockerd.log" >&2; fail "dockerd did not start"; }
record "dockerd" ok $((SECONDS - t)) "$("$DOCKER" version --format '{{.Server.Version}}'), vfs, no bridge, $SOCKET"

# ---- 2. images -------------------------------------------------------------------------------
t=$SECONDS
if [ -z "${PYTHON_IMAGE:-}" ]; then
  if ! PYTHON_IMAGE="$(bash k8s/base-image.sh 2>"$RUN/base-image.log")"; then
    cat "$RUN/base-image.log" >&2
    record "image: base" FAIL $((SECONDS - t)) "k8s/base-image.sh: $RUN/base-image.log"
    print_table
    exit 1
  fi
  cat "$RUN/base-image.log" >&2
fi
base_size="$("$DOCKER" image inspect --format '{{.Size}}' "$PYTHON_IMAGE")"
record "image: base" ok $((SECONDS - t)) \
  "$PYTHON_IMAGE, $((base_size / 1000000)) MB$(grep -q reused "$RUN/base-image.log" 2>/dev/null && echo ', cached')"

t=$SECONDS
if DOCKER_BUILDKIT=1 "$DOCKER" build --network host --progress plain \
    --build-arg PYTHON_IMAGE="$PYTHON_IMAGE" -f k8s/Dockerfile -t "$IMAGE" . \
    >"$RUN/build.log" 2>&1; then
  build_seconds=$((SECONDS - t))
  size="$("$DOCKER" image inspect --format '{{.Size}}' "$IMAGE")"
  context="$(grep -A3 'load build context' "$RUN/build.log" \
    | grep -o 'transferring context: [0-9.]* *[kMG]*B' | head -1 || true)"
  cached="$(grep -c ' CACHED$' "$RUN/build.log" || true)"
  record "image: k8s/Dockerfile" ok "$build_seconds" \
    "$IMAGE, $((size / 1000000)) MB, BuildKit, ${context:-context ?}, $cached steps cached"
  # What earlier runs left: the previous image of this tag, base images of an older recipe.
  "$DOCKER" images user-activity-base --format '{{.Repository}}:{{.Tag}}' | grep -vxF "$PYTHON_IMAGE" \
    | xargs -r "$DOCKER" rmi >/dev/null 2>&1 || true
  "$DOCKER" image prune --force >/dev/null 2>&1 || true
else
  record "image: k8s/Dockerfile" FAIL $((SECONDS - t)) "$RUN/build.log"
  tail -30 "$RUN/build.log" >&2
  print_table
  exit 1
fi

# ---- 3. the manifests' pods ------------------------------------------------------------------
status=0
.venv/bin/python -m devenv.deploy --image "$IMAGE" --docker "$DOCKER" --run-dir "$RUN" \
  --steps-file "$STEPS_FILE" || status=$?
# vfs copies every layer: one build of the image takes about 5 GB of the data root. The build
# cache (which makes a code-change rebuild take 16 s, not a minute) is dropped only past a bound.
t=$SECONDS
used_gb="$(du -s --block-size=1G "$DATA_ROOT" | cut -f1)"
if [ "$used_gb" -gt "${DEPLOY_TEST_MAX_GB:-20}" ]; then
  "$DOCKER" builder prune --force >/dev/null 2>&1 || true
  record "docker data root" ok $((SECONDS - t)) \
    "$used_gb GB > ${DEPLOY_TEST_MAX_GB:-20} GB: build cache dropped, now $(du -s --block-size=1G "$DATA_ROOT" | cut -f1) GB"
else
  record "docker data root" ok $((SECONDS - t)) "$used_gb GB in $DATA_ROOT"
fi
t=$SECONDS
stop_dockerd
DOCKERD_PID=""
record "dockerd stopped" ok $((SECONDS - t))
print_table
if [ "$status" -ne 0 ]; then echo "deploy-test: FAILED (logs: $RUN/logs)" >&2; fi
exit "$status"
