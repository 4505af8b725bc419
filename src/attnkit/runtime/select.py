"""Choosing a backend: the priority order for the call (runtime/priority.py: per architecture and call
class, as data with its measurements), an explicit override, an autotune mode with an on-disk cache, and
memory of backends that failed at run time.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from attnkit.errors import first_line
from attnkit.runtime.backends import REGISTRY, Backend
from attnkit.runtime.call import AttentionCall
from attnkit.runtime.priority import order_for
from attnkit.runtime.probe import Probe
from attnkit.runtime.table import Decision

ENV_BACKEND = "ATTNKIT_BACKEND"
ENV_AUTOTUNE = "ATTNKIT_AUTOTUNE"


class NoBackendError(RuntimeError):
    """No backend can serve a call; the message lists every backend with its reasons."""


def priority_for(call: AttentionCall, probe: Probe) -> tuple[str, ...]:
    return decided_order(call, probe)[0]


def decided_order(call: AttentionCall, probe: Probe) -> tuple[tuple[str, ...], Decision]:
    """The order selection walks for `call`, and the measured table point or row that decided it."""
    cap = probe.capability(call.device_index) if call.device == "cuda" else None
    return graph_alibi_order(*order_for(call, cap), call)


def graph_alibi_order(order: tuple[str, ...], decision: Decision,
                      call: AttentionCall) -> tuple[tuple[str, ...], Decision]:
    """Rule 5 of runtime/table.py: in a torch.compile graph, a half-precision ALiBi call goes first to the backends
    that take the slopes (flex's score_mod, flash-attn 2), then to those that build a dense bias from them
    (Limits.alibi_bias: torch's SDPA kernels, xformers). The table and the rows rank them eagerly, where that bias is
    built once per slopes tensor and kept (layout.BiasCache); a graph cannot keep it and builds it on every call.
    Measured on an H100 (2026-12-07, tools/probe-alibi-graph.py,
    docs/results/2026-12-07-h100-alibi-graph-session29.json; 7 ALiBi shapes, D64 and D128, decode to training, 8
    passes, each in both timing modes): compiled, `sdpa` ran 1.035-3.15x its eager time and flex 0.92-1.10x, so flex
    was the faster of the two in a graph in 15 of the 16 columns (the few-query forward back to back: sdpa 3%
    faster), 5 of them among the 6 where `sdpa` was faster eagerly. A backend the deciding table point did not
    find correct (its own order, `Decision.point`, leaves out what failed or answered wrongly there: flex raised on a
    D64 decode point) is not moved. float32 keeps the order as measured (flex's float32 kernels are 20-500x slower from D128 up: the
    table's float32 points), and so does the CPU (unmeasured). Applied after the table or the rows (order_for), so
    `attnkit tune --cross-check` does not score it: the sweep times eager calls only."""
    if not (call.trace == "compile" and call.alibi and call.device == "cuda" and call.dtype in ("float16", "bfloat16")):
        return order, decision
    lim = {n: REGISTRY[n].first_limits() for n in order if n in REGISTRY}
    dense = [i for i, n in enumerate(order) if n in lim and lim[n].alibi_bias]
    if not dense:
        return order, decision
    trusted = set(decision.point) if decision.source == "table" else set(order)
    slopes = list(dict.fromkeys(n for n in order[dense[0]:] if n in lim and n in trusted
                                and lim[n].alibi and not lim[n].alibi_bias))
    if not slopes:
        return order, decision
    head = order[:dense[0]]
    moved = (*head, *slopes, *(n for n in order[dense[0]:] if n not in slopes))
    return moved, replace(decision, label=f"{decision.label}; in a graph, the ALiBi backends that take the slopes "
                                          "ahead of those that build a dense bias (rule 5)")


def explain(call: AttentionCall, probe: Probe, names: list[str] | None = None) -> dict[str, list[str]]:
    """name -> reasons it cannot serve `call` ([] = it can), for every backend (or `names`), in the order
    selection tries them for this call, then the backends it does not try."""
    if names is None:
        order = priority_for(call, probe)
        names = [*order, *(n for n in REGISTRY if n not in order)]
    return {n: REGISTRY[n].check(call, probe) for n in names}


def fell_back(fell: list[str]) -> str:
    """The verdict line of a pick that raised and was answered by the next candidate."""
    return f"the pick fell back ({'; '.join(fell)})"


def _format_all(call: AttentionCall, why: dict[str, list[str]], head: str) -> str:
    lines = [f"{head} ({call.describe()}):"]
    lines += [f"  {name}: {'; '.join(r) if r else 'ok'}" for name, r in why.items()]
    return "\n".join(lines)


def _cache_path() -> Path:
    from attnkit._io import cache_dir

    return cache_dir() / "autotune.json"


class Selector:
    """Per-process selection state. `attention()` uses the module-level SELECTOR."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.demoted: dict[tuple[Any, ...], set[str]] = {}  # bucket -> backends that failed at run time
        self.tuned: dict[str, str] = {}  # "<fingerprint>|<bucket>" -> backend name
        self._warned: set[tuple[str, str]] = set()
        # told whenever a decision may change: with the shape bucket it changed for, or None for all
        self._listeners: list[Callable[[tuple[Any, ...] | None], None]] = []
        self._watching = threading.local()  # this thread's open `fallbacks()` blocks (a demotion is the caller's)
        self._disk_loaded = False
        self.autotune = os.environ.get(ENV_AUTOTUNE, "") not in ("", "0")
        self.forced = os.environ.get(ENV_BACKEND) or None

    def reset(self) -> None:
        with self._lock:
            self.demoted.clear()
            self.tuned.clear()
            self._warned.clear()
            self._disk_loaded = False
            self.autotune = os.environ.get(ENV_AUTOTUNE, "") not in ("", "0")
            self.forced = os.environ.get(ENV_BACKEND) or None
        self.changed()

    def on_change(self, listener: Callable[[tuple[Any, ...] | None], None]) -> None:
        self._listeners.append(listener)

    def changed(self, bucket: tuple[Any, ...] | None = None) -> None:
        for listener in self._listeners:
            listener(bucket)

    # -- explicit choice -------------------------------------------------------------------------------
    def explicit(self, name: str, call: AttentionCall, probe: Probe, source: str) -> Backend:
        if name not in REGISTRY:
            raise ValueError(f"{source}: unknown backend {name!r}; known: {', '.join(REGISTRY)}")
        why = REGISTRY[name].check(call, probe)
        if why:
            raise NoBackendError(_format_all(call, {name: why}, f"{source}={name} cannot serve this call"))
        return REGISTRY[name]

    # -- the walk --------------------------------------------------------------------------------------
    def candidates(self, call: AttentionCall, probe: Probe) -> list[Backend]:
        demoted = self.demoted.get(call.bucket(), set())
        return [REGISTRY[n] for n in priority_for(call, probe)
                if n not in demoted and not REGISTRY[n].check(call, probe)]

    def select(self, call: AttentionCall, probe: Probe, backend: str | None = None,
               timer: Callable[[Backend], float] | None = None) -> Backend:
        if backend is not None:
            return self.explicit(backend, call, probe, "backend")
        if self.forced is not None:
            return self.explicit(self.forced, call, probe, ENV_BACKEND)
        found = self.candidates(call, probe)
        if not found:
            decided = decided_order(call, probe)[1].describe()
            raise NoBackendError(_format_all(call, explain(call, probe), "no attention backend can serve this call")
                                 + f"\n  (order decided by {decided})")
        if self.autotune and timer is not None and len(found) > 1:
            return self._autotuned(call, probe, found, timer)
        return found[0]

    # -- runtime fallback ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def fallbacks(self) -> Iterator[list[str]]:
        """The run-time fallbacks inside the block ("backend: Error: first line"), for checks whose verdict is
        about the pick (smoke, oracle): a right answer that a fallback gave hides that the pick raised."""
        seen: list[str] = []
        open_blocks: list[list[str]] = self._watching.__dict__.setdefault("blocks", [])
        open_blocks.append(seen)
        try:
            yield seen
        finally:
            open_blocks[:] = [b for b in open_blocks if b is not seen]  # by identity: nested blocks may be equal

    @contextlib.contextmanager
    def judged_pick(self) -> Iterator[list[str]]:
        """A check of the pick itself (a smoke row, an oracle case): from no demotions (an earlier check's fallback
        must not decide this one, and checks share shape buckets), with this block's fallbacks recorded."""
        self.reset()
        with self.fallbacks() as fell:
            yield fell

    def demote(self, backend: str, call: AttentionCall, exc: BaseException) -> None:
        with self._lock:
            self.demoted.setdefault(call.bucket(), set()).add(backend)
            for seen in self._watching.__dict__.get("blocks", ()):
                seen.append(f"{backend}: {type(exc).__name__}: {first_line(exc)}")
            key = (backend, type(exc).__name__)
            if key not in self._warned:
                self._warned.add(key)
                first = first_line(exc)
                warnings.warn(f"attnkit: backend {backend} failed at run time ({type(exc).__name__}: {first}); "
                              f"falling back for calls like {call.describe()}", RuntimeWarning, stacklevel=4)
        self.changed(call.bucket())  # only this bucket's bound calls are dropped

    # -- autotune --------------------------------------------------------------------------------------
    def _key(self, call: AttentionCall, probe: Probe) -> str:
        return f"{probe.fingerprint()}|{call.bucket()!r}"

    def _load_disk(self) -> None:
        if self._disk_loaded:
            return
        self._disk_loaded = True
        self.tuned.update(_read_cache(_cache_path()))

    def _save_disk(self) -> None:
        """Merge with what is on disk under a file lock, then write atomically: two processes tuning at once
        keep both sides' entries (a plain write loses the other writer's)."""
        import fcntl

        from attnkit._io import write_atomic

        path = _cache_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path.with_name(path.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                merged = {**_read_cache(path), **self.tuned}
                write_atomic(path, json.dumps(merged, indent=1, sort_keys=True))
            self.tuned.update(merged)
        except OSError as exc:
            warnings.warn(f"attnkit: cannot write autotune cache {path}: {exc}", RuntimeWarning, stacklevel=2)

    def _autotuned(self, call: AttentionCall, probe: Probe, found: list[Backend],
                   timer: Callable[[Backend], float]) -> Backend:
        with self._lock:
            self._load_disk()
            key = self._key(call, probe)
            name = self.tuned.get(key)
            if name is not None and any(b.name == name for b in found):
                return REGISTRY[name]
            times: dict[str, float] = {}
            for b in found:
                try:
                    times[b.name] = timer(b)
                except Exception:  # a candidate that fails while timing is simply not chosen
                    continue
            if not times:
                return found[0]
            best = min(times, key=lambda n: times[n])
            self.tuned[key] = best
            self._save_disk()
            return REGISTRY[best]


def _read_cache(path: Path) -> dict[str, str]:
    """The autotune table on disk; anything unreadable (missing, not JSON, nested absurdly deep) counts as empty."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


SELECTOR = Selector()


def select(call: AttentionCall, probe: Probe | None = None, backend: str | None = None) -> Backend:
    """The backend attnkit would use for `call` (no autotuning: that needs real tensors)."""
    from attnkit.runtime.probe import probe as _probe

    return SELECTOR.select(call, probe or _probe(), backend)
