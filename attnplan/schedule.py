"""The device-side split-KV schedule: which program does which (sequence, KV head, token range).

A plan fixes what a CUDA graph needs (the grid, the work granularity, the workspace); the mapping of the
live lengths to programs is recomputed at every launch, on the GPU, from ``seq_lens`` (FlashAttention-3's
``hopper/flash_prepare_scheduler.cu`` chooses splits per batch on the device the same way; FlashInfer's
balanced decode plan and stream-K / LeanAttention balance work per program). So one plan made for the
cache's capacity before capture serves every replay, and a long sequence among short ones is spread over
many programs instead of one.

This module is the schedule written once, in host code: every backend's kernels compute exactly these
integers in a prologue (32-bit arithmetic suffices: the planner keeps a batch's capacity below 2^31 granules;
kernels write ``ceil(a / b)`` as ``(a - 1) // b + 1`` for ``a >= 1`` so no sum overflows), and the reference backend, the tests and :meth:`SplitPlan.explain`
call :func:`schedule_units` directly.

Definitions (all integers; ``B`` sequences, ``Q`` queries per sequence, ``G`` tokens per granule):

* Sequence ``b`` of length ``L`` sees the positions ``[base, L)``, ``base = max(0, L - Q - window_left)``
  with a sliding window, else ``0``; its span ``n = L - base`` covers ``nb = ceil(n / G)`` granules.
* The batch holds ``T = sum_b nb`` granules, its longest sequence ``nb_max``. The plan's ``targets`` table
  gives the wanted number of work units for a batch of that size: ``t = targets[k + 32 * tail]`` with
  ``k = min(bit_length(T + (T >> 1)), 31)`` (:func:`bucket_of`: bucket ``k`` holds ``T`` in
  ``[ceil(2^k / 3), ceil(2^(k+1) / 3))``, so ``T = 2^n`` sits near its bucket's geometric middle) and
  ``tail = 2 * T < B * nb_max`` (a long-tailed batch, padding slots counted:
  entries 32-63 are a second table for those; a near-uniform batch reads entries 0-31).
* Granules per unit: ``c = max(min_unit_granules, ceil(T / t))``, or ``min_unit_granules`` when ``t == 0``
  (batch-invariant and forced schedules: no dependence on the batchmates).
* Units of ``b``: ``u = min(max_units_per_seq, ceil(nb / c))``, then equal sizes ``cb = ceil(nb / u)``
  granules and ``units = ceil(nb / cb)`` (``<= u``: every unit non-empty). A sequence with ``nb == 0``
  (length 0, or no visible position) still gets one (empty) unit, so its output is written.
* ``indptr`` is the exclusive prefix sum of ``units`` in sequence order; the batch has ``U = indptr[B]``
  units, ``U <= max_units`` always (``max_units`` is chosen by the planner from this bound:
  ``sum_b ceil(nb / c) <= T / c + B <= max(targets) + B``; ``B * max_units_per_seq`` where a bucket holding work
  has no target: :func:`max_units_bound`).
* Unit ``j`` of ``b`` covers tokens ``[base + j * cb * G, min(base + (j + 1) * cb * G, L))``.
* Slots, longest units first: sequence ``b``'s units occupy the consecutive slots ``[first[b], first[b] +
  units[b])``, unit ``j`` in slot ``first[b] + j``. In a batch of at most :data:`LONGEST_FIRST_BATCH` (32)
  sequences the sequences take the slots in order of decreasing ``cb``, ties by index (an empty sequence,
  ``cb = 0``, last), so ``first[b]`` is the sum of ``units[i]`` over the sequences ``i`` with ``cb[i] > cb[b]``,
  or ``cb[i] == cb[b]`` and ``i < b``; a larger batch takes them in index order (``first = indptr[:-1]``). A grid
  fills the SMs in slot order, so where the units make more than one wave of programs the longest start first
  and the wave's tail is short units (longest-processing-time-first list scheduling; FlashAttention-3's
  ``hopper/flash_prepare_scheduler.cu`` orders a varlen batch the same way, ``varlen_sort_batches``). The slot
  changes where a unit runs and where its partial state goes, never what it computes or the merge order.

Programs: a 1-D grid of ``max_units * num_kv_heads`` programs; program ``p`` serves grid slot ``s = p //
num_kv_heads`` for KV head ``h = p % num_kv_heads`` (unit-major). Slot ``s`` runs unit ``s`` (packed: the slots
``s >= U`` come last and exit), except where the prologue knows ``U`` before its search and the grid holds more
than ``pack`` slots per unit: there :func:`slot_unit` spreads the ``U`` units evenly over the slots, and the
slots between them exit (cuda_ptx: batches of at most 32 sequences, ``pack`` 1; for plans that may see long-tailed
batches, from 2 KV heads on, over at most the first :func:`spread_window` slots; triton: batches of one prologue
block, at most 1,024 sequences, ``pack`` 2, over the whole grid). A sequence with one unit writes ``out`` /
``lse`` directly (sinks applied there); with more, unit ``u`` writes its partial state into workspace slot ``u``
(whichever grid slot ran it) and the merge combines slots ``[first[b], first[b] + units[b])`` in slot order (the
kernels write ``first`` and ``units`` to the workspace's ``meta``).

Lengths on the device: the kernels read each length as ``min(max(seq_lens[b], 0), capacity)`` (``capacity`` the
tokens a sequence of the cache holds), so a length written after ``plan()`` (or found at a CUDA-graph replay) outside
``[0, capacity]`` is the clamped one in every definition above, in every program alike. :func:`schedule_units` and
:func:`check_invariants` take the same ``capacity``; without it a negative length is refused (a host length outside
the capacity is refused by the input validation before any schedule).

Invariants (tested for many length vectors, :func:`check_invariants`): every visible position of every
sequence lies in exactly one unit; units of a sequence are contiguous, in order and non-empty (except the
one empty unit of an empty sequence); ``1 <= units[b] <= max_units_per_seq``; ``U <= max_units``; the sequences'
slot ranges tile ``[0, U)`` in the order above; with ``targets`` all zero, a sequence's units depend on its own
length alone (batch invariance; its slots may move with its batchmates, its arithmetic does not).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Schedule", "Units", "schedule_units", "check_invariants", "clamp_lengths", "NUM_TARGETS", "NUM_BUCKETS",
           "POLICIES", "LONGEST_FIRST_BATCH", "SPREAD_PROGRAMS_PER_SM", "SPREAD_MIN_KV_HEADS", "bucket_of",
           "bucket_range", "max_units_bound", "is_long_tailed", "slot_unit", "spread_window", "first_slots"]

#: buckets of batch work: ``k = bit_length(T + (T >> 1))`` for ``T`` total granules, clamped to ``NUM_BUCKETS - 1``
NUM_BUCKETS = 32
#: entries of the targets table: the near-uniform table (``[0, 32)``), then the long-tailed one (``[32, 64)``)
NUM_TARGETS = 2 * NUM_BUCKETS
#: ``balanced``: units from the batch's total work (default); ``batch_invariant``: from each sequence's own length;
#: ``forced``: up to ``max_units_per_seq`` units per sequence (a forced split count); ``single``: one unit each
POLICIES = ("balanced", "batch_invariant", "forced", "single")
#: the largest batch whose sequences take the slots longest units first (each sequence's first slot counted from
#: every other's: a warp's shuffles on cuda_ptx, a ``[32, 32]`` comparison in Triton's prologue); a larger batch
#: takes them in index order, a scan. Measured on an H100 (benchmarks/NOTES.md, "Longest units first"): 1-5% faster
#: at batch 16, but 5-25% slower at 8/1/128 batch 64 with the order up to 64, so the order stops at one warp's batch
LONGEST_FIRST_BATCH = 32
#: the spread window of :func:`slot_unit`, in programs per SM (:func:`spread_window`; cuda_ptx's 4-warp programs: 3
#: fit per SM on sm_90). Measured on an H100 (benchmarks/NOTES.md, "Where a capacity plan's working programs sit: the
#: spread's window"), capacity plans of 8 KV heads whose grid of 384 programs the SMs hold at once: level to 8% faster
#: with their working programs within the first 264 programs than spread over all 384 (16 sequences of 16K tokens 369
#: -> 352 us); at one KV head 4-5% slower (8/1/128 b16), so below :data:`SPREAD_MIN_KV_HEADS` KV heads the units
#: spread over the whole grid, as before. Unmeasured: 2-7 and more than 8 KV heads, other values of this constant
SPREAD_PROGRAMS_PER_SM = 2
#: the fewest KV heads for which :func:`spread_window` bounds the spread (above; measured at 1 and 8 only)
SPREAD_MIN_KV_HEADS = 2


def bucket_of(total_granules: int) -> int:
    """Bucket of a batch of ``T = total_granules`` granules: ``bit_length(T + (T >> 1))`` (of ``floor(3 T / 2)``), at
    most ``NUM_BUCKETS - 1`` (31). Bucket ``k`` holds ``[ceil(2^k / 3), ceil(2^(k+1) / 3))`` (:func:`bucket_range`):
    each bucket holds one power of two, ``2^(k-1)``, at most 6.1% above its geometric middle: the planner plans
    the bucket there (:func:`attnplan.planner.make_plan`), at the total of a uniform batch of a power-of-two batch
    and length (where live plans are made and split-table rows measured), not at a bucket's end between two rows."""
    t = int(total_granules)
    return min((t + (t >> 1)).bit_length(), NUM_BUCKETS - 1)


def bucket_range(k: int) -> tuple[int, int | None]:
    """The totals of granules bucket ``k`` holds (:func:`bucket_of`), ``(lo, hi)`` inclusive; ``hi`` is ``None`` for
    the last bucket (``NUM_BUCKETS - 1``), which holds every larger total too. Raises ``ValueError`` for ``k``
    outside ``[0, NUM_BUCKETS)``."""
    if not 0 <= k < NUM_BUCKETS:
        raise ValueError(f"bucket {k} is not in [0, {NUM_BUCKETS})")
    if k == 0:
        return 0, 0
    lo = -(-(1 << k) // 3)
    return lo, (None if k == NUM_BUCKETS - 1 else -(-(1 << (k + 1)) // 3) - 1)


def is_long_tailed(total_granules: int, batch: int, max_granules: int) -> bool:
    """Whether a batch reads the long-tailed targets table: ``2 * T < batch * nb_max`` (its mean below half its
    longest; padding slots of length 0 count in ``batch``)."""
    return 2 * int(total_granules) < int(batch) * int(max_granules)


@dataclass(frozen=True)
class Schedule:
    """The schedule's plan-time constants (part of :class:`attnplan.SplitPlan`).

    Attributes:
        policy: one of :data:`POLICIES`.
        granule: tokens per granule; a multiple of the kernel's KV tile (``block_n``) and of the page size.
        min_unit_granules: fewest granules a unit gets (``c``'s floor; the planner's smallest chunk).
        max_units_per_seq: most units (splits) one sequence may get; 1 = single pass (no partial states, no merge).
        targets: :data:`NUM_TARGETS` ints: the wanted units per batch by bucket of total granules, for near-uniform
            batches (``[0, 32)``) then for long-tailed ones (``[32, 64)``); 0 = none.
        max_units: unit slots: the grid's unit axis and the workspace's split axis, at least the batch.
    Raises:
        ValueError: on construction, when a field is out of range (names the field).
    """

    policy: str
    granule: int
    min_unit_granules: int
    max_units_per_seq: int
    targets: tuple[int, ...]
    max_units: int

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"Schedule.policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("granule", "min_unit_granules", "max_units_per_seq", "max_units"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v >= 1 << 31:
                raise ValueError(f"Schedule.{name} must be an int in [1, 2^31), got {v!r}")
        t = self.targets
        if not isinstance(t, tuple) or len(t) != NUM_TARGETS or any(
                isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 1 << 31 for x in t):
            raise ValueError(f"Schedule.targets must be a tuple of {NUM_TARGETS} ints in [0, 2^31), got {t!r}")
        if self.policy == "single" and self.max_units_per_seq != 1:
            raise ValueError("a single-pass schedule has max_units_per_seq 1")
        if self.policy in ("batch_invariant", "forced", "single") and any(t):
            raise ValueError(f"a {self.policy} schedule has no targets (all zero)")

    @property
    def sized_by_lengths(self) -> bool:
        """Units sized from the live lengths (``balanced``, ``batch_invariant``): one long sequence among short ones
        may hold most of the units while its batchmates' rows have one."""
        return self.policy in ("balanced", "batch_invariant")

    @property
    def single_pass(self) -> bool:
        """One unit per sequence: programs write the output directly; no workspace, no merge."""
        return self.max_units_per_seq == 1

    def to_dict(self) -> dict:
        return {"policy": self.policy, "granule": self.granule, "min_unit_granules": self.min_unit_granules,
                "max_units_per_seq": self.max_units_per_seq, "targets": list(self.targets),
                "max_units": self.max_units}

    @staticmethod
    def from_dict(d: dict) -> "Schedule":
        """Inverse of :meth:`to_dict`. Raises ``TypeError``/``KeyError``/``ValueError`` on bad input (``KeyError``: a
        key missing; ``ValueError``: unknown keys, or a field out of range; ``TypeError``: ``targets`` not a list)."""
        if not isinstance(d, dict):
            raise TypeError(f"schedule must be a mapping, got {type(d).__name__}")
        unknown = set(d) - {"policy", "granule", "min_unit_granules", "max_units_per_seq", "targets", "max_units"}
        if unknown:
            raise ValueError(f"unknown schedule keys {sorted(map(str, unknown))}")
        if not isinstance(d.get("targets", ()), (list, tuple)):  # (a missing key: KeyError below)
            raise TypeError(f"schedule targets must be a list of ints, got {type(d['targets']).__name__}")
        return Schedule(policy=d["policy"], granule=d["granule"], min_unit_granules=d["min_unit_granules"],
                        max_units_per_seq=d["max_units_per_seq"], targets=tuple(d["targets"]),
                        max_units=d["max_units"])


def max_units_bound(schedule_targets, batch: int, max_units_per_seq: int) -> int:
    """The most units any length vector can produce under a balanced schedule: ``min(B * S, max(t) + B)`` (units of
    ``c >= T / t`` granules: ``sum ceil(nb / c) <= T / c + B <= t + B``), or ``B * S`` where a bucket that holds work
    has no target (a zero outside buckets 0 and 32: its units are of ``min_unit_granules``, as many as the lengths
    make)."""
    if any(t == 0 for k, t in enumerate(schedule_targets) if k % NUM_BUCKETS):
        return batch * max_units_per_seq
    return min(batch * max_units_per_seq, max(schedule_targets) + batch)


def spread_window(sm_count: int, num_kv_heads: int) -> int:
    """The slots a batch's units are spread over at most (:func:`slot_unit`'s ``window``): ``ceil(SPREAD_PROGRAMS_PER_SM
    x sm_count / num_kv_heads)``, ``SPREAD_PROGRAMS_PER_SM`` programs per SM (each slot runs one program per KV head),
    at least 1; 0 (the whole grid) for fewer than :data:`SPREAD_MIN_KV_HEADS` KV heads. cuda_ptx applies it to plans
    that may see long-tailed batches (``attnplan.backends.cuda_ptx.spread_slots``).

    Raises:
        ValueError: ``sm_count`` or ``num_kv_heads`` below 1.
    """
    if sm_count < 1 or num_kv_heads < 1:
        raise ValueError(f"sm_count and num_kv_heads must be >= 1, got {sm_count} and {num_kv_heads}")
    if num_kv_heads < SPREAD_MIN_KV_HEADS:
        return 0
    return -(-SPREAD_PROGRAMS_PER_SM * int(sm_count) // int(num_kv_heads))


def slot_unit(slot: int, num_units: int, slots: int, pack: int = 1, window: int = 0) -> int:
    """The unit that grid slot ``slot`` of ``slots`` runs when the live batch has ``num_units <= slots`` units, or
    -1 (the slot exits). Let ``S = min(slots, window)`` (``S = slots`` for ``window`` 0): where ``S`` is more than
    ``pack`` times the units, the units are spread evenly over the first ``S`` slots: unit ``u`` runs in slot
    ``floor(u S / U)``, so slot ``s < S`` runs ``u = ceil(s U / S)`` when ``floor(u S / U) == s`` (a bijection from
    ``[0, U)`` onto those slots; slot 0 always runs unit 0), and the slots from ``S`` on exit; else they are packed,
    slot ``u`` running unit ``u`` for ``u < U`` (the empty slots last). The kernels apply it where the prologue
    knows ``U`` for free (cuda_ptx: batches of at most 32, one warp's schedule, ``pack`` 1, ``window``
    :func:`spread_window`; triton: batches of one prologue block, ``pack`` =
    ``attnplan.backends.triton.kernels.PACK_SLOTS_PER_UNIT``, no window): the working programs of a grid much larger
    than its units are then spread over the grid's order instead of packed at its start, which the hardware hands
    out to the SMs in order (an H200, cuda_ptx, 64 working programs in a grid of 160: 263 us spread against 320
    packed; why one placement streams faster is not established, benchmarks/NOTES.md); the
    window bounds how thinly (an H100, cuda_ptx, 16 units x 8 KV heads in 48 slots, all resident at once: 369 us
    spread over the 48, 352 over the first 33, 347 for a single pass of exactly its programs). The state of unit
    ``u`` still goes to workspace slot ``u``.

    Raises:
        ValueError: ``num_units`` outside ``[1, slots]``, or ``window`` below 0.
    """
    if not 1 <= num_units <= slots:
        raise ValueError(f"num_units must be in [1, slots={slots}], got {num_units}")
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    spread = min(slots, window) if window else slots
    if spread <= pack * num_units:
        return slot if slot < num_units else -1
    if slot >= spread:
        return -1
    u = (slot * num_units + spread - 1) // spread
    return u if u < num_units and (u * spread) // num_units == slot else -1


@dataclass(frozen=True)
class Units:
    """The schedule of one batch (host integers, int64 CPU tensors).

    Attributes:
        base: ``[B]`` first visible position of each sequence.
        granules: ``[B]`` granules of each sequence's span (``nb``).
        unit_granules: ``[B]`` granules per unit (``cb``; 0 for an empty sequence).
        units: ``[B]`` units per sequence (>= 1).
        indptr: ``[B + 1]`` first unit of each sequence in sequence order (the exclusive prefix sum of ``units``);
            ``indptr[B]`` = total units ``U``. Unit ``indptr[b] + j`` is unit ``j`` of ``b``.
        seq, start, end: ``[U]`` each unit's sequence and token range ``[start, end)``, in sequence order.
        first: ``[B]`` the slot of each sequence's unit 0 (:func:`first_slots`): unit ``j`` of ``b`` runs in grid
            slot ``first[b] + j`` and writes its partial state to workspace slot ``first[b] + j``.
        slot: ``[U]`` each unit's slot, ``first[seq] + j`` (a permutation of ``[0, U)``).
        total_granules: ``T``; granules_per_unit: ``c``; target: ``t``, the targets table's entry for this batch
            (0: none, units from each sequence's own length).
    """

    base: torch.Tensor
    granules: torch.Tensor
    unit_granules: torch.Tensor
    units: torch.Tensor
    indptr: torch.Tensor
    seq: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    total_granules: int
    granules_per_unit: int
    target: int
    first: torch.Tensor
    slot: torch.Tensor

    @property
    def num_units(self) -> int:
        return int(self.indptr[-1])

    def by_slot(self) -> torch.Tensor:
        """``[U]`` the unit (sequence-order index) in each slot: the inverse of :attr:`slot`; gathering a workspace's
        ``[..., U, ...]`` states with it puts them in sequence order, the ragged layout of ``indptr``."""
        inv = torch.empty_like(self.slot)
        inv[self.slot] = torch.arange(self.slot.numel())
        return inv


def first_slots(unit_granules, units) -> torch.Tensor:
    """``first[b]``, the slot of sequence ``b``'s unit 0 (the module docstring's "Slots, longest units first"), from
    ``cb`` (``unit_granules``) and ``units``, both ``[B]``: an int64 ``[B]`` CPU tensor."""
    cb = torch.as_tensor(unit_granules).to("cpu", torch.int64).reshape(-1)
    un = torch.as_tensor(units).to("cpu", torch.int64).reshape(-1)
    if un.numel() > LONGEST_FIRST_BATCH:  # index order: the exclusive prefix sum
        return torch.cumsum(un, 0) - un
    order = torch.argsort(-cb, stable=True)  # cb descending, ties by index
    first = torch.empty_like(un)
    first[order] = torch.cumsum(un[order], 0) - un[order]
    return first


def clamp_lengths(seq_lens, capacity: int) -> torch.Tensor:
    """The lengths as the kernels read them: each clamped into ``[0, capacity]``, an int64 ``[B]`` CPU tensor.

    Raises:
        ValueError: ``capacity`` negative.
    """
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    return torch.as_tensor(seq_lens).to("cpu", torch.int64).reshape(-1).clamp(0, int(capacity))


def _host_lengths(seq_lens, capacity: int | None) -> torch.Tensor:
    """``seq_lens`` as an int64 ``[B]`` CPU tensor, clamped into ``[0, capacity]`` when ``capacity`` is given."""
    if capacity is not None:
        return clamp_lengths(seq_lens, capacity)
    return torch.as_tensor(seq_lens).to("cpu", torch.int64).reshape(-1)


def schedule_units(seq_lens, schedule: Schedule, q_len: int = 1, window_left: int = -1,
                   capacity: int | None = None) -> Units:
    """The schedule of a batch: the module docstring's definitions, computed on the host.

    Args:
        seq_lens: ``[B]`` lengths in tokens (a list or a tensor; read to the host).
        schedule: the plan's :class:`Schedule`.
        q_len: queries per sequence; window_left: sliding window in tokens, ``-1`` = none.
        capacity: tokens a sequence of the cache holds; given, each length is first clamped into ``[0, capacity]``
            as the kernels clamp the lengths they read (:func:`clamp_lengths`; ``Units.start`` / ``end`` then lie in
            the clamped span). ``None``: the lengths as given.
    Returns:
        :class:`Units`.
    Raises:
        ValueError: a negative length (without ``capacity``), or a negative ``capacity``.
    """
    lens = _host_lengths(seq_lens, capacity)
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError(f"seq_lens must be >= 0, got {lens.tolist()[:16]}")
    g = schedule.granule
    if window_left >= 0:
        base = (lens - q_len - window_left).clamp(min=0)
    else:
        base = torch.zeros_like(lens)
    nb = (lens - base + g - 1) // g
    total = int(nb.sum())
    tail = is_long_tailed(total, lens.numel(), int(nb.max()) if nb.numel() else 0)
    t = schedule.targets[bucket_of(total) + NUM_BUCKETS * tail]
    c = schedule.min_unit_granules if t == 0 else max(schedule.min_unit_granules, -(-total // t))
    u = torch.clamp((nb + c - 1) // c, max=schedule.max_units_per_seq)
    empty = nb == 0
    u = torch.where(empty, torch.ones_like(u), u)
    cb = torch.where(empty, torch.zeros_like(nb), (nb + u - 1) // u)
    units = torch.where(empty, torch.ones_like(u), (nb + cb.clamp(min=1) - 1) // cb.clamp(min=1))
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(units, 0)
    seq = torch.repeat_interleave(torch.arange(lens.numel()), units)
    j = torch.arange(int(indptr[-1])) - indptr[:-1][seq]
    start = base[seq] + j * cb[seq] * g
    end = torch.minimum(start + cb[seq] * g, lens[seq])
    start = torch.where(empty[seq], lens[seq], start)
    end = torch.where(empty[seq], lens[seq], end)
    first = first_slots(cb, units)
    return Units(base, nb, cb, units, indptr, seq, start, end, total, c, int(t), first, first[seq] + j)


def check_invariants(seq_lens, schedule: Schedule, q_len: int = 1, window_left: int = -1,
                     capacity: int | None = None) -> Units:
    """Assert the module docstring's invariants for one batch; returns its :class:`Units`. With ``capacity`` the
    lengths are clamped into ``[0, capacity]`` first (:func:`schedule_units`) and the invariants hold for the
    clamped lengths.

    Raises:
        AssertionError: naming the invariant and the first sequence that breaks it.
    """
    lens = _host_lengths(seq_lens, capacity)
    s = schedule_units(lens, schedule, q_len, window_left)
    assert s.num_units <= schedule.max_units, f"{s.num_units} units exceed max_units {schedule.max_units}"
    if s.units.numel():
        assert int(s.units.min()) >= 1, "a sequence has no unit"
        assert int(s.units.max()) <= schedule.max_units_per_seq, \
            f"a sequence has more than max_units_per_seq = {schedule.max_units_per_seq} units"
    assert sorted(s.slot.tolist()) == list(range(s.num_units)), "the units' slots are not a permutation of [0, U)"
    n = lens.numel()
    order = sorted(range(n), key=lambda b: int(s.first[b]))
    if n <= LONGEST_FIRST_BATCH:
        keys = [(-int(s.unit_granules[b]), b) for b in order]
        assert keys == sorted(keys), "the sequences do not take the slots longest units first"
    else:
        assert order == list(range(n)), "a batch above LONGEST_FIRST_BATCH does not take the slots in index order"
    for b in range(n):
        lo, hi = int(s.indptr[b]), int(s.indptr[b + 1])
        assert s.slot[lo:hi].tolist() == list(range(int(s.first[b]), int(s.first[b]) + hi - lo)), \
            f"sequence {b}: its units' slots are not [first, first + units) in order"
        starts, ends = s.start[lo:hi].tolist(), s.end[lo:hi].tolist()
        assert (s.seq[lo:hi] == b).all(), f"sequence {b}: units out of order"
        length, base = int(lens[b]), int(s.base[b])
        if base >= length:
            assert hi - lo == 1 and starts[0] == ends[0], f"sequence {b}: an empty sequence has one empty unit"
            continue
        assert starts[0] == base and ends[-1] == length, f"sequence {b}: units cover [{starts[0]}, {ends[-1]}) " \
                                                           f"instead of [{base}, {length})"
        for a in range(len(starts)):
            assert starts[a] < ends[a], f"sequence {b}: unit {a} is empty"
            if a:
                assert starts[a] == ends[a - 1], f"sequence {b}: units {a - 1} and {a} do not abut"
            assert ends[a] - starts[a] <= int(s.unit_granules[b]) * schedule.granule, f"sequence {b}: unit {a} too long"
    return s
