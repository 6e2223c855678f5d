"""YAML configuration: backend order, per-backend options, split policy, determinism, plan cache.

The shipped ``plans/default.yaml`` is read first; a user file (the ``path`` argument or the
``ATTNPLAN_CONFIG`` environment variable) is deep-merged over it. Validation is pydantic's:
unknown keys and bad values raise :class:`ConfigError` naming the key, the value and what is
allowed. Per-device tuned tables (``plans/<device>.yaml``, e.g. ``plans/h200.yaml``) hold the
cost-model constants measured on that device; :func:`device_table` reads them.
"""

from __future__ import annotations

import functools
import os
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["Config", "ConfigError", "load_config", "device_table", "CostModel", "BACKEND_NAMES"]

BACKEND_NAMES = ("triton", "cuda_ptx", "numba", "reference")
BackendName = Literal["cuda_ptx", "triton", "numba", "reference"]


class ConfigError(ValueError):
    """A configuration file or value is invalid; the message names key, value and what is allowed."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KernelOptions(_Strict):
    """Per-backend kernel options; ``None`` lets the planner choose."""

    block_n: int | None = Field(None, ge=16, le=512, description="KV tokens per inner-loop tile")
    num_warps: int | None = Field(None, ge=1, le=16)
    num_stages: int | None = Field(None, ge=1, le=8)
    threads: int | None = Field(None, ge=32, le=1024, description="threads per CTA (numba, cuda_ptx)")
    lanes: int | None = Field(None, ge=1, le=32, description="threads sharing one KV row (numba)")
    unroll: int | None = Field(None, ge=1, le=16, description="KV positions per thread group per step (numba)")
    mma: bool | None = Field(None, description="cuda_ptx: tensor-core (mma.sync) path; null = wherever it serves "
                                                 "(fp16/bf16, head_dim a multiple of 16, split-K)")
    pdl: bool | None = Field(None, description="cuda_ptx: programmatic dependent launch of the merge kernel "
                                                "(sm_90+); null = on")
    passes: Literal[1, 2, 4, 8] | None = Field(None, description="cuda_ptx: 16-token m-tiles per warp tile on the "
                               "tensor-core path (1, 2, 4 or 8); null = 8 KB of K + V per stage")


class SplitPolicy(_Strict):
    """How the planner splits the KV sequence (DESIGN.md "Planner")."""

    merge: Literal["auto", "separate", "fused"] = Field(
        "auto", description="cross-program merge of sequences with several units: separate kernel, fused into the "
                            "last program of each (sequence, KV head) (atomic completion counter, fixed merge order), "
                            "or auto = the cheaper by the cost model")
    num_splits: int = Field(0, ge=0, le=1024, description="0 = heuristic, 1 = never split, >1 = forced")
    max_splits: int = Field(256, ge=1, le=1024, description="most splits a sequence may get")
    min_chunk_tokens: int = Field(64, ge=16, description="smallest chunk the planner makes (cost model and tuned "
                                                        "table; not a forced num_splits), tokens")
    batch_invariant: bool = Field(False, description="fix each sequence's units from its own length alone (units of "
                                  "invariant_chunk_tokens), so its output is bitwise independent of its batchmates, "
                                  "under CUDA-graph replay too; kernel options then do not depend on the batch")
    invariant_chunk_tokens: int = Field(2048, ge=16, le=1 << 20, description="unit size of the batch-invariant "
                                        "schedule, tokens (rounded up to the granule)")


class CostModel(_Strict):
    """Constants of the planner's cost model (microseconds, GB/s). Defaults are conservative
    guesses; ``attnplan tune`` measures them per device into ``plans/<device>.yaml``."""

    launch_us: float = Field(3.0, ge=0, description="fixed cost of one kernel launch")
    program_us: float = Field(1.0, ge=0, description="fixed cost of one program (CTA): prologue, q load, epilogue")
    programs_per_sm: int = Field(2, ge=1, le=32, description="programs resident per SM (a wave is this x SMs)")
    paged_programs_per_sm: int | None = Field(None, ge=1, le=32, description="the same for paged caches (null = as contiguous)")
    sat_programs_per_sm: float = Field(2.0, gt=0, description="resident programs per SM needed to saturate memory bandwidth")
    paged_sat_programs_per_sm: float | None = Field(None, gt=0, description="the same for paged caches (null = as contiguous)")
    bandwidth_fraction: float = Field(0.9, gt=0, le=1, description="share of the measured bandwidth a streaming kernel reaches")
    mem_bandwidth_gbs: float | None = Field(None, gt=0, description="measured read bandwidth; overrides the device's estimate")
    merge_split_latency_us: float = Field(0.4, ge=0, description="fused merge: serialized cost per split read by the last program")


class PlanCacheConfig(_Strict):
    enabled: bool = True
    disk: bool = True
    dir: str | None = Field(None, description="directory of the on-disk cache; null = the user cache directory")
    memory_entries: int = Field(1024, ge=1)


class Config(_Strict):
    """The validated configuration. See ``plans/default.yaml`` for every key with its default."""

    version: Literal[1] = 1
    backends: list[BackendName] = Field(default_factory=lambda: list(BACKEND_NAMES), min_length=1)
    backends_fp8_kv: list[BackendName] | None = Field(
        None, min_length=1, description="for a 1-byte (fp8) KV cache these go first, in this order; only backends "
                                        "also in `backends` are used; null = backends' order")
    deterministic: bool = True
    split: SplitPolicy = SplitPolicy()
    cost_model: CostModel = CostModel()
    plan_cache: PlanCacheConfig = PlanCacheConfig()
    backend_options: dict[BackendName, KernelOptions] = Field(default_factory=dict)

    def options(self, backend: str) -> KernelOptions:
        return self.backend_options.get(backend, KernelOptions())

    def with_overrides(self, **changes: Any) -> "Config":
        """A copy with nested keys replaced, e.g. ``with_overrides(split={"num_splits": 4})``."""
        data = _deep_merge(self.model_dump(), changes)
        return _validate(data, "override")


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<top>"
        val = e.get("input")
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        if not e["loc"]:  # a cross-key check (Config's model validator): its message names the keys
            lines.append("  " + msg.removeprefix("Value error, "))
            continue
        lines.append(f"  {key}: {msg} (got {val!r})")
    return f"invalid attnplan config ({source}):\n" + "\n".join(lines)


def _validate(data: Any, source: str) -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"invalid attnplan config ({source}): top level must be a mapping, got {type(data).__name__}")
    for key in ("backends", "backends_fp8_kv"):
        if isinstance(data.get(key), list) and len(set(data[key])) != len(data[key]):
            raise ConfigError(f"invalid attnplan config ({source}):\n  {key}: duplicate entries (got {data[key]!r})")
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def _read_yaml(path: Path | str, source: str) -> dict:
    try:
        text = Path(path).read_text() if not isinstance(path, resources.abc.Traversable) else path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read attnplan config {source}: {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"attnplan config {source} is not valid YAML: {e}") from None
    return data if data is not None else {}


@functools.lru_cache(maxsize=1)
def _default_data() -> dict:
    return _read_yaml(resources.files("attnplan.plans") / "default.yaml", "plans/default.yaml")


def load_config(path: str | os.PathLike | None = None, **overrides: Any) -> Config:
    """Load ``plans/default.yaml`` and merge the user's file over it.

    Args:
        path: a YAML file; when ``None``, ``$ATTNPLAN_CONFIG`` if set.
        **overrides: top-level keys merged last (for tests and the CLI).
    Raises:
        ConfigError: unreadable file, bad YAML, unknown key, or bad value.
    """
    data = dict(_default_data())
    src = "plans/default.yaml"
    path = path if path is not None else os.environ.get("ATTNPLAN_CONFIG") or None
    if path is not None:
        user = _read_yaml(path, str(path))
        if not isinstance(user, dict):
            raise ConfigError(f"invalid attnplan config ({path}): top level must be a mapping")
        data = _deep_merge(data, user)
        src = str(path)
    if overrides:
        data = _deep_merge(data, overrides)
    return _validate(data, src)


@functools.lru_cache(maxsize=None)
def device_table(slug: str) -> dict:
    """The tuned table of the device ``slug`` (e.g. ``"h200"``) as a dict (``{}`` when there is none).

    Looked up in order, the first file found being the whole table (files are not merged):

    1. the user's table, :func:`attnplan.device.user_table_path` (``<cache dir>/plans/<slug>.yaml``,
       the cache dir being ``$ATTNPLAN_CACHE_DIR`` or the platform's user cache directory), where
       ``attnplan tune`` writes by default;
    2. the packaged ``plans/<slug>.yaml``.

    Keys: ``cost_model`` (a :class:`CostModel` mapping), ``cost_model_by_backend`` (per backend
    name, :class:`CostModel` keys that override ``cost_model`` for that backend's plans),
    ``kernel_options``, ``split_table`` and optionally ``measured`` notes.

    Memoized per ``slug`` for the process: after writing a table or changing ``$ATTNPLAN_CACHE_DIR``,
    call ``device_table.cache_clear()`` (``attnplan tune`` does).

    Raises:
        ConfigError: the file found is unreadable, not YAML, or its cost-model constants are invalid;
            the message names the file.
    """
    from .device import user_table_path

    user = user_table_path(slug)
    if user.is_file():
        f, source = user, str(user)
    else:
        f, source = resources.files("attnplan.plans") / f"{slug}.yaml", f"plans/{slug}.yaml"
        if not f.is_file():
            return {}
    data = _read_yaml(f, source)
    if not isinstance(data, dict):
        raise ConfigError(f"invalid device table ({source}): top level must be a mapping, got {type(data).__name__}")
    try:
        CostModel.model_validate(data.get("cost_model") or {})
        for entry in (data.get("cost_model_by_backend") or {}).values():
            CostModel.model_validate({**(data.get("cost_model") or {}), **(entry or {})})
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None
    return data
