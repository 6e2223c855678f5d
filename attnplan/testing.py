"""Test and benchmark helpers: the one tolerance table and random decode inputs.

Tolerances (FlashAttention's and xformers' practice): a kernel's error against the float64
reference must stay within a small multiple of the rounding of the output dtype itself. ``atol``
and ``rtol`` are used as ``|out - ref| <= atol + rtol * |ref|`` elementwise; the values below
are a few output ulps, because the inputs are exact in their dtype and accumulation is fp32.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from .backends.base import DecodeInputs
from .problem import DecodeProblem, default_sm_scale, dtype_name

__all__ = ["TOLERANCES", "tolerance", "make_inputs", "problem_of", "assert_close_to_reference", "poison", "poisoned_workspace", "assert_probe_matches", "DecodeCase", "DTYPES", "long_tailed_lengths",
           "bucket_schedule", "BUCKET_END_TOTALS", "TOP_BUCKET_LENGTHS"]

#: short dtype names used in test ids
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

#: dtype -> (atol, rtol) against the float64 reference; the one place tolerances are stated.
#: float32 allows TF32-free fp32 accumulation error over 10^5 terms; partial states are fp32.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 4e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for outputs of ``dtype``; fp32 for partial states whatever the input dtype."""
    return TOLERANCES[dtype]


def make_inputs(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, seq_lens, *, q_len: int = 1,
                page_size: int | None = None, dtype: torch.dtype = torch.float16, device="cpu",
                capacity: int | None = None, generator: torch.Generator | None = None,
                sm_scale: float | None = None, scale: float = 1.0, extra_pages: int = 3) -> DecodeInputs:
    """Random decode inputs with fresh draws (unless ``generator`` is seeded by the caller).

    Args:
        seq_lens: list of ``batch`` lengths in tokens.
        page_size: ``None`` for a contiguous cache; else a paged cache whose pages are a random
            permutation (so a wrong block-table lookup reads the wrong data) plus ``extra_pages``
            unused pages.
        capacity: tokens per sequence the cache holds (default: the longest length, at least 1).
        scale: standard deviation of q and KV entries.
    Returns:
        :class:`~attnplan.backends.base.DecodeInputs` on ``device``.
    Raises:
        ValueError: ``seq_lens`` does not hold ``batch`` lengths, or ``page_size`` is not ``None`` or a positive int.
    """
    lens = [int(x) for x in seq_lens]
    if len(lens) != batch:
        raise ValueError(f"seq_lens holds {len(lens)} lengths for a batch of {batch}")
    if page_size is not None and (isinstance(page_size, bool) or not isinstance(page_size, numbers.Integral)
                                  or page_size < 1):
        raise ValueError(f"page_size must be None (a contiguous cache) or a positive int, got {page_size!r}")
    cap = capacity if capacity is not None else max(max(lens), 1)
    g = generator
    # draw where the generator lives (a CUDA generator draws on the GPU: fast for GB-sized caches)
    draw_dev = g.device if g is not None else torch.device(device)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=draw_dev) * scale).to(dtype)

    q = rnd(batch, q_len, num_q_heads, head_dim)
    if page_size is None:
        k, v = rnd(batch, cap, num_kv_heads, head_dim), rnd(batch, cap, num_kv_heads, head_dim)
        block_table = None
    else:
        pages_per_seq = -(-cap // page_size)
        num_pages = batch * pages_per_seq + extra_pages
        k, v = rnd(num_pages, page_size, num_kv_heads, head_dim), rnd(num_pages, page_size, num_kv_heads, head_dim)
        perm = torch.randperm(num_pages, generator=g, device=draw_dev)[: batch * pages_per_seq]
        block_table = perm.view(batch, pages_per_seq).to(torch.int32).to(device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    scale_ = default_sm_scale(head_dim) if sm_scale is None else sm_scale
    return DecodeInputs(q.to(device), k.to(device), v.to(device), sl, block_table, scale_)


@dataclass(frozen=True)
class DecodeCase:
    """One test problem, with a readable id (``bf16-gqa4-32x8-paged16-d128-q1-len4097_1``).

    ``heads`` = (num_q_heads, num_kv_heads); ``lens`` in tokens; ``page`` None = contiguous;
    ``splits``: the split counts to run (0 = planner); window / cap / sinks: variants.
    """

    heads: tuple[int, int]
    head_dim: int
    lens: tuple[int, ...]
    q_len: int = 1
    page: int | None = None
    dtype: str = "fp16"
    splits: tuple[int, ...] = (0,)
    scale: float = 1.0
    window: int = -1
    cap: float = 0.0
    sinks: bool = False
    tags: tuple[str, ...] = field(default=())

    @property
    def id(self) -> str:
        hq, hkv = self.heads
        layout = f"paged{self.page}" if self.page else "contig"
        extra = [f"w{self.window}"] * (self.window >= 0) + [f"cap{self.cap:g}"] * (self.cap > 0) + ["sinks"] * self.sinks
        return (f"{self.dtype}-gqa{hq // hkv}-{hq}x{hkv}-{layout}-d{self.head_dim}-q{self.q_len}-"
                f"len{'_'.join(map(str, self.lens[:4]))}" + "".join("-" + t for t in (*extra, *self.tags)))

    def inputs(self, device="cpu", generator: torch.Generator | None = None) -> DecodeInputs:
        """Fresh random inputs for this case (:func:`make_inputs`)."""
        hq, hkv = self.heads
        return make_inputs(len(self.lens), hq, hkv, self.head_dim, self.lens, q_len=self.q_len, page_size=self.page,
                           dtype=DTYPES[self.dtype], device=device, generator=generator, scale=self.scale)


def long_tailed_lengths(batch: int, max_kv: int, seed: int = 0) -> list[int]:
    """KV lengths (tokens) as in serving: lognormal around ``max_kv / 16`` (sigma 1.2), clipped to
    ``[1, max_kv]``, and one sequence (the first) at ``max_kv``. Raises ``ValueError`` unless ``batch`` and
    ``max_kv`` are at least 1."""
    import math
    import random

    if batch < 1 or max_kv < 1:
        raise ValueError(f"batch and max_kv must be at least 1, got {batch} and {max_kv}")

    rng = random.Random(seed)
    lens = [max(1, min(max_kv, int(math.exp(rng.gauss(math.log(max(max_kv / 16, 1)), 1.2))))) for _ in range(batch)]
    lens[0] = max_kv
    return lens


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN so any element a kernel fails to write shows up in the comparison."""
    return t.fill_(float("nan"))


def poisoned_workspace(plan, device):
    """``Workspace.allocate(plan, device)`` with its partial state filled with NaN and ``meta`` (and ``lens``) with -7, so a
    state slot or table entry a kernel fails to write shows up (``Workspace``'s shapes and dtypes)."""
    from .backends.base import Workspace

    ws = Workspace.allocate(plan, device)
    if ws.state is not None:
        ws.state.fill_(float("nan"))
    if ws.meta is not None:
        ws.meta.fill_(-7)
    if ws.lens is not None:
        ws.lens.fill_(-7)
    return ws


def assert_probe_matches(res, meta, units, probe) -> None:
    """Assert a schedule probe's output equals :func:`attnplan.schedule.schedule_units`'s ``units``.

    ``probe``: slots. ``res``: int ``[len(probe), 8]``, per probed slot ``(b, j, start, end, units_b, c, first_b,
    cb)`` of the unit there (sequence, index in it, token range, the sequence's units, granules per unit, the slot of
    its unit 0, its granules per unit); a slot past the batch's units reports ``b = -1`` and leaves the rest at the
    probe's fill, -7. ``meta``: int ``[2 B]``, ``first`` then ``units``. Raises AssertionError naming the first slot
    that differs."""
    n = units.num_units
    in_slot = units.by_slot()
    for row, slot in zip(res.tolist(), probe):
        if slot >= n:
            assert row == [-1] + [-7] * 7, f"slot {slot} past {n}: {row}"
            continue
        k = int(in_slot[slot])
        b = int(units.seq[k])
        want = [b, k - int(units.indptr[b]), int(units.start[k]), int(units.end[k]), int(units.units[b]),
                units.granules_per_unit, int(units.first[b]), int(units.unit_granules[b])]
        assert row == want, f"slot {slot}: kernel {row}, schedule_units {want}"
    bsz = len(units.units)
    assert meta[:bsz].tolist() == units.first.tolist() and meta[bsz:].tolist() == units.units.tolist(), "meta"


#: totals of granules at both ends of buckets 2-9 (:func:`attnplan.schedule.bucket_of`: ``bit_length(T + T // 2)``)
BUCKET_END_TOTALS = (2, 3, 5, 6, 42, 43, 85, 86, 170, 171)
#: lengths (tokens, granule 16) whose totals end bucket 30 (715,827,882 granules), start bucket 31 (715,827,883), and
#: make ``T + T // 2`` pass 2^31 (15 x 2^31 - 1 tokens: bucket 31 by the clamp, not a wrapped int)
TOP_BUCKET_LENGTHS = ([16 * 89478485] * 7 + [16 * 89478487], [16 * 89478485] * 7 + [16 * 89478488], [2**31 - 1] * 15)


def bucket_schedule(total: int, units: int, max_units: int, granule: int = 16):
    """A balanced :class:`~attnplan.schedule.Schedule` (granule ``granule`` tokens, units of at least one granule, at
    most 256 per sequence, ``max_units`` slots) whose targets are 1 except ``bucket_of(total)``'s entry in both tables
    (near-uniform and long-tailed), which is ``units``: a batch of ``total`` granules gets ``units`` units in all
    (each sequence's share), a kernel that reads any other bucket one per sequence. Raises ``ValueError`` (from the
    schedule) for fields out of range."""
    from .schedule import NUM_BUCKETS, NUM_TARGETS, Schedule, bucket_of

    targets = [1] * NUM_TARGETS
    targets[bucket_of(total)] = targets[NUM_BUCKETS + bucket_of(total)] = units
    return Schedule("balanced", granule, 1, 256, tuple(targets), max_units)


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None,
                              what: str = "out") -> None:
    """Assert ``out`` equals the float64 ``ref`` within :data:`TOLERANCES` (NaN never passes, in ``out`` or in
    ``ref``; ``-inf`` must match ``-inf``)."""
    atol, rtol = tolerance(dtype or out.dtype)
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    assert o.shape == r.shape, f"{what}: shape {tuple(o.shape)} != reference {tuple(r.shape)}"
    assert not torch.isnan(o).any(), f"{what}: NaN at {torch.isnan(o).nonzero()[:5].tolist()}"
    assert not torch.isnan(r).any(), f"{what}: the reference holds NaN at {torch.isnan(r).nonzero()[:5].tolist()}"
    inf_r, inf_o = torch.isinf(r), torch.isinf(o)
    assert torch.equal(inf_r, inf_o) and torch.equal(o[inf_o], r[inf_r]), \
        f"{what}: infinities differ at {(inf_r != inf_o).nonzero()[:5].tolist()}"
    fin = ~inf_r
    err = (o[fin] - r[fin]).abs()
    bound = atol + rtol * r[fin].abs()
    if (err > bound).any():
        i = int((err - bound).argmax())
        raise AssertionError(f"{what}: max error {float(err.max()):.3e} (worst {float(err[i]):.3e} vs bound "
                             f"{float(bound[i]):.3e}, ref {float(r[fin][i]):.4f}); atol {atol}, rtol {rtol}")


#: the fp32 domain's edge (README, "fp32 range"), as ``(sm_scale, lo, hi)``: q = e_0 and K's first column drawn in
#: ``[lo, hi)``, so ``q.k`` is there; ``lo = None``: q = 0 (equal weights over V). Scaled scores of ~1e38-2e38, of one
#: sign or both in a row; the last case (-3e38 to -4e38) is past the domain
FP32_EDGE_CASES = ((1e36, 100.0, 200.0), (-1e36, 100.0, 200.0), (1e36, -200.0, 200.0), (1.0, None, None),
                   (-1e36, 300.0, 400.0))
#: V's magnitude in those cases: positive values up to this, over rows of at most 40 tokens, sum below fp32's largest
#: value only if no softmax weight exceeds 1 by more than ~3%
FP32_EDGE_V = 3.3e38 / 40


def assert_fp32_edge(out: torch.Tensor, lse: torch.Tensor, ref: torch.Tensor, ref_lse: torch.Tensor, lo,
                     dtype: torch.dtype, what: str) -> None:
    """An :data:`FP32_EDGE_CASES` case's ``out`` ``[batch, q_len, num_q_heads, head_dim]`` and fp32 ``lse`` ``[batch,
    q_len, num_q_heads]`` (any device) against the float64 ``ref`` / ``ref_lse`` of the same shapes (CPU): finite and
    within :data:`TOLERANCES` (``out`` at ``dtype``'s, ``lse`` at fp32's) inside the domain; past it (the last case,
    ``lo`` 300) the documented empty row (``out`` 0, ``lse`` -inf), or the reference within 2% where a backend still
    fits the scores. ``what`` names the case in the message. Raises ``AssertionError``."""
    if lo == FP32_EDGE_CASES[-1][1]:
        empty = bool((out == 0).all()) and bool((lse == float("-inf")).all())
        assert empty or torch.allclose(out.cpu().float(), ref.float(), rtol=2e-2), what
        return
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    assert_close_to_reference(out.cpu(), ref, dtype, f"out at {what}")
    assert_close_to_reference(lse.cpu(), ref_lse, torch.float32, f"lse at {what}")


#: the benchmarks' output check: the largest difference from a reference allowed per sequence, relative to that
#: sequence's largest output element (:func:`max_seq_rel_error`). bf16 rounding is ~0.4% of it, while a sequence
#: read in part or not at all differs by tens of percent; an absolute bound cannot tell, since on random inputs a
#: sequence's outputs shrink as 1/sqrt(length) (to ~0.02 at 128K tokens).
BENCH_CHECK_REL = 0.02


def max_seq_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max over sequences b of max|out[b] - ref[b]| / max|ref[b]|`` (``[batch, ...]`` tensors of any float dtype,
    compared in fp32; a sequence whose reference is all zeros compares its absolute difference)."""
    d = (out.float() - ref.float()).flatten(1).abs().amax(dim=1)
    m = ref.float().flatten(1).abs().amax(dim=1)
    return float(torch.where(m > 0, d / m.clamp_min(1e-30), d).max())


def problem_of(x: DecodeInputs) -> DecodeProblem:
    """The :class:`~attnplan.DecodeProblem` of inputs ``x`` with their live lengths (tokens; reads
    ``seq_lens`` to the host, so tests only) and variants (window, soft-cap, sinks, per-head fp8
    scales), for planning without the public API and its plan cache."""
    b, q_len, hq, d = x.q.shape
    lens = x.seq_lens.tolist()
    return DecodeProblem(b, hq, x.k_cache.shape[2], d, q_len, x.k_cache.shape[1] if x.paged else None,
                         dtype_name(x.q.dtype), dtype_name(x.k_cache.dtype), max(lens), sum(lens),
                         window_left=x.window_left, soft_cap=x.soft_cap, has_sinks=x.sinks is not None,
                         kv_scale="head" if x.k_scale is not None else "none")
