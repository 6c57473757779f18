"""Compress recipes as files: `compress --config recipe.yaml|recipe.json|OUT.zarr`.

A recipe is a flat mapping whose keys are the long names of `compress` options with `_` for `-`
(``sparsity``, ``group_size``, ``format``, ``tile`` ...) plus ``model``. Every artifact stores its resolved
recipe (root attribute ``config``), so ``--config OUT.zarr`` (or the YAML that ``inspect --recipe``
prints) rebuilds the same bytes. Command-line flags and environment variables override the file; a
key that names no option is an error that names the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from .errors import UserError

# Options that describe one run, not the recipe: never read from a file.
RUN_ONLY = ("config_file", "output", "quiet", "as_json", "log_level")


def option_keys(command: click.Command) -> dict[str, str]:
    """Recipe key -> click parameter name, for every option of ``command`` (old names too: ``dp_sparsity``)."""
    keys: dict[str, str] = {}
    for p in command.params:
        if p.name in RUN_ONLY:
            continue
        if isinstance(p, click.Argument):
            keys[p.name] = p.name
            continue
        longs = [o for o in p.opts if o.startswith("--")] or [f"--{p.name}"]
        for opt in longs:  # every long name: an old name (--dp-sparsity) reads old recipes and artifacts
            keys[opt[2:].replace("-", "_")] = p.name
    return keys


def read_recipe(path: str) -> dict:
    """The recipe mapping stored in ``path``: a .yaml/.yml/.json file, or an artifact's stored recipe."""
    p = Path(path)
    if p.is_dir():
        from .artifact.store import Artifact

        cfg = Artifact(p, verify=False).attrs.get("config")  # the recipe only: compress reads the model
        if not isinstance(cfg, dict):
            raise UserError(f"--config: artifact {path} stores no recipe")
        return dict(cfg)
    if not p.is_file():
        raise UserError(f"--config: file {path} does not exist")
    text = p.read_text(encoding="utf-8")
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--config: {path} is not valid JSON (line {e.lineno}: {e.msg})") from None
    elif p.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            raise UserError(f"--config: {path} is not valid YAML{where}") from None
    else:
        raise UserError(f"--config: {path} must be a .yaml, .yml or .json file or an OUT.zarr artifact")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"--config: {path} must hold a mapping of option: value, not {type(data).__name__}")
    return data


def to_default_map(recipe: dict, command: click.Command, source: str) -> dict:
    """Recipe -> click default_map (parameter name -> value); unknown keys raise UserError."""
    keys = option_keys(command)
    out = {}
    for key, value in recipe.items():
        k = str(key).replace("-", "_")
        if k not in keys:
            raise UserError(f"--config: {source}: unknown key {key!r} (keys are compress options: "
                            f"{', '.join(sorted(keys))})")
        if value is None:
            continue
        param = next(p for p in command.params if p.name == keys[k])
        if getattr(param, "multiple", False):  # targets, ignore: lists as they are
            value = list(value) if isinstance(value, (list, tuple)) else [value]
        elif isinstance(value, (list, tuple)) and any(isinstance(v, dict) for v in value):  # layer_overrides
            value = json.dumps(list(value))
        elif isinstance(value, (list, tuple)):  # tile: [16, 64] -> "16x64"
            value = "x".join(str(v) for v in value)
        out[keys[k]] = value
    return out


def load_into_context(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """Eager click callback of ``--config``: the file's values become the command's defaults."""
    if value:
        defaults = to_default_map(read_recipe(value), ctx.command, value)
        ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def recipe_yaml(config: dict, header: str | None = None) -> str:
    """A stored recipe as YAML that ``compress --config`` accepts."""
    import yaml

    body = yaml.safe_dump(dict(config), sort_keys=False, default_flow_style=None)
    return (f"# {header}\n" if header else "") + body
