"""The Triton backend's device-side schedule and its hostile-input guarantees, against the host schedule
(:func:`attnplan.schedule.schedule_units`) and the float64 reference.

* The prologue computes exactly the host schedule's integers (each unit's sequence, first unit, unit count and
  granules per unit; ``workspace.meta``) for balanced, forced and batch-invariant schedules, windows, zero lengths,
  batches that take several prologue blocks, and a batch of 65,536 sequences (probed by a small kernel that runs the
  prologue alone).
* Offsets past 2^31 elements: a head-major cache view with a head stride of 2^30 (3 KV heads), and q / out views
  with head strides of 2^30, over one large buffer of which only the touched elements are written (the rest is
  untouched virtual memory); an offset computed in 32 bits lands 2^31 elements early, inside the buffer, and reads
  zeros or writes elsewhere.
* Strides: q's batch / head strides, the cache's page / token / head strides, the block table's row (and column)
  stride, ``seq_lens``' stride, out's and lse's leading strides, all honoured.
* NaN isolation: NaN (or inf) in a V or K row that a query cannot see (the last ``q_len - 1`` positions, the first
  positions of a window) never reaches it; the rows that see it get NaN where the reference does.
* The merges: the fused merge's counters reset (runs at changing lengths, poisoned workspace), empty units and
  empty rows with finite and ``-inf`` sinks.
"""

from __future__ import annotations

import pytest
import torch

import attnplan
from attnplan import reference
from attnplan.backends import DecodeInputs, get_backend
from attnplan.schedule import NUM_TARGETS, Schedule, schedule_units
from attnplan.testing import assert_close_to_reference, make_inputs, poison

from conftest import HAS_CUDA

DEVICE = "cuda" if HAS_CUDA else "cpu"
pytestmark = pytest.mark.skipif(not get_backend("triton").available(torch.device(DEVICE))[0],
                                reason="triton unavailable here")


def _cfg(**split):
    return attnplan.load_config(split=split, plan_cache={"disk": False})


def _out(x):
    return (poison(torch.empty_like(x.q)),
            poison(torch.empty(x.q.shape[:3], dtype=torch.float32, device=x.q.device)))


# -- the prologue equals the host schedule ----------------------------------------------------------------------

try:
    import triton
    import triton.language as tl

    from attnplan.backends.triton.kernels import _schedule
except ImportError:  # the module's tests skip (pytestmark)
    triton = None

if triton is not None:
    @triton.jit
    def _probe_kernel(SEQ_LENS, TARGETS, META, US, OUT, batch, window_left, min_c, max_s, capacity,
                      Q_LEN: tl.constexpr, GRANULE: tl.constexpr, WINDOW: tl.constexpr, BALANCED: tl.constexpr,
                      BLOCK_B: tl.constexpr, ONE_BLOCK: tl.constexpr):
        """The partial kernel's prologue alone: program ``p`` asks for unit ``US[p]`` and stores what it finds
        (lengths clamped into ``[0, capacity]``)."""
        pid = tl.program_id(0)
        u = tl.load(US + pid)
        b, first, units, cb, seq_len, _ = _schedule(SEQ_LENS, 1, TARGETS, META, batch, u, 0, pid, window_left,
                                                    min_c, max_s, capacity, Q_LEN, GRANULE, WINDOW, BALANCED, True,
                                                    BLOCK_B, ONE_BLOCK)
        tl.store(OUT + pid * 5, b)
        tl.store(OUT + pid * 5 + 1, first)
        tl.store(OUT + pid * 5 + 2, units)
        tl.store(OUT + pid * 5 + 3, cb)
        tl.store(OUT + pid * 5 + 4, seq_len)


    @triton.jit
    def _slot_probe_kernel(SEQ_LENS, TARGETS, META, OUT, batch, slots, min_c, max_s, GRANULE: tl.constexpr,
                           BLOCK_B: tl.constexpr):
        """The prologue of grid slot ``p`` of ``slots`` (the single-block path): the sequence and unit it runs."""
        pid = tl.program_id(0)
        b, _, _, _, _, u = _schedule(SEQ_LENS, 1, TARGETS, META, batch, pid, slots, pid, 0, min_c, max_s,
                                     2**31 - 1, 1, GRANULE, False, True, False, BLOCK_B, True)
        tl.store(OUT + pid * 2, b)
        tl.store(OUT + pid * 2 + 1, u)


def _probe(lens, sched: Schedule, q_len, window, us, block_b, one_block=False, capacity=2**31 - 1):
    """Run the prologue alone for units ``us`` (program 0 must ask for unit 0: it writes the meta); ``one_block``:
    the single-block path (``len(lens) <= block_b``); lengths clamped into ``[0, capacity]``."""
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    meta = torch.full((2 * len(lens),), -7, dtype=torch.int32, device=DEVICE)
    out = torch.full((len(us), 5), -7, dtype=torch.int32, device=DEVICE)
    _probe_kernel[(len(us),)](lens_t, torch.tensor(sched.targets, dtype=torch.int32, device=DEVICE), meta,
                       torch.tensor(us, dtype=torch.int32, device=DEVICE), out, len(lens), max(window, 0),
                       sched.min_unit_granules, sched.max_units_per_seq, capacity, Q_LEN=q_len, GRANULE=sched.granule,
                       WINDOW=window >= 0, BALANCED=any(sched.targets), BLOCK_B=block_b, ONE_BLOCK=one_block)
    return out.cpu(), meta.cpu()


def _expect(lens, sched, q_len, window, us, capacity=None, longest_first=True):
    """The host schedule's ``(b, first[b], units[b], cb, length)`` of the unit in each slot of ``us`` (``-1`` past the
    units) and the ``first`` table. ``longest_first=False``: the slots in index order, what the looped prologue
    computes; it serves batches above one prologue block (1,024 sequences, index order in
    :func:`attnplan.schedule.first_slots` too) and is probed here at small batches as well."""
    s = schedule_units(lens, sched, q_len, window, capacity)
    first = s.first if longest_first else s.indptr[:-1]
    in_slot = s.by_slot() if longest_first else torch.arange(s.num_units)
    rows = []
    for u in us:
        if u >= s.num_units:
            rows.append(-1)
            continue
        b = int(s.seq[in_slot[u]])
        length = int(lens[b]) if capacity is None else min(max(int(lens[b]), 0), capacity)
        rows.append([b, int(first[b]), int(s.units[b]), int(s.unit_granules[b]), length])
    return first, rows


def _targets(gen, lo=1, hi=64):
    return tuple(int(x) for x in torch.randint(lo, hi, (NUM_TARGETS,), generator=gen))


SCHEDULES = {
    "balanced": lambda gen: Schedule("balanced", 16, 2, 8, _targets(gen), 1 << 20),
    "balanced-zero-targets-low": lambda gen: Schedule("balanced", 32, 1, 5, (0, 0, 0, 0) + _targets(gen)[4:], 1 << 20),
    "forced": lambda gen: Schedule("forced", 16, 1, 7, (0,) * NUM_TARGETS, 1 << 20),
    "invariant": lambda gen: Schedule("batch_invariant", 64, 3, 4, (0,) * NUM_TARGETS, 1 << 20),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("q_len,window", [(1, -1), (3, 40)])  # q_len counts with a window only
# the looped prologue over one block (7, 16, False) is in the full tier: the loop runs over three blocks at 33
# sequences, and a batch of one block takes the single-block path (7, 16, True)
@pytest.mark.parametrize("batch,block_b,one_block", [(7, 16, True), pytest.param(7, 16, False, marks=pytest.mark.full),
                                                     (33, 16, False), (32, 32, True), (50, 64, True)])
def test_prologue_matches_host_schedule(name, q_len, window, batch, block_b, one_block, gen):
    """Random lengths with zeros and long ones; every unit, a unit past the total, and the meta; the single-block
    path (longest units first: 7 sequences in a block of 16, 32 in one of 32; index order: 50 in one of 64) and the
    loops (``block_b`` 16 with 33 sequences: three blocks, the last of one sequence, and the search stops early)."""
    sched = SCHEDULES[name](gen)
    lens = torch.randint(0, 300, (batch,), generator=gen)
    lens[torch.rand(batch, generator=gen) < 0.3] = 0
    lens[0] = 1000
    lens = lens.tolist()
    s = schedule_units(lens, sched, q_len, window)
    us = list(range(s.num_units)) + [s.num_units, s.num_units + 5]
    got, meta = _probe(lens, sched, q_len, window, us, block_b, one_block)
    first, rows = _expect(lens, sched, q_len, window, us, longest_first=one_block)
    for u, (row, want) in enumerate(zip(got.tolist(), rows)):
        assert (row[0] == -1) if want == -1 else row == want, f"unit {u}: kernel {row}, host {want}"
    assert meta[:batch].tolist() == first.tolist() and meta[batch:].tolist() == s.units.tolist()


#: targets tables of the clamp tests: "c1" gives units of one granule whatever the batch's total; "total" (8
#: units for any bucket) makes the granules per unit ceil(T / 8), so an unclamped length in the total shows
CLAMP_TARGETS = {"c1": tuple([0] + [min(4 << k, 2**31 - 1) for k in range(1, NUM_TARGETS)]),
                 "total": (8,) * NUM_TARGETS}


@pytest.mark.parametrize("table", ["c1", "total"])
@pytest.mark.parametrize("q_len,window", [(1, -1), (2, 7)])
@pytest.mark.parametrize("block_b,one_block", [(16, True), (4, False)])
def test_prologue_clamps_lengths_into_the_capacity(q_len, window, block_b, one_block, table):
    """Lengths outside ``[0, capacity]`` on the device (one past it, the largest int32, negative, the smallest int32)
    are read clamped into it: every unit's sequence, first unit, unit count, granules per unit and length, and the
    meta, are the host schedule's for the clamped lengths (the single-block path and the blocked loops; with a
    table whose granules per unit follow the batch's total, the total's clamp too)."""
    cap = 96
    lens = [cap + 1, 2**31 - 1, -5, 40, -2**31, cap]
    sched = Schedule("balanced", 16, 1, 4, CLAMP_TARGETS[table], 1 << 20)
    s = schedule_units(lens, sched, q_len, window, cap)
    assert int(s.end.max()) <= cap and int(s.units[1]) == int(s.units[0]) and int(s.units[2]) == 1
    assert table != "c1" or int(s.units[0]) == 3 or window >= 0  # 6 granules in 3 units of 2; a window: one
    us = list(range(s.num_units)) + [s.num_units]
    got, meta = _probe(lens, sched, q_len, window, us, block_b, one_block, capacity=cap)
    first, rows = _expect(lens, sched, q_len, window, us, capacity=cap, longest_first=one_block)
    for u, (row, want) in enumerate(zip(got.tolist(), rows)):
        assert (row[0] == -1) if want == -1 else row == want, f"unit {u}: kernel {row}, host {want}"
    assert meta[:6].tolist() == first.tolist() and meta[6:].tolist() == s.units.tolist()


@pytest.mark.parametrize("extra", [0, 3, "2x", "2x+1", "3x+2"])
def test_prologue_places_units_in_slots_as_slot_unit(extra, gen):
    """With the grid's slots known (the single-block path), slot ``p`` runs unit ``slot_unit(p, U, slots,
    PACK_SLOTS_PER_UNIT)``: packed in a grid of at most that many slots per unit, spread in a larger one; a slot
    without a unit finds no sequence."""
    from attnplan.backends.triton.kernels import PACK_SLOTS_PER_UNIT
    from attnplan.schedule import slot_unit

    sched = SCHEDULES["balanced"](gen)
    lens = torch.randint(1, 700, (9,), generator=gen).tolist()
    s = schedule_units(lens, sched)
    total = s.num_units
    slots = {0: total, 3: total + 3, "2x": 2 * total, "2x+1": 2 * total + 1, "3x+2": 3 * total + 2}[extra]
    out = torch.full((slots, 2), -7, dtype=torch.int32, device=DEVICE)
    meta = torch.zeros(2 * len(lens), dtype=torch.int32, device=DEVICE)
    _slot_probe_kernel[(slots,)](torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                                 torch.tensor(sched.targets, dtype=torch.int32, device=DEVICE), meta, out, len(lens),
                                 slots, sched.min_unit_granules, sched.max_units_per_seq, GRANULE=sched.granule,
                                 BLOCK_B=16)
    got = out.cpu().tolist()
    for p in range(slots):
        u = slot_unit(p, total, slots, PACK_SLOTS_PER_UNIT.value)
        assert got[p][0] == (int(s.seq[s.by_slot()[u]]) if u >= 0 else -1), (p, got[p], u)
        if u >= 0:
            assert got[p][1] == u


def test_prologue_at_batch_65536(gen):
    """65,536 sequences (64 prologue blocks of 1024): units at the start, the middle and the end of the batch, and
    past the total, equal the host schedule's; the meta too."""
    batch = 65536
    sched = Schedule("balanced", 16, 1, 16, _targets(gen, 1 << 16, 1 << 17), 1 << 20)
    lens = torch.randint(0, 300, (batch,), generator=gen)
    lens[12345] = 40000
    lens = lens.tolist()
    s = schedule_units(lens, sched)
    n = s.num_units
    us = [0, int(s.first[12345]) + 3, n // 2, n - 1, n, n + 1000]
    got, meta = _probe(lens, sched, 1, -1, us, 1024)
    first, rows = _expect(lens, sched, 1, -1, us)
    for u, row, want in zip(us, got.tolist(), rows):
        assert (row[0] == -1) if want == -1 else row == want, f"unit {u}: kernel {row}, host {want}"
    assert torch.equal(meta[:batch].long(), first) and torch.equal(meta[batch:].long(), s.units)


@pytest.mark.parametrize("merge", ["separate", "fused"])
def test_several_prologue_blocks_end_to_end(merge, gen, monkeypatch):
    """Prologue blocks of 16 sequences over a batch of 33 (three blocks, the last of one sequence; a capacity plan:
    balanced targets; past LONGEST_FIRST_BATCH, so the slots are in index order, what the loop computes): outputs
    equal the reference and the separate merge's meta equals the host schedule."""
    import attnplan.backends.triton as tb

    monkeypatch.setattr(tb, "MAX_BLOCK_B", 16)
    be = get_backend("triton")
    be._launches.clear()
    lens = torch.randint(0, 40, (33,), generator=gen)
    lens[3] = 150
    lens[32] = 120
    x = make_inputs(33, 4, 1, 16, lens.tolist(), page_size=16, device=DEVICE, generator=gen, capacity=160)
    w = attnplan.DecodeWrapper(_cfg(merge=merge), backend="triton")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=True)
    const = w.backend._launch(plan, w.workspace).const
    assert plan.merge == merge and const["BLOCK_B"] == 16 and not const["ONE_BLOCK"]
    out, lse = _out(x)
    w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out, ref)
    assert_close_to_reference(lse, ref_lse, torch.float32, "lse")
    s = schedule_units(lens.tolist(), plan.schedule)
    assert int(s.units.max()) > 1
    if merge == "separate":
        assert w.workspace.meta.cpu().tolist() == s.first.tolist() + s.units.tolist()
    else:
        assert int(w.workspace.counters.abs().sum()) == 0
    be._launches.clear()


# -- 64-bit offsets ------------------------------------------------------------------------------------------------

BIG = 1 << 30


def _big_buffer(elements: int, dtype):
    """A buffer of ``elements`` (virtual memory: only what is written is ever touched), or skip."""
    try:
        return torch.empty(elements, dtype=dtype, device=DEVICE)
    except (RuntimeError, MemoryError) as e:  # no room for the address space
        pytest.skip(f"cannot reserve {elements} elements: {e}")


@pytest.mark.parametrize("page", [None, 16])
@pytest.mark.parametrize("splits", [1, 3])
def test_head_major_cache_with_head_stride_2_30(page, splits, gen):
    """A head-major KV cache view, head stride 2^30 elements, 3 KV heads: head 2 starts at 2^31 elements, past int32.
    The views start 2^31 elements into the buffer, so a wrapped 32-bit offset reads zeros inside it (no fault)."""
    src = make_inputs(2, 6, 3, 16, [37, 20], page_size=page, device=DEVICE, generator=gen, capacity=48)
    k0, v0 = src.k_cache, src.v_cache
    pages, tokens, hkv, d = k0.shape
    buf = _big_buffer(4 * BIG + 2 * pages * tokens * d + 64, torch.float16)
    strides = (tokens * d, d, BIG, 1)
    k = buf.as_strided(k0.shape, strides, 2 * BIG)
    v = buf.as_strided(v0.shape, strides, 2 * BIG + pages * tokens * d)
    k.copy_(k0)
    v.copy_(v0)
    x = DecodeInputs(src.q, k, v, src.seq_lens, src.block_table, src.sm_scale)
    w = attnplan.DecodeWrapper(_cfg(), backend="triton")
    w.plan(x.q, k, v, x.seq_lens, x.block_table, num_splits=splits)
    out, lse = _out(x)
    w.run(x.q, k, v, x.seq_lens, x.block_table, out=out, lse=lse)
    ref, ref_lse = reference.attention(x.q, k0, v0, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out, ref)
    assert_close_to_reference(lse, ref_lse, torch.float32, "lse")


@pytest.mark.parametrize("splits", [1, 3])
def test_q_and_out_with_head_stride_2_30(splits, gen):
    """q and out views with head stride 2^30 (4 query heads: heads 2 and 3 start past 2^31 elements), read and
    written where they are. The views start 2^31 elements into the buffer (a wrapped offset stays inside it). They
    interleave in one buffer without sharing an element, which validation's conservative overlap check refuses, so
    the plan is made on plain tensors and the backend runs the views directly."""
    src = make_inputs(2, 4, 2, 16, [33, 9], q_len=2, device=DEVICE, generator=gen)
    b, ql, hq, d = src.q.shape
    buf = _big_buffer(5 * BIG + 2048, torch.float16)
    q = buf.as_strided(src.q.shape, (ql * d, d, BIG, 1), 2 * BIG)
    out = buf.as_strided(src.q.shape, (ql * d, d, BIG, 1), 2 * BIG + 1024)
    q.copy_(src.q)
    out.fill_(float("nan"))
    lse = poison(torch.empty(b, ql, hq, dtype=torch.float32, device=DEVICE))
    w = attnplan.DecodeWrapper(_cfg(), backend="triton")
    plan = w.plan(src.q, src.k_cache, src.v_cache, src.seq_lens, num_splits=splits)
    w.backend.run(plan, DecodeInputs(q, src.k_cache, src.v_cache, src.seq_lens, None, src.sm_scale), w.workspace,
                  out, lse)
    ref, ref_lse = reference.attention(src.q, src.k_cache, src.v_cache, src.seq_lens, None, src.sm_scale)
    assert_close_to_reference(out, ref)
    assert_close_to_reference(lse, ref_lse, torch.float32, "lse")


# -- strides -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", [None, 16])
@pytest.mark.parametrize("splits,merge", [(1, "separate"), (3, "separate"), (3, "fused")])
def test_every_stride_is_honoured(page, splits, merge, gen):
    """Non-contiguous views of every input and output (q's batch and head strides, the cache's page / token / head
    strides, the block table's row and column strides, seq_lens' stride, out's and lse's leading strides), run
    through the backend directly (validation may refuse some of these views; the kernel honours them all)."""
    src = make_inputs(3, 8, 2, 32, [45, 0, 17], q_len=2, page_size=page, device=DEVICE, generator=gen, capacity=48)
    b, ql, hq, d = src.q.shape
    # the gaps hold zeros (a kernel that ignored a stride reads wrong values, not out of bounds)
    q = torch.zeros(b + 1, ql, 2 * hq, d, dtype=src.q.dtype, device=DEVICE)[1:, :, ::2].copy_(src.q)
    n0, t0, hkv, _ = src.k_cache.shape
    k = torch.zeros(n0, 2 * t0, hkv + 1, d, dtype=src.q.dtype, device=DEVICE)[:, ::2, 1:].copy_(src.k_cache)
    v = torch.zeros(n0, t0, hkv, 2 * d, dtype=src.q.dtype, device=DEVICE)[..., d:].copy_(src.v_cache)
    sl = torch.zeros(2 * b, dtype=torch.int32, device=DEVICE)[::2].copy_(src.seq_lens)
    bt = None
    if page:
        bt = torch.zeros(src.block_table.shape[1], 2 * b, dtype=torch.int32, device=DEVICE).t()[::2]
        bt.copy_(src.block_table)
        assert bt.stride(1) != 1
    x = DecodeInputs(q, k, v, sl, bt, src.sm_scale)
    w = attnplan.DecodeWrapper(_cfg(merge=merge), backend="triton")
    plan = w.plan(src.q, src.k_cache, src.v_cache, src.seq_lens, src.block_table, num_splits=splits)
    out = poison(torch.empty(b, ql + 1, hq, 2 * d, dtype=src.q.dtype, device=DEVICE))[:, 1:, :, :d]
    lse = poison(torch.empty(b, 3 * ql, hq, dtype=torch.float32, device=DEVICE))[:, ::3]
    if w.workspace.state is not None:
        w.workspace.state.fill_(float("nan"))
    w.backend.run(plan, x, w.workspace, out, lse)
    ref, ref_lse = reference.attention(src.q, src.k_cache, src.v_cache, src.seq_lens, src.block_table, src.sm_scale)
    assert_close_to_reference(out, ref)
    assert_close_to_reference(lse, ref_lse, torch.float32, "lse")


# -- NaN isolation -------------------------------------------------------------------------------------------------

def _nan_equal(out, ref, dtype=torch.float16):
    """NaN exactly where the reference has NaN (no NaN leaks, none lost), the rest within tolerance."""
    o = out.detach().cpu().double()
    nan_o, nan_r = torch.isnan(o), torch.isnan(ref)
    assert torch.equal(nan_o, nan_r), f"NaN at {(nan_o != nan_r).nonzero()[:6].tolist()} differs from the reference"
    inf = float("inf")
    assert_close_to_reference(o.nan_to_num(7.0, inf, -inf), ref.nan_to_num(7.0, inf, -inf), dtype)


NAN_CASES = [  # (q_len, window, page, splits, merge)
    (2, -1, None, 1, "separate"),
    (2, -1, 16, 3, "separate"),
    (4, -1, None, 3, "fused"),
    (3, 6, 16, 1, "separate"),
    (3, 6, None, 3, "fused"),
    (4, 40, 16, 3, "separate"),
]


@pytest.mark.parametrize("q_len,window,page,splits,merge", NAN_CASES)
def test_nan_in_positions_a_query_cannot_see(q_len, window, page, splits, merge, gen):
    """NaN in V at each sequence's last position (only its last query sees it), +inf and NaN in V and NaN in K at
    the first position of the window that only query 0 sees, NaN in V inside the span every query sees: the
    queries that cannot see a position are exact, the others are NaN where the reference is."""
    lens = [50, 37, 2]
    x = make_inputs(3, 8, 2, 32, lens, q_len=q_len, page_size=page, device=DEVICE, generator=gen, capacity=64)

    def at(b, pos):  # (k, v) rows of sequence b at logical position pos
        if page is None:
            return x.k_cache[b, pos], x.v_cache[b, pos]
        p = int(x.block_table[b, pos // page])
        return x.k_cache[p, pos % page], x.v_cache[p, pos % page]

    for b, n in enumerate(lens):
        at(b, n - 1)[1][0, 3] = float("nan")  # the last position: query q_len - 1 only
        if window >= 0 and n - q_len - window >= 0:
            first = n - q_len - window  # query 0's first visible position, before every later query's window
            at(b, first)[1][0, 5] = float("inf")
            at(b, first)[1][0, 6] = float("nan")
            at(b, first)[0][1, 2] = float("nan")  # KV head 1: query 0's scores there are NaN
    at(0, 10)[1][1, 9] = float("nan")  # seen by every query of sequence 0 (KV head 1's rows)
    w = attnplan.DecodeWrapper(_cfg(merge=merge), backend="triton")
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=splits, window_left=window)
    out, lse = _out(x)
    w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                       window_left=window)
    _nan_equal(out, ref)
    _nan_equal(lse, ref_lse, torch.float32)
    assert torch.isfinite(out[0, 0, :4, 3]).all() and torch.isnan(out[0, q_len - 1, :4, 3]).all()


# -- the merges ----------------------------------------------------------------------------------------------------

def test_fused_merge_resets_between_runs_and_lengths(gen):
    """One capacity plan with the fused merge, runs at other lengths written in place into ``seq_lens`` (as a graph
    replay would), the workspace poisoned between runs: every run equals the reference and the counters are back
    at zero."""
    x = make_inputs(2, 8, 2, 32, [100, 50], page_size=16, dtype=torch.bfloat16, device=DEVICE, capacity=128,
                    generator=gen)
    w = attnplan.DecodeWrapper(_cfg(merge="fused"), backend="triton")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=4, capacity=True)
    assert plan.merge == "fused"
    for lens in ([100, 50], [3, 0], [128, 128], [0, 0], [1, 127]):
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        w.workspace.state.fill_(float("nan"))
        out, lse = _out(x)
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
        ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
        assert_close_to_reference(out, ref, torch.bfloat16)
        assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")
        assert int(w.workspace.counters.abs().sum()) == 0


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the interpreter's numpy warns on inf - inf in any lane
@pytest.mark.parametrize("merge", ["separate", "fused"])
def test_empty_units_and_rows_with_sinks(merge, gen):
    """8 units forced over lengths 0, 1, 17 and q_len 2 (query 0 of the length-1 sequence sees nothing): an empty
    row gives 0 / -inf, or the sink's logit with a finite sink; a ``-inf`` sink is no sink and gives no NaN, and no
    lane computes one (under the interpreter a NaN from ``-inf - -inf`` warns even where ``tl.where`` drops it). (A
    merged row cannot be empty: a query sees nothing only in a sequence shorter than q_len, one granule; the merge
    kernels' empty rows are tested in test_merge_kernels.py.)"""
    x = make_inputs(3, 8, 2, 32, [0, 1, 17], q_len=2, dtype=torch.bfloat16, device=DEVICE, capacity=64,
                    generator=gen)
    z = torch.randn(8, generator=gen).float()
    z[0] = z[5] = float("-inf")
    # 16-token tiles on every device (a GPU's default tile is wider: the 17-token sequence would get one unit)
    cfg = attnplan.load_config(split={"merge": merge}, plan_cache={"disk": False},
                               backend_options={"triton": {"block_n": 16}})
    for s in (None, z.to(DEVICE)):
        w = attnplan.DecodeWrapper(cfg, backend="triton")
        plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, num_splits=8, sinks=s)
        out, lse = _out(x)
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, out=out, lse=lse)
        ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale, sinks=s)
        assert_close_to_reference(out, ref, torch.bfloat16)
        assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")
        assert torch.all(out[0] == 0) and torch.all(out[1, 0] == 0)
        if s is None:
            assert torch.all(torch.isneginf(lse[0])) and torch.all(torch.isneginf(lse[1, 0]))
        else:
            assert torch.equal(lse[0, 0].cpu(), z) and torch.equal(lse[1, 0].cpu(), z)
    assert schedule_units([0, 1, 17], plan.schedule, 2).units.tolist() == [1, 1, 2]


if triton is not None:
    from attnplan.backends.triton.kernels import _merge_rows

    @triton.jit
    def _merge_rows_kernel(WS_O, WS_LSE, OUT, OUT_LSE, first, count, ws_slots, HEAD_DIM: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, UNROLL: tl.constexpr):
        """The fused merge's last-program merge (:func:`_merge_rows`) alone: rows ``[0, ROWS)`` of a contiguous
        ``[ROWS, ws_slots]`` state, slots ``[first, first + count)``."""
        offs_m = tl.arange(0, BLOCK_M)
        row_ok = offs_m < ROWS
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        o, lse = _merge_rows(WS_O, WS_LSE, offs_m.to(tl.int64) * ws_slots, first, count, row_ok, offs_d, d_ok,
                             HEAD_DIM, BLOCK_M, BLOCK_D, 32, UNROLL)
        tl.store(OUT + offs_m[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(OUT_LSE + offs_m, lse, mask=row_ok)


@pytest.mark.parametrize("count,unroll", [(1, 1), (2, 4), (5, 8), (7, 3), (33, 4), (70, 5)])
def test_fused_merge_rows_keep_the_merge_contract(count, unroll, gen):
    """The fused merge's last program (:func:`~attnplan.backends.triton.kernels._merge_rows`, its LSEs 32 slots per
    load and ``unroll`` states per step, counts that are not multiples of either) gives
    :func:`attnplan.state.merge_states` of its slot range, row by row. It keeps the NaN pattern exactly and the
    values within fp32 rounding: an all-empty row gives ``0 / -inf``; NaN in a non-empty state's ``lse`` or ``o``
    (also where that state's weight underflows to 0) makes the row NaN; NaN in empty states' ``o`` and in slots
    outside the range never leaks in; rows past ``ROWS`` and columns past ``head_dim`` are never written
    (poisoned)."""
    from attnplan.state import PartialState, merge_states

    rows, d, first = 10, 24, 2
    slots = first + count + 3
    lse = torch.randn(rows, slots, generator=gen) * 3
    o = torch.randn(rows, slots, d, generator=gen)
    empty = torch.rand(rows, slots, generator=gen) < 0.3
    lse[empty], o[empty] = float("-inf"), float("nan")  # an empty state's o is never read
    lse[0] = float("-inf")  # every state empty
    lse[1, first + count - 1] = float("nan")  # NaN lse in the last slot
    lse[2] = float("-inf")
    lse[2, first + count // 2] = float("nan")  # NaN lse among empty states
    lse[3, first], o[3, first, 5] = 0.0, float("nan")  # NaN in a non-empty o
    if count > 1:  # NaN o whose weight exp(0 - 200) underflows to 0
        lse[4, first], o[4, first, 3], lse[4, first + count - 1] = 0.0, float("nan"), 200.0
    lse[5, :first] = lse[5, first + count:] = float("nan")  # NaN outside the range
    o[6, :first] = o[6, first + count:] = float("nan")
    dev = torch.device(DEVICE)
    flat = poison(torch.empty(16 * 32, device=dev))  # out [rows, d] with row stride d, then room it must not touch
    out_lse = poison(torch.empty(16, device=dev))
    _merge_rows_kernel[(1,)](o.to(dev).contiguous(), lse.to(dev).contiguous(), flat, out_lse, first, count, slots,
                             HEAD_DIM=d, BLOCK_M=16, BLOCK_D=32, ROWS=rows, UNROLL=unroll)
    got = flat[: rows * d].view(rows, d).cpu()
    want, want_lse = merge_states(PartialState(o[None, None, :, first:first + count].double(),
                                               lse[None, None, :, first:first + count].double()))
    want, want_lse = want[0, 0].float(), want_lse[0, 0].float()
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.isnan(out_lse[:rows].cpu()),
                                                                            torch.isnan(want_lse))
    assert (got[0] == 0).all() and out_lse[0] == float("-inf")
    assert torch.isnan(got[1]).all() and torch.isnan(got[2]).all() and torch.isnan(got[3, 5])
    if count > 1:
        assert torch.isnan(got[4, 3])
    assert not torch.isnan(got[5:7]).any() and not torch.isnan(out_lse[5:7]).any()
    ok = ~torch.isnan(want)
    torch.testing.assert_close(got[ok], want[ok], rtol=1e-5, atol=1e-6)
    okl = ~torch.isnan(want_lse)
    torch.testing.assert_close(out_lse[:rows].cpu()[okl], want_lse[okl], rtol=1e-5, atol=1e-6)
    assert flat[rows * d:].isnan().all() and out_lse[rows:].isnan().all()  # nothing written past the rows


# -- GPU: realistic sizes, racing programs -------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("merge", ["separate", "fused"])
@pytest.mark.parametrize("page", [None, 16])
@pytest.mark.parametrize("q_len", [1, 4])
def test_capacity_plan_long_tail_gpu(merge, page, q_len, gen):
    """b=8, 32/8/128 bf16, capacity 32K, one long sequence among short ones: 3 runs per length vector, bitwise
    equal, each equal to the reference; fused counters at zero."""
    x = make_inputs(8, 32, 8, 128, [100] * 8, q_len=q_len, page_size=page, dtype=torch.bfloat16, device="cuda",
                    capacity=32768, generator=gen)
    w = attnplan.DecodeWrapper(_cfg(merge=merge), backend="triton")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=True)
    assert plan.merge == merge
    for lens in ([32768, 5, 100, 0, 1, 700, 2048, 9], [1] * 8, [32768] * 8):
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
        runs = []
        for _ in range(3):
            out, lse = _out(x)
            w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
            runs.append(out)
        torch.cuda.synchronize()
        assert all(torch.equal(runs[0], r) for r in runs[1:])
        assert_close_to_reference(runs[0], ref, torch.bfloat16)
        assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")
        if merge == "fused":
            assert int(w.workspace.counters.abs().sum()) == 0


def test_longest_first_batch_is_the_schedules():
    """The prologue's own copy of the batch limit of longest-first slots (its module imports nothing of attnplan's),
    a power of two of at least 16: the prologue's block (``BLOCK_B = max(16, next_pow2(batch))``) is then at most the
    limit exactly when the batch is."""
    from attnplan.backends.triton.kernels import LONGEST_FIRST_BATCH as KERNEL_LIMIT
    from attnplan.schedule import LONGEST_FIRST_BATCH

    assert KERNEL_LIMIT.value == LONGEST_FIRST_BATCH
    assert LONGEST_FIRST_BATCH >= 16 and LONGEST_FIRST_BATCH & (LONGEST_FIRST_BATCH - 1) == 0


def test_log2e_is_the_problems():
    """The kernels' own log2(e) and ln(2) (their module imports nothing of attnplan's) are the host's: the host scales
    ``sm_scale`` by ``attnplan.problem.LOG2E``, the kernels undo it for the soft cap and the LSE."""
    import math

    from attnplan.backends.triton.kernels import LN2, LOG2E
    from attnplan.problem import LOG2E as HOST_LOG2E

    assert LOG2E.value == HOST_LOG2E == 1.0 / math.log(2.0)
    assert LN2.value == math.log(2.0)
