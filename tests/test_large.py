"""Large caches: offsets past 2^31 elements (int32 page offsets would wrap). GPU only."""

import pytest
import torch

import attnplan
from attnplan import reference
from attnplan.testing import assert_close_to_reference

from conftest import HAS_CUDA, kernel_backends

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", kernel_backends("cuda") if HAS_CUDA else ["triton"])
def test_page_offsets_beyond_int32(backend):
    """page 16, 8 KV heads, head_dim 128, 140,000 pages (2.29e9 elements per tensor): sequences whose
    block tables point past page 131,072 read the right data."""
    num_pages, ps, hkv, d = 140_000, 16, 8, 128
    assert num_pages * ps * hkv * d > 2**31
    g = torch.Generator(device="cuda").manual_seed(3)
    k = torch.empty(num_pages, ps, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.empty_like(k)
    lens = [1000, 37, 4096]
    pages_per_seq = 256
    bt = torch.zeros(3, pages_per_seq, dtype=torch.int32, device="cuda")
    for b, n in enumerate(lens):  # pages at the very end of the cache, past 2^31 / (16 * 8 * 128)
        used = -(-n // ps)
        bt[b, :used] = torch.arange(num_pages - (b + 1) * pages_per_seq, num_pages - (b + 1) * pages_per_seq + used,
                                    dtype=torch.int32, device="cuda")
    for b in range(3):  # fill only the pages in use (random), the rest stays arbitrary
        rows = bt[b].long()
        k[rows] = torch.randn(pages_per_seq, ps, hkv, d, generator=g, device="cuda").bfloat16()
        v[rows] = torch.randn(pages_per_seq, ps, hkv, d, generator=g, device="cuda").bfloat16()
    q = torch.randn(3, 1, 32, d, generator=g, device="cuda").bfloat16()
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    assert int(bt.max()) > 131_072
    for splits in (1, 4):
        out = attnplan.decode(q, k, v, sl, bt, backend=backend, num_splits=splits)
        ref, _ = reference.attention(q, k, v, sl, bt)
        assert_close_to_reference(out, ref, torch.bfloat16)
    del k, v
    torch.cuda.empty_cache()
