"""A Hugging Face model decoding with attnplan against transformers' SDPA, eager and compiled, plus the op's
replay cost against a hand-captured DecodeWrapper.

The model: a Llama-shaped ``LlamaForCausalLM`` with random weights (no download): 16 layers, hidden 2048, 32 query /
8 KV heads (GQA group 4), head_dim 64, MLP 8192, vocabulary 32,000, bf16, batch 1. For each prompt length
(default 1K, 8K, 32K random tokens) it measures the time per new token: the model's forward for one token over the
cache (what ``generate`` calls once per new token), teacher-forced with the same random tokens in every run, each
step bracketed by ``torch.cuda.synchronize()`` and timed on the host clock (the wall time a user waits), the median
of ``--new-tokens`` steps after ``--warmup`` untimed ones:

- **eager**: transformers' default DynamicCache, ``attn_implementation`` ``sdpa`` against ``attnplan``;
- **compiled**: a StaticCache of ``prompt + warmup + new tokens + 8`` positions (``generate(...,
  cache_implementation="static")`` sizes it so) and ``torch.compile(model.forward, mode="reduce-overhead",
  fullgraph=True)``: the decode step captured in torch's CUDA graphs and replayed; one compile per attention
  implementation and prompt length (the cache's shape is part of the graph; each implementation on its own copy of
  the model), its seconds recorded. The prefill runs eagerly, as ``generate`` runs it.

In each mode the two implementations run on their own copies of the model and caches, and their steps alternate
token by token (the order swapped every token), so the host's load moves both alike; the speedup is the median of
the per-token ratios sdpa / attnplan, with their range.

**Logits agreement**: the first ``--keep`` decode steps' logits of every bf16 run against an fp32 eager SDPA run of
the same weights fed the same tokens: ``max |logits - logits_fp32_sdpa|`` of attnplan against that of bf16 SDPA
(same mode), so attnplan's error is read against what SDPA itself achieves in bf16.

**Op against a hand-captured wrapper**: per prompt length, 16 decode calls of the model's attention shape (one per
layer, each on its own transformers-layout cache ``[1, 8, capacity, 64]`` read as the transposed view) as one step,
timed as CUDA-graph replay device time (L2 flushed in front, :func:`attnplan.timing.time_cuda`): a DecodeWrapper
planned for the capacity and captured by hand, ``torch.ops.attnplan.decode`` captured by hand, and the op under
``torch.compile(mode="reduce-overhead")``; then every variant is replayed at other lengths (changed in place) and
checked against a float32 reference on the GPU. The control: torch's SDPA on the same caches, captured by hand and
compiled the same way (what reduce-overhead adds to SDPA is torch's), and the host time of each compiled step.
The same 16 calls as a chain (each call's output is the next call's query; the step returns the last output, as a
model's step returns its logits) are captured by hand and compiled: a compiled step of 16 outputs pays torch's
rebuilding of every output tensor at each replay, which a model's step does not.

Prints a table last and writes one JSON (``--out``) with the command and the environment, after every phase.

Usage (GPU machine, ~3 minutes on an H200, most of it compiling)::

    python benchmarks/bench_hf.py
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time

import torch

import attnplan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import environment  # noqa: E402

MODEL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, head_dim=64, max_position_embeddings=65536 + 1024, rope_theta=500000.0)
IMPLS = ("sdpa", "attnplan")
DEVICE = "cuda"


def _sync() -> None:
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


def _empty_cache() -> None:
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.empty_cache()


def _env() -> dict:
    """The benchmark environment (``bench_decode.environment``) plus transformers' version."""
    env = environment()
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001 - recorded as absent
        env["transformers"] = None
    return env


def build_models(layers: int):
    """The fp32 model (random weights, seed 0, built on the GPU) and its bf16 copy."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**MODEL, "num_hidden_layers": layers})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(DEVICE):
        fp32 = LlamaForCausalLM(cfg).eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16).eval()
    return fp32, bf16


def set_impl(model, impl: str) -> None:
    model.config._attn_implementation = impl


def prefill(model, ids, cache, chunk: int | None = None) -> None:
    """The prompt into ``cache`` (last position's logits only); ``chunk``: in pieces of that many tokens (the fp32
    run: an unmasked fp32 prefill of 32K tokens with GQA would take SDPA's math path, 32K x 32K scores a head)."""
    with torch.no_grad():
        if chunk is None:
            model(ids, cache=cache, use_cache=True, logits_to_keep=1)
            return
        for s in range(0, ids.shape[1], chunk):
            pos = torch.arange(s, min(s + chunk, ids.shape[1]), device=ids.device)[None]
            model(ids[:, s:s + chunk], position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)


def decode_steps(forward, cache, tokens, start: int, keep: int, warmup: int) -> dict:
    """Feed ``tokens`` ``[1, n]`` one per step after a prompt of ``start`` tokens; steps ``>= warmup`` are timed.

    Returns:
        ``{"step_ms": [...], "median_ms", "logits": fp32 [keep, vocab] of the first keep steps, "first_ms"}``.
    """
    n = tokens.shape[1]
    pos = torch.arange(start, start + n, device=tokens.device).view(n, 1)
    times, kept = [], []
    with torch.no_grad():
        for i in range(n):
            _sync()
            t0 = time.perf_counter()
            out = forward(input_ids=tokens[:, i:i + 1], position_ids=pos[i:i + 1], cache=cache, use_cache=True)
            _sync()
            times.append((time.perf_counter() - t0) * 1e3)
            if i < keep:
                kept.append(out.logits[:, -1].float().clone())
    timed = times[warmup:]
    return {"step_ms": timed, "median_ms": statistics.median(timed) if timed else float("nan"),
            "first_ms": times[0], "logits": torch.cat(kept) if kept else None}


def max_err(x, ref) -> float:
    return float((x - ref).abs().max()) if x is not None and ref is not None else float("nan")


def run_model(args, res: dict, save) -> None:
    from transformers import DynamicCache

    fp32, bf16 = build_models(args.layers)
    n_steps = args.warmup + args.new_tokens
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for L in args.lengths:
        pt = res["points"].setdefault(str(L), {"prompt": L})
        ids = torch.randint(1, MODEL["vocab_size"], (1, L), device=DEVICE, generator=gen)
        tokens = torch.randint(1, MODEL["vocab_size"], (1, n_steps), device=DEVICE, generator=gen)
        # the fp32 reference: eager SDPA, DynamicCache, the same tokens
        cache = DynamicCache(config=fp32.config)
        prefill(fp32, ids, cache, chunk=2048)
        ref = decode_steps(fp32.forward, cache, tokens[:, :args.keep], L, args.keep, 0)["logits"]
        del cache
        if not args.skip_eager:
            paired_steps(args, bf16, ids, tokens, L, ref, pt, compiled=False)
            save()
        if not args.skip_compiled:
            paired_steps(args, bf16, ids, tokens, L, ref, pt, compiled=True)
            save()
    set_impl(bf16, "sdpa")
    del fp32, bf16
    _empty_cache()


def paired_steps(args, bf16, ids, tokens, L: int, ref, pt: dict, compiled: bool) -> None:
    """One mode's decode steps of both implementations, timed in alternation. Each implementation gets its own copy
    of the model and its own cache (eager: a DynamicCache; compiled: a StaticCache and ``torch.compile(mode=
    "reduce-overhead", fullgraph=True)``), prefilled first; then every token runs on both, the order swapped each
    token, so a change in the host's load moves both alike. Records per implementation (``pt["<mode>_<impl>"]``) the
    median host ms per token after ``--warmup`` tokens, the first step's time (compiled: the compile), the logits
    error of the first ``--keep`` tokens, and the per-token ratios sdpa / attnplan (``pt["<mode>_speedup"]``: their
    median and range)."""
    from transformers import DynamicCache, StaticCache

    mode = "compiled" if compiled else "eager"
    n_steps = tokens.shape[1]
    runs = {}
    for impl in IMPLS:
        try:
            model = copy.deepcopy(bf16)
            set_impl(model, impl)
            if compiled:
                f = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
                cache = StaticCache(config=model.config, max_cache_len=L + n_steps + 8)
            else:
                f, cache = model.forward, DynamicCache(config=model.config)
            prefill(model, ids, cache)
            runs[impl] = {"model": model, "f": f, "cache": cache, "ms": [], "logits": []}
        except Exception as e:  # noqa: BLE001 - reported, the other implementation still runs
            pt[f"{mode}_{impl}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    pos = torch.arange(L, L + n_steps, device=tokens.device).view(n_steps, 1)
    host = {} if compiled else timed_attention(runs)
    try:
        _steps(args, runs, tokens, pos, compiled)
    finally:
        if host:
            timed_attention(runs, restore=host)
    for impl, ns in (host.get("calls") or {}).items():
        timed = ns[args.warmup * len(ns) // max(n_steps, 1):]
        if timed and f"{mode}_{impl}" not in pt:
            runs[impl]["attn_host_us"] = {"median_call": statistics.median(timed) / 1e3,
                                          "per_token": sum(timed) / 1e3 / (n_steps - args.warmup),
                                          "calls": len(timed)}
    record(args, runs, pt, mode, ref, L)


def timed_attention(runs: dict, restore: dict | None = None) -> dict:
    """Eager mode: re-register each implementation's transformers attention function under its name with a host
    timer around each call (``perf_counter_ns``, no sync: the host's own cost of the call, the first layer's
    ``plan()`` of each step included); ``restore`` (what this returned) puts the originals back. Returns
    ``{"orig": name -> function, "calls": name -> [ns per call]}``."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if restore is not None:
        for name, fn in restore["orig"].items():
            AttentionInterface.register(name, fn)
        return restore
    orig, calls = {}, {}
    for impl in runs:
        fn = ALL_ATTENTION_FUNCTIONS[impl]
        orig[impl], calls[impl] = fn, []

        def timed(*a, _fn=fn, _log=calls[impl], **kw):
            t0 = time.perf_counter_ns()
            res = _fn(*a, **kw)
            _log.append(time.perf_counter_ns() - t0)
            return res

        AttentionInterface.register(impl, timed)
    return {"orig": orig, "calls": calls}


def _steps(args, runs: dict, tokens, pos, compiled: bool) -> None:
    """The alternating decode steps of :func:`paired_steps` (each implementation's host ms and first logits)."""
    n_steps = tokens.shape[1]
    with torch.no_grad():
        for i in range(n_steps):
            order = IMPLS if i % 2 == 0 else IMPLS[::-1]
            for impl in order:
                r = runs.get(impl)
                if r is None or "error" in r:
                    continue
                try:
                    if compiled:
                        torch.compiler.cudagraph_mark_step_begin()
                    _sync()
                    t0 = time.perf_counter()
                    out = r["f"](input_ids=tokens[:, i:i + 1], position_ids=pos[i:i + 1], cache=r["cache"],
                                 use_cache=True)
                    _sync()
                    r["ms"].append((time.perf_counter() - t0) * 1e3)
                    if i < args.keep:
                        r["logits"].append(out.logits[:, -1].float().clone())
                except Exception as e:  # noqa: BLE001
                    r["error"] = f"{type(e).__name__}: {str(e)[:300]}"


def record(args, runs: dict, pt: dict, mode: str, ref, L: int) -> None:
    """:func:`paired_steps`' results into ``pt`` (and printed)."""
    for impl, r in runs.items():
        if "error" in r:
            pt[f"{mode}_{impl}"] = {"error": r["error"]}
            print(f"  L={L} {mode} {impl}: {r['error']}", flush=True)
            continue
        timed = r["ms"][args.warmup:]
        pt[f"{mode}_{impl}"] = {"median_ms": statistics.median(timed), "step_ms": timed, "first_ms": r["ms"][0],
                                "logits_err": max_err(torch.cat(r["logits"]) if r["logits"] else None, ref)}
        if "attn_host_us" in r:
            pt[f"{mode}_{impl}"]["attn_host_us"] = r["attn_host_us"]
        print(f"  L={L} {mode} {impl}: {pt[f'{mode}_{impl}']['median_ms']:.3f} ms/token (first step "
              f"{r['ms'][0] / 1e3:.1f} s), logits err {pt[f'{mode}_{impl}']['logits_err']:.3g}"
              + (f", attention host us: {r['attn_host_us']['median_call']:.1f} per call (median), "
                 f"{r['attn_host_us']['per_token']:.0f} per token" if "attn_host_us" in r else ""), flush=True)
    if all("median_ms" in pt.get(f"{mode}_{impl}", {}) for impl in IMPLS):
        ratios = [a / b for a, b in zip(pt[f"{mode}_sdpa"]["step_ms"], pt[f"{mode}_attnplan"]["step_ms"])]
        pt[f"{mode}_speedup"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                 "tokens": len(ratios)}
        print(f"  L={L} {mode} sdpa / attnplan per token: median {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f})", flush=True)
    runs.clear()
    torch._dynamo.reset()
    _empty_cache()


def reference_out(q, k, v, n: int) -> torch.Tensor:
    """float32 decode attention of ``q [1, 1, Hq, D]`` over the first ``n`` tokens of ``k, v [1, cap, Hkv, D]``."""
    hq, d, hkv = q.shape[2], q.shape[3], k.shape[2]
    qq = q[0, 0].float().view(hkv, hq // hkv, d)
    s = torch.einsum("hgd,nhd->hgn", qq, k[0, :n].float()) / math.sqrt(d)
    return torch.einsum("hgn,nhd->hgd", torch.softmax(s, -1), v[0, :n].float()).reshape(1, 1, hq, d)


def capture_on_warmup_stream(step) -> torch.cuda.CUDAGraph:
    """``step()`` run once on a side stream (plans, compiles), then captured on that same stream: the op's fused-merge
    counters are per stream, so a capture on the warm-up stream finds them (another stream would zero its own per
    call, a memset in the graph)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        step()
    torch.cuda.synchronize()
    return g


def op_check_one(args, L: int, gen: torch.Generator) -> dict:
    """One prompt length of :func:`op_check`: the three variants' replay times per call and their worst errors at
    other lengths (``error`` set when one is wrong)."""
    from attnplan.timing import time_cuda

    hq, hkv, d, layers = MODEL["num_attention_heads"], MODEL["num_key_value_heads"], MODEL["head_dim"], args.layers
    row: dict = {"prompt": L}
    cap = L + args.warmup + args.new_tokens + 8
    q = torch.randn(1, hq, 1, d, device="cuda", generator=gen, dtype=torch.bfloat16).transpose(1, 2)
    kv = [tuple(torch.randn(1, hkv, cap, d, device="cuda", generator=gen, dtype=torch.bfloat16).transpose(1, 2)
                for _ in range(2)) for _ in range(layers)]
    flat = [t for pair in kv for t in pair]
    lens = torch.full((1,), L, dtype=torch.int32, device="cuda")
    for t in (q, lens, *flat):  # as the StaticCache's tensors are: replays read them in place, no copies
        torch._dynamo.mark_static_address(t)
    w = attnplan.DecodeWrapper()
    w.plan(q, kv[0][0], kv[0][1], lens, capacity=True)
    outs = [torch.empty_like(q) for _ in range(layers)]
    op_outs: list = []
    compiled_out: list = []

    def wrapper_step():
        for (k, v), o in zip(kv, outs):
            w.run(q, k, v, lens, out=o)

    def op_step():
        op_outs[:] = [torch.ops.attnplan.decode(q, k, v, lens, None, None, "") for k, v in kv]

    def layers_fn(q, lens, *flat):
        return [torch.ops.attnplan.decode(q, flat[2 * i], flat[2 * i + 1], lens, None, None, "")
                for i in range(layers)]

    # the chain: each call's output is the next call's query, and the step returns the last output only, as in a
    # model, where attention feeds the next layer and a step's graph has one output (the logits); with 16 outputs,
    # cudagraph trees rebuild each output tensor at every replay, which costs any op the same host time
    chain_outs = [torch.empty_like(q) for _ in range(layers)]
    chain_out: list = []

    def wrapper_chain():
        x = q
        for (k, v), o in zip(kv, chain_outs):
            x = w.run(x, k, v, lens, out=o)

    def chain_fn(q, lens, *flat):
        x = q
        for i in range(layers):
            x = torch.ops.attnplan.decode(x, flat[2 * i], flat[2 * i + 1], lens, None, None, "")
        return x

    gw, go = capture_on_warmup_stream(wrapper_step), capture_on_warmup_stream(op_step)
    gwc = capture_on_warmup_stream(wrapper_chain)
    torch._dynamo.reset()
    f = torch.compile(layers_fn, mode="reduce-overhead", fullgraph=True)
    fc = torch.compile(chain_fn, mode="reduce-overhead", fullgraph=True)

    def compiled_step(_=0):
        torch.compiler.cudagraph_mark_step_begin()
        compiled_out[:] = f(q, lens, *flat)

    def compiled_chain(_=0):
        torch.compiler.cudagraph_mark_step_begin()
        chain_out[:] = [fc(q, lens, *flat)]

    # the control: torch's SDPA over the same caches' first L positions, 16 calls, captured by hand and compiled the
    # same way; what reduce-overhead adds to SDPA's replay is torch's, not the op's
    qh, kvh = q.transpose(1, 2), [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in kv]
    sdpa_out: list = []

    def sdpa_fn(qh, *flat_h):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return [sdpa(qh, flat_h[2 * i][:, :, :L], flat_h[2 * i + 1][:, :, :L], enable_gqa=True) for i in range(layers)]

    flat_h = [t for pair in kvh for t in pair]
    gs = capture_on_warmup_stream(lambda: sdpa_fn(qh, *flat_h))
    fs = torch.compile(sdpa_fn, mode="reduce-overhead", fullgraph=True)

    def sdpa_compiled_step(_=0):
        torch.compiler.cudagraph_mark_step_begin()
        sdpa_out[:] = fs(qh, *flat_h)

    for _ in range(3):  # compile + warm-up, record, replay
        compiled_step()
        compiled_chain()
        sdpa_compiled_step()
    torch.cuda.synchronize()
    t = {name: time_cuda(fn, iters=args.iters, flush=True)["median_us"] / layers
         for name, fn in (("wrapper_us", lambda i: gw.replay()), ("op_graph_us", lambda i: go.replay()),
                          ("op_compiled_us", compiled_step), ("sdpa_graph_us", lambda i: gs.replay()),
                          ("sdpa_compiled_us", sdpa_compiled_step), ("wrapper_chain_us", lambda i: gwc.replay()),
                          ("op_compiled_chain_us", compiled_chain))}
    # host time of one compiled step (the Python call of cudagraph trees' replay, launch included), per call: where
    # it exceeds the device time, the replay above waits for the host
    for name, fn in (("op_compiled_host_us", compiled_step), ("sdpa_compiled_host_us", sdpa_compiled_step),
                     ("op_compiled_chain_host_us", compiled_chain)):
        torch.cuda.synchronize()
        h = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            fn()
            h.append((time.perf_counter() - t0) * 1e6 / layers)
            torch.cuda.synchronize()
        t[name] = statistics.median(h)
    row.update(t, plan=w.plan_.explain([L]).splitlines()[-3:])
    row["op_compiled_over_wrapper"] = t["op_compiled_us"] / t["wrapper_us"]
    row["op_graph_over_wrapper"] = t["op_graph_us"] / t["wrapper_us"]
    row["op_compiled_chain_over_wrapper"] = t["op_compiled_chain_us"] / t["wrapper_chain_us"]
    row["sdpa_compiled_over_graph"] = t["sdpa_compiled_us"] / t["sdpa_graph_us"]
    errs = {"wrapper": 0.0, "op_graph": 0.0, "op_compiled": 0.0, "op_compiled_chain": 0.0}
    for n in (L, 1, cap, L // 3 + 7, 0):
        lens.fill_(n)
        gw.replay()
        go.replay()
        compiled_step()
        # read before the chain's compiled step replays: cudagraph trees reuse one memory pool, and a replay of the
        # other compiled function may overwrite this step's outputs (as a model's next step would its logits)
        compiled_snap = {i: compiled_out[i].clone() for i in (0, layers - 1)}
        gwc.replay()
        compiled_chain()
        torch.cuda.synchronize()
        # the chain against its hand-captured twin (the same kernels in the same order)
        errs["op_compiled_chain"] = max(errs["op_compiled_chain"], max_err(chain_out[0].float(), chain_outs[-1].float()))
        for i in (0, layers - 1):
            ref = reference_out(q, kv[i][0], kv[i][1], n) if n else torch.zeros(1, 1, hq, d, device="cuda")
            for name, o in (("wrapper", outs[i]), ("op_graph", op_outs[i]), ("op_compiled", compiled_snap[i])):
                errs[name] = max(errs[name], max_err(o.float(), ref))
    row["max_err_at_other_lengths"] = errs
    bad = {k: e for k, e in errs.items() if not e < 0.05}
    if bad:
        row["error"] = f"wrong results at other lengths: {bad}"
    return row


def op_check(args, res: dict, save) -> None:
    """The op (hand-captured, and compiled with reduce-overhead) against a hand-captured DecodeWrapper: 16 calls a
    step, device time of a replay, per prompt length; then correctness at other lengths."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    for L in args.lengths:
        try:
            row = op_check_one(args, L, gen)
            print(f"  L={L} op check: wrapper {row['wrapper_us']:.2f} us/call, op captured {row['op_graph_us']:.2f}, "
                  f"op compiled {row['op_compiled_us']:.2f} ({row['op_compiled_over_wrapper']:.3f}x, chain "
                  f"{row['op_compiled_chain_over_wrapper']:.3f}x, host "
                  f"{row['op_compiled_host_us']:.2f}); sdpa captured {row['sdpa_graph_us']:.2f}, compiled "
                  f"{row['sdpa_compiled_us']:.2f} ({row['sdpa_compiled_over_graph']:.3f}x); errors "
                  f"{row['max_err_at_other_lengths']}", flush=True)
        except Exception as e:  # noqa: BLE001 - one length's failure is reported, the rest still run
            row = {"prompt": L, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  L={L} op check: {row['error']}", flush=True)
        res["op_check"][str(L)] = row
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        save()


def _f(x, fmt="{:.2f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) and x == x else "-"


def _speedup(pt: dict, mode: str, sdpa_ms: float, attnplan_ms: float) -> str:
    """A mode's speedup cell: the median per-token ratio with its range, else the ratio of the medians."""
    sp = pt.get(f"{mode}_speedup")
    return f"{sp['median']:.3f}x ({sp['min']:.2f}-{sp['max']:.2f})" if sp else _f(sdpa_ms / attnplan_ms, "{:.2f}x")


def table(res: dict) -> str:
    """The printed summary: ms per new token and speedups, logits errors, the op check."""
    lines = ["ms per new token (median), batch 1, bf16; speedup = sdpa / attnplan, the median of the per-token "
             "ratios of the alternating runs (their range in brackets)",
             "| prompt | eager sdpa | eager attnplan | speedup | compiled sdpa | compiled attnplan | speedup |",
             "|---|---|---|---|---|---|---|"]
    get = lambda pt, k, f="median_ms": pt.get(k, {}).get(f, float("nan"))  # noqa: E731
    for L, pt in res["points"].items():
        es, ea, cs, ca = (get(pt, k) for k in ("eager_sdpa", "eager_attnplan", "compiled_sdpa", "compiled_attnplan"))
        esp, csp = (_speedup(pt, m, x, y) for m, x, y in (("eager", es, ea), ("compiled", cs, ca)))
        lines.append(f"| {int(L):,} | {_f(es)} | {_f(ea)} | {esp} | {_f(cs)} | {_f(ca)} | {csp} |")
    lines += ["", "max |logits - fp32 SDPA logits| over the first decode steps (same weights, same tokens)",
              "| prompt | eager sdpa | eager attnplan | compiled sdpa | compiled attnplan |", "|---|---|---|---|---|"]
    for L, pt in res["points"].items():
        errs = [get(pt, k, "logits_err") for k in ("eager_sdpa", "eager_attnplan", "compiled_sdpa",
                                                    "compiled_attnplan")]
        lines.append(f"| {int(L):,} | " + " | ".join(_f(e, "{:.3g}") for e in errs) + " |")
    lines += ["", "eager: host time of the transformers attention call (us; no sync), median per call and summed per "
                  "token (every layer's call, the first layer's plan() of each step included)",
              "| prompt | sdpa per call | attnplan per call | sdpa per token | attnplan per token |", "|---|---|---|---|---|"]
    for L, pt in res["points"].items():
        h = [pt.get(k, {}).get("attn_host_us", {}) for k in ("eager_sdpa", "eager_attnplan")]
        lines.append(f"| {int(L):,} | {_f(h[0].get('median_call'), '{:.1f}')} | {_f(h[1].get('median_call'), '{:.1f}')} "
                     f"| {_f(h[0].get('per_token'), '{:.0f}')} | {_f(h[1].get('per_token'), '{:.0f}')} |")
    lines += ["", "16 decode calls per step, CUDA-graph replay device time per call (us); ratio = op / wrapper; "
                  "SDPA's own ratio (compiled / captured by hand) and the compiled steps' host time per call beside it; "
                  "chain: each call's output is the next call's query and the step returns the last one",
              "| prompt | wrapper (by hand) | op (by hand) | op (reduce-overhead) | ratio | sdpa ratio | "
              "host op / sdpa | chain: wrapper | chain: op (reduce-overhead) | chain ratio | max err at other lengths |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for L, row in res["op_check"].items():
        errs = row.get("max_err_at_other_lengths", {})
        lines.append(f"| {int(L):,} | {_f(row.get('wrapper_us'))} | {_f(row.get('op_graph_us'))} | "
                     f"{_f(row.get('op_compiled_us'))} | {_f(row.get('op_compiled_over_wrapper'), '{:.3f}')} | "
                     f"{_f(row.get('sdpa_compiled_over_graph'), '{:.3f}')} | "
                     f"{_f(row.get('op_compiled_host_us'))} / {_f(row.get('sdpa_compiled_host_us'))} | "
                     f"{_f(row.get('wrapper_chain_us'))} | {_f(row.get('op_compiled_chain_us'))} | "
                     f"{_f(row.get('op_compiled_chain_over_wrapper'), '{:.3f}')} | "
                     f"{_f(max(errs.values()) if errs else float('nan'), '{:.3g}')} |")
    errors = [f"{L} {k}: {v['error']}" for L, pt in res["points"].items() for k, v in pt.items()
              if isinstance(v, dict) and "error" in v]
    errors += [f"{L} op check: {row['error']}" for L, row in res["op_check"].items() if "error" in row]
    if errors:
        lines += ["", "errors:"] + [f"  {e}" for e in errors]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,8192,32768", help="comma-separated prompt lengths (tokens)")
    ap.add_argument("--new-tokens", type=int, default=24, help="timed decode steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (compiled: compile, "
                                                          "warm-up run, graph record)")
    ap.add_argument("--keep", type=int, default=4, help="decode steps whose logits are compared with fp32 SDPA")
    ap.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"])
    ap.add_argument("--iters", type=int, default=20, help="timed replays per op-check variant")
    ap.add_argument("--skip-eager", action="store_true")
    ap.add_argument("--skip-compiled", action="store_true")
    ap.add_argument("--skip-op-check", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/hf.json")
    args = ap.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    if not torch.cuda.is_available():
        print("bench_hf needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        import attnplan.hf
    except ImportError as e:  # pragma: no cover - the [test] extra installs transformers
        print(f"bench_hf needs transformers: pip install -e '.[hf]' ({e})", file=sys.stderr)
        return 2
    attnplan.hf.register()
    t0 = time.time()
    res = {"command": " ".join(["python", "benchmarks/bench_hf.py", *(sys.argv[1:] if argv is None else argv)]),
           "env": _env(), "model": {**MODEL, "num_hidden_layers": args.layers, "dtype": "bfloat16", "batch": 1},
           "method": "per new token: the model's forward for one teacher-forced token, host clock between "
                     "synchronizes, median of --new-tokens steps after --warmup; eager = DynamicCache, compiled = "
                     "StaticCache + torch.compile(model.forward, mode='reduce-overhead', fullgraph=True); in each "
                     "mode the two implementations alternate token by token (own model copy and cache each), "
                     "<mode>_speedup = median per-token sdpa / attnplan; logits_err = "
                     "max |logits - fp32 eager SDPA logits| over the first --keep steps; op check = CUDA-graph replay "
                     "device time (L2 flushed) of 16 calls, per call",
           "args": {k: v for k, v in vars(args).items() if k != "out"}, "points": {}, "op_check": {}}

    def save():
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            res["wall_s"] = time.time() - t0
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    if not (args.skip_eager and args.skip_compiled):
        run_model(args, res, save)
    if not args.skip_op_check:
        op_check(args, res, save)
    save()
    print(f"done in {time.time() - t0:.0f} s; results in {args.out or '(not written)'}\n", flush=True)
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
