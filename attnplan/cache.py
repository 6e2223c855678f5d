"""The plan cache: an in-memory LRU in front of versioned JSON files on disk.

Key: the device fingerprint (name, SM count, compute capability, driver), the library and
plan-format versions, the backend, the problem bucket (batch, heads, head_dim, q_len, dtypes, page
size, KV-length buckets), whether the plan is a capacity plan, and the config's planning inputs
(split policy, cost model, the backend's kernel options). Files are written atomically (a
temporary file in the same folder, then ``os.replace``), so another process never reads a
half-written plan; an unwritable folder drops to memory with one warning.

The cache trusts nothing it reads: a file that does not load and validate as a plan for its key
is a miss with a ``RuntimeWarning`` naming the file, and is rebuilt (never an exception, never a
wrong answer). A file must be a regular file of at most :data:`MAX_PLAN_BYTES` bytes of UTF-8 JSON, an
object with this library's and plan format's versions and the requested key, whose ``plan``
rebuilds with :meth:`SplitPlan.from_dict` and passes :func:`check_plan`: field types, the problem
it names (a valid :class:`~attnplan.DecodeProblem`), ``SplitPlan.validate(problem)`` where the plan
class has it (else the grid / merge grid / workspace / chunk-alignment checks here), and the
caller's own ``validate`` (see :meth:`PlanCache.get_or_create`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import stat
import tempfile
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import platformdirs

from ._version import __version__
from .planner import PLAN_VERSION, SplitPlan
from .problem import DecodeProblem

__all__ = ["PlanCache", "CacheStats", "default_cache_dir", "check_plan", "load_plan_file", "MAX_PLAN_BYTES",
           "UNUSABLE"]

#: largest plan file read, bytes (a plan is a few KiB)
MAX_PLAN_BYTES = 1 << 20
#: what makes a plan file unusable (a miss with a warning, never an exception out of the cache)
UNUSABLE = (ValueError, TypeError, KeyError, AttributeError, IndexError, json.JSONDecodeError, UnicodeDecodeError,
            OSError, RecursionError, OverflowError)
_TMP_PREFIX = ".tmp-"


def default_cache_dir() -> Path:
    """``$ATTNPLAN_CACHE_DIR`` if set, else the platform's user cache directory for attnplan."""
    env = os.environ.get("ATTNPLAN_CACHE_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir("attnplan"))


def _int(name: str, v, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}"[:200])
    return v


def plan_problem_of(plan: SplitPlan) -> DecodeProblem:
    """The :class:`DecodeProblem` a plan names in ``plan.problem`` (its bucketed fields). Raises
    ``ValueError`` / ``TypeError`` / ``KeyError`` when they are not a valid problem."""
    p = plan.problem
    if not isinstance(p, dict):
        raise TypeError(f"plan.problem must be a mapping, got {type(p).__name__}")
    batch, max_len = _int("problem.batch", p["batch"], 1), _int("problem.max_kv_len", p["max_kv_len"])
    mean = _int("problem.mean_kv_len", p.get("mean_kv_len", max_len))
    fields = {f.name for f in dataclasses.fields(DecodeProblem)} - {"max_kv_len", "total_kv_len"}
    kw = {k: p[k] for k in fields if k in p}
    for k, v in kw.items():
        if k in ("q_dtype", "kv_dtype", "kv_scale"):
            if not isinstance(v, str):
                raise TypeError(f"problem.{k} must be a string, got {v!r}"[:200])
        elif k == "soft_cap":
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"problem.soft_cap must be a number, got {v!r}"[:200])
        elif k == "has_sinks":
            if not isinstance(v, bool):
                raise TypeError(f"problem.has_sinks must be a bool, got {v!r}"[:200])
        elif k == "page_size" and v is None:
            pass
        else:
            _int(f"problem.{k}", v, -1)
    return DecodeProblem(max_kv_len=max_len, total_kv_len=min(mean, max_len) * batch, **kw)


def _check_layout(plan: SplitPlan, problem: DecodeProblem) -> None:
    """The plan's grid, merge grid, workspace and chunk alignment fit ``problem`` (the plan format of
    :func:`attnplan.planner.make_plan`: grid ``(num_splits * column_programs, num_kv_heads, batch)``)."""
    rows = problem.batch * problem.q_len * problem.num_q_heads
    want = (plan.num_splits * plan.column_programs, problem.num_kv_heads, problem.batch)
    if plan.grid != want:
        raise ValueError(f"grid {plan.grid} does not fit the problem: expected {want}")
    if plan.single_pass != (plan.num_splits == 1):
        raise ValueError(f"single_pass {plan.single_pass} with {plan.num_splits} split(s)")
    if plan.single_pass:
        if plan.merge != "none" or plan.merge_grid != (0,):
            raise ValueError(f"a single-pass plan has merge 'none' and merge grid (0,), got {plan.merge!r} "
                             f"{plan.merge_grid}")
    else:
        want_m = (rows,) if plan.merge == "separate" else (0,)
        if plan.merge not in ("separate", "fused", "atomic") or plan.merge_grid != want_m:
            raise ValueError(f"merge {plan.merge!r} with merge grid {plan.merge_grid} (expected {want_m})")
    ws = rows * plan.state_slots * (problem.head_dim + 1) * 4 + plan.sync_words * 4
    if plan.workspace_bytes != ws:
        raise ValueError(f"workspace_bytes {plan.workspace_bytes} != {ws} for the problem")
    block_n = _int("kernel.block_n", plan.kernel.get("block_n"), 1)
    align = math.lcm(block_n, problem.page_size or 1)
    if plan.chunk_size % align:
        raise ValueError(f"chunk_size {plan.chunk_size} is not a multiple of block_n and the page size ({align})")


def _pow2(name: str, v, lo: int, hi: int) -> None:
    if _int(name, v, lo) > hi or v & (v - 1):
        raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {v!r}")


def _check_kernel(plan: SplitPlan) -> None:
    """Hard limits of the kernels the plan's options feed (what a tampered file could break): Triton's
    ``tl.arange`` tile and warp count must be powers of two; numba's thread layout must be whole."""
    k = plan.kernel
    _int("kernel.block_n", k.get("block_n"), 1)
    if plan.backend == "triton":
        _pow2("kernel.block_n", k["block_n"], 16, 1024)
        _pow2("kernel.num_warps", k.get("num_warps"), 1, 32)
        if _int("kernel.num_stages", k.get("num_stages"), 1) > 16:
            raise ValueError(f"kernel.num_stages must be in [1, 16], got {k['num_stages']}")
    elif plan.backend == "numba" and all(n in k for n in ("lanes", "threads", "unroll")):
        _pow2("kernel.lanes", k["lanes"], 1, 32)
        threads, unroll = _int("kernel.threads", k["threads"], 1), _int("kernel.unroll", k["unroll"], 1)
        if threads > 1024 or threads % k["lanes"] or k["block_n"] != threads // k["lanes"] * unroll:
            raise ValueError(f"kernel threads {threads} / lanes {k['lanes']} / unroll {unroll} / block_n "
                             f"{k['block_n']} do not make a thread layout")


def check_plan(plan: SplitPlan, problem: DecodeProblem | None = None) -> DecodeProblem:
    """Validate a plan read from disk as strictly as a config: field types and ranges, the problem it
    names, then ``plan.validate(problem)`` where :class:`SplitPlan` has it, else the layout checks
    of this module. ``problem`` defaults to the plan's own (:func:`plan_problem_of`).

    Returns the problem checked against. Raises ``ValueError`` / ``TypeError`` / ``KeyError`` naming the
    field that is wrong.
    """
    for name in ("backend", "policy", "merge", "partition"):
        if not isinstance(getattr(plan, name), str):
            raise TypeError(f"{name} must be a string, got {getattr(plan, name)!r}"[:200])
    for name in ("single_pass", "capacity_mode"):
        if not isinstance(getattr(plan, name), bool):
            raise TypeError(f"{name} must be a bool, got {getattr(plan, name)!r}"[:200])
    _int("num_splits", plan.num_splits, 1)
    _int("chunk_size", plan.chunk_size, 1)
    _int("workspace_bytes", plan.workspace_bytes)
    _int("column_programs", plan.column_programs, 1)
    if plan.version != PLAN_VERSION:
        raise ValueError(f"plan version {plan.version!r} != {PLAN_VERSION}")
    if len(plan.grid) != 3:
        raise ValueError(f"grid must be 3 ints >= 1, got {plan.grid}"[:200])
    for g in plan.grid:
        _int("grid", g, 1)
    if len(plan.merge_grid) != 1:
        raise ValueError(f"merge_grid must be 1 int, got {plan.merge_grid}"[:200])
    _int("merge_grid", plan.merge_grid[0])
    if isinstance(plan.predicted_us, bool) or not isinstance(plan.predicted_us, (int, float)) \
            or not math.isfinite(plan.predicted_us):
        raise ValueError(f"predicted_us must be a finite number, got {plan.predicted_us!r}")
    if not isinstance(plan.kernel, dict) or not isinstance(plan.device, dict):
        raise TypeError("kernel and device must be mappings")
    for k, v in plan.kernel.items():
        if not isinstance(k, str) or not (v is None or isinstance(v, (bool, int, str))
                                          or (isinstance(v, float) and math.isfinite(v))):
            raise ValueError(f"kernel option {k!r} = {v!r} is not a plain value"[:200])
    _check_kernel(plan)
    problem = problem if problem is not None else plan_problem_of(plan)
    validate = getattr(plan, "validate", None)
    if callable(validate):
        validate(problem)
    else:
        _check_layout(plan, problem)
    return problem


def _read_limited(path: Path) -> str:
    """A regular file's text (UTF-8, at most :data:`MAX_PLAN_BYTES`). Raises ``FileNotFoundError``,
    ``OSError``, ``ValueError`` (not a regular file, too large) or ``UnicodeDecodeError``."""
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    with open(path, "rb") as f:
        raw = f.read(MAX_PLAN_BYTES + 1)
    if len(raw) > MAX_PLAN_BYTES:
        raise ValueError(f"larger than {MAX_PLAN_BYTES} bytes")
    return raw.decode("utf-8")


def load_plan_file(path: str | os.PathLike, key: tuple | None = None) -> SplitPlan:
    """Load and validate one plan file (``key``: the key it must have been written for; ``None``: any).

    Raises one of :data:`UNUSABLE` (``FileNotFoundError`` when there is no file) naming what is wrong.
    """
    data = json.loads(_read_limited(Path(path)))
    if not isinstance(data, dict):
        raise ValueError(f"a plan file holds a JSON object, got {type(data).__name__}")
    if data.get("plan_version") != PLAN_VERSION or data.get("library") != __version__:
        raise ValueError(f"written by plan format {data.get('plan_version')!r} / attnplan {data.get('library')!r}"[:200])
    if key is not None and data.get("key") != json.loads(json.dumps(key, default=str)):
        raise ValueError("key mismatch (the file was written for another key)")
    if not isinstance(data.get("plan"), dict):
        raise ValueError("no plan object in the file")
    plan = SplitPlan.from_dict(data["plan"])
    check_plan(plan)
    return plan


@dataclass
class CacheStats:
    """Counters: ``hits`` (memory), ``disk_hits``, ``misses`` (planned anew), ``writes``,
    ``rebuilt`` (unusable files replaced)."""

    hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    writes: int = 0
    rebuilt: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class PlanCache:
    """In-memory LRU plan cache backed by a directory of JSON files.

    Args:
        directory: on-disk folder (``None``: :func:`default_cache_dir`); plans go in
            ``<directory>/v<PLAN_VERSION>/<key>.json``.
        disk: use the disk at all.
        memory_entries: LRU capacity.
    """

    def __init__(self, directory: str | os.PathLike | None = None, *, disk: bool = True, memory_entries: int = 1024):
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.disk = disk
        self.memory_entries = memory_entries
        self.stats = CacheStats()
        self._mem: OrderedDict[tuple, SplitPlan] = OrderedDict()
        self._lock = threading.Lock()
        self._warned_disk = False

    @property
    def folder(self) -> Path:
        return self.directory / f"v{PLAN_VERSION}"

    @staticmethod
    def disk_key(key: tuple) -> str:
        """File name of a key: sha256 of its canonical JSON with the library version."""
        blob = json.dumps([__version__, PLAN_VERSION, key], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def lookup(self, key: tuple) -> SplitPlan | None:
        """Memory-only lookup (no disk, no counters): the hot path of ``run()``."""
        return self._mem.get(key)

    def get_or_create(self, key: tuple, build: Callable[[], SplitPlan],
                      validate: Callable[[SplitPlan], None] | None = None) -> SplitPlan:
        """Return the cached plan for ``key`` or build, store and return it.

        Args:
            validate: called with a plan read from disk, after :func:`check_plan`; raising one of
                :data:`UNUSABLE` (e.g. ``ValueError``: the plan does not fit the caller's problem) makes
                the file a miss with a warning. Plans from memory or ``build`` are not re-validated.
        """
        plan = self._mem.get(key)
        if plan is not None:
            self.stats.hits += 1
            with self._lock:
                if key in self._mem:
                    self._mem.move_to_end(key)
            return plan
        plan = self._read(key, validate)
        if plan is not None:
            self.stats.disk_hits += 1
        else:
            self.stats.misses += 1
            plan = build()
            self._write(key, plan)
        self._remember(key, plan)
        return plan

    def _remember(self, key: tuple, plan: SplitPlan) -> None:
        with self._lock:
            self._mem[key] = plan
            self._mem.move_to_end(key)
            while len(self._mem) > self.memory_entries:
                self._mem.popitem(last=False)

    def _path(self, key: tuple) -> Path:
        return self.folder / f"{self.disk_key(key)}.json"

    def _warn_disk(self, msg: str) -> None:
        if not self._warned_disk:
            warnings.warn(f"attnplan plan cache: {msg}; keeping plans in memory only", RuntimeWarning, stacklevel=4)
            self._warned_disk = True
        self.disk = False

    def _read(self, key: tuple, validate: Callable[[SplitPlan], None] | None = None) -> SplitPlan | None:
        if not self.disk:
            return None
        path = self._path(key)
        try:
            plan = load_plan_file(path, key)
            if validate is not None:
                validate(plan)
            return plan
        except FileNotFoundError:
            return None
        except PermissionError as e:
            self._warn_disk(f"cannot read {path}: {e}")
            return None
        except UNUSABLE as e:
            msg = str(e)
            warnings.warn(f"attnplan plan cache: {path} is unusable ({type(e).__name__}: "
                          f"{msg[:200] + '...' if len(msg) > 200 else msg}); rebuilding it", RuntimeWarning, stacklevel=4)
            self.stats.rebuilt += 1
            return None

    def _write(self, key: tuple, plan: SplitPlan) -> None:
        if not self.disk:
            return
        path = self._path(key)
        payload = json.dumps({"plan_version": PLAN_VERSION, "library": __version__, "key": key,
                              "plan": plan.to_dict()}, sort_keys=True, default=str)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=_TMP_PREFIX, suffix=".json")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(payload)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            self.stats.writes += 1
        except OSError as e:
            self._warn_disk(f"cannot write {path}: {e}")

    def _files(self) -> list[Path]:
        """Every ``v*/*.json`` entry under the directory (plans and leftover temporary files), sorted;
        raises ``OSError`` when the directory cannot be listed."""
        if not self.directory.is_dir():
            return []
        return sorted(self.directory.glob("v*/*.json"))

    def clear(self, *, disk: bool = True, errors: list | None = None) -> int:
        """Empty the memory LRU and (``disk=True``) delete every plan file and leftover temporary file;
        returns the files removed. Files that cannot be removed (a read-only folder) are skipped;
        ``errors``, when given, receives one ``"path: reason"`` line for each."""
        with self._lock:
            self._mem.clear()
        removed = 0
        if not disk:
            return 0
        try:
            files = self._files()
        except OSError as e:
            if errors is not None:
                errors.append(f"{self.directory}: {e}")
            return 0
        for f in files:
            try:
                if f.is_symlink() or f.is_file():
                    f.unlink()
                    removed += 1
                elif errors is not None:
                    errors.append(f"{f}: not a regular file, left in place")
            except FileNotFoundError:
                pass
            except OSError as e:
                if errors is not None:
                    errors.append(f"{f}: {e.strerror or e}")
        return removed

    def entries(self) -> list[dict]:
        """Every file in the cache folders (all versions), for ``attnplan plans show``: ``{"file",
        "plan"}`` (the plan as a dict, validated by :func:`load_plan_file`) or ``{"file", "error"}``
        (why it is unusable: corrupt, another version, a leftover temporary file...). Never raises."""
        try:
            files = self._files()
        except OSError as e:
            return [{"file": str(self.directory), "error": f"cannot list the cache: {e}"}]
        out = []
        for f in files:
            if f.name.startswith(_TMP_PREFIX):
                out.append({"file": str(f), "error": "leftover temporary file of an interrupted write "
                                                     "(`attnplan plans clear` removes it)"})
                continue
            try:
                plan = load_plan_file(f)
                out.append({"file": str(f), "plan": plan.to_dict(), "plan_version": plan.version})
            except UNUSABLE as e:
                msg = str(e)
                out.append({"file": str(f), "error": f"{type(e).__name__}: {msg[:200] + '...' if len(msg) > 200 else msg}"})
        return out
