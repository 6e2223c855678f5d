"""Hugging Face ``transformers`` integration: attnplan as an attention implementation.

``register()`` adds ``"attnplan"`` to transformers' ``AttentionInterface`` (and its mask
interface, reusing the SDPA mask). A model loaded or configured with
``attn_implementation="attnplan"`` then runs decode steps (``1 <= q_len <= 16`` new tokens over
a longer cache) through :func:`attnplan.decode`, reading transformers' KV cache tensors
``[batch, num_kv_heads, kv_len, head_dim]`` in place as a contiguous cache
``[batch, kv_len, num_kv_heads, head_dim]`` (a transposed view: attnplan's kernels take any
batch/token/head strides with unit stride in head_dim), with no copy. Everything else (prefill,
padded batches with an attention mask, soft-capping, dropout) goes to transformers' own SDPA
implementation.

Needs the ``hf`` extra (``pip install -e '.[hf]'`` from the repository, i.e. transformers >= 4.56);
importing this module does not import transformers, :func:`register` does.

Example::

    import attnplan.hf
    attnplan.hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attnplan")
"""

from __future__ import annotations

import torch

from .api import decode
from .problem import MAX_Q_LEN

__all__ = ["register", "attnplan_attention_forward", "NAME"]

NAME = "attnplan"
#: counters of how calls were served, for tests and for users who want to know
STATS = {"attnplan": 0, "sdpa_fallback": 0}


def attnplan_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                               **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function (the ``AttentionInterface`` signature).

    Args:
        query: ``[batch, num_q_heads, q_len, head_dim]``; key, value: ``[batch, num_kv_heads,
            kv_len, head_dim]`` (the cache after this step's update).
        attention_mask: ignored for batch 1 (causal decode needs none); a batch with a mask may
            hold padding, so it falls back to SDPA.
        scaling: score scale (transformers passes ``head_dim ** -0.5`` or the model's own).
    Returns:
        ``(attn_output [batch, q_len, num_q_heads, head_dim], None)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, hq, q_len, d = query.shape
    kv_len = key.shape[2]
    decode_step = 1 <= q_len <= MAX_Q_LEN and kv_len >= q_len and kv_len > 0
    plain = (dropout == 0.0 or not module.training) and kwargs.get("softcap") is None and kwargs.get("sinks") is None \
        and kwargs.get("s_aux") is None and getattr(module, "sliding_window", None) is None
    if not (decode_step and plain and (attention_mask is None or b == 1)) or query.dtype != key.dtype:
        STATS["sdpa_fallback"] += 1
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    STATS["attnplan"] += 1
    q = query.transpose(1, 2)  # [b, q_len, hq, d]
    if q.stride(-1) != 1:
        q = q.contiguous()
    k = key.transpose(1, 2)  # [b, kv_len, hkv, d] view of the cache
    v = value.transpose(1, 2)
    seq_lens = torch.full((b,), kv_len, dtype=torch.int32, device=query.device)
    out = decode(q, k, v, seq_lens, None, sm_scale=scaling, seq_lens_host=[kv_len] * b)  # no sync per layer
    return out, None


def register() -> None:
    """Register ``"attnplan"`` with transformers' attention (and attention-mask) interfaces.

    Raises:
        ImportError: transformers is not installed (``pip install 'attnplan[hf]'``).
    """
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError(f"attnplan.hf.register() needs transformers >= 4.56: pip install 'attnplan[hf]' ({e})") from e

    AttentionInterface.register(NAME, attnplan_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register(NAME, sdpa_mask)
    except ImportError:  # older transformers without a mask interface
        pass
