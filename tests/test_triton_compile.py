"""The Triton kernels through the real compiler for sm_90 and sm_80, on a machine without a GPU.

CPU-only CI runs the kernels in Triton's interpreter, which skips the compiler's type checks: a partial kernel
that passed every interpreted test once failed to compile on an H200 (``Loop-carried variable ok ... re-assigned``,
then ``e``: names of the fp8 q-shift prologue reused in the KV loop), and a name a helper's caller reuses (a scalar
``head`` beside the rows' ``head`` vector) passes the interpreter and not the compiler. Each case here is a
specialization the backend launches (the schedule's prologue with balanced / forced targets, in one block or looped
over the batch, single pass, variants, fp8 with bf16 / fp16 q, paged, q_len > 1 with its edge positions, the fused
merge); compiling it is the check (``backends/triton/offline.py``).
"""

from __future__ import annotations

import pytest

offline = pytest.importorskip("attnplan.backends.triton.offline")

_SINGLE = {"MULTI": False, "BALANCED": False, "MERGE": "none"}
#: (id, q dtype, kv dtype, constexpr overrides): the specializations of the partial kernel
PARTIAL_CASES = [
    ("bf16-balanced-separate", "bf16", "bf16", {}),
    ("bf16-single", "bf16", "bf16", _SINGLE),
    ("bf16-forced-fused-looped-prologue", "bf16", "bf16", {"BALANCED": False, "MERGE": "fused", "ONE_BLOCK": False}),
    ("fp16-paged16-window-softcap", "fp16", "fp16",
     {"PAGED": True, "PAGE_SIZE": 16, "WINDOW": True, "SOFTCAP": True}),
    ("fp8-bf16q", "bf16", "fp8e4nv", {}),
    # the bf16-q shift prologue's names must not be reused inside the KV loop (softcap, window, paged)
    ("fp8-bf16q-qlen8-window-softcap-sinks-fused", "bf16", "fp8e4nv",
     {"PAGED": True, "PAGE_SIZE": 16, "Q_LEN": 8, "BLOCK_M": 32, "WINDOW": True, "SOFTCAP": True, "SINKS_ON": True,
      "MERGE": "fused"}),
    ("fp8-fp16q-paged-qlen4-fused-sinks", "fp16", "fp8e4nv",
     {"PAGED": True, "PAGE_SIZE": 32, "Q_LEN": 4, "BLOCK_M": 16, "MERGE": "fused", "SINKS_ON": True}),
    ("d80-group7-qlen3-single-sinks", "bf16", "bf16", {"HEAD_DIM": 80, "BLOCK_D": 128, "GROUP": 7, "Q_LEN": 3,
                                                        "BLOCK_M": 32, "SINKS_ON": True, **_SINGLE}),
    ("fp32-ieee-qlen2-looped-prologue", "fp32", "fp32", {"Q_LEN": 2, "DOT_PRECISION": "ieee", "BLOCK_B": 16,
                                                          "ONE_BLOCK": False}),
    # one prologue block of at most LONGEST_FIRST_BATCH: the slots longest units first, a [BLOCK_B, BLOCK_B] compare
    ("bf16-balanced-separate-longest-first-b32", "bf16", "bf16", {"BLOCK_B": 32}),
    ("bf16-balanced-fused-longest-first-b16", "bf16", "bf16", {"BLOCK_B": 16, "MERGE": "fused"}),
]
#: every variant on at once for each (q, KV) dtype pair, single pass and fused: a name a variant's branch assigns before the
#: KV loop and the loop reassigns with another shape fails here
_ALL_ON = {"PAGED": True, "PAGE_SIZE": 16, "Q_LEN": 4, "BLOCK_M": 16, "WINDOW": True, "SOFTCAP": True,
           "SINKS_ON": True}
PARTIAL_CASES += [
    (f"all-variants-{q}q-{kv}-{merge}", q, kv, {**_ALL_ON, "MERGE": merge, **(_SINGLE if merge == "none" else {})})
    for q, kv in (("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp8e4nv"), ("fp16", "fp8e4nv"))
    for merge in ("none", "fused")
]


#: every case for sm_90; sm_80 (no fp8 loads, another mma generation) for the plain specializations only: the
#: variants' code paths do not depend on the architecture
ARCHS = [90, 80]
SM80_CASES = ("bf16-balanced-separate", "bf16-single", "fp32-ieee-qlen2-looped-prologue")
_PARTIAL = [(f"{c[0]}-sm{arch}", {"kind": "partial", "q": c[1], "kv": c[2], "arch": arch, "const": c[3]})
            for c in PARTIAL_CASES for arch in ARCHS if arch >= 89 or c[0] in SM80_CASES]
_MERGE = [(f"merge-d{d}", {"kind": "merge", "out": "bf16", "const": {"HEAD_DIM": d, "BLOCK_D": d, "SINKS_ON": True}})
          for d in (128, 256)] + [
    # the few-rows geometry (merge_geometry): a 16-column slice, 256 splits per load
    ("merge-d128-slice16", {"kind": "merge", "out": "bf16",
                            "const": {"HEAD_DIM": 128, "BLOCK_D": 16, "BLOCK_S": 256, "SINKS_ON": True}})]


_CASES = dict(_PARTIAL + _MERGE)


@pytest.mark.parametrize("case", list(_CASES))
def test_kernel_compiles(case):
    """Each case compiled in a child process of its own (Triton's interpreter, which CI runs under, cannot compile;
    one process per case lets pytest-xdist's workers share the cases). fp8 cases only for sm_89+ (Triton's
    float8_e4m3fn loads). The raw launch's parameter list (``raw.param_kinds``: Triton's signature less its
    constants, plus the scratch pointers the metadata declares) must be the PTX entry's, size for size: the bound
    launch packs its arguments by it."""
    (res,) = offline.compile_cases([_CASES[case]])
    assert res["ok"], res["error"]
    assert res["derived_params"] is not None and res["derived_params"] == res["ptx_params"], res
    assert len(res["ptx_params"]) >= (30 if _CASES[case]["kind"] == "partial" else 10)


def test_offline_compile_reports_unknown_constexpr():
    res = offline.compile_cases([{"kind": "partial", "const": {"NOT_A_CONSTEXPR": 1}}])
    assert not res[0]["ok"] and "unknown constexpr" in res[0]["error"]
