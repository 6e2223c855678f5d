"""The split planner: from a problem, a device and the config to a frozen, cached `SplitPlan`.

A plan fixes what a CUDA graph needs: the backend, the kernel options, the grid and the workspace, and the
constants of the device-side schedule (:mod:`attnplan.schedule`), which maps the live ``seq_lens`` to programs
at every launch. The planner's job is to choose those constants.

How many splits a sequence should get (FlashAttention's ``num_splits_heuristic`` and Flash-Decoding's argument):
programs are counted per KV head, ``batch x num_kv_heads x splits``, because one program serves a whole GQA group
where its rows fit (each KV byte is read once; counting query heads would under-split GQA). For a batch of uniform
length the split count comes from the device's measured split table (``plans/<device>.yaml``, written by
``attnplan tune``: the best split count of an exhaustive search, as programs per SM, at the nearest measured
(sequence x KV head pairs, KV length, GQA group, head_dim)), or else from a small cost model in microseconds, taking
the fewest splits within 2% of the best:

    T(n) = launch + waves(n) * program_us                         partial kernel fixed costs
         + stream(n)                                                bandwidth-bound time
         + [n > 1] * merge(n)                                       separate merge kernel or fused

    near-uniform lengths (programs in waves of resident = SMs x programs_per_sm; a last wave of a few long programs
    costs a whole program):
        stream(n) = full_waves * wave(resident) + wave(rest),  wave(k) = max(k * chunk_bytes(n) / BW_eff,
                                                                            chunk_bytes(n) / bw_per_program)
    long-tailed lengths (short sequences' programs finish early and free their slots):
        stream(n) = max(kv_bytes / (BW_eff * min(1, live(n) / (SMs * sat))), chunk_bytes(n) / bw_per_program)

Worked example (batch 1, 32/8/128 bf16, 32K tokens, 132 SMs, 4.35 TB/s, default constants): one program streams
at most ``0.9 x 4.35 TB/s / (132 x 2)`` = 14.8 GB/s. 8 KV heads give 8 programs unsplit, so each streams 16 MiB
alone (1135.3 us); at 17 splits the 136 programs cover every SM once, about half the 264 that saturate the memory
(75.6 us); at 32 splits 256 programs stream 0.5 MiB each at nearly the whole bandwidth (42.6 us); 64 splits predict
43.9 us, so the planner takes 32.

The schedule turns that choice into a rule the GPU applies to any lengths: for every size of batch work (total
granules ``T``, bucketed by powers of two) the plan stores the number of work units a uniform batch of that size
would get (``targets``: splits x batch); a live batch of ``T`` granules then gets units of about ``T / targets``
granules each, so a long sequence among short ones gets many units and each short one one unit. A capacity plan
(CUDA graphs) fills that table for every bucket up to the capacity and counts each bucket's split-table row in
programs of its own warps (:func:`row_programs_per_sm`); a live plan of near-uniform lengths takes the rows as
measured and fills the buckets its rounded lengths reach (a long-tailed live plan is planned as the capacity plan of
its longest length). So the two may give the same lengths different units (cuda_ptx's rows carry
their own warps), with the same result within rounding.

Policies (``SplitPlan.policy``): ``tuned`` (the split table), ``heuristic`` (the cost model), ``forced``
(``num_splits > 1``: up to that many equal units per sequence), ``no-split`` (``num_splits = 1``, or a live plan of
near-uniform lengths whose cost-model split count is 1 or whose targets give the middle of the lengths it serves,
``1/sqrt(2)`` of the planned ones, one unit per sequence: single pass; a tuned plan that ends single pass keeps
``tuned``) and ``batch-invariant`` (config ``split.batch_invariant``: units of a fixed size from each sequence's own
length, so a sequence's output is bitwise independent of its batchmates).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from ._repr import short_repr
from .config import MAX_SPLITS, Config, CostModel, device_table
from .device import DeviceInfo
from .problem import DecodeProblem, explain_lengths, torch_dtype
from .schedule import NUM_BUCKETS, NUM_TARGETS, Schedule, bucket_of, max_units_bound, schedule_units

__all__ = ["SplitPlan", "Launch", "launch_problem_of", "KernelOptions", "TableRow", "make_plan", "PLAN_VERSION",
           "cost_model_for", "split_table_layout", "entry_options", "table_candidates", "MERGES", "PLAN_POLICIES",
           "FUSED_TEAM_UNITS", "check_num_splits"]

PLAN_VERSION = 10  # 2: device-side schedule (a 1 plan had a host-fixed chunk size); 3: q_block; 4: capacity plans'
#                  targets scaled to their warps; 5: that scaling bounded at saturation; 6: a row carried to another
#                  pair count loads the SMs evenly (even_load_splits); 7: one-bucket live plans' grids fit their units;
#                  8: head_block (a GQA group larger than a program in several launches); 9: long-tailed live plans
#                  from the longest length's row (and keys that keep the batch long-tailed: problem.mean_bucket);
#                  10: buckets of bit_length(T + T/2), each planned at its power of two
#: cross-program merges: ``none`` (single pass), ``separate`` (merge kernel), ``fused`` (last program merges)
MERGES = ("none", "separate", "fused")
#: the fused merge's team: a (sequence, KV head) of more units merges in two levels where the backend's fused merge does
#: (cuda_ptx: teams of this many consecutive units, each merged by its last program, then the teams by the last team's)
FUSED_TEAM_UNITS = 16
PLAN_POLICIES = ("tuned", "heuristic", "forced", "no-split", "batch-invariant")


class KernelOptions(Mapping):
    """A backend's kernel options (``block_n``, ``num_warps``, ``num_stages``, ...): a frozen, hashable mapping of
    option name to a JSON scalar, so plans are hashable and backends can cache per-plan launch state."""

    __slots__ = ("_items", "_hash")

    def __init__(self, items: Mapping | None = None, **kw):
        d = {**(dict(items) if items is not None else {}), **kw}
        for k, v in d.items():
            if not isinstance(k, str) or not (v is None or isinstance(v, (bool, int, float, str))):
                raise TypeError(f"kernel option {k!r} must map a name to a JSON scalar, got {v!r}")
        self._items = tuple(sorted(d.items()))
        self._hash = hash(self._items)

    def __getitem__(self, k):
        for key, v in self._items:
            if key == k:
                return v
        raise KeyError(k)

    def __iter__(self):
        return (k for k, _ in self._items)

    def __len__(self):
        return len(self._items)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self):
        return repr(dict(self._items))

    def to_dict(self) -> dict:
        return dict(self._items)


def json_scalar(value) -> bool:
    """Whether ``value`` is a kernel option's value in a device table: ``None`` (the backend's default), a bool, an
    int, a finite float or a string."""
    return value is None or isinstance(value, (int, str)) or (isinstance(value, float) and math.isfinite(value))


class TableRow(NamedTuple):
    """One row of a device's measured split table (``split_table.<backend>.<layout>`` in ``plans/<device>.yaml``).

    Attributes:
        pairs: batch x KV heads it was measured at; kv_len: KV tokens per sequence.
        programs_per_sm: the exhaustive search's best split count, as programs per SM.
        us: that step's time, microseconds (CUDA-graph replay).
        group: GQA group of the heads measured (``None`` for an untagged row: any group); head_dim: its head_dim.
        options: the kernel options that split count was measured with (``attnplan tune --row-options``), as
            sorted ``(name, value)`` pairs; empty when the row carries none.
    """

    pairs: int
    kv_len: int
    programs_per_sm: float
    us: float
    group: int | None = None
    head_dim: int = 128
    options: tuple = ()

    @staticmethod
    def from_row(row) -> "TableRow":
        """A YAML row ``[pairs, kv_len, programs_per_sm, us, group?, head_dim?, options?]``.

        Raises:
            ValueError: not a list of 4, 6 or 7 fields; pairs, kv_len or head_dim not an int in [1, 2^31); group not
                such an int or null; programs_per_sm not a finite number > 0; us not a finite number >= 0; options
                not a mapping (or list of pairs) of an option name to a JSON scalar (null: the backend's default).
        """
        if not isinstance(row, (list, tuple)) or len(row) not in (4, 6, 7):
            raise ValueError("a split-table row is [pairs, kv_len, programs_per_sm, us(, group, head_dim(, "
                             f"options))], got {row!r}")
        group, head_dim = (row[4], row[5]) if len(row) >= 6 else (None, 128)
        opts = row[6] if len(row) >= 7 else {}
        if isinstance(opts, Mapping):
            opts = tuple(sorted(dict(opts).items(), key=lambda kv: str(kv[0])))
        elif isinstance(opts, (list, tuple)) and all(isinstance(o, (list, tuple)) and len(o) == 2 for o in opts):
            opts = tuple(tuple(o) for o in opts)
        else:
            raise ValueError(f"split-table row options must be a mapping of option to value, got {opts!r}")
        for name, value in opts:
            if not isinstance(name, str) or not json_scalar(value):
                raise ValueError(f"split-table row option {name!r} must map a name to a JSON scalar, got {value!r}")
        for name, v in (("pairs", row[0]), ("kv_len", row[1]), ("head_dim", head_dim)) + (
                (("group", group),) if group is not None else ()):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v < 1 << 31:
                raise ValueError(f"split-table row {name} must be an int in [1, 2^31), got {v!r} in {list(row)!r}")
        for name, v, least in (("programs_per_sm", row[2], None), ("us", row[3], 0.0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (
                    v <= 0 if least is None else v < least):
                raise ValueError(f"split-table row {name} must be a finite number {'> 0' if least is None else '>= 0'}"
                                 f", got {v!r} in {list(row)!r}")
        return TableRow(row[0], row[1], float(row[2]), float(row[3]), group, head_dim, opts)


def entry_options(entry: TableRow | None) -> dict:
    """The kernel options a split-table row carries (``{}`` for none or no row). The row's split count was measured
    with them, so :func:`attnplan.api.plan_problem` runs them with it: only for a plan that row makes (policy
    ``tuned``, the same row again once the options are applied), not when the config sets the backend's options,
    and not when they do not fit the problem's kernel (``ValueError`` from the backend's ``kernel_config``). Measured
    on an H200: cuda_ptx with 8 KV warps per program beat 4 warps, each at its best split count, by 3-11% at 16-64
    (sequence, KV head) pairs and 1K-16K tokens, while single passes that fill the SMs keep 4 warps."""
    return dict(entry.options) if entry is not None else {}


class DeviceKey(NamedTuple):
    """The device a plan is for (its fingerprint; part of the plan-cache key)."""

    name: str
    sm_count: int
    cc: tuple[int, int]
    driver: str = ""

    @property
    def arch(self) -> str | None:
        """``sm_90`` style architecture name (:attr:`attnplan.device.DeviceInfo.arch`); ``None`` for the CPU
        stand-in (compute capability (0, 0))."""
        return None if tuple(self.cc) == (0, 0) else f"sm_{self.cc[0]}{self.cc[1]}"

    @staticmethod
    def of(device: DeviceInfo) -> "DeviceKey":
        """``device``'s key, its fields as Python ``str`` / ``int`` (a numpy integer among the facts is converted)."""
        return DeviceKey(str(device.name), int(device.sm_count), tuple(int(c) for c in device.compute_capability),
                         str(device.driver))


def launch_problem_of(problem: DecodeProblem, q_block: int = 0, head_block: int = 0) -> DecodeProblem:
    """The problem one launch of a plan serves (the planner plans it, the backend picks its kernel options for it):
    ``problem`` with ``q_len = q_block`` (0: all queries), and with ``head_block > 0`` that many query heads over
    one KV head (:attr:`SplitPlan.head_block`)."""
    if q_block:
        problem = replace(problem, q_len=q_block)
    if head_block:
        problem = replace(problem, num_q_heads=head_block, num_kv_heads=1)
    return problem


class Launch(NamedTuple):
    """One launch of a plan (:attr:`SplitPlan.launches`): queries ``[i0, i1)``, query heads ``[h0, h1)`` and KV
    heads ``[k0, k1)`` of the step, run as ``plan`` (the problem of that slice; ``q_block`` and ``head_block`` 0)."""

    i0: int
    i1: int
    h0: int
    h1: int
    k0: int
    k1: int
    plan: "SplitPlan"


_FIELD_KINDS = {int: "an int", float: "a number", bool: "true or false", str: "a string"}


def _nested(what: str, make, v):
    """``make(v)`` for the plan field ``what`` (a nested mapping), its ``TypeError`` / ``KeyError`` /
    ``ValueError`` raised again with the field named (a missing key of a nested mapping as ``KeyError``)."""
    try:
        return make(v)
    except KeyError as e:
        raise KeyError(f"plan {what}: key {e.args[0] if e.args else ''} missing") from None
    except (TypeError, ValueError) as e:
        raise type(e)(f"plan {what}: {e}") from None


def _type_name(v) -> str:
    """``v``'s type, qualified by its module outside the builtins (``numpy.bool``, not ``bool``)."""
    t = type(v)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _is_int(v) -> bool:
    """An int, not a bool (a plan's counts)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    """An int or a float, not a bool (a plan's times)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _field(v, kind: type, what: str):
    """A plan file's field ``v`` if it is a JSON value of ``kind``, else ``TypeError`` naming it (nothing is
    converted): ``int`` an int, not a bool; ``float`` an int or a float, not a bool; ``bool`` and ``str`` exactly."""
    if kind is bool:
        ok = type(v) is bool
    elif kind is float:
        ok = _is_real(v)
    else:
        ok = isinstance(v, kind) and not isinstance(v, bool)
    if not ok:
        raise TypeError(f"plan {what} must be {_FIELD_KINDS[kind]}, got {v!r:.40}")
    return v


def _float_field(v, what: str) -> float:
    """:func:`_field` of kind ``float``, as a float; an int too large for one is a ``ValueError`` naming it."""
    try:
        return float(_field(v, float, what))
    except OverflowError:
        raise ValueError(f"plan {what} must be a finite number, got an int of {int(v).bit_length()} bits") from None


@dataclass(frozen=True)
class SplitPlan:
    """A frozen, hashable, serializable split-KV plan.

    Attributes:
        backend: the backend's name.
        problem: the (bucketed) :class:`~attnplan.DecodeProblem` planned for: lengths raised to their bucket's
            bound, or the capacity for a capacity plan.
        device: the device's :class:`DeviceKey`.
        schedule: the device-side schedule's constants (:class:`~attnplan.schedule.Schedule`).
        kernel: the backend's :class:`KernelOptions` (``block_n``: tokens per KV tile, ...).
        merge: ``"none"`` (single pass: every sequence has one unit, programs write ``out``), ``"separate"`` (a
            merge kernel combines the partial states of sequences with several units) or ``"fused"`` (the last
            program of each (sequence, KV head) to finish, by an atomic completion counter, merges its rows in unit
            order; the counter resets itself for the next launch or graph replay).
        policy: how the split count was chosen (:data:`PLAN_POLICIES`, module docstring).
        predicted_us: the cost model's step time at the planned lengths, microseconds (not measured).
        capacity_mode: planned for the cache's capacity (the plan to capture in a CUDA graph).
        table_entry: for ``tuned``: the split-table row used.
        candidates: ``(splits, chunk_tokens, predicted_us)`` the cost model scored at the planned lengths.
        q_block: ``0``: one launch serves all ``q_len`` queries of a sequence. Else the queries go in blocks of
            ``q_block`` (the last one may be shorter), one launch each, because the backend's program cannot hold
            the GQA group x ``q_len`` rows (``Backend.q_block``): the launch for queries ``[i0, i1)`` is the problem
            with ``q_len = i1 - i0`` and lengths ``max(0, L - (q_len - i1))`` (its queries see what they see in the
            whole problem; :attr:`launches`), with its own meta and counters and the rows ``[i0, i1)`` of the
            workspace's state. Each launch reads the KV again. The schedule, the kernel options and the grid are
            the launch's (``problem`` stays the whole problem, the workspace is sized for it).
        head_block: ``0``: a launch serves whole GQA groups. Else one GQA group alone is more rows than the
            backend's program holds (``Backend.head_block``): each launch serves one KV head ``k`` and a block of
            ``head_block`` of its query heads, ``[k * group + g0, k * group + g1)`` (the last block of a group may
            be smaller), one query per launch (``q_block`` 1, or ``q_len`` 1). Launches go query block by query
            block, then KV head by KV head, then head block by head block (:attr:`launches`); each reads its KV
            head again.
        version: :data:`PLAN_VERSION`.
    """

    backend: str
    problem: DecodeProblem
    device: DeviceKey
    schedule: Schedule
    kernel: KernelOptions
    merge: str
    policy: str
    predicted_us: float
    capacity_mode: bool = False
    table_entry: TableRow | None = None
    candidates: tuple[tuple[int, int, float], ...] = field(default=())
    q_block: int = 0
    head_block: int = 0
    version: int = PLAN_VERSION

    # -- derived --------------------------------------------------------------------------------------
    @property
    def q_blocks(self) -> tuple[tuple[int, int], ...]:
        """The launches' query ranges ``(i0, i1)``: ``((0, q_len),)`` unless :attr:`q_block` splits them."""
        q = self.problem.q_len
        b = self.q_block or q
        return tuple((i, min(q, i + b)) for i in range(0, q, b))

    @property
    def head_blocks(self) -> tuple[tuple[int, int], ...]:
        """The query-head ranges ``(g0, g1)`` inside one GQA group a launch serves: ``((0, group),)`` unless
        :attr:`head_block` splits the group."""
        g = self.problem.group_size
        b = self.head_block or g
        return tuple((i, min(g, i + b)) for i in range(0, g, b))

    @property
    def launches(self) -> tuple[Launch, ...]:
        """One :class:`Launch` per launch, in launch order: the plan of the problem's slice (``q_len = i1 - i0``,
        and with head blocks ``h1 - h0`` query heads over one KV head), which a backend executes on ``q[:, i0:i1,
        h0:h1]`` and the caches' KV heads ``[k0, k1)`` with lengths ``max(0, L - (q_len - i1))``;
        ``(Launch(0, q_len, 0, num_q_heads, 0, num_kv_heads, self),)`` when one launch serves it all. Computed
        once per plan."""
        got = self.__dict__.get("_launches")
        if got is None:
            p = self.problem
            if not self.q_block and not self.head_block:
                got = (Launch(0, p.q_len, 0, p.num_q_heads, 0, p.num_kv_heads, self),)
            elif not self.head_block:
                got = tuple(Launch(i0, i1, 0, p.num_q_heads, 0, p.num_kv_heads,
                                   replace(self, problem=replace(p, q_len=i1 - i0), q_block=0))
                            for i0, i1 in self.q_blocks)
            else:
                g, plans, got = p.group_size, {}, []
                for i0, i1 in self.q_blocks:
                    for k in range(p.num_kv_heads):
                        for g0, g1 in self.head_blocks:
                            key = (i1 - i0, g1 - g0)  # one plan per slice shape (the last block may be smaller)
                            one = plans.get(key)
                            if one is None:
                                one = plans[key] = replace(self, problem=launch_problem_of(p, *key), q_block=0,
                                                           head_block=0)
                            got.append(Launch(i0, i1, k * g + g0, k * g + g1, k, k + 1, one))
                got = tuple(got)
            object.__setattr__(self, "_launches", got)  # a memo, not a field: equality and hashing ignore it
        return got

    @property
    def multi_launch(self) -> bool:
        """Whether the plan runs in several launches (:attr:`q_block` or :attr:`head_block`)."""
        return bool(self.q_block or self.head_block)

    @property
    def launch_problem(self) -> DecodeProblem:
        """The problem one launch serves: the first launch's slice of :attr:`problem` (``q_len = q_block``, and
        ``head_block`` query heads over one KV head), or :attr:`problem` itself."""
        return self.launches[0].plan.problem

    def first_launch_problem(self) -> DecodeProblem:
        """:attr:`launch_problem` without building :attr:`launches` (one per query block, KV head and head block):
        what :meth:`validate` and the checks of a plan read from disk use, before its head counts are known to fit
        a problem (a file's ``num_kv_heads`` of 10^8 would otherwise build 10^8 launches)."""
        got = self.__dict__.get("_launches")
        return got[0].plan.problem if got is not None else launch_problem_of(self.problem, self.q_block,
                                                                                 self.head_block)

    @property
    def num_splits(self) -> int:
        """Most units (splits) one sequence may get (``schedule.max_units_per_seq``)."""
        return self.schedule.max_units_per_seq

    @property
    def single_pass(self) -> bool:
        """One program per (sequence, KV head) writes ``out`` / ``lse`` directly: no partial states, no merge."""
        return self.schedule.single_pass

    @property
    def grid(self) -> tuple[int]:
        """The partial kernel's 1-D grid: ``max_units x num_kv_heads`` programs, unit-major (one launch's: with
        head blocks, of its one KV head)."""
        return (self.schedule.max_units * self.launch_problem.num_kv_heads,)

    @property
    def num_programs(self) -> int:
        """CTAs (programs) of one partial-kernel launch: :attr:`grid`'s size, slots without a unit included."""
        return self.grid[0]

    @property
    def state_slots(self) -> int:
        """Split slots of the workspace's :class:`~attnplan.PartialState` (``max_units``; 0 for single pass)."""
        return 0 if self.single_pass else self.schedule.max_units

    @property
    def meta_words(self) -> int:
        """int32 words of the schedule's per-sequence table the partial kernel writes for the separate merge:
        ``first[b]`` then ``units[b]`` (``2 x batch`` per launch; 0 without a separate merge)."""
        return 2 * self.problem.batch * len(self.launches) if self.merge == "separate" else 0

    @property
    def sync_words(self) -> int:
        """int32 completion counters of the fused merge per launch, zero at rest: one per (sequence, KV head) (at
        ``b * Hkv + h``), then one per (unit slot, KV head) for the two-level merge of sequences of more than
        :data:`FUSED_TEAM_UNITS` units (team ``j`` of sequence ``b`` counts at its first unit's slot, ``(batch +
        first[b] + j FUSED_TEAM_UNITS) * Hkv + h``: slots are unique, not in sequence order), so ``(batch +
        max_units) x`` the launch's KV heads, times the plan's launches (each launch its own table, one after
        another); 0 without the fused merge. A backend whose fused merge has one level (triton) uses the first
        ``batch x Hkv`` of a launch's table."""
        if self.merge != "fused":
            return 0
        heads = 1 if self.head_block else self.problem.num_kv_heads
        return (self.problem.batch + self.schedule.max_units) * heads * len(self.launches)

    @property
    def lens_words(self) -> int:
        """int32 words of the launches' lengths ``max(0, L - (q_len - i1))``: ``batch`` per query block but the last
        (which reads ``seq_lens`` itself); 0 without query blocks."""
        return self.problem.batch * (len(self.q_blocks) - 1)

    @property
    def units_bound(self) -> int:
        """The most units the schedule can give one launch's batch at any lengths up to the capacity: ``batch x
        min(max_units_per_seq, ceil(capacity granules / min_unit_granules))``, and for a balanced schedule at most
        :func:`~attnplan.schedule.max_units_bound` of its targets (the slots :func:`make_plan` sizes ``max_units``
        to; :meth:`validate` requires ``max_units`` to be at least this, a plan read from disk exactly this)."""
        s, p = self.schedule, self.first_launch_problem()
        if s.single_pass:
            return p.batch
        per_seq = min(s.max_units_per_seq, -(-(-(-_capacity_span(p) // s.granule)) // s.min_unit_granules))
        bound = p.batch * per_seq
        if s.policy == "balanced":
            bound = min(bound, max_units_bound(s.targets, p.batch, s.max_units_per_seq))
        return bound

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the workspace the plan needs: the fp32 partial states (``o`` and ``lse`` of ``state_slots``
        slots x ``q_len`` x ``num_q_heads``, ``head_dim + 1`` floats each; the state is ragged, so there is no batch
        factor) and the int32 words of the merge's table, the fused merge's counters, the query blocks' lengths and
        the schedule's targets."""
        p = self.problem
        return (self.state_slots * p.q_len * p.num_q_heads * (p.head_dim + 1) * 4
                + 4 * (self.meta_words + self.sync_words + self.lens_words + NUM_TARGETS))

    # -- checks and serialization ---------------------------------------------------------------------
    def check_types(self) -> None:
        """Check every field's type (a plan edited with ``dataclasses.replace`` is not checked when it is made):
        ``backend``, ``merge`` and ``policy`` strings, ``problem`` a :class:`DecodeProblem`, ``device`` a
        :class:`DeviceKey` (name, SMs, ``(major, minor)``, driver), ``schedule`` a :class:`Schedule`, ``kernel`` a
        :class:`KernelOptions`, ``predicted_us`` a real number, ``capacity_mode`` a bool, ``table_entry`` a
        :class:`TableRow` or ``None``, ``candidates`` ``(splits, chunk_tokens, predicted_us)`` triples,
        ``q_block``, ``head_block`` and ``version`` ints.

        Raises:
            TypeError: naming the first field of the wrong type.
        """
        d = self.device
        if isinstance(d, DeviceKey):
            for what, ok, want in (("name", isinstance(d.name, str), "a str"),
                                   ("sm_count", _is_int(d.sm_count), "an int"),
                                   ("cc", isinstance(d.cc, tuple) and len(d.cc) == 2 and all(_is_int(c) for c in d.cc),
                                    "an (int, int) tuple"),
                                   ("driver", isinstance(d.driver, str), "a str")):
                if not ok:
                    raise TypeError(f"plan device {what} must be {want}, got {_type_name(getattr(d, what))} "
                                    f"{getattr(d, what)!r:.60}")
        cands_ok = isinstance(self.candidates, tuple) and all(
            isinstance(c, tuple) and len(c) == 3 and _is_int(c[0]) and _is_int(c[1]) and _is_real(c[2])
            for c in self.candidates)
        for what, ok, want in (
                ("backend", isinstance(self.backend, str), "a str"),
                ("problem", isinstance(self.problem, DecodeProblem), "a DecodeProblem"),
                ("device", isinstance(d, DeviceKey), "a DeviceKey"),
                ("schedule", isinstance(self.schedule, Schedule), "a Schedule"),
                ("kernel", isinstance(self.kernel, KernelOptions), "a KernelOptions"),
                ("merge", isinstance(self.merge, str), "a str"),
                ("policy", isinstance(self.policy, str), "a str"),
                ("predicted_us", _is_real(self.predicted_us), "a real number"),
                ("capacity_mode", type(self.capacity_mode) is bool, "a bool"),
                ("table_entry", self.table_entry is None or isinstance(self.table_entry, TableRow),
                 "a TableRow or None"),
                ("candidates", cands_ok, "a tuple of (int, int, float) triples"),
                ("q_block", _is_int(self.q_block), "an int"),
                ("head_block", _is_int(self.head_block), "an int"),
                ("version", _is_int(self.version), "an int")):
            if not ok:
                raise TypeError(f"plan {what} must be {want}, got {_type_name(getattr(self, what))} "
                                f"{getattr(self, what)!r:.60}")

    def validate(self, problem: DecodeProblem | None = None) -> None:
        """Check the plan's field types (:meth:`check_types`), its internal consistency, and that it serves
        ``problem`` when given (a plan loaded from disk is validated so before use).

        Raises:
            TypeError: a field of the wrong type.
            ValueError: naming what does not fit.
        """
        self.check_types()
        s, k = self.schedule, self.kernel
        if self.version != PLAN_VERSION:
            raise ValueError(f"plan version {self.version} is not {PLAN_VERSION}")
        qb = self.q_block
        if not (qb == 0 or 1 <= qb < self.problem.q_len):
            raise ValueError(f"q_block {qb!r} must be 0 (one launch) or an int in [1, q_len {self.problem.q_len})")
        hb, g = self.head_block, self.problem.group_size
        if not (hb == 0 or 1 <= hb < g):
            raise ValueError(f"head_block {hb!r} must be 0 (whole GQA groups) or an int in [1, GQA group {g})")
        if hb and qb != 1 and self.problem.q_len != 1:
            raise ValueError(f"head_block {hb} launches one query at a time (q_block 1 or q_len 1), not q_block {qb}")
        p = self.first_launch_problem()  # the schedule and the kernel are the launch's
        if self.merge not in MERGES or self.policy not in PLAN_POLICIES:
            raise ValueError(f"plan merge {self.merge!r} / policy {self.policy!r} unknown")
        if self.policy == "tuned" and self.table_entry is None:
            raise ValueError("a tuned plan names the split-table row it used (table_entry)")
        if (self.merge == "none") != s.single_pass:
            raise ValueError(f"merge {self.merge!r} does not fit max_units_per_seq {s.max_units_per_seq}")
        bn = k.get("block_n")
        if isinstance(bn, bool) or not isinstance(bn, int) or bn < 1 or s.granule % bn:
            raise ValueError(f"kernel block_n {bn!r} must be a positive int dividing the granule {s.granule}")
        if p.page_size and s.granule % p.page_size:
            raise ValueError(f"granule {s.granule} must be a multiple of the page size {p.page_size}")
        if s.max_units < p.batch:
            raise ValueError(f"max_units {s.max_units} must cover the batch {p.batch}")
        if s.single_pass and s.max_units != p.batch:
            raise ValueError(f"a single-pass schedule has one slot per sequence: max_units {s.max_units} is not the "
                             f"batch {p.batch}")
        bound = self.units_bound
        if not s.single_pass and s.max_units < bound:
            raise ValueError(f"max_units {s.max_units} is below the schedule's bound {bound} for this problem")
        p = self.problem
        if problem is not None:
            fields = ("batch", "num_q_heads", "num_kv_heads", "head_dim", "q_len", "page_size", "q_dtype",
                      "kv_dtype", "window_left", "soft_cap", "has_sinks", "kv_scale")
            bad = [f for f in fields if getattr(problem, f) != getattr(p, f)]
            if bad:
                raise ValueError(f"plan does not fit the problem: {', '.join(bad)} differ")
            if problem.capacity > p.capacity:
                raise ValueError(f"plan serves a capacity of {p.capacity} tokens, the problem has {problem.capacity}")

    def to_dict(self) -> dict:
        """The plan as JSON-ready values (the plan-cache file's body); :meth:`from_dict` reads it back."""
        return {"backend": self.backend, "problem": self.problem.to_dict(), "device": list(self.device),
                "schedule": self.schedule.to_dict(), "kernel": self.kernel.to_dict(), "merge": self.merge,
                "policy": self.policy, "predicted_us": self.predicted_us, "capacity_mode": self.capacity_mode,
                "table_entry": None if self.table_entry is None else
                [*self.table_entry[:6], [list(o) for o in self.table_entry.options]],
                "candidates": [list(c) for c in self.candidates], "q_block": self.q_block,
                "head_block": self.head_block, "version": self.version}

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON, keys sorted."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @staticmethod
    def from_dict(d: Any) -> "SplitPlan":
        """Rebuild a plan from :meth:`to_dict` output, strictly.

        Raises:
            TypeError, KeyError, ValueError: not a plan of this version (unknown or missing keys, bad values).
        """
        if not isinstance(d, dict):
            raise TypeError(f"a plan must be a mapping, got {type(d).__name__}")
        want = {"backend", "problem", "device", "schedule", "kernel", "merge", "policy", "predicted_us",
                "capacity_mode", "table_entry", "candidates", "q_block", "head_block", "version"}
        if set(d) != want:
            raise KeyError(f"plan keys {sorted(set(d) ^ want)} missing or unknown")
        if _field(d["version"], int, "version") != PLAN_VERSION:
            raise ValueError(f"plan version {d['version']!r} is not {PLAN_VERSION}")
        for name in ("schedule", "kernel"):
            if not isinstance(d[name], dict):
                raise TypeError(f"plan {name} must be a mapping, got {type(d[name]).__name__}")
        if not isinstance(d["problem"], dict) or not isinstance(d["device"], list) or len(d["device"]) != 4:
            raise TypeError("plan problem must be a mapping and device [name, sm_count, cc, driver]")
        name, sms, cc, driver = d["device"]
        if not isinstance(cc, (list, tuple)) or len(cc) != 2:
            raise TypeError(f"plan device compute capability must be [major, minor], got {cc!r}")
        cands = d["candidates"]
        if not isinstance(cands, (list, tuple)) or any(not isinstance(c, (list, tuple)) or len(c) != 3 for c in cands):
            raise TypeError("plan candidates must be a list of [splits, chunk_tokens, predicted_us]")
        te = d["table_entry"]
        plan = SplitPlan(
            backend=_field(d["backend"], str, "backend"), problem=_nested("problem", lambda v: DecodeProblem(**v),
                                                                          d["problem"]),
            device=DeviceKey(_field(name, str, "device name"), _field(sms, int, "device sm_count"),
                             (_field(cc[0], int, "device cc"), _field(cc[1], int, "device cc")),
                             _field(driver, str, "device driver")),
            schedule=_nested("schedule", Schedule.from_dict, d["schedule"]),
            kernel=_nested("kernel", KernelOptions, d["kernel"]), merge=_field(d["merge"], str, "merge"),
            policy=_field(d["policy"], str, "policy"),
            predicted_us=_float_field(d["predicted_us"], "predicted_us"),
            capacity_mode=_field(d["capacity_mode"], bool, "capacity_mode"),
            table_entry=None if te is None else _nested("table_entry", TableRow.from_row, te),
            candidates=tuple((_field(a, int, "candidate splits"), _field(b, int, "candidate chunk_tokens"),
                              _float_field(c, "candidate predicted_us")) for a, b, c in cands),
            q_block=_field(d["q_block"], int, "q_block"), head_block=_field(d["head_block"], int, "head_block"),
            version=d["version"])
        plan.validate()
        return plan

    # -- explanation ----------------------------------------------------------------------------------
    def explain(self, seq_lens=None) -> str:
        """Why this plan: shapes, the split choice, the schedule and what it does at ``seq_lens`` (``batch`` ints in
        ``[0, capacity]``: a list, tuple, numpy array or tensor; by default the planned lengths: every sequence at
        the planned maximum). Words: ``docs/glossary.md``.

        Raises:
            TypeError, ValueError: ``seq_lens`` is not ``batch`` ints in ``[0, capacity]``
                (:func:`attnplan.problem.explain_lengths`).
        """
        if seq_lens is not None:
            seq_lens = explain_lengths(seq_lens, self.problem.batch, self.problem.capacity)
        p, dev, s = self.problem, self.device, self.schedule
        cpu = tuple(dev.cc) == (0, 0)
        base = p.batch * self.launch_problem.num_kv_heads  # per launch (head blocks: one KV head each)
        head = (f"backend {self.backend} on {dev.name} ({dev.sm_count} SMs"
                + (": the planner's stand-in for a CPU run; times below are not predictions for this machine)"
                   if cpu else f", compute capability {dev.cc[0]}.{dev.cc[1]})"))
        lines = [
            head,
            f"problem: batch {p.batch}, heads {p.num_q_heads}/{p.num_kv_heads} (GQA group {p.group_size}), "
            f"head_dim {p.head_dim}, q_len {p.q_len}, "
            f"{'paged, page ' + str(p.page_size) if p.paged else 'contiguous'}, q {p.q_dtype} / kv {p.kv_dtype}; "
            + (f"capacity plan (CUDA graphs): any lengths up to {p.capacity} tokens" if self.capacity_mode else
               f"planned for sequences of up to {p.max_kv_len} tokens, {p.total_kv_len // max(p.batch, 1)} on average "
               "(lengths rounded up to powers of two)"),
            f"(sequence, KV head) pairs: {base}" + (" per launch" if self.head_block else "")
            + f" (one program per {'head block' if self.head_block else 'GQA group'} and unit) on {dev.sm_count} SMs",
        ]
        variants = []
        if p.window_left >= 0:
            variants.append(f"sliding window of {p.window_left} tokens (query at position t sees [t - {p.window_left}, "
                            f"t]: each sequence's last {p.visible_span} positions at most are planned and read)")
        if p.soft_cap:
            variants.append(f"soft cap {p.soft_cap:g} (cap x tanh(score / cap))")
        if p.has_sinks:
            variants.append("sinks (a logit per query head joins each row's softmax denominator at the merge)")
        if p.kv_scale != "none":
            variants.append(f"fp8 KV with {'per-KV-head' if p.kv_scale == 'head' else 'per-tensor'} scales")
        if variants:
            lines.append("variants: " + "; ".join(variants))
        if self.head_block:
            n = len(self.launches)
            lines.append(f"GQA group of {p.group_size} query heads is more rows than one {self.backend} program holds: "
                         f"{n} launches, one per query, KV head and block of up to {self.head_block} of its query "
                         f"heads ({len(self.head_blocks)} per GQA group); each reads its KV head again; the schedule "
                         f"below is one launch's (one KV head)")
        elif self.q_block:
            n = len(self.q_blocks)
            lines.append(f"queries in {n} launches of up to {self.q_block} (GQA group x q_len = "
                         f"{p.group_size * p.q_len} rows is more than one {self.backend} program holds): each launch "
                         f"reads the KV again; the schedule below is the last launch's (queries "
                         f"[{self.q_blocks[-1][0]}, {p.q_len}), at the sequences' own lengths)")
        if self.policy == "forced":
            lines.append(f"split count forced: up to {self.num_splits} equal units per sequence")
        elif self.policy == "no-split":
            if not self.candidates:
                why = "num_splits = 1"
            elif min(c[0] for c in self.candidates if c[2] <= min(t for _, _, t in self.candidates) * 1.02) == 1:
                why = "the cost model's split count at the planned lengths is 1"
            else:
                why = "the targets give one unit per sequence at the middle of the lengths the plan serves"
            lines.append(f"single pass: one program per (sequence, KV head), no partial states, no merge ({why})")
        elif self.policy == "batch-invariant":
            lines.append(f"batch-invariant: units of {s.min_unit_granules * s.granule} tokens from each sequence's "
                         "own length (outputs bitwise independent of the batchmates)")
        elif self.policy == "tuned":
            e = self.table_entry
            lines.append(f"split counts from the device's measured split table (attnplan tune): at the planned "
                         f"length the nearest row is {e.pairs} pairs x {e.kv_len} tokens, best at "
                         f"{e.programs_per_sm:g} programs per SM" + ("" if cpu else f" ({e.us:g} us measured there)"))
            pairs = base
            if e.pairs != pairs:
                lines.append(f"  carried from {e.pairs} to {pairs} pairs: a count whose programs leave the busiest SM "
                             f"more than {EVEN_LOAD_MAX_IMBALANCE:g}x above the mean is raised until they do not "
                             f"(units of at least {EVEN_LOAD_MIN_CHUNK} tokens at the planned length)")
            if s.single_pass:
                lines.append("  one unit per sequence: single pass (the row's count at the planned lengths, or the "
                             "targets at the middle of the lengths the plan serves)")
            w = _warps(self.kernel)
            tail = not self.capacity_mode and p.long_tailed
            if tail:
                lines.append("  a long-tailed batch (mean below half the longest): planned as a capacity plan of its "
                             "longest length, from the row of a uniform batch at that length")
            if (self.capacity_mode or tail) and w is not None:
                lines.append(f"  {'capacity plan' if self.capacity_mode else 'as there'}: each bucket's row counted "
                             f"in programs of {w} warps (a row measured with other warps scaled by the ratio, up to "
                             "the memory's saturation point)")
            if e.options:
                ran = all(self.kernel.get(k) == v for k, v in e.options)
                lines.append(f"  the row's kernel options {dict(e.options)} "
                             + ("(applied)" if ran else "(not applied: the config sets the backend's options, or they "
                                                        "do not fit this problem's kernel)"))
        elif self.candidates:
            best = min(c[2] for c in self.candidates)
            shown = sorted(self.candidates, key=lambda c: c[2])[:5]
            per = (f" of one launch; {len(self.launches)} launches per step" if self.multi_launch else "")
            lines.append(f"cost model at the planned length (splits: chunk tokens, predicted us{per}): " + ", ".join(
                f"{n}: {c}, {t:.1f}" for n, c, t in sorted(shown)) + f"; the fewest splits within 2% of {best:.1f}")
        if s.single_pass:
            lines.append(f"schedule: single pass, grid {self.num_programs} programs (one per sequence x KV head)")
        else:
            hkv = self.launch_problem.num_kv_heads
            lines.append(
                f"schedule ({s.policy}, computed on the device at every launch from seq_lens): granule {s.granule} "
                f"tokens, units of at least {s.min_unit_granules * s.granule} tokens, at most {s.max_units_per_seq} "
                f"units per sequence; grid {s.max_units} unit slots x {hkv} KV head{'s' * (hkv != 1)} = "
                f"{self.num_programs} programs (slots without a unit exit)")
            lens = [p.max_kv_len] * p.batch if seq_lens is None else seq_lens
            lines.append("  " + describe_units(self.launches[-1].plan, lens,
                                               "planned" if seq_lens is None else "these"))
            lines.append("  merge: " + {"separate": "a merge kernel combines each row's unit states in unit order "
                                                    "(sequences with one unit are written directly)",
                                        "fused": "the last program of each (sequence, KV head) merges its rows in unit "
                                                 "order (no extra launch"
                                                 + (f"; more than {FUSED_TEAM_UNITS} units: in teams of "
                                                    f"{FUSED_TEAM_UNITS}, then the teams)"
                                                    if self.backend == "cuda_ptx" else ")")}[self.merge])
        lines.append(f"kernel options {dict(self.kernel)}; workspace {self.workspace_bytes / 2**20:.2f} MiB"
                     + ("" if cpu else f"; predicted {self.predicted_us:.1f} us per step at the planned lengths"))
        return "\n".join(lines)


def describe_units(plan: SplitPlan, seq_lens, which: str = "these") -> str:
    """One line: what the schedule does at ``seq_lens`` (units, programs, heaviest program's KV bytes vs the mean;
    with a targets table, the granules per unit it gives the batch's total against the target; whether the slots
    are longest units first rather than in sequence order)."""
    p = plan.problem
    u = schedule_units(seq_lens, plan.schedule, p.q_len, p.window_left)
    sizes = (u.end - u.start).clamp(min=0)
    real = sizes[sizes > 0]
    per_tok = p.kv_bytes_per_token
    if not real.numel():
        return f"at {which} lengths: {u.num_units} units, all empty"
    heavy, mean = int(real.max()) * per_tok, float(real.double().mean()) * per_tok
    empty = u.num_units - real.numel()  # the one empty unit of each sequence with no visible position
    c = u.granules_per_unit
    return (f"at {which} lengths: {u.num_units} units ({int(u.units.min())}-{int(u.units.max())} per sequence) = "
            f"{real.numel() * p.num_kv_heads} programs with work"
            + (f" (+{empty * p.num_kv_heads} of empty sequences)" if empty else "")
            + f"; heaviest program {_size(heavy, heavy)} of KV vs mean {_size(mean, heavy)} ({heavy / mean:.2f}x)"
            + (f"; {c} granule{'s' * (c != 1)} per unit ({u.total_granules} granules, target {u.target} units)"
               if u.target else "")
            + ("; slots longest units first" if u.first.tolist() != u.indptr[:-1].tolist() else ""))


def _size(n: float, scale: float) -> str:
    """``n`` bytes in MiB, or in KiB where ``scale`` (the larger of the numbers shown together) is under 0.1 MiB."""
    return f"{n / 2**10:.1f} KiB" if scale < 2**20 / 10 else f"{n / 2**20:.2f} MiB"


def cost_model_for(device: DeviceInfo, config: Config, backend: str | None = None) -> tuple[CostModel, float]:
    """The cost model for ``device`` (and ``backend``) and its read bandwidth in GB/s.

    The tuned table ``plans/<device>.yaml`` wins over the config's defaults: its ``cost_model``, then
    ``cost_model_by_backend.<backend>`` (constants measured for one backend's kernels). An explicit
    ``mem_bandwidth_gbs`` in either wins over the device's estimate.
    """
    table = device_table(device.slug()) if device.compute_capability != (0, 0) else {}
    over = {**(table.get("cost_model") or {}), **((table.get("cost_model_by_backend") or {}).get(backend) or {})}
    cm = CostModel.model_validate({**config.cost_model.model_dump(), **over}) if over else config.cost_model
    return cm, float(cm.mem_bandwidth_gbs or device.mem_bandwidth_gbs)


def _align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _cost_us(problem: DecodeProblem, device: DeviceInfo, cm: CostModel, bw_gbs: float, splits: int, chunk: int,
             merges: tuple[str, ...] = ("separate", "fused"), fused_parallelism: int = 1,
             fused_max_chunk: int = 0) -> float:
    """Predicted step time in microseconds (the module docstring's T(n)); the merge term is the cheapest of
    ``merges``."""
    bw = bw_gbs * 1e3 * cm.bandwidth_fraction  # bytes per microsecond
    hkv, batch = problem.num_kv_heads, problem.batch
    max_len, total = max(problem.max_kv_len, 1), max(problem.total_kv_len, 1)
    # live programs: each sequence's ceil(len / chunk) programs; sum approximated from the total.
    live = hkv * min(batch * splits, max(batch, math.ceil(total / chunk)))
    paged = problem.paged
    per_sm = cm.paged_programs_per_sm if paged and cm.paged_programs_per_sm else cm.programs_per_sm
    resident = device.sm_count * per_sm
    programs = hkv * batch * splits
    waves = math.ceil(programs / resident)
    kv_bytes = total * hkv * problem.kv_bytes_per_token
    sat = _sat_programs_per_sm(cm, paged)
    occupancy = min(1.0, live / (device.sm_count * sat))
    bw_per_program = bw / (device.sm_count * sat)
    chunk_bytes = min(chunk, max_len) * problem.kv_bytes_per_token
    if 2 * total >= batch * max_len:
        # near-uniform lengths: programs run in waves of `resident`; a wave of n programs streams n chunks at the
        # device's bandwidth, but no program faster than its own rate, so a last wave of a few long programs costs
        # a whole program (wave quantization)
        def wave(n: int) -> float:
            return max(n * chunk_bytes / bw, chunk_bytes / bw_per_program)

        full, rest = divmod(programs, resident)
        stream = full * wave(resident) + (wave(rest) if rest else 0.0)
    else:  # long-tailed lengths: short sequences' programs finish early and free their slots
        stream = max(kv_bytes / (bw * occupancy), chunk_bytes / bw_per_program)
    t = cm.launch_us + waves * cm.program_us + stream
    if splits > 1:
        costs = _merge_cost_us(problem, cm, bw, bw_per_program, splits, fused_parallelism)
        t += min(costs[m] for m in _merges_for(merges, chunk, fused_max_chunk))
    return t


def _merges_for(merges: tuple[str, ...], chunk: int, fused_max_chunk: int) -> tuple[str, ...]:
    """``merges`` without ``fused`` where the backend caps its chunk (``fused_max_chunk`` tokens, 0 = no cap)."""
    if fused_max_chunk and chunk > fused_max_chunk:
        return tuple(m for m in merges if m != "fused") or ("separate",)
    return merges


def _merge_cost_us(problem: DecodeProblem, cm: CostModel, bw: float, bw_per_program: float, splits: int,
                   fused_parallelism: int = 1) -> dict:
    """Cost of each merge strategy after the partial kernel, microseconds.

    separate: one more launch, then all rows' states read at full bandwidth.
    fused: no launch; the last program of each (sequence, KV head) reads its group's states alone (at one
    program's bandwidth, and a dependent load per split and pass: ``merge_split_latency_us``), while the other
    groups' last programs do the same in parallel. Measured on an H200 under graph replay, Triton's fused merge was
    1-8 us slower than its separate merge kernel; cuda_ptx's last program reads many splits per round trip, so
    ``fused_parallelism`` (:attr:`~attnplan.backends.base.Backend.fused_merge_parallelism`) divides that
    serialized part.
    """
    rows = problem.batch * problem.q_len * problem.num_q_heads
    state_bytes = (problem.head_dim + 1) * 4 * splits
    out_bytes = problem.head_dim * torch_dtype(problem.q_dtype).itemsize
    group_rows = problem.q_len * problem.group_size
    return {"separate": cm.launch_us + rows * (2 * state_bytes + out_bytes) / bw,
            "fused": cm.program_us + (2 * splits * cm.merge_split_latency_us
                                      + group_rows * (state_bytes + out_bytes) / bw_per_program) / fused_parallelism}


#: a split-table entry serves problems within this factor of its work and length (log-space box)
TABLE_REACH = 4.0


def split_table_layout(layout: str, kv_itemsize: int) -> str:
    """The key of a split table's rows: ``layout`` (``"contiguous"`` or ``"paged"``), with ``"_fp8"`` for a 1-byte
    KV cache (``kv_itemsize`` in bytes), as ``attnplan tune`` writes and the planner reads."""
    return layout + ("_fp8" if kv_itemsize == 1 else "")


def _table_entry(problem: DecodeProblem, device: DeviceInfo, backend: str) -> TableRow | None:
    """The nearest row of the device's measured split table for ``problem`` (the first of
    :func:`table_candidates`), or ``None`` (cost model)."""
    near = table_candidates(problem, device, backend)
    return near[0][1] if near else None


def table_candidates(problem: DecodeProblem, device: DeviceInfo, backend: str) -> list[tuple[float, TableRow]]:
    """The rows of the device's measured split table that may serve ``problem``, nearest first, as
    ``(distance, row)``: ``distance`` is dimensionless (a sum of absolute natural-log ratios, below); equal
    distances keep table order. Empty where the table does not apply (no table, no section, CPU stand-in).

    ``plans/<device>.yaml`` key ``split_table.<backend>.<layout>`` (:class:`TableRow` fields); a 1-byte (fp8) cache
    reads ``<layout>_fp8``. Used for near-uniform lengths only (the mean at least half the maximum), rows of the
    problem's head_dim (rows measured at head_dim <= 128 serve every head_dim <= 128), and a row within
    :data:`TABLE_REACH` of the problem in both pairs and length. The nearest wins: log distance in pairs plus log
    distance in length plus half the log distance of the group sizes (at the same point a row of the problem's own
    group wins; one grid step away a row of another group may), ties going to a tagged row of the problem's own
    head_dim. The group term exists because the best split depends on the group's work per token too: measured on
    an H200, 32/32/128 and 16/8/256 planned from other heads' rows or the cost model missed the best by 5-25%.
    """
    itemsize = torch_dtype(problem.kv_dtype).itemsize
    if device.compute_capability == (0, 0) or itemsize not in (1, 2) or problem.long_tailed:
        return []
    layout = split_table_layout("paged" if problem.paged else "contiguous", itemsize)
    rows = _table_rows(device.slug(), backend, layout)
    work, kv = problem.batch * problem.num_kv_heads, max(problem.max_kv_len, 1)
    near = []
    for row in rows:
        if not (row.head_dim == problem.head_dim or (row.head_dim <= 128 and problem.head_dim <= 128)):
            continue
        dw, dk = abs(math.log(row.pairs / work)), abs(math.log(row.kv_len / kv))
        dg = abs(math.log(row.group / problem.group_size)) if row.group else 0.0
        d = dw + dk + 0.5 * dg + (0.0 if row.group and row.head_dim == problem.head_dim else 1e-3)
        if max(dw, dk) <= math.log(TABLE_REACH):
            near.append((d, row))
    near.sort(key=lambda t: t[0])  # stable: of equal distances the first row in the table wins
    return near


_ROWS: dict = {}


def _table_rows(slug: str, backend: str, layout: str) -> tuple[TableRow, ...]:
    """The split table's rows as :class:`TableRow` (parsed once per table object)."""
    table = device_table(slug)
    key = (id(table), backend, layout)
    rows = _ROWS.get(key)
    if rows is None:
        raw = ((table.get("split_table") or {}).get(backend) or {}).get(layout) or []
        rows = _ROWS[key] = tuple(TableRow.from_row(r) for r in raw)
    return rows


class _Choice(NamedTuple):
    splits: int  # after chunk alignment at the problem's length
    chunk: int
    predicted: float
    policy: str
    entry: TableRow | None
    candidates: tuple
    want: int  # before alignment: the split count the table or the cost model asks for


#: warps per program of the programs the cost model's ``sat_programs_per_sm`` counts: the options
#: ``attnplan tune``'s fit ran with (4 warps for both backends in the H200's table; re-check on a re-tune)
SAT_WARPS = 4


def row_programs_per_sm(entry: TableRow, num_warps: int | None, sat_programs_per_sm: float | None = None) -> float:
    """A split-table row's best programs per SM for programs of ``num_warps`` warps: the row's own figure when it
    carries no ``num_warps`` option or the same one, else scaled by the ratio of warps (the same warps per SM). The
    row's split count was measured with its options: a program of fewer warps has fewer loads in flight, so it
    takes more programs to keep the same bytes in flight per SM. With ``sat_programs_per_sm`` (the cost model's
    saturation point, in programs of :data:`SAT_WARPS` warps) a count scaled up stops where the memory saturates
    but not below the row's own (a row already past that point, many programs, is taken as measured); a count
    scaled down (a plan of more warps than the row's) follows the ratio.
    Measured on an H200: at 8/1/128 with 16 long-tailed sequences up to 128K, a capacity plan running the 128K
    row's 2-warp options planned from the 16K row's 8-warp count (0.61 programs per SM) gave 166 units and 62.5 us
    against 52.7 us with 784 units; at 32/8/128 b64, the 4K row's 8-warp count (3.9 per SM, past saturation)
    doubled for 4 warps took 208.5 us against 200.9 unscaled."""
    row_warps = dict(entry.options).get("num_warps")
    pps = entry.programs_per_sm
    if not num_warps or type(row_warps) is not int or row_warps <= 0 or row_warps == num_warps:
        return pps
    scaled = pps * row_warps / num_warps
    if sat_programs_per_sm and scaled > pps:
        scaled = min(scaled, max(pps, sat_programs_per_sm * SAT_WARPS / num_warps))
    return scaled


#: the most load imbalance (programs on the busiest SM over the mean, ``ceil(P / SMs) / (P / SMs)`` for ``P``
#: programs) a table row's split count may leave when carried to another pair count (:func:`even_load_splits`)
EVEN_LOAD_MAX_IMBALANCE = 1.10
#: shortest unit (tokens, at the planned length: a bucket's shorter lengths get shorter units) that
#: :func:`even_load_splits` splits down to: below it a step's fixed cost (prologue, merge) outweighs what an even
#: load gains
EVEN_LOAD_MIN_CHUNK = 2048


def load_imbalance(programs: int, sm_count: int) -> float:
    """Programs on the busiest SM over the mean when ``programs`` equal programs are spread over ``sm_count`` SMs
    (``>= 1``; 1 when they divide evenly)."""
    return -(-programs // sm_count) * sm_count / programs


def _even_enough(programs: int, sm_count: int) -> bool:
    """:func:`load_imbalance` at most :data:`EVEN_LOAD_MAX_IMBALANCE`, compared in integers (hundredths)."""
    return -(-programs // sm_count) * sm_count * 100 <= round(EVEN_LOAD_MAX_IMBALANCE * 100) * programs


def even_load_splits(asked: int, pairs: int, sm_count: int, most: int) -> int:
    """The split count (units per sequence) for ``pairs`` (sequence, KV head) pairs on ``sm_count`` SMs when a
    split-table row measured at another pair count asks for ``asked``: ``asked`` if its ``pairs x asked`` programs
    load the SMs within :data:`EVEN_LOAD_MAX_IMBALANCE` (:func:`load_imbalance`), else the next count up to ``most``
    (the largest count allowed) that does (``asked`` when none does). A row's programs per SM carried to another
    pair count can leave a fraction of the SMs, or of a wave, idle: measured on an H200 (cuda_ptx, 90K tokens),
    64/8/128 at 12 sequences (96 pairs) took the 128-pair rows' single pass, 96 programs on 132 SMs, 1.09x slower
    than 9 splits; 28/4/128 at 48 sequences (192 pairs) one split where 11 were best (1.09-1.13x)."""
    for s in range(asked, most + 1):
        if _even_enough(pairs * s, sm_count):
            return s
    return asked


def _choose_splits(problem: DecodeProblem, device: DeviceInfo, backend: str, cm: CostModel, bw: float, limit: int,
                   align: int, merges: tuple[str, ...], fused_parallelism: int, fused_max_chunk: int,
                   num_warps: int | None = None, row_at_max: bool = False) -> _Choice:
    """The split count for ``problem`` at its lengths (the table's row, else the cost model's fewest splits within
    2% of the best); ``limit``: most splits; ``align``: chunk alignment in tokens; ``num_warps``: the plan's warps
    per program, which a row measured with other warps is scaled to (:func:`row_programs_per_sm`);
    ``row_at_max``: take the row of a uniform batch at the problem's longest length (for a long-tailed batch,
    which no row serves as it is: the row sets the kernel options and the merge; the schedule's targets set the
    units)."""
    max_len = max(problem.visible_span, 1)
    row_problem = replace(problem, total_kv_len=problem.batch * problem.max_kv_len) if row_at_max else problem
    if (entry := _table_entry(row_problem, device, backend)) is not None:
        sat = _sat_programs_per_sm(cm, problem.paged)
        pairs = problem.batch * problem.num_kv_heads
        asked = max(1, round(row_programs_per_sm(entry, num_warps, sat) * device.sm_count / pairs))
        if entry.pairs != pairs:
            asked = even_load_splits(asked, pairs, device.sm_count, min(limit, max_len // EVEN_LOAD_MIN_CHUNK))
        want = min(limit, asked)
        chunk = _align_up(-(-max_len // want), align)
        splits = -(-max_len // chunk)
        return _Choice(splits, chunk, _cost_us(problem, device, cm, bw, splits, chunk, merges, fused_parallelism,
                                               fused_max_chunk), "tuned", entry, (), asked)
    candidates, seen = [], set()
    for n in range(1, limit + 1):
        chunk = _align_up(-(-max_len // n), align)
        n_eff = -(-max_len // chunk)
        if n_eff in seen:
            continue
        seen.add(n_eff)
        candidates.append((n_eff, chunk, round(_cost_us(problem, device, cm, bw, n_eff, chunk, merges,
                                                        fused_parallelism, fused_max_chunk), 3)))
    best = min(c[2] for c in candidates)
    splits, chunk, predicted = min((c for c in candidates if c[2] <= best * 1.02), key=lambda c: c[0])
    return _Choice(splits, chunk, predicted, "heuristic", None, tuple(candidates), splits)


def _sat_programs_per_sm(cm: CostModel, paged: bool) -> float:
    """Resident programs per SM that saturate the memory: the cost model's paged figure for a paged cache where it
    has one, else its figure."""
    return cm.paged_sat_programs_per_sm if paged and cm.paged_sat_programs_per_sm else cm.sat_programs_per_sm


def _warps(kernel: Mapping) -> int | None:
    """The kernel options' warps per program (``num_warps``), or ``None`` where they name none."""
    w = kernel.get("num_warps")
    return w if isinstance(w, int) and not isinstance(w, bool) and w > 0 else None


def check_granule_counters(problem: DecodeProblem, granule: int) -> int:
    """The schedule's 32-bit counters hold a batch at ``problem``'s capacity in granules of ``granule`` tokens.
    Returns the granules of one sequence at the capacity (its visible span, :func:`_capacity_span`).

    Raises:
        ValueError: ``batch x ceil(capacity span / granule) >= 2^31``."""
    cap_granules = -(-_capacity_span(problem) // granule)
    if problem.batch * cap_granules >= 1 << 31:
        raise ValueError(f"batch {problem.batch} x {cap_granules} granules of {granule} tokens per sequence exceeds "
                         "the schedule's 32-bit counters (2^31 granules per batch); use a larger page size or "
                         "block_n")
    return cap_granules


def _capacity_span(problem: DecodeProblem) -> int:
    """Most positions any query of a sequence at the cache's capacity can see, tokens (the window bounds it)."""
    cap = max(problem.capacity, problem.max_kv_len, 1)
    return cap if problem.window_left < 0 else min(cap, problem.window_left + problem.q_len)


def check_num_splits(num_splits, who: str = "") -> None:
    """``num_splits`` must be ``None`` (the config's ``split.num_splits``) or an ``int``, not a ``bool``, in ``[0,``
    :data:`~attnplan.config.MAX_SPLITS` ``]``: 0 = planner, 1 = no split, >1 = forced.

    Raises:
        ValueError: otherwise, the message starting with ``who``.
    """
    if num_splits is not None and (not _is_int(num_splits) or not 0 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"{who}num_splits must be an int in [0, {MAX_SPLITS}] (0 = planner, 1 = no split, >1 = "
                         f"forced) or None (the config's split.num_splits), got {short_repr(num_splits, 80)}")


def make_plan(problem: DecodeProblem, device: DeviceInfo, config: Config, backend: str, kernel: Mapping,
              *, capacity_mode: bool = False, num_splits: int | None = None,
              merge_strategies: frozenset[str] = frozenset({"separate"}), fused_merge_parallelism: int = 1,
              fused_merge_max_chunk: int = 0, q_block: int = 0, head_block: int = 0) -> SplitPlan:
    """Plan a problem (usually already :meth:`DecodeProblem.bucketed`).

    Args:
        problem: shapes, dtypes and the lengths to plan for (``max_kv_len`` tokens; the capacity for a capacity plan).
        device: the device the kernels run on.
        config: split policy and cost-model constants.
        backend: backend name recorded in the plan.
        kernel: the backend's kernel options; ``kernel["block_n"]`` (tokens) aligns the granule.
        capacity_mode: plan for any lengths up to the capacity (the plan to capture in a CUDA graph): never single
            pass unless ``num_splits == 1``, so a long sequence in a later batch is still spread over programs.
        num_splits: overrides ``config.split.num_splits`` (0 = planner, 1 = single pass, >1 = up to that many units).
        merge_strategies: the merges the backend implements (``"separate"``, ``"fused"``); ``config.split.merge``
            picks one (one the backend lacks falls back to ``separate``), ``auto`` the cheaper by the cost model.
        fused_merge_parallelism: the backend's :attr:`~attnplan.backends.base.Backend.fused_merge_parallelism`.
        fused_merge_max_chunk: the backend's :attr:`~attnplan.backends.base.Backend.fused_merge_max_chunk`
            (longest chunk in tokens for which ``auto`` considers ``fused``; 0 = no cap).
        q_block: queries per launch when the backend's program cannot hold the whole ``q_len``
            (:meth:`attnplan.backends.base.Backend.q_block`; 0 or ``>= q_len``: one launch). The launch problem
            (``q_len = q_block``) is planned, ``kernel`` must be its options, and the plan's predicted time is the
            launch's times the number of launches (:attr:`SplitPlan.q_block`).
        head_block: query heads per launch when one GQA group alone is more rows than the backend's program holds
            (:meth:`attnplan.backends.base.Backend.head_block`; 0 or ``>= group``: whole groups). The launch problem
            (``head_block`` query heads over one KV head, ``q_len`` 1 or ``q_block``) is planned, ``kernel`` must be
            its options, and the predicted time is the launch's times the number of launches
            (:attr:`SplitPlan.head_block`; ``q_block`` is then 1 whatever is passed, or 0 at ``q_len`` 1).
    Returns:
        the :class:`SplitPlan`; it serves any lengths up to the cache's capacity.
    Raises:
        TypeError: ``problem`` is not a :class:`DecodeProblem`, ``device`` not a :class:`DeviceInfo`, ``config``
            not a :class:`~attnplan.config.Config`, ``kernel`` not a mapping or ``capacity_mode`` not a bool.
        ValueError: ``num_splits`` is neither ``None`` nor an int from 0 to :data:`~attnplan.config.MAX_SPLITS` (as
            ``plan()``), ``kernel`` has no positive ``block_n``, or the batch's capacity exceeds 2^31 granules.
    """
    for what, v, kind in (("problem", problem, DecodeProblem), ("device", device, DeviceInfo),
                          ("config", config, Config), ("kernel", kernel, Mapping)):
        if not isinstance(v, kind):
            raise TypeError(f"make_plan: {what} must be a {kind.__name__}, got {_type_name(v)}")
    if type(capacity_mode) is not bool:
        raise TypeError(f"make_plan: capacity_mode must be a bool, got {_type_name(capacity_mode)}")
    check_num_splits(num_splits, "make_plan: ")
    head_block = head_block if 0 < head_block < problem.group_size else 0
    q_block = 1 if head_block and problem.q_len > 1 else (q_block if 0 < q_block < problem.q_len else 0)
    if q_block or head_block:
        one = make_plan(launch_problem_of(problem, q_block, head_block), device, config, backend, kernel,
                        capacity_mode=capacity_mode, num_splits=num_splits, merge_strategies=merge_strategies,
                        fused_merge_parallelism=fused_merge_parallelism, fused_merge_max_chunk=fused_merge_max_chunk)
        plan = replace(one, problem=problem, q_block=q_block, head_block=head_block)
        plan = replace(plan, predicted_us=one.predicted_us * len(plan.launches))
        plan.validate()
        return plan
    cm, bw = cost_model_for(device, config, backend)
    forced = config.split.num_splits if num_splits is None else num_splits
    block_n = kernel.get("block_n")
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 1:
        raise ValueError(f"kernel option block_n must be a positive int, got {block_n!r}")
    granule = math.lcm(block_n, problem.page_size or 1)
    batch = problem.batch
    merges = tuple(m for m in ("separate", "fused") if m in merge_strategies) or ("separate",)
    span = max(problem.visible_span, 1)
    if problem.window_left >= 0:  # with a sliding window only the window's span is planned
        problem_w = replace(problem, max_kv_len=span, total_kv_len=min(problem.total_kv_len, batch * span))
    else:
        problem_w = problem
    cap_granules = check_granule_counters(problem, granule)
    min_c = max(1, -(-config.split.min_chunk_tokens // granule))
    limit = max(1, min(config.split.max_splits, span // (min_c * granule)))
    zeros = (0,) * NUM_TARGETS
    choice = None
    if forced == 1:
        policy, sched = "no-split", Schedule("single", granule, 1, 1, zeros, batch)
        splits, chunk = 1, _align_up(span, granule)
    elif forced > 1:
        policy = "forced"
        sched = Schedule("forced", granule, 1, forced, zeros, batch * min(forced, cap_granules))
        splits = min(forced, -(-span // granule))
        chunk = granule * -(-(-(-span // granule)) // splits)
    elif config.split.batch_invariant:
        policy = "batch-invariant"
        c = max(min_c, -(-_align_up(config.split.invariant_chunk_tokens, granule) // granule))
        s_cap = config.split.max_splits
        sched = Schedule("batch_invariant", granule, c, s_cap, zeros, batch * min(s_cap, -(-cap_granules // c)))
        splits, chunk = min(s_cap, -(-span // (c * granule))), c * granule
    else:
        # a live long-tailed batch (its bucketed lengths say so: problem.mean_bucket) is planned as the capacity plan
        # of its longest length would be: from the split-table row of a uniform batch at that length, whose kernel
        # options api.plan_problem applies, with every bucket's row scaled to them. Measured on an H200, such
        # batches planned by the cost model with the backend's default options ran 1.1-1.7x their capacity plans.
        uniform = not problem.long_tailed
        tail_live = not capacity_mode and problem.long_tailed
        # a capacity plan's rows are scaled to its own warps (row_programs_per_sm): it runs one row's options at
        # every live length, so the other buckets' rows were measured with other programs
        warps = _warps(kernel) if capacity_mode or tail_live else None
        choice = _choose_splits(problem_w, device, backend, cm, bw, limit, granule, merges, fused_merge_parallelism,
                                fused_merge_max_chunk, warps, row_at_max=tail_live)
        if tail_live and choice.entry is not None:  # the row's count is a uniform batch's, not what the targets give
            # these lengths: the time predicted is the cost model's best at them
            choice = choice._replace(predicted=_choose_splits(
                problem_w, device, backend, cm, bw, limit, granule, merges, fused_merge_parallelism,
                fused_merge_max_chunk).predicted)
        policy, splits, chunk = choice.policy, choice.splits, choice.chunk
        if choice.splits == 1 and uniform and not capacity_mode:
            sched = Schedule("single", granule, 1, 1, zeros, batch)
            policy = "no-split" if policy == "heuristic" else policy
        else:
            one_bucket = not capacity_mode and problem.total_kv_len >= batch * problem.max_kv_len
            targets = _targets(problem_w, device, backend, cm, bw, config, granule, min_c, merges,
                               fused_merge_parallelism, fused_merge_max_chunk, cap_granules, capacity_mode, choice,
                               warps, one_bucket=one_bucket)
            s_cap = config.split.max_splits
            sched = Schedule("balanced", granule, min_c, s_cap, targets,
                             min(max_units_bound(targets, batch, s_cap), batch * min(s_cap, -(-cap_granules // min_c))))
            if one_bucket and int(schedule_units([max(1, round(problem.max_kv_len / math.sqrt(2)))] * batch, sched,
                                                 problem.q_len, problem.window_left).units.max()) <= 1:
                # the planned (bucketed) lengths stand for real ones from half of them up (problem.len_bucket); where
                # the targets give the middle of those one unit per sequence, and the bucket holds no long-tailed
                # batch, the single-pass kernel serves the plan without a scheduled grid (measured on an H200,
                # 28/4/128 paged, 48 sequences of 3,000 tokens: 75.2 us single pass against 82.7 scheduled with one
                # unit each)
                sched = Schedule("single", granule, 1, 1, zeros, batch)
                splits, chunk = 1, _align_up(span, granule)
                policy = "no-split" if policy == "heuristic" else policy
                choice = choice._replace(predicted=_cost_us(problem_w, device, cm, bw, 1, chunk, merges,
                                                            fused_merge_parallelism, fused_merge_max_chunk))
    predicted = choice.predicted if choice is not None else _cost_us(
        problem_w, device, cm, bw, splits, chunk, merges, fused_merge_parallelism, fused_merge_max_chunk)
    merge = "none"
    if not sched.single_pass:
        want = config.split.merge
        if want == "auto" and sched.policy != "batch_invariant":
            bwp = bw * 1e3 * cm.bandwidth_fraction
            costs = _merge_cost_us(problem_w, cm, bwp, bwp / (device.sm_count * cm.sat_programs_per_sm),
                                   max(splits, 2), fused_parallelism=fused_merge_parallelism)
            merge = min((costs[m], m) for m in _merges_for(merges, chunk, fused_merge_max_chunk))[1]
        else:
            merge = want if want in merges else "separate"
    return SplitPlan(backend=backend, problem=problem, device=DeviceKey.of(device), schedule=sched,
                     kernel=KernelOptions(kernel), merge=merge, policy=policy, predicted_us=float(predicted),
                     capacity_mode=capacity_mode, table_entry=choice.entry if choice is not None else None,
                     candidates=choice.candidates if choice is not None else ())


def _bucket_granules(k: int, top: int | None = None) -> int:
    """The granules of bucket ``k``'s representative batch, where :func:`_targets` plans the bucket's units: the one
    power of two the bucket holds, ``2^(k-1)`` (:func:`~attnplan.schedule.bucket_of` puts it 6% above the bucket's
    geometric middle), at most ``top`` (the most granules a batch of the plan holds). Uniform batches of power-of-two
    batches and lengths, where split-table rows are measured and live plans are made (``len_bucket``), total it: the
    schedule then gives them exactly the split a live plan chooses at their length (``ceil(T / target)`` granules
    per unit of the chosen chunk)."""
    p = 1 << max(0, k - 1)
    return p if top is None else max(1, min(p, top))


def _targets(problem: DecodeProblem, device: DeviceInfo, backend: str, cm: CostModel, bw: float, config: Config,
             granule: int, min_c: int, merges, fused_parallelism: int, fused_max_chunk: int, cap_granules: int,
             capacity_mode: bool, choice: _Choice, num_warps: int | None = None,
             one_bucket: bool = False) -> tuple[int, ...]:
    """The balanced schedule's targets: for each bucket ``k`` of total granules, the units a uniform batch of that
    much work gets (the split count :func:`_choose_splits` asks for, before chunk alignment, x batch; the schedule
    aligns on the device at the live total, and clamps to ``min_unit_granules``); then the long-tailed table, the
    same counts times ``cost_model.tail_target_scale``, raised to ``cost_model.tail_programs_per_sm`` programs per SM
    and capped at units of ``cost_model.tail_min_unit_tokens`` tokens on average (both off by default: unmeasured
    candidates for batches whose longest sequence holds much of the work). A capacity plan fills every
    bucket up to the capacity; a live plan computes the buckets its (bucketed) lengths can reach and extends the
    ends. ``one_bucket``: a live plan whose (bucketed) mean and longest lengths share one power-of-two bucket, so no
    batch of its bucket is long-tailed (the mean above the bucket's lower end, so above half the longest): its
    long-tailed table repeats the uniform one, and the grid (sized for the largest target,
    :func:`~attnplan.schedule.max_units_bound`) is not twice the units of those batches. A long-tailed batch run
    through it anyway (no new plan, or a graph replayed at other lengths) is served correctly with the uniform
    counts."""
    batch = problem.batch
    k_max = bucket_of(batch * cap_granules)
    if capacity_mode:
        k_lo, k_hi = 1, k_max
        top = batch * cap_granules  # the most granules a batch of this plan holds
    else:
        span = max(problem.max_kv_len, 1)
        top = batch * -(-span // granule)  # a uniform batch at the planned longest length
        k_hi = min(k_max, bucket_of(top))
        # the bucketed lengths stand for real ones down to half of them (attnplan.problem.len_bucket)
        k_lo = max(1, min(k_hi, bucket_of(max(1, problem.total_kv_len // (2 * granule)))))
    targets = [0] * NUM_BUCKETS
    memo: dict[int, int] = {}
    for k in range(k_lo, k_hi + 1):
        # each bucket planned at its power of two (the buckets put it near their middle, at a split-table row's
        # length): planned at a bucket's end between two rows, a uniform batch of a power-of-two batch and length
        # ran the row of 1.4x its length, measured on an H100 at cuda_ptx 32/8/128 b4 64K contiguous: the 64K row's 3
        # units ran as the 128K row's 13, 360.4 against 346.9 us
        rep = _bucket_granules(k, top)
        m = max(1, rep * granule // batch)  # tokens per sequence of that uniform batch
        if m not in memo:
            virt = replace(problem, max_kv_len=m, total_kv_len=m * batch, window_left=-1, capacity=max(m, 1))
            limit = max(1, min(config.split.max_splits, m // (min_c * granule)))
            ch = _choose_splits(virt, device, backend, cm, bw, limit, granule, merges, fused_parallelism,
                                fused_max_chunk, num_warps)
            memo[m] = min(config.split.max_splits, ch.want)
        targets[k] = memo[m] * batch
    for k in range(k_hi + 1, NUM_BUCKETS):
        targets[k] = targets[k_hi]
    for k in range(1, k_lo):
        targets[k] = targets[k_lo]
    # long-tailed batches: the same work's units, scaled by the device's measured factor (cost_model.tail_target_scale)
    scale = 1.0 if one_bucket else cm.tail_target_scale
    tail = [0] + [max(1, round(t * scale)) if t else 0 for t in targets[1:]]
    if not one_bucket and (cm.tail_programs_per_sm or cm.tail_min_unit_tokens):
        floor = math.ceil(cm.tail_programs_per_sm * device.sm_count / problem.num_kv_heads)
        for k in range(1, NUM_BUCKETS):
            if tail[k]:
                tail[k] = max(tail[k], floor)
                if cm.tail_min_unit_tokens:  # the bucket's representative work, as for its uniform target above
                    tail[k] = max(1, min(tail[k], _bucket_granules(k, top) * granule // cm.tail_min_unit_tokens))
    targets = targets + tail
    return tuple(targets)
