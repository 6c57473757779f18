"""Zero-shot task accuracy through lm-evaluation-harness, offline, on a model or a rebuilt artifact.

``unionsparse eval SOURCE --tasks arc_easy,hellaswag --tasks-data DIR``: each task is lm-eval's own (its
prompt, choices and metrics, from the installed ``lm_eval``), but its rows come from local files, never
from the hub: ``DIR/<task>/<split>.jsonl`` (or ``.json`` / ``.parquet``), the rows of the hub data set's
split in its own columns. For every task, a small YAML file that ``include:``\\ s lm-eval's and replaces
its data source (``dataset_path: json``, ``data_files``) is given to a ``TaskManager`` of these files only.
The model is the one perplexity evaluates (:func:`.perplexity.load_for_eval`: an artifact is rebuilt with
its stored weights and arithmetic), wrapped in lm-eval's ``HFLM``. Everything runs with
``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` set, and every argument and data file is checked before
the model is loaded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..errors import UserError

log = logging.getLogger(__name__)

__all__ = ["evaluate_tasks", "format_table", "check_eval_mode", "check_task_args", "task_plan", "MIN_LM_EVAL"]

MIN_LM_EVAL = "0.4.13"  # the TaskManager / simple_evaluate API this module is written and tested against
INSTALL_HINT = "pip install 'unionsparse[tasks]'"
DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclass
class TaskPlan:
    """One task: lm-eval's YAML, its config, and the local files that replace its data source."""

    name: str
    yaml_path: Path
    config: dict
    files: dict[str, Path]  # split name -> local file
    builder: str  # "json" or "parquet"
    scored: str  # the split whose rows are scored
    source: str  # the hub data set the rows come from, e.g. "allenai/ai2_arc ARC-Easy"


# ------------------------------------------------------------------------------------------ arguments


def check_eval_mode(text: str | None, max_windows: int | None, tasks: str | None, limit: int | None,
                    batch_size: int | None) -> bool:
    """True for ``eval --tasks``, False for perplexity (``--text``); the options of the other mode are refused."""
    if tasks is None:
        if text is None:
            raise UserError("eval needs --text FILE (perplexity) or --tasks NAMES (lm-eval tasks)")
        for flag, value in (("--limit", limit), ("--batch-size", batch_size)):
            if value is not None:
                raise UserError(f"{flag} applies to --tasks only (perplexity uses --max-windows)")
        return False
    if text is not None:
        raise UserError("--text and --tasks: give one of them (perplexity, or lm-eval tasks)")
    if max_windows is not None:
        raise UserError("--max-windows applies to --text (perplexity) only; use --limit with --tasks")
    return True


def parse_tasks(text: str) -> list[str]:
    """``--tasks a,b``: task names, in order, without repeats."""
    names = [t.strip() for t in (text or "").split(",") if t.strip()]
    if not names:
        raise UserError("--tasks: give one or more lm-eval task names, e.g. --tasks arc_easy,hellaswag")
    for n in names:
        if not NAME.match(n):
            raise UserError(f"--tasks: {n!r} is not a task name (letters, digits, _ . -; no globs or paths)")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"--tasks: {dup[0]} is named twice")
    return names


def check_task_args(tasks: str, data_dir: str | None, limit: int | None, batch_size: int | None,
                    device: str) -> tuple[list[str], Path]:
    """Every option of ``eval --tasks`` (no file read but ``DIR``'s existence); returns (names, DIR)."""
    names = parse_tasks(tasks)
    if limit is not None and limit < 1:
        raise UserError(f"--limit must be >= 1, got {limit}")
    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device: unknown value {device!r} (choose from cpu, cuda)")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device is available here (use --device cpu)")
    if not data_dir:
        raise UserError("--tasks needs --tasks-data DIR (or UNIONSPARSE_EVAL_TASKS_DATA): the folder holding "
                        "DIR/<task>/<split>.jsonl; task data is never downloaded")
    d = Path(data_dir).expanduser()
    if not d.is_dir():
        raise UserError(f"--tasks-data {data_dir}: folder does not exist")
    return names, d


def require_lm_eval():
    """The installed ``lm_eval`` package, at least :data:`MIN_LM_EVAL`; one line naming the extra if not."""
    try:
        import lm_eval
    except ImportError:
        raise UserError(f"--tasks needs lm-evaluation-harness: {INSTALL_HINT}") from None
    from packaging.version import Version

    found = _dist_version("lm_eval") or getattr(lm_eval, "__version__", "0")
    if Version(found) < Version(MIN_LM_EVAL):
        raise UserError(f"--tasks needs lm_eval >= {MIN_LM_EVAL}, found {found}: pip install -U 'unionsparse[tasks]'")
    return lm_eval


# ------------------------------------------------------------------------------------------ task configs


def _yaml_loader(base: Path) -> type[yaml.SafeLoader]:
    """A safe YAML loader that keeps lm-eval's ``!function`` references as strings (they are not run here)."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: str(base / loader.construct_scalar(node)))
    return Loader


def read_task_config(path: Path, _seen: tuple[Path, ...] = ()) -> dict:
    """A task YAML with its ``include:`` files merged under it (the including file's keys win)."""
    path = path.resolve()
    if path in _seen:
        raise UserError(f"--tasks: include cycle at {path}")
    with path.open("rb") as fh:
        cfg = yaml.load(fh, Loader=_yaml_loader(path.parent))  # noqa: S506 - a SafeLoader subclass
    if not isinstance(cfg, dict):
        raise UserError(f"--tasks: {path} is not a task config")
    inc = cfg.pop("include", None)
    merged: dict = {}
    for p in [] if inc is None else inc if isinstance(inc, list) else [inc]:
        merged.update(read_task_config(path.parent / p, (*_seen, path)))
    return merged | cfg


def lm_eval_tasks_dir() -> Path:
    spec = importlib.util.find_spec("lm_eval")
    return Path(next(iter(spec.submodule_search_locations))) / "tasks"


def find_task_yaml(name: str, root: Path | None = None) -> Path:
    """The YAML file of lm-eval's task ``name``: the first (sorted) file under lm_eval/tasks that declares
    ``task: name`` (a text scan, ~1 s, instead of indexing every task, ~10 s)."""
    root = root or lm_eval_tasks_dir()
    line = re.compile(rf"^task:\s*['\"]?{re.escape(name)}['\"]?\s*(#.*)?$", re.M)
    for p in sorted(root.rglob("*.yaml"), key=lambda q: q.as_posix()):
        try:
            if line.search(p.read_text(encoding="utf-8", errors="replace")):
                return p
        except OSError:
            continue
    raise UserError(f"--tasks {name}: no such task in lm_eval (groups and tags such as mmlu or ai2_arc are not "
                    "taken: name their tasks, e.g. arc_easy,arc_challenge)")


def eval_splits(name: str, cfg: dict) -> list[str]:
    """The splits the task reads at 0 or its own few-shot: the one it scores (test, else validation) and, for a
    task whose YAML asks for few-shot examples, the split they come from."""
    if "class" in cfg or cfg.get("custom_dataset") or not isinstance(cfg.get("dataset_path"), str):
        raise UserError(f"--tasks {name}: this task reads its data through its own code; only tasks with a "
                        "dataset_path can use local files")
    scored = cfg.get("test_split") or cfg.get("validation_split")
    if not scored:
        raise UserError(f"--tasks {name}: the task names no test or validation split")
    need = [scored]
    if int(cfg.get("num_fewshot") or 0) > 0:
        shots = cfg.get("fewshot_split") or cfg.get("training_split") or cfg.get("validation_split")
        if shots and shots not in need:
            need.append(shots)
    return need


def split_file(folder: Path, split: str) -> Path | None:
    """``folder/<split>.jsonl|.json|.parquet`` (exactly one of them), or None."""
    found = [folder / f"{split}{s}" for s in DATA_SUFFIXES if (folder / f"{split}{s}").is_file()]
    if len(found) > 1:
        raise UserError(f"--tasks-data: {found[0]} and {found[1]} both hold split {split!r}; keep one")
    return found[0] if found else None


def hub_source(cfg: dict) -> str:
    return " ".join(str(v) for v in (cfg.get("dataset_path"), cfg.get("dataset_name")) if v)


def local_files(name: str, cfg: dict, data_dir: Path) -> dict[str, Path]:
    """split -> file for every split of the task that ``DIR/<task>/`` holds; the splits it reads must be there."""
    folder = data_dir / name
    source = hub_source(cfg)
    for split in eval_splits(name, cfg):
        f = split_file(folder, split)
        if f is None:
            raise UserError(f"--tasks {name}: no local data: {folder / split}.jsonl is missing (or .json/.parquet: "
                            f"the rows of {source} split {split!r}; see docs/cli.md, eval --tasks)")
        if f.stat().st_size == 0:
            raise UserError(f"--tasks {name}: {f} is empty")
    splits = {cfg.get(k) for k in ("training_split", "validation_split", "test_split", "fewshot_split")} - {None}
    files = {s: f for s in sorted(splits) if (f := split_file(folder, s)) is not None}
    if len({DATA_SUFFIXES[f.suffix] for f in files.values()}) > 1:
        raise UserError(f"--tasks-data: {folder} mixes parquet and json files; use one format per task")
    return files


def task_plan(names: list[str], data_dir: Path) -> list[TaskPlan]:
    """Each task's lm-eval YAML and local files, checked (one line naming the task and the file if not)."""
    plans = []
    root = lm_eval_tasks_dir()
    for name in names:
        path = find_task_yaml(name, root)
        cfg = read_task_config(path)
        files = local_files(name, cfg, data_dir)
        plans.append(TaskPlan(name, path, cfg, files, DATA_SUFFIXES[next(iter(files.values())).suffix],
                              eval_splits(name, cfg)[0], hub_source(cfg)))
    return plans


def override_yaml(plan: TaskPlan) -> str:
    """A task YAML that includes lm-eval's and reads the local files; splits without a file are dropped."""
    cfg = plan.config
    over = {"include": str(plan.yaml_path), "task": plan.name, "dataset_path": plan.builder, "dataset_name": None,
            "dataset_kwargs": {"data_files": {s: str(f.resolve()) for s, f in plan.files.items()}}}
    for key in ("training_split", "validation_split", "test_split", "fewshot_split"):
        if cfg.get(key) is not None:
            over[key] = cfg[key] if cfg[key] in plan.files else None
    return yaml.safe_dump(over, sort_keys=False)


# ------------------------------------------------------------------------------------------ running


@contextlib.contextmanager
def offline():
    """``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` for the run, also in the already-imported hub clients'
    settings (they read the variables at import); everything is put back afterwards."""
    import datasets.config
    import huggingface_hub.constants as hub

    env = {v: os.environ.get(v) for v in OFFLINE_VARS}
    attrs = [(hub, "HF_HUB_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE")]
    saved = [(m, a, getattr(m, a)) for m, a in attrs if hasattr(m, a)]
    os.environ.update(dict.fromkeys(OFFLINE_VARS, "1"))
    for m, a, _ in saved:
        setattr(m, a, True)
    try:
        yield
    finally:
        for m, a, v in saved:
            setattr(m, a, v)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def load_tasks(plans: list[TaskPlan], limit: int | None):
    """lm-eval's Task objects, their data read from the local files and the rows to be scored checked against
    the task's prompt; a file it cannot read or a row that does not fit is one line naming the task and file."""
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory(prefix="unionsparse-tasks-") as tmp:
        for p in plans:
            (Path(tmp) / f"{p.name}.yaml").write_text(override_yaml(p), encoding="utf-8")
        manager = TaskManager(include_path=tmp, include_defaults=False)
        tasks = []
        for p in plans:  # one at a time, so that an unreadable file is named with its task
            try:
                task = manager.load([p.name])["tasks"][p.name]
            except Exception as e:  # noqa: BLE001 - datasets' errors on a malformed file are many types
                files = ", ".join(str(f) for f in p.files.values())
                raise UserError(f"--tasks {p.name}: cannot use {files} ({_first_line(e)}); the rows need the "
                                f"columns of {p.source}") from None
            check_rows(p, task, limit)
            tasks.append(task)
    return manager, tasks


def check_rows(plan: TaskPlan, task, limit: int | None) -> None:
    """The rows to be scored render to a prompt, a target and (multiple choice) the choices: a file of the
    wrong columns is refused here, not after the model is rebuilt."""
    docs = task.eval_docs
    where = plan.files[plan.scored]
    n = len(docs) if limit is None else min(limit, len(docs))
    if n == 0:
        raise UserError(f"--tasks {plan.name}: {where} holds no rows")
    for i in range(n):
        doc = docs[i]
        try:
            task.doc_to_text(doc)
            task.doc_to_target(doc)
            if task.config.output_type == "multiple_choice":
                task.doc_to_choice(doc)
        except Exception as e:  # noqa: BLE001 - a template or a task's own function on the user's row
            raise UserError(f"--tasks {plan.name}: row {i + 1} of {where} does not fit the task "
                            f"({_first_line(e)}); the rows need the columns of {plan.source}") from None


def run_tasks(model, tokenizer, manager, tasks, limit: int | None, batch_size: int) -> dict:
    """``lm_eval.simple_evaluate`` of ``HFLM`` on the model as given (zero-shot unless a task's YAML says)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    quiet = log.getEffectiveLevel() > logging.INFO  # lm-eval's own warnings only at --log-level info/debug
    if tokenizer.bos_token_id is None and tokenizer.eos_token_id is None:
        raise UserError("MODEL: its tokenizer has neither a BOS nor an EOS token, one of which lm-eval puts before "
                        "every scored text")
    lm_log = logging.getLogger("lm_eval")
    level = lm_log.level
    if quiet:
        lm_log.setLevel(logging.ERROR)
    try:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                       log_samples=False, write_out=False)
    finally:
        lm_log.setLevel(level)


def _number(v):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def summarize(raw: dict, names: list[str]) -> dict:
    """Per task: every metric lm-eval reports (``acc``, ``acc_norm``, ...) with its standard error, and the
    number of items scored. Metrics under a filter other than ``none`` keep it: ``name,filter``."""
    out = {}
    for name in names:
        row = raw["results"][name]
        metrics: dict[str, dict] = {}
        for key, value in row.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            label = metric if filt == "none" else key
            metrics[label] = {"value": _number(value), "stderr": _number(row.get(f"{metric}_stderr,{filt}"))}
        n = (raw.get("n-samples") or {}).get(name) or {}
        version = (raw.get("versions") or {}).get(name)
        out[name] = {"metrics": metrics, "samples": n.get("effective"), "version": version}
    return out


def evaluate_tasks(source, tasks: str, data_dir: str | None, limit: int | None = None,
                   batch_size: int | None = None, device: str = "cpu", dynamic_pruning: bool = True,
                   tokenizer: str | None = None, verify: bool = True) -> dict:
    """lm-eval task metrics of MODEL or an artifact (a path or an open Artifact; rebuilt; ``verify``: its manifest
    checked), offline; returns a dict for the CLI and --json."""
    names, folder = check_task_args(tasks, data_dir, limit, batch_size, device)
    lm_eval = require_lm_eval()
    plans = task_plan(names, folder)  # every file checked before the model is loaded
    t0 = time.perf_counter()
    from . import perplexity  # the loader perplexity uses: the same rebuilt model

    with offline():
        manager, task_objs = load_tasks(plans, limit)
        model, tok, kind = perplexity.load_for_eval(source, dynamic_pruning=dynamic_pruning, tokenizer=tokenizer,
                                                    verify=verify)
        model.to(device)
        raw = run_tasks(model, tok, manager, task_objs, limit, batch_size or 1)
    from ...formats.arithmetic.sparse_inputs import activation_sparsity_summary

    return {
        "source": perplexity.source_name(source),
        "kind": kind,
        "tasks": summarize(raw, names),
        "tasks_data": str(folder),
        "limit": limit,
        "batch_size": batch_size or 1,
        "lm_eval": _dist_version("lm_eval") or getattr(lm_eval, "__version__", None),
        "dynamic_pruning": activation_sparsity_summary(model),
        "seconds": time.perf_counter() - t0,
    }


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def format_table(res: dict) -> str:
    """The metrics as a small fixed-width table, one row per task and metric."""
    def num(v):
        return "-" if v is None else f"{v:.4f}"

    rows = [("task", "metric", "value", "stderr", "n")]
    for name, t in res["tasks"].items():
        for metric, m in t["metrics"].items():
            rows.append((name, metric, num(m["value"]), num(m["stderr"]), str(t["samples"] or "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    return "\n".join(lines + [f"({res['source']}, lm_eval {res['lm_eval']}"
                              + (f", --limit {res['limit']}" if res["limit"] else "") + ")"])

