"""The `unionsparse` command: compress, inspect, verify, eval, export, generate (and the commands other modules add).

Exit codes: 0 success, 1 a check failed (verify), 2 bad input (one line on stderr, no traceback), 3 a bug
(one line, the traceback in a file).
Every option also reads an environment variable: UNIONSPARSE_<COMMAND>_<OPTION>, e.g.
UNIONSPARSE_COMPRESS_SPARSITY=0.6.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from ..formats import registry
from ..formats.errors import UnionsparseError
from .errors import UserError
from .report.summarize import summarize_command
from .terminal import printable

EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_BUG = 3


class LiveChoice(click.Choice):
    """A choice whose values ``values()`` gives when the option is parsed or shown, not before (``--format``: the
    registered formats, so that a format registered after this module was imported is a choice too; ``--to``:
    ``export.TARGETS``, without importing the exporters until then)."""

    def __init__(self, values) -> None:
        self._values = values
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(self._values())

    @choices.setter
    def choices(self, _value) -> None:
        pass


def FormatChoice() -> LiveChoice:  # noqa: N802 - a click type, as click.Choice
    return LiveChoice(registry.names)


def _export_targets() -> tuple[str, ...]:
    from .export import TARGETS

    return TARGETS


class ShownChoice(LiveChoice):
    """A ``compress`` option's choices in ``--help`` and shell completion, not checked here: the configuration
    checks them (``CompressConfig.validate_options``), once, whether the value came from a flag, the environment,
    a recipe or Python. ``choices``: a tuple, or a callable giving it (the registered formats)."""

    def __init__(self, choices) -> None:
        super().__init__(choices if callable(choices) else lambda: choices)

    def convert(self, value, param, ctx):
        return value


def config_options(command):
    """The ``compress`` options, one per ``config.option`` field of CompressConfig, in its order: flags, help,
    choices and type come from the configuration, which validates the values, choices included (docs/cli.md)."""
    import dataclasses

    from .config import CompressConfig

    for f in reversed(dataclasses.fields(CompressConfig)):
        meta = f.metadata.get("cli")
        if meta is None:
            continue
        kw: dict = {"help": meta["help"], "metavar": meta["metavar"], "multiple": meta["multiple"]}
        choices = meta["choices"]
        if isinstance(f.default, bool):
            kw["is_flag"] = True
        else:
            empty = meta["multiple"] or isinstance(f.default, tuple)  # nothing given: the configuration's ()
            kw["default"] = None if empty else f.default
            kw["show_default"] = f.default is not None and not empty
            kw["type"] = (ShownChoice(choices) if choices
                          else meta["type"] or (type(f.default) if f.default is not None and not empty else None))
        command = click.option(*meta["flags"], f.name, **kw)(command)
    return command


def _ns(text: str) -> list[int]:
    try:
        ns = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--n: expected comma-separated integers such as 1,8,32, got {text!r}") from None
    if not ns or min(ns) <= 0:
        raise UserError(f"--n: widths must be positive integers, got {text!r}")
    return ns


def _check_artifact(path: str, no_verify: bool, open_now: bool = True, every_file: bool = False):
    """Commands that use an artifact open it with its manifest checked (signature, files, sizes; then each file as
    it is read: one line, exit 2, when one differs); ``open_now``: here, before any other work; ``every_file``:
    every file's SHA-256 too (bench, which reads them all after its own checks). ``--no-verify`` skips the checks
    and says so on stderr. Returns the Artifact opened here (None: not opened here), which the command uses: an
    artifact is opened once per command."""
    from .artifact.store import Artifact

    if no_verify:
        click.echo(printable(f"note: --no-verify: {path} is used without checking its files against its manifest"),
                   err=True)
        return Artifact(path, verify=False) if open_now else None
    if not open_now:
        return None
    art = Artifact(path)
    if every_file:
        art.check_files()
    return art


def _load_recipe(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """`--config`: the recipe's values become the command's defaults (flags and env vars win)."""
    from .recipe import load_into_context

    return load_into_context(ctx, param, value)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "UNIONSPARSE"})
@click.version_option(package_name="unionsparse", prog_name="unionsparse")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
              help="Logging level of unionsparse's messages on stderr.")
def cli(log_level: str) -> None:
    """Offline compression of causal LMs into sparse low-bit IE-BME / Tiled-CBC zarr artifacts."""
    from .progress import configure_logging

    configure_logging(log_level)


@cli.command()
@click.option("--config", "config_file", default=None, is_eager=True, expose_value=False,
              callback=_load_recipe,
              help="Recipe file (.yaml/.json) or an OUT.zarr whose recipe to reuse; flags override it.")
@click.argument("model")
@click.option("-o", "--output", required=True, help="Artifact path, OUT.zarr.")
@config_options
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def compress(model, output, quiet, as_json, **options) -> None:
    """Compress MODEL (a model folder, a .gguf file or a hub id) into OUT.zarr."""
    from .config import CompressConfig
    from .pipeline.compress import compress as run
    from .progress import Reporter

    options["layer_overrides"] = parse_overrides_option(options["layer_overrides"])
    options["targets"], options["ignore"] = tuple(options["targets"]), tuple(options["ignore"])
    cfg = CompressConfig(model=model, output=output, **options)
    with Reporter(quiet=quiet or as_json) as rep:
        summary = run(cfg, rep)  # validates the configuration first, once
    summary["requested_sparsity"] = cfg.requested_sparsity
    summary["notes"] = cfg.notes()
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        click.echo(
            f"wrote {output}: {summary['layers']} layers, {summary['bits_per_weight']:.3f} bits/weight, "
            f"CR {summary['cr']:.2f}x vs fp16, sparsity {100 * summary['sparsity']:.1f}%"
            f"{sparsity_note(cfg.requested_sparsity, summary['sparsity'])} in {summary['seconds']:.1f} s"
        )
        for n in summary["notes"]:
            click.echo(f"note: {n}", err=True)


def parse_overrides_option(text: str | list | None) -> tuple[dict, ...]:
    """``--layer-overrides``: a JSON (or YAML) list of mappings, or the list a recipe file gave."""
    if text is None or text == "":
        return ()
    if isinstance(text, (list, tuple)):
        return tuple(text)
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        raise UserError("--layer-overrides: expected a JSON list such as "
                        '[{"match": ".*down_proj", "quant": "w4a16"}]') from None
    if not isinstance(data, list):
        raise UserError(f"--layer-overrides: expected a list of mappings, got {type(data).__name__}")
    return tuple(data)


def sparsity_note(requested: float, achieved: float) -> str:
    """Why the achieved sparsity exceeds the pruned fraction: kept weights whose codes round to zero."""
    if achieved - requested < 0.005:
        return ""
    return f" (requested {100 * requested:.1f}%; kept weights whose codes round to zero add the rest)"


@cli.command()
@click.argument("artifact")
@click.option("--layer", default=None, help="Only this layer (module path).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--compare", is_flag=True, help="Baselines (CSR, Tiled-CSL, TCA-BME, dense) on the same masks.")
@click.option("--plot", "plot_file", default=None, help="Write per-layer figures to FILE.png (matplotlib).")
@click.option("--html", "html_file", default=None, help="Write one self-contained HTML page (tables + plot).")
@click.option("--recipe", is_flag=True, help="Print the stored recipe as YAML (for compress --config).")
def inspect(artifact, layer, as_json, compare, plot_file, html_file, recipe) -> None:
    """PMR/CR statistics of ARTIFACT, per layer and for the whole model."""
    from rich.console import Console

    from .report.tables import inspect_data, print_tables, without_baselines

    if recipe:
        from .recipe import read_recipe, recipe_yaml

        header = f"recipe of {artifact}: unionsparse compress --config FILE -o OUT.zarr"
        click.echo(recipe_yaml(read_recipe(artifact), header), nl=False)
        return
    data = inspect_data(artifact, layer, compare or bool(plot_file or html_file))
    if plot_file or html_file:
        from .report.html import write_html
        from .report.plots import render, write_plot

        if plot_file:
            click.echo(f"wrote {write_plot(data, plot_file)}", err=True)
        if html_file:
            click.echo(f"wrote {write_html(data, html_file, render(data))}", err=True)
        if not compare:
            data = without_baselines(data)  # the artifact is read once
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        print_tables(data, Console(width=None if sys.stdout.isatty() else 220), compare)


@cli.command()
@click.argument("artifact")
@click.option("--backend", default="auto", show_default=True, type=click.Choice(["auto", "cupy", "cpu"]),
              help="Kernel checks: cupy (the GPU kernels), cpu (their CPU references), auto (cupy with a GPU).")
@click.option("--n", "ns", default="1,8,32", show_default=True, help="Decode widths to check.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the random activations.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True,
              help="Print {ok, backend, layers, failures, notes, manifest_sha256} as JSON.")
def verify(artifact, backend, ns, seed, quiet, as_json) -> None:
    """Decode and re-encode every layer and check the kernels on it; exit 1 if any check fails."""
    from .progress import Reporter
    from .verify.checks import verify as run

    widths = _ns(ns)
    from .artifact.store import Artifact

    try:
        n_layers = len(Artifact(artifact, verify=False).layer_names)
    except UserError:
        n_layers = 0  # verify() decides: corruption of one of our stores is a failed check (exit 1)
    with Reporter(quiet=quiet or as_json) as rep, rep.stage("verifying layers", n_layers) as bar:
        res = run(artifact, backend, widths, seed, on_layer=lambda _: bar.advance())
    if as_json:
        click.echo(json.dumps({"ok": res.ok, "backend": res.backend, "layers": res.checked_layers,
                               "failures": res.failures, "notes": res.notes, "manifest_sha256": res.digest},
                              indent=2))
    else:  # failures quote artifact-provided names: control characters are shown as escapes
        for n in res.notes:
            click.echo(f"note: {printable(n)}", err=True)
        for f in res.failures:
            click.echo(f"FAIL {printable(f)}")
        status = "OK" if res.ok else f"FAILED: {len(res.failures)} problem(s)"
        click.echo(printable(f"verify {artifact}: {res.checked_layers} layers, backend {res.backend}: {status}"))
    if not res.ok:
        sys.exit(EXIT_CHECK_FAILED)


@cli.command()
@click.argument("artifact", required=False)
@click.option("--shapes", default="spinfer", show_default=True, type=click.Choice(["spinfer", "unionsparse"]),
              help="Kernel corpus (without ARTIFACT).")
@click.option("--n", "ns", default="1,2,4,8,16,32", show_default=True, help="Decode widths.")
@click.option("--sparsity", default=0.5, show_default=True, type=float)
@click.option("--format", "fmt", default=registry.names()[0], show_default=True, type=FormatChoice(),
              help="Kernels to time.")
@click.option("--e2e", is_flag=True,
              help="Time per output token of whole decode steps (one CUDA graph per step) for every linear kind "
                   "beside dense fp16 and W4A16, with the breakdown and the byte floor (docs/cli.md).")
@click.option("--spec", default=None, help="--e2e: synthetic models, comma-separated: llama2-7b, llama3-8b, tiny "
                                           "(default llama2-7b,llama3-8b; tiny with --device cpu).")
@click.option("--batch", "batches", default=None, help="--e2e: batch sizes (default 1,4,8).")
@click.option("--context", "contexts", default=None, help="--e2e: context lengths (default 512,2048).")
@click.option("--kinds", default=None, help="--e2e: linear kinds (default fp16, w4a16, iebme-w4a4-50-o128, "
                                            "iebme-w4a4-0-o128, iebme-w4a8-50, iebme-w4a8-0, iebme-w4a4-50, "
                                            "iebme-w4a4-0, tcbc-fp16-30+30; "
                                            "also iebme-w4a4-50-o128-dp, iebme-w4a4-70, iebme-w4a4-90, "
                                            "iebme-w2a4-50-o128, tcbc-fp16-50+30, tcbc-int4-50+30, "
                                            "tcbc-int4-50+50; fp16 always runs).")
@click.option("--steps", default=None, type=int, help="--e2e: replays per timed repeat (default 16).")
@click.option("--device", default=None, type=click.Choice(["cuda", "cpu"]),
              help="--e2e: cuda (default), or cpu: a smoke run of --spec tiny, not a performance figure.")
@click.option("--time-budget", default=None, type=float,
              help="--e2e: seconds; cases not started by then are listed as skipped.")
@click.option("--out", "out_dir", default=None, help="--e2e: write DIR/e2e-<machine>-<date>.json (and .md).")
@click.option("--record", is_flag=True, default=None,
              help="--e2e ARTIFACT: keep its time per token beside it (OUT.zarr.figures.json) for inspect.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--no-verify", is_flag=True,
              help="Use the artifact without checking its files against its manifest (said on stderr).")
def bench(artifact, shapes, ns, sparsity, fmt, e2e, spec, batches, contexts, kinds, steps, device, time_budget,
          out_dir, record, as_json, no_verify) -> None:
    """Time the project's kernels beside cuBLAS fp16 (and int8) on the same shapes (needs a GPU); --e2e: whole
    decode steps."""
    opened = _check_artifact(artifact, no_verify, every_file=True) if artifact else None

    e2e_only = {"--spec": spec, "--batch": batches, "--context": contexts, "--kinds": kinds, "--steps": steps,
                "--device": device, "--time-budget": time_budget, "--out": out_dir, "--record": record or None}
    if e2e:
        from .bench.e2e import e2e_command, format_table

        if time_budget is not None and not time_budget > 0:
            raise UserError(f"--time-budget must be a positive number of seconds, got {time_budget}")
        log = None if as_json else (lambda msg: click.echo(printable(msg), err=True))
        data = e2e_command(opened or artifact, spec, batches, contexts, kinds, steps, device or "cuda", out_dir,
                           time_budget, record=bool(record), log=log, verify=not no_verify)
        if as_json:
            click.echo(json.dumps(data, indent=2, default=str))
        else:
            click.echo("\n".join(printable(line) for line in format_table(data).splitlines()))
        if not as_json and data.get("written_to"):
            click.echo(printable(f"results: {data['written_to']}"))
        return
    given = [k for k, v in e2e_only.items() if v is not None]
    if given:
        raise UserError(f"{given[0]} applies to bench --e2e only")
    from .bench.kernels import bench_command

    if not 0.0 <= sparsity < 1.0:
        raise UserError(f"--sparsity must be in [0, 1), got {sparsity}")
    data = bench_command(opened or artifact, shapes, _ns(ns), sparsity, as_json, fmt=fmt, verify=not no_verify)
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        for n, s in data["summary"].items():
            speedup = s["geomean_speedup_vs_cublas"]
            click.echo(f"N={n}: geomean speedup vs cuBLAS {speedup:.2f}x over {s['cases']} shapes")


@cli.command(name="eval")
@click.argument("source", metavar="MODEL_OR_ARTIFACT")
@click.option("--text", "text_path", default=None, help="Evaluation text file (one row a line): perplexity.")
@click.option("--seqlen", default=2048, show_default=True, type=int, help="Window length in tokens.")
@click.option("--max-windows", default=None, type=int, help="Evaluate only the first N windows.")
@click.option("--tasks", default=None, help="lm-eval tasks instead of perplexity, e.g. arc_easy,hellaswag.")
@click.option("--tasks-data", default=None, help="Folder of local task data: DIR/<task>/<split>.jsonl.")
@click.option("--limit", default=None, type=int, help="--tasks: score only the first N items of each task.")
@click.option("--batch-size", default=None, type=int, help="--tasks: requests per forward pass (default 1).")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
@click.option("--act-sparsity/--no-act-sparsity", "dp", default=True, show_default=True,
              help="Tiled-CBC artifacts: apply the stored dynamic-pruning thresholds to every token.")
@click.option("--dp/--no-dp", "dp_old", default=None, hidden=True)  # the old name, kept for one release
@click.option("--tokenizer", default=None,
              help="Tokenizer: a model folder, .gguf file or tokenizer folder (an artifact without one needs it).")
@click.option("--record", is_flag=True,
              help="Keep the result beside the artifact (OUT.zarr.figures.json, outside the store) for inspect.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--no-verify", is_flag=True,
              help="Use the artifact without checking its files against its manifest (said on stderr).")
def eval_cmd(source, text_path, seqlen, max_windows, tasks, tasks_data, limit, batch_size, device, dp, dp_old,
             tokenizer, record, as_json, no_verify) -> None:
    """Perplexity (--text) or lm-eval task accuracy (--tasks) of a model or of an artifact (rebuilt)."""
    from .artifact.ownership import store_attrs
    from .evaluate.perplexity import evaluate_source
    from .evaluate.tasks import check_eval_mode, evaluate_tasks, format_table

    dp = dp if dp_old is None else dp_old
    is_artifact = store_attrs(Path(source)) is not None
    if record and not is_artifact:
        raise UserError(f"--record: {source} is not a unionsparse artifact (figures are kept beside artifacts)")
    opened = _check_artifact(source, no_verify) if is_artifact else None
    from .report.figures import record as keep

    if check_eval_mode(text_path, max_windows, tasks, limit, batch_size):
        res = evaluate_tasks(opened or source, tasks, tasks_data, limit, batch_size, device, dynamic_pruning=dp,
                             tokenizer=tokenizer, verify=not no_verify)
        if record:
            for name, t in res["tasks"].items():
                keep(source, "tasks", name + (f", {limit} items" if limit else ""),
                     {m: v["value"] for m, v in t["metrics"].items()})
        click.echo(json.dumps(res, indent=2) if as_json else format_table(res))
        return
    res = evaluate_source(opened or source, text_path, seqlen, max_windows, device, dynamic_pruning=dp,
                          tokenizer=tokenizer, verify=not no_verify, quiet=as_json)
    if record:
        key = f"{Path(text_path).name}, seqlen {seqlen}" + (f", {max_windows} windows" if max_windows else "")
        keep(source, "perplexity", key + ("" if dp else ", no activation sparsity"),
             {"ppl": res["ppl"], "windows": res["windows"], "text": str(Path(text_path).resolve())})
    if as_json:
        click.echo(json.dumps(res, indent=2))
    else:
        click.echo(printable(f"perplexity {res['ppl']:.4f} on {res['windows']} windows of {seqlen} tokens ({source})"))


@cli.command()
@click.argument("artifact")
@click.option("-o", "--output", required=True, help="Output folder DIR (new, or empty).")
@click.option("--to", "target", default="hf", show_default=True, type=LiveChoice(_export_targets),
              help="A Hugging Face folder of fp16 weights, or packed int4/int2 codes.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest safetensors file, e.g. 500MB.")
@click.option("--overwrite", is_flag=True, help="Replace DIR if an earlier export wrote it.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON on stdout.")
@click.option("--no-verify", is_flag=True,
              help="Use the artifact without checking its files against its manifest (said on stderr).")
def export(artifact, output, target, max_shard_size, overwrite, as_json, no_verify) -> None:
    """Write ARTIFACT as a Hugging Face folder or a compressed-tensors checkpoint in DIR."""
    from .export import EXPORTERS

    _check_artifact(artifact, no_verify, open_now=False)  # the exporter opens it first thing
    res = EXPORTERS[target](artifact, output, overwrite=overwrite, max_shard_size=max_shard_size,
                            verify=not no_verify)
    for line in res.not_expressed:
        click.echo(f"note: not expressed in {target}: {line}", err=True)
    for line in res.notes:
        click.echo(f"note: {line}", err=True)
    if as_json:
        click.echo(json.dumps(res.to_json(), indent=2))
    else:
        dense = f", {len(res.dense_layers)} layers dense fp16" if res.dense_layers else ""
        click.echo(f"wrote {output} ({target}): {len(res.files)} files{dense}; details in {output}/unionsparse.json")


@cli.command()
@click.argument("artifact")
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--batch-file", default=None, help="File of prompts, one per line (see --batch-size).")
@click.option("--batch-size", default=1, show_default=True, type=int,
              help="Prompts of --batch-file generated together (1: one after another, streamed; more: each "
                   "batch's texts printed when it ends; Tiled-CBC thresholds apply only at batch 1).")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0: greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float, help="Nucleus sampling mass, in (0, 1].")
@click.option("--seed", default=0, show_default=True, type=int, help="Sampling seed (same seed, same tokens).")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]),
              help="cpu: the kernels' arithmetic, exact; cuda: the artifact's kernels (CuPy and a GPU).")
@click.option("--chat", is_flag=True, help="Wrap each prompt in the chat template stored in the artifact.")
@click.option("--act-sparsity/--no-act-sparsity", "act_sparsity", default=True, show_default=True,
              help="Tiled-CBC artifacts: apply the stored activation-sparsity thresholds at decode.")
@click.option("--quiet", is_flag=True, help="No load time and speed lines on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON instead of streaming text.")
@click.option("--no-verify", is_flag=True,
              help="Use the artifact without checking its files against its manifest (said on stderr).")
def generate(artifact, prompt, batch_file, batch_size, max_new_tokens, temperature, top_p, seed, device, chat,
             act_sparsity, quiet, as_json, no_verify) -> None:
    """Generate text from ARTIFACT, streaming it to stdout (needs nothing but the artifact)."""
    from .runtime.command import generate_command

    _check_artifact(artifact, no_verify, open_now=False)  # opened once the arguments are checked
    generate_command(artifact, prompt, batch_file, max_new_tokens, temperature, top_p, seed, device, chat,
                     act_sparsity, quiet, as_json, batch_size, verify=not no_verify)


cli.add_command(summarize_command)  # compressor/report/summarize.py: one table over a folder of artifacts


def _name_env_vars(group: click.Group) -> None:
    """UNIONSPARSE_<COMMAND>_<LONG OPTION> for every option (click's own name would use the Python
    parameter name, e.g. ..._COMPRESS_FMT for --format or ..._INSPECT_AS_JSON for --json)."""
    for cname, cmd in group.commands.items():
        for p in cmd.params:
            longs = [o for o in getattr(p, "opts", []) if o.startswith("--")]
            if isinstance(p, click.Option) and p.envvar is None and longs:  # old names (aliases) too
                names = [f"UNIONSPARSE_{cname}_{o[2:]}".upper().replace("-", "_") for o in longs]
                p.envvar = names[0] if len(names) == 1 else names


def _log_level_everywhere(group: click.Group) -> None:
    """``--log-level`` after the command name too (``unionsparse compress ... --log-level info``)."""

    def set_level(_ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
        if value:
            from .progress import configure_logging

            configure_logging(value)

    for cmd in group.commands.values():
        cmd.params.append(click.Option(
            ["--log-level"], default=None, expose_value=False, is_eager=True, callback=set_level,
            envvar="UNIONSPARSE_LOG_LEVEL", type=click.Choice(["debug", "info", "warning", "error"],
                                                              case_sensitive=False),
            help="As the global --log-level."))


_log_level_everywhere(cli)
_name_env_vars(cli)


def _report_bug(e: BaseException) -> str:
    """Write the traceback of an unexpected exception to a file; where it went (or why it could not be kept)."""
    import tempfile
    import traceback

    try:
        fd, path = tempfile.mkstemp(prefix="unionsparse-crash-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(f"unionsparse {' '.join(sys.argv[1:])}\n\n")
            traceback.print_exception(type(e), e, e.__traceback__, file=f)
    except OSError as err:  # a full disk or a read-only temporary folder
        return f"traceback not saved ({err.strerror or type(err).__name__}; UNIONSPARSE_DEBUG=1 prints it)"
    return f"traceback in {path}"


def main(argv: list[str] | None = None) -> None:
    """Entry point. Errors about the input (any UnionsparseError, click's usage errors) are one line and exit 2;
    anything else is a bug: one line, exit 3, and the traceback in a file (UNIONSPARSE_DEBUG=1 raises it)."""
    try:
        cli.main(args=argv, prog_name="unionsparse", standalone_mode=False)
    except UnionsparseError as e:
        click.echo(printable(f"unionsparse: error: {e}"), err=True)
        sys.exit(EXIT_BAD_INPUT)
    except click.exceptions.Abort:
        click.echo("unionsparse: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:  # usage errors: unknown option, missing argument, bad type
        click.echo(printable(f"unionsparse: error: {e.format_message()}"), err=True)
        sys.exit(EXIT_BAD_INPUT if e.exit_code == 2 else e.exit_code)
    except KeyboardInterrupt:
        click.echo("unionsparse: interrupted (rerun compress with --resume to continue)", err=True)
        sys.exit(130)
    except Exception as e:
        if os.environ.get("UNIONSPARSE_DEBUG"):
            raise
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        click.echo(printable(f"unionsparse: internal error (a bug, please report it): {type(e).__name__}: {first}; ")
                   + _report_bug(e), err=True)
        sys.exit(EXIT_BUG)
    sys.exit(0)


if __name__ == "__main__":  # pragma: no cover
    main()
