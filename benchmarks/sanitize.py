"""Small decode workloads for compute-sanitizer (memcheck, racecheck, initcheck) on each backend.

Every merge strategy the backend implements (separate, fused) runs every case. Shapes cover page boundaries
(lengths 15/16/17 with page 16), zero lengths, q_len > 1, a cache larger than the lengths, GQA group 16, the
largest head_dim (256), few rows over many splits, and a long sequence among short ones (the balanced schedule
spreads it over many units); then strided views of every input and output, and offsets past 2^31 elements
(a head-major cache view with head stride 2^30, a paged cache beyond 2^31 elements). Each result is compared with the float64 reference so a run that "passes" the
sanitizer also computed the right thing.

    compute-sanitizer --tool memcheck python3 benchmarks/sanitize.py --backend triton
"""

import argparse
import sys

import torch

import attnplan
from attnplan import reference
from attnplan.testing import assert_close_to_reference, make_inputs

CASES = [
    dict(hq=32, hkv=8, d=128, lens=[15, 16, 17, 0], page=16, q_len=1, splits=0),
    dict(hq=32, hkv=8, d=128, lens=[33, 0, 1], page=16, q_len=4, splits=3),
    dict(hq=64, hkv=4, d=128, lens=[300, 7], page=None, q_len=1, splits=5),
    dict(hq=16, hkv=8, d=256, lens=[513, 64], page=16, q_len=1, splits=2),
    dict(hq=28, hkv=4, d=128, lens=[256, 255], page=64, q_len=3, splits=0),
    # few rows over many splits: the merges' many-split paths
    dict(hq=8, hkv=1, d=128, lens=[9000], page=16, q_len=1, splits=130),
    # a long sequence among short ones and an empty one: many units for one sequence, one for the others
    dict(hq=32, hkv=8, d=128, lens=[20000, 5, 0, 300], page=16, q_len=1, splits=0),
]


def run_cases(backend_name: str, device: str = "cuda", generator: torch.Generator | None = None) -> tuple[int, list]:
    """Every case of :data:`CASES` under every merge strategy the backend implements, each with a live plan
    (:func:`attnplan.decode`) and a capacity plan (the one a CUDA graph captures: more unit slots than the lengths
    use), checked against the float64 reference. Returns ``(runs, merges)``.

    Raises:
        AssertionError: an output differs from the reference beyond :data:`attnplan.testing.TOLERANCES`.
    """
    g = generator if generator is not None else torch.Generator(device=device).manual_seed(0)
    merges = sorted(attnplan.backends.get_backend(backend_name).merge_strategies)
    n = 0
    for merge in merges:
        cfg = attnplan.load_config(split={"merge": merge}, plan_cache={"disk": False})
        for c in CASES:
            x = make_inputs(len(c["lens"]), c["hq"], c["hkv"], c["d"], c["lens"], q_len=c["q_len"], page_size=c["page"],
                            dtype=torch.bfloat16, device=device, generator=g, capacity=max(c["lens"]) + 40)
            ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
            lse = torch.empty(x.q.shape[:3], device=device)
            out = attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=backend_name,
                                  num_splits=c["splits"], lse=lse, config=cfg)
            if device == "cuda":
                torch.cuda.synchronize()
            assert_close_to_reference(out, ref, torch.bfloat16)
            w = attnplan.DecodeWrapper(cfg, backend=backend_name)
            w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=c["splits"], capacity=True)
            out = w.run(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, lse=lse)
            if device == "cuda":
                torch.cuda.synchronize()
            assert_close_to_reference(out, ref, torch.bfloat16)
            n += 2
    return n, merges


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_layout_cases(backend_name: str, device: str = "cuda", generator: torch.Generator | None = None,
                     large: bool = True) -> int:
    """Strided views of every input and output the input contract allows (q's batch and head strides, the cache's
    page / token / head strides, block-table rows of a wider table, out's and lse's leading strides) and, with
    ``large``, offsets past 2^31 elements: a head-major cache view with head stride 2^30 and 3 KV heads, and a paged
    cache of more than 2^31 elements whose block table points past that. Each equals the float64 reference.
    Returns the number of runs."""
    g = generator if generator is not None else torch.Generator(device=device).manual_seed(1)
    n = 0
    for page in (None, 16):
        src = make_inputs(3, 8, 2, 64, [70, 0, 33], q_len=2, page_size=page, dtype=torch.bfloat16, device=device,
                          generator=g, capacity=80)
        b, ql, hq, d = src.q.shape
        q = torch.zeros(b + 1, ql, 2 * hq, d, dtype=src.q.dtype, device=device)[1:, :, ::2]
        q.copy_(src.q)
        n0, t0, hkv, _ = src.k_cache.shape
        k = torch.zeros(n0, 2 * t0, hkv + 1, d, dtype=src.q.dtype, device=device)[:, ::2, 1:]
        k.copy_(src.k_cache)
        v = torch.zeros(n0, t0, hkv, 2 * d, dtype=src.q.dtype, device=device)[..., d:]
        v.copy_(src.v_cache)
        bt = None
        if page:
            bt = torch.zeros(b, 2 * src.block_table.shape[1], dtype=torch.int32, device=device)[:, 3:3 + src.block_table.shape[1]]
            bt.copy_(src.block_table)
        out = torch.full((b, ql + 1, hq, d), float("nan"), dtype=src.q.dtype, device=device)[:, 1:]
        lse = torch.full((b, 3 * ql, hq), float("nan"), device=device)[:, ::3]
        ref, ref_lse = reference.attention(src.q, src.k_cache, src.v_cache, src.seq_lens, src.block_table, src.sm_scale)
        for capacity in (False, True):
            w = attnplan.DecodeWrapper(backend=backend_name)
            w.plan(q, k, v, src.seq_lens, bt, capacity=capacity)
            w.run(q, k, v, src.seq_lens, bt, out=out, lse=lse)
            _sync(device)
            assert_close_to_reference(out, ref, torch.bfloat16)
            assert_close_to_reference(lse, ref_lse, torch.float32, "lse")
            n += 1
    if not large:
        return n
    big = 1 << 30
    # a head-major cache view: head stride 2^30 elements, 3 KV heads (head 2 starts at 2^31)
    lens = [40, 7]
    hkv, d, cap = 3, 64, 48
    kbuf = torch.zeros(hkv * big, dtype=torch.bfloat16, device=device)
    vbuf = torch.zeros(hkv * big, dtype=torch.bfloat16, device=device)
    shape, strides = (2, cap, hkv, d), (cap * d, d, big, 1)
    k, v = kbuf.as_strided(shape, strides), vbuf.as_strided(shape, strides)
    k.copy_(torch.randn(shape, generator=g, device=device).to(torch.bfloat16))
    v.copy_(torch.randn(shape, generator=g, device=device).to(torch.bfloat16))
    q = torch.randn(2, 1, 6, d, generator=g, device=device).to(torch.bfloat16)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    ref, _ = reference.attention(q, k, v, sl, None)
    for capacity in (False, True):
        w = attnplan.DecodeWrapper(backend=backend_name)
        w.plan(q, k, v, sl, capacity=capacity)
        out = w.run(q, k, v, sl)
        _sync(device)
        assert_close_to_reference(out, ref, torch.bfloat16)
        n += 1
    del kbuf, vbuf, k, v
    if device == "cuda":
        torch.cuda.empty_cache()
    # a paged cache of more than 2^31 elements; the block table points to pages past 2^31 elements
    page, hkv, d = 16, 8, 128
    pages = (1 << 31) // (page * hkv * d) + 64
    kc = torch.empty(pages, page, hkv, d, dtype=torch.bfloat16, device=device)
    vc = torch.empty(pages, page, hkv, d, dtype=torch.bfloat16, device=device)
    lens = [100, 33]
    bt = torch.tensor([[pages - 1 - i for i in range(8)], [pages - 20 - i for i in range(8)]], dtype=torch.int32,
                      device=device)
    for row in bt.tolist():
        for p in row:
            kc[p].copy_(torch.randn(page, hkv, d, generator=g, device=device).to(torch.bfloat16))
            vc[p].copy_(torch.randn(page, hkv, d, generator=g, device=device).to(torch.bfloat16))
    q = torch.randn(2, 1, 32, d, generator=g, device=device).to(torch.bfloat16)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    ref, _ = reference.attention(q, kc, vc, sl, bt)
    for capacity in (False, True):
        w = attnplan.DecodeWrapper(backend=backend_name)
        w.plan(q, kc, vc, sl, bt, capacity=capacity)
        out = w.run(q, kc, vc, sl, bt)
        _sync(device)
        assert_close_to_reference(out, ref, torch.bfloat16)
        n += 1
    del kc, vc
    if device == "cuda":
        torch.cuda.empty_cache()
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", required=True)
    ap.add_argument("--no-large", action="store_true", help="skip the cases with offsets past 2^31 elements")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sanitize.py needs a CUDA GPU", file=sys.stderr)
        return 2
    n, merges = run_cases(args.backend)
    n_layout = run_layout_cases(args.backend, large=not args.no_large)
    print(f"sanitize workload for {args.backend}: {n} runs equal the reference (merges: {', '.join(merges)}; live "
          f"and capacity plans), and {n_layout} runs of strided views and offsets past 2^31 elements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
