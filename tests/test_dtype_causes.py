"""Issue 47, a cause that sends the user the wrong way: a kernel whose form and eps are right but
that holds its scale, or does its arithmetic, in a narrower dtype is named for the dtype, not for
an eps it used (`eps_missing`) or nothing (`unexplained`)."""

import math

import torch
from conftest import plugin

from parity_cli import api


def _only(report):
    (layer,) = [l for l in report.layers if l.name == "model.norm"]
    return layer


def test_a_float16_scale_that_overflows_is_not_a_missing_eps(ckpt):
    """eps 1e-12 is used in float32, but 1/sqrt(1e-12) = 1e6 held in float16 (largest 65504) is inf."""
    src = ckpt("llama", layers=1, eps=1e-12, dtype="float16")
    layer = _only(api.check(src, candidate=plugin("scale_held_in_dtype"), dtype="float16"))
    assert layer.status == "fail" and [d.code for d in layer.diagnoses] == ["scale_in_input_dtype"]
    d = layer.diagnoses[0]
    top = float(torch.finfo(torch.float16).max)
    assert 1 / math.sqrt(1e-12) > top  # the premise: this eps's scale does not fit
    assert math.isclose(d.evidence["overflow_below_q_plus_eps"], top ** -2, rel_tol=1e-12)
    assert d.evidence["nonfinite_rows"] > 0 and "the eps is used" in d.message and "0 * inf = NaN" in d.message


def test_a_dropped_eps_is_still_named_eps_missing(ckpt):
    """The other kernel on the same checkpoint: eps dropped, scale in float32; only the zero rows are NaN."""
    src = ckpt("llama", layers=1, eps=1e-12, dtype="float16")
    layer = _only(api.check(src, candidate=plugin("eps_missing"), dtype="float16"))
    assert [d.code for d in layer.diagnoses] == ["eps_missing"]


def test_a_float32_kernel_computing_in_float16_is_named(ckpt):
    src = ckpt("llama", layers=1, eps=1e-6, dtype="float32")
    layer = _only(api.check(src, candidate=plugin("half_arithmetic"), dtype="float32"))
    assert layer.status == "fail" and [d.code for d in layer.diagnoses] == ["arithmetic_in_lower_dtype"]
    assert layer.diagnoses[0].evidence["values_dtype"] == "float16"
    assert layer.diagnoses[0].evidence["checked_at"] == "float32"


def test_a_correct_float32_kernel_is_named_nothing(ckpt):
    src = ckpt("llama", layers=1, eps=1e-6, dtype="float32")
    report = api.check(src, candidate=plugin("rms_norm"), dtype="float32")
    assert report.passed and all(not l.diagnoses for l in report.layers)
