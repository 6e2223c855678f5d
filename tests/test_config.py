"""YAML config: defaults, user overrides, environment variable, clear errors."""

from pathlib import Path

import pytest
import torch

import attnplan
import attnplan.testing
from attnplan.config import Config, ConfigError, load_config


def test_defaults_load():
    c = load_config()
    assert c.backends[-1] == "reference" and c.deterministic and c.split.num_splits == 0


def test_user_file_overrides_and_env(tmp_path, monkeypatch):
    f = tmp_path / "c.yaml"
    f.write_text("backends: [triton, reference]\nsplit:\n  num_splits: 4\n")
    c = load_config(f)
    assert c.backends == ("triton", "reference") and c.split.num_splits == 4
    assert c.split.max_splits == 256  # untouched keys keep their defaults
    monkeypatch.setenv("ATTNPLAN_CONFIG", str(f))
    assert load_config().split.num_splits == 4


def test_threads_asking_for_the_default_context_at_once_get_one(tmp_path, monkeypatch):
    """The process-wide context is made once even when its first callers are several threads at once, with the
    config of that moment (``$ATTNPLAN_CONFIG`` changed meanwhile by another thread does not split it in two); each
    caller had its own context, the config file read by whichever thread got there, and the last one kept."""
    import threading
    import time

    import attnplan.api as api

    f = tmp_path / "c.yaml"
    f.write_text("split:\n  num_splits: 4\n")
    monkeypatch.setenv("ATTNPLAN_CONFIG", str(f))
    monkeypatch.setattr(api, "_DEFAULT", None)
    loads, real = [], api.load_config

    def slow_load(*a, **k):  # a load takes long enough for the other threads to arrive meanwhile
        loads.append(1)
        c = real(*a, **k)
        time.sleep(0.05)
        return c

    monkeypatch.setattr(api, "load_config", slow_load)
    start, got = threading.Barrier(4), []

    def ask():
        start.wait(10)
        got.append(attnplan.default_context())
        monkeypatch.delenv("ATTNPLAN_CONFIG", raising=False)  # later callers' changes do not matter

    threads = [threading.Thread(target=ask, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == 4 and all(c is got[0] for c in got) and loads == [1]
    assert got[0] is attnplan.default_context() and got[0].config.split.num_splits == 4


@pytest.mark.parametrize("text,needle", [
    ("backends: [triton, cudnn]", "backends.1"),
    ("split:\n  num_splitz: 4", "split.num_splitz: unknown key"),
    ("split:\n  num_splits: -1", "split.num_splits"),
    ("plan_cache:\n  memory_entries: zero", "plan_cache.memory_entries"),
    ("colour: blue", "colour: unknown key"),
    ("backends: [triton, triton]", "duplicate"),
    ("backend_options:\n  triton: {block_n: 3}", "backend_options.triton.block_n"),
    ("- a\n- b", "mapping"),
    ("split: [1, 2", "not valid YAML"),
    ("split:\n  merge: auto\n bad", "not valid YAML: line 3, column 2: expected <block end>"),
    ("cost_model: {tail_target_scale: 1e1}", "YAML reads 1e1 as a string: write it with a dot"),
])
def test_errors_name_key_and_value(tmp_path, text, needle):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")) as e:
        load_config(f)
    assert str(f) in str(e.value) and len(str(e.value).splitlines()) <= 2, str(e.value)  # the file, one line an error


@pytest.mark.parametrize("text,needle", [
    ("split:\n  max_split: 256", "split.max_split: unknown key; did you mean 'max_splits'? (known keys: partition, "
                                 "merge, num_splits, max_splits,"),
    ("splits: {num_splits: 2}", "splits: unknown key; did you mean 'split'? (known keys: version, backends,"),
    ("backend_options: {triton: {mma: true}}", "backend_options.triton.mma: unknown key (known keys: block_n, "
                                               "num_warps, num_stages)"),
    ("backend_options: {tritn: {}}", "did you mean 'triton'?"),
])
def test_unknown_keys_name_the_nearest_and_the_known_keys(tmp_path, text, needle):
    """A typo in a key is answered with the nearest known key and every key that mapping takes."""
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert needle in str(e.value), str(e.value)


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_an_empty_path_is_an_error_and_an_empty_variable_is_unset(tmp_path, monkeypatch):
    """``load_config('')`` (an empty ``--config``) names the mistake instead of failing to open ``''``; an empty
    ``$ATTNPLAN_CONFIG`` is unset, as the shell's convention has it."""
    with pytest.raises(ConfigError, match="the path is empty"):
        load_config("")
    monkeypatch.setenv("ATTNPLAN_CONFIG", "")
    assert load_config() == load_config(None) and load_config().split.num_splits == 0


def test_forced_backend_order_is_followed(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("backends: [reference]\n")
    x = attnplan.testing.make_inputs(1, 4, 2, 16, [5])
    w = attnplan.DecodeWrapper(str(f))
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens)
    assert w.backend.name == "reference"


def test_fp8_kv_cache_follows_its_own_dispatch_order(tmp_path):
    """``backends_fp8_kv`` orders the backends for a 1-byte KV cache only; a 2-byte cache keeps ``backends``."""
    f = tmp_path / "c.yaml"
    f.write_text("backends: [triton, reference]\nbackends_fp8_kv: [reference, triton]\n")
    x = attnplan.testing.make_inputs(1, 4, 2, 16, [5], device="cuda" if torch.cuda.is_available() else "cpu")
    fp8 = (x.k_cache.float() / 4).to(torch.float8_e4m3fn), (x.v_cache.float() / 4).to(torch.float8_e4m3fn)
    w = attnplan.DecodeWrapper(str(f))
    w.plan(x.q, *fp8, x.seq_lens, k_scale=4.0, v_scale=4.0)
    assert w.backend.name == "reference"
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens)
    assert w.backend.name == "triton"
    # a user's backends list bounds the fp8 order too (the default fp8 order names cuda_ptx first)
    f.write_text("backends: [triton, reference]\n")
    w = attnplan.DecodeWrapper(str(f))
    w.plan(x.q, *fp8, x.seq_lens, k_scale=4.0, v_scale=4.0)
    assert w.backend.name == "triton"
    from attnplan.api import dispatch_order

    assert dispatch_order(load_config(f), fp8_kv=True) == ["triton", "reference"]
    f.write_text("backends_fp8_kv: [reference, reference]\n")
    with pytest.raises(ConfigError, match="backends_fp8_kv: duplicate"):
        load_config(f)


def test_backends_by_arch_orders_one_architecture(tmp_path):
    """``backends_by_arch`` puts its backends first on GPUs of that architecture only (after the fp8 list for a
    1-byte cache), bounded by ``backends``; a user file replaces one architecture's list; bad keys and duplicates
    are errors naming the key."""
    from attnplan.api import dispatch_order

    c = load_config()
    assert c.backends[0] == "triton" and c.backends_by_arch == {"sm_90": ("cuda_ptx",)}
    assert dispatch_order(c, False, "sm_90") == ["cuda_ptx", "triton", "numba", "reference"]
    assert dispatch_order(c, False, "sm_80") == dispatch_order(c, False, None) == list(c.backends)
    f = tmp_path / "c.yaml"
    f.write_text("backends: [triton, numba, reference]\nbackends_fp8_kv: [numba]\n"
                 "backends_by_arch: {sm_90: [reference, numba], sm_100: [numba]}\n")
    c = load_config(f)
    assert dispatch_order(c, False, "sm_90") == ["reference", "numba", "triton"]
    assert dispatch_order(c, True, "sm_90") == ["numba", "reference", "triton"]  # fp8's list first, no repeats
    assert dispatch_order(c, True, "sm_89") == ["numba", "triton", "reference"]
    assert dispatch_order(c, False, "sm_100") == ["numba", "triton", "reference"]
    f.write_text("backends: [triton, reference]\n")  # the default sm_90 entry names a backend not listed: unused
    assert dispatch_order(load_config(f), False, "sm_90") == ["triton", "reference"]
    f.write_text("backends_by_arch: {sm_90: [triton]}\n")  # merged over the default key by key
    assert dispatch_order(load_config(f), False, "sm_90")[:2] == ["triton", "cuda_ptx"]
    # explain() shows an order the per-architecture (or fp8) list changed, and nothing where it did not
    import dataclasses

    x = attnplan.testing.make_inputs(1, 4, 2, 16, [5])
    w = attnplan.DecodeWrapper()
    w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens)
    assert "dispatch order" not in w.explain()
    w.plan_ = dataclasses.replace(w.plan_, device=w.plan_.device._replace(cc=(9, 0)))
    assert "\ndispatch order cuda_ptx, triton, numba, reference (backends_by_arch.sm_90 first)" in w.explain()
    w.plan_ = dataclasses.replace(w.plan_, device=w.plan_.device._replace(cc=(8, 0)))
    assert "dispatch order" not in w.explain()
    for text in ("backends_by_arch: {sm_90: []}", "backends_by_arch: null"):  # the ways out of the default
        f.write_text(text + "\n")
        assert dispatch_order(load_config(f), False, "sm_90") == list(load_config().backends)
    f.write_text("backends_by_arch: {}\n")  # merged key by key: the default stays
    assert dispatch_order(load_config(f), False, "sm_90")[0] == "cuda_ptx"
    with pytest.raises(TypeError, match="arch must be a str"):
        dispatch_order(c, False, ["sm_90"])
    for bad in ({"backends": ["triton", "triton"]}, {"backends_by_arch": {"sm_90": ["numba", "numba"]}}):
        with pytest.raises(ValueError, match="duplicate entries"):  # a Config built directly, not from a file
            Config(**bad)
    # a bad override is named as one, not as the shipped file's value
    with pytest.raises(ConfigError, match=r"\(override\):\n  backends_by_arch\.sm_90"):
        load_config(backends_by_arch={"sm_90": "x"})
    with pytest.raises(ConfigError, match=r"c\.yaml with overrides\)"):
        load_config(f, backends_by_arch={"sm_90": "x"})
    for text, needle in [("backends_by_arch: {hopper: [triton]}", "backends_by_arch.hopper"),
                         ("backends_by_arch: {sm_90: [triton, numba, cuda_ptx, reference, triton]}",
                          "backends_by_arch.sm_90"),
                         ("backends_by_arch: {sm_90: [cudnn]}", "backends_by_arch.sm_90"),
                         ("backends_by_arch: {sm_90: [triton, triton]}", "backends_by_arch.sm_90: duplicate"),
                         ("backends_by_arch: [sm_90]", "backends_by_arch")]:
        f.write_text(text + "\n")
        with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
            load_config(f)


# -- hostile files: every failure is a ConfigError naming the file and the key, quickly and briefly --------

ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join(["*" + chr(97 + i)] * 9) + "]\n" for i in range(8))


@pytest.mark.parametrize("text,needle", [
    (ALIAS_BOMB, "expands to more than"),                               # 9^9 values through aliases
    ("split: " + "[" * 5000 + "]" * 5000, "nested deeper than"),       # RecursionError before
    ("split:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(100)), "nested deeper than"),
    (b"backends: [\xff\xfe]\n", "not UTF-8"),                           # UnicodeDecodeError before
    ("# " + "x" * (2 << 20), "larger than"),
    ("backends: [[triton]]", "backends.0"),                             # TypeError before (unhashable)
    ("cost_model: {sat_programs_per_sm: .inf}", "cost_model.sat_programs_per_sm"),   # ZeroDivisionError at plan time
    ("cost_model: {launch_us: .nan}", "cost_model.launch_us"),
    ("cost_model: {bandwidth_fraction: 0}", "cost_model.bandwidth_fraction"),
    ("backend_options: {triton: {block_n: 17}}", "backend_options.triton.block_n: must be a power of two"),
    ("backend_options: {numba: {block_n: 48}}", "backend_options.numba.block_n"),
    ("backend_options: {triton: {mma: true, passes: 8}}", "backend_options.triton.mma: unknown key"),
    ("backend_options: {numba: {pdl: false}}", "backend_options.numba.pdl: unknown key"),
    ("backend_options: {reference: {block_n: 16}}", "backend_options.reference.block_n: unknown key .this mapping "
                                                    "takes no keys."),
    ("backend_options: {cuda_ptx: {lanes: 4}}", "backend_options.cuda_ptx.lanes: unknown key"),
    ("backend_options: {triton: {num_warps: 3}}", "backend_options.triton.num_warps"),
    ("backend_options: {triton: {num_warps: true}}", "backend_options.triton.num_warps: a boolean"),
    ("backend_options: {cuda_ptx: {threads: 100}}", "backend_options.cuda_ptx.threads: must be a multiple of 32"),
    ("backend_options: {triton: {block_dv: 64}}", "backend_options.triton.block_dv: block_dv was removed"),
    ("split: {partition: split_v}", "split.partition: split_v was removed"),
    ("split: {merge: atomic}\ndeterministic: false", "split.merge: atomic was removed"),
    ("split: {num_splits: '4'}", "split.num_splits"),
    ("version: true", "version: a boolean"),
    ("plan_cache: {dir: ''}", "plan_cache.dir"),
    ("? [a, b]\n: 1\n", "not valid YAML"),
    ("a: \x00", "not valid YAML"),
])
def test_hostile_files_are_config_errors(tmp_path, text, needle):
    import time

    f = tmp_path / "bad.yaml"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    t = time.perf_counter()
    with pytest.raises(ConfigError, match=needle) as e:
        load_config(f)
    assert time.perf_counter() - t < 5.0
    assert str(f) in str(e.value) and len(str(e.value)) < 2000


def test_error_repeats_a_long_value_shortened(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("backends: triton" + "x" * 100_000 + "\ncolour: [" + ", ".join(["blue"] * 10_000) + "]\n")
    with pytest.raises(ConfigError, match="colour: unknown key") as e:
        load_config(f)
    assert len(str(e.value)) < 1000


def test_many_errors_are_listed_briefly(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("\n".join(f"k{i}: 1" for i in range(500)))
    with pytest.raises(ConfigError, match=r"and 480 more") as e:
        load_config(f)
    assert len(str(e.value).splitlines()) == 22


def test_benign_aliases_and_null_block_dv_load(tmp_path):
    """Aliases that expand to a few values are fine (anchors for shared options); ``block_dv: null`` (the value
    older files carry) reads as unset."""
    f = tmp_path / "ok.yaml"
    f.write_text("backend_options:\n  triton: &o {block_n: 32, num_warps: 4}\n  cuda_ptx: *o\n"
                 "  numba: {block_n: 32}\n  reference: null\n")
    c = load_config(f)
    assert c.options("triton").model_dump() == {"block_n": 32, "num_warps": 4, "num_stages": None}
    assert c.options("cuda_ptx").block_n == 32 and c.options("numba").block_n == 32
    assert load_config(backend_options={"triton": {"block_dv": None}}).options("triton").block_n is None


def test_each_backend_reads_only_its_own_options():
    """The options models list exactly the keys each backend's kernel_config reads."""
    from attnplan.config import OPTION_MODELS

    keys = {b: set(m.model_fields) - {"block_dv"} for b, m in OPTION_MODELS.items()}
    assert keys == {"triton": {"block_n", "num_warps", "num_stages"},
                    "numba": {"block_n", "threads", "lanes", "unroll"},
                    "cuda_ptx": {"block_n", "num_warps", "num_stages", "threads", "mma", "pdl", "passes"},
                    "reference": set()}
    with pytest.raises(KeyError, match="unknown backend"):
        load_config().options("cudnn")


def test_device_tables_still_load():
    from attnplan.config import device_table

    assert device_table("h200")["cost_model"]["programs_per_sm"] >= 1


def test_plan_cache_dir_with_a_nul_is_refused_by_key():

    from attnplan.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="plan_cache.dir: a path cannot hold a NUL character"):
        load_config(plan_cache={"dir": "a\0b"})


@pytest.mark.parametrize("text,needle", [
    ("split:\n  num_splits: 2\nsplit:\n  num_splits: 3\n",
     r"duplicate key 'split' at line 3, column 1 \(first at line 1, column 1\)"),
    ("split: {num_splits: 2, num_splits: 5}\n",
     r"duplicate key 'num_splits' at line 1, column 24 \(first at line 1, column 9\)"),
    ("backend_options:\n  triton:\n    block_n: 32\n    num_warps: 4\n    block_n: 64\n",
     r"duplicate key 'block_n' at line 5, column 5 \(first at line 3, column 5\)"),
    ("cost_model:\n  launch_us: 1.0\nplan_cache: {enabled: true}\ncost_model: {launch_us: 1.0}\n",
     "duplicate key 'cost_model' at line 4"),  # equal values too: the file says two things
    ("colour: 1\ncolour: 2\n", "duplicate key 'colour' at line 2"),  # before the unknown key
    ("backends: [triton, {a: 1, a: 2}]\n", "duplicate key 'a'"),  # inside a sequence
    ("split:\n  num_splits: 1\n  0x1: a\n  1: b\n", "duplicate key 1 at line 4"),  # equal once resolved
])
def test_duplicate_keys_are_refused_at_any_depth(tmp_path, text, needle):
    """PyYAML keeps the last of two equal keys silently; attnplan refuses the file, naming the key and both lines."""
    f = tmp_path / "dup.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=needle) as e:
        load_config(f)
    assert str(f) in str(e.value)


def test_a_merge_key_may_still_be_overridden(tmp_path):
    """YAML's ``<<`` merge brings keys in that the mapping may override: no duplicate."""
    f = tmp_path / "ok.yaml"
    f.write_text("backend_options:\n  triton: &o {block_n: 32, num_warps: 4}\n  cuda_ptx: {<<: *o, num_warps: 8}\n")
    c = load_config(f)
    assert c.options("cuda_ptx").block_n == 32 and c.options("cuda_ptx").num_warps == 8


def test_a_device_table_with_a_duplicate_key_is_refused(tmp_path, monkeypatch):
    from attnplan.config import device_table
    from attnplan.device import user_table_path

    monkeypatch.setenv("ATTNPLAN_CACHE_DIR", str(tmp_path))
    device_table.cache_clear()
    try:
        f = user_table_path("dup-gpu")
        f.parent.mkdir(parents=True)
        f.write_text("cost_model: {launch_us: 2.0}\ncost_model: {launch_us: 3.0}\n")
        with pytest.raises(ConfigError, match="duplicate key 'cost_model' at line 2"):
            device_table("dup-gpu")
    finally:
        device_table.cache_clear()


def test_a_leading_tilde_is_the_home_folder_in_every_path_setting(tmp_path, monkeypatch):
    """``plan_cache.dir: "~/x"``, ``$ATTNPLAN_CACHE_DIR``, ``$ATTNPLAN_CONFIG``, a config path and
    ``PlanCache("~/x")`` mean the home folder's ``x``, never a folder named ``~`` in the current directory."""
    from attnplan.api import Context
    from attnplan.cache import PlanCache, default_cache_dir

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    (home / "c.yaml").write_text("plan_cache: {dir: ~/plans}\nsplit: {num_splits: 2}\n")
    for cfg in (load_config("~/c.yaml"), load_config(plan_cache={"dir": "~/plans"})):
        assert cfg.plan_cache.dir == str(home / "plans")
    monkeypatch.setenv("ATTNPLAN_CONFIG", "~/c.yaml")
    cfg = load_config()
    assert cfg.split.num_splits == 2 and cfg.plan_cache.dir == str(home / "plans")
    ctx = Context.from_config(cfg)
    x = attnplan.testing.make_inputs(1, 4, 2, 16, [20], page_size=16, dtype=torch.float32)
    attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend="reference", config=ctx)
    assert ctx.cache.directory == home / "plans" and list((home / "plans").glob("v*/*.json"))
    monkeypatch.setenv("ATTNPLAN_CACHE_DIR", "~/envcache")
    assert default_cache_dir() == home / "envcache"
    assert PlanCache("~/direct").directory == home / "direct"
    assert not (cwd / "~").exists() and list(cwd.iterdir()) == []


def test_a_tilde_user_that_does_not_expand_is_a_config_error_naming_its_source(tmp_path, monkeypatch):
    """``~nosuchuser/x`` cannot be expanded: as ``plan_cache.dir``, ``$ATTNPLAN_CACHE_DIR`` or a ``PlanCache``
    folder it is a ConfigError naming where it came from (not a folder named ``~nosuchuser`` in the current
    directory, nor pathlib's RuntimeError out of every decode() call)."""
    from attnplan.api import Context
    from attnplan.cache import PlanCache, default_cache_dir

    monkeypatch.chdir(tmp_path)
    bad = "~attnplan-no-such-user-x9/plans"
    with pytest.raises(ConfigError, match=r"plan_cache.dir: cannot expand '~attnplan-no-such-user-x9' \(no such "
                                          r"user, or no home folder\)"):
        load_config(plan_cache={"dir": bad})
    with pytest.raises(ConfigError, match="PlanCache directory = '~attnplan-no-such-user-x9/plans': cannot expand"):
        PlanCache(bad)
    monkeypatch.setenv("ATTNPLAN_CACHE_DIR", bad)
    with pytest.raises(ConfigError, match="ATTNPLAN_CACHE_DIR = '~attnplan-no-such-user-x9/plans': cannot expand"):
        default_cache_dir()
    x = attnplan.testing.make_inputs(1, 4, 2, 16, [20], page_size=16, dtype=torch.float32)
    with pytest.raises(ConfigError, match="ATTNPLAN_CACHE_DIR"):
        attnplan.decode(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, backend="reference",
                        config=Context.from_config(load_config()))
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv("ATTNPLAN_CACHE_DIR", "./~attnplan-no-such-user-x9")  # a folder so named, said so
    assert default_cache_dir() == Path("./~attnplan-no-such-user-x9")


def test_the_packaged_default_file_names_every_key():
    """``plans/default.yaml`` is where the README sends a user for the config's keys ("every key"): it names every
    field of the config's models (a removed key kept only for its error, excluded from dumps, aside), at the model's
    default, so loading it changes nothing the models do not already say."""
    import yaml
    from importlib import resources

    from attnplan.config import Config

    data = yaml.safe_load((resources.files("attnplan.plans") / "default.yaml").read_text())
    missing = []

    def walk(model, node, prefix):
        for name, field in model.model_fields.items():
            if field.exclude:
                continue
            if name not in node:
                missing.append(prefix + name)
            elif hasattr(field.annotation, "model_fields") and isinstance(node[name], dict):
                walk(field.annotation, node[name], prefix + name + ".")

    walk(Config, data, "")
    assert not missing, f"keys the default file does not name: {missing}"
    defaults, loaded = Config().model_dump(), Config.model_validate(data).model_dump()
    assert {k for k in defaults if defaults[k] != loaded[k]} <= {"backends_fp8_kv", "backends_by_arch"}  # on purpose


@pytest.mark.parametrize("text,needle", [
    ("split: {num_splits: " + "9" * 5000 + "}", "cannot be read"),       # past Python's int conversion limit
    ("split: {num_splits: 0x" + "f" * 5000 + "}", "an int of 20000 bits"),  # read, then refused by its bound
    ("split: {num_splits: 1:00}", "base-60"),                              # YAML 1.1 would read 60
    ("cost_model: {launch_us: 1:30.5}", "base-60"),
    ("split: {num_splits: 010}", "octal .*read as 8"),                    # YAML 1.1 would read 8
    ("split: {min_chunk_tokens: -0_100}", "octal .*read as -64"),
    ("backend_options: {triton: {num_warps: 4.0}}", r"num_warps: a float is not allowed here \(one of \[1, 2, 4"),
])
def test_numbers_yaml_reads_oddly_are_config_errors(tmp_path, text, needle):
    """Numbers PyYAML reads but a user does not mean, or that Python cannot print, are ConfigErrors naming the file
    (a 5,000-digit int raised a bare ValueError, in PyYAML or in the error's own formatting; ``1:00`` loaded as 60,
    ``010`` as 8, ``num_warps: 4.0`` and ``version: 1.0`` as ints)."""
    path = tmp_path / "odd.yaml"
    path.write_text("version: 1\n" + text + "\n")
    with pytest.raises(ConfigError, match=needle) as e:
        load_config(path)
    assert str(path) in str(e.value)
    path.write_text("version: 1.0\n")  # Literal[1] takes 1.0 by equality: a float is refused where ints are listed
    with pytest.raises(ConfigError, match=r"version: a float is not allowed here \(one of \[1\]\)"):
        load_config(path)


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no FIFOs here")
def test_a_config_path_that_is_not_a_file_is_refused(tmp_path):
    """A FIFO (or any other non-regular file) as the config is refused at once; opening it blocked forever."""
    import os

    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(fifo)


def test_a_config_is_immutable_all_the_way_down():
    """A validated Config's backend lists and per-architecture table refuse edits in place: before, a frozen model's
    lists could be edited after validation (a duplicate or an unknown backend went unchecked until plan()), and new
    wrappers of the config took the edit while a wrapper that had planned kept the old order. Dumps stay plain
    lists (with_overrides, YAML); the config copies, pickles and compares equal."""
    import copy
    import pickle

    import yaml

    c = attnplan.load_config(backends_by_arch={"sm_90": ["cuda_ptx"]}, backends_fp8_kv=["triton"])
    for edit in (lambda: c.backends.insert(0, "reference"), lambda: c.backends_fp8_kv.append("numba"),
                 lambda: c.backends_by_arch.__setitem__("sm_90", ["reference"]),
                 lambda: c.backends_by_arch["sm_90"].append("triton"), lambda: c.backends_by_arch.update(sm_80=[]),
                 lambda: c.backends_by_arch.pop("sm_90")):
        with pytest.raises((AttributeError, TypeError)):
            edit()
    assert list(c.backends) == list(attnplan.load_config().backends) and dict(c.backends_by_arch) == {
        "sm_90": ("cuda_ptx",)} and c.backends_fp8_kv == ("triton",)
    d = c.model_dump()
    assert type(d["backends"]) is list and d["backends_by_arch"] == {"sm_90": ["cuda_ptx"]}
    assert type(d["backends_by_arch"]["sm_90"]) is list and yaml.safe_load(yaml.safe_dump(d)) == d
    assert c.with_overrides(split={"num_splits": 2}).backends == c.backends
    assert copy.deepcopy(c) == c == pickle.loads(pickle.dumps(c))
    # its own values passed back (tuples, the frozen dict) are taken as the lists they were
    assert c.with_overrides(backends=c.backends[:2]).backends == c.backends[:2]
    assert attnplan.load_config(backends=c.backends, backends_by_arch=c.backends_by_arch,
                                backends_fp8_kv=c.backends_fp8_kv) == c
    assert Config(**dict(c)) == c


@pytest.mark.parametrize("bad", [3, True, b"plans/default.yaml", 2.5, ["c.yaml"],
                                 pytest.param(10**5000, id="huge_int")])
def test_a_config_path_of_another_type_is_refused_by_name(bad, tmp_path):
    """A path is a ``str`` or an ``os.PathLike``: an int (which ``os.stat`` would take as an open file descriptor),
    a bool, bytes or a list is a ``TypeError`` naming ``path``, whatever file it might reach."""
    f = tmp_path / "c.yaml"
    f.write_text("split: {num_splits: 2}\n")
    with open(f) as fh:  # an open descriptor the int could name
        assert fh.fileno() >= 0
        with pytest.raises(TypeError, match="load_config: path must be a str or os.PathLike"):
            load_config(bad)


def test_a_config_path_the_os_refuses_is_a_config_error():
    """A path with a NUL character (which the OS cannot take) is a ``ConfigError`` naming the file, like any other
    unreadable config, not a bare ``ValueError`` from inside ``os.stat``."""
    with pytest.raises(ConfigError, match="cannot read attnplan config .*embedded null"):
        load_config("plans/a\0b.yaml")
