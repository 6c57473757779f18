"""Launch variants of the IE-BME studies (``tune_iebme_warps.py``, ``trace_iebme.py``): ``--variants`` strings
such as ``"WARPS=8,MINB=5;TMA=0;"`` parsed and put in force.

A key names a field of the product's ``kernels.iebme_spmm.LaunchSettings`` (``SETTINGS_KEYS``) or a study build
of the kernel (``BUILD_KEYS``: a macro; ``SOURCE``: another revision of the .cu), which ``kernels/study.py``
holds apart from the product's settings. Nothing here reads or writes an environment variable.
"""

from __future__ import annotations

import argparse

from unionsparse.kernels import iebme_spmm, study

SETTINGS_KEYS = {"NSTAGE": "nstage", "WARPS": "warps", "ILP": "ilp", "MINB": "minb", "XBYTES": "x_bytes",
                 "CLUSTER": "cluster", "PDL": "pdl", "MAXSPLITS": "max_splits"}
BUILD_KEYS = {"TMA": "IEBME_TMA", "TRACE": "IEBME_TRACE"}  # TMA=0: cp.async rings on sm_90; TRACE=1: timestamps
KEYS = (*SETTINGS_KEYS, *BUILD_KEYS, "SOURCE")


def parse_overrides(text: str) -> list[dict[str, str]]:
    """``"WARPS=8,MINB=5;"`` -> [{"WARPS": "8", "MINB": "5"}, {}] (an empty item is the shipped default); keys
    upper-cased, each one of ``KEYS``."""
    out = []
    for item in text.split(";"):
        kv = [p.split("=", 1) for p in item.split(",") if p.strip()]
        if any(len(p) != 2 for p in kv):
            raise argparse.ArgumentTypeError(f"a variant is KEY=VALUE[,KEY=VALUE...], got {item!r}")
        variant = {k.strip().upper(): v.strip() for k, v in kv}
        unknown = sorted(set(variant) - set(KEYS))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown launch setting {unknown[0]} (known: {', '.join(KEYS)})")
        out.append(variant)
    return out


def current() -> dict[str, str]:
    """The variant in force, as ``parse_overrides`` items are (non-default values only)."""
    st, b = iebme_spmm.settings(), study.build(iebme_spmm.KERNEL)
    dflt = iebme_spmm.LaunchSettings()
    out = {k: str(int(getattr(st, f))) for k, f in SETTINGS_KEYS.items() if getattr(st, f) != getattr(dflt, f)}
    out.update({k: str(v) for k, m in BUILD_KEYS.items() for name, v in b.defines if name == m})
    if b.source:
        out["SOURCE"] = b.source
    return out


def apply_overrides(variant: dict[str, str], keep: tuple[str, ...] = ()) -> str:
    """Put ``variant`` in force: the product's launch settings and the kernel's study build (keys named in
    ``keep`` keep their current value, every other one its default); returns the variant's label."""
    now = current()
    merged = {k: now[k] for k in keep if k in now}
    merged.update(variant)
    settings = {SETTINGS_KEYS[k]: int(v) for k, v in merged.items() if k in SETTINGS_KEYS}
    defines = tuple((m, int(merged[k])) for k, m in BUILD_KEYS.items() if merged.get(k, ""))
    iebme_spmm.use_settings(iebme_spmm.LaunchSettings(**settings))
    study.use_build(iebme_spmm.KERNEL, study.Build(merged.get("SOURCE", ""), defines))
    return ",".join(f"{key}={val}" for key, val in variant.items()) or "default"
