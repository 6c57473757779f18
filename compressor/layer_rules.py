"""Per-layer rules of a recipe, as llm-compressor users know them: ``targets`` / ``ignore`` and overrides.

* ``targets``: regular expressions over module paths (``model.layers.3.mlp.down_proj``); only the decoder
  linears that match one are compressed (empty: all of them).
* ``ignore``: linears that match one are kept dense (float16, in ``dense/``), even when a target matches.
* ``overrides``: a list of ``{match: REGEX, <option>: value, ...}``; every linear that ``match`` matches takes
  those options instead of the run's (later entries win). Options: :data:`OVERRIDABLE`; ``dense: true`` keeps
  the layer dense.

A pattern is a Python regular expression matched against the whole path (``re.fullmatch``); llm-compressor's
``re:`` prefix is accepted and dropped. Every pattern must match at least one linear of the model, and every
layer's resulting options must be valid, before any work starts.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .errors import UserError

OVERRIDABLE = ("sparsity", "quant", "group_size", "format", "tile", "areas", "reorder", "keep_outliers", "dense")


@dataclass(frozen=True)
class LayerRules:
    targets: tuple[re.Pattern, ...] = ()
    ignore: tuple[re.Pattern, ...] = ()
    overrides: tuple[tuple[re.Pattern, dict], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.targets or self.ignore or self.overrides)


def compile_pattern(text: str, where: str) -> re.Pattern:
    if not isinstance(text, str) or not text.strip():
        raise UserError(f"{where}: a pattern must be a non-empty string, got {text!r}")
    body = text[3:] if text.startswith("re:") else text
    try:
        return re.compile(body)
    except re.error as e:
        raise UserError(f"{where}: {text!r} is not a regular expression ({e})") from None


def parse_rules(targets: Iterable[str] = (), ignore: Iterable[str] = (),
                overrides: Sequence[dict] | None = None) -> LayerRules:
    """Compile and check the rules' form (not yet against a model)."""
    over = []
    for i, entry in enumerate(overrides or ()):
        where = f"--layer-overrides entry {i + 1}"
        if not isinstance(entry, dict) or "match" not in entry:
            raise UserError(f"{where}: expected a mapping with a 'match' pattern, got {entry!r}")
        opts = {str(k).replace("-", "_"): v for k, v in entry.items() if k != "match"}
        unknown = sorted(set(opts) - set(OVERRIDABLE))
        if unknown:
            raise UserError(f"{where}: {unknown[0]!r} cannot be set per layer (choose from {', '.join(OVERRIDABLE)})")
        if not opts:
            raise UserError(f"{where}: sets no option")
        if "dense" in opts and not isinstance(opts["dense"], bool):
            raise UserError(f"{where}: dense must be true or false, got {opts['dense']!r}")
        over.append((compile_pattern(entry["match"], where), opts))
    return LayerRules(tuple(compile_pattern(t, "--targets") for t in targets),
                      tuple(compile_pattern(t, "--ignore") for t in ignore), tuple(over))


def _matches(pattern: re.Pattern, name: str) -> bool:
    return pattern.fullmatch(name) is not None


def resolve(rules: LayerRules, cfg, names: Sequence[str]) -> dict[str, object | None]:
    """Each linear's configuration (``cfg`` with its overrides applied, validated) or None when it stays dense.

    ``cfg`` is the run's CompressConfig; raises UserError naming the pattern that matches nothing or the layer
    whose options are invalid.
    """
    for kind, pats in (("--targets", rules.targets), ("--ignore", rules.ignore),
                       ("--layer-overrides match", tuple(p for p, _ in rules.overrides))):
        for p in pats:
            if not any(_matches(p, n) for n in names):
                raise UserError(f"{kind} {p.pattern!r} matches no decoder linear (e.g. {names[0]})")
    out: dict[str, object | None] = {}
    checked: dict[tuple, object] = {}
    for name in names:
        if rules.targets and not any(_matches(p, name) for p in rules.targets):
            out[name] = None
            continue
        if any(_matches(p, name) for p in rules.ignore):
            out[name] = None
            continue
        opts: dict = {}
        for p, o in rules.overrides:
            if _matches(p, name):
                opts.update(o)
        if opts.pop("dense", False):
            out[name] = None
            continue
        key = tuple(sorted(opts.items(), key=lambda kv: kv[0]))
        if key not in checked:
            values = {k: _option_value(k, v) for k, v in opts.items()}
            if "format" in values and values["format"] != cfg.format and "tile" not in values:
                values["tile"] = None  # another format: its own default tile, not the run's
            layer_cfg = dataclasses.replace(cfg, **values)
            try:
                layer_cfg.validate_options()
            except UserError as e:
                raise UserError(f"layer {name} (--layer-overrides {dict(opts)}): {e}") from None
            checked[key] = layer_cfg
        out[name] = checked[key]
    if all(v is None for v in out.values()):
        raise UserError("--targets/--ignore/--layer-overrides leave no decoder linear to compress")
    return out


def _option_value(key: str, value):
    if key in ("tile", "areas") and isinstance(value, (list, tuple)):
        return "x".join(str(v) for v in value)
    return value


def describe(layer_cfgs: dict[str, object | None], run_cfg) -> dict[str, dict]:
    """Per layer, what differs from the run's options (``{"dense": True}`` for a kept-dense layer)."""
    out = {}
    for name, c in layer_cfgs.items():
        if c is None:
            out[name] = {"dense": True}
            continue
        diff = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)
                if f.name in OVERRIDABLE and getattr(c, f.name) != getattr(run_cfg, f.name)}
        if diff:
            out[name] = diff
    return out


def layer_options(recipe: dict, name: str) -> dict | None:
    """A stored recipe's options for one linear under its per-layer rules (None: the rules keep it dense); what
    ``verify`` checks a layer against. A recipe whose rules do not compile keeps its options as they are."""
    if not isinstance(recipe, dict):
        return recipe
    try:
        rules = parse_rules(recipe.get("targets") or (), recipe.get("ignore") or (), recipe.get("layer_overrides"))
    except UserError:
        return recipe
    if (rules.targets and not any(_matches(p, name) for p in rules.targets)) or any(
            _matches(p, name) for p in rules.ignore):
        return None
    opts: dict = {}
    for p, o in rules.overrides:
        if _matches(p, name):
            opts.update(o)
    if opts.pop("dense", False):
        return None
    if "format" in opts and opts["format"] != recipe.get("format") and "tile" not in opts:
        opts["tile"] = None
    return {**recipe, **opts}
