"""Small decode workloads for compute-sanitizer (memcheck, racecheck, initcheck) on each backend.

Every merge strategy and intra-program partition the backend implements runs every case. Shapes
cover page boundaries (lengths 15/16/17 with page 16), zero lengths, q_len > 1, a
padded capacity grid, GQA group 16, the largest head_dim (256), and few rows over many splits. Each result is compared
with the float64 reference so a run that "passes" the sanitizer also computed the right thing.

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
    # few rows over many splits: Triton's column-sliced merge and cuda_ptx's multi-team merge
    dict(hq=8, hkv=1, d=128, lens=[9000], page=16, q_len=1, splits=130),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    backend = attnplan.backends.get_backend(args.backend)
    # every plan axis the backend implements: merge strategies (atomic needs deterministic: false)
    # and intra-program partitions, each over every case
    axes = [(m, p) for m in sorted(backend.merge_strategies) for p in sorted(backend.partitions)]
    n = 0
    for merge, partition in axes:
        cfg = attnplan.load_config(split={"merge": merge, "partition": partition}, deterministic=merge != "atomic",
                                   plan_cache={"disk": False})
        for c in CASES:
            x = make_inputs(len(c["lens"]), c["hq"], c["hkv"], c["d"], c["lens"], q_len=c["q_len"], page_size=c["page"],
                            dtype=torch.bfloat16, device="cuda", generator=g, capacity=max(c["lens"]) + 40)
            lse = torch.empty(x.q.shape[:3], device="cuda")
            out = attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=args.backend,
                                  num_splits=c["splits"], lse=lse, config=cfg)
            torch.cuda.synchronize()
            ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
            assert_close_to_reference(out, ref, torch.bfloat16)
            n += 1
    print(f"sanitize workload for {args.backend}: {n} cases equal the reference "
          f"(merge x partition: {', '.join(f'{m}/{p}' for m, p in axes)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
