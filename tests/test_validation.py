"""Bad input: each check trips with a message naming the argument, the value and the expectation."""

import pytest
import torch

import attnplan
from attnplan.testing import make_inputs


def good(**kw):
    x = make_inputs(2, 8, 2, 16, [5, 9], page_size=kw.pop("page_size", None), **kw)
    return dict(q=x.q, k_cache=x.k_cache, v_cache=x.v_cache, seq_lens=x.seq_lens, block_table=x.block_table)


def call(args):
    return attnplan.decode(args["q"], args["k_cache"], args["v_cache"], args["seq_lens"], args["block_table"],
                           backend="reference")


def test_good_inputs_pass():
    call(good())
    call(good(page_size=4))


@pytest.mark.parametrize("mutate,exc,needle", [
    (lambda a: a.update(q=a["q"][0]), ValueError, "q must be 4-D"),
    (lambda a: a.update(q=a["q"].to(torch.int32)), TypeError, "q.dtype"),
    (lambda a: a.update(v_cache=a["v_cache"][:, :-1]), ValueError, "v_cache shape"),
    (lambda a: a.update(k_cache=a["k_cache"].float(), v_cache=a["v_cache"].float()), TypeError, "k_cache.dtype"),
    (lambda a: a.update(k_cache=a["k_cache"][..., :8], v_cache=a["v_cache"][..., :8]), ValueError, "head_dim 8 must equal"),
    (lambda a: a.update(seq_lens=a["seq_lens"].long()), TypeError, "seq_lens.dtype"),
    (lambda a: a.update(seq_lens=a["seq_lens"][:1]), ValueError, r"seq_lens must have shape \[batch\] = \[2\]"),
    (lambda a: a.update(seq_lens=torch.tensor([5, 10], dtype=torch.int32)), ValueError, "seq_lens\\[1\\] = 10 exceeds the cache capacity 9"),
    (lambda a: a.update(seq_lens=torch.tensor([5, -1], dtype=torch.int32)), ValueError, "seq_lens must be >= 0"),
    (lambda a: a.update(q=a["q"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError, "unit stride"),
    (lambda a: a.update(q=torch.zeros(2, 17, 8, 16, dtype=torch.float16)), ValueError, "q_len"),
    (lambda a: a.update(k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1]), ValueError, "contiguous k_cache must have shape"),
])
def test_contiguous_input_errors(mutate, exc, needle):
    a = good()
    mutate(a)
    with pytest.raises(exc, match=needle):
        call(a)


@pytest.mark.parametrize("mutate,exc,needle", [
    (lambda a: a.update(block_table=a["block_table"].long()), TypeError, "block_table.dtype"),
    (lambda a: a.update(block_table=a["block_table"][:1]), ValueError, "block_table must have shape"),
    (lambda a: a["block_table"].__setitem__((1, 2), 10_000), ValueError, r"block_table\[1, 2\] = 10000 is outside"),
    (lambda a: a["block_table"].__setitem__((0, 0), -1), ValueError, r"block_table\[0, 0\] = -1"),
    (lambda a: a.update(seq_lens=torch.tensor([5, 13], dtype=torch.int32)), ValueError, "max_pages_per_seq"),
    (lambda a: a.update(k_cache=a["k_cache"][:, :3], v_cache=a["v_cache"][:, :3]), ValueError, "page_size"),
])
def test_paged_input_errors(mutate, exc, needle):
    a = good(page_size=4)
    mutate(a)
    with pytest.raises(exc, match=needle):
        call(a)


def test_unused_block_table_entries_are_not_checked():
    """Entries past a sequence's pages may hold anything (padding)."""
    a = good(page_size=4)
    a["block_table"][0, 2] = 10_000  # sequence 0 has 5 tokens = 2 pages
    call(a)


@pytest.mark.parametrize("hq,hkv", [(33, 2), (3, 2)])
def test_non_divisible_gqa_is_rejected_before_any_kernel(hq, hkv):
    """cases.yaml non-divisible-gqa."""
    q = torch.zeros(1, 1, hq, 16, dtype=torch.float16)
    k = torch.zeros(1, 8, hkv, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match=rf"num_q_heads \({hq}\).*num_kv_heads \({hkv}\)"):
        attnplan.decode(q, k, k, torch.tensor([4], dtype=torch.int32))


def test_devices_must_match():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device type")
    a = good()
    a["q"] = a["q"].cuda()
    with pytest.raises(ValueError, match="k_cache is on"):
        call(a)


def test_run_checks_against_plan_and_requires_plan():
    a = good()
    w = attnplan.DecodeWrapper(backend="reference")
    with pytest.raises(attnplan.PlanNotReadyError):
        w.run(a["q"], a["k_cache"], a["v_cache"], a["seq_lens"])
    w.plan(a["q"], a["k_cache"], a["v_cache"], a["seq_lens"])
    with pytest.raises(ValueError, match="differ from the planned"):
        w.run(a["q"][:1], a["k_cache"], a["v_cache"], a["seq_lens"])
    with pytest.raises(ValueError, match="out must be"):
        w.run(a["q"], a["k_cache"], a["v_cache"], a["seq_lens"], out=torch.empty(3))


def test_forced_unsupported_backend_gives_reasons():
    a = good()
    a["q"] = a["q"].float()
    with pytest.raises(attnplan.NoBackendError, match="no backend can run"):
        attnplan.decode(torch.zeros(1, 1, 4, 12, dtype=torch.float16), torch.zeros(1, 4, 2, 12, dtype=torch.float16),
                        torch.zeros(1, 4, 2, 12, dtype=torch.float16), torch.tensor([3], dtype=torch.int32),
                        backend="triton")


@pytest.mark.parametrize("bad", [-3, 5000, 2.5, True, "4"])
def test_plan_num_splits_is_checked(bad):
    import attnplan
    from attnplan.testing import make_inputs

    x = make_inputs(1, 4, 1, 16, [20], dtype=torch.float32)
    w = attnplan.DecodeWrapper(backend="reference")
    with pytest.raises(ValueError, match="num_splits"):
        w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, num_splits=bad)


@pytest.mark.parametrize("bad", [24, 48, 17])
def test_config_block_dv_must_be_a_power_of_two(bad):
    import attnplan
    from attnplan.config import ConfigError

    with pytest.raises(ConfigError, match="block_dv"):
        attnplan.load_config(backend_options={"triton": {"block_dv": bad}})


def test_seq_lens_host_replaces_the_device_read_and_is_checked():
    import attnplan
    from attnplan.testing import make_inputs

    x = make_inputs(2, 4, 1, 16, [20, 7], dtype=torch.float32)
    w = attnplan.DecodeWrapper(backend="reference")
    plan = w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, seq_lens_host=[20, 7])
    assert plan.problem["max_kv_len"] == attnplan.problem.len_bucket(20)
    with pytest.raises(ValueError, match="seq_lens_host must hold 2"):
        w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, seq_lens_host=[20])
    with pytest.raises(ValueError, match="exceeds the cache capacity"):
        w.plan(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, seq_lens_host=[20, 999])
