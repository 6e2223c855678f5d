"""YAML configuration: backend order, per-backend options, split policy, determinism, plan cache.

The shipped ``plans/default.yaml`` is read first; a user file (the ``path`` argument or the
``ATTNPLAN_CONFIG`` environment variable) is deep-merged over it. Validation is pydantic's, in
strict mode (no ``"4"`` for 4, no ``true`` for 1, no ``.inf`` / ``.nan``): unknown keys and bad
values raise :class:`ConfigError` naming the key, the value (shortened) and what is allowed. Each
backend has its own options model listing the keys its ``kernel_config`` reads, so an option
another backend owns (``triton: {mma: true}``) is an unknown key, not silently ignored.

A file is read as UTF-8 (at most :data:`MAX_CONFIG_BYTES`), nested at most :data:`MAX_DEPTH` levels
deep, and its YAML aliases may expand to at most :data:`MAX_NODES` values (an alias bomb is refused
before anything walks it). Per-device tuned tables (``plans/<device>.yaml``, e.g.
``plans/h200.yaml``) hold the cost-model constants measured on that device; :func:`device_table`
reads them through the same reader.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import stat
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, StringConstraints, ValidationError, ValidationInfo,
                      field_serializer, field_validator, model_validator)

from ._repr import short_repr

__all__ = ["Config", "ConfigError", "load_config", "device_table", "CostModel", "BACKEND_NAMES", "TritonOptions",
           "NumbaOptions", "CudaPtxOptions", "ReferenceOptions", "BackendOptions", "MAX_CONFIG_BYTES", "MAX_DEPTH",
           "MAX_NODES", "expand_home"]

BACKEND_NAMES = ("triton", "cuda_ptx", "numba", "reference")
BackendName = Literal["cuda_ptx", "triton", "numba", "reference"]

#: largest config or device-table file read, bytes
MAX_CONFIG_BYTES = 1 << 20
#: deepest nesting of mappings / sequences in a file
MAX_DEPTH = 32
#: most values (scalars, mappings, sequences; an alias counts as many as it expands to) in a file
MAX_NODES = 200_000
#: most error lines one ConfigError lists
MAX_ERRORS = 20


#: most splits (units) one sequence may get: the bound of ``split.num_splits`` / ``split.max_splits``, of a
#: ``num_splits`` argument and of a plan read from disk
MAX_SPLITS = 1024

class ConfigError(ValueError):
    """A configuration file or value is invalid; the message names key, value and what is allowed."""


def expand_home(path: str | os.PathLike, source: str) -> str:
    """``path`` with a leading ``~`` (the home folder) or ``~user`` expanded, as ``os.path.expanduser`` does.

    Raises:
        ConfigError: naming ``source`` (where the path came from), when the leading ``~`` cannot be expanded (no such
            user, or no home folder): the path would otherwise name a relative folder called ``~user``.
    """
    text = os.fspath(path)
    out = os.path.expanduser(text)
    if out.startswith("~"):
        head = out.split("/", 1)[0]
        raise ConfigError(f"{source} = {text!r:.200}: cannot expand {head!r:.60} (no such user, or no home folder); "
                          "give the folder's full path (or ./ before a name that starts with ~)")
    return out


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """``true`` is not 1, nor ``1.0``: refuse a bool for a field whose type has no bool, and a float for a Literal
        of ints (pydantic's Literal[1, 2] takes both, by equality)."""
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(v, bool) and not _allows_bool(annotation):
            raise ValueError("a boolean is not allowed here")
        if isinstance(v, float):
            choices = _int_literal(annotation)
            if choices:
                raise ValueError(f"a float is not allowed here (one of {choices})")
        return v


def _int_literal(annotation: Any) -> list:
    """The values of ``annotation``'s Literal of ints (``Literal[1, 2] | None`` included), or [] where it has none or
    also takes a float."""
    parts = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    if float in parts:
        return []
    return [v for p in parts if typing.get_origin(p) is Literal for v in typing.get_args(p)
            if isinstance(v, int) and not isinstance(v, bool)]


def _allows_bool(annotation: Any) -> bool:
    if annotation is bool or annotation is Any:
        return True
    return any(_allows_bool(a) for a in typing.get_args(annotation))


def _whole_warps(v):
    """``v`` (threads per CTA, or None) when it is a multiple of 32, else ValueError."""
    if v is not None and v % 32:
        raise ValueError("must be a multiple of 32 (a whole number of warps)")
    return v


def _power_of_two(v: int | None) -> int | None:
    if v is not None and v & (v - 1):
        raise ValueError("must be a power of two")
    return v


class TritonOptions(_Strict):
    """``backend_options.triton``: the keys the Triton backend's ``kernel_config`` reads; ``None`` lets the planner
    choose. ``block_dv`` (the split-V column width) was removed with the split-V partition."""

    block_n: int | None = Field(None, ge=16, le=512, description="KV tokens per inner-loop tile, a power of two "
                                                                 "(tl.arange needs one)")
    num_warps: Literal[1, 2, 4, 8, 16] | None = Field(None, description="warps per program (a power of two)")
    num_stages: int | None = Field(None, ge=1, le=8, description="software-pipeline stages of the KV loop")
    block_dv: None = Field(None, exclude=True, description="removed (was split-V's column width); only null is read")

    @field_validator("block_dv", mode="before")
    @classmethod
    def _block_dv_removed(cls, v):
        if v is not None:
            raise ValueError("block_dv was removed from attnplan together with the split-V partition; delete the key")
        return v

    @field_validator("block_n")
    @classmethod
    def _block_n(cls, v):
        return _power_of_two(v)


class NumbaOptions(_Strict):
    """``backend_options.numba``: the keys the numba backend's ``kernel_config`` reads (``threads``, ``lanes`` and
    ``unroll`` on a GPU only: the simulator keeps its own layout, 8 threads of 2 lanes); ``None`` lets the planner
    choose."""

    block_n: int | None = Field(None, ge=16, le=512, description="KV tokens per tile, a power of two")
    threads: int | None = Field(None, ge=32, le=1024, description="threads per CTA, a multiple of 32")
    lanes: Literal[1, 2, 4, 8, 16, 32] | None = Field(None, description="threads sharing one KV row")
    unroll: int | None = Field(None, ge=1, le=16, description="KV positions per thread group per step")

    @field_validator("block_n")
    @classmethod
    def _block_n(cls, v):
        return _power_of_two(v)

    @field_validator("threads")
    @classmethod
    def _threads(cls, v):
        return _whole_warps(v)


class CudaPtxOptions(_Strict):
    """``backend_options.cuda_ptx``: the keys the CUDA C backend's ``kernel_config`` reads; ``None`` lets the
    planner choose. ``block_n`` must also be a multiple of the kernel's tile (checked when planning)."""

    block_n: int | None = Field(None, ge=1, le=4096, description="chunk alignment, tokens (a multiple of the "
                                                                 "kernel's tile, checked when planning)")
    num_warps: int | None = Field(None, ge=1, le=16, description="KV warps per row group")
    num_stages: int | None = Field(None, ge=1, le=8, description="cp.async ring stages")
    threads: int | None = Field(None, ge=32, le=1024, description="threads per CTA, a multiple of 32 x row groups "
                                                                  "(instead of num_warps)")
    mma: bool | None = Field(None, description="tensor-core (mma.sync) path; null = wherever it serves "
                                               "(fp16/bf16, head_dim a multiple of 16, split-K)")
    pdl: bool | None = Field(None, description="programmatic dependent launch of the merge kernel (sm_90+); null = on")
    passes: Literal[1, 2, 4, 8] | None = Field(None, description="16-token m-tiles per warp tile on the tensor-core "
                                                                 "path; null = 8 KB of K + V per stage")

    @field_validator("threads")
    @classmethod
    def _threads(cls, v):
        return _whole_warps(v)


class ReferenceOptions(_Strict):
    """``backend_options.reference``: the float64 reference has no kernel options (an empty mapping)."""


#: per-backend options model
OPTION_MODELS: dict[str, type[_Strict]] = {"triton": TritonOptions, "numba": NumbaOptions, "cuda_ptx": CudaPtxOptions,
                                           "reference": ReferenceOptions}


class BackendOptions(_Strict):
    """``backend_options``: one options model per backend (``null`` or a missing key = the defaults)."""

    triton: TritonOptions = TritonOptions()
    cuda_ptx: CudaPtxOptions = CudaPtxOptions()
    numba: NumbaOptions = NumbaOptions()
    reference: ReferenceOptions = ReferenceOptions()

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None}
        return data


class SplitPolicy(_Strict):
    """How the planner splits the KV sequence (see :mod:`attnplan.planner`)."""

    partition: Literal["auto", "split_k"] = Field(
        "auto", description="work partition inside a program: split_k = warps take different KV positions and "
                            "merge through shared memory; auto = the backend's choice (split_k)")
    merge: Literal["auto", "separate", "fused"] = Field(
        "auto", description="cross-program merge of sequences with several units: separate kernel, fused into the "
                            "last program of each (sequence, KV head) (atomic completion counter, fixed merge order), "
                            "or auto = the cheaper by the cost model; fused on a backend without a fused merge runs "
                            "separate")
    num_splits: int = Field(0, ge=0, le=MAX_SPLITS, description="0 = heuristic, 1 = never split, >1 = forced")
    max_splits: int = Field(256, ge=1, le=MAX_SPLITS, description="most splits the planner gives a sequence (a "
                            "forced num_splits is its own limit)")
    min_chunk_tokens: int = Field(64, ge=16, le=1 << 20, description="smallest chunk the planner makes (cost model "
                                                                     "and tuned table; not a forced num_splits), tokens")
    batch_invariant: bool = Field(False, description="fix each sequence's units from its own length alone (units of "
                                  "invariant_chunk_tokens), so its output is bitwise independent of its batchmates, "
                                  "under CUDA-graph replay too; kernel options then do not depend on the batch. "
                                  "A forced num_splits (1 or more, here or in the call) takes precedence")
    invariant_chunk_tokens: int = Field(2048, ge=16, le=1 << 20, description="unit size of the batch-invariant "
                                        "schedule, tokens (rounded up to the granule)")

    @field_validator("partition", mode="before")
    @classmethod
    def _partition_removed(cls, v):
        if v == "split_v":
            raise ValueError("split_v was removed from attnplan; use split_k or auto")
        return v

    @field_validator("merge", mode="before")
    @classmethod
    def _merge_removed(cls, v):
        if v == "atomic":
            raise ValueError("atomic was removed from attnplan; use separate, fused or auto")
        return v


class CostModel(_Strict):
    """Constants of the planner's cost model (microseconds, GB/s): finite and bounded, positive but for the fixed
    costs (``launch_us``, ``program_us``, ``merge_split_latency_us``) and the optional ``tail_programs_per_sm`` and
    ``tail_min_unit_tokens``, which may be 0. Defaults are conservative guesses; ``attnplan tune`` measures them per
    device into ``plans/<device>.yaml``."""

    launch_us: float = Field(3.0, ge=0, le=1e4, description="fixed cost of one kernel launch")
    program_us: float = Field(1.0, ge=0, le=1e4, description="fixed cost of one program (CTA): prologue, q load, "
                                                             "epilogue")
    programs_per_sm: int = Field(2, ge=1, le=32, description="programs resident per SM (a wave is this x SMs)")
    paged_programs_per_sm: int | None = Field(None, ge=1, le=32, description="the same for paged caches (null = as "
                                                                             "contiguous)")
    sat_programs_per_sm: float = Field(2.0, ge=1 / 64, le=64, description="resident programs per SM needed to "
                                                                          "saturate memory bandwidth")
    paged_sat_programs_per_sm: float | None = Field(None, ge=1 / 64, le=64, description="the same for paged caches "
                                                                                       "(null = as contiguous)")
    bandwidth_fraction: float = Field(0.9, ge=0.01, le=1, description="share of the measured bandwidth a streaming "
                                                                      "kernel reaches")
    mem_bandwidth_gbs: float | None = Field(None, ge=1, le=1e6, description="measured read bandwidth; overrides the "
                                                                            "device's estimate")
    merge_split_latency_us: float = Field(0.4, ge=0, le=1e4, description="fused merge: serialized cost per split "
                                                                         "read by the last program")
    tail_target_scale: float = Field(1.0, ge=0.125, le=16, description="work units of a long-tailed batch (mean "
                                     "length below half the longest) per unit of a uniform batch of the same work: "
                                     "the device-side schedule's second targets table")
    tail_programs_per_sm: float = Field(0.0, ge=0, le=64, description="long-tailed batches: at least this many "
                                        "programs with work per SM (targets raised to this x SMs / KV heads units); "
                                        "0 = off")
    tail_min_unit_tokens: int = Field(0, ge=0, le=1 << 20, description="long-tailed batches: units of at least this "
                                      "many tokens on average (targets capped at the bucket's tokens / this; it wins "
                                      "over tail_programs_per_sm); 0 = off")


class PlanCacheConfig(_Strict):
    enabled: bool = True
    disk: bool = True
    dir: str | None = Field(None, min_length=1, description="directory of the on-disk cache; null = the user cache "
                                                            "directory")
    memory_entries: int = Field(1024, ge=1, le=1 << 20)

    @field_validator("dir")
    @classmethod
    def _no_nul(cls, v):
        if v is not None and "\0" in v:
            raise ValueError("a path cannot hold a NUL character")
        if v is None:
            return v
        try:  # "~/x": the home folder's x, not a folder named "~"
            return expand_home(v, "plan_cache.dir")
        except ConfigError as e:
            raise ValueError(str(e).split(": ", 1)[1]) from None


class _FrozenDict(dict):
    """A dict that refuses edits (a validated :class:`Config`'s ``backends_by_arch``); it copies and pickles."""

    def _refuse(self, *_, **__):
        raise TypeError("a Config is immutable: make a new one (Config.with_overrides, load_config)")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):
        return type(self), (dict(self),)


class Config(_Strict):
    """The validated configuration. See ``plans/default.yaml`` for every key with its default: ``load_config()``
    reads that file first. A bare ``Config()`` holds the models' own defaults, which differ from the file's in two
    keys: ``backends_fp8_kv`` (``None``) and ``backends_by_arch`` (``{}``), so it keeps ``backends``' order for an
    fp8 cache and on sm_90 (where the file puts cuda_ptx first).

    Immutable all the way down: after validation the backend lists (lists in a file, lists or tuples in code) are
    stored as tuples and ``backends_by_arch`` as a dict that refuses edits (``TypeError``), so they cannot be edited
    in place past the checks; ``model_dump()`` gives plain lists, and a config's own values may be passed back
    (``with_overrides(backends=c.backends[:2])``). Make a changed config with :meth:`with_overrides` or
    :func:`load_config` (pydantic's ``model_copy(update=...)`` validates nothing)."""

    version: Literal[1] = 1
    backends: list[BackendName] = Field(default_factory=lambda: list(BACKEND_NAMES), min_length=1, max_length=4)
    backends_fp8_kv: list[BackendName] | None = Field(
        None, min_length=1, max_length=4, description="for a 1-byte (fp8) KV cache these go first, in this order; only "
                                                      "backends also in `backends` are used; null = backends' order")
    backends_by_arch: dict[Annotated[str, StringConstraints(pattern=r"^sm_[0-9]{2,3}$")],
                           Annotated[list[BackendName], Field(max_length=4)]] | None = Field(
        default_factory=dict, description="per GPU architecture (`sm_90` for compute capability 9.0), the backends that "
                                          "go first there, in this order (after backends_fp8_kv for an fp8 cache); "
                                          "only backends also in `backends` are used; [] for an architecture or null "
                                          "for all: `backends`' order")
    deterministic: bool = Field(True, description="no effect, either value: reruns of one plan are always bitwise "
                                                  "identical (fixed merge order); accepted for older config files")
    split: SplitPolicy = SplitPolicy()
    cost_model: CostModel = CostModel()
    plan_cache: PlanCacheConfig = PlanCacheConfig()
    backend_options: BackendOptions = BackendOptions()

    @field_validator("backends", "backends_fp8_kv", mode="before")
    @classmethod
    def _list_from_tuple(cls, v):
        """A config's own (tuple) values passed back, e.g. ``with_overrides(backends=c.backends[:2])``."""
        return list(v) if isinstance(v, tuple) else v

    @field_validator("backends_by_arch", mode="before")
    @classmethod
    def _by_arch_from_frozen(cls, v):
        """As :meth:`_list_from_tuple`, for ``backends_by_arch`` (its own frozen dict of tuples, passed back)."""
        if isinstance(v, dict):
            return {k: list(x) if isinstance(x, tuple) else x for k, x in v.items()}
        return v

    @model_validator(mode="after")
    def _no_duplicate_backends(self) -> "Config":
        """No backend twice in one list (``backends``, ``backends_fp8_kv``, each of ``backends_by_arch``): a file's
        error names the file and the key (:func:`_format_errors`)."""
        lists = [("backends", self.backends), ("backends_fp8_kv", self.backends_fp8_kv or [])]
        lists += [(f"backends_by_arch.{k}", v) for k, v in (self.backends_by_arch or {}).items()]
        for key, v in lists:
            if len(set(v)) != len(v):
                raise ValueError(f"{key}: duplicate entries (got {short_repr(v, 200)})")
        # frozen all the way down: a list edited in place after validation (``config.backends.insert(...)``) would
        # skip these checks and change the backend order of new wrappers only (a context memoizes its own)
        object.__setattr__(self, "backends", tuple(self.backends))
        if self.backends_fp8_kv is not None:
            object.__setattr__(self, "backends_fp8_kv", tuple(self.backends_fp8_kv))
        if self.backends_by_arch is not None:
            object.__setattr__(self, "backends_by_arch",
                               _FrozenDict({k: tuple(v) for k, v in self.backends_by_arch.items()}))
        return self

    @field_serializer("backends", "backends_fp8_kv")
    def _dump_list(self, v):
        return None if v is None else list(v)

    @field_serializer("backends_by_arch")
    def _dump_by_arch(self, v):
        return None if v is None else {k: list(x) for k, x in v.items()}

    def options(self, backend: str) -> BaseModel:
        """The options model of ``backend`` (:data:`OPTION_MODELS`); raises ``KeyError`` for an unknown name."""
        if backend not in OPTION_MODELS:
            raise KeyError(f"unknown backend {backend!r}; known: {sorted(OPTION_MODELS)}")
        return getattr(self.backend_options, backend)

    def with_overrides(self, **changes: Any) -> "Config":
        """A copy with nested keys replaced, e.g. ``with_overrides(split={"num_splits": 4})``; this config is
        unchanged.

        Raises:
            ConfigError: the merged settings fail validation (an unknown key, a value of the wrong type or out of
                range), naming the key.
        """
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


def _known_keys(loc: tuple) -> str:
    """For an unknown key at ``loc``: the nearest known key (``difflib``) and the keys its mapping takes, as text
    (empty where the mapping is not one of the config's models)."""
    model: Any = Config
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return ""
        model = ann
    keys = [k for k, f in model.model_fields.items() if not f.exclude]
    near = difflib.get_close_matches(str(loc[-1]), keys, n=1)
    return (f"; did you mean {near[0]!r}?" if near else "") + (f" (known keys: {', '.join(keys)})" if keys
                                                                else " (this mapping takes no keys)")


#: number text that YAML 1.1 leaves a string (``1e3``, ``1.5E3``): a float written without its dot or exponent sign
_FLOAT_TEXT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)[eE][-+]?\d+")


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    errors = err.errors()
    for e in errors[:MAX_ERRORS]:
        key = ".".join(str(p) for p in e["loc"]) or "<top>"
        val = e.get("input")
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key" + _known_keys(e["loc"])
        elif isinstance(val, str) and e["type"] in ("float_type", "float_parsing") and _FLOAT_TEXT.fullmatch(val):
            # YAML 1.1 (PyYAML) reads an exponent without a dot or a signed exponent as a string
            msg += f"; YAML reads {val} as a string: write it with a dot and a signed exponent, e.g. 1.0e+3"
        if not e["loc"]:  # a cross-key check (Config's model validator): its message names the keys
            lines.append("  " + msg.removeprefix("Value error, "))
            continue
        lines.append(f"  {key}: {msg.removeprefix('Value error, ')} (got {short_repr(val, 200)})")
    if len(errors) > MAX_ERRORS:
        lines.append(f"  ... and {len(errors) - MAX_ERRORS} more")
    return f"invalid attnplan config ({source}):\n" + "\n".join(lines)


def _validate(data: Any, source: str) -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"invalid attnplan config ({source}): top level must be a mapping, got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


class _DuplicateKey(yaml.YAMLError):
    """A mapping of the file names one key twice (PyYAML keeps the last silently)."""

    def __init__(self, key: Any, mark, first):
        super().__init__(f"duplicate key {short_repr(key, 200)} at line {mark.line + 1}, column {mark.column + 1} "
                         f"(first at line {first.line + 1}, column {first.column + 1}); a key may appear once per mapping")


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with nesting bounded to :data:`MAX_DEPTH` (its composer recurses per level) and
    duplicate keys refused in every mapping, at any depth (:class:`_DuplicateKey`; a key a ``<<`` merge brings in
    may still be overridden, as YAML's merge key intends)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: PyYAML's own error names it
                    continue
                if first is not key_node:
                    raise _DuplicateKey(key, key_node.start_mark, first.start_mark)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        if ":" in node.value:  # YAML 1.1's base 60 (1:00 is 60): a time-like typo, not a number anyone means here
            raise yaml.constructor.ConstructorError(None, None, f"{node.value!r} is a base-60 number in YAML 1.1 "
                                                    f"(it would read as {super().construct_yaml_int(node)}); write the "
                                                    "number itself", node.start_mark)
        digits = node.value.replace("_", "").lstrip("+-")
        if len(digits) > 1 and digits[0] == "0" and digits[1].isdigit():  # YAML 1.1's octal: 010 is 8
            raise yaml.constructor.ConstructorError(None, None, f"{node.value!r} is an octal number in YAML 1.1 "
                                                    f"(it would read as {super().construct_yaml_int(node)}); write "
                                                    "the decimal number without leading zeros", node.start_mark)
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node):
        if ":" in node.value:
            raise yaml.constructor.ConstructorError(None, None, f"{node.value!r} is a base-60 number in YAML 1.1; "
                                                    "write the number itself", node.start_mark)
        return super().construct_yaml_float(node)

    def compose_node(self, parent, index):
        depth = getattr(self, "_attnplan_depth", 0)
        if depth >= MAX_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels",
                                              self.peek_event().start_mark)
        self._attnplan_depth = depth + 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._attnplan_depth = depth


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)
_BoundedLoader.add_constructor("tag:yaml.org,2002:float", _BoundedLoader.construct_yaml_float)


def _count_values(data: Any, limit: int) -> int:
    """Values in ``data`` with shared (aliased) objects counted each time they appear; stops past ``limit``."""
    n, stack = 0, [data]
    while stack:
        x = stack.pop()
        n += 1
        if n > limit:
            break
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return n


def _read_yaml(path: Path | str, source: str) -> dict:
    """Read a YAML file as UTF-8 within the module's bounds. Raises :class:`ConfigError` for every failure."""
    try:
        if not isinstance(path, resources.abc.Traversable) and not stat.S_ISREG(os.stat(path).st_mode):
            # a FIFO or a device would block or never end: a config is a file
            raise ConfigError(f"attnplan config {source} is not a regular file")
        opener = path.open if isinstance(path, resources.abc.Traversable) else Path(path).open
        with opener("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:  # ValueError: a path the OS cannot take (an embedded NUL)
        raise ConfigError(f"cannot read attnplan config {source}: {e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"attnplan config {source} is larger than {MAX_CONFIG_BYTES} bytes; a config is a few "
                          "hundred bytes")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"attnplan config {source} is not UTF-8 text: {e}") from None
    try:
        data = yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 (a SafeLoader subclass)
    except _DuplicateKey as e:
        raise ConfigError(f"invalid attnplan config ({source}): {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"attnplan config {source} is not valid YAML: {_yaml_error(e)}") from None
    except RecursionError:
        raise ConfigError(f"attnplan config {source} is nested too deeply") from None
    except ValueError as e:  # an int of more digits than Python converts (sys.get_int_max_str_digits)
        raise ConfigError(f"attnplan config {source} holds a value that cannot be read: {e}") from None
    if _count_values(data, MAX_NODES) > MAX_NODES:
        raise ConfigError(f"attnplan config {source} expands to more than {MAX_NODES} values (YAML aliases "
                          "repeating a large value?)")
    return data if data is not None else {}


def _yaml_error(e: yaml.YAMLError) -> str:
    """One line for a YAML parse error: the problem and where in the file (PyYAML's own text spans several lines and
    names the decoded text, not the file)."""
    mark = getattr(e, "problem_mark", None)
    what = " ".join(str(getattr(e, "problem", None) or e).split())
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context = getattr(e, "context", None)
    line = where + what + (f" ({' '.join(str(context).split())})" if context else "")
    return line[:300] + " ..." if len(line) > 300 else line


@functools.lru_cache(maxsize=1)
def _default_data() -> dict:
    return _read_yaml(resources.files("attnplan.plans") / "default.yaml", "plans/default.yaml")


def load_config(path: str | os.PathLike | None = None, **overrides: Any) -> Config:
    """Load ``plans/default.yaml`` and merge the user's file over it.

    Args:
        path: a YAML file (a leading ``~`` is the home folder); when ``None``, ``$ATTNPLAN_CONFIG`` if set and not
            empty.
        **overrides: top-level keys merged last (for tests and the CLI).
    Raises:
        TypeError: ``path`` is neither ``None``, a ``str`` nor an ``os.PathLike`` (a file descriptor, bytes, ...).
        ConfigError: an empty ``path``; an unreadable, oversized, non-UTF-8 or too deeply nested file, a path the OS
            refuses (e.g. with a NUL character), bad YAML, an alias bomb, a key given twice in one mapping, unknown
            key, or bad value (each names the file and the key).
    """
    data = dict(_default_data())
    src = "plans/default.yaml"
    path = path if path is not None else os.environ.get("ATTNPLAN_CONFIG") or None
    if path is not None:
        if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
            raise TypeError(f"load_config: path must be a str or os.PathLike naming a YAML file, or None, got "
                            f"{type(path).__name__} {short_repr(path)}")
        if not os.fspath(path):  # ``--config ''`` / ``load_config('')``: an empty variable's text, not a file
            raise ConfigError("invalid attnplan config: the path is empty (give a YAML file, or None / no "
                              "--config for plans/default.yaml; an empty $ATTNPLAN_CONFIG counts as unset)")
        path = os.path.expanduser(path)  # "~/attnplan.yaml" from the environment or a quoted argument
        user = _read_yaml(path, str(path))
        if not isinstance(user, dict):
            raise ConfigError(f"invalid attnplan config ({path}): top level must be a mapping, got "
                              f"{type(user).__name__}")
        data = _deep_merge(data, user)
        src = str(path)
    if overrides:
        data = _deep_merge(data, overrides)
        src = f"{src} with overrides" if path is not None else "override"
    return _validate(data, src)


_TABLE_OVERRIDES: dict[str, dict] = {}  # slug -> table: attnplan tune's table while it tunes


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

    Memoized per ``slug`` for the process, as are the planner's views of it: after writing a table or changing
    ``$ATTNPLAN_CACHE_DIR``, call :func:`attnplan.reload_device_tables` (``attnplan tune`` does).

    Raises:
        ConfigError: the file found is unreadable, not YAML, or fails :func:`check_device_table` (a section that
            is not a mapping, invalid cost-model constants, a bad or duplicated split-table row); the message
            names the file and the key or row.
    """
    from .device import user_table_path

    if slug in _TABLE_OVERRIDES:  # attnplan tune's table while it tunes (tune.table_override)
        return _TABLE_OVERRIDES[slug]
    user = user_table_path(slug)
    if user.is_file():
        f, source = user, str(user)
    else:
        _warn_old_table_name(user, slug)
        f, source = resources.files("attnplan.plans") / f"{slug}.yaml", f"plans/{slug}.yaml"
        if not f.is_file():
            return {}
    return check_device_table(_read_yaml(f, source), source)


def _warn_old_table_name(user: Path, slug: str) -> None:
    """Warn where the user's table directory holds a file of the name an earlier attnplan gave this device's table
    (the device name's first word, ``h100.yaml`` for ``h100_80gb_hbm3``) and none of the current name: it is not
    read, since that name was shared by every model of the first word (an H100's SXM and PCIe parts)."""
    old = user.with_name(slug.split("_")[0] + ".yaml")
    if old != user and old.is_file():
        import warnings

        warnings.warn(f"{old} is not read: device tables are named by the whole device name now; if it was measured "
                      f"on this device, rename it to {user.name} (then attnplan.reload_device_tables())",
                      UserWarning, stacklevel=3)


_TABLE_SECTIONS = ("cost_model", "cost_model_by_backend", "kernel_options", "split_table", "measured")


def check_device_table(data, source: str) -> dict:
    """``data`` (a device table as read from YAML) if it is one, with every section checked; else ``ConfigError``.

    Checks: the top level (no other sections than these) and each of ``cost_model``, ``cost_model_by_backend`` (per
    backend), ``kernel_options`` (per backend, per layout: option name to JSON scalar), ``split_table`` (per backend,
    per layout: a list of rows) and ``measured`` is a mapping or empty; the cost-model constants validate as
    :class:`CostModel`; every split-table row parses (:meth:`attnplan.planner.TableRow.from_row`: pairs, KV length,
    group and head_dim ints in ``[1, 2^31)``, a finite programs per SM > 0); no two rows of a layout share a point
    (pairs, KV length, group, head_dim), which the planner and ``attnplan tune`` would otherwise resolve apart.

    Raises:
        ConfigError: the first defect, naming ``source`` and the key or row.
    """
    from .planner import TableRow, json_scalar

    def mapping(value, where: str) -> dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"invalid device table ({source}): {where} must be a mapping, got {type(value).__name__}")
        return value

    if not isinstance(data, dict):
        raise ConfigError(f"invalid device table ({source}): top level must be a mapping, got {type(data).__name__}")
    for key in data:  # a misspelt section would be ignored, and its rows with it
        if key not in _TABLE_SECTIONS:
            near = difflib.get_close_matches(str(key), _TABLE_SECTIONS, n=1)
            raise ConfigError(f"invalid device table ({source}): unknown section {short_repr(key, 80)}"
                              + (f"; did you mean {near[0]!r}?" if near else "")
                              + f" (known sections: {', '.join(_TABLE_SECTIONS)})")
    for key in _TABLE_SECTIONS:
        mapping(data.get(key), key)
    try:
        CostModel.model_validate(data.get("cost_model") or {})
        for name, entry in mapping(data.get("cost_model_by_backend"), "cost_model_by_backend").items():
            over = mapping(entry, f"cost_model_by_backend.{name}")
            CostModel.model_validate({**(data.get("cost_model") or {}), **over})
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None

    def check_options(backend, opts: dict, where: str) -> None:
        """A built-in backend's kernel options as its ``backend_options`` model takes them (the same ranges as a
        config file's), so a hand-edited table cannot plan a kernel the backend cannot build."""
        model = OPTION_MODELS.get(backend)
        if model is None:  # another backend's options: its own kernel_config checks them
            return
        try:
            model.model_validate({k: v for k, v in opts.items() if v is not None})
        except ValidationError as e:
            first = e.errors()[0]
            key = ".".join(str(p) for p in first["loc"])
            msg = ("unknown key" + _known_keys(("backend_options", backend, key)) if first["type"] == "extra_forbidden"
                   else first["msg"].removeprefix("Value error, "))
            raise ConfigError(f"invalid device table ({source}): {where}.{key}: {msg} (got "
                              f"{short_repr(first.get('input'), 200)})") from None

    for backend, layouts in mapping(data.get("kernel_options"), "kernel_options").items():
        for layout, opts in mapping(layouts, f"kernel_options.{backend}").items():
            for name, value in mapping(opts, f"kernel_options.{backend}.{layout}").items():
                if not json_scalar(value):
                    raise ConfigError(f"invalid device table ({source}): kernel_options.{backend}.{layout}.{name} "
                                      f"must be a JSON scalar (null: the backend's default), got {value!r}")
            check_options(backend, opts or {}, f"kernel_options.{backend}.{layout}")
    for backend, layouts in mapping(data.get("split_table"), "split_table").items():
        for layout, rows in mapping(layouts, f"split_table.{backend}").items():
            where = f"split_table.{backend}.{layout}"
            if rows is None:
                continue
            if not isinstance(rows, list):
                raise ConfigError(f"invalid device table ({source}): {where} must be a list of rows, got "
                                  f"{type(rows).__name__}")
            seen: dict = {}
            for i, raw in enumerate(rows):
                try:
                    row = TableRow.from_row(raw)
                except ValueError as e:
                    raise ConfigError(f"invalid device table ({source}): {where}[{i}]: {e}") from None
                check_options(backend, dict(row.options or {}), f"{where}[{i}].options")
                point = (row.pairs, row.kv_len, row.group, row.head_dim)
                if point in seen:
                    raise ConfigError(f"invalid device table ({source}): {where}[{seen[point]}] and [{i}] are both "
                                      f"rows of {row.pairs} pairs x {row.kv_len} tokens (group {row.group}, head_dim "
                                      f"{row.head_dim}); keep one")
                seen[point] = i
    return data
