"""Issue 27 (part): `--exact` against an implementation (`--reference hf`, a plugin) compares
bit for bit at the dtype both sides run at: the reference runs at the candidate's dtype unless
--reference-dtype says otherwise (at the old default, float64, a bitwise-equal candidate failed).
The report's reference.dtype_source says which. The CLI and the library resolve it the same way:
--reference-dtype defaults to None, resolved in options.reference_dtype_for."""

import json

import pytest
from conftest import load_json, run_parity

from parity_cli import api, preflight
from parity_cli.errors import InputError
from parity_cli.options import CheckOptions, reference_dtype_for

FAST = ("--strata", "tiny,normal,large", "-q")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from parity_cli.sources.synthetic import write_checkpoint

    # stored bfloat16: the candidate runs at bfloat16 unless --dtype says otherwise
    return write_checkpoint(tmp_path_factory.mktemp("r") / "llama", "llama", layers=1, hidden=32, heads=2,
                            eps=1e-5, dtype="bfloat16")


def _check(path, tmp_path, *args, expect: int):
    """The report of `parity check` with `args`, whose exit code must be `expect` (0 pass, 1 fail)."""
    out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
    r = run_parity("check", path, *FAST, *args, "--json", out)
    assert r.returncode == expect, (r.returncode, r.stdout, r.stderr)
    return r.returncode, load_json(out)


def test_hf_against_itself_under_exact_passes_at_the_candidate_dtype(llama, tmp_path):
    code, d = _check(llama, tmp_path, "--reference", "hf", "--candidate", "hf", "--exact", expect=0)
    assert (d["reference"]["dtype"], d["reference"]["dtype_source"]) == ("bfloat16", "candidate:--exact")
    assert d["candidate"]["dtype"] == "bfloat16"
    assert (d["tolerance"]["atol"], d["tolerance"]["rtol"], d["tolerance"]["exact"]) == (0, 0, True)


def test_an_explicit_reference_dtype_is_kept_and_fails_as_before(llama, tmp_path):
    """float64 against a bfloat16 candidate under --exact: the candidate's rounding is a bitwise
    difference on every layer (the behaviour the option asks for)."""
    code, d = _check(llama, tmp_path, "--reference", "hf", "--candidate", "hf", "--exact",
                     "--reference-dtype", "float64", expect=1)
    assert (d["reference"]["dtype"], d["reference"]["dtype_source"]) == ("float64", "option:--reference-dtype")
    assert d["summary"]["failed"] == d["summary"]["layers"] > 0


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_torch_against_hf_under_exact_is_the_same_check_as_naming_the_dtype(llama, tmp_path, jobs):
    """--candidate torch --reference hf --exact is exactly --reference-dtype bfloat16 (the
    candidate's), with --jobs workers too: the same statuses and the same numbers per stratum."""
    # Llama's hf order rounds the normalised value to bfloat16 before the gain, F.rms_norm rounds once after
    # it: bitwise, some element differs, so both runs fail, the same way
    _, implied = _check(llama, tmp_path, "--reference", "hf", "--candidate", "torch", "--exact", "--jobs", jobs,
                        expect=1)
    _, named = _check(llama, tmp_path, "--reference", "hf", "--candidate", "torch", "--exact", "--jobs", jobs,
                      "--reference-dtype", "bfloat16", expect=1)
    assert implied["reference"]["dtype"] == named["reference"]["dtype"] == "bfloat16"
    assert implied["reference"]["dtype_source"] == "candidate:--exact"
    assert named["reference"]["dtype_source"] == "option:--reference-dtype"
    assert implied["summary"] == named["summary"]
    for a, b in zip(implied["layers"], named["layers"], strict=True):
        assert (a["name"], a["status"], a["strata"]) == (b["name"], b["status"], b["strata"])


def test_the_candidate_dtype_follows_dtype(llama, tmp_path):
    code, d = _check(llama, tmp_path, "--reference", "hf", "--candidate", "hf", "--exact", "--dtype", "float16",
                     expect=0)
    assert d["reference"]["dtype"] == d["candidate"]["dtype"] == "float16"


@pytest.mark.parametrize("args,dtype,source,expect", [
    (("--reference", "hf", "--candidate", "hf"), "float64", "default", 0),  # not --exact: the float64 reference
    # the oracle is float64 under --exact too: a bfloat16 candidate differs from it bitwise
    (("--candidate", "hf", "--exact"), "float64", "default", 1),
    (("--candidate", "hf",), "float64", "default", 0),
    (("--candidate", "hf", "--reference-dtype", "fp32"), "float32", "option:--reference-dtype", 0),
])
def test_elsewhere_the_reference_stays_float64(llama, tmp_path, args, dtype, source, expect):
    _, d = _check(llama, tmp_path, *args, expect=expect)
    assert (d["reference"]["dtype"], d["reference"]["dtype_source"]) == (dtype, source)


def test_the_report_is_schema_valid(llama, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    from parity_cli.resources import schema_path

    _, d = _check(llama, tmp_path, "--reference", "hf", "--candidate", "hf", "--exact", expect=0)
    jsonschema.validate(d, json.loads(schema_path().read_text()))


def test_the_library_resolves_as_the_cli(llama):
    assert CheckOptions().reference_dtype is None
    report = api.check(llama, CheckOptions(reference="hf", candidate="hf", exact=True, strata=["tiny", "normal"]))
    assert report.passed
    assert (report.header["reference"]["dtype"], report.header["reference"]["dtype_source"]) == (
        "bfloat16", "candidate:--exact")
    report = api.check(llama, reference="hf", candidate="hf", exact=True, reference_dtype="float64",
                       strata=["tiny", "normal"])
    assert not report.passed and report.header["reference"]["dtype"] == "float64"


@pytest.mark.parametrize("opts,expected", [
    (dict(), ("float64", "default")),
    (dict(exact=True), ("float64", "default")),
    (dict(reference="hf"), ("float64", "default")),
    (dict(reference="hf", exact=True), ("float16", "candidate:--exact")),
    (dict(reference="plugins.py:Norm", exact=True), ("float16", "candidate:--exact")),
    (dict(reference="hf", exact=True, reference_dtype="torch.float64"), ("float64", "option:--reference-dtype")),
    (dict(reference_dtype="BF16"), ("bfloat16", "option:--reference-dtype")),
])
def test_reference_dtype_for(opts, expected):
    assert reference_dtype_for(CheckOptions(**opts), "float16") == expected
    assert api.is_oracle(CheckOptions(**opts)) == (opts.get("reference", "oracle") == "oracle"
                                                   and expected[0] == "float64")


def test_explain_skips_the_dtype_rung_when_the_reference_runs_at_the_candidate_dtype(llama, tmp_path):
    """Under --exact against hf both sides run at bfloat16: 'the candidate at the reference
    dtype' changes nothing, so it cannot be the factor (it read 'the dtype carries the error')."""
    out = tmp_path / "e.json"
    r = run_parity("check", llama, *FAST, "--reference", "hf", "--candidate", "torch", "--exact", "--explain",
                   "--json", out)
    d = load_json(out)
    if r.returncode == 0:
        pytest.skip("torch's kernel is bitwise hf's here: nothing to explain")
    for group in d["explain"]["groups"]:
        dtype_rungs = [s for s in group["steps"] if s["changes"] == "dtype"]
        assert [s["status"] for s in dtype_rungs] == ["skipped"]
        assert group["conclusion"]["factor"] != "dtype"


def test_the_preflight_and_help(llama):
    preflight.check_inputs(llama, reference="hf", reference_dtype=None)  # None: resolved after the load
    with pytest.raises(InputError, match="--reference-dtype: unknown dtype 'float8'"):
        preflight.check_inputs(llama, reference="hf", reference_dtype="float8")
    r = run_parity("check", "--help")
    text = " ".join(r.stdout.split())
    assert "--reference-dtype" in text and "the candidate's dtype" in text and "[default: float64" in text
