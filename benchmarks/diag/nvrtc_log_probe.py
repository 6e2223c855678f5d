# Diagnostic (s6): does NVRTC print a ptxas report when the same program is compiled again in one process,
# and does a one-off macro bring it back? Prints, per specialization, compile_once's report presence for
# the first compile, a second identical one and one with -DATTNPLAN_REPORT_NONCE, then compile_source's.
import cuda.bindings

from attnplan.backends.cuda_ptx.launch import kernel_source, make_spec
from attnplan.backends.cuda_ptx.nvrtc import compile_once, compile_source, nvrtc_version, parse_ptxas_info, select_target

print("nvrtc", nvrtc_version(), "cuda.bindings", cuda.bindings.__version__)
target = select_target((9, 0))
for kind, page in (("partial", None), ("partial", 16), ("single", None)):
    spec = make_spec(kind, "bfloat16", 128, 4, 1, page)
    src, opts = kernel_source(), spec.options()
    seen = []
    for extra in ([], [], ["-DATTNPLAN_REPORT_NONCE=99"]):
        _, log = compile_once(src, "decode.cu", [*opts, *extra], target)
        seen.append(bool(parse_ptxas_info(log)))
    c = compile_source(src, "decode.cu", opts, target)
    print(f"{spec.name}: report first / again / again+nonce = {seen}; compile_source again: {c.resources}")
