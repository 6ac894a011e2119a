"""The README's commands are the ones that work: Quick start is two one-line sh commands that
run verbatim on a fresh venv, .ci/run runs the second word for word, extras named in install
lines exist, every `parity SUBCOMMAND` is real, and the pass rule states its formula and the
tolerance profile it ships with."""

import re
import shlex
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from pages import DOCS, FENCE, README, ROOT, fenced

PASS_RULE = DOCS["docs/pass-rule.md"]


def section(title: str) -> str:
    """The body of the level-2 section `## title`, up to the next level-2 heading (headings
    inside fenced blocks do not count)."""
    body = FENCE.sub(lambda m: "\0" * len(m.group(0)), README)  # same offsets, no fences
    starts = [m.start() for m in re.finditer(r"^## ", body, re.M)]
    head = re.search(rf"^## {re.escape(title)}[ \t]*$", body, re.M)
    assert head, f"README has no '## {title}' section"
    end = min((s for s in starts if s > head.start()), default=len(README))
    return README[head.end():end]


def steps(command: str) -> list[list[str]]:
    """A one-line `a && b && c` as its words per step, shell quoting removed, `--quiet` (which
    changes nothing that is run) dropped."""
    return [[w for w in shlex.split(part) if w != "--quiet"] for part in command.split("&&")]


def quick_start() -> list[str]:
    blocks = fenced(section("Quick start"))
    assert [lang for lang, _ in blocks] == ["sh", "sh"], blocks
    commands = []
    for _, body in blocks:
        lines = [line for line in body.splitlines() if line.strip()]
        assert len(lines) == 1, f"a Quick start block must be one command line: {body!r}"
        assert not lines[0].rstrip().endswith("\\")
        commands.append(lines[0].strip())
    return commands


def ci_steps() -> list[list[str]]:
    """The commands .ci/run executes: comments, blank lines, `set` and `cd` left out; a
    continued line joined; `a && b` split."""
    text = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or re.match(r"(set|cd)\b", line):
            continue
        out += steps(line)
    return out


def torch_pin(step: list[str]) -> str:
    assert step[:4] == ["python", "-m", "pip", "install"], step
    pins = [w for w in step[4:] if w.startswith("torch==")]
    assert len(pins) == 1, step
    return pins[0]


def test_quick_start_is_two_one_line_sh_commands():
    assert len(quick_start()) == 2


def test_quick_start_demo_command():
    demo = steps(quick_start()[0])
    assert torch_pin(demo[0]) == "torch==2.13.0"
    assert torch_pin(demo[0]) == torch_pin(ci_steps()[0])  # the same pin as CI
    assert ["python", "-m", "pip", "install", "."] in demo[1:-1]
    assert demo[-1] == ["parity", "demo"]


def test_quick_start_test_command():
    test = steps(quick_start()[1])
    assert torch_pin(test[0]) == "torch==2.13.0"
    assert ["python", "-m", "pip", "install", "-e", ".[test]", "-c", "constraints/test.txt"] in test[1:-1]
    assert test[-1] == ["python", "-m", "pytest", "-q"]


def _lock() -> dict:
    pins = {}
    for line in (ROOT / "constraints" / "test.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.strip().partition("==")
            assert version and not any(c in version for c in "<>=!~*"), f"not an exact pin: {line}"
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_the_lock_pins_every_package_of_the_test_extra_exactly():
    """Issue 34: the test command installs from the lock, which pins the whole test extra (and what it
    pulls in) to one version each; the package's own ranges stay open for users."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _lock()
    for requirement in project["optional-dependencies"]["test"] + project["dependencies"]:
        name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        if "python_version < '3.11'" in requirement:
            continue
        assert name in pins, f"{name} is not in constraints/test.txt"
    assert pins["torch"] == torch_pin(steps(quick_start()[1])[0]).split("==")[1]  # the README's torch pin
    for requirement in project["dependencies"] + project["optional-dependencies"]["transformers"]:
        assert not re.search(r"==", requirement), f"a user-facing range is pinned: {requirement}"


def test_quick_start_states_how_long_the_tests_take():
    """A newcomer knows what to expect before running them: a time, next to the test command."""
    text = section("Quick start")
    after = text[text.index("python -m pytest -q"):]
    assert re.search(r"\btake about [\d.]+ minutes\b.*\(\d+ s measured", after, re.S), after[:400]


# what .ci/run adds after the README's test command: the tests it leaves out (`--tier slow`, issue 49:
# every test runs in CI, the default run stays within its time), then the architecture and lint checks,
# which the tests also run (tests/test_architecture.py), so a README user misses nothing
SLOW_STEPS = [["python", "-m", "pytest", "-q", "--tier", "slow"]]
LINT_STEPS = [["lint-imports"], ["ruff", "check", "."], ["python", "tools/weak_asserts.py"]]
# then the documentation site (issue 50), built strict with the docs extra
DOCS_STEPS = [["python", "-m", "pip", "install", "-e", ".[docs]", "-c", "constraints/test.txt", "-c", "constraints/docs.txt"],
              ["mkdocs", "build", "--strict", "--site-dir", "site"]]


def test_ci_runs_the_readme_test_command():
    readme = steps(quick_start()[1])
    assert ci_steps()[:len(readme)] == readme
    assert ci_steps()[len(readme):] == SLOW_STEPS + LINT_STEPS + DOCS_STEPS


def test_ci_run_is_executable_bash():
    run = ROOT / ".ci" / "run"
    assert run.read_text().startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in run.read_text()


def code_spans() -> list[str]:
    """Every fenced block and inline code span of the README and the docs pages (inline spans may
    wrap a line)."""
    out = []
    for text in (README, *DOCS.values()):
        out += [body for _, body in fenced(text)] + re.findall(r"`([^`]+)`", FENCE.sub("", text))
    return out


def test_every_extra_in_an_install_line_exists():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = []
    for span in code_spans():
        if "pip install" not in span:
            continue
        for group in re.findall(r"\[([A-Za-z0-9_.,\s-]+)\]", span):
            named += [name.strip() for name in group.split(",")]
    assert named, "no extra named in the README's install lines"
    assert "test" in named and "plot" in named
    assert not [name for name in named if name not in extras], (named, sorted(extras))


def test_no_install_line_needs_the_package_on_an_index():
    """parity-cli is not on an index: extras are installed from a checkout (`-e '.[x]'`)."""
    assert "parity-cli[" not in README
    for span in code_spans():
        for line in span.splitlines():
            if "pip install" in line:
                assert "parity-cli" not in line and "parity_cli" not in line, line


def test_no_reference_to_the_brief():
    for text in (README, *DOCS.values()):
        assert not re.search(r"\bBRIEF\b", text)


def test_every_parity_subcommand_named_is_real():
    import click

    from parity_cli.cli import cli

    assert isinstance(cli, click.Group)
    real = set(cli.list_commands(click.Context(cli)))  # a lazily loading group lists them too
    # `parity WORD` where parity is a word of its own (not parity_cli, not a path); an inline
    # span may wrap between the two words, a line of a fenced block may not
    word = r"(?:^|(?<=[\s;&|(]))parity{gap}+([A-Za-z][\w-]*)"
    named = set()
    for text in (README, *DOCS.values()):
        for _, body in fenced(text):
            named.update(re.findall(word.format(gap=r"[ \t]"), body, re.M))
        for span in re.findall(r"`([^`]+)`", FENCE.sub("", text)):
            named.update(re.findall(word.format(gap=r"\s"), span, re.M))
    assert {"check", "demo", "inspect", "runtimes", "capture"} <= named, named  # the parser sees the usual ones
    assert named <= real, f"the README or docs name parity subcommands that do not exist: {sorted(named - real)}"


def normalise(text: str) -> str:
    text = " ".join(text.split())
    for a, b in (("−", "-"), ("≤", "<="), ("·", "*"), ("×", "*")):
        text = text.replace(a, b)
    return text.replace(" ", "")


def test_pass_rule_states_the_formula_and_the_shipped_tolerances():
    rule = PASS_RULE
    assert "|cand-ref|<=atol+rtol*|ref|" in normalise(section("Reading the verdict"))  # the README says it too
    assert "|cand-ref|<=atol+rtol*|ref|" in normalise(rule)
    assert "--max-violation-fraction" in rule
    assert "configs/tolerances.toml" in rule
    profiles = tomllib.loads((ROOT / "configs" / "tolerances.toml").read_text())
    rows = {m.group(1): (float(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^\s*\|\s*(\w+)\s*\|\s*([\d.e+-]+)\s*\|\s*([\d.e+-]+)\s*\|\s*$", rule, re.M)}
    assert rows == {dtype: (p["atol"], p["rtol"]) for dtype, p in profiles.items()}


def test_pass_rule_default_violation_fraction_is_the_cli_default():
    import click

    from parity_cli.cli import cli

    check = cli.get_command(click.Context(cli), "check")
    option = next(p for p in check.params if p.name == "max_violation_fraction")
    assert option.default == 0
    assert "(default 0" in PASS_RULE


@pytest.mark.parametrize("title", ["Quick start", "First commands", "Reading the verdict", "Documentation"])
def test_sections_exist(title):
    assert section(title).strip()
