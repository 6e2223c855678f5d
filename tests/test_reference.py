"""The float64 reference checked against an independent dense computation."""

import pytest
import torch

from attnplan import reference
from attnplan.schedule import NUM_TARGETS, Schedule
from attnplan.testing import make_inputs


def naive(q, k, v, lens, sm_scale, window_left=-1):
    """Dense, per (b, i, h) loop: softmax over K[first:limit] of the KV head h // group (``first`` = 0, or with a
    window the query's position minus ``window_left``)."""
    b_, ql, hq, d = q.shape
    hkv = k.shape[2]
    out = torch.zeros(b_, ql, hq, d, dtype=torch.float64)
    for b in range(b_):
        for i in range(ql):
            limit = max(0, lens[b] - ql + i + 1)
            first = max(0, limit - 1 - window_left) if window_left >= 0 else 0
            for h in range(hq):
                if limit == 0:
                    continue
                kk = k[b, first:limit, h // (hq // hkv)].double()
                vv = v[b, first:limit, h // (hq // hkv)].double()
                p = torch.softmax(kk @ q[b, i, h].double() * sm_scale, 0)
                out[b, i, h] = p @ vv
    return out


def to_contiguous(x):
    """Rebuild a contiguous cache from a paged one (same logical data)."""
    ps = x.k_cache.shape[1]
    cap = x.block_table.shape[1] * ps
    pos = torch.arange(cap)
    k = torch.stack([x.k_cache[x.block_table[b].long()[pos // ps], pos % ps] for b in range(x.q.shape[0])])
    v = torch.stack([x.v_cache[x.block_table[b].long()[pos // ps], pos % ps] for b in range(x.q.shape[0])])
    return k, v


@pytest.mark.parametrize("heads", [(32, 8), (28, 4), (64, 8), (8, 1), (4, 4)], ids=lambda h: f"{h[0]}-{h[1]}")
@pytest.mark.parametrize("q_len", [1, 3])
def test_reference_matches_naive(heads, q_len, gen):
    hq, hkv = heads
    lens = [0, 1, 2, 17, 40][: 3 if hq > 16 else 5]
    x = make_inputs(len(lens), hq, hkv, 16, lens, q_len=q_len, page_size=4, dtype=torch.float32, generator=gen)
    k, v = to_contiguous(x)
    out, lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert torch.allclose(out, naive(x.q, k, v, lens, x.sm_scale), atol=1e-12)
    out_c, lse_c = reference.attention(x.q, k, v, x.seq_lens, None, x.sm_scale)
    assert torch.allclose(out, out_c, atol=1e-14)
    for b, length in enumerate(lens):
        for i in range(q_len):
            if length - q_len + i + 1 <= 0:
                assert torch.all(torch.isneginf(lse[b, i])) and torch.all(out[b, i] == 0)
            else:
                assert torch.all(torch.isfinite(lse[b, i]))


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("window_left", [0, 4, 39, 40])
def test_a_window_reads_only_its_positions(q_len, window_left, gen, monkeypatch):
    """With a sliding window the reference matches the dense computation and gathers only the positions some query
    of the sequence sees (a window over 128K tokens must not read them all), in attention() and in partial()."""
    lens = [0, 2, 17, 41]
    x = make_inputs(len(lens), 4, 2, 16, lens, q_len=q_len, page_size=4, dtype=torch.float32, generator=gen)
    k, v = to_contiguous(x)
    read = []
    gather = reference.gather_kv
    monkeypatch.setattr(reference, "gather_kv", lambda *a, start=0, **kw: (
        read.append((a[2], a[3] - start)), gather(*a, start=start, **kw))[1])
    for kc, vc, table in ((x.k_cache, x.v_cache, x.block_table), (k, v, None)):
        read.clear()
        out, _ = reference.attention(x.q, kc, vc, x.seq_lens, table, x.sm_scale, window_left=window_left)
        assert torch.allclose(out, naive(x.q, k, v, lens, x.sm_scale, window_left), atol=1e-12)
        for b, n in read:
            assert n <= min(lens[b], window_left + q_len), (b, n)
    sched = Schedule("forced", 4, 1, 16, (0,) * NUM_TARGETS, 64)  # 4-token units
    read.clear()
    st, units = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, sched,
                                  window_left=window_left)
    o, _ = reference.merge(st, indptr=units.indptr)
    assert torch.allclose(o, naive(x.q, k, v, lens, x.sm_scale, window_left), atol=1e-12)
    for b in range(len(lens)):
        assert sum(n for bb, n in read if bb == b) <= min(lens[b], window_left + q_len + 4)  # units: whole granules


def test_reference_partial_follows_the_schedule(gen):
    """Partial states of the schedule's units merge to the full attention, whatever the unit sizes."""
    x = make_inputs(2, 4, 2, 16, [50, 9], dtype=torch.float32, generator=gen)
    full, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale)
    for sched in (Schedule("forced", 8, 1, 3, (0,) * NUM_TARGETS, 6), Schedule("batch_invariant", 8, 2, 8, (0,) * NUM_TARGETS, 16)):
        st, units = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale, sched)
        assert st.num_splits == units.num_units
        o, _ = reference.merge(st, indptr=units.indptr)
        assert torch.allclose(o, full, atol=1e-12)


def test_positions_a_row_cannot_see_never_affect_it(gen):
    """NaN in K or V past a query's position (q_len 2) or before its window reaches only the rows that see it."""
    x = make_inputs(1, 4, 2, 16, [20], q_len=2, dtype=torch.float32, generator=gen)
    k, v = x.k_cache.clone(), x.v_cache.clone()
    clean, clean_lse = reference.attention(x.q, k, v, x.seq_lens, None, x.sm_scale, window_left=5)
    k[0, 19], v[0, 19] = float("nan"), float("nan")  # the last position: query 1 sees it, query 0 does not
    k[0, 13], v[0, 13] = float("nan"), float("nan")  # query 0's window starts at 13, query 1's at 14
    out, lse = reference.attention(x.q, k, v, x.seq_lens, None, x.sm_scale, window_left=5)
    assert torch.isnan(out[0, 1]).all() and torch.isnan(out[0, 0]).all()
    k[0, 13], v[0, 13] = x.k_cache[0, 13], x.v_cache[0, 13]
    out, lse = reference.attention(x.q, k, v, x.seq_lens, None, x.sm_scale, window_left=5)
    assert torch.equal(out[0, 0], clean[0, 0]) and torch.equal(lse[0, 0], clean_lse[0, 0])
    assert torch.isnan(out[0, 1]).all()
    k[0, 19], v[0, 19] = x.k_cache[0, 19], x.v_cache[0, 19]
    v[0, 13] = float("inf")  # V outside query 1's window
    out, _ = reference.attention(x.q, k, v, x.seq_lens, None, x.sm_scale, window_left=5)
    assert torch.equal(out[0, 1], clean[0, 1]) and torch.isnan(out[0, 0]).all()


def test_an_empty_row_with_a_minus_inf_sink_is_zero_and_its_lse_the_sink(gen):
    """A length-0 sequence: ``o`` is 0 (never NaN from exp(-inf - -inf)) and the LSE is the sink, ``-inf`` where
    the sink is ``-inf`` (no sink), as :func:`attnplan.state.merge_states` writes such a row."""
    x = make_inputs(2, 4, 2, 16, [5, 0], dtype=torch.float32, generator=gen)
    sinks = torch.tensor([float("-inf"), 0.3, float("-inf"), 1.0])
    o, lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale, sinks=sinks)
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    assert lse[1, 0].tolist() == sinks.double().tolist()
    assert torch.isfinite(o[0]).all() and torch.isfinite(lse[0]).all()


def test_block_table_entries_outside_the_cache_read_the_nearest_page(gen):
    """The reference clamps a page index into ``[0, num_pages)`` itself, as the kernels do (a table entry of -5
    reads page 0, one of 2^31 - 1 the last page), not only when handed a clamped table."""
    x = make_inputs(2, 4, 2, 16, [45, 38], page_size=16, dtype=torch.float32, generator=gen)
    n = x.k_cache.shape[0]
    bt = x.block_table.clone()
    bt[0, 0], bt[0, 2], bt[1, 1], bt[1, 2] = -5, n + 7, 2**31 - 1, n
    got = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, bt, x.sm_scale)
    want = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, bt.clamp(0, n - 1), x.sm_scale)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
