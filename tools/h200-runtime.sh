#!/usr/bin/env bash
# The runtime issue's H200 run (device machine: no network, torch 2.11.0+cu130, Python 3.12, 64 MiB per transfer).
# Steps, any of:  install  smoke  warmup  bench  bench-wait   (default: install smoke warmup)
#   install  FlashAttention-4 (from ../shared/tools/fa4-bundle.sh's two halves: .fa4a copied to /root/fa4 by the
#            previous command, .fa4b sent with this one) and .whl/*.whl (pydantic, nox and its deps,
#            nvidia-cudnn-frontend, the xformers wheel built by `attnkit wheels build`) into python3's site-packages
#   smoke    `nox -s smoke` (the README's main command) -> $OUT/<date>-h200-smoke.json, doctor in $OUT/doctor.txt
#   warmup   `attnkit warmup` twice in fresh processes on an empty cache: cold (compiles) then warm (disk cache)
#            -> $OUT/<date>-h200-fa4-warmup.json
#   bench    starts `attnkit bench` in the background (setsid: it may outlast one command, the machine stays while
#            the next command follows within 30 s); BENCH_ARGS adds e.g. --shape LABEL
#   bench-wait  waits for it (WAIT_S, default 540) -> $OUT/<date>-h200-bench.json + .png + bench.log
# Prepare here first (the machine has no network): ../shared/tools/fa4-bundle.sh (-> .fa4a, .fa4b), and in .whl/ the
# cp312 manylinux wheels of pydantic, pydantic-core, annotated-types, typing-inspection, nox and its dependencies
# (argcomplete attrs colorlog dependency-groups distlib filelock platformdirs python-discovery virtualenv),
# nvidia-cudnn-frontend==1.32.0 and the xformers wheel from `attnkit wheels build --package xformers --cell
# torch2.11-cu130-py312 --archs 90` (python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux_2_28_x86_64 ... -d .whl NAME==VERSION). Send .fa4a with one command and .fa4b + .whl with
# the next (the machine is kept ~30 s between commands).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STEPS=${*:-install smoke warmup}
DATE=$(date +%Y-%m-%d)
export ATTNKIT_REPORT_DIR=$OUT ATTNKIT_MACHINE_LABEL=h200 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')

for step in $STEPS; do
  echo "== $step ($(date +%T))"
  case $step in
  install)
    if [ ! -f /root/fa4/.installed ]; then
      # the bundle's parts: staged in /root/fa4 by earlier calls, or carried with this one (.fa4b, .fa4d)
      for part in .fa4?/libs.part.*; do [ -f "$part" ] && cp "$part" /root/fa4/; done
      cat /root/fa4/libs.part.* > /tmp/libs.tar.xz || exit 1
      [ "$(sha256sum /tmp/libs.tar.xz | cut -d' ' -f1)" = "$(cat /root/fa4/libs.sha256)" ] || { echo "fa4 libs: sha256 mismatch"; exit 1; }
      tar xJf /tmp/libs.tar.xz -C "$site" && rm /tmp/libs.tar.xz
      python3 -m pip install -q --no-index --no-deps --no-compile /root/fa4/*.whl || exit 1
      python3 -m pip install -q --no-index --no-deps --no-compile "${WHL_DIR:-.whl}"/*.whl || exit 1
      touch /root/fa4/.installed
    fi
    python3 -m pip list 2>/dev/null | grep -iE "^(flash|nvidia-cutlass|xformers|nvidia-cudnn-frontend|torch |nox|pydantic )" ;
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$OUT/nvidia-smi.txt" ;;
  smoke)
    t0=$(date +%s)
    python3 -m nox -s smoke -- "$OUT/$DATE-h200-smoke.json" > "$OUT/smoke.log" 2>&1; echo "smoke rc=$? in $(( $(date +%s) - t0 )) s"
    grep -E "^smoke:|FAILED" "$OUT/smoke.log" | head -40 ;;
  warmup)
    rm -rf /tmp/ak-cold && mkdir -p /tmp/ak-cold
    for run in cold warm; do
      ATTNKIT_CACHE_DIR=/tmp/ak-cold python3 -m attnkit.cli warmup --shapes tools/warmup-shapes.json \
        --report "$OUT/warmup-$run.json" > "$OUT/warmup-$run.log" 2>&1; echo "warmup $run rc=$?"
    done
    python3 - "$OUT" "$DATE" <<'PY'
import json, sys, os
out, date = sys.argv[1], sys.argv[2]
cold, warm = (json.load(open(os.path.join(out, f"warmup-{r}.json"))) for r in ("cold", "warm"))
rows = [{"shape": c["shape"], "backend": c["backend"], "cold_first_call_s": c["first_call_s"],
         "warm_first_call_s": w["first_call_s"], "steady_call_s": w["second_call_s"]}
        for c, w in zip(cold["shapes"], warm["shapes"])]
doc = {"date": date, "what": "attnkit warmup, run twice in fresh processes on one empty ATTNKIT_CACHE_DIR: "
       "cold = FlashAttention-4 compiles, warm = its disk cache (in attnkit's cache folder)",
       "gpu": cold["gpu"], "flash_attn4_import_s": {"cold": cold["flash_attn4_import_s"], "warm": warm["flash_attn4_import_s"]},
       "total_s": {"cold": cold["total_s"], "warm": warm["total_s"]}, "cached_files": warm["flash_attn4_cached_files"],
       "shapes": rows}
json.dump(doc, open(os.path.join(out, f"{date}-h200-fa4-warmup.json"), "w"), indent=1)
for r in rows:
    print(r)
print("total", doc["total_s"], "import", doc["flash_attn4_import_s"])
PY
    rm -f "$OUT"/warmup-cold.json "$OUT"/warmup-warm.json ;;
  bench)
    if [ -f /root/bench/PID ] && kill -0 "$(cat /root/bench/PID)" 2>/dev/null; then
      echo "a bench is already running (pid $(cat /root/bench/PID)): bench-wait collects it"; continue
    fi
    rm -rf /root/bench && mkdir -p /root/bench
    (setsid bash -c "echo \$\$ > /root/bench/PID; python3 -m attnkit.cli bench --out /root/bench/$DATE-h200-bench.json \
       ${BENCH_ARGS:-} > /root/bench/bench.log 2>&1; echo \$? > /root/bench/DONE" &) ;;
  bench-wait)
    deadline=$(( $(date +%s) + ${WAIT_S:-540} ))
    while [ ! -f /root/bench/DONE ] && [ "$(date +%s)" -lt $deadline ]; do sleep 5; done
    cp /root/bench/* "$OUT"/ 2>/dev/null
    if [ -f /root/bench/DONE ]; then echo "bench rc=$(cat /root/bench/DONE)"; else echo "bench still running"; fi
    grep -E "^bench |^summary|below target" /root/bench/bench.log | cut -c1-300 ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done
