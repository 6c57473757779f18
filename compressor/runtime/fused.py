"""Linears that read the same input run as one product: Q/K/V and gate/up (docs/runtime.md, "Fused linears").

The artifact stores every linear separately. At load, the stored encodings of the linears of one block that read
the same input are stacked by rows (:func:`~unionsparse.formats.stacking.stack_rows`, each member padded to whole
tiles, so the bytes are those a fused encoding would have), their scales and outlier side matrices too
(:func:`stack_records`); one :class:`~.linear.CompressedLinear` computes the stacked output, and
:class:`SharedInputLinear` hands each original module path a member that returns its rows of it.

Only layers whose stored options make them one product are stacked: one format, bits, tile (and areas), group
size, activation record (bits, clip, outlier channels) and activation-sparsity threshold. A group whose members
differ is split into the largest sets of members that agree; the others stay separate, with the reason recorded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ...formats import registry
from ...formats.arithmetic.outlier_side import OutlierSide
from ...formats.errors import FormatError
from ...formats.stacking import stack_rows
from ..artifact.store import LayerRecord
from ..errors import UserError
from ..model.shared_inputs import SHARED_INPUTS


@dataclass(frozen=True)
class Group:
    """The stored sibling linears of one block part that read the same input."""

    parent: str                   # module path of the block part, e.g. model.layers.3.self_attn
    members: tuple[str, ...]      # module paths of the stored members, in stacking order
    missing: tuple[str, ...]      # module paths of the siblings the artifact does not store (kept dense)

    @property
    def fused_name(self) -> str:
        """Module path of the stacked op for ``members`` (e.g. ``...self_attn.fused_q_k_v_proj``)."""
        return fused_name(self.parent, self.members)


def fused_name(parent: str, members: Sequence[str]) -> str:
    short = [m.rpartition(".")[2].removesuffix("_proj") for m in members]
    return f"{parent}.fused_{'_'.join(short)}_proj"


def shared_input_groups(names: Iterable[str]) -> list[Group]:
    """Groups of stored layers (``names``) that read the same input, by module path: ``<parent>.self_attn.{q,k,v}_proj``
    and ``<parent>.mlp.{gate,up}_proj`` (LLaMA-style models: LLaMA, Mistral, Qwen2, SmolLM2), in order of first
    appearance. Groups with no stored member are left out."""
    stored = set(names)
    seen: dict[str, Group] = {}
    for name in names:
        parent, _, child = name.rpartition(".")
        for part, siblings in SHARED_INPUTS:
            if child in siblings and (parent == part or parent.endswith(f".{part}")) and parent not in seen:
                paths = [f"{parent}.{s}" for s in siblings]
                seen[parent] = Group(parent, tuple(p for p in paths if p in stored),
                                     tuple(p for p in paths if p not in stored))
    return list(seen.values())


def _short(name: str) -> str:
    return name.rpartition(".")[2]


def _activation_difference(a: dict | None, b: dict | None) -> str:
    if not isinstance(a, dict) or not isinstance(b, dict):
        return f"{a!r} vs {b!r}"
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return ", ".join(f"{k} {b.get(k)!r} vs {a.get(k)!r}" for k in keys)


def mismatch(a: LayerRecord, b: LayerRecord, ignore_thresholds: bool = False) -> str | None:
    """Why stored layer ``b`` cannot be computed in one product with ``a`` (one line), or None when it can.
    ``ignore_thresholds``: activation-sparsity thresholds are not applied, so they need not agree."""
    ga, gb = (registry.of(r.encoding).geometry_attrs(r.encoding) for r in (a, b))
    checks = [("format", ga["format"], gb["format"]), ("input features", ga["shape"][1], gb["shape"][1])]
    checks += [(k, ga.get(k), gb.get(k)) for k in sorted(set(ga) | set(gb)) if k not in ("format", "shape")]
    checks += [("group_size", a.attrs.get("group_size"), b.attrs.get("group_size")),
               ("scales", a.scales is not None, b.scales is not None)]
    if not ignore_thresholds:
        checks.append(("activation-sparsity threshold", a.attrs.get("dp_threshold"), b.attrs.get("dp_threshold")))
    oa, ob = (None if r.outliers is None else r.outliers.channels.tolist() for r in (a, b))
    checks.append(("outlier channels", oa, ob))
    for what, va, vb in checks:
        if va != vb:
            return f"{_short(b.name)} has {what} {vb!r}, {_short(a.name)} {va!r}"
    if a.attrs.get("activations") != b.attrs.get("activations"):
        diff = _activation_difference(a.attrs.get("activations"), b.attrs.get("activations"))
        return f"{_short(b.name)} quantizes its input otherwise than {_short(a.name)} ({diff})"
    return None


def _stack_array(parts: Sequence[np.ndarray], offsets: Sequence[int], rows: int, fill: float) -> np.ndarray:
    out = np.full((rows, *parts[0].shape[1:]), fill, dtype=parts[0].dtype)
    for o, p in zip(offsets, parts, strict=True):
        out[o : o + p.shape[0]] = p
    return out


def stack_records(records: Sequence[LayerRecord], name: str | None = None,
                  ignore_thresholds: bool = False) -> LayerRecord | str:
    """One record for the rows of ``records`` stacked (stacking order), or one line saying why they cannot be
    one product (:func:`mismatch`, or the format's refusal).

    The encoding is :func:`~unionsparse.formats.stacking.stack_rows`'s; scales and the outlier side's codes and
    scales are stacked at the same row offsets, the rows between members holding zero codes and scale 1 (finite,
    never used: those rows' codes are zero). The attrs hold the geometry, ``group_size``, ``activations`` and
    ``dp_threshold`` the members share, and ``fused``: the members' names, row offsets and row counts. The record
    exists at run time only; nothing is written."""
    if not records:
        return "no layers to stack"
    first = records[0]
    for r in records[1:]:
        why = mismatch(first, r, ignore_thresholds)
        if why is not None:
            return why
    try:
        enc, offsets = stack_rows([r.encoding for r in records])
    except FormatError as e:
        return str(e)
    rows = int(enc.shape[0])
    scales = None
    if first.scales is not None:
        scales = _stack_array([r.scales for r in records], offsets, rows, 1.0)
    side = None
    if first.outliers is not None:
        o = first.outliers
        side = OutlierSide(o.channels, o.perm, _stack_array([r.outliers.codes for r in records], offsets, rows, 0),
                           _stack_array([r.outliers.scales for r in records], offsets, rows, 1.0), o.bits)
    attrs = registry.of(enc).geometry_attrs(enc)
    attrs.update({k: first.attrs[k] for k in ("group_size", "activations") if k in first.attrs})
    taus = {r.attrs.get("dp_threshold") for r in records}
    attrs["dp_threshold"] = taus.pop() if len(taus) == 1 else None  # several only when thresholds are ignored
    attrs["fused"] = {"members": [r.name for r in records], "row_offsets": offsets,
                      "rows": [int(r.encoding.shape[0]) for r in records]}
    if name is None:
        parent = first.name.rpartition(".")[0]
        name = fused_name(parent, [r.name for r in records])
    return LayerRecord(name, enc, scales, attrs, side)


def partition(records: Sequence[LayerRecord], ignore_thresholds: bool = False) -> list[list[LayerRecord]]:
    """``records`` split into sets that can each be one product (:func:`mismatch` is None with the set's first),
    in order: the largest sets when one member differs, e.g. [q, v] and [k] when k_proj has other bits."""
    sets: list[list[LayerRecord]] = []
    for r in records:
        for s in sets:
            if mismatch(s[0], r, ignore_thresholds) is None:
                s.append(r)
                break
        else:
            sets.append([r])
    return sets


@dataclass
class GroupPlan:
    """What happens to one group: stacked records (with their members) and the layers left alone, with why."""

    stacked: list[tuple[LayerRecord, list[LayerRecord]]]
    separate: list[dict]          # {"layer": module path, "stored": bool, "reason": one line}


def plan_group(group: Group, records: Sequence[LayerRecord], ignore_thresholds: bool = False) -> GroupPlan:
    """Stack what can be stacked of one group (``records``: its stored members, in order)."""
    plan = GroupPlan([], [])
    for s in partition(records, ignore_thresholds):
        if len(s) > 1:
            rec = stack_records(s, fused_name(group.parent, [r.name for r in s]), ignore_thresholds)
            if isinstance(rec, LayerRecord):
                plan.stacked.append((rec, s))
                continue
            plan.separate += [{"layer": r.name, "stored": True, "reason": rec} for r in s]
            continue
        r = s[0]
        others = [o for o in records if o is not r]
        why = (mismatch(others[0], r, ignore_thresholds) if others else None) or (
            "the only stored layer of its group (the others are kept dense)")
        plan.separate.append({"layer": r.name, "stored": True, "reason": why})
    plan.separate += [{"layer": m, "stored": False, "reason": "not in the artifact (kept dense)"}
                      for m in group.missing]
    return plan


def _version(x: torch.Tensor) -> int | None:
    """The tensor's in-place version counter (None for inference tensors, which have none)."""
    return None if x.is_inference() else x._version


class SharedInputLinear(nn.Module):
    """One module computing the stacked output ``[..., M]`` of linears that read the same input, and the members
    that replace those linears (:meth:`members`), each returning its rows of it.

    The stacked product runs once per input: a member called with the very tensor object (unchanged in place)
    the last product was computed from, whose rows have not been handed out yet for that product, gets a slice
    of it; any other call (a new input, a member called twice, an input changed in place) computes the product
    again, so results never depend on the call order. The decision is Python-side only (object identity and
    integers; no tensor values, no host synchronisation), so it runs once while a CUDA graph is captured and the
    graph replays one product per input. transformers' LLaMA-style forwards call q/k/v_proj with one
    ``hidden_states`` object and ``gate_proj(x)`` then ``up_proj(x)``. The slices are views of the product
    (no copy); biases stay with the members and are added to their slice, as the separate layers add theirs.
    """

    def __init__(self, stacked: nn.Module, names: Sequence[str], offsets: Sequence[int], sizes: Sequence[int],
                 biases: Sequence[torch.Tensor | None] | None = None) -> None:
        super().__init__()
        if not len(names) == len(offsets) == len(sizes) or not names:
            raise UserError("one name, offset and size per member")
        self.stacked = stacked
        self.in_features = int(stacked.in_features)
        self.out_features = int(stacked.out_features)
        self.names = list(names)
        self.offsets = [int(o) for o in offsets]
        self.sizes = [int(s) for s in sizes]
        if any(o < 0 or o + s > self.out_features for o, s in zip(self.offsets, self.sizes, strict=True)):
            raise UserError(f"member rows {list(zip(self.offsets, self.sizes, strict=True))} exceed the stacked "
                             f"output of {self.out_features}")
        biases = list(biases) if biases is not None else [None] * len(names)
        # plain list: the members sit at the original module paths; registering them here too would put each
        # module twice in the tree (and this module inside each of them would make a cycle)
        self._members = [SharedInputMember(self, i, b) for i, b in enumerate(biases)]
        self.computations = 0  # stacked products computed (Python-side count; under CUDA graphs: at capture)
        self._all = (1 << len(names)) - 1
        self._clear()

    def _clear(self) -> None:
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._version: int | None = None
        self._served = 0

    def members(self) -> list[nn.Module]:
        """The drop-ins for the original linears, in stacking order."""
        return list(self._members)

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s rows of the stacked product of ``x`` (computed unless reusable, see the class)."""
        bit = 1 << index
        version = _version(x)
        if self._input is x and self._version == version and not self._served & bit:
            y = self._output
            self._served |= bit
        else:
            y = self.stacked(x)
            self.computations += 1
            self._input, self._output, self._version, self._served = x, y, version, bit
        if self._served == self._all:  # every member served: nothing to keep alive
            self._clear()
        o = self.offsets[index]
        return y[..., o : o + self.sizes[index]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole stacked output ``[..., M]`` (padding rows between members included, biases not added)."""
        return self.stacked(x)

    def extra_repr(self) -> str:
        parts = ", ".join(f"{_short(n)} rows {o}..{o + s}" for n, o, s in
                          zip(self.names, self.offsets, self.sizes, strict=True))
        return f"in={self.in_features}, out={self.out_features}: {parts}"


class SharedInputMember(nn.Module):
    """Drop-in for one of the linears a :class:`SharedInputLinear` computes: its rows of the stacked output,
    plus its bias (added in the input's dtype, as :class:`~.linear.CompressedLinear` adds it)."""

    def __init__(self, shared: SharedInputLinear, index: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "shared", shared)  # not a submodule: the shared op is registered once
        self.index = index
        self.name = shared.names[index]
        self.in_features = shared.in_features
        self.out_features = shared.sizes[index]
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise UserError(f"{self.name}: bias of shape {tuple(bias.shape)} for {self.out_features} outputs")
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.shared.output(self.index, x)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y

    def extra_repr(self) -> str:
        o = self.shared.offsets[self.index]
        return f"in={self.in_features}, out={self.out_features}, rows {o}..{o + self.out_features} of a stacked op"
