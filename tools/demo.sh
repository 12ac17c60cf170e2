#!/usr/bin/env bash
# ramjet's main job on an embedded default: installs what it needs, starts the local S3
# server, generates the synthetic YOLO dataset (5,315 photo-like images), packs it into
# s3://$RAMJET_S3_BUCKET/demo, verifies every checksum, streams it through the engine five
# times (cold: empty node-local cache; then four warm epochs from the cache: the first reads it
# from the disk, the next three show the steady state), prints a summary, then runs
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
# Epoch 2 reads the cache from the disk: cache fills bypass the page cache (O_DIRECT, so a cold
# epoch does not pay for copying every shard into it), and this first warm read is the device's.
# Epochs 3 to 5 read it from the page cache: the steady state of a dataset that fits in memory.
for e in 2 3 4 5; do
  echo "demo: streaming epoch $e (warm: from the cache)"
  "$ramjet" stream "$url" --cache-dir "$cache" --cache-limit 4GiB | tee "$RAMJET_STATE/demo/warm$e.txt"
done
cp "$RAMJET_STATE/demo/warm2.txt" "$RAMJET_STATE/demo/warm.txt"
secs_of() { head -1 "$1" | sed -E 's/.* in ([0-9.]+) s:.*/\1/'; }
steady=$(for e in 3 4 5; do secs_of "$RAMJET_STATE/demo/warm$e.txt"; done | sort -g | sed -n 2p)
steady_line=$(for e in 3 4 5; do
  f="$RAMJET_STATE/demo/warm$e.txt"
  if [ "$(secs_of "$f")" = "$steady" ]; then head -1 "$f" | sed 's/^stream: //'; break; fi
done)

echo
echo "demo summary"
echo "  dataset   $samples synthetic 640x480 JPEGs with YOLO boxes ($src)"
echo "  synth     $(secs "$t0" "$t1") s"
echo "  pack      $(secs "$t1" "$t2") s -> $url (local S3 at $AWS_ENDPOINT_URL)"
echo "  verify    $(secs "$t2" "$t3") s, every shard and sample checksum OK"
echo "  stream    cold:         $(head -1 "$RAMJET_STATE/demo/cold.txt" | sed 's/^stream: //')"
echo "            first warm:   $(head -1 "$RAMJET_STATE/demo/warm2.txt" | sed 's/^stream: //') (the cache read from the disk)"
echo "            steady warm:  $steady_line (median of epochs 3-5, from the page cache)"
echo "            warm:         $(sed -n 2p "$RAMJET_STATE/demo/warm2.txt" | sed 's/^stream: //')"

echo
echo "demo: ramjet-bench --quick (ramjet and its peers side by side, interleaved rounds; about 3-4 minutes)"
tools/ramjet-bench --quick
