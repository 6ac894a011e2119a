import math

import pytest
import torch

from parity_cli.errors import InputError
from parity_cli.probes.strata import build_probes, select_strata

DEFAULT = ["zero", "tiny", "normal", "constant", "mixed", "large", "outlier"]


def probes(dtype=torch.float32, dim=64, eps=1e-6, seed=0, names=None):
    return {p.stratum: p.x for p in build_probes(select_strata(names), dim, eps, dtype, seed)}


def test_default_strata_and_extreme_opt_in():
    assert [s.name for s in select_strata(None)] == DEFAULT
    assert [s.name for s in select_strata(["extreme", "zero"])] == ["extreme", "zero"]
    with pytest.raises(InputError, match="unknown stratum 'bogus'"):
        select_strata(["bogus"])


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_tiny_sweeps_q_over_eps(eps):
    x = probes(torch.float64, eps=eps)["tiny"]
    ratios = [sum(v * v for v in row) / len(row) / eps for row in x.tolist()]
    for level in (0.01, 0.1, 1.0, 10.0, 100.0):
        assert any(math.isclose(r, level, rel_tol=1e-9) for r in ratios), level


def test_tiny_after_rounding_still_near_its_levels():
    x = probes(torch.bfloat16, eps=1e-6)["tiny"]
    ratios = sorted(sum(v * v for v in row) / len(row) / 1e-6 for row in x.tolist())
    assert ratios[0] == pytest.approx(0.01, rel=0.02) and ratios[-1] == pytest.approx(100, rel=0.02)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_large_spans_256_to_6e4_and_stays_representable(dtype):
    x = probes(dtype)["large"].abs()
    assert x.min() >= 255 and x.max() <= 6.01e4 and x.max() > 2e4
    assert torch.isfinite(x.to(dtype)).all()
    assert (x * x).min() > 65504  # every square overflows float16


def test_outlier_has_a_few_huge_channels_among_normal_ones():
    x = probes()["outlier"]
    assert len(x) > 0
    for row in x.abs():
        huge = (row >= 1e3).sum().item()
        assert 1 <= huge <= 3 and row.max() <= 1e4
        assert (row[row < 1e3] < 10).all()


def test_mixed_spreads_over_decades():
    x = probes()["mixed"].abs()
    assert x.min() < 1e-3 and x.max() > 1e2


def test_probes_are_rounded_to_the_candidate_dtype_and_deterministic():
    a = probes(torch.float16, seed=3)
    b = probes(torch.float16, seed=3)
    c = probes(torch.float16, seed=4)
    for name, x in a.items():
        assert x.dtype == torch.float64
        assert torch.equal(x, x.to(torch.float16).to(torch.float64)), name
        assert torch.equal(x, b[name])
    assert not torch.equal(a["normal"], c["normal"])


def test_probes_are_sized_to_the_layer():
    for dim in (1, 7, 128):
        made = probes(dim=dim)
        assert set(made) >= {"zero", "tiny", "normal", "large"}
        for x in made.values():
            assert x.shape[-1] == dim


def test_extreme_goes_toward_the_dtype_limit():
    x = probes(torch.float32, names=["extreme"])["extreme"].abs()
    assert x.min() >= 1.8e19 and torch.isfinite(x).all()
    assert torch.isinf((x.to(torch.float32)) ** 2).all()


def test_a_candidate_writing_into_its_input_does_not_change_later_layers(ckpt):
    from conftest import plugin

    from parity_cli import api

    report = api.check(ckpt("llama", layers=2, eps=1e-5), candidate=plugin("mutates_input"), dtype="float64",
                       reference="oracle")
    spans = {tuple(s.q_over_eps for s in layer.strata) for layer in report.layers}
    assert len(spans) == 1  # every layer saw the same probes
    normal = next(s for s in report.layers[-1].strata if s.name == "normal")
    assert normal.q_over_eps[0] > 0
