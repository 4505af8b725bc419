#!/usr/bin/env bash
# Issue 22's H200 sweep, after FlashAttention-4 is installed (tools/h200-runtime.sh install): the JIT kernels of
# the plan compiled first by CPU shards side by side (untimed), then the timed sweep alone on the GPU for BUDGET
# seconds, appending to one results file (resumable: a later session passes it back with RESUME=path and the
# sweep skips what it holds); then the table merged from it and the held-out validation.
#   SHARDS=12 COMPILE=240 BUDGET=300 bash tools/h200-tune.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; SHARDS=${SHARDS:-12}; COMPILE=${COMPILE:-240}; BUDGET=${BUDGET:-300}
DATE=$(date +%Y-%m-%d); work=/root/tune; mkdir -p "$work" "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore ATTNKIT_CACHE_DIR=/root/ak-cache
results=$work/results.jsonl
[ -n "${RESUME:-}" ] && cp "$RESUME" "$results"
for i in $(seq 1 "$SHARDS"); do   # compile phase: CPU-bound, every shard at once, for COMPILE seconds at most
  timeout "$COMPILE" setsid python3 -m attnkit.cli tune --compile-only --shard "$i/$SHARDS" \
    > "$work/compile-$i.log" 2>&1 < /dev/null &
done
wait
python3 -m attnkit.cli tune --out "$results" --resume --budget "$BUDGET" > "$work/tune.log" 2>&1
tail -n 2 "$work/tune.log"
cp "$results" "$OUT/$DATE-h200-tune.jsonl"
python3 -m attnkit.cli tune --merge "$results" --table "$OUT/sm90.json" --png "$OUT/$DATE-h200-tune-winners.png" 2>&1 | tail -3
tail -n 1 "$work"/compile-*.log > "$OUT/compile.log"
