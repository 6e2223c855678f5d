"""attnplan: split-KV ("Flash-Decoding") decode attention with a planner, a plan cache, and
interchangeable Triton / Numba CUDA / NVRTC backends that share one partial-state format and
one merge contract, all checked against one CPU float64 reference.

Quick use::

    import attnplan
    out = attnplan.decode(q, k_cache, v_cache, seq_lens, block_table)   # one call
    w = attnplan.DecodeWrapper(); w.plan(...); w.run(...)              # plan once, run many
"""

from ._version import __version__
from .api import (Context, DecodeWrapper, NoBackendError, PlanNotReadyError, decode, default_context,
                  reload_device_tables, select_backend)
from .config import Config, ConfigError, load_config
from .device import CPU_STANDIN, DeviceInfo, device_info
from .planner import SplitPlan, make_plan
from .problem import DecodeProblem
from .state import PartialState, merge_state_pair, merge_states

__all__ = [
    "__version__", "decode", "DecodeWrapper", "Context", "NoBackendError", "PlanNotReadyError", "default_context",
    "select_backend", "reload_device_tables", "Config", "ConfigError", "load_config", "DeviceInfo", "CPU_STANDIN",
    "device_info",
    "SplitPlan", "make_plan", "DecodeProblem", "PartialState", "merge_states", "merge_state_pair",
]
