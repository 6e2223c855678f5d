"""A streaming-read kernel for measuring the memory-read ceiling (see :mod:`attnplan.timing`)."""

import triton
import triton.language as tl


@triton.jit
def _read_kernel(X, PARTIAL, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(PARTIAL + pid, tl.sum(x.to(tl.float32), 0))


def streaming_read(x, partial, block: int) -> None:
    """Read every element of 1-D ``x`` once; ``partial[i]`` gets the sum of tile ``i``."""
    _read_kernel[(partial.numel(),)](x, partial, x.numel(), BLOCK=block, num_warps=8)
