"""The batched comparison (one pass per quantity over every stratum of a layer) against the
per-stratum compare() and against values derived by hand: the verdict, the counts, the worst
element and the maxima must not depend on which path computed them."""

import math
import random

import pytest
import torch

from parity_cli.comparison import Tolerance, compare, compare_batch, ulp_distance

F64 = torch.float64


def fields(r):
    return (r.name, r.status, r.vectors, r.elements, r.violations, r.max_abs_err, r.max_rel_err,
            r.nonfinite_reference, r.nonfinite_candidate, r.max_ulp, r.failing_q_over_eps, r.q_over_eps,
            r.attenuation, (r.worst.vector, r.worst.index, r.worst.input, r.worst.reference, r.worst.candidate,
                            r.worst.allowed),
            r.row_error, r.row_q_over_eps)


def both(segments, x, ref, cand, tol, extra=None, q=None, **kw):
    batched = compare_batch(segments, x, ref, cand, 1e-6, "rms_norm", tol, extra=extra, q=q, **kw)
    single = [compare(name, x[a:b], ref[a:b], cand[a:b], 1e-6, "rms_norm", tol,
                      extra=None if extra is None else extra[a:b], q=None if q is None else q[a:b], **kw)
              for name, a, b in segments]
    return batched, single


def test_hand_derived_counts_through_the_batch():
    """The example of test_check.py's compare test, as two strata of one batch: the NaN row
    takes the general path, the finite row the batched one."""
    x = torch.ones(3, 4, dtype=F64)
    ref = torch.tensor([[1.0, 2.0, 0.0, -1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 2.0, 0.0, -1.0]], dtype=F64)
    cand = ref.clone()
    cand[0, 1] = 2.0 + 2e-3     # outside 1e-3 + 0 * 2
    cand[0, 2] = 5e-4           # zero reference: atol alone, inside
    cand[1, 3] = float("nan")   # non-finite: always a violation
    tol = Tolerance(atol=1e-3, rtol=0.0, source="test")
    finite, nan = compare_batch([("a", 0, 1), ("b", 1, 3)], x, ref, cand, 1e-6, "rms_norm", tol)
    assert (finite.violations, finite.status, finite.nonfinite_candidate) == (1, "fail", 0)
    assert finite.max_abs_err == pytest.approx(2e-3)
    assert finite.max_rel_err == pytest.approx(1e-3)  # the zero reference is excluded from rel error
    assert (finite.worst.vector, finite.worst.index) == (0, 1)
    assert finite.bad.tolist() == [[False, True, False, False]]
    assert (nan.violations, nan.status, nan.nonfinite_candidate) == (1, "fail", 1)
    assert nan.max_abs_err == nan.max_rel_err == math.inf
    assert (nan.worst.vector, nan.worst.index) == (0, 3)


@pytest.mark.parametrize("above", [False, True])
def test_the_boundary_is_inclusive_on_both_paths(above):
    """|c - r| == atol + rtol*|r| passes, one float64 step above fails: allowed = 2^-7 + 2^-10
    at r = 1, and 1 + allowed is exact, so d == allowed exactly."""
    allowed = 2.0 ** -7 + 2.0 ** -10
    c = 1.0 + allowed
    if above:
        c = math.nextafter(c, math.inf)
    x = torch.ones(1, 3, dtype=F64)
    ref = torch.ones(1, 3, dtype=F64)
    cand = torch.tensor([[c, 1.0, 1.0]], dtype=F64)
    tol = Tolerance(atol=2.0 ** -10, rtol=2.0 ** -7, source="test")
    (b,), (s,) = both([("t", 0, 1)], x, ref, cand, tol)
    assert b.violations == s.violations == int(above)
    assert fields(b) == fields(s)


def test_zero_reference_with_an_error_is_judged_by_atol_alone():
    """r = 0 and c != 0: relative error is undefined there and excluded (0, not inf)."""
    x = torch.ones(1, 3, dtype=F64)
    ref = torch.tensor([[0.0, 2.0, 4.0]], dtype=F64)
    cand = torch.tensor([[5e-4, 2.0 + 2e-3, 4.0]], dtype=F64)
    tol = Tolerance(atol=1e-3, rtol=0.0, source="test")
    (b,), (s,) = both([("t", 0, 1)], x, ref, cand, tol)
    assert b.max_rel_err == pytest.approx(1e-3)
    assert fields(b) == fields(s)


def test_random_batches_agree_with_the_per_stratum_comparison():
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    for trial in range(40):
        sizes = [rng.randint(1, 5) for _ in range(rng.randint(1, 6))]
        dim = rng.choice([1, 3, 64, 257])
        n = sum(sizes)
        x = torch.randn(n, dim, generator=gen, dtype=F64)
        ref = torch.randn(n, dim, generator=gen, dtype=F64) * 10.0 ** rng.randint(-3, 3)
        ref[torch.rand(n, dim, generator=gen) < 0.1] = 0.0
        noise = torch.randn(n, dim, generator=gen, dtype=F64) * 10.0 ** rng.randint(-6, -1)
        cand = ref + noise * (torch.rand(n, dim, generator=gen) < rng.random())
        if trial % 5 == 0:  # a non-finite value somewhere: that stratum takes the general path
            cand[rng.randrange(n), rng.randrange(dim)] = rng.choice([math.nan, math.inf, -math.inf])
        segments, start = [], 0
        for k, size in enumerate(sizes):
            segments.append((f"s{k}", start, start + size))
            start += size
        tol = Tolerance(atol=10.0 ** rng.randint(-6, -2), rtol=rng.choice([0.0, 1e-3, 1.6e-2]), source="test")
        kw = {"dtype": rng.choice([torch.bfloat16, torch.float16, torch.float32]),
              "max_violation_fraction": rng.choice([0.0, 0.01])}
        if trial % 3 == 1:  # a LayerNorm-like per-element allowance on top of atol + rtol|r|
            kw["extra"] = torch.rand(n, dim, generator=gen, dtype=F64) * 10.0 ** rng.randint(-5, -2)
        if trial % 2:  # the rows' q handed in, as check_layer does from the probe set
            kw["q"] = (x * x).mean(-1)
        batched, single = both(segments, x, ref, cand, tol, **kw)
        assert len(batched) == len(single) == len(segments)
        for b, s in zip(batched, single):
            assert repr(fields(b)) == repr(fields(s)), (trial, b.name)  # repr: NaN equals NaN
            assert (b.bad is None) == (s.bad is None)
            if b.bad is not None:
                assert torch.equal(b.bad, s.bad)


def test_an_atol_below_the_smallest_normal_takes_the_general_path():
    """atol = 1e-310 (subnormal): d / allowed overflows to inf for both elements, which would
    make the first the worst; the errors are 0.1 and 0.2, so the worst is the second."""
    x = torch.ones(1, 2, dtype=F64)
    ref = torch.tensor([[1.0, 0.5]], dtype=F64)
    cand = torch.tensor([[1.1, 0.7]], dtype=F64)
    (b,), (s,) = both([("t", 0, 1)], x, ref, cand, Tolerance(atol=1e-310, rtol=0.0, source="test"))
    assert b.worst.index == s.worst.index == 1 and b.violations == 2


def test_ulps_against_frexp():
    """The unit in the last place of a dtype at |r| is eps * 2^(e - 1) with r = m * 2^e,
    m in [0.5, 1) (math.frexp): independent of the mantissa-clearing shortcut."""
    values = [1.0, 1.5, 0.75, 3.0, -2.0, 1e-3, 6.0e4, 2.0 ** -20, 1e-40, 0.0]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        info = torch.finfo(dtype)
        ref = torch.tensor(values, dtype=F64)
        cand = ref + 3e-3
        got = ulp_distance(ref, cand, dtype).tolist()
        assert len(got) == len(values)
        for r, c, g in zip(values, cand.tolist(), got):
            _, e = math.frexp(max(abs(r), info.tiny))
            assert g == abs(c - r) / (info.eps * 2.0 ** (e - 1))
