# Diagnostic (s6): does NVRTC print a ptxas report when the same program is compiled again in one process,
# and does an extra unused macro bring it back? Per specialization: report presence for the first compile, a
# second identical one and one with -DATTNPLAN_REPORT_NONCE=99 (results/2026-11-30-s6-call7: NVRTC 13.0 with
# driver 580 gives [True, False, False]; the pip NVRTC 13.5 and 13.0 on a CPU machine give [True, True, True]).
import cuda.bindings

from attnplan.backends.cuda_ptx.launch import kernel_source, make_spec
from attnplan.backends.cuda_ptx.nvrtc import compile_source, nvrtc_version, parse_ptxas_info, select_target

print("nvrtc", nvrtc_version(), "cuda.bindings", cuda.bindings.__version__)
target = select_target((9, 0))
for kind, page in (("partial", None), ("partial", 16), ("single", None)):
    spec = make_spec(kind, "bfloat16", 128, 4, 1, page)
    # the log's own report (Compiled.resources falls back to the cubin's counts when the log has none)
    seen = [bool(parse_ptxas_info(compile_source(kernel_source(), "decode.cu", [*spec.options(), *extra], target).log))
            for extra in ([], [], ["-DATTNPLAN_REPORT_NONCE=99"])]
    print(f"{spec.name}: report first / again / again+nonce = {seen}")
