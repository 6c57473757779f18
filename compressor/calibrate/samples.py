"""Calibration samples: the bundled English text, C4 / Alpaca from the hub or a local file, windowed as the
Wanda/SparseGPT code.

``load_calibration(source, tokenizer, nsamples, seqlen, seed)`` returns ``LongTensor [nsamples, seqlen]``.

``builtin`` is ``calibration_en.txt`` next to this module (English prose written for unionsparse, Apache-2.0
as the package; ``calibration_en.md`` says so): documents separated by lines of ``=====``. It is small (tens
of thousands of tokens), so larger requests take overlapping windows (``concat`` sampling, below).

Sampling (``mode="auto"`` picks one of the two, see ``docs/pruning.md``):

* ``documents`` (the reference recipe): ``rng = random.Random(seed)``; for each sample draw random
  documents until one tokenizes to more than ``seqlen`` tokens, then take the window starting at
  ``rng.randint(0, len - seqlen - 1)``. Same draws as the reference's ``random.seed(seed)``.
* ``concat`` (fallback for short documents): shuffle the documents with ``random.Random(seed)``,
  tokenize each without special tokens, join them with the EOS token id, and take ``nsamples``
  windows starting at ``rng.randint(0, total - seqlen)``. Windows may overlap; a warning says so
  when the stream holds fewer than ``nsamples * seqlen`` tokens.

``auto`` uses ``documents`` when the documents longer than ``seqlen`` hold at least
``nsamples * seqlen`` tokens together (found by tokenizing documents in file order until that much
is seen), else ``concat``.
"""

from __future__ import annotations

import gzip
import json
import logging
import random
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..errors import UserError

log = logging.getLogger(__name__)

__all__ = ["load_calibration", "load_documents", "sample_windows", "CalibrationInfo"]

HUB_SOURCES = {
    "c4": ("allenai/c4", {"data_files": {"train": "en/c4-train.00000-of-01024.json.gz"}, "split": "train"}),
    "alpaca": ("tatsu-lab/alpaca", {"split": "train"}),
}
BUILTIN_TEXT = Path(__file__).with_name("calibration_en.txt")
DOCUMENT_SEPARATOR = "====="
LOCAL_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz", ".parquet")
_LOCAL_HINT = (
    "pass a local file with --calib PATH (.json, .jsonl, .json.gz or .parquet; "
    "field 'text', or 'instruction'/'input'/'output')"
)


class CalibrationInfo(dict):
    """What ``load_calibration`` did: mode, documents, eligible, stream_tokens, overlap."""


# --------------------------------------------------------------------------------------------------
# documents


def _alpaca_text(rec: dict) -> str:
    parts = [str(rec.get(k) or "").strip() for k in ("instruction", "input", "output")]
    return "\n".join(p for p in parts if p)


def _records_to_texts(records: Sequence[object], where: str) -> list[str]:
    if len(records) == 0:
        raise UserError(f"{where}: no records")
    first = records[0]
    if not isinstance(first, dict):
        raise UserError(f"{where}: records must be JSON objects, record 0 is {type(first).__name__}")
    alpaca = "instruction" in first and "output" in first
    if not alpaca and "text" not in first:
        raise UserError(
            f"{where}: record 0 has fields {sorted(first)[:8]}; need 'text' (C4 form) or "
            "'instruction', 'input', 'output' (Alpaca form)"
        )
    texts = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise UserError(f"{where}: record {i} is not a JSON object")
        if alpaca:
            if "instruction" not in rec or "output" not in rec:
                raise UserError(f"{where}: record {i} lacks 'instruction' or 'output' (Alpaca form)")
            texts.append(_alpaca_text(rec))
        else:
            t = rec.get("text")
            if not isinstance(t, str):
                raise UserError(f"{where}: record {i} has no string field 'text' (C4 form)")
            texts.append(t)
    if not any(t.strip() for t in texts):
        raise UserError(f"{where}: every record's text is empty")
    return texts


def _parse_json_text(raw: str, where: str) -> list[object]:
    """A JSON list, an object holding one list of records, or JSON lines."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        if e.msg != "Extra data":
            if raw.strip() == "":
                raise UserError(f"{where}: file is empty") from None
            raise UserError(f"{where}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return _parse_jsonl_text(raw, where)
    if isinstance(obj, list):
        return obj
    if isinstance(obj, dict):
        lists = [k for k, v in obj.items() if isinstance(v, list)]
        if len(lists) == 1:
            return obj[lists[0]]
        if "text" in obj or "instruction" in obj:
            return [obj]
        raise UserError(
            f"{where}: JSON object must hold exactly one list of records, found keys {sorted(obj)[:8]}"
        )
    raise UserError(f"{where}: JSON top level must be a list or an object, got {type(obj).__name__}")


def _parse_jsonl_text(raw: str, where: str) -> list[object]:
    out = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: line {n} is not valid JSON ({e.msg})") from None
    if not out:
        raise UserError(f"{where}: file is empty")
    return out


def _read_local(path: Path) -> list[str]:
    where = f"--calib {path}"
    name = path.name.lower()
    if not path.exists():
        raise UserError(f"{where}: file does not exist")
    if not path.is_file():
        raise UserError(f"{where}: not a file")
    if not name.endswith(LOCAL_SUFFIXES):
        raise UserError(f"{where}: unsupported file type; use {', '.join(LOCAL_SUFFIXES)}")
    try:
        if name.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise UserError(f"{where}: reading .parquet needs pyarrow (pip install pyarrow)") from None
            try:
                records = pq.read_table(path).to_pylist()
            except Exception as e:  # pyarrow raises ArrowInvalid (a ValueError) and others
                raise UserError(
                    f"{where}: not a readable parquet file ({str(e).splitlines()[0][:200]})"
                ) from None
            return _records_to_texts(records, where)
        data = path.read_bytes()
        if name.endswith(".gz"):
            try:
                data = gzip.decompress(data)
            except (OSError, EOFError) as e:
                raise UserError(f"{where}: not a readable gzip file ({e})") from None
        try:
            raw = data.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise UserError(f"{where}: not UTF-8 text") from None
        if name.endswith((".jsonl", ".jsonl.gz")):
            records = _parse_jsonl_text(raw, where)
        else:
            records = _parse_json_text(raw, where)
        return _records_to_texts(records, where)
    except PermissionError:
        raise UserError(f"{where}: file is not readable (permission denied)") from None
    except IsADirectoryError:
        raise UserError(f"{where}: not a file") from None


class _HubColumn(Sequence):
    """Lazy texts of a hub dataset (C4 has ~356k documents; only the drawn ones are read)."""

    def __init__(self, ds, alpaca: bool):
        self.ds, self.alpaca = ds, alpaca

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i):  # type: ignore[override]
        rec = self.ds[int(i)]
        return _alpaca_text(rec) if self.alpaca else rec["text"]


def _hub_unreachable() -> str | None:
    """Why the hub cannot be reached (DNS failure), or None. Offline mode skips the check (cache use)."""
    import os
    import socket
    from urllib.parse import urlparse

    if any(
        os.environ.get(v, "").lower() in ("1", "true", "yes")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    ):
        return None
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        return f"{host} does not resolve: {e}"
    return None


def _load_hub(source: str) -> Sequence[str]:
    repo, kwargs = HUB_SOURCES[source]
    reason = _hub_unreachable()  # fail at once instead of after the hub client's retries (~40 s)
    if reason is not None:
        raise UserError(
            f"--calib {source}: cannot reach the Hugging Face hub for {repo} ({reason}); {_LOCAL_HINT}, "
            "or set HF_HUB_OFFLINE=1 to use a cached copy"
        )
    try:
        from datasets import load_dataset

        ds = load_dataset(repo, **kwargs)
    except Exception as e:  # offline, hub errors, missing credentials: all mean "use a local file"
        msg = str(e).strip().splitlines()
        reason = msg[0][:200] if msg else type(e).__name__
        raise UserError(
            f"--calib {source}: cannot load {repo} from the Hugging Face hub ({reason}); {_LOCAL_HINT}"
        ) from None
    return _HubColumn(ds, alpaca=(source == "alpaca"))


def builtin_documents() -> list[str]:
    """The documents of the bundled calibration text (``--calib builtin``), offline."""
    try:
        raw = BUILTIN_TEXT.read_text(encoding="utf-8")
    except OSError as e:  # an installation without its package data
        raise UserError(f"--calib builtin: cannot read {BUILTIN_TEXT} ({e.strerror or type(e).__name__}); "
                        f"reinstall unionsparse or {_LOCAL_HINT}") from None
    lines = [ln for ln in raw.splitlines() if not ln.startswith("#")]  # the header comment
    docs, cur = [], []
    for ln in lines + [DOCUMENT_SEPARATOR]:
        if ln.strip() == DOCUMENT_SEPARATOR:
            text = "\n".join(cur).strip()
            if text:
                docs.append(text)
            cur = []
        else:
            cur.append(ln)
    return docs


def load_documents(source: str | Path) -> Sequence[str]:
    """The documents of ``source``: ``"builtin"`` (bundled), ``"c4"``, ``"alpaca"`` (hub) or a local file path."""
    s = str(source)
    if s == "builtin":
        return builtin_documents()
    if s in HUB_SOURCES:
        return _load_hub(s)
    return _read_local(Path(s).expanduser())


# --------------------------------------------------------------------------------------------------
# windows


def _tokenize_fn(tokenizer) -> Callable[[Sequence[str], bool], list[list[int]]]:
    def tok(texts: Sequence[str], special: bool) -> list[list[int]]:
        enc = tokenizer(list(texts), add_special_tokens=special, verbose=False)
        return [list(ids) for ids in enc["input_ids"]]

    return tok


def sample_windows(
    docs: Sequence[str],
    tokenize: Callable[[Sequence[str], bool], list[list[int]]],
    nsamples: int,
    seqlen: int,
    seed: int,
    sep_id: int | None,
    mode: str = "auto",
    chunk: int = 256,
) -> tuple[torch.Tensor, CalibrationInfo]:
    """Draw ``nsamples`` windows of ``seqlen`` tokens from ``docs`` (see the module docstring)."""
    if nsamples < 1:
        raise UserError(f"--nsamples must be >= 1, got {nsamples}")
    if seqlen < 2:
        raise UserError(f"--seqlen must be >= 2, got {seqlen}")
    if mode not in ("auto", "documents", "concat"):
        raise UserError(f"mode must be auto, documents or concat, got {mode!r}")
    n_docs = len(docs)
    lengths: dict[int, list[int]] = {}  # tokenized documents (with special tokens), by index

    def ids_of(i: int) -> list[int]:
        if i not in lengths:
            lengths[i] = tokenize([docs[i]], True)[0]
        return lengths[i]

    # eligibility scan in file order, chunked for the fast tokenizer
    need = nsamples * seqlen
    eligible_tokens, eligible, scanned = 0, 0, 0
    if mode != "concat":
        while scanned < n_docs and (
            mode == "documents" and eligible == 0 or mode == "auto" and eligible_tokens < need
        ):
            idx = list(range(scanned, min(scanned + chunk, n_docs)))
            for i, ids in zip(idx, tokenize([docs[i] for i in idx], True), strict=True):
                lengths[i] = ids
                if len(ids) > seqlen:
                    eligible += 1
                    eligible_tokens += len(ids)
            scanned = idx[-1] + 1
    use_docs = mode == "documents" or (mode == "auto" and eligible_tokens >= need)
    if mode == "documents" and eligible == 0:
        raise UserError(
            f"calibration: no document is longer than --seqlen {seqlen} tokens; use a smaller --seqlen"
        )

    rng = random.Random(seed)
    info = CalibrationInfo(documents=n_docs, eligible=eligible if scanned == n_docs else None)
    out = torch.empty(nsamples, seqlen, dtype=torch.long)
    if use_docs:
        info.update(mode="documents", overlap=False)
        for s in range(nsamples):
            while True:
                i = rng.randint(0, n_docs - 1)
                ids = ids_of(i)
                if len(ids) > seqlen:
                    break
            start = rng.randint(0, len(ids) - seqlen - 1)
            out[s] = torch.tensor(ids[start : start + seqlen], dtype=torch.long)
        return out, info

    order = list(range(n_docs))
    rng.shuffle(order)
    stream: list[int] = []
    for c in range(0, n_docs, chunk):
        part = order[c : c + chunk]
        for ids in tokenize([docs[i] for i in part], False):
            if not ids:
                continue
            if stream and sep_id is not None:
                stream.append(sep_id)
            stream.extend(ids)
    total = len(stream)
    if total < seqlen:
        raise UserError(
            f"calibration: the data holds only {total} tokens, fewer than --seqlen {seqlen}; "
            "use more text or a smaller --seqlen"
        )
    overlap = total < need
    if overlap:
        msg = (
            f"calibration: {total} tokens in all, fewer than --nsamples {nsamples} x --seqlen {seqlen}; "
            "windows overlap"
        )
        warnings.warn(msg, stacklevel=3)
        log.warning(msg)
    info.update(mode="concat", stream_tokens=total, overlap=overlap)
    stream_t = torch.tensor(stream, dtype=torch.long)
    for s in range(nsamples):
        start = rng.randint(0, total - seqlen)
        out[s] = stream_t[start : start + seqlen]
    return out, info


def load_calibration(
    source: str | Path,
    tokenizer,
    nsamples: int = 128,
    seqlen: int = 2048,
    seed: int = 0,
    mode: str = "auto",
    return_info: bool = False,
):
    """``LongTensor [nsamples, seqlen]`` of calibration windows from ``source`` (``builtin``, ``c4``, ``alpaca``
    or PATH).

    With ``return_info=True`` returns ``(samples, CalibrationInfo)``.
    """
    docs = load_documents(source)
    sep = getattr(tokenizer, "eos_token_id", None)
    if sep is None:
        sep = getattr(tokenizer, "bos_token_id", None)
    samples, info = sample_windows(docs, _tokenize_fn(tokenizer), nsamples, seqlen, seed, sep, mode=mode)
    info["source"] = str(source)
    log.info("calibration: %s", dict(info))
    return (samples, info) if return_info else samples
