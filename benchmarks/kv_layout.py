"""The KV cache's layout, token-major against head-major, for the same values in one process.

Token-major (NHD: ``[B, T, Hkv, D]`` contiguous, ``[pages, page, Hkv, D]`` paged) is attnplan's default layout and
FlashInfer's ``"NHD"``: a KV head's token rows are ``D`` elements long (256 B at bf16 head_dim 128) and
``Hkv x D`` elements apart. Head-major (HND: ``[B, Hkv, T, D]``, ``[pages, Hkv, page, D]``, FlashInfer's ``"HND"``)
keeps each head's tokens together, as torch SDPA's dense copy does. attnplan reads a head-major cache as a strided
view of the token-major shape (no copy, no option: the kernels take the cache's strides); the step reads the same
bytes either way.

Times are CUDA-graph replays with an L2 flush in front (:func:`peers.time_step`), medians; the read bound is
:func:`bench_decode.read_bound` of the same bytes. Peers: cuDNN (SDPA on its dense head-major copy; ``flash`` and
``flex`` likewise) and, at paged points, FlashInfer's paged decode in both layouts (tensor cores on and off) where
it imports. Outputs are compared (``*_maxdiff``, max abs): each backend's head-major output with its token-major
one, every other output (other backends, FlashInfer) with the first output of the point (the first backend's
token-major one unless it refused). A column that could not run holds its error under ``*_error``.

    python benchmarks/kv_layout.py --heads '32,8,128;28,4,128' --batches 4,16 --kv 16384 --out kv_layout.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from attnplan.testing import make_inputs, problem_of
from bench_decode import environment, read_bound, time_backend
from peers import time_flashinfer, time_peer


def head_major(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(storage, view)``: ``t``'s values head-major (``[B, Hkv, T, D]`` or ``[pages, Hkv, page, D]``, contiguous)
    and the same storage viewed in ``t``'s token-major shape (strides of a permuted tensor)."""
    hm = t.permute(0, 2, 1, 3).contiguous()
    return hm, hm.permute(0, 2, 1, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="32,8,128;28,4,128;64,8,128")
    ap.add_argument("--batches", default="4,16")
    ap.add_argument("--kv", default="16384")
    ap.add_argument("--layouts", default="contig,paged16")
    ap.add_argument("--backends", default="cuda_ptx,triton")
    ap.add_argument("--peers", default="cudnn,flashinfer,flashinfer_tc",
                    help="cudnn / flash / flex on SDPA's dense copy; flashinfer / flashinfer_tc on paged points")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for hs in args.heads.split(";"):
        hq, hkv, d = (int(v) for v in hs.split(","))
        for layout in args.layouts.split(","):
            page = int(layout[5:]) if layout.startswith("paged") else None
            for batch in (int(v) for v in args.batches.split(",")):
                for kv in (int(v) for v in args.kv.split(",")):
                    x = make_inputs(batch, hq, hkv, d, [kv] * batch, page_size=page, dtype=torch.bfloat16,
                                    device="cuda", generator=gen, extra_pages=0)
                    hm_k, vk = head_major(x.k_cache)
                    hm_v, vv = head_major(x.v_cache)
                    xh = dataclasses.replace(x, k_cache=vk, v_cache=vv)
                    nbytes = problem_of(x).bytes_moved()
                    row = {"heads": f"{hq}/{hkv}/{d}", "layout": layout, "batch": batch, "kv": kv, "bytes": nbytes,
                           "read_us": round(read_bound(nbytes, args.iters)["read_us"], 1)}
                    first = None  # (name, output) of the first backend's token-major run

                    def record(key, res, out, mine=None):
                        """``key``'s time (or error) and its output's difference from ``mine`` (the same backend's
                        token-major output) or else from the first backend's."""
                        nonlocal first
                        if out is not None:  # checked whether or not it could be timed
                            if mine is not None:
                                row[f"{key}_maxdiff"] = float((out.float() - mine.float()).abs().max())
                            elif first is None:
                                first = (key, out)
                            else:
                                d = float((out.float() - first[1].float()).abs().max())
                                row[f"{key}_maxdiff_vs_{first[0]}"] = d
                        if "graph_us" in res:
                            row[f"{key}_us"] = round(res["graph_us"], 1)
                        else:
                            row[f"{key}_error"] = res.get("error") or res.get("graph_error") or "no time"

                    for be in args.backends.split(","):
                        mine = None
                        for name, xx in (("nhd", x), ("hnd", xh)):
                            try:
                                r, o = time_backend(be, [xx], args.iters)
                            except Exception as e:  # noqa: BLE001 - a backend that refuses is recorded
                                r, o = {"error": f"{type(e).__name__}: {str(e)[:200]}"}, None
                            if "plan" in r:
                                row[f"{be}_{name}_units"] = r["plan"]["units"]
                            record(f"{be}_{name}", r, o, mine)
                            if name == "nhd":
                                mine = o
                        del mine
                    for peer in args.peers.split(","):
                        if peer not in ("flashinfer", "flashinfer_tc"):  # cudnn, flash, flex: on the dense copy
                            r, o = time_peer(peer, [x], args.iters)
                            record(peer, r, o)
                        elif page is not None:
                            for lay in ("NHD", "HND"):
                                r, o = time_flashinfer([x], args.iters, peer == "flashinfer_tc", kv_layout=lay,
                                                       caches=[(hm_k, hm_v)] if lay == "HND" else None)
                                record(f"{peer}_{lay.lower()}", r, o)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    del x, xh, xx, hm_k, hm_v, vk, vv, first
                    torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python benchmarks/kv_layout.py " + " ".join(
                f"--{k.replace('_', '-')} '{v}'" for k, v in vars(args).items() if k != "out"),
                "env": environment(), "rows": rows}, f, indent=1)
    # the table, last
    keys = list(dict.fromkeys(k.rsplit("_", 1)[0] for r in rows for k in r if k.endswith(("_us", "_error"))))

    def cell(r, k):
        return f"{r[k + '_us']}" if k + "_us" in r else "err" if k + "_error" in r else "-"

    widths = [max(14, len(k)) for k in keys]
    print("heads      layout   batch     kv  " + "  ".join(f"{k:>{n}s}" for k, n in zip(keys, widths)))
    for r in rows:
        print(f"{r['heads']:10s} {r['layout']:8s} {r['batch']:5d} {r['kv']:6d}  "
              + "  ".join(f"{cell(r, k):>{n}}" for k, n in zip(keys, widths)))


if __name__ == "__main__":
    main()
