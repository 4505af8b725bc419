"""Selection from measurement: the table lookup (runtime/table.py), the sweep that writes tables
(bench/tune.py, run for real on this CPU), the flex backend's limits and numerics, and the dense-bias cache."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import re
import subprocess
import sys
import warnings
from dataclasses import replace
from importlib import resources
from pathlib import Path

import pytest
import torch
from test_selection import call, fake_probe

from attnkit.bench import tune
from attnkit.errors import UsageError
from attnkit.runtime import layout, loaders, priority, table
from attnkit.runtime import select as sel
from attnkit.runtime.attention import attention
from attnkit.runtime.backends import REGISTRY
from attnkit.runtime.backends import flex as flex_mod
from attnkit.runtime.reference import reference_attention


def _table(cells: dict, arch: str = "sm90") -> dict:
    return table.validate({"schema": table.SCHEMA, "arch": arch, "cells": cells, "provenance": {}}, "test")


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """A folder of tables used instead of the packaged ones ($ATTNKIT_SELECTION_DIR)."""
    monkeypatch.setenv(table.ENV_TABLES, str(tmp_path))
    table.load.cache_clear()
    yield tmp_path
    table.load.cache_clear()


def write(folder: Path, data: dict, arch: str = "sm90") -> None:
    (folder / f"{arch}.json").write_text(json.dumps(data))
    table.load.cache_clear()


def pt(hd: int, w: float, *order: str) -> dict:
    return {"head_dim": hd, "log2_work": w, "order": list(order)}


# -- the lookup rule ----------------------------------------------------------------------------------------------

def test_cell_key_names_every_categorical_feature():
    c = call(kv_heads=4, alibi=True)
    assert table.cell_of(c) == "fwdbwd|bfloat16|causal|gqa|equal|-|-|alibi|no"
    assert table.cell_of(replace(c, seqlen_q=1, requires_grad=False, causal=False, kv_heads=1, alibi=False,
                                 window=(64, 0))) == "fwd|bfloat16|full|mqa|decode|window|-|-|no"
    assert table.query_shape(4, 4096) == "few" and table.query_shape(512, 4096) == "chunk"
    assert table.query_shape(4096, 512) == "more"
    short = replace(c, varlen=True, lengths_q=(10, 50), lengths_k=(10, 50))
    assert table.varlen_class(short) == "short"
    assert table.varlen_class(replace(short, lengths_q=(4000, 3000))) == "long"


def test_nearest_point_by_the_larger_normalised_distance_with_ties_to_the_larger():
    pts = [pt(64, 30, "a"), pt(128, 30, "b"), pt(128, 36, "c"), pt(256, 36, "d")]
    assert table.nearest(pts, 96, 30)["order"] == ["b"]  # log2: 96 is nearer 128 than 64
    assert table.nearest(pts, 100, 40)["order"] == ["c"]  # work 4 octaves off (1.33) beats 10 off (3.33)
    # 88: a's head dim is nearer (0.46 octave), but its work is 10 octaves off; c's head dim is 0.54 octave off
    # and its work 4: the larger of the two normalised distances decides (rule 2), so c
    assert table.nearest(pts, 88, 40)["order"] == ["c"]
    assert table.distance(pts[2], 88, 40) == pytest.approx(4 / table.RULE.far_log2)
    # b, c and d are all 3 octaves off in work; d is also off in head dim (the larger sum), b and c tie: the larger
    # work
    assert table.nearest(pts, 128, 33)["order"] == ["c"]
    # a tie (with head dims counted alike both ways): the larger head dim
    symmetric = table.Rule(head_dim_up=1.0)
    assert table.nearest([pt(64, 36, "a"), pt(256, 36, "d")], 128, 36, symmetric)["order"] == ["d"]
    assert table.distance(pt(256, 36, "a"), 128, 36) == 1.0  # an octave of head dim above the call is still near
    assert table.distance(pt(64, 36, "a"), 128, 36) == table.RULE.head_dim_up > 1.0  # an octave below it is far
    assert table.distance(pt(128, 36, "a"), 128, 36 + table.RULE.far_log2 + 0.1) > 1.0


def scored(hd: int, w: float, **scores: float) -> dict:
    """A point as `tune --merge` writes it: its order, and each backend's mean worse-mode ratio to the fastest."""
    return {"head_dim": hd, "log2_work": w, "order": sorted(scores, key=scores.get), "scores": scores}


def test_blend_lets_the_near_points_of_the_deciding_cell_vote_and_the_sibling_dtype_with_them():
    """Rule.blend: one point's order is one measurement (its near tie can be noise); the cell's near points vote,
    each by the log of its scores, weighted by nearness. Chosen by leave-one-out over the sweep's own cases
    (docs/results/2026-12-05-dev-tune-cross-check-blend.json), never by the validation shapes."""
    key = "fwd|bfloat16|causal|mha|equal|-|-|-|no"
    c = call(causal=True, requires_grad=False, seqlen_q=4096, seqlen_k=4096, heads=16, kv_heads=16, head_dim=128)
    w = table.log2_work(c)
    nearest = scored(128, round(w), a=1.0, b=1.02)  # a wins here by 2%
    near = scored(128, round(w) + 1, a=1.6, b=1.0)  # b by 60%, one octave of work away
    far = scored(128, round(w) + 9, a=1.0, b=9.0)  # too far to vote
    plain, blended = table.Rule(blend=0.0), table.Rule(blend_sibling=False)
    t = _table({key: [nearest, near, far]})
    assert table.decide(c, t, plain).order == ("a", "b")
    d = table.decide(c, t, blended)
    assert d.order == ("b", "a") and not d.far and "blended with 1 more near point" in d.label
    # a backend a near point did not score counts BLEND_MISSING there; one no point scored keeps the nearest's order
    t = _table({key: [scored(128, round(w), a=1.0, b=1.05) | {"order": ["a", "b", "c"]},
                      scored(128, round(w) + 1, a=1.1)]})
    assert table.decide(c, t, blended).order == ("a", "b", "c")
    # points without scores (a table from before scores were written): the nearest point alone, as before
    t = _table({key: [pt(128, round(w), "a", "b"), pt(128, round(w) + 1, "b", "a")]})
    assert table.decide(c, t, blended).order == ("a", "b")
    # blend_sibling: the float16 twin's near points vote with the bfloat16 cell's
    twin = key.replace("bfloat16", "float16")
    t = _table({key: [nearest], twin: [near]})
    assert table.decide(c, t, blended).order == ("a", "b")
    assert table.decide(c, t, table.RULE).order == ("b", "a")
    with pytest.raises(ValueError, match="blend must be >= 0"):
        table.Rule(blend=-1.0)


def test_the_sequence_length_tells_apart_points_of_one_work_and_head_dim():
    """Rule.far_seqlen_log2 (since 2026-12-06): at one work and head dim, a few long sequences and many short ones are
    different calls: on the H100 FA4 won B1 S4096's causal forward and cuDNN B16 S1024's
    (docs/results/2026-12-06-h100-tune-session17-wide-23-cases.jsonl). Chosen by leave-one-out over the sweep's own
    cases (docs/results/2026-12-06-dev-tune-cross-check-702-cases-session17.json), not by the validation shapes."""
    key = "fwd|bfloat16|causal|mha|equal|-|-|-|no"
    long_seq = scored(64, 34, flash_attn4=1.0, sdpa=1.6) | {"log2_seqlen": 13.0}  # B1 H4 S8192
    short_seq = scored(64, 34, flash_attn4=1.3, sdpa=1.0) | {"log2_seqlen": 10.0}  # B16 H16 S1024
    gpt2 = call(causal=True, requires_grad=False, batch=8, seqlen_q=1000, seqlen_k=1000, heads=16, kv_heads=16,
                head_dim=64, head_dim_v=64)
    assert table.log2_seqlen(gpt2) == pytest.approx(9.966, abs=1e-3)
    t = _table({key: [long_seq, short_seq]})
    d = table.decide(gpt2, t)
    # S8192 is more than 8x the call's S1000: that point is far and does not vote
    assert not d.far and d.order[0] == "sdpa" and "log2(seqlen)=10" in d.label and "blended" not in d.label
    assert table.distance(long_seq, 64, table.log2_work(gpt2), table.RULE, table.log2_seqlen(gpt2)) > 1.0
    long_call = replace(gpt2, batch=1, seqlen_q=8192, seqlen_k=8192, heads=4, kv_heads=4)
    d = table.decide(long_call, t)
    assert not d.far and d.order[0] == "flash_attn4" and "log2(seqlen)=13" in d.label
    # without the third distance both points are as near, and they vote alike: FA4's 1.6x win outweighs its 1.3x loss
    unsized = table.Rule(far_seqlen_log2=0.0)
    d = table.decide(gpt2, t, unsized)
    assert not d.far and d.order[0] == "flash_attn4" and "blended with 1 more" in d.label and "seqlen" not in d.label
    # that rule's tie between the two goes to the nearer sequence length, whichever comes first in the table
    for pts in ([long_seq, short_seq], [short_seq, long_seq]):
        assert table.nearest(pts, 64, 34.0, unsized, 9.97) is short_seq
    # points written before 2026-12-06 carry no sequence length: the distance leaves it out
    old = {k: v for k, v in short_seq.items() if k != "log2_seqlen"}
    assert table.distance(old, 64, 34, table.RULE, 3.0) == table.distance(old, 64, 34, unsized)
    assert table.distance(short_seq, 64, 34, table.RULE, 10.0 + 2 * table.RULE.far_seqlen_log2) == 2.0
    # packed calls: the mean keys per sequence
    packed = replace(gpt2, varlen=True, lengths_q=(100, 300), lengths_k=(100, 300))
    assert table.log2_seqlen(packed) == pytest.approx(math.log2(200))
    for bad in (-1.0, "10", True, 64, None):
        with pytest.raises(table.TableError, match="log2_seqlen must be a number in"):
            _table({key: [short_seq | {"log2_seqlen": bad}]})
    with pytest.raises(ValueError, match="far_seqlen_log2 must be >= 0"):
        table.Rule(far_seqlen_log2=-1.0)


def test_the_blend_weighs_a_point_off_in_two_features_less_than_one_off_in_one():
    """Rule.blend_distance "sum" (since 2026-12-06): a point off in work and in sequence length votes less than the
    point at the call's own sequence length. With the largest offset, a D64 causal forward at 2^36 and S1024 went to
    FA4 on the votes of points at 4x longer sequences, where cuDNN was 1.3x faster at its own (the H100 bench:
    docs/results/2026-12-06-h100-bench-5-small-shapes-702-case-table-session18.json). Chosen by leave-one-out over
    the sweep's own cases (docs/results/2026-12-06-dev-tune-cross-check-702-cases-blend-sum.json)."""
    key = "fwd|bfloat16|causal|mha|equal|-|-|-|no"
    own_seqlen = scored(64, 35, sdpa_cudnn=1.0, flash_attn4=1.3) | {"log2_seqlen": 10.0}  # work off by 0.5
    longer = scored(64, 37, sdpa_cudnn=1.6, flash_attn4=1.0) | {"log2_seqlen": 12.0}  # work 0.5 and seqlen 0.67 off
    c = call(causal=True, requires_grad=False, batch=32, seqlen_q=1024, seqlen_k=1024, heads=32, kv_heads=32,
             head_dim=64, head_dim_v=64)
    assert (table.log2_work(c), table.log2_seqlen(c)) == (36.0, 10.0)
    t = _table({key: [own_seqlen, longer]})
    by_max = table.decide(c, t, replace(table.RULE, blend_distance="max"))
    assert by_max.order[0] == "flash_attn4" and "blended with 1 more" in by_max.label
    by_sum = table.decide(c, t)
    assert by_sum.order[0] == "sdpa_cudnn" and "blended with 1 more" in by_sum.label
    # a point off in one feature only weighs the same by either distance; beside the other two it leaves the
    # outcome to how the point off in two features is weighed: FA4 by the largest, cuDNN by the sum
    level = scored(64, 36, sdpa_cudnn=1.0, flash_attn4=1.1) | {"log2_seqlen": 12.0}  # seqlen 0.67 off, work exact
    assert table._blend_distance(level, 64, 36.0, table.RULE, 10.0) == table.distance(level, 64, 36.0, table.RULE, 10.0)
    t = _table({key: [own_seqlen, longer, level]})
    assert table.decide(c, t, replace(table.RULE, blend_distance="max")).order[0] == "flash_attn4"
    d = table.decide(c, t)
    assert d.order[0] == "sdpa_cudnn" and "blended with 2 more" in d.label
    # which points are near stays rule 2's (the largest offset): a point 0.5 and 0.67 off in two features votes
    assert table.distance(longer, 64, 36.0, table.RULE, 10.0) <= 1.0 < sum(
        table._offsets(longer, 64, 36.0, table.RULE, 10.0))
    with pytest.raises(ValueError, match="blend_distance must be 'max' or 'sum'"):
        table.Rule(blend_distance="mean")


def test_a_point_below_the_calls_head_dim_counts_farther_than_one_above():
    """Kernels pad a head dim up: a cliff lies above a measured head dim (flex float32, 0.98 ms at D64 and 33 ms at
    D128 in one decode cell of the sweep), so a point below the call stands for it less well than one above."""
    below, above = pt(64, 30, "flex"), pt(128, 30, "sdpa_efficient")
    symmetric = table.Rule(head_dim_up=1.0)
    # 88 is 0.46 octave above 64 and 0.54 below 128: counted alike, the point below is nearer; counted 1.5x (0.69),
    # the point above; 72 (0.17 above 64, x1.5: 0.25; 0.83 below 128) still takes the point below
    assert table.nearest([below, above], 88, 30, symmetric)["order"] == ["flex"]
    assert table.nearest([below, above], 88, 30)["order"] == ["sdpa_efficient"]
    assert table.nearest([below, above], 72, 30)["order"] == ["flex"]
    assert table.distance(below, 128, 30, symmetric) == 1.0 < table.distance(below, 128, 30)
    assert table.distance(above, 128, 30, symmetric) == table.distance(above, 128, 30)
    with pytest.raises(ValueError, match="head_dim_up must be >= 1"):
        table.Rule(head_dim_up=0.5)


def test_the_rows_read_off_half_precision_runs_hold_for_half_precision_only():
    """Their sources measured bf16 and fp16. In float32 the sweep has flex 3-500x slower than SDPA's kernels from
    D128 up, and flex is what the default order offers next where SDPA cannot run (a decode at 2^35 work)."""
    cases = {"ALiBi": call(alibi=True), "ALiBi forward": call(alibi=True, requires_grad=False),
             "decode": call(seqlen_q=1, causal=False, requires_grad=False),
             "small": call(seqlen_q=64, seqlen_k=64, batch=1)}
    for label, c in cases.items():
        for dtype in ("bfloat16", "float16"):
            order, d = priority.rows_order(replace(c, dtype=dtype), (9, 0))
            assert d.source == "row" and d.label.startswith(label) and order[0] != "sdpa_efficient", (label, dtype, d)
        order, d = priority.rows_order(replace(c, dtype="float32"), (9, 0))
        assert d.label == "float32" and order[:2] == ("sdpa_efficient", "sdpa"), (label, d)


def test_a_half_precision_call_takes_its_siblings_cell_where_its_own_has_no_near_point(tables):
    c = call()  # bfloat16
    own, sib = table.cell_of(c), table.cell_of(replace(c, dtype="float16"))
    assert table.sibling(own) == sib and table.sibling(sib) == own
    assert table.sibling(table.cell_of(replace(c, dtype="float32"))) is None
    w = table.log2_work(c)
    write(tables, _table({sib: [pt(128, w, "sdpa_flash")]}))  # measured in float16 only
    order, d = priority.order_for(c, (9, 0))
    assert d.source == "table" and order[0] == "sdpa_flash" and "float16" in d.label
    # its own cell decides where it has a near point; a far own point gives way to a near sibling point
    write(tables, _table({own: [pt(128, w, "sdpa_cudnn")], sib: [pt(128, w, "sdpa_flash")]}))
    assert priority.order_for(c, (9, 0))[0][0] == "sdpa_cudnn"
    write(tables, _table({own: [pt(128, w + 5, "sdpa_cudnn")], sib: [pt(128, w, "sdpa_flash")]}))
    assert priority.order_for(c, (9, 0))[0][0] == "sdpa_flash"
    # float32 has no sibling: a float16 table cell never decides it
    c32 = replace(c, dtype="float32")
    write(tables, _table({table.cell_of(replace(c32, dtype="float16")): [pt(128, w, "sdpa_flash")]}))
    assert priority.order_for(c32, (9, 0))[1].source != "table"


def test_where_no_dtype_sibling_is_near_the_same_cell_with_other_kv_sharing_decides(tables):
    c = call(kv_heads=4)  # gqa, bfloat16
    key = table.cell_of(c)
    mqa, mha = (key.replace("|gqa|", f"|{kv}|") for kv in ("mqa", "mha"))
    # the call's own dtype first (the other kv sharing, nearest first), then the sibling dtype of each (Rule.relax)
    assert table.neighbours(key)[:6] == [key, mqa, mha, table.sibling(key), table.sibling(mqa), table.sibling(mha)]
    assert table.neighbours(table.cell_of(replace(c, dtype="float32")))[1].split("|")[3] == "mqa"  # no sibling
    w = table.log2_work(c)
    write(tables, _table({mha: [pt(128, w, "sdpa_flash")], mqa: [pt(128, w + 5, "sdpa_cudnn")]}))
    order, d = priority.order_for(c, (9, 0))
    assert d.source == "table" and order[0] == "sdpa_flash" and "|mha|" in d.label  # the far mqa point does not
    write(tables, _table({mha: [pt(128, w, "sdpa_flash")], mqa: [pt(128, w, "sdpa_cudnn")]}))
    assert priority.order_for(c, (9, 0))[0][0] == "sdpa_cudnn"  # the nearer kv sharing first
    write(tables, _table({mha: [pt(128, w, "sdpa_flash")], key: [pt(128, w, "sdpa_efficient")]}))
    assert priority.order_for(c, (9, 0))[0][0] == "sdpa_efficient"  # the call's own cell first
    write(tables, _table({mha: [pt(128, w + 5, "sdpa_flash")]}))  # only far points: the rows decide
    assert priority.order_for(c, (9, 0))[1].source != "table"


def test_table_decides_where_it_has_the_cell_and_never_hides_a_backend(tables):
    c = call()
    write(tables, _table({table.cell_of(c): [pt(128, table.log2_work(c), "sdpa_flash", "sdpa_cudnn")]}))
    order, d = priority.order_for(c, (9, 0))
    assert d.source == "table" and order[:2] == ("sdpa_flash", "sdpa_cudnn") and "D128" in d.describe()
    assert sorted(order) == sorted(priority.default_order(c, (9, 0)))
    p = fake_probe((9, 0))
    assert sel.SELECTOR.select(c, p).name == "sdpa_flash"
    # a backend the table ranks first but this machine lacks: the next one, then the default order
    write(tables, _table({table.cell_of(c): [pt(128, 37.0, "flash_attn4", "sdpa_efficient")]}))
    assert sel.SELECTOR.select(c, p).name == "sdpa_efficient"
    # a call of another cell: the hand-written rows decide
    other = replace(c, window=(512, 0))
    assert priority.order_for(other, (9, 0))[1] == priority.order_for(other, (9, 0))[1]
    assert priority.order_for(other, (9, 0))[1].source == "row"


def test_forced_backend_beats_the_table(tables, monkeypatch):
    c = call()
    write(tables, _table({table.cell_of(c): [pt(128, 37.0, "sdpa_flash")]}))
    p = fake_probe((9, 0))
    assert sel.SELECTOR.select(c, p, backend="sdpa_efficient").name == "sdpa_efficient"
    monkeypatch.setattr(sel.SELECTOR, "forced", "sdpa_math")
    assert sel.SELECTOR.select(c, p).name == "sdpa_math"


def test_no_table_for_the_architecture_falls_back_to_the_rows(tables):
    c = call()
    write(tables, _table({table.cell_of(c): [pt(128, 37.0, "sdpa_flash")]}, arch="sm80"), arch="sm80")
    order, d = priority.order_for(c, (9, 0))
    assert d.source in ("row", "default") and order == priority.order_for(c, (9, 0))[0]
    assert priority.order_for(c, (8, 0))[1].source == "table"


def test_a_far_point_does_not_decide(tables):
    c = call()
    rows = priority.order_for(c, (9, 0))
    assert rows[1].source != "table"
    for far in (pt(128, table.log2_work(c) - 2.5, "sdpa_flash"),  # 5.7x less work
                pt(32, table.log2_work(c), "sdpa_flash")):  # the same work, a head dim 4x smaller
        write(tables, _table({table.cell_of(c): [far]}))
        d = table.decide(c, table.table_for((9, 0)))
        assert d is not None and d.far and "too far from the call to decide" in d.describe()
        order, decided = priority.order_for(c, (9, 0))
        assert order == rows[0] and decided.source == rows[1].source  # the rows decide, as with no table
        assert "is far from this call" in decided.describe()
    # within 4x of work (RULE.far_log2) and one octave of head dim above the call's: the point decides (one below
    # counts RULE.head_dim_up times as far)
    write(tables, _table({table.cell_of(c): [pt(256, table.log2_work(c) - 1.9, "sdpa_flash")]}))
    order, decided = priority.order_for(c, (9, 0))
    assert decided.source == "table" and order[0] == "sdpa_flash"


@pytest.mark.parametrize("bad, msg", [
    ({"schema": 99, "cells": {}}, "not an attnkit selection table"),
    ({"schema": 1, "cells": []}, "'cells' must map"),
    ({"schema": 1, "cells": {"x": []}}, "cell 'x' has no points"),
    ({"schema": 1, "cells": {"x": [{"head_dim": "64", "log2_work": 3, "order": ["a"]}]}}, "each point needs"),
    ({"schema": 1, "cells": {"x": [{"head_dim": 64, "log2_work": 3, "order": ["a"], "scores": {"a": "1"}}]}},
     "scores must map backend names to ratios >= 1"),
    ({"schema": 1, "cells": {"x": [{"head_dim": 64, "log2_work": 3, "order": ["a"], "scores": {"a": 0.5}}]}},
     "scores must map"),
])
def test_a_bad_table_is_one_line_naming_the_file(tables, bad, msg):
    write(tables, bad)
    with pytest.raises(table.TableError, match=msg) as ei:
        priority.order_for(call(), (9, 0))
    assert str(tables / "sm90.json") in str(ei.value) and "\n" not in str(ei.value)


def test_no_backend_error_says_what_decided(tables):
    p = fake_probe((9, 0))
    with pytest.raises(sel.NoBackendError, match=r"order decided by default: mps order"):
        sel.SELECTOR.select(call(dtype="float64", device="mps"), p)


# -- the flex backend ----------------------------------------------------------------------------------------------

def test_flex_flash_is_off_unless_opted_in(monkeypatch):
    flash = REGISTRY["flex_flash"]
    ok = fake_probe((9, 0), ("flash-attn-4",))
    monkeypatch.delenv("ATTNKIT_EXPERIMENTAL_FLEX_FLASH", raising=False)
    assert flash.check(call(alibi=True), ok) == [flex_mod.FLASH_BROKEN]
    assert "ATTNKIT_EXPERIMENTAL_FLEX_FLASH=1" in flex_mod.FLASH_BROKEN
    monkeypatch.setenv("ATTNKIT_EXPERIMENTAL_FLEX_FLASH", "1")
    assert flash.check(call(alibi=True), ok) == []
    # selection never reaches it by default: ALiBi, forward or training, goes to flex's Triton kernels
    monkeypatch.delenv("ATTNKIT_EXPERIMENTAL_FLEX_FLASH")
    assert sel.SELECTOR.select(call(alibi=True, requires_grad=False), ok).name == "flex"


def test_the_race_calls_flex_flash_without_the_opt_in_and_only_where_it_can_run(monkeypatch):
    """The bench and --validate race torch's flex on its FLASH backend (FA4's kernels with the score_mod compiled
    in) as a library call: the opt-in guards attention()'s picks, not a measurement, which records errors itself."""
    from attnkit.bench.candidates import LIBRARIES, _library_reasons

    monkeypatch.delenv("ATTNKIT_EXPERIMENTAL_FLEX_FLASH", raising=False)
    ok = fake_probe((9, 0), ("flash-attn-4",))
    assert "flex_flash" in LIBRARIES and REGISTRY["flex_flash"].check(call(alibi=True), ok) == [flex_mod.FLASH_BROKEN]
    assert _library_reasons("flex_flash", call(alibi=True), ok) == []
    assert _library_reasons("flex_flash", call(alibi=True), fake_probe((9, 0))) == ["flash-attn-4 is not installed"]
    assert "has kernels for compute capability 9.0-10.3" in "; ".join(
        _library_reasons("flex_flash", call(alibi=True), fake_probe((8, 0), ("flash-attn-4",))))
    assert "no dropout support" in _library_reasons("flex_flash", call(dropout=True), ok)
    # FA4 that does not load is said as such, opted in or not, and the race leaves the call out
    monkeypatch.setitem(loaders.FA4_STATE, "error", "flash_attn.cute does not import: undefined symbol")
    assert _library_reasons("flex_flash", call(alibi=True), ok) == ["flash_attn.cute does not import: undefined symbol"]
    monkeypatch.setenv("ATTNKIT_EXPERIMENTAL_FLEX_FLASH", "1")
    assert REGISTRY["flex_flash"].check(call(alibi=True), ok) == ["flash_attn.cute does not import: undefined symbol"]
    monkeypatch.delenv("ATTNKIT_EXPERIMENTAL_FLEX_FLASH")
    monkeypatch.delitem(loaders.FA4_STATE, "error")
    old = replace(ok, torch=replace(ok.torch, version="2.10.0"))
    assert "needs torch >= 2.11" in _library_reasons("flex_flash", call(), old)[0]
    assert _library_reasons("flex", call(alibi=True), ok) == REGISTRY["flex"].check(call(alibi=True), ok) == []


def test_flex_compiles_one_entry_point_per_signature():
    """dynamo keeps 8 graphs per code object; each signature's entry point has its own, and computes flex."""
    from torch.nn.attention.flex_attention import flex_attention

    a, b = flex_mod._compiled(("test", 1)), flex_mod._compiled(("test", 2))
    assert a is flex_mod._compiled(("test", 1)) and a is not b
    codes = {f._torchdynamo_orig_callable.__code__ for f in (a, b)}
    assert len(codes) == 2 and flex_mod._entry.__code__ not in codes
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))

    def alibi(score, b, h, i, j):
        return score - 0.25 * (i - j).abs()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # flex's eager path warns that it is not compiled: known
        want = flex_attention(q, k, v, score_mod=alibi)
    assert torch.allclose(a(q, k, v, None, {"score_mod": alibi}), want, atol=1e-5)


def test_flex_new_key_lengths_do_not_multiply_graphs():
    """A new key length must not be a new graph: the mods close over the causal offset (Sk - Sq) and the window,
    and had dynamo specialised on them, every length would compile again until, past the recompile limit, flex
    ran uncompiled. Automatic dynamic shapes keep it at two graphs (the first length static, then dynamic)."""
    from torch._dynamo.utils import counters

    from attnkit.runtime.call import Inputs

    entry = flex_mod._compiled(("test-offsets",))
    counters.clear()
    q = torch.randn(1, 20, 2, 16)
    for sk in range(40, 52):
        k = v = torch.randn(1, sk, 2, 16)
        call, p = Inputs(q, k, v, causal=True, window=(8, 0), alibi_slopes=torch.rand(2)).prepare()
        _, score_mod, _, _ = flex_mod.mask_and_score(call, p, q.device)
        entry(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, {"score_mod": score_mod})
    assert counters["stats"]["unique_graphs"] <= 2


def test_flex_compiles_its_first_sizes_each_for_itself_then_shares_one_dynamic_entry(monkeypatch):
    """flex in a dynamic graph ran 1.3-1.8x slower with ALiBi (H100, 2026-12-07): a signature's first
    STATIC_SIZES sizes get an entry point each, compiled with dynamic=False; later sizes and packed calls (None)
    share the signature's one entry, which torch.compile's default makes dynamic at its second size."""
    import torch

    made: list[tuple[str, object]] = []
    real = torch.compile

    def compile_(fn, **kw):
        made.append((fn.__name__, kw.get("dynamic", "unset")))
        return real(fn, **kw)

    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(flex_mod, "_STATIC", {"sizes": 2})
    sig = ("test-static", len(flex_mod._SIGNATURES))
    a = flex_mod.entry_point(sig, ((1, 2), (3, 4)))
    assert flex_mod.entry_point(sig, ((1, 2), (3, 4))) is a  # the same size: its own entry again
    b = flex_mod.entry_point(sig, ((5, 6), (7, 8)))
    shared = flex_mod.entry_point(sig, ((9, 9), (9, 9)))  # past 2 sizes
    assert len({id(a), id(b), id(shared)}) == 3
    assert flex_mod.entry_point(sig, ((10, 10), (10, 10))) is shared and flex_mod.entry_point(sig, None) is shared
    assert flex_mod.entry_point(sig, ((1, 2), (3, 4))) is a  # a size seen early keeps its own kernel
    assert [d for _, d in made] == [False, False, None]
    assert flex_mod.entry_point(("test-packed", len(flex_mod._SIGNATURES)), None) is not shared


def test_the_bench_and_the_sweep_compile_every_size_for_itself(monkeypatch):
    monkeypatch.setattr(flex_mod, "_STATIC", {"sizes": flex_mod.STATIC_SIZES})
    flex_mod.for_measurement(64)
    assert flex_mod._STATIC["sizes"] == 64
    sig = ("test-measured", len(flex_mod._SIGNATURES))
    entries = {id(flex_mod.entry_point(sig, ((n,), (n,)))) for n in range(flex_mod.STATIC_SIZES + 3)}
    assert len(entries) == flex_mod.STATIC_SIZES + 3


def test_a_static_flex_entry_computes_flex_at_its_size():
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = (torch.randn(1, 2, n, 16) for n in (24, 40, 40))
    entry = flex_mod.entry_point(("test-static-run", len(flex_mod._SIGNATURES)), (q.shape, k.shape, v.shape))

    def alibi(score, b, h, i, j):
        return score - 0.25 * (i + 16 - j).abs()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # flex's eager path warns that it is not compiled: known
        want = flex_attention(q, k, v, score_mod=alibi)
    counters.clear()
    for _ in range(2):
        got = entry(q, k, v, None, {"score_mod": alibi})
    assert torch.allclose(got, want, atol=1e-5) and counters["stats"]["unique_graphs"] == 1


def test_flex_limits_as_data(monkeypatch):
    monkeypatch.setenv("ATTNKIT_EXPERIMENTAL_FLEX_FLASH", "1")
    flex, flash = REGISTRY["flex"], REGISTRY["flex_flash"]
    ok = fake_probe((9, 0), ("flash-attn-4",))
    assert flex.check(call(alibi=True), ok) == [] and flash.check(call(alibi=True), ok) == []
    assert flex.check(call(softcap=True, window=(256, 0)), ok) == []
    assert "needs compute capability >= 8.0" in "; ".join(flex.check(call(), fake_probe((7, 5))))
    assert "has kernels for compute capability 9.0-10.3" in "; ".join(flash.check(call(), fake_probe((12, 0),
                                                                                                     ("flash-attn-4",))))
    assert flash.check(call(), fake_probe((9, 0))) == ["flash-attn-4 is not installed"]
    old = fake_probe((9, 0), ("flash-attn-4",))
    old = replace(old, torch=replace(old.torch, version="2.4.1"))
    assert "needs torch >= 2.5" in flex.check(call(), old)[0]
    assert "needs torch >= 2.11" in flash.check(call(), replace(old, torch=replace(old.torch, version="2.10.0")))[0]
    assert "no dropout support" in flex.check(call(dropout=True), ok)
    assert "no attn_bias support" in flex.check(call(bias=True), ok)
    cpu = call(device="cpu")
    assert any("no backward on CPU" in r for r in flex.check(cpu, fake_probe(None)))
    assert flex.check(replace(cpu, requires_grad=False), fake_probe(None)) == []


def test_flex_alibi_rows_are_measured_rows_with_sources():
    p = fake_probe((9, 0), ("flash-attn-4",))
    assert sel.SELECTOR.select(call(alibi=True), p).name == "flex"
    assert sel.SELECTOR.select(call(alibi=True, requires_grad=False), p).name == "flex"
    assert sel.SELECTOR.select(call(softcap=True), fake_probe((9, 0))).name == "flex"  # not eager math


def _packed(lens):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return cu, max(lens)


@pytest.mark.parametrize("kw", [
    {"causal": True}, {"causal": True, "alibi": True}, {"window": (7, 3), "softcap": 5.0},
    {"causal": True, "sq": 20, "sk": 50, "alibi": True}, {"causal": True, "sq": 50, "sk": 20},
    {"alibi_batch": True, "sq": 30, "sk": 40},
    # one-sided windows, and one unbounded on both sides (no mask at all)
    {"window": (-1, 4)}, {"window": (5, -1), "alibi": True}, {"window": (-1, -1), "sq": 20, "sk": 50},
])
def test_flex_matches_the_reference_on_cpu(kw):
    torch.manual_seed(0)
    kw = dict(kw)
    sq, sk = kw.pop("sq", 48), kw.pop("sk", 48)
    q, k, v = torch.randn(2, sq, 4, 24), torch.randn(2, sk, 2, 24), torch.randn(2, sk, 2, 24)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = torch.rand(4)
    if kw.pop("alibi_batch", False):
        kw["alibi_slopes"] = torch.rand(2, 4)
    out = attention(q, k, v, backend="flex", **kw)
    assert (out - reference_attention(q, k, v, **kw)).abs().max() < 1e-5


@pytest.mark.parametrize("kw", [{"causal": True}, {"causal": True, "alibi_slopes": torch.rand(4)},
                                {"window": (3, 2), "alibi_slopes": torch.rand(4, 4)},
                                {}])  # the document term alone
def test_flex_packed_varlen_is_a_document_mask(kw):
    torch.manual_seed(1)
    lq, lk = [5, 0, 17, 9], [8, 3, 17, 4]  # cross lengths, an empty sequence
    (cq, mq), (ck, mk) = _packed(lq), _packed(lk)
    q, k, v = torch.randn(sum(lq), 4, 16), torch.randn(sum(lk), 2, 16), torch.randn(sum(lk), 2, 16)
    args = {"cu_seqlens_q": cq, "cu_seqlens_k": ck, "max_seqlen_q": mq, "max_seqlen_k": mk, **kw}
    out = attention(q, k, v, backend="flex", **args)
    assert (out - reference_attention(q, k, v, **args)).abs().max() < 1e-5


def test_flex_under_torch_compile_records_the_flex_op_and_matches_the_reference():
    """fullgraph compile of attention(backend="flex") on this CPU (aot_eager: the recorded graph, run without
    code generation): flex_attention is in the graph, and the output equals the reference."""
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(2)
    q, k, v = torch.randn(2, 40, 4, 16), torch.randn(2, 56, 2, 16), torch.randn(2, 56, 2, 16)
    slopes = torch.rand(4)
    graphs = []

    def keep(gm, inputs):  # the graph AOTAutograd recorded, run as it is
        graphs.append(gm)
        return gm.forward

    @torch.compile(fullgraph=True, backend=aot_autograd(fw_compiler=keep))
    def f(q, k, v):
        return attention(q, k, v, causal=True, alibi_slopes=slopes, backend="flex")

    out = f(q, k, v)
    assert len(graphs) == 1
    assert any("flex_attention" in str(n.target) for n in graphs[0].graph.nodes), graphs[0].graph
    assert (out - reference_attention(q, k, v, causal=True, alibi_slopes=slopes)).abs().max() < 1e-5


# -- the dense-bias cache -----------------------------------------------------------------------------------------

def test_alibi_bias_is_built_once_per_slopes_tensor_and_again_after_an_in_place_change():
    q = torch.randn(2, 40, 4, 16)
    slopes = torch.rand(4)
    before = layout.BIASES.builds
    for _ in range(6):
        out = attention(q, q, q, causal=True, alibi_slopes=slopes, backend="sdpa")
    assert layout.BIASES.builds - before == 1
    assert (out - reference_attention(q, q, q, causal=True, alibi_slopes=slopes)).abs().max() < 1e-5
    slopes.mul_(3.0)  # in place: a new version, so a new bias
    out = attention(q, q, q, causal=True, alibi_slopes=slopes, backend="sdpa")
    assert layout.BIASES.builds - before == 2
    assert (out - reference_attention(q, q, q, causal=True, alibi_slopes=slopes)).abs().max() < 1e-5
    attention(q, q, q, causal=True, alibi_slopes=torch.rand(4), backend="sdpa")  # another tensor: another build
    assert layout.BIASES.builds - before == 3


def test_a_dead_slopes_tensor_frees_its_bias():
    from attnkit.runtime import dispatch

    q = torch.randn(1, 32, 4, 16)
    slopes = torch.rand(4)
    attention(q, q, q, alibi_slopes=slopes, backend="sdpa")
    ours = [k for k, (_, refs) in layout.BIASES._entries.items() if any(r() is slopes for r in refs)]
    assert len(ours) == 1
    dispatch.invalidate()  # the bound call holds the slopes (tiny); the cache holds them only weakly
    del slopes
    gc.collect()
    assert ours[0] not in layout.BIASES._entries


def test_slopes_that_require_grad_are_never_cached_and_get_their_gradient():
    q = torch.randn(1, 24, 4, 16)
    slopes = torch.rand(4, requires_grad=True)
    before = layout.BIASES.builds
    for _ in range(2):
        attention(q, q, q, causal=True, alibi_slopes=slopes, backend="sdpa").sum().backward()
    assert layout.BIASES.builds - before == 2 and slopes.grad is not None and slopes.grad.abs().sum() > 0


# -- the sweep --------------------------------------------------------------------------------------------------

def test_the_plan_covers_every_cell_and_every_level_and_any_prefix_is_balanced(monkeypatch):
    cases = tune.plan()
    cells = tune._cells(tune.FEATURES)
    basic = [c for c in cells if tune.basic(c)]
    assert 0 < len(basic) < len(cells)
    key = lambda s: (s.dtype, *s.label.split("|")[1:6])  # noqa: E731
    # stage 1: every basic cell at the common head dims, in training where its query shape trains
    head = cases[:2 * len(basic)]
    assert {(k, s.head_dim) for s in head for k in [tuple(s.label.split("|")[:6])]} == {
        (tuple(map(str, c)), d) for c in basic for d in tune.COMMON_HEAD_DIMS}
    assert all(s.train == ("|decode|" not in s.label and "|few|" not in s.label) for s in head)
    # stage 1b: the basic half-precision cells at the common head dims, every DENSE_WORK_LOG2 level, the points
    # stage 1 measured already left out (each label once in the plan)
    half = [c for c in basic if c[0] in tune.HALF]
    lattice = {(tuple(map(str, c)), d, f"w{w}") for c in half for d in tune.COMMON_HEAD_DIMS for w in tune.DENSE_WORK_LOG2}
    n_dense = len(lattice - {(tuple(s.label.split("|")[:6]), s.head_dim, s.label.split("|")[7]) for s in head})
    dense = cases[2 * len(basic):2 * len(basic) + n_dense]
    assert 0 < n_dense < len(lattice) and all(
        (tuple(s.label.split("|")[:6]), s.head_dim, s.label.split("|")[7]) in lattice for s in dense)
    levels = [tune.DENSE_WORK_LOG2.index(int(s.label.split("|")[7][1:])) for s in dense]
    assert levels == sorted(levels) and levels[0] == 0  # level by level, the middle of the range first
    assert all(s.train == ("|decode|" not in s.label and "|few|" not in s.label) for s in dense)
    # stage 1c: the plain packed cells in half precision at the common head dims, class by class (short first),
    # each class at its PACKED_WORK_LOG2 levels
    start = 2 * len(basic) + n_dense
    plain_packed = [c for c in cells if c[0] in tune.HALF and c[4] == "-" and c[5] != "no"]
    n_packed = sum(len(tune.PACKED_WORK_LOG2[c[5]]) for c in plain_packed) * len(tune.COMMON_HEAD_DIMS)
    packed = cases[start:start + n_packed]
    classes = [s.label.split("|")[5] for s in packed]
    assert classes == sorted(classes, key=list(tune.PACKED_WORK_LOG2).index) and classes[0] == "short"
    assert {(tuple(s.label.split("|")[:6]), s.head_dim, int(s.label.split("|")[7][1:])) for s in packed} == {
        (tuple(map(str, c)), d, w) for c in plain_packed for d in tune.COMMON_HEAD_DIMS
        for w in tune.PACKED_WORK_LOG2[c[5]]}
    assert all(s.train and s.lengths and len(s.lengths) <= 512 for s in packed)
    start += n_packed
    # stage 1d: the equal-length basic ones again at each WIDE_WORK_LOG2 level, a 4x shorter sequence and a 16x
    # larger batch: the same work (its long twin's table point), batch x heads 256-1024
    n_wide = len([c for c in half if c[3] == "equal"]) * len(tune.COMMON_HEAD_DIMS) * len(tune.WIDE_WORK_LOG2)
    wide = cases[start:start + n_wide]
    assert all(s.label.endswith("|wide") and s.train for s in wide) and not any(
        s.label.endswith("|wide") for s in cases[:start] + cases[start + n_wide:])
    for s in wide:
        cell = (s.dtype, s.causal, *s.label.split("|")[2:6])
        twin = tune.shape_for(cell, s.head_dim, float(s.label.split("|")[7][1:]), True, 0)
        assert (s.seqlen_q * tune.WIDE, s.batch) == (twin.seqlen_q, twin.batch * tune.WIDE ** 2)
        assert s.batch * s.seqlen_q ** 2 == twin.batch * twin.seqlen_q ** 2 and s.batch * s.heads >= 256
    start += n_wide
    # stage 1e: the basic half-precision cells at the common head dims at TINY_WORK_LOG2 (a few us of work), below
    # every other stage's levels, in training where the query shape trains; a cell whose smallest call at a head
    # dim does more than twice the level's work is left out there (14 of the 72: chunked prefill, GQA `more`)
    n_tiny = sum(any(s.label.split("|")[7] == f"w{w}" for w in tune.TINY_WORK_LOG2) for s in cases)
    assert n_tiny == 58 and len(half) * len(tune.COMMON_HEAD_DIMS) == 72
    tiny = cases[start:start + n_tiny]
    assert {s.label.split("|")[7] for s in tiny} == {f"w{w}" for w in tune.TINY_WORK_LOG2}
    assert all(s.train == ("|decode|" not in s.label and "|few|" not in s.label) for s in tiny)
    assert {s.label.split("|")[3] for s in tiny} == {"decode", "few", "chunk", "equal", "more"}
    assert not any("|chunk|" in s.label and s.head_dim == 128 for s in tiny)
    # any prefix balanced: head dim by head dim (COMMON_HEAD_DIMS' order), each in the plan's one cell order
    dims = [tune.COMMON_HEAD_DIMS.index(s.head_dim) for s in tiny]
    assert dims == sorted(dims)
    rank = {k: i for i, k in enumerate(tuple(s.label.split("|")[:6]) for s in head[:len(basic)])}
    for d in tune.COMMON_HEAD_DIMS:
        at = [rank[tuple(s.label.split("|")[:6])] for s in tiny if s.head_dim == d]
        assert at == sorted(at) and len(at) > len(half) // 2
    works = [s.batch * s.heads * s.seqlen_q * s.seqlen_k * s.head_dim for s in tiny]
    assert max(works) <= 2 ** (max(tune.TINY_WORK_LOG2) + 1) and min(works) >= 2 ** min(tune.TINY_WORK_LOG2)
    # the last stage: the causal MHA ALiBi cells in half precision, unpacked, every ALIBI_QUERY_SHAPES, at the
    # common head dims on ALIBI_WORK_LOG2, level by level, training where the query shape trains
    lm = [c for c in cells if c[0] in tune.HALF and c[1] is True and c[2] == "mha" and c[4:] == ("alibi", "no")
          and c[3] in tune.ALIBI_QUERY_SHAPES]
    assert len(lm) == len(tune.ALIBI_QUERY_SHAPES)
    lm_lattice = {(tuple(map(str, c)), d, f"w{w}") for c in lm for d in tune.COMMON_HEAD_DIMS
                  for w in tune.ALIBI_WORK_LOG2[c[3]]}
    at = lambda s: (tuple(s.label.split("|")[:6]), s.head_dim, s.label.split("|")[7])  # noqa: E731
    n_alibi = next(n for n in range(len(cases), 0, -1) if all(at(s) in lm_lattice for s in cases[-n:]))
    alibi = cases[-n_alibi:]  # the stage's points an earlier stage has not measured, last
    assert len(lm_lattice) == len(lm) * len(tune.COMMON_HEAD_DIMS) * 3 and n_alibi >= len(lm_lattice) - 2
    assert lm_lattice <= {at(s) for s in cases}
    levels = [tune.ALIBI_WORK_LOG2[s.label.split("|")[3]].index(int(s.label.split("|")[7][1:])) for s in alibi]
    assert levels == sorted(levels) and all(s.alibi and s.causal and s.heads == s.kv_heads for s in alibi)
    # a decode or few-query case's K and V fit a GPU (4 bytes per unit of work in MHA at 2^33: 32 GiB at most)
    assert all(2 * 2 * s.batch * s.seqlen_k * s.kv_heads * s.head_dim <= 2 ** 35 for s in alibi)
    assert all(s.train == ("|decode|" not in s.label and "|few|" not in s.label) for s in alibi)
    # a later stage's point that the packed stage measured already comes once, where it first comes
    monkeypatch.setattr(tune, "packed", lambda *a: [])
    unpacked = tune.plan()
    packed_labels = {s.label for s in packed}
    overlap = len(packed_labels & {s.label for s in unpacked})
    assert len(cases) == (tune.BASIC_POINTS * len(basic) + tune.POINTS_PER_CELL * (len(cells) - len(basic))
                          + n_dense + n_packed + n_wide + n_tiny + n_alibi - overlap)
    # stage 2: every other cell once (a cell whose first point the packed stage measured: there)
    n_dense += n_packed + n_wide + n_tiny  # (the stages after 1e start that much later)
    dense += packed + wide + tiny + alibi
    a = 2 * len(basic) + n_dense
    unpacked_second = unpacked[a - n_packed:a - n_packed + len(cells) - len(basic)]
    second = cases[a:a + len(cells) - len(basic) - len([s for s in unpacked_second if s.label in packed_labels])]
    assert [s.label for s in second] == [s.label for s in unpacked_second if s.label not in packed_labels]
    assert len({key(s) for s in second} | {key(s) for s in packed}) == len(cells) - len(basic)
    assert not {key(s) for s in second} & {key(s) for s in head}
    first = {tuple(s.label.split("|")[:6]) for s in cases[:a + len(second)]}
    assert len(first) == len(cells)  # the first two stages measure every cell
    assert {s.head_dim for s in cases} == set(tune.HEAD_DIMS)
    assert {s.label.split("|")[7] for s in cases} == {f"w{w}" for w in (
        *tune.WORK_LOG2, *tune.DENSE_WORK_LOG2, *(w for ws in tune.PACKED_WORK_LOG2.values() for w in ws),
        *tune.TINY_WORK_LOG2)}
    assert {s.label.split("|")[7] for s in cases if s not in dense} == {f"w{w}" for w in tune.WORK_LOG2}
    assert len({s.label for s in cases}) == len(cases)
    for s in cases[:200]:
        assert (s.seqlen_q == 1) == ("|decode|" in s.label) and s.heads % s.kv_heads == 0
        assert not (s.train and ("|decode|" in s.label or "|few|" in s.label))


def test_validation_shapes_are_not_grid_points():
    grid = {(s.head_dim, s.heads, s.kv_heads, s.seqlen_q, s.seqlen_k) for s in tune.plan()}
    for s in tune.validation_shapes(quick=False):
        assert (s.head_dim, s.heads, s.kv_heads, s.seqlen_q, s.seqlen_k) not in grid, s.label
    assert {71, 20} <= {s.heads for s in tune.validation_shapes(quick=False)}


def test_refine_adds_midpoints_where_the_winner_changes():
    def result(w, winner, loser):
        s = tune.shape_for(("bfloat16", True, "mha", "equal", "-", "no"), 128, w, True, 0)
        ms = {f"attnkit:{winner}": {"fwd": {"sync": 1.0, "b2b": 1.0}},
              f"attnkit:{loser}": {"fwd": {"sync": 2.0, "b2b": 2.0}}}
        return {"shape": {"label": s.label, "train": True}, "cell": {"fwd": "c"}, "head_dim": 128,
                "log2_work": float(w), "ms": ms, "wrong": {}}
    same = [result(27, "a", "b"), result(35, "a", "b")]
    assert tune.refine(same) == []
    mids = tune.refine([result(27, "a", "b"), result(35, "b", "a")])
    assert len(mids) == 1 and "|w31|" in mids[0].label
    # a wide twin sits on its long case's level: refine reads the long lattice alone, in any order of records
    twin = {**result(35, "a", "b"), "shape": {"label": result(35, "a", "b")["shape"]["label"] + "|wide"}}
    for records in ([result(27, "a", "b"), twin, result(35, "b", "a")], [twin, result(35, "b", "a"),
                                                                         result(27, "a", "b")]):
        assert [m.label for m in tune.refine(records)] == [m.label for m in mids]


@pytest.mark.parametrize("fails", [1, 2])
def test_compile_only_tries_a_case_out_of_memory_again_after_the_others_then_leaves_it(monkeypatch, tmp_path, fails):
    """16 compile shards share one GPU: a case whose tensors do not fit beside the others (CUDA OOM on the H200,
    153 of ~260 cases on 2026-12-03) is tried again after the shard's other cases, under the shards' lock; if it
    fails again it is said and left to the timed run, and the shard goes on."""
    import tempfile

    from attnkit.bench import candidates

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    real, made = candidates.Case, []

    def case(s, device):
        made.append(s.label)
        if len(made) == 1 or (fails == 2 and len(made) == 3):
            raise MemoryError("CUDA out of memory. Tried to allocate 64.12 GiB.")
        return real(s, device)

    monkeypatch.setattr(candidates, "Case", case)
    said: list[str] = []
    r = tune.compile_only(quick=True, max_cases=2, say=said.append)
    assert made[2] == made[0] and len(made) == 3  # the first case, once more, after the second
    assert r == {"cases": 2, "candidate_errors": 0, "deferred": 1, "left_for_timed_run": fails - 1}
    assert said[0] == f"deferred {made[0]}: CUDA out of memory. Tried to allocate 64.12 GiB."
    assert said[1] == f"compiled {made[1]}"
    assert said[2] == (f"compiled {made[0]}" if fails == 1 else
                       f"left for the timed run {made[0]}: MemoryError: CUDA out of memory. Tried to allocate 64.12 GiB.")
    assert (tmp_path / tune.COMPILE_LOCK).exists()


@pytest.mark.parametrize("error", ["OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
                                   "RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED"])
def test_a_candidate_out_of_memory_defers_its_case_and_its_own_errors_do_not(monkeypatch, tmp_path, error):
    """timer.warm keeps each candidate's error as a result: one that is an allocation failure means the case did not
    fit beside the other shards, so the case is deferred like one whose tensors did not fit."""
    import tempfile

    from attnkit.bench import timer

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    calls: list[int] = []

    def warm(runs, device, times=2):
        calls.append(len(runs))
        return {}, ({next(iter(runs)): error} if len(calls) == 1 else {})

    monkeypatch.setattr(timer, "warm", warm)
    said: list[str] = []
    r = tune.compile_only(quick=True, max_cases=1, say=said.append)
    assert r["deferred"] == 1 and r["left_for_timed_run"] == 0 and said[0].startswith("deferred ")
    assert said[-1].startswith("compiled ") and len(calls) >= 2
    assert tune.out_of_memory(torch.OutOfMemoryError("CUDA out of memory.")) and not tune.out_of_memory(
        ValueError("head_dim 48 not supported"))


def test_compile_only_leaves_a_case_that_raises_otherwise_at_once(monkeypatch):
    from attnkit.bench import candidates

    real, made = candidates.Case, []

    def case(s, device):
        made.append(s.label)
        if len(made) == 1:
            raise ValueError("a shape the case cannot build")
        return real(s, device)

    monkeypatch.setattr(candidates, "Case", case)
    said: list[str] = []
    r = tune.compile_only(quick=True, max_cases=2, say=said.append)
    assert len(made) == 2 and r["left_for_timed_run"] == 1
    assert said[0] == f"left for the timed run {made[0]}: ValueError: a shape the case cannot build"


def test_compile_only_runs_just_the_backends_that_compile(monkeypatch):
    """The compile phase's shards run FA4 and flex only: the rest have nothing to cache, and sdpa_math's score
    matrix at the largest work levels is what ran 7 of 16 shards out of GPU memory (2026-12-01)."""
    from attnkit.bench import timer

    seen: list[str] = []

    def warm(runs, device, times=2):
        seen.extend(runs)
        return {}, {}

    monkeypatch.setattr(timer, "warm", warm)
    s = next(x for x in tune.plan(tune.QUICK) if not x.alibi)
    assert tune._compile_case(s, "cpu") == 0
    assert seen and all(REGISTRY[n.split(":", 1)[1]].compiles for n in seen)
    assert {n for n, b in REGISTRY.items() if b.compiles} == {"flash_attn4", "flex", "flex_flash"}


def test_the_sweep_prunes_a_slow_backend_after_its_first_calls(monkeypatch):
    """prune: a candidate 3x slower than the fastest in the first two calls is not timed again; its first time
    stands for both modes, so it still ranks (last)."""
    from attnkit.bench import run as bench_run

    timed: list[set[str]] = []

    def interleaved(runs, device, iters, calls=1, seed=0):
        timed.append(set(runs))
        return {n: (10.0 if n == "attnkit:sdpa_math" else 1.0 + 0.1 * i) for i, n in enumerate(sorted(runs))}

    monkeypatch.setattr(bench_run, "interleaved", interleaved)
    warms: list[tuple[int, set[str]]] = []
    real_warm = bench_run.warm
    monkeypatch.setattr(bench_run, "warm", lambda runs, device, times=2, seconds=None: (
        warms.append((times, set(runs))), real_warm(runs, device, times, seconds))[1])
    s = next(x for x in tune.plan(tune.QUICK) if not x.alibi)
    r = bench_run.bench_shape(s, "cpu", iters=1, rounds=1, backends_only=True, prune=3.0)
    # the sweep warms every candidate once, and the JIT ones until FA4's replay is steady (its own path, the
    # recording call, the check call: JIT_WARM_CALLS in all) before the two pruning calls
    from attnkit.bench.candidates import JIT_WARM_CALLS

    assert JIT_WARM_CALLS == 3
    assert warms[0][0] == 1 and all(t == JIT_WARM_CALLS - 1 for t, _ in warms[1:]) and len(warms) <= 2
    assert all(REGISTRY[n.split(":", 1)[1]].compiles for _, names in warms[1:] for n in names)
    assert r["jit_warmed"] is True and r["jit_warm_calls"] == JIT_WARM_CALLS
    assert set(r["step_seconds"]["fwd"]) == {"warm", "check", "first_calls", "sync", "b2b"}
    warm_s = r["warm_seconds"]["fwd"]  # where the warm step's time went, per candidate
    assert set(warm_s) == set(timed[0]) and all(x >= 0 for x in warm_s.values())
    assert sum(warm_s.values()) <= r["step_seconds"]["fwd"]["warm"] + 0.01
    assert "attnkit:sdpa_math" in timed[0] and all("attnkit:sdpa_math" not in t for t in timed[1:])
    assert r["ms"]["attnkit:sdpa_math"]["fwd"] == {"sync": 1e4, "b2b": 1e4, "pruned": True}
    assert tune.decision_order(r, "fwd")[-1] == "sdpa_math"
    r = bench_run.bench_shape(s, "cpu", iters=1, rounds=1, backends_only=True)  # the bench: no pruning
    assert "pruned" not in r["ms"]["attnkit:sdpa_math"]["fwd"] and [t for t, _ in warms][-1] == 2 and len(warms) == 3


def test_a_case_computes_its_float64_reference_once_for_all_its_candidates(monkeypatch):
    from attnkit.bench.run import bench_shape
    from attnkit.runtime import reference

    real, n = reference.reference_rows, []
    monkeypatch.setattr(reference, "reference_rows", lambda *a, **k: (n.append(1), real(*a, **k))[1])
    s = next(x for x in tune.plan(tune.QUICK) if not x.alibi)
    r = bench_shape(s, "cpu", iters=1, rounds=1, backends_only=True)
    assert len(r["max_err"]) >= 2 and len(n) == len({0, s.batch - 1})


def test_scores_rank_by_the_worse_mode_and_drop_wrong_backends():
    r = {"ms": {"attnkit:a": {"fwd": {"sync": 1.0, "b2b": 3.0}}, "attnkit:b": {"fwd": {"sync": 1.5, "b2b": 1.5}},
                "attnkit:c": {"fwd": {"sync": 0.1, "b2b": 0.1}}, "sdpa_plain": {"fwd": {"sync": 0.1, "b2b": 0.1}}},
         "wrong": {"attnkit:c": "forward max error 1 > 0.05"}}
    assert tune.decision_order(r, "fwd") == ["b", "a"]  # a loses 2x back to back; c was wrong


def test_tune_on_this_cpu_shards_resumes_merges_and_selection_reads_the_table(tmp_path, monkeypatch):
    """The whole pipeline for real, on the small grid: two shards (one cut short, then resumed), merged into a
    table with provenance, which selection then decides from."""
    cli = [sys.executable, "-m", "attnkit.cli", "tune", "--quick"]
    s1, s2 = tmp_path / "s1.jsonl", tmp_path / "s2.jsonl"
    run = lambda *a: subprocess.run([*cli, *a], capture_output=True, text=True, timeout=600)  # noqa: E731
    r = run("--compile-only", "--shard", "1/2", "--max-cases", "1")  # untimed: JIT caches only
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[-1]) == {"cases": 1, "candidate_errors": 0,
                                                                   "deferred": 0, "left_for_timed_run": 0}
    r = run("--out", str(s1), "--shard", "1/2", "--max-cases", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["ran"] == 1
    assert "exists; pass --resume" in run("--out", str(s1), "--shard", "1/2").stderr
    r = run("--out", str(s1), "--shard", "1/2", "--resume", "--max-cases", "1")
    assert json.loads(r.stdout.splitlines()[-1])["done_before"] == 1
    assert run("--out", str(s2), "--shard", "2/2", "--max-cases", "1").returncode == 0
    lines = [json.loads(x) for x in s1.read_text().splitlines()]
    assert lines[0]["header"] and len({x["shape"]["label"] for x in lines if "shape" in x}) == 2  # nothing twice
    assert [i for i, x in enumerate(lines) if x.get("header")] == [0, 2]  # the resumed run heads its own case
    out = tmp_path / "sel" / "cpu.json"
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--merge", str(s1), str(s2), "--table", str(out),
                        "--png"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    t = json.loads(out.read_text())
    table.validate(t, str(out))
    assert t["arch"] == "cpu" and t["provenance"]["cases"] == 3 and t["provenance"]["torch"] == torch.__version__
    assert t["provenance"]["shards"] == ["1/2", "2/2"]  # a resumed file keeps its one header
    assert t["provenance"]["files"] == [s1.name, s2.name]  # by name, in merge order: no path of this machine
    assert out.with_suffix(".png").stat().st_size > 1000
    every = [p for pts in t["cells"].values() for p in pts]
    assert all(set(p["order"]) <= set(REGISTRY) for p in every)
    # selection decides from it: every measured cell is among these calls, and each call near a point takes
    # that point's order
    monkeypatch.setenv(table.ENV_TABLES, str(out.parent))
    table.load.cache_clear()
    try:
        calls = [replace(c, head_dim=hd, head_dim_v=hd, seqlen_k=sk, seqlen_q=1 if c.seqlen_q == 1 else sk)
                 for c in _cpu_calls() for hd in (32, 64) for sk in (32, 64, 128, 256)]
        assert set(t["cells"]) <= {table.cell_of(c) for c in calls}
        near = [(c, table.nearest(t["cells"][table.cell_of(c)], c.head_dim, table.log2_work(c))) for c in calls
                if table.cell_of(c) in t["cells"]]
        near = [(c, pt) for c, pt in near if table.distance(pt, c.head_dim, table.log2_work(c)) <= 1.0]
        assert near
        for c, pt in near:
            order, d = priority.order_for(c, None)
            assert d.source == "table" and order[0] == pt["order"][0]
    finally:
        table.load.cache_clear()


def _cpu_calls():
    base = call(device="cpu", dtype="float32", requires_grad=False)
    for causal in (True, False):
        for kvh in (16, 4):
            for sq in (1, 512):
                for alibi in (False, True):
                    yield replace(base, causal=causal and sq > 1, kv_heads=kvh, seqlen_q=sq, seqlen_k=512,
                                  alibi=alibi, heads=16)


def test_merge_refuses_missing_and_foreign_files(tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"shape": {}}\n')
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--merge", str(bad), "--table",
                        str(tmp_path / "t.json")], capture_output=True, text=True)
    assert r.returncode != 0 and "not an attnkit tune file" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--merge", str(tmp_path / "nope.jsonl"),
                        "--table", str(tmp_path / "t.json")], capture_output=True, text=True)
    assert r.returncode != 0 and "does not exist" in r.stderr
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize(("args", "msg"), [
    (["--out", "{out}", "--only-compiled", "--refine", "{out}"], "--only-compiled: not with --refine"),
    (["--validate", "--only-compiled"], "--only-compiled: not with --validate"),
    (["--compile-only", "--only-compiled"], "--only-compiled: not with --compile-only"),
    (["--out", "{out}", "--only-compiled"], "--only-compiled: no {out}.compiled (run `attnkit tune --compile-only"),
])
def test_only_compiled_with_what_it_cannot_serve_is_one_line(tmp_path, args, msg):
    out = str(tmp_path / "t.jsonl")
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", *(a.format(out=out) for a in args)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and msg.format(out=out) in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not Path(out).exists()


def test_match_keeps_the_plans_order_and_only_the_cases_it_finds(tmp_path):
    cases = tune.plan()
    short = tune.matching(cases, r"\|-\|short\|")
    assert short and len(short) < len(cases) and all("|-|short|" in s.label for s in short)
    assert [s.label for s in cases if "|-|short|" in s.label] == [s.label for s in short]
    assert tune.matching(cases, None) is cases
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--plan", "--match", r"\|-\|short\|D64\|"],
                       capture_output=True, text=True)
    listed = r.stdout.split()
    assert r.returncode == 0 and listed == [s.label for s in short if "|D64|" in s.label]


def test_match_narrows_the_timed_run_and_the_compile_phase_alike(monkeypatch, tmp_path):
    """What --compile-only compiles under a --match is what the timed run with that --match measures, so
    --only-compiled finds it; the results file's header records the --match."""
    out = tmp_path / "t.jsonl"
    compiled: list[str] = []
    monkeypatch.setattr(tune, "_compile_case", lambda s, device, every_candidate=False: compiled.append(s.label) or 0)
    tune.compile_only(quick=True, match="w18", skip_done=out, say=lambda *_: None)
    held_out = {s.label for s in tune.validation_shapes(quick=True)}
    listed = tune.compiled_path(out).read_text().split()
    wanted = [s.label for s in tune.plan(tune.QUICK) if "w18" in s.label]
    assert listed == wanted and set(compiled) == held_out | set(wanted) and len(wanted) < len(tune.plan(tune.QUICK))
    # the cases asked for are compiled before the held-out shapes (without --match the held-out shapes go first)
    assert compiled[:len(wanted)] == wanted and sorted(compiled[len(wanted):]) == sorted(held_out)
    r = tune.run(out, quick=True, match="w18", only_compiled=True, max_cases=2, say=lambda *_: None)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert r["ran"] == 2 and lines[0]["match"] == "w18" and lines[0]["planned"] == len(wanted)
    assert [x["shape"]["label"] for x in lines[1:]] == wanted[:2]


def test_a_case_whose_tensors_do_not_fit_is_left_out_and_the_sweep_goes_on(tmp_path, monkeypatch):
    """An out-of-memory error while a case's own tensors are made (not a candidate's: that is its recorded error) is
    tried once more after attnkit's caches and the allocator are released; twice, the case is left out with one
    line, the sweep goes on, and it gets no result line, so a --resume takes it. On 2026-12-07 (H100) such a case
    stopped the sweep with 9 cases left; any other error still stops it."""
    from attnkit.runtime import layout

    real, seen, released = tune.bench_shape, [], []
    cleared = layout.BIASES.clear
    monkeypatch.setattr(layout.BIASES, "clear", lambda: released.append(1) or cleared())

    def first_never_fits_second_fits_on_retry(s, *a, **k):
        seen.append(s.label)
        if s.label == seen[0] or seen.count(s.label) == 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return real(s, *a, **k)

    monkeypatch.setattr(tune, "bench_shape", first_never_fits_second_fits_on_retry)
    out, said = tmp_path / "t.jsonl", []
    r = tune.run(out, quick=True, match="w18", max_cases=2, say=said.append)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    first, second = seen[0], seen[2]
    assert seen == [first, first, second, second] and len(released) == 3
    assert r["ran"] == 1 and r["did_not_fit"] == [first] and r["left"] == 0
    assert [x["shape"]["label"] for x in lines[1:]] == [second]
    assert any(first in m and "does not fit" in m for m in said)
    monkeypatch.setattr(tune, "bench_shape", lambda *a, **k: (_ for _ in ()).throw(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        tune.run(out, quick=True, match="w18", max_cases=1, say=lambda *_: None)


def test_plan_with_out_lists_only_what_that_file_has_not_measured(tmp_path):
    joined = tmp_path / "sweep.jsonl"
    joined.write_text("".join(f.read_text() for f in PACKAGED_FROM))
    # the packed cases with very short sequences: the packaged sweep files measured 83 of the plan's 104 (the tiny
    # stage stood here until its last case, 2026-12-07, session 27); once they measure all, another set with cases
    # left stands in here
    stage = [s.label for s in tune.matching(tune.plan(), r"\|short\|")]
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--plan", "--match", r"\|short\|", "--out",
                        str(joined)], capture_output=True, text=True)
    listed = r.stdout.split()
    recorded = {json.loads(x)["shape"]["label"] for x in joined.read_text().splitlines() if '"shape"' in x}
    assert r.returncode == 0 and listed and set(listed) < set(stage)
    assert [x for x in stage if x in listed] == listed  # in plan order
    assert all(x in recorded for x in stage if x not in listed)  # what is left out was measured there
    assert f"{len(listed)} cases ({len(stage) - len(listed)} more measured in {joined})" in r.stderr
    for bad, msg in ((tmp_path / "none.jsonl", "no such file"), (tmp_path / "text.jsonl", "no header line")):
        if bad.name == "text.jsonl":
            bad.write_text("not a sweep\n")
        r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--plan", "--out", str(bad)],
                           capture_output=True, text=True)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1 and not r.stdout


@pytest.mark.parametrize(("args", "msg"), [
    (["--plan", "--match", "("], "--match: '(' is not a regular expression"),
    (["--plan", "--match", "nothing-like-a-label"], "--match: 'nothing-like-a-label' finds no planned case"),
    (["--merge", "{out}", "--table", "{out}.json", "--match", "x"], "--match: not with --merge"),
    (["--validate", "--match", "nothing-like-a-label"],
     "--match: 'nothing-like-a-label' finds none of the held-out shapes --validate times here (labels look like"),
    (["--validate", "--match", "("], "--match: '(' is not a regular expression"),
    (["--rescore", "{out}", "--match", "x"], "--match: not with --rescore"),
    (["--plan", "--match", "a{4294967296}"], "is not a regular expression (the repetition number is too large)"),
    (["--plan", "--match", "(" * 3000 + ")" * 3000], "is not a regular expression (maximum recursion depth"),
    # no GPU here: the timed run measures the quick grid, where the packed cells are not
    (["--out", "{out}", "--match", r"\|short\|"], "--match: '\\\\|short\\\\|' finds no case of the quick grid"),
    (["--plan", "--out", "{dir}"], "is not a regular file"),
])
def test_match_that_cannot_pick_is_one_line(tmp_path, args, msg):
    out = str(tmp_path / "t.jsonl")
    argv = [a.replace("{out}", out).replace("{dir}", str(tmp_path)) for a in args]  # no str.format: "a{4294967296}"
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", *argv], capture_output=True, text=True)
    assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1 and not r.stdout


def test_half_precision_cells_alternate_between_the_two_dtypes_and_every_one_is_reachable():
    """Each half-precision cell of the plan is measured in one dtype; both dtypes are measured; and every
    half-precision table cell a call can fall in is the plan's cell or its sibling (rule 1)."""
    cells = tune._cells(tune.FEATURES)
    half = [c for c in cells if c[0] in tune.HALF]
    rest = {c[1:] for c in half}
    assert len(rest) == len(half)  # one dtype per cell
    counts = {d: sum(c[0] == d for c in half) for d in tune.HALF}
    assert abs(counts["bfloat16"] - counts["float16"]) <= 1
    both = {(d, *r) for d in tune.HALF for r in rest}
    assert all((d, *c[1:]) in both for c in half for d in tune.HALF)
    assert {c for c in cells if c[0] == "float32"} == {c for c in tune._cells({**tune.FEATURES, "dtype": ("float32",)})}


def test_when_both_the_own_and_the_sibling_cell_are_far_the_own_cell_is_named(tables):
    c = call()
    own, sib = table.cell_of(c), table.cell_of(replace(c, dtype="float16"))
    w = table.log2_work(c)
    write(tables, _table({own: [pt(128, w + 5, "sdpa_cudnn")], sib: [pt(128, w + 6, "sdpa_flash")]}))
    d = table.decide(c, table.table_for((9, 0)))
    assert d is not None and d.far and own in d.label and d.order[0] == "sdpa_cudnn"
    assert priority.order_for(c, (9, 0))[1].source != "table"


def test_far_decides_lets_the_least_distant_far_point_decide_a_scored_variant_not_the_shipped_rule(tables):
    """Rule.far_decides (scored by `tune --cross-check`, not shipped): the least distant far point, in whichever
    cell, decides instead of the rows; the shipped rule keeps rule 4."""
    c = call()
    own, sib = table.cell_of(c), table.cell_of(replace(c, dtype="float16"))
    w = table.log2_work(c)
    t = _table({own: [pt(128, w + 6, "sdpa_cudnn")], sib: [pt(128, w + 5, "sdpa_flash")]})
    assert not table.RULE.far_decides and table.decide(c, t).far
    d = table.decide(c, t, table.Rule(far_decides=True))
    assert d is not None and not d.far and d.order[0] == "sdpa_flash" and sib in d.label and "far_decides" in d.label
    assert "far points decide too (no hand-written rows where a table exists)" in tune.CROSS_CHECK_RULES


@pytest.mark.parametrize(("heads", "kv", "sq", "forced"), [
    (4, 2, 96, True),     # the H200 smoke's causal_sq_gt_sk: BLOCK_M 256 > the mask's 128-row blocks
    (32, 8, 33, True),    # a Llama 32/8 group from 33 queries on
    (32, 8, 32, False),   # 32 * 4 = 128: the decoding kernel runs
    (4, 2, 62, False),    # the smoke's varlen_keyless (62 packed queries): passed on the H200
    (4, 4, 100, False),   # MHA: the block is Q_LEN itself, always <= 128
    (4, 2, 128, False),   # 128 queries: the main kernel anyway
])
def test_flex_keeps_short_gqa_queries_off_the_decoding_kernel(heads, kv, sq, forced):
    c = call(device="cuda", heads=heads, kv_heads=kv, seqlen_q=sq)
    assert flex_mod.decode_options(c, sq) == ({"FORCE_USE_FLEX_ATTENTION": True} if forced else {})


def test_flex_passes_the_decode_option_and_flash_keeps_only_its_backend(monkeypatch):
    """What bind() hands to flex_attention, for a short GQA query on the CPU's flex path (the option's effect is
    inductor's CUDA lowering; the CPU path accepts and ignores it: the answer stays the reference's)."""
    from attnkit.runtime.call import Inputs

    seen: list[dict] = []
    real, create = flex_mod._flex()

    def spy(*a, **kw):
        seen.append(kw.get("kernel_options"))
        return real(*a, **kw)

    monkeypatch.setattr(flex_mod, "_flex", lambda: (spy, create))
    q, k, v = torch.randn(1, 96, 4, 16), torch.randn(1, 40, 2, 16), torch.randn(1, 40, 2, 16)
    inp = Inputs(q, k, v, causal=True)
    c, p = inp.prepare()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = REGISTRY["flex"].bind(c, p, q, k, v)(q, k, v)
        assert seen == [{"FORCE_USE_FLEX_ATTENTION": True}]
        torch.testing.assert_close(out.double(), reference_attention(q, k, v, causal=True), rtol=1e-4, atol=1e-4)
        # no mask: torch's own empty mask has blocks that any BLOCK_M divides, the decoding kernel may run
        c0, p0 = Inputs(q, k, v).prepare()
        REGISTRY["flex"].bind(c0, p0, q, k, v)(q, k, v)
        assert seen[-1] is None
        # packed varlen: Q_LEN is the packed total (96 queries here), the sequence lengths do not count
        cu = torch.tensor([0, 40, 96], dtype=torch.int32)
        cv, pv = Inputs(q[0], k[0].repeat(3, 1, 1)[:96], v[0].repeat(3, 1, 1)[:96], causal=True, cu_seqlens_q=cu,
                        cu_seqlens_k=cu, max_seqlen_q=56, max_seqlen_k=56).prepare()
        REGISTRY["flex"].bind(cv, pv, q[0], k[0].repeat(3, 1, 1)[:96], v[0].repeat(3, 1, 1)[:96])(
            q[0], k[0].repeat(3, 1, 1)[:96], v[0].repeat(3, 1, 1)[:96])
        assert seen[-1] == {"FORCE_USE_FLEX_ATTENTION": True}
        # torch refuses FORCE_USE_FLEX_ATTENTION beside a BACKEND: flex_flash passes its BACKEND alone
        monkeypatch.setenv("ATTNKIT_EXPERIMENTAL_FLEX_FLASH", "1")
        with contextlib.suppress(Exception):  # FLASH has no CPU path: what it was handed is the point
            REGISTRY["flex_flash"].bind(c, p, q, k, v)(q, k, v)
    assert seen[-1] == {"BACKEND": "FLASH"}


def test_a_head_dim_split_makes_a_point_across_it_far():
    point = {"head_dim": 192, "log2_work": 35.0}
    assert table.distance(point, 128, 35.0, table.Rule()) <= 1.0  # near by head dim alone (1.5x above)
    assert table.distance(point, 128, 35.0, table.Rule(head_dim_split=128)) > 1.0
    assert table.distance(point, 160, 35.0, table.Rule(head_dim_split=128)) <= 1.0  # both above: as before
    with pytest.raises(ValueError, match="head_dim_split"):
        table.Rule(head_dim_split=-1)


def test_flex_backward_is_offered_to_a_graph_with_static_sizes_only():
    c = call(device="cuda", trace="compile", softcap=2.0, requires_grad=True, symbolic=True)
    assert flex_mod.GRAPH_GRAD in REGISTRY["flex"].extra_reasons(c, (9, 0))
    assert REGISTRY["flex"].extra_reasons(replace(c, symbolic=False), (9, 0)) == []
    assert REGISTRY["flex"].extra_reasons(replace(c, requires_grad=False), (9, 0)) == []
    assert REGISTRY["flex"].extra_reasons(replace(c, trace=None), (9, 0)) == []
    # packed varlen: refused in a graph with static sizes too (inductor's lowering of its backward raised)
    assert REGISTRY["flex"].extra_reasons(replace(c, symbolic=False, varlen=True), (9, 0)) == [
        flex_mod.GRAPH_GRAD_VARLEN]
    assert REGISTRY["flex"].extra_reasons(replace(c, varlen=True, requires_grad=False), (9, 0)) == []


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_traced_call_says_whether_the_graph_keeps_its_sizes_dynamic(monkeypatch, dynamic):
    seen = []
    real = sel.SELECTOR.select

    def spy(c, *a, **k):
        seen.append(c)
        return real(c, *a, **k)

    monkeypatch.setattr(sel.SELECTOR, "select", spy)
    torch._dynamo.reset()
    f = torch.compile(lambda q: attention(q, q, q, causal=True), fullgraph=True, backend="aot_eager", dynamic=dynamic)
    f(torch.randn(2, 24, 4, 16))
    traced = [c for c in seen if c.trace == "compile"]
    assert traced and all(c.symbolic is dynamic and c.dynamic is dynamic for c in traced)
    assert ("with every size dynamic" in traced[0].describe()) is dynamic


def test_flex_is_refused_in_a_graph_compiled_with_dynamic_true_forward_too():
    """GRAPH_DYNAMIC: flex's forward inside attnkit's graph call failed in inductor under torch.compile(dynamic=True)
    on the CPU (tools/probe-flex-graph-dynamic.py), sizes static or not; dynamic=None (SymInt sizes after a
    recompile) passed and keeps it."""
    c = call(device="cuda", trace="compile", alibi=True, requires_grad=False, dynamic=True, symbolic=True)
    assert REGISTRY["flex"].extra_reasons(c, (9, 0)) == [flex_mod.GRAPH_DYNAMIC]
    assert REGISTRY["flex"].extra_reasons(replace(c, symbolic=False), (9, 0)) == [flex_mod.GRAPH_DYNAMIC]
    assert REGISTRY["flex"].extra_reasons(replace(c, dynamic=False), (9, 0)) == []
    assert REGISTRY["flex"].extra_reasons(replace(c, trace="", dynamic=False), (9, 0)) == []


def test_flex_records_its_backward_in_a_graph_with_static_sizes(monkeypatch):
    """fullgraph compile (aot_eager) of attention(backend="flex") with ALiBi, forward and backward: flex's op and its
    backward are in the graphs, and the gradients equal the float64 reference. torch refuses flex's backward on the
    CPU in eager only (its frontend's device check): lifted here, and flex's own CPU refusal is judged as for a
    CUDA call, so the graph-recording rule is what decides."""
    import torch.nn.attention.flex_attention as torch_flex
    from torch._dynamo.backends.common import aot_autograd

    monkeypatch.setattr(torch_flex, "_validate_device", lambda *a, **k: None)
    as_cuda = flex_mod.Flex.extra_reasons
    monkeypatch.setattr(flex_mod.Flex, "extra_reasons",
                        lambda self, c, cap: as_cuda(self, replace(c, device="cuda"), cap))
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 40, 4, 16, requires_grad=True) for _ in range(3))
    slopes = torch.rand(4)
    graphs = []

    def keep(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: attention(q, k, v, causal=True, alibi_slopes=slopes, backend="flex"),
                      fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), dynamic=False)
    out = f(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert len(graphs) == 2  # the forward graph and the backward graph
    assert any("flex_attention" in str(n.target) for n in graphs[0].graph.nodes), graphs[0].graph
    assert any("flex_attention_backward" in str(n.target) for n in graphs[1].graph.nodes), graphs[1].graph
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, causal=True, alibi_slopes=slopes)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), torch.ones_like(ref))
    assert (out.double() - ref).abs().max() < 1e-5
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g.double() - r).abs().max() < 1e-4


def test_validate_writes_each_shape_as_it_lands(tmp_path, monkeypatch):
    """A --validate run stopped by its time limit keeps the shapes it measured (the report is rewritten per shape)."""
    real, seen = tune.bench_shape, []

    def bench_then_stop(s, *a, **k):
        if seen:
            raise KeyboardInterrupt  # what `timeout` does to the second shape
        seen.append(s.label)
        return real(s, *a, **k)

    monkeypatch.setattr(tune, "bench_shape", bench_then_stop)
    out = tmp_path / "validate.json"
    with pytest.raises(KeyboardInterrupt):
        tune.validate(out, quick=True, say=lambda *_: None)
    doc = json.loads(out.read_text())
    assert [r["shape"] for r in doc["shapes"]] == seen
    assert doc["device"] == "cpu" and doc["summary"] and all(v["shapes"] == 1 for v in doc["summary"].values())
    # every mode raced again head to head: attnkit against the race's fastest other candidate
    row = doc["shapes"][0]
    for key, x in row["ratios"].items():
        assert 0 < x["confirmed_selected_over_oracle"] <= 1.0 and x["confirmed_against"] != "attnkit", key
        assert doc["summary"][key]["confirmed_min"] == x["confirmed_selected_over_oracle"]
    assert set(row["ms"]) >= {"attnkit", f"attnkit:{row['selected']['fwd']}"}  # every candidate's times kept


def test_validate_with_match_times_only_those_shapes_and_resume_takes_the_rest(tmp_path, monkeypatch):
    """--validate --match REGEX: the held-out shapes whose label it finds, the rest left to a later --resume (one
    shape from the end of the list timed first, on a device session too short for all)."""
    timed: list[str] = []
    real = tune.bench_shape

    def noting(s, *a, **k):
        timed.append(s.label)
        return real(s, *a, **k)

    monkeypatch.setattr(tune, "bench_shape", noting)
    labels = [s.label for s in tune.validation_shapes(True)]
    out = tmp_path / "v.json"
    tune.validate(out, quick=True, say=lambda *_: None, match="ALiBi")
    assert timed == [x for x in labels if "ALiBi" in x] and len(timed) < len(labels)
    assert [r["shape"] for r in json.loads(out.read_text())["shapes"]] == timed
    timed.clear()
    rep = tune.validate(out, quick=True, say=lambda *_: None, resume=True)
    assert timed == [x for x in labels if "ALiBi" not in x]
    assert sorted(r["shape"] for r in rep["shapes"]) == sorted(labels)


def test_the_head_to_head_rerun_races_attnkit_against_the_races_fastest_other(monkeypatch):
    from attnkit.bench import run as bench_run

    raced = []

    def interleaved(runs, device, iters, calls=1, seed=0):
        raced.append((sorted(runs), iters, calls))
        return {n: (2.0 if n == "attnkit" else 1.0) for n in runs}

    monkeypatch.setattr(bench_run, "interleaved", interleaved)
    runs = {n: (lambda: None) for n in ("attnkit", "attnkit:a", "attnkit:b", "flash_attn4")}
    race = {"sync": {"attnkit": 1.0, "attnkit:a": 0.9, "attnkit:b": 1.2, "flash_attn4": 0.95},
            "b2b": {"attnkit": 1.0, "attnkit:a": 1.1, "attnkit:b": 1.2, "flash_attn4": 1.05}}
    got = bench_run._head_to_head(runs, "cpu", race, iters=30, rounds=12, calls=7)
    assert got == {"sync": {"against": "attnkit:a", "selected_over_it": 0.5},
                   "b2b": {"against": "flash_attn4", "selected_over_it": 0.5}}
    assert raced == [(["attnkit", "attnkit:a"], 30, 1), (["attnkit", "flash_attn4"], 12, 7)]


def test_the_timed_run_measures_what_compile_only_compiled_first(tmp_path, monkeypatch):
    """compile-only (with the timed run's --out) lists each case it compiled beside that file; the timed run takes
    those first, so its budget is spent timing, not compiling (a 320 s case on the H200, 2026-12-01)."""
    out = tmp_path / "t.jsonl"
    todo = [s.label for s in tune.plan(tune.QUICK)]
    held_out = [s.label for s in tune.validation_shapes(quick=True)]
    compiled: dict[str, bool] = {}
    monkeypatch.setattr(tune, "_compile_case", lambda s, device, every_candidate=False:
                        compiled.__setitem__(s.label, every_candidate) or 0)
    tune.compile_only(quick=True, shard=(2, 3), say=lambda *_: None, skip_done=out)
    listed = tune.compiled_labels(out)
    # the held-out shapes come first (every candidate compiled: validate times the libraries' own calls too),
    # and are not listed for the timed run, which measures grid points only
    mine = [*held_out, *todo][1::3]
    assert list(compiled) == mine and [compiled[x] for x in mine] == [x in held_out for x in mine]
    assert listed == set(mine) - set(held_out) and tune.compiled_path(out).name == "t.jsonl.compiled"
    timed = []

    def bench(s, *a, **k):
        timed.append(s.label)
        return {"shape": {"label": s.label}, "ms": {}}

    monkeypatch.setattr(tune, "bench_shape", bench)
    tune.run(out, quick=True, max_cases=len(listed) + 1, say=lambda *_: None)
    assert set(timed[:len(listed)]) == listed and timed[len(listed)] == todo[0]  # then the plan's order
    # --only-compiled: nothing else, and what waits for a compile phase is counted as left
    timed.clear()
    r = tune.run(tmp_path / "u.jsonl", quick=True, say=lambda *_: None, only_compiled=True)
    assert timed == [] and r["ran"] == 0 and r["not_compiled"] == len(todo) == r["left"]
    tune.compiled_path(tmp_path / "u.jsonl").write_text(todo[3] + "\n")
    r = tune.run(tmp_path / "u.jsonl", quick=True, say=lambda *_: None, only_compiled=True)
    assert timed == [todo[3]] and r["ran"] == 1 and r["not_compiled"] == len(todo) - 1


# -- the packaged table ---------------------------------------------------------------------------------------------

_RESULTS = Path(__file__).parent.parent / "docs" / "results"
# the sweep files the packaged table names in its provenance (tune --merge writes their names, in merge order):
# 157 cases, their FA4 forwards timed again with the replay, 106, 191 and 68 more cases, ..., the refreshes of
# torch_varlen's packed cases and of the training cases near the cuDNN / FA4 crossover, the short-packed cells,
# and the `wide` and `tiny` stages (some on an H100 of the same stack)
# (a table that names none leaves this empty: the packaged-table test below then fails, not the module's collection)
PACKAGED_FROM = tune.merged_from("sm90", _RESULTS)


def test_the_packaged_sm90_table_is_the_merge_of_its_sweep_and_carries_its_provenance():
    """Nobody edits the table by hand: `attnkit tune --merge` of the sweep files it names gives it back exactly."""
    text = (resources.files("attnkit") / "data" / "selection" / "sm90.json").read_text(encoding="utf-8")
    packaged = table.validate(json.loads(text), "sm90.json")
    prov = packaged["provenance"]
    # the files it names are all there, each once; the first is the first sweep, the last the flex refresh of the
    # softcap and window cases (session 33)
    assert len(PACKAGED_FROM) == len(set(PACKAGED_FROM)) == 22 and all(f.is_file() for f in PACKAGED_FROM)
    assert json.loads(json.dumps(tune.merge(PACKAGED_FROM))) == packaged
    assert prov["files"][0] == "2026-12-02-h200-tune-session7-157-cases.jsonl"
    assert prov["files"][-1] == "2026-12-08-h100-tune-session33-flex-refresh-softcap-window-19-cases.jsonl"
    assert prov["gpus"] == ["NVIDIA H200"] and prov["torch"].startswith("2.11") and prov["cases"] == 794
    # the varlen refresh's, the wide stage's, the tiny stage's, the causal ALiBi chunk / few and LM cases' and the flex
    # refreshes' passes (session 32's 11 ALiBi chunks: 6 of their passes had been the H200's; session 33's 19 softcap
    # and window cases: its 36 had been) and session 33's 10 alibi_lm cases, all on an H100 of the same stack
    assert prov["passes_per_gpu"] == {"NVIDIA H200": 1049, "NVIDIA H100 80GB HBM3": 249}
    assert prov["libraries"]["flash-attn-4"] and prov["driver"] and prov["date"].startswith("2026-12-08")
    assert set(prov["grid"]["dtype"]) == {"bfloat16", "float16", "float32"}
    assert all(set(p["order"]) <= set(REGISTRY) for pts in packaged["cells"].values() for p in pts)


def test_the_packaged_table_decides_a_call_at_one_of_its_points(monkeypatch):
    monkeypatch.delenv(table.ENV_TABLES, raising=False)
    table.load.cache_clear()
    try:
        sweep = [json.loads(x) for f in PACKAGED_FROM for x in f.read_text().splitlines()]
        case = next(r for r in sweep if "shape" in r and "fwd" in r.get("cell", {}) and not r["shape"]["lengths"])
        t = table.table_for((9, 0))
        assert t is not None and t["arch"] == "sm90"
        pts = t["cells"][case["cell"]["fwd"]]
        here = next(p for p in pts if case["shape"]["label"] in p["cases"])
        key = case["cell"]["fwd"].split("|")
        shp = case["shape"]
        c = call(dtype=key[1], causal=key[2] == "causal", heads=shp["heads"], kv_heads=shp["kv_heads"],
                 seqlen_q=shp["seqlen_q"], seqlen_k=shp["seqlen_k"], head_dim=shp["head_dim"],
                 head_dim_v=shp["head_dim"], batch=shp["batch"], requires_grad=False,
                 window=tuple(shp["window"]) if shp["window"] else None, softcap=bool(shp["softcap"]),
                 alibi=shp["alibi"])
        assert table.cell_of(c) == case["cell"]["fwd"]
        d = table.decide(c, t)
        assert d is not None and not d.far and d.order == tuple(here["order"])
        order, decided = priority.order_for(c, (9, 0))
        assert decided.source == "table" and order[:len(here["order"])] == tuple(here["order"])
    finally:
        table.load.cache_clear()


# -- the rule's knobs, chosen by leave-one-out (tune --cross-check) ---------------------------------------------------

def test_neighbours_relax_kv_then_dtype_then_causality_and_a_rule_without_dtype_follows_each_cell_by_its_sibling():
    key = "fwd|bfloat16|causal|gqa|equal|-|-|-|no"
    got = table.neighbours(key)
    assert [k.split("|")[3] for k in got[:3]] == ["gqa", "mqa", "mha"]  # the nearer kv sharing first
    assert {k.split("|")[1] for k in got[:3]} == {"bfloat16"} and got[3:6] == [table.sibling(k) for k in got[:3]]
    assert all(k.split("|")[2] == "full" for k in got[6:]) and len(got) == len(set(got)) == 12
    # without "dtype" in relax (the rule until 2026-12-05): each cell at once followed by its sibling
    interleaved = table.neighbours(key, table.Rule(relax=("kv", "causal")))
    assert interleaved[:2] == [key, "fwd|float16|causal|gqa|equal|-|-|-|no"] and set(interleaved) == set(got)
    assert table.neighbours(key, table.Rule(relax=())) == interleaved[:2]
    assert table.neighbours(key, table.Rule(relax=("kv",))) == interleaved[:6]
    assert table.neighbours(key, table.Rule(relax=("dtype",))) == interleaved[:2]
    assert table.neighbours("fwd|float32|causal|gqa|equal|-|-|-|no")[:3] == [  # float32: no sibling to list
        "fwd|float32|causal|gqa|equal|-|-|-|no", "fwd|float32|causal|mqa|equal|-|-|-|no",
        "fwd|float32|causal|mha|equal|-|-|-|no"]
    with pytest.raises(ValueError, match="unknown relaxation 'size'"):
        table.Rule(relax=("size",))
    with pytest.raises(ValueError, match="must be > 0"):
        table.Rule(far_log2=0)
    with pytest.raises(ValueError, match="not a table cell key"):
        table.neighbours("fwd|bfloat16|causal")
    # each relaxation applies to every cell listed before it: the order of `relax` changes the order, not the set
    swapped = table.neighbours(key, table.Rule(relax=("causal", "kv")))
    assert set(swapped) == set(got) and swapped[2] == "fwd|bfloat16|full|gqa|equal|-|-|-|no"
    # the far threshold is the rule's: a point 3 octaves away in work is near at 8x, far at 4x
    c = call()
    w = table.log2_work(c)
    t = _table({table.cell_of(c): [pt(128, w + 3, "sdpa_flash")]})
    assert not table.decide(c, t, table.Rule(far_log2=3.0)).far and table.decide(c, t).far


def _case(label: str, cell: str, hd: int, lw: float, ms: dict) -> dict:
    shape = {"label": label, "batch": 1, "heads": 16, "kv_heads": 16, "seqlen_q": 1024, "seqlen_k": 1024,
             "head_dim": hd, "dtype": "bfloat16", "causal": cell.split("|")[2] == "causal", "window": None,
             "lengths": None, "train": False, "alibi": False, "softcap": 0.0, "lengths_k": None}
    return {"label": label, "shape": shape, "cell": {"fwd": cell}, "head_dim": hd, "log2_work": lw,
            "ms": {f"attnkit:{n}": {"fwd": {"sync": a, "b2b": b}} for n, (a, b) in ms.items()}, "wrong": {}}


def test_cross_check_hides_each_case_and_times_the_rules_pick_by_its_own_measurement(tmp_path):
    header = {"header": True, "schema": 1, "grid": {}, "shard": "1/1",
              "environment": {"date": "2026-12-02T00:00:00+00:00", "probe": {"gpus": [
                  {"name": "NVIDIA H200", "capability": [9, 0]}], "driver": "1", "torch": {"version": "2.11"}}}}
    causal, full = "fwd|bfloat16|causal|mha|equal|-|-|-|no", "fwd|bfloat16|full|mha|equal|-|-|-|no"
    lines = [header,
             _case("a", causal, 128, 30.0, {"sdpa_flash": (1.0, 1.0), "sdpa_cudnn": (2.0, 2.0)}),
             _case("b", full, 128, 30.0, {"sdpa_flash": (1.0, 1.0), "sdpa_cudnn": (4.0, 4.0)})]
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rep = tune.cross_check([f], {"own": table.Rule(relax=()), "causal": table.Rule(relax=("causal",))})
    own, relaxed = rep["rules"]["own"], rep["rules"]["causal"]
    # hidden, a's cell is empty: the own-cell rule falls to the rows; relaxed, b's point decides: sdpa_flash
    assert {x["source"] for x in own["calls"]} == {"rows"}
    assert [(x["case"], x["source"], x["pick"], x["sync"]) for x in relaxed["calls"]] == [
        ("a", "table", "sdpa_flash", 1.0), ("b", "table", "sdpa_flash", 1.0)]
    assert relaxed["summary"]["decided_by_table"] == 2 and relaxed["summary"]["geomean_b2b"] == 1.0
    # a causal one-query case is recorded (and looked up) as the runtime describes it: an unmasked decode
    dec = _case("d", "fwd|bfloat16|full|mha|decode|-|-|-|no", 128, 30.0,
                {"sdpa_flash": (1.0, 1.0), "sdpa_cudnn": (2.0, 2.0)})
    dec["shape"].update(causal=True, seqlen_q=1)
    f.write_text("".join(json.dumps(x) + "\n" for x in [*lines, dec]))
    rep = tune.cross_check([f], {"own": table.Rule(relax=())})["rules"]["own"]
    assert rep["summary"]["skipped"] == 0 and [x["case"] for x in rep["calls"]] == ["a", "b", "d"]
    # a case line that is not what the sweep writes: one line naming --cross-check
    bad = {**lines[1], "shape": {k: v for k, v in lines[1]["shape"].items() if k != "dtype"}}
    f.write_text("".join(json.dumps(x) + "\n" for x in [header, bad]))
    with pytest.raises(tune.UsageError, match=r"^--cross-check: (a )?case .* is not what `attnkit tune` writes"):
        tune.cross_check([f])
    f.write_text("not json\n")
    with pytest.raises(tune.UsageError, match=r"^--cross-check: .* is not an attnkit tune file"):
        tune.cross_check([f])


def test_cross_check_times_each_pick_against_the_plain_call_and_a_margin_puts_it_first(tmp_path):
    """The cross-check scores a pick against the plain call (PLAIN) too, where the case timed it; Rule.plain_margin
    puts the plain call first where it measured within the margin of the lead (2026-12-06, session 21)."""
    header = {"header": True, "schema": 1, "grid": {}, "shard": "1/1",
              "environment": {"date": "2026-12-02T00:00:00+00:00", "probe": {"gpus": [
                  {"name": "NVIDIA H200", "capability": [9, 0]}], "driver": "1", "torch": {"version": "2.11"}}}}
    key = "fwd|bfloat16|causal|mha|equal|-|-|-|no"
    lines = [header,
             _case("a", key, 128, 30.0, {"sdpa_cudnn": (1.0, 1.0), "sdpa": (1.01, 1.01)}),
             _case("b", key, 128, 31.0, {"sdpa_cudnn": (1.0, 1.0), "sdpa": (0.95, 0.95)})]  # near, not merged
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rep = tune.cross_check([f], {"as measured": table.Rule(blend=0.0), "margin": table.Rule(blend=0.0,
                                                                                         plain_margin=0.05)})
    measured, margin = rep["rules"]["as measured"], rep["rules"]["margin"]
    # hidden a: b's point decides (sdpa first there) -> a picks sdpa, 1/1.01 of the best; hidden b: a's point,
    # where cuDNN led by 1%: as measured cuDNN, 0.95 of the plain call; with the margin the plain call
    assert [(x["case"], x["pick"]) for x in measured["calls"]] == [("a", "sdpa"), ("b", "sdpa_cudnn")]
    assert measured["calls"][1]["plain_sync"] == 0.95 and measured["summary"]["vs_plain_share_below_0.98"] == 0.5
    assert [x["pick"] for x in margin["calls"]] == ["sdpa", "sdpa"]
    assert margin["summary"]["vs_plain_min_worse_mode"] == 1.0


def test_the_plain_margin_moves_the_plain_call_first_only_within_the_margin():
    key = "fwd|bfloat16|causal|mha|equal|-|-|-|no"
    c = call(causal=True, requires_grad=False, seqlen_q=4096, seqlen_k=4096, heads=16, kv_heads=16, head_dim=128)
    w = round(table.log2_work(c))
    t = _table({key: [scored(128, w, flash_attn4=1.0, sdpa=1.03, sdpa_cudnn=1.2)]})
    assert table.decide(c, t).order[0] == "flash_attn4"  # shipped: the order as measured
    d = table.decide(c, t, table.Rule(plain_margin=0.05))
    assert d.order == ("sdpa", "flash_attn4", "sdpa_cudnn") and "the plain call within 3.0% of flash_attn4" in d.label
    assert table.decide(c, t, table.Rule(plain_margin=0.02)).order[0] == "flash_attn4"
    # blended: the weighted mean of the near points' scores decides whether the plain call is within the margin
    t = _table({key: [scored(128, w, flash_attn4=1.0, sdpa=1.03), scored(128, w + 1, flash_attn4=1.0, sdpa=1.2)]})
    assert table.decide(c, t, table.Rule(blend_sibling=False, plain_margin=0.05)).order[0] == "flash_attn4"
    assert table.decide(c, t, table.Rule(blend_sibling=False, plain_margin=0.15)).order[0] == "sdpa"
    # a point without the plain call's score, or a far point, keeps its order
    t = _table({key: [scored(128, w, flash_attn4=1.0, sdpa_cudnn=1.01)]})
    assert table.decide(c, t, table.Rule(plain_margin=0.5)).order[0] == "flash_attn4"
    t = _table({key: [scored(128, w + 5, flash_attn4=1.0, sdpa=1.01)]})  # 32x the work away: far, rule 4 decides
    d = table.decide(c, t, table.Rule(plain_margin=0.5))
    assert d.far and d.order == ("flash_attn4", "sdpa") and "plain call" not in d.label
    with pytest.raises(ValueError, match="plain_margin must be in"):
        table.Rule(plain_margin=1.0)


@pytest.mark.parametrize(("args", "msg"), [
    (["--cross-check", "{missing}"], "--cross-check: {missing}: no such file"),
    (["--cross-check", "{good}", "--out", "{good}"], "is one of the --cross-check inputs"),
    (["--cross-check", "{good}", "--merge", "{good}"], "--cross-check: not with --merge"),
])
def test_cross_check_cli_refuses_in_one_line(tmp_path, args, msg):
    good, missing = tmp_path / "good.jsonl", tmp_path / "missing.jsonl"
    good.write_text('{"header": true}\n')
    fill = {"good": good, "missing": missing}
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", *(a.format(**fill) for a in args)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and msg.format(**fill) in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert good.read_text() == '{"header": true}\n'  # the input is never written


# timed on the H200 with the packaged table's data less 14 of its short-packed cases (timed after it)
VALIDATED = _RESULTS / "2026-12-06-h200-tune-validate-session16-14-shapes.json"


def test_rescore_decides_the_validate_shapes_again_and_times_each_pick_by_the_reports_measurement():
    """The validate report's figures stand for what ships while the runtime, as it is now, picks what the device
    picked on every shape, or a pick the report itself timed faster (a new table or rule that changes a pick
    needs a new validate on the GPU, or this: the 14 short-packed cases timed after that validate moved the packed
    encoder's forward from FA4 to torch_varlen, and the wide stage's points with the sequence length as a distance
    moved GPT-2's fp16 forward (B8 S1000) from FA4 to torch's SDPA pick; that H200 run timed both faster in both
    modes)."""
    rep = tune.rescore(VALIDATED)
    moved = [c for c in rep["calls"] if not c["same_pick"]]
    assert rep["picks"] == 24 and [(c["shape"], c["pass"], c["pick"]) for c in moved] == [
        ("val packed encoder x64 24-200 H12 D64", "fwd", "torch_varlen"),
        ("val GPT-2-medium fp16 train S1000 H16 D64", "fwd", "sdpa")]
    data = json.loads(VALIDATED.read_text())
    for c in moved:
        row = next(r for r in data["shapes"] if r["shape"] == c["shape"])
        for mode in ("sync", "b2b"):  # faster in both modes than the report's own pick, by the report's own times
            assert (row["ms"][f"attnkit:{c['pick']}"]["fwd"][mode]
                    < row["ms"][f"attnkit:{row['selected']['fwd']}"]["fwd"][mode])
    for c in rep["calls"]:  # each ratio is the report's fastest over the report's time of the pick forced
        ms = next(r for r in data["shapes"] if r["shape"] == c["shape"])["ms"]
        times = [v[c["pass"]]["sync"] for v in ms.values() if c["pass"] in v]
        assert c["sync"] == round(min(times) / ms[f"attnkit:{c['pick']}"][c["pass"]]["sync"], 3)
    assert rep["summary"]["fwd_sync"]["shapes"] == 14 and rep["summary"]["fwdbwd_b2b"]["shapes"] == 10


# timed on an H100 with the device's own merge of the packaged table's files (session 33, 12 of the 14 shapes)
VALIDATED_H100 = _RESULTS / "2026-12-08-h100-tune-validate-session33-12-of-14-shapes.json"


def test_the_packaged_table_makes_every_pick_of_the_newest_validate():
    """The table rebuilt here from the committed files is the one the device validated: every pass of every shape it
    reached gets the same pick."""
    rep = tune.rescore(VALIDATED_H100)
    assert rep["picks"] == 20 and all(c["same_pick"] for c in rep["calls"])
    assert rep["summary"]["fwd_sync"]["shapes"] == 12 and rep["summary"]["fwdbwd_sync"]["shapes"] == 8


def test_rescore_says_where_the_runtime_now_picks_otherwise(monkeypatch):
    from attnkit.runtime import priority as prio

    real = prio.order_for

    def slow_first(call, cap):
        order, d = real(call, cap)
        return ("sdpa_efficient", *(n for n in order if n != "sdpa_efficient")), d

    monkeypatch.setattr(prio, "order_for", slow_first)
    rep = tune.rescore(VALIDATED)
    moved = [c for c in rep["calls"] if not c["same_pick"]]
    assert moved and all(c["pick"] == "sdpa_efficient" for c in moved)
    assert rep["summary"]["fwd_b2b"]["geomean"] < 0.9  # the mem-efficient kernel is no H200 winner


@pytest.mark.parametrize(("content", "msg"), [
    (None, "--rescore: {f}: no such file"),
    ('{"environment": {"probe": {}}, "shapes": [{"shape": "val odd D48 S77 H20/4 fp32", "params": {"batch": 3}}]}',
     "was measured with other parameters than tune.validation_shapes gives it now"),
    ("not json", "--rescore: {f}: not an `attnkit tune --validate --out` report"),
    ('{"environment": {"probe": {}}, "shapes": [{"shape": "val nothing like it"}]}',
     "is not one of tune.validation_shapes"),
    ('[1, 2]', "not an `attnkit tune --validate --out` report"),
    ('{"environment": {"probe": {}}, "shapes": [{"shape": "val odd D48 S77 H20/4 fp32"}]}',
     "a shape's times are not what `attnkit tune --validate` writes (KeyError"),
    ('{"environment": {"probe": {}}, "shapes": [{"shape": "val odd D48 S77 H20/4 fp32", "ms": {"attnkit:sdpa_cpu": '
     '{"fwd": {"sync": 0, "b2b": 0}}}}]}', "(ValueError: attnkit:sdpa_cpu fwd sync time 0 is not a number > 0)"),
    ('{"environment": {"probe": {}}, "shapes": [{"shape": "val odd D48 S77 H20/4 fp32", "ms": {"attnkit:sdpa_cpu": '
     '{"fwd": {"sync": NaN, "b2b": 1}}}}]}', "time nan is not a number > 0"),
    ('{"environment": {"probe": {"gpus": [{"capability": [9]}]}}, "shapes": []}', "capability [9] is not [major, minor]"),
    ("[" * 100000, "not an `attnkit tune --validate --out` report (RecursionError"),
])
def test_rescore_cli_refuses_in_one_line(tmp_path, content, msg):
    f = tmp_path / "v.json"
    if content is not None:
        f.write_text(content)
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--rescore", str(f)], capture_output=True,
                       text=True)
    assert r.returncode == 2 and msg.format(f=f) in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_resumed_sweep_heads_its_cases_and_a_cut_last_line_does_not_swallow_the_next(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"header": true}\n{"shape": {"label": "x"}, "cut')
    tune._append_line(f, {"header": True, "n": 2})
    tune._append_line(f, {"shape": {"label": "y"}})
    rows = tune._read_lines(f)
    assert rows == [{"header": True}, {"header": True, "n": 2}, {"shape": {"label": "y"}}]


def test_a_forward_refresh_replaces_only_the_forward_pass_of_the_cases_fa4_ran(tmp_path):
    """FA4's forward replay changed its forward times: `--refresh-fwd` re-times the forward of the cases FA4 ran
    in, and merge takes that pass from the later line, every candidate's times with it; fwd+bwd stays."""
    header = {"header": True, "schema": 1, "grid": {}, "shard": "1/1",
              "environment": {"date": "2026-12-02T00:00:00+00:00", "probe": {"gpus": [
                  {"name": "NVIDIA H200", "capability": [9, 0]}], "driver": "1", "torch": {"version": "2.11"}}}}
    cell = "fwd|bfloat16|causal|mha|equal|-|-|-|no"
    old = _case("a", cell, 128, 30.0, {"sdpa_cudnn": (1.0, 1.0), "flash_attn4": (1.2, 0.9)})
    old["shape"]["train"] = True
    old["cell"]["fwdbwd"] = "fwdbwd" + cell[3:]
    for n, (a, b) in {"sdpa_cudnn": (3.0, 3.0), "flash_attn4": (2.0, 2.0)}.items():
        old["ms"][f"attnkit:{n}"]["fwdbwd"] = {"sync": a, "b2b": b}
    other = _case("b", cell, 64, 30.0, {"sdpa_cudnn": (1.0, 1.0)})  # FA4 did not run: nothing to refresh
    f = tmp_path / "old.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in [header, old, other]))
    shapes = tune.refresh_cases([f])
    assert [(s.label, s.train) for s in shapes] == [("a", False)]
    new = _case("a", cell, 128, 30.0, {"sdpa_cudnn": (1.0, 1.0), "flash_attn4": (0.8, 0.8)})
    g = tmp_path / "refresh.jsonl"
    g.write_text("".join(json.dumps(x) + "\n" for x in [header, new]))
    before = tune.merge([f])["cells"][cell]
    after = tune.merge([f, g])
    assert next(p for p in before if p["head_dim"] == 128)["order"][0] == "sdpa_cudnn"
    pt = next(p for p in after["cells"][cell] if p["head_dim"] == 128)
    assert pt["order"][0] == "flash_attn4" and pt["ms"]["flash_attn4"]["sync"] == 0.8
    assert after["cells"]["fwdbwd" + cell[3:]][0]["order"][0] == "flash_attn4"  # fwd+bwd from the first line
    assert after["provenance"]["cases"] == 2  # a refreshed case is still one case
    merged = tune.latest_passes([old, new])
    assert len(merged) == 1 and merged[0]["ms"]["attnkit:sdpa_cudnn"]["fwdbwd"]["sync"] == 3.0
    assert old["ms"]["attnkit:flash_attn4"]["fwd"]["sync"] == 1.2  # the record as read is left alone
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--refresh-fwd", str(tmp_path / "none.jsonl"),
                        "--out", str(tmp_path / "o.jsonl")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().endswith("no such file (give earlier `attnkit tune --out` files)")


def _train_case(label: str, lw: float, fa4: float, cudnn: float, **shape: object) -> dict:
    cell = "fwdbwd|bfloat16|causal|mha|equal|-|-|-|no"
    r = _case(label, "fwd" + cell[6:], 128, lw, {"sdpa_cudnn": (1.0, 1.0), "flash_attn4": (1.0, 1.0)})
    r["shape"].update(train=True, **shape)
    r["cell"]["fwdbwd"] = cell
    r["ms"]["attnkit:sdpa_cudnn"]["fwdbwd"] = {"sync": cudnn, "b2b": cudnn}
    r["ms"]["attnkit:flash_attn4"]["fwdbwd"] = {"sync": fa4, "b2b": fa4}
    return r


def _header(date: str) -> dict:
    return {"header": True, "schema": 1, "grid": {}, "shard": "1/1", "environment": {"date": date, "probe": {
        "gpus": [{"name": "NVIDIA H200", "capability": [9, 0]}], "driver": "1", "torch": {"version": "2.11"}}}}


def test_a_pass_where_fa4_was_pruned_before_its_replay_was_steady_measures_nothing_and_the_earlier_record_stands(
        tmp_path):
    """2026-12-04: the sweep warmed JIT backends twice while FA4's replay now records on the second call and checks
    on the third, so FA4 was pruned on its check call (fwd+bwd at 2.5-31 ms where it runs in ~1). Such a pass
    (a header from SECOND_CALL_RECORDING_SINCE on, fewer than JIT_WARM_CALLS warm calls, FA4 pruned) is dropped
    when read: the case's earlier line for that pass decides, its other pass still counts, a line with no pass
    left is gone, and a train refresh times it again. A pruned FA4 after enough warm calls, or in an older
    session, is a measurement (FA4 was slow there)."""
    def pruned(r: dict, ps: str) -> dict:
        r["ms"]["attnkit:flash_attn4"][ps] = {"sync": 9.0, "b2b": 9.0, "pruned": True}
        return r

    old, new = _header("2026-12-03T12:00:00+00:00"), _header(tune.SECOND_CALL_RECORDING_SINCE + "T21:10:00+00:00")
    steady = _train_case("steady", 35.0, 1.1, 1.0)
    steady["jit_warm_calls"] = 3
    lines = [old, _train_case("near", 35.0, 0.8, 1.0), pruned(_train_case("slow", 35.0, 1.0, 1.0), "fwdbwd"),
             new, pruned(_train_case("near", 35.0, 1.0, 0.9), "fwdbwd"), pruned(pruned(
                 _train_case("gone", 33.0, 1.0, 1.0), "fwd"), "fwdbwd"), pruned(steady, "fwdbwd")]
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = [(r["shape"]["label"], sorted(r["cell"])) for r in tune.steady_cases(tune._read_lines(f))]
    assert got == [("near", ["fwd", "fwdbwd"]), ("slow", ["fwd", "fwdbwd"]), ("near", ["fwd"]),  # its fwd only
                   ("steady", ["fwd", "fwdbwd"])]
    t = tune.merge([f])
    cell = "fwdbwd|bfloat16|causal|mha|equal|-|-|-|no"
    # "near" at 2^35: the old fwd+bwd (FA4 0.8 against cuDNN 1.0) stands beside steady's (cuDNN first) and slow's
    pts = {p["log2_work"]: p for p in t["cells"][cell]}
    assert set(pts) == {35.0} and set(pts[35.0]["cases"]) == {"near", "slow", "steady"}
    assert t["provenance"]["cases"] == 3
    # the refresh's unsteady fwd+bwd does not count as timed on the new path: a train refresh takes "near" again
    assert "near" in {s.label for s in tune.refresh_cases([f], "train")}
    # a resumed sweep runs again a case with no steady fwd+bwd ("gone"; "half", whose only line lost it), not the rest
    half = _header(tune.SECOND_CALL_RECORDING_SINCE + "T22:00:00+00:00"), pruned(_train_case("half", 31.0, 1.0, 1.0),
                                                                                  "fwdbwd")
    assert tune.done_labels([*lines, *half]) == {"near", "slow", "steady"}


def test_a_train_refresh_picks_the_half_precision_training_cases_near_the_crossover_not_yet_timed_again(tmp_path):
    """`--refresh-train`: FA4's training path got faster (its host paths replayed), so the training cases at the
    cuDNN / FA4 crossover are timed again, both passes; a far loser, a small or huge work level, a feature cell, float32
    and a case whose fwd+bwd was already timed on the replayed path (a line under a header from FA4_TRAIN_SINCE on)
    are not."""
    def header(date: str) -> dict:
        return {"header": True, "schema": 1, "grid": {}, "shard": "1/1", "environment": {"date": date, "probe": {
            "gpus": [{"name": "NVIDIA H200", "capability": [9, 0]}], "driver": "1", "torch": {"version": "2.11"}}}}
    old, new = header("2026-12-03T12:00:00+00:00"), header(tune.FA4_TRAIN_SINCE + ":30+00:00")
    lines = [old, _train_case("near", 35.0, 1.2, 1.0), _train_case("far", 35.0, 1.6, 1.0),
             _train_case("small", 29.0, 1.1, 1.0), _train_case("huge", 39.0, 0.9, 1.0),
             _train_case("window", 35.0, 1.0, 1.0, window=[512, 0]), _train_case("fp32", 35.0, 1.0, 1.0, dtype="float32"),
             _train_case("done", 35.0, 1.2, 1.0), _train_case("fwd only", 35.0, 1.2, 1.0), new,
             _train_case("done", 35.0, 0.9, 1.0), _train_case("new", 33.0, 1.1, 1.0),
             _case("fwd only", "fwd|bfloat16|causal|mha|equal|-|-|-|no", 128, 35.0, {"flash_attn4": (1.0, 1.0)})]
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    shapes = tune.refresh_cases([f], "train")
    # "fwd only" was timed again since, forward only (a --refresh-fwd): its fwd+bwd is still the old path's
    assert [(s.label, s.train) for s in shapes] == [("near", True), ("fwd only", True)]
    assert {s.label for s in tune.refresh_cases([f], "fwd")} >= {"near", "far", "done"}  # forwards FA4 ran
    with pytest.raises(ValueError, match="refresh kind 'bwd'"):
        tune.refresh_cases([f], "bwd")
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--refresh-train", str(f), "--refresh-fwd", str(f),
                        "--out", str(tmp_path / "o.jsonl")], capture_output=True, text=True)
    assert r.returncode == 2 and "--refresh-train: not with --refresh-fwd" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_varlen_refresh_times_again_every_pass_of_the_packed_cases_torch_varlen_ran_before_its_direct_route(
        tmp_path):
    """`--refresh-varlen`: torch_varlen calls aten's varlen pair directly since TORCH_VARLEN_DIRECT_SINCE (its
    custom-op host path cost ~0.8 ms per packed fwd+bwd), so the packed cases it ran in before are timed again,
    training ones both passes; a dense case, a packed case it did not run, and one timed since are not."""
    def packed(label: str, train: bool, names: tuple[str, ...]) -> dict:
        r = _case(label, "fwd|bfloat16|full|mha|equal|-|-|-|short", 64, 28.0, {n: (1.0, 1.0) for n in names})
        r["shape"].update(lengths=[7, 30, 12], train=train)
        return r

    def both(r: dict) -> dict:  # a training line as the sweep writes it: both passes timed
        for t in r["ms"].values():
            t["fwdbwd"] = dict(t["fwd"])
        return r

    old, new = _header("2026-12-04T12:00:00+00:00"), _header(tune.TORCH_VARLEN_DIRECT_SINCE + ":30+00:00")
    lines = [old, packed("train", True, ("torch_varlen", "cudnn_ragged")), packed("fwd", False, ("torch_varlen",)),
             packed("no varlen kernel timed", True, ("flash_attn4",)), packed("done", True, ("torch_varlen",)),
             packed("fwd done since", False, ("torch_varlen",)),
             _case("dense", "fwd|bfloat16|full|mha|equal|-|-|-|no", 64, 28.0, {"torch_varlen": (1.0, 1.0)}),
             new, both(packed("done", True, ("torch_varlen",))), packed("fwd done since", False, ("torch_varlen",)),
             packed("train", True, ("torch_varlen",))]  # its forward alone since (a --refresh-fwd): fwd+bwd stale
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    shapes = tune.refresh_cases([f], "varlen")
    assert [(s.label, s.train, s.lengths) for s in shapes] == [("train", True, (7, 30, 12)), ("fwd", False, (7, 30, 12))]
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--refresh-varlen", str(f), "--refresh-train",
                        str(f), "--out", str(tmp_path / "o.jsonl")], capture_output=True, text=True)
    assert r.returncode == 2 and "--refresh-varlen: not with --refresh-train" in r.stderr


def test_a_flex_refresh_times_again_the_one_length_cases_where_flex_was_a_contender_score_mods_first(tmp_path):
    """`--refresh-flex`: before FLEX_STATIC_SINCE a case after a signature's first in a process timed flex's
    dynamic graph (1.3-1.8x slower with ALiBi). Cases where flex was within REFRESH_FLEX_NEAR of the fastest are
    timed again, score mods first, then windows, then masks alone, nearest first; a packed case or a decode (they
    keep the dynamic kernel), flex far behind, no flex timed, or a case with every pass timed since, are not."""
    def both(r: dict) -> dict:  # a training line as the sweep writes it: both passes timed
        for t in r["ms"].values():
            t["fwdbwd"] = dict(t["fwd"])
        return r

    def case(label: str, flex: float, **shape: object) -> dict:
        r = _case(label, "fwd|bfloat16|causal|mha|equal|-|-|-|no", 64, 30.0,
                  {"sdpa": (1.0, 1.0), **({"flex": (flex, flex)} if flex else {})})
        r["shape"].update(shape)
        return r

    lines = [_header("2026-12-06T12:00:00+00:00"), case("mask near", 1.2), case("mask nearer", 1.1),
             case("window", 1.5, window=[64, 0]), case("alibi", 1.8, alibi=True), case("softcap", 1.05, softcap=30.0),
             case("far", 2.5, alibi=True), case("no flex", 0), case("packed", 1.1, lengths=[7, 30]),
             case("done since", 1.2, alibi=True), case("decode", 1.1, alibi=True, seqlen_q=1),
             both(case("train, forward since", 1.3, alibi=True, train=True)),
             _header(tune.FLEX_STATIC_SINCE + ":30+00:00"), case("done since", 1.1, alibi=True),
             case("train, forward since", 1.2, alibi=True)]  # a forward refresh alone: its fwd+bwd is stale
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert [s.label for s in tune.refresh_cases([f], "flex")] == ["softcap", "train, forward since", "alibi",
                                                                   "window", "mask nearer", "mask near"]
    # --match narrows a refresh to the cases asked for, in refresh order; one that finds none is one line, no --out
    assert [s.label for s in tune.refreshed([f], "flex", "^(window|alibi)$")] == ["alibi", "window"]
    assert [s.label for s in tune.refreshed([f], "flex", None)] == [s.label for s in tune.refresh_cases([f], "flex")]
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--refresh-flex", str(f), "--match", "^far$",
                        "--out", str(tmp_path / "o.jsonl")], capture_output=True, text=True)
    assert r.returncode == 2 and "--match: '^far$' finds none of the 6 cases --refresh-flex picks" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "o.jsonl").exists()
    none = tmp_path / "none.jsonl"  # a refresh that picks no case runs none, with a --match as without: not refused
    none.write_text("".join(json.dumps(x) + "\n" for x in [*lines[:1], case("far", 2.5, alibi=True)]))
    assert tune.refreshed([none], "flex", "^far$") == tune.refreshed([none], "flex", None) == []
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--refresh-flex", str(f), "--refresh-varlen",
                        str(f), "--out", str(tmp_path / "o.jsonl")], capture_output=True, text=True)
    assert r.returncode == 2 and "--refresh-flex: not with --refresh-varlen" in r.stderr
    # --plan lists the cases a refresh would time, in its order, --match and --out (what it has timed) applied
    done = tmp_path / "done.jsonl"
    done.write_text("".join(json.dumps(x) + "\n" for x in [lines[0], case("alibi", 1.0, alibi=True)]))
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--plan", "--refresh-flex", str(f), "--match",
                        "^(window|alibi|softcap)$", "--out", str(done)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split("\n")[:-1] == ["softcap", "window"], r.stderr
    assert r.stderr.strip() == "2 cases (1 more measured in " + str(done) + ")"
    for mode in (["--merge", str(f), "--table", str(tmp_path / "t.json")], ["--validate"],
                 ["--cross-check", str(f)]):
        r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--refresh-flex", str(f), *mode],
                           capture_output=True, text=True)
        assert r.returncode == 2 and f"--refresh-flex: not with {mode[0]}" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "t.json").exists()


def test_cross_check_with_the_cell_hidden_lets_only_the_neighbours_decide(tmp_path):
    """--hide-cell: besides the hidden case, its whole cell is hidden, so a case whose cell holds another point is
    decided by a neighbour cell, as a call whose cell the sweep never measured would be."""
    causal, full = "fwd|bfloat16|causal|mha|equal|-|-|-|no", "fwd|bfloat16|full|mha|equal|-|-|-|no"
    lines = [_header("2026-12-02T00:00:00+00:00"),
             _case("a", causal, 128, 30.0, {"sdpa_flash": (1.0, 1.0), "sdpa_cudnn": (2.0, 2.0)}),
             _case("a2", causal, 128, 31.0, {"sdpa_flash": (1.0, 1.0), "sdpa_cudnn": (2.0, 2.0)}),
             _case("b", full, 128, 30.0, {"sdpa_flash": (3.0, 3.0), "sdpa_cudnn": (1.0, 1.0)})]
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rules = {"relaxed": table.Rule(relax=("causal",))}
    plain = tune.cross_check([f], rules)["rules"]["relaxed"]["calls"]
    hidden = tune.cross_check([f], rules, hide_cell=True)
    assert hidden["hide_cell"] is True
    # a's own cell keeps a2's point in plain leave-one-out (sdpa_flash, right); hidden, b's full cell decides
    assert [(x["case"], x["pick"]) for x in plain] == [("a", "sdpa_flash"), ("a2", "sdpa_flash"), ("b", "sdpa_flash")]
    assert [(x["case"], x["pick"], x["sync"]) for x in hidden["rules"]["relaxed"]["calls"]] == [
        ("a", "sdpa_cudnn", 0.5), ("a2", "sdpa_cudnn", 0.5), ("b", "sdpa_flash", 0.3333)]
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--hide-cell", "--merge", str(f), "--table",
                        str(tmp_path / "t.json")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().endswith(
        "--hide-cell: only with --cross-check (it changes what the leave-one-out hides)")
    assert len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--hide-cell", "--rescore", str(f)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--hide-cell: only with --cross-check" in r.stderr


def test_the_shipped_rule_is_among_the_cross_checked_variants_and_the_old_order_still_is():
    """The rule that ships is scored beside the variants it was chosen from, and the variants keep the meaning of
    their names when the default changes (each states the neighbour order it was scored with)."""
    named = {n: r for n, r in tune.CROSS_CHECK_RULES.items() if r is not None}
    assert [n for n, r in named.items() if r == table.RULE] == [
        "the blend weighed by the sum of offsets (shipped since 2026-12-06, session 18)"]
    assert named["the sibling dtype after the other kv sharing (shipped 2026-12-05 to 2026-12-06)"].far_seqlen_log2 == 0
    later = ("sum of offsets", "plain call", "far points decide", "head dim 128")  # variants of the rule shipped then
    assert all(r.far_seqlen_log2 == 0 for n, r in named.items()
               if "sequence length" not in n and not any(w in n for w in later))
    # every variant scored before the sum of offsets keeps the largest offset it was scored with
    assert all(r.blend_distance == "max" for n, r in named.items() if not any(w in n for w in later))
    # far points deciding: scored on the shipped rule, not shipped
    assert not table.RULE.far_decides and [replace(r, far_decides=False) for n, r in named.items()
                                           if r.far_decides] == [table.RULE]
    # a head-dim split: scored on the shipped rule, not shipped
    assert table.RULE.head_dim_split == 0
    assert replace(named["a point across head dim 128 is far"], head_dim_split=0) == table.RULE
    # the plain-call margin: scored on the shipped rule, not shipped (it is 0 there)
    assert table.RULE.plain_margin == 0 and all(
        replace(r, plain_margin=0.0) == table.RULE for n, r in named.items() if "plain call" in n)
    assert named["the sequence length a distance too, far 8x (shipped 2026-12-06)"] == replace(
        table.RULE, blend_distance="max")
    assert named["+ the deciding cell's and its sibling dtype's near points blended (0.25)"].relax == ("kv", "causal")
    assert all("dtype" not in r.relax for n, r in named.items() if n.startswith(("+", "own")))


def _gpu_header(date: str, gpu: str, cap: tuple[int, int] = (9, 0), torch_version: str = "2.11") -> dict:
    h = _header(date)
    h["environment"]["probe"]["gpus"] = [{"name": gpu, "capability": list(cap)}]
    h["environment"]["probe"]["torch"] = {"version": torch_version}
    return h


def test_merge_keeps_cases_of_one_work_and_other_sequence_lengths_apart(tmp_path):
    """Cases that land on one work and head dim are one point only where their sequence length is one too (since
    2026-12-06: B1 S4096 and B16 S1024 are 2^34 both); each point says its log2_seqlen (the keys per sequence)."""
    causal = "fwd|bfloat16|causal|mha|equal|-|-|-|no"
    long_seq = _case("long", causal, 64, 34.0, {"flash_attn4": (1.0, 1.0), "sdpa": (1.2, 1.2)})
    long_seq["shape"] |= {"seqlen_q": 4096, "seqlen_k": 4096}
    short_seq = _case("short", causal, 64, 34.0, {"flash_attn4": (1.3, 1.3), "sdpa": (1.0, 1.0)})
    short_seq["shape"] |= {"batch": 16}
    again = _case("again", causal, 64, 34.0, {"flash_attn4": (1.1, 1.1), "sdpa": (1.0, 1.0)})
    again["shape"] |= {"batch": 16, "heads": 16}
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in [_header("2026-12-06T00:00:00+00:00"), long_seq, short_seq,
                                                         again]))
    pts = tune.merge([f])["cells"][causal]
    assert [(p["log2_seqlen"], p["cases"], p["order"][0]) for p in pts] == [
        (10.0, ["short", "again"], "sdpa"), (12.0, ["long"], "flash_attn4")]
    broken = {**long_seq, "shape": {k: v for k, v in long_seq["shape"].items() if k != "seqlen_k"}}
    f.write_text("".join(json.dumps(x) + "\n" for x in [_header("2026-12-06T00:00:00+00:00"), broken]))
    with pytest.raises(UsageError, match=r"^--merge: case long: its shape is not what `attnkit tune` writes"):
        tune.merge([f])


def test_merge_fills_an_architectures_table_from_another_card_of_it_and_says_which_points(tmp_path):
    """2026-12-05: the device lends H100s far more often than H200s, both sm90. A case measured on the H100 goes
    into the sm90 table beside the H200's: its own cell measured there beats a neighbour cell standing in. The
    table's GPU is the one that timed most passes; a point timed (in part) elsewhere lists its GPUs, and the
    runtime's decision names them. A later line's pass replaces an earlier one whatever its card (a refresh)."""
    causal, full = "fwd|bfloat16|causal|mha|equal|-|-|-|no", "fwd|bfloat16|full|mha|equal|-|-|-|no"
    h200 = [_gpu_header("2026-12-02T00:00:00+00:00", "NVIDIA H200"),
            _case("a", causal, 128, 30.0, {"sdpa_flash": (1.0, 1.0), "sdpa_cudnn": (2.0, 2.0)}),
            _case("b", causal, 128, 34.0, {"sdpa_flash": (2.0, 2.0), "sdpa_cudnn": (1.0, 1.0)}),
            _case("e", causal, 64, 30.0, {"sdpa_flash": (1.0, 1.0)}),
            _case("f", causal, 64, 36.0, {"sdpa_flash": (1.0, 1.0)})]
    h100 = [_gpu_header("2026-12-06T00:00:00+00:00", "NVIDIA H100 80GB HBM3"),
            _case("c", full, 64, 30.0, {"sdpa_flash": (3.0, 3.0), "sdpa_cudnn": (1.0, 1.0)}),
            _case("b", causal, 128, 34.0, {"sdpa_flash": (1.0, 1.0), "sdpa_cudnn": (5.0, 5.0)})]
    f1, f2 = tmp_path / "h200.jsonl", tmp_path / "h100.jsonl"
    for f, lines in ((f1, h200), (f2, h100)):
        f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    t = tune.merge([f1, f2])
    assert t["arch"] == "sm90" and t["provenance"]["gpus"] == ["NVIDIA H200"]
    assert t["provenance"]["passes_per_gpu"] == {"NVIDIA H100 80GB HBM3": 2, "NVIDIA H200": 3}
    pts = {(k, p["head_dim"], p["log2_work"]): p for k, ps in t["cells"].items() for p in ps}
    h100_name = ["NVIDIA H100 80GB HBM3"]
    assert pts[(full, 64, 30.0)]["order"][0] == "sdpa_cudnn" and pts[(full, 64, 30.0)]["gpus"] == h100_name
    # the later (H100) line's pass replaced the H200's, and the point says where it was timed
    assert pts[(causal, 128, 34.0)]["order"][0] == "sdpa_flash" and pts[(causal, 128, 34.0)]["gpus"] == h100_name
    assert "gpus" not in pts[(causal, 128, 30.0)]
    # the runtime's decision names the card a point was timed on, where it is not the table's
    from attnkit.runtime.call import AttentionCall
    c = AttentionCall("cuda", 0, "bfloat16", 1, 1024, 1024, 16, 16, 64, 64, False, False, None, False, False, False,
                      False)
    d = table.decide(c, t)
    assert d is not None and d.order[0] == "sdpa_cudnn" and "timed on NVIDIA H100 80GB HBM3" in d.describe()
    # a point whose cases were timed on two cards lists both
    both = tmp_path / "both.jsonl"
    both.write_text("".join(json.dumps(x) + "\n" for x in (
        h100[0], _case("g", causal, 64, 30.0, {"sdpa_flash": (1.0, 1.0)}))))
    pt = {(p["head_dim"], p["log2_work"]): p for p in tune.merge([f1, both])["cells"][causal]}[(64, 30.0)]
    assert pt["cases"] == ["e", "g"] and pt["gpus"] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    # case lines above a file's first header (a header line cut by a kill) count as that first header's session
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(json.dumps(x) + "\n" for x in (h200[1], h100[0], h100[1])))
    t = tune.merge([cut])
    assert t["provenance"]["gpus"] == ["NVIDIA H100 80GB HBM3"] and "passes_per_gpu" not in t["provenance"]
    # one GPU, one table: the single-card merge writes no per-point or per-GPU tags
    single = tune.merge([f1])
    assert "passes_per_gpu" not in single["provenance"]
    assert not any("gpus" in p for ps in single["cells"].values() for p in ps)
    # the same stack on another architecture, or another torch, is refused in one line
    for other in (_gpu_header("2026-12-06T00:00:00+00:00", "NVIDIA A100", (8, 0)),
                  _gpu_header("2026-12-06T00:00:00+00:00", "NVIDIA H100 80GB HBM3", torch_version="2.12")):
        f3 = tmp_path / "other.jsonl"
        f3.write_text("".join(json.dumps(x) + "\n" for x in (other, _case("d", full, 64, 31.0, {"sdpa": (1, 1)}))))
        with pytest.raises(UsageError, match="one table is one GPU architecture and software stack") as err:
            tune.merge([f1, f3])
        assert str(f3) in str(err.value) and ("capability" in str(err.value) or "torch 2.12" in str(err.value))
    driver = _gpu_header("2026-12-06T00:00:00+00:00", "NVIDIA H100 80GB HBM3")
    driver["environment"]["probe"]["driver"] = "2"
    f3.write_text("".join(json.dumps(x) + "\n" for x in (driver, _case("d", full, 64, 31.0, {"sdpa": (1, 1)}))))
    with pytest.raises(UsageError, match="driver 2, the first file's 1"):
        tune.merge([f1, f3])
    # a table whose point names its GPUs wrongly is refused when loaded, in one line naming it
    with pytest.raises(table.TableError, match="gpus must be a non-empty list"):
        _table({causal: [{**pts[(causal, 128, 30.0)], "gpus": 5}]})


def test_validate_resumes_its_own_report_only_from_the_same_machine_and_shape_set(tmp_path, monkeypatch):
    """`tune --validate --resume --out R`: R's shapes stay and are not timed again, the rest are, and the report
    keeps every session's date (2026-12-05: the 14 shapes took more than one 420 s command). A report from another
    GPU, driver or library set, of another shape set, or with a shape's parameters changed since, is refused in one
    line, and so is a report that is not one."""
    from dataclasses import asdict
    env = {"date": "2026-12-05T18:00:00+00:00", "probe": {
        "gpus": [{"name": "NVIDIA H200", "capability": [9, 0]}], "driver": "580", "torch": {"version": "2.11"},
        "libraries": [{"name": "flash-attn-4", "version": "4.0.0b36", "installed": True}]}}
    later = json.loads(json.dumps(env))
    later["date"] = "2026-12-05T19:00:00+00:00"
    timed: list[str] = []

    def bench_shape(s, device, **kw):
        timed.append(s.label)
        return {"selected_by_pass": {"fwd": "sdpa"}, "row": {"fwd": "test"}, "ms": {"sdpa_plain": {}},
                "ratios": {"fwd": {"sync": {"selected_over_oracle": 1.0, "oracle": "attnkit"}}}}

    monkeypatch.setattr(tune, "measuring_device", lambda what: "cpu")
    monkeypatch.setattr(tune, "environment", lambda: later)
    monkeypatch.setattr(tune, "bench_shape", bench_shape)
    shapes = tune.validation_shapes(True)
    first = {"shape": shapes[0].label, "params": asdict(shapes[0]), "ratios": {"fwd_sync": {
        "selected_over_oracle": 0.5, "oracle": "x", "selected_over_sdpa_plain": 1.0}}, "ms": {}}
    f = tmp_path / "v.json"
    f.write_text(json.dumps({"environment": env, "shapes": [first]}))
    rep = tune.validate(f, quick=True, resume=True, say=lambda *_: None)
    assert timed == [s.label for s in shapes[1:]]  # the earlier shape is kept, not timed again
    assert [r["shape"] for r in rep["shapes"]] == [s.label for s in shapes]
    assert rep["shapes"][0]["ratios"]["fwd_sync"]["selected_over_oracle"] == 0.5
    assert rep["environment"]["sessions"] == [env["date"], later["date"]]
    assert json.loads(f.read_text())["environment"]["sessions"] == [env["date"], later["date"]]
    # refused, in one line, before anything is timed
    timed.clear()
    cases = []
    for key, value, msg in (("gpus", [{"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0]}], "measured with gpus"),
                            ("driver", "570", "measured with driver"),
                            ("libraries", [{"name": "flash-attn-4", "version": "4.0.0b37", "installed": True}],
                             "measured with libraries")):
        other = json.loads(json.dumps(env))
        other["probe"][key] = value
        cases.append(({"environment": other, "shapes": [first]}, msg))
    cases += [({"environment": env, "shapes": [{**first, "params": {**first["params"], "batch": 99}}]},
               "with the parameters it has now"),
              ({"environment": env, "shapes": [{**first, "shape": "val Llama-3-8B prefill S3000 GQA 32/8"}]},
               "is not one of this run's validation shapes"),
              ({"environment": env, "shapes": [{"shape": first["shape"]}]}, "not an `attnkit tune --validate"),
              ({"environment": {"probe": []}, "shapes": [first]}, "not an `attnkit tune --validate"),
              ({"environment": env, "shapes": [{**first, "shape": {"a": 1}}]}, "not an `attnkit tune --validate"),
              ({"environment": env, "shapes": [first, first]}, "a shape appears twice"),
              ({"environment": env, "shapes": [{**first, "ratios": {"fwd_sync": {"selected_over_oracle": "x"}}}]},
               "a ratio that is not a number > 0"),
              ({"environment": {**env, "sessions": "abc"}, "shapes": [first]}, "sessions that are not dates"),
              ("[" * 100000, "not an `attnkit tune --validate --out` report (RecursionError")]
    for data, msg in cases:
        f.write_text(data if isinstance(data, str) else json.dumps(data))
        with pytest.raises(UsageError, match=re.escape(msg)) as err:
            tune.validate(f, quick=True, resume=True, say=lambda *_: None)
        assert "\n" not in str(err.value) and str(f) in str(err.value)
    assert timed == []
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--validate", "--resume"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "--resume: with --validate it needs --out" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", "--validate", "--out", str(f)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "exists; pass --resume" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_merge_without_matplotlib_writes_the_table_and_says_there_is_no_chart_in_one_line(tmp_path):
    """matplotlib is an optional extra (as for `attnkit bench`): --png without it gave a traceback after the table
    was written (a wheel installed with torch alone, 2026-12-05)."""
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in (
        _header("2026-12-02T00:00:00+00:00"),
        _case("a", "fwd|bfloat16|causal|mha|equal|-|-|-|no", 128, 30.0, {"sdpa": (1.0, 1.0)}))))
    code = ("import sys; sys.modules['matplotlib'] = None; from attnkit.cli import main; sys.argv = ['attnkit', "
            f"'tune', '--merge', {str(f)!r}, '--table', {str(tmp_path / 'sm90.json')!r}, '--png']; sys.exit(main())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == f"--png: matplotlib is not installed, so no {tmp_path / 'sm90.png'} (pip install matplotlib)"
    assert json.loads((tmp_path / "sm90.json").read_text())["cells"] and not (tmp_path / "sm90.png").exists()


def test_tune_refuses_to_overwrite_what_is_not_its_own_and_to_write_a_table_the_runtime_would_refuse(tmp_path):
    """Found by a hostile-input sweep of the installed wheel (2026-12-05): `--merge X --table X` replaced the
    results with the table; `--out F --resume` replaced a file that is no sweep's with a header line; a hand-edited
    time made a table the runtime refuses to load; a refresh file with a line of the wrong shape gave a traceback.
    Each is now one line, exit 2, and the files stay as they were."""
    cell = "fwd|bfloat16|causal|mha|equal|-|-|-|no"
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in (_header("2026-12-02T00:00:00+00:00"),
                                                        _case("a", cell, 128, 30.0, {"sdpa": (1.0, 1.0)}))))
    before = f.read_bytes()

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "attnkit.cli", "tune", *args], capture_output=True, text=True)

    r = cli("--merge", str(f), "--table", str(f))
    assert r.returncode == 2 and "is one of the --merge inputs" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert f.read_bytes() == before
    for args, msg in ((["--merge", str(f), "--table", str(tmp_path)], "is a folder"),
                      (["--merge", str(f), "--table", str(tmp_path / "t.json"), "--arch", "sm../../x"],
                       "is not an architecture name"),
                      (["--merge", str(f), "--table", str(tmp_path / "t.json"), "--png", str(tmp_path)], "is a folder"),
                      (["--plan", "--table", str(tmp_path / "t.json")], "--table: only with --merge")):
        r = cli(*args)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    assert not (tmp_path / "t.json").exists()
    other = tmp_path / "notes.txt"
    other.write_text("my notes\n")
    r = cli("--out", str(other), "--resume", "--max-cases", "1")
    assert r.returncode == 2 and "is not an `attnkit tune` results file" in r.stderr
    assert other.read_text() == "my notes\n"
    # a time of 1e-320 against 1.0 makes a score of infinity: the runtime would refuse that table
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text("".join(json.dumps(x) + "\n" for x in (_header("2026-12-02T00:00:00+00:00"), _case(
        "a", cell, 128, 30.0, {"sdpa": (1e-320, 1e-320), "sdpa_math": (1.0, 1.0)}))))
    r = cli("--merge", str(tiny), "--table", str(tmp_path / "t.json"))
    assert r.returncode == 2 and "cannot rank" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t.json").exists()
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps(_header("2026-12-02T00:00:00+00:00")) + "\n")
    r = cli("--merge", str(empty), "--table", str(tmp_path / "t.json"))
    assert r.returncode == 2 and "no case with a timed pass" in r.stderr and not (tmp_path / "t.json").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(x) + "\n" for x in (_header("2026-12-02T00:00:00+00:00"), {
        "shape": "not a dict", "cell": {"fwd": cell}, "ms": {"attnkit:torch_varlen": {"fwd": {}}}})))
    r = cli("--refresh-varlen", str(bad), "--out", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and "--refresh-varlen: a line of" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.jsonl").exists()
