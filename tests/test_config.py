"""YAML config: defaults, user overrides, environment variable, clear errors."""

import pytest
import torch

import attnplan
import attnplan.testing
from attnplan.config import ConfigError, load_config


def test_defaults_load():
    c = load_config()
    assert c.backends[-1] == "reference" and c.deterministic and c.split.num_splits == 0


def test_user_file_overrides_and_env(tmp_path, monkeypatch):
    f = tmp_path / "c.yaml"
    f.write_text("backends: [triton, reference]\nsplit:\n  num_splits: 4\n")
    c = load_config(f)
    assert c.backends == ["triton", "reference"] and c.split.num_splits == 4
    assert c.split.max_splits == 256  # untouched keys keep their defaults
    monkeypatch.setenv("ATTNPLAN_CONFIG", str(f))
    assert load_config().split.num_splits == 4


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
])
def test_errors_name_key_and_value(tmp_path, text, needle):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")) as e:
        load_config(f)
    assert str(f) in str(e.value)


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


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
