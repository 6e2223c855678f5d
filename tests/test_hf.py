"""transformers integration: greedy generation with attnplan equals transformers' own attention."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnplan.hf  # noqa: E402

from conftest import HAS_CUDA  # noqa: E402


def _model(cfg_kwargs, device, dtype, attn):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**cfg_kwargs)
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _generate(model, ids, n):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True,
                             pad_token_id=0, eos_token_id=None)
    return out[:, ids.shape[1]:]


def _compare(cfg_kwargs, prompt_len, device, dtype, n_new=32):
    attnplan.hf.register()
    ids = torch.randint(1, cfg_kwargs["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(1)).to(device)
    ref = _generate(_model(cfg_kwargs, device, dtype, "eager"), ids, n_new)
    before = dict(attnplan.hf.STATS)
    got = _generate(_model(cfg_kwargs, device, dtype, attnplan.hf.NAME), ids, n_new)
    served = attnplan.hf.STATS["attnplan"] - before["attnplan"]
    assert served >= (n_new - 1) * cfg_kwargs["num_hidden_layers"], attnplan.hf.STATS
    assert torch.equal(got, ref), (got, ref)


def test_tiny_llama_generates_identical_tokens():
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    _compare(cfg, prompt_len=9, device="cuda" if HAS_CUDA else "cpu", dtype=torch.float32)


@pytest.mark.gpu
def test_larger_llama_long_prompt_gpu():
    cfg = dict(vocab_size=1000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=16,
               num_key_value_heads=4, head_dim=64, max_position_embeddings=8192)
    _compare(cfg, prompt_len=3000, device="cuda", dtype=torch.float32)


def test_register_without_transformers_names_the_extra(monkeypatch):
    """``register()`` with transformers missing: an ImportError that says which extra to install."""
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes ``from transformers import ...`` fail
    with pytest.raises(ImportError, match=r"pip install 'attnplan\[hf\]'"):
        attnplan.hf.register()
