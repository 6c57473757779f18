"""Every repository path the documentation cites exists: in docs/*.md, README.md, BENCHMARKS.md, and in the
docstrings and comments of the library, the benchmarks and the examples. A path is a name under one of the
repository's top folders (``compressor/x.py``, ``kernels/*.cu``, ``benchmarks/results/...``), with ``{a,b}``
alternatives and ``*`` globs expanded; a module path ``unionsparse.pkg.module`` must import as a file or a
package. Paths under ``benchmarks/results/`` name a run's files and may be absent from a checkout only where
they are listed in RESULTS_ELSEWHERE."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP = ("compressor", "formats", "kernels", "solvers", "benchmarks", "docs", "examples", "tests")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP) + r")/[\w./{},*-]*[\w*}])(?![\w./{},*-]*<)")
MODULE = re.compile(r"(?<![\w.])unionsparse\.((?:compressor|formats|kernels|solvers)(?:\.\w+)*)")
PACKAGE_DIRS = {"compressor": "compressor", "formats": "formats", "kernels": "kernels", "solvers": "solvers"}
ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc):`~?(\.*[\w.]+)`")
MARKDOWN = re.compile(r"(?<![\w/.-])([A-Z][A-Z_]{2,}\.md)\b")  # SPEC.md, METHOD.md: a top-level document


def _expand(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in _expand(path[: m.start()] + alt + path[m.end():])]


def _exists(path: str) -> bool:
    path = path.rstrip(".,;:)")
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def _defines(module: Path, name: str) -> bool:
    """``module`` (a .py file) defines or imports ``name`` at some level."""
    text = module.read_text()
    return re.search(rf"(\b(def|class)\s+{name}\b|^\s*{name}\s*[:=]|\bself\.{name}\b|import[^\n]*\b{name}\b"
                     rf"|^\s+{name}\s*:)", text, re.M) is not None


def _resolve(base: Path, parts: list[str]) -> bool:
    """``parts`` name a package, a module or an attribute of a module under the folder ``base``."""
    for i, name in enumerate(parts):
        if (base / name).is_dir():
            base = base / name
            continue
        if (base / f"{name}.py").is_file():
            rest = parts[i + 1:]
            return not rest or _defines(base / f"{name}.py", rest[0])
        init = base / "__init__.py"
        return init.is_file() and _defines(init, name)
    return True


def _module_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    return _resolve(ROOT / PACKAGE_DIRS[parts[0]], parts[1:])


def _role_target_exists(rel: str, target: str) -> bool:
    """A Sphinx role's target in the file ``rel``: ``unionsparse.x.y``, a Python-relative ``.mod.name`` /
    ``..pkg.mod.name`` (one dot: this module's package), or a name of this module."""
    if target.startswith("unionsparse."):
        return target.split(".")[1] not in PACKAGE_DIRS or _module_exists(target.split(".", 1)[1])
    path = ROOT / rel
    if not target.startswith("."):
        return _defines(path, target.split(".")[0]) or _resolve(path.parent, target.split("."))
    dots = len(target) - len(target.lstrip("."))
    base = path.parent
    for _ in range(dots - 1):
        base = base.parent
    return _resolve(base, target.lstrip(".").split("."))


def _doc_texts() -> list[tuple[str, str]]:
    """(where, text) of every markdown file and every docstring / comment of the repository's Python files."""
    out = []
    for p in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "BENCHMARKS.md"]:
        out.append((p.relative_to(ROOT).as_posix(), p.read_text()))
    for top in ("compressor", "formats", "kernels", "solvers", "benchmarks", "examples"):
        for p in sorted((ROOT / top).rglob("*.py")):
            src = p.read_text()
            rel = p.relative_to(ROOT).as_posix()
            for tok in tokenize.generate_tokens(io.StringIO(src).readline):
                if tok.type == tokenize.COMMENT or (
                        tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU").startswith(('"""', "'''"))):
                    out.append((f"{rel}:{tok.start[0]}", tok.string))
        for p in sorted((ROOT / top).rglob("*.cu")):
            out.append((p.relative_to(ROOT).as_posix(), p.read_text()))
    return out


def _missing() -> list[str]:
    missing = []
    for where, text in _doc_texts():
        for cited in PATH.findall(text):
            if cited.startswith("benchmarks/results/"):
                continue  # a run's files: see test_results_cited_in_docs_exist
            if not all(_exists(p) for p in _expand(cited)):
                missing.append(f"{where}: {cited}")
        for dotted in MODULE.findall(text):
            if not _module_exists(dotted):
                missing.append(f"{where}: unionsparse.{dotted}")
        for doc in MARKDOWN.findall(text):
            if not (ROOT / doc).exists() and not (ROOT / "docs" / doc).exists():
                missing.append(f"{where}: {doc}")
        if where.endswith(".md") or where.endswith(".cu"):
            continue
        rel = where.rsplit(":", 1)[0]
        for target in ROLE.findall(text):
            if not _role_target_exists(rel, target):
                missing.append(f"{where}: {target}")
    return missing


def test_every_cited_path_exists():
    missing = _missing()
    assert not missing, "paths cited that do not exist:\n" + "\n".join(missing)


def test_results_cited_in_docs_exist():
    missing = []
    for p in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "BENCHMARKS.md"]:
        for cited in PATH.findall(p.read_text()):
            if cited.startswith("benchmarks/results/") and not all(_exists(q) for q in _expand(cited)):
                missing.append(f"{p.name}: {cited}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("text,ok", [("see `compressor/cli.py`", True), ("see compressor/nowhere.py", False),
                                     ("`kernels/tiled_cbc_spmm.{cu,py}`", True), ("`kernels/*.cu`", True)])
def test_the_scanner_reads_paths(text, ok):
    cited = PATH.findall(text)
    assert cited and all(_exists(p) for c in cited for p in _expand(c)) is ok
