"""``attnplan.testing``'s comparison with the float64 reference fails on the defects it exists to catch: a NaN on
either side, and a row that lost one key at each dtype's tolerance; its input helpers refuse arguments they cannot
serve."""

from __future__ import annotations

import pytest
import torch

from attnplan import reference
from attnplan.testing import DTYPES, assert_close_to_reference, make_inputs

NAN = float("nan")


@pytest.mark.parametrize("out_v,ref_v", [(NAN, 0.5), (0.5, NAN)], ids=["nan-out", "nan-ref"])
def test_a_nan_on_either_side_never_passes(out_v, ref_v):
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_to_reference(torch.tensor([0.5, out_v]), torch.tensor([0.5, ref_v], dtype=torch.float64),
                                  torch.float32)


#: keys per row: dropping one moves the output 4.5-117x past the dtype's tolerance over 50 seeds (medians 12-20x;
#: the exact result rounded to the dtype stays within 0.12 of it), so a tolerance loosened some tens of times fails
ROW_KEYS = {"fp32": 16384, "fp16": 256, "bf16": 32}


@pytest.mark.parametrize("dt", DTYPES)
def test_the_tolerance_passes_the_rounded_result_and_fails_one_dropped_key(dt, gen):
    dtype = DTYPES[dt]
    n = ROW_KEYS[dt]
    x = make_inputs(1, 8, 2, 64, [n], dtype=dtype, generator=gen)
    ref, _ = reference.attention(x.q, x.k_cache, x.v_cache, x.seq_lens, None, x.sm_scale)
    short = torch.tensor([n - 1], dtype=torch.int32)
    bad, _ = reference.attention(x.q, x.k_cache, x.v_cache, short, None, x.sm_scale)
    assert_close_to_reference(ref.to(dtype), ref, dtype)  # the exact result rounded to the dtype passes
    with pytest.raises(AssertionError, match="max error"):
        assert_close_to_reference(bad.to(dtype), ref, dtype)


def test_input_helpers_refuse_arguments_they_cannot_serve():
    """The helpers' argument errors: a ValueError naming the argument (``make_inputs`` asserted the batch, divided by
    a page size of 0; ``long_tailed_lengths`` raised IndexError for no sequences and gave lengths of 1 for a
    ``max_kv`` of 0, outside its documented ``[1, max_kv]``)."""
    from attnplan.testing import long_tailed_lengths, make_inputs

    for kw, msg in (({"page_size": 0}, "page_size must be None"), ({"page_size": True}, "page_size must be None"),
                    ({"page_size": 4.0}, "page_size must be None")):
        with pytest.raises(ValueError, match=msg):
            make_inputs(2, 4, 2, 16, [3, 5], **kw)
    with pytest.raises(ValueError, match="seq_lens holds 1 lengths for a batch of 2"):
        make_inputs(2, 4, 2, 16, [3])
    for batch, max_kv in ((0, 100), (3, 0)):
        with pytest.raises(ValueError, match="batch and max_kv must be at least 1"):
            long_tailed_lengths(batch, max_kv)
    lens = long_tailed_lengths(5, 100, seed=3)
    assert len(lens) == 5 and lens[0] == 100 and all(1 <= n <= 100 for n in lens)
    assert make_inputs(2, 4, 2, 16, [3, 5], page_size=4).block_table.shape == (2, 2)
