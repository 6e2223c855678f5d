"""The partial-state format and the merge contract (dense and ragged), against float64 worked examples."""

import math

import pytest
import torch

from attnplan import reference
from attnplan.schedule import NUM_TARGETS, Schedule
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


def test_worked_example_merge_of_two_halves():
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
    for granule, splits in [(16, 1), (16, 5), (8, 9), (16, 12), (8, 3)]:
        sched = Schedule("forced" if splits > 1 else "single", granule, 1, splits, (0,) * NUM_TARGETS, 3 * splits)
        st, units = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, x.block_table, x.sm_scale, sched)
        o, lse = merge_states(st, indptr=units.indptr)
        assert torch.allclose(o, ref_o, atol=1e-12) and torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        assert torch.allclose(lse[~torch.isinf(lse)], ref_lse[~torch.isinf(ref_lse)], atol=1e-12)
        n = int(units.indptr[1])  # sequence 0's units, reversed
        perm = torch.cat([torch.arange(n).flip(0), torch.arange(n, units.num_units)])
        o2, lse2 = merge_states(PartialState(st.o[:, :, :, perm], st.lse[:, :, :, perm]), indptr=units.indptr)
        assert torch.allclose(o2, o, atol=1e-12) and torch.allclose(lse2[~torch.isinf(lse2)], lse[~torch.isinf(lse)])


def test_zero_length_row_is_zero_neg_inf_without_nan(gen):
    """A padding slot of length 0 (vLLM PR 57094) and the lse sign of an empty row (FlashAttention PR 978)."""
    x = make_inputs(4, 16, 2, 32, [100, 200, 7, 0], dtype=torch.float32, generator=gen)
    sched = Schedule("forced", 16, 1, 13, (0,) * NUM_TARGETS, 52)
    st, units = reference.partial(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale, sched)
    o, lse = merge_states(st, indptr=units.indptr)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.all(o[3] == 0) and torch.all(torch.isneginf(lse[3]))
    last = int(units.indptr[3])  # the empty sequence's one unit holds the empty state
    assert torch.all(torch.isneginf(st.lse[0, :, :, last])) and torch.all(st.o[0, :, :, last] == 0)


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


# -- the ragged (scheduled) form, sinks edge cases, NaN, zero splits -------------------------------------------------

def _random_state(gen, b, q, h, s, d, empty_frac=0.3):
    o = torch.randn(b, q, h, s, d, generator=gen, dtype=torch.float64)
    lse = torch.randn(b, q, h, s, generator=gen, dtype=torch.float64) * 3
    empty = torch.rand(b, q, h, s, generator=gen) < empty_frac
    lse = lse.masked_fill(empty, NEG_INF)
    o = o.masked_fill(empty.unsqueeze(-1), 0.0)
    return PartialState(o, lse)


def test_ragged_merge_equals_dense_merge(gen):
    """Sequence b's units at slots [indptr[b], indptr[b+1]) of a batch-1 state merge like a dense state whose
    unused splits are empty."""
    counts = [3, 1, 0, 5]
    dense = _random_state(gen, 4, 2, 3, 5, 8)
    for b, c in enumerate(counts):  # splits past a sequence's count are empty in the dense form
        dense.lse[b, :, :, c:] = NEG_INF
        dense.o[b, :, :, c:] = 0.0
    indptr = torch.tensor([0, 3, 4, 4, 9])
    o_r = torch.cat([dense.o[b, :, :, :c] for b, c in enumerate(counts)], dim=2).unsqueeze(0)
    l_r = torch.cat([dense.lse[b, :, :, :c] for b, c in enumerate(counts)], dim=2).unsqueeze(0)
    pad = torch.full((1, 2, 3, 2), float("nan"), dtype=torch.float64)  # unused slots past indptr[-1] are never read
    ragged = PartialState(torch.cat([o_r, pad.unsqueeze(-1).expand(1, 2, 3, 2, 8)], 3), torch.cat([l_r, pad], 3))
    sinks = torch.randn(3, generator=gen, dtype=torch.float64)
    for z in (None, sinks):
        o1, l1 = merge_states(dense, z)
        o2, l2 = merge_states(ragged, z, indptr=indptr)
        assert torch.allclose(o1, o2, atol=1e-12) and torch.equal(torch.isneginf(l1), torch.isneginf(l2))
        assert torch.allclose(l1[torch.isfinite(l1)], l2[torch.isfinite(l2)], atol=1e-12)
    o, lse = merge_states(ragged, indptr=indptr)
    assert (o[2] == 0).all() and torch.isneginf(lse[2]).all()  # a sequence with no unit is an empty row
    with pytest.raises(ValueError, match="indptr"):
        merge_states(ragged, indptr=torch.tensor([0, 3, 2, 4, 9]))
    with pytest.raises(ValueError, match="indptr"):
        merge_states(ragged, indptr=torch.tensor([0, 3, 4, 4, 12]))
    with pytest.raises(TypeError, match="indptr"):
        merge_states(ragged, indptr=torch.tensor([0.0, 9.0]))


def test_zero_splits_give_empty_rows():
    st = PartialState(torch.zeros(2, 1, 3, 0, 4), torch.zeros(2, 1, 3, 0))
    o, lse = merge_states(st)
    assert o.shape == (2, 1, 3, 4) and (o == 0).all() and torch.isneginf(lse).all()
    o, lse = merge_states(st, torch.tensor([0.5, float("-inf"), 1.0]))
    assert (o == 0).all() and lse[..., 0].eq(0.5).all() and torch.isneginf(lse[..., 1]).all()


def test_sinks_edge_values_and_checks():
    empty = PartialState(torch.zeros(1, 1, 2, 2, 3), torch.full((1, 1, 2, 2), NEG_INF))
    o, lse = merge_states(empty, torch.tensor([float("-inf"), float("-inf")]))
    assert not torch.isnan(o).any() and (o == 0).all() and torch.isneginf(lse).all()  # -inf sink = no sink
    full = PartialState(torch.ones(1, 1, 2, 1, 3), torch.zeros(1, 1, 2, 1))
    o, lse = merge_states(full, torch.tensor([float("inf"), float("-inf")]))
    assert (o[..., 0, :] == 0).all() and torch.isposinf(lse[..., 0]).all()  # +inf sink takes all the weight
    assert (o[..., 1, :] == 1).all() and (lse[..., 1] == 0).all()
    with pytest.raises(ValueError, match="sinks"):
        merge_states(full, torch.zeros(1))  # not broadcast to every head
    with pytest.raises(TypeError, match="sinks"):
        merge_states(full, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="PartialState"):
        merge_states((full.o, full.lse))


def test_nan_in_is_nan_out_never_an_empty_row():
    st = PartialState(torch.ones(1, 1, 1, 3, 2), torch.tensor([[[[0.0, float("nan"), NEG_INF]]]]))
    o, lse = merge_states(st)
    assert torch.isnan(lse).all() and torch.isnan(o).all()
    st = PartialState(torch.tensor([[[[[1.0, float("nan")], [2.0, 2.0]]]]]), torch.tensor([[[[0.0, 0.0]]]]))
    o, lse = merge_states(st)
    assert torch.isnan(o[..., 1]).all() and torch.isfinite(o[..., 0]).all() and torch.isfinite(lse).all()


def test_merge_refuses_non_float_states_and_makes_a_plus_inf_lse_nan():
    """A bool or integer state is a TypeError (not a failure deep in torch); a ``+inf`` LSE (a split of unbounded
    weight) has no finite merge: the row is NaN, as documented, never a silent number."""
    o, lse = torch.zeros(1, 1, 1, 2, 4), torch.tensor([[[[float("inf"), 0.0]]]])
    with pytest.raises(TypeError, match="state's o must be a float16, bfloat16, float32 or float64 tensor, got "
                                        "torch.bool"):
        merge_states(PartialState(o.bool(), lse))
    with pytest.raises(TypeError, match="state's lse must be a float16, .* got torch.int32"):
        merge_states(PartialState(o, lse.to(torch.int32)))
    out, out_lse = merge_states(PartialState(o, lse))
    assert torch.isnan(out).all() and torch.isnan(out_lse).all()


@pytest.mark.parametrize("field", ["o", "lse"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64])
def test_merge_refuses_fp8_and_complex_states_by_field(field, dtype):
    """fp8 (and complex) pass ``is_floating_point`` / are numbers, but torch has no merge arithmetic in them: a
    TypeError naming the field and the dtypes the merge takes, not torch's RuntimeError / NotImplementedError."""
    t = {"o": torch.zeros(1, 1, 2, 3, 4), "lse": torch.zeros(1, 1, 2, 3)}
    t[field] = t[field].to(dtype)
    with pytest.raises(TypeError, match=f"merge_states: the state's {field} must be a float16, bfloat16, float32 or "
                                        f"float64 tensor, got {dtype}"):
        merge_states(PartialState(t["o"], t["lse"]))
    with pytest.raises(TypeError, match=f"the state's {field} must be"):
        merge_state_pair(PartialState(t["o"], t["lse"]), PartialState(t["o"], t["lse"]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_merge_takes_every_float_dtype_it_computes_in(dtype):
    o, lse = torch.ones(1, 1, 2, 3, 4, dtype=dtype), torch.zeros(1, 1, 2, 3, dtype=dtype)
    out, out_lse = merge_states(PartialState(o, lse))
    assert out.dtype == dtype and torch.allclose(out.double(), torch.ones(1, 1, 2, 4, dtype=torch.float64))
    assert torch.allclose(out_lse.double(), torch.full((1, 1, 2), math.log(3), dtype=torch.float64), atol=1e-2)


@pytest.mark.parametrize("o,lse", [
    ([1.0], torch.zeros(1, 1, 2, 3)), (torch.zeros(1, 1, 2, 3, 4), None), (None, None),
    (torch.zeros(1, 1, 2, 3, 4), [[0.0]]), (__import__("numpy").zeros((1, 1, 2, 3, 4)), torch.zeros(1, 1, 2, 3))])
def test_partial_state_fields_must_be_tensors(o, lse):
    name = "o" if not isinstance(o, torch.Tensor) else "lse"
    with pytest.raises(TypeError, match=f"PartialState: {name} must be a torch.Tensor, got "
                                        f"{type(o if name == 'o' else lse).__name__}"):
        PartialState(o, lse)


@pytest.mark.parametrize("other", [
    lambda o, lse: PartialState(o[:1], lse[:1]),  # another batch
    lambda o, lse: PartialState(o[:, :, :1], lse[:, :, :1]),  # other heads
    lambda o, lse: PartialState(o[..., :2], lse),  # another head_dim
    lambda o, lse: PartialState(o.to("meta"), lse.to("meta")),  # another device
], ids=["batch", "heads", "head_dim", "device"])
def test_states_of_other_rows_are_refused_by_merge_pair_and_concat(other):
    """Only states of the same rows merge: a pair or concat of others is a ValueError naming both shapes, not
    torch's stack / cat error from deep inside the merge."""
    o, lse = torch.zeros(2, 1, 3, 2, 4), torch.zeros(2, 1, 3, 2)
    b = other(o, lse)
    with pytest.raises(ValueError, match=r"merge_state_pair: state 1 has rows \[batch, q_len, num_q_heads\]"):
        merge_state_pair(PartialState(o, lse), b)
    with pytest.raises(ValueError, match=r"PartialState.concat: state 1 has rows"):
        PartialState.concat([PartialState(o, lse), b])
    with pytest.raises(ValueError, match="needs at least one state"):
        PartialState.concat([])
    with pytest.raises(TypeError, match="state 1 must be a PartialState, got tuple"):
        PartialState.concat([PartialState(o, lse), (o, lse)])
    with pytest.raises(ValueError, match="indptr is on the meta device"):
        merge_states(PartialState(o[:1], lse[:1]), indptr=torch.tensor([0, 2], device="meta"))


@pytest.mark.parametrize("scale", [1e14, 1e17, 1e30])
def test_reference_weights_sum_to_one_at_huge_scores(scale, gen):
    """The float64 oracle at legal score scales far past fp32's usual range: 128 equal scores give the mean of V,
    whatever their size (normalizing by ``exp(s - lse)`` lost ``log(128)`` in ``lse`` from ~1e16 on and gave 128x
    the mean), and a soft cap of 1e30 over scores of ~1e36 keeps every output inside V's range."""
    q = torch.ones(1, 1, 1, 16)
    k = torch.ones(1, 128, 1, 16)
    v = torch.randn(1, 128, 1, 16, generator=gen)
    lens = torch.tensor([128], dtype=torch.int32)
    o, lse = reference.attention(q, k, v, lens, None, scale)
    torch.testing.assert_close(o, v.double().mean(1, keepdim=True), rtol=1e-12, atol=1e-12)
    assert lse.item() == pytest.approx(16 * scale + math.log(128), rel=1e-12)
    o, _ = reference.attention(q, k, v, lens, None, scale * 1e6, soft_cap=1e30)
    assert o.abs().max() <= v.double().abs().max()


@pytest.mark.parametrize("dtype,splits", [(torch.float16, 17), (torch.bfloat16, 65)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_row_at_the_dtypes_largest_magnitude_stays_finite(dtype, splits, sign):
    """Every split's ``o`` at the dtype's largest finite value: the weights sum to 1 only up to rounding (here to
    just above it in the state's own dtype), and the convex combination must still come back as that value, not
    inf (half-precision states merge in float32; float32 and float64 ones in their own dtype: not promised there)."""
    big = sign * torch.finfo(dtype).max
    o = torch.full((1, 1, 1, splits, 3), big, dtype=dtype)
    lse = torch.zeros(1, 1, 1, splits, dtype=dtype)
    lse[..., 0] = -0.3
    out, out_lse = merge_states(PartialState(o, lse))
    assert out.dtype == dtype and torch.equal(out, torch.full_like(out, big))
    ref = torch.logsumexp(lse.double(), -1)
    assert torch.allclose(out_lse.double(), ref, rtol=torch.finfo(dtype).eps)


@pytest.mark.parametrize("o_dtype,lse_dtype", [(torch.bfloat16, torch.float16), (torch.float16, torch.float32),
                                               (torch.float32, torch.bfloat16), (torch.float64, torch.float16)])
def test_mixed_dtypes_come_back_in_their_own_dtypes(o_dtype, lse_dtype, gen):
    """``o`` in ``state.o``'s dtype and ``lse`` in ``state.lse``'s, whatever torch would promote them to, and each
    within its dtype's rounding of the float64 merge of the same values."""
    o = torch.randn(2, 1, 3, 5, 8, generator=gen).to(o_dtype)
    lse = (4 * torch.randn(2, 1, 3, 5, generator=gen)).to(lse_dtype)
    out, out_lse = merge_states(PartialState(o, lse))
    assert out.dtype == o_dtype and out_lse.dtype == lse_dtype
    ref_o, ref_lse = merge_states(PartialState(o.double(), lse.double()))
    assert torch.allclose(out.double(), ref_o, rtol=torch.finfo(o_dtype).eps, atol=torch.finfo(o_dtype).eps)
    assert torch.allclose(out_lse.double(), ref_lse, rtol=torch.finfo(lse_dtype).eps)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_states_merge_to_within_one_rounding(dtype, gen):
    """A merge of 64 half-precision splits is the float64 merge of the same values rounded once: within half an ulp
    of the result plus the float32 arithmetic's few ulps of the row's largest ``|o_s|`` (a merge in the state's own
    dtype rounds at every product and sum, 10-100x more)."""
    o = torch.randn(4, 2, 4, 64, 32, generator=gen).to(dtype)
    lse = (3 * torch.randn(4, 2, 4, 64, generator=gen)).to(dtype)
    out, _ = merge_states(PartialState(o, lse))
    ref, _ = merge_states(PartialState(o.double(), lse.double()))
    big = o.double().abs().amax(dim=3)
    bound = torch.finfo(dtype).eps / 2 * ref.abs() + 64 * torch.finfo(torch.float32).eps * big
    assert ((out.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("indptr,needle", [([1, 3], "must start at 0"), ([0, 4], "end <= 3"),
                                           ([0, 2, 1], "not decrease")])
def test_ragged_merge_refuses_a_bad_offset_array(indptr, needle):
    """``indptr`` is sequence b's slots ``[indptr[b], indptr[b + 1])``: one that starts past 0, ends past the slots
    or decreases would merge the wrong slots; it is refused by name."""
    state = PartialState(torch.zeros(1, 1, 2, 3, 4), torch.zeros(1, 1, 2, 3))
    with pytest.raises(ValueError, match=needle):
        merge_states(state, indptr=torch.tensor(indptr))
