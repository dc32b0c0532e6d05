"""flashkda.reference_forward, the library's fp64 token recurrence on host arrays, against the
independent numpy recurrence of kda_reference.py: every gate form, varlen with empty sequences,
initial state, flags and scale."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import GATES, make_problem
from kda_reference import kda_forward, rel_rms

import flashkda


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("flags", [(True, True), (False, False)])
def test_matches_the_numpy_recurrence(rng, gate, flags):
    l2norm, logit = flags
    p = make_problem(rng, lengths=[5, 0, 23, 16], H=2, K=32, V=16, gate=gate, state=True, cu_dtype=np.int64)
    if not logit:
        p["beta"] = rng.random(p["beta"].shape).astype(np.float32)
    kw = dict(gate=gate, A_log=p.get("A_log"), dt_bias=p.get("dt_bias"), lower_bound=p.get("lower_bound", -5.0),
              scale=0.375, initial_state=p["h0_vk"], cu_seqlens=p["cu_seqlens"])
    out, ht = flashkda.reference_forward(p["q"], p["k"], p["v"], p["g"], p["beta"], l2norm_qk=l2norm,
                                         beta_is_logit=logit, **kw)
    ref_o, ref_h = kda_forward(p["q"], p["k"], p["v"], p["g"], p["beta"], l2norm=l2norm, beta_logit=logit, **kw)
    assert out.dtype == np.float64 and ht.dtype == np.float64
    assert out.shape == ref_o.shape and ht.shape == ref_h.shape
    # Both are fp64 evaluations of the same recurrence: they differ only by rounding order. (The C++
    # API takes scale and lower_bound as float: 0.375 and -2 are exact there.)
    assert rel_rms(out, ref_o) <= 1e-12
    assert rel_rms(ht, ref_h) <= 1e-12
    np.testing.assert_array_equal(ht[1], p["h0_vk"][1])  # the empty sequence keeps its state exactly


def test_precomputed_gate_ignores_gate_parameters(rng):
    """A_log and dt_bias mean nothing to the precomputed form: whatever they are, they are unused
    (the argument fuzzer once got AttributeError for a list here)."""
    p = make_problem(rng, B=1, T=9, H=2, K=16, V=16, gate="precomputed")
    args = (p["q"], p["k"], p["v"], p["g"], p["beta"])
    out0, ht0 = flashkda.reference_forward(*args, gate="precomputed")
    out1, ht1 = flashkda.reference_forward(*args, gate="precomputed", A_log=[1.0, 2.0], dt_bias="unused")
    np.testing.assert_array_equal(out0, out1)
    np.testing.assert_array_equal(ht0, ht1)
