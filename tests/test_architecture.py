"""The layer rules of docs/architecture.md, enforced: imports point only downward, formats are looked up in the
registry, and only the command line turns library errors into exit codes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("compressor", "solvers", "formats", "kernels")


def lint_imports(tmp_path: Path, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """import-linter on a plain copy of the package (pyproject's package-dir mapping assembles it from four
    folders, which the linter cannot follow), with ``extra`` files added to the copy."""
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    pkg = tmp_path / "unionsparse"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, pkg / name, ignore=shutil.ignore_patterns("__pycache__", "*.cu", "*.cuh"))
    for rel, text in (extra or {}).items():
        (pkg / rel).write_text(text)
    return subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=tmp_path, capture_output=True,
                          text=True, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=300)


def test_import_contracts_hold(tmp_path):
    """import-linter's contracts in pyproject.toml (layers; only the CLI imports the CLI)."""
    res = lint_imports(tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "BROKEN" not in res.stdout and "KEPT" in res.stdout


def test_contract_catches_an_upward_import(tmp_path):
    """The contract is live: a formats module importing the compressor breaks it."""
    res = lint_imports(tmp_path, {"formats/upward.py": "from ..compressor import errors  # noqa\n"})
    assert res.returncode != 0 and "unionsparse.formats.upward" in res.stdout


def test_contract_catches_the_runtime_importing_a_compress_stage(tmp_path):
    """The runtime runs an artifact without the compress stages (their shared numerics live in formats/)."""
    res = lint_imports(tmp_path, {"compressor/runtime/upward.py": "from ..quantize import gptq  # noqa\n"})
    assert res.returncode != 0 and "unionsparse.compressor.runtime.upward" in res.stdout


def test_contract_catches_an_import_circle(tmp_path):
    """Two modules of one package importing each other (even inside a function) break the acyclic contract."""
    res = lint_imports(tmp_path, {"compressor/artifact/circle_a.py": "def f():\n    from . import circle_b  # noqa\n",
                                  "compressor/artifact/circle_b.py": "from . import circle_a  # noqa\n"})
    assert res.returncode != 0 and "circle_a" in res.stdout


def test_no_format_name_literals_outside_formats():
    """Above formats/, code asks the registry (capabilities, NAME constants) instead of comparing names."""
    offenders = []
    for top in ("compressor", "solvers", "kernels"):
        for p in (ROOT / top).rglob("*.py"):
            for i, line in enumerate(p.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if re.search(r"[\"'](ie-bme|tiled-cbc)[\"']", code) and "COLORS" not in code:
                    offenders.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_no_format_module_or_matrix_type_above_formats():
    """Above formats/, the compressor asks the registry (``registry.get`` / ``registry.of``, a Format's capabilities
    and ``kernel_ops``) instead of importing a format's module or type-checking its matrix type. The kernel
    benchmarks (``compressor/bench/``) time particular formats' kernels and are exempt; kernels/ and solvers/
    implement particular formats."""
    pattern = re.compile(r"formats(\.|\s+import\s+.*\b)(iebme|tiled_cbc)\b|\b(IEBMEMatrix|TiledCBCMatrix)\b"
                         r"|registry\.Matrix\s*=|\bisinstance\([^)]*Matrix\)")
    offenders = []
    for p in (ROOT / "compressor").rglob("*.py"):
        if p.parent.name == "bench":
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if pattern.search(line.split("#", 1)[0]):
                offenders.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_registry_imports_no_format():
    """Formats register themselves; the registry module knows none of them."""
    text = (ROOT / "formats" / "registry.py").read_text()
    assert not re.search(r"^\s*(from|import)\s+.*\b(iebme|tiled_cbc)\b", text, re.M)


def test_every_library_error_is_a_value_error():
    from unionsparse.compressor.errors import UserError
    from unionsparse.formats import FormatError, UnionsparseError
    from unionsparse.solvers import SolverError

    for cls in (FormatError, SolverError, UserError):
        assert issubclass(cls, UnionsparseError) and issubclass(cls, ValueError)


def test_registry_round_trips_each_format():
    import numpy as np
    from unionsparse.formats import FormatError, registry

    rng = np.random.default_rng(0)
    codes = (rng.integers(-8, 8, (40, 200)) * (rng.random((40, 200)) < 0.4)).astype(np.int8)
    for name in registry.names():
        fmt = registry.get(name)
        m = fmt.encode(codes, bits=4, tile=fmt.default_tile)
        assert registry.of(m) is fmt
        arrays = fmt.to_arrays(m)
        back = fmt.from_arrays(fmt.geometry_attrs(m), lambda k, required, a=arrays: a.get(k))
        assert np.array_equal(back.decode(), codes)
        assert fmt.stats(m)["nnz"] == np.count_nonzero(codes)
    with pytest.raises(FormatError, match="unknown format"):
        registry.get("csr")


def test_a_bug_is_exit_3_with_a_traceback_file(monkeypatch, capsys):
    """An unexpected exception is reported as a bug (exit 3, one line naming the traceback file), not as bad
    input; a library error about a value is exit 2."""
    from unionsparse.compressor import cli
    from unionsparse.solvers import SolverError

    def boom(*_a, **_k):
        raise KeyError("internal inconsistency")

    monkeypatch.setattr("unionsparse.compressor.report.tables.inspect_data", boom)
    with pytest.raises(SystemExit) as e:
        cli.main(["inspect", "whatever.zarr"])
    assert e.value.code == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a bug" in err[0]
    path = Path(err[0].rsplit("traceback in ", 1)[1])
    assert "KeyError" in path.read_text() and "Traceback" in path.read_text()
    path.unlink()

    def bad_value(*_a, **_k):
        raise SolverError("areas 3x3 do not divide the tile 16x64")

    monkeypatch.setattr("unionsparse.compressor.report.tables.inspect_data", bad_value)
    with pytest.raises(SystemExit) as e:
        cli.main(["inspect", "whatever.zarr"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "unionsparse: error: areas 3x3 do not divide the tile 16x64"
