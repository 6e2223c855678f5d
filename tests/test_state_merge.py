"""The partial-state format and the merge contract (DESIGN.md; seed 003 §03-04; cases.yaml)."""

import math

import pytest
import torch

from attnplan import reference
from attnplan.state import PartialState, merge_state_pair, merge_states
from attnplan.testing import make_inputs

NEG_INF = float("-inf")


def _state_of(scores, values):
    """float64 state (o, lse) of one scalar row over the given scores and values."""
    s = torch.tensor(scores, dtype=torch.float64)
    v = torch.tensor(values, dtype=torch.float64)
    lse = torch.logsumexp(s, 0)
    return (torch.exp(s - lse) * v).sum(), lse


def _row_state(parts):
    o = torch.stack([p[0] for p in parts]).view(1, 1, 1, len(parts), 1)
    lse = torch.stack([p[1] for p in parts]).view(1, 1, 1, len(parts))
    return PartialState(o, lse)


def test_seed_003_worked_example():
    """scores [0, ln2, ln3, ln4], V [1, 2, 4, 8]: output 4.9; averaging the halves gives 3.976."""
    s = [0.0, math.log(2), math.log(3), math.log(4)]
    v = [1.0, 2.0, 4.0, 8.0]
    a, b = _state_of(s[:2], v[:2]), _state_of(s[2:], v[2:])
    assert float(a[0]) == pytest.approx(5 / 3) and float(b[0]) == pytest.approx(44 / 7)
    o, lse = merge_states(_row_state([a, b]))
    assert float(o.squeeze()) == pytest.approx(4.9, abs=1e-12)
    assert float(lse.squeeze()) == pytest.approx(math.log(10), abs=1e-12)
    naive = (float(a[0]) + float(b[0])) / 2
    assert naive == pytest.approx(3.976, abs=1e-3) and abs(naive - 4.9) > 0.9


def test_empty_splits_get_no_weight_and_all_empty_row_is_zero_neg_inf():
    a = _state_of([0.3, 1.2], [2.0, -1.0])
    empty = (torch.tensor(0.0, dtype=torch.float64), torch.tensor(NEG_INF, dtype=torch.float64))
    o, lse = merge_states(_row_state([empty, a, empty]))
    assert float(o.squeeze()) == pytest.approx(float(a[0])) and float(lse.squeeze()) == pytest.approx(float(a[1]))
    o, lse = merge_states(_row_state([empty, empty]))
    assert float(o.squeeze()) == 0.0 and math.isinf(float(lse.squeeze())) and float(lse.squeeze()) < 0
    assert not torch.isnan(o).any()


def test_empty_split_with_garbage_o_does_not_leak():
    """An empty split's o is masked by its lse = -inf even if the buffer held NaN."""
    a = _state_of([0.1], [3.0])
    bad = (torch.tensor(float("nan"), dtype=torch.float64), torch.tensor(NEG_INF, dtype=torch.float64))
    o, _ = merge_states(_row_state([a, bad]))
    assert float(o.squeeze()) == pytest.approx(3.0)


def test_merge_with_itself_keeps_o_adds_ln2(gen):
    o = torch.randn(2, 1, 3, 1, 8, generator=gen, dtype=torch.float64)
    lse = torch.randn(2, 1, 3, 1, generator=gen, dtype=torch.float64)
    st = PartialState(torch.cat([o, o], 3), torch.cat([lse, lse], 3))
    mo, ml = merge_states(st)
    assert torch.allclose(mo, o.squeeze(3)) and torch.allclose(ml, lse.squeeze(3) + math.log(2))


def test_merging_empty_state_leaves_other_unchanged(gen):
    o = torch.randn(1, 1, 2, 1, 4, generator=gen, dtype=torch.float64)
    lse = torch.randn(1, 1, 2, 1, generator=gen, dtype=torch.float64)
    e = PartialState(torch.zeros_like(o), torch.full_like(lse, NEG_INF))
    merged = merge_state_pair(PartialState(o, lse), e)
    assert torch.allclose(merged.o, o) and torch.allclose(merged.lse, lse)


@pytest.mark.parametrize("page_size", [None, 16])
def test_result_independent_of_split_count_and_order(page_size, gen):
    x = make_inputs(3, 8, 2, 32, [70, 0, 33], q_len=2, page_size=page_size, dtype=torch.float32, generator=gen)
    ref_o, ref_lse = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale)
    for chunk, splits in [(80, 1), (16, 5), (8, 9), (16, 12), (5, 3)]:
        st = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, chunk, splits)
        o, lse = merge_states(st)
        assert torch.allclose(o, ref_o, atol=1e-12) and torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        assert torch.allclose(lse[~torch.isinf(lse)], ref_lse[~torch.isinf(ref_lse)], atol=1e-12)
        perm = torch.randperm(splits, generator=gen)
        o2, lse2 = merge_states(PartialState(st.o[:, :, :, perm], st.lse[:, :, :, perm]))
        assert torch.allclose(o2, o, atol=1e-12) and torch.allclose(lse2[~torch.isinf(lse2)], lse[~torch.isinf(lse)])


def test_zero_length_row_is_zero_neg_inf_without_nan(gen):
    """cases.yaml zero-length-padding-row / zero-length-lse-sign."""
    x = make_inputs(4, 16, 2, 32, [100, 200, 7, 0], dtype=torch.float32, generator=gen)
    st = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale, 16, 13)
    o, lse = merge_states(st)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.all(o[3] == 0) and torch.all(torch.isneginf(lse[3]))
    assert torch.all(torch.isneginf(st.lse[3])) and torch.all(st.o[3] == 0)


def test_noncontiguous_state_buffers(gen):
    """A strided view (splits taken from a bigger buffer) merges like a contiguous one."""
    o = torch.randn(2, 1, 2, 6, 8, generator=gen, dtype=torch.float64)
    lse = torch.randn(2, 1, 2, 6, generator=gen, dtype=torch.float64)
    view = PartialState(o[:, :, :, ::2], lse[:, :, :, ::2])
    dense = PartialState(view.o.contiguous(), view.lse.contiguous())
    a, b = merge_states(view), merge_states(dense)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_partial_state_validates_shapes():
    with pytest.raises(ValueError, match="o.shape"):
        PartialState(torch.zeros(1, 1, 2, 3, 4), torch.zeros(1, 1, 2, 4))
    with pytest.raises(ValueError, match="5-D"):
        PartialState(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3))
