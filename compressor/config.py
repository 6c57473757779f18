"""The compress configuration: every option, validated up front so bad input fails before any work."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..formats import registry
from ..formats.errors import FormatError
from .errors import UserError
from .quantize.modes import QUANT_MODES, QuantMode

PRUNE_METHODS = ("wanda", "sparsegpt", "magnitude", "none")
REORDER_METHODS = ("auto", "dp", "cpsat", "none")
SPARSITY_PROFILES = ("uniform", "owl")
STRUCTURES = ("unstructured", "union")  # --structure (compressor/pruning/union.py)
ACT_SPARSITY_PROFILES = ("uniform", "greedy")
DEVICES = ("cpu", "cuda")
CALIB_SUFFIXES = (".json", ".jsonl", ".json.gz", ".parquet")
CALIB_NAMES = ("builtin", "c4", "alpaca")  # builtin: the English text bundled in the package (offline)
MAX_AUTO_OUTLIERS = 128  # --keep-outliers auto: Atom's 128 channels, at most a quarter of a layer's K


def option(default, *flags: str, help: str | None = None, choices=None, type=None, metavar: str | None = None,
           multiple: bool = False):
    """One compress option: the configuration field and its command-line flag in one place. ``cli.py`` builds the
    ``compress`` command's options from these (flags, help, choices shown, type), and
    :meth:`CompressConfig.validate` checks the values, choices included, whichever way they came (flags, a recipe
    file, Python). ``choices``: a tuple, or a callable giving it when asked (the registered formats)."""
    return dataclasses.field(default=default, metadata={"cli": {
        "flags": flags, "help": help, "choices": choices, "type": type, "metavar": metavar, "multiple": multiple}})


@dataclass
class CompressConfig:
    """Every compress option (the command line's ``compress`` flags are built from the ``option`` fields, in this
    order)."""

    model: str
    output: str
    prune: str = option("magnitude", "--prune", choices=PRUNE_METHODS, help="Pruning method.")
    sparsity: float = option(0.5, "--sparsity")
    nm: str | None = option(None, "--nm", help="N:M semi-structured mask such as 2:4 (instead of unstructured).")
    structure: str = option("unstructured", "--structure", choices=STRUCTURES,
                            help="unstructured (per row), or union: IE-BME's union positions pruned whole, so the "
                                 "stored bytes and the decode time shrink with the sparsity (docs/pruning.md).")
    union_density: float | None = option(None, "--union-density", type=float,
                                         help="--structure union: the fraction of union positions kept, above "
                                              "1 - sparsity: each row then prunes within them (more bytes, less "
                                              "quality loss). Default: 1 - sparsity.")
    sparsity_profile: str = option("uniform", "--sparsity-profile", choices=SPARSITY_PROFILES)
    quant: str = option("w4a4", "--quant", choices=tuple(QUANT_MODES),
                        help="Weight/activation bits (none: fp16 values, tiled-cbc). On Hopper w4a8 runs as fast as "
                             "w4a4 and keeps more quality (README, Settings that keep quality).")
    group_size: int = option(128, "--group-size")
    gptq: bool = option(False, "--gptq", help="GPTQ weight error feedback (needs --prune wanda|sparsegpt).")
    clip_search: bool = option(False, "--clip-search", help="Per-group weight clip ratios scored on calibration H.")
    keep_outliers: int | str = option(
        "auto", "--keep-outliers", metavar="auto|N",
        help="Atom: the N most active input channels (from calibration) as an 8-bit side matrix (ie-bme, w4a4|w2a4|"
             "w4a8|w2a8). auto: min(128, K/4) per layer where that applies (ie-bme with quantized activations), "
             "else 0; 0: none.")
    format: str = option(registry.names()[0], "--format", choices=registry.names)
    tile: str | None = option(None, "--tile", help="Local tile HxW (ie-bme 16x64, tiled-cbc 256x16).")
    areas: str = option("2x2", "--areas", help="IE-BME area grid R_AxC_A.")
    reorder: str = option("auto", "--reorder", choices=REORDER_METHODS, help="Row reordering (ie-bme).")
    calib: str = option("builtin", "--calib",
                        help="Calibration text: builtin (English text bundled with unionsparse, offline)|c4|alpaca "
                             "(hub)|PATH (.json/.jsonl/.json.gz/.parquet).")
    nsamples: int = option(128, "--nsamples")
    seqlen: int = option(2048, "--seqlen")
    seed: int = option(0, "--seed")
    device: str = option("cpu", "--device", choices=DEVICES)
    workers: int | None = option(None, "--workers", type=int, help="Local Dask workers for reordering/encoding.")
    scheduler: str | None = option(None, "--scheduler", help="Address of an existing Dask scheduler.")
    act_sparsity: float = option(
        0.0, "--act-sparsity", "--dp-sparsity",
        help="Activation sparsity (TEAL) target: per-layer thresholds for formats whose decode kernel skips small "
             "inputs (tiled-cbc). --dp-sparsity: the old name, kept for one release.")
    act_sparsity_profile: str = option("uniform", "--act-sparsity-profile", "--dp-profile",
                                       choices=ACT_SPARSITY_PROFILES,
                                       help="Per-layer targets: uniform, or greedy (TEAL).")
    # the dynamic-pruning calibration text (TEAL: Alpaca), any --calib form
    act_sparsity_calib: str = option("alpaca", "--act-sparsity-calib", "--dp-calib",
                                     help="Activation-sparsity calibration text: c4|alpaca|PATH (as --calib).")
    # per-layer rules (compressor/layer_rules.py)
    targets: tuple[str, ...] = option((), "--targets", multiple=True, metavar="REGEX",
                                      help="Compress only the decoder linears whose module path matches (repeatable; "
                                           "default: all).")
    ignore: tuple[str, ...] = option((), "--ignore", multiple=True, metavar="REGEX",
                                     help="Keep the matching decoder linears dense fp16 (repeatable).")
    layer_overrides: tuple[dict, ...] = option(
        (), "--layer-overrides", metavar="JSON", type=str,
        help='Per-layer options, e.g. \'[{"match": ".*down_proj", "quant": "w4a16"}]\' (docs/cli.md, "Per-layer '
             'rules"); usually from a recipe file.')
    resume: bool = option(False, "--resume", help="Continue an interrupted run after its last complete layer.")
    overwrite: bool = option(False, "--overwrite", help="Replace OUT.zarr if it exists.")

    # ------------------------------------------------------------------ derived
    @property
    def quant_mode(self) -> QuantMode:
        return QUANT_MODES[self.quant]

    @property
    def bits(self) -> int | None:
        """Weight bits (None: float16 weights)."""
        return self.quant_mode.weight_bits

    @property
    def act_bits(self) -> int:
        """Activation bits (16: float16 activations, ``quantize.modes.FP16_ACTIVATIONS``)."""
        return self.quant_mode.act_bits

    @property
    def fmt(self) -> registry.Format:
        return registry.get(self.format)

    @property
    def tile_shape(self) -> tuple[int, int]:
        return parse_grid("--tile", self.tile) if self.tile else self.fmt.default_tile

    @property
    def area_grid(self) -> tuple[int, int]:
        return parse_grid("--areas", self.areas)

    @property
    def requested_sparsity(self) -> float:
        """The fraction of weights pruning removes (N:M: 1 - N/M; --prune none: 0)."""
        if self.prune == "none":
            return 0.0
        if self.nm:
            from .pruning.nm import parse_nm

            n, m = parse_nm(self.nm)
            return 1 - n / m
        return float(self.sparsity)

    @property
    def outliers_apply(self) -> bool:
        """Whether outlier channels exist for these options: an 8-bit side matrix next to 4-bit activations."""
        return self.quant_mode.quantizes_activations and self.fmt.outlier_side

    def notes(self) -> list[str]:
        """Advice on accepted options that a user who ships to GPUs would not pick knowingly (compress prints it)."""
        q = self.quant_mode
        if not q.quantizes_activations or self.fmt.takes_quantized_activations:
            return []
        why = ("; without outlier channels (ie-bme only) its 4-bit activations give noise (README, \"Settings that "
               "keep quality\")") if q.act_bits < 8 else ""
        return [f"--format {self.format} --quant {self.quant}: no GPU kernel of {self.format} takes quantized "
                f"activations, so the GPU runtime refuses the artifact (the CPU runs it){why}; for a GPU pick "
                "--quant w4a16 (4-bit values) or none (fp16 values)"]

    def outliers_for(self, k: int) -> int:
        """The outlier channels of a layer with ``k`` input channels: an explicit N, or ``auto``:
        ``min(128, k // 4)`` where outliers apply (IE-BME with 4-bit activations), else 0."""
        if self.keep_outliers == "auto":
            return min(MAX_AUTO_OUTLIERS, k // 4) if self.outliers_apply else 0
        return int(self.keep_outliers)

    @property
    def uses_outliers(self) -> bool:
        """Whether the run keeps outlier channels in some layer (they are chosen from calibration statistics):
        the run's own options, or those of a per-layer override."""
        variants = [self] + [self._override_variant(o) for o in self.layer_overrides if isinstance(o, dict)]
        return any(v is not None and _outliers_set(v.keep_outliers) and v.outliers_apply for v in variants)

    def _override_variant(self, entry: dict) -> CompressConfig | None:
        """The run's options with one override entry's quant / format / keep_outliers (None: not valid ones)."""
        opts = {str(k).replace("-", "_"): v for k, v in entry.items()}
        keys = {k: opts[k] for k in ("quant", "format", "keep_outliers") if k in opts}
        if not keys or opts.get("dense") is True:
            return None
        if keys.get("quant", self.quant) not in QUANT_MODES or keys.get("format", self.format) not in registry.names():
            return None  # validation names the bad value
        return dataclasses.replace(self, **keys)

    @property
    def needs_calibration(self) -> bool:
        return self.prune in ("wanda", "sparsegpt") or self.act_sparsity > 0 or self.uses_outliers

    def to_dict(self) -> dict:
        """The recipe stored in the artifact: everything that changes its bytes (not paths or -o)."""
        d = dataclasses.asdict(self)
        for k in ("output", "resume", "overwrite", "workers", "scheduler"):
            d.pop(k)
        d["tile"] = list(self.tile_shape)
        d["targets"], d["ignore"] = list(self.targets), list(self.ignore)
        d["layer_overrides"] = [dict(o) for o in self.layer_overrides]
        if not (self.needs_calibration or self.sparsity_profile == "owl"):  # settings this run never used
            for k in ("calib", "nsamples", "seqlen", "seed"):
                d.pop(k)
        if self.act_sparsity == 0:
            d.pop("act_sparsity_profile")
            d.pop("act_sparsity_calib")
        return d

    @property
    def rules(self):
        """The per-layer rules, compiled (``layer_rules.LayerRules``)."""
        from .layer_rules import parse_rules

        return parse_rules(self.targets, self.ignore, self.layer_overrides)

    # --------------------------------------------------------------- validation
    def validate(self) -> CompressConfig:
        """Every option, the per-layer rules' form, the files named and the model source; before any work."""
        self.validate_options()
        self.rules  # noqa: B018 - compiles the patterns, raises UserError on a bad one
        self._validate_sources()
        return self

    def validate_options(self) -> CompressConfig:
        """The options alone (also each layer's options under the per-layer rules)."""
        self._check_choices()
        if not (0.0 <= self.sparsity < 1.0):
            raise UserError(f"--sparsity must lie in [0, 1), got {self.sparsity}")
        if not (0.0 <= self.act_sparsity < 1.0):
            raise UserError(f"--act-sparsity must lie in [0, 1), got {self.act_sparsity}")
        if self.act_sparsity > 0 and not self.fmt.activation_sparsity:
            raise UserError(f"--act-sparsity: {self.format} has no activation-sparsity kernel; use --format "
                            f"{' or '.join(registry.names_with('activation_sparsity'))}")
        if self.act_sparsity > 0 and self.quant_mode.quantizes_activations:
            raise UserError(f"--act-sparsity: the spMspV kernel takes fp16 activations, not --quant {self.quant}; "
                            "use --quant none or w4a16")
        if self.act_sparsity_profile == "greedy" and self.act_sparsity == 0:
            raise UserError("--act-sparsity-profile greedy needs a dynamic sparsity target (--act-sparsity > 0)")
        if self.act_sparsity_profile == "greedy" and self.act_sparsity > 0.95:
            raise UserError(f"--act-sparsity-profile greedy: --act-sparsity {self.act_sparsity} exceeds the "
                            "per-layer cap 0.95")
        if self.nm is not None:
            from .pruning.nm import parse_nm

            parse_nm(self.nm)
            if self.prune == "none":
                raise UserError("--nm needs a pruning method (--prune magnitude|wanda|sparsegpt)")
        self._validate_structure()
        if self.prune == "none" and self.sparsity_profile != "uniform":
            raise UserError("--sparsity-profile owl needs a pruning method")
        if self.group_size <= 0:
            raise UserError(f"--group-size must be a positive integer, got {self.group_size}")
        if (self.gptq or self.clip_search) and self.quant == "none":
            raise UserError("--gptq/--clip-search quantize weights; pick --quant w4a4|w2a4|w4a8|w2a8|w4a16")
        if (self.gptq or self.clip_search) and self.prune not in ("wanda", "sparsegpt"):
            raise UserError("--gptq/--clip-search need calibration statistics: use --prune wanda|sparsegpt")
        self._validate_outliers()
        if self.bits is None and not self.fmt.holds_fp16:
            raise UserError(f"--quant none: {self.format} stores integer codes; use --format "
                            f"{' or '.join(registry.names_with('holds_fp16'))} for fp16")
        if not self.fmt.reorders_rows and self.reorder not in ("auto", "none"):
            raise UserError(f"--reorder: {self.format} takes no row permutations")
        try:
            self.fmt.check_geometry(self.tile_shape, bits=self.bits, areas=self.area_grid,
                                    group_size=None if self.bits is None else self.group_size)
        except FormatError as e:
            raise UserError(f"--tile/--areas/--group-size: {e}") from None
        if self.nsamples <= 0:
            raise UserError(f"--nsamples must be positive, got {self.nsamples}")
        if self.seqlen <= 0:
            raise UserError(f"--seqlen must be positive, got {self.seqlen}")
        if self.workers is not None and self.workers <= 0:
            raise UserError(f"--workers must be positive, got {self.workers}")
        if self.workers is not None and self.scheduler is not None:
            raise UserError("--workers and --scheduler are exclusive")
        return self

    def _check_choices(self) -> None:
        """Every option that has choices, against its field's ``choices``: the one check of them (the command line
        lists them in its help but leaves the check here, whichever way a value came)."""
        for f in dataclasses.fields(self):
            meta = f.metadata.get("cli")
            if meta is not None and meta["choices"]:
                allowed = meta["choices"]() if callable(meta["choices"]) else meta["choices"]
                choice("/".join(meta["flags"]), getattr(self, f.name), tuple(allowed))  # old names too

    def _validate_sources(self) -> None:
        """Files the options name, the model source, the context length and the device."""
        if self.act_sparsity_calib not in CALIB_NAMES:  # a file the user names must exist, used or not
            check_calib_path(self.act_sparsity_calib, "--act-sparsity-calib")
        if self.calib not in CALIB_NAMES:
            check_calib_path(self.calib)
        from .model.loading import check_source
        from .preflight import MAX_SEQLEN, check_seqlen, source_context

        check_source(self.model)
        if self.seqlen > MAX_SEQLEN or self.needs_calibration or self.sparsity_profile == "owl":
            check_seqlen("--seqlen", self.seqlen, source_context(self.model), self.model)
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise UserError("--device cuda: no CUDA device is available here (use --device cpu)")

    def _validate_structure(self) -> None:
        """``--structure union``: IE-BME's union positions, pruned by a per-row-set metric (magnitude, Wanda), on the
        stored column order (no outlier channels, which move columns)."""
        if self.structure != "union":
            if self.union_density is not None:
                raise UserError("--union-density needs --structure union")
            return
        d = self.union_density
        if d is not None and not (1 - self.sparsity <= d <= 1):
            raise UserError(f"--union-density must lie in [1 - sparsity, 1] = [{1 - self.sparsity:g}, 1], got {d}")
        if "areas" not in self.fmt.extra_geometry:  # the union bitmap over a tile's areas (IE-BME)
            names = [n for n in registry.names() if "areas" in registry.get(n).extra_geometry]
            raise UserError(f"--structure union: {self.format} has no union bitmap over areas; use --format "
                            f"{' or '.join(names)}")
        if self.prune not in ("magnitude", "wanda"):
            raise UserError(f"--structure union: use --prune magnitude or wanda, not {self.prune}")
        if self.nm is not None:
            raise UserError("--nm and --structure union are exclusive")
        if self.outliers_apply and parse_keep_outliers(self.keep_outliers) != 0:
            raise UserError("--structure union: outlier channels reorder the columns the union positions group; "
                            "use --keep-outliers 0, or --quant w4a16 (no activation quantization, no outliers)")

    @property
    def union(self) -> tuple[tuple[int, int], tuple[int, int], float | None] | None:
        """The (tile, areas, union density) a union-structured mask follows; None for an unstructured one."""
        return (self.tile_shape, self.area_grid, self.union_density) if self.structure == "union" else None

    def _validate_outliers(self) -> None:
        """``--keep-outliers auto|N``: an explicit N > 0 needs IE-BME with 4-bit activations; N < K is checked on
        the model. Channels are chosen from calibration statistics, which a run with outliers collects whatever
        its pruning method (``needs_calibration``)."""
        self.keep_outliers = n = parse_keep_outliers(self.keep_outliers)
        if n == "auto" or n == 0:
            return
        if not self.quant_mode.quantizes_activations:
            raise UserError(f"--keep-outliers {n}: outlier channels are kept at 8 bits next to quantized activations; "
                            f"use --quant w4a4, w2a4, w4a8 or w2a8, not {self.quant} (or --keep-outliers auto)")
        if not self.fmt.outlier_side:
            raise UserError(f"--keep-outliers {n}: {self.format} has no 8-bit side matrix; use --format "
                            f"{' or '.join(registry.names_with('outlier_side'))} "
                            "(or --keep-outliers auto)")


def parse_keep_outliers(value) -> int | str:
    """``--keep-outliers``: ``auto`` or a non-negative integer (an int, or its digits from a recipe or the
    environment); UserError otherwise."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if text.isdigit():
            return int(text)
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise UserError(f"--keep-outliers must be auto or a non-negative integer, got {value!r}")


def _outliers_set(value) -> bool:
    """``keep_outliers`` asks for some channels (auto or N > 0); a bad value is left to validation."""
    try:
        return parse_keep_outliers(value) != 0
    except UserError:
        return False


def choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    """UserError naming ``flag`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise UserError(f"{flag}: unknown value {value!r} (choose from {', '.join(allowed)})")


def parse_grid(flag: str, text: str) -> tuple[int, int]:
    """'16x64' -> (16, 64)."""
    try:
        a, b = (int(v) for v in str(text).lower().split("x"))
    except ValueError:
        raise UserError(f"{flag}: expected ROWSxCOLS such as 16x64, got {text!r}") from None
    if a <= 0 or b <= 0:
        raise UserError(f"{flag}: both sides must be positive, got {text!r}")
    return a, b


def check_calib_path(path: str, flag: str = "--calib") -> None:
    p = Path(path)
    if not p.name.endswith(CALIB_SUFFIXES):
        raise UserError(f"{flag}: {path} is not {', '.join(CALIB_NAMES)} or a {'/'.join(CALIB_SUFFIXES)} file")
    if not p.is_file():
        raise UserError(f"{flag}: file {path} does not exist")
