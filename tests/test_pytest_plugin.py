"""The pytest plugin of parity_cli.testing (issue 28): registered through the `pytest11` entry point,
opt-in, a `norm_parity` fixture bound to the test's parameters, `--parity-strata`, `--parity-dtypes`,
the norm_cases() parametrisation over families x dtypes x sizes, and failures that read as the CLI's
finding while -x and --lf behave as pytest's. The plugin's own behaviour runs in pytester sessions;
the kernel library's suite over every case runs here, through the fixture, as a library would."""

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from kernel_examples import fused_norms as k

from parity_cli.testing import NormCase, norm_cases

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent

# the family defaults of the brief's table (section 5): what each case is checked at
FAMILY_EPS = {"llama": 1e-6, "gemma": 1e-6, "olmo2": 1e-5, "cohere": 1e-5, "t5": 1e-6, "layer_norm": 1e-5}


# --- a kernel library's suite: 6 families x 3 dtypes through the fixture ---------------------------------


@pytest.mark.parametrize("case", norm_cases())
def test_fused_kernels_hold_parity_on_every_case(case, norm_parity):
    result = norm_parity(k.FAMILY_KERNELS[case.family])
    t = result.to_dict()["testing"]
    assert (t["family"], t["dtype"], t["eps"]) == (case.family, case.dtype, FAMILY_EPS[case.family])
    assert t["weight"] == "random"


def test_norm_cases_cover_families_dtypes_and_sizes():
    params = norm_cases()
    cases = [p.values[0] for p in params]
    assert all(isinstance(c, NormCase) for c in cases)
    assert len(cases) == 18 and len({p.id for p in params}) == 18
    assert {c.family for c in cases} == set(FAMILY_EPS)
    assert {c.dtype for c in cases} == {"bfloat16", "float16", "float32"}
    assert all(c.eps == FAMILY_EPS[c.family] for c in cases)
    cohere = [c for c in cases if c.family == "cohere"]
    assert all((c.heads, c.hidden_size) == (4096 // 128, 128) for c in cohere)  # per-head q/k norms
    assert all(c.heads is None and c.hidden_size == 4096 for c in cases if c.family != "cohere")
    ids = [p.id for p in norm_cases(families=["gemma"], dtypes=["bf16", "float32"], hidden_sizes=[256, 1024])]
    assert ids == ["gemma-bf16-h256", "gemma-fp32-h256", "gemma-bf16-h1024", "gemma-fp32-h1024"]
    with pytest.raises(ValueError, match="^family: unknown family"):
        norm_cases(families=["nonexistent"])
    with pytest.raises(ValueError, match="^dtype: "):
        norm_cases(dtypes=["float8"])


# --- registration: the entry point, opt-in, no torch at start-up ------------------------------------------


def test_registered_through_the_pytest11_entry_point(pytestconfig):
    found = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert found.get("parity") == "parity_cli.testing.plugin"
    assert pytestconfig.pluginmanager.hasplugin("parity")


def test_importing_the_plugin_imports_no_torch():
    """What pytest imports at start-up is the plugin module alone: no torch, not even the API module (its
    names load on first use); the API module itself imports no torch either."""
    code = ("import sys, parity_cli.testing.plugin; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m == 'parity_cli.testing.api')); "
            "from parity_cli.testing import assert_norm_parity; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["[]", "[]"]


def test_a_project_that_does_not_use_it_pays_no_torch_import(pytester):
    """A fresh pytest process (the plugin loaded by its entry point, as in any project with parity-cli
    installed): a plain test sees no torch in sys.modules, and the plugin is there."""
    pytester.makepyfile(test_plain="""
        import sys

        def test_plain(pytestconfig):
            assert pytestconfig.pluginmanager.hasplugin("parity")
            assert "torch" not in sys.modules
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    off = pytester.runpytest_subprocess("-p", "no:parity", "--parity-strata=tiny")
    assert off.ret == pytest.ExitCode.USAGE_ERROR  # -p no:parity leaves it out: its options are unknown


# --- behaviour in a session -------------------------------------------------------------------------------------

LIBRARY = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})

import pytest
from kernel_examples import fused_norms as k
from parity_cli.testing import norm_cases

# the library's per-family configuration, with gemma served without its offset (the planted fault)
KERNELS = dict(k.FAMILY_KERNELS, gemma=k.gemma_rms_norm_without_offset)


@pytest.mark.parametrize("case", norm_cases(hidden_sizes=(256,)))
def test_kernel(case, norm_parity):
    norm_parity(KERNELS[case.family])
"""


def test_a_failure_reads_as_the_finding(pytester, monkeypatch):
    """18 cases: gemma's 3 fail, the rest pass. Each failure is the finding (code, cause, strata, q/eps, worst
    element), raised at the test's own line: no frame of parity's, no tensor printed, no rewritten assert."""
    monkeypatch.setenv("COLUMNS", "240")  # the short summary line whole
    pytester.makepyfile(test_lib=LIBRARY)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=15, failed=3)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["*FAILED test_lib.py::test_kernel[[]gemma-bf16-h256[]] - AssertionError: "
                                 "weight_offset_mismatch (the +1 is missing (gain w))*"])
    result.stdout.fnmatch_lines(["E *AssertionError: weight_offset_mismatch*", "E *checked: gemma RMSNorm (gain 1 + w*",
                                 "E *strata * q/eps *", "E *worst gemma:rms_norm[[]256[]] * allowed*"])
    assert out.count("norm_parity(KERNELS[case.family])") == 3  # the test's own line, once per failure
    assert "tensor(" not in out and "parity_cli/testing" not in out and "parity_cli/check" not in out
    assert "where " not in out  # assertion rewriting's "where x = ..." explanation


def test_exitfirst_and_last_failed(pytester):
    """-x stops at the first failure (the 3 llama cases ran before it); --lf reruns just the 3 that failed."""
    pytester.makepyfile(test_lib=LIBRARY)
    first = pytester.runpytest("-x")
    first.assert_outcomes(passed=3, failed=1)
    full = pytester.runpytest()
    full.assert_outcomes(passed=15, failed=3)
    again = pytester.runpytest("--lf")
    again.assert_outcomes(failed=3)
    again.stdout.fnmatch_lines(["*run-last-failure: rerun previous 3 failures*"])


def test_parity_dtypes_deselects_other_dtypes(pytester):
    pytester.makepyfile(test_lib=LIBRARY)
    result = pytester.runpytest("--parity-dtypes=bf16", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=5, failed=1, deselected=12)
    result.stdout.fnmatch_lines(["parity: --parity-dtypes=bf16"])
    two = pytester.runpytest("--parity-dtypes=float16,float32", "-p", "no:cacheprovider")
    two.assert_outcomes(passed=10, failed=2, deselected=6)
    bad = pytester.runpytest("--parity-dtypes=float8", "-p", "no:cacheprovider")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--parity-dtypes: 'float8' is not a dtype*"])


def test_parity_strata_sets_the_probes(pytester):
    """--parity-strata is what every fixture call probes: eps hard-coded at 1e-5 for a model with 1e-6 cannot
    show on normal and large rows (q/eps >= 1e6 there), so it passes on those alone and fails with tiny."""
    pytester.makepyfile(test_strata=f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from kernel_examples import fused_norms as k

        def test_eps(norm_parity):
            result = norm_parity(k.rms_norm_eps_1e5, family="llama", hidden_size=256, eps=1e-6, dtype="bfloat16")
            assert result.to_dict()["probes"]["strata"] == ["normal", "large"]
    """)
    pytester.runpytest("--parity-strata=normal,large", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    failing = pytester.runpytest("--parity-strata=normal,tiny", "-p", "no:cacheprovider")
    failing.assert_outcomes(failed=1)
    failing.stdout.fnmatch_lines(["*AssertionError: eps_mismatch (behaves as eps ≈ 1e-5, configured 1e-6)*"])
    bad = pytester.runpytest("--parity-strata=tinny", "-p", "no:cacheprovider")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--parity-strata: unknown stratum 'tinny'*"])


def test_marker_and_named_parameters_bind_the_fixture(pytester):
    """The marker's keywords are the defaults (module, class, then the test: the closest wins); parameters
    named like assert_norm_parity's keywords and the call's own overrides win over them."""
    pytester.makepyfile(test_bound=f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        import pytest
        from kernel_examples import fused_norms as k

        pytestmark = pytest.mark.norm_parity(family="llama", hidden_size=256, eps=1e-6, dtype="float32")

        @pytest.mark.norm_parity(family="gemma")
        class TestGemma:
            @pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
            def test_offset(self, norm_parity, dtype):
                result = norm_parity(k.FAMILY_KERNELS["gemma"])
                t = result.to_dict()["testing"]
                assert (t["family"], t["dtype"], t["hidden_size"], t["eps"]) == ("gemma", dtype, 256, 1e-6)

        def test_module_default(norm_parity):
            assert norm_parity.kwargs["family"] == "llama"
            assert norm_parity(k.fused_rms_norm, hidden_size=512).to_dict()["testing"]["hidden_size"] == 512

        def test_check_does_not_raise(norm_parity):
            result = norm_parity.check(k.rms_norm_eps_1e5)
            assert not result and "eps_mismatch" in repr(result)

        @pytest.mark.norm_parity(hidden=256)
        def test_wrong_keyword(norm_parity):
            pass
    """)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(["*@pytest.mark.norm_parity takes keyword arguments of assert_norm_parity*hidden*"])


def test_opt_in_nothing_happens_without_the_fixture(pytester):
    """A session whose tests use neither the fixture nor the marker: no option given, no header line, no
    deselection, the tests run as they are."""
    pytester.makepyfile(test_plain="""
        import pytest

        @pytest.mark.parametrize("n", [1, 2, 3])
        def test_plain(n):
            assert n > 0
    """)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    assert not [line for line in result.stdout.lines if line.startswith("parity")]  # no header line
    result = pytester.runpytest("--parity-dtypes=bfloat16", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)  # only norm_cases() parameters are ever deselected
