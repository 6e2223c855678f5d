"""``attnplan.testing``'s comparison with the float64 reference fails on the defects it exists to catch: a NaN on
either side, and a row that lost one key at each dtype's tolerance."""

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
