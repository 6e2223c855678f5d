"""Every kernel backend runs the device-side schedule exactly: capacity plans on long-tailed and padded batches,
forced and batch-invariant schedules, poisoned outputs and workspaces, bitwise reruns and batch invariance.

On CPU the backends run in Triton's interpreter / numba's simulator at small sizes (the CUDA C backend runs in its
own host emulation tests and on the GPU); on a GPU the same tests run on the device.
"""

from __future__ import annotations

import pytest
import torch

import attnplan
from attnplan import reference
from attnplan.backends import get_backend
from attnplan.config import load_config
from attnplan.schedule import schedule_units
from attnplan.testing import assert_close_to_reference, make_inputs

from conftest import HAS_CUDA, kernel_backends

DEVICE = "cuda" if HAS_CUDA else "cpu"
BACKENDS = kernel_backends(DEVICE)
DT = torch.bfloat16 if HAS_CUDA else torch.float16

# (lens, q_len, page, window, softcap, sinks): long-tailed, padded (zeros), uniform, and variants
CASES = [
    ((300, 5, 0, 40), 1, 16, -1, 0.0, False),
    ((257, 0, 0, 0), 2, None, -1, 0.0, True),
    ((64, 64, 64), 1, 8, -1, 0.0, False),
    ((200, 31, 7), 3, 16, 20, 0.0, False),
    ((150, 1), 1, None, -1, 30.0, True),
]


def _ids(c):
    lens, q_len, page, window, cap, sinks = c
    return (f"len{'_'.join(map(str, lens))}-q{q_len}-{'paged' + str(page) if page else 'contig'}"
            + (f"-w{window}" if window >= 0 else "") + (f"-cap{cap:g}" if cap else "") + ("-sinks" if sinks else ""))


#: query / KV heads: GQA group 4 on one KV head (the schedule is per sequence; the KV-head grid axis and its
#: offsets are checked by tests/test_backends.py on several KV heads)
HEADS = (4, 1)


def _inputs(lens, q_len, page, gen, capacity=None):
    return make_inputs(len(lens), *HEADS, 32, list(lens), q_len=q_len, page_size=page, dtype=DT, device=DEVICE,
                       generator=gen, capacity=capacity or max(max(lens), 1) + 9)


def _run(w, x, out=None, lse=None):
    out = torch.full_like(x.q, float("nan")) if out is None else out
    lse = torch.full(x.q.shape[:3], float("nan"), device=x.q.device) if lse is None else lse
    w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
    return out, lse


def _check(x, out, lse, window=-1, cap=0.0, sinks=None):
    ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale,
                                       window_left=window, soft_cap=cap, sinks=sinks)
    assert_close_to_reference(out, ref)
    assert_close_to_reference(lse, ref_lse, torch.float32, "lse")


@pytest.mark.parametrize("case", CASES, ids=_ids)
# forced counts (full tier) are what tests/test_backends.py's and tests/test_variants.py's decode cases plan
@pytest.mark.parametrize("mode", ["capacity", "live", pytest.param("forced3", marks=pytest.mark.full), "invariant"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_schedule_matches_reference(backend, mode, case, gen):
    """The plan for the capacity (or live lengths, a forced count, the batch-invariant schedule) serves the lengths;
    output and lse written for every row (poisoned with NaN before), the workspace poisoned too."""
    lens, q_len, page, window, cap, with_sinks = case
    cfg = load_config(split={"batch_invariant": mode == "invariant", "invariant_chunk_tokens": 32})
    x = _inputs(lens, q_len, page, gen)
    sinks = torch.randn(HEADS[0], generator=gen).to(DEVICE) if with_sinks else None
    w = attnplan.DecodeWrapper(cfg, backend=backend)
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=mode in ("capacity", "invariant"),
           num_splits=3 if mode == "forced3" else None, window_left=window, logits_soft_cap=cap, sinks=sinks)
    if w.workspace.state is not None:
        w.workspace.state.fill_(float("nan"))
    out, lse = _run(w, x)
    _check(x, out, lse, window, cap, sinks)


@pytest.mark.parametrize("merge", ["separate", "fused"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_capacity_plan_replays_changing_lengths(backend, merge, gen):
    """One capacity plan, many length vectors (one long among short, all zero, all full): each equals the
    reference, and two runs of the same lengths are bitwise equal (fixed merge order). On a GPU the capacity is
    4096 tokens: there a plan's targets (from the device's split choice) can leave a 200-token sequence one unit."""
    if merge not in get_backend(backend).merge_strategies:
        pytest.skip(f"{backend} has no {merge} merge (the config's choice falls back to separate: the other case)")
    # on the CPU a capacity at which each backend's capacity plan spreads the long sequence (cuda_ptx's
    # emulation, tests/test_cuda_ptx_emulation.py, plans larger granules)
    cap = 4096 if DEVICE == "cuda" else 200 if backend == "cuda_ptx" else 128
    cfg = load_config(split={"merge": merge})
    x = _inputs([cap, 3, 0, 50], 1, 16, gen, capacity=cap)
    w = attnplan.DecodeWrapper(cfg, backend=backend)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=True)
    assert not plan.single_pass
    for lens in ([cap, 3, 0, 50], [0, 0, 0, 0], [cap] * 4, [1, cap, 17, 2]):
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out, lse = _run(w, x)
        _check(x, out, lse)
        again, again_lse = _run(w, x)
        assert torch.equal(out, again) and torch.equal(lse, again_lse)
    u = schedule_units([cap, 3, 0, 50], plan.schedule)
    assert int(u.units[0]) > 1, "the long sequence is spread over several units"


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariant_outputs_are_bitwise_independent_of_batchmates(backend, gen):
    """split.batch_invariant: the same sequence (same q, same KV) in batches with different batchmates gives
    bitwise the same output."""
    cfg = load_config(split={"batch_invariant": True, "invariant_chunk_tokens": 32})
    x = _inputs([180, 7, 0, 90], 1, 16, gen, capacity=200)
    w = attnplan.DecodeWrapper(cfg, backend=backend)
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=True)
    first, _ = _run(w, x)
    x.seq_lens.copy_(torch.tensor([180, 200, 150, 1], dtype=torch.int32))  # other batchmates, same sequence 0
    second, _ = _run(w, x)
    assert torch.equal(first[0], second[0])
    _check(x, second, _run(w, x)[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_programs_without_a_unit_write_nothing(backend, gen):
    """Slots past the batch's units exit: the workspace slots they would own keep their poison, and out rows are
    written by the units that own them (no stray writes into other sequences)."""
    cfg = load_config()
    # a capacity plan for 1,024 tokens a sequence run at 120: fewer units than the grid's slots on every backend
    x = _inputs([120, 0, 0, 0], 1, 16, gen, capacity=1024)
    w = attnplan.DecodeWrapper(cfg, backend=backend)
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, capacity=True)
    used = schedule_units(x.seq_lens.tolist(), plan.schedule).num_units
    if w.workspace.state is not None:
        w.workspace.state.fill_(float("nan"))
    out, lse = _run(w, x)
    _check(x, out, lse)
    if w.workspace.state is not None:
        assert used < plan.schedule.max_units, (used, plan.schedule.max_units)  # else nothing here is checked
        assert torch.isnan(w.workspace.state.o[:, :, :, used:]).all()
        assert torch.isnan(w.workspace.state.lse[:, :, :, used:]).all()
