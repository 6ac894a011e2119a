"""The oracle and the q/eps arithmetic against the seeds' worked values and an independent
pure-Python float64 transcription (math.hypot; no torch in the expected values)."""

import math
import random

import pytest
import torch

from parity_cli.backends.implementations import mean_square, oracle_normalize
from parity_cli.comparison import attenuation, q_over_eps_stats

# The sources' table: q/eps -> A = sqrt(q/(q+eps)), rounded to 6 decimals there.
SEED_ATTENUATION = [(0.01, 0.099504), (0.1, 0.301511), (1.0, 0.707107), (10.0, 0.953463), (100.0, 0.995037)]


def python_rms(x, eps):
    """Independent transcription: hypot of x/sqrt(n) and sqrt(eps) is sqrt(q + eps)."""
    n = len(x)
    denom = math.hypot(*(v / math.sqrt(n) for v in x), math.sqrt(eps))
    return [v / denom if denom else 0.0 for v in x]


@pytest.mark.parametrize("ratio,expected", SEED_ATTENUATION)
def test_attenuation_table(ratio, expected):
    assert round(attenuation(ratio), 6) == expected


@pytest.mark.parametrize("ratio,expected", SEED_ATTENUATION)
def test_oracle_on_constant_rows_gives_the_attenuation(ratio, expected):
    eps = 1e-6
    x = torch.full((1, 2), math.sqrt(ratio * eps), dtype=torch.float64)
    y = oracle_normalize(x, eps)
    assert round(float(y[0, 0]), 6) == expected
    (qmin, qmax), (amin, amax) = q_over_eps_stats(x, eps, "rms_norm")
    assert qmin == pytest.approx(ratio, rel=1e-12) and qmax == pytest.approx(ratio, rel=1e-12)
    assert amin == pytest.approx(expected, abs=5e-7)


def test_one_percent_budget():
    ratio = 1 / (0.99 ** -2 - 1)
    assert ratio == pytest.approx(49.2512562814, rel=1e-10)
    assert attenuation(49.2512562814) == pytest.approx(0.99, abs=1e-10)
    assert attenuation(49.0) < 0.99 < attenuation(49.5)


def test_eps_inside_vs_outside_the_root():
    x = torch.tensor([[0.001, 0.001]], dtype=torch.float64)
    inside = float(oracle_normalize(x, 1e-6)[0, 0])
    assert round(inside, 6) == 0.707107
    from parity_cli.diagnose.causes import _eps_outside  # the variant the diagnosis plants

    outside = float(_eps_outside(x, 1e-6)[0, 0])
    assert round(outside, 6) == 0.999001
    assert abs(inside - outside) > 0.29
    assert round(float(oracle_normalize(x, 1e-4)[0, 0]), 6) == 0.099504


def test_huge_inputs_do_not_overflow():
    y = oracle_normalize(torch.tensor([[1e200, -1e200]], dtype=torch.float64), 1e-6)
    assert y.tolist() == [[1.0, -1.0]]
    big = torch.tensor([[1.7e308, -1.7e308, 1.7e308]], dtype=torch.float64)
    assert torch.allclose(oracle_normalize(big, 1e-5), torch.tensor([[1.0, -1.0, 1.0]], dtype=torch.float64))


def test_zero_rows_give_zeros():
    for eps in (1e-6, 1e-5):
        y = oracle_normalize(torch.zeros(3, 8, dtype=torch.float64), eps)
        assert torch.equal(y, torch.zeros(3, 8, dtype=torch.float64))
    assert torch.isnan(oracle_normalize(torch.zeros(1, 8, dtype=torch.float64), 0.0)).all()  # 0/0
    assert mean_square(torch.zeros(1, 4, dtype=torch.float64)).tolist() == [0.0]


def test_oracle_matches_independent_transcription():
    rng = random.Random(7)
    for _ in range(50):
        n = rng.randint(1, 40)
        scale = 10 ** rng.uniform(-8, 30)
        x = [rng.gauss(0, 1) * scale for _ in range(n)]
        eps = 10 ** rng.uniform(-12, -3)
        got = oracle_normalize(torch.tensor([x], dtype=torch.float64), eps)[0].tolist()
        want = python_rms(x, eps)
        assert len(got) == n
        for g, w in zip(got, want, strict=True):
            assert g == pytest.approx(w, rel=1e-12, abs=1e-300)


def test_layer_norm_oracle_removes_the_mean():
    x = [1.0, 2.0, 3.0, 6.0]
    mu = sum(x) / 4
    var = sum((v - mu) ** 2 for v in x) / 4
    want = [(v - mu) / math.sqrt(var + 1e-5) for v in x]
    got = oracle_normalize(torch.tensor([x], dtype=torch.float64), 1e-5, "layer_norm")[0].tolist()
    assert got == pytest.approx(want, rel=1e-13)


def test_scaling_the_input_is_scaling_eps():
    """RMSNorm(c*x; eps) == RMSNorm(x; eps/c^2): scale-invariant only where eps is negligible."""
    x = torch.tensor([[0.3, -1.2, 0.05, 2.0]], dtype=torch.float64)
    c = 1e-3
    assert torch.allclose(oracle_normalize(c * x, 1e-6), oracle_normalize(x, 1e-6 / c ** 2), rtol=1e-13)
