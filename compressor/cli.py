"""The `unionsparse` command: compress, inspect, verify (and the commands other modules add).

Exit codes: 0 success, 1 a check failed (verify), 2 bad input (one line on stderr, no traceback).
Every option also reads an environment variable: UNIONSPARSE_<COMMAND>_<OPTION>, e.g.
UNIONSPARSE_COMPRESS_SPARSITY=0.6.
"""

from __future__ import annotations

import json
import os
import sys

import click

from .batch import summarize_command
from .errors import UserError
from .terminal import printable

EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2


def _ns(text: str) -> list[int]:
    try:
        ns = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--n: expected comma-separated integers such as 1,8,32, got {text!r}") from None
    if not ns or min(ns) <= 0:
        raise UserError(f"--n: widths must be positive integers, got {text!r}")
    return ns


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
@click.option("--prune", default="magnitude", show_default=True, help="wanda|sparsegpt|magnitude|none")
@click.option("--sparsity", default=0.5, show_default=True, type=float)
@click.option("--nm", default=None, help="N:M semi-structured mask such as 2:4 (instead of unstructured).")
@click.option("--sparsity-profile", default="uniform", show_default=True, help="uniform|owl")
@click.option("--quant", default="w4a4", show_default=True, help="w4a4|w2a4|w4a16|none")
@click.option("--group-size", default=128, show_default=True, type=int)
@click.option("--gptq", is_flag=True, help="GPTQ weight error feedback (needs --prune wanda|sparsegpt).")
@click.option("--clip-search", is_flag=True, help="Per-group weight clip ratios scored on calibration H.")
@click.option("--keep-outliers", default=0, show_default=True, type=int,
              help="Atom: the N most active input channels as an 8-bit side matrix (ie-bme, w4a4|w2a4).")
@click.option("--format", "fmt", default="ie-bme", show_default=True, help="ie-bme|tiled-cbc")
@click.option("--tile", default=None, help="Local tile HxW (ie-bme 16x64, tiled-cbc 256x16).")
@click.option("--areas", default="2x2", show_default=True, help="IE-BME area grid R_AxC_A.")
@click.option("--reorder", default="auto", show_default=True, help="auto|dp|cpsat|none (ie-bme).")
@click.option("--calib", default="c4", show_default=True, help="c4|alpaca|PATH (.json/.jsonl/.json.gz/.parquet)")
@click.option("--nsamples", default=128, show_default=True, type=int)
@click.option("--seqlen", default=2048, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--device", default="cpu", show_default=True, help="cpu|cuda")
@click.option("--workers", default=None, type=int, help="Local Dask workers for reordering/encoding.")
@click.option("--scheduler", default=None, help="Address of an existing Dask scheduler.")
@click.option("--dp-sparsity", default=0.0, show_default=True, type=float,
              help="Tiled-CBC dynamic (activation) sparsity target for the thresholds.")
@click.option("--dp-profile", default="uniform", show_default=True, help="uniform|greedy")
@click.option("--dp-calib", default="alpaca", show_default=True,
              help="Dynamic-pruning calibration text: c4|alpaca|PATH (as --calib).")
@click.option("--resume", is_flag=True, help="Continue an interrupted run after its last complete layer.")
@click.option("--overwrite", is_flag=True, help="Replace OUT.zarr if it exists.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def compress(model, output, prune, sparsity, nm, sparsity_profile, quant, group_size, gptq, clip_search,
             keep_outliers, fmt, tile, areas, reorder,
             calib, nsamples, seqlen, seed, device, workers, scheduler, dp_sparsity, dp_profile, dp_calib, resume,
             overwrite, quiet, as_json) -> None:
    """Compress MODEL (a model folder, a .gguf file or a hub id) into OUT.zarr."""
    from .config import CompressConfig
    from .pipeline import compress as run
    from .progress import Reporter

    cfg = CompressConfig(
        model=model, output=output, prune=prune, sparsity=sparsity, nm=nm, sparsity_profile=sparsity_profile,
        quant=quant, group_size=group_size, gptq=gptq, clip_search=clip_search, keep_outliers=keep_outliers,
        format=fmt, tile=tile, areas=areas, reorder=reorder, calib=calib,
        nsamples=nsamples, seqlen=seqlen, seed=seed, device=device, workers=workers, scheduler=scheduler,
        dp_sparsity=dp_sparsity, dp_profile=dp_profile, dp_calib=dp_calib, resume=resume, overwrite=overwrite,
    ).validate()
    with Reporter(quiet=quiet or as_json) as rep:
        summary = run(cfg, rep)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        click.echo(
            f"wrote {output}: {summary['layers']} layers, {summary['bits_per_weight']:.3f} bits/weight, "
            f"CR {summary['cr']:.2f}x vs fp16, sparsity {100 * summary['sparsity']:.1f}% "
            f"in {summary['seconds']:.1f} s"
        )


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

    from .report import inspect_data, print_tables

    if recipe:
        from .recipe import read_recipe, recipe_yaml

        header = f"recipe of {artifact}: unionsparse compress --config FILE -o OUT.zarr"
        click.echo(recipe_yaml(read_recipe(artifact), header), nl=False)
        return
    data = inspect_data(artifact, layer, compare or bool(plot_file or html_file))
    if plot_file or html_file:
        from .html_report import write_html
        from .plots import render, write_plot

        if plot_file:
            click.echo(f"wrote {write_plot(data, plot_file)}", err=True)
        if html_file:
            click.echo(f"wrote {write_html(data, html_file, render(data))}", err=True)
        if not compare:
            data = inspect_data(artifact, layer, False)
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        print_tables(data, Console(width=None if sys.stdout.isatty() else 220), compare)


@cli.command()
@click.argument("artifact")
@click.option("--backend", default="auto", show_default=True, help="auto|cupy|cpu")
@click.option("--n", "ns", default="1,8,32", show_default=True, help="Decode widths to check.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--quiet", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
def verify(artifact, backend, ns, seed, quiet, as_json) -> None:
    """Decode and re-encode every layer and check the kernels on it; exit 1 if any check fails."""
    from .config import choice
    from .progress import Reporter
    from .verify import verify as run

    choice("--backend", backend, ("auto", "cupy", "cpu"))
    widths = _ns(ns)
    from .artifact import Artifact

    try:
        n_layers = len(Artifact(artifact).layer_names)
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
@click.option("--shapes", default="spinfer", show_default=True, help="spinfer|unionsparse (without ARTIFACT).")
@click.option("--n", "ns", default="1,2,4,8,16,32", show_default=True, help="Decode widths.")
@click.option("--sparsity", default=0.5, show_default=True, type=float)
@click.option("--format", "fmt", default="ie-bme", show_default=True, help="ie-bme|tiled-cbc kernels.")
@click.option("--json", "as_json", is_flag=True)
def bench(artifact, shapes, ns, sparsity, fmt, as_json) -> None:
    """Time the project's kernels beside cuBLAS fp16 (and int8) on the same shapes (needs a GPU)."""
    from ..kernels.bench import bench_command
    from .config import choice

    if not 0.0 <= sparsity < 1.0:
        raise UserError(f"--sparsity must be in [0, 1), got {sparsity}")
    choice("--format", fmt, ("ie-bme", "tiled-cbc"))
    data = bench_command(artifact, shapes, _ns(ns), sparsity, as_json, fmt=fmt)
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        for n, s in data["summary"].items():
            speedup = s["geomean_speedup_vs_cublas"]
            click.echo(f"N={n}: geomean speedup vs cuBLAS {speedup:.2f}x over {s['cases']} shapes")


@cli.command(name="eval")
@click.argument("source", metavar="MODEL_OR_ARTIFACT")
@click.option("--text", "text_path", required=True, help="Evaluation text file (one row a line).")
@click.option("--seqlen", default=2048, show_default=True, type=int, help="Window length in tokens.")
@click.option("--max-windows", default=None, type=int, help="Evaluate only the first N windows.")
@click.option("--device", default="cpu", show_default=True, help="cpu|cuda")
@click.option("--dp/--no-dp", "dp", default=True, show_default=True,
              help="Tiled-CBC artifacts: apply the stored dynamic-pruning thresholds to every token.")
@click.option("--tokenizer", default=None,
              help="Tokenizer: a model folder, .gguf file or tokenizer folder (an artifact without one needs it).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def eval_cmd(source, text_path, seqlen, max_windows, device, dp, tokenizer, as_json) -> None:
    """WikiText-2-style perplexity of a model or of an artifact (rebuilt with its stored weights)."""
    from .evaluate import evaluate_source

    res = evaluate_source(source, text_path, seqlen, max_windows, device, dynamic_pruning=dp, tokenizer=tokenizer)
    if as_json:
        click.echo(json.dumps(res, indent=2))
    else:
        click.echo(printable(f"perplexity {res['ppl']:.4f} on {res['windows']} windows of {seqlen} tokens ({source})"))


cli.add_command(summarize_command)  # compressor/batch.py: one table over a folder of artifacts


def _name_env_vars(group: click.Group) -> None:
    """UNIONSPARSE_<COMMAND>_<LONG OPTION> for every option (click's own name would use the Python
    parameter name, e.g. ..._COMPRESS_FMT for --format or ..._INSPECT_AS_JSON for --json)."""
    for cname, cmd in group.commands.items():
        for p in cmd.params:
            longs = [o for o in getattr(p, "opts", []) if o.startswith("--")]
            if isinstance(p, click.Option) and p.envvar is None and longs:
                p.envvar = f"UNIONSPARSE_{cname}_{longs[0][2:]}".upper().replace("-", "_")


_name_env_vars(cli)


def main(argv: list[str] | None = None) -> None:
    """Entry point: maps bad input to one line and exit 2, never a traceback."""
    try:
        cli.main(args=argv, prog_name="unionsparse", standalone_mode=False)
    except UserError as e:
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
        click.echo(printable(f"unionsparse: internal error: {type(e).__name__}: {first} ")
                   + "(set UNIONSPARSE_DEBUG=1 for a traceback, and please report it)", err=True)
        sys.exit(3)
    sys.exit(0)


if __name__ == "__main__":  # pragma: no cover
    main()
