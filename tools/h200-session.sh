#!/usr/bin/env bash
# One H200 session's work as ONE background job, so that the machine's 30 minutes go to GPU work and not to
# commands waiting on each other (the machine is held while a command runs and kept 30 s after it).
#   aside     here, before the session (2026-12-05): docs/results/ (37 MB of the 41 MB tree; every call sends the
#             tree) moved to .results-aside/ in the checkout (git-ignored through .git/info/exclude, so it does not
#             travel), its tune .jsonl files copied back (TUNE_FROM reads them), so
#             the two fa4-bundle halves travel in two calls (prep with .fa4a .oracle, start with .fa4b .whl) and no
#             `split`/`stage` is needed; `back` restores it before anything is committed (both refuse to overwrite)
#   prep      call 1 (carry .fa4a .oracle .whlA): FlashAttention-4's first half and flash-attn's tests file to
#             /root, pydantic installed (.whlA may come with `stage` instead)
#   stage     optional call 2, and 3 (carry .fa4b [.whlA], then .fa4d) when the tree is too large for .fa4b and .whl
#             in one call: the bundle's later parts to /root/fa4, for `start` to find there (a tree of 36 MB on
#             2026-12-03: the libs in three 22 MB parts, `split 3`)
#             (a tree over ~22 MB leaves no room for .fa4a's small wheels beside its part: `tools/h200-session.sh
#             split` moves them to .fa4c, which then travels with `start`, and `start` copies them to /root/fa4;
#             `split 3` also cuts the libs into three parts, for a tree over ~30 MB)
#   start     call 2 (carry .fa4b .whl [.fa4c]): FlashAttention-4 installed (tools/h200-runtime.sh install), the tree's
#             src/ copied to $S/src, then `job` started under setsid; then as `wait`. TUNE_FROM=FILE resumes
#             an earlier session's sweep (docs/results/*-h200-tune-*.jsonl; TUNE_FROM=packaged: every file the
#             packaged sm90 table was merged from, as its provenance names them); ORACLE_RESUME=FILE an earlier
#             oracle report (the grid's passes run what it left, merged with it); SMOKE_ONLY="--backend ..." the
#             smoke's rows for those backends only (one process); WHL_DIR a smaller wheel folder than .whl to carry.
#             KEEP_TABLE=1 keeps the earlier run's merged table ($R/selection) in use for this run's phases
#             (refused beside an ORDER with tune or refresh: they merge their own).
#             On a machine still warm from an earlier `start` (its results fetched by `wait`), `start` again needs no
#             carry: the install is skipped, $S/ak-cache (FA4's and flex's compiled kernels) kept, and the earlier
#             run's sweep file resumed unless TUNE_FROM names others, so e.g.
#             ORDER=bench BENCH_RESUME=... compiles nothing again. A bare `python3 -m attnkit.cli ...` there does
#             not see that cache (2026-12-06: such a bench spent its 190 s compiling FA4)
#   wait [S]  every later call (no carry): up to S seconds (default 540) for the job to end, then its results
#             packed into $OUT/results.tar.gz (one file: $OUT brings back 8 at most) and its log printed.
#             REFRESH=1 first copies this call's src/ to $S/src: phases not yet started run the fixed code
#             (only between phases: a running one imports lazily and could see half of the copy)
#   job       the phases in ORDER (default "checks hf compiled tune"), each writing under $S/results (a phase's
#             failure is logged, the next one runs):
#             checks: smoke (beside the oracle, at most SMOKE_S s, each process's report partial if its limit stops
#               it: the phases after it wait for it, and on an H100
#               on 2026-12-06 attention()'s own and compiled rows were still running after 6 min; SMOKE_ONLY=none leaves it out, SMOKE_SPLIT=attnkit runs only
#               attention()'s own rows, in 3 processes (SMOKE_PROCS=N: N), and SMOKE_EXTRA="--backend X ..." those backends' rows
#               beside them in a 4th; SMOKE_ONLY leaves both out); oracle: flash-attn's grid in SHARDS
#               processes side by side (16 on a card over 100 GB, else 8), the own pick over the whole grid (ORACLE_OWN s), then every backend forced
#               (ORACLE_FORCED s; 0 leaves it out), merged;
#             hf: the HF training step eager and compiled (HF_S s); compiled: bench --compiled (COMPILED_S s;
#               COMPILED_SHAPES="label;label" those suite shapes, "all" every one whose eager pick compiles);
#             replay: FA4's forward replay, exact and timed (tools/probe-fa4-replay.py, REPLAY_S s);
#             varlen: a packed call's routes against the plain padded call, kernels counted
#               (tools/probe-varlen-padded.py, VARLEN_S s);
#             train: FA4's training path replayed (forward and backward), close and timed (tools/probe-fa4-train.py,
#               TRAIN_S s);
#             refresh: TUNE_FROM's forward passes that FA4 ran (REFRESH_FROM's only, when set), timed again
#               (REFRESH_KIND=train: the training cases near the cuDNN / FA4 crossover instead, both passes;
#               REFRESH_KIND=varlen: the packed cases torch_varlen ran, every pass, since its route changed;
#               REFRESH_KIND=flex: the cases of one length where flex was a contender, timed before each size got
#               its own flex kernel, every pass; REFRESH_KIND="train varlen": both, one after the other, each with
#               the budgets below)
#               (compile REFRESH_COMPILE s, timed REFRESH_BUDGET s; REFRESH_MATCH=REGEX those of its cases whose
#               label it finds) and merged over TUNE_FROM into
#               $R/selection/sm90.json;
#             sdpahost: attnkit's host time on torch's kernels in training against the plain call
#               (tools/probe-sdpa-train-host.py, SDPAHOST_S s);
#             guardprof: forms of the cuDNN gradient-layout guard timed and profiled on the plain call
#               (tools/probe-cudnn-guard-forms.py, GUARDPROF_S s); dispatch: attention()'s host us per call over
#               the plain call on a tiny shape, three repeats (DISPATCH_S s); compstack: compiled attention()'s
#               host time by Python frame (tools/probe-compiled-host-stack.py, COMPSTACK_S s); flexgrad: flex's
#               backward in a compiled graph (tools/probe-flex-compiled-grad.py, FLEXGRAD_S s); alibigraph: ALiBi's dense bias
#               against flex in a compiled graph (tools/probe-alibi-graph.py, ALIBIGRAPH_S s); flexdyn: flex's forward
#               in a graph with dynamic sizes (tools/probe-flex-graph-dynamic.py, FLEXDYN_S s); flexsize: flex compiled for one size against
#               flex after another size (tools/probe-flex-first-size.py, FLEXSIZE_S s); flexhost: attention()'s flex
#               against torch's flex called directly, one difference at a time (tools/probe-flex-host.py, FLEXHOST_S s); bench: `attnkit
#               bench` (BENCH_S s; BENCH_SHAPES="label;label" its suite shapes by label; BENCH_RESUME=FILE an
#               earlier session's report cut short, continued with --resume: same machine kind only);
#             rebench: `attnkit bench` again for REBENCH_SHAPES="label;label" into bench-again.json (REBENCH_S s);
#             tune: (TUNE_MATCH=REGEX: only the plan's cases whose label it finds, `tune --match`, timed and
#               compiled; the held-out shapes are compiled all the same, for validate, after the matched cases) the plan's JIT kernels (FA4, flex) and the held-out shapes' compiled by SHARDS CPU shards
#               (TUNE_COMPILE s), the timed sweep alone on the GPU over what they compiled (TUNE_BUDGET s;
#               ONLY_COMPILED=0 times the rest too), merged into sm90.json + PNG; --validate against that table
#               (VALIDATE_S s, VALIDATE_MATCH=REGEX its shapes whose label it finds; it writes each shape as it lands).
#             A phase after the sweep runs with its table (ATTNKIT_SELECTION_DIR): ORDER="tune checks" checks the
#             runtime's picks as they are once the table is packaged
# every `timeout` also kills (-k 15) 15 s after its TERM: a TERM'd compile waits for inductor's workers (session 4's
# 120 s compile phase took 237 s)
set -uo pipefail
# everything this script writes and removes is under $S (its own folder), or /root/fa4 when that is a bundle half
S=${ATTNKIT_SESSION_DIR:-/root/attnkit-session}
OUT=${OUT:-/tmp/out}; R=$S/results
case ${1:-wait} in split|aside|back) ;; *) mkdir -p "$OUT" "$R" ;; esac   # these three run here, before the session
ORACLE_OWN=${ORACLE_OWN:-360}; ORACLE_FORCED=${ORACLE_FORCED:-300}; TUNE_COMPILE=${TUNE_COMPILE:-200}
TUNE_BUDGET=${TUNE_BUDGET:-300}; VALIDATE_S=${VALIDATE_S:-240}; HF_S=${HF_S:-300}; COMPILED_S=${COMPILED_S:-240}; REPLAY_S=${REPLAY_S:-240}; TRAIN_S=${TRAIN_S:-240}; REFRESH_COMPILE=${REFRESH_COMPILE:-150}; REFRESH_BUDGET=${REFRESH_BUDGET:-280}; VARLEN_S=${VARLEN_S:-120}; SDPAHOST_S=${SDPAHOST_S:-150}; SMOKE_S=${SMOKE_S:-900}; GUARDPROF_S=${GUARDPROF_S:-150}; DISPATCH_S=${DISPATCH_S:-60}; REBENCH_S=${REBENCH_S:-300}; COMPSTACK_S=${COMPSTACK_S:-240}; FLEXGRAD_S=${FLEXGRAD_S:-240}; ALIBIGRAPH_S=${ALIBIGRAPH_S:-300}; FLEXDYN_S=${FLEXDYN_S:-200}; FLEXSIZE_S=${FLEXSIZE_S:-200}; FLEXHOST_S=${FLEXHOST_S:-300}; BENCH_S=${BENCH_S:-600}; SHARDS=${SHARDS:-}
step=${1:-wait}
# the phases `job` runs, each a function below (one list: ORDER is checked against it)
PHASES="checks hf compiled tune replay refresh train varlen sdpahost guardprof dispatch compstack flexgrad alibigraph flexdyn flexsize flexhost bench rebench"
ORDER=${ORDER:-checks hf compiled tune}   # the phases a job runs, in order (`start` checks KEEP_TABLE against them)

phase() { echo "$(date +%T) $*" | tee -a "$R/phases.log"; }
on() {   # a phase with budget 0 is left out; a budget that is not whole seconds is said so, and left out too
  case ${1:-0} in ''|*[!0-9]*) phase "skipped: $2 (budget '${1:-}' is not whole seconds)"; return 1 ;; esac
  [ "$1" -gt 0 ] || { phase "skipped: $2 (its budget is 0)"; return 1; }
}

ak="python3 -m attnkit.cli"

table_in_use() {   # the phases after the sweep check and time the runtime as it decides from this session's table
  if [ -s "$R/selection/sm90.json" ] && [ "${ATTNKIT_SELECTION_DIR:-}" != "$R/selection" ]; then
    export ATTNKIT_SELECTION_DIR=$R/selection; phase "  (selection from $R/selection/sm90.json from here on)"
  fi
}

checks() {
  local i
  phase "smoke + oracle (own pick)"
  mkdir -p "$R/oracle"
  # the smoke in 4 processes side by side: flex's rows (it compiles each signature: 12 of the 15 min on
  # 2026-12-01) split over 3 by case, and every other row in the 4th
  local groups others j
  # SMOKE_PROCS=N: flex's rows over N processes instead (2026-12-07: 150 s stopped all of them before any report;
  # each now writes the rows it ran when its limit stops it)
  local procs=${SMOKE_PROCS:-3}
  case $procs in ''|*[!0-9]*|0) phase "SMOKE_PROCS '$procs' is not a whole number > 0: 3"; procs=3 ;; esac
  groups=$(python3 -c "from attnkit.runtime.smoke import CASES; c = list(CASES); n = $procs; print(' '.join(','.join(c[i::n]) for i in range(n) if c[i::n]))")
  others=$(python3 -c "from attnkit.runtime.backends import REGISTRY; from attnkit.runtime.smoke import AUTO, COMPILED; print(' '.join('--backend ' + n for n in [*REGISTRY, AUTO, COMPILED] if n != 'flex'))")
  if [ -z "$groups" ] || [ -z "$others" ]; then phase "smoke split: listing failed, one process"; groups=; others=" "; fi
  if [ -n "${SMOKE_ONLY:-}" ]; then groups=; others=$SMOKE_ONLY; fi   # e.g. "--backend attnkit-compiled": those rows only
  if [ "${SMOKE_ONLY:-}" = none ]; then groups=; others=; phase "skipped: smoke (SMOKE_ONLY=none)"; fi
  # SMOKE_SPLIT=BACKEND: that backend's rows alone, split by case over the 3 processes (flex's by default);
  # with SMOKE_EXTRA, those backends' rows beside them
  local split=${SMOKE_SPLIT:-flex}
  if [ -n "${SMOKE_SPLIT:-}" ]; then
    if [ -n "${SMOKE_ONLY:-}" ] && [ "$SMOKE_ONLY" != none ]; then phase "skipped: SMOKE_SPLIT (SMOKE_ONLY is set: its rows run, in one process)"
    else others=${SMOKE_EXTRA:-}; fi   # SMOKE_EXTRA="--backend X ...": those rows too, in a 4th process
  fi
  j=0
  for g in $groups; do   # flex compiles: 4 inductor threads each, beside the oracle's SHARDS single-threaded shards
    j=$((j + 1))
    (TORCHINDUCTOR_COMPILE_THREADS=4 ATTNKIT_REPORT_DIR=$R timeout -k 15 "$SMOKE_S" $ak smoke --backend "$split" $(echo "$g" | sed 's/^/--case /; s/,/ --case /g') \
      --report "$R/smoke-$split-$j.json" > "$R/smoke-$split-$j.log" 2>&1; echo "smoke $split $j rc=$?" >> "$R/phases.log") &
  done
  if [ -n "$others" ]; then   # " ": every row, one process
  (ATTNKIT_REPORT_DIR=$R timeout -k 15 "$SMOKE_S" $ak smoke $others --report "$R/smoke.json" > "$R/smoke.log" 2>&1; echo "smoke rc=$?" >> "$R/phases.log") &
  fi
  # 2026-12-01: 16 shards with every backend forced ran 461 cases in 300 s, the own pick alone ~20 cases/s:
  # the own pick over the whole grid first, then the forced backends for what is left of the budget. The 16
  # processes claim kernel configurations from one folder per pass (oracle --claims): static shards finished in
  # 212-436 s, and the heaviest ones left the same 94 cases in two sessions
  # ORACLE_RESUME=<an earlier session's merged report in the tree>: the passes run only what it left (oracle --resume)
  local pids=() resume= earlier=
  if [ -n "${ORACLE_RESUME:-}" ]; then   # copied by `start`, which stops when it cannot
    resume="--resume $R/oracle-earlier.json" earlier=$R/oracle-earlier.json
  fi
  for i in $(seq 1 "$SHARDS"); do
    TORCHINDUCTOR_COMPILE_THREADS=1 $ak oracle --tests "$S/ref/test_flash_attn.py" --claims "$R/oracle/claims-own" \
      $resume --backend attnkit --budget "$ORACLE_OWN" --out "$R/oracle/own-$i.json" > "$R/oracle/own-$i.log" 2>&1 < /dev/null &
    pids+=($!)
  done
  wait "${pids[@]}"   # the oracle shards only: the smoke (15 min on the H200 on 2026-12-01) goes on beside the forced
  # backends, up to the next phases
  if on "$ORACLE_FORCED" "oracle (forced backends)"; then
  phase "oracle (forced backends)"
  forced=$(python3 -c "from attnkit.runtime.backends import REGISTRY; print(' '.join('--backend ' + n for n in REGISTRY))")
  pids=()
  for i in $(seq 1 "$SHARDS"); do
    TORCHINDUCTOR_COMPILE_THREADS=1 $ak oracle --tests "$S/ref/test_flash_attn.py" --claims "$R/oracle/claims-forced" \
      $resume $forced --budget "$ORACLE_FORCED" --out "$R/oracle/shard-$i.json" > "$R/oracle/shard-$i.log" 2>&1 < /dev/null &
    pids+=($!)
  done
  wait "${pids[@]}"
  fi
  local reports
  reports=$(ls "$R"/oracle/own-*.json "$R"/oracle/shard-*.json 2>/dev/null)   # the forced pass may be left out
  $ak oracle --merge $earlier $reports --out "$R/oracle.json" > "$R/oracle-merge.log" 2>&1
  phase "oracle merged rc=$? ($(echo $reports | wc -w) reports)"
  [ -s "$R/oracle.json" ] && rm -rf "$R"/oracle/shard-*.json "$R"/oracle/own-*.json "$R"/oracle/claims-*   # merged; logs stay
  wait   # the smoke: the compile shards' tensors (up to 64 GiB a case) would make its rows fail for want of memory
}

hf() {
  # the compile issue's HF step: a 2-layer Llama (GQA 16/4, D128), full / padded / packed batches, sdpa and
  # attnkit, eager and compiled(fullgraph), with graph breaks counted (bench/integrations.py)
  if on "$HF_S" "integrations (HF step)"; then
  phase "integrations (HF step)"
  timeout -k 15 "$HF_S" $ak bench --integrations --out "$R/integrations.json" --layers 2 --only train_step \
    > "$R/integrations.log" 2>&1
  phase "integrations rc=$?"
  fi
}

compiled() {
  # compiled vs eager before the sweep (both on the same selection, so the sweep's table does not change the
  # ratio): the compile issue's baseline rows first (docs/results/2026-12-01-h200-compile-before-ops.json), then more JIT picks
  # COMPILED_SHAPES="label;label": those suite shapes instead, in that order ("all": every shape whose eager
  # pick compiles, as `bench --compiled` chooses them)
  if on "$COMPILED_S" compiled; then
  local want
  want=$(echo "${COMPILED_SHAPES:-}" | sed 's/^ *//; s/ *$//')
  case $want in
    all) SHAPE_ARGS=() ;;
    *[!\ \;]*) shape_args "$want" ;;
    *) shape_args "train MHA D128 S4096 causal;train GQA 32/8 D128 S8192 causal;prefill Sq512 Sk4096 GQA 32/8 D128;\
window 1024 S4096 D128 causal;window 4096 GQA 32/8 S16384 causal;varlen GQA 32/8 D128 17-4096 causal;\
decode GQA 32/8 D128 Sk4096;train D96 S2048 causal" ;;
  esac
  local shapes=("${SHAPE_ARGS[@]}")
  phase "compiled ($(( ${#shapes[@]} / 2 )) shapes; 0: every shape whose eager pick compiles)"
  timeout -k 15 "$COMPILED_S" $ak bench --compiled --out "$R/compiled.json" "${shapes[@]}" > "$R/compiled.log" 2>&1
  phase "compiled rc=$?"
  fi
}

refresh() {
  # recorded cases whose backend's host path changed since, timed again: compile shards first (--compile-only
  # --refresh-KIND), then the timed run over what they compiled, merged with TUNE_FROM (a refreshed pass replaces
  # the old one). REFRESH_KIND, one or more of (tune.refresh_cases says which cases): fwd (FA4's forwards, its
  # forward replay), train (training cases near the cuDNN / FA4 crossover), varlen (packed cases torch_varlen ran,
  # its direct route), flex (cases of one length where flex was a contender, timed before each size got its own
  # flex kernel: score mods first); each kind gets REFRESH_COMPILE and REFRESH_BUDGET and its own refresh-KIND.jsonl (a case two
  # kinds share is done for one once it has that kind's passes: one file would let the first hide the second's),
  # joined in REFRESH_KIND's order into refresh.jsonl (later lines' passes replace earlier ones: tune.latest_passes)
  # REFRESH_FROM=<tune lines in the tree>: only those cases (copied by `start`), merged over TUNE_FROM
  # REFRESH_MATCH=REGEX: only the refresh's cases whose label it finds (`tune --match`), in refresh order, for each
  # kind in REFRESH_KIND: for a budget that cannot take them all (2026-12-07: 98 flex cases, 614 s of device time
  # left after ten refused starts)
  local from=$R/tune.jsonl kind flag i pids refused match=()
  [ -n "${REFRESH_MATCH:-}" ] && match=("--match=$REFRESH_MATCH")   # one argument: a regex may begin with "-"
  [ -n "${REFRESH_FROM:-}" ] && from=$R/refresh-from.jsonl
  if [ ! -s "$R/tune.jsonl" ]; then phase "skipped: refresh (no TUNE_FROM)"; return; fi
  on "$REFRESH_BUDGET" "refresh" && on "$REFRESH_COMPILE" "refresh (compile)" || return 0
  mkdir -p "$R/refresh" "$R/selection"
  local done_kinds=() kinds
  kinds=$(python3 -c "from attnkit.bench.tune import REFRESH_KINDS; print(*REFRESH_KINDS)")   # tune's own list
  for kind in ${REFRESH_KIND:-fwd}; do
    case " $kinds " in *" $kind "*) flag=--refresh-$kind ;; *) phase "skipped: refresh kind '$kind' ($kinds)"; continue ;; esac
    phase "refresh $kind compile"
    local compiled_before
    compiled_before=$(cat "$R/refresh-$kind.jsonl.compiled" 2>/dev/null | wc -l)
    pids=()
    for i in $(seq 1 "$SHARDS"); do
      TORCHINDUCTOR_COMPILE_THREADS=1 timeout -k 15 "$REFRESH_COMPILE" $ak tune --compile-only "$flag" "$from" ${match[@]+"${match[@]}"} \
        --shard "$i/$SHARDS" --out "$R/refresh-$kind.jsonl" --resume > "$R/refresh/compile-$kind-$i.log" 2>&1 < /dev/null &
      pids+=($!)
    done
    wait "${pids[@]}"
    if [ "$(cat "$R/refresh-$kind.jsonl.compiled" 2>/dev/null | wc -l)" -le "$compiled_before" ]; then   # 2026-12-05: 60 s on 16 shards finished no packed case
      refused=$(grep -h -- "--match:" "$R"/refresh/compile-"$kind"-*.log 2>/dev/null | head -1)   # REFRESH_MATCH found none
      phase "refresh $kind: its compile phase finished no case in $REFRESH_COMPILE s, nothing to time (${refused:-raise REFRESH_COMPILE})"
      continue
    fi
    phase "refresh $kind timed"
    $ak tune "$flag" "$from" ${match[@]+"${match[@]}"} --out "$R/refresh-$kind.jsonl" --resume --budget "$REFRESH_BUDGET" --only-compiled \
      > "$R/refresh/tune-$kind.log" 2>&1
    phase "refresh $kind rc=$? ($(grep -c '"shape"' "$R/refresh-$kind.jsonl" 2>/dev/null) cases)"
    [ -s "$R/refresh-$kind.jsonl" ] && done_kinds+=("$R/refresh-$kind.jsonl")
  done
  if [ ${#done_kinds[@]} -eq 0 ]; then phase "skipped: refresh merge (no kind timed a case)"; return 0; fi
  cat "${done_kinds[@]}" > "$R/refresh.jsonl"   # header lines included: a file may hold several sessions
  $ak tune --merge "$R/tune.jsonl" "$R/refresh.jsonl" --table "$R/selection/sm90.json" --png "$R/tune-winners.png" \
    > "$R/refresh/merge.log" 2>&1
  phase "refresh merged rc=$?"
}

probe() {
  # one tools/probe-*.py under its time limit: BUDGET NAME SCRIPT REPORT [WORD...]; each WORD's count of log lines
  # starting with it goes into the phase line
  local budget=$1 name=$2 script=$3 report=$4 w counts=""
  shift 4
  on "$budget" "$name" || return 0
  phase "$name"
  timeout -k 15 "$budget" python3 "tools/$script" "$R/$report.json" > "$R/$report.log" 2>&1
  local rc=$?
  for w in "$@"; do counts="$counts${counts:+, }$(grep -c "^$w" "$R/$report.log") $w"; done
  phase "$name rc=$rc${counts:+ ($counts)}"
}

# FlashAttention-4's forward replay (runtime/backends/fa4_replay.py): bitwise against FA4's own call on a grid of
# forward calls, and timed against FA4 direct and the plain SDPA call
replay() { probe "$REPLAY_S" "fa4 replay probe" probe-fa4-replay.py fa4-replay exact timed; }
# FlashAttention-4's training path with forward and backward replayed (fa4_ops.eager_function): forward bitwise and
# gradients within rounding of FA4's own call on a grid, and fwd+bwd timed
train() { probe "$TRAIN_S" "fa4 training replay probe" probe-fa4-train.py fa4-train close timed; }
# a packed call's routes against the plain padded call, with each step's kernel count: where the padded route's
# ~500 us over the plain call went on 2026-12-04
varlen() { probe "$VARLEN_S" "varlen routes probe" probe-varlen-padded.py varlen-padded; }
# attnkit's host time on torch's own kernels in training against the plain SDPA call, interleaved: the H200
# validate's GPT-2 fp16 row (12-15% behind the plain call)
sdpahost() { probe "$SDPAHOST_S" "sdpa training host probe" probe-sdpa-train-host.py sdpa-train-host; }
# forms of the cuDNN gradient-layout guard on the plain SDPA call, timed and profiled (kernel launch against GPU
# start): where the guard's 23-32 us per synced training step went on the H100 (2026-12-06)
guardprof() { probe "$GUARDPROF_S" "cudnn guard forms probe" probe-cudnn-guard-forms.py cudnn-guard-forms; }
# flex's backward recorded in a compiled graph with static sizes: gradients against float64 and flex's kernels in
# the graph; attention()'s own pick compiled with dynamic sizes beside it (tools/probe-flex-compiled-grad.py)
flexgrad() { probe "$FLEXGRAD_S" "flex compiled backward probe" probe-flex-compiled-grad.py flex-compiled-grad ok failed; }
alibigraph() { probe "$ALIBIGRAPH_S" "ALiBi in a graph probe" probe-alibi-graph.py alibi-graph; }
flexdyn() { probe "$FLEXDYN_S" "flex forward in a dynamic graph probe" probe-flex-graph-dynamic.py flex-graph-dynamic ok failed; }
# flexsize: flex compiled for one size against flex after another size of the same signature (a dynamic graph)
flexsize() { probe "$FLEXSIZE_S" "flex first size probe" probe-flex-first-size.py flex-first-size case; }
# flexhost: attention()'s flex call against torch's flex called directly, one difference at a time (block mask, mods
# and entry point, bound runner, lookup), timed and profiled (the held-out BLOOM shape's 0.89 with a sync)
flexhost() { probe "$FLEXHOST_S" "flex host probe" probe-flex-host.py flex-host case; }
# a compiled attention() step's host time, Python frame by frame, against eager and the plain call compiled
compstack() { probe "$COMPSTACK_S" "compiled host stack probe" probe-compiled-host-stack.py compiled-host-stack; }
# `attnkit bench` (BENCH_SHAPES="label;label": only those suite shapes), its report written shape by shape
bench() {
  on "$BENCH_S" "bench" || return 0
  local resume=()   # BENCH_RESUME=<an earlier session's report cut short, in the tree>: its shapes kept (--resume)
  if [ -n "${BENCH_RESUME:-}" ]; then
    cp "$BENCH_RESUME" "$R/bench.json" || { phase "bench: BENCH_RESUME=$BENCH_RESUME could not be copied: not run"; return 0; }
    resume=(--resume)
  fi
  bench_run bench "$BENCH_S" "${BENCH_SHAPES:-}" "${resume[@]}"
}
# the same bench again, into its own report, for the shapes in REBENCH_SHAPES ("label;label"): e.g. a resumed
# suite's shapes that an earlier session timed with other sampling
rebench() {
  on "$REBENCH_S" "rebench" || return 0
  case ${REBENCH_SHAPES:-} in *[!\ \;]*) ;; *) phase "skipped: rebench (REBENCH_SHAPES names no shape)"; return 0 ;; esac
  bench_run bench-again "$REBENCH_S" "$REBENCH_SHAPES"
}
shape_args() {   # "label;label" -> SHAPE_ARGS=(--shape label ...): the suite shapes a bench command is to run
  local labels=() label
  SHAPE_ARGS=()
  IFS=';' read -ra labels <<< "$1"
  for label in "${labels[@]}"; do
    label=$(echo "$label" | sed 's/^ *//; s/ *$//')   # "a; b": the spaces around a ';' are not the label's
    [ -n "$label" ] && SHAPE_ARGS+=(--shape "$label")
  done
  return 0
}
bench_run() {   # NAME BUDGET "label;label" [--resume]: `attnkit bench` into $R/NAME.json, its log $R/NAME.log
  local name=$1 budget=$2
  shape_args "$3"
  local shapes=("${SHAPE_ARGS[@]}")
  local what="$(( ${#shapes[@]} / 2 )) shapes"
  [ "${#shapes[@]}" -gt 0 ] || what="the whole suite"
  phase "$name ($what${4:+; resuming ${BENCH_RESUME:-$R/$name.json}})"
  timeout -k 15 "$budget" $ak bench --out "$R/$name.json" "${shapes[@]}" "${@:4}" > "$R/$name.log" 2>&1
  phase "$name rc=$?"
}
# attention()'s host time per call over the plain SDPA call on a tiny shape (issue 22: <= 3 us), three repeats
dispatch() {
  on "$DISPATCH_S" "dispatch overhead" || return 0
  phase "dispatch overhead"
  timeout -k 15 "$DISPATCH_S" python3 -c "import json, sys; from attnkit.bench.run import dispatch_overhead
json.dump([dispatch_overhead('cuda') for _ in range(3)], open(sys.argv[1], 'w'), indent=1)" "$R/dispatch-overhead.json" > "$R/dispatch-overhead.log" 2>&1
  phase "dispatch overhead rc=$?"
}

tune() {
  local i match=()
  [ -n "${TUNE_MATCH:-}" ] && match=("--match=$TUNE_MATCH")   # the plan's cases whose label it finds, e.g. '\|-\|short\|'
  if on "$TUNE_BUDGET" tune && on "$TUNE_COMPILE" "tune (its compile phase)"; then
  phase "tune compile"
  mkdir -p "$R/tune"
  pids=()
  for i in $(seq 1 "$SHARDS"); do
    TORCHINDUCTOR_COMPILE_THREADS=1 timeout -k 15 "$TUNE_COMPILE" $ak tune --compile-only --shard "$i/$SHARDS" \
      --out "$R/tune.jsonl" --resume ${match[@]+"${match[@]}"} > "$R/tune/compile-$i.log" 2>&1 < /dev/null &   # skips what TUNE_FROM has
    pids+=($!)
  done
  wait "${pids[@]}"
  phase "tune timed"
  # ONLY_COMPILED=1: the timed run measures what the compile phase finished (no JIT compile in its budget)
  $ak tune --out "$R/tune.jsonl" --resume ${match[@]+"${match[@]}"} --budget "$TUNE_BUDGET" $([ "${ONLY_COMPILED:-1}" = 1 ] && echo --only-compiled) \
    > "$R/tune/tune.log" 2>&1
  phase "tune rc=$? ($(grep -c '"shape"' "$R/tune.jsonl" 2>/dev/null) cases)"
  fi
  if [ -s "$R/tune.jsonl" ]; then   # this session's sweep, or TUNE_FROM's alone: the table validate decides from
  mkdir -p "$R/selection" "$R/tune"
  # a refresh phase before this one: its lines go last, so its passes replace the old ones (tune.latest_passes)
  $ak tune --merge "$R/tune.jsonl" $([ -s "$R/refresh.jsonl" ] && echo "$R/refresh.jsonl") \
    --table "$R/selection/sm90.json" --png "$R/tune-winners.png" > "$R/tune/merge.log" 2>&1
  phase "tune merged rc=$?"
  fi
  if [ ! -s "$R/selection/sm90.json" ]; then phase "skipped: validate (no table: no sweep ran and no TUNE_FROM)"
  elif on "$VALIDATE_S" validate; then
  local vmatch=()   # VALIDATE_MATCH=REGEX: only the held-out shapes whose label it finds (tune --validate --match)
  [ -n "${VALIDATE_MATCH:-}" ] && vmatch=("--match=$VALIDATE_MATCH")
  ATTNKIT_SELECTION_DIR=$R/selection timeout -k 15 "$VALIDATE_S" $ak tune --validate --resume ${vmatch[@]+"${vmatch[@]}"} --out "$R/validate.json" > "$R/validate.log" 2>&1
  phase "validate rc=$?"
  fi
}

job() {
  # the shards share one GPU: 16 beside the smoke's 3 processes fit an H200's 141 GB; on an 80 GB H100
  # (2026-12-05) 18 of 751 oracle cases (varlen ALiBi D256) and one smoke row failed with the driver's "out of
  # memory", so an 80 GB card runs 8 (SHARDS=N sets it)
  # (the tune and refresh compile shards too: each runs its cases once on the GPU, up to 64 GiB a case; untested on
  # an H100 at 8)
  local mem
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  case $mem in ''|*[!0-9]*) mem=0 ;; esac   # no nvidia-smi, or "[N/A]": the smaller count
  [ -n "$SHARDS" ] || SHARDS=$([ "$mem" -ge 100000 ] && echo 16 || echo 8)
  case $SHARDS in ''|0|*[!0-9]*) phase "SHARDS='$SHARDS' is not a whole number above 0: 8"; SHARDS=8 ;; esac
  export PYTHONPATH=$S/src PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore ATTNKIT_CACHE_DIR=$S/ak-cache \
    ATTNKIT_MACHINE_LABEL=${ATTNKIT_MACHINE_LABEL:-h200}
  phase "job on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) ($mem MiB): $SHARDS shards"
  local p
  for p in $ORDER; do
    [ "$p" = tune ] || table_in_use   # every phase after a sweep runs on its table
    case " $PHASES " in *" $p "*) $p ;; *) phase "skipped: unknown phase '$p' in ORDER ($PHASES)" ;; esac
  done
  phase "DONE"
}

pack() {
  tar czf "$OUT/results.tar.gz" -C "$S" results 2>/dev/null
  tail -n 20 "$R/phases.log" 2>/dev/null
  grep -hE "^smoke:|FAILED" "$R"/smoke*.log 2>/dev/null | head -20
  tail -n 2 "$R/tune/tune.log" 2>/dev/null | cut -c1-300
  grep -h "^[A-Za-z].*: plain" "$R/cudnn-guard-forms.log" 2>/dev/null
  grep -hv USDT "$R/compiled-host-stack.log" 2>/dev/null | head -60
  grep -v "Warning\|warnings.warn" "$R/alibi-graph.log" 2>/dev/null | cut -c1-400 | tail -n 12
  grep -h "^ok\|^failed\|^summary" "$R/flex-graph-dynamic.log" 2>/dev/null | cut -c1-700
  grep -h "^case" "$R/flex-first-size.log" 2>/dev/null | cut -c1-500
  grep -h "^case" "$R/flex-host.log" 2>/dev/null | cut -c1-1200   # two passes, six forms: ~700 characters
  grep -h "^bench \|^summary" "$R/bench.log" "$R/bench-again.log" 2>/dev/null | cut -c1-600
  cat "$R/dispatch-overhead.json" 2>/dev/null | tr -d ' \n' | cut -c1-400; echo
}

case $step in
  prep)
    if [ -e /root/fa4 ] && [ ! -f /root/fa4/libs.sha256 ]; then echo "/root/fa4 is not a fa4-bundle half: left alone"; exit 1; fi
    rm -rf /root/fa4 "$S/ref" && cp -r .fa4a /root/fa4 && mkdir -p "$S/ref" && cp .oracle/test_flash_attn.py "$S/ref/" || exit 1
    if [ -d .whlA ]; then python3 -m pip install -q --no-index --no-deps --no-compile .whlA/*.whl || exit 1; fi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" ;;
  stage)   # when the tree and both bundle halves do not fit one call's 64 MiB: .fa4b (+ .whlA) now, .whl with start
    ls .fa4?/libs.part.* > /dev/null 2>&1 || { echo "stage: no bundle part carried (.fa4b or .fa4d)"; exit 1; }
    for part in .fa4?/libs.part.*; do cp "$part" /root/fa4/ || exit 1; done
    if [ -d .whlA ]; then python3 -m pip install -q --no-index --no-deps --no-compile .whlA/*.whl || exit 1; fi
    ls -la /root/fa4 | tail -3 ;;
  aside)   # here: docs/results/ out of the tree that travels, its sweep files back in
    away=.results-aside
    [ -e "$away" ] && { echo "aside: $away exists (an earlier aside not brought back?): run 'back' or look at it"; exit 1; }
    grep -qx "/$away/" .git/info/exclude 2>/dev/null || echo "/$away/" >> .git/info/exclude
    [ -d docs/results ] || { echo "aside: no docs/results here (run it in the checkout's root)"; exit 1; }
    mv docs/results "$away" && mkdir docs/results && cp "$away"/*.jsonl docs/results/ &&
      echo "docs/results aside in $away (its .jsonl copied back); run 'tools/h200-session.sh back' before committing" ;;
  back)    # here: docs/results/ as it was (the sweep files copied back are the same files)
    away=.results-aside
    [ -d "$away" ] || { echo "back: nothing aside ($away does not exist)"; exit 1; }
    for f in docs/results/*; do   # what is here is aside too, unchanged: nothing is lost by putting it back
      cmp -s "$f" "$away/$(basename "$f")" || { echo "back: docs/results/$(basename "$f") is new or changed: move it to $away first"; exit 1; }
    done
    rm -rf docs/results && mv "$away" docs/results && git status --short docs/results | head -5 ;;
  split)   # here, before the session: .fa4a's small wheels to .fa4c (2026-12-02: a 26 MB tree + .fa4a was 66 MiB)
    mkdir -p .fa4c && { ! ls .fa4a/*.whl > /dev/null 2>&1 || mv .fa4a/*.whl .fa4c/; } || exit 1
    grep -qx "/.fa4c/" .git/info/exclude 2>/dev/null || echo "/.fa4c/" >> .git/info/exclude
    if [ "${2:-2}" = 3 ] && [ -f .fa4b/libs.part.01 ] && [ ! -f .fa4d/libs.part.02 ]; then
      # `split 3`: the libs in three parts (.fa4a, .fa4b, .fa4d), each with a tree of up to ~40 MB under 64 MiB
      tmp=$(mktemp -d) && cat .fa4a/libs.part.00 .fa4b/libs.part.01 > "$tmp/libs.tar.xz" &&
        [ "$(sha256sum "$tmp/libs.tar.xz" | cut -d' ' -f1)" = "$(cat .fa4a/libs.sha256)" ] &&
        (cd "$tmp" && split -n 3 -d libs.tar.xz part.) && mkdir -p .fa4d &&
        mv "$tmp/part.00" .fa4a/libs.part.00 && mv "$tmp/part.01" .fa4b/libs.part.01 && mv "$tmp/part.02" .fa4d/libs.part.02
      rc=$?; rm -rf "$tmp"; [ $rc = 0 ] || { echo "split 3: re-cutting the bundle failed (rc $rc): run fa4-bundle.sh again"; exit 1; }
      grep -qx "/.fa4d/" .git/info/exclude 2>/dev/null || echo "/.fa4d/" >> .git/info/exclude
    fi
    du -sh .fa4?/ ;;
  start)
    if [ "${TUNE_FROM:-}" = packaged ]; then   # the sweep files the packaged table was merged from, in merge order
      # (resolved first, so a table that names none stops the start before the install and before $R is cleared)
      TUNE_FROM=$(PYTHONPATH=src python3 -c 'from attnkit.bench.tune import merged_from; print(*merged_from())' 2>/dev/null)
      [ -n "$TUNE_FROM" ] || { echo "TUNE_FROM=packaged: src/attnkit/data/selection/sm90.json names no sweep files" \
        "(provenance.files, written by tune --merge)"; exit 1; }
      for f in $TUNE_FROM; do [ -f "$f" ] || { echo "TUNE_FROM=packaged: $f is not in this tree"; exit 1; }; done
    fi
    if [ "${KEEP_TABLE:-0}" = 1 ]; then   # checked before the install, like TUNE_FROM: a refusal costs no minutes
      case " $ORDER " in *" tune "*|*" refresh "*)
        echo "KEEP_TABLE=1: ORDER has tune or refresh, which merge a table of their own over the kept one"; exit 1 ;; esac
      [ -s "$R/selection/sm90.json" ] || [ -s "$S/selection-kept/sm90.json" ] ||
        { echo "KEEP_TABLE=1: no earlier table on this machine ($R/selection/sm90.json)"; exit 1; }
    fi
    if [ -d .fa4c ]; then cp .fa4c/*.whl /root/fa4/ || exit 1; fi   # the small wheels, when `split` moved them
    OUT=$OUT bash tools/h200-runtime.sh install || exit 1
    # a warm machine's earlier run: not this one's, but for its sweep file, which this run resumes unless TUNE_FROM
    # names others (2026-12-06: a second start without TUNE_FROM began the sweep again and re-timed 25 done cases)
    # (TUNE_FROM=/dev/null starts the sweep afresh; a copy left by a start cut between the two moves is kept)
    if [ -n "${TUNE_FROM:-}" ]; then rm -f "$S/tune-earlier.jsonl"
    elif [ -s "$R/tune.jsonl" ]; then mv "$R/tune.jsonl" "$S/tune-earlier.jsonl"; fi
    # KEEP_TABLE=1: the earlier run's merged table (a refresh's or a sweep's $R/selection) stays in use, so this
    # run's phases time the runtime as it decides from it (2026-12-07: a rebench after a refresh, on the same warm
    # machine, had to copy it aside by hand; without it `start` clears $R and the packaged table decides); a copy
    # that a start cut between the two moves left in $S/selection-kept is the one kept
    if [ "${KEEP_TABLE:-0}" = 1 ]; then
      [ -s "$S/selection-kept/sm90.json" ] || mv "$R/selection" "$S/selection-kept" || exit 1
    else rm -rf "$S/selection-kept"; fi
    rm -rf "$S/src" "$R" && mkdir -p "$R" && cp -r src "$S/src"
    [ -s "$S/tune-earlier.jsonl" ] && mv "$S/tune-earlier.jsonl" "$R/tune.jsonl"
    [ -d "$S/selection-kept" ] && mv "$S/selection-kept" "$R/selection"
    : > "$R/phases.log"   # `wait` reads a machine without it as a bare one
    cp "$OUT/nvidia-smi.txt" "$R/" 2>/dev/null
    # TUNE_FROM=<an earlier session's tune .jsonl in the tree>: the timed sweep resumes it (752 cases do not fit
    # one session: 69 were timed in 450 s on 2026-12-02)
    # (several files, space-separated: joined; each keeps its header line, as --merge expects)
    # a file whose last line was cut by a kill ends without a newline: one is added, so the next file's header
    # does not join that line (--merge refuses files from another GPU architecture, driver or library versions; an H100 beside an H200 is one sm90)
    if [ -n "${TUNE_FROM:-}" ]; then
      : > "$R/tune.jsonl"
      for f in $TUNE_FROM; do cat "$f" >> "$R/tune.jsonl" || exit 1; [ -z "$(tail -c1 "$f")" ] || echo >> "$R/tune.jsonl"; done
    fi
    if [ -n "${ORACLE_RESUME:-}" ]; then cp "$ORACLE_RESUME" "$R/oracle-earlier.json" || exit 1; fi
    if [ -n "${REFRESH_FROM:-}" ]; then cp "$REFRESH_FROM" "$R/refresh-from.jsonl" || exit 1; fi
    setsid nohup bash "$0" job > "$R/job.log" 2>&1 < /dev/null &
    sleep 2; bash "$0" wait "${2:-480}" ;;
  job) job ;;
  wait)
    # no job here: a bare machine (the one that ran `start` went back 30 s after its last command ended; on
    # 2026-12-06 a `wait` issued 35 s late slept 330 s of device time on a fresh machine): say so at once
    if [ ! -f "$R/phases.log" ]; then echo "wait: no job on this machine ($R/phases.log missing: a fresh machine?" \
      "the one that ran 'start' goes back 30 s after a command ends; call 'wait' at once after 'start')"; exit 1; fi
    if [ "${REFRESH:-0}" = 1 ]; then rm -rf "$S/src.new" && cp -r src "$S/src.new" && rm -rf "$S/src" && mv "$S/src.new" "$S/src" && echo "src refreshed"; fi
    deadline=$(( $(date +%s) + ${2:-540} ))
    while ! grep -q DONE "$R/phases.log" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
    pack ;;
  *) echo "unknown step $step (aside | back | split | prep | stage | start | wait [S] | job)"; exit 2 ;;
esac
