#!/usr/bin/env bash
# Issue 21's H200 run, after FlashAttention-4 is installed (tools/h200-runtime.sh install): `attnkit oracle` over
# flash-attn's whole test grid in N shards side by side (split by kernel configuration, so no two shards JIT-compile
# the same FA4 kernel), each within BUDGET seconds, then merged; then `attnkit smoke`.
#   TESTS=.oracle/test_flash_attn.py SHARDS=8 BUDGET=400 bash tools/h200-oracle.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; SHARDS=${SHARDS:-8}; BUDGET=${BUDGET:-400}; TESTS=${TESTS:-.oracle/test_flash_attn.py}
DATE=$(date +%Y-%m-%d); work=/root/oracle; mkdir -p "$work" "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore ATTNKIT_CACHE_DIR=/root/ak-cache
for i in $(seq 1 "$SHARDS"); do
  setsid nohup python3 -m attnkit.cli oracle --tests "$TESTS" --shard "$i/$SHARDS" --budget "$BUDGET" \
    --out "$work/shard-$i.json" > "$work/shard-$i.log" 2>&1 < /dev/null &
done
deadline=$(( $(date +%s) + BUDGET + 120 ))
while [ "$(ls "$work"/shard-*.json 2>/dev/null | wc -l)" -lt "$SHARDS" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
ls "$work"/shard-*.json | wc -l
python3 -m attnkit.cli oracle --merge "$work"/shard-*.json --out "$OUT/$DATE-h200-oracle.json" 2>&1 | tail -40
tail -n 3 "$work"/shard-*.log > "$OUT/oracle-shards.log"
python3 -m attnkit.cli smoke --report "$OUT/$DATE-h200-smoke.json" > "$OUT/smoke.log" 2>&1; echo "smoke rc=$?"
grep -E "^smoke:|FAILED" "$OUT/smoke.log" | head -20
