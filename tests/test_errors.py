"""Library code raises the library's error types (docs/architecture.md, "Errors"): a subclass of
``UnionsparseError`` for anything about values, so that the command line reports it in one line. A built-in
exception is raised only where this allowlist says why."""

from __future__ import annotations

import builtins
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("compressor", "solvers", "formats", "kernels")
BUILTIN_ERRORS = {name for name, obj in vars(builtins).items()
                  if isinstance(obj, type) and issubclass(obj, BaseException)}
RAISE = re.compile(r"\braise\s+([A-Za-z_][A-Za-z0-9_]*)\b")

# (file, built-in exception) -> (how many, why it is not a library error)
ALLOWED = {
    ("compressor/artifact/scan.py", "ValueError"):
        (10, "parse_array_meta's reasons; Store.array_meta re-raises them as StoreError with the node's path"),
    ("compressor/model/loading.py", "ValueError"):
        (1, "caught three lines below and reported as a UserError naming the file"),
    ("compressor/model/streaming.py", "KeyError"): (1, "the Mapping protocol of a lazy name -> tensor view"),
    ("formats/arithmetic/linears.py", "NotImplementedError"): (1, "the abstract matmul_2d of RowwiseLinear"),
    ("kernels/cluster_launch.py", "TypeError"):
        (1, "a launcher passed a Python object the driver call cannot take: a bug in the caller"),
    ("compressor/pipeline/encode.py", "TypeError"): (1, "a layer not quantized by the pipeline: a bug"),
    ("compressor/export.py", "OSError"): (1, "an environment fault with its errno, reported by files.py in one line"),
    ("compressor/export.py", "RuntimeError"):
        (5, "export's self-check of compressed-tensors' output against the artifact: a bug if it fires (exit 3)"),
}


def _raises() -> Counter:
    found: Counter = Counter()
    for top in PACKAGES:
        for p in sorted((ROOT / top).rglob("*.py")):
            for line in p.read_text().splitlines():
                for name in RAISE.findall(line.split("#", 1)[0]):
                    if name in BUILTIN_ERRORS:
                        found[(p.relative_to(ROOT).as_posix(), name)] += 1
    return found


def test_built_in_exceptions_only_where_allowed():
    found = _raises()
    unexpected = {k: n for k, n in found.items() if k not in ALLOWED}
    assert not unexpected, f"raise a library error (UserError, FormatError, SolverError, KernelError): {unexpected}"
    stale = {k: (n, found.get(k, 0)) for k, (n, _) in ALLOWED.items() if found.get(k, 0) != n}
    assert not stale, f"allowlist counts (allowed, found) out of date: {stale}"


def test_kernel_error_is_a_library_error():
    from unionsparse.formats import UnionsparseError
    from unionsparse.kernels.errors import KernelError

    assert issubclass(KernelError, UnionsparseError) and issubclass(KernelError, ValueError)


def test_kernels_without_a_gpu_raise_kernel_error(monkeypatch):
    import pytest
    from unionsparse.kernels import loader
    from unionsparse.kernels.errors import KernelError

    monkeypatch.setattr(loader, "cupy_or_none", lambda: None)
    with pytest.raises(KernelError, match="CuPy and a CUDA device"):
        loader.load_module("glue")
