#!/usr/bin/env bash
# ramjet's main job on an embedded default: installs what it needs, starts the local S3
# server, generates the synthetic YOLO dataset (5,315 photo-like images), packs it into
# s3://$RAMJET_S3_BUCKET/demo, verifies every checksum, streams it through the engine twice
# (cold: empty node-local cache; warm: from the cache), prints a summary, then runs
# ramjet-bench's quick mode: ramjet beside MosaicML Streaming, WebDataset, boto3 GETs and a torch
# DataLoader over local files, on the same data (table, JSON and chart in target/bench/ramjet-bench).
#
# Usage: tools/demo.sh          (RAMJET_DEMO_SAMPLES=N for another size)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$RAMJET_ROOT"

samples="${RAMJET_DEMO_SAMPLES:-5315}"
tools/setup.sh
echo "demo: building ramjet (release)"
cargo build --release -q -p ramjet-tools
ramjet="$RAMJET_ROOT/target/release/ramjet"

started_here=0
if ! tools/s3-server.sh status >/dev/null 2>&1; then
  started_here=1
fi
tools/s3-server.sh start
if [ "$started_here" = 1 ]; then
  trap 'tools/s3-server.sh stop >/dev/null' EXIT
fi

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

src="$RAMJET_STATE/demo/synth-$samples"
t0=$(now)
if [ -f "$src/.complete" ]; then
  echo "demo: reusing $src"
else
  rm -rf "$src"
  "$ramjet" synth "$src" --samples "$samples"
  touch "$src/.complete"
fi
t1=$(now)
url="s3://$RAMJET_S3_BUCKET/demo/synth-$samples"
"$ramjet" pack "$src" "$url"
t2=$(now)
"$ramjet" verify "$url"
t3=$(now)
"$ramjet" inspect "$url"
cache="$RAMJET_STATE/demo/cache"
rm -rf "$cache"
echo
echo "demo: streaming epoch 1 (cold: empty node-local cache at $cache)"
"$ramjet" stream "$url" --cache-dir "$cache" --cache-limit 4GiB | tee "$RAMJET_STATE/demo/cold.txt"
echo "demo: streaming epoch 2 (warm: from the cache)"
"$ramjet" stream "$url" --cache-dir "$cache" --cache-limit 4GiB | tee "$RAMJET_STATE/demo/warm.txt"

echo
echo "demo summary"
echo "  dataset   $samples synthetic 640x480 JPEGs with YOLO boxes ($src)"
echo "  synth     $(secs "$t0" "$t1") s"
echo "  pack      $(secs "$t1" "$t2") s -> $url (local S3 at $AWS_ENDPOINT_URL)"
echo "  verify    $(secs "$t2" "$t3") s, every shard and sample checksum OK"
echo "  stream    cold: $(head -1 "$RAMJET_STATE/demo/cold.txt" | sed 's/^stream: //')"
echo "            warm: $(head -1 "$RAMJET_STATE/demo/warm.txt" | sed 's/^stream: //')"
echo "            warm: $(sed -n 2p "$RAMJET_STATE/demo/warm.txt" | sed 's/^stream: //')"

echo
echo "demo: ramjet-bench --quick (ramjet and its peers side by side, interleaved rounds; about 3-4 minutes)"
tools/ramjet-bench --quick
