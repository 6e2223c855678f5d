"""The plan cache: memory LRU, disk files, versioning, faults, concurrency, key contents."""

import json
import os
from pathlib import Path
import stat
import warnings

import pytest
import torch

import attnplan
from attnplan.api import Context, plan_problem
from attnplan.backends import get_backend
from attnplan.cache import PlanCache
from attnplan.device import DeviceInfo
from attnplan.planner import PLAN_VERSION

from conftest import run_spawned

DEV_A = DeviceInfo("NVIDIA H200", 132, (9, 0), 227 * 1024, 60 * 2**20, 4350.0, "cuda-13.0")
DEV_B = DeviceInfo("NVIDIA H200", 66, (9, 0), 227 * 1024, 60 * 2**20, 4350.0, "cuda-13.0")  # MIG-like slice
DEV_C = DeviceInfo("NVIDIA H200", 132, (8, 0), 227 * 1024, 60 * 2**20, 4350.0, "cuda-13.0")
PROB = attnplan.DecodeProblem(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, max_kv_len=20000)
#: the folder of this plan format's files
VDIR = f"v{PLAN_VERSION}"


def ctx_at(path, **cache):
    cfg = attnplan.load_config(plan_cache={"dir": str(path), **cache})
    return Context.from_config(cfg)


def plan(ctx, dev=DEV_A, problem=PROB):
    return plan_problem(problem, get_backend("reference"), torch.device("cpu"), ctx, dev_info=dev)


def test_hits_misses_and_disk_roundtrip(tmp_path):
    ctx = ctx_at(tmp_path)
    p1 = plan(ctx)
    assert ctx.cache.stats.misses == 1 and ctx.cache.stats.writes == 1
    assert plan(ctx) is p1 and ctx.cache.stats.hits == 1
    # same bucket (20000 and 30000 both bucket to 32768): hit
    plan(ctx, problem=attnplan.DecodeProblem(**{**PROB.to_dict(), "max_kv_len": 30000, "total_kv_len": -1}))
    assert ctx.cache.stats.hits == 2
    fresh = ctx_at(tmp_path)
    p2 = plan(fresh)
    assert fresh.cache.stats.disk_hits == 1 and fresh.cache.stats.misses == 0 and p2 == p1


def test_key_includes_arch_and_sm_count(tmp_path):
    """Another SM count (a MIG slice) or compute capability re-plans: both are in the key, and the SM count moves
    the schedule's targets (units wanted per batch size: half the SMs, half the units)."""
    ctx = ctx_at(tmp_path)
    a, b, c = plan(ctx, DEV_A), plan(ctx, DEV_B), plan(ctx, DEV_C)
    assert ctx.cache.stats.misses == 3
    assert a.device.sm_count == 132 and b.device.sm_count == 66 and c.device.cc == (8, 0)
    assert max(a.schedule.targets) > max(b.schedule.targets) and a.schedule.max_units > b.schedule.max_units


def test_config_change_replans(tmp_path):
    ctx = ctx_at(tmp_path)
    plan(ctx)
    cfg = attnplan.load_config(plan_cache={"dir": str(tmp_path)}, split={"max_splits": 2})
    ctx2 = Context.from_config(cfg)
    p = plan(ctx2)
    assert ctx2.cache.stats.misses == 1 and p.num_splits <= 2


def test_a_forced_split_count_keys_its_own_plan(tmp_path):
    """``num_splits`` is in the key: within one context a plan forced to 1 split and one forced to 3 are two plans,
    and asking for 1 again is a hit on the first."""
    ctx = ctx_at(tmp_path)
    be, dev = get_backend("reference"), torch.device("cpu")
    one = plan_problem(PROB, be, dev, ctx, dev_info=DEV_A, num_splits=1)
    three = plan_problem(PROB, be, dev, ctx, dev_info=DEV_A, num_splits=3)
    assert one.num_splits == 1 and three.num_splits == 3 and ctx.cache.stats.misses == 2
    assert plan_problem(PROB, be, dev, ctx, dev_info=DEV_A, num_splits=1) is one


def test_every_part_of_a_key_reaches_its_file_name():
    """Keys that differ in any one part have different files (else two keys would evict each other's file: the
    stored key is checked, so a warning and a rebuild at each alternation, not a wrong plan)."""
    from attnplan.api import _plan_key

    ctx = Context.from_config(attnplan.load_config())
    key = _plan_key(PROB.bucket_key(), 20000, get_backend("reference"), ctx, "device", "table", "extra", False, None)
    names = {PlanCache.disk_key(key)} | {PlanCache.disk_key(key[:i] + ("changed",) + key[i + 1:])
                                          for i in range(len(key))}
    assert len(names) == len(key) + 1


def test_corrupt_and_old_files_are_rebuilt_with_warning(tmp_path):
    ctx = ctx_at(tmp_path)
    plan(ctx)
    (f,) = list((tmp_path / VDIR).glob("*.json"))
    f.write_text("{not json")
    fresh = ctx_at(tmp_path)
    with pytest.warns(RuntimeWarning, match="unusable"):
        plan(fresh)
    assert fresh.cache.stats.rebuilt == 1 and fresh.cache.stats.misses == 1
    data = json.loads(f.read_text())
    data["library"] = "0.0.0-old"
    f.write_text(json.dumps(data))
    again = ctx_at(tmp_path)
    with pytest.warns(RuntimeWarning, match="unusable"):
        plan(again)
    assert json.loads(f.read_text())["library"] == attnplan.__version__


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_falls_back_to_memory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    ctx = ctx_at(ro)
    with pytest.warns(RuntimeWarning, match="memory only"):
        plan(ctx)
    assert plan(ctx) is not None and ctx.cache.stats.hits == 1


def test_unwritable_directory_falls_back_to_memory_with_one_warning(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    ctx = ctx_at(blocker / "sub")  # mkdir under a regular file fails even for root
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        plan(ctx)
        plan(ctx, DEV_B)
    assert sum("memory only" in str(w.message) for w in rec) == 1
    assert ctx.cache.stats.misses == 2


def _worker(path, n, q):
    import attnplan as ap
    from attnplan.api import Context as C, plan_problem as pp
    from attnplan.backends import get_backend as gb

    ctx = C.from_config(ap.load_config(plan_cache={"dir": path}))
    plans = []
    for i in range(n):
        prob = ap.DecodeProblem(batch=1 + i % 3, num_q_heads=32, num_kv_heads=8, head_dim=128, max_kv_len=1000 * (1 + i))
        plans.append(pp(prob, gb("reference"), torch.device("cpu"), ctx, dev_info=DEV_A).to_json())
    q.put(plans)


def test_concurrent_processes_never_read_half_written_files(tmp_path):
    results = run_spawned(_worker, [(str(tmp_path), 12)] * 2)
    assert all(r == results[0] for r in results)
    for f in (tmp_path / VDIR).glob("*.json"):
        json.loads(f.read_text())  # every file complete
    assert not list((tmp_path / VDIR).glob(".tmp-*"))


@pytest.mark.parametrize("removed", ["temporary file", "folder"])
def test_a_clear_by_another_process_during_a_write_keeps_the_disk(tmp_path, monkeypatch, removed):
    """Another process clearing the shared folder (``attnplan plans clear`` also removes the temporary files of
    writes in flight) or removing it while this one writes a plan: the write is made again, with no warning, and the
    cache stays on disk (it dropped to memory for good, warning that it could not write). A removal at every try
    is an unusable folder: one warning, memory only."""
    import attnplan.cache as cache_mod

    real = os.replace
    clears = [1]

    def replace_after_a_clear(src, dst):
        if clears:
            clears.pop()
            if removed == "folder":
                import shutil

                shutil.rmtree(tmp_path)
            else:
                PlanCache(tmp_path).clear()
        return real(src, dst)

    monkeypatch.setattr(cache_mod.os, "replace", replace_after_a_clear)
    ctx = ctx_at(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = plan(ctx)
    assert not clears and ctx.cache.disk and ctx.cache.stats.writes == 1
    files = list((tmp_path / VDIR).iterdir())
    assert len(files) == 1 and not files[0].name.startswith(".tmp-")
    assert plan(ctx_at(tmp_path)).to_json() == p.to_json() and not clears

    clears.extend([1] * cache_mod._WRITE_TRIES)
    with pytest.warns(RuntimeWarning, match="memory only"):
        plan(ctx, DEV_B)
    assert not ctx.cache.disk and not clears


def test_clear_and_entries(tmp_path):
    ctx = ctx_at(tmp_path)
    plan(ctx)
    plan(ctx, DEV_B)
    assert len(ctx.cache.entries()) == 2
    assert ctx.cache.clear() == 2 and ctx.cache.entries() == []


def test_clear_skips_files_another_process_removed_meanwhile(tmp_path, monkeypatch):
    """A file listed by clear() that another process removes (or renames into place) before clear() reaches it is
    gone, not an error: one process may clear the folder while others write plans."""
    ctx = ctx_at(tmp_path)
    plan(ctx)
    files = ctx.cache._files()
    assert len(files) == 1
    gone = files[0].with_name(".tmp-renamed-meanwhile.json")  # listed, then renamed away by its writer
    monkeypatch.setattr(ctx.cache, "_files", lambda: [gone, *files])
    errors = []
    assert ctx.cache.clear(errors=errors) == 1 and errors == []


def test_lru_evicts(tmp_path):
    """The memory cache evicts the least recently used plan: a hit refreshes it (first in is not first out)."""
    cache = PlanCache(tmp_path, disk=False, memory_entries=2)
    made = []
    for k in range(2):
        cache.get_or_create(("k", k), lambda k=k: made.append(k) or k)
    assert cache.get_or_create(("k", 0), lambda: made.append("again") or -1) == 0  # a hit: k0 is now the newest
    cache.get_or_create(("k", 2), lambda: made.append(2) or 2)
    assert cache.lookup(("k", 1)) is None and cache.lookup(("k", 0)) == 0 and cache.lookup(("k", 2)) == 2
    assert made == [0, 1, 2]


def test_a_hit_never_rebuilds_and_a_disabled_cache_always_does(monkeypatch):
    """A plan-cache hit returns the stored plan without planning (the build is counted, not timed: no test asserts
    wall-clock time); with the cache disabled every call plans."""
    import attnplan.api as api

    builds = []
    real = api.make_plan
    monkeypatch.setattr(api, "make_plan", lambda *a, **k: builds.append(1) or real(*a, **k))
    ctx = api.Context.from_config(attnplan.load_config(plan_cache={"disk": False}))
    cold = api.Context.from_config(attnplan.load_config(plan_cache={"enabled": False}))
    prob = attnplan.DecodeProblem(batch=4, num_q_heads=32, num_kv_heads=8, head_dim=128, max_kv_len=4096,
                                  total_kv_len=4 * 4000, q_dtype="float16", kv_dtype="float16")
    be, dev = get_backend("reference"), torch.device("cpu")
    first = api.plan_problem(prob, be, dev, ctx, dev_info=DEV_A)
    assert len(builds) == 1
    for _ in range(5):
        assert api.plan_problem(prob, be, dev, ctx, dev_info=DEV_A) is first
    assert len(builds) == 1 and ctx.cache.stats.hits == 5 and ctx.cache.stats.misses == 1
    for _ in range(3):
        assert api.plan_problem(prob, be, dev, cold, dev_info=DEV_A) == first
    assert len(builds) == 4 and cold.cache.stats.misses == 3 and cold.cache.stats.hits == 0



def test_keys_without_effect_do_not_plan_again(tmp_path):
    """``deterministic`` and ``split.partition`` are accepted with no effect, so a config differing only in them
    keys the same plans (no new plan, no new file); a key the planner reads (``split.max_splits``) keys others."""
    import attnplan.api as api

    base = attnplan.load_config(plan_cache={"dir": str(tmp_path)})
    same = base.model_copy(update={"deterministic": False,
                                   "split": base.split.model_copy(update={"partition": "split_k"})})
    other = base.model_copy(update={"split": base.split.model_copy(update={"max_splits": 128})})
    fps = [api.Context.from_config(c).planning_fingerprint("triton") for c in (base, same, other)]
    assert fps[0] == fps[1] != fps[2]
    be, dev = get_backend("reference"), torch.device("cpu")
    first = api.plan_problem(PROB, be, dev, api.Context.from_config(base), dev_info=DEV_A)
    ctx = api.Context.from_config(same)
    assert api.plan_problem(PROB, be, dev, ctx, dev_info=DEV_A) == first
    assert ctx.cache.stats.misses == 0 and ctx.cache.stats.disk_hits == 1

# -- hostile plan files: a miss with a warning naming the file, never an exception or a wrong answer -------

from conftest import kernel_backends  # noqa: E402

from attnplan import reference  # noqa: E402
from attnplan.testing import assert_close_to_reference, make_inputs  # noqa: E402

CACHE_BACKEND = (kernel_backends("cpu") or ["reference"])[0]


def _mutated(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    return json.dumps(data)


def _set(*keys_value):
    *keys, value = keys_value

    def fn(d):
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return fn


def _add(key, delta):
    def fn(d):
        d["plan"]["schedule"][key] += delta
    return fn


HOSTILE = {
    # not a plan file at all
    "non-utf8": lambda f: b"\xff\xfe{\"plan\": 1}",
    "json list": lambda f: "[1, 2]",
    "json null": lambda f: "null",
    "json string": lambda f: '"plan"',
    "not json": lambda f: "{not json",
    "deep nesting": lambda f: "[" * 100_000 + "]" * 100_000,
    "huge": lambda f: " " * (2 << 20),
    "plan a list": lambda f: _mutated(f, _set("plan", [])),
    "other key": lambda f: _mutated(f, _set("key", ["another", "key"])),
    "other version": lambda f: _mutated(f, _set("plan_version", 0)),
    "plan version 1": lambda f: _mutated(f, _set("plan", "version", 1)),
    # fields of the wrong type or missing / unknown
    "unknown field": lambda f: _mutated(f, _set("plan", "colour", "blue")),
    "missing field": lambda f: _mutated(f, lambda d: d["plan"].pop("schedule")),
    "v1 field chunk_size": lambda f: _mutated(f, _set("plan", "chunk_size", 16)),
    "schedule a list": lambda f: _mutated(f, _set("plan", "schedule", [1, 2])),
    "schedule field missing": lambda f: _mutated(f, lambda d: d["plan"]["schedule"].pop("granule")),
    "max_units_per_seq a string": lambda f: _mutated(f, _set("plan", "schedule", "max_units_per_seq", "3")),
    "max_units_per_seq 0": lambda f: _mutated(f, _set("plan", "schedule", "max_units_per_seq", 0)),
    "max_units a float": lambda f: _mutated(f, _set("plan", "schedule", "max_units", 6.0)),
    "max_units true": lambda f: _mutated(f, _set("plan", "schedule", "max_units", True)),
    "max_units 2^31": lambda f: _mutated(f, _set("plan", "schedule", "max_units", 1 << 31)),
    "targets short": lambda f: _mutated(f, _set("plan", "schedule", "targets", [0] * 31)),
    "targets a string": lambda f: _mutated(f, _set("plan", "schedule", "targets", "0" * 32)),
    "targets negative": lambda f: _mutated(f, _set("plan", "schedule", "targets", [-1] * 32)),
    "targets on a forced schedule": lambda f: _mutated(f, _set("plan", "schedule", "targets", [4] * 32)),
    "policy unknown": lambda f: _mutated(f, _set("plan", "schedule", "policy", "greedy")),
    "plan policy unknown": lambda f: _mutated(f, _set("plan", "policy", "magic")),
    "device a dict": lambda f: _mutated(f, _set("plan", "device", {"sm_count": 132})),
    "kernel a list": lambda f: _mutated(f, _set("plan", "kernel", [64])),
    "kernel option a dict": lambda f: _mutated(f, _set("plan", "kernel", "block_n", {"x": 1})),
    "table_entry short": lambda f: _mutated(f, _set("plan", "table_entry", [1, 2])),
    "candidates not triples": lambda f: _mutated(f, _set("plan", "candidates", [[1, 2]])),
    "problem not a problem": lambda f: _mutated(f, _set("plan", "problem", "num_kv_heads", 3)),
    "NaN prediction": lambda f: _mutated(f, _set("plan", "predicted_us", float("nan"))),
    "negative prediction": lambda f: _mutated(f, _set("plan", "predicted_us", -1.0)),
    "candidate time negative": lambda f: _mutated(f, _set("plan", "candidates", [[1, 64, 5.0], [2, 32, -1.0]])),
    "candidate time NaN": lambda f: _mutated(f, _set("plan", "candidates", [[1, 64, float("nan")]])),
    "candidate of 0 splits": lambda f: _mutated(f, _set("plan", "candidates", [[0, 64, 5.0]])),
    "candidate of 0-token chunks": lambda f: _mutated(f, _set("plan", "candidates", [[1, 0, 5.0]])),
    "prediction a string": lambda f: _mutated(f, _set("plan", "predicted_us", "3.5")),
    "capacity_mode a string": lambda f: _mutated(f, _set("plan", "capacity_mode", "no")),
    "sm_count a string": lambda f: _mutated(
        f, lambda d: d["plan"]["device"].__setitem__(1, str(d["plan"]["device"][1]))),
    # well-typed plans a kernel would execute wrongly if they were trusted
    "max_units 0": lambda f: _mutated(f, _set("plan", "schedule", "max_units", 0)),
    "max_units below the batch": lambda f: _mutated(f, _set("plan", "schedule", "max_units", 1)),
    "workspace too small": lambda f: _mutated(f, _add("max_units", -1)),
    "kernel {}": lambda f: _mutated(f, _set("plan", "kernel", {})),
    "block_n 0": lambda f: _mutated(f, _set("plan", "kernel", "block_n", 0)),
    "granule not a multiple of block_n": lambda f: _mutated(f, _set("plan", "schedule", "granule", 1)),
    "granule not a multiple of the page size": lambda f: _mutated(
        f, lambda d: (d["plan"]["kernel"].update(block_n=2), d["plan"]["schedule"].update(granule=2))),
    "merge atomic": lambda f: _mutated(f, _set("plan", "merge", "atomic")),
    "merge none with units": lambda f: _mutated(f, _set("plan", "merge", "none")),
    "problem batch": lambda f: _mutated(f, _set("plan", "problem", "batch", 5)),
    "problem capacity": lambda f: _mutated(f, _set("plan", "problem", "capacity", 8)),
    "problem page size": lambda f: _mutated(f, _set("plan", "problem", "page_size", 8)),
    # well-typed plans whose sizes are beyond what the problem can need (an allocation of that size would be tried)
    "max_units above the bound": lambda f: _mutated(f, _add("max_units", 1)),
    # a balanced schedule without targets makes units of min_unit_granules: more than slots for the batch alone
    "balanced without targets, slots for the batch": lambda f: _mutated(f, lambda d: d["plan"]["schedule"].update(
        policy="balanced", targets=[0] * 64, max_units=2)),
    "max_units 2^31 - 1": lambda f: _mutated(f, _set("plan", "schedule", "max_units", (1 << 31) - 1)),
    "problem capacity beyond the 32-bit counters": lambda f: _mutated(f, _set("plan", "problem", "capacity", 1 << 40)),
}


#: the files whose plan a kernel would execute wrongly if it were trusted: run on a kernel backend
KERNEL_RELEVANT = {"max_units 0", "max_units below the batch", "workspace too small", "kernel {}", "block_n 0",
                   "granule not a multiple of block_n", "granule not a multiple of the page size", "merge atomic",
                   "merge none with units", "problem batch", "problem capacity", "problem page size",
                   "max_units_per_seq 0", "max_units above the bound", "max_units 2^31 - 1",
                   "problem capacity beyond the 32-bit counters", "balanced without targets, slots for the batch"}


def _decode_with_cache(ctx, x, backend=CACHE_BACKEND):
    return attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend=backend,
                           num_splits=3, config=ctx)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_plan_file_is_a_miss_with_a_warning(tmp_path, name):
    backend = CACHE_BACKEND if name in KERNEL_RELEVANT else "reference"
    x = make_inputs(2, 2, 1, 16, [37, 9], page_size=4, dtype=torch.float32, generator=torch.Generator().manual_seed(3))
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    _decode_with_cache(ctx_at(tmp_path), x, backend)
    (f,) = list((tmp_path / VDIR).glob("*.json"))
    text = HOSTILE[name](f)
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    ctx = ctx_at(tmp_path)
    with pytest.warns(RuntimeWarning, match=f"{f.name} is unusable"):
        out = _decode_with_cache(ctx, x, backend)
    assert_close_to_reference(out, ref, torch.float32)
    assert ctx.cache.stats.rebuilt == 1 and ctx.cache.stats.misses == 1 and ctx.cache.stats.disk_hits == 0
    again = ctx_at(tmp_path)  # rebuilt: the next process reads it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_problem(_problem(x), get_backend(backend), torch.device("cpu"), again, num_splits=3)
    assert again.cache.stats.disk_hits == 1


def _problem(x):
    """The problem ``attnplan.decode`` plans for ``x``: a live plan is made for its capacity's power-of-two bucket."""
    from attnplan.problem import len_bucket
    from attnplan.testing import problem_of

    p = problem_of(x)
    return attnplan.DecodeProblem(**{**p.to_dict(),
                                     "capacity": len_bucket(x.block_table.shape[1] * x.k_cache.shape[1])})


def test_a_directory_or_fifo_in_place_of_a_plan_is_a_miss(tmp_path):
    x = make_inputs(1, 4, 2, 16, [9], dtype=torch.float32)
    _decode_with_cache(ctx_at(tmp_path), x, "reference")
    (f,) = list((tmp_path / VDIR).glob("*.json"))
    f.unlink()
    os.mkfifo(f)  # reading it would block forever
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        _decode_with_cache(ctx_at(tmp_path), x, "reference")


def test_caller_validate_hook_refuses_a_plan(tmp_path):
    cache = PlanCache(tmp_path)
    p = plan(ctx_at(tmp_path))
    cache.get_or_create(("k",), lambda: p)
    fresh = PlanCache(tmp_path)

    def refuse(plan_):
        raise ValueError("plan is for another problem")
    with pytest.warns(RuntimeWarning, match="plan is for another problem"):
        got = fresh.get_or_create(("k",), lambda: p, validate=refuse)
    assert got == p and fresh.stats.misses == 1 and fresh.stats.rebuilt == 1
    assert PlanCache(tmp_path).get_or_create(("k",), lambda: None, validate=lambda q: None) == p


def test_check_plan_accepts_what_the_planner_makes():
    from attnplan.cache import check_plan

    for prob in (PROB, attnplan.DecodeProblem(batch=3, num_q_heads=8, num_kv_heads=2, head_dim=64, q_len=2,
                                               max_kv_len=100, window_left=20, soft_cap=5.0, has_sinks=True)):
        for dev in (DEV_A, DEV_B):
            check_plan(plan(ctx_at("/nonexistent-dir-never-written", disk=False), dev, prob))


def test_check_plan_bounds_the_sizes_of_a_loaded_plan():
    """A plan read from disk has exactly the unit slots its problem can need (SplitPlan.units_bound; validate()
    refuses fewer, check_plan more), at most 1024 units per sequence, and a capacity within the schedule's 32-bit
    counters: the workspace and the grid a file makes are never larger than a plan the planner makes."""
    import dataclasses

    from attnplan.cache import check_plan

    p = plan(ctx_at("/nonexistent-dir-never-written", disk=False))
    s = p.schedule
    assert not p.single_pass and s.max_units == p.units_bound
    check_plan(p)
    bad = {
        "exceeds the": dataclasses.replace(p, schedule=dataclasses.replace(s, max_units=s.max_units + 1)),
        "exceeds 1024": dataclasses.replace(p, schedule=dataclasses.replace(s, max_units_per_seq=2000)),
        "32-bit counters": dataclasses.replace(p, problem=dataclasses.replace(p.problem, capacity=1 << 40)),
    }
    for match, q in bad.items():
        q.validate()  # consistent in itself: only the sizes are out of bounds
        with pytest.raises(ValueError, match=match):
            check_plan(q)


@pytest.mark.parametrize("backend,option,value", [
    ("cuda_ptx", "num_warps", 64), ("cuda_ptx", "num_stages", 0), ("cuda_ptx", "threads", 96),
    ("cuda_ptx", "mma", "yes"), ("triton", "colour", 1), ("numba", "merge_threads", 7),
    ("reference", "num_warps", 4)])
def test_plan_file_kernel_options_its_backend_refuses_are_rebuilt(tmp_path, backend, option, value):
    """A plan file's kernel options must be what the plan's backend makes of them: its kernel_config, given them
    for the plan's launch problem, neither raises (an option out of the kernel's range: cuda_ptx's num_warps 64,
    num_stages 0) nor changes them (a derived option edited, an unknown one added). Else the file is unusable and
    rebuilt with a warning (nothing compiled here: plan_problem only plans)."""
    prob = attnplan.DecodeProblem(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16, max_kv_len=100,
                                  capacity=128, q_dtype="float16", kv_dtype="float16")
    be, cpu = get_backend(backend), torch.device("cpu")
    first = plan_problem(prob, be, cpu, ctx_at(tmp_path), num_splits=3)
    (f,) = list((tmp_path / VDIR).glob("*.json"))
    f.write_text(_mutated(f, _set("plan", "kernel", option, value)))
    ctx = ctx_at(tmp_path)
    with pytest.warns(RuntimeWarning, match=f"{f.name} is unusable .*{option}"):
        again = plan_problem(prob, be, cpu, ctx, num_splits=3)
    assert again == first and ctx.cache.stats.rebuilt == 1 and ctx.cache.stats.disk_hits == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan_problem(prob, be, cpu, ctx_at(tmp_path), num_splits=3) == first  # the rebuilt file is read


def test_a_plan_file_naming_another_device_is_rebuilt(tmp_path):
    """A plan file whose plan names another device than the one it is read for (a GPU's, read on the CPU, where its
    backend's kernel options cannot be checked for that GPU) is unusable and rebuilt with a warning, even with its
    key and everything else intact."""
    prob = attnplan.DecodeProblem(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16, max_kv_len=100,
                                  capacity=128, q_dtype="float16", kv_dtype="float16")
    be, cpu = get_backend("triton"), torch.device("cpu")
    first = plan_problem(prob, be, cpu, ctx_at(tmp_path), num_splits=3)
    (f,) = list((tmp_path / VDIR).glob("*.json"))
    f.write_text(_mutated(f, lambda d: d["plan"].update(device=["NVIDIA H100 80GB HBM3", 132, [9, 0], "cuda-13.0"])))
    ctx = ctx_at(tmp_path)
    with pytest.warns(RuntimeWarning, match=f"{f.name} is unusable .*plan for device .*H100"):
        assert plan_problem(prob, be, cpu, ctx, num_splits=3) == first
    assert ctx.cache.stats.rebuilt == 1 and ctx.cache.stats.disk_hits == 0


def test_a_plan_file_with_a_huge_head_count_is_refused_without_building_its_launches(tmp_path, monkeypatch):
    """A plan of head blocks (a GQA group larger than a program: one launch per query, KV head and head block) edited
    to 10^6 KV heads: validating it must not build its 2 x 10^6 launches (SplitPlan.first_launch_problem); it does
    not fit the caller's problem and is rebuilt with a warning."""
    from attnplan.planner import SplitPlan

    prob = attnplan.DecodeProblem(batch=2, num_q_heads=71, num_kv_heads=1, head_dim=64, page_size=16, max_kv_len=100,
                                  capacity=128, q_dtype="bfloat16", kv_dtype="bfloat16")
    be, cpu = get_backend("cuda_ptx"), torch.device("cpu")
    first = plan_problem(prob, be, cpu, ctx_at(tmp_path), num_splits=3)
    assert first.head_block and len(first.launches) == 2
    (f,) = list((tmp_path / VDIR).glob("*.json"))
    f.write_text(_mutated(f, lambda d: d["plan"]["problem"].update(num_q_heads=71 * 10**6, num_kv_heads=10**6)))
    real = SplitPlan.launches.fget

    def launches(self):
        assert self.problem.num_kv_heads < 10**4, "built the launches of a plan file's 10^6 KV heads"
        return real(self)
    monkeypatch.setattr(SplitPlan, "launches", property(launches))
    ctx = ctx_at(tmp_path)
    with pytest.warns(RuntimeWarning, match=f"{f.name} is unusable .*num_q_heads, num_kv_heads differ"):
        assert plan_problem(prob, be, cpu, ctx, num_splits=3) == first
    assert ctx.cache.stats.rebuilt == 1


def test_entries_and_clear_survive_hostile_files(tmp_path, monkeypatch):
    ctx = ctx_at(tmp_path)
    plan(ctx)
    folder = tmp_path / VDIR
    A, B, C, D = (c * 32 + ".json" for c in "abcd")  # hostile contents under the cache's own file names
    (folder / A).write_bytes(b"\xff\xfe")
    (folder / B).write_text("[1]")
    (folder / ".tmp-leftover.json").write_text('{"plan_ver')
    (folder / C).mkdir()
    (tmp_path / "v0").mkdir()
    (tmp_path / "v0" / D).write_text(json.dumps({"plan_version": 0, "plan": {}}))
    entries = {Path(e["file"]).name: e for e in ctx.cache.entries()}
    assert sum("plan" in e for e in entries.values()) == 1
    assert "UnicodeDecodeError" in entries[A]["error"] and "JSON object" in entries[B]["error"]
    assert "leftover temporary file" in entries[".tmp-leftover.json"]["error"]
    assert "not a regular file" in entries[C]["error"] and "plan format 0" in entries[D]["error"]
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):  # a read-only folder (root ignores permissions, so simulated)
        if self.name == B:
            raise PermissionError(13, "Permission denied")
        return real_unlink(self, missing_ok=missing_ok)
    monkeypatch.setattr(Path, "unlink", unlink)
    errors = []
    assert ctx.cache.clear(errors=errors) == 4
    assert len(errors) == 2 and any(f"{B}: Permission denied" in e for e in errors)
    assert any(f"{C}: not a regular file" in e for e in errors)
    assert sorted(p.name for p in folder.iterdir()) == [B, C]


def test_atomic_write_replaces_whole_files_and_cleans_up(tmp_path, monkeypatch):
    """One writer for plan files, tuned tables and results: the old file or the new one, never a part, no temporary
    file left behind on an error; ``readable`` files get open()'s mode, cache files stay private."""
    from attnplan.cache import atomic_write

    path = tmp_path / "sub" / "t.txt"
    atomic_write(path, "one")
    assert path.read_text() == "one" and (path.stat().st_mode & 0o777) == 0o600
    atomic_write(path, "two", readable=True)
    umask = os.umask(0)
    os.umask(umask)
    assert path.read_text() == "two" and (path.stat().st_mode & 0o777) == 0o666 & ~umask

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, "three")
    assert path.read_text() == "two" and sorted(p.name for p in path.parent.iterdir()) == ["t.txt"]


def test_threads_missing_one_key_build_it_once(tmp_path):
    """Threads that miss the same key together build it once: the others wait for the build and hit memory (one
    miss, three hits); a build that raises leaves the key to the next waiter, which builds its own."""
    import threading
    import time

    def run_threads(cache, build, n):
        out: list = []

        def call():
            try:
                out.append(cache.get_or_create(("k",), build))
            except RuntimeError as e:
                out.append(e)

        threads = [threading.Thread(target=call) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    builds: list = []

    def slow_build():
        builds.append(1)
        time.sleep(0.2)
        return "plan"

    cache = PlanCache(tmp_path, disk=False)
    assert run_threads(cache, slow_build, 4) == ["plan"] * 4 and len(builds) == 1
    assert cache.stats.misses == 1 and cache.stats.hits == 3

    tries: list = []

    def flaky_build():
        tries.append(1)
        time.sleep(0.1)
        if len(tries) == 1:
            raise RuntimeError("the first build fails")
        return "plan"

    out = run_threads(PlanCache(tmp_path, disk=False), flaky_build, 2)
    assert len(tries) == 2 and "plan" in out and any(isinstance(o, RuntimeError) for o in out)
