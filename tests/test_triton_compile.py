"""The Triton kernels through the real compiler for sm_90 and sm_80, on a machine without a GPU.

CPU-only CI runs the kernels in Triton's interpreter, which skips the compiler's type checks: in
session 4 a partial kernel that passed every interpreted test failed to compile on the H200
(``Loop-carried variable ok ... re-assigned``, then ``e``: names of the fp8 q-shift prologue reused
in the KV loop). Each case here is a
specialization the backend launches (variants, fp8 with bf16 / fp16 q, paged, split-V column
programs, the in-kernel merges); compiling it is the check (``backends/triton/offline.py``).
"""

from __future__ import annotations

import pytest

offline = pytest.importorskip("attnplan.backends.triton.offline")

#: (id, q dtype, kv dtype, constexpr overrides): the specializations of the partial kernel
PARTIAL_CASES = [
    ("bf16", "bf16", "bf16", {}),
    ("fp16-paged16-window-softcap", "fp16", "fp16",
     {"PAGED": True, "PAGE_SIZE": 16, "WINDOW": True, "SOFTCAP": True}),
    ("fp8-bf16q", "bf16", "fp8e4nv", {}),
    # the bf16-q shift prologue's names must not be reused inside the KV loop (softcap, window, paged)
    ("fp8-bf16q-qlen8-window-softcap-sinks-fused", "bf16", "fp8e4nv",
     {"PAGED": True, "PAGE_SIZE": 16, "Q_LEN": 8, "BLOCK_M": 32, "WINDOW": True, "SOFTCAP": True, "SINKS_ON": True,
      "MERGE": "fused", "WRITE_OUT_LSE": True}),
    ("fp8-fp16q-paged-qlen4-fused-sinks", "fp16", "fp8e4nv",
     {"PAGED": True, "PAGE_SIZE": 32, "Q_LEN": 4, "BLOCK_M": 16, "MERGE": "fused", "SINKS_ON": True,
      "WRITE_OUT_LSE": True}),
    ("splitv-atomic", "bf16", "bf16", {"BLOCK_DV": 64, "N_COLS": 2, "MERGE": "atomic", "WRITE_OUT_LSE": True}),
    ("d80-group7-qlen3", "bf16", "bf16", {"HEAD_DIM": 80, "BLOCK_D": 128, "BLOCK_DV": 128, "GROUP": 7, "Q_LEN": 3,
                                           "BLOCK_M": 32}),
]
#: every variant on at once for each (q, KV) dtype pair and both in-kernel merges: a name a variant's
#: branch assigns before the KV loop and the loop reassigns with another shape fails here
_ALL_ON = {"PAGED": True, "PAGE_SIZE": 16, "Q_LEN": 4, "BLOCK_M": 16, "WINDOW": True, "SOFTCAP": True,
           "SINKS_ON": True, "WRITE_OUT_LSE": True}
PARTIAL_CASES += [
    (f"all-variants-{q}q-{kv}-{merge}", q, kv, {**_ALL_ON, "MERGE": merge,
                                                  **({"BLOCK_DV": 64, "N_COLS": 2} if merge == "atomic" else {})})
    for q, kv in (("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp8e4nv"), ("fp16", "fp8e4nv"))
    for merge in ("fused", "atomic")
]


ARCHS = [90, 80]
_PARTIAL = [(f"{c[0]}-sm{arch}", {"kind": "partial", "q": c[1], "kv": c[2], "arch": arch, "const": c[3]})
            for c in PARTIAL_CASES for arch in ARCHS if not (c[2].startswith("fp8") and arch < 89)]
_MERGE = [(f"merge-d{d}", {"kind": "merge", "out": "bf16", "const": {"HEAD_DIM": d, "BLOCK_D": d, "SINKS_ON": True}})
          for d in (128, 256)] + [
    # the few-rows geometry (merge_geometry): a 16-column slice, 256 splits per load
    ("merge-d128-slice16", {"kind": "merge", "out": "bf16",
                            "const": {"HEAD_DIM": 128, "BLOCK_D": 16, "BLOCK_S": 256, "SINKS_ON": True}})]


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Every case compiled in one child process (Triton's interpreter, which CI runs under, cannot
    compile): ``{case id: result}``."""
    cases = _PARTIAL + _MERGE
    return dict(zip([i for i, _ in cases], offline.compile_cases([c for _, c in cases])))


@pytest.mark.parametrize("case", [i for i, _ in _PARTIAL + _MERGE])
def test_kernel_compiles(case, compiled):
    """fp8 cases only for sm_89+ (Triton's float8_e4m3fn loads)."""
    res = compiled[case]
    assert res["ok"], res["error"]


def test_offline_compile_reports_unknown_constexpr():
    res = offline.compile_cases([{"kind": "partial", "const": {"NOT_A_CONSTEXPR": 1}}])
    assert not res[0]["ok"] and "unknown constexpr" in res[0]["error"]
