"""Tests that cannot fail (issue 49), found in the source: an AST scan that .ci/run and
tests/test_architecture.py run over tests/.

- `no-assert`: a test function that asserts nothing: no `assert`, no pytest.raises/fail/warns/skip
  (a skip states its reason), and no call to a helper that asserts (a function of tests/ whose body
  holds an assert or one of those, found transitively).
- `pass-or-fail`: an assert that a status or verdict is in a collection holding both "pass" and
  "fail", or an exit code in one holding two of 0, 1 and 2: a test that accepts either outcome.
- `loop-only`: a test whose every assert sits in a for loop, with nothing asserting the loop ran: over
  an empty list it passes having checked nothing.

A test (or an assert line) that says why it is what it is, in a `# weak-ok: <reason>` comment on the line
before or on it, is exempt: the reason is reviewed where it stands.

`python tools/weak_asserts.py [PATH ...]` prints `file:line: kind: test` for each and exits 1 if any."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PYTEST_CHECKS = {"raises", "fail", "warns", "skip", "importorskip", "xfail", "deprecated_call"}
_HELPERS: set[str] = set()  # the asserting helpers of the scan in progress
_LOCALS: set[str] = set()  # names the test in progress binds to a non-empty literal


def _called_name(node: ast.Call) -> str | None:
    f = node.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f.attr
    return None


def _is_pytest_check(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "pytest"
            and node.func.attr in PYTEST_CHECKS)


def _assert_call(node: ast.AST) -> bool:
    """assert_close, assert_array_equal, assert_frame_equal: an assertion library's call."""
    return isinstance(node, ast.Call) and (_called_name(node) or "").startswith("assert")


def _asserts_directly(fn: ast.AST) -> bool:
    return any(isinstance(n, ast.Assert) or _is_pytest_check(n) or isinstance(n, ast.Raise) or _assert_call(n)
               for n in ast.walk(fn))


def _functions(trees: dict) -> dict:
    out: dict = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(node.name, []).append(node)
    return out


def asserting_helpers(trees: dict) -> set[str]:
    """Names of functions in the scanned files that assert, directly or through another such call."""
    funcs = _functions(trees)
    known = {name for name, defs in funcs.items() if any(_asserts_directly(d) for d in defs)}
    changed = True
    while changed:
        changed = False
        for name, defs in funcs.items():
            if name in known:
                continue
            if any(isinstance(n, ast.Call) and _called_name(n) in known for d in defs for n in ast.walk(d)):
                known.add(name)
                changed = True
    return known


def _exit_code(node: ast.AST) -> bool:
    """`r.returncode`, `code`, `exit_code`: what an exit code is called."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name in ("returncode", "code", "exit_code", "status_code")


def _pass_or_fail(node: ast.Assert) -> bool:
    for n in ast.walk(node.test):
        if isinstance(n, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in n.ops):
            for c in n.comparators:
                if isinstance(c, (ast.Tuple, ast.List, ast.Set)):
                    words = {e.value for e in c.elts if isinstance(e, ast.Constant)}
                    if {"pass", "fail"} <= words or {"PASS", "FAIL"} <= words or (
                            _exit_code(n.left) and len({w for w in words if w in (0, 1, 2)}) > 1):
                        return True
    return False


def _never_empty(it: ast.AST) -> bool:
    """A loop's iterable that cannot be empty: a non-empty literal, range(N) with N > 0, a module
    constant (UPPER_CASE) or its entry, a helper's result where the helper asserts (`failing(report)`),
    or enumerate/zip/sorted/reversed/list/tuple of one; `.items()` of a non-empty dict literal."""
    if isinstance(it, (ast.Tuple, ast.List, ast.Set)):
        return bool(it.elts)
    if isinstance(it, ast.Dict):
        return bool(it.keys)
    if isinstance(it, ast.Name):
        return it.id.isupper() or it.id in _LOCALS
    if isinstance(it, ast.Subscript):  # CASES[kind]: a module constant's entry
        return isinstance(it.value, ast.Name) and it.value.id.isupper()
    if isinstance(it, ast.Attribute):
        return it.attr.isupper() or (it.attr in ("items", "keys", "values") and _never_empty(it.value))
    if isinstance(it, ast.Call):
        name = _called_name(it)
        if name in _HELPERS:  # failing(report): a helper that asserts what it returns is not empty
            return True
        if name == "range":
            args = [a.value for a in it.args if isinstance(a, ast.Constant)]
            if len(args) == len(it.args) == 1:
                return args[0] > 0
            if len(args) == len(it.args) >= 2:
                return args[1] > args[0]
            return False
        if name in ("enumerate", "zip", "sorted", "reversed", "list", "tuple", "product") and it.args:
            return all(_never_empty(a) for a in it.args)
        if name in ("items", "keys", "values") and isinstance(it.func, ast.Attribute):
            return _never_empty(it.func.value)
    return False


def _loop_only(fn: ast.AST, helpers: set[str]) -> bool:
    """Every assert (and asserting call) of the test inside a for loop that may run zero times."""
    inside, outside = 0, 0
    _LOCALS.clear()
    for node in ast.walk(fn):  # cases = [...] in the test itself: a loop over it runs
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and isinstance(node.value, (ast.List, ast.Tuple, ast.Set, ast.Dict)) and _never_empty(node.value):
            _LOCALS.add(node.targets[0].id)

    def visit(node, in_loop):
        nonlocal inside, outside
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            looped = in_loop or (isinstance(child, (ast.For, ast.AsyncFor)) and not _never_empty(child.iter))
            counted = isinstance(child, ast.Assert) or _is_pytest_check(child) or _assert_call(child) or (
                isinstance(child, ast.Call) and _called_name(child) in helpers)
            if counted:
                if in_loop:
                    inside += 1
                else:
                    outside += 1
            visit(child, looped)

    for stmt in fn.body:
        if isinstance(stmt, (ast.For, ast.AsyncFor)):
            visit(stmt, not _never_empty(stmt.iter))
        else:
            counted = isinstance(stmt, ast.Assert)
            if counted:
                outside += 1
            visit(stmt, False)
    return inside > 0 and outside == 0


def scan(paths: list[Path]) -> list[tuple[str, int, str, str]]:
    texts = {p: p.read_text() for p in paths}
    trees = {p: ast.parse(text, str(p)) for p, text in texts.items()}

    def excused(path, first: int, last: int) -> bool:
        lines = texts[path].splitlines()
        return any(re.search(r"#\s*weak-ok:\s*\S", lines[k]) for k in range(max(0, first - 4), min(last, len(lines))))
    helpers = asserting_helpers(trees)
    _HELPERS.clear()
    _HELPERS.update(helpers)
    found = []
    for path, tree in trees.items():
        if not path.name.startswith("test_"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert) and _pass_or_fail(node) and not excused(path, node.lineno, node.lineno):
                found.append((str(path), node.lineno, "pass-or-fail", ""))
        for node in tree.body:
            tests = [node] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else (
                [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if isinstance(node, ast.ClassDef) else [])
            for fn in tests:
                if not fn.name.startswith("test") or excused(path, fn.lineno, fn.end_lineno or fn.lineno):
                    continue
                calls = {_called_name(n) for n in ast.walk(fn) if isinstance(n, ast.Call)}
                if not _asserts_directly(fn) and not (calls & helpers):
                    found.append((str(path), fn.lineno, "no-assert", fn.name))
                elif _loop_only(fn, helpers):
                    found.append((str(path), fn.lineno, "loop-only", fn.name))
    return sorted(found)


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent / "tests"
    paths = [Path(a) for a in argv] or sorted(root.rglob("*.py"))
    found = scan(paths)
    for path, line, kind, name in found:
        print(f"{path}:{line}: {kind}: {name}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
