# Diagnostic (s6): the raw NVRTC log and parsed ptxas report of a few cuda_ptx specializations, compiled twice each.
import sys, cuda.bindings
from attnplan.backends.cuda_ptx.launch import make_spec, kernel_source
from attnplan.backends.cuda_ptx.nvrtc import compile_source, select_target, nvrtc_version
print("nvrtc", nvrtc_version(), "cuda.bindings", cuda.bindings.__version__)
for kind, page in (("partial", None), ("partial", 16), ("single", None)):
    spec = make_spec(kind, "bfloat16", 128, 4, 1, page)
    for i in range(2):
        c = compile_source(kernel_source(), "decode.cu", spec.options(), select_target((9, 0)))
        print(spec.name, i, "resources:", c.resources, "log chars:", len(c.log))
        print("   log:", repr(c.log[:1500]))
