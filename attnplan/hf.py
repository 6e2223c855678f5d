"""Hugging Face ``transformers`` integration: attnplan as an attention implementation.

``register()`` adds ``"attnplan"`` to transformers' ``AttentionInterface`` (and its mask
interface, reusing the SDPA mask). A model loaded or configured with
``attn_implementation="attnplan"`` then runs its decode steps (``1 <= q_len <= 16`` new tokens over
a longer cache) through attnplan, reading transformers' KV cache tensors
``[batch, num_kv_heads, kv_len, head_dim]`` in place as a contiguous cache
``[batch, kv_len, num_kv_heads, head_dim]`` (a transposed view: attnplan's kernels take any
batch/token/head strides with unit stride in head_dim), with no copy. Everything else (prefill,
padded batches, sliding-window or chunked layers, dropout, float64 models) goes to transformers' own SDPA
implementation, except calls that SDPA would get wrong or refuse: a soft cap (``softcap=``, Gemma-2) other than on the eager DynamicCache
decode steps attnplan serves with it (``logits_soft_cap``), attention sinks (``s_aux=`` / ``sinks=``, gpt-oss) and a
position bias go to the model's own eager attention (its modeling module's ``eager_attention_forward``, what
``attn_implementation="eager"`` runs), and sparse attention over selected positions (``indices=`` /
``block_indices=``, DeepSeek-V3.2-style models) raises ``NotImplementedError``: neither attnplan nor SDPA reads
those positions, and computing dense attention instead would be silently wrong.

Which cache, which path (what transformers hands the attention function decides; it never sees the cache):

- **DynamicCache** (the default): the key/value tensors hold exactly the valid tokens and a decode step
  (``q_len == 1``) comes with no mask, so every sequence's length is ``kv_len``, known on the host. Eager calls
  plan once per step for the live length (the first layer plans, the other layers reuse the plan: same shapes)
  through :class:`~attnplan.DecodeWrapper`, with no device sync; a layer whose tensors have the raw shapes, strides,
  dtype, device and alignment of the last call the wrapper verified launches that call's kernels again with its own
  data pointers, without re-checking them (most of an eager call's host time is Python, dearer between transformers'
  per-layer work than in a loop); the plan comes from the plan cache except once per
  power-of-two length bucket, and where the config leaves the merge to the planner the steps use the fused merge
  (one kernel launch per layer: an eager step's time is the host's).
- **StaticCache** (``cache_implementation="static"``, the cache of ``torch.compile``): the key/value tensors
  are the whole preallocated cache ``[batch, num_kv_heads, max_cache_len, head_dim]`` and a decode step comes
  with a boolean mask ``[batch, 1, q_len, max_cache_len]`` whose last row sees the positions up to the cache
  position of the newest token. The valid length is that row's count (cache position + 1), computed on the
  device (never read back to the host; an eager call reads back one verdict per mask, below), and the step runs
  through ``torch.ops.attnplan.decode`` (:mod:`attnplan.ops`): one capacity plan per input signature, shared by
  all layers, made on the first call; under ``torch.compile`` the op traces without graph breaks (it has a fake
  implementation) and its kernels capture into the CUDA graphs of ``mode="reduce-overhead"``, where every replay
  reads the new lengths. Only batch 1 takes this path: with a mask, a larger batch may hold padding, which
  attnplan's prefix-length cache cannot express, so it falls back to SDPA.
  A DynamicCache step of several tokens over a cache (speculative verification) comes with a mask too and takes
  this path; its shapes, so its plan, change every step.
- **Which masks attnplan serves.** attnplan computes causal attention over a prefix: query ``i`` of ``q_len`` sees
  the positions ``j < L - q_len + i + 1``, ``L`` the count of the mask's last row. A batch-1 mask that is anything
  else (left padding, a masked hole, a tree mask of speculative decoding whose drafts do not all see each other)
  goes to SDPA, which is exact for any mask. Eager calls check it once per mask tensor: the check compares the
  mask with the prefix mask of its lengths on the device and reads the verdict back (one device-to-host sync per
  mask, not per layer: transformers builds one mask per forward and hands the same tensor to every layer, and the
  verdict and lengths are kept for the thread's last mask, keyed on the tensor's identity and ``_version``, its
  in-place version counter; an inference-mode tensor has none, so its verdict holds while the layers' ``layer_idx``
  rises, i.e. within one forward).
  **Under torch.compile (and during a CUDA-graph capture) a batch-1 mask is taken to be the causal prefix of its
  last row, unchecked**: the check needs the verdict on the host, a sync that would break the graph (and is illegal
  under capture), and computing SDPA's answer too on every step, to pick between the two on the device, would cost
  more than attnplan saves. A compiled model fed a batch-1 mask that is not a causal prefix gets wrong attention
  silently; feed it an unpadded prompt, or run such masks with ``attn_implementation="sdpa"``.
- Under ``torch.compile`` any served call goes through the op (with a DynamicCache the lengths are the
  tensors' ``kv_len``).

Needs the ``hf`` extra (``pip install -e '.[hf]'`` from the repository, i.e. transformers >= 4.56);
importing this module does not import transformers, :func:`register` does.

Example (eager, DynamicCache)::

    import attnplan.hf
    attnplan.hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attnplan", dtype=torch.bfloat16)
    out = model.generate(ids, max_new_tokens=64)

Example (StaticCache, compiled decode step: generate compiles the forward itself on a GPU)::

    out = model.generate(ids, max_new_tokens=64, cache_implementation="static")
"""

from __future__ import annotations

import collections
import sys
import threading
import warnings
import weakref

import torch

from . import ops  # noqa: F401  (registers torch.ops.attnplan.decode, which the compiled path calls)
from .api import Context, DecodeWrapper, default_context
from .problem import DTYPE_NAMES, MAX_Q_LEN, Q_DTYPES, SOFT_CAP_MAX, SOFT_CAP_MIN, check_sm_scale

__all__ = ["register", "attnplan_attention_forward", "NAME", "STATS"]

NAME = "attnplan"


class _Stats(collections.Counter):
    """:data:`STATS`: a ``Counter`` whose ``clear()`` sets its counts to 0 and keeps its keys."""

    def clear(self) -> None:
        for k in self:
            self[k] = 0


#: how eager calls were served, for tests and for users who want to know (calls traced by ``torch.compile`` are
#: not counted: dynamo would guard on the counter's value and recompile at every step); ``STATS.clear()`` resets
#: the counts to 0 (a key deleted by hand counts from 0 again)
STATS = _Stats({"attnplan": 0, "sdpa_fallback": 0, "eager_fallback": 0})

_SDPA = None  # transformers' sdpa_attention_forward, bound on first use
_EAGER_CTX = None  # (the default context it was made from, the eager steps' context): _eager_context
_STEP = threading.local()  # this thread's steps: .memo (the last verified call), .by_stream ((device, stream) ->
# _StreamStep), .last (the _StreamStep of the last call that was not a repeat)


#: streams per thread whose eager-step wrappers are kept (a thread that cycles through more frees the oldest's)
STREAM_STEPS = 8


class _StreamStep:
    """One thread's eager steps on one CUDA stream: its own :class:`DecodeWrapper` (so runs on two streams never
    share a workspace) and the ``seq_lens`` tensor, scale and soft cap its plan was made for."""

    __slots__ = ("wrapper", "seq_lens", "scale", "cap")

    def __init__(self):
        self.wrapper = self.seq_lens = self.scale = self.cap = None


_MASK = threading.local()  # this thread's last checked mask: .ref (weakref), .version, .layer, .lens (None: SDPA)
#: keyword arguments of the attention call that ask for a variant attnplan does not serve here (any that is not None;
#: ``softcap`` is served on the eager DynamicCache path: :func:`_soft_cap`)
_VARIANT_KWARGS = frozenset(("sinks", "s_aux", "position_bias", "sliding_window", "indices", "block_indices"))
#: of those, the ones transformers' SDPA function ignores or refuses: the model's own eager attention serves them
_EAGER_KWARGS = ("softcap", "sinks", "s_aux", "position_bias")
#: sparse attention over selected positions (DeepSeek-V3.2-style top-k indices): no fallback computes it
_SPARSE_KWARGS = ("indices", "block_indices")
#: the query dtypes attnplan's kernels take; a model in another (float64) runs on SDPA
_SERVED_DTYPES = frozenset(t for t, name in DTYPE_NAMES.items() if name in Q_DTYPES)


def _sdpa():
    global _SDPA
    if _SDPA is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _SDPA = sdpa_attention_forward
    return _SDPA


def _fallback(module: torch.nn.Module, kwargs: dict):
    """The attention function for a call attnplan does not serve: transformers' SDPA, or the model's own eager
    attention where the call carries a variant SDPA ignores (sinks, a position bias) or refuses (a soft cap).

    Raises:
        NotImplementedError: the call asks for sparse attention over selected positions (``indices=`` /
            ``block_indices=``), which neither attnplan nor SDPA computes, or for an eager-only variant on a module
            whose modeling file has no ``eager_attention_forward``; the message names the argument.
    """
    if kwargs:
        for name in _SPARSE_KWARGS:
            if kwargs.get(name) is not None:
                raise NotImplementedError(
                    f"attnplan: the attention call of {type(module).__name__} passes {name}= (sparse attention over "
                    f"selected positions), which neither attnplan nor its SDPA fallback computes; load the model "
                    f"with attn_implementation='eager' or 'sdpa', which fold the selection into the mask")
        for name in _EAGER_KWARGS:
            if kwargs.get(name) is not None:
                eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
                if eager is None:
                    raise NotImplementedError(
                        f"attnplan: the attention call of {type(module).__name__} passes {name}=, which SDPA does not "
                        f"compute, and its module has no eager_attention_forward to fall back to; load the model "
                        f"with attn_implementation='eager'")
                return _with_additive_mask(eager)
    return _sdpa()


def _with_additive_mask(eager):
    """``eager`` called with the additive mask it expects. attnplan registers SDPA's mask function, which hands the
    attention call a boolean mask (True = attend), or ``None`` where SDPA's own ``is_causal`` would do (no padding);
    a model's eager attention adds its mask to the scores. So a boolean mask becomes 0 / the dtype's lowest value
    (transformers' ``eager_mask``), and a missing one over several queries the mask SDPA's ``is_causal`` applies:
    query ``i`` sees positions ``j <= i`` (aligned to the cache's start: SDPA's mask function returns ``None`` only
    where that is the causal mask, a prefill, or a StaticCache whose unwritten tail those rows must not see)."""
    def call(module, query, key, value, attention_mask, **kw):
        q_len, kv_len = query.shape[2], key.shape[2]
        if attention_mask is None and q_len > 1:
            i = torch.arange(q_len, device=query.device)[:, None]
            attention_mask = (torch.arange(kv_len, device=query.device)[None, :] <= i)[None, None]
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            low = torch.finfo(query.dtype).min
            attention_mask = torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(~attention_mask, low)
        return eager(module, query, key, value, attention_mask, **kw)

    return call


def _count(what: str) -> None:
    if not torch.compiler.is_compiling():
        STATS[what] += 1


def _mask_lengths(mask: torch.Tensor, b: int, q_len: int, kv_len: int, layer: int | None = None
                  ) -> torch.Tensor | None:
    """The valid KV length per sequence from transformers' boolean attention mask ``[b, 1, q_len, kv_len]``
    (True = attend): the count of the last query row, int32 ``[b]`` on the mask's device. ``None`` for a mask of
    another kind (float, or another shape) and, in eager mode, for a mask that is not the causal prefix of those
    lengths or whose lengths hold no earlier token (a prefill into an empty cache: a count of ``q_len``; a
    StaticCache's key is its whole capacity, so ``kv_len`` alone cannot tell) (:func:`_is_causal_prefix`): those go
    to SDPA. Eager: one check (a sync) per mask tensor, its verdict
    and lengths kept for the thread's next calls with the same unchanged tensor (``layer``: the calling module's
    ``layer_idx``, which bounds the verdict of a tensor without a version counter to one forward). Under
    torch.compile or a CUDA-graph capture: the lengths, computed on the device, unchecked (no sync)."""
    if mask.dtype != torch.bool or mask.dim() != 4 or tuple(mask.shape[-2:]) != (q_len, kv_len) \
            or mask.shape[0] != b:
        return None
    if torch.compiler.is_compiling() or (mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        return mask[:, 0, -1].sum(-1, dtype=torch.int32)
    memo = _MASK
    version = None if mask.is_inference() else mask._version
    ref = getattr(memo, "ref", None)
    if ref is not None and ref() is mask:
        if version is None:  # an inference tensor has no version counter: the verdict holds within one forward
            hit = layer is not None and memo.layer is not None and layer > memo.layer
        else:
            hit = memo.version == version
        if hit:
            memo.layer = layer
            return memo.lens
    memo.ref = None  # a check that raises leaves no verdict behind
    lens = mask[:, 0, -1].sum(-1, dtype=torch.int32)
    lens = lens if _is_causal_prefix(mask, lens, q_len, kv_len) else None
    memo.ref, memo.version, memo.layer, memo.lens = weakref.ref(mask), version, layer, lens
    return lens


def _is_causal_prefix(mask: torch.Tensor, lens: torch.Tensor, q_len: int, kv_len: int) -> bool:
    """Whether the boolean mask ``[b, 1, q_len, kv_len]`` is exactly the causal-prefix mask of ``lens`` (its last
    rows' counts), the attention attnplan computes (query ``i`` sees the positions ``j < L - q_len + i + 1``), over
    a cache that holds earlier tokens (every ``L > q_len``: not a prefill). One device-to-host sync (the verdict)."""
    dev = mask.device
    stop = lens.view(-1, 1, 1, 1) - q_len + 1 + torch.arange(q_len, device=dev).view(1, 1, -1, 1)
    return bool(((mask == (torch.arange(kv_len, device=dev) < stop)).all() & (lens > q_len).all()).item())


def _soft_cap(kwargs: dict) -> float | None:
    """The call's soft cap (Gemma-2's ``softcap=``) as attnplan's ``logits_soft_cap``: ``0.0`` for none, ``None``
    for a value attnplan does not take (not a real number, or outside ``[SOFT_CAP_MIN, SOFT_CAP_MAX]``)."""
    cap = kwargs.get("softcap") if kwargs else None
    if cap is None:
        return 0.0
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not SOFT_CAP_MIN <= cap <= SOFT_CAP_MAX:
        return None
    return float(cap)


def _module_attr(module: torch.nn.Module, name: str, default=None):
    """``getattr(module, name, default)`` without ``nn.Module.__getattr__``'s raise-and-catch where the name is
    neither the instance's nor its class's (an attention module without ``sliding_window``: about 1 us a layer)."""
    d = module.__dict__
    if name in d:
        return d[name]
    return getattr(module, name, default) if hasattr(type(module), name) else default


def _full_attention_layer(module: torch.nn.Module) -> bool:
    """Whether the module's layer attends to its whole causal prefix by its model's config: its entry of
    ``config.layer_types`` is ``"full_attention"``, or, for a config without per-layer types, the config sets no
    ``sliding_window`` and no ``attention_chunk_size``. A sliding or chunked layer whose module carries no
    ``sliding_window`` attribute (Llama-4's chunked layers, PhiMoE's windows: the window lives only in the mask and the
    cache) must not be served: under ``torch.compile`` its mask is taken to be a causal prefix, and it is not one."""
    cfg = _module_attr(module, "config")
    if cfg is None:
        return True
    types = getattr(cfg, "layer_types", None)
    idx = _module_attr(module, "layer_idx")
    if isinstance(types, (list, tuple)) and isinstance(idx, int) and 0 <= idx < len(types):
        return types[idx] == "full_attention"
    return getattr(cfg, "sliding_window", None) is None and getattr(cfg, "attention_chunk_size", None) is None


def _serves(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            dropout: float, kwargs: dict) -> bool:
    """Whether this call is plain decode attention attnplan computes (the mask aside): anything else, a float64
    model, query heads that are not a whole multiple of the KV heads, an empty batch, a key or value whose head_dim
    is strided, an eager call's lazily negated view (the kernels read memory as it is; under torch.compile the call
    goes through ``torch.ops.attnplan.decode``, which torch's dispatcher hands materialized inputs, and is not
    checked, to keep the graph whole), a layer its config makes sliding or chunked
    (:func:`_full_attention_layer`), and a call that needs gradients (grad mode on and an input that requires grad:
    attnplan computes none) included, goes to :func:`_fallback`."""
    b, hq, q_len, d = query.shape
    kv_len = key.shape[2]
    hkv = key.shape[1]
    return (b >= 1 and 1 <= q_len <= MAX_Q_LEN and kv_len >= q_len and 0 < hkv == value.shape[1] and hq % hkv == 0
            and key.stride(-1) == 1 and value.stride(-1) == 1
            and query.dtype == key.dtype == value.dtype and query.dtype in _SERVED_DTYPES
            and (torch.compiler.is_compiling() or not (query.is_neg() or key.is_neg() or value.is_neg()))
            and key.shape[-1] == value.shape[-1] == d
            and (dropout == 0.0 or not module.training)
            and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
            and (_VARIANT_KWARGS.isdisjoint(kwargs) or all(kwargs.get(n) is None for n in _VARIANT_KWARGS))
            and _module_attr(module, "sliding_window") is None
            and kwargs.get("is_causal", _module_attr(module, "is_causal", True)) is not False
            and _full_attention_layer(module))


def _eager_context():
    """The context of eager steps' wrappers: the process's (:func:`~attnplan.api.default_context`:
    ``plans/default.yaml`` and ``$ATTNPLAN_CONFIG``), with the fused merge where the config leaves the merge to the
    planner (``split.merge: auto``, not batch-invariant). An eager step is host bound (transformers' own per-layer
    work takes longer than the GPU's), so one kernel launch per layer (the last program of each sequence and KV head
    merges) beats a merge kernel's second launch: measured on an H200 host (host time per call, the GPU busy), the
    attention call took 23.9 us (triton) and 22.0 (cuda_ptx) with the fused merge against 27.5 and 26.2 with the
    separate one. The price is GPU time where chunks are long (cuda_ptx's fused kernel streams chunks over 2,048
    tokens 4-9% slower), hidden while the step is host bound. A backend without the fused merge plans the separate one."""
    global _EAGER_CTX
    base = default_context()
    if _EAGER_CTX is None or _EAGER_CTX[0] is not base:
        ctx, split = base, base.config.split
        if split.merge == "auto" and not split.batch_invariant:
            ctx = Context.from_config(base.config.model_copy(update={"split": split.model_copy(
                update={"merge": "fused"})}))
        _EAGER_CTX = (base, ctx)
    return _EAGER_CTX[1]


_CURRENT_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only torch builds


def _stream_of(index: int) -> int:
    """The current CUDA stream's handle on device ``index`` (``Tensor.get_device()``: -1, a CPU tensor, gives 0),
    without making a ``torch.cuda.Stream`` or a ``torch.device``."""
    if index < 0:
        return 0
    get = _CURRENT_RAW_STREAM
    return get(index) if get is not None else torch.cuda.current_stream(index).cuda_stream


def _step_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_len: int,
                 scale: float | None, cap: float = 0.0) -> torch.Tensor:
    """Eager decode with every sequence ``kv_len`` long, on transformers' tensors (query ``[b, hq, q_len, d]``, key
    and value ``[b, hkv, kv_len, d]``), into a fresh contiguous output ``[b, q_len, hq, d]``.

    This thread's :class:`DecodeWrapper` runs where the inputs are what it was planned for
    (:meth:`DecodeWrapper.try_run` compares the token-major views' shapes, strides, dtypes, devices and alignment
    with the plan's, so a model's layers run on one plan); it plans again for the live length where they are not (a
    DynamicCache one token longer: once per step, a plan-cache hit within the length's power-of-two bucket), when the
    score scale changes or on another stream. A layer whose tensors repeat the raw signature of the last call so
    verified (:func:`_repeat`) launches again without the views and the check. Each stream of the thread has its
    own wrapper (:class:`_StreamStep`): unsynchronized steps on two streams (a draft and a target model) never run
    one workspace at once."""
    st = _STEP
    memo = getattr(st, "memo", None)
    if memo is not None and memo[0] == scale and memo[1] == cap:
        out = _repeat(memo, query, key, value)
        if out is not None:
            return out
    st.memo = None
    q = query.transpose(1, 2)  # [b, q_len, hq, d]
    copied = q.stride(-1) != 1
    if copied:
        q = q.contiguous()
    k = key.transpose(1, 2)  # [b, kv_len, hkv, d] views of the cache
    v = value.transpose(1, 2)
    dev = query.get_device()
    stream = _stream_of(dev)
    by_stream = getattr(st, "by_stream", None)
    if by_stream is None:
        by_stream = st.by_stream = {}
    ss = by_stream.get((dev, stream))
    if ss is None:
        while len(by_stream) >= STREAM_STEPS:  # the least recently created first (its wrapper and workspace freed)
            del by_stream[next(iter(by_stream))]
        ss = by_stream[(dev, stream)] = _StreamStep()
    st.last = ss  # the step this call used (for inspection)
    w = ss.wrapper
    out = None
    if w is not None and ss.scale == scale and ss.cap == cap:
        out = w.try_run(q, k, v, ss.seq_lens, None, out=q.new_empty(q.shape))
    if out is None:
        b = q.shape[0]
        lens = torch.full((b,), kv_len, dtype=torch.int32, device=q.device)
        w = ss.wrapper = w or DecodeWrapper(_eager_context())
        ss.scale = ss.cap = None  # a plan() that raises leaves no usable step behind
        w.plan(q, k, v, lens, None, sm_scale=scale, logits_soft_cap=cap, seq_lens_host=[kv_len] * b)
        ss.scale, ss.cap, ss.seq_lens = scale, cap, lens
        out = w.run(q, k, v, lens, None, out=q.new_empty(q.shape))
    launcher = w._launcher  # the bound launch run() / try_run() just used, while the plan stays (attnplan.api)
    if w._fast is not None and not copied and w.backend.graph_safe \
            and getattr(launcher, "launch_direct", None) is not None:
        pq, pk, pv = query.data_ptr(), key.data_ptr(), value.data_ptr()
        st.memo = (scale, cap, w, w._fast, launcher, ss.seq_lens.data_ptr(), out.shape, query.dtype, dev, stream,
                   query.shape, query.stride(), not pq & 15, key.shape, key.stride(), not pk & 15,
                   value.shape, value.stride(), not pv & 15)
    return out


def _repeat(memo: tuple, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
    """The launch of the last verified call (:func:`_step_decode`'s memo) again for this layer's tensors, or ``None``
    (nothing launched). It launches only where the wrapper still holds the plan and bound launch of that call and
    query, key and value have its raw shapes, strides, dtype, device and 16-byte alignment, on the same stream:
    their token-major views then have the signature ``try_run()`` accepted, and the output is fresh (it overlaps
    nothing), so ``try_run()`` would launch the same kernels with the same arguments but the data pointers."""
    (_, _, w, fast, launcher, p_lens, oshape, dtype, dev, stream,
     qs, qst, qa, ks, kst, ka, vs, vst, va) = memo
    if w._fast is fast and w._launcher is launcher \
            and query.shape == qs and query.stride() == qst and query.dtype is dtype and query.get_device() == dev \
            and key.shape == ks and key.stride() == kst and key.dtype is dtype and key.get_device() == dev \
            and value.shape == vs and value.stride() == vst and value.dtype is dtype and value.get_device() == dev:
        pq, pk, pv = query.data_ptr(), key.data_ptr(), value.data_ptr()
        if (not pq & 15) is qa and (not pk & 15) is ka and (not pv & 15) is va and _stream_of(dev) == stream:
            out = query.new_empty(oshape)
            if launcher.launch_direct((pq, pk, pv, p_lens, 0), out, None):
                return out
    return None


def attnplan_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                               **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function (the ``AttentionInterface`` signature).

    Args:
        query: ``[batch, num_q_heads, q_len, head_dim]``; key, value: ``[batch, num_kv_heads,
            kv_len, head_dim]`` (the cache after this step's update: the valid tokens of a DynamicCache, the
            whole ``max_cache_len`` of a StaticCache), query's dtype.
        attention_mask: ``None`` (a decode step over a DynamicCache: every position is visible), or
            transformers' boolean mask ``[batch, 1, q_len, kv_len]`` (True = attend): with batch 1 the valid length
            is read from its last row on the device and attnplan serves the mask if it is the causal prefix of
            that length (checked once per mask tensor in eager mode, assumed under torch.compile: module
            docstring), SDPA otherwise; with a larger batch it may hold padding, so SDPA serves it.
        dropout: must be 0 (or the module in eval mode) for attnplan to serve the call.
        scaling: score scale (transformers passes ``head_dim ** -0.5`` or the model's own): 0 or a magnitude in
            ``[SM_SCALE_MIN, FP32_SCALED_MAX]``, negative ones too (:func:`attnplan.problem.check_sm_scale`);
            ``None`` means ``1/sqrt(head_dim)``.
        **kwargs: the model's other arguments, passed on to a fallback. ``softcap`` (a float in
            ``[SOFT_CAP_MIN, SOFT_CAP_MAX]``, Gemma-2) is attnplan's ``logits_soft_cap`` on eager unmasked decode
            steps; ``sinks`` / ``s_aux`` / ``position_bias`` (and a soft cap elsewhere) send the call to the model's
            own eager attention, ``sliding_window`` to SDPA; ``indices`` / ``block_indices`` raise (below).
    Returns:
        ``(attn_output [batch, q_len, num_q_heads, head_dim], None)`` in query's dtype: no attention weights, as
        transformers' SDPA (``output_attentions=True`` warns, ``UserWarning``, and the model returns none); a call
        that falls back returns what its fallback returns (SDPA: no weights; the model's eager attention: its own).
    Raises:
        NoBackendError: no attnplan backend serves the model's heads (e.g. its head_dim; the reasons are listed);
            a dtype the kernels do not take (float64) and uneven head counts go to SDPA instead.
        NotImplementedError: sparse attention over selected positions (``indices=`` / ``block_indices=``), or a
            variant only the model's eager attention computes on a module without one (:func:`_fallback`).
        ValueError, TypeError: inputs attnplan serves but refuses as :func:`attnplan.decode` does (e.g. ``scaling``
            out of the range above), before any kernel runs.
        ConfigError: ``$ATTNPLAN_CONFIG`` names a file that does not load (:func:`attnplan.api.default_context`).
    """
    b, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    lens = None
    cap = _soft_cap(kwargs)
    if cap is not None and _serves(module, query, key, value, dropout, kwargs):
        if attention_mask is None:
            via = "host" if q_len == 1 else None  # q_len > 1 unmasked: a prefill (SDPA's causal path)
            if cap and torch.compiler.is_compiling():
                via = None  # the op takes no soft cap: a compiled soft-capped step runs the model's eager attention
        elif cap:
            via = None  # the device-lengths path (the op) takes no soft cap
        elif b == 1 and kv_len > q_len:  # a step over a cache (a prefill with an empty one goes to SDPA)
            lens = _mask_lengths(attention_mask, b, q_len, kv_len, getattr(module, "layer_idx", None))
            via = None if lens is None else "device"
        else:
            via = None
    else:
        via = None
    if via is None:
        fallback = _fallback(module, kwargs)
        _count("sdpa_fallback" if fallback is _SDPA else "eager_fallback")
        return fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if kwargs.get("output_attentions"):
        # a call attnplan serves forms no weights, as transformers' SDPA (the model's output holds none): said, not
        # silent (a call that falls back gets the fallback's own handling: SDPA's message, eager's weights)
        warnings.warn("attnplan attention does not return attention weights (output_attentions=True): load the "
                      "model with attn_implementation='eager' for them", UserWarning, stacklevel=2)
    if scaling is not None and type(scaling) is not float:
        # the step's memo compares scales by value: a bool, tensor or numpy scale would match a float one there
        check_sm_scale(scaling)
        scaling = float(scaling)
    if via == "host" and not torch.compiler.is_compiling():
        out = _step_decode(query, key, value, kv_len, scaling, cap)
        _count("attnplan")  # counted once served: a call that raises is not
        return out, None
    q = query.transpose(1, 2)  # [b, q_len, hq, d]
    if q.stride(-1) != 1:
        q = q.contiguous()
    k = key.transpose(1, 2)  # [b, kv_len, hkv, d] view of the cache
    v = value.transpose(1, 2)
    if lens is None:
        lens = torch.full((b,), kv_len, dtype=torch.int32, device=query.device)
    out = torch.ops.attnplan.decode(q, k, v, lens, None, scaling, "")
    _count("attnplan")
    return out, None


def register() -> None:
    """Register ``"attnplan"`` with transformers' attention (and attention-mask) interfaces, and
    ``torch.ops.attnplan.decode``.

    Raises:
        ImportError: transformers is not installed (``pip install 'attnplan[hf]'``).
    """
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError(f"attnplan.hf.register() needs transformers >= 4.56: pip install 'attnplan[hf]' ({e})") from e
    _sdpa()
    AttentionInterface.register(NAME, attnplan_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register(NAME, sdpa_mask)
    except ImportError:  # older transformers without a mask interface
        pass
