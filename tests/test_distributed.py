"""Context-parallel decode with 2 gloo processes on the CPU: equals single-device decode."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from conftest import HAS_CUDA, run_spawned


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, page, backend, lens, seed, q):
    import torch.distributed as dist

    from attnplan import reference
    from attnplan.distributed import ContextParallelDecode
    from attnplan.testing import make_inputs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(seed)
        x = make_inputs(len(lens), 8, 2, 32, lens, page_size=page, dtype=torch.float16, generator=g)
        ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
        # shard: rank r takes positions [r*L/world, (r+1)*L/world) of each sequence (uneven, 0 allowed)
        shard_k, shard_v, shard_lens = [], [], []
        for b, n in enumerate(lens):
            lo, hi = n * rank // world, n * (rank + 1) // world
            k, v = reference.gather_kv(x.k_cache, x.v_cache, b, n, x.block_table)
            shard_k.append(k[lo:hi])
            shard_v.append(v[lo:hi])
            shard_lens.append(hi - lo)
        cap = max(max(shard_lens), 1)
        kc = torch.zeros(len(lens), cap, 2, 32, dtype=torch.float16)
        vc = torch.zeros_like(kc)
        for b, (k, v) in enumerate(zip(shard_k, shard_v)):
            kc[b, : len(k)] = k.half()
            vc[b, : len(v)] = v.half()
        cp = ContextParallelDecode(backend=backend)
        sl = torch.tensor(shard_lens, dtype=torch.int32)
        cp.plan(x.q, kc, vc, sl, num_splits=2)
        out = cp.run(x.q, kc, vc, sl)
        err = float((out.double() - ref).abs().max())
        q.put((rank, err, bool(torch.isnan(out).any())))
    finally:
        dist.destroy_process_group()


# the gloo exchange is the same for every backend: the triton param runs it with a kernel backend; the reference
# backend's context-parallel merge runs in test_context_parallel_merge_in_one_process (full tier: reference here)
@pytest.mark.parametrize("backend", [pytest.param("reference", marks=pytest.mark.full), "triton"])
def test_context_parallel_gloo_two_ranks(backend):
    if backend == "triton" and not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton on CPU needs TRITON_INTERPRET=1")
    if HAS_CUDA and backend == "triton":
        pytest.skip("the gloo test runs CPU tensors; the GPU path is benchmarks/bench_cp.py")
    port = _free_port()
    lens = [37, 0, 5, 64]
    res = run_spawned(_worker, [(r, 2, port, None, backend, lens, 1234) for r in range(2)], timeout=180)
    for rank, err, nan in res:
        assert not nan and err < 4e-3, (rank, err)


def _mismatch_worker(rank, world, port, q_out):
    import torch.distributed as dist

    from attnplan.api import PlanNotReadyError
    from attnplan.distributed import ContextParallelDecode

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    seen = []
    try:
        cp = ContextParallelDecode(backend="reference")
        k = torch.zeros(3, 8, 2, 16, dtype=torch.float16)
        lens = torch.tensor([8, 8, 8], dtype=torch.int32)
        q = torch.zeros(3, 1, 4, 16, dtype=torch.float16)
        try:
            cp.run(q, k, k, lens)
        except PlanNotReadyError as e:
            seen.append(("run before plan", str(e)))
        # rank 1 plans a batch of 2 (its shard of the first two sequences), q in another dtype, another score scale,
        # a length past its shard's capacity (its own plan() raises): every rank must refuse, none abort or wait
        same = (q, k, lens, None)
        cases = ((same, (q, k, lens, 0.25)),  # None is 1/sqrt(head_dim) = 0.25: the same scale, planned
                 (same, (q[:2], k[:2], lens[:2], None)), (same, (q.bfloat16(), k.bfloat16(), lens, None)),
                 (same, (q, k, lens, 1.0)), (same, (q, k, torch.tensor([8, 9, 8], dtype=torch.int32), None)))
        for on_rank0, on_rank1 in cases:
            qq, kk, ll, sc = on_rank0 if rank == 0 else on_rank1
            try:
                cp.plan(qq, kk, kk, ll, sm_scale=sc)
                seen.append(("planned", ""))
            except ValueError as e:
                seen.append(("mismatch", str(e)))
        try:
            cp.run(q, k, k, lens)  # the failed plan left none
        except PlanNotReadyError as e:
            seen.append(("run after a failed plan", str(e)))
        q_out.put((rank, seen))
    finally:
        dist.destroy_process_group()


def test_context_parallel_ranks_must_plan_the_same_q():
    """A rank whose q differs in shape or dtype from another's, or whose score scale does: every rank's plan() raises
    a ValueError naming each rank's (before, the shape mismatch aborted one process inside gloo, the dtype mismatch
    exchanged bytes read in the wrong dtype, and other scales merged states of other scores, giving wrong or
    different outputs; ``None`` and an explicit 1/sqrt(head_dim) agree). A plan() that raises on one rank raises on
    every rank (before, the others waited in the agreement's all-gather until the group's timeout). run() before plan(), or after a plan() that raised, raises
    PlanNotReadyError."""
    port = _free_port()
    res = run_spawned(_mismatch_worker, [(r, 2, port) for r in range(2)], timeout=120)
    for rank, seen in res:
        kinds = [k for k, _ in seen]
        assert kinds == ["run before plan", "planned"] + ["mismatch"] * 4 + ["run after a failed plan"], (rank, seen)
        assert "rank 0: (3, 1, 4, 16) torch.float16, rank 1: (2, 1, 4, 16) torch.float16" in seen[2][1]
        assert "rank 1: (3, 1, 4, 16) torch.bfloat16" in seen[3][1]
        assert "same sm_scale" in seen[4][1] and "rank 0: 0.25, rank 1: 1.0" in seen[4][1]
        assert ("plan() raised on rank(s) [1]" if rank == 0 else "seq_lens") in seen[5][1], seen[5]


def test_context_parallel_refuses_q_len_above_one(monkeypatch):
    import attnplan.distributed as d

    monkeypatch.setattr(d.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(d.dist, "get_backend", lambda group=None: "gloo")
    # the agreement's all-gather, as two ranks refusing the same q would make it
    monkeypatch.setattr(d.dist, "all_gather_into_tensor", lambda out, mine, group=None: out.copy_(mine.repeat(2)))
    cp = d.ContextParallelDecode(backend="reference")
    q = torch.zeros(1, 2, 4, 16, dtype=torch.float16)
    k = torch.zeros(1, 8, 2, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="q_len 1"):
        cp.plan(q, k, k, torch.tensor([8], dtype=torch.int32))


def test_bench_cp_dry_run_two_ranks(tmp_path):
    """benchmarks/bench_cp.py end to end with 2 gloo ranks and two cache sizes: it must finish (a
    collective or barrier that only one rank reaches hangs it; the timeout turns that into a failure)
    and its context-parallel output must match single-device decode."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "cp.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cp.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, str(script), "--cpu", "--world", "2", "--kv", "64,96", "--iters", "2",
                    "--backend", "reference", "--out", str(out)], check=True, timeout=240, env=env,
                   capture_output=True)
    from attnplan.testing import tolerance

    results = json.loads(out.read_text())["results"]
    assert [r["total_kv"] for r in results] == [64, 96]
    atol, _ = tolerance(torch.float16)  # the dry run's dtype; outputs are O(1)
    for r in results:
        assert r["max_abs_diff_vs_single"] <= atol
        assert r["step_us"] > 0 and r["exchange_us"] > 0 and r["comm_kernel_us_per_rank"] == [None, None]


def _shards(x, lens, world, rank):
    """Rank ``rank``'s contiguous shard of every sequence (uneven, 0 allowed) as a contiguous cache."""
    from attnplan import reference

    ks, vs, n_r = [], [], []
    for b, n in enumerate(lens):
        lo, hi = n * rank // world, n * (rank + 1) // world
        k, v = reference.gather_kv(x.k_cache, x.v_cache, b, n, x.block_table)
        ks.append(k[lo:hi])
        vs.append(v[lo:hi])
        n_r.append(hi - lo)
    hkv, d = x.k_cache.shape[2], x.k_cache.shape[3]
    kc = torch.zeros(len(lens), max(max(n_r), 1), hkv, d, dtype=x.k_cache.dtype)
    vc = torch.zeros_like(kc)
    for b, (k, v) in enumerate(zip(ks, vs)):
        kc[b, : len(k)] = k.to(kc.dtype)
        vc[b, : len(v)] = v.to(vc.dtype)
    return kc, vc, torch.tensor(n_r, dtype=torch.int32)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("backend", ["reference", "numba", "triton"])
def test_context_parallel_merge_in_one_process(backend, world, gen, monkeypatch):
    """Every rank's ContextParallelDecode in one process, the all-gather emulated: the gathered states go into the
    ragged merge workspace (slot b * world + r) and the backend's separate merge gives single-device decode; the
    result buffer starts as NaN so a row the merge leaves unwritten shows."""
    import attnplan.distributed as d
    from attnplan import reference
    from attnplan.testing import assert_close_to_reference, make_inputs

    from conftest import kernel_backends

    if backend != "reference" and backend not in kernel_backends("cpu"):
        pytest.skip(f"{backend} is not available here")
    lens = [37, 0, 5, 64, 2]
    x = make_inputs(len(lens), 4, 2, 32, lens, page_size=4, dtype=torch.float16, generator=gen)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    monkeypatch.setattr(d.dist, "get_world_size", lambda group=None: world)
    # plan()'s check that the ranks agree on q: every rank sends the same descriptor
    monkeypatch.setattr(d.dist, "all_gather_into_tensor", lambda recv, send, group=None: recv.copy_(send.repeat(world)))
    ranks = []
    for r in range(world):
        cp = d.ContextParallelDecode(backend=backend)
        kc, vc, sl = _shards(x, lens, world, r)
        cp.plan(x.q, kc, vc, sl)
        cp.local.run(x.q, kc, vc, sl, out=cp._out, lse=cp._lse)
        cp._result.fill_(float("nan"))
        ranks.append(cp)
    monkeypatch.setattr(d.dist, "all_gather_into_tensor",
                        lambda recv, send, group=None: recv.copy_(torch.cat([c._send for c in ranks])))
    for cp in ranks:
        if world > 1:
            mp, ws = cp._merge_plan, cp._workspace
            assert mp.merge == "separate" and mp.schedule.max_units_per_seq == world
            assert ws.meta.tolist() == [b * world for b in range(len(lens))] + [world] * len(lens)
        assert_close_to_reference(cp.exchange(), ref, torch.float16)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_an_exchange_before_any_run_gives_nan(world, gen, monkeypatch):
    """``exchange()`` after ``plan()`` but before any local run merges the send buffer's initial contents: NaN in
    every element at every world size (a world of one copies the local output as it is), never stale memory."""
    import attnplan.distributed as d
    from attnplan.testing import make_inputs

    lens = [9, 3]
    x = make_inputs(len(lens), 4, 2, 32, lens, page_size=4, dtype=torch.float16, generator=gen)
    monkeypatch.setattr(d.dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(d.dist, "all_gather_into_tensor", lambda recv, send, group=None: recv.copy_(send.repeat(world)))
    cp = d.ContextParallelDecode(backend="reference")
    torch.empty(1 << 20, dtype=torch.float16).fill_(1.5)  # leave non-NaN values where buffers may be carved next
    cp.plan(x.q, *_shards(x, lens, world, 0))
    assert cp.exchange().isnan().all()


def test_merge_workspace_refuses_a_world_of_one():
    import attnplan
    from attnplan.distributed import merge_workspace

    w = attnplan.DecodeWrapper(backend="reference")
    q = torch.zeros(1, 1, 4, 16)
    k = torch.zeros(1, 8, 2, 16)
    plan = w.plan(q, k, k, torch.tensor([8], dtype=torch.int32))
    with pytest.raises(ValueError, match="world must be an int >= 2"):
        merge_workspace(plan, 1, torch.device("cpu"))


@pytest.mark.parametrize("mma", [False, True], ids=["split_k", "mma"])
def test_merge_workspace_of_a_plan_in_head_blocks(mma, gen):
    """A local plan in head blocks (a GQA group of 66 over cuda_ptx's 64 rows) gives a merge-only plan of one launch
    over every row: cuda_ptx's emulated merge kernel (only the merge's spec is built: a partial program could not
    hold the 66 rows) merges the world's states per sequence like :func:`attnplan.merge_states`."""
    emulate = pytest.importorskip("attnplan.backends.cuda_ptx.emulate")
    if emulate.compiler() is None:
        pytest.skip("no C++ compiler for the host emulation")
    from attnplan import PartialState, merge_states
    from attnplan.api import Context, plan_problem
    from attnplan.config import load_config
    from attnplan.distributed import merge_workspace
    from attnplan.problem import DecodeProblem
    from attnplan.testing import assert_close_to_reference, poison

    be = emulate.EmulatedCudaPtxBackend()
    prob = DecodeProblem(2, 66, 1, 16, 1, 8, "bfloat16", "bfloat16", 32, 64, capacity=32)
    ctx = Context.from_config(load_config(plan_cache={"enabled": False}, backend_options={"cuda_ptx": {"mma": mma}}))
    plan = plan_problem(prob, be, torch.device("cpu"), ctx, num_splits=2)
    assert plan.head_block == 33
    world = 3
    mp, ws = merge_workspace(plan, world, torch.device("cpu"))
    assert (mp.q_block, mp.head_block, len(mp.launches)) == (0, 0, 1)
    ws.state.o.copy_(torch.randn(ws.state.o.shape, generator=gen))
    ws.state.lse.copy_(torch.randn(ws.state.lse.shape, generator=gen) * 3)
    out = poison(torch.empty(2, 1, 66, 16, dtype=torch.bfloat16))
    be.merge(mp, ws, out, None)
    for b in range(2):
        sl = slice(b * world, (b + 1) * world)
        want, _ = merge_states(PartialState(ws.state.o[:, :, :, sl].double(), ws.state.lse[:, :, :, sl].double()))
        assert_close_to_reference(out[b:b + 1], want, torch.bfloat16)
