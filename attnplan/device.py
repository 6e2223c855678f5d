"""`DeviceInfo`: the device facts the planner and the cache key use, read from the device.

Never assume an SM count (an older revision of PyTorch's flex-decoding hard-coded 128 SMs): facts
come from ``torch.cuda.get_device_properties`` of the tensors' device. CPU interpreter / simulator
runs use :data:`CPU_STANDIN`, a documented stand-in small enough that plans for small test shapes
still split. :func:`user_table_path` is where a device's tuned table is looked for first.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .problem import _is_real

__all__ = ["DeviceInfo", "CPU_STANDIN", "device_info", "user_table_path"]


@dataclass(frozen=True)
class DeviceInfo:
    """Device facts.

    Attributes:
        name: device name as the driver reports it (``"NVIDIA H200"``).
        sm_count: streaming multiprocessors.
        compute_capability: ``(major, minor)``; ``(0, 0)`` for the CPU stand-in.
        smem_per_block: opt-in shared memory per block, bytes.
        l2_bytes: L2 cache size, bytes.
        mem_bandwidth_gbs: memory read bandwidth, GB/s: the datasheet estimate from clock and bus width, else a
            default (the planner's cost model uses the device table's measured value instead where one exists,
            :func:`attnplan.planner.cost_model_for`).
        driver: the CUDA version torch was built with (``"cuda-13.0"``; "" on CPU), not the installed driver's;
            part of the plan-cache key.
    """

    name: str
    sm_count: int
    compute_capability: tuple[int, int]
    smem_per_block: int
    l2_bytes: int
    mem_bandwidth_gbs: float
    driver: str = ""

    def __post_init__(self) -> None:
        """Raises ``TypeError`` / ``ValueError`` naming the field: the planner divides by the SM count and the
        bandwidth, so a hand-made ``DeviceInfo`` of 0 SMs or a NaN bandwidth is refused here, not deep in a plan."""
        if not isinstance(self.name, str) or not isinstance(self.driver, str):
            raise TypeError(f"DeviceInfo.name and .driver must be strings, got {self.name!r} and {self.driver!r}")
        cc = self.compute_capability
        if not (isinstance(cc, tuple) and len(cc) == 2 and all(_is_int(c) and 0 <= c < 1 << 16 for c in cc)):
            raise ValueError(f"DeviceInfo.compute_capability must be a (major, minor) tuple of ints, got {cc!r}")
        for field, lo in (("sm_count", 1), ("smem_per_block", 0), ("l2_bytes", 0)):
            v = getattr(self, field)
            if not _is_int(v) or not lo <= v < 1 << 40:
                raise ValueError(f"DeviceInfo.{field} must be an int in [{lo}, 2^40), got {v!r}")
        bw = self.mem_bandwidth_gbs
        if not _is_real(bw) or not 0 < bw < float("inf"):
            raise ValueError(f"DeviceInfo.mem_bandwidth_gbs must be a finite number of GB/s above 0, got {bw!r}")

    @property
    def arch(self) -> str:
        """``sm_90`` style architecture name."""
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"

    def fingerprint(self) -> dict:
        """What the plan cache keys on: name, SM count, compute capability (a cubin or a tuned split is
        only valid for its architecture and SM count) and CUDA version."""
        return {"name": self.name, "sm_count": self.sm_count, "cc": list(self.compute_capability), "driver": self.driver}

    def slug(self) -> str:
        """File-name form of the whole device name, used for ``plans/<slug>.yaml``: lower case, ``NVIDIA`` dropped,
        other characters than letters and digits as ``_`` (``NVIDIA H200`` -> ``h200``, ``NVIDIA H100 80GB HBM3`` ->
        ``h100_80gb_hbm3``, ``NVIDIA GeForce RTX 4090`` -> ``geforce_rtx_4090``). The whole name, because models
        that share a first word (an H100's SXM and PCIe parts, a family of GeForce cards, MIG slices) differ in SMs
        and bandwidth, and a table measured on one would plan the other."""
        return _slug(self.name)

    def to_dict(self) -> dict:
        return asdict(self)


def _is_int(v) -> bool:
    """An integer (numpy's included), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@functools.lru_cache(maxsize=64)
def _slug(name: str) -> str:
    n = name.lower().replace("nvidia", "").strip()
    return "_".join(filter(None, "".join(c if c.isascii() and c.isalnum() else "_" for c in n).split("_"))) or "unknown"


CPU_STANDIN = DeviceInfo(
    name="cpu-standin", sm_count=8, compute_capability=(0, 0), smem_per_block=100 * 1024,
    l2_bytes=4 * 1024 * 1024, mem_bandwidth_gbs=100.0, driver="",
)
"""Stand-in for CPU runs (Triton interpreter, numba simulator, reference): 8 "SMs" so the planner
splits small test problems the way it would split large ones on a real GPU."""


@functools.lru_cache(maxsize=None)
def _cuda_device_info(index: int) -> DeviceInfo:
    p = torch.cuda.get_device_properties(index)
    bw = 0.0
    clock = getattr(p, "memory_clock_rate", 0) or 0  # kHz
    bus = getattr(p, "memory_bus_width", 0) or 0  # bits
    if clock and bus:
        bw = 2.0 * clock * 1e3 * bus / 8 / 1e9
    return DeviceInfo(
        name=p.name,
        sm_count=int(p.multi_processor_count),
        compute_capability=(int(p.major), int(p.minor)),
        smem_per_block=int(getattr(p, "shared_memory_per_block_optin", 0) or 48 * 1024),
        l2_bytes=int(getattr(p, "L2_cache_size", 0) or 0),
        mem_bandwidth_gbs=bw or 2000.0,
        driver=f"cuda-{torch.version.cuda}",
    )


def device_info(device: torch.device | str | None = None) -> DeviceInfo:
    """Device facts for ``device`` (a tensor's device: a ``torch.device`` or its string, ``None`` for the current
    CUDA device, else the CPU). Devices other than CUDA get :data:`CPU_STANDIN`.

    Raises:
        TypeError: ``device`` is not a ``torch.device``, a string or ``None``.
        ValueError: a string that names no device, or a CUDA device this process cannot see.
    """
    if device is not None and not isinstance(device, (torch.device, str)):
        raise TypeError(f"device must be a torch.device, a string or None, got {type(device).__name__}")
    try:
        dev = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    except RuntimeError as e:
        raise ValueError(f"device {device!r} names no device: {e}") from None
    if dev.type != "cuda":
        return CPU_STANDIN
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not seen or (dev.index is not None and dev.index >= seen):
        raise ValueError(f"device {str(dev)!r}: this process sees {seen} CUDA device{'s' * (seen != 1)}")
    return _cuda_device_info(dev.index if dev.index is not None else torch.cuda.current_device())


def user_table_path(slug: str) -> Path:
    """The user's tuned table for the device ``slug`` (:meth:`DeviceInfo.slug`):
    ``<cache dir>/plans/<slug>.yaml``, the cache dir being ``$ATTNPLAN_CACHE_DIR`` if set, else
    ``platformdirs.user_cache_dir("attnplan")`` (the plan cache's directory). ``attnplan tune`` writes
    there unless given ``--out``; :func:`attnplan.config.device_table` reads it before the packaged
    ``plans/<slug>.yaml``. The file need not exist."""
    from .cache import default_cache_dir  # at call time: cache imports the planner, which imports this module

    return default_cache_dir() / "plans" / f"{slug}.yaml"
