#!/usr/bin/env bash
# Issue 14's H200 run: flash-attn for the reference cell at --archs 90 built as N shards one after another (each
# in a build tree of its own, one object store), then the link job; reports under /root/fa and $OUT.
# Stages, one device call each (a call lasts <= 10 minutes; the machine keeps /root between back-to-back calls):
#   bash tools/h200-sharded-build.sh setup       # deps from .carry14/wheels, then `wheels plan --shards N`
#   bash tools/h200-sharded-build.sh shard I     # compile shard I/N (setsid it to overlap with other work)
#   bash tools/h200-sharded-build.sh link        # gather, link, verify, import + one GPU call against SDPA
# Prepare here: .carry14/wheels (cp312 wheels: build deps + attnkit's deps) and .carry14/cache/sdists/<sdist>.
set -uo pipefail
N=${SHARDS:-2}
CELL=torch2.11-cu130-py312
W=/root/fa
mkdir -p "$W" "${OUT:-/tmp/out}"
# attnkit and the sdist are copied out of the checkout: a background shard outlives the call that started it
export PYTHONPATH=/root/site:$W/src PATH=/root/site/bin:$PATH ATTNKIT_CACHE_DIR=$W/cache PYTHONUNBUFFERED=1
common=(--package flash-attn --cell "$CELL" --python python3 --toolkit auto --archs 90)
case "${1:-}" in
  setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /root/site .carry14/wheels/*.whl || exit 1
    rm -rf "$W/src" "$W/cache" && cp -r src "$W/src" && cp -r .carry14/cache "$W/cache"
    nproc; free -g | head -2; nvcc --version | tail -1
    python3 -m attnkit.cli wheels plan "${common[@]}" --build-dir "$W/plan" --shards "$N" --json > "$W/plan.json" 2> "$W/plan.log"
    echo "plan rc=$? $(python3 -c "import json; d=json.load(open('$W/plan.json')); print(d['units'], 'units', [len(s['units']) for s in d['plan']])")"
    ;;
  shard)
    t0=$(date +%s)
    python3 -m attnkit.cli wheels build "${common[@]}" --build-dir "$W/shard$2" --shard "$2/$N" --objects "$W/objects" \
      --out "$W/house" --report "$W/shard$2.json" > "$W/shard$2.log" 2>&1
    echo "shard $2 rc=$? in $(( $(date +%s) - t0 )) s" | tee "$W/shard$2.done"
    ;;
  link)
    t0=$(date +%s)
    python3 -m attnkit.cli wheels build "${common[@]}" --build-dir "$W/link" --link-only --objects "$W/objects" \
      --out "$W/house" --report "$W/link.json" > "$W/link.log" 2>&1
    echo "link rc=$? in $(( $(date +%s) - t0 )) s"
    python3 -m pip install -q --no-deps --no-index --target /root/fa-site "$W"/house/*.whl && PYTHONPATH=/root/fa-site python3 - <<'PY' | tee "$W/import.txt"
import torch, flash_attn, torch.nn.functional as F
q, k, v = (torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out = flash_attn.flash_attn_func(q, k, v, causal=True)
ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
print("flash_attn", flash_attn.__version__, flash_attn.__file__, "max|fa-sdpa|", float((out - ref).abs().max()))
PY
    cp "$W"/plan.json "$W"/shard*.json "$W"/link.json "$W"/import.txt "${OUT:-/tmp/out}/" 2>/dev/null
    tail -c 3000 "$W/link.log" > "${OUT:-/tmp/out}/link.log.tail"
    ;;
  *) echo "usage: $0 setup | shard I | link" >&2; exit 2 ;;
esac
