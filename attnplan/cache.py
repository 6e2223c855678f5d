"""The plan cache: an in-memory LRU in front of versioned JSON files on disk.

Key (DESIGN.md "Plan cache"; cases.yaml cache-key-missing-arch): the device fingerprint (name,
SM count, compute capability, driver), the library and plan-format versions, the backend, the
problem bucket (batch, heads, head_dim, q_len, dtypes, page size, KV-length buckets), whether
the plan is a capacity plan, and the config's planning inputs (split policy, cost model, the
backend's kernel options). Files are written atomically (a temporary file in the same folder,
then ``os.replace``), so another process never reads a half-written plan; a corrupt or
old-format file is rebuilt with a warning; an unwritable folder drops to memory with one warning.
"""

from __future__ import annotations

import hashlib
import json
import os
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

__all__ = ["PlanCache", "CacheStats", "default_cache_dir"]


def default_cache_dir() -> Path:
    """``$ATTNPLAN_CACHE_DIR`` if set, else the platform's user cache directory for attnplan."""
    env = os.environ.get("ATTNPLAN_CACHE_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir("attnplan"))


@dataclass
class CacheStats:
    """Counters: ``hits`` (memory), ``disk_hits``, ``misses`` (planned anew), ``writes``,
    ``rebuilt`` (corrupt or old files replaced)."""

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

    def get_or_create(self, key: tuple, build: Callable[[], SplitPlan]) -> SplitPlan:
        """Return the cached plan for ``key`` or build, store and return it."""
        plan = self._mem.get(key)
        if plan is not None:
            self.stats.hits += 1
            with self._lock:
                if key in self._mem:
                    self._mem.move_to_end(key)
            return plan
        plan = self._read(key)
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

    def _read(self, key: tuple) -> SplitPlan | None:
        if not self.disk:
            return None
        path = self._path(key)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            self._warn_disk(f"cannot read {path}: {e}")
            return None
        try:
            data = json.loads(text)
            if data.get("plan_version") != PLAN_VERSION or data.get("library") != __version__:
                raise ValueError(f"written by plan format {data.get('plan_version')} / attnplan {data.get('library')}")
            if data.get("key") != json.loads(json.dumps(key, default=str)):
                raise ValueError("key mismatch")
            return SplitPlan.from_dict(data["plan"])
        except (ValueError, KeyError, TypeError) as e:
            warnings.warn(f"attnplan plan cache: {path} is unusable ({e}); rebuilding it", RuntimeWarning, stacklevel=3)
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
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".json")
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

    def clear(self, *, disk: bool = True) -> int:
        """Empty the memory LRU and (``disk=True``) delete every plan file; returns files removed."""
        with self._lock:
            self._mem.clear()
        removed = 0
        if disk and self.directory.exists():
            for f in self.directory.glob("v*/*.json"):
                f.unlink(missing_ok=True)
                removed += 1
        return removed

    def entries(self) -> list[dict]:
        """Every plan on disk (all versions) as ``{"file", "plan" or "error"}`` dicts, for ``attnplan plans show``."""
        out = []
        if not self.directory.exists():
            return out
        for f in sorted(self.directory.glob("v*/*.json")):
            try:
                data = json.loads(f.read_text())
                out.append({"file": str(f), "plan": data["plan"], "plan_version": data.get("plan_version")})
            except (OSError, ValueError, KeyError) as e:
                out.append({"file": str(f), "error": str(e)})
        return out
