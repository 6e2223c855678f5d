"""The plan cache: an in-memory LRU in front of versioned JSON files on disk.

Key: the device fingerprint (name, SM count, compute capability, CUDA version), the library and
plan-format versions, the backend, the problem bucket (batch, heads, head_dim, q_len, dtypes, page
size, KV-length buckets), whether the plan is a capacity plan, and the config's planning inputs
(split policy, cost model, the backend's kernel options). Files are written atomically (a
temporary file in the same folder, then ``os.replace``), so another process never reads a
half-written plan; an unwritable folder drops to memory with one warning. Processes may share the folder, and one
may clear or remove it while others use it: a write whose folder or temporary file vanished is tried again, a file
that vanished is a miss. One :class:`PlanCache` may serve several threads (its memory LRU is locked; its counters
are approximate under contention).

The cache trusts nothing it reads: a file that does not load and validate as a plan for its key
is a miss with a ``RuntimeWarning`` naming the file, and is rebuilt (never an exception, never a
wrong answer). A file must be a regular file of at most :data:`MAX_PLAN_BYTES` bytes of UTF-8 JSON, an
object with this library's and plan format's versions and the requested key, whose ``plan``
rebuilds with :meth:`SplitPlan.from_dict` (strict: unknown or missing fields, bad types and an
inconsistent schedule are refused) and passes :func:`check_plan` (``SplitPlan.validate``, sizes no larger than
its problem can need, and kernel options its backend's ``kernel_config`` accepts and makes again), and the
caller's own ``validate`` (see :meth:`PlanCache.get_or_create`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
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
from .config import MAX_SPLITS, expand_home
from .planner import PLAN_VERSION, SplitPlan, check_granule_counters
from .problem import DecodeProblem

__all__ = ["PlanCache", "CacheStats", "default_cache_dir", "check_plan", "load_plan_file", "atomic_write",
           "MAX_PLAN_BYTES", "UNUSABLE"]

#: largest plan file read, bytes (a plan is a few KiB)
MAX_PLAN_BYTES = 1 << 20
#: what makes a plan file unusable (a miss with a warning, never an exception out of the cache)
UNUSABLE = (ValueError, TypeError, KeyError, AttributeError, IndexError, json.JSONDecodeError, UnicodeDecodeError,
            OSError, RecursionError, OverflowError)
_TMP_PREFIX = ".tmp-"
#: the names attnplan gives its cache's files and folders: ``v<plan format>/<32 hex digits>.json`` (PlanCache.disk_key)
_VERSION_DIR = re.compile(r"v[0-9]+")
_PLAN_FILE = re.compile(r"[0-9a-f]{32}\.json")
#: tries of a plan file's write whose folder or temporary file another process removed meanwhile
_WRITE_TRIES = 4


def _read_umask() -> int:
    """The process's umask (read once, at import: reading it means setting it, which races with other threads)."""
    m = os.umask(0o022)
    os.umask(m)
    return m


_UMASK = _read_umask()


def atomic_write(path: str | os.PathLike, text: str, *, readable: bool = False, suffix: str = "") -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder (made if missing) and ``os.replace``,
    so a reader sees the old file or the new one, never a part. ``readable``: the file gets the mode a plain
    ``open()`` would give it (``0o666`` less the umask) instead of ``mkstemp``'s private ``0o600`` (results files;
    cache entries stay private). The temporary file (``.tmp-*`` + ``suffix``) is removed on any error.

    Raises:
        OSError: the folder or the file cannot be written.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=_TMP_PREFIX, suffix=suffix)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        if readable:
            os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def default_cache_dir() -> Path:
    """``$ATTNPLAN_CACHE_DIR`` if set (a leading ``~`` is the home folder), else the platform's user cache
    directory for attnplan.

    Raises:
        ConfigError: ``$ATTNPLAN_CACHE_DIR`` starts with a ``~user`` that cannot be expanded
            (:func:`attnplan.config.expand_home`).
    """
    env = os.environ.get("ATTNPLAN_CACHE_DIR")
    return Path(expand_home(env, "ATTNPLAN_CACHE_DIR")) if env else Path(platformdirs.user_cache_dir("attnplan"))


def _int(name: str, v, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}"[:200])
    return v


def _pow2(name: str, v, lo: int, hi: int) -> None:
    if _int(name, v, lo) > hi or v & (v - 1):
        raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {v!r}")




def _check_sizes(plan: SplitPlan) -> None:
    """The size fields that drive the workspace's allocation and the grid, bounded by what the plan's problem can
    need (a plan the planner makes has exactly these): ``max_units_per_seq`` at most :data:`MAX_SPLITS`, the
    capacity within the schedule's 32-bit counters, and ``max_units`` exactly the schedule's bound
    (:attr:`SplitPlan.units_bound`; :meth:`SplitPlan.validate` has refused fewer)."""
    s, p = plan.schedule, plan.first_launch_problem()
    if s.max_units_per_seq > MAX_SPLITS:
        raise ValueError(f"schedule.max_units_per_seq {s.max_units_per_seq} exceeds {MAX_SPLITS}, the most "
                         "splits a plan is made with")
    check_granule_counters(p, s.granule)
    bound = plan.units_bound
    if s.max_units > bound:
        raise ValueError(f"schedule.max_units {s.max_units} exceeds the {bound} unit slots this problem can need "
                         f"(batch {p.batch}, at most {s.max_units_per_seq} units per sequence, capacity {p.capacity} "
                         "tokens)")


def _kernel_device(plan: SplitPlan):
    """The torch device the plan's backend picks kernel options for (the plan's device fingerprint: compute
    capability (0, 0) is the CPU stand-in), or ``None`` where this process cannot ask (a GPU plan without CUDA)."""
    import torch

    if tuple(plan.device.cc) == (0, 0):
        return torch.device("cpu")
    return torch.device("cuda") if torch.cuda.is_available() else None


def _ask_backend(plan: SplitPlan) -> None:
    """The plan's backend must make the plan's kernel options again from them: its ``kernel_config`` for the
    plan's launch problem, given the options, must accept them (raising ``ValueError`` names what is out of its
    range) and return them unchanged (a derived option edited, an unknown one added). A backend that failed to
    load is not asked (no plan runs on it)."""
    from .backends import UnavailableBackend, get_backend

    be = get_backend(plan.backend)  # ValueError: an unknown backend
    if isinstance(be, UnavailableBackend):
        return
    device = _kernel_device(plan)
    if device is None:
        return
    try:
        again = be.kernel_config(plan.first_launch_problem(), plan.kernel.to_dict(), device)
    except (ValueError, TypeError, KeyError, ArithmeticError, RuntimeError) as e:
        raise ValueError(f"the {plan.backend} backend refuses the kernel options: {e} "
                         f"(options {dict(plan.kernel)})"[:400]) from None
    have = plan.kernel.to_dict()
    if dict(again) != have:
        diff = sorted(set(have) ^ set(again) | {n for n in set(have) & set(again) if have[n] != again[n]})
        raise ValueError(f"kernel options {', '.join(f'{n}={have.get(n)!r}' for n in diff)} are not the "
                         f"{plan.backend} backend's ({', '.join(f'{n}={again.get(n)!r}' for n in diff)} for the "
                         "plan's other options)"[:400])


def _check_kernel(plan: SplitPlan) -> None:
    """Hard limits of the kernels the plan's options feed (what a tampered file could break): Triton's
    ``tl.arange`` tile and warp count must be powers of two; numba's thread layout must be whole; then the
    backend itself is asked (:func:`_ask_backend`)."""
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
    _ask_backend(plan)


def check_plan(plan: SplitPlan, problem: DecodeProblem | None = None) -> DecodeProblem:
    """Validate a plan read from disk (or given to ``DecodeWrapper.use_plan``) as strictly as a config: its fields'
    types (:meth:`SplitPlan.check_types`; :meth:`SplitPlan.from_dict` refused unknown or missing fields and bad types
    in a file, but a plan edited in memory has not been through it), the plan's own consistency and its fit to
    ``problem`` (:meth:`SplitPlan.validate`; ``problem`` defaults to the plan's own), finite predictions >= 0 (its
    own and its cost-model candidates', with at least one split and chunk token each), sizes
    that drive an allocation bounded by what the problem can need (:func:`_check_sizes`), and the hard limits of the
    kernels its options feed, asking its backend (:func:`_check_kernel`).

    Returns the problem checked against. Raises ``ValueError`` / ``TypeError`` naming what is wrong.
    """
    if not isinstance(plan, SplitPlan):
        raise TypeError(f"not a plan: {type(plan).__name__}")
    problem = plan.problem if problem is None else problem
    plan.validate(problem)  # the field types first (SplitPlan.check_types)
    if not (math.isfinite(plan.predicted_us) and plan.predicted_us >= 0):
        raise ValueError(f"predicted_us must be a finite number >= 0, got {plan.predicted_us!r}")
    for n, chunk, t in plan.candidates:  # explain() takes the fewest splits within 2% of their best time
        if n < 1 or chunk < 1 or not (math.isfinite(t) and t >= 0):
            raise ValueError(f"plan candidate {[n, chunk, t]!r}: splits and chunk tokens must be at least 1 and the "
                             "predicted time a finite number >= 0")
    _check_sizes(plan)
    _check_kernel(plan)
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
        raise ValueError((f"written by plan format {data.get('plan_version')!r} / attnplan {data.get('library')!r}"[:120]
                          + f", not format {PLAN_VERSION} / {__version__!r}: never read by this attnplan "
                          "(`attnplan plans clear` removes it)"))
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
        """The counters by name (a new dict, e.g. for logging or JSON)."""
        return dict(self.__dict__)


class PlanCache:
    """In-memory LRU plan cache backed by a directory of JSON files.

    Args:
        directory: on-disk folder (``None``: :func:`default_cache_dir`; a leading ``~`` is the home folder); plans
            go in ``<directory>/v<PLAN_VERSION>/<key>.json``.
        disk: use the disk at all.
        memory_entries: LRU capacity.
    """

    def __init__(self, directory: str | os.PathLike | None = None, *, disk: bool = True, memory_entries: int = 1024):
        self.directory = Path(expand_home(directory, "PlanCache directory")) if directory is not None \
            else default_cache_dir()
        self.disk = disk
        self.memory_entries = memory_entries
        self.stats = CacheStats()
        self._mem: OrderedDict[tuple, SplitPlan] = OrderedDict()
        self._lock = threading.Lock()
        self._building: dict[tuple, threading.Lock] = {}  # one lock per key being read or built (get_or_create)
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
        """The plan for ``key`` if it is in memory, else ``None``: no disk, no counters, no change of the LRU order
        (to inspect the cache; :meth:`hit` is the counted lookup that ``plan()`` makes)."""
        return self._mem.get(key)

    def hit(self, key: tuple) -> SplitPlan | None:
        """The plan for ``key`` if it is in memory (counted as a hit, made most recently used), else ``None``
        (nothing counted: follow with :meth:`get_or_create`). The hit path of :meth:`get_or_create` without its
        callbacks."""
        plan = self._mem.get(key)
        if plan is not None:
            self.stats.hits += 1
            with self._lock:
                try:
                    self._mem.move_to_end(key)
                except KeyError:  # evicted by another thread meanwhile
                    pass
        return plan

    def get_or_create(self, key: tuple, build: Callable[[], SplitPlan],
                      validate: Callable[[SplitPlan], None] | None = None) -> SplitPlan:
        """Return the cached plan for ``key`` or build, store and return it.

        Threads that miss the same key at once read or build it once: the first takes the key's lock and the
        others wait on it, then find the plan in memory (a hit each). A ``build`` that raises lets the next
        waiter try its own.

        Args:
            validate: called with a plan read from disk, after :func:`check_plan`; raising one of
                :data:`UNUSABLE` (e.g. ``ValueError``: the plan does not fit the caller's problem) makes
                the file a miss with a warning. Plans from memory or ``build`` are not re-validated.
        """
        plan = self.hit(key)
        if plan is not None:  # a memory hit: counted and made most recently used, as hit() does
            return plan
        with self._lock:
            flight = self._building.setdefault(key, threading.Lock())
        try:
            with flight:
                plan = self.hit(key)  # built by the thread this one waited for
                if plan is not None:
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
        finally:
            with self._lock:  # later callers hit memory; waiters still hold the lock object
                if self._building.get(key) is flight:
                    del self._building[key]

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
        except (PermissionError, NotADirectoryError) as e:  # the cache's folder is not one we can use
            self._warn_disk(f"cannot read {path}: {e}")
            return None
        except UNUSABLE as e:
            msg = str(e)
            warnings.warn(f"attnplan plan cache: {path} is unusable ({type(e).__name__}: "
                          f"{msg[:200] + '...' if len(msg) > 200 else msg}); rebuilding it", RuntimeWarning, stacklevel=4)
            self.stats.rebuilt += 1
            return None

    def _write(self, key: tuple, plan: SplitPlan) -> None:
        """Write the plan's file. Another process may empty the folder meanwhile (``attnplan plans clear`` removes
        the temporary files of writes in flight too) or remove it: a write that finds its folder or its temporary
        file gone is tried again (the folder is made again), up to :data:`_WRITE_TRIES` times, before the cache drops
        to memory; any other ``OSError`` drops it at once."""
        if not self.disk:
            return
        path = self._path(key)
        payload = json.dumps({"plan_version": PLAN_VERSION, "library": __version__, "key": key,
                              "plan": plan.to_dict()}, sort_keys=True, default=str)
        for attempt in range(_WRITE_TRIES):
            try:
                atomic_write(path, payload, suffix=".json")
                self.stats.writes += 1
                return
            except FileNotFoundError as e:  # removed meanwhile by another process: write again
                if attempt + 1 == _WRITE_TRIES:
                    self._warn_disk(f"cannot write {path}: {e}")
            except OSError as e:
                self._warn_disk(f"cannot write {path}: {e}")
                return

    def _files(self) -> list[Path]:
        """attnplan's own files under the directory, sorted: plan files (``v<N>/<32 hex digits>.json``) and
        leftover temporary files of writes (``v<N>/.tmp-*.json``), in version folders that are folders, not links.
        Nothing else is listed (nor removed by :meth:`clear`): a directory shared with other files keeps them.

        Raises:
            OSError: the directory or a version folder cannot be listed (``NotADirectoryError`` for a file).
        """
        try:
            with os.scandir(self.directory) as it:
                top = sorted(it, key=lambda e: e.name)
        except FileNotFoundError:
            return []
        out = []
        for d in top:
            if not _VERSION_DIR.fullmatch(d.name) or not d.is_dir(follow_symlinks=False):
                continue
            with os.scandir(d.path) as it:
                out += [Path(f.path) for f in it if _PLAN_FILE.fullmatch(f.name)
                        or (f.name.startswith(_TMP_PREFIX) and f.name.endswith(".json"))]
        return sorted(out)

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
                mode = f.lstat().st_mode  # FileNotFoundError: another process removed or renamed it meanwhile
                if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
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
        """attnplan's own files in the cache's version folders (all versions; :meth:`_files`), for ``attnplan plans
        show``: ``{"file", "plan", "plan_version"}`` (the plan as a dict, validated by :func:`load_plan_file`, and its
        format version) or ``{"file", "error"}`` (why it is unusable: corrupt, another version, a leftover temporary
        file...). Never raises."""
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
