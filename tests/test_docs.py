"""Issue 50: a short README that leads into a documentation site by task (docs/, mkdocs.yml; .ci/run
builds it with `mkdocs build --strict`, where a broken internal link fails), every page reachable from
the site's navigation, and what the README quotes from a run is what that run prints."""

import re

from conftest import run_parity
from pages import PAGES, README, ROOT


def _nav_pages() -> set[str]:
    """The .md files mkdocs.yml's nav names (read as text: PyYAML cannot parse mkdocs' own tags)."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").partition("\nnav:\n")[2]
    return set(re.findall(r":\s*([\w/.-]+\.md)\s*$", nav, re.M))


def test_the_readme_is_short():
    assert len(README.splitlines()) <= 200


def test_every_docs_page_is_in_the_navigation_and_every_entry_is_a_page():
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert len(pages) >= 15 and _nav_pages() == pages


def test_every_page_the_readme_links_exists_and_every_task_page_is_linked():
    """A newcomer finds any task from the README in one click."""
    linked = set(re.findall(r"\]\(([^)#\s]+)\)", README))
    local = {link for link in linked if not link.startswith(("http://", "https://"))}
    assert local and all((ROOT / link).is_file() for link in local), sorted(l for l in local if not (ROOT / l).is_file())
    pages = {"docs/" + page for page in _nav_pages() if page not in ("index.md", "coverage.md", "benchmarks.md")}
    assert pages <= local, sorted(pages - local)


def test_a_snippet_included_into_the_docs_exists():
    """Pages that include a file of the repository (DIAGNOSIS.md, the report's schema, the README's Quick
    start on the site's first page) name one that is there, and a section of it that is marked."""
    included = [m for p in (ROOT / "docs").rglob("*.md") for m in re.findall(r'^--8<-- "([^"]+)"', p.read_text(), re.M)]
    files = {name.partition(":")[0] for name in included}
    assert {"DIAGNOSIS.md", "COVERAGE.md", "BENCHMARKS.md", "parity_cli/schema/report.schema.json", "README.md"} <= files
    assert all((ROOT / name).is_file() for name in files)
    for name, _, part in (name.partition(":") for name in included if ":" in name):  # a named section of a file
        text = (ROOT / name).read_text(encoding="utf-8")
        assert f"--8<-- [start:{part}]" in text and f"--8<-- [end:{part}]" in text, (name, part)


def test_the_verdict_the_readme_quotes_is_the_demos():
    quoted = re.findall(r"`((?:PASS|FAIL): [^`]+)`", README)
    assert quoted
    r = run_parity("demo")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert all(q in lines for q in quoted), (quoted, [line for line in lines if line.startswith(("PASS", "FAIL"))])


# options the pages name that belong to the other tools they show
OTHER_TOOLS = {"--index-url": "pip", "--no-deps": "pip", "--lf": "pytest", "--strict": "mkdocs build",
               "--hf-path": "mlx_lm.convert", "--mlx-path": "mlx_lm.convert", "--model": "ct2-transformers-converter",
               "--output_dir": "ct2-transformers-converter",
               "--tier": "this repository's tests/conftest.py", "--python": "tools/optimum_intel_fixture.py"}  # the ORT GenAI builder's are single-letter


def _parity_options() -> set[str]:
    """Every long option of every parity command (click's own declarations), --help, and the pytest
    plugin's."""
    import click

    from parity_cli.cli import cli

    found, commands = {"--help"}, [cli]
    while commands:
        command = commands.pop()
        found.update(o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--"))
        commands.extend(command.commands.values() if isinstance(command, click.Group) else ())
    plugin = (ROOT / "parity_cli" / "testing" / "plugin.py").read_text(encoding="utf-8")
    return found | set(re.findall(r'addoption\("(--[a-z-]+)"', plugin))


def test_every_option_a_page_names_is_one_the_cli_has():
    """An option renamed or removed in the code cannot live on in the prose."""
    options = _parity_options()
    named = {m: page for page, text in PAGES.items() if not page.startswith("docs/reference/")
             for m in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)}
    assert "--candidate" in named and "--parity-strata" in named
    unknown = {o: page for o, page in named.items() if o not in options and o not in OTHER_TOOLS}
    assert not unknown, unknown


def test_no_page_writes_out_a_commands_options():
    """A command's options are described once, by click, on the CLI reference: a synopsis written out
    by hand (`parity fused CKPT [--dtype D] ...`) is a second copy that drifts."""
    synopses = {page: m for page, text in PAGES.items() if not page.startswith("docs/reference/")
                for m in re.findall(r"`parity [a-z]+ [^`]*\[--[^`]*`", text)}
    assert not synopses, synopses
