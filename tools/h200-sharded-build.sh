#!/usr/bin/env bash
# Issue 14's H200 run: flash-attn for the reference cell at --archs 90, built as N shards, each in a build tree of
# its own and pinned (taskset) to a CPU set of its own, as N runners would, into one object store; then the
# link job (in `start` itself when the shards end within WAIT_S). A device call lasts <= 10 min and the machine
# is handed back 30 s after a call ends, so shards run side by side in the background (setsid) and a second
# call must follow at once. Measured 2026-11-30 on the 32-core kind, 4 shards x 7 CPUs: 46 of 73 units done
# after 9 min (units take 53-393 s each under that load). On the 64-core kind use SHARDS=4 CORES=15:
#   SHARDS=4 CORES=15 bash tools/h200-sharded-build.sh start    # deps, N shards in the background, the plan,
#                                                                # one unit at 4 archs on the spare CPUs
#   bash tools/h200-sharded-build.sh finish                       # wait for the shards, link, verify, GPU check
# Prepare here: .carry14/wheels (cp312 wheels: build deps + attnkit's deps), .carry14/cache/sdists/<sdist>.
set -uo pipefail
N=${SHARDS:-4}
CORES=${CORES:-15}
CELL=${CELL:-torch2.11-cu130-py312}
W=${W:-/root/fa}
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}
mkdir -p "$W" "$OUT"
# attnkit, the sdist and this script are copied out of the checkout: background shards outlive the call
export PYTHONPATH=/root/site:$W/src PATH=/root/site/bin:$PATH ATTNKIT_CACHE_DIR=$W/cache PYTHONUNBUFFERED=1
# PACKAGE_ARGS, CELL, PY, W, PROBE and NO_DEPS=1 let the same steps run on a dev machine against a small extension
read -ra pkg <<< "${PACKAGE_ARGS:---package flash-attn --toolkit auto --archs 90}"
common=("${pkg[@]}" --cell "$CELL" --python "$PY")
probe_unit=${PROBE:-flash_fwd_hdim128_bf16_sm80.cu}  # the unit compiled again for 80;90;100;120

collect() {  # whatever exists now goes back through $OUT (max 8 files)
  cp "$W"/plan.json "$W"/archs.json "$W"/link.json "$W"/import.txt "$OUT"/ 2>/dev/null
  python3 - "$W" "$N" > "$OUT/shards.json" <<'PY'
import json, pathlib, sys
w, n = pathlib.Path(sys.argv[1]), int(sys.argv[2])
out = {}
for i in range(1, n + 1):
    rep, done = w / f"shard{i}.json", w / f"shard{i}.done"
    out[i] = {"done": done.read_text().strip() if done.exists() else None,
              "report": json.loads(rep.read_text()) if rep.exists() else None,
              "log_tail": (w / f"shard{i}.log").read_text()[-1500:] if (w / f"shard{i}.log").exists() else None}
print(json.dumps(out, indent=1))
PY
  ps -eo etimes=,args= | awk '/cicc|nvcc|ptxas/ && !/awk/ { for (i = 2; i <= NF; i++) if ($i ~ /\.cu$/) {
    n = split($i, p, "/"); print "running", p[n], $1 "s"; break } }' | sort -u -k2,2 > "$W/running.status"
  python3 - "$W" > "$OUT/ninja_logs.json" <<'PY'
import json, pathlib, sys
w, out = pathlib.Path(sys.argv[1]), {}
for log in sorted(w.glob("shard*/**/.ninja_log")):
    rows = [ln.split("\t") for ln in log.read_text().splitlines() if ln[:1].isdigit()]
    out[str(log)] = {r[3]: (int(r[1]) - int(r[0])) / 1000 for r in rows if len(r) >= 4}
print(json.dumps(out, indent=1))
PY
  tail -c 3000 "$W/link.log" > "$OUT/link.log.tail" 2>/dev/null
  cat "$W/archs.log" >> "$W/archs.status" 2>/dev/null
  cat "$W"/*.status > "$OUT/status.txt" 2>/dev/null
}

link_and_check() {
  t1=$(date +%s)
  "$PY" -m attnkit.cli wheels build "${common[@]}" --build-dir "$W/link" --link-only --objects "$W/objects" \
    --jobs "$(nproc)" --out "$W/house" --report "$W/link.json" > "$W/link.log" 2>&1
  echo "link rc=$? in $(( $(date +%s) - t1 )) s" | tee "$W/link.status"
  rm -rf /root/fa-site && python3 -m pip install -q --no-deps --no-index --target /root/fa-site "$W"/house/*.whl && PYTHONPATH=/root/fa-site python3 - <<'PY' | tee "$W/import.txt"
import torch, flash_attn, torch.nn.functional as F
q, k, v = (torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out = flash_attn.flash_attn_func(q, k, v, causal=True)
ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
print("flash_attn", flash_attn.__version__, flash_attn.__file__, "max|fa-sdpa|", float((out - ref).abs().max()))
PY
}

progress() { echo "$(date +%T) objects in store: $(ls "$W/objects" 2>/dev/null | grep -c '\.o$'); done: $(ls "$W"/shard*.done 2>/dev/null | wc -l)/$N; load $(cut -d' ' -f1 /proc/loadavg); mem used $(free -g | awk '/Mem/{print $3}') GiB"; }

case "${1:-}" in
  start)
    [ -n "${NO_DEPS:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /root/site \
      .carry14/wheels/*.whl || exit 1
    rm -rf "$W" && mkdir -p "$W" && cp -r src "$W/src" && cp -r "${CACHE:-.carry14/cache}" "$W/cache" && cp "$0" "$W/run.sh" && cp tools/h200_unit_archs.py "$W/unit_archs.py"
    { date -u; nproc; lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Socket'; free -g | head -2; nvcc --version | tail -1;
      python3 -c 'import torch; print("torch", torch.__version__)'; } | tee "$W/machine.status"
    for i in $(seq 1 "$N"); do
      lo=$(( (i - 1) * CORES )); hi=$(( i * CORES - 1 ))
      setsid taskset -c "$lo-$hi" bash "$W/run.sh" shard "$i" < /dev/null > /dev/null 2>&1 &
    done
    spare="$(( N * CORES ))-$(( $(nproc) - 1 ))"
    [ $(( N * CORES )) -lt "$(nproc)" ] || spare="0-$(( $(nproc) - 1 ))"
    setsid taskset -c "$spare" bash "$W/run.sh" archs < /dev/null > "$W/archs.log" 2>&1 &
    echo "shards on CPUs 0-$(( N * CORES - 1 )) ($CORES each), plan and the 4-arch unit on $spare"
    [ -n "${NO_PLAN:-}" ] || { taskset -c "$spare" "$PY" -m attnkit.cli wheels plan "${common[@]}" --build-dir "$W/plan" \
      --shards "$N" --json > "$W/plan.json" 2> "$W/plan.log"
    echo "plan rc=$? $(python3 -c "import json; d=json.load(open('$W/plan.json')); print(d['units'], 'units', [len(s['units']) for s in d['plan']])")"; }
    t0=$(date +%s)
    while [ $(( $(date +%s) - t0 )) -lt "${WAIT_S:-480}" ] && [ "$(ls "$W"/shard*.done 2>/dev/null | wc -l)" -lt "$N" ]; do
      progress; sleep 15
    done
    progress
    [ "$(ls "$W"/shard*.done 2>/dev/null | wc -l)" -lt "$N" ] || link_and_check
    collect
    ;;
  finish)
    t0=$(date +%s)
    while [ "$(ls "$W"/shard*.done 2>/dev/null | wc -l)" -lt "$N" ] || [ ! -e "$W/archs.status" ]; do
      [ $(( $(date +%s) - t0 )) -gt "${WAIT_S:-420}" ] && { echo "still running"; progress; collect; exit 3; }
      progress; sleep 15
    done
    cat "$W"/shard*.done
    link_and_check
    collect
    ;;
  shard)  # one shard, on the CPUs it was pinned to
    t0=$(date +%s)
    "$PY" -m attnkit.cli wheels build "${common[@]}" --build-dir "$W/shard$2" --shard "$2/$N" --objects "$W/objects" \
      --jobs "$(nproc)" --out "$W/house" --report "$W/shard$2.json" > "$W/shard$2.log" 2>&1
    echo "shard $2/$N rc=$? in $(( $(date +%s) - t0 )) s on $(nproc) CPUs ($(taskset -pc $$ | cut -d: -f2 | tr -d ' '))" > "$W/shard$2.done"
    ;;
  archs)  # the probe unit's own compile command: sm_90 alone, then 80;90;100;120 with --threads 4
    until tree=$(dirname "$(find "$W/shard1" -name build.ninja 2>/dev/null | head -1)") && [ "$tree" != . ]; do sleep 5; done
    PATH=$PATH:/usr/local/cuda/bin python3 "$W/unit_archs.py" "$tree" "$probe_unit" "$W/archs.json"
    echo "archs rc=$?" > "$W/archs.status"
    ;;
  *) echo "usage: $0 start | finish   (internal: shard I | archs)" >&2; exit 2 ;;
esac
