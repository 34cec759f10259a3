"""Every third-party module that pagefleet, its tests and its benchmarks import is declared in
pyproject.toml: in `dependencies` or one of the extras. A module that only arrives as some other
package's dependency works on the machine it was written on and breaks a fresh install when that
package's next release drops it (httpx once came with openai, until openai moved to httpx2).

The imports are read from the source (every `import` and `from ... import` anywhere in a file,
guarded or not), mapped to the distributions installed here that provide them, and checked
against the names pyproject.toml declares."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("pagefleet", "kernels", "worker", "cluster", "router", "protos", "tests", "benchmarks")
FIRST_PARTY = set(SCANNED)


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_distributions(pyproject: Path = ROOT / "pyproject.toml") -> set[str]:
    """The distribution names pyproject.toml declares, runtime and every extra, normalized."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {_normal(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r).group()) for r in requirements}


def imported_modules(paths: list[Path]) -> dict[str, set[str]]:
    """Top-level module name -> the files (relative to the root) that import it, leaving out the
    standard library, the project's own packages and modules beside the importing file (the
    tests' helpers, imported by their bare names)."""
    found: dict[str, set[str]] = {}
    for path in paths:
        local = {p.stem for p in path.parent.glob("*.py")} | {
            p.name for p in path.parent.iterdir() if (p / "__init__.py").exists()
        }
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in FIRST_PARTY or top in local:
                    continue
                shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                found.setdefault(top, set()).add(str(shown))
    return found


def undeclared(paths: list[Path], declared: set[str]) -> list[str]:
    """One line per imported module that no declared distribution provides."""
    providers = importlib.metadata.packages_distributions()
    problems = []
    for module, files in sorted(imported_modules(paths).items()):
        dists = {_normal(d) for d in providers.get(module, [])}
        where = ", ".join(sorted(files)[:3])
        if not dists:
            problems.append(f"{module}: imported ({where}) but installed by no package")
        elif not dists & declared:
            problems.append(
                f"{module}: imported ({where}) from {', '.join(sorted(dists))}, which pyproject.toml does not declare"
            )
    return problems


def _sources() -> list[Path]:
    return sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))


def test_every_imported_module_is_declared():
    problems = undeclared(_sources(), declared_distributions())
    assert not problems, "undeclared imports:\n" + "\n".join(problems)


def test_an_undeclared_import_is_found(tmp_path):
    """The check itself: a file importing a module that only a transitive dependency brings
    (attrs, through ray and hypothesis), or no installed package at all, is reported; removing
    the declaration of one that is declared makes it undeclared."""
    (tmp_path / "helper.py").write_text("")
    source = tmp_path / "uses.py"
    source.write_text(
        "import helper\nimport json\nimport numpy\n"
        "def f():\n    import attr\n    from no_such_module_anywhere import x\n"
    )
    problems = undeclared([source], declared_distributions())
    without_numpy = undeclared([source], declared_distributions() - {"numpy"})
    assert [p.split(":")[0] for p in problems] == ["attr", "no_such_module_anywhere"]
    assert "numpy" in [p.split(":")[0] for p in without_numpy]
