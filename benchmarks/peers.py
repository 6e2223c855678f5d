"""The decode benchmark's peers, timed in the same process as attnplan: torch's
``scaled_dot_product_attention`` with the flash and cuDNN backends, and ``torch.compile``d
FlexAttention, each on a dense ``[batch, heads, kv_len, head_dim]`` bf16 copy of the inputs padded to
the longest sequence (what a serving system hands a dense kernel). GQA goes through ``enable_gqa``.

This module, not the library, owns the one global setting the benchmark changes: FlexAttention's
``torch._dynamo.config`` recompile limit is raised (once, when the first flex peer is built) so that
every benchmark shape compiles instead of falling back to eager after the default 8 recompiles.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from attnplan.timing import capture_graphs, time_cuda

#: peer names as the benchmark's results and tables spell them
PEERS = {"flash": "sdpa_flash", "cudnn": "sdpa_cudnn", "flex": "flex", "flashinfer": "flashinfer",
         "flashinfer_tc": "flashinfer_tc"}


def bf16_view(x):
    """The peers' view of a set of inputs (:class:`attnplan.backends.DecodeInputs`): its KV cache in bf16
    (an fp8 cache widened; the peers have no fp8 KV path). Inputs already in bf16 are returned as they are."""
    if x.k_cache.dtype != torch.float8_e4m3fn:
        return x
    return dataclasses.replace(x, k_cache=x.k_cache.to(torch.bfloat16), v_cache=x.v_cache.to(torch.bfloat16))


def dense_copies(sets) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Dense ``(q [B, H, Q, D], k [B, Hkv, L, D], v [B, Hkv, L, D])`` copies of each input set (the SDPA layout),
    ``L`` the longest sequence; a paged cache is gathered through its block table. Made once, outside the
    timed region."""
    dense = []
    for x in map(bf16_view, sets):
        lmax = int(x.seq_lens.max())
        if x.block_table is not None:
            ps = x.k_cache.shape[1]
            pages = x.block_table[:, : -(-lmax // ps)].long()
            k = x.k_cache[pages].flatten(1, 2)[:, :lmax]
            v = x.v_cache[pages].flatten(1, 2)[:, :lmax]
        else:
            k, v = x.k_cache[:, :lmax], x.v_cache[:, :lmax]
        dense.append((x.q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()))
    return dense


_FLEX: dict = {}


def _flex_fn():
    """``torch.compile``d FlexAttention, compiled once per process (raises dynamo's recompile limit to 256
    first: one compile per benchmark shape)."""
    if "fn" not in _FLEX:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        for knob in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 256)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def time_step(step, n: int, iters: int, res: dict) -> None:
    """Fill ``res`` with a step's times (microseconds, medians of ``iters``): ``eager_us`` (the eager call, host
    included), ``graph_us`` (CUDA-graph replay, device time: an L2 flush queued in front, so the host's launch
    latency is not counted and L2 is cold) and ``graph_host_us`` (replay with the host's launch latency). The
    ``n`` input sets rotate (``step(j)``, ``j < n``). A step that cannot be captured keeps its eager time and
    records ``graph_error``."""
    res["eager_us"] = time_cuda(lambda i: step(i % n), warmup=10, iters=iters)["median_us"]
    try:
        graphs = capture_graphs(step, n)
    except Exception as e:  # noqa: BLE001 - a peer that cannot be captured keeps its eager time
        res["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        torch.cuda.synchronize()
        return
    res["graph_us"] = time_cuda(lambda i: graphs[i % n].replay(), warmup=10, iters=iters, flush=True)["median_us"]
    res["graph_host_us"] = time_cuda(lambda i: graphs[i % n].replay(), warmup=10, iters=iters)["median_us"]
    del graphs


def time_flashinfer(sets, iters: int, tensor_cores: bool, kv_layout: str = "NHD",
                    caches=None) -> tuple[dict, torch.Tensor | None]:
    """Time FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (:mod:`flashinfer_peer`) on the paged ``sets``
    themselves (same cache, same block tables as attnplan): plan() on the host per set, run() captured.
    ``kv_layout`` ``"HND"`` reads ``caches`` instead, one ``(k, v)`` pair ``[pages, Hkv, page, D]`` per set (the same
    values head-major); the sets keep giving the shapes, lengths and block tables.

    Returns ``(result, out)`` like :func:`time_peer`; ``{"error": ...}`` when FlashInfer does not import, the
    cache is not paged bf16, or ``q_len > 1``."""
    from flashinfer_peer import FlashInferDecode, load

    fi, why = load()
    x0 = sets[0]
    if fi is None:
        return {"error": f"flashinfer not available: {why}"}, None
    if x0.block_table is None or x0.k_cache.dtype != torch.bfloat16 or x0.q.shape[1] != 1:
        return {"error": "flashinfer peer: paged bf16 caches with q_len 1 only"}, None
    try:
        b, _, hq, d = x0.q.shape
        hkv, page = x0.k_cache.shape[2], x0.k_cache.shape[1]
        lens = [int(n) for n in x0.seq_lens.tolist()]
        wrappers, outs = [], []
        for x in sets:
            pe = FlashInferDecode(fi, hq, hkv, d, page, b, x.block_table.numel(), tensor_cores, kv_layout=kv_layout)
            pe.plan(lens, x.block_table)
            wrappers.append(pe)
            outs.append(torch.empty_like(x.q))

        kv = caches if caches is not None else [(x.k_cache, x.v_cache) for x in sets]

        def step(j):
            wrappers[j].run(sets[j].q, kv[j][0], kv[j][1], outs[j])

        step(0)
        torch.cuda.synchronize()
        out = outs[0].clone()
        res: dict = {}
        time_step(step, len(sets), iters, res)
        return res, out
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}, None


def time_peer(kind: str, sets, iters: int) -> tuple[dict, torch.Tensor | None]:
    """Time peer ``kind`` (``"flash"``, ``"cudnn"`` or ``"flex"`` on dense copies of ``sets``; ``"flashinfer"`` /
    ``"flashinfer_tc"`` on the paged sets themselves, :func:`time_flashinfer`) (:func:`time_step`).

    FlexAttention runs without a mask (decode with ``q_len`` 1 sees the whole cache). ``q_len > 1`` is not
    benchmarked for any peer (a KV cache needs a bottom-right causal mask). A peer that refuses the shape is
    recorded as ``{"error": ...}``, not raised.

    Returns:
        ``(result, out)``: the times, and the peer's output ``[B, Q, H, D]`` of set 0 (``None`` on error).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if kind in ("flashinfer", "flashinfer_tc"):
        return time_flashinfer(sets, iters, kind == "flashinfer_tc")
    if sets[0].q.shape[1] != 1:
        return {"error": f"{kind} peer: q_len > 1 with a KV cache needs a bottom-right causal mask (not benchmarked)"}, None
    dense = dense_copies(sets)
    try:
        if kind == "flex":
            fn = _flex_fn()

            def step(j):
                return fn(*dense[j], enable_gqa=True)
        else:
            backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[kind]

            def step(j):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(*dense[j], enable_gqa=True)
        out = step(0).transpose(1, 2).clone()
        torch.cuda.synchronize()
        res: dict = {}
        time_step(step, len(dense), iters, res)
        return res, out
    except Exception as e:  # noqa: BLE001 - a peer that cannot run this shape is recorded, not fatal
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}, None
    finally:
        del dense
        torch.cuda.empty_cache()
