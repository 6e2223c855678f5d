"""cuda_ptx on CPU: NVRTC compiles, ptxas resources, compile errors, launch geometry, argument
packing and the compile cache. Needs NVRTC (pip ``nvidia-cuda-nvrtc``), no GPU; nvcc is optional.

Register limit: the kernels use ``__launch_bounds__(threads)`` with at most 256 threads, so ptxas
may use up to 255 registers (the merge kernel with 8 teams at head_dim 256: 512 threads, 128 registers);
the tests require no spill at all, at most :data:`MAX_REGISTERS` and one program within an SM's register file.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import re
import shutil
import struct
import subprocess
import warnings

import pytest
import torch

from attnplan.backends.base import Workspace
from attnplan.backends.cuda_ptx import BLOCK_N_CAP, CudaPtxBackend
from attnplan.backends.cuda_ptx import args as A
from attnplan.backends.cuda_ptx import runtime as R
from attnplan.backends.cuda_ptx import spec as S
from attnplan.backends.cuda_ptx import nvrtc as N
from attnplan.backends.cuda_ptx._bindings import NvrtcError
from attnplan.backends.cuda_ptx.source import kernel_program
from attnplan.config import load_config
from attnplan.device import CPU_STANDIN
from attnplan.planner import KernelOptions, make_plan
from attnplan.problem import DecodeProblem
from attnplan.schedule import Schedule
from attnplan.state import PartialState

try:
    N.nvrtc_version()
    HAS_NVRTC = True
except Exception:  # noqa: BLE001
    HAS_NVRTC = False
needs_nvrtc = pytest.mark.skipif(not HAS_NVRTC, reason="NVRTC (cuda-python + nvidia-cuda-nvrtc) not loadable")

MAX_REGISTERS = 255
#: decode.cu and its headers
PROG = kernel_program()
ARCHS = [(9, 0), (8, 0)]

# (kind, dtype, head_dim, group, q_len, page_size): head_dim 64/128/256, group 1/4/8, q_len 1 and 4,
# fp16/bf16/fp32, paged and contiguous, split and single pass (the merge kernels separately).
SPECS = [
    ("partial", "bfloat16", 128, 4, 1, 16),
    ("single", "bfloat16", 128, 4, 1, None),
    ("partial", "float16", 64, 1, 1, None),
    ("partial", "float16", 256, 8, 1, 64),
    ("partial", "bfloat16", 128, 8, 4, 16),
    ("single", "float32", 128, 4, 4, 1),
    ("partial", "float32", 256, 1, 1, None),
    ("partial", "bfloat16", 96, 7, 1, 16),
]


def spec_id(s) -> str:
    kind, dt, d, g, q, p = s[:6]
    extra = "".join(f"-{v}" for v in (s[6] if len(s) > 6 else {}).values())
    return f"{kind}-{dt}-d{d}-g{g}-q{q}-{'page' + str(p) if p else 'contig'}{extra}"


#: the full tier (tests/conftest.py: a GPU machine, ``--full`` or ATTNPLAN_FULL_TESTS=1)
FULL = pytest.mark.full


def arch_cases(specs, archs=ARCHS, ids=spec_id):
    """``(spec, cc)`` parameters: every spec for the first architecture (sm_90); for the others the first spec in
    the default run and the rest in the full tier (the same source compiled for another architecture: its own
    register allocation and instruction selection, checked on every spec where the full tier runs)."""
    return [pytest.param(sp, cc, id=f"{ids(sp)}-sm_{cc[0]}{cc[1]}", marks=() if cc == archs[0] or i == 0 else FULL)
            for i, sp in enumerate(specs) for cc in archs]


def arch_params(values, archs=ARCHS, ids=str):
    """``(*value, cc)`` parameters like :func:`arch_cases` for a list of parameter tuples: every value for the first
    architecture, the other architectures for the first value in the default run and the rest in the full tier."""
    return [pytest.param(*v, cc, id=f"{ids(v)}-sm_{cc[0]}{cc[1]}", marks=() if cc == archs[0] or i == 0 else FULL)
            for i, v in enumerate(values) for cc in archs]


FP8 = "float8_e4m3fn"
CORE = {"mma": False}
WS = {"window": True, "softcap": True}
# fp8 KV (q fp16 / bf16) on CUDA cores (mma False; the fp8 tensor-core specs are FP8_MMA_SPECS), the same
# spread of shapes, each (kind, q dtype, head_dim, group, q_len, page_size, make_spec keywords)
FP8_CORE_SPECS = [
    ("partial", "bfloat16", 128, 4, 1, 16, {"kv_dtype": FP8, **CORE}),
    ("single", "float16", 64, 1, 1, None, {"kv_dtype": FP8, **CORE}),
    ("partial", "bfloat16", 256, 8, 1, 64, {"kv_dtype": FP8, **CORE}),
    ("partial", "float16", 128, 8, 4, 16, {"kv_dtype": FP8, **CORE}),        # 32 rows: fp8's most
]


# the tensor-core path (mma.sync m16n8k16; the default for fp16 / bf16 with head_dim % 16 == 0, split-K):
# the target problem, 1-8 n8-tiles of rows in 1-4 row groups, head_dim 64-256 with swizzled (64, 128,
# 256) and padded (80, 96) ring rows, pages 1-64, single pass, window + soft-cap
MMA_SPECS = [
    ("partial", "bfloat16", 128, 4, 1, 16, {}),
    ("partial", "bfloat16", 128, 4, 1, None, {}),
    ("single", "bfloat16", 128, 4, 1, None, {}),
    ("partial", "float16", 64, 1, 1, None, {}),
    ("partial", "float16", 256, 8, 1, 64, {}),
    ("partial", "bfloat16", 128, 8, 4, 16, {}),                              # 32 rows: 2 x 2 n8-tiles
    ("partial", "bfloat16", 128, 16, 4, 16, {}),                             # 64 rows: 4 x 2 n8-tiles
    ("partial", "bfloat16", 96, 7, 1, 16, {}),                               # 12 chunks: padded rows
    ("partial", "bfloat16", 80, 8, 3, 1, {}),                                # page 1, 24 rows
    ("partial", "float16", 64, 16, 3, None, {}),                             # 48 rows: 2 x 3 n8-tiles
    ("partial", "bfloat16", 128, 4, 1, 16, WS),
    ("single", "float16", 128, 8, 1, 16, WS),
    # two n8-tiles a warp at head_dim 64 and several queries (10-16 rows): a stated minimum of one program per SM
    # (layout.cuh) keeps ptxas from spilling to fit 128 registers
    ("single", "float16", 64, 3, 5, None, {}),                               # 15 rows
    ("single", "bfloat16", 64, 8, 2, None, {}),                              # 16 rows
    ("single", "bfloat16", 64, 3, 4, 16, {}),                                # 12 rows, paged
]


# fp8 e4m3fn KV on the tensor cores (the default for fp8 split-K): 32-token tiles for head_dim 128 (16 for 256),
# 1-4 n8-tiles in 1-2 row groups, head_dim 64-256 with swizzled (128, 256) and padded (64:
# 4 -> 5 chunks, 96: 6 -> 7; 80: 5 chunks, odd, unpadded) rows, fp16 and bf16 q (bf16: q moved to fp16),
# contiguous and paged, single pass, window + soft-cap
F8 = {"kv_dtype": FP8}
FP8_MMA_SPECS = [
    ("partial", "bfloat16", 128, 4, 1, 16, F8),                              # the target problem
    ("partial", "float16", 128, 4, 1, 16, F8),
    ("partial", "bfloat16", 128, 4, 1, None, F8),
    ("single", "bfloat16", 128, 4, 1, None, F8),
    ("partial", "bfloat16", 64, 1, 1, None, F8),                             # 64-token tiles
    ("partial", "float16", 256, 8, 1, 64, F8),
    ("partial", "bfloat16", 128, 8, 4, 16, F8),                              # 32 rows: 2 x 2 n8-tiles
    ("partial", "bfloat16", 96, 7, 1, 16, F8),
    ("partial", "bfloat16", 80, 8, 3, 1, F8),                                # page 1, 24 rows, odd chunks
    ("partial", "bfloat16", 128, 1, 3, 16, F8),                              # group 1, q_len 3
    ("partial", "bfloat16", 128, 4, 1, 16, {**F8, **WS}),
    ("single", "float16", 128, 8, 1, 16, {**F8, **WS}),
]


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> N.CompileCache:
    """One compile cache per test run: each specialization compiles once (several tests share some). Under
    pytest-xdist the workers share its directory (in the run's own base temp directory, fresh for every run), so a
    specialization another worker compiled is read from disk (written atomically) instead of compiled again."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # base is <the run's base temp>/popen-gwN
        shared = base.parent / "compile-cache"
        shared.mkdir(exist_ok=True)
        return N.CompileCache(shared)
    return N.CompileCache(tmp_path_factory.mktemp("cc"))


# --------------------------------------------------------------------------------------------------
# (1) NVRTC compiles every representative specialization to a cubin, (2) without spills
# --------------------------------------------------------------------------------------------------
@needs_nvrtc
@pytest.mark.parametrize("s,cc", arch_cases(SPECS))
def test_nvrtc_compiles_cubin_without_spills(s, cc, cache):
    spec = S.make_spec(*s, mma=False)  # the CUDA-core path (MMA_SPECS: the tensor-core one)
    c = PROG.cached(cache, spec.name, spec.options(), N.select_target(cc))
    assert c.target.kind == "cubin" and c.target.arch == f"sm_{cc[0]}{cc[1]}"
    assert len(c.image) > 1000 and c.image[:4] == b"\x7fELF"
    res = _ptxas(c, spec.entry)
    assert res["arch"] == f"sm_{cc[0]}{cc[1]}"
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0, res
    assert 0 < res["registers"] <= MAX_REGISTERS, res
    assert res["registers"] * spec.threads <= 65536, "one program must fit an SM's register file"
    print(f"{spec.name} sm_{cc[0]}{cc[1]}: {res['registers']} regs, spills {res['spill_stores']}/{res['spill_loads']}, "
          f"stack {res['stack']}, dynamic smem {spec.smem_bytes}")


def _ptxas(c, entry: str) -> dict:
    """ptxas's report for ``entry`` (from NVRTC's log, else read from the cubin); fails with the log when there
    is none. When the log has one, the cubin's own counts (:func:`N.cubin_resources`) must agree with it."""
    assert entry in c.resources, (f"no ptxas report for {entry} ({c.source}, {c.target.arch} {c.target.kind}, "
                                  f"{len(c.image)} bytes); log: {c.log!r}")
    res = c.resources[entry]
    if c.target.kind == "cubin" and res.get("from") != "cubin":
        cub = N.cubin_resources(c.image, c.target.arch)[entry]
        assert {k: cub[k] for k in ("registers", "stack", "smem", "barriers")} == \
            {k: res[k] for k in ("registers", "stack", "smem", "barriers")}, (cub, res)
        if res["stack"] == 0:
            assert cub["spill_stores"] == 0 and cub["spill_loads"] == 0
    return res


def _compiled_resources(spec, cc, cache, two_programs: bool = False) -> dict:
    """Compile ``spec`` for ``cc`` and check ptxas's report: no spills, no stack, registers within
    :data:`MAX_REGISTERS` and one program within an SM's register file (with ``two_programs``: two
    programs, for one-row-group specs of at most 128 threads). Returns the resources."""
    c = PROG.cached(cache, spec.name, spec.options(), N.select_target(cc))
    res = _ptxas(c, spec.entry)
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["stack"] == 0, res
    assert 0 < res["registers"] <= MAX_REGISTERS and res["registers"] * spec.threads <= 65536, res
    if two_programs and spec.row_groups == 1 and spec.threads <= 128:
        assert 2 * res["registers"] * spec.threads <= 65536, res
    return res


@needs_nvrtc
@pytest.mark.parametrize("s,cc", arch_cases(FP8_CORE_SPECS))
def test_fp8_core_compile_without_spills(s, cc, cache):
    """fp8 KV specializations on CUDA cores: cubins, no spills, registers within the limit, the fp8 macro set."""
    spec = S.make_spec(*s[:6], **s[6])
    d = spec.defines()
    assert d["ATTNPLAN_KV_FP8"] == 1 and d["ATTNPLAN_MMA"] == 0
    res = _compiled_resources(spec, cc, cache)
    print(f"{spec.name} sm_{cc[0]}{cc[1]}: {res['registers']} regs, spills {res['spill_stores']}/{res['spill_loads']}, "
          f"dynamic smem {spec.smem_bytes}")


@needs_nvrtc
@pytest.mark.parametrize("s,cc", arch_cases(MMA_SPECS))
def test_mma_compiles_without_spills(s, cc, cache):
    """Tensor-core specializations (mma.sync, ldmatrix(.trans), movmatrix, cvt.rn.{bf16,f16}x2): cubins for
    sm_90 and sm_80, no spills, no stack, registers within the limit, two programs' registers per SM for
    one-row-group specs (the 2-programs-per-SM target). The PTX's instructions are checked in
    test_mma_ptx_uses_tensor_core_instructions and test_fp8_mma_ptx_instructions."""
    spec = S.make_spec(*s[:6], **s[6])
    assert spec.mma and spec.defines()["ATTNPLAN_MMA"] == 1 and spec.name.endswith(
        "-mma" + ("-window-softcap" if s[6] else ""))
    res = _compiled_resources(spec, cc, cache, two_programs=True)
    print(f"{spec.name} sm_{cc[0]}{cc[1]}: {res['registers']} regs, spills {res['spill_stores']}/{res['spill_loads']}, "
          f"dynamic smem {spec.smem_bytes}, tile {spec.tile_tokens}, {spec.row_groups}x{spec.n_tiles} n8-tiles")


@needs_nvrtc
@pytest.mark.parametrize("passes,warps,page,cc", arch_params([(2, 2, None), (2, 2, 16), (4, 1, None)],
                                                             ids=lambda v: "-".join(map(str, v))))
def test_mma_larger_warp_tiles_compile_without_spills(passes, warps, page, cc, cache):
    """Option ``passes`` (16-token m-tiles per warp tile, tensor-core path): the tile, the ring and the
    name follow it; cubins without spills within the register limit."""
    spec = S.make_spec("partial", "bfloat16", 128, 4, 1, page, num_warps=warps, passes=passes, mma=True)
    assert spec.mma and spec.passes == passes and spec.tile_tokens == 16 * passes and f"-p{passes}" in spec.name
    assert spec.stage_bytes == 2 * 16 * passes * 128 * 2
    res = _compiled_resources(spec, cc, cache, two_programs=False)
    print(f"{spec.name} sm_{cc[0]}{cc[1]}: {res['registers']} regs, spills {res['spill_stores']}/{res['spill_loads']}, "
          f"dynamic smem {spec.smem_bytes}")


@needs_nvrtc
@pytest.mark.parametrize("args,passes", [(("single", "bfloat16", 128, 1, 1, 2), 8),
                                         # the same 64-page tile (the block-table window's batches) at head_dim 256
                                         pytest.param(("partial", "bfloat16", 256, 1, 1, 1), 4, marks=FULL)],
                         ids=["d128-page2-p8", "d256-page1-p4"])
def test_mma_tiles_over_more_than_32_pages_compile(args, passes, cache):
    """Tensor-core tiles spanning more than 32 pages (64 here) keep the per-page block-table loads: the
    block-table window holds 32 slots per batch (decode.cu, PAGE_WIN)."""
    spec = S.make_spec(*args, mma=True, passes=passes, smem_limit=227 * 1024)
    assert spec.mma and spec.tile_tokens // (args[5]) > 32
    c = PROG.cached(cache, spec.name, spec.options(), N.select_target((9, 0)))
    assert c.image[:4] == b"\x7fELF"


def test_mma_passes_option_is_checked():
    with pytest.raises(ValueError, match="passes 3"):
        S.make_spec("partial", "bfloat16", 128, 4, 1, None, passes=3, mma=True)
    with pytest.raises(ValueError, match="passes 8"):  # 64 rows: 4 n8-tiles per warp take at most 2 m-tiles
        S.make_spec("partial", "bfloat16", 128, 16, 4, None, passes=8, mma=True)
    # an explicit tile never turns into the CUDA-core path: a ring that does not fit, or an invalid count, raises
    with pytest.raises(ValueError, match="shared memory"):
        S.make_spec("partial", "bfloat16", 128, 4, 1, None, num_warps=4, passes=4)
    with pytest.raises(ValueError, match="passes 3"):
        S.make_spec("partial", "bfloat16", 128, 4, 1, None, passes=3)
    # the CUDA-core path ignores it (its tile follows its registers)
    assert S.make_spec("partial", "float32", 128, 4, 1, None, passes=2).passes == \
        S.make_spec("partial", "float32", 128, 4, 1, None).passes


@needs_nvrtc
@pytest.mark.parametrize("s,cc", arch_cases(FP8_MMA_SPECS, [*ARCHS, (8, 9)]))
def test_fp8_mma_compiles_without_spills(s, cc, cache):
    """fp8 KV on the tensor cores: cubins for sm_90 and sm_89 (cvt.rn.f16x2.e4m3x2) and sm_80 (the integer
    decoder), no spills, no stack, registers within the limit, two programs' registers per SM for
    one-row-group specs; at head_dim 128 the tile keeps the bf16 default's bytes (8 KB stages). (These kernels state
    __launch_bounds__(threads, 1): see decode.cu.)"""
    spec = S.make_spec(*s[:6], **s[6])
    suffix = "-kvfp8-mma" + ("-window-softcap" if "window" in s[6] else "")
    assert spec.mma and spec.kv_fp8 and spec.name.endswith(suffix)
    d = spec.defines()
    assert d["ATTNPLAN_MMA"] == 1 and d["ATTNPLAN_KV_FP8"] == 1
    if s[2] == 128:  # the same spec with bf16 KV: the same 8 KB stages, twice the tokens of 1-byte KV
        bf16 = S.make_spec(*s[:6], **{k: v for k, v in s[6].items() if k != "kv_dtype"})
        assert spec.stage_bytes == bf16.stage_bytes == 8192 and spec.tile_tokens == 2 * bf16.tile_tokens
    res = _compiled_resources(spec, cc, cache, two_programs=True)
    print(f"{spec.name} sm_{cc[0]}{cc[1]}: {res['registers']} regs, spills {res['spill_stores']}/{res['spill_loads']}, "
          f"dynamic smem {spec.smem_bytes}, tile {spec.tile_tokens}, stages {spec.stages}, "
          f"{spec.row_groups}x{spec.n_tiles} n8-tiles")


# the fused merge (plan.merge fused; decode.cu's ATTNPLAN_MERGE): the target problem on tensor cores, 2 row groups,
# head_dim 256 (a row's merge team of 2 warps; 1 warp with num_warps 1: 2 slots per thread), fp8 KV on tensor and
# CUDA cores, fp32, window + soft-cap
FU = {"merge": "fused"}
MERGE_SPECS = [
    ("partial", "bfloat16", 128, 4, 1, 16, FU),
    ("partial", "bfloat16", 128, 8, 4, 16, FU),
    ("partial", "float16", 256, 8, 1, 64, FU),
    ("partial", "float16", 256, 1, 1, None, {**FU, **CORE, "num_warps": 1}),
    ("partial", "bfloat16", 128, 4, 1, 16, {**F8, **FU}),
    ("partial", "bfloat16", 128, 4, 1, 16, {**F8, **CORE, **FU}),
    ("partial", "float32", 128, 4, 4, 1, {**FU, **CORE}),
    ("partial", "bfloat16", 96, 7, 1, 16, {**CORE, **FU}),
    ("partial", "bfloat16", 128, 4, 1, 16, {**WS, **FU}),
]


@needs_nvrtc
@pytest.mark.parametrize("s,cc", arch_cases(MERGE_SPECS))
def test_in_kernel_merge_compiles_without_spills(s, cc, cache):
    """Fused-merge partial kernels: cubins for sm_90 and sm_80, no spills, no stack, registers within the
    limit; printed next to the same specialization without the merge (the epilogue runs after the main loop,
    so it should not raise the register peak much)."""
    spec = S.make_spec(*s[:6], **s[6])
    plain = dataclasses.replace(spec, merge="none")
    assert spec.name == plain.name + "-" + s[6]["merge"]
    assert spec.defines()["ATTNPLAN_MERGE"] == S.MERGE_CODES[spec.merge] == 1
    res, base = _compiled_resources(spec, cc, cache), _compiled_resources(plain, cc, cache)
    print(f"{spec.name} sm_{cc[0]}{cc[1]}: {res['registers']} regs (without the merge {base['registers']}), spills "
          f"{res['spill_stores']}/{res['spill_loads']}, dynamic smem {spec.smem_bytes} (without {plain.smem_bytes})")


@needs_nvrtc
def test_in_kernel_merge_ptx():
    """The fused kernel counts with atom.acq_rel.gpu after a barrier (no per-thread fence) and reads the states
    with ld.global.cg, never the non-coherent path, and triggers no dependent launch (no merge kernel follows); the
    plain partial kernel has none of them (and the PDL trigger); no kernel takes a lock (no CAS, no release
    exchange)."""
    def ptx(**kw):
        spec = S.make_spec("partial", "bfloat16", 128, 4, 1, 16, **kw)
        c = PROG.compile(spec.options(), N.CompileTarget("compute_90", "ptx"))
        return c.image.rstrip(b"\x00").decode()

    plain, fused = ptx(), ptx(merge="fused")
    merge = PROG.compile(S.merge_spec("bfloat16", 128).options(),
                             N.CompileTarget("compute_90", "ptx")).image.decode(errors="replace")
    assert "atom.acq_rel.gpu.global.add.s32" in fused and "ld.global.cg.v4.f32" in fused and "ld.global.cg.f32" in fused
    # one fence, the count's release in the thread that counts: no __threadfence (membar.gl / fence.sc) per thread
    assert "membar.gl" not in fused and "fence.sc" not in fused
    # the function's definition (its parameter list followed by a body, not a declaration), up to the next one
    # (fused_merge's, not fused_merge_rows': a mangled name carries its length, 11)
    start = re.search(r"\.func\s+\S*11fused_merge\S*\s*\([^)]*\)\s*\{", fused).end()
    nxt = re.search(r"\.(func|entry)\s", fused[start:])
    body = fused[start:start + nxt.start()] if nxt else fused[start:]
    assert "bar.sync" in body and "atom.acq_rel.gpu" in body
    assert body.index("bar.sync") < body.index("atom.acq_rel.gpu")  # the states, then the count
    # the merge kernel's merge_row reads the states of an earlier launch through the non-coherent path; the
    # fused merge's never does (fp32 vector loads are only the states')
    assert "ld.global.nc.v4.f32" in merge and "ld.global.nc.v4.f32" not in fused
    assert "griddepcontrol.launch_dependents" not in fused and "griddepcontrol.launch_dependents" in plain
    assert not any(ins in plain for ins in ("atom.", "ld.global.cg", "membar.gl"))
    assert not any(ins in p for p in (plain, fused, merge) for ins in ("atom.acquire", "atom.release", ".cas."))


def test_in_kernel_merge_specs():
    """merge is a partial kernel's option ("none" or "fused"); the fused merge needs no shared memory of its own."""
    for bad in ("tree", "atomic"):
        with pytest.raises(ValueError, match="merge must be one of"):
            S.make_spec("partial", "bfloat16", 128, 4, 1, 16, merge=bad)
    with pytest.raises(ValueError, match="in-kernel merge of the 'partial' kernel"):
        S.make_spec("single", "bfloat16", 128, 4, 1, 16, merge="fused")
    plain = S.make_spec("partial", "bfloat16", 128, 4, 1, 16)
    assert S.make_spec("partial", "bfloat16", 128, 4, 1, 16, merge="fused").smem_bytes == plain.smem_bytes
    assert "ATTNPLAN_MERGE" not in S.merge_spec("bfloat16", 128).defines()


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fp8_mma_ptx_instructions(dtype):
    """The fp8 tensor-core spec's PTX: fp16 mma.sync (q bf16 or fp16), ldmatrix(.trans), movmatrix, and for
    sm_89 and sm_90 cvt.rn.f16x2.e4m3x2 (no integer fallback's mul.rn.f16x2); for sm_80 the fallback, no e4m3 cvt."""
    spec = S.make_spec("partial", dtype, 128, 4, 1, 16, kv_dtype=FP8)

    def ptx(arch):
        c = PROG.compile(spec.options(), N.CompileTarget(arch, "ptx"))
        return c.image.rstrip(b"\x00").decode()

    p90, p80 = ptx("compute_90"), ptx("compute_80")
    for p in (p90, p80):
        for ins in ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                    "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "movmatrix.sync.aligned.m8n8.trans.b16",
                    "cvt.rn.f16x2.f32"):
            assert ins in p, ins
        assert "bf16.bf16" not in p and "cvt.rn.bf16x2.f32" not in p  # every fp8 mma is fp16
    assert "cvt.rn.f16x2.e4m3x2" in p90 and "mul.rn.f16x2" not in p90
    assert "cvt.rn.f16x2.e4m3x2" not in p80 and "mul.rn.f16x2" in p80
    p89 = ptx("compute_89")  # Ada has the e4m3 conversion too
    assert "cvt.rn.f16x2.e4m3x2" in p89 and "mul.rn.f16x2" not in p89


@needs_nvrtc
def test_mma_ptx_uses_tensor_core_instructions():
    """The tensor-core spec's PTX holds the mma / ldmatrix / movmatrix instructions; the CUDA-core one none."""
    def ptx(**kw):
        spec = S.make_spec("partial", "bfloat16", 128, 4, 1, 16, **kw)
        c = PROG.compile(spec.options(), N.CompileTarget("compute_90", "ptx"))
        return c.image.rstrip(b"\x00").decode()

    on, off = ptx(), ptx(mma=False)
    for ins in ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "movmatrix.sync.aligned.m8n8.trans.b16",
                "cvt.rn.bf16x2.f32"):
        assert ins in on and ins not in off, ins


@needs_nvrtc
@pytest.mark.parametrize("kind,dtype,group,page,kw", [("single", "bfloat16", 8, 16, {}),
                                                      ("partial", "float32", 4, None, {}),
                                                      ("single", "bfloat16", 8, 16, {"kv_dtype": FP8}),
                                                      ("single", "bfloat16", 8, 16, {"kv_dtype": FP8, **CORE}),
                                                      ("partial", "float16", 4, None, {"kv_dtype": FP8, **CORE})])
def test_variant_kernels_compile_without_spills(kind, dtype, group, page, kw, cache):
    """Sliding window + soft-cap compiled in (sinks are a run-time pointer of every kernel)."""
    spec = S.make_spec(kind, dtype, 128, group, 1, page, window=True, softcap=True, **kw)
    assert spec.name.endswith("-window-softcap") and spec.defines()["ATTNPLAN_WINDOW"] == 1
    c = PROG.cached(cache, spec.name, spec.options(), N.select_target((9, 0)))
    res = _ptxas(c, spec.entry)
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["registers"] <= MAX_REGISTERS, res
    print(f"{spec.name} sm_90: {res['registers']} regs, spills {res['spill_stores']}/{res['spill_loads']}")


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [16, 64, 256])
def test_merge_kernel_compiles(dtype, head_dim, cache):
    spec = S.merge_spec(dtype, head_dim)
    c = PROG.cached(cache, spec.name, spec.options(), N.select_target((9, 0)))
    res = _ptxas(c, "attnplan_merge")
    assert res["spill_stores"] == 0 and res["registers"] <= 128
    assert spec.threads == max(32, -(-head_dim // 4 // 32) * 32)
    assert res["barriers"] == 0 and res["smem"] == 0 and spec.smem_bytes == 0  # one team: no barrier, no smem


# the merge kernel with several teams per CTA (decode.cu's ATTNPLAN_MERGE_TEAMS; spec.merge_teams): 2 and 8
# teams, head_dim 64 / 128 (one-warp teams, 16-split chunks) and 256 (two-warp teams, 8-split chunks)
MERGE_TEAM_SPECS = [(dt, d, t) for t in (2, 8) for d in (64, 128, 256) for dt in ("bfloat16", "float16")]


@needs_nvrtc
# float16's teams in the full tier: the teams merge fp32 states, only the output's conversion is the dtype's (bfloat16
# compiles every head_dim and team count in the default run; float16's one-team merges: test_merge_kernel_compiles)
@pytest.mark.parametrize("dtype,head_dim,teams,cc",
                         [p if p.values[0] == "bfloat16" else pytest.param(*p.values, id=p.id, marks=FULL)
                          for p in arch_params(MERGE_TEAM_SPECS, ids=lambda v: "-".join(map(str, v)))])
def test_merge_teams_compile_without_spills(dtype, head_dim, teams, cc, cache):
    """Merge kernels of 2 and 8 teams: cubins for sm_90 and sm_80, no spills, no stack, registers within the
    limit and one CTA within an SM's register file (``__launch_bounds__`` of teams x team threads: 512 at
    head_dim 256 x 8 teams), one barrier (the teams' combine), the teams' results in dynamic shared memory."""
    spec = S.merge_spec(dtype, head_dim, teams)
    res = _compiled_resources(spec, cc, cache)
    assert res["barriers"] == 1 and res["smem"] == 0, res  # dynamic, not static, shared memory
    assert spec.threads == teams * (64 if head_dim == 256 else 32) and spec.smem_bytes == teams * (head_dim + 2) * 4
    print(f"{spec.name} sm_{cc[0]}{cc[1]}: {res['registers']} regs, spills {res['spill_stores']}/{res['spill_loads']}, "
          f"stack {res['stack']}, threads {spec.threads}, dynamic smem {spec.smem_bytes}")


def test_merge_teams_rule():
    """spec.merge_teams: one team when the rows fill the SMs or one 16-split chunk holds the splits, else the
    smallest power of two with teams x 16 >= splits, at most 8; counts below 1 are errors."""
    assert S.MERGE_CHUNK == 16 and S.MAX_MERGE_TEAMS == 8
    assert S.merge_teams(8, 128, 132) == 8  # the measured case: b1, 1 KV head, 8 query heads, 128 splits
    assert [S.merge_teams(8, n, 132) for n in (1, 16, 17, 32, 33, 64, 65, 128, 129, 4096)] == \
        [1, 1, 2, 2, 4, 4, 8, 8, 8, 8]
    assert S.merge_teams(131, 128, 132) == 8 and S.merge_teams(132, 128, 132) == 1 and S.merge_teams(500, 128, 132) == 1
    assert S.merge_teams(1, 40, 1) == 1  # one SM: the row fills it
    for bad in ((0, 8, 132), (8, 0, 132), (8, 8, 0)):
        with pytest.raises(ValueError, match="merge_teams"):
            S.merge_teams(*bad)


def test_merge_teams_spec_and_launch_config():
    """The teams count goes into the spec's name, defines, threads and dynamic shared memory, and the launch
    config passes them; one team keeps the old name, no shared memory; bad counts and kinds are refused."""
    one, t8, t2 = S.merge_spec("bfloat16", 128), S.merge_spec("bfloat16", 128, 8), S.merge_spec("float16", 256, 2)
    assert one == S.merge_spec("bfloat16", 128, 1) and one.teams == 1
    assert (one.name, one.threads, one.smem_bytes) == ("merge-bfloat16-d128", 32, 0)
    assert (t8.name, t8.threads, t8.smem_bytes) == ("merge-bfloat16-d128-t8", 256, 8 * 130 * 4)
    assert (t2.name, t2.threads, t2.smem_bytes) == ("merge-float16-d256-t2", 128, 2 * 258 * 4)
    assert S.merge_spec("float16", 64, 4).threads == 128  # head_dim 64: a whole warp per team (16 column threads)
    assert one.defines()["ATTNPLAN_MERGE_TEAMS"] == 1 and one.defines()["ATTNPLAN_SMEM_BYTES"] == 0
    assert t8.defines()["ATTNPLAN_MERGE_TEAMS"] == 8 and t8.defines()["ATTNPLAN_SMEM_BYTES"] == 4160
    assert t8.defines()["ATTNPLAN_THREADS"] == 256 and "-DATTNPLAN_MERGE_TEAMS=8" in t8.options()
    cfg = S.merge_launch_config(t8, 8)
    assert cfg.grid == (8, 1, 1) and cfg.block == (256, 1, 1) and cfg.smem == 4160
    assert S.merge_launch_config(one, 8).smem == 0
    for bad in (0, 3, 16, -2):
        with pytest.raises(ValueError, match="merge teams must be one of"):
            S.merge_spec("bfloat16", 128, bad)
    with pytest.raises(ValueError, match="teams"):
        S.KernelSpec("partial", "bfloat16", 128, teams=2)
    with pytest.raises(ValueError, match="teams"):
        S.KernelSpec("merge", "bfloat16", 128, teams=3)
    with pytest.raises(ValueError, match="merge kernel's spec"):
        S.merge_launch_config(S.make_spec("partial", "bfloat16", 128, 4, 1, 16), 8)


def test_backend_merge_teams_from_plan():
    """The backend's merge spec takes its teams from the plan's rows (batch x q_len x q heads for a forced count, one
    sequence's q_len x q heads for a schedule from the lengths), its most units per sequence and the device's SM
    count (the CPU stand-in's 8 without a GPU; the plan's fingerprint when no device is given)."""
    be = CudaPtxBackend()
    cfg = load_config(split={"merge": "separate"})

    def plan(batch, q_heads, splits, q_len=1):
        prob = DecodeProblem(batch, q_heads, 1, 128, q_len, 16, "bfloat16", "bfloat16", 4096, 4096 * batch)
        kc = be.kernel_config(prob, {}, torch.device("cpu"))
        p = make_plan(prob, CPU_STANDIN, cfg, "cuda_ptx", kc, num_splits=splits)
        assert p.num_splits == splits and p.merge == "separate"
        return p

    few = plan(1, 4, 40)  # 4 rows < 8 SMs, 40 splits: 4 teams of 16 splits
    assert CPU_STANDIN.sm_count == 8 and be.merge_teams_for(few) == 4 == be.merge_teams_for(few, torch.device("cpu"))
    assert be.spec_for("merge", few) == S.merge_spec("bfloat16", 128, 4)
    assert be.spec_for("merge", few).name == "merge-bfloat16-d128-t4"
    assert be.merge_teams_for(plan(1, 4, 16)) == 1  # one chunk
    assert be.merge_teams_for(plan(2, 4, 128)) == 1  # 8 rows fill the 8 SMs
    assert be.merge_teams_for(plan(1, 2, 128, q_len=3)) == 8  # 6 rows (q_len counts)
    assert be.merge_teams_for(dataclasses.replace(few, device=few.device._replace(sm_count=4))) == 1
    # schedules that size units from the lengths: one long sequence's rows may hold most units whatever the batch,
    # so the rows that count are one sequence's (q heads x q_len: 4 here), not the batch's that fill the 8 SMs, while
    # the batch's 8-team CTAs stay within MERGE_THREADS_PER_SM (1,024) threads per SM: 1,024 x 8 = 8,192 threads,
    # i.e. 32 rows of 256 threads (head_dim 128) or 16 rows of 512 (head_dim 256); past that the batch's rows decide
    assert S.merge_spec("bfloat16", 128, 8).threads == 256 and S.merge_spec("bfloat16", 256, 8).threads == 512
    for batch, heads, q_len, head_dim, teams in ((2, 4, 1, 128, 8), (8, 4, 1, 128, 8), (9, 4, 1, 128, 1),
                                                 (8, 2, 2, 128, 8), (9, 2, 2, 128, 1), (4, 4, 1, 256, 8),
                                                 (5, 4, 1, 256, 1)):
        prob = DecodeProblem(batch, heads, 1, head_dim, q_len, 16, "bfloat16", "bfloat16", 4096, 4096 * batch)
        kc = be.kernel_config(prob, {}, torch.device("cpu"))
        for split in ({"merge": "separate"}, {"merge": "separate", "batch_invariant": True}):
            p = make_plan(prob, CPU_STANDIN, load_config(split=split), "cuda_ptx", kc, capacity_mode=True)
            s = p.schedule
            assert s.policy in ("balanced", "batch_invariant") and p.merge == "separate" and s.max_units_per_seq > 64
            assert be.merge_teams_for(p) == teams, (batch, heads, q_len, head_dim, split)
    forced = plan(4, 4, 128)  # 16 rows of a forced count: they fill the SMs
    assert forced.schedule.policy == "forced" and be.merge_teams_for(forced) == 1


@needs_nvrtc
def test_merge_teams_host_kernel_disagreement_fails_compile(cache):
    """decode.cu static_asserts the host's merge threads and dynamic shared memory for a teams spec, and the
    teams count itself."""
    spec = S.merge_spec("bfloat16", 128, 8)

    def with_(name, value):
        return [o if not o.startswith(f"-D{name}=") else f"-D{name}={value}" for o in spec.options()]

    target = N.CompileTarget("sm_90", "cubin")
    with pytest.raises(NvrtcError, match="disagree on dynamic shared memory"):
        PROG.cached(cache, "mismatch-smem", with_("ATTNPLAN_SMEM_BYTES", spec.smem_bytes + 16), target)
    with pytest.raises(NvrtcError, match="disagree on merge threads"):
        PROG.cached(cache, "mismatch-threads", with_("ATTNPLAN_THREADS", 128), target)
    with pytest.raises(NvrtcError, match="merge teams per CTA"):
        PROG.cached(cache, "mismatch-teams", with_("ATTNPLAN_MERGE_TEAMS", 3), target)


@needs_nvrtc
def test_merge_teams_ptx():
    """One team: no barrier, no shared memory in the PTX; 8 teams: one bar.sync and shared-memory stores and
    loads; both wait for the partial grid first (griddepcontrol.wait on sm_90) and read the states through the
    non-coherent path (an earlier launch's)."""
    def ptx(teams):
        spec = S.merge_spec("bfloat16", 128, teams)
        return PROG.compile(spec.options(),
                                N.CompileTarget("compute_90", "ptx")).image.rstrip(b"\x00").decode()

    one, eight = ptx(1), ptx(8)
    assert "bar.sync" not in one and "st.shared" not in one and "ld.shared" not in one
    assert eight.count("bar.sync") == 1 and "st.shared.v4.f32" in eight and "ld.shared.v4.f32" in eight
    for p in (one, eight):
        body = p[p.index(".entry attnplan_merge"):]
        assert "griddepcontrol.wait" in body and "ld.global.nc.v4.f32" in body
        assert body.index("griddepcontrol.wait") < body.index("ld.global")


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("s", [(*SPECS[0], CORE), FP8_CORE_SPECS[0], MMA_SPECS[0], FP8_MMA_SPECS[0]]
                         + [pytest.param(s, marks=FULL) for s in ((*SPECS[4], CORE), SPECS[5], FP8_CORE_SPECS[3],
                                                                  MMA_SPECS[6])], ids=spec_id)
def test_nvcc_ptxas_verbose_no_spills(s, tmp_path):
    """The same source through nvcc's ptxas (another toolkit version than the pip NVRTC): the target problem on
    each path (CUDA cores, fp8 on CUDA cores, tensor cores, fp8 on tensor cores) in the default run, more shapes in
    the full tier (NVRTC's ptxas checks every one of them in the default run)."""
    spec = S.make_spec(*s[:6], **(s[6] if len(s) > 6 else {}))
    src = tmp_path / "decode.cu"
    src.write_text(PROG.flattened())
    cmd = [NVCC, "-cubin", "-arch=sm_90", "-std=c++17", "-Xptxas", "-v", *[o for o in spec.options() if o.startswith("-D")],
           str(src), "-o", str(tmp_path / "k.cubin")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = N.parse_ptxas_info(r.stdout + r.stderr)[spec.entry]
    print(f"nvcc {spec.name}: {res}")
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["registers"] <= MAX_REGISTERS, res


def test_parse_ptxas_info():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k1' for 'sm_90'
ptxas info    : Function properties for k1
ptxas         .     8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 200 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compiling entry function 'k2' for 'sm_80'
ptxas info    : Function properties for k2
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers
"""
    info = N.parse_ptxas_info(log)
    assert info["k1"] == {"arch": "sm_90", "registers": 200, "spill_stores": 12, "spill_loads": 16, "stack": 8,
                          "smem": 1024, "barriers": 1}
    assert info["k2"]["registers"] == 40 and info["k2"]["spill_stores"] == 0 and info["k2"]["arch"] == "sm_80"


# --------------------------------------------------------------------------------------------------
# (3) compile errors carry NVRTC's log
# --------------------------------------------------------------------------------------------------
@needs_nvrtc
def test_compile_error_has_nvrtc_log(cache):
    bad = 'extern "C" __global__ void k(float* x) { x[0] = undefined_symbol_xyz; }\n'
    with pytest.raises(NvrtcError, match="undefined_symbol_xyz") as ei:
        N.compile_source(bad, "bad.cu", ["-std=c++17"], N.CompileTarget("sm_90", "cubin"))
    assert "nvrtcCompileProgram" in str(ei.value) and "NVRTC_ERROR_COMPILATION" in str(ei.value)
    assert "undefined_symbol_xyz" in ei.value.log


@needs_nvrtc
def test_host_kernel_disagreement_fails_compile(cache):
    """decode.cu static_asserts the host's shared-memory / tile / thread arithmetic."""
    spec = S.make_spec("partial", "bfloat16", 128, 4, 1, 16)
    opts = [o if not o.startswith("-DATTNPLAN_SMEM_BYTES=") else f"-DATTNPLAN_SMEM_BYTES={spec.smem_bytes + 16}"
            for o in spec.options()]
    with pytest.raises(NvrtcError, match="disagree on dynamic shared memory"):
        PROG.cached(cache, "mismatch", opts, N.CompileTarget("sm_90", "cubin"))
    assert not list(cache.path.glob("mismatch*.cubin")), "a failed compile must cache nothing"


# --------------------------------------------------------------------------------------------------
# (4) host side: specs, launch configuration, argument packing
# --------------------------------------------------------------------------------------------------
def test_vector_layout_and_spec_defaults():
    assert S.vector_layout("bfloat16", 128) == {"vec": 8, "dv": 16, "lpt": 16, "nv": 1, "tpp": 2, "elems": 8}
    assert S.vector_layout("float32", 256) == {"vec": 4, "dv": 64, "lpt": 32, "nv": 2, "tpp": 1, "elems": 8}
    assert S.vector_layout("float16", 96)["lpt"] == 16  # 12 vectors padded to 16 lanes
    s = S.make_spec("partial", "bfloat16", 128, 4, 1, 16, mma=False)  # the target problem: 32/8/128 bf16
    assert (s.row_groups, s.kv_warps, s.passes, s.tile_tokens, s.threads) == (1, 4, 4, 8, 128)
    assert s.stage_bytes == 4096 and (s.stages - 1) * s.kv_warps * s.stage_bytes >= 48 * 1024
    assert s.smem_bytes == 4 * s.stages * 4096 and not s.mma and s.row_chunks == 16
    g16 = S.make_spec("partial", "bfloat16", 128, 16, 1, 16, mma=False)
    assert (g16.row_groups, g16.rows_per_group, g16.num_warps) == (2, 8, 8)
    g28 = S.make_spec("partial", "bfloat16", 128, 7, 4, 16, mma=False)
    assert g28.row_groups == 4 and g28.rows_per_group == 7 and g28.num_warps <= S.MAX_WARPS
    assert S.make_spec("partial", "bfloat16", 128, 4, 1, None).page_size == 0
    assert "page16" in s.name and "contig" in S.make_spec("single", "bfloat16", 128, 4, 1, None).name


def test_mma_spec_defaults_and_fallbacks():
    """The tensor-core path is make_spec's default where it serves: one 16-token m-tile per warp tile for
    head_dim 128 (8 KB stages, 2 stages x 4 warps = 64 KB: up to 3 programs per H200 SM, 32 KB in flight
    per program: MMA_INFLIGHT_BYTES, measured),
    rows in n8-tiles (<= 256 / head_dim per warp), XOR-swizzled or padded ring rows; fp8 KV on tensor cores
    too with the tile sized in bytes (twice the tokens); CUDA cores for fp32, head_dim % 16 != 0,
    and where the tensor-core program would not fit."""
    s = S.make_spec("partial", "bfloat16", 128, 4, 1, 16)
    assert s.mma and s.name == "partial-bfloat16-d128-g4-q1-page16-w1x4-s2-p1-mma"
    assert (s.row_groups, s.kv_warps, s.passes, s.tile_tokens, s.threads, s.rows_per_group, s.n_tiles) == \
        (1, 4, 1, 16, 128, 8, 1)
    assert s.row_chunks == 16 and s.stage_bytes == 8192 and s.smem_bytes == 64 * 1024 and s.stages == 2
    assert (s.stages - 1) * s.kv_warps * s.stage_bytes >= S.MMA_INFLIGHT_BYTES
    d64 = S.make_spec("partial", "float16", 64, 4, 1, None)
    assert d64.mma and d64.tile_tokens == 32 and d64.stage_bytes == 8192  # two m-tiles per warp tile
    d96 = S.make_spec("partial", "bfloat16", 96, 4, 1, None)
    assert d96.row_chunks == 13 and d96.stage_bytes == 2 * 16 * 13 * 16  # 12 chunks + 1 padding
    d256 = S.make_spec("partial", "bfloat16", 256, 8, 1, 64)
    assert d256.mma and d256.kv_warps == 3 and d256.smem_bytes <= S.SMEM_BUDGET  # 16 KB stages: fewer warps
    r32 = S.make_spec("partial", "bfloat16", 128, 8, 4, 16)  # 32 rows: 2 row groups of 2 n8-tiles
    assert (r32.row_groups, r32.rows_per_group, r32.n_tiles) == (2, 16, 2)
    r48 = S.make_spec("partial", "float16", 64, 16, 3, None)  # 48 rows at head_dim 64: 3 n8-tiles per warp
    assert (r48.row_groups, r48.n_tiles, r48.passes) == (2, 3, 1)
    r24 = S.make_spec("partial", "bfloat16", 128, 8, 3, 16)  # 24 rows: 3 n8-tiles, 2 per warp, one padded
    assert (r24.row_groups, r24.rows_per_group) == (2, 16)
    # the CUDA-core path where the tensor-core one cannot serve
    for kw, why in (({"dtype": "float32"}, "float16 or bfloat16"), ({"head_dim": 72}, "multiple of 16")):
        a = {"kind": "partial", "dtype": "bfloat16", "head_dim": 128, "group": 4, "q_len": 1, "page_size": 16, **kw}
        assert not S.make_spec(**a).mma
        assert why in S.mma_unsupported(a["dtype"], a["head_dim"], a.get("kv_dtype"))
        with pytest.raises(ValueError, match="mma=True"):
            S.make_spec(**a, mma=True)
    assert S.mma_unsupported("float16", 128) == "" and S.mma_unsupported("bfloat16", 128, FP8) == ""
    assert "KV cache" in S.mma_unsupported("bfloat16", 128, "float16")
    # fp8 e4m3fn KV: the same 8 KB stages hold 32 tokens (2 m-tiles) at head_dim 128: 2 stages x 4 warps = 64 KB,
    # the bf16 default's 32 KB in flight (twice its tokens), soft-cap or not
    f8 = S.make_spec("partial", "bfloat16", 128, 4, 1, 16, kv_dtype=FP8)
    assert f8.mma and f8.kv_fp8 and f8.name == "partial-bfloat16-d128-g4-q1-page16-w1x4-s2-p2-kvfp8-mma"
    assert (f8.passes, f8.tile_tokens, f8.row_chunks, f8.stage_bytes, f8.stages, f8.smem_bytes) == \
        (2, 32, 8, 8192, 2, 64 * 1024)
    inflight = (s.stages - 1) * s.kv_warps * s.stage_bytes
    assert (f8.stages - 1) * f8.kv_warps * f8.stage_bytes == inflight == S.MMA_INFLIGHT_BYTES
    f8c = S.make_spec("partial", "bfloat16", 128, 4, 1, 16, kv_dtype=FP8, window=True, softcap=True)
    assert (f8c.tile_tokens, f8c.stage_bytes, f8c.stages, f8c.smem_bytes) == (32, 8192, 2, 64 * 1024)
    assert S.make_spec("partial", "float16", 64, 1, 1, None, kv_dtype=FP8).row_chunks == 5  # 4 chunks + 1 padding
    assert S.make_spec("partial", "float16", 80, 1, 1, None, kv_dtype=FP8).row_chunks == 5  # odd: no padding
    assert S.make_spec("partial", "float16", 256, 8, 1, 64, kv_dtype=FP8).smem_bytes == 64 * 1024  # 4 warps fit
    assert not S.make_spec("partial", "bfloat16", 128, 4, 1, 16, kv_dtype=FP8, mma=False).mma
    with pytest.raises(ValueError, match="rows"):  # fp8 keeps the CUDA-core path's 32 rows as its fallback
        S.make_spec("partial", "bfloat16", 128, 16, 4, 16, kv_dtype=FP8, mma=True)
    big = S.make_spec("partial", "bfloat16", 256, 16, 4, 16, smem_limit=99 * 1024)  # 8 row groups x 16 KB stages
    assert not big.mma
    with pytest.raises(ValueError, match="shared memory"):
        S.make_spec("partial", "bfloat16", 256, 16, 4, 16, smem_limit=99 * 1024, mma=True)
    assert S.make_spec("partial", "bfloat16", 128, 4, 1, 16, num_warps=2, num_stages=5).stages == 5


def test_spec_limits_raise():
    with pytest.raises(ValueError, match="rows"):
        S.make_spec("partial", "bfloat16", 128, 16, 8, None)  # 128 rows
    with pytest.raises(ValueError, match="num_warps"):
        S.make_spec("partial", "bfloat16", 128, 16, 1, None, num_warps=8)  # 2 row groups x 8
    with pytest.raises(ValueError, match="num_stages"):
        S.make_spec("partial", "bfloat16", 128, 4, 1, None, num_stages=1)
    with pytest.raises(ValueError, match="shared memory"):
        S.make_spec("partial", "bfloat16", 128, 4, 1, None, num_stages=8, smem_limit=48 * 1024)
    with pytest.raises(ValueError, match="head_dim"):
        S.make_spec("partial", "bfloat16", 100, 4, 1, None)
    with pytest.raises(ValueError, match="kind"):
        S.make_spec("merge", "bfloat16", 128, 4, 1, None)


def test_stage_choice_respects_smem_limit():
    full = S.make_spec("partial", "bfloat16", 128, 8, 1, 16, mma=False)
    s = S.make_spec("partial", "bfloat16", 128, 8, 1, 16, smem_limit=40 * 1024, mma=False)
    assert s.smem_bytes <= 40 * 1024 < full.smem_bytes and 2 <= s.stages < full.stages
    # tensor cores: two stages of every warp must fit, so the default KV warps shrink instead
    m = S.make_spec("partial", "bfloat16", 128, 8, 1, 16, smem_limit=40 * 1024)
    assert m.mma and m.smem_bytes <= 40 * 1024 and m.kv_warps == 2 and m.stages == 2
    assert S.make_spec("partial", "bfloat16", 256, 8, 8, 16, smem_limit=227 * 1024).smem_bytes <= S.SMEM_BUDGET


def test_partial_launch_config():
    """The plan's 1-D unit-major grid of units x KV heads as CUDA grid (1, Hkv, units) (no division in the kernel),
    flattened on x past gridDim.y / .z's 65535."""
    s = S.make_spec("partial", "bfloat16", 128, 4, 1, 16)
    cfg = S.partial_launch_config(s, 17, 8)
    assert cfg.grid == (1, 8, 17) and cfg.block == (128, 1, 1) and cfg.smem == s.smem_bytes
    big = S.partial_launch_config(s, 70000, 8)  # units beyond gridDim.z's 65535: flattened on x, unit-major
    assert big.grid == (8 * 70000, 1, 1)
    assert S.partial_launch_config(s, 3, 70000).grid == (3 * 70000, 1, 1)
    for bad in ((0, 8), (4, 0), (2**20, 2**12)):
        with pytest.raises(ValueError):
            S.partial_launch_config(s, *bad)
    m = S.merge_launch_config(S.merge_spec("float16", 256), 4 * 32)
    assert m.grid == (128, 1, 1) and m.block == (64, 1, 1) and m.smem == 0
    m = S.merge_launch_config(S.merge_spec("float16", 256, 4), 3)
    assert m.grid == (3, 1, 1) and m.block == (256, 1, 1) and m.smem == 4 * 258 * 4


@needs_nvrtc
def test_pdl_launch_config_and_griddepcontrol():
    """Programmatic dependent launch: the host config carries the one attribute, the sm_90 PTX has the
    partial kernel's trigger and the merge kernel's wait, and sm_80 code has neither (no such PTX)."""
    from cuda.bindings import driver

    m = S.merge_launch_config(S.merge_spec("bfloat16", 128), 96)
    c = R.pdl_launch_config(m, stream=1234)
    assert (c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.sharedMemBytes) == (96, 1, 1, 32, 0)
    c8 = R.pdl_launch_config(S.merge_launch_config(S.merge_spec("bfloat16", 128, 8), 8))
    assert (c8.gridDimX, c8.blockDimX, c8.sharedMemBytes) == (8, 256, 8 * 130 * 4)  # the teams' dynamic smem
    assert c.numAttrs == 1 and int(c.hStream) == 1234
    assert c.attrs[0].id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert c.attrs[0].value.programmaticStreamSerializationAllowed == 1
    partial = S.make_spec("partial", "bfloat16", 128, 4, 1, None)
    for arch, present in (("compute_90", True), ("compute_80", False)):
        for spec, insn in ((S.merge_spec("bfloat16", 128), "griddepcontrol.wait"),
                           (partial, "griddepcontrol.launch_dependents")):
            ptx = PROG.compile(spec.options(), N.CompileTarget(arch, "ptx")).image.decode()
            assert (insn in ptx) == present, (arch, spec.name)
            if present and spec is partial:
                # the trigger follows the KV stream: after the last cp.async of the ring, so the merge's CTAs,
                # once launched, wait only through the programs' epilogues
                body = ptx[ptx.index(".entry attnplan_decode_partial"):]
                assert body.index(insn) > body.rindex("cp.async.wait_group"), "trigger before the ring's last wait"


def test_packed_args_layout():
    sig = (("p", "ptr"), ("f", "f32"), ("i", "i32"), ("big", "i64"), ("null", "ptr"))
    vals = [0x7F00DEADBEE0, 0.5, -7, 3 * 2**40, None]
    pa = A.PackedArgs(sig, vals)
    base = ctypes.addressof(pa.buffer)
    assert [pa.pointers[i] for i in range(5)] == [base + 8 * i for i in range(5)]
    assert pa.value("p") == 0x7F00DEADBEE0 and pa.value("f") == 0.5 and pa.value("i") == -7
    assert pa.value("big") == 3 * 2**40 and pa.value("null") == 0
    assert ctypes.cast(pa.kernel_params, ctypes.POINTER(ctypes.c_void_p))[3] == base + 24
    with pytest.raises(ValueError):
        A.PackedArgs(sig, vals[:-1])
    with pytest.raises(struct.error):
        A.PackedArgs((("i", "i32"),), [2**31])


def _plan(problem, splits, be=None, merge="separate"):
    be = be or CudaPtxBackend(N.CompileCache(disk=False))
    kc = be.kernel_config(problem, {}, torch.device("cpu"))
    return make_plan(problem, CPU_STANDIN, load_config(split={"merge": merge}), "cuda_ptx", kc, num_splits=splits,
                     merge_strategies=be.merge_strategies)


def _named(values):
    return dict(zip((n for n, _ in A.PARTIAL_SIGNATURE), values))


def test_partial_args_strides_and_workspace():
    """partial_args: the ragged workspace's strides (a buffer wider than the plan's slots), the schedule's integers,
    out's and lse's strides, the workspace's pointers; the single pass gets granule and max_units_per_seq 1, slot
    strides 0 and no schedule or workspace."""
    from attnplan.testing import make_inputs

    x = make_inputs(2, 8, 2, 64, [33, 5], q_len=3, page_size=16, dtype=torch.bfloat16)
    prob = DecodeProblem(2, 8, 2, 64, 3, 16, "bfloat16", "bfloat16", 33)
    be = CudaPtxBackend(N.CompileCache(disk=False))
    plan = _plan(prob, 3, be)
    spec = be.spec_for("partial", plan)
    assert spec.kind == "partial" and plan.merge == "separate"
    u = plan.schedule.max_units + 2
    st = PartialState.empty(1, 3, 8, u, 64)  # buffer wider than the plan
    targets, meta = torch.tensor(plan.schedule.targets, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    out, lse = torch.empty_like(x.q), torch.empty(2, 3, 8)
    vals = A.partial_args(spec, x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, out, lse,
                          schedule=plan.schedule, targets=targets, meta=meta, ws_o=st.o, ws_lse=st.lse)
    named = _named(vals)
    assert (named["o_ss"], named["o_sh"], named["o_si"]) == (64, u * 64, 8 * u * 64)  # strides from the tensors
    assert (named["l_ss"], named["l_sh"], named["l_si"]) == (1, u, 8 * u)
    s = plan.schedule
    assert (named["batch"], named["granule"], named["min_unit_granules"], named["max_units_per_seq"],
            named["balanced"]) == (2, s.granule, s.min_unit_granules, 3, 0)
    assert named["targets"] == targets.data_ptr() and named["meta"] == meta.data_ptr() and named["counters"] == 0
    assert named["ws_o"] == st.o.data_ptr() and named["ws_lse"] == st.lse.data_ptr()
    assert (named["out_sb"], named["out_si"], named["out_sh"]) == (3 * 8 * 64, 8 * 64, 64)
    assert (named["ol_sb"], named["ol_si"], named["ol_sh"]) == (24, 8, 1) and named["out_lse"] == lse.data_ptr()
    assert named["k_s0"] == 16 * 2 * 64 and named["k_s1"] == 2 * 64 and named["k_sh"] == 64
    assert named["bt_sb"] == x.block_table.stride(0) and named["block_table"] == x.block_table.data_ptr()
    assert named["last_page"] == x.k_cache.shape[0] - 1  # the clamp of every block-table entry
    assert named["capacity"] == x.block_table.shape[1] * 16  # the clamp of every length: pages x page size
    assert named["num_kv_heads"] == 2
    assert abs(named["scale_log2"] - x.sm_scale * 1.4426950408889634) < 1e-12
    single_plan = _plan(prob, 1, be)
    single = be.spec_for("partial", single_plan)
    assert single.kind == "single" and single_plan.single_pass
    sv = _named(A.partial_args(single, x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale, out, None))
    assert sv["o_ss"] == sv["l_ss"] == 0 and sv["max_units_per_seq"] == 1 and sv["granule"] == 1
    assert sv["out_lse"] == sv["block_table"] == sv["bt_sb"] == sv["ws_o"] == sv["targets"] == sv["meta"] == 0
    assert sv["last_page"] == 0  # no block table: never read
    assert sv["capacity"] == x.k_cache.shape[1]  # a contiguous cache's token axis
    A.PackedArgs(A.PARTIAL_SIGNATURE, vals)  # every value fits its slot
    balanced = Schedule("balanced", 64, 1, 8, (0, *([3] * 63)), 30)
    assert A.schedule_ints(balanced, 5) == (5, 64, 1, 8, 1) and A.schedule_ints(None, 5) == (5, 1, 1, 1, 0)


def test_64bit_strides_pack():
    """Page index x page stride beyond 2**31 elements travels as int64."""
    q = torch.empty(1, 1, 8, 128, dtype=torch.bfloat16)
    k = torch.empty(140_000, 16, 8, 128, dtype=torch.bfloat16, device="meta")  # shapes and strides only
    spec = S.make_spec("single", "bfloat16", 128, 1, 1, 16)
    vals = A.partial_args(spec, q, k, k, torch.zeros(1, dtype=torch.int32), torch.zeros(1, 8750, dtype=torch.int32),
                          0.1, torch.empty_like(q), None)
    pa = A.PackedArgs(A.PARTIAL_SIGNATURE, vals)
    assert pa.value("k_s0") == 16384 and 139_999 * pa.value("k_s0") > 2**31


def test_64bit_strides_of_every_tensor_pack():
    """Strides beyond 2**31 elements of q, the caches (sequence, token, head), the block table's rows, the ragged
    workspace (query, head, slot), out and lse travel as int64, exactly (meta tensors: shapes and strides only); the
    merge kernel's too."""
    big = 2**33 + 8  # a multiple of 8 (16-byte vectors of bf16) past 2**32

    def strided(shape, strides, dtype=torch.bfloat16):
        return torch.empty(0, dtype=dtype, device="meta").as_strided(shape, strides)

    q = strided((2, 2, 8, 128), (4 * big, 2 * big, big, 1))
    k = strided((2, 64, 2, 128), (3 * big, big, 2 * big, 1))
    bt = strided((2, 4), (big, 1), torch.int32)
    o = strided((1, 2, 8, 4, 128), (5 * big, 4 * big, 3 * big, big, 1), torch.float32)
    lse = strided((1, 2, 8, 4), (4 * big, 3 * big, 2 * big, big), torch.float32)
    out = strided((2, 2, 8, 128), (3 * big, 2 * big, big, 1))
    out_lse = strided((2, 2, 8), (3 * big, 2 * big, big), torch.float32)
    spec = S.make_spec("partial", "bfloat16", 128, 4, 2, 16, merge="fused")
    sched = Schedule("forced", 64, 1, 2, (0,) * 64, 4)
    vals = A.partial_args(spec, q, k, k, torch.zeros(2, dtype=torch.int32), bt, 0.1, out, out_lse, schedule=sched,
                          targets=torch.zeros(64, dtype=torch.int32), counters=torch.zeros(4, dtype=torch.int32),
                          ws_o=o, ws_lse=lse)
    pa = A.PackedArgs(A.PARTIAL_SIGNATURE, vals)
    want = {"q_sb": 4 * big, "q_si": 2 * big, "q_sh": big, "k_s0": 3 * big, "k_s1": big, "k_sh": 2 * big,
            "v_s0": 3 * big, "bt_sb": big, "o_si": 4 * big, "o_sh": 3 * big, "o_ss": big, "l_si": 3 * big,
            "l_sh": 2 * big, "l_ss": big, "out_sb": 3 * big, "out_sh": big, "ol_sb": 3 * big, "ol_sh": big}
    assert {n: pa.value(n) for n in want} == want
    assert all(k == "i64" for n, k in A.PARTIAL_SIGNATURE if n.endswith(("_sb", "_si", "_sh", "_ss", "_s0", "_s1")))
    assert all(k == "i64" for n, k in A.MERGE_SIGNATURE if n.endswith(("_sb", "_si", "_sh", "_ss")))
    mo = strided((1, 2, 8, 300, 128), (5 * big, 4 * big, 3 * big, big, 1), torch.float32)
    mvals = A.merge_args(mo, lse, torch.zeros(4, dtype=torch.int32), out, out_lse)
    mpa = A.PackedArgs(A.MERGE_SIGNATURE, mvals)
    assert (mpa.value("o_si"), mpa.value("o_ss"), mpa.value("out_sh"), mpa.value("l_sh"), mpa.value("batch")) == \
        (4 * big, big, big, 2 * big, 2)


def test_slot_arguments_pack_as_int32_or_are_refused():
    """The spread's window (``partial_args``' ``spread_slots``) and the probe's ``slots`` are int32 kernel arguments:
    0 and 2^31 - 1 pack as given, -1 and 2^31 are refused naming the argument."""
    q = torch.empty(1, 1, 8, 64, dtype=torch.bfloat16)
    k = torch.empty(1, 100, 2, 64, dtype=torch.bfloat16, device="meta")
    spec = S.make_spec("single", "bfloat16", 64, 4, 1, None)
    sched = Schedule("forced", 64, 1, 2, (0,) * 64, 2)
    lens, i32 = torch.zeros(1, dtype=torch.int32), functools.partial(torch.zeros, dtype=torch.int32)

    def partial(n):
        vals = A.partial_args(spec, q, k, k, lens, None, 0.1, torch.empty_like(q), None, spread_slots=n)
        return A.PackedArgs(A.PARTIAL_SIGNATURE, vals).value("spread_slots")

    def probe(n):
        return A.PackedArgs(A.PROBE_SIGNATURE, A.probe_args(lens, i32(64), None, i32(1), i32(8), sched,
                                                            slots=n)).value("slots")

    for pack, name in ((partial, "spread_slots"), (probe, "slots")):
        for n in (0, 2**31 - 1):
            assert pack(n) == n, (name, n)
        for n in (-1, 2**31):
            with pytest.raises(ValueError, match=rf"^{name} must be in \[0, 2\^31\)"):
                pack(n)


@pytest.mark.parametrize("paged", [False, True], ids=["contig", "paged16"])
def test_window_left_packs_any_valid_int(paged):
    """window_left packs for every int the validation allows (>= -1, however large): a window at least the cache's
    capacity is the capacity (it restricts nothing: the emulation tests check the outputs); -1 stays -1, smaller
    windows are exact; below -1 is refused."""
    q = torch.empty(1, 1, 8, 64, dtype=torch.bfloat16)
    k = torch.empty(8 if paged else 1, 16 if paged else 100, 2, 64, dtype=torch.bfloat16, device="meta")
    bt = torch.zeros(1, 6, dtype=torch.int32) if paged else None
    capacity = 96 if paged else 100
    assert A.kv_capacity(k, bt) == capacity
    spec = S.make_spec("single", "bfloat16", 64, 4, 1, 16 if paged else None, window=True)

    def packed(window):
        vals = A.partial_args(spec, q, k, k, torch.zeros(1, dtype=torch.int32), bt, 0.1, torch.empty_like(q), None,
                              window_left=window)
        return A.PackedArgs(A.PARTIAL_SIGNATURE, vals).value("window_left")

    for window, want in ((-1, -1), (0, 0), (17, 17), (capacity - 1, capacity - 1), (capacity, capacity),
                         (capacity + 1, capacity), (2**31 - 1, capacity), (2**31, capacity), (2**63, capacity),
                         (10**40, capacity)):
        assert packed(window) == want, window
    with pytest.raises(ValueError, match="window_left must be >= -1"):
        packed(-2)


def _meta_inputs(batch, hq, hkv, d, pages=300, page=16, max_pages=256, device="meta"):
    """q, a paged cache, seq_lens and a block table, uninitialized (meta: shapes and strides only)."""
    from attnplan.backends.base import DecodeInputs

    dev = dict(device=device, dtype=torch.bfloat16)
    q = torch.empty(batch, 1, hq, d, **dev)
    k = torch.empty(pages, page, hkv, d, **dev)
    return DecodeInputs(q, k, k, torch.empty(batch, device=device, dtype=torch.int32),
                        torch.empty(batch, max_pages, device=device, dtype=torch.int32), 0.1)


def _no_launch(be):
    """Stop the backend before the driver (no GPU); returns the launches' named argument values."""
    launched = []
    be._launch = lambda spec, cfg, sig, values, *a, **kw: launched.append(  # noqa: E731
        (spec, cfg, dict(zip((n for n, _ in sig), values)), kw.get("pdl", a[1] if len(a) > 1 else False)))
    return launched


def test_kv_capacity_over_2_30_is_refused():
    """A cache that holds more than MAX_KV_TOKENS = 2**30 tokens per sequence is refused, naming the tensor that
    makes it so (k_cache for a contiguous cache, block_table for a paged one), before any launch; at the limit it
    is accepted (meta tensors: no data, the refusal comes from the host checks)."""
    from attnplan.backends.base import DecodeInputs

    be = CudaPtxBackend(N.CompileCache(disk=False))
    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(1, 1, 8, 64, **meta)
    sl = torch.empty(1, device="meta", dtype=torch.int32)
    launched = _no_launch(be)
    for paged in (False, True):
        prob = DecodeProblem(1, 8, 1, 64, 1, 16 if paged else None, "bfloat16", "bfloat16", 4096)
        plan = _plan(prob, 4, be)
        ws = Workspace.allocate(plan, torch.device("meta"))
        for tokens, ok in ((2**30, True), (2**30 + 16, False)):
            if paged:
                k = torch.empty(8, 16, 1, 64, **meta)
                x = DecodeInputs(q, k, k, sl, torch.empty(1, tokens // 16, device="meta", dtype=torch.int32), 0.1)
            else:
                k = torch.empty(1, tokens, 1, 64, **meta)
                x = DecodeInputs(q, k, k, sl, None, 0.1)
            if ok:
                be.partial(plan, x, ws, q, None)
            else:
                with pytest.raises(ValueError, match=("block_table's" if paged else "k_cache holds") + ".*2\\*\\*30"):
                    be.partial(plan, x, ws, q, None)
    assert len(launched) == 2


def test_backend_input_checks():
    """Host checks that guard the kernels' assumptions, each tripped once (meta tensors: no data)."""
    from attnplan.backends.base import DecodeInputs

    be = CudaPtxBackend(N.CompileCache(disk=False))
    prob = DecodeProblem(1, 8, 2, 128, 1, 16, "bfloat16", "bfloat16", 4096)
    plan = _plan(prob, 4, be)
    ws = Workspace.allocate(plan, torch.device("meta"))
    x = _meta_inputs(1, 8, 2, 128)
    q, k, sl, bt = x.q, x.k_cache, x.seq_lens, x.block_table
    launched = _no_launch(be)
    be.partial(plan, x, ws, q, None)
    assert len(launched) == 1
    huge = torch.empty(300, 16, 2, 128, device="meta", dtype=torch.bfloat16).as_strided((300, 16, 2, 128),
                                                                                        (2**33, 2**29, 128, 1))
    with pytest.raises(ValueError, match="token stride"):
        be.partial(plan, DecodeInputs(q, huge, huge, sl, bt, 0.1), ws, q, None)
    with pytest.raises(ValueError, match="page size"):
        be.partial(plan, DecodeInputs(q, k[:, :8], k[:, :8], sl, bt, 0.1), ws, q, None)
    with pytest.raises(ValueError, match="KV heads"):
        be.partial(plan, DecodeInputs(q, k[:, :, :1], k[:, :, :1], sl, bt, 0.1), ws, q, None)
    with pytest.raises(ValueError, match="plan is for q"):
        be.partial(plan, DecodeInputs(torch.empty(2, 1, 8, 128, device="meta", dtype=torch.bfloat16), k, k,
                                      torch.empty(2, device="meta", dtype=torch.int32), bt.expand(2, 256), 0.1),
                   ws, q, None)
    with pytest.raises(ValueError, match="window"):
        be.partial(plan, DecodeInputs(q, k, k, sl, bt, 0.1, window_left=16), ws, q, None)
    k8 = torch.empty(300, 16, 2, 128, device="meta", dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale"):  # fp8 without its scales
        be.partial(plan, DecodeInputs(q, k8, k8, sl, bt, 0.1), ws, q, None)
    sc2, sc1 = torch.empty(2, device="meta"), torch.empty(1, device="meta")
    with pytest.raises(ValueError, match="v_scale"):  # one scale per KV head
        be.partial(plan, DecodeInputs(q, k8, k8, sl, bt, 0.1, k_scale=sc2, v_scale=sc1), ws, q, None)
    with pytest.raises(ValueError, match="float8_e4m3fn"):  # K fp8, V not
        be.partial(plan, DecodeInputs(q, k8, k, sl, bt, 0.1, k_scale=sc2, v_scale=sc2), ws, q, None)
    with pytest.raises(ValueError, match="without dequantization scales"):  # scales on a bf16 cache
        be.partial(plan, DecodeInputs(q, k, k, sl, bt, 0.1, k_scale=sc2, v_scale=sc2), ws, q, None)
    with pytest.raises(ValueError, match="k_cache torch.float8_e4m3fn: re-plan"):  # an fp8 cache under a bf16 plan
        be.partial(plan, DecodeInputs(q, k8, k8, sl, bt, 0.1, k_scale=sc2, v_scale=sc2), ws, q, None)
    with pytest.raises(ValueError, match="sinks"):
        be.partial(plan, DecodeInputs(q, k, k, sl, bt, 0.1, sinks=torch.empty(7, device="meta")), ws, q, None)
    with pytest.raises(ValueError, match="out must be"):
        be.partial(plan, x, ws, torch.empty(1, 1, 8, 128, device="meta"), None)
    with pytest.raises(ValueError, match="out must be"):
        be.partial(plan, x, ws, torch.empty(1, 1, 8, 256, device="meta", dtype=torch.bfloat16)[..., ::2], None)
    with pytest.raises(ValueError, match="lse must be"):
        be.partial(plan, x, ws, q, torch.empty(1, 1, 8, device="meta", dtype=torch.float16))
    assert len(launched) == 1


def test_index_tensor_strides():
    """seq_lens with a non-unit stride and block tables with a non-unit column stride (or the wrong dtype) are refused,
    each naming its argument; a block table whose rows are rows of a wider table (row stride > max_pages) is taken,
    its row stride passed to the kernel (meta tensors: no data; the emulation test runs one)."""
    from attnplan.backends.base import DecodeInputs

    be = CudaPtxBackend(N.CompileCache(disk=False))
    prob = DecodeProblem(3, 8, 2, 128, 1, 16, "bfloat16", "bfloat16", 4096)
    plan = _plan(prob, 4, be)
    ws = Workspace.allocate(plan, torch.device("meta"))
    x = _meta_inputs(3, 8, 2, 128, pages=900)
    q, k, sl, bt = x.q, x.k_cache, x.seq_lens, x.block_table
    i32 = dict(device="meta", dtype=torch.int32)
    launched = _no_launch(be)
    be.partial(plan, x, ws, q, None)
    wide = torch.empty(3, 300, **i32)[:, :256]  # rows of a wider table: row stride 300
    be.partial(plan, DecodeInputs(q, k, k, sl, wide, 0.1), ws, q, None)
    assert [v["bt_sb"] for _, _, v, _ in launched] == [256, 300]
    for bad_sl in (torch.empty(6, **i32)[::2], torch.empty(3, device="meta", dtype=torch.int64),
                   torch.empty(3, 1, **i32)):
        with pytest.raises(ValueError, match="seq_lens"):
            be.partial(plan, DecodeInputs(q, k, k, bad_sl, bt, 0.1), ws, q, None)
    for bad_bt in (torch.empty(256, 3, **i32).t(), torch.empty(3, 512, **i32)[:, ::2],
                   torch.empty(3, 256, device="meta", dtype=torch.int64)):
        with pytest.raises(ValueError, match="block_table"):
            be.partial(plan, DecodeInputs(q, k, k, sl, bad_bt, 0.1), ws, q, None)
    assert len(launched) == 2


def test_workspace_checks_and_launches():
    """What each plan's launches take: a single pass one schedule-free kernel (grid (1, Hkv, B)); a separate-merge
    plan the partial kernel with meta and no counters, then the merge kernel with PDL (unless the plan's pdl is off)
    over B x Q x H rows; a fused plan one launch with counters and no meta. Workspaces that do not serve the plan are
    refused naming the buffer (small CPU tensors, uninitialized: the launch stops before the driver)."""
    be = CudaPtxBackend(N.CompileCache(disk=False))
    assert be.merge_strategies == {"separate", "fused"}
    prob = DecodeProblem(2, 8, 2, 128, 1, 16, "bfloat16", "bfloat16", 4096)
    plans = {m: _plan(prob, 4, be, merge=m) for m in ("separate", "fused")}
    single = _plan(prob, 1, be)
    sep, fused = plans["separate"], plans["fused"]
    # the fused counters: 2 (sequence, KV head) groups' per KV head, then one per unit slot and KV head (the
    # two-level merge's team counters)
    words = (2 + fused.schedule.max_units) * 2
    assert fused.merge == "fused" and fused.sync_words == words and sep.meta_words == 4
    assert be.spec_for("partial", fused).merge == "fused" and be.spec_for("partial", sep).merge == "none"
    assert be.spec_for("merge", fused).kind == "merge" and be.spec_for("partial", single).kind == "single"
    with pytest.raises(ValueError, match="kind"):
        be.spec_for("single", sep)
    x = _meta_inputs(2, 8, 2, 128, pages=40, max_pages=16, device="cpu")
    q = x.q
    launched = _no_launch(be)
    dev = torch.device("cpu")
    wss = {"single": Workspace.allocate(single, dev), **{m: Workspace.allocate(p, dev) for m, p in plans.items()}}
    be.run(single, x, wss["single"], q, None)
    be.run(sep, x, wss["separate"], q, None)
    be.run(fused, x, wss["fused"], q, None)
    (s1, c1, v1, _), (s2, c2, v2, _), (s3, c3, v3, pdl3), (s4, c4, v4, _) = launched
    assert s1.kind == "single" and c1.grid == (1, 2, 2) and v1["ws_o"] == 0 and v1["targets"] == 0
    assert s2.kind == "partial" and c2.grid == (1, 2, sep.schedule.max_units) and v2["meta"] != 0 == v2["counters"]
    assert s3.kind == "merge" and c3.grid == (2 * 8, 1, 1) and pdl3 is True
    assert s4.merge == "fused" and v4["counters"] != 0 == v4["meta"] and len(launched) == 4
    be.run(dataclasses.replace(sep, kernel=KernelOptions({**sep.kernel, "pdl": False})), x, wss["separate"], q, None)
    assert launched[-1][0].kind == "merge" and launched[-1][3] is False
    with pytest.raises(ValueError, match="no separate merge"):
        be.merge(fused, wss["fused"], q, None)
    small = Workspace.allocate(dataclasses.replace(sep, schedule=dataclasses.replace(sep.schedule, max_units=2)), dev)
    with pytest.raises(ValueError, match="workspace.state"):
        be.partial(sep, x, small, q, None)
    with pytest.raises(ValueError, match="workspace.meta"):
        be.partial(sep, x, wss["fused"], q, None)
    with pytest.raises(ValueError, match="workspace.counters"):
        be.partial(fused, x, wss["separate"], q, None)
    ws = wss["fused"]
    for bad in (ws.counters[:words - 1], torch.empty(words, dtype=torch.int64),
                torch.empty(words, 2, dtype=torch.int32)[:, 0]):
        with pytest.raises(ValueError, match="workspace.counters"):
            be.partial(fused, x, dataclasses.replace(ws, counters=bad), q, None)
    with pytest.raises(ValueError, match="workspace.targets"):
        be.partial(fused, x, dataclasses.replace(ws, targets=ws.targets[:32]), q, None)
    with pytest.raises(ValueError, match="workspace has no state"):
        be.partial(sep, x, wss["single"], q, None)
    with pytest.raises(ValueError, match="out must be"):
        be.merge(sep, wss["separate"], torch.empty(2, 1, 8, 128), None)


def test_check_layout_rejects_misaligned():
    t = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    A.check_layout("q", t, 8, 16)
    with pytest.raises(ValueError, match="q"):
        A.check_layout("q", t[..., 1:], 8, 16)
    with pytest.raises(ValueError, match="unit stride"):
        A.check_layout("q", t.transpose(1, 2), 8, 16)


@needs_nvrtc
@pytest.mark.parametrize("kind,signature", [("partial", A.PARTIAL_SIGNATURE), ("merge", A.MERGE_SIGNATURE),
                                            ("fp8-core", A.PARTIAL_SIGNATURE), ("core", A.PARTIAL_SIGNATURE),
                                            ("fused", A.PARTIAL_SIGNATURE), ("fused-core", A.PARTIAL_SIGNATURE),
                                            ("single", A.PARTIAL_SIGNATURE), ("probe", A.PROBE_SIGNATURE)])
def test_signature_matches_ptx_entry(kind, signature):
    """The host's argument list equals the kernel's parameter list (sizes and float slots) in the PTX."""
    extra = {"fp8-core": {"kv_dtype": FP8, **CORE}, "core": CORE, "fused": {"merge": "fused"},
             "fused-core": {"merge": "fused", **CORE}}.get(kind, {})
    if kind == "merge":
        spec = S.merge_spec("bfloat16", 128)
    else:
        spec = S.make_spec("single" if kind == "single" else "partial", "bfloat16", 128, 4, 1, 16, **extra)
        spec = dataclasses.replace(spec, probe=kind == "probe")
    c = PROG.compile(spec.options(), N.CompileTarget("compute_90", "ptx"))
    ptx = c.image.rstrip(b"\x00").decode()
    m = re.search(r"\.entry\s+" + spec.entry + r"\s*\((.*?)\)", ptx, re.S)
    assert m, ptx[:2000]
    types = re.findall(r"\.param\s+\.(\w+)", m.group(1))
    size = {"u64": 8, "b64": 8, "s64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4}
    assert [size[t] for t in types] == A.expected_param_sizes(signature)
    assert [i for i, t in enumerate(types) if t == "f32"] == [i for i, (_, k) in enumerate(signature) if k == "f32"]


@needs_nvrtc
def test_last_page_capacity_and_spread_slots_are_the_last_parameters_and_read():
    """``last_page``, the clamp of every block-table entry, then ``capacity``, the clamp of every length, then
    ``spread_slots``, the spread's window, come after every other parameter (those keep the order the single pass's
    registers were measured with: the single pass's 34 come first, then the schedule's and the workspace's); every
    paged kernel reads ``last_page`` (the block-table window of a tile in one page and of PAGE_REG's pages, the
    per-chunk loads; partial, single pass, fused merge), a contiguous one never does; every kernel reads ``capacity``
    (its lengths), and the probe takes it just before its own ``slots``; the scheduled partial kernels read
    ``spread_slots``, the single pass never does."""
    names = [n for n, _ in A.PARTIAL_SIGNATURE]
    assert A.PARTIAL_SIGNATURE[-3:] == (("last_page", "i32"), ("capacity", "i32"), ("spread_slots", "i32"))
    assert names.count("last_page") == 1 and names.count("capacity") == 1 and names.count("spread_slots") == 1
    assert A.PROBE_SIGNATURE[-2:] == (("capacity", "i32"), ("slots", "i32"))
    assert names.index("targets") == 34 and names[:34][-1] == "l_ss"
    n = names.index("capacity")  # last_page's index + 1
    paged = [("partial", "bfloat16", 128, 4, 1, 16, {}),                         # mma, a tile in one page
             ("single", "bfloat16", 128, 4, 1, 16, {"kv_dtype": FP8}),           # fp8 mma: 2 pages per tile
             ("partial", "bfloat16", 128, 4, 1, 1, {}),                          # mma, per-chunk loads
             ("single", "bfloat16", 128, 4, 1, 64, CORE),                        # CUDA cores, a tile in one page
             ("partial", "bfloat16", 128, 4, 1, 1, CORE),                        # CUDA cores, per-chunk loads
             ("partial", "bfloat16", 128, 4, 1, 16, {"merge": "fused"})]
    contiguous = [("partial", "bfloat16", 128, 4, 1, None, {}), ("single", "bfloat16", 128, 4, 1, None, CORE)]
    for s, reads in [(s, True) for s in paged] + [(s, False) for s in contiguous]:
        spec = S.make_spec(*s[:6], **s[6])
        body, _ = _entry_ptx(spec)
        assert (re.search(r"ld\.param\.u32\s+%r\d+, \[" + spec.entry + f"_param_{n - 1}\\]", body) is not None) \
            == reads, spec.name
        assert re.search(r"ld\.param\.u32\s+%r\d+, \[" + spec.entry + f"_param_{n}\\]", body), spec.name
        assert (re.search(r"ld\.param\.u32\s+%r\d+, \[" + spec.entry + f"_param_{n + 1}\\]", body) is not None) \
            == (spec.kind == "partial"), spec.name


def _entry_ptx(spec, arch="compute_90"):
    """The PTX of ``spec``'s entry (its ``.entry`` to the end of the module) and the whole module."""
    ptx = PROG.compile(spec.options(), N.CompileTarget(arch, "ptx")).image.rstrip(b"\x00").decode()
    return ptx[ptx.index(".entry " + spec.entry):], ptx


@needs_nvrtc
def test_schedule_structure_in_the_ptx():
    """The single pass has no schedule: no call, no shared-memory exchange before its loop; the partial kernel calls
    the prologue and its row writes out of line (schedule_unit, write_rows: inlined they moved the main loop's
    registers), the prologue's warp scan (shfl.sync.up) and ballots are in the module; a probe spec's module holds the
    probe entry beside an identical partial kernel; the NaN isolation's vote exists only for q_len > 1."""
    part = S.make_spec("partial", "bfloat16", 128, 4, 1, 16)
    single = dataclasses.replace(part, kind="single")
    p_body, p_mod = _entry_ptx(part)
    s_body, _ = _entry_ptx(single)
    assert "call" not in s_body.split(".entry")[1] and "shfl.sync.up" not in s_body
    assert p_body.count("call.uni") >= 2 and "schedule_unit" in p_mod and "write_rows" in p_mod
    assert "shfl.sync.up" in p_mod
    probe = dataclasses.replace(part, probe=True)
    assert probe.entry == "attnplan_schedule_probe" and probe.name == part.name + "-probe"
    assert probe.defines()["ATTNPLAN_SCHEDULE_PROBE"] == 1 and "ATTNPLAN_SCHEDULE_PROBE" not in part.defines()
    _, probe_mod = _entry_ptx(probe)
    assert ".entry attnplan_schedule_probe" in probe_mod and ".entry attnplan_decode_partial" in probe_mod
    with pytest.raises(ValueError, match="probe"):
        dataclasses.replace(single, probe=True)
    for spec, has_vote in ((part, False), (single, False), (S.make_spec("partial", "bfloat16", 128, 4, 2, 16), True),
                           (S.make_spec("single", "bfloat16", 128, 4, 2, 16, kv_dtype=FP8), True)):
        assert ("vote.sync.any" in _entry_ptx(spec)[1]) == has_vote, spec.name


@needs_nvrtc
@pytest.mark.parametrize("warps,cc", arch_params([(1,), (4,), (8,)], ids=lambda v: str(v[0])))
def test_schedule_probe_compiles_without_spills(warps, cc, cache):
    """The probe (the prologue with 32, 128 and 256 threads, 8 / 2 / 1 sequences per thread and chunk): a cubin, no
    spills, few registers (it runs before the main loop and holds none of its state)."""
    spec = dataclasses.replace(S.make_spec("partial", "float16", 64, 1, 2, None, num_warps=warps, mma=False,
                                           window=True), probe=True)
    res = _compiled_resources(spec, cc, cache)
    assert res["registers"] <= 64, res


# --------------------------------------------------------------------------------------------------
# backend: support as data, availability, kernel options
# --------------------------------------------------------------------------------------------------
def test_backend_declarations_and_reasons():
    be = CudaPtxBackend(N.CompileCache(disk=False))
    assert be.name == "cuda_ptx"
    ok, why = be.available(torch.device("cpu"))
    assert not ok and why == "cuda_ptx runs only on CUDA devices; on CPU it is compiled and checked, not run"
    assert be.supports(DecodeProblem(1, 32, 8, 128, 1, 16, "bfloat16", "bfloat16", 4096)) == []
    assert be.supports(DecodeProblem(1, 32, 8, 128, 1, 16, "bfloat16", "bfloat16", 4096, window_left=128,
                                     soft_cap=30.0, has_sinks=True)) == []
    assert "fp8_kv" in be.variants and be.merge_strategies == {"separate", "fused"}
    assert be.supports(DecodeProblem(1, 32, 8, 128, 1, 16, "bfloat16", "float8_e4m3fn", 4096, kv_scale="head",
                                     window_left=64, soft_cap=30.0, has_sinks=True)) == []
    assert be.supports(DecodeProblem(1, 32, 8, 128, 1, 16, "float16", "float8_e4m3fn", 4096, kv_scale="tensor")) == []
    fp8 = be.supports(DecodeProblem(1, 8, 1, 72, 1, 16, "bfloat16", "float8_e4m3fn", 4096, kv_scale="head"))
    assert any("multiple of 16" in r for r in fp8)
    fp8 = DecodeProblem(1, 64, 1, 128, 1, 16, "bfloat16", "float8_e4m3fn", 4096, kv_scale="head")
    assert be.supports(fp8) == [] and (be.head_block(fp8), be.q_block(fp8), be.kv_passes(fp8)) == (32, 1, 2)
    # more queries than one program's rows: served in blocks of queries (the plan's q_block), whole GQA groups each
    spec16 = DecodeProblem(1, 64, 8, 128, 16, 16, "bfloat16", "bfloat16", 4096)  # group 8 x 16 queries = 128 rows
    assert be.supports(spec16) == [] and be.q_block(spec16) == 8
    spec16_fp8 = DecodeProblem(1, 64, 8, 128, 16, 16, "bfloat16", "float8_e4m3fn", 4096, kv_scale="head")
    assert be.supports(spec16_fp8) == [] and be.q_block(spec16_fp8) == S.max_rows(S.FP8, 128) // 8 == 4
    assert be.q_block(DecodeProblem(1, 32, 8, 128, 16, 16, "bfloat16", "bfloat16", 4096)) == 16  # 64 rows: one
    assert any("must equal kv_dtype" in r for r in be.supports(DecodeProblem(1, 8, 1, 128, 1, 16, "bfloat16",
                                                                             "float16", 4096)))
    reasons = be.supports(DecodeProblem(1, 128, 1, 100, 1, None, "bfloat16", "bfloat16", 10))
    assert any("head_dim 100" in r for r in reasons) and not any("rows" in r for r in reasons)
    assert be.head_block(DecodeProblem(1, 128, 1, 128, 1, None, "bfloat16", "bfloat16", 10)) == 64


def test_kernel_config_options():
    be = CudaPtxBackend(N.CompileCache(disk=False))
    prob = DecodeProblem(1, 32, 8, 128, 1, 16, "bfloat16", "bfloat16", 131072)
    kc = be.kernel_config(prob, {}, torch.device("cpu"))
    assert kc["mma"] is True and kc["block_n"] == kc["tile_tokens"] * kc["num_warps"] == 64
    assert "partition" not in kc
    core = be.kernel_config(prob, {"mma": False}, torch.device("cpu"))
    assert core["mma"] is False and core["block_n"] == core["tile_tokens"] * core["num_warps"] == 32
    assert be.kernel_config(prob, {"num_warps": 2, "num_stages": 3}, "cpu")["num_stages"] == 3
    assert be.kernel_config(prob, {"threads": 256}, "cpu")["num_warps"] == 8
    with pytest.raises(ValueError, match="block_n"):
        be.kernel_config(prob, {"block_n": 20}, "cpu")
    plan = make_plan(prob, CPU_STANDIN, load_config(), "cuda_ptx", kc, num_splits=17)
    assert plan.schedule.granule % kc["tile_tokens"] == 0 and plan.schedule.max_units_per_seq == 17
    assert be.spec_for("partial", plan) == S.make_spec("partial", "bfloat16", 128, 4, 1, 16, smem_limit=99 * 1024)
    # the default granule: one pass of the warps, at most BLOCK_N_CAP tokens unless one tile is longer
    d32 = be.kernel_config(DecodeProblem(1, 8, 2, 32, 1, 16, "bfloat16", "bfloat16", 200), {}, "cpu")
    assert d32["tile_tokens"] == 64 and d32["num_warps"] == 4 and d32["block_n"] == 128 == BLOCK_N_CAP
    assert be.kernel_config(DecodeProblem(1, 8, 2, 32, 1, 16, "bfloat16", "bfloat16", 200), {"block_n": 256},
                            "cpu")["block_n"] == 256


def test_kernel_config_mma_option():
    """Option ``mma``: auto (default) / false / true; the plan's kernel options and ``explain()`` show the choice and
    ``spec_for`` follows it (single pass and split); true where the path cannot serve is an error naming why."""
    be = CudaPtxBackend(N.CompileCache(disk=False))
    prob = DecodeProblem(1, 32, 8, 128, 1, 16, "bfloat16", "bfloat16", 131072)
    cfg = load_config()
    for opt, want in ((None, True), (True, True), (False, False)):
        kc = be.kernel_config(prob, {"mma": opt}, "cpu")
        plan = make_plan(prob, CPU_STANDIN, cfg, "cuda_ptx", kc, num_splits=8)
        single = make_plan(prob, CPU_STANDIN, cfg, "cuda_ptx", kc, num_splits=1)
        assert kc["mma"] is want and f"'mma': {want}" in plan.explain()
        assert be.spec_for("partial", plan).mma is want and be.spec_for("partial", single).mma is want
        assert be.spec_for("partial", single).kind == "single"
        assert plan.schedule.granule % kc["block_n"] == 0
    for p, why in ((DecodeProblem(1, 32, 8, 128, 1, 16, "float32", "float32", 4096), "float16 or bfloat16"),
                   (DecodeProblem(1, 32, 8, 72, 1, 16, "bfloat16", "bfloat16", 4096), "multiple of 16")):
        assert be.kernel_config(p, {}, "cpu")["mma"] is False
        with pytest.raises(ValueError, match=why):
            be.kernel_config(p, {"mma": True}, "cpu")
    p8 = DecodeProblem(1, 32, 8, 128, 1, 16, "bfloat16", FP8, 4096, kv_scale="head")  # fp8 KV: tensor cores too
    for opt, want in ((None, True), (True, True), (False, False)):
        kc = be.kernel_config(p8, {"mma": opt}, "cpu")
        plan = make_plan(p8, CPU_STANDIN, cfg, "cuda_ptx", kc, num_splits=8)
        assert kc["mma"] is want and be.spec_for("partial", plan).mma is want and be.spec_for("partial", plan).kv_fp8
    with pytest.raises(ValueError, match="mma"):
        be.kernel_config(prob, {"mma": "yes"}, "cpu")


def test_kernel_config_fp8_and_variants_follow_the_plan():
    """fp8 specs follow the plan's kv_dtype, the window and soft-cap variants its problem; the split-V partition is
    gone (no partition option or attribute)."""
    be = CudaPtxBackend(N.CompileCache(disk=False))
    assert not hasattr(be, "partitions")
    cfg = load_config()
    p8 = DecodeProblem(1, 32, 8, 128, 1, 16, "bfloat16", FP8, 131072, kv_scale="head")
    k8 = be.kernel_config(p8, {}, "cpu")
    assert k8["mma"] and k8["tile_tokens"] == 32 and k8["block_n"] == 128  # tensor cores: 2 m-tiles per warp tile
    k8c = be.kernel_config(p8, {"mma": False}, "cpu")
    assert k8c["tile_tokens"] == 16 and k8c["block_n"] == 64  # CUDA cores: 16 fp8 values per lane, 4 tokens a pass
    s8 = be.spec_for("partial", make_plan(p8, CPU_STANDIN, cfg, "cuda_ptx", k8, num_splits=4))
    assert s8.kv_fp8 and s8.kv_dtype == FP8 and s8.dtype == "bfloat16" and s8.layout["vec"] == 16
    pw = DecodeProblem(1, 32, 8, 128, 1, 16, "bfloat16", "bfloat16", 4096, window_left=100, soft_cap=30.0)
    sw = be.spec_for("partial", make_plan(pw, CPU_STANDIN, cfg, "cuda_ptx", be.kernel_config(pw, {}, "cpu"),
                                          num_splits=4))
    assert sw.window and sw.softcap


def test_fp8_layouts():
    assert S.vector_layout(FP8, 128) == {"vec": 16, "dv": 8, "lpt": 8, "nv": 1, "tpp": 4, "elems": 16}
    assert S.max_rows(FP8, 128) == 32 and S.max_rows("bfloat16", 128) == 64
    with pytest.raises(ValueError, match="multiple of 16"):
        S.make_spec("partial", "bfloat16", 72, 4, 1, 16, kv_dtype=FP8)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        S.make_spec("partial", "float32", 128, 4, 1, 16, kv_dtype=FP8)
    with pytest.raises(ValueError, match="rows"):
        S.make_spec("partial", "bfloat16", 128, 16, 4, 16, kv_dtype=FP8)
    k8 = S.make_spec("partial", "bfloat16", 128, 4, 1, 16, kv_dtype=FP8, mma=False)
    assert k8.tile_tokens == 16 and k8.stage_bytes == 4096 and k8.rows_per_group == 4


def test_partial_args_scales():
    from attnplan.testing import make_inputs

    x = make_inputs(1, 8, 2, 64, [33], page_size=16, dtype=torch.bfloat16)
    k8 = x.k_cache.to(torch.float8_e4m3fn)
    ks, vs = torch.ones(2), torch.full((2,), 0.5)
    spec = S.make_spec("single", "bfloat16", 64, 4, 1, 16, kv_dtype=FP8)
    out = torch.empty_like(x.q)
    vals = A.partial_args(spec, x.q, k8, k8, x.seq_lens, x.block_table, x.sm_scale, out, None, k_scale=ks, v_scale=vs)
    named = _named(vals)
    assert named["k_scale"] == ks.data_ptr() and named["v_scale"] == vs.data_ptr()
    assert named["k_s1"] == 2 * 64 and named["k_s0"] == 16 * 2 * 64  # strides in fp8 elements (bytes)
    plain = _named(A.partial_args(spec, x.q, k8, k8, x.seq_lens, x.block_table, x.sm_scale, out, None))
    assert plain["k_scale"] == 0 and plain["v_scale"] == 0


# --------------------------------------------------------------------------------------------------
# (5) the compile cache
# --------------------------------------------------------------------------------------------------
@needs_nvrtc
def test_compile_cache_hits_keys_and_rebuilds(tmp_path):
    spec = S.merge_spec("float16", 64)
    src, heads, opts = PROG.source, PROG.headers, spec.options()

    def get(cache, target=N.CompileTarget("sm_90", "cubin"), options=opts, headers=heads):
        return cache.get(spec.name, src, options, target, headers=headers)

    c1 = N.CompileCache(tmp_path)
    a = get(c1)
    assert c1.stats.compiles == 1 and a.source == "compiled"
    b = get(c1)
    assert c1.stats.memory_hits == 1 and b.image == a.image
    files = list((tmp_path).glob("*.cubin"))
    assert len(files) == 1
    name = files[0].name
    major, minor = N.nvrtc_version()
    assert name.startswith(f"{spec.name}.sm_90.nvrtc{major}.{minor}.") and name.endswith(".cubin")

    c2 = N.CompileCache(tmp_path)  # a new process: disk hit
    d = get(c2)
    assert c2.stats.disk_hits == 1 and c2.stats.compiles == 0 and d.image == a.image and d.resources == a.resources

    # the key includes the architecture, the options and every header's text
    get(c2, target=N.CompileTarget("sm_80", "cubin"))
    get(c2, options=opts + ["-DATTNPLAN_UNUSED=1"])
    edited = tuple((n, t + "\n// an edit\n" if n == "state.cuh" else t) for n, t in heads)
    get(c2, headers=edited)
    assert c2.stats.compiles == 3 and len(list(tmp_path.glob("*.cubin"))) == 4
    key = N.CompileCache.key
    target = N.CompileTarget("sm_90", "cubin")
    assert key(src, opts, target, (13, 0), heads) != key(src, opts, target, (13, 5), heads)
    assert len({key(src, opts, target, (13, 5), h)
                for h in (heads, edited, heads[1:], tuple((n + "x", t) for n, t in heads))}) == 4
    assert key(src, opts, target, (13, 5), heads) == key(src, opts, target, (13, 5), list(heads))

    # a corrupt file is rebuilt with a warning
    files[0].write_bytes(files[0].read_bytes()[:-100] + b"garbage")
    c3 = N.CompileCache(tmp_path)
    with pytest.warns(RuntimeWarning, match="corrupt"):
        e = get(c3)
    assert c3.stats.compiles == 1 and c3.stats.rebuilt == 1 and e.image == a.image
    c4 = N.CompileCache(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get(c4)
    assert c4.stats.disk_hits == 1
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


@needs_nvrtc
def test_kernel_program_headers():
    """decode.cu and every header it includes travel to NVRTC by name; a compile without them fails naming the
    missing include; the flattened single-file text compiles to the same PTX; the digest covers every header."""
    names = [n for n, _ in PROG.headers]
    assert PROG.name == "decode.cu" and names == sorted(names) and {"config.cuh", "ptx.cuh", "state.cuh"} <= set(names)
    included = set(re.findall(r'#include "([^"]+)"', PROG.source + "".join(t for _, t in PROG.headers)))
    assert included <= set(names), included - set(names)
    spec = S.make_spec("partial", "bfloat16", 128, 4, 1, 16)
    target = N.CompileTarget("compute_90", "ptx")
    with pytest.raises(NvrtcError, match="config.cuh"):
        N.compile_source(PROG.source, PROG.name, spec.options(), target)
    flat = PROG.flattened()
    assert not re.search(r"^\s*#\s*(include|pragma once)", flat, re.M)
    assert N.compile_source(flat, PROG.name, spec.options(), target).image == PROG.compile(spec.options(), target).image
    other = dataclasses.replace(PROG, headers=tuple((n, t + " ") if n == names[-1] else (n, t) for n, t in PROG.headers))
    assert other.digest != PROG.digest and dataclasses.replace(PROG).digest == PROG.digest
    with pytest.raises(ValueError, match="not one of its headers"):
        dataclasses.replace(PROG, headers=PROG.headers[1:]).flattened()


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNPLAN_CACHE_DIR", str(tmp_path))
    assert N.default_cache_dir() == tmp_path / "nvrtc"
    monkeypatch.delenv("ATTNPLAN_CACHE_DIR")
    assert N.default_cache_dir().name == "nvrtc"


def test_select_target_cubin_else_ptx():
    archs = [75, 80, 86, 89, 90]
    assert N.select_target((9, 0), archs) == N.CompileTarget("sm_90", "cubin")
    assert N.select_target((12, 0), archs) == N.CompileTarget("compute_90", "ptx")  # device newer than NVRTC
    assert N.select_target((8, 7), archs) == N.CompileTarget("compute_86", "ptx")
    with pytest.raises(NvrtcError):
        N.select_target((7, 0), archs)


@needs_nvrtc
def test_missing_ptxas_report_read_from_cubin(monkeypatch):
    """NVRTC 13.0 on driver 580 (seen on the H200 machines) sometimes prints no ptxas report: the report then
    comes from the cubin and equals what ptxas printed for the same program."""
    spec = S.make_spec("partial", "bfloat16", 128, 4, 1, 16)
    target = N.select_target((9, 0))
    logged = PROG.compile(spec.options(), target)
    if "from" in logged.resources[spec.entry]:  # e.g. the H200 machines' NVRTC 13.0
        pytest.skip("this NVRTC printed no ptxas report to compare the cubin's counts with")
    monkeypatch.setattr(N, "_program_log", lambda nvrtc, prog: "")  # what the device's NVRTC printed
    silent = PROG.compile(spec.options(), target)
    assert silent.log == "" and silent.image == logged.image
    got, want = silent.resources[spec.entry], logged.resources[spec.entry]
    assert got["from"] == "cubin" and "from" not in want
    assert {k: got[k] for k in want} == want


@needs_nvrtc
@pytest.mark.parametrize("cc", ARCHS, ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_cubin_resources_with_spills_and_static_smem(cc):
    """A kernel that spills (registers capped) and one with static shared memory and a barrier: the cubin's
    counts equal ptxas's, and spills show as a non-zero frame with unknown (None) spill bytes, which the
    no-spill checks reject."""
    spill = r"""extern "C" __global__ void k(float *o, const float *a, int n) {
      float v[64];
    #pragma unroll
      for (int i = 0; i < 64; ++i) v[i] = a[threadIdx.x * 64 + i];
      float s = 0.f;
      for (int j = 0; j < n; ++j) {
    #pragma unroll
        for (int i = 0; i < 64; ++i) { v[i] = v[i] * v[(i + j) & 63] + 1.f; s += v[i]; }
      }
      o[threadIdx.x] = s;
    }"""
    shared = r"""extern "C" __global__ void k(float *o) {
      __shared__ float b[256];
      b[threadIdx.x] = threadIdx.x;
      __syncthreads();
      o[threadIdx.x] = b[(threadIdx.x + 1) & 255];
    }"""
    target = N.select_target(cc)
    c = N.compile_source(spill, "k.cu", ["--maxrregcount=32"], target)
    res, cub = c.resources["k"], N.cubin_resources(c.image, target.arch)["k"]
    assert res["spill_stores"] > 0 and res["stack"] > 0, res
    assert (cub["registers"], cub["stack"]) == (res["registers"], res["stack"]) == (32, res["stack"])
    assert cub["spill_stores"] is None and cub["spill_loads"] is None
    c = N.compile_source(shared, "k.cu", [], target)
    res, cub = c.resources["k"], N.cubin_resources(c.image, target.arch)["k"]
    assert (cub["smem"], cub["barriers"], cub["registers"]) == (res["smem"], res["barriers"], res["registers"]) \
        == (1024, 1, res["registers"])
    with pytest.raises(ValueError, match="not a cubin"):
        N.cubin_resources(b"not an ELF image", target.arch)


@needs_nvrtc
def test_unreadable_cubin_report_never_fails_a_compile(monkeypatch):
    """The cubin report is a diagnostic: when neither the log nor the cubin gives one, the compile still succeeds
    with empty resources (and the image a logged compile gives)."""
    spec = S.make_spec("partial", "bfloat16", 64, 1, 1, None)
    target = N.select_target((9, 0))
    logged = PROG.compile(spec.options(), target)

    def unreadable(image, arch):
        raise ValueError("unknown EIATTR format 9 at byte 0")

    monkeypatch.setattr(N, "_program_log", lambda nvrtc, prog: "")
    monkeypatch.setattr(N, "cubin_resources", unreadable)
    c = PROG.compile(spec.options(), target)
    assert c.resources == {} and c.image == logged.image
