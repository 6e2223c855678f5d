"""Where tuned device tables are read from and written to: the user's table directory
(``$ATTNPLAN_CACHE_DIR/plans``) first, the packaged ``plans/<device>.yaml`` second; ``attnplan tune``
writes to the user's directory, never into the installed package."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml

import attnplan
import attnplan.tune as tune
from attnplan.config import ConfigError, device_table
from attnplan.device import DeviceInfo, user_table_path

H200 = DeviceInfo("NVIDIA H200", 132, (9, 0), 227 * 1024, 60 * 2**20, 4800.0, "cuda-13.0")
PACKAGED = resources.files("attnplan.plans") / "h200.yaml"


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """An empty user cache directory; the memoized tables are cleared before and after the test."""
    monkeypatch.setenv("ATTNPLAN_CACHE_DIR", str(tmp_path))
    tune._reload()
    yield tmp_path
    tune._reload()


def _write(path, table):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(table))


def test_user_table_path_follows_the_cache_dir(user_dir):
    assert user_table_path("h200") == user_dir / "plans" / "h200.yaml"


def test_packaged_table_is_read_when_the_user_has_none(user_dir):
    packaged = yaml.safe_load(PACKAGED.read_text())
    assert device_table("h200") == packaged and "split_table" in packaged
    assert device_table("no-such-device") == {}


def test_user_table_replaces_the_packaged_one(user_dir):
    """A user table is the whole table (no merge with the packaged one), and the planner plans from it."""
    from attnplan.planner import cost_model_for

    _write(user_dir / "plans" / "h200.yaml", {"cost_model": {"sat_programs_per_sm": 7.5, "mem_bandwidth_gbs": 1234.0}})
    assert device_table("h200") == {"cost_model": {"sat_programs_per_sm": 7.5, "mem_bandwidth_gbs": 1234.0}}
    cm, bw = cost_model_for(H200, attnplan.load_config())
    assert cm.sat_programs_per_sm == 7.5 and bw == 1234.0
    (user_dir / "plans" / "h200.yaml").unlink()
    tune._reload()
    assert device_table("h200") == yaml.safe_load(PACKAGED.read_text())


def test_invalid_user_table_names_the_file(user_dir):
    path = user_dir / "plans" / "h200.yaml"
    _write(path, {"cost_model": {"programs_per_sm": 0}})
    with pytest.raises(ConfigError, match=rf"{path}.*\n  programs_per_sm: .*greater than or equal to 1"):
        device_table("h200")
    tune._reload()
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=rf"invalid device table \({path}\): top level must be a mapping"):
        device_table("h200")


def test_tune_writes_to_the_user_directory_unless_given_a_path(user_dir, tmp_path_factory):
    target, reads = tune.table_paths("h200")
    assert target == reads == str(user_dir / "plans" / "h200.yaml")
    other = str(tmp_path_factory.mktemp("elsewhere") / "t.yaml")
    assert tune.table_paths("h200", other) == (other, reads)
    assert not str(target).startswith(str(resources.files("attnplan")))


def test_tune_starts_from_packaged_then_user_then_target(user_dir, tmp_path_factory):
    packaged = yaml.safe_load(PACKAGED.read_text())
    user = user_dir / "plans" / "h200.yaml"
    assert tune.start_table("h200", str(user)) == packaged  # nothing of the user's yet
    _write(user, {"kernel_options": {"triton": {"contiguous": {"num_warps": 8}}}})
    t = tune.start_table("h200", str(user))
    assert t["kernel_options"] == {"triton": {"contiguous": {"num_warps": 8}}} and t["split_table"] == packaged["split_table"]
    other = tmp_path_factory.mktemp("elsewhere") / "t.yaml"
    _write(other, {"split_table": {}})
    t = tune.start_table("h200", str(other))
    assert t["split_table"] == {} and t["kernel_options"] == {"triton": {"contiguous": {"num_warps": 8}}}


def test_new_user_table_keeps_the_packaged_header_and_is_read_back(user_dir):
    """``_write_table`` into a missing folder: made atomically, with the packaged file's provenance comments and
    the tune's stamp; the planner's table is then that file."""
    path = user_table_path("h200")
    table = tune.start_table("h200", str(path))
    table["cost_model"] = {**table["cost_model"], "sat_programs_per_sm": 3.25}
    tune._write_table(str(path), table, "h200")
    text = path.read_text()
    packaged_header = [ln for ln in PACKAGED.read_text().splitlines(keepends=True) if ln.startswith("#")][:3]
    assert text.startswith("".join(packaged_header)) and "# Written by `attnplan tune`" in text
    assert text.count("# Written by `attnplan tune`") == 1
    tune._reload()
    assert device_table("h200")["cost_model"]["sat_programs_per_sm"] == 3.25
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]
