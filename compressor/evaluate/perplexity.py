"""WikiText-2-style perplexity, computed as the Wanda / SparseGPT reference ``eval_ppl`` does.

Text: every line of the file is one row of the data set (CRLF or LF, normalised to ``\\n``, kept at
the row's end as in the Hugging Face ``wikitext`` rows); rows are joined with ``"\\n\\n"`` and
tokenized once. Windows: non-overlapping ``seqlen`` tokens from the start, the remainder dropped.
Each window's loss is the mean next-token NLL over its ``seqlen - 1`` predictions; the perplexity is
``exp(mean over windows)`` (the reference's ``sum(loss·seqlen) / (nsamples·seqlen)``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError

log = logging.getLogger(__name__)

__all__ = ["load_eval_text", "tokenize_eval_text", "perplexity", "window_nlls"]


def load_eval_text(text_path: str | Path) -> str:
    """The evaluation text of ``text_path``: its lines (line ends normalised) joined with ``"\\n\\n"``."""
    from ..preflight import read_user_text

    raw = read_user_text("--text", text_path)
    rows = raw.replace("\r\n", "\n").replace("\r", "\n").splitlines(keepends=True)
    rows = [r if r.endswith("\n") else r + "\n" for r in rows if r.strip()]
    if not rows:
        raise UserError(f"--text {text_path}: file holds no text")
    return "\n\n".join(rows)


def tokenize_eval_text(tokenizer, text: str) -> torch.Tensor:
    """Token ids ``[1, L]`` of the whole text, tokenized once (default special tokens)."""
    return torch.tensor([tokenizer(text, verbose=False)["input_ids"]], dtype=torch.long)


@torch.no_grad()
def window_nlls(
    model: nn.Module,
    ids: torch.Tensor,
    seqlen: int = 2048,
    max_windows: int | None = None,
    device: str | torch.device | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[float]:
    """Mean next-token NLL (nats) of each non-overlapping ``seqlen`` window of ``ids [1, L]``; ``progress(n)`` is
    called once with the number of windows, then with 0 after each one (a progress bar's total, then advances)."""
    if seqlen < 2:
        raise UserError(f"--seqlen must be >= 2, got {seqlen}")
    n = ids.numel() // seqlen
    if n == 0:
        raise UserError(f"evaluation text has {ids.numel()} tokens, fewer than --seqlen {seqlen}")
    if max_windows is not None:
        if max_windows < 1:
            raise UserError(f"--max-windows must be >= 1, got {max_windows}")
        n = min(n, max_windows)
    if device is None:
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    if progress is not None:
        progress(n)
    out = []
    try:
        for i in range(n):
            x = ids[:, i * seqlen : (i + 1) * seqlen].to(device)
            logits = model(x, use_cache=False).logits
            loss = nn.functional.cross_entropy(logits[0, :-1, :].float(), x[0, 1:], reduction="mean")
            out.append(float(loss))
            if progress is not None:
                progress(0)
    finally:
        model.train(was_training)
    return out


def perplexity(
    model: nn.Module,
    tokenizer,
    text_path: str | Path,
    seqlen: int = 2048,
    max_windows: int | None = None,
    device: str | torch.device | None = None,
) -> float:
    """WikiText-2-style perplexity of ``model`` on ``text_path`` (see the module docstring)."""
    ids = tokenize_eval_text(tokenizer, load_eval_text(text_path))
    nlls = window_nlls(model, ids, seqlen, max_windows, device)
    ppl = math.exp(sum(nlls) / len(nlls))
    log.info("perplexity %.4f over %d windows of %d tokens", ppl, len(nlls), seqlen)
    return ppl


def is_artifact(source) -> bool:
    """True when ``source`` is an open Artifact or a zarr directory store (an artifact rather than a model)."""
    from ..artifact.store import Artifact

    if isinstance(source, Artifact):
        return True
    p = Path(source)
    return p.is_dir() and (p / "zarr.json").is_file()


def source_name(source) -> str:
    """The path of MODEL or of an artifact (open or not), as the results name it."""
    from ..artifact.store import Artifact

    return str(source.path) if isinstance(source, Artifact) else str(source)


def open_artifact(source, verify: bool = True):
    """``source`` itself when it is an open Artifact (a command opens its artifact once), else opened here."""
    from ..artifact.store import Artifact

    return source if isinstance(source, Artifact) else Artifact(source, verify=verify)


def load_artifact_tokenizer(art, tokenizer: str | Path | None = None):
    """The tokenizer for an artifact: ``tokenizer`` when given, else the one stored in the artifact.

    Never the source model the artifact names: what an artifact says must not make eval read another
    file or reach the network (UserError when there is neither).
    """
    from ..calibrate.layerwise import load_tokenizer

    if tokenizer is not None:
        return load_tokenizer(str(tokenizer), flag="--tokenizer", purpose="")
    from ..artifact.tokenizer import has_tokenizer
    from ..artifact.tokenizer import load_tokenizer as stored_tokenizer

    if not has_tokenizer(art):
        raise UserError(f"{art.path}: the artifact stores no tokenizer; pass --tokenizer (the source model's "
                        "folder, .gguf file or tokenizer folder)")
    return stored_tokenizer(art)


def load_for_eval(source: str | Path, dtype: torch.dtype = torch.float32, dynamic_pruning: bool = True,
                  tokenizer: str | Path | None = None, verify: bool = True):
    """``(model, tokenizer, kind)`` for MODEL (folder, .gguf, hub id) or an artifact (rebuilt).

    An artifact's tokenizer is ``tokenizer`` or the one stored in it (:func:`load_artifact_tokenizer`);
    MODEL's is its own unless ``tokenizer`` is given. Tiled-CBC layers compute the decode kernel's
    arithmetic, every token with the layer's stored dynamic-pruning threshold unless ``dynamic_pruning``
    is False (:mod:`unionsparse.formats.arithmetic.sparse_inputs`). ``verify``: an artifact's files are checked
    against its manifest as they are read (``--no-verify``: not).
    """
    from ..calibrate.layerwise import load_tokenizer

    if is_artifact(source):
        from ..model.rebuild import rebuild_model

        art = open_artifact(source, verify)
        tok = load_artifact_tokenizer(art, tokenizer)  # before the slow rebuild
        model = rebuild_model(art, dynamic_pruning=dynamic_pruning)
        return model.eval(), tok, "artifact"
    from ..model.loading import load_model

    tok = load_tokenizer(str(tokenizer if tokenizer is not None else source),
                         flag="--tokenizer" if tokenizer is not None else "MODEL", purpose="")
    loaded = load_model(str(source), dtype=dtype)
    return loaded.model.eval(), tok, loaded.kind


def load_artifact_on_gpu(source: str | Path, dynamic_pruning: bool = True, tokenizer: str | Path | None = None,
                         verify: bool = True):
    """``(model, tokenizer, "artifact")``: the artifact's compressed linears as ``generate --device cuda`` runs them
    (its CuPy kernels, fused Q/K/V and gate/up), with float32 dense parts as the CPU path's eval has, so that a
    perplexity does not depend on the device (W4A4 moves by about 1% between float16 and float32 dense parts on
    SmolLM2), and the stored thresholds applied to every token as the CPU path's eval does (docs/runtime.md,
    "Evaluating on a GPU")."""
    from ..runtime.cuda import require_cuda
    from ..runtime.model import build_model, thresholds_on_every_row

    require_cuda()
    art = open_artifact(source, verify)
    tok = load_artifact_tokenizer(art, tokenizer)  # before the slow build
    model = build_model(art, "cuda", "cuda", dtype=torch.float32, dynamic_pruning=dynamic_pruning, fuse=True)
    return thresholds_on_every_row(model), tok, "artifact"


def evaluate_source(
    source: str | Path,
    text_path: str | Path,
    seqlen: int = 2048,
    max_windows: int | None = None,
    device: str = "cpu",
    dynamic_pruning: bool = True,
    tokenizer: str | Path | None = None,
    verify: bool = True,
    quiet: bool = False,
) -> dict:
    """Perplexity of MODEL or an artifact on ``text_path``; returns a dict for the CLI (and ``--json``).

    ``dynamic_pruning``: a Tiled-CBC artifact's thresholds are applied to every token (see
    :mod:`unionsparse.formats.arithmetic.sparse_inputs`); the result's ``dynamic_pruning`` then gives the
    fraction of weight reads skipped.
    ``tokenizer``: a model folder, .gguf file, tokenizer folder or hub id to tokenize with (an artifact
    without a stored tokenizer needs it). ``verify`` False: an artifact's manifest is not checked (``--no-verify``).
    Progress bars on stderr (a terminal) unless ``quiet``; at ``--log-level info`` a line per stage.
    """
    import time

    if device not in ("cpu", "cuda"):
        raise UserError(f"--device: unknown value {device!r} (choose from cpu, cuda)")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available here (use --device cpu)")
    text = load_eval_text(text_path)  # check the text before the slow model load
    from ..preflight import check_eval_args

    # and the window length against the context
    check_eval_args(source if is_artifact(source) else str(source), seqlen, max_windows, verify)
    from ..progress import Reporter

    t0 = time.perf_counter()
    with Reporter(quiet=quiet) as rep:
        what = "rebuilding the artifact" if is_artifact(source) else f"loading {Path(source_name(source)).name}"
        with rep.stage(what, total=None):
            if device == "cuda" and is_artifact(source):  # the artifact's kernels, float32 dense parts
                model, tok, kind = load_artifact_on_gpu(source, dynamic_pruning, tokenizer, verify)
            else:
                model, tok, kind = load_for_eval(source, dynamic_pruning=dynamic_pruning, tokenizer=tokenizer,
                                                 verify=verify)
                model.to(device)
        ids = tokenize_eval_text(tok, text)
        t_windows = time.perf_counter()
        ends: list[float] = []  # when each window finished: the first carries a GPU's kernel compilation

        def advance(n: int) -> None:
            if n:
                bar.update(0, n)
            else:
                ends.append(time.perf_counter())
                bar.advance()

        with rep.stage(f"perplexity windows of {seqlen} tokens", total=None) as bar:
            nlls = window_nlls(model, ids, seqlen, max_windows, device, progress=advance)
    from ...formats.arithmetic.sparse_inputs import activation_sparsity_summary

    return {
        "dynamic_pruning": activation_sparsity_summary(model),
        "source": source_name(source),
        "kind": kind,
        "device": device,
        "runtime": "cuda kernels, float32 dense parts" if device == "cuda" and kind == "artifact" else "torch, float32",
        "text": str(text_path),
        "seqlen": seqlen,
        "windows": len(nlls),
        "tokens": int(ids.numel()),
        "nll": sum(nlls) / len(nlls),
        "ppl": math.exp(sum(nlls) / len(nlls)),
        "seconds": time.perf_counter() - t0,
        "load_seconds": t_windows - t0,  # rebuilding or loading the model, and tokenizing the text
        "windows_seconds": time.perf_counter() - t_windows,  # the forwards (on a GPU: kernel compilation too)
        "first_window_seconds": ends[0] - t_windows,
        # the windows after the first, per window: the steady speed, compilation and first-touch costs left out
        "later_window_seconds": (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else None,
    }
