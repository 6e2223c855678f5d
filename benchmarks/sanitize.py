"""Small decode workloads for compute-sanitizer (memcheck, racecheck, initcheck) on each backend.

Every merge strategy the backend implements (separate, fused) runs every case. Shapes cover page boundaries
(lengths 15/16/17 with page 16), zero lengths, q_len > 1, a cache larger than the lengths, GQA group 16, the
largest head_dim (256), few rows over many splits, and a long sequence among short ones (the balanced schedule
spreads it over many units). Each result is compared with the float64 reference so a run that "passes" the
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sanitize.py needs a CUDA GPU", file=sys.stderr)
        return 2
    n, merges = run_cases(args.backend)
    print(f"sanitize workload for {args.backend}: {n} runs equal the reference (merges: {', '.join(merges)}; live "
          "and capacity plans)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
