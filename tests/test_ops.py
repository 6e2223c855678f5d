"""The torch.library op: eager, fake tensors, torch.compile(fullgraph=True), its plans and device tables, a first
call under capture, transformers' StaticCache views, CUDA graphs (GPU: by hand and torch.compile's reduce-overhead)."""

import pytest
import torch

import attnplan
import attnplan.ops  # noqa: F401  (registers torch.ops.attnplan.decode)
from attnplan import reference
from attnplan.backends import get_backend
from attnplan.testing import assert_close_to_reference, make_inputs

from conftest import HAS_CUDA, kernel_backends

DEVICE = "cuda" if HAS_CUDA else "cpu"
BACKEND = (kernel_backends(DEVICE) or ["reference"])[0]


@pytest.fixture(autouse=True)
def _fresh_op_plans():
    """Every test starts and ends with no op plans (a test's config must not leak into another's plans)."""
    attnplan.ops.clear_op_plans()
    yield
    attnplan.ops.clear_op_plans()


def _use_config(tmp_path, monkeypatch, text: str) -> None:
    """Plan with ``text`` over the default config for the rest of the test (the default context rebuilt)."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text)
    monkeypatch.setenv("ATTNPLAN_CONFIG", str(cfg))
    monkeypatch.setattr(attnplan.api, "_DEFAULT", None)


def test_op_eager_matches_reference(gen):
    x = make_inputs(2, 8, 2, 32, [20, 0], page_size=4, dtype=torch.float16, device=DEVICE, generator=gen)
    out = torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, None, BACKEND)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out, ref, torch.float16)
    x.seq_lens[0] = 11  # a later step with other lengths reuses the capacity plan
    out = torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, None, BACKEND)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    assert_close_to_reference(out, ref, torch.float16)


def test_op_resolves_lazily_negated_inputs(gen):
    """torch's dispatcher materializes a lazily negated view before a custom op sees it, so the op computes with the
    negation (DecodeWrapper.run(), which would read the memory as it is, refuses such a view instead), also on the
    call after a plan-cache hit of the same signature."""
    x = make_inputs(2, 8, 2, 32, [20, 7], page_size=4, dtype=torch.float16, device=DEVICE, generator=gen)
    torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, None, BACKEND)
    for args in ((torch._neg_view(x.q), x.k_cache, x.v_cache), (x.q, x.k_cache, torch._neg_view(x.v_cache))):
        out = torch.ops.attnplan.decode(*args, x.seq_lens, x.block_table, None, BACKEND)
        ref, _ = reference.attention(*(a.resolve_neg() for a in args), x.seq_lens, x.block_table, x.sm_scale)
        assert_close_to_reference(out, ref, torch.float16)


def test_op_opcheck(gen):
    x = make_inputs(1, 4, 2, 16, [9], dtype=torch.float32, device=DEVICE, generator=gen)
    torch.library.opcheck(torch.ops.attnplan.decode.default,
                          (x.q, x.k_cache, x.v_cache, x.seq_lens, None, None, BACKEND),
                          test_utils=("test_schema", "test_faketensor"))


def test_op_compiles_fullgraph(gen):
    x = make_inputs(2, 8, 2, 32, [13, 30], dtype=torch.float16, device=DEVICE, generator=gen)
    proj = torch.nn.Linear(32, 32, dtype=torch.float16, device=DEVICE)

    def layer(q, k, v, lens):
        o = torch.ops.attnplan.decode(q, k, v, lens, None, None, BACKEND)
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
        return torch.ops.attnplan.decode(q, k, v, lens, bt, None, BACKEND) + 1

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
    torch.ops.attnplan.decode(a["q"], a["k"], a["v"], a["lens"], a["bt"], None, BACKEND)
    change(a)
    with pytest.raises(exc, match=needle):
        torch.ops.attnplan.decode(a["q"], a["k"], a["v"], a["lens"], a["bt"], None, BACKEND)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_op_refuses_a_non_finite_scale(bad):
    x = make_inputs(1, 4, 2, 16, [9], dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="sm_scale must be finite"):
        torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, None, bad, BACKEND)


@pytest.mark.parametrize("which", ["k_cache", "seq_lens"])
def test_op_refuses_a_tensor_on_the_meta_device_among_real_ones(which, gen):
    """A meta tensor among real ones sends the call to the fake kernel: it refuses the mix (as attnplan.decode
    does) instead of returning uninitialized memory; all on meta, it gives the output's shape and dtype."""
    x = make_inputs(2, 4, 2, 16, [17, 33], dtype=torch.float32, device=DEVICE, generator=gen)
    a = dict(q=x.q, k_cache=x.k_cache, v_cache=x.v_cache, seq_lens=x.seq_lens)
    mixed = {**a, which: a[which].to("meta")}
    with pytest.raises(ValueError, match=f"{which} is on meta"):
        torch.ops.attnplan.decode(*mixed.values(), None, None, BACKEND)
    out = torch.ops.attnplan.decode(*(t.to("meta") for t in a.values()), None, None, BACKEND)
    assert out.device.type == "meta" and out.shape == x.q.shape and out.dtype == x.q.dtype


@pytest.mark.parametrize("which", ["q", "k_cache", "v_cache"])
def test_op_refuses_an_input_that_requires_grad(which, gen):
    """As attnplan.decode: under grad mode an input that requires grad is refused at the call (attnplan computes no
    gradients), not at backward(); under no_grad the same call is served."""
    x = make_inputs(1, 4, 2, 16, [9], dtype=torch.float32, device=DEVICE, generator=gen)
    a = dict(q=x.q, k_cache=x.k_cache, v_cache=x.v_cache)
    a[which] = a[which].detach().requires_grad_()
    with pytest.raises(ValueError, match=f"{which} requires grad"):
        torch.ops.attnplan.decode(*a.values(), x.seq_lens, None, None, BACKEND)
    with torch.no_grad():
        out = torch.ops.attnplan.decode(*a.values(), x.seq_lens, None, None, BACKEND)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale)
    assert not out.requires_grad
    assert_close_to_reference(out, ref, torch.float32)


@pytest.mark.parametrize("scale", [0.0, -0.5, -0.0, 0.3, None])
def test_op_honours_every_finite_scale(scale, gen):
    """``sm_scale`` is ``float?``: every finite value is the scale, 0 and negative ones included (``<= 0`` once meant
    the default: 0.0 and -0.5 were served at 1/sqrt(head_dim), max error 0.9 against the reference), ``None`` the
    default; the scale and the backend may be left out."""
    x = make_inputs(2, 8, 2, 32, [20, 7], page_size=4, dtype=torch.float32, device=DEVICE, generator=gen)
    x.q.mul_(4)  # scores far from 0, so a wrong scale shows
    for _ in range(2):  # planned, then the cached plan
        out = torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, scale, BACKEND)
        ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, scale)
        assert_close_to_reference(out, ref, torch.float32, what=f"sm_scale {scale}")
    if scale is None:
        out = torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
        assert_close_to_reference(out, ref, torch.float32, what="no scale, no backend")


def test_op_plan_key_is_the_scale_the_kernels_use(gen):
    """``None`` shares a plan with ``1/sqrt(head_dim)`` given explicitly (the key holds the resolved scale); 0.0 and
    a negative scale get plans of their own."""
    from attnplan.problem import default_sm_scale

    x = make_inputs(1, 8, 2, 32, [20], dtype=torch.float32, device=DEVICE, generator=gen)
    for scale in (None, default_sm_scale(32), 0.0, -0.25):
        torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, None, scale, BACKEND)
    assert sorted(k[1] for k in attnplan.ops._PLANS) == [-0.25, 0.0, default_sm_scale(32)]
    assert sorted(e[2] for e in attnplan.ops._PLANS.values()) == [-0.25, 0.0, default_sm_scale(32)]


@pytest.mark.parametrize("scale", [None, -0.5, 0.0])
def test_op_opcheck_and_compile_with_optional_scale(scale, gen):
    """The ``float?`` scale passes opcheck's schema and fake-tensor checks and traces with fullgraph=True; the compiled
    result equals the reference at that scale."""
    x = make_inputs(1, 4, 2, 16, [9], dtype=torch.float32, device=DEVICE, generator=gen)
    torch.library.opcheck(torch.ops.attnplan.decode.default, (x.q, x.k_cache, x.v_cache, x.seq_lens, None, scale,
                                                              BACKEND), test_utils=("test_schema", "test_faketensor"))
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, lens: torch.ops.attnplan.decode(q, k, v, lens, None, scale, BACKEND) * 2,
                      fullgraph=True, backend="aot_eager" if not HAS_CUDA else "inductor")
    out = f(x.q, x.k_cache, x.v_cache, x.seq_lens)
    torch._dynamo.reset()
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, None, scale)
    assert_close_to_reference(out / 2, ref, torch.float32)


def test_op_keeps_the_targets_with_the_plan_and_allocates_the_rest_per_call(gen, monkeypatch):
    """The schedule's targets table goes to the device once, with the plan (a host-to-device copy under capture is
    illegal); the ragged partial states and the (indptr, units) table are fresh torch allocations of every call
    (torch.compile's CUDA graphs own them), shaped for the plan; the fused merge's counters are the stream's own,
    zero at rest."""
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
        out = torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, None, BACKEND)
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
    if w1.counters is not None:  # the stream's zero-at-rest counters: no memset per call (or per replay)
        assert w1.counters is w2.counters and w1.counters.numel() >= 3 * 2 and not w1.counters.any()


@pytest.mark.parametrize("merge", ["separate", "fused"])
def test_op_counters_stay_zero_at_rest_and_results_stay_right(merge, gen, tmp_path, monkeypatch):
    """Forcing each merge: the fused merge's shared counters are zero after every call (the last program of each
    (sequence, KV head) resets its counter), so the next call on the stream starts clean; a second signature on
    the same stream shares them; every result equals the reference."""
    if merge not in get_backend(BACKEND).merge_strategies:
        pytest.skip(f"{BACKEND} has no {merge} merge")
    _use_config(tmp_path, monkeypatch, f"split:\n  merge: {merge}\n  num_splits: 4\n")
    for hq, lens in ((8, [64, 40]), (8, [3, 64]), (4, [50, 0])):
        x = make_inputs(2, hq, 2, 32, lens, dtype=torch.float16, device=DEVICE, capacity=64, generator=gen)
        out = torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, None, None, BACKEND)
        ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale)
        assert_close_to_reference(out, ref, torch.float16)
        (_, plan, _, _), = [e for k, e in attnplan.ops._PLANS.items() if k[0][0][1] == x.q.shape]
        assert plan.merge == merge and not plan.single_pass
    counters = [t for (dev, _), t in attnplan.ops._COUNTERS.items() if dev.type == torch.device(DEVICE).type]
    if merge == "fused":
        assert len(counters) == 1 and not counters[0].any()


def test_op_first_call_under_capture_raises_plan_not_ready(gen, monkeypatch):
    """A new signature during a (here simulated) CUDA-graph capture is refused with PlanNotReadyError, never
    planned inside the capture; a signature planned before the capture runs."""
    attnplan.ops.clear_op_plans()
    x = make_inputs(1, 8, 2, 32, [20], dtype=torch.float16, device=DEVICE, capacity=32, generator=gen)
    torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, None, None, BACKEND)  # planned (warm-up)
    monkeypatch.setattr(attnplan.ops, "_capturing", lambda q: True)
    out = torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, None, None, BACKEND)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale)
    assert_close_to_reference(out, ref, torch.float16)
    q2 = torch.randn(2, 1, 8, 32, dtype=torch.float16, generator=gen).to(DEVICE)  # another batch: a new signature
    k2, v2 = (torch.randn(2, 32, 2, 32, dtype=torch.float16, generator=gen).to(DEVICE) for _ in range(2))
    lens2 = torch.tensor([5, 32], dtype=torch.int32, device=DEVICE)
    with pytest.raises(attnplan.PlanNotReadyError, match="new input signature during CUDA graph capture"):
        torch.ops.attnplan.decode(q2, k2, v2, lens2, None, None, BACKEND)
    assert len(attnplan.ops._PLANS) == 1


def test_op_plans_are_an_lru_and_evicted_plans_keep_their_device_tables(gen, monkeypatch):
    """The op keeps at most MAX_OP_PLANS signatures (least recently used out); the targets tables stay alive (a
    captured graph may read them) and are shared by plans with the same table; a re-used signature re-plans."""
    monkeypatch.setattr(attnplan.ops, "MAX_OP_PLANS", 2)
    attnplan.ops.clear_op_plans()
    xs = [make_inputs(1, 8, 2, 32, [n], dtype=torch.float16, device=DEVICE, capacity=n, generator=gen)
          for n in (16, 24, 40)]
    for x in (xs[0], xs[1], xs[0], xs[2]):  # xs[1] is the least recently used when xs[2] comes
        torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, None, None, BACKEND)
    shapes = [k[0][1][1] for k in attnplan.ops._PLANS]  # the k_cache shapes kept, oldest first
    assert shapes == [xs[0].k_cache.shape, xs[2].k_cache.shape]
    tables = {e[3].data_ptr() for e in attnplan.ops._PLANS.values()}
    assert all(t.data_ptr() in {v.data_ptr() for v in attnplan.ops._TARGETS.values()} for t in
               (e[3] for e in attnplan.ops._PLANS.values())) and len(tables) <= 2
    out = torch.ops.attnplan.decode(xs[1].q, xs[1].k_cache, xs[1].v_cache, xs[1].seq_lens, None, None, BACKEND)
    ref, _ = reference.attention(xs[1].q, xs[1].k_cache, xs[1].v_cache, xs[1].seq_lens, None, xs[1].sm_scale)
    assert_close_to_reference(out, ref, torch.float16)


def _hf_layout(batch, hq, hkv, d, cap, dtype, device, gen):
    """q and transformers' StaticCache layout: k/v buffers ``[batch, hkv, cap, head_dim]`` read as the transposed
    views ``[batch, cap, hkv, head_dim]``, and ``seq_lens`` on the device."""
    q = torch.randn(batch, hq, 1, d, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)
    kb, vb = (torch.randn(batch, hkv, cap, d, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    lens = torch.zeros(batch, dtype=torch.int32, device=device)
    return q, kb.transpose(1, 2), vb.transpose(1, 2), lens


def test_op_on_transformers_static_cache_views(gen):
    """The op on a StaticCache's transposed views (head stride = capacity x head_dim) at several live lengths up to
    the capacity, one plan for all of them."""
    attnplan.ops.clear_op_plans()
    q, k, v, lens = _hf_layout(1, 8, 2, 32, 80, torch.float16, DEVICE, gen)
    for n in (80, 1, 33, 0, 64):
        lens.fill_(n)
        out = torch.ops.attnplan.decode(q, k, v, lens, None, None, BACKEND)
        ref, _ = reference.attention(q, k, v, lens, None, 32 ** -0.5)
        assert_close_to_reference(out, ref, torch.float16, what=f"length {n}")
    assert len(attnplan.ops._PLANS) == 1


@pytest.mark.gpu
def test_op_first_call_under_real_capture_raises_plan_not_ready(gen):
    attnplan.ops.clear_op_plans()
    q, k, v, lens = _hf_layout(1, 32, 8, 64, 4096, torch.bfloat16, "cuda", gen)
    lens.fill_(1000)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(attnplan.PlanNotReadyError, match="during CUDA graph capture"):
        with torch.cuda.graph(g):
            torch.ops.attnplan.decode(q, k, v, lens, None, None, BACKEND)
    assert not attnplan.ops._PLANS
    out = torch.ops.attnplan.decode(q, k, v, lens, None, None, BACKEND)  # eager after the failed capture: plans
    ref, _ = reference.attention(q, k, v, lens, None, 64 ** -0.5)
    assert_close_to_reference(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["by hand on the warm-up stream", "by hand on another stream", "reduce-overhead"])
def test_op_replays_with_changing_lengths_on_static_cache_views(how, gen):
    """Captured once (by hand, on the stream that planned it, which finds that stream's counters, or on another,
    which zeroes its own per call; or by torch.compile's CUDA-graph trees with their pool checks on), replayed while
    the lengths change in place: every replay equals the reference at the new lengths."""
    cap = 32768
    q, k, v, lens = _hf_layout(1, 32, 8, 64, cap, torch.bfloat16, "cuda", gen)
    lens.fill_(1024)

    def step(q, k, v, lens):
        return torch.ops.attnplan.decode(q, k, v, lens, None, None, BACKEND) * 2

    if how.startswith("by hand"):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(q, k, v, lens)  # plans (warm-up)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s if how.endswith("warm-up stream") else None):
            static_out = step(q, k, v, lens)
        run = lambda: (g.replay(), static_out)[1]  # noqa: E731
    else:
        torch._dynamo.reset()
        with torch._inductor.config.patch({"triton.slow_path_cudagraph_asserts": True}):
            f = torch.compile(step, fullgraph=True, mode="reduce-overhead")
            for _ in range(3):  # warm-up, record, replay
                f(q, k, v, lens)
        run = lambda: f(q, k, v, lens)  # noqa: E731
    for n in (1024, cap, 1, 8191, 0, 20000):
        lens.fill_(n)
        out = run().clone()
        ref, _ = reference.attention(q, k, v, lens, None, 64 ** -0.5)
        assert_close_to_reference(out / 2, ref, torch.bfloat16, what=f"{how} length {n}")
    assert len(attnplan.ops._PLANS) == 1
    torch._dynamo.reset()


@pytest.mark.gpu
def test_op_long_lived_tables_are_outside_graph_pools(gen, tmp_path, monkeypatch):
    """The targets table and the fused merge's counters made on a call whose allocations are routed to a private
    memory pool (as torch.compile's warm-up run is) lie outside that pool."""
    _use_config(tmp_path, monkeypatch, "split:\n  merge: fused\n  num_splits: 8\n")
    q, k, v, lens = _hf_layout(1, 32, 8, 64, 8192, torch.bfloat16, "cuda", gen)
    lens.fill_(5000)
    pool = torch.cuda.MemPool()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), torch.cuda.use_mem_pool(pool):
        out = torch.ops.attnplan.decode(q, k, v, lens, None, None, BACKEND)
        counters = attnplan.ops._COUNTERS[(q.device, s.cuda_stream)]
    torch.cuda.synchronize()
    (_, plan, _, targets), = attnplan.ops._PLANS.values()
    assert plan.merge == "fused"
    spans = [(seg["address"], seg["address"] + seg["total_size"]) for seg in pool.snapshot()]
    for name, t in (("targets", targets), ("counters", counters)):
        assert not any(a <= t.data_ptr() < b for a, b in spans), f"{name} lies in the private pool"
    ref, _ = reference.attention(q, k, v, lens, None, 64 ** -0.5)
    assert_close_to_reference(out, ref, torch.bfloat16)


def test_op_temporaries_do_not_outlive_the_call(gen, monkeypatch):
    """The per-call partial states and (indptr, units) table are freed when the call returns: no backend cache keeps
    them (kept, they leak in torch.compile's CUDA-graph pool, whose pool checks raise on live untracked tensors)."""
    import gc
    import weakref

    be = get_backend(BACKEND)
    refs = []
    real = be.run

    def spy(plan, inputs, ws, out, lse=None):
        refs.extend(weakref.ref(t) for t in (ws.state.o if ws.state is not None else None, ws.meta) if t is not None)
        return real(plan, inputs, ws, out, lse)

    monkeypatch.setattr(be, "run", spy)
    x = make_inputs(2, 8, 2, 32, [60, 7], dtype=torch.float16, device=DEVICE, capacity=64, generator=gen)
    for _ in range(2):
        out = torch.ops.attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, None, None, BACKEND)
    gc.collect()
    assert refs and all(r() is None for r in refs), "a per-call temporary is still referenced after the call"
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale)
    assert_close_to_reference(out, ref, torch.float16)


@pytest.mark.parametrize("shape,msg", [
    ((), r"q must be 4-D"), ((1, 1, 4, 0), r"head_dim \(q.shape\[3\]\) must be >= 1"),
])
def test_op_default_scale_of_a_q_without_head_dim_is_a_named_error(shape, msg):
    """``sm_scale=None`` with a 0-d q or head_dim 0: the planner's ValueError naming q, as with a scale given (the
    op's plan key took ``1/sqrt(q.shape[-1])`` first: IndexError, ZeroDivisionError)."""
    import attnplan.ops  # noqa: F401

    q = torch.zeros(shape, dtype=torch.float16)
    k = torch.zeros(1, 8, 2, max(shape[-1], 1) if shape else 16, dtype=torch.float16)
    for scale in (None, 1.0):
        with pytest.raises(ValueError, match=msg):
            torch.ops.attnplan.decode(q, k, k, torch.tensor([8], dtype=torch.int32), None, scale, "reference")
