"""Long-tailed batches under CUDA-graph replay: a capacity plan (made once, before capture) against a live plan
(made for each length vector) and FlashInfer's paged decode (tensor cores on and off), with the bare read of the
live bytes as the floor, all in one process on one paged cache.

For each (heads, batch, length distribution) the benchmark draws ``--vectors`` seeded length vectors, builds one
page pool that serves all of them (the serving-system picture: one pool, block tables change), and times, per
vector, the graph replay of one decode step (L2 flushed in front: device time of every kernel of the step):

- attnplan ``capacity``: ``DecodeWrapper.plan(..., capacity=True)`` once for the whole point, one graph per vector
  (same plan, each vector's lengths and block table), replayed;
- attnplan ``live``: ``plan()`` from the vector's own lengths (``seq_lens_host``), captured and replayed;
- FlashInfer ``BatchDecodeWithPagedKVCacheWrapper`` with and without tensor cores: ``plan()`` on the host for the
  vector (its balanced split), ``run()`` captured and replayed;
- attnplan ``invariant`` (``--invariant``, on by default): the capacity plan with ``split.batch_invariant: true``
  (each sequence's units from its own length: bitwise the same output whatever its batchmates), its cost beside
  the default;
- ``read``: one streaming-read kernel over as many bytes as the step must move (K + V of the live tokens, q, out).

Every output is checked against a float32 reference on the GPU before it is timed. The table printed last gives,
per point, the means over its vectors; the JSON has every vector. Distributions (tokens, capped at ``--capacity``):
``lognormal`` (median capacity / 16, sigma 1.2), ``bimodal`` (10% of the batch, rounded: 2 of 16, 6 of 64, in
[capacity / 2, capacity], the rest in [16, 2048)),
``one_long`` (one sequence at the capacity, the rest in [16, 2048)).

Usage (GPU machine)::

    python benchmarks/bench_longtail.py --out benchmarks/results/longtail.json
    python benchmarks/bench_longtail.py --backends cuda_ptx --no-flashinfer --configs benchmarks/configs/tail-programs.yaml
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
import zlib

import torch

import attnplan
import attnplan.testing
from attnplan.timing import capture_graphs, time_cuda

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import environment  # noqa: E402
from flashinfer_peer import FlashInferDecode, load as load_flashinfer  # noqa: E402

DISTS = ("lognormal", "bimodal", "one_long")


def draw_lengths(dist: str, batch: int, cap: int, seed: int) -> list[int]:
    """One seeded length vector (tokens, each in [1, cap])."""
    rng = random.Random(seed)
    if dist == "lognormal":
        return [max(1, min(cap, int(math.exp(rng.gauss(math.log(cap / 16), 1.2))))) for _ in range(batch)]
    if dist == "bimodal":
        n_long = max(1, round(0.1 * batch))
        lens = [rng.randrange(cap // 2, cap + 1) for _ in range(n_long)] + [rng.randrange(16, 2048)
                                                                            for _ in range(batch - n_long)]
        rng.shuffle(lens)
        return lens
    if dist == "one_long":
        lens = [rng.randrange(16, 2048) for _ in range(batch)]
        lens[rng.randrange(batch)] = cap
        return lens
    raise ValueError(f"unknown distribution {dist!r}; expected one of {DISTS}")


def reference_out(q, k_cache, v_cache, lens, bt, page):
    """float32 decode attention per sequence on the GPU: ``[batch, 1, Hq, D]``."""
    b_, _, hq, d = q.shape
    hkv = k_cache.shape[2]
    out = torch.empty(b_, 1, hq, d, dtype=torch.float32, device=q.device)
    for b, n in enumerate(lens):
        pages = bt[b, : -(-n // page)].long()
        k = k_cache[pages].reshape(-1, hkv, d)[:n].float()
        v = v_cache[pages].reshape(-1, hkv, d)[:n].float()
        qq = q[b, 0].float().view(hkv, hq // hkv, d)
        s = torch.einsum("hgd,nhd->hgn", qq, k) / math.sqrt(d)
        out[b, 0] = torch.einsum("hgn,nhd->hgd", torch.softmax(s, -1), v).reshape(hq, d)
    return out


def max_err(out, ref) -> float:
    """:func:`attnplan.testing.max_seq_rel_error`: the largest difference per sequence, relative to its largest
    output element."""
    return attnplan.testing.max_seq_rel_error(out, ref)


_READ: dict = {}


def read_us(nbytes: int, iters: int) -> float:
    """Graph-replay device time of one streaming read of ``nbytes`` (4,096-element tiles, L2 flushed in front)."""
    if nbytes not in _READ:
        from attnplan._read_kernel import streaming_read

        n = -(-nbytes // 2)
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        partial = torch.empty(-(-n // 4096), device="cuda", dtype=torch.float32)
        (g,) = capture_graphs(lambda j: streaming_read(x, partial, 4096), 1)
        _READ[nbytes] = time_cuda(lambda i: g.replay(), warmup=10, iters=iters, flush=True)["median_us"]
        del x, partial, g
    return _READ[nbytes]


def scaled_plan(w, scale: float) -> None:
    """Replace ``w``'s capacity plan by the same plan with its long-tailed targets table (entries 32-63) scaled by
    ``scale`` and the unit slots the new table needs (what ``cost_model.tail_target_scale`` would plan), through
    ``DecodeWrapper.use_plan`` (a workspace to match; run() then launches this plan)."""
    import dataclasses

    from attnplan.schedule import NUM_BUCKETS, max_units_bound

    plan = w.plan_
    s = plan.schedule
    base = s.targets[NUM_BUCKETS:]
    tail = tuple([0] + [max(1, round(t * scale)) if t else 0 for t in base[1:]])
    targets = s.targets[:NUM_BUCKETS] + tail
    p = plan.problem
    cap_units = p.batch * min(s.max_units_per_seq, -(-(-(-p.capacity // s.granule)) // s.min_unit_granules))
    sched = dataclasses.replace(s, targets=targets,
                                max_units=min(max_units_bound(targets, p.batch, s.max_units_per_seq), cap_units))
    w.use_plan(dataclasses.replace(plan, schedule=sched))


def graph_time(step, iters: int) -> float:
    (g,) = capture_graphs(lambda j: step(), 1)
    t = time_cuda(lambda i: g.replay(), warmup=10, iters=iters, flush=True)["median_us"]
    del g
    return t


def checked_time(w, q, k_cache, v_cache, sl, bt, ref, what: str, iters: int) -> tuple[float, float]:
    """Run ``w`` once on these inputs, check its output against ``ref`` (:func:`max_err` under
    :data:`attnplan.testing.BENCH_CHECK_REL`, else AssertionError naming ``what``), then time its captured step:
    ``(graph replay us, relative error)``."""
    out = torch.empty_like(q)
    w.run(q, k_cache, v_cache, sl, bt, out=out)
    torch.cuda.synchronize()
    err = max_err(out, ref)
    assert err < attnplan.testing.BENCH_CHECK_REL, \
        f"{what}: error {err:.3g} of a sequence's largest output element"
    return graph_time(lambda: w.run(q, k_cache, v_cache, sl, bt, out=out), iters), err


def shuffled_block_table(lens, page: int, pages_per_seq: int, pool: int, gen) -> torch.Tensor:
    """A block table int32 ``[len(lens), pages_per_seq]`` on the GPU whose sequences (``lens``: tokens each) hold
    ``ceil(n / page)`` distinct pages each of a pool of ``pool`` pages, in a random order drawn from ``gen`` (one
    ``randperm``); unused columns hold page 0. The caller sizes the pool (at least the sequences' pages) and the rows
    (``pages_per_seq``)."""
    need = [-(-n // page) for n in lens]
    perm = torch.randperm(pool, generator=gen, device="cuda").to(torch.int32)
    bt = torch.zeros(len(lens), pages_per_seq, dtype=torch.int32, device="cuda")
    off = 0
    for b, p in enumerate(need):
        bt[b, :p] = perm[off: off + p]
        off += p
    return bt


def run_point(hq, hkv, d, batch, dist, args, fi, gen) -> dict:
    page, cap = args.page, args.capacity
    vecs = [draw_lengths(dist, batch, cap, seed=zlib.crc32(f'{dist}-{batch}-{hq}-{hkv}-{d}-{v}'.encode()))
            for v in range(args.vectors)]
    pages_per_seq = cap // page
    need = max(sum(-(-n // page) for n in lens) for lens in vecs)
    pool = need + 1
    k_cache = torch.randn(pool, page, hkv, d, generator=gen, device="cuda").to(torch.bfloat16)
    v_cache = torch.randn(pool, page, hkv, d, generator=gen, device="cuda").to(torch.bfloat16)
    inputs = []
    for lens in vecs:
        bt = shuffled_block_table(lens, page, pages_per_seq, pool, gen)
        q = torch.randn(batch, 1, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
        sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        inputs.append((q, sl, bt, lens))
    refs = [reference_out(q, k_cache, v_cache, lens, bt, page) for q, sl, bt, lens in inputs]
    kv_token_bytes = hkv * d * 2 * 2
    res = {"heads": [hq, hkv, d], "batch": batch, "dist": dist, "page": page, "capacity": cap,
           "vectors": [{"lens_sum": sum(l), "lens_max": max(l), "lens_min": min(l)} for l in vecs]}
    for vi, (q, sl, bt, lens) in enumerate(inputs):
        nbytes = sum(lens) * kv_token_bytes + 2 * q.numel() * 2
        res["vectors"][vi]["read_us"] = read_us(nbytes, args.iters)
        res["vectors"][vi]["bytes"] = nbytes
    for be in args.backends:
        try:
            w = attnplan.DecodeWrapper(backend=be)
            q0, sl0, bt0, _ = inputs[0]
            plan = w.plan(q0, k_cache, v_cache, sl0, bt0, capacity=True)
            res.setdefault("plans", {})[be] = {"capacity": plan.explain(inputs[0][3]).splitlines()}
            for vi, (q, sl, bt, lens) in enumerate(inputs):
                v = res["vectors"][vi]
                v[f"{be}_capacity_us"], v[f"{be}_capacity_err"] = checked_time(
                    w, q, k_cache, v_cache, sl, bt, refs[vi], f"{be} capacity plan, vector {vi}", args.iters)
                wl = attnplan.DecodeWrapper(backend=be)
                wl.plan(q, k_cache, v_cache, sl, bt, seq_lens_host=lens)
                v[f"{be}_live_us"], _ = checked_time(wl, q, k_cache, v_cache, sl, bt, refs[vi],
                                                     f"{be} live plan, vector {vi}", args.iters)
                if vi == 0:
                    res["plans"][be]["live"] = wl.explain(lens).splitlines()
            variants = []  # (result key, wrapper with its capacity plan)
            for scale in args.tail_scales:  # the capacity plan with its long-tailed targets table rescaled
                sw = attnplan.DecodeWrapper(backend=be)
                sw.plan(q0, k_cache, v_cache, sl0, bt0, capacity=True)
                scaled_plan(sw, scale)
                variants.append((f"tail{scale:g}", sw))
            for path in args.configs:  # the capacity plan of another config file (e.g. benchmarks/configs/*.yaml)
                cw = attnplan.DecodeWrapper(path, backend=be)
                cw.plan(q0, k_cache, v_cache, sl0, bt0, capacity=True)
                variants.append((config_key(path), cw))
            if args.invariant:  # split.batch_invariant: each sequence's units from its own length alone
                iw = attnplan.DecodeWrapper(attnplan.load_config(split={"batch_invariant": True}), backend=be)
                iw.plan(q0, k_cache, v_cache, sl0, bt0, capacity=True)
                variants.append(("invariant", iw))
            for name, vw in variants:
                for vi, (q, sl, bt, lens) in enumerate(inputs):
                    res["vectors"][vi][f"{be}_{name}_us"], _ = checked_time(
                        vw, q, k_cache, v_cache, sl, bt, refs[vi], f"{be} {name} plan, vector {vi}", args.iters)
        except Exception as e:  # noqa: BLE001 - one backend's failure is reported, the rest still run
            res.setdefault("errors", {})[be] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  {be}: {res['errors'][be]}", flush=True)
    if fi is not None:
        for tc in (False, True):
            name = "fi_tc" if tc else "fi"
            try:
                for vi, (q, sl, bt, lens) in enumerate(inputs):
                    pe = FlashInferDecode(fi, hq, hkv, d, page, batch, need + batch, tc)
                    pe.plan(lens, bt)
                    out = torch.empty_like(q)
                    pe.run(q, k_cache, v_cache, out)
                    torch.cuda.synchronize()
                    err = max_err(out, refs[vi])
                    assert err < attnplan.testing.BENCH_CHECK_REL, \
                        f"FlashInfer ({name}): error {err:.3g} of a sequence's largest output at vector {vi}"
                    res["vectors"][vi][f"{name}_us"] = graph_time(lambda: pe.run(q, k_cache, v_cache, out), args.iters)
            except Exception as e:  # noqa: BLE001
                res.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  {name}: {res['errors'][name]}", flush=True)
    del k_cache, v_cache, inputs, refs
    torch.cuda.empty_cache()
    return res


def config_key(path: str) -> str:
    """The result key of a ``--configs`` file: ``cfg_<file stem>`` (``benchmarks/configs/tail-programs.yaml`` ->
    ``cfg_tail-programs``)."""
    return "cfg_" + os.path.splitext(os.path.basename(path))[0]


def summarize(pt: dict, backends, tail_scales=(), configs=()) -> dict:
    """Per point: means over vectors of the best backend's capacity / live times, FlashInfer's best, the read."""
    vs = pt["vectors"]

    def best(v, suffix):
        ts = [v[f"{b}{suffix}"] for b in backends if f"{b}{suffix}" in v]
        return min(ts) if ts else float("nan")

    cap = [best(v, "_capacity_us") for v in vs]
    live = [best(v, "_live_us") for v in vs]
    fi = [min([v[k] for k in ("fi_us", "fi_tc_us") if k in v] or [float("nan")]) for v in vs]
    rd = [v["read_us"] for v in vs]
    gm = lambda xs: math.exp(statistics.fmean(math.log(x) for x in xs)) if all(x == x and x > 0 for x in xs) else float("nan")  # noqa: E731
    out = {"capacity_us": statistics.fmean(cap), "live_us": statistics.fmean(live), "fi_us": statistics.fmean(fi),
           "read_us": statistics.fmean(rd), "cap_over_live": gm([c / l for c, l in zip(cap, live)]),
           "fi_over_cap": gm([f / c for f, c in zip(fi, cap)]), "read_over_cap": gm([r / c for r, c in zip(rd, cap)])}
    inv = [best(v, "_invariant_us") for v in vs]
    if all(x == x for x in inv):  # the batch-invariant capacity plan (best backend) against the default's
        out["invariant_us"] = statistics.fmean(inv)
        out["invariant_over_cap"] = gm([i / c for i, c in zip(inv, cap)])
    # the rescaled long-tailed tables and the other configs' capacity plans against the plan as made, per backend
    for name in [f"tail{scale:g}" for scale in tail_scales] + [config_key(c) for c in configs]:
        for b in backends:
            key = f"{b}_{name}_us"
            if all(key in v and f"{b}_capacity_us" in v for v in vs):
                out[f"{b}_{name}_over_cap"] = gm([v[key] / v[f"{b}_capacity_us"] for v in vs])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32,8,128;64,8,128;8,1,128;16,8,256",
                    help="';'-separated num_q_heads,num_kv_heads,head_dim")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--dists", default=",".join(DISTS))
    ap.add_argument("--capacity", type=int, default=131072, help="tokens per sequence the cache holds")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--vectors", type=int, default=3, help="length vectors per point")
    ap.add_argument("--backends", default="triton,cuda_ptx")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--tail-scales", default="", help="also time the capacity plan with its long-tailed targets "
                    "scaled by each of these factors (comma-separated), to choose cost_model.tail_target_scale")
    ap.add_argument("--configs", default="", help="also time the capacity plans of these config files (comma-"
                    "separated YAML paths, each merged over plans/default.yaml) against the default's, per backend")
    ap.add_argument("--invariant", action=argparse.BooleanOptionalAction, default=True,
                    help="also time capacity plans with split.batch_invariant (its cost beside the default)")
    ap.add_argument("--out", default="benchmarks/results/longtail.json")
    args = ap.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    args.tail_scales = [float(x) for x in args.tail_scales.split(",") if x]
    args.configs = [c for c in args.configs.split(",") if c]
    for c in args.configs:
        attnplan.load_config(c)  # a bad file fails here, not after the first points
    if not torch.cuda.is_available():
        print("bench_longtail needs a CUDA GPU", file=sys.stderr)
        return 2
    fi, why = (None, "--no-flashinfer") if args.no_flashinfer else load_flashinfer()
    print(f"FlashInfer: {'version ' + fi.__version__ if fi else 'not used (' + why + ')'}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    heads = [tuple(int(x) for x in h.split(",")) for h in args.heads.split(";") if h]
    points, t0 = [], time.time()
    result = {"command": " ".join(["python", "benchmarks/bench_longtail.py", *(argv or sys.argv[1:])]),
              "env": environment(), "flashinfer": fi.__version__ if fi else why, "points": points,
              "method": "CUDA-graph replay, L2 flushed before each replay, median of --iters per vector; means over "
                        "vectors per point; ratios are geometric means of per-vector ratios"}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    for hq, hkv, d in heads:
        for batch in (int(b) for b in args.batches.split(",")):
            for dist in args.dists.split(","):
                pt = run_point(hq, hkv, d, batch, dist, args, fi, gen)
                pt["summary"] = summarize(pt, args.backends, args.tail_scales, args.configs)
                points.append(pt)
                s = pt["summary"]
                print(f"{hq}/{hkv}/{d} b{batch} {dist}: capacity {s['capacity_us']:.1f} us, live {s['live_us']:.1f}, "
                      f"FlashInfer {s['fi_us']:.1f}, read {s['read_us']:.1f} ({time.time() - t0:.0f} s)", flush=True)
                with open(args.out, "w") as f:  # after every point: a run cut short keeps what it measured
                    json.dump(result, f, indent=1)
    print_table(points)
    rs = [pt["summary"]["invariant_over_cap"] for pt in points if "invariant_over_cap" in pt["summary"]]
    if rs:
        g = math.exp(statistics.fmean(math.log(r) for r in rs))
        print(f"batch-invariant capacity plans (split.batch_invariant): time / default's {g:.3f} geomean over "
              f"{len(rs)} points, {min(rs):.3f}-{max(rs):.3f}")
    print_variants(points, [(f"tail{s:g}", f"long-tailed targets x{s:g}") for s in args.tail_scales] +
                   [(config_key(c), c) for c in args.configs], args.backends)
    return 0


def print_variants(points, variants, backends, moved: float = 0.02) -> None:
    """Per backend and variant (``(name, what)``: a rescaled table or a config file), its capacity plans' time over
    the default's: the geometric mean over the points, the range, the points faster / slower by over 1%, then each
    point that moved by more than ``moved``."""
    for name, what in variants:
        for b in backends:
            key = f"{b}_{name}_over_cap"
            rs = [pt["summary"][key] for pt in points if pt["summary"].get(key)]
            if not rs:
                continue
            g = math.exp(statistics.fmean(math.log(r) for r in rs))
            print(f"{b} {what}: time / plan's {g:.3f} (geomean over {len(rs)} points, {min(rs):.3f}-"
                  f"{max(rs):.3f}; faster at {sum(r < 0.99 for r in rs)}, slower at {sum(r > 1.01 for r in rs)})")
            far = [f"{'/'.join(map(str, pt['heads']))} b{pt['batch']} {pt['dist']} {pt['summary'][key]:.3f}"
                   for pt in points if pt["summary"].get(key) and abs(pt["summary"][key] - 1) > moved]
            if far:
                print(f"  moved by more than {moved:.0%}: " + ", ".join(far))


def print_table(points) -> None:
    ok = lambda c: "yes" if c else "NO"  # noqa: E731
    print("\nheads      batch dist       capacity_us  live_us  flashinfer_us  read_us  cap/live  FI/cap  read/cap")
    fis, hits = [], {"fi": 0, "read": 0, "live": 0}
    for pt in points:
        s = pt["summary"]
        h = "/".join(map(str, pt["heads"]))
        print(f"{h:10s} {pt['batch']:5d} {pt['dist']:10s} {s['capacity_us']:11.1f} {s['live_us']:8.1f} "
              f"{s['fi_us']:14.1f} {s['read_us']:8.1f} {s['cap_over_live']:9.3f} {s['fi_over_cap']:7.3f} "
              f"{s['read_over_cap']:9.3f}")
        if s["fi_over_cap"] == s["fi_over_cap"]:
            fis.append(s["fi_over_cap"])
        hits["fi"] += s["fi_over_cap"] >= 1.05
        hits["read"] += s["read_over_cap"] >= 0.90
        hits["live"] += s["cap_over_live"] <= 1.03
    n = len(points)
    gm = math.exp(statistics.fmean(math.log(x) for x in fis)) if fis else float("nan")
    print(f"\ntargets: FI/cap >= 1.05 at {hits['fi']}/{n} ({ok(hits['fi'] == n)}); geomean FI/cap {gm:.3f} "
          f"(>= 1.10: {ok(gm >= 1.10)}); read/cap >= 0.90 at {hits['read']}/{n}; cap/live <= 1.03 at {hits['live']}/{n}")


if __name__ == "__main__":
    sys.exit(main())
