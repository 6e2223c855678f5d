"""``numba.cuda`` kernels of the ``numba`` backend: the scheduled split-KV kernel and the merge.

Importing this module imports numba; :mod:`attnplan.backends.numba` imports it lazily so a broken
numba makes only this backend unavailable. The same Python source runs compiled on a GPU and,
under ``NUMBA_ENABLE_CUDASIM=1``, in numba's CUDA simulator (every simulated thread is a Python
thread, so the simulator runs with few threads and the helpers below are plain Python there).

Method (the kernel contract of :mod:`attnplan.backends.base`; Flash-Decoding, Dao et al. 2023):

* A 1-D grid of ``max_units * num_kv_heads`` programs (CTAs), unit-major: program ``p`` serves work
  unit ``u = p // num_kv_heads`` for KV head ``h = p % num_kv_heads``, with the ``G`` query heads of
  ``h``'s GQA group and all ``Q`` queries of the unit's sequence: ``R = G * Q`` rows, row
  ``r = qi * G + g``.
* **Schedule prologue** (``DecodeSpec.sched``, plans with ``max_units_per_seq > 1``): the program's
  threads read all ``batch`` lengths from ``seq_lens`` (in chunks of ``threads x SCHED_PER``
  sequences, so any batch works) and compute :func:`attnplan.schedule.schedule_units`'s integers
  exactly: each sequence's granules ``nb``, the total ``T`` (a block reduction), the granules per
  unit ``c`` from ``targets[min(bit_length(T + T // 2), 31) + 32 * (2 T < batch * nb_max)]``, each
  sequence's units and the slot ``first[b]`` of its unit 0 (:mod:`attnplan.schedule`, "Slots, longest units
  first"): in a batch of at most ``LONGEST_FIRST_BATCH`` (32) sequences the sum of the units of the sequences
  with more granules per unit (ties: a lower index), each thread comparing its sequences with a shared table of
  every sequence's ``(cb, units)``; in a larger batch the exclusive prefix sum in index order (a block scan per
  chunk, carried across chunks; warp shuffles and one shared word per warp on the GPU, a shared-memory tree in the
  simulator; the shared buffer holds at least ``2 x LONGEST_FIRST_BATCH`` words for the table). Hence the
  sequence ``b`` whose slots ``[first[b], first[b] + units[b])`` hold the program's slot ``u``, its unit index
  ``j = u - first[b]`` and token range ``[start, end)``. ``ceil(a / b)`` is computed as
  ``(a - 1) // b + 1`` for ``a >= 1`` (no ``a + b - 1`` overflow); the total is 64-bit. Every length is
  read as ``min(max(seq_lens[b], 0), capacity)`` (``capacity`` the tokens a sequence of the cache holds, a kernel
  argument; ``seq_len_at``), in the prologue and after it, so a length written on the device beyond the cache
  reads the clamped span, never outside the cache, and every program derives the same schedule. A program
  with ``u`` past the batch's units exits before reading any KV. Program 0 writes ``meta`` (``first``
  then ``units``) for the separate merge. Without the prologue (single pass) ``u = b``.
* A sequence with one unit writes ``out`` (q's dtype) and ``lse`` directly, the sink applied; a unit
  of a sequence with several writes its normalized fp32 partial state into workspace slot ``u``
  (``ws_o[0, qi, hq, u, :]``, ``ws_lse[0, qi, hq, u]``), and :func:`merge_kernel` combines slots
  ``[first[b], first[b] + units[b])`` in slot order.
* Threads are split into token groups of ``LANES`` threads. A group works on one KV position at a
  time; its lanes cover ``head_dim`` in ``NSLOT`` slots of one *word* each, slot ``i`` of lane ``j``
  holding word ``i * LANES + j`` of the position's K (and V) row, so the lanes of one slot read
  ``LANES`` adjacent words (coalesced; a warp reads ``32 / LANES`` whole positions per slot).
  A word is 8 bytes (four fp16/bf16 or two fp32 elements, read as one ``int64``) when the cache's
  strides allow an ``int64`` view, else one element. ``head_dim`` need not divide evenly: the
  slots past the row's last word are clamped (re-read a valid word) and carry ``q = 0``.
* Each token group keeps its own online-softmax state per row (running max ``m``, sum ``l``,
  unnormalized ``acc`` for its lanes' channels) over the positions it visits:
  ``t0 + u * NGROUPS + group`` for ``u < UNROLL`` in tiles of ``BLOCK_N = NGROUPS * UNROLL``
  positions from the unit's start. The ``UNROLL`` positions' loads are issued together (positions
  past the unit are clamped to its last position and masked out afterwards, so loads are
  unconditional and never leave ``[start, end)``). Scores are summed across a group's lanes by an
  xor butterfly (``shfl_xor_sync`` on the GPU; a shared-memory exchange in the simulator, which has
  no shuffles), so every lane holds the same bits. The update is once per tile and branch-free:
  masked scores become ``-inf``, ``m' = max(m, s_u)``, ``l' = l e^(m - m') + sum_u e^(s_u - m')``,
  ``acc' = acc e^(m - m') + sum_u e^(s_u - m') v_u``, with the exponent base replaced by 0 while
  ``m'`` is still ``-inf`` (never ``-inf - (-inf)``). The exponential is ``libdevice.fast_expf``
  (``ex2.approx.ftz`` of ``x log2 e``; its arguments are ``<= 0``, so only weights below 2^-126
  flush to 0) on the GPU, ``math.exp`` in the simulator.
* At the end the groups' states are merged through shared memory (``M = max_g m_g``,
  ``L = sum_g l_g e^(m_g - M)``, ``o = sum_g acc_g e^(m_g - M) / L``, precise ``exp``/``log``) and
  the program writes its rows. A row that saw no position gets ``o = 0, lse = -inf`` (direct output
  with a sink: ``lse`` = the sink); a unit with no visible position reads no KV.
* Scores are ``(q . k) sm_scale`` in fp32 (the scale per dot product: a large legal scale never overflows q);
  accumulation is fp32 throughout.

NaN isolation (positions a row cannot see never affect it, NaN included; :func:`attnplan.reference._attend`
defines the result): masked scores are *selected* to ``-inf``, never multiplied. Every running maximum
propagates NaN (Python's and numba's ``max`` skip a NaN second argument, which would make a row of NaN
scores look empty). ``P @ V`` would multiply a V row a query cannot see by ``p = 0`` and ``0 * NaN = NaN``;
with ``q_len > 1`` (compile time) a tile holding positions that some rows of the program see and others do
not (the last ``q_len - 1`` positions of the sequence, the first ``q_len - 1`` of a sliding window: only
there do rows disagree; the test is block-uniform) gets its non-finite V entries zeroed before the plain
multiply-add, and afterwards NaN is added to the columns of those entries in the rows that see their
position. Other tiles (and every tile with ``q_len = 1``, where the program's only query sees the whole
unit) are untouched, and the per-row update loop keeps its old size (so it still unrolls and the
accumulators stay in registers).

Attention variants are flags of the specialization (``DecodeSpec.window/softcap/fp8/sinks``,
``MergeSpec.sinks``), so a kernel without variants compiles without their code; their run-time values
(``window_left``, the cap, the scale and sink tensors) are kernel arguments. Semantics are the
reference's and the Triton kernels' (:mod:`attnplan.reference`, base.py's ``DecodeInputs``):

* window: a sequence's units start at ``base = max(0, L - Q - window_left)`` (no unit lies before
  the first position any query can see) and query ``qi`` (position ``p = L - Q + qi``) sees only
  positions ``>= p - window_left``; rows with nothing visible in a unit write the empty state.
* soft cap: the natural-log scaled score ``x`` becomes ``cap * tanh(x / cap)``, with ``tanh`` from
  ``e = exp(-2 |x / cap|)`` as ``sign(x) (1 - e) / (1 + e)`` (never overflows), and below ``|x / cap|`` = 0.375
  from its Taylor series to ``x^11`` (``1 - e`` would lose digits there): within 4 ulps of fp32.
* fp8 KV (``float8_e4m3fn``; q fp16/bf16): the caches arrive as ``uint8`` bits (or ``int64`` words
  of 8 codes) and :func:`fp8_e4m3_to_f32` widens each code exactly in the kernel; ``k_scale[h]``
  is folded into the score scale (each dot product times ``sm_scale * k_scale[h]``) and ``v_scale[h]``
  into the factor that normalizes the unit's output.
* sinks: never part of a partial state; the merge kernel and the direct (one-unit) epilogue apply
  ``lse' = logaddexp(lse, sink[head])``, ``o' = o exp(lse - lse')`` (an empty row: ``o = 0``,
  ``lse = sink``; a ``-inf`` sink is no sink; a ``+inf`` sink gives ``o = 0, lse = +inf``).

16-bit floats (numba has no usable bf16, and sees torch bf16 tensors as a 2-byte void dtype): the
host passes 16-bit tensors as ``int16`` (or ``int64``-word) views and the kernels widen the bits:

* bf16 -> fp32: the 16 bits ``h`` become the fp32 bit pattern ``h << 16`` (exact), reinterpreted
  with ``libdevice.int_as_float`` on the GPU (``numpy.uint32(...).view(float32)`` in the simulator).
* fp16 -> fp32: ``libdevice.half2float`` (``numpy`` ``float16`` view in the simulator).
* fp32 -> bf16 output: round to nearest even on the bit pattern ``u`` of the fp32 value:
  ``(u + 0x7FFF + ((u >> 16) & 1)) >> 16``; NaN becomes the quiet NaN ``0x7FC0`` (sign kept).
* fp32 -> fp16 output: ``libdevice.float2half_rn`` (``numpy`` conversion, also round-to-nearest-even,
  in the simulator).
* 16-bit results are stored into the ``int16`` view as the signed value ``(bits ^ 0x8000) - 0x8000``.

The word unpacking takes element ``e`` of a little-endian ``int64`` word as bits
``16 e .. 16 e + 15`` (fp16/bf16), ``32 e .. 32 e + 31`` (fp32) or ``8 e .. 8 e + 7`` (fp8).

fp8 e4m3fn -> fp32 (sign 1, exponent 4 with bias 7, mantissa 3, no infinities; exponent 0 holds the
subnormals ``m 2^-9``; ``0x7F``/``0xFF`` are NaN): the code ``c`` becomes the fp32 bit pattern
``(c & 0x80) << 24 | (c & 0x7F) << 20``, whose value is exactly ``2^-120`` times the code's value
(normal codes get exponent ``e - 127`` instead of ``e - 7``; subnormal codes become fp32 subnormals
``m 2^-129``), multiplied by ``2^120`` (exact: the kernels compile without flush-to-zero); NaN
codes give NaN.

Offsets into the caches are 64-bit (:func:`_make_token_offset`): page ids, positions and head
indices are widened before they multiply a stride, so views whose element offsets pass 2^31 (a
head-major cache with a head stride of 2^30 and 3 KV heads, pages past 2^31 elements) are read
where they are. Every other tensor is indexed by numba with its own (64-bit) strides: q's batch and
head strides, the block table's row and column strides, ``seq_lens``' stride, ``out``/``lse``'s.

Kernels are built by :func:`decode_kernel` / :func:`merge_kernel` from a specialization tuple whose
fields are compile-time constants (closure variables), and cached per specialization. Launch them
inside :func:`launch_scope`: the process-wide patches numba needs here are installed for the
launch only and restored afterwards (the simulator's shared arrays made atomic; numpy's
``row_stack`` for numba-cuda's first compile under numpy >= 2.4).

Threads: on a GPU, launches and kernel builds from several Python threads run concurrently. numba's simulator
runs one kernel at a time (it keeps the running launch's fake ``cuda`` module in process-wide state and swaps it
into this module's globals, where a concurrent launch or a kernel build reading ``cuda`` finds the other launch's),
so under ``NUMBA_ENABLE_CUDASIM=1`` :func:`launch_scope` and the kernel builds take one re-entrant process-wide lock:
simulated launches from several threads run one after another.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from typing import NamedTuple

import numpy

import numba
from numba import cuda
from numba.core import config as _numba_config

from attnplan.schedule import LONGEST_FIRST_BATCH, NUM_BUCKETS

__all__ = ["SIM", "DecodeSpec", "MergeSpec", "decode_kernel", "merge_kernel", "schedule_probe_kernel",
           "launch_scope", "KIND_FP32", "KIND_FP16", "KIND_BF16", "KIND_FP8", "f32_to_bits16", "bits16_to_f32",
           "fp8_e4m3_to_f32", "fp8_decode_kernel", "SCHED_PER"]

#: True when numba runs its CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` when numba was imported).
SIM: bool = bool(_numba_config.ENABLE_CUDASIM)

KIND_FP32, KIND_FP16, KIND_BF16 = 0, 1, 2
#: the KV cache's kind when it is float8_e4m3fn (q is then fp16 or bf16; never an output kind)
KIND_FP8 = 3
#: sequences each thread of the schedule prologue handles per chunk (a chunk is ``threads x SCHED_PER``)
SCHED_PER = 4

float32 = numba.float32
int64 = numba.int64
uint64 = numba.uint64
NEG_INF = numpy.float32(-numpy.inf)
POS_INF = numpy.float32(numpy.inf)
ZERO = numpy.float32(0.0)
ONE = numpy.float32(1.0)
TWO = numpy.float32(2.0)
#: below this |x|, tanh(x) by its Taylor series to x^11 (TANH_C: the coefficients of x^3 .. x^11), where
#: (1 - e^-2|x|) / (1 + e^-2|x|) would lose digits of a small x in 1 - e^-2|x|: within 4 ulps of fp32 everywhere
TANH_SERIES_BELOW = numpy.float32(0.375)
TANH_C3, TANH_C5, TANH_C7, TANH_C9, TANH_C11 = (numpy.float32(c) for c in (-1 / 3, 2 / 15, -17 / 315, 62 / 2835,
                                                                          -1382 / 155925))
NAN = numpy.float32(numpy.nan)
TWO_POW_120 = numpy.float32(2.0 ** 120)
FULL_MASK = 0xFFFFFFFF


# -- bit primitives: the only code that differs between the GPU and the simulator -------------------
# Integers passed in and out are non-negative bit patterns (int64 in [0, 2^32) or [0, 2^16)).

if SIM:
    def _device(fn):
        return fn  # plain Python: fastest in the simulator

    def _i2f(bits):
        return numpy.uint32(int(bits) & 0xFFFFFFFF).view(numpy.float32)

    def _f2i(x):
        return int(numpy.float32(x).view(numpy.uint32))

    def _h2f(bits):
        return numpy.float32(numpy.uint16(int(bits) & 0xFFFF).view(numpy.float16))

    def _f2h(x):
        with numpy.errstate(over="ignore"):  # beyond fp16 range -> inf, as the GPU's conversion
            return int(numpy.float16(numpy.float32(x)).view(numpy.uint16))

    def _bits(w):
        return int(w)  # numpy integer word -> Python int (no fixed-width overflow)

    def fexp(x):
        return numpy.float32(math.exp(x))

    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray as _FakeCUDAArray


    def _locked_shared_array():
        """``(FakeCUDAShared, original array method, atomic replacement)``, or ``None`` (with a warning)
        for a simulator whose ``FakeCUDAShared`` does not look like the one described here.

        The simulator gives a block's threads one array per ``cuda.shared.array`` call site by
        looking the site up in a per-launch dict that it fills lazily (numba-cuda
        ``simulator/kernelapi.py``, ``FakeCUDAShared.array``)::

            res = self._allocations.get(caller)
            if res is None:
                res = np.empty(shape, dtype)
                self._allocations[caller] = res
            return res

        Every simulated thread is a Python thread, and the first block of every launch runs this
        check-then-insert in all its threads at once. A thread switch between the lookup and the
        store lets two threads both see no array and each make its own: the one whose store is
        overwritten keeps a private "shared" array for the whole launch. Its writes are lost to
        the others and it reads ``np.empty`` garbage for theirs (scores of the butterfly, a token
        group's ``m``/``l``, the accumulator exchange, the schedule's scan), so block ``(0, 0, 0)``
        writes wrong, usually finite, values. Rare at the default switch interval (the window is a
        few bytecodes), but any kernel with a shared array is exposed.

        The replacement does the same lookup, keyed the same way (the caller's file and line), under
        a lock.
        """
        import sys
        import warnings

        from numba.core import types as _types
        from numba.cuda.simulator import kernelapi
        from numba.np import numpy_support

        cls = getattr(kernelapi, "FakeCUDAShared", None)
        try:
            ok = cls is not None and isinstance(cls(0)._allocations, dict)
        except Exception:  # noqa: BLE001 - another simulator version: leave it as it is
            ok = False
        if not ok:
            warnings.warn("attnplan: numba's CUDA simulator has no FakeCUDAShared._allocations dict; its "
                          "cuda.shared.array allocation is not made thread-safe", RuntimeWarning, stacklevel=2)
            return None
        original = cls.array
        lock = threading.Lock()

        def array(self, shape, dtype, alignment=None):
            if alignment is not None or shape == 0:
                # alignment: the simulator refuses it; size 0: the dynamic buffer, made when the launch
                # starts (no lazy state, no caller lookup)
                return original(self, shape, dtype, alignment)
            if isinstance(dtype, _types.Type):
                dtype = numpy_support.as_dtype(dtype)
            frame = sys._getframe(1)  # the kernel's frame: the call site is the array's identity
            site = (frame.f_code.co_filename, frame.f_lineno)
            del frame
            with lock:
                res = self._allocations.get(site)
                if res is None:
                    res = self._allocations[site] = numpy.empty(shape, dtype)
            return res

        array._attnplan_race_free = True
        array.__doc__ = original.__doc__
        return cls, original, array

    _SIM_SHARED = _locked_shared_array()
    #: whether :func:`launch_scope` makes the simulator's shared-array allocation atomic
    SIM_SHARED_RACE_FREE: bool = _SIM_SHARED is not None

    def _install_patches():
        if _SIM_SHARED is not None:
            cls, _, locked = _SIM_SHARED
            cls.array = locked

    def _remove_patches():
        if _SIM_SHARED is not None:
            cls, original, _ = _SIM_SHARED
            cls.array = original

    def sim_array(ary: numpy.ndarray):
        """Hand a numpy view to a simulated kernel without the simulator's copy-in/copy-out (which
        refuses non-contiguous arrays): the kernel reads and writes the tensor's memory directly."""
        return _FakeCUDAArray(ary)

    def _as_f32(x):
        return numpy.float32(x)
else:
    from numba.cuda import libdevice

    SIM_SHARED_RACE_FREE = False  # no simulator: real shared memory
    _ROW_STACK_SET: list = []

    def _install_patches():
        # numba-cuda 0.30.4's numba/cuda/np/arrayobj.py registers an overload of numpy.row_stack when the CUDA
        # target loads its registries (at the first kernel compile of the process); numpy >= 2.4 removed
        # row_stack, and that compile fails with "module 'numpy' has no attribute 'row_stack'".
        if "row_stack" not in vars(numpy):
            numpy.row_stack = numpy.vstack
            _ROW_STACK_SET.append(True)

    def _remove_patches():
        if _ROW_STACK_SET:
            _ROW_STACK_SET.clear()
            if vars(numpy).get("row_stack") is numpy.vstack:
                del numpy.row_stack

    def _device(fn):
        return cuda.jit(device=True, forceinline=True)(fn)

    @_device
    def _i2f(bits):
        return libdevice.int_as_float(numba.int32(bits))

    @_device
    def _f2i(x):
        return int64(libdevice.float_as_int(x)) & 0xFFFFFFFF

    @_device
    def _h2f(bits):
        return libdevice.half2float(numba.int16(bits))

    @_device
    def _f2h(x):
        return int64(libdevice.float2half_rn(x)) & 0xFFFF

    @_device
    def _bits(w):
        return int64(w)

    @_device
    def fexp(x):
        # ex2.approx.ftz(x * log2 e): arguments are <= 0 or -inf here, results in [0, 1]
        return libdevice.fast_expf(x)

    @_device
    def _as_f32(x):
        return float32(x)


def _bf16_round_bits(u):
    """fp32 bit pattern ``u`` (int in [0, 2^32)) -> bf16 bits, round to nearest even; NaN -> quiet NaN."""
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return ((u >> 16) & 0x8000) | 0x7FC0
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


_bf16_round = _device(_bf16_round_bits)


@_device
def fp8_e4m3_to_f32(c):
    """fp32 value of the float8_e4m3fn code ``c`` (int in [0, 256)), exact (module docstring)."""
    x = _i2f(((c & 0x80) << 24) | ((c & 0x7F) << 20)) * TWO_POW_120
    if (c & 0x7F) == 0x7F:
        x = NAN
    return x


def _make_unpack(kind: int, ew: int):
    """``unpack(word, e) -> float32``: element ``e`` of a word of ``ew`` elements of ``kind``."""
    if kind == KIND_FP32 and ew == 1:
        @_device
        def unpack(w, e):
            return _as_f32(w)
    elif kind == KIND_FP32:
        @_device
        def unpack(w, e):
            return _i2f((_bits(w) >> (32 * e)) & 0xFFFFFFFF)
    elif kind == KIND_BF16:
        @_device
        def unpack(w, e):
            return _i2f(((_bits(w) >> (16 * e)) & 0xFFFF) << 16)
    elif kind == KIND_FP8:
        @_device
        def unpack(w, e):
            return fp8_e4m3_to_f32((_bits(w) >> (8 * e)) & 0xFF)
    else:
        @_device
        def unpack(w, e):
            return _h2f((_bits(w) >> (16 * e)) & 0xFFFF)
    return unpack


def _make_pack(kind: int):
    """``pack(x) -> value to store`` into the output view of ``kind`` (int16 bits for 16-bit floats)."""
    if kind == KIND_FP32:
        @_device
        def pack(x):
            return _as_f32(x)
    elif kind == KIND_BF16:
        @_device
        def pack(x):
            return (_bf16_round(_f2i(x)) ^ 0x8000) - 0x8000
    else:
        @_device
        def pack(x):
            return (_f2h(x) ^ 0x8000) - 0x8000
    return pack


def f32_to_bits16(x: float, kind: int) -> int:
    """The signed 16-bit pattern the kernels store for fp32 value ``x`` in ``kind`` (fp16/bf16);
    simulator-only helper exposed for tests of the rounding."""
    if not SIM:
        raise RuntimeError("f32_to_bits16 is the simulator's Python helper")
    return _make_pack(kind)(numpy.float32(x))


def bits16_to_f32(bits: int, kind: int) -> numpy.float32:
    """fp32 value of a 16-bit pattern of ``kind`` as the kernels widen it; simulator-only helper."""
    if not SIM:
        raise RuntimeError("bits16_to_f32 is the simulator's Python helper")
    return _make_unpack(kind, 1)(numpy.int16(numpy.uint16(bits & 0xFFFF).view(numpy.int16)), 0)


_FP8_DECODE = []


def fp8_decode_kernel():
    """A small kernel ``(codes, out)``: ``out[i] = fp8_e4m3_to_f32(codes[i])`` for a ``uint8`` array of
    codes and a float32 ``out`` of the same length (grid-stride loop; any launch shape). It runs the
    kernels' own decoder, compiled on a GPU or in the simulator, for tests."""
    if not _FP8_DECODE:
        with _sim_serial():
            if not _FP8_DECODE:
                def fp8_decode(codes, out):
                    start = cuda.grid(1)
                    step = cuda.gridsize(1)
                    for i in range(start, codes.shape[0], step):
                        out[i] = fp8_e4m3_to_f32(_bits(codes[i]))
                _FP8_DECODE.append(cuda.jit(fp8_decode))
    return _FP8_DECODE[0]




# -- the launch scope ---------------------------------------------------------------------------------

_SCOPE_LOCK = threading.Lock()
_SCOPE_DEPTH = [0]
#: the simulator's one launch at a time (module docstring, "Threads"): held by :func:`launch_scope` and the kernel
#: builds under the simulator, never on a GPU
_SIM_LOCK = threading.RLock()
# held across a fork (as the Triton interpreter's lock): a child forked while another thread simulates a launch
# would otherwise inherit the lock held by a thread it does not have
os.register_at_fork(before=_SIM_LOCK.acquire, after_in_parent=_SIM_LOCK.release, after_in_child=_SIM_LOCK.release)


def _sim_serial():
    """The simulator's process-wide lock (:data:`_SIM_LOCK`) under ``NUMBA_ENABLE_CUDASIM=1``; a no-op on a GPU."""
    return _SIM_LOCK if SIM else contextlib.nullcontext()


@contextlib.contextmanager
def launch_scope():
    """Install the process-wide patches numba needs for this module's kernels for the duration of a
    launch only, and restore numba and numpy as they were afterwards.

    * Simulator: numba's ``FakeCUDAShared.array`` is replaced by an atomic lookup
      (:func:`_locked_shared_array`; without it two simulated threads of a block can get different
      "shared" arrays, a rare wrong result).
    * GPU: ``numpy.row_stack = numpy.vstack`` while numpy lacks it (numpy >= 2.4), for numba-cuda's
      first kernel compile of the process (which looks the name up).

    Nested and concurrent scopes (several Python threads) share one installation: the first to enter
    installs, the last to leave restores. Every launch of this module's kernels belongs inside one
    (the backend's launches are; tests that launch a kernel themselves use it too). Under the simulator
    the scope also holds the simulator's lock (module docstring, "Threads"): scopes of other threads wait.
    """
    with _sim_serial():
        with _SCOPE_LOCK:
            if _SCOPE_DEPTH[0] == 0:
                _install_patches()
            _SCOPE_DEPTH[0] += 1
        try:
            yield
        finally:
            with _SCOPE_LOCK:
                _SCOPE_DEPTH[0] -= 1
                if _SCOPE_DEPTH[0] == 0:
                    _remove_patches()


@_device
def _sink_join(lse, z):
    """``(logaddexp(lse, z), exp(lse - logaddexp(lse, z)))``: the sink ``z`` joins a non-empty row's
    denominator. A ``-inf`` sink is no sink (factor 1); a ``+inf`` sink takes all the weight (``+inf``,
    factor 0); NaN in either gives NaN."""
    if z == NEG_INF:
        return lse, ONE
    if z == POS_INF:
        return z, ZERO
    top = z
    if lse > z:
        top = lse
    new = top + math.log(math.exp(lse - top) + math.exp(z - top))
    return new, math.exp(lse - new)


# -- specializations ---------------------------------------------------------------------------------

class DecodeSpec(NamedTuple):
    """Compile-time constants of the split-KV kernel.

    kind: ``KIND_FP32/FP16/BF16`` of q and the cache; ew: elements per KV word (1, 2, 4 or 8);
    head_dim; group: GQA group size; q_len; paged; lanes: threads per token group (power of two
    <= 32); threads: threads per program (multiple of ``lanes``; of 32 on a GPU); unroll: positions
    per group per tile; sched: run the schedule prologue (a plan with ``max_units_per_seq > 1``:
    one-unit sequences write ``out``, others the workspace) instead of the single pass (``u = b``,
    ``out`` only); has_lse: ``lse`` is written next to ``out``; kv_same: K and V have the same
    strides (one offset computation serves both). Variants (module docstring): window (sliding
    window), softcap (logits soft cap), fp8 (float8_e4m3fn cache with per-KV-head scales; ``kind``
    stays q's), sinks (the sink joins the denominator of rows written directly to ``out``).
    """

    kind: int
    ew: int
    head_dim: int
    group: int
    q_len: int
    paged: bool
    lanes: int
    threads: int
    unroll: int
    sched: bool
    has_lse: bool
    kv_same: bool = False
    window: bool = False
    softcap: bool = False
    fp8: bool = False
    sinks: bool = False

    @property
    def block_n(self) -> int:
        return (self.threads // self.lanes) * self.unroll

    def tag(self) -> str:
        kind = ("fp32", "fp16", "bf16")[self.kind]
        variants = "".join(f"-{name}" for name, on in (("window", self.window), ("softcap", self.softcap),
                                                      ("fp8", self.fp8), ("sinks", self.sinks)) if on)
        return (f"decode-{kind}-w{self.ew}-d{self.head_dim}-g{self.group}-q{self.q_len}-"
                f"{'paged' if self.paged else 'contig'}-l{self.lanes}-t{self.threads}-u{self.unroll}-"
                f"{'sched' if self.sched else 'single'}{'-lse' if self.has_lse else ''}"
                f"{'-kvsame' if self.kv_same else ''}{variants}")


class MergeSpec(NamedTuple):
    """Compile-time constants of the merge kernel: out ``kind``, ``head_dim``, ``threads``, ``has_lse``,
    ``sinks`` (the sink logits join the denominator)."""

    kind: int
    head_dim: int
    threads: int
    has_lse: bool
    sinks: bool = False

    def tag(self) -> str:
        kind = ("fp32", "fp16", "bf16")[self.kind]
        return (f"merge-{kind}-d{self.head_dim}-t{self.threads}{'-lse' if self.has_lse else ''}"
                f"{'-sinks' if self.sinks else ''}")


#: shared-memory floats for the cross-group reduction of ``acc`` (32 KiB)
_SMEM_ACC_FLOATS = 8192

_DECODE_CACHE: dict = {}
_MERGE_CACHE: dict = {}
_PROBE_CACHE: dict = {}


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


# -- the device-side schedule (attnplan.schedule.schedule_units, on the GPU) -----------------------------

def _sched_buffer_words(threads: int) -> int:
    """int64 words of shared memory the schedule prologue uses: its block reductions' (one per thread in the
    simulator, a shared-memory tree without shuffles; one per warp on the GPU, warp shuffles then the warps' sums),
    and at least ``2 x LONGEST_FIRST_BATCH`` for the table of a small batch's ``(cb, units)`` (512 B)."""
    return max(threads if SIM else max(1, threads // 32), 2 * LONGEST_FIRST_BATCH)


def _make_block_reductions(threads: int):
    """``(block_sum, block_scan, block_max)`` over the ``threads`` threads of a program, of one int64 per thread:
    ``block_sum(x, tid, buf) -> total``, ``block_scan(x, tid, buf) -> (inclusive prefix, total)`` and
    ``block_max(x, tid, buf) -> max``; every thread gets the same result. ``buf``: shared int64 ``[_sched_buffer_words(threads)]``; both end with a
    barrier, so ``buf`` may be reused at once."""
    NT = threads
    if SIM:
        P2 = _next_pow2(NT)

        def block_sum(x, tid, buf):
            buf[tid] = x
            cuda.syncthreads()
            s = P2 // 2
            while s >= 1:  # tree
                if tid < s and tid + s < NT:
                    buf[tid] += buf[tid + s]
                cuda.syncthreads()
                s //= 2
            total = buf[0]
            cuda.syncthreads()
            return total

        def block_scan(x, tid, buf):
            buf[tid] = x
            cuda.syncthreads()
            off = 1
            while off < NT:  # inclusive scan (Hillis-Steele)
                add = int64(0)
                if tid >= off:
                    add = buf[tid - off]
                cuda.syncthreads()
                buf[tid] += add
                cuda.syncthreads()
                off *= 2
            incl = buf[tid]
            total = buf[NT - 1]
            cuda.syncthreads()
            return incl, total

        def block_max(x, tid, buf):
            buf[tid] = x
            cuda.syncthreads()
            s = P2 // 2
            while s >= 1:  # tree
                if tid < s and tid + s < NT:
                    buf[tid] = max(buf[tid], buf[tid + s])
                cuda.syncthreads()
                s //= 2
            m = buf[0]
            cuda.syncthreads()
            return m

        return block_sum, block_scan, block_max

    NW = max(1, NT // 32)

    @_device
    def block_sum(x, tid, buf):
        v = x
        for lv in range(5):  # butterfly over the warp's 32 lanes
            v += cuda.shfl_xor_sync(FULL_MASK, v, 16 >> lv)
        if tid % 32 == 0:
            buf[tid // 32] = v
        cuda.syncthreads()
        total = int64(0)
        for w in range(NW):
            total += buf[w]
        cuda.syncthreads()
        return total

    @_device
    def block_max(x, tid, buf):
        v = x
        for lv in range(5):  # butterfly over the warp's 32 lanes
            v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, 16 >> lv))
        if tid % 32 == 0:
            buf[tid // 32] = v
        cuda.syncthreads()
        m = int64(0)
        for w in range(NW):
            m = max(m, buf[w])
        cuda.syncthreads()
        return m

    @_device
    def block_scan(x, tid, buf):
        lane = tid % 32
        warp = tid // 32
        v = x
        for lv in range(5):  # inclusive scan within the warp
            y = cuda.shfl_up_sync(FULL_MASK, v, 1 << lv)
            if lane >= (1 << lv):
                v += y
        if lane == 31:
            buf[warp] = v
        cuda.syncthreads()
        before = int64(0)
        total = int64(0)
        for w in range(NW):
            t = buf[w]
            if w < warp:
                before += t
            total += t
        cuda.syncthreads()
        return before + v, total

    return block_sum, block_scan, block_max


def _make_schedule(threads: int, q_len: int, window: bool):
    """``(prologue, unit_range, seq_span, seq_len_at)`` device functions for ``threads`` threads per program.

    * ``seq_len_at(seq_lens, b, capacity) -> int64``: sequence ``b``'s length clamped into ``[0, capacity]``, as
      every read of ``seq_lens`` takes it.
    * ``seq_span(length, window_left, granule) -> (base, nb)``: first visible position and granules.
    * ``prologue(seq_lens, targets, meta, u, tid, buf, info, window_left, granule, min_unit_granules,
      max_units_per_seq, write_meta, capacity) -> (b, j, c)``: called by all threads of the program (it has barriers);
      ``buf`` is a shared int64 ``[_sched_buffer_words(threads)]`` array and ``info`` a shared int64 ``[2]``.
      Returns the sequence ``b`` of the unit in slot ``u`` (``-1`` when ``u`` is past the batch's units), its
      index ``j = u - first[b]`` in ``b``, and the granules per unit ``c``; ``first[i]`` is the slot of sequence
      ``i``'s unit 0 (:mod:`attnplan.schedule`, "Slots, longest units first": in a batch of at most
      ``LONGEST_FIRST_BATCH`` (32) sequences the sequences take the slots in order of decreasing granules per unit,
      ties by index; a larger batch in index order, ``first = indptr[:-1]``). With ``write_meta`` it writes
      ``meta[i] = first[i]``, ``meta[batch + i] = units[i]`` for every sequence (and scans the whole batch;
      otherwise a larger batch stops after ``u``'s chunk).
    * ``unit_range(seq_lens, b, j, c, window_left, granule, max_units_per_seq, capacity) -> (start, end, units_b)``.
    """
    NT, QL, WINDOW, PER, LF = threads, q_len, window, SCHED_PER, LONGEST_FIRST_BATCH
    CH = NT * PER
    LAST_BUCKET = NUM_BUCKETS - 1
    block_sum, block_scan, block_max = _make_block_reductions(NT)

    @_device
    def seq_len_at(seq_lens, b, capacity):
        # a length beyond the cache reads the clamped span (never outside the cache); a negative one is empty
        return min(max(int64(seq_lens[b]), int64(0)), int64(capacity))

    @_device
    def seq_span(length, window_left, granule):
        base = int64(0)
        if WINDOW:
            base = max(length - QL - window_left, int64(0))
        n = length - base
        nb = int64(0)
        if n > 0:
            nb = (n - 1) // granule + 1
        return base, nb

    @_device
    def seq_units(nb, c, max_per):
        # (units, granules per unit); ceil(a / b) as (a - 1) // b + 1 for a >= 1: no a + b - 1 overflow
        if nb <= 0:
            return int64(1), int64(0)
        uu = (nb - 1) // c + 1
        if uu > max_per:
            uu = int64(max_per)
        cb = (nb - 1) // uu + 1
        return (nb - 1) // cb + 1, cb

    @_device
    def prologue(seq_lens, targets, meta, u, tid, buf, info, window_left, granule, min_c, max_per, write_meta,
                 capacity):
        nbatch = seq_lens.shape[0]
        if tid == 0:
            info[0] = -1
            info[1] = 0
        # the batch's total granules
        tot = int64(0)
        mx = int64(0)
        for i in range(tid, nbatch, NT):
            _, nb = seq_span(seq_len_at(seq_lens, i, capacity), window_left, granule)
            tot += nb
            mx = max(mx, nb)
        total = block_sum(tot, tid, buf)  # its barriers also publish info's reset
        nb_max = block_max(mx, tid, buf)
        k = 0  # bucket: bit_length(total + total // 2), at most NUM_BUCKETS - 1
        t3 = total + (total >> 1)
        while k < LAST_BUCKET and (t3 >> k) != 0:
            k += 1
        if 2 * total < int64(nbatch) * nb_max:  # a long-tailed batch: the second table
            k += NUM_BUCKETS
        t = int64(targets[k])
        c = int64(min_c)
        if t > 0 and total > 0:
            c2 = (total - 1) // t + 1
            if c2 > c:
                c = c2
        if nbatch <= LF:  # block-uniform
            # longest units first: first[i] sums the units of the sequences before i in the order of decreasing
            # granules per unit cb, ties by index (an empty sequence, cb = 0, last); not a prefix sum, so no scan.
            # Every sequence's (cb, units) goes to a table in buf (the reductions above end with a barrier, so buf
            # is free), then each thread takes whole sequences (one or two on a GPU, whose blocks have at least 32
            # threads) and compares each with the table, at most 32 steps a sequence
            for i in range(tid, nbatch, NT):
                _, nb = seq_span(seq_len_at(seq_lens, i, capacity), window_left, granule)
                un_i, cb_i = seq_units(nb, c, max_per)
                buf[i] = cb_i
                buf[LF + i] = un_i
            cuda.syncthreads()
            for i in range(tid, nbatch, NT):
                cb_i = buf[i]
                un_i = buf[LF + i]
                start = int64(0)
                for i2 in range(nbatch):
                    cb2 = buf[i2]
                    if cb2 > cb_i or (cb2 == cb_i and i2 < i):
                        start += buf[LF + i2]
                if write_meta:
                    meta[i] = start
                    meta[nbatch + i] = un_i
                if u >= start and u < start + un_i:  # the slots' ranges tile [0, U): one writer at most
                    info[0] = i
                    info[1] = start
            cuda.syncthreads()  # info is read by every thread below
            return info[0], u - info[1], c
        # a larger batch, in index order: units per sequence and their exclusive prefix sum, chunk by chunk (CH
        # sequences, PER per thread)
        un = cuda.local.array(PER, int64)
        running = int64(0)
        for c0 in range(0, nbatch, CH):
            i0 = c0 + tid * PER
            mine = int64(0)
            for e in range(PER):
                x = int64(0)
                if i0 + e < nbatch:
                    _, nb = seq_span(seq_len_at(seq_lens, i0 + e, capacity), window_left, granule)
                    x, _ = seq_units(nb, c, max_per)
                un[e] = x
                mine += x
            incl, chunk_total = block_scan(mine, tid, buf)
            start = running + incl - mine
            for e in range(PER):
                if i0 + e < nbatch:
                    if write_meta:
                        meta[i0 + e] = start
                        meta[nbatch + i0 + e] = un[e]
                    if u >= start and u < start + un[e]:
                        info[0] = i0 + e
                        info[1] = start
                    start += un[e]
            running += chunk_total
            cuda.syncthreads()
            if info[0] >= 0 and not write_meta:  # block-uniform: read after the barrier
                break
        return info[0], u - info[1], c

    @_device
    def unit_range(seq_lens, b, j, c, window_left, granule, max_per, capacity):
        length = seq_len_at(seq_lens, b, capacity)
        base, nb = seq_span(length, window_left, granule)
        units_b, cb = seq_units(nb, c, max_per)
        if nb <= 0:  # an empty sequence: one empty unit at its end
            return length, length, units_b
        lo = base + j * cb * granule
        hi = min(lo + cb * granule, length)
        return lo, hi, units_b

    return prologue, unit_range, seq_span, seq_len_at


def schedule_probe_kernel(threads: int, q_len: int = 1, window: bool = False):
    """A kernel that runs only the schedule prologue, for tests of the device-side integers (``threads`` a
    multiple of 32 on a GPU; ``ValueError`` otherwise).

    Arguments (grid ``(n,)``, ``threads`` threads)::

        seq_lens  [B] int32
        targets   [64] int32
        meta      [2 B] int32, written by block 0 when ``write_meta``
        units     [n] int: the unit each block asks about
        res       [n, 6] int64: (b, j, start, end, units_b, c) of that unit; b = -1 (rest untouched) past the
                  batch's units
        granule, min_unit_granules, max_units_per_seq, write_meta, window_left: ints
        capacity  int: every length is clamped into [0, capacity], as the decode kernel clamps it
    """
    if not SIM and threads % 32:
        raise ValueError(f"the schedule prologue runs whole warps on a GPU: threads {threads} is not a multiple of 32")
    key = (threads, q_len, window)
    kern = _PROBE_CACHE.get(key)
    if kern is None:
        with _sim_serial():
            kern = _PROBE_CACHE.get(key) or _build_probe(key, threads, q_len, window)
    return kern


def _build_probe(key: tuple, threads: int, q_len: int, window: bool):
    """:func:`schedule_probe_kernel`'s build on a miss (under the simulator's lock), kept in the cache."""
    prologue, unit_range, _, _ = _make_schedule(threads, q_len, window)
    NBUF = _sched_buffer_words(threads)

    def schedule_probe(seq_lens, targets, meta, units, res, granule, min_c, max_per, write_meta, window_left,
                       capacity):
        buf = cuda.shared.array(NBUF, int64)
        info = cuda.shared.array(2, int64)
        blk = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        u = int64(units[blk])
        b, j, c = prologue(seq_lens, targets, meta, u, tid, buf, info, window_left, granule, min_c, max_per,
                           write_meta != 0 and blk == 0, capacity)
        if tid == 0:
            res[blk, 0] = b
            if b >= 0:
                lo, hi, ub = unit_range(seq_lens, b, j, c, window_left, granule, max_per, capacity)
                res[blk, 1] = j
                res[blk, 2] = lo
                res[blk, 3] = hi
                res[blk, 4] = ub
                res[blk, 5] = c

    kern = _PROBE_CACHE[key] = cuda.jit(schedule_probe)
    return kern


def _make_head_base(paged: bool):
    """The plain function ``head_base(h, b, s0, s2) -> int64``: the word offset of KV head ``h`` (plus
    sequence ``b``'s for a contiguous cache), 64-bit: ``h`` and ``b`` are widened before they multiply a
    stride (a head stride of 2^30 with 3 KV heads is past 2^31 at ``h = 2``)."""
    if paged:
        def head_base(h, b, s0, s2):
            return int64(h) * s2
    else:
        def head_base(h, b, s0, s2):
            return int64(h) * s2 + int64(b) * s0
    return head_base


def _make_token_offset(paged: bool):
    """The plain function ``token_offset(table, b, pos, shift, last_page, s0, s1, base) -> int64``: the word
    offset of position ``pos`` of sequence ``b`` from ``base`` (:func:`_make_head_base`). 64-bit: the page id
    and the position are widened before they multiply a stride, so an offset past 2^31 never wraps. The page
    id read from the block table is clamped into ``[0, last_page]`` (``last_page = num_pages - 1``): an entry
    outside the cache reads a wrong page, never memory outside the cache (the input contract of
    :mod:`attnplan.problem`: with host lengths the table's values are not checked). The kernels compile both
    as device functions; the tests compile them with ``numba.njit`` to check the typed arithmetic (the
    simulator computes with Python integers, which never wrap)."""
    if paged:
        def token_offset(table, b, pos, shift, last_page, s0, s1, base):
            # physical page from the block table, clamped; page * page stride can exceed 2^31
            page = min(max(int64(table[b, pos >> shift]), int64(0)), int64(last_page))
            return base + page * s0 + int64(numba.int32(pos & ((1 << shift) - 1))) * s1
    else:
        def token_offset(table, b, pos, shift, last_page, s0, s1, base):
            return base + int64(numba.int32(pos)) * s1
    return token_offset


def _make_allreduce(lanes: int, n: int, threads: int):
    """In-place sum of ``vals[0:n]`` across the ``lanes`` threads of each token group (xor butterfly;
    every lane ends with the same bits)."""
    if SIM:
        def allreduce(vals, scratch, tid):
            off = lanes // 2
            while off >= 1:
                for j in range(n):
                    scratch[tid * n + j] = vals[j]
                cuda.syncthreads()
                other = (tid ^ off) * n
                for j in range(n):
                    vals[j] += scratch[other + j]
                cuda.syncthreads()
                off //= 2
        return allreduce

    levels = lanes.bit_length() - 1

    @_device
    def allreduce(vals, scratch, tid):
        for lv in range(levels):  # constant trip count: unrolled, vals stays in registers
            off = lanes >> (lv + 1)
            for j in range(n):
                vals[j] += cuda.shfl_xor_sync(FULL_MASK, vals[j], off)
    return allreduce



def decode_kernel(spec: DecodeSpec):
    """The (cached) split-KV kernel for ``spec``.

    Kernel arguments, launched on the plan's grid ``(max_units * num_kv_heads,)`` with ``spec.threads``
    threads::

        q         [B, Q, Hq, D]   float32, or int16 bits of fp16/bf16 (any strides)
        k, v      1-D views of the caches' storage, from their first element (float32, int16 bits,
                  uint8 fp8 codes, or int64 words of ew elements); element (i0, i1, h, w) of the logical cache
                  [B, max_len, Hkv, D / ew] or paged [pages, page_size, Hkv, D / ew] is at
                  i0 * s0 + i1 * s1 + h * s2 + w (64-bit offsets)
        ks, vs    strides (s0, s1, s2) of k and v in words (int32 when all fit, else int64)
        seq_lens  [B] int32 (any stride)
        table     [B, max_pages] int32 block table (any strides; any int32 array when not paged)
        out       [B, Q, Hq, D] in q's view: rows of one-unit sequences
        lse_out   [B, Q, Hq] float32 (any array when ``not spec.has_lse``)
        ws_o      the workspace's PartialState.o [1, Q, Hq, max_units, D] float32 (``spec.sched``; else any array)
        ws_lse    the workspace's PartialState.lse [1, Q, Hq, max_units] float32 (idem)
        meta      [2 B] int32: first then units, written by program 0 when ``write_meta`` (else any int array)
        targets   [64] int32: the schedule's targets table (near-uniform, then long-tailed)
        num_kv_heads int; granule, min_unit_granules, max_units_per_seq: the schedule's constants
        write_meta int: 1 when the plan's merge is separate
        page_shift int, log2(page_size) (0 when not paged)
        last_page int, num_pages - 1 (0 when not paged): page ids from the table are clamped into [0, last_page]
        capacity  int, the tokens a sequence of the cache holds: lengths from seq_lens are clamped into [0, capacity]
        qk_scale  float32, sm_scale
        window_left int, the sliding window (read only when ``spec.window``)
        soft_cap  float32, the cap (read only when ``spec.softcap``)
        k_scale, v_scale [Hkv] float32 (read only when ``spec.fp8``; any array otherwise)
        sinks     [Hq] float32 sink logits (read only when ``spec.sinks``; any array otherwise)
    """
    kern = _DECODE_CACHE.get(spec)
    if kern is None:
        with _sim_serial():
            kern = _DECODE_CACHE.get(spec)
            if kern is None:
                kern = _DECODE_CACHE[spec] = _build_decode(spec)
    return kern


def _build_decode(spec: DecodeSpec):
    kind, EW, D, G, QL = spec.kind, spec.ew, spec.head_dim, spec.group, spec.q_len
    R = G * QL
    T = spec.lanes
    NT = spec.threads
    NG = NT // T
    U = spec.unroll
    BLOCK_N = NG * U
    NWORDS = D // EW
    NSLOT = -(-NWORDS // T)
    EPT = NSLOT * EW
    RB = max(1, min(R, _SMEM_ACC_FLOATS // (NG * D)))
    NRED = U * R
    SCRATCH = NT * NRED if (SIM and T > 1) else 1
    # array sizes must be single constants for numba (it does not fold products of closure variables)
    N_ML, N_ACC_SH, N_QV, N_W, N_VF = NG * R, NG * RB * D, R * EPT, U * NSLOT, U * EPT
    PAGED, SCHED, HAS_LSE, KV_SAME = spec.paged, spec.sched, spec.has_lse, spec.kv_same
    WINDOW, SOFTCAP, FP8, SINKS = spec.window, spec.softcap, spec.fp8, spec.sinks
    # rows of one program disagree about a position only with several queries (module docstring)
    CARE = QL > 1
    WIN_EDGE = QL - 1  # the first positions of a window seen by some queries only
    if FP8 and (kind == KIND_FP32 or EW not in (1, 8)):
        raise ValueError(f"numba kernel: an fp8 cache needs fp16/bf16 q and 1 or 8 codes per word ({spec})")
    if NT % T or (not SIM and NT % 32) or T > 32 or T & (T - 1) or NG * D > _SMEM_ACC_FLOATS:
        raise ValueError(f"numba kernel: bad thread layout {spec} (lanes a power of two <= 32 dividing "
                         f"threads, threads a multiple of 32 on a GPU, groups x head_dim <= {_SMEM_ACC_FLOATS})")
    if FP8:
        word_t = numba.uint8 if EW == 1 else numba.int64
    elif kind == KIND_FP32:
        word_t = numba.float32 if EW == 1 else numba.int64
    else:
        word_t = numba.int16 if EW == 1 else numba.int64

    unpack = _make_unpack(KIND_FP8 if FP8 else kind, EW)
    qload = _make_unpack(kind, 1)
    pack = _make_pack(kind)
    allreduce = _make_allreduce(T, NRED, NT)
    prologue, unit_range, seq_span, seq_len_at = _make_schedule(NT, QL, WINDOW)
    NBUF = _sched_buffer_words(NT)
    token_offset = _device(_make_token_offset(PAGED))
    head_base = _device(_make_head_base(PAGED))

    if SINKS:
        @_device
        def empty_lse(sinks, hq, direct):  # a row with nothing visible: o = 0, lse = the sink (direct rows)
            if direct:
                return sinks[hq]
            return NEG_INF
    else:
        @_device
        def empty_lse(sinks, hq, direct):
            return NEG_INF

    if HAS_LSE:
        @_device
        def store_out_lse(dst, b, qi, hq, x):
            dst[b, qi, hq] = x
    else:
        @_device
        def store_out_lse(dst, b, qi, hq, x):
            pass

    if SCHED:  # one-unit sequences write out, the others their workspace slot
        @_device
        def store_o(out, ws_o, direct, b, qi, hq, u, d, x):
            if direct:
                out[b, qi, hq, d] = pack(x)
            else:
                ws_o[0, qi, hq, u, d] = x

        @_device
        def store_lse(lse_out, ws_lse, direct, b, qi, hq, u, x):
            if direct:
                store_out_lse(lse_out, b, qi, hq, x)
            else:
                ws_lse[0, qi, hq, u] = x
    else:
        @_device
        def store_o(out, ws_o, direct, b, qi, hq, u, d, x):
            out[b, qi, hq, d] = pack(x)

        @_device
        def store_lse(lse_out, ws_lse, direct, b, qi, hq, u, x):
            store_out_lse(lse_out, b, qi, hq, x)

    def split_kv_decode(q, k, v, ks0, ks1, ks2, vs0, vs1, vs2, seq_lens, table, out, lse_out, ws_o, ws_lse, meta,
                        targets, num_kv_heads, granule, min_unit_granules, max_units_per_seq, write_meta,
                        page_shift, last_page, capacity, qk_scale, window_left, soft_cap, k_scale, v_scale, sinks):
        m_sh = cuda.shared.array(N_ML, float32)
        l_sh = cuda.shared.array(N_ML, float32)
        acc_sh = cuda.shared.array(N_ACC_SH, float32)
        scratch = cuda.shared.array(SCRATCH, float32)
        lse_sh = cuda.shared.array(R, float32)
        sched_buf = cuda.shared.array(NBUF, int64)
        info = cuda.shared.array(2, int64)

        p = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid % T
        grp = tid // T
        u = p // num_kv_heads
        h = p - u * num_kv_heads
        hq0 = h * G

        if SCHED:
            b, j, c = prologue(seq_lens, targets, meta, int64(u), tid, sched_buf, info, window_left, granule,
                               min_unit_granules, max_units_per_seq, write_meta != 0 and p == 0, capacity)
            if b < 0:  # no unit for this program: write nothing
                return
            lo, hi, units_b = unit_range(seq_lens, b, j, c, window_left, granule, max_units_per_seq, capacity)
            direct = units_b == 1
        else:  # single pass: unit u is sequence u, written directly
            b = int64(u)
            lo, _ = seq_span(seq_len_at(seq_lens, b, capacity), window_left, granule)
            hi = seq_len_at(seq_lens, b, capacity)
            direct = True
        length = seq_len_at(seq_lens, b, capacity)  # the length the schedule read

        if lo >= hi:  # empty unit (whole program): read nothing, write empty states
            for idx in range(tid, R * D, NT):
                r = idx // D
                qi = r // G
                store_o(out, ws_o, direct, b, qi, hq0 + r - qi * G, u, idx - r * D, ZERO)
            for r in range(tid, R, NT):
                qi = r // G
                hq = hq0 + r - qi * G
                store_lse(lse_out, ws_lse, direct, b, qi, hq, u, empty_lse(sinks, hq, direct))
            return

        # q of this lane's channels, all rows; the score scale (sm_scale, and the fp8 cache's k_scale) applies to each
        # dot product, not to q: a large legal scale times q would overflow where the score does not (q x s x 0 = NaN)
        if FP8:
            qk_scale = qk_scale * k_scale[h]
        qv = cuda.local.array(N_QV, float32)
        for r in range(R):
            qi = r // G
            for i in range(NSLOT):
                w = i * T + lane
                wc = min(w, NWORDS - 1)
                for e in range(EW):
                    x = qload(q[b, qi, hq0 + r - qi * G, wc * EW + e], 0)
                    if w >= NWORDS:
                        x = ZERO
                    qv[(r * NSLOT + i) * EW + e] = x

        m = cuda.local.array(R, float32)
        l = cuda.local.array(R, float32)
        acc = cuda.local.array(N_QV, float32)
        for r in range(R):
            m[r] = NEG_INF
            l[r] = ZERO
        for jj in range(R * EPT):
            acc[jj] = ZERO

        kw = cuda.local.array(N_W, word_t)
        vw = cuda.local.array(N_W, word_t)
        kf = cuda.local.array(EPT, float32)
        vf = cuda.local.array(N_VF, float32)
        sc = cuda.local.array(NRED, float32)
        bad = cuda.local.array(N_VF, float32)  # careful tiles: 0, or NaN for a non-finite V entry
        lim0 = length - QL + 1  # query qi sees positions < lim0 + qi
        low0 = lim0 - 1 - window_left  # ... and, with a window, positions >= low0 + qi
        inv_cap = ONE
        if SOFTCAP:
            inv_cap = ONE / soft_cap
        kbase = head_base(h, b, ks0, ks2)
        vbase = head_base(h, b, vs0, vs2)

        for t0 in range(lo, hi, BLOCK_N):
            # issue all loads of this tile first (clamped positions: unconditional, never past the unit)
            for uu in range(U):
                pos = min(t0 + uu * NG + grp, hi - 1)
                ko = token_offset(table, b, pos, page_shift, last_page, ks0, ks1, kbase)
                vo = ko
                if not KV_SAME:
                    vo = token_offset(table, b, pos, page_shift, last_page, vs0, vs1, vbase)
                for i in range(NSLOT):
                    wc = min(i * T + lane, NWORDS - 1)
                    # unsigned index: numba skips the negative-index wraparound code
                    kw[uu * NSLOT + i] = k[uint64(ko + wc)]
                    vw[uu * NSLOT + i] = v[uint64(vo + wc)]
            # partial scores of this lane, then summed across the group's lanes
            for uu in range(U):
                for i in range(NSLOT):
                    for e in range(EW):
                        kf[i * EW + e] = unpack(kw[uu * NSLOT + i], e)
                for r in range(R):
                    dot = ZERO
                    for jj in range(EPT):
                        dot += qv[r * EPT + jj] * kf[jj]
                    sc[uu * R + r] = dot
            allreduce(sc, scratch, tid)
            for uu in range(U):
                for i in range(NSLOT):
                    for e in range(EW):
                        vf[(uu * NSLOT + i) * EW + e] = unpack(vw[uu * NSLOT + i], e)
            # a tile holding positions some rows see and others do not (block-uniform): its non-finite V
            # entries are zeroed for the multiply-add and added back as NaN to the rows that see them, below
            careful = False
            if CARE:
                careful = t0 + BLOCK_N > lim0
                if WINDOW:
                    if t0 < low0 + WIN_EDGE and t0 + BLOCK_N > low0:
                        careful = True
                if careful:
                    for jj in range(N_VF):
                        vx = vf[jj]
                        bad[jj] = ZERO
                        if vx - vx != ZERO:  # inf or NaN
                            bad[jj] = NAN
                            vf[jj] = ZERO
            # online softmax, once per tile and row: masked scores become -inf (selected, not multiplied)
            for r in range(R):
                mo = m[r]
                mn = mo
                for uu in range(U):
                    pos = t0 + uu * NG + grp
                    x = sc[uu * R + r] * qk_scale
                    if SOFTCAP:  # cap * tanh(x / cap), tanh from exp(-2|x / cap|): no overflow; a series near 0
                        t = x * inv_cap
                        at = abs(t)
                        if at < TANH_SERIES_BELOW:
                            x2 = at * at
                            th = at + at * x2 * ((((TANH_C11 * x2 + TANH_C9) * x2 + TANH_C7) * x2 + TANH_C5) * x2
                                                 + TANH_C3)
                        else:
                            ex = fexp(-(TWO * at))
                            th = (ONE - ex) / (ONE + ex)
                        if t < ZERO:
                            th = -th
                        x = th * soft_cap
                    vis = pos < hi and (QL == 1 or pos < lim0 + r // G)
                    if WINDOW:
                        if pos < low0 + r // G:
                            vis = False
                    if not vis:
                        x = NEG_INF
                    sc[uu * R + r] = x
                    if not (x <= mn) and mn == mn:  # max that keeps a NaN (max() would drop it)
                        mn = x
                ms = mn
                if mn == NEG_INF:  # nothing visible yet: keep exp's argument finite (no -inf - -inf)
                    ms = ZERO
                alpha = fexp(mo - ms)
                psum = ZERO
                for uu in range(U):
                    pe = fexp(sc[uu * R + r] - ms)
                    sc[uu * R + r] = pe
                    psum += pe
                l[r] = l[r] * alpha + psum
                m[r] = mn
                for jj in range(EPT):
                    a = acc[r * EPT + jj] * alpha
                    for uu in range(U):
                        a += sc[uu * R + r] * vf[uu * EPT + jj]
                    acc[r * EPT + jj] = a
            if CARE:
                if careful:  # NaN in a column for a non-finite V entry of a position the row sees
                    for r in range(R):
                        for uu in range(U):
                            pos = t0 + uu * NG + grp
                            vis = pos < hi and pos < lim0 + r // G
                            if WINDOW:
                                if pos < low0 + r // G:
                                    vis = False
                            if vis:
                                for jj in range(EPT):
                                    acc[r * EPT + jj] += bad[uu * EPT + jj]

        # merge the token groups' states through shared memory
        if lane == 0:
            for r in range(R):
                m_sh[grp * R + r] = m[r]
                l_sh[grp * R + r] = l[r]
        cuda.syncthreads()
        # Register arrays (m, l, acc) are indexed only with loop counters of fully unrolled loops
        # (constant trip counts), so they stay in registers; the per-row statistics below are read
        # back from shared memory.
        fac = cuda.local.array(R, float32)
        vsc = ONE
        if FP8:
            vsc = v_scale[h]
        for r in range(R):
            mx = NEG_INF
            for g2 in range(NG):
                mg = m_sh[g2 * R + r]
                if not (mg <= mx) and mx == mx:  # NaN-keeping max
                    mx = mg
            fac[r] = ZERO
            lse = NEG_INF
            if mx != NEG_INF:
                tot = ZERO
                for g2 in range(NG):
                    mg = m_sh[g2 * R + r]
                    if mg != NEG_INF:
                        tot += l_sh[g2 * R + r] * math.exp(mg - mx)
                lse = mx + math.log(tot)
                f = vsc / tot  # the fp8 cache's v_scale joins the normalization
                if SINKS:
                    if direct:  # lse' = logaddexp(lse, sink), o' = o exp(lse - lse')
                        lse, fs = _sink_join(lse, sinks[hq0 + r - (r // G) * G])
                        f = f * fs
                mine = m_sh[grp * R + r]
                if mine != NEG_INF:
                    fac[r] = math.exp(mine - mx) * f
            if r % NT == tid:  # the row's lse, stored below by this same thread (small unrolled body)
                lse_sh[r] = lse
        for r in range(tid, R, NT):
            qi = r // G
            hq = hq0 + r - qi * G
            x = lse_sh[r]
            if x == NEG_INF:  # nothing visible: -inf, or the sink for a direct row
                x = empty_lse(sinks, hq, direct)
            store_lse(lse_out, ws_lse, direct, b, qi, hq, u, x)
        for r0 in range(0, R, RB):
            for r in range(R):
                if r >= r0 and r < r0 + RB:
                    f = fac[r]
                    rr = r - r0
                    for i in range(NSLOT):
                        w = i * T + lane
                        if w < NWORDS:
                            for e in range(EW):
                                acc_sh[(grp * RB + rr) * D + w * EW + e] = acc[r * EPT + i * EW + e] * f
            cuda.syncthreads()
            for idx in range(tid, RB * D, NT):
                rr = idx // D
                r = r0 + rr
                if r < R:
                    d = idx - rr * D
                    tot = ZERO
                    for g2 in range(NG):
                        tot += acc_sh[(g2 * RB + rr) * D + d]
                    qi = r // G
                    store_o(out, ws_o, direct, b, qi, hq0 + r - qi * G, u, d, tot)
            cuda.syncthreads()

    split_kv_decode.__name__ = split_kv_decode.__qualname__ = "split_kv_decode_" + spec.tag().replace("-", "_")
    if SIM:
        return cuda.jit(split_kv_decode)
    # Ask for two resident programs per SM (<= 128 registers per thread) when the register arrays
    # leave room for it: q and acc (R * EPT fp32 each) and the tile's K and V words.
    word_regs = 2 * U * NSLOT * (2 if EW > 1 else 1)
    two = NT <= 256 and 2 * R * EPT + word_regs <= 96
    return cuda.jit(split_kv_decode, launch_bounds=(NT, 2) if two else NT)


def merge_kernel(spec: MergeSpec):
    """The (cached) separate merge kernel for ``spec``.

    Arguments, grid ``(batch * q_len * num_q_heads,)`` (one program per row ``(b, qi, h)``),
    ``spec.threads`` threads::

        ws_o      the workspace's PartialState.o [1, Q, H, max_units, D] float32
        ws_lse    the workspace's PartialState.lse [1, Q, H, max_units] float32
        meta      [2 B] int32: first[b] (the slot of b's unit 0) at b, units[b] at B + b (written by the partial
                  kernel's program 0; the slots' ranges need not be in sequence order)
        out       [B, Q, H, D] float32 or int16 bits of fp16/bf16
        lse_out   [B, Q, H] float32 (any array when ``not spec.has_lse``)
        sinks     [H] float32 sink logits (read only when ``spec.sinks``; any array otherwise)

    A row of a sequence with ``units[b] <= 1`` exits (the partial kernel wrote it). Otherwise, the contract of
    :func:`attnplan.state.merge_states` over slots ``[first[b], first[b] + units[b])`` in slot order:
    ``lse = logsumexp_s lse_s``, ``o = sum_s exp(lse_s - lse) o_s``; states with ``lse_s = -inf`` weigh 0
    (their ``o_s`` is never read); a row whose every state is empty gets ``o = 0, lse = -inf``; NaN in a
    non-empty state makes the row NaN (the maximum keeps NaN), never an empty row. With ``spec.sinks`` the
    sink then joins the denominator once: ``lse' = logaddexp(lse, sink[h])``, ``o' = o exp(lse - lse')``
    (an all-empty row: ``o = 0``, ``lse = sink[h]``; a ``-inf`` sink is no sink).
    """
    kern = _MERGE_CACHE.get(spec)
    if kern is None:
        with _sim_serial():
            kern = _MERGE_CACHE.get(spec)
            if kern is None:
                kern = _MERGE_CACHE[spec] = _build_merge(spec)
    return kern


def _build_merge(spec: MergeSpec):
    D, NT, HAS_LSE, SINKS = spec.head_dim, spec.threads, spec.has_lse, spec.sinks
    pack = _make_pack(spec.kind)

    if HAS_LSE:
        @_device
        def store_lse(dst, b, qi, h, x):
            dst[b, qi, h] = x
    else:
        @_device
        def store_lse(dst, b, qi, h, x):
            pass

    def merge_states(ws_o, ws_lse, meta, out, lse_out, sinks):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nb = out.shape[0]
        nq = out.shape[1]
        nh = out.shape[2]
        h = row % nh
        t = row // nh
        qi = t % nq
        b = t // nq
        n = int64(meta[nb + b])
        if n <= 1:  # a one-unit sequence: written by the partial kernel
            return
        s0 = int64(meta[b])
        mx = NEG_INF
        for s in range(s0, s0 + n):
            ls = ws_lse[0, qi, h, s]
            if not (ls <= mx) and mx == mx:  # NaN-keeping max
                mx = ls
        if mx == NEG_INF:  # every state empty: o = 0, lse = -inf (with a sink: lse = the sink)
            for d in range(tid, D, NT):
                out[b, qi, h, d] = pack(ZERO)
            if tid == 0:
                if SINKS:
                    store_lse(lse_out, b, qi, h, sinks[h])
                else:
                    store_lse(lse_out, b, qi, h, NEG_INF)
            return
        tot = ZERO
        for s in range(s0, s0 + n):
            ls = ws_lse[0, qi, h, s]
            if ls != NEG_INF:
                tot += math.exp(ls - mx)
        lse = mx + math.log(tot)
        inv = ONE / tot
        if SINKS:  # the sink joins the denominator once
            lse, fs = _sink_join(lse, sinks[h])
            inv = inv * fs
        for d in range(tid, D, NT):
            a = ZERO
            for s in range(s0, s0 + n):
                ls = ws_lse[0, qi, h, s]
                if ls != NEG_INF:
                    a += math.exp(ls - mx) * ws_o[0, qi, h, s, d]
            out[b, qi, h, d] = pack(a * inv)
        if tid == 0:
            store_lse(lse_out, b, qi, h, lse)

    merge_states.__name__ = merge_states.__qualname__ = "merge_states_" + spec.tag().replace("-", "_")
    return cuda.jit(merge_states)
