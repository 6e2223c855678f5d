"""Host cost of one eager decode call: what a caller that does not capture graphs pays on the CPU per layer.

Times, per backend, two ways: ``*_host_us`` is the median host time of one call over ``--calls`` calls timed one by
one while a GPU spin keeps the GPU busy (:func:`host_us`: the host's own cost, what a layer's call costs while the
GPU runs earlier work); the plain fields are the wall time per call of a back-to-back loop of ``--calls`` calls,
median of 5 rounds (:func:`per_call_us`), which the GPU's step bounds from below (at 1K tokens the step of a
two-kernel plan takes about as long as its launches). The fields:

- ``run_us``: ``DecodeWrapper.run()`` after one ``plan()``;
- ``run_checks_us``: the same with the launch stubbed (the argument checks alone);
- ``bound_us``: the backend's bound launch alone (``Backend.bind``: Triton's compiled-kernel launcher, numba's
  marshalled arguments, cuda_ptx's packed ``kernelParams``), and ``jit_us``: the same launches through the backend's
  ``run()`` (Triton's JIT, numba's dispatcher, cuda_ptx's checks and argument packing on every call), the path
  ``run()`` took before bound launches;
- ``plan_hit_us``: ``plan()`` again with host lengths (a plan-cache hit); ``decode_us``: ``attnplan.decode()`` with
  ``seq_lens_host`` (a plan-cache hit, its wrapper reused);
- torch's ``scaled_dot_product_attention`` on the same data (dense, ``enable_gqa``) as the bar, and the floor of any
  call that launches a kernel: one ``cuLaunchKernel`` of an empty kernel through cuda-python and torch's ``add_``;
- the transformers attention call of an eager decode step (``attnplan.hf`` against transformers' SDPA function, on
  ``bench_hf.py``'s model shape; :func:`hf_calls`), per backend and merge, and its cost outside ``run()``'s launch.

It also checks that ``run()`` and, with host lengths, ``plan()`` / ``decode()`` never synchronize the host
(``torch.cuda.set_sync_debug_mode("error")``; ``decode()`` without host lengths is documented to synchronize once,
reported as ``decode_nohost_sync``), and whether the bound launch's direct path was taken (``direct``).

``--cpu`` times the same host paths per stage on the CPU (Triton interpreter, numba simulator) with every launch
stubbed (the interpreter would dominate): ``run()``'s checks, the bound launch's direct path with a stand-in for
the compiled kernel (Triton) or for ``cuda.core.launch`` over a template of numba's size (numba), a ``plan()``
hit and a ``decode()`` call, and the pieces of each. cuda_ptx, which cannot run on a CPU, is timed there with its
device runtime real but for the driver (:func:`cuda_ptx_cpu_stand_in`: the context query and both launches return
at once), its bound launch beside the unbound ``run()`` path. It prints its table and writes nothing.

Usage (GPU machine)::

    python benchmarks/bench_host.py --out benchmarks/results/host.json
    python benchmarks/bench_host.py --cpu          # any machine
    python benchmarks/bench_host.py --profile 500 --kv 1024   # GPU: where run()'s host time goes (cProfile)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import types

if "--cpu" in sys.argv:  # before numba and the Triton kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import torch
import torch.nn.functional as F

import attnplan
import attnplan.backends
from attnplan.backends import DecodeInputs
from attnplan.testing import make_inputs


def per_call_us(fn, calls: int, repeats: int = 5) -> float:
    """Median over ``repeats`` rounds of the mean wall time per call of ``calls`` back-to-back calls (us)."""
    for _ in range(min(200, calls)):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter_ns() - t0) / calls / 1e3)
    return statistics.median(rounds)


def host_us(fn, calls: int, burst: int = 100) -> float:
    """Median host time of one call (us) over ``calls`` calls timed one by one, in bursts of ``burst`` calls queued
    behind a GPU spin (``torch.cuda._sleep``) that outlasts the burst (checked with an event after the spin: a burst
    it did not outlast is discarded and the spin doubled): the GPU is busy throughout, so a
    launch neither waits for a full queue nor pays the kick of an idle GPU, and the time is the host's own (what a
    layer's call costs while the GPU runs the previous layers). :func:`per_call_us` is the loop's wall time instead,
    bounded below by the GPU's step."""
    for _ in range(min(200, calls)):
        fn()
    torch.cuda.synchronize()
    pc = time.perf_counter_ns
    times = []
    spin = burst * 200_000  # GPU cycles: ~100 us per call at ~2 GHz, doubled whenever a burst outlasts it
    done = torch.cuda.Event()
    bursts = max(1, calls // burst)
    while len(times) < bursts * burst:
        torch.cuda._sleep(spin)
        done.record()  # completes when the spin does
        batch = []
        for _ in range(burst):
            t0 = pc()
            fn()
            batch.append(pc() - t0)
        outlasted = done.query()  # the spin ended before the burst: the GPU may have idled, the burst is void
        torch.cuda.synchronize()
        if outlasted:
            spin *= 2
            if spin > 1 << 40:
                raise RuntimeError("host_us: the GPU spin never outlasted a burst")
            continue
        times += batch
    return statistics.median(times) / 1e3


def no_sync(fn) -> str:
    """'ok' if ``fn`` runs with sync debug mode 'error', else the error."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "ok"
    except RuntimeError as e:
        return f"sync: {str(e)[:120]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def launch_floor(t: torch.Tensor, calls: int) -> dict:
    """What one launch costs the host at least (us, :func:`host_us`): ``cuLaunchKernel`` of a loaded empty kernel
    (one warp) through cuda-python (the call cuda_ptx's bound launch makes) and torch's ``add_`` of a scalar (its
    dispatcher and one launch)."""
    r = {"torch_op_host_us": host_us(lambda: t.add_(0), calls)}
    try:
        from attnplan.backends.cuda_ptx._bindings import bindings, check_driver
        from attnplan.backends.cuda_ptx.nvrtc import compile_source, select_target

        driver, _ = bindings()
        image = compile_source('extern "C" __global__ void attnplan_nop() {}', "nop.cu", [],
                               select_target(torch.cuda.get_device_capability())).image
        mod = check_driver(driver.cuModuleLoadData(image), "cuModuleLoadData")
        fn = check_driver(driver.cuModuleGetFunction(mod, b"attnplan_nop"), "cuModuleGetFunction")
        stream = torch.cuda.current_stream().cuda_stream
        check_driver(driver.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, 0, 0), "cuLaunchKernel")
        r["launch_host_us"] = host_us(lambda: driver.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, 0, 0), calls)
        torch.cuda.synchronize()
        check_driver(driver.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, 0, 0), "cuLaunchKernel")
    except Exception as e:  # noqa: BLE001 - the floor is context, not a result
        r["launch_error"] = f"{type(e).__name__}: {str(e)[:120]}"
    return r


def measure(be: str, x, lens: list[int], calls: int) -> dict:
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    ctx = attnplan.Context.from_config(attnplan.load_config())
    w = attnplan.DecodeWrapper(ctx, backend=be)
    w.plan(*args, seq_lens_host=lens)
    out = torch.empty_like(x.q)
    w.run(*args, out=out)
    attnplan.decode(*args, out=out, backend=be, config=ctx, seq_lens_host=lens)
    r = {"backend": be, "plan": f"{w.plan_.policy} {w.plan_.num_splits} splits, merge {w.plan_.merge}"}
    r["run_us"] = per_call_us(lambda: w.run(*args, out=out), calls)
    r["run_host_us"] = host_us(lambda: w.run(*args, out=out), calls)
    bound = w._launcher
    ptrs = tuple(0 if t is None else t.data_ptr() for t in args)
    if bound is not None:
        r["bound_us"] = per_call_us(lambda: bound(*args, out, None, ptrs), calls)
        r["bound_host_us"] = host_us(lambda: bound(*args, out, None, ptrs), calls)
        fast, w._launcher = w._fast, lambda *a: None
        w._fast = w._make_fast()  # the one-pass check holds the launch it makes
        r["run_checks_us"] = per_call_us(lambda: w.run(*args, out=out), calls)
        w._launcher, w._fast = bound, fast
        r["direct"] = len(getattr(bound, "direct", {}))
        if be == "triton":  # the raw launch against Triton's own launcher, in the same run
            r["raw"] = bool(bound.direct) and all(e[2] is not None for e in bound.direct.values())
            w2 = attnplan.DecodeWrapper(ctx, backend=be)
            w2.plan(*args, seq_lens_host=lens)
            w2._launcher.raw = False
            w2.run(*args, out=out)
            w2.run(*args, out=out)
            b2 = w2._launcher
            r["run_launcher_host_us"] = host_us(lambda: w2.run(*args, out=out), calls)
            r["bound_launcher_host_us"] = host_us(lambda: b2(*args, out, None, ptrs), calls)
    else:  # no bound launch: run() goes through backend.run; stub that for the checks alone
        w.backend.run = lambda *a, **k: None  # an instance attribute over the class's method
        try:
            r["run_checks_us"] = per_call_us(lambda: w.run(*args, out=out), calls)
        finally:
            del w.backend.run  # the class's method again
    inputs = DecodeInputs(*args, w._sm_scale, **w._variant)
    r["jit_us"] = per_call_us(lambda: w.backend.run(w.plan_, inputs, w.workspace, out, None), calls)
    r["plan_hit_us"] = per_call_us(lambda: w.plan(*args, seq_lens_host=lens), calls // 4)
    r["decode_us"] = per_call_us(lambda: attnplan.decode(*args, out=out, backend=be, config=ctx, seq_lens_host=lens),
                                 calls // 4)
    r["decode_host_us"] = host_us(lambda: attnplan.decode(*args, out=out, backend=be, config=ctx, seq_lens_host=lens),
                                  calls)
    r["plan_hit_host_us"] = host_us(lambda: w.plan(*args, seq_lens_host=lens), calls)
    r["run_sync"] = no_sync(lambda: w.run(*args, out=out))
    r["plan_sync"] = no_sync(lambda: w.plan(*args, seq_lens_host=lens))
    r["decode_sync"] = no_sync(lambda: attnplan.decode(*args, out=out, backend=be, config=ctx, seq_lens_host=lens))
    r["decode_nohost_sync"] = no_sync(lambda: attnplan.decode(*args, out=out, backend=be, config=ctx))
    return r


def hf_calls(backends: list[str], calls: int, kv: int, hq: int = 32, hkv: int = 8, d: int = 64) -> list[dict]:
    """The host cost of one eager transformers attention call (``attnplan.hf``'s against transformers'
    ``sdpa_attention_forward``) on a DynamicCache's tensors of ``kv`` tokens (bench_hf.py's model: b1 32/8/64 bf16),
    per attnplan backend and merge (the eager steps' context forced to each), with the GPU busy (``host_us``) and in a
    loop (``us``); ``outside_run_host_us``: the same call with the launch stubbed (the integration's own Python and
    run()'s checks). Empty where transformers does not import."""
    try:
        import attnplan.hf as hf
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:
        return []
    hf.register()
    gen = torch.Generator(device="cuda").manual_seed(1)
    query = torch.randn(1, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    key, value = (torch.randn(1, hkv, kv, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    module = types.SimpleNamespace(training=False, is_causal=True, num_key_value_groups=hq // hkv)
    scale = d ** -0.5
    sdpa = lambda: sdpa_attention_forward(module, query, key, value, None, scaling=scale)  # noqa: E731
    rows = [{"what": "hf sdpa", "kv": kv, "host_us": host_us(sdpa, calls), "us": per_call_us(sdpa, calls)}]
    call = lambda: hf.attnplan_attention_forward(module, query, key, value, None, scaling=scale)  # noqa: E731
    saved = hf._EAGER_CTX
    try:
        for be in backends:
            for merge in ("fused", "separate"):
                hf._EAGER_CTX = (attnplan.api.default_context(), attnplan.Context.from_config(
                    attnplan.load_config(backends=[be], split={"merge": merge})))
                hf._STEP.__dict__.clear()
                try:
                    ref = reference_hf(query, key, value, scale)
                    err = (call()[0].float() - ref).abs().max().item()
                    w = hf._STEP.last.wrapper
                    r = {"what": "hf attnplan", "kv": kv, "backend": be, "merge": w.plan_.merge, "max_err": err,
                         "host_us": host_us(call, calls), "us": per_call_us(call, calls)}
                    bound, fast = w._launcher, w._fast
                    w._launcher = lambda *a: None
                    w._fast = w._make_fast()  # the one-pass check holds the launch it makes
                    r["outside_run_host_us"] = host_us(call, calls)
                    w._launcher, w._fast = bound, fast
                except Exception as e:  # noqa: BLE001 - report and go on
                    r = {"what": "hf attnplan", "kv": kv, "backend": be, "merge": merge,
                         "error": f"{type(e).__name__}: {str(e)[:200]}"}
                rows.append(r)
                print(r, flush=True)
    finally:
        hf._EAGER_CTX = saved
        hf._STEP.__dict__.clear()
    return rows


def reference_hf(query, key, value, scale) -> torch.Tensor:
    """float32 attention of ``query [1, Hq, 1, D]`` over ``key, value [1, Hkv, kv, D]``: ``[1, 1, Hq, D]``."""
    hq, hkv = query.shape[1], key.shape[1]
    k = key.float().repeat_interleave(hq // hkv, 1)
    v = value.float().repeat_interleave(hq // hkv, 1)
    p = torch.softmax(query.float() @ k.transpose(-1, -2) * scale, -1)
    return (p @ v).transpose(1, 2)


def per_call_cpu_us(fn, calls: int, repeats: int = 7) -> float:
    """:func:`per_call_us` without a GPU: ``time.perf_counter_ns`` around ``calls`` calls, median of rounds."""
    for _ in range(min(200, calls)):
        fn()
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter_ns() - t0) / calls / 1e3)
    return statistics.median(rounds)


def cuda_ptx_cpu_stand_in():
    """Let cuda_ptx plan and launch on CPU tensors: available, nothing to compile or load (a loaded function is its
    spec's name: ``prepare`` itself runs, building and looking up its kernel specs as on a GPU), its
    :class:`DeviceRuntime` real but for the driver (the context query and both launches return
    success at once: the driver's own cost is not counted), torch's current device 0 and stream 0. Returns a
    function that undoes it."""
    from attnplan.backends import get_backend
    from attnplan.backends.cuda_ptx import runtime as R

    be = get_backend("cuda_ptx")
    real, _ = R.bindings()
    ok = (real.CUresult.CUDA_SUCCESS,)

    class Driver:
        def __getattr__(self, name):
            return getattr(real, name)

        def cuCtxGetCurrent(self):
            return ok[0], 1

        def cuLaunchKernel(self, *args):
            return ok

        def cuLaunchKernelEx(self, *args):
            return ok

    driver = Driver()
    rt = object.__new__(R.DeviceRuntime)
    rt.index, rt._ctx_int, rt._tls, rt.pdl_supported = 0, 1, threading.local(), True
    rt._functions, rt._lock, rt._load = {}, threading.Lock(), (lambda spec: spec.name)
    saved = (R.bindings, torch.cuda.current_device, torch.cuda.current_stream)
    R.bindings = lambda: (driver, None)
    torch.cuda.current_device = lambda: 0
    torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=0)
    be.available, be._runtime_for = (lambda device: (True, "")), (lambda d: rt)

    def undo():
        R.bindings, torch.cuda.current_device, torch.cuda.current_stream = saved
        for name in ("available", "_runtime_for"):
            delattr(be, name)

    return undo


def cpu_stages(be: str, calls: int, hq: int, hkv: int, d: int, kv: int) -> list[tuple[str, float]]:
    """Per-stage host cost on the CPU, every launch stubbed (see the module docstring)."""
    from attnplan import api
    from attnplan import problem as P
    from attnplan.backends import get_backend

    x = make_inputs(1, hq, hkv, d, [kv], page_size=16, dtype=torch.bfloat16)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    lens = [kv]
    ctx = attnplan.Context.from_config(attnplan.load_config())
    w = attnplan.DecodeWrapper(ctx, backend=be)
    w.plan(*args, seq_lens_host=lens)
    out = torch.empty_like(x.q)
    sig, ptrs = w._signature_ptrs(*args)
    rows = []
    bound, fast, snap = w._launcher, w._fast, w._snap
    w._launcher = lambda *a: None
    w._fast = w._make_fast()  # the one-pass check holds the launch it makes
    w._snapshot()  # and the full path's snapshot
    rows.append(("run(), launch stubbed", per_call_cpu_us(lambda: w.run(*args, out=out), calls)))
    w._fast = None
    rows.append(("  the full path (one-pass check off)", per_call_cpu_us(lambda: w.run(*args, out=out), calls)))
    w._launcher, w._fast, w._snap = bound, fast, snap
    rows.append(("  signature and pointers (full path, decode)", per_call_cpu_us(lambda: w._signature_ptrs(*args),
                                                                               calls)))
    rows.append(("  out / lse checks (full path)", per_call_cpu_us(lambda: w._check_outputs(w._sig, x.q, out, None),
                                                                        calls)))
    rows.append(("  overlap checks (full path, decode)",
                 per_call_cpu_us(lambda: w._check_overlap(w._extents, w._q_terms, out, None, ptrs, None, None, None),
                                 calls)))
    if be == "triton" and bound is not None:
        from attnplan.backends.triton import _Direct

        dp = _Direct()
        dp.run, dp.function, dp.packed, dp.device, dp.debug = (lambda *a: None), None, None, 0, False
        dp.const_tail = (0,) * 30
        from triton import knobs  # Triton's own default hooks: what the direct path sees on a GPU

        bound.hooks = types.SimpleNamespace(launch_enter_hook=knobs.runtime.launch_enter_hook,
                                            launch_exit_hook=knobs.runtime.launch_exit_hook, debug=False)
        bound.current_device, bound.current_stream = (lambda: 0), (lambda dev: 0)
        key = (out.stride(), None, out.data_ptr() & 15)
        bound.direct[key] = (dp, dp if bound.merge else None, None, None)
        rows.append(("bound launch, Triton's launcher (stubbed)",
                     per_call_cpu_us(lambda: bound(*args, out, None, ptrs), calls)))
        from attnplan.backends.cuda_ptx.args import PARTIAL_SIGNATURE
        from attnplan.backends.triton.raw import RawKernel

        params = [(i, k, 8 if k in ("ptr", "i64") else 4) for i, (_, k) in enumerate(PARTIAL_SIGNATURE)]
        ok = lambda *a: (0,)  # noqa: E731 - the driver's cuLaunchKernel, stubbed
        rk = RawKernel(0, (1, 1, 1), 4, 0, params, (0,) * len(params), ((0, 1, 2, 3, 4), (5, 6)), ok)
        rm = RawKernel(0, (1, 1, 1), 4, 0, params, (0,) * len(params), ((5, 6),), ok)
        bound.direct[key] = (dp, dp if bound.merge else None, rk, rm if bound.merge else None)
        rows.append(("bound launch, raw path (driver stubbed)",
                     per_call_cpu_us(lambda: bound(*args, out, None, ptrs), calls)))
    if be == "numba" and bound is not None:
        from attnplan.backends.numba import _ROLE_INDEX, _Direct

        calls_ = [w.backend._partial_call(w.plan_, DecodeInputs(*args, w._sm_scale, **w._variant), w.workspace,
                                          out, None)]
        if w.plan_.merge == "separate":
            calls_.append(w.backend._merge_call(w.plan_, w.workspace, out, None, None))
        made = []
        for *_, tensors in calls_:  # a template of numba's size: arrays as 5 + 2 x ndim words, scalars as one
            template, patch = [], []
            for t, role in tensors:
                if t is None:
                    template.append(0)
                    continue
                if role is not None:
                    patch.append((len(template) + 4, _ROLE_INDEX[role]))
                template += [0] * (5 + 2 * t.dim())
            d_ = _Direct()
            d_.launch, d_.config, d_.handle = (lambda *a: None), None, None
            d_.template, d_.patch, d_.streams = template, tuple(patch), {0: "stream"}
            made.append(d_)
        bound.sim, bound.current_device, bound.raw_stream = False, (lambda: 0), (lambda dev: 0)
        bound.device = torch.device("cpu")
        bound.direct[(out.stride(), None)] = tuple(made)
        rows.append(("bound launch, direct path (cuda.core.launch stubbed)",
                     per_call_cpu_us(lambda: bound(*args, out, None, ptrs), calls)))
    if be == "cuda_ptx" and bound is not None:  # the driver's calls stubbed (cuda_ptx_cpu_stand_in)
        inputs = DecodeInputs(*args, w._sm_scale, **w._variant)
        rows.append(("run(), bound launch (driver stubbed)", per_call_cpu_us(lambda: w.run(*args, out=out), calls)))
        # run() without the bound launch: the one-pass check made again without it (its launch tuple held it)
        fast, w._launcher = w._fast, None
        w._fast = w._make_fast()
        rows.append(("run(), unbound: backend.run (driver stubbed)",
                     per_call_cpu_us(lambda: w.run(*args, out=out), calls)))
        w._fast, w._launcher = fast, bound
        rows.append(("  bound launch alone (driver stubbed)",
                     per_call_cpu_us(lambda: bound(*args, out, None, ptrs), calls)))
        rows.append(("  backend.run alone (driver stubbed)",
                     per_call_cpu_us(lambda: w.backend.run(w.plan_, inputs, w.workspace, out, None), calls)))
    rows.append(("plan() hit, host lengths", per_call_cpu_us(lambda: w.plan(*args, seq_lens_host=lens), calls)))
    static = P.validate_inputs(*args)
    rows.append(("  validate_inputs (memoized away on a hit)",
                 per_call_cpu_us(lambda: P.validate_inputs(*args), calls)))
    rows.append(("  host lengths", per_call_cpu_us(lambda: P.host_lengths(static, lens, x.k_cache.shape[0]), calls)))
    prob = P.DecodeProblem(max_kv_len=kv, total_kv_len=kv, **static)
    rows.append(("  select_backend (memoized away on a hit)",
                 per_call_cpu_us(lambda: api.select_backend(prob, x.q.device, ctx.config, be, False), calls)))
    rows.append(("  plan_problem (a plan-cache hit)",
                 per_call_cpu_us(lambda: api.plan_problem(prob, w.backend, x.q.device, ctx), calls)))
    bb = get_backend(be)
    stub = (lambda *a, **k: None)
    bb.run = stub
    bind = getattr(type(bb), "bind", None)
    if bind is not None:
        bb.bind = lambda *a, **k: stub
    try:
        attnplan.decode(*args, out=out, backend=be, config=ctx, seq_lens_host=lens)
        rows.append(("decode(), host lengths, launch stubbed",
                     per_call_cpu_us(lambda: attnplan.decode(*args, out=out, backend=be, config=ctx,
                                                             seq_lens_host=lens), calls)))
        key = (sig, be)
        rows.append(("  output checks from the signature", per_call_cpu_us(lambda: api._outputs_fit(sig[0], out, None),
                                                                           calls)))

        def pool():
            h = hash(key)
            ctx._give_wrapper(h, key, ctx._take_wrapper(h, key))

        rows.append(("  wrapper pool (hash, take, give back)", per_call_cpu_us(pool, calls)))
    finally:
        del bb.run
        if bind is not None:
            del bb.bind
    return rows


def profile_run(backends, calls: int, hq: int, hkv: int, d: int, kv: int, top: int = 14) -> None:
    """cProfile ``calls`` calls of ``DecodeWrapper.run()`` per backend (b1, paged, bf16, one plan) and print the
    functions with the most time of their own, and the per-call wall time of the same loop without the profiler."""
    import cProfile
    import pstats

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = make_inputs(1, hq, hkv, d, [kv], page_size=16, dtype=torch.bfloat16, device="cuda", generator=gen)
    args = (x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table)
    for be in backends:
        w = attnplan.DecodeWrapper(backend=be)
        w.plan(*args, seq_lens_host=[kv])
        out = torch.empty_like(x.q)
        wall = per_call_us(lambda: w.run(*args, out=out), calls)
        launches = 1 if w.plan_.single_pass or w.plan_.merge == "fused" else 2
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(calls):
            w.run(*args, out=out)
        pr.disable()
        torch.cuda.synchronize()
        print(f"\n{be}: run() {wall:.1f} us per call ({launches} launch(es); plan {w.plan_.policy}, merge "
              f"{w.plan_.merge}); top functions by own time over {calls} profiled calls:")
        pstats.Stats(pr).sort_stats("tottime").print_stats(top)
        ctx = attnplan.Context.from_config(attnplan.load_config())
        dec = lambda: attnplan.decode(*args, out=out, backend=be, config=ctx, seq_lens_host=[kv])  # noqa: E731
        dec()
        wall = per_call_us(dec, calls)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(calls):
            dec()
        pr.disable()
        torch.cuda.synchronize()
        print(f"\n{be}: decode() with host lengths {wall:.1f} us per call; top functions by own time:")
        pstats.Stats(pr).sort_stats("tottime").print_stats(top)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="triton,cuda_ptx,numba")
    ap.add_argument("--kv", default="1024,32768")
    ap.add_argument("--heads", default="32,8,128")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--hf-kv", type=int, default=1024, help="KV length of the transformers attention call's rows")
    ap.add_argument("--out", default="benchmarks/results/host.json")
    ap.add_argument("--cpu", action="store_true", help="per-stage host cost on the CPU, launches stubbed")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="GPU: cProfile N run() and N decode() calls per backend at the first --kv and print "
                         "the top functions")
    args = ap.parse_args(argv)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    if args.profile:
        profile_run(args.backends.split(","), args.profile, hq, hkv, d, int(args.kv.split(",")[0]))
        return 0
    if args.cpu:
        kv = int(args.kv.split(",")[0])
        for be in args.backends.split(","):
            undo = cuda_ptx_cpu_stand_in() if be == "cuda_ptx" else None
            try:
                if not attnplan.backends.get_backend(be).available(torch.device("cpu"))[0]:
                    continue
                print(f"\n{be} on the CPU, b1 {hq}/{hkv}/{d} bf16 paged, kv {kv} (us per call, launches stubbed)")
                for name, us in cpu_stages(be, args.calls, hq, hkv, d, kv):
                    print(f"  {name:52s} {us:8.1f}")
            finally:
                if undo is not None:
                    undo()
        return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    first_kv = int(args.kv.split(",")[0])
    for kv in (int(x) for x in args.kv.split(",")):
        x = make_inputs(1, hq, hkv, d, [kv], page_size=16, dtype=torch.bfloat16, device="cuda", generator=gen)
        qd = x.q.transpose(1, 2)  # [1, Hq, 1, D]
        kd = torch.randn(1, hkv, kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        vd = torch.randn_like(kd)
        sdpa = per_call_us(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True), args.calls)
        sdpa_host = host_us(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True), args.calls)
        rows.append({"kv": kv, "what": "torch sdpa", "us": sdpa, "host_us": sdpa_host})
        if kv == first_kv:  # the floor of any call that launches: one driver launch, and torch's cheapest op
            rows.append({"kv": kv, "what": "floor", **launch_floor(qd, args.calls)})
        for be in args.backends.split(","):
            try:
                r = {"kv": kv, **measure(be, x, [kv], args.calls)}
            except Exception as e:  # noqa: BLE001 - report and go on
                r = {"kv": kv, "backend": be, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            rows.append(r)
            print(r, flush=True)
    hf_rows = hf_calls([b for b in args.backends.split(",") if b in ("triton", "cuda_ptx")], args.calls, args.hf_kv)
    rows += hf_rows
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python", "benchmarks/bench_host.py", *(argv or sys.argv[1:])]),
                   "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    fl = next((r for r in rows if r.get("what") == "floor"), {})
    if fl:
        launch = f"{fl['launch_host_us']:.1f}" if "launch_host_us" in fl else fl.get("launch_error", "-")
        print(f"\nfloor (host us per call, GPU busy): one cuLaunchKernel {launch}, torch "
              f"add_ {fl['torch_op_host_us']:.1f}")
    print("\nhost us per call (GPU busy; loop wall time in brackets)\n"
          "kv      backend   run            checks  bound          jit     plan_hit  decode         sdpa           "
          "direct  syncs(run/plan/decode; decode without host lengths)")
    for r in rows:
        if "run_launcher_host_us" in r:
            print(f"{r['kv']:<7d} {r['backend']:9s} raw launch {'on' if r['raw'] else 'OFF'}: run {r['run_host_us']:.1f} "
                  f"bound {r['bound_host_us']:.1f}; Triton's launcher: run {r['run_launcher_host_us']:.1f} bound "
                  f"{r['bound_launcher_host_us']:.1f}")
    sd = {r["kv"]: r for r in rows if r.get("what") == "torch sdpa"}
    for r in rows:
        if "run_us" in r:
            bound = f"{r['bound_host_us']:5.1f} [{r['bound_us']:5.1f}]" if "bound_us" in r else "      -      "
            s_ = sd[r["kv"]]
            print(f"{r['kv']:<7d} {r['backend']:9s} {r['run_host_us']:5.1f} [{r['run_us']:5.1f}] "
                  f"{r['run_checks_us']:6.1f}  {bound}  {r['jit_us']:6.1f}  {r['plan_hit_host_us']:7.1f}  "
                  f"{r['decode_host_us']:5.1f} [{r['decode_us']:5.1f}]  {s_['host_us']:5.1f} [{s_['us']:5.1f}]  "
                  f"{r.get('direct', '-')!s:>6}  {r['run_sync']}/{r['plan_sync']}/{r['decode_sync']}; "
                  f"{r['decode_nohost_sync'][:5]}")
        elif "error" in r and "what" not in r:
            print(f"{r['kv']:<7d} {r['backend']:9s} error {r['error']}")
    if hf_rows:
        print(f"\ntransformers attention call, b1 32/8/64 bf16 DynamicCache kv {args.hf_kv}: host us per call (GPU "
              "busy; loop wall time in brackets); outside run = the call with the launch stubbed")
        for r in hf_rows:
            name = "sdpa" if r["what"] == "hf sdpa" else f"attnplan {r['backend']} {r['merge']}"
            if "error" in r:
                print(f"  {name:28s} error {r['error']}")
                continue
            extra = f"  outside run {r['outside_run_host_us']:5.1f}  max err {r['max_err']:.2g}" \
                if "outside_run_host_us" in r else ""
            print(f"  {name:28s} {r['host_us']:6.1f} [{r['us']:6.1f}]{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
