"""Diagnostic: why is the paged cache slower than the contiguous one at the same point?

The decode grid's points under 0.95x are paged (page 16), where attnplan's step runs 2-5% slower than on the
contiguous cache of the same shape (``benchmarks/results/decode_grid.csv``), while the peers always get a dense
copy. Two suspects:

- the DRAM order of a randomly permuted page pool (the benchmark's block tables are a random permutation);
- the kernel's own cost of paging (the block-table load chain, per-page address arithmetic).

Per shape and backend this times, by CUDA-graph replay (L2 flushed in front, medians, input sets rotated,
the same method as ``bench_decode.py``): the contiguous cache, the paged cache with a random block table, and the
same paged cache with the pages in order (block table = arange). Beside them, a Triton read of the same bytes
page by page through each block table (``gather read``) and the plain streaming read (``bench_decode.read_bound``).
If the in-order paged step matches the contiguous one, the loss is the page order (memory); if it matches the
random one, it is the kernel. A per-head read (``head_read``): one program per (chunk, KV head, sequence)
reading only its head's 16 rows of each page, the decode kernels' access pattern without their compute, through
the random and the in-order table. On an H200 cuda_ptx was 4% slower on random pages than in order at b4 32K and
b16 16K while the whole-page gather read was not; if the per-head read shows the same gap, the cause is the access
pattern's DRAM locality, not the kernel.

For the large-batch points: ``--splits`` (forced split counts, 0 = the planner's) and a fourth cache, ``padded``: the contiguous cache with ``--pad`` tokens of unused room after each sequence, so sequences
start ``(kv + pad) x kv_heads x head_dim`` elements apart instead of a power of two (same bytes read, same
kernel). If ``padded`` (or the random page order) beats ``contig``, concurrently running programs reading at
the same offset of power-of-two-strided sequences collide in DRAM (partition camping), not the kernel.

    python benchmarks/paged_order.py --out order.json
    python benchmarks/paged_order.py --shapes 64/8/128:256:1024 --splits 1,2 --out order.json
"""

import argparse
import dataclasses
import json

import torch
import triton
import triton.language as tl

from attnplan.timing import capture_graphs, time_cuda
from bench_decode import build_sets, read_bound, time_backend


@triton.jit
def _gather_read(K, V, TBL, PARTIAL, PAGE_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    page = tl.load(TBL + pid).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, PAGE_ELEMS, BLOCK):
        offs = page * PAGE_ELEMS + off + tl.arange(0, BLOCK)
        acc += tl.load(K + offs).to(tl.float32) + tl.load(V + offs).to(tl.float32)
    tl.store(PARTIAL + pid, tl.sum(acc, 0))


def gather_read_us(x, table, iters):
    """Graph-replay time (us) of reading every page of ``table`` (flattened) from K and V, one program per page."""
    page_elems = x.k_cache[0].numel()
    block = min(page_elems, 8192)
    tbl = table.flatten().contiguous()
    partial = torch.empty(tbl.numel(), device="cuda", dtype=torch.float32)
    (g,) = capture_graphs(lambda j: _gather_read[(tbl.numel(),)](x.k_cache, x.v_cache, tbl, partial,
                                                               PAGE_ELEMS=page_elems, BLOCK=block, num_warps=8), 1)
    return time_cuda(lambda i: g.replay(), warmup=10, iters=iters, flush=True)["median_us"]


@triton.jit
def _head_read(K, V, TBL, PARTIAL, pages_per_seq, pages_per_prog, HKV: tl.constexpr, D: tl.constexpr,
               PAGE: tl.constexpr):
    """One program per (chunk of pages, KV head, sequence), like the decode kernels' programs (one per work unit
    and KV head): it reads its head's
    ``PAGE`` rows of ``D`` elements (stride ``HKV * D``) from each page of its chunk, in block-table order."""
    chunk, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, PAGE)[:, None] * (HKV * D) + h * D + tl.arange(0, D)[None, :]
    acc = tl.zeros([PAGE, D], dtype=tl.float32)
    first = chunk * pages_per_prog
    for i in range(first, tl.minimum(first + pages_per_prog, pages_per_seq)):
        page = tl.load(TBL + b * pages_per_seq + i).to(tl.int64)
        offs = page * (PAGE * HKV * D) + rows
        acc += tl.load(K + offs).to(tl.float32) + tl.load(V + offs).to(tl.float32)
    tl.store(PARTIAL + (b * HKV + h) * tl.num_programs(0) + chunk, tl.sum(tl.sum(acc, 1), 0))


def head_read(x, table, splits):
    """Launch :func:`_head_read` over ``x``'s paged cache through ``table`` ([batch, pages per sequence]) with
    ``splits`` chunks per sequence; returns the per-program partial sums (fp32)."""
    batch, pps = table.shape
    _, page, hkv, d = x.k_cache.shape
    ppp = -(-pps // splits)
    partial = torch.empty(batch * hkv * splits, device=x.k_cache.device, dtype=torch.float32)
    _head_read[(splits, hkv, batch)](x.k_cache, x.v_cache, table.contiguous(), partial, pps, ppp, HKV=hkv, D=d,
                                     PAGE=page, num_warps=4)
    return partial


def head_read_us(x, table, splits, iters):
    """Graph-replay time (us) of :func:`head_read`: the decode kernels' per-head access pattern, with no compute."""
    (g,) = capture_graphs(lambda j: head_read(x, table, splits), 1)
    return time_cuda(lambda i: g.replay(), warmup=10, iters=iters, flush=True)["median_us"]


def step_us(backend, sets, iters, num_splits=None):
    """Graph-replay step time (us) of ``backend`` on ``sets`` and ``(units, merge)`` of its plan (the units the
    schedule gives the longest sequence, :func:`bench_decode.plan_record`): the benchmark's own
    :func:`bench_decode.time_backend` (which also times the eager call)."""
    res, _ = time_backend(backend, sets, iters, num_splits=num_splits or None)
    return res["graph_us"], res["plan"]["units"], res["plan"]["merge"]


def tag(backend: str, splits: int) -> str:
    """JSON key prefix of one timing: forced split counts get their own keys, the planner's (0) keeps the old ones."""
    return f"{backend}_s{splits}" if splits else backend


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="64/8/128:16:1024,32/8/128:16:1024,32/32/128:4:1024,64/8/128:16:4096,"
                                        "8/1/128:16:16384,32/8/128:4:32768,32/8/128:16:16384")
    ap.add_argument("--backends", default="cuda_ptx,triton")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--splits", default="0", help="split counts to force (up to that many units per sequence), "
                                                  "comma-separated (0 = the planner's)")
    ap.add_argument("--pad", type=int, default=0, help="also time a contiguous cache with this many tokens of room "
                    "after each sequence (0 = not timed)")
    ap.add_argument("--head-splits", type=int, default=8, help="chunks per sequence of the per-head read")
    ap.add_argument("--out")
    a = ap.parse_args()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)
    rows = []
    for s in a.shapes.split(","):
        heads, batch, kv = s.split(":")
        hq, hkv, d = map(int, heads.split("/"))
        batch, kv = int(batch), int(kv)
        nbytes = 2 * batch * kv * hkv * d * 2
        n_sets = max(2, min(8, (512 << 20) // nbytes))
        contig = build_sets(batch, hq, hkv, d, [kv] * batch, None, n_sets, gen)
        paged = build_sets(batch, hq, hkv, d, [kv] * batch, 16, n_sets, gen)
        ordered = [dataclasses.replace(x, block_table=torch.arange(x.block_table.numel(), device="cuda", dtype=torch.int32)
                                       .view_as(x.block_table)) for x in paged]
        caches = [("contig", contig), ("random", paged), ("ordered", ordered)]
        if a.pad:
            def padded(t):
                room = t.new_empty(t.shape[0], t.shape[1] + a.pad, *t.shape[2:])
                room[:, : t.shape[1]].copy_(t)
                return room[:, : t.shape[1]]
            caches.append(("padded", [dataclasses.replace(x, k_cache=padded(x.k_cache), v_cache=padded(x.v_cache))
                                      for x in contig]))
        row = {"heads": [hq, hkv, d], "batch": batch, "kv": kv, "bytes": nbytes, "pad": a.pad,
               "read_us": read_bound(nbytes, a.iters)["read_us"],
               "gather_random_us": gather_read_us(paged[0], paged[0].block_table, a.iters),
               "gather_ordered_us": gather_read_us(paged[0], ordered[0].block_table, a.iters),
               "head_splits": a.head_splits,
               "head_random_us": head_read_us(paged[0], paged[0].block_table, a.head_splits, a.iters),
               "head_ordered_us": head_read_us(paged[0], ordered[0].block_table, a.head_splits, a.iters)}
        names = [n for n, _ in caches]
        for b in a.backends.split(","):
            for ns in map(int, a.splits.split(",")):
                for name, sets in caches:
                    t, got, merge = step_us(b, sets, a.iters, ns)
                    row[f"{tag(b, ns)}_{name}_us"] = t
                    row[f"{tag(b, ns)}_{name}_plan"] = [got, merge]
        rows.append(row)
        del contig, paged, ordered, caches
        torch.cuda.empty_cache()
        print(f"{heads:10s} b{batch:<3d} kv{kv:<6d} read {row['read_us']:6.1f} gather rnd/ord "
              f"{row['gather_random_us']:6.1f}/{row['gather_ordered_us']:6.1f} per-head ({a.head_splits} chunks) "
              f"rnd/ord {row['head_random_us']:6.1f}/{row['head_ordered_us']:6.1f}", flush=True)
        for b in a.backends.split(","):
            for ns in map(int, a.splits.split(",")):
                k = tag(b, ns)
                print(f"    {b:8s} splits {row[f'{k}_contig_plan'][0]:3d}/{row[f'{k}_random_plan'][0]:<3d} "
                      + " ".join(f"{n} {row[f'{k}_{n}_us']:7.1f}" for n in names), flush=True)
    if a.out:
        json.dump({"rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
