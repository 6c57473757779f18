"""The body of ``unionsparse generate``: every argument checked before the model loads, text streamed to
stdout as tokens come, load time and per-prompt speed on stderr (one line each)."""

from __future__ import annotations

import json
import sys

import click

from ..artifact.store import Artifact
from ..artifact.tokenizer import has_tokenizer, load_tokenizer
from ..errors import UserError
from ..preflight import read_user_text
from .generate import DEVICES, Generation
from .sampling import check_sampling


def read_prompts(prompt: str | None, batch_file: str | None) -> list[str]:
    """The prompts of ``--prompt`` or ``--batch-file`` (one a line, blank lines skipped)."""
    if (prompt is None) == (batch_file is None):
        raise UserError("give exactly one of --prompt TEXT and --batch-file FILE")
    if prompt is not None:
        if not prompt:
            raise UserError("--prompt is empty")
        return [prompt]
    text = read_user_text("--batch-file", batch_file)
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"--batch-file {batch_file}: file holds no prompt")
    return prompts


def check_prompt_lengths(art: Artifact, tok, prompts: list[str], chat: bool, flag: str) -> None:
    """Every prompt leaves room for a new token in the stored model's context: checked before the model loads."""
    from ..preflight import model_context

    context = model_context(art.attrs.get("model_config"))
    if context is None:
        return
    for i, p in enumerate(prompts, 1):
        ids = (tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) if chat else tok(p, verbose=False)["input_ids"])
        if len(ids) >= context:
            where = flag if flag == "--prompt" else f"{flag}: prompt {i}"
            raise UserError(f"{where}: the prompt has {len(ids)} tokens; the model holds at most {context} positions")


def _speed_line(g: Generation) -> str:
    rate = f"{g.tokens_per_s:.2f} tokens/s" if g.tokens_per_s is not None else "- tokens/s"
    seed = f", seed {g.seed}" if g.seed is not None else ""
    batch = g.stats.get("batch", 1)
    together = f" per row, {batch} rows together" if batch > 1 else ""
    return (f"first token {g.first_token_s:.3f} s, {len(g.ids)} tokens, decode {rate}{together} "
            f"(stop: {g.stop}{seed})")


def generate_command(artifact: str, prompt: str | None, batch_file: str | None, max_new_tokens: int,
                     temperature: float, top_p: float, seed: int, device: str, chat: bool, dp: bool,
                     quiet: bool, as_json: bool, batch_size: int = 1, verify: bool = True) -> None:
    """Run ``generate`` (see the module docstring); library errors propagate as ``UserError``. ``verify``: the
    artifact's files are checked against its manifest as they are read (``--no-verify``: not)."""
    from . import load

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"--batch-size must be a positive integer, got {batch_size!r}")
    prompts = read_prompts(prompt, batch_file)
    check_sampling(max_new_tokens, temperature, top_p)
    if device not in DEVICES:
        raise UserError(f"--device: unknown value {device!r} (choose from {', '.join(DEVICES)})")
    if device == "cuda":
        from .cuda import require_cuda

        require_cuda()
    art = Artifact(artifact, verify=verify)
    if not has_tokenizer(art):
        raise UserError(f"{artifact}: the artifact holds no tokenizer (written before unionsparse stored one, or its "
                        "model had none); compress the model again to store it")
    tok = load_tokenizer(art)
    if chat and not getattr(tok, "chat_template", None):
        raise UserError(f"--chat: the tokenizer stored in {artifact} has no chat template")
    check_prompt_lengths(art, tok, prompts, chat, "--prompt" if prompt is not None else "--batch-file")
    rt = load(art, device=device, dynamic_pruning=dp, tokenizer=tok)
    if not quiet and not as_json:
        st = rt.step_stats()
        step = "static KV cache" + (", one CUDA graph per step" if st["graph"] else "")
        if "graph_error" in st:
            step += f", eager steps: the CUDA-graph capture failed ({st['graph_error']})"
        if rt.static_unsupported is not None:
            step = f"transformers' own forward ({rt.static_unsupported})"
        ops = f" as {rt.n_ops} ops (Q/K/V, gate/up fused)" if rt.n_ops != rt.n_compressed else ""
        click.echo(f"loaded {artifact} in {rt.load_s:.2f} s ({rt.n_compressed} compressed linears{ops}, "
                   f"backend {rt.backend}; decode: {step})", err=True)

    def echo(_token: int | None, text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()

    results = []
    for p, g in _generations(rt, prompts, batch_size, as_json, echo, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, seed=seed, chat=chat):
        if as_json:
            results.append({"prompt": p, "text": g.text, "ids": g.ids, "stop": g.stop, "seed": g.seed,
                            "prompt_tokens": len(g.prompt_ids), "first_token_s": g.first_token_s,
                            "tokens_per_s": g.tokens_per_s, "batch": g.stats.get("batch", 1)})
            continue
        if batch_size > 1:  # generated together: the text comes whole
            sys.stdout.write(g.text or "")
        sys.stdout.write("\n")
        sys.stdout.flush()
        if not quiet:
            click.echo(_speed_line(g), err=True)
    if as_json:
        click.echo(json.dumps({"artifact": artifact, "device": device, "load_s": rt.load_s, "results": results},
                              indent=2))


def _generations(rt, prompts: list[str], batch_size: int, as_json: bool, echo, **kw):
    """(prompt, Generation) in order: one at a time, streamed to ``echo``, or ``batch_size`` prompts together."""
    if batch_size == 1:
        for p in prompts:
            yield p, rt.generate(p, stream=None if as_json else echo, **kw)
        return
    for i in range(0, len(prompts), batch_size):
        part = prompts[i:i + batch_size]
        yield from zip(part, rt.generate_batch(part, **kw), strict=True)
