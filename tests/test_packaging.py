"""How the package behaves as installed and as a checkout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_checkout_kernels_folder_does_not_shadow_an_installed_kernels_package(tmp_path):
    """Python run from the checkout's root puts it first on sys.path, where the ``kernels/`` folder would
    shadow an installed top-level ``kernels`` package (Hugging Face's, which transformers >= 5.25 imports:
    ``make grid-verify`` failed with "cannot import name 'CUDAProperties' from 'kernels'"). The folder hands
    the name over to the installed package (and its submodules); without one it stays importable, and
    transformers' Llama config imports from the root either way."""
    root = Path(__file__).resolve().parents[1]
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("MARK = 'installed'\n")
    (site / "kernels" / "layers.py").write_text("NAME = 'layers'\n")
    probe = "import kernels, kernels.layers; print(getattr(kernels, 'MARK', 'ours'), kernels.layers.NAME)"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", probe], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["installed", "layers"], r.stderr
    r = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__file__)"], cwd=root,
                       env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-c", "from transformers import LlamaConfig; print(LlamaConfig().model_type)"],
                       cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("llama"), r.stderr[-2000:]
