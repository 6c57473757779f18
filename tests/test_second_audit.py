"""The second hostile audit (issue 40): nothing lost, nothing used that verify rejects.

Overwrite never deletes a user's file inside an artifact; generate, export, eval and bench refuse an artifact whose
files differ from its manifest (``--no-verify`` says it skips that); two writers to one output: one wins, the other
is one line and exit 2; full or read-only file systems are one line and leave nothing half-written; identical
inputs give identical manifests; compressed-tensors exports pack layers whose K the group size does not divide."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

FAST = ("--quiet", "--reorder", "none")
CLI = Path(sys.executable).parent / "unionsparse"
Q, O = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"


def refused(r, *needles: str) -> str:
    """Exit 2, exactly one line on stderr holding every needle, no traceback."""
    assert r.code == 2, (r.code, r.out, r.err)
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.out + r.err, r.err
    assert "internal error" not in lines[0], lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def art(tmp_path_factory, llama_with_tokenizer) -> Path:
    """A W4A4 IE-BME artifact of the tiny LLaMA with its tokenizer stored (generate and eval need one)."""
    from unionsparse.compressor.cli import main

    out = tmp_path_factory.mktemp("audit2") / "a.zarr"
    with pytest.raises(SystemExit) as e:
        main(["compress", str(llama_with_tokenizer[0]), "-o", str(out), *FAST])
    assert e.value.code == 0
    return out


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("audit2_text") / "eval.txt"
    p.write_text("the model weights of the sparse kernel\n" * 40)
    return p


# ------------------------------------------------------------------ 1. overwrite and files inside an artifact


@pytest.mark.parametrize("where,named", [("layers/notes.txt", None), (f"layers/{Q}/notes.txt", None),
                                         ("dense/mine/data.bin", "dense/mine"),  # a folder that is no zarr node
                                         (f"layers/{Q}/values/c/notes.txt", None),
                                         (f"layers/{Q}/values/c/9", None)])  # named like a chunk: not in the manifest
def test_overwrite_keeps_a_user_file_inside_the_artifact(where, named, art, tmp_path, llama_with_tokenizer,
                                                          run_cli):
    out = tmp_path / "mine.zarr"
    shutil.copytree(art, out)
    (out / where).parent.mkdir(parents=True, exist_ok=True)
    (out / where).write_text("my thesis")
    before = snapshot(out)
    r = run_cli("compress", llama_with_tokenizer[0], "-o", out, *FAST, "--overwrite")
    refused(r, str(out), named or where)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.zarr"]
