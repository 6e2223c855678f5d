"""FlashInfer's paged decode as a benchmark peer: ``BatchDecodeWithPagedKVCacheWrapper``, tensor cores on and off.

FlashInfer's plan() runs on the host outside the graph (its work balancing across sequences happens there, from
the host lengths); run() is captured. Its paged cache is ``[pages, page, kv_heads, head_dim]`` ("NHD"), attnplan's
layout, so both read the same cache; its ``indices`` are each sequence's pages concatenated, ``indptr`` their
offsets, ``last_page_len = (len - 1) % page + 1`` (FlashInfer needs at least one token per sequence).

On a machine with ``pip install flashinfer-python`` this imports it; :func:`load` returns ``None`` (and the
reason) when it does not import, and the benchmark says so.
"""

from __future__ import annotations

import torch

__all__ = ["load", "FlashInferDecode"]

_WORKSPACE: dict = {}


def load():
    """``(flashinfer module, None)`` or ``(None, reason)``."""
    try:
        import flashinfer  # noqa: F401
        return flashinfer, None
    except Exception as e:  # noqa: BLE001 - any import failure makes the peer unavailable
        return None, f"{type(e).__name__}: {str(e)[:200]}"


class FlashInferDecode:
    """One FlashInfer decode wrapper over attnplan-layout paged inputs.

    Args:
        fi: the ``flashinfer`` module.
        num_q_heads, num_kv_heads, head_dim, page_size: the problem.
        batch: sequences; max_pages: most pages any plan may index (the cuda-graph buffers' size).
        tensor_cores: ``use_tensor_cores`` (FlashInfer's prefill-kernel decode path).
        kv_layout: ``"NHD"`` (``[pages, page, Hkv, D]``, attnplan's) or ``"HND"`` (``[pages, Hkv, page, D]``).
    """

    def __init__(self, fi, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, batch: int,
                 max_pages: int, tensor_cores: bool, kv_layout: str = "NHD"):
        dev = torch.device("cuda")
        if "ws" not in _WORKSPACE:
            _WORKSPACE["ws"] = torch.zeros(512 << 20, dtype=torch.uint8, device=dev)
        self.indptr = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
        self.indices = torch.zeros(max(max_pages, 1), dtype=torch.int32, device=dev)
        self.last = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.w = fi.BatchDecodeWithPagedKVCacheWrapper(
            _WORKSPACE["ws"], kv_layout, use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last)
        self.shape = (num_q_heads, num_kv_heads, head_dim, page_size)

    def plan(self, seq_lens: list[int], block_table: torch.Tensor) -> None:
        """Host planning for these lengths (outside any graph). ``block_table`` ``[batch, pages]`` int32."""
        hq, hkv, d, page = self.shape
        pages = [max(1, -(-n // page)) for n in seq_lens]
        indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0).tolist()), dtype=torch.int32)
        bt = block_table.cpu()
        indices = torch.cat([bt[b, :p] for b, p in enumerate(pages)]).to(torch.int32)
        last = torch.tensor([(max(n, 1) - 1) % page + 1 for n in seq_lens], dtype=torch.int32)
        self.w.plan(indptr.cuda(), indices.cuda(), last.cuda(), hq, hkv, d, page,
                    q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
        """``q [batch, 1, Hq, D]`` (attnplan's layout) -> ``out [batch, 1, Hq, D]``."""
        self.w.run(q[:, 0], (k_cache, v_cache), out=out[:, 0])
