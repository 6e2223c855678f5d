"""Triton's split-V partition (column programs) and atomic merge (issue #10), against the float64
reference, NaN-poisoned outputs.

split-V (seed 000): ``column_programs`` programs per split, each owning ``block_dv`` V / output
columns and recomputing QK^T over full K rows; partial states keep their format. Atomic merge
(seed 000 cost 1): every program merges its state into a locked accumulator in completion order;
opt-in, refused under ``deterministic: true``; counters and locks left at zero for the next run.
On CPU the interpreter runs programs one after another (no lock contention); the ``gpu``-marked
tests run realistic sizes where programs do race.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import attnplan
from attnplan import reference
from attnplan.backends import get_backend
from attnplan.config import ConfigError
from attnplan.device import DeviceInfo
from attnplan.planner import make_plan
from attnplan.state import PartialState, merge_states
from attnplan.testing import assert_close_to_reference, make_inputs, poison

from conftest import HAS_CUDA

DEVICE = "cuda" if HAS_CUDA else "cpu"
FP8 = torch.float8_e4m3fn
pytestmark = pytest.mark.skipif(not get_backend("triton").available(torch.device(DEVICE))[0],
                                reason="triton unavailable here")


def _cfg(partition: str = "auto", merge: str = "auto", block_dv: int | None = None):
    """The default config with the partition / merge forced (atomic needs ``deterministic: false``)."""
    return attnplan.load_config(split={"partition": partition, "merge": merge}, deterministic=merge != "atomic",
                                plan_cache={"disk": False}, backend_options={"triton": {"block_dv": block_dv}})


def _check(cfg, x, splits, *, window=-1, cap=0.0, sinks=None, fp8=None, runs=1):
    """Plan ``x`` with ``cfg`` on triton, run ``runs`` times into poisoned buffers, compare each run
    with the reference; the in-kernel merges' counters and locks must be back at zero."""
    kc, vc, kw = x.k_cache, x.v_cache, {}
    if fp8 is not None:
        kc, vc = (x.k_cache.float() / 4).to(FP8), (x.v_cache.float() * 2).to(FP8)
        kw = dict(k_scale=fp8[0], v_scale=fp8[1])
    w = attnplan.DecodeWrapper(cfg, backend="triton")
    plan = w.plan(x.q, kc, vc, x.seq_lens, x.block_table, num_splits=splits, window_left=window,
                  logits_soft_cap=cap, sinks=sinks, **kw)
    ref, ref_lse = reference.attention(x.q, kc, vc, x.seq_lens, x.block_table, x.sm_scale, window_left=window,
                                       soft_cap=cap, sinks=sinks, **kw)
    for _ in range(runs):
        out = poison(torch.empty_like(x.q))
        lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32, device=DEVICE))
        w.run(x.q, kc, vc, x.seq_lens, x.block_table, out=out, lse=lse)
        assert_close_to_reference(out, ref, x.q.dtype)
        assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")
    if w.counters is not None:
        assert int(w.counters.abs().sum()) == 0, "counters / locks not reset"
    return plan, w


# -- split-V --------------------------------------------------------------------------------------

def _layouts(first, second, third):
    """A half fraction of ``first x second x third x {contiguous, paged 16}``: the layout alternates
    with the parity of the second and third factors, so every level of each factor meets both layouts
    (the interpreter runs programs one by one; the full product would take minutes)."""
    return [(a, b, c, 16 if (i + j) % 2 else None) for a in first for i, b in enumerate(second)
            for j, c in enumerate(third)]


def _ids(d, hq, hkv, ql, page):
    return f"d{d}-{hq}x{hkv}-q{ql}-{'paged16' if page else 'contig'}"


SPLIT_V_GRID = [pytest.param(d, hq, hkv, ql, page, id=_ids(d, hq, hkv, ql, page))
                for d, (hq, hkv), ql, page in _layouts((64, 96, 128), ((4, 4), (8, 2)), (1, 3))]


@pytest.mark.parametrize("head_dim,hq,hkv,q_len,page", SPLIT_V_GRID)
def test_split_v_matches_reference(head_dim, hq, hkv, q_len, page, gen):
    """Single pass and 3 splits (merge kernel, or fused for q_len 3: the last of the 3 x 2 programs of a
    group merges all columns); lengths 37, 0, 1; default block_dv = half the padded head_dim."""
    x = make_inputs(3, hq, hkv, head_dim, [37, 0, 1], q_len=q_len, page_size=page, dtype=torch.bfloat16,
                    device=DEVICE, generator=gen)
    for splits in (1, 3):
        plan, _ = _check(_cfg("split_v", "fused" if q_len == 3 else "separate"), x, splits)
        assert plan.partition == "split_v" and plan.column_programs == 2
        assert plan.grid == (splits * 2, hkv, 3) and plan.single_pass == (splits == 1)
        assert plan.kernel["block_dv"] == max(16, 1 << (head_dim - 1).bit_length()) // 2


VARIANTS = {
    "window": dict(window=9),
    "softcap": dict(cap=5.0),
    "sinks": dict(sinks=True),
    "fp8": dict(fp8=True),
    "all": dict(window=11, cap=20.0, sinks=True, fp8=True),
}


def _variant_kw(name, hq, hkv, gen):
    kw = dict(VARIANTS[name])
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(hq, generator=gen).float().to(DEVICE)
    if kw.pop("fp8", False):
        kw["fp8"] = ((torch.rand(hkv, generator=gen) + 0.5).float().to(DEVICE),
                     (torch.rand(hkv, generator=gen) + 0.5).float().to(DEVICE))
    return kw


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_split_v_variants(variant, gen):
    """Window, soft-cap, sinks (applied at merge / single-pass epilogue), fp8 KV with per-head scales."""
    x = make_inputs(3, 8, 2, 96, [40, 1, 0], q_len=3, page_size=16, dtype=torch.bfloat16, device=DEVICE,
                    generator=gen, scale=2.0 if variant == "softcap" else 1.0)
    kw = _variant_kw(variant, 8, 2, gen)
    for splits in (1, 3):
        plan, _ = _check(_cfg("split_v"), x, splits, **kw)
        assert plan.partition == "split_v"


@pytest.mark.parametrize("head_dim,block_dv,cols", [(80, 16, 5), (96, 32, 3), (64, 128, 1), (256, None, 2), (16, None, 1)])
def test_split_v_block_dv_option(head_dim, block_dv, cols, gen):
    """``backend_options.triton.block_dv`` sets the column programs: ceil(head_dim / block_dv), a slice
    wider than the padded head_dim is clamped (one program), tl.dot's 16 is the floor."""
    x = make_inputs(2, 4, 2, head_dim, [21, 3], page_size=16, device=DEVICE, generator=gen)
    plan, _ = _check(_cfg("split_v", block_dv=block_dv), x, 2)
    assert plan.column_programs == cols and plan.grid[0] == 2 * cols


def test_split_v_block_dv_must_be_a_power_of_two(gen):
    # the config refuses it when loaded, and the backend refuses it from any other source (a table)
    for bad in (48, 8):
        with pytest.raises(ConfigError, match="block_dv"):
            _cfg("split_v", block_dv=bad)
    problem = attnplan.DecodeProblem(batch=1, num_q_heads=4, num_kv_heads=2, head_dim=64, max_kv_len=5,
                                     q_dtype="float16", kv_dtype="float16")
    with pytest.raises(ValueError, match="backend_options.triton.block_dv must be a power of two"):
        get_backend("triton").kernel_config(problem, {"block_dv": 48, "partition": "split_v"}, DEVICE)


def test_split_v_partial_states_keep_the_format(gen):
    """Each split's (o, lse) in a poisoned buffer with spare splits equals ``reference.partial``; the
    states merge with the reference merge and with triton's merge kernel (formats unchanged)."""
    x = make_inputs(3, 8, 2, 96, [45, 0, 16], q_len=2, page_size=16, dtype=torch.bfloat16, device=DEVICE, generator=gen)
    w = attnplan.DecodeWrapper(_cfg("split_v"), backend="triton")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=3)
    assert plan.column_programs == 2
    b, ql, hq, d = x.q.shape
    state = PartialState.empty(b, ql, hq, plan.num_splits + 2, d, device=DEVICE).fill_(float("nan"))
    w.backend.partial(plan, x, state)
    ref = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, plan.chunk_size, 3)
    assert_close_to_reference(state.o[:, :, :, :3], ref.o, torch.bfloat16, what="partial o")
    assert_close_to_reference(state.lse[:, :, :, :3], ref.lse, torch.float32, what="partial lse")
    assert torch.isnan(state.o[:, :, :, 3:]).all() and torch.isnan(state.lse[:, :, :, 3:]).all()
    used = PartialState(state.o[:, :, :, :3].contiguous(), state.lse[:, :, :, :3].contiguous())
    full, full_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    o, lse = merge_states(PartialState(used.o.cpu().double(), used.lse.cpu().double()))
    assert_close_to_reference(o, full, torch.bfloat16)
    out = poison(torch.empty_like(x.q))
    w.backend.merge(plan, used, out, None)
    assert_close_to_reference(out, full, torch.bfloat16)


def test_split_v_explain_and_cost():
    """explain() names the partition, why, the column programs and the K re-reads; the cost model
    counts programs x column programs; the grid is the launch grid."""
    problem = attnplan.DecodeProblem(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                     q_dtype="bfloat16", kv_dtype="bfloat16", max_kv_len=32768)
    dev = DeviceInfo("NVIDIA H200", 132, (9, 0), 227 * 1024, 60 * 2**20, 4350.0, "cuda-13.0")
    be = get_backend("triton")
    kernel = {"block_n": 64, "block_dv": 64}
    kw = dict(partitions=be.partitions, merge_strategies=be.merge_strategies, num_splits=16)
    v = make_plan(problem, dev, _cfg("split_v"), "triton", kernel, **kw)
    k = make_plan(problem, dev, _cfg(), "triton", kernel, **kw)
    assert v.partition == "split_v" and v.column_programs == 2 and v.grid == (32, 8, 1) and v.num_programs == 256
    assert k.partition == "split_k" and k.column_programs == 1 and k.grid == (16, 8, 1) and k.kernel["block_dv"] is None
    text = v.explain()
    for words in ("split-v", "2 column program(s) per split", "64 of the 128", "K bytes x2", "config split.partition",
                  "16 splits x 2 column programs"):
        assert words in text, text
    assert "split-k" in k.explain() and "default (split.partition: auto)" in k.explain()
    filled = attnplan.DecodeProblem(**{**problem.to_dict(), "batch": 64, "max_kv_len": 4096, "total_kv_len": 64 * 4096})
    fv, fk = (make_plan(filled, dev, c, "triton", kernel, **{**kw, "num_splits": 1}) for c in (_cfg("split_v"), _cfg()))
    assert fv.num_programs == 2 * fk.num_programs and fv.predicted_us > fk.predicted_us  # device full: K read twice costs
    tuned = make_plan(problem, dev, _cfg(), "triton", {**kernel, "partition": "split_v"}, **kw)
    assert tuned.partition == "split_v" and "kernel option partition" in tuned.explain()


# -- atomic merge ---------------------------------------------------------------------------------

ATOMIC_GRID = [pytest.param(part, d, hq, hkv, ql, page, id=f"{part}-" + _ids(d, hq, hkv, ql, page))
               for part, (hq, hkv), ql, page in _layouts(("split_k", "split_v"), ((4, 4), (8, 2)), (1, 3))
               for d in ((128,) if ql == 1 else (64,))]


@pytest.mark.parametrize("partition,head_dim,hq,hkv,q_len,page", ATOMIC_GRID)
def test_atomic_merge_matches_reference(partition, head_dim, hq, hkv, q_len, page, gen):
    """Lengths 70, 0, 33 over 5 splits (empty splits and an all-empty row), with and without
    sinks, two runs of the same plan (the counters and locks reset themselves)."""
    x = make_inputs(3, hq, hkv, head_dim, [70, 0, 33], q_len=q_len, page_size=page, dtype=torch.bfloat16,
                    device=DEVICE, generator=gen)
    sinks = torch.randn(hq, generator=gen).float().to(DEVICE) if q_len == 3 else None
    plan, w = _check(_cfg(partition, "atomic"), x, 5, sinks=sinks, runs=2)
    cols = 2 if partition == "split_v" else 1
    assert plan.merge == "atomic" and plan.merge_grid == (0,) and plan.column_programs == cols
    assert plan.state_slots == cols and w.workspace.num_splits == cols  # one accumulator slot per column program
    assert plan.sync_words == 2 * 3 * hkv * cols and w.counters.numel() == plan.sync_words


@pytest.mark.parametrize("variant", ["window", "softcap", "fp8"])
def test_atomic_merge_variants(variant, gen):
    x = make_inputs(2, 8, 2, 64, [50, 7], q_len=2, page_size=16, dtype=torch.bfloat16, device=DEVICE, generator=gen,
                    scale=2.0 if variant == "softcap" else 1.0)
    _check(_cfg("split_v", "atomic"), x, 4, **_variant_kw(variant, 8, 2, gen))


def test_atomic_merge_is_refused_when_deterministic(tmp_path):
    """Opt-in only: ``split.merge: atomic`` with ``deterministic: true`` (the default) is a config error
    (a ValueError) naming both settings, from overrides and from a YAML file alike."""
    with pytest.raises(ValueError, match=r"split.merge: atomic .* needs deterministic: false"):
        attnplan.load_config(split={"merge": "atomic"})
    f = tmp_path / "atomic.yaml"
    f.write_text("split:\n  merge: atomic\n")
    with pytest.raises(ConfigError, match="deterministic: false"):
        attnplan.load_config(f)
    f.write_text("deterministic: false\nsplit:\n  merge: atomic\n")
    assert attnplan.load_config(f).split.merge == "atomic"
    with pytest.raises(ConfigError, match="deterministic"):
        attnplan.load_config(f).with_overrides(deterministic=True)


def test_planner_never_chooses_atomic_on_its_own():
    """``merge: auto`` picks among the deterministic strategies even when determinism is off; a
    backend without the atomic merge falls back to ``separate``."""
    dev = DeviceInfo("NVIDIA H200", 132, (9, 0), 227 * 1024, 60 * 2**20, 4350.0, "cuda-13.0")
    cfg = attnplan.load_config(deterministic=False, plan_cache={"disk": False})
    be = get_backend("triton")
    for batch, kv in ((1, 131072), (4, 4096), (2, 512)):
        problem = attnplan.DecodeProblem(batch=batch, num_q_heads=32, num_kv_heads=8, head_dim=128, max_kv_len=kv,
                                         q_dtype="bfloat16", kv_dtype="bfloat16")
        plan = make_plan(problem, dev, cfg, "triton", {"block_n": 64}, merge_strategies=be.merge_strategies)
        assert plan.merge in ("separate", "fused", "none"), plan.explain()
    atomic = _cfg(merge="atomic")
    plan = make_plan(problem, dev, atomic, "numba", {"block_n": 64}, num_splits=4)  # implements separate only
    assert plan.merge == "separate"
    plan = make_plan(problem, dev, atomic, "triton", {"block_n": 64}, num_splits=4, merge_strategies=be.merge_strategies)
    assert plan.merge == "atomic" and "NOT bitwise reproducible" in plan.explain()


def test_atomic_merge_resets_between_runs_and_lengths(gen):
    """One plan, runs at other lengths written in place into ``seq_lens`` (as a graph replay would),
    the accumulator poisoned between runs: every run equals the reference (the first program of a
    group stores its state without reading the accumulator; the last resets counter and lock)."""
    x = make_inputs(2, 8, 2, 64, [100, 50], page_size=16, dtype=torch.bfloat16, device=DEVICE, capacity=128,
                    generator=gen)
    cfg = _cfg("split_v", "atomic")
    w = attnplan.DecodeWrapper(cfg, backend="triton")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=4, capacity=True)
    assert plan.merge == "atomic" and plan.max_tokens >= 128
    for lens in ([100, 50], [3, 0], [128, 128], [0, 0], [1, 127]):
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        w.workspace.fill_(float("nan"))
        out = poison(torch.empty_like(x.q))
        lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32, device=DEVICE))
        w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, out=out, lse=lse)
        ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
        assert_close_to_reference(out, ref, torch.bfloat16)
        assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")
        assert int(w.counters.abs().sum()) == 0


def test_atomic_merge_empty_splits_and_empty_rows(gen):
    """8 splits of 32 tokens over lengths 0, 1, 17: most splits are empty (-inf states merged into the accumulator
    first, last and in between); an all-empty row gives 0 / -inf, or the sink's logit with sinks."""
    x = make_inputs(3, 8, 2, 64, [0, 1, 17], dtype=torch.bfloat16, device=DEVICE, capacity=256, generator=gen)
    sinks = torch.randn(8, generator=gen).float().to(DEVICE)
    for s in (None, sinks):
        w = attnplan.DecodeWrapper(_cfg("split_v", "atomic"), backend="triton")
        w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, num_splits=8, sinks=s)
        lse = poison(torch.empty(x.q.shape[:3], dtype=torch.float32, device=DEVICE))
        out = w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, lse=lse)
        ref, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale, sinks=s)
        assert_close_to_reference(out, ref, torch.bfloat16)
        assert_close_to_reference(lse, ref_lse, torch.float32, what="lse")
        assert torch.all(out[0] == 0)
        assert torch.all(torch.isneginf(lse[0])) if s is None else torch.equal(lse[0, 0].cpu(), s.cpu())


# -- GPU: realistic sizes, racing programs --------------------------------------------------------

GPU_MODES = [("split_v", "separate"), ("split_v", "fused"), ("split_v", "atomic"), ("split_k", "atomic")]


@pytest.mark.gpu
@pytest.mark.parametrize("partition,merge", GPU_MODES)
@pytest.mark.parametrize("page", [None, 16])
@pytest.mark.parametrize("splits", [0, 16])
def test_split_v_and_atomic_gpu(partition, merge, page, splits, gen):
    """b=2, 32/8/128, KV up to 4096, bf16: the planner's split count and 16 forced; 3 runs each."""
    x = make_inputs(2, 32, 8, 128, [4096, 1000], page_size=page, dtype=torch.bfloat16, device="cuda", generator=gen)
    plan, _ = _check(_cfg(partition, merge), x, splits, runs=3)
    assert plan.partition == partition and plan.merge in (merge, "none")


@pytest.mark.gpu
@pytest.mark.parametrize("partition,merge", GPU_MODES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_split_v_and_atomic_variants_gpu(partition, merge, variant, gen):
    x = make_inputs(2, 32, 8, 128, [3000, 17], q_len=4, page_size=16, dtype=torch.bfloat16, device="cuda",
                    generator=gen, scale=2.0 if variant == "softcap" else 1.0)
    _check(_cfg(partition, merge), x, 12, runs=2, **_variant_kw(variant, 32, 8, gen))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_split_v_head_dims_gpu(head_dim, gen):
    x = make_inputs(2, 16, 4, head_dim, [2049, 1], page_size=16, dtype=torch.float16, device="cuda", generator=gen)
    for merge in ("separate", "atomic"):
        _check(_cfg("split_v", merge), x, 8)
