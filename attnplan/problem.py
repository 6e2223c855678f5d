"""`DecodeProblem`: the shapes, dtypes and lengths a plan is made for, and input validation.

Tensor conventions (the same as FlashAttention's kvcache API and vLLM's paged cache):

- ``q``: ``[batch, q_len, num_q_heads, head_dim]`` fp16 / bf16 / fp32.
- contiguous cache: ``k_cache, v_cache``: ``[batch, max_kv_len, num_kv_heads, head_dim]``.
- paged cache: ``k_cache, v_cache``: ``[num_pages, page_size, num_kv_heads, head_dim]`` with
  ``block_table``: ``[batch, max_pages_per_seq]`` int32.
- ``seq_lens``: ``[batch]`` int32, valid KV length of each sequence (0 allowed).
- query ``i`` of a sequence of length ``L`` sees KV positions ``< L - q_len + i + 1``.

Input contract
--------------
Every input below is checked on the host before any kernel runs; a violation raises ``TypeError``
(wrong type or dtype of q, the cache, lengths or block table) or ``ValueError`` (shape, stride, device, value or
aliasing; and any fault of ``sinks`` but its layout, including its type or dtype), and the message
names the argument, what was given and what is required.

*Layout.* Every tensor is dense (strided): a sparse or nested tensor (the latter's layout says strided) is a
``TypeError`` naming it; so is a tensor with elements but no memory of its own (a wrapper subclass such as
``DTensor``, or a tensor under ``torch.func.vmap``: its data pointer is 0 or unavailable). ``out`` and ``lse`` are
written in place: while grad mode is on, one that requires grad is a ``ValueError``, as torch's ``out=`` refuses it.

*Strides.* Unit stride (in elements) is required on the last axis of ``q``, ``k_cache``, ``v_cache``,
``out`` and ``lse``, on ``seq_lens``, on the block table's last axis (its columns), on ``sinks`` and on
tensor ``k_scale`` / ``v_scale``: the kernels address these with ``base + index``. Every other stride is
free: ``q``'s batch / query / head strides, the cache's page (or batch), token and head strides (a
cache may be a view into a larger pool, K and V may be interleaved), the block table's row stride and
the leading strides of ``out`` and ``lse``. An axis of size 1 may have any stride (it is never stepped). A
backend whose kernels read ``q`` and the caches in 16-byte vectors (``Backend.vector_rows``: cuda_ptx) serves only
views whose data pointer and strides are multiples of 16 bytes (:func:`rows_16_byte`); dispatch passes it over
for other views, and a plan forced onto it is refused at ``plan()``.

*Values.* ``seq_lens`` in ``[0, capacity]``; the block-table entries a sequence uses (its first
``ceil(seq_len / page_size)``) in ``[0, num_pages)``, the others are never read. ``sm_scale`` finite
(0 and negative scales are legal), 0 or at least :data:`SM_SCALE_MIN` and at most :data:`FP32_SCALED_MAX` in
magnitude (a normal fp32 number after the ``log2(e)`` factor); the kernels compute in fp32, so ``sum_i |q_i k_i|``
and ``|sm_scale|`` times it must also stay within it (with an fp8 cache, over K's stored values and times
``k_scale``), and ``max|V| x visible tokens`` within fp32's range (not checked: these are values; past them a row
overflows to inf / NaN, or to an empty row where every scaled score is -inf; README, "fp32 range"). ``logits_soft_cap``
in ``[0, SOFT_CAP_MAX]``: 0 (off) or at least :data:`SOFT_CAP_MIN` (fp32's smallest normal number). ``window_left`` an
``int`` (not ``bool``) ``>= -1`` (-1 = no window; a window longer than the cache is legal, of any size:
:func:`effective_window`). fp8 ``k_scale`` / ``v_scale``: finite, at least :data:`SCALE_MIN` (fp32's smallest normal
number) and at most :data:`FP32_SCALED_MAX` (floats and tensor values alike), and ``sm_scale`` times the largest K scale
too. A paged cache has at least one page. No input or output is a lazily negated view
(``Tensor.is_neg()``; checked by ``plan()``, ``run()`` and ``decode()``, ``seq_lens`` and the block table
included: such a view has the signature of the tensor it views). ``sinks``: no NaN and
no ``+inf``; ``-inf`` means "no sink" for that head. Float scales are checked on every call. Tensor ``sinks`` /
``k_scale`` / ``v_scale`` values are read once per tensor version: the first ``plan()`` that sees a tensor reads it
(one device-to-host copy, a sync), and later plans skip it while its data pointer, version counter
(``tensor._version``, bumped by every in-place torch op) and device are unchanged. Writes that bypass
the version counter (through ``.data``, an inference-mode tensor, or a foreign kernel) are not seen.
``seq_lens`` and the block table are read by ``plan()`` only when ``seq_lens_host`` is not given (one
device-to-host read of both, a single host sync); ``run()`` reads no values: keep them valid between
``plan()`` and ``run()``. Lengths are still validated on the host wherever the host reads them (``plan()``,
``seq_lens_host``). On the device every kernel backend (triton, numba, cuda_ptx) reads each length clamped
into ``[0, capacity]`` (``min(max(seq_lens[b], 0), capacity)``, the schedule and every row derived from the
clamped value), and the reference backend does the same: a ``seq_lens`` value outside ``[0, capacity]``
written after ``plan()`` (or found at a CUDA-graph replay) is not detected, but the output is then attention
over the clamped span (a negative length is an empty sequence: ``out = 0``, ``lse = -inf`` or the sink), never
a read outside the cache. The page clamp below does the same for the block table's entries.

*Host lengths.* With ``seq_lens_host`` (``batch`` host ints equal to ``seq_lens``: a list, tuple or iterator
of ``int``, a 1-D CPU integer tensor or a numpy integer array; floats, strings and other kinds are a
``TypeError``, a device tensor too, since reading it is the sync this argument avoids) ``plan()`` and
``attnplan.decode()`` read nothing from the device: the host lengths are checked (``[0, capacity]``)
and the block table's values are not read at all. The caller vouches for its lengths and its table, as
FlashInfer's and vLLM's ``plan()`` do. The kernels make that safe: every page index a kernel backend
(triton, numba, cuda_ptx) loads from the block table is clamped into ``[0, num_pages)`` before it
addresses the cache, so an entry outside that range reads a wrong page (a wrong output for that
sequence) but never reads outside the cache. A paged cache with no pages (``num_pages == 0``) cannot
serve a non-empty sequence and is refused on the host.

*Aliasing.* ``out`` and ``lse`` may not overlap any input (``q``, ``k_cache``, ``v_cache``,
``seq_lens``, ``block_table``, ``sinks``, the scales) or each other. The test compares the byte ranges
``[first byte, last byte]`` the tensors span, so it is conservative: interleaved views that share
no element but whose ranges cross (``lse = buf[..., 0]``, ``out = buf[..., 1:]``) are refused too.

*Plan and run.* ``run()`` compares the shapes, strides, dtypes, devices and 16-byte alignment of the
data pointers of ``q``, ``k_cache``, ``v_cache``, ``seq_lens`` and ``block_table`` with those
``plan()`` saw (an O(1) signature, no allocation, no sync; a difference is a ``ValueError`` asking for
a new ``plan()``), checks ``out`` and ``lse`` (shape, dtype, device, last-axis stride, overlap) and
the strides of the ``sinks`` and scales ``plan()`` kept; it reads no values. ``torch.ops.attnplan.decode``
keys its plans on the same signature, so a call with any difference is validated (and planned) anew.

*NaN and infinities.* A NaN in ``q`` or in a K position a query row can see makes that row's output and LSE NaN,
as does an infinity there that makes a score NaN or ``+inf``; one that makes a score ``-inf`` gives that position
weight 0, as softmax does (a row whose every score is ``-inf`` is empty: 0, LSE ``-inf``), and under a soft cap an
infinite score is capped like any other. A NaN or infinity in a V position a row sees makes the output columns it
reaches non-finite. Positions a row cannot see (past its
sequence's length, outside its sliding window, the later positions of speculative queries, pages
the block table does not map for it, unused cache capacity) never affect it, whatever they hold.
"""

from __future__ import annotations

import math
import numbers
import operator
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Set
from dataclasses import asdict, dataclass, replace

import torch

from ._repr import short_repr as _short
from .schedule import is_long_tailed

__all__ = ["DecodeProblem", "validate_inputs", "validate_values", "host_lengths", "validate_outputs",
           "check_no_overlap", "overlap_error", "rows_16_byte", "check_sm_scale", "SM_SCALE_MIN", "check_no_grad",
           "tensor_signature", "signature_change", "same_signature", "is_contiguous_layout", "DTYPE_NAMES",
           "dtype_name", "len_bucket", "explain_lengths"]

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
               torch.float8_e4m3fn: "float8_e4m3fn"}
Q_DTYPES = ("float16", "bfloat16", "float32")
KV_SCALES = ("none", "tensor", "head")
_NAME_TO_DTYPE = {v: k for k, v in DTYPE_NAMES.items()}
MAX_Q_LEN = 16


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the names used in problems, plans and cache keys). Raises ``KeyError`` for other dtypes."""
    return DTYPE_NAMES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`."""
    return _NAME_TO_DTYPE[name]


def len_bucket(n: int) -> int:
    """KV-length bucket used in plan-cache keys: the next power of two, at least 16 tokens."""
    return 16 if n <= 16 else 1 << (int(n) - 1).bit_length()


def mean_bucket(total_kv_len: int, batch: int, max_kv_len: int) -> int:
    """The mean length's bucket in a plan-cache key (tokens): :func:`len_bucket` of the mean, except for a
    long-tailed batch (mean below half the longest: ``2 x total < batch x max``) whose mean rounds up to half the
    longest's bucket, which gets a quarter of it. So the bucketed lengths say whether the batch is long-tailed, as
    the real ones do: a near-uniform batch's mean bucket is at least half its longest's, a long-tailed one's at
    most a quarter (the plan of a long-tailed batch is never a single pass, :func:`attnplan.planner.make_plan`),
    except where the longest is at most 16 tokens (one bucket: both are 16)."""
    m = len_bucket(-(-total_kv_len // batch))
    # is_long_tailed's test written out: this runs on every plan-cache hit, where the call cost 0.2 us more
    if 2 * total_kv_len < batch * max_kv_len and 2 * m == len_bucket(max_kv_len):
        return m // 2
    return m


#: the :class:`DecodeProblem` fields that must be ints (``page_size`` too, unless ``None``)
_INT_FIELDS = ("batch", "num_q_heads", "num_kv_heads", "head_dim", "q_len", "max_kv_len", "total_kv_len", "capacity")


@dataclass(frozen=True)
class DecodeProblem:
    """One decode-attention problem as the planner sees it.

    Attributes:
        batch: number of sequences.
        num_q_heads / num_kv_heads: query and KV heads; ``num_q_heads % num_kv_heads == 0``.
        head_dim: channels per head.
        q_len: queries per sequence (1 = plain decode, >1 = speculative verification).
        page_size: tokens per page for a paged cache, ``None`` for a contiguous cache.
        q_dtype / kv_dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"`` (kv_dtype also ``"float8_e4m3fn"``); the
            output takes q's.
        max_kv_len: the longest sequence the plan must serve, in tokens (live maximum for an
            eager plan, the cache capacity for a CUDA-graph plan).
        total_kv_len: sum of all sequences' lengths in tokens (``batch * max_kv_len`` when only
            the capacity is known); lets the planner see long-tailed batches.
        capacity: tokens each sequence can hold in the cache (contiguous: ``max_kv_len`` axis;
            paged: ``max_pages_per_seq * page_size``); a live plan made by ``DecodeWrapper`` takes its power-of-two
            bucket (:func:`len_bucket`), so it serves every cache of up to that many tokens.
        window_left: sliding window, tokens: the query at position ``p`` sees ``[p - window_left, p]``;
            ``-1`` = no window.
        soft_cap: logits soft-cap ``cap * tanh(score / cap)`` on the scaled scores; ``0`` = off.
        has_sinks: a per-query-head sink logit joins the softmax denominator (gpt-oss), applied at merge.
        kv_scale: dequantization scales of an fp8 cache: ``"none"``, ``"tensor"`` or ``"head"``
            (per KV head); K and V are multiplied by their scales.

    Raises:
        TypeError: a count, length or ``page_size`` that is not an int (a bool, a float, a string; numpy integers
            are taken as ints), ``has_sinks`` not a bool, ``window_left`` / ``soft_cap`` of the wrong type.
        ValueError: a value out of range (named, with the range).
    """

    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    q_len: int = 1
    page_size: int | None = None
    q_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    max_kv_len: int = 0
    total_kv_len: int = -1
    capacity: int = 0
    window_left: int = -1
    soft_cap: float = 0.0
    has_sinks: bool = False
    kv_scale: str = "none"

    def __post_init__(self) -> None:
        # the types first: every field reaches the planner's integer arithmetic, the plan cache's key and JSON
        for name in _INT_FIELDS if self.page_size is None else _INT_FIELDS + ("page_size",):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"DecodeProblem.{name} must be an int, got {type(v).__name__} {_short(v)}")
            object.__setattr__(self, name, int(v))  # numpy / other integers as Python ints
        if not isinstance(self.has_sinks, bool):
            raise TypeError(f"DecodeProblem.has_sinks must be a bool, got {type(self.has_sinks).__name__} "
                            f"{_short(self.has_sinks)}")
        check_window_left(self.window_left)
        check_soft_cap(self.soft_cap, "soft_cap")
        object.__setattr__(self, "window_left", int(self.window_left))
        object.__setattr__(self, "soft_cap", float(self.soft_cap))
        if self.total_kv_len < 0:
            object.__setattr__(self, "total_kv_len", self.batch * self.max_kv_len)
        if self.capacity <= 0:
            object.__setattr__(self, "capacity", self.max_kv_len)
        check_heads(self.num_q_heads, self.num_kv_heads)
        for name in ("batch", "head_dim", "q_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.q_len > MAX_Q_LEN:
            raise ValueError(f"q_len must be <= {MAX_Q_LEN}, got {self.q_len}")
        if self.page_size is not None and (self.page_size < 1 or self.page_size & (self.page_size - 1)):
            raise ValueError(f"page_size must be a power of two >= 1, got {self.page_size}")
        if self.q_dtype not in Q_DTYPES:
            raise ValueError(f"q_dtype must be one of {Q_DTYPES}, got {self.q_dtype!r}")
        if self.kv_dtype not in _NAME_TO_DTYPE:
            raise ValueError(f"kv_dtype must be one of {sorted(_NAME_TO_DTYPE)}, got {self.kv_dtype!r}")
        if self.kv_scale not in KV_SCALES:
            raise ValueError(f"kv_scale must be one of {KV_SCALES}, got {self.kv_scale!r}")
        if self.max_kv_len < 0:
            raise ValueError(f"max_kv_len must be >= 0, got {self.max_kv_len}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (the GQA group); one program serves a whole group where its rows fit (else the
        plan's head blocks split it)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def long_tailed(self) -> bool:
        """Whether the lengths are long-tailed: the mean below half the longest, ``2 x total_kv_len < batch x
        max_kv_len`` (the device-side schedule's test, :func:`attnplan.schedule.is_long_tailed`, in tokens)."""
        return is_long_tailed(self.total_kv_len, self.batch, self.max_kv_len)

    @property
    def visible_span(self) -> int:
        """Most KV positions any query of a sequence can see, tokens (the window bounds it)."""
        if self.window_left < 0:
            return self.max_kv_len
        return min(self.max_kv_len, self.window_left + self.q_len)

    @property
    def variants(self) -> frozenset[str]:
        """Names of the attention variants this problem uses (backends declare the ones they serve)."""
        v = set()
        if self.window_left >= 0:
            v.add("window")
        if self.soft_cap > 0:
            v.add("softcap")
        if self.has_sinks:
            v.add("sinks")
        if self.kv_dtype == "float8_e4m3fn":
            v.add("fp8_kv")
        return frozenset(v)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K plus V per token per KV head."""
        return 2 * self.head_dim * torch_dtype(self.kv_dtype).itemsize

    def bytes_moved(self, total_kv_tokens: int | None = None) -> int:
        """The fewest bytes a decode step must move: K + V of every valid token, q read, out written."""
        tokens = self.total_kv_len if total_kv_tokens is None else total_kv_tokens
        qo = 2 * self.batch * self.q_len * self.num_q_heads * self.head_dim * torch_dtype(self.q_dtype).itemsize
        return tokens * self.num_kv_heads * self.kv_bytes_per_token + qo

    def bucket(self) -> dict:
        """The fields of the plan-cache key (:mod:`attnplan.cache`): lengths bucketed to powers of two."""
        return {
            "batch": self.batch, "num_q_heads": self.num_q_heads, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "q_len": self.q_len, "page_size": self.page_size,
            "q_dtype": self.q_dtype, "kv_dtype": self.kv_dtype,
            "max_kv_len": len_bucket(self.max_kv_len),
            "mean_kv_len": mean_bucket(self.total_kv_len, self.batch, self.max_kv_len),
            "window_left": self.window_left, "soft_cap": self.soft_cap, "has_sinks": self.has_sinks,
            "kv_scale": self.kv_scale,
        }

    def bucket_key(self) -> tuple:
        """:meth:`bucket`'s values as a tuple, in its order (the plan-cache key; built without a dict
        because a cache hit must cost microseconds)."""
        return (self.batch, self.num_q_heads, self.num_kv_heads, self.head_dim, self.q_len, self.page_size,
                self.q_dtype, self.kv_dtype, len_bucket(self.max_kv_len),
                mean_bucket(self.total_kv_len, self.batch, self.max_kv_len),
                self.window_left, self.soft_cap, self.has_sinks, self.kv_scale)

    @staticmethod
    def static_bucket_key(static: dict, max_kv_len: int, total_kv_len: int) -> tuple:
        """:meth:`bucket_key` of ``DecodeProblem(max_kv_len=..., total_kv_len=..., **static)`` (``static``: what
        :func:`validate_inputs` returns; ``total_kv_len >= 0``) without making the problem: a plan-cache hit
        needs only its key."""
        b = static["batch"]
        return (b, static["num_q_heads"], static["num_kv_heads"], static["head_dim"], static["q_len"],
                static["page_size"], static["q_dtype"], static["kv_dtype"], len_bucket(max_kv_len),
                mean_bucket(total_kv_len, b, max_kv_len), static["window_left"], static["soft_cap"],
                static["has_sinks"], static["kv_scale"])

    def bucketed(self) -> "DecodeProblem":
        """The problem the plan is made for: lengths raised to their bucket's upper bound, so one
        plan serves every length in the bucket."""
        b = self.bucket()
        return replace(self, max_kv_len=b["max_kv_len"], total_kv_len=min(b["mean_kv_len"] * self.batch, b["max_kv_len"] * self.batch))

    def to_dict(self) -> dict:
        return asdict(self)


def check_heads(num_q_heads: int, num_kv_heads: int) -> None:
    """Raise ``ValueError`` naming both head counts unless ``num_q_heads`` is a positive multiple of ``num_kv_heads``."""
    if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads}); "
            "each KV head serves a GQA group of num_q_heads // num_kv_heads query heads"
        )


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _is_real(x) -> bool:
    """A Python / numpy real number, not a bool and not a tensor (reading a tensor would sync)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _as_float(x) -> float:
    """``float(x)`` of a real number (:func:`_is_real`), or ``+-inf`` for one beyond the float range (an int of
    more than 1024 bits, a huge ``Fraction``), which the range checks then refuse by name (never an
    ``OverflowError``). Range checks compare this Python float, not ``x``: a numpy ``float16`` compared with a bound
    above its range would warn on the bound's cast."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


#: log2(e): the kernels' base-2 softmax scales ``sm_scale`` and the soft cap by it, in fp32 (the bounds below)
LOG2E = 1.4426950408889634

#: the largest magnitude a float parameter the kernels scale by log2(e) may have (fp32's largest finite value over
#: log2(e)): a larger finite ``sm_scale``, soft cap or fp8 scale would become inf in fp32, and the output NaN
FP32_SCALED_MAX = 3.4028234663852886e38 / LOG2E


#: the largest soft cap: the kernels compute ``tanh(score / cap)`` in fp32, and above ~1e30 a score that matters to
#: the softmax (|score| >= ~1e-7) divided by the cap falls below fp32's smallest normal number (~1.2e-38) and is
#: flushed to 0
SOFT_CAP_MAX = 1e30

#: fp32's smallest normal number (2^-126, ~1.18e-38): a smaller positive float is 0 or a subnormal in fp32, which a
#: GPU may flush to 0
FP32_NORMAL_MIN = 2.0 ** -126

#: the smallest positive soft cap (:data:`FP32_NORMAL_MIN`): below it ``score / cap`` of a score of 0 could be
#: ``0 / 0`` (the row NaN); at this cap and above, ``1 / cap`` is finite in fp32 and every score is capped to within
#: ``cap`` of 0
SOFT_CAP_MIN = FP32_NORMAL_MIN

#: the smallest fp8 dequantization scale (``k_scale`` / ``v_scale``; :data:`FP32_NORMAL_MIN`): the kernels apply it in
#: fp32, where a smaller one could be 0 (all scores 0, or an all-zero output), so it is refused like 0
SCALE_MIN = FP32_NORMAL_MIN


def check_window_left(window_left) -> None:
    """``window_left`` must be an ``int`` (not ``bool``) ``>= -1`` tokens; raises ``TypeError`` / ``ValueError``."""
    if isinstance(window_left, bool) or not isinstance(window_left, numbers.Integral):
        raise TypeError(f"window_left must be an int (-1 = no window, else tokens >= 0), got "
                        f"{type(window_left).__name__} {window_left!r}")
    if window_left < -1:
        raise ValueError(f"window_left must be -1 (no window) or an int >= 0 tokens, got {_short(window_left)}")


#: windows of at least this many tokens are clamped (:func:`effective_window`)
WINDOW_CLAMP = 1 << 30


def kv_capacity(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """Tokens a sequence of the cache can hold: ``k_cache.shape[1]`` (contiguous ``[B, T, Hkv, D]``), or
    ``block_table.shape[1] x page_size`` (paged ``[pages, page_size, Hkv, D]``). Shapes only: no device access."""
    if block_table is None:
        return int(k_cache.shape[1])
    return int(block_table.shape[1]) * int(k_cache.shape[1])


def effective_window(window_left: int, capacity: int) -> int:
    """The window the kernels get: ``window_left`` itself below :data:`WINDOW_CLAMP` (2^30 tokens), else
    ``max(2^30, min(window_left, capacity))``, which sees exactly the same positions (a window at least as long as
    the cache is no window) and keeps ``L - q_len - window_left`` within 32 bits for caches of up to 2^31 tokens
    (larger ones: the kernels that take them use 64-bit positions, and cuda_ptx refuses them). A live plan's key
    then does not depend on the capacity for any window below 2^30."""
    if window_left < WINDOW_CLAMP:
        return int(window_left)
    return max(WINDOW_CLAMP, min(int(window_left), int(capacity)))


def check_soft_cap(cap, name: str = "logits_soft_cap") -> None:
    """The soft cap must be a finite real in ``[0, SOFT_CAP_MAX]``, ``0`` (off) or at least :data:`SOFT_CAP_MIN`;
    raises ``TypeError`` / ``ValueError`` naming ``name``."""
    if not _is_real(cap):
        raise TypeError(f"{name} must be a float >= 0 (0 = off), got {type(cap).__name__} {cap!r}")
    c = _as_float(cap)
    if not math.isfinite(c) or c < 0 or c > SOFT_CAP_MAX:
        raise ValueError(f"{name} must be a finite float in [0, {SOFT_CAP_MAX:g}] (0 = off; the kernels compute "
                         f"score / cap in fp32, which a larger cap flushes to 0), got {_short(cap)}")
    if 0 < c < SOFT_CAP_MIN:
        raise ValueError(f"{name} must be a finite float in [0, {SOFT_CAP_MAX:g}], 0 (off) or at least "
                         f"{SOFT_CAP_MIN:.4g} (fp32's smallest normal number: the kernels compute score / cap in fp32, "
                         f"where a smaller cap is 0 or flushed to 0), got {_short(cap)}")


def check_strided(t: torch.Tensor, name: str) -> None:
    """Raise ``TypeError`` unless the tensor ``t`` (named ``name`` in the message) has torch's dense, strided layout:
    a sparse or other tensor has no data pointer the kernels could read, and a nested tensor (whose layout may say
    strided) no single shape."""
    if t.layout != torch.strided or t.is_nested:
        raise TypeError(f"{name} must be a dense (strided) tensor, got "
                        f"{'a nested tensor' if t.is_nested else t.layout}")


def check_addressable(t: torch.Tensor, name: str) -> None:
    """Raise ``TypeError`` unless the kernels can address the elements of ``t`` (named ``name`` in the message): a
    tensor with elements must have a data pointer. A wrapper subclass without storage of its own (``DTensor``, a
    tensor under ``torch.func.vmap``) has none (``data_ptr()`` raises or answers 0), and a
    kernel handed its address would read or write address 0. A meta tensor (address 0 too) is left to its own check;
    a tensor without elements is never read. O(1), no sync."""
    if t.is_meta or t.numel() == 0:
        return
    try:
        p = t.data_ptr()
    except RuntimeError:
        p = 0
    if not p:
        raise TypeError(f"{name} is a {type(t).__name__} without memory of its own (no data pointer the kernels "
                        f"could read or write): pass a plain tensor (a DTensor's to_local(), a subclass's inner "
                        f"tensor)")


def check_no_grad(q, k_cache, v_cache, sinks=None, k_scale=None, v_scale=None) -> None:
    """attnplan computes no gradients (decode attention, for inference): while grad mode is on, an input that requires
    grad would get an output detached from it, silently. Refused instead (``plan()`` and ``decode()``; ``run()``
    does not look). O(1), no sync.

    Raises:
        ValueError: grad mode is on and ``q``, ``k_cache``, ``v_cache``, ``sinks``, ``k_scale`` or ``v_scale`` (fp8
            scale tensors) requires grad (named)."""
    if not torch.is_grad_enabled():
        return
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("sinks", sinks), ("k_scale", k_scale),
                    ("v_scale", v_scale)):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(f"{name} requires grad: attnplan computes no gradients (its output would be detached "
                             f"from {name}); call it under torch.no_grad() or torch.inference_mode(), or pass "
                             f"{name}.detach()")


#: the smallest magnitude of a nonzero ``sm_scale`` (:data:`FP32_NORMAL_MIN` over log2(e), ~8.1e-39): the kernels
#: take ``sm_scale x log2(e)`` as an fp32 argument, and a smaller one is subnormal there (flushed to 0 by some
#: kernels and GPUs, kept by others, and typed fp64 by Triton's interpreter, whose fp64 -> bf16 conversion gives 0)
SM_SCALE_MIN = FP32_NORMAL_MIN / LOG2E


def check_sm_scale(sm_scale) -> None:
    """``sm_scale`` must be ``None`` (``1/sqrt(head_dim)``) or a finite real, 0 or of magnitude in
    ``[SM_SCALE_MIN, FP32_SCALED_MAX]``; 0 and negative scales are legal (they flatten or invert the softmax).
    Raises ``TypeError`` / ``ValueError``."""
    if sm_scale is None:
        return
    if not _is_real(sm_scale):
        raise TypeError(f"sm_scale must be a float or None (1/sqrt(head_dim)), got {type(sm_scale).__name__} "
                        f"{sm_scale!r}")
    v = _as_float(sm_scale)
    if not math.isfinite(v) or abs(v) > FP32_SCALED_MAX:
        raise ValueError(f"sm_scale must be finite and at most {FP32_SCALED_MAX:.4g} in magnitude (the kernels scale "
                         f"it by log2(e) in fp32), got {_short(sm_scale)}")
    if v != 0 and abs(v) < SM_SCALE_MIN:
        raise ValueError(f"sm_scale must be 0 or at least {SM_SCALE_MIN:.4g} in magnitude (the kernels scale it by "
                         f"log2(e) in fp32, and a smaller scale is subnormal there), got {_short(sm_scale)}; pass 0 "
                         "for a uniform softmax")


def _unit_stride(name: str, t: torch.Tensor, axis: int, what: str) -> None:
    """Raise ``ValueError`` unless ``t``'s ``axis`` has unit stride (an axis of size <= 1 may have any)."""
    if t.shape[axis] > 1 and t.stride(axis) != 1:
        raise ValueError(f"{name} must have unit stride in {what}, got strides {tuple(t.stride())} for shape "
                         f"{_shape(t)}; pass {name}.contiguous()")


def validate_inputs(q, k_cache, v_cache, seq_lens, block_table=None, *, window_left: int = -1,
                    soft_cap: float = 0.0, sinks=None, k_scale=None, v_scale=None, sm_scale=None) -> dict:
    """Check shapes, dtypes, devices, strides and scalar parameters (the module's input contract).
    Returns the problem's static fields.

    No host sync, except the one-time value check of tensor ``sinks`` / ``k_scale`` / ``v_scale``
    (once per tensor version, see the module docstring).

    Raises:
        TypeError: an argument is not a tensor (or a number where one is expected), or has an
            unsupported dtype (``sinks`` raises ``ValueError`` for these).
        ValueError: shapes, strides, devices or head counts do not agree, a tensor is on the meta device (no data),
            or a parameter's value is
            out of range (non-finite scale, negative soft cap, NaN sink...); the message names the
            argument, what was given and what is expected.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("seq_lens", seq_lens),
                    ("block_table", block_table)):
        if not isinstance(t, torch.Tensor):
            if name == "block_table":
                continue  # None (a contiguous cache), or refused by name below
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        check_strided(t, name)
        if t.is_meta:
            raise ValueError(f"{name} is on the meta device (a shape without data): attnplan reads and writes "
                             "values, pass tensors on the CPU or a GPU")
        check_addressable(t, name)
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D [batch, q_len, num_q_heads, head_dim], got shape {_shape(q)}")
    batch, q_len, hq, d = q.shape
    if q.dtype not in DTYPE_NAMES or DTYPE_NAMES[q.dtype] not in Q_DTYPES:
        raise TypeError(f"q.dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be 4-D, got shape {_shape(k_cache)}")
    if _shape(v_cache) != _shape(k_cache):
        raise ValueError(f"v_cache shape {_shape(v_cache)} must equal k_cache shape {_shape(k_cache)}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"v_cache.dtype {v_cache.dtype} must equal k_cache.dtype {k_cache.dtype}")
    if k_cache.dtype not in DTYPE_NAMES:
        raise TypeError(f"k_cache.dtype must be float16, bfloat16, float32 or float8_e4m3fn, got {k_cache.dtype}")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 and q.dtype == torch.float32:
        raise TypeError("an fp8 KV cache needs q in float16 or bfloat16, got float32")
    if not fp8 and k_cache.dtype != q.dtype:
        raise TypeError(f"k_cache.dtype {k_cache.dtype} must equal q.dtype {q.dtype} (or be float8_e4m3fn)")
    if d < 1:
        raise ValueError(f"head_dim (q.shape[3]) must be >= 1, got shape {_shape(q)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_not_lazy(name, t)
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} must equal q's head_dim {d} (shape {_shape(k_cache)})")
    check_heads(hq, hkv)
    if q_len < 1 or q_len > MAX_Q_LEN:
        raise ValueError(f"q_len (q.shape[1]) must be in [1, {MAX_Q_LEN}], got {q_len}")
    if batch < 1:
        raise ValueError(f"batch (q.shape[0]) must be >= 1, got {batch}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all inputs must share one device")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must have shape [batch] = [{batch}], got {_shape(seq_lens)}")
    if seq_lens.dtype != torch.int32:
        raise TypeError(f"seq_lens.dtype must be torch.int32, got {seq_lens.dtype}")
    check_not_lazy("seq_lens", seq_lens)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in head_dim (last axis), got strides {t.stride()}")
    _unit_stride("seq_lens", seq_lens, 0, "its batch axis (a contiguous [batch] int32 tensor)")
    if block_table is None:
        if k_cache.shape[0] < batch:
            raise ValueError(
                f"contiguous k_cache must have shape [batch={batch}, max_kv_len, num_kv_heads, head_dim], "
                f"got {_shape(k_cache)}"
            )
        page_size, capacity = None, int(k_cache.shape[1])
    else:
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be a torch.Tensor or None, got {type(block_table).__name__}")
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape [batch={batch}, max_pages_per_seq], got {_shape(block_table)}")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table.dtype must be torch.int32, got {block_table.dtype}")
        check_not_lazy("block_table", block_table)
        if block_table.device != q.device:
            raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}")
        _unit_stride("block_table", block_table, 1, "its last axis (the pages of one sequence; rows may be strided)")
        page_size = int(k_cache.shape[1])
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size (k_cache.shape[1]) must be a power of two, got {page_size}")
        capacity = int(block_table.shape[1]) * page_size
        if k_cache.shape[0] == 0 and capacity > 0:  # the kernels clamp page indices into [0, num_pages): none there
            raise ValueError(f"a paged k_cache needs at least one page (k_cache.shape[0] = 0) for a block table of "
                             f"{block_table.shape[1]} pages per sequence: any length up to its capacity "
                             f"({capacity} tokens) may be run with the plan")
    check_sm_scale(sm_scale)
    kv_scale, k_max = _check_scales(fp8, k_scale, v_scale, int(hkv), q.device)
    if sm_scale is not None and abs(float(sm_scale)) * k_max > FP32_SCALED_MAX:
        what = "k_scale" if _is_real(k_scale) else "max(k_scale)"
        raise ValueError(f"sm_scale x {what} = {abs(float(sm_scale)) * k_max:.4g} exceeds {FP32_SCALED_MAX:.4g}: the "
                         "kernels fold the K scale into the score scale in fp32")
    check_window_left(window_left)
    check_soft_cap(soft_cap)
    if sinks is not None:
        if isinstance(sinks, torch.Tensor):
            check_strided(sinks, "sinks")
            check_addressable(sinks, "sinks")
        if not isinstance(sinks, torch.Tensor) or sinks.shape != (hq,) or sinks.dtype != torch.float32:
            raise ValueError(f"sinks must be a float32 tensor of shape [num_q_heads] = [{hq}], got "
                             f"{getattr(sinks, 'shape', type(sinks).__name__)} {getattr(sinks, 'dtype', '')}")
        if sinks.device != q.device:
            raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")
        _unit_stride("sinks", sinks, 0, "its head axis")
        check_not_lazy("sinks", sinks)
        _check_values_once("sinks", sinks)
    return dict(batch=int(batch), q_len=int(q_len), num_q_heads=int(hq), num_kv_heads=int(hkv), head_dim=int(d),
                page_size=page_size, q_dtype=dtype_name(q.dtype), kv_dtype=dtype_name(k_cache.dtype), capacity=capacity,
                window_left=effective_window(window_left, capacity), soft_cap=float(soft_cap),
                has_sinks=sinks is not None, kv_scale=kv_scale)


def _check_scales(fp8: bool, k_scale, v_scale, hkv: int, device) -> tuple[str, float]:
    """fp8 caches need K and V dequantization scales: finite floats in ``[SCALE_MIN, FP32_SCALED_MAX]`` (per tensor)
    or fp32 ``[num_kv_heads]`` tensors with unit stride whose values are. Returns the scale kind (``"none"``,
    ``"tensor"``, ``"head"``) and the largest K scale (0 without one)."""
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale / v_scale apply only to a float8_e4m3fn KV cache")
        return "none", 0.0
    kinds, k_max = set(), 0.0
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is None:
            raise ValueError(f"{name} is required with a float8_e4m3fn KV cache (a float, or float32 [num_kv_heads])")
        if _is_real(sc):
            vmax = _as_float(sc)
            if not (math.isfinite(vmax) and SCALE_MIN <= vmax <= FP32_SCALED_MAX):
                raise ValueError(f"{name} must be a finite float in [{SCALE_MIN:.4g}, {FP32_SCALED_MAX:.4g}] (the "
                                 f"dequantization scale, applied in fp32: smaller is 0 or subnormal there), got "
                                 f"{_short(sc)}")
            kinds.add("tensor")
        else:
            if isinstance(sc, torch.Tensor):
                check_strided(sc, name)
                check_addressable(sc, name)
            if not (isinstance(sc, torch.Tensor) and sc.dtype == torch.float32 and sc.shape == (hkv,)
                    and sc.device == device):
                raise ValueError(f"{name} must be a float or a float32 tensor [num_kv_heads] = [{hkv}] on {device}, "
                                 f"got {_describe(sc)}")
            _unit_stride(name, sc, 0, "its KV-head axis")
            check_not_lazy(name, sc)
            vmax = _check_values_once(name, sc)
            kinds.add("head")
        if name == "k_scale":
            k_max = vmax
    return ("head" if "head" in kinds else "tensor"), k_max


def check_not_lazy(name: str, t: torch.Tensor) -> None:
    """Refuse a lazily negated or conjugated view (``Tensor.is_neg()`` / ``is_conj()``) of any shape and dtype: the
    kernels read and write its memory as it is, without the pending negation.

    Raises:
        ValueError: ``t`` is such a view (the message names ``name``).
    """
    if t.is_neg() or t.is_conj():
        raise ValueError(f"{name} is a lazily negated or conjugated view (the kernels read and write its memory as it "
                         f"is): pass {name}.resolve_neg() / .resolve_conj()")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {_shape(x)} on {x.device}"
    r = repr(x)
    return f"{type(x).__name__} {r[:80] + '...' if len(r) > 80 else r}"


#: (data_ptr, version, device, shape, strides, name) -> (weak reference to the checked tensor's base, its largest
#: value): the tensor values :func:`_check_values_once` has read (bounded; a hit needs the same base tensor still
#: alive, so memory freed and reused by another tensor is read again)
_SEEN_VALUES: "OrderedDict[tuple, tuple[weakref.ref, float]]" = OrderedDict()
_SEEN_LOCK = threading.Lock()
_SEEN_MAX = 4096


def _bad_values(name: str, v: torch.Tensor) -> int | None:
    """Index of the first value of ``v`` that ``name`` may not hold, or ``None`` (reads ``v``: a sync on a GPU)."""
    bad = (torch.isnan(v) | (v == float("inf")) if name == "sinks"
           else ~(torch.isfinite(v) & (v >= SCALE_MIN) & (v <= FP32_SCALED_MAX)))
    if not bool(bad.any()):
        return None
    return int(bad.nonzero()[0, 0])


def _check_values_once(name: str, t: torch.Tensor) -> float:
    """Read ``t``'s values (a device-to-host copy: a sync on a GPU) unless this tensor was checked at its
    current version. ``sinks``: no NaN and no ``+inf``; ``k_scale`` / ``v_scale``: finite, at least
    :data:`SCALE_MIN` and at most :data:`FP32_SCALED_MAX`. Returns the largest value (kept with the check, so a later
    plan needs no read)."""
    base = t if t._base is None else t._base
    try:
        version = t._version
    except RuntimeError:  # an inference-mode tensor has no version counter: keyed without one
        version = -1
    key = (t.data_ptr(), version, str(t.device), _shape(t), tuple(t.stride()), name)
    with _SEEN_LOCK:
        seen = _SEEN_VALUES.get(key)
        if seen is not None and seen[0]() is base:
            _SEEN_VALUES.move_to_end(key)
            return seen[1]
    v = t.detach()
    i = _bad_values(name, v)
    if i is not None:
        want = ("must not be NaN or +inf (-inf = no sink for that head)" if name == "sinks"
                else f"must be finite, at least {SCALE_MIN:.4g} (fp32's smallest normal number) and at most "
                     f"{FP32_SCALED_MAX:.4g} (a dequantization scale per KV head, applied in fp32)")
        raise ValueError(f"{name}[{i}] = {float(v[i])}: {name} {want}")
    vmax = float(v.max()) if v.numel() else 0.0
    with _SEEN_LOCK:
        _SEEN_VALUES[key] = (weakref.ref(base), vmax)
        _SEEN_VALUES.move_to_end(key)
        while len(_SEEN_VALUES) > _SEEN_MAX:
            _SEEN_VALUES.popitem(last=False)
    return vmax


def has_internal_overlap(shape, strides) -> bool:
    """Whether two elements of a tensor of this shape and these strides may share memory (O(ndim), no read): an
    axis of more than one element whose stride is below the span of the axes with smaller strides (a zero stride
    included, as of an ``expand()``). Conservative: a layout whose axes interleave without overlapping, which no
    torch view makes, counts as overlapping."""
    span = 1
    for st, n in sorted(zip(strides, shape)):
        if n > 1:
            if st < span:
                return True
            span += (n - 1) * st
    return False


def validate_outputs(q: torch.Tensor, out, lse) -> None:
    """Check the output buffers against ``q`` (O(1), no sync): ``out`` ``[batch, q_len, num_q_heads,
    head_dim]`` in q's dtype and ``lse`` ``[batch, q_len, num_q_heads]`` float32 (either may be ``None``:
    not checked), both on q's device with unit stride in their last axis (leading strides are free).

    Raises:
        TypeError: ``out`` or ``lse`` is not a tensor, or has no memory of its own (:func:`check_addressable`).
        ValueError: shape, dtype, device or last-axis stride differ (named, with what is required), or grad mode is
            on and the buffer requires grad (written in place, it would hold a result autograd knows nothing of;
            torch's own ``out=`` refuses it too).
    """
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        check_strided(out, "out")
        check_addressable(out, "out")
        _check_output_grad("out", out)
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got {tuple(out.shape)} "
                             f"{out.dtype} on {out.device}")
        _unit_stride("out", out, -1, "head_dim (last axis)")
        _no_self_overlap("out", out)
        check_not_lazy("out", out)
    if lse is None:
        return
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor or None, got {type(lse).__name__}")
    check_strided(lse, "lse")
    check_addressable(lse, "lse")
    _check_output_grad("lse", lse)
    if lse.shape != q.shape[:3] or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(f"lse must be {tuple(q.shape[:3])} float32 on {q.device}, got {tuple(lse.shape)} {lse.dtype} "
                         f"on {lse.device}")
    _unit_stride("lse", lse, -1, "num_q_heads (last axis)")
    _no_self_overlap("lse", lse)
    check_not_lazy("lse", lse)


def _no_self_overlap(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` when two elements of output ``t`` share memory (:func:`has_internal_overlap`): two
    rows would be written to one place and one result lost."""
    if not t.is_contiguous() and has_internal_overlap(t.shape, t.stride()):
        raise ValueError(f"{name} has elements that share memory (shape {_shape(t)}, strides {tuple(t.stride())}, e.g. "
                         f"an expand()): two rows would be written to one place; pass a buffer of distinct elements")


def _check_output_grad(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` where grad mode is on and the output buffer ``t`` requires grad."""
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad: attnplan writes it in place and computes no gradients (autograd "
                         f"would not know of the result); pass a buffer that does not require grad, or call under "
                         f"torch.no_grad()")


def check_variant_tensors(q: torch.Tensor, sinks, k_scale, v_scale,
                          num_kv_heads: int | None = None) -> None:
    """``run()``'s O(1) recheck of the tensors ``plan()`` kept by reference (the caller may have resized them in
    place since): ``sinks`` ``[num_q_heads]`` and ``k_scale`` / ``v_scale`` ``[num_kv_heads]`` (their sizes checked
    when ``num_kv_heads`` is given), float32 on q's device with unit stride. Their values are not read (see the
    module docstring). Raises ``ValueError``."""
    for name, t, n in (("sinks", sinks, q.shape[2]), ("k_scale", k_scale, num_kv_heads),
                       ("v_scale", v_scale, num_kv_heads)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.float32 or t.device != q.device \
                or (n is not None and t.shape[0] != n):
            raise ValueError(f"{name} must be a 1-D float32 tensor of {n if n is not None else 'its'} elements on "
                             f"{q.device}, got {_describe(t)}")
        _unit_stride(name, t, 0, "its only axis")


def tensor_signature(name: str, t) -> tuple | None:
    """``(name, shape, strides, dtype, device, data pointer 16-byte aligned)`` of ``t`` (``None`` for
    ``None``): what ``run()`` compares with the plan (O(1), no allocation, no sync).

    Raises:
        TypeError: ``t`` is neither a tensor nor ``None``.
    """
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return (name, t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


_SIG_FIELDS = ("shape", "strides", "dtype", "device", "16-byte alignment of the data pointer")


def rows_16_byte(sig: tuple) -> bool:
    """Whether the tensor of :func:`tensor_signature` ``sig`` can be read in 16-byte vectors: its data pointer and
    every stride of an axis longer than one (in bytes) are multiples of 16 (a C-contiguous tensor whose rows are
    whole 16-byte vectors, or a view into a pool of such rows)."""
    _, shape, strides, dtype, _, aligned = sig
    size = dtype.itemsize
    return aligned and all(s * size % 16 == 0 for s, n in zip(strides[:-1], shape[:-1]) if n > 1)


def is_contiguous_layout(shape, strides) -> bool:
    """Whether a tensor of ``shape`` and ``strides`` is C-contiguous by torch's rule (``Tensor.is_contiguous()``):
    empty, or every axis longer than one has the stride of the axes after it. An axis of length one may have any
    stride: only index 0 is ever read along it. ``shape`` and ``strides``: equal-length sequences of ints (strides
    in elements, as ``Tensor.stride()`` gives them)."""
    shape = tuple(shape)
    if 0 in shape:
        return True
    expected = 1
    for n, st in zip(reversed(shape), reversed(tuple(strides))):
        if n != 1:
            if st != expected:
                return False
            expected *= n
    return True


def same_signature(planned: tuple, got: tuple) -> bool:
    """Whether two :func:`tensor_signature` tuples of the same arguments describe the same launch: equal, or equal
    but for the strides of tensors that are C-contiguous under both (:func:`is_contiguous_layout`: then they differ
    only along axes of length one, where only index 0 is read). ``run()``'s one-pass check and its full path accept
    exactly these."""
    if planned == got:
        return True
    if len(planned) != len(got):
        return False
    for a, b in zip(planned, got):
        if a == b:
            continue
        if a is None or b is None or a[0] != b[0] or a[1] != b[1] or a[3:] != b[3:]:
            return False
        if not (is_contiguous_layout(a[1], a[2]) and is_contiguous_layout(b[1], b[2])):
            return False
    return True


def signature_change(planned: tuple, got: tuple) -> str:
    """What differs between two signatures of :func:`tensor_signature` tuples, argument by argument (for
    ``run()``'s error message)."""
    names = ("q", "k_cache", "v_cache", "seq_lens", "block_table")
    for i, (a, b) in enumerate(zip(planned, got)):
        if a == b:
            continue
        name = (a or b)[0] if (a or b) else names[i] if i < len(names) else f"argument {i}"
        if a is None or b is None:
            return f"{name} was {'None' if a is None else 'a tensor'} at plan() and is {'None' if b is None else 'a tensor'} now"
        for field, x, y in zip(_SIG_FIELDS, a[1:], b[1:]):
            if x != y:
                show = (lambda v: tuple(v) if isinstance(v, torch.Size) else v)
                return f"{name} {field} {show(y)} differs from the planned {show(x)}"
    return "the inputs differ from the planned ones"


def _byte_range(t: torch.Tensor) -> tuple[int, int] | None:
    """``[first, end)`` bytes ``t`` spans in its device's address space, ``None`` when empty (O(ndim);
    torch strides are never negative)."""
    if t.numel() == 0:
        return None
    p, size = t.data_ptr(), t.element_size()
    return p, p + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * size


def _storage_range(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    p = st.data_ptr()
    return p, p + st.nbytes()


def check_no_overlap(outputs, inputs) -> None:
    """Raise ``ValueError`` if an output tensor's bytes overlap an input's or another output's.

    ``outputs`` / ``inputs``: ``(name, tensor or None)`` pairs. O(1) per pair, no allocation, no sync:
    first the byte ranges of the tensors' storages (disjoint storages cannot overlap), then, for
    tensors on one device whose storages cross, the byte ranges the tensors themselves span
    (conservative: crossing ranges count even when no element is shared, e.g. interleaved views).
    """
    outs = [(n, t, _storage_range(t)) for n, t in outputs if isinstance(t, torch.Tensor) and t.numel()]
    if not outs:
        return
    others = [(n, t, _storage_range(t)) for n, t in inputs if isinstance(t, torch.Tensor) and t.numel()]
    for i, (on, ot, (a0, a1)) in enumerate(outs):
        for n, t, (b0, b1) in outs[i + 1:] + others:
            if a0 < b1 and b0 < a1 and t.device == ot.device:
                (c0, c1), (d0, d1) = _byte_range(ot), _byte_range(t)
                if c0 < d1 and d0 < c1:
                    raise overlap_error(on, c0, c1, n, d0, d1)


class OverlapError(ValueError):
    """An output overlapping another tensor in memory (a ``ValueError``): ``output`` and ``other`` are their argument
    names (``"out"`` / ``"lse"``; ``"q"``, a cache, ``"seq_lens"``, ...)."""

    def __init__(self, message: str, output: str, other: str):
        super().__init__(message)
        self.output, self.other = output, other


def overlap_error(on: str, c0: int, c1: int, n: str, d0: int, d1: int) -> OverlapError:
    """The error of output ``on`` (bytes ``[c0, c1)``) overlapping tensor ``n`` (bytes ``[d0, d1)``), which
    :func:`check_no_overlap` raises and ``DecodeWrapper.run()``'s own check of the same rule too."""
    return OverlapError(f"{on} overlaps {n} in memory (bytes [{c0:#x}, {c1:#x}) and [{d0:#x}, {d1:#x})); "
                        f"the kernels would read what they write: pass a separate {on} buffer", on, n)


def host_lengths(static: dict, seq_lens_host, num_pages: int) -> tuple[list[int], int, int] | None:
    """The fast path of :func:`validate_values` for host lengths: a ``list`` or ``tuple`` of ``batch`` Python
    ``int`` s (or bools), all in ``[0, capacity]``. Returns ``(the lengths as a new list, max_kv_len,
    total_kv_len)``, or ``None`` when the input is of another kind or breaks a rule (then :func:`validate_values`
    decides and raises its own error). O(batch) Python, no tensor made, nothing read from the device."""
    if type(seq_lens_host) is not list and type(seq_lens_host) is not tuple:
        return None
    lens = list(seq_lens_host)
    if len(lens) != static["batch"]:
        return None
    try:
        total = sum(lens)
    except TypeError:
        return None
    if type(total) is not int:  # a float, numpy or tensor element: the general path converts (and checks) them
        return None
    lo, hi = min(lens), max(lens)
    if lo < 0 or hi > static["capacity"] or (hi > 0 and num_pages == 0 and static["page_size"] is not None):
        return None
    return lens, int(hi), total


_HOST_KINDS = "a list, tuple, 1-D CPU integer tensor or numpy integer array of one int per sequence"


def as_host_lengths(seq_lens_host, name: str = "seq_lens_host") -> list[int]:
    """``seq_lens_host`` as a new list of Python ints: a list or tuple (or another ordered iterable: a range, an
    iterator, read once) of ints (anything :func:`operator.index` takes: Python, numpy and 0-d torch integers;
    bools count as 0 and 1), a 1-D CPU integer (or bool) tensor or a 1-D numpy integer (or bool) array. Plan-time
    only (:func:`host_lengths` is the fast path of lists and tuples of Python ints, and never calls this). ``name``:
    the argument the errors name.

    Raises:
        TypeError: a scalar, a string, a mapping, a set, a float or complex tensor or array, an entry that is not an
            int (a float, even a whole one: no length is truncated; NaN, a string, ``None``, a list...).
        ValueError: a tensor that is not 1-D or not on the CPU (reading it would be the device read that
            ``seq_lens_host`` avoids), an array that is not 1-D.
    """
    x = seq_lens_host
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be host integers, got a tensor on {x.device} (pass "
                             "seq_lens_host=None to read seq_lens)")
        if x.dim() != 1 or x.layout != torch.strided:
            raise ValueError(f"{name} must be 1-D [batch] (dense), got a {x.layout} tensor of shape "
                             f"{tuple(x.shape)}")
        if x.is_floating_point() or x.is_complex():
            raise TypeError(f"{name} must hold ints, got a {x.dtype} tensor")
        return x.tolist()
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray):
        if isinstance(x, np.ma.MaskedArray):  # its masked entries would read as None
            raise TypeError(f"{name} must be {_HOST_KINDS}, got a numpy masked array (pass x.filled(...) or a list)")
        if x.ndim != 1:
            raise ValueError(f"{name} must be 1-D [batch], got an array of shape {x.shape}")
        if x.dtype.kind not in "iub":
            raise TypeError(f"{name} must hold ints, got a {x.dtype} array")
        return x.tolist()
    if isinstance(x, (str, bytes, bytearray, Mapping, Set)) or not hasattr(x, "__iter__"):
        raise TypeError(f"{name} must be {_HOST_KINDS}, got {type(x).__name__}"
                        + (f" {x!r}" if isinstance(x, numbers.Number) else ""))
    items = list(x)
    try:
        return [operator.index(v) for v in items]
    except TypeError:
        for i, v in enumerate(items):
            try:
                operator.index(v)
            except TypeError:
                raise TypeError(f"{name}[{i}] must be an int (a length in tokens), got {_short(v)} "
                                f"({type(v).__name__})") from None
        raise


def explain_lengths(seq_lens, batch: int, capacity: int) -> list[int]:
    """The lengths an ``explain()`` is asked about, as a new list of ``batch`` Python ints in ``[0, capacity]``: any
    kind :func:`as_host_lengths` takes, or a tensor on any device (read: explaining is not a hot path).

    Raises:
        TypeError: not a sequence of ints (named ``seq_lens``, as :func:`as_host_lengths` names it).
        ValueError: not ``batch`` lengths, or one outside ``[0, capacity]`` (the kernels read each length clamped
            into that range: a schedule at other lengths is none the plan runs).
    """
    if isinstance(seq_lens, torch.Tensor) and seq_lens.device.type == "meta":
        raise ValueError("seq_lens must hold lengths to explain, got a meta tensor (it has no values)")
    if isinstance(seq_lens, torch.Tensor) and seq_lens.device.type != "cpu":
        seq_lens = seq_lens.detach().cpu()
    lens = as_host_lengths(seq_lens, "seq_lens")
    if len(lens) != batch:
        raise ValueError(f"seq_lens must hold {batch} lengths (one per sequence of the plan), got {len(lens)}")
    for i, n in enumerate(lens):
        if not 0 <= n <= capacity:
            raise ValueError(f"seq_lens[{i}] = {_short(n)} is outside [0, {capacity}] (the plan's capacity in tokens)")
    return lens


def _check_host_lengths(static: dict, lens: list[int], num_pages: int) -> tuple[int, int]:
    """:func:`validate_values` for host lengths (Python ints of any size): the count, ``[0, capacity]`` and a
    paged cache with pages. Returns ``(max_kv_len, total_kv_len)``."""
    batch = static["batch"]
    if len(lens) != batch:
        raise ValueError(f"seq_lens_host must hold {batch} lengths (one per sequence), got {len(lens)}")
    if not lens:
        return 0, 0
    if min(lens) < 0:
        shown = ", ".join(_short(v) for v in lens[:16]) + (", ..." if len(lens) > 16 else "")
        raise ValueError(f"seq_lens must be >= 0, got [{shown}] (given as seq_lens_host)")
    hi = max(lens)
    bad = lens.index(hi)
    cap = static["capacity"]
    if hi > cap:
        where = "max_pages_per_seq * page_size" if static["page_size"] is not None else "k_cache.shape[1]"
        raise ValueError(f"seq_lens[{bad}] = {_short(hi)} exceeds the cache capacity {cap} tokens ({where}; given "
                         f"as seq_lens_host[{bad}])")
    if static["page_size"] is not None and num_pages == 0 and hi > 0:
        # the table is not read, so the one layout no clamp can make safe is refused here
        raise ValueError(f"k_cache has no pages (num_pages = k_cache.shape[0] = 0) but seq_lens[{bad}] = {hi} needs "
                         "at least one")
    return int(hi), int(sum(lens))


def _read_values(seq_lens: torch.Tensor, block_table: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``seq_lens`` (and the block table) as int64 CPU tensors. On a GPU both are copied into pinned host
    memory without blocking and the host then waits once for the stream (one sync for both)."""
    if not seq_lens.is_cuda:
        return (seq_lens.detach().to("cpu", torch.int64),
                None if block_table is None else block_table.detach().to("cpu", torch.int64))
    lens = seq_lens.detach().to("cpu", non_blocking=True)
    bt = None if block_table is None else block_table.detach().to("cpu", non_blocking=True)
    torch.cuda.current_stream(seq_lens.device).synchronize()
    return lens.to(torch.int64), None if bt is None else bt.to(torch.int64)


def validate_values(static: dict, seq_lens: torch.Tensor, block_table: torch.Tensor | None,
                    num_pages: int, seq_lens_host=None) -> tuple[int, int]:
    """Check the values of the lengths and, without host lengths, of ``block_table`` (plan-time only).

    Without ``seq_lens_host``, ``seq_lens`` and ``block_table`` are read to the host (on a GPU: one
    device-to-host read of both, one host sync). With ``seq_lens_host`` (the same lengths as host integers)
    they are checked instead of ``seq_lens``, and nothing is read from the device: no copy, no sync, and the
    block table's values are not checked (the kernels clamp every page index they load into
    ``[0, num_pages)``; see the module docstring).

    Returns ``(max_kv_len, total_kv_len)`` in tokens.

    Raises:
        ValueError: a length is negative or beyond the cache's capacity; a block-table entry a
            sequence uses is outside ``[0, num_pages)`` (checked without host lengths only); a paged
            cache has no pages but a sequence is not empty; ``seq_lens_host`` has the wrong length, or is a
            tensor not 1-D on the CPU (:func:`as_host_lengths`).
        TypeError: ``seq_lens_host`` is not a sequence of ints (:func:`as_host_lengths`).
    """
    if seq_lens_host is not None:
        fast = host_lengths(static, seq_lens_host, num_pages)
        if fast is not None:
            return fast[1], fast[2]
        return _check_host_lengths(static, as_host_lengths(seq_lens_host), num_pages)
    lens, bt = _read_values(seq_lens, block_table)
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError(f"seq_lens must be >= 0, got {lens.tolist()[:16]}")
    cap = static["capacity"]
    if lens.numel() and int(lens.max()) > cap:
        bad = int(lens.argmax())
        where = "max_pages_per_seq * page_size" if block_table is not None else "k_cache.shape[1]"
        raise ValueError(f"seq_lens[{bad}] = {int(lens[bad])} exceeds the cache capacity {cap} tokens ({where})")
    if bt is not None and lens.numel():
        ps = static["page_size"]
        pages_used = (lens + ps - 1) // ps
        cols = torch.arange(bt.shape[1]).unsqueeze(0)
        used = cols < pages_used.unsqueeze(1)
        vals = bt[used]
        if vals.numel() and (int(vals.min()) < 0 or int(vals.max()) >= num_pages):
            b, i = [int(x) for x in ((bt < 0) | (bt >= num_pages)).logical_and(used).nonzero()[0]]
            raise ValueError(
                f"block_table[{b}, {i}] = {int(bt[b, i])} is outside [0, num_pages={num_pages}) for a page that "
                f"seq_lens[{b}] = {int(lens[b])} uses"
            )
    return (int(lens.max()) if lens.numel() else 0), int(lens.sum())


def default_sm_scale(head_dim: int) -> float:
    """``1 / sqrt(head_dim)``, the usual score scale."""
    return 1.0 / math.sqrt(head_dim)
