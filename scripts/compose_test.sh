#!/usr/bin/env bash
# deploy/compose.yaml for real, on a Docker engine of its own: build the images, start the services,
# drive a run from this machine, SIGKILL one inference container mid-run, scrape every service's
# /metrics, then check from the journal and the trainer's checkpoint that every attempt was trained
# exactly once; then start the services again and drive an environment run (multi-turn episodes of
# the environment service's guess_number) to its end. The last line printed is one JSON object of
# what was measured. As root on Debian or Ubuntu (make compose-test).
#
# Environment: BUDGET (samples of the run, 4096); ENV_BUDGET (samples of the environment run, 64);
# BASE_IMAGE (python:3.11-slim when it can be
# pulled, else one made here from Debian packages with mmdebstrap); COMPOSE_TEST_ROOT (the engine's
# data root, kept afterwards as a build cache; unset, a temporary one that is removed).
#
# The engine is started without iptables rules or a default bridge (builds use the host's network),
# so it changes nothing of the host's firewall; it is stopped by its pid, and everything it made
# (containers, volumes, network, the temporary data root) is removed, also when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."

BUDGET=${BUDGET:-4096}
ENV_BUDGET=${ENV_BUDGET:-64}
PROJECT=pipelinerl-compose-test
BIN=.venv/bin
HOST_DIR=deploy/host
started=$(date +%s)
work=$(mktemp -d)
root=${COMPOSE_TEST_ROOT:-$work/data-root}
dockerd_pid=

say() { echo "compose-test [$(since "$started") s]: $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }
since() { echo $(($(date +%s) - $1)); }

# Waits up to $1 seconds for the command that follows to succeed.
wait_for() {
  local deadline=$(($(date +%s) + $1))
  shift
  until "$@"; do
    (($(date +%s) < deadline)) || return 1
    sleep 2
  done
}

dockerd_stopped() { [[ ! -e /proc/$dockerd_pid ]] || [[ $(ps -o stat= -p "$dockerd_pid") == Z* ]]; }

cleanup() {
  local rc=$?
  if [[ -n $dockerd_pid ]]; then
    if ((rc != 0)) && [[ -n ${compose:-} ]]; then
      $compose ps >&2 || true
      $compose logs --tail 30 >&2 || true
    fi
    if [[ -n ${compose:-} ]]; then
      say "removing the containers, volumes and network"
      timeout 120 $compose down -v --remove-orphans >&2 || say "compose down failed"
    fi
    # a kept data root keeps the newest images only
    [[ -z ${COMPOSE_TEST_ROOT:-} ]] || timeout 300 docker image prune -f >/dev/null || true
    say "stopping dockerd (pid $dockerd_pid)"
    kill "$dockerd_pid" 2>/dev/null || true
    wait_for 60 dockerd_stopped || kill -KILL "$dockerd_pid" 2>/dev/null || true
    wait "$dockerd_pid" || true
    # dockerd leaves its network namespace mounted under its exec root
    findmnt -rno TARGET | grep "^$work/" | sort -r | xargs -r umount || true
  fi
  rm -rf "$work" "$HOST_DIR/ca.crt" "$HOST_DIR/pip.conf" "$HOST_DIR/wheels" || say "could not remove $work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM  # through cleanup too

# --- the engine -----------------------------------------------------------------------------------
step=$(date +%s)
if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null || ! command -v mmdebstrap >/dev/null; then
  say "installing docker.io, docker-compose and mmdebstrap from Debian packages"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io iptables mmdebstrap docker-compose >/dev/null
fi
engine_install_s=$(since "$step")

export DOCKER_HOST="unix://$work/docker.sock"
dockerd --data-root "$root" --exec-root "$work/exec" --pidfile "$work/dockerd.pid" -H "$DOCKER_HOST" \
  --iptables=false --ip-masq=false --bridge=none >"$work/dockerd.log" 2>&1 &
dockerd_pid=$!
wait_for 60 docker version >/dev/null 2>&1 || { tail -20 "$work/dockerd.log" >&2; fail "dockerd did not answer in 60 s"; }
# The bearer token every service requires, from an env file as a user would give it.
token=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
echo "PIPELINERL_AUTH_TOKEN=$token" >"$work/auth.env"
compose="docker-compose"
docker compose version >/dev/null 2>&1 && compose="docker compose"
compose="$compose --env-file $work/auth.env -p $PROJECT -f deploy/compose.yaml"
compose_version=$($compose version --short)

# --- the base image -------------------------------------------------------------------------------
step=$(date +%s)
BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim}
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && ! timeout 120 docker pull -q "$BASE_IMAGE" >/dev/null 2>&1; then
  . /etc/os-release
  BASE_IMAGE=pipelinerl-base:$VERSION_CODENAME
  if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    say "no registry answers; building $BASE_IMAGE from this machine's Debian package sources"
    mirrors=()
    for file in /etc/apt/sources.list /etc/apt/sources.list.d/debian.sources; do
      if [[ -s $file ]]; then mirrors+=("$file"); fi
    done
    excludes=()
    for path in /usr/share/doc /usr/share/man /usr/share/info /usr/share/locale; do
      excludes+=(--dpkgopt="path-exclude=$path/*")
    done
    timeout 600 mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
      "${excludes[@]}" --dpkgopt='path-include=/usr/share/doc/*/copyright' \
      "$VERSION_CODENAME" - "${mirrors[@]}" | docker import - "$BASE_IMAGE" >/dev/null
  fi
fi
base_image_s=$(since "$step")

# --- what the builds take from this machine: CA bundle, package index settings, the torch wheel ----
ca=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
mkdir -p "$HOST_DIR/wheels"
{
  echo "[global]"
  [[ -f $ca ]] && cp "$ca" "$HOST_DIR/ca.crt" && echo "cert = /tmp/host/ca.crt"
  # index settings of this machine's pip; local paths (file:) do not exist inside a build
  $BIN/python -m pip config list | sed -nE "s/^(:env:|global)\.(index-url|extra-index-url|trusted-host)='(.*)'$/\2 \3/p" |
    awk '{ kept = ""; for (i = 2; i <= NF; i++) if ($i !~ /^file:/) kept = kept " " $i }
         kept != "" && !seen[$1]++ { print $1 " =" kept }'
} >"$HOST_DIR/pip.conf"
python_tag=$(docker run --rm --network none --entrypoint python3 "$BASE_IMAGE" \
  -c 'import sys; print("%d.%d" % sys.version_info[:2])')
torch_spec=$(sed -n 's/^ARG TORCH_SPEC=//p' deploy/Dockerfile)
build_args=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
# Where this machine's pip finds the pinned CPU wheel, the build needs no extra index for it.
if $BIN/python -m pip download --quiet --no-deps --only-binary=:all: --dest "$HOST_DIR/wheels" \
  --python-version "$python_tag" --platform "manylinux_2_28_$(uname -m)" "$torch_spec" 2>/dev/null; then
  build_args+=(--build-arg TORCH_INDEX_URL=)
fi

# --- build, start, wait for health ----------------------------------------------------------------
say "building the images ($compose_version)"
step=$(date +%s)
timeout 1200 $compose build "${build_args[@]}" >"$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; fail "image build"; }
build_s=$(since "$step")

say "starting the services"
step=$(date +%s)
timeout 300 $compose up -d --no-build >&2 || fail "compose up"
all_healthy() {
  local id status unhealthy=0
  for id in $($compose ps -q); do
    status=$(docker inspect -f '{{.State.Health.Status}}' "$id")
    [[ $status == healthy ]] || unhealthy=1
  done
  return $unhealthy
}
wait_for 240 all_healthy || fail "not every service was healthy 240 s after up"
healthy_s=$(since "$step")

# --- a run driven from this machine, one inference container killed once a quarter is trained -----
say "driving a run of $BUDGET samples from this machine"
run_dir=$work/run
step=$(date +%s)
PIPELINERL_RUN_AUTH_TOKEN=$token $BIN/pipelinerl run --coordinator-address 127.0.0.1:50050 \
  --run-dir "$run_dir" --max-samples "$BUDGET" --duration-s 420 >"$work/run.log" 2>&1 &
driver=$!
trained() { tail -n 1 "$run_dir/metrics.jsonl" 2>/dev/null | sed -nE 's/.*"trained": ([0-9]+).*/\1/p'; }
quarter_trained() {
  local n
  n=$(trained)
  ((${n:-0} >= BUDGET / 4)) || ! kill -0 "$driver" 2>/dev/null
}
wait_for 300 quarter_trained || fail "a quarter of the budget was not trained within 300 s"
kill -0 "$driver" 2>/dev/null || { cat "$work/run.log" >&2; fail "the run ended before the kill"; }
victim=$($compose ps -q inference-1)
killed_at=$(trained)
docker kill "$victim" >/dev/null
say "killed inference-1 at $killed_at trained samples"
driver_rc=0
wait "$driver" || driver_rc=$?
((driver_rc == 0)) || { cat "$work/run.log" >&2; fail "pipelinerl run exited $driver_rc"; }
run_s=$(since "$step")
summary=$(grep -E '^completed: ' "$work/run.log") || { cat "$work/run.log" >&2; fail "the run did not complete"; }
samples_per_s=$(sed -nE 's/.*\(([0-9.]+)\/s\)$/\1/p' <<<"$summary")

# --- /metrics of every service still up, read from inside its container (port 9100, not published)
say "scraping /metrics"
scrape() {
  docker exec "$($compose ps -q "$1")" python3 -c \
    'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:9100/metrics", timeout=10).read().decode())'
}
series=""
for service in reward-0 reward-1 environment trainer inference-0 coordinator; do
  text=$(scrape "$service") || fail "$service serves no /metrics"
  role=${service%-[0-9]}
  count=$(grep -c "^pipelinerl_${role}_" <<<"$text") || fail "$service: no pipelinerl_${role}_* series"
  series+="\"$service\": $count, "
  case $service in
    trainer) version=$(awk '$1 == "pipelinerl_trainer_version" { print $2 }' <<<"$text") ;;
    inference-0) served=$(awk '$1 == "pipelinerl_inference_weight_version" { print $2 }' <<<"$text") ;;
  esac
done
awk -v v="${version:-0}" -v s="${served:-0}" 'BEGIN { exit !(v > 0 && s > 0) }' ||
  fail "scraped trainer version ${version:-none}, inference-0 version ${served:-none}: not both past 0"

# --- the evidence: journal, final checkpoint and step metrics, copied out of the stopped services --
say "checking the journal and the final checkpoint"
timeout 120 $compose stop >&2
evidence=$work/evidence
mkdir -p "$evidence"
docker cp "$($compose ps -q coordinator):/data/." "$evidence"
docker cp "$($compose ps -q trainer):/data/." "$evidence"
dispositions=$(PYTHONPATH=. $BIN/python scripts/run_evidence.py "$evidence" "$BUDGET") || fail "the run's evidence"

# --- an environment run on the same services, started again: episodes played on the environment
# container, rendered by the coordinator, trained by the trainer --------------------------------
say "starting the services again for an environment run of $ENV_BUDGET samples"
# all at once (compose v1's `start` waits out each health gate in turn); the coordinator reconnects
# to whatever comes up after it
docker start $($compose ps -q) >/dev/null || fail "starting the containers again"
wait_for 480 all_healthy || fail "not every service was healthy 480 s after starting again"
step=$(date +%s)
PIPELINERL_RUN_AUTH_TOKEN=$token timeout 600 $BIN/pipelinerl run --coordinator-address 127.0.0.1:50050 \
  --run-id env-run --run-dir "$work/env-run" --environment guess_number --max-samples "$ENV_BUDGET" \
  --duration-s 300 \
  >"$work/env-run.log" 2>&1 || { cat "$work/env-run.log" >&2; fail "the environment run failed"; }
env_run_s=$(since "$step")
grep -qE '^completed: ' "$work/env-run.log" || { cat "$work/env-run.log" >&2; fail "the environment run did not complete"; }
sum_of() { awk -v name="$1" '$1 ~ "^" name "([{]|$)" { total += $2 } END { print total + 0 }'; }
episodes=$(scrape coordinator | sum_of pipelinerl_coordinator_episodes_total)
steps=$(scrape environment | sum_of pipelinerl_environment_steps_total)
env_errors=$(scrape coordinator | sum_of pipelinerl_coordinator_environment_errors_total)
awk -v e="$episodes" -v s="$steps" 'BEGIN { exit !(e > 0 && s > 0) }' ||
  fail "scraped $episodes episodes at the coordinator, $steps steps at the environment: not both past 0"

sizes=""
for role in reward environment coordinator inference trainer; do
  sizes+="\"$role\": $(($(docker image inspect -f '{{.Size}}' "pipelinerl-$role:dev") / 1000000)), "
done
format='{"compose": "%s", "base_image": "%s", "engine_install_s": %d, "base_image_s": %d, "build_s": %d,'
format+=' "healthy_s": %d, "run_s": %d, "budget": %d, "samples_per_s": %s, "killed_at_trained": %d,'
format+=' "image_mb": {%s}, "metrics_series": {%s}, "scraped_version": %s, "evidence": %s,'
format+=' "environment_run": {"budget": %d, "run_s": %d, "episodes": %s, "steps": %s, "errors": %s}, "total_s": %d}\n'
printf "$format" "$compose_version" "$BASE_IMAGE" "$engine_install_s" "$base_image_s" "$build_s" "$healthy_s" \
  "$run_s" "$BUDGET" "$samples_per_s" "$killed_at" "${sizes%, }" "${series%, }" "$version" "$dispositions" \
  "$ENV_BUDGET" "$env_run_s" "$episodes" "$steps" "$env_errors" "$(since "$started")"
