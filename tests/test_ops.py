"""The torch.library op: eager, fake tensors, torch.compile(fullgraph=True), CUDA graphs (GPU)."""

import pytest
import torch

import attnplan
import attnplan.ops  # noqa: F401  (registers torch.ops.attnplan.decode)
from attnplan import reference
from attnplan.testing import assert_close_to_reference, make_inputs

from conftest import HAS_CUDA, kernel_backends

DEVICE = "cuda" if HAS_CUDA else "cpu"
BACKEND = (kernel_backends(DEVICE) or ["reference"])[0]


def test_op_eager_matches_reference(gen):
    x = make_inputs(2, 8, 2, 32, [20, 0], page_size=4, dtype=torch.float16, device=DEVICE, generator=gen)
    out = torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, 0.0, BACKEND)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out, ref, torch.float16)
    x.seq_lens[0] = 11  # a later step with other lengths reuses the capacity plan
    out = torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, 0.0, BACKEND)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out, ref, torch.float16)


def test_op_opcheck(gen):
    x = make_inputs(1, 4, 2, 16, [9], dtype=torch.float32, device=DEVICE, generator=gen)
    torch.library.opcheck(torch.ops.attnplan.decode.default,
                          (x.q, x.k_cache, x.v_cache, x.seq_lens, None, 0.0, BACKEND),
                          test_utils=("test_schema", "test_faketensor"))


def test_op_compiles_fullgraph(gen):
    x = make_inputs(2, 8, 2, 32, [13, 30], dtype=torch.float16, device=DEVICE, generator=gen)
    proj = torch.nn.Linear(32, 32, dtype=torch.float16, device=DEVICE)

    def layer(q, k, v, lens):
        o = torch.ops.attnplan.decode(q, k, v, lens, None, 0.0, BACKEND)
        return proj(o) * 2

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager" if not HAS_CUDA else "inductor")
    got = compiled(x.q, x.k_cache, x.v_cache, x.seq_lens)
    want = layer(x.q, x.k_cache, x.v_cache, x.seq_lens)
    assert torch.allclose(got.float(), want.float(), atol=1e-2)


@pytest.mark.gpu
def test_op_under_torch_compile_cudagraphs(gen):
    x = make_inputs(2, 32, 8, 128, [1000, 64], page_size=16, dtype=torch.bfloat16, device="cuda", capacity=4096,
                    generator=gen)

    def step(q, k, v, lens, bt):
        return torch.ops.attnplan.decode(q, k, v, lens, bt, 0.0, BACKEND) + 1

    f = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    for lens in ([1000, 64], [4096, 0], [7, 3000], [5, 5]):
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out = f(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table).clone()
        ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
        assert_close_to_reference(out - 1, ref, torch.bfloat16)


@pytest.mark.parametrize("change,exc,needle", [
    (lambda x: x.update(v=x["v"].to(torch.bfloat16)), TypeError, "v_cache.dtype"),
    (lambda x: x.update(v=x["v"][:-2]), ValueError, "v_cache shape"),
    (lambda x: x.update(k=torch.stack([x["k"], x["k"]], -1)[..., 0]), ValueError, "k_cache must have unit stride"),
    (lambda x: x.update(lens=x["lens"].long()), TypeError, "seq_lens.dtype"),
    (lambda x: x.update(bt=x["bt"].long()), TypeError, "block_table.dtype"),
    (lambda x: x.update(bt=x["bt"].t().contiguous().t()), ValueError, "block_table must have unit stride"),
])
def test_op_validates_every_new_signature(change, exc, needle):
    """After a valid first call, a call whose V, seq_lens or block table differs is validated anew (the plan key
    holds every input's shape, strides, dtype, device and alignment): a bf16 V returned inf and a V with fewer
    pages read out of bounds when the key left them out."""
    attnplan.ops.clear_op_plans()
    x = make_inputs(2, 8, 2, 32, [20, 9], page_size=4, dtype=torch.float16, device=DEVICE)
    a = dict(q=x.q, k=x.k_cache, v=x.v_cache, lens=x.seq_lens, bt=x.block_table)
    torch.ops.attnplan.decode(a["q"], a["k"], a["v"], a["lens"], a["bt"], 0.0, BACKEND)
    change(a)
    with pytest.raises(exc, match=needle):
        torch.ops.attnplan.decode(a["q"], a["k"], a["v"], a["lens"], a["bt"], 0.0, BACKEND)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_op_refuses_a_non_finite_scale(bad):
    x = make_inputs(1, 4, 2, 16, [9], dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="sm_scale must be finite"):
        torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, None, bad, BACKEND)


def test_op_keeps_the_targets_with_the_plan_and_allocates_the_rest_per_call(gen, monkeypatch):
    """The schedule's targets table goes to the device once, with the plan (a host-to-device copy under capture is
    illegal); the ragged partial states and the (indptr, units) table are fresh torch allocations of every call
    (torch.compile's CUDA graphs own them), shaped for the plan."""
    from attnplan.backends import get_backend

    attnplan.ops.clear_op_plans()
    be = get_backend(BACKEND)
    seen = []
    real = be.run
    monkeypatch.setattr(be, "run", lambda plan, inputs, ws, out, lse=None: (seen.append((plan, ws)),
                                                                             real(plan, inputs, ws, out, lse))[1])
    x = make_inputs(3, 8, 2, 32, [40, 3, 0], page_size=4, dtype=torch.float16, device=DEVICE, capacity=64,
                    generator=gen)
    for lens in ([40, 3, 0], [64, 64, 1]):
        x.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out = torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, 0.0, BACKEND)
        ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
        assert_close_to_reference(out, ref, torch.float16)
    (p1, w1), (p2, w2) = seen
    assert p1 is p2 and p1.capacity_mode and not p1.single_pass  # one capacity plan, with partial states
    assert w1.targets is w2.targets and w1.targets.tolist() == list(p1.schedule.targets)
    assert w1.targets_host == p1.schedule.targets and w1.targets.dtype == torch.int32
    assert w1.state is not w2.state and w1.state.o.shape == (1, 1, 8, p1.schedule.max_units, 32)
    assert w1.state.o.dtype == w1.state.lse.dtype == torch.float32
    assert (w1.meta is None) == (p1.merge != "separate") and (w1.counters is None) == (p1.merge != "fused")
    if w1.meta is not None:
        assert w1.meta.numel() == 2 * 3 and w1.meta is not w2.meta
