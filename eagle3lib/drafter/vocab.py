"""Vocab maps between a target's vocabulary (Vt tokens) and a drafter's (Vd tokens), and their diff.

A map is the ascending list of the Vt-vocabulary ids the drafter can propose. Checkpoints store it
twice: `d2t` int64 [Vd], an offset (draft position i is target token `i + d2t[i]`), and `t2d`
bool [Vt], True for the Vd chosen tokens. Because SpecForge and speculators sort the chosen ids,
`arange(Vd) + d2t == nonzero(t2d)`; a map that breaks this is refused, as is any other
inconsistency, with a message naming the file and the problem.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from eagle3lib.files import (
    load_weights_only,
    read_safetensors,
    read_safetensors_header,
    save_safetensors,
    shareable,
    staging_path,
)


class VocabMapError(ValueError):
    """A map (or token-count table) that is malformed or does not fit what it is used with."""


def _as_int64(values, source: str, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(values)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise VocabMapError(f"{source}: {name} must hold integers, got dtype {tensor.dtype}")
    if tensor.dim() != 1:
        raise VocabMapError(f"{source}: {name} must be 1-D, got shape {list(tensor.shape)}")
    return tensor.to(torch.int64)


class VocabMap:
    """One draft vocabulary: `draft_ids` int64 [Vd], ascending target ids, out of `vt` target tokens.

    Build it with `from_ids`, `from_d2t`, `from_t2d`, `from_pair` (both encodings, checked against
    each other), `from_counts` (the SpecForge/speculators construction) or `load` (any file that
    holds one); `source` names where it came from in every error message.
    """

    def __init__(self, draft_ids: torch.Tensor, vt: int, source: str = "<in memory>"):
        ids = _as_int64(draft_ids, source, "draft ids")
        if ids.numel() == 0:
            raise VocabMapError(f"{source}: the map is empty (Vd = 0)")
        if ids.numel() > vt:
            raise VocabMapError(f"{source}: Vd {ids.numel()} is larger than the target vocab Vt {vt}")
        bad = ((ids < 0) | (ids >= vt)).nonzero()
        if bad.numel():
            i = int(bad[0])
            raise VocabMapError(
                f"{source}: {bad.numel()} draft id(s) out of range [0, {vt}), first at draft position {i}: "
                f"target id {int(ids[i])}"
            )
        unique, counts = ids.unique(return_counts=True)
        if unique.numel() != ids.numel():
            repeated = unique[counts > 1]
            first = int((ids == repeated[0]).nonzero()[1])
            raise VocabMapError(
                f"{source}: {ids.numel() - unique.numel()} duplicate target id(s) in the map, e.g. target id "
                f"{int(repeated[0])} again at draft position {first}"
            )
        descending = (ids[1:] < ids[:-1]).nonzero()
        if descending.numel():
            i = int(descending[0])
            raise VocabMapError(
                f"{source}: draft ids are not ascending at draft position {i + 1} (target id "
                f"{int(ids[i + 1])} after {int(ids[i])}); SpecForge and speculators sort the chosen ids, "
                "and t2d cannot encode another order"
            )
        self.draft_ids = ids
        self.vt = int(vt)
        self.source = source

    # ------------------------------------------------------------------ encodings

    @property
    def vd(self) -> int:
        return self.draft_ids.numel()

    @property
    def d2t(self) -> torch.Tensor:
        """int64 [Vd] offsets: draft position i is target token i + d2t[i]."""
        return self.draft_ids - torch.arange(self.vd)

    @property
    def t2d(self) -> torch.Tensor:
        """bool [Vt]: True for the target tokens in the draft vocab."""
        mask = torch.zeros(self.vt, dtype=torch.bool)
        mask[self.draft_ids] = True
        return mask

    @property
    def target_to_draft(self) -> torch.Tensor:
        """int64 [Vt]: each target token's draft position, -1 where the map lacks the token."""
        positions = torch.full((self.vt,), -1, dtype=torch.int64)
        positions[self.draft_ids] = torch.arange(self.vd)
        return positions

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, VocabMap):
            return NotImplemented
        return self.vt == other.vt and torch.equal(self.draft_ids, other.draft_ids)

    __hash__ = None  # mutable tensors inside

    def __repr__(self) -> str:
        return f"VocabMap(vd={self.vd}, vt={self.vt}, source={self.source!r})"

    def check_vt(self, vt: int, what: str = "the target") -> VocabMap:
        """Refuse a map built for another target vocabulary; returns self for chaining."""
        if self.vt != vt:
            raise VocabMapError(f"{self.source}: the map is for Vt {self.vt} but {what} has Vt {vt}")
        return self

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_ids(cls, draft_ids, vt: int, source: str = "<in memory>") -> VocabMap:
        return cls(draft_ids, vt, source)

    @classmethod
    def from_d2t(cls, d2t, vt: int, source: str = "<in memory>") -> VocabMap:
        offsets = _as_int64(d2t, source, "d2t")
        return cls(offsets + torch.arange(offsets.numel()), vt, source)

    @classmethod
    def from_t2d(cls, t2d, source: str = "<in memory>") -> VocabMap:
        mask = torch.as_tensor(t2d)
        if mask.dim() != 1:
            raise VocabMapError(f"{source}: t2d must be 1-D, got shape {list(mask.shape)}")
        if mask.dtype != torch.bool:
            if mask.dtype.is_floating_point or not bool(((mask == 0) | (mask == 1)).all()):
                raise VocabMapError(f"{source}: t2d must be a bool (or 0/1) mask, got dtype {mask.dtype}")
            mask = mask.bool()
        return cls(mask.nonzero().flatten(), mask.numel(), source)

    @classmethod
    def from_pair(cls, d2t, t2d, source: str = "<in memory>") -> VocabMap:
        """Both encodings, as checkpoints store them; they must describe the same map."""
        from_t2d = cls.from_t2d(t2d, source)
        offsets = _as_int64(d2t, source, "d2t")
        if offsets.numel() != from_t2d.vd:
            raise VocabMapError(
                f"{source}: d2t has {offsets.numel()} entries but t2d marks {from_t2d.vd} tokens"
            )
        ids = offsets + torch.arange(offsets.numel())
        wrong = (ids != from_t2d.draft_ids).nonzero()
        if wrong.numel():
            i = int(wrong[0])
            raise VocabMapError(
                f"{source}: d2t and t2d disagree at {wrong.numel()} draft position(s), first at {i}: "
                f"d2t says target id {int(ids[i])}, t2d puts target id {int(from_t2d.draft_ids[i])} there"
            )
        return from_t2d

    @classmethod
    def from_counts(cls, counts, vd: int, vt: int | None = None, source: str = "<counts>") -> VocabMap:
        """The map SpecForge and speculators build from token counts (counted under the loss mask).

        Take the Vd most frequent tokens, ties to the lower id; when fewer than Vd tokens were seen,
        pad with the lowest unseen ids (a stable sort of the counts does both at once, since unseen
        tokens have count 0); then sort the chosen ids ascending. This equals speculators'
        `build_vocab_mappings_from_distribution` exactly; SpecForge's `Counter.most_common` breaks
        ties by first appearance in the data instead, which matches whenever tied tokens were
        first seen in id order.
        """
        table = _as_int64(counts, source, "counts")
        if vt is not None and table.numel() != vt:
            raise VocabMapError(f"{source}: the count table has {table.numel()} entries, expected Vt {vt}")
        if bool((table < 0).any()):
            negative = int((table < 0).nonzero()[0])
            raise VocabMapError(f"{source}: negative token count at target id {negative}")
        if not 0 < vd <= table.numel():
            raise VocabMapError(f"{source}: Vd {vd} must be in [1, Vt {table.numel()}]")
        most_frequent_first = torch.sort(-table, stable=True).indices
        return cls(most_frequent_first[:vd].sort().values, table.numel(), source)

    # ------------------------------------------------------------------ files

    @classmethod
    def load(cls, path: str | os.PathLike, vd: int | None = None, vt: int | None = None) -> VocabMap:
        """Read a map from any file or folder that holds one.

        - a drafter checkpoint folder (`d2t`/`t2d` read straight from its safetensors; Vt from
          config.json when only `d2t` is stored),
        - a speculators folder or file pair `d2t.npy`/`t2d.npy`,
        - a `.safetensors` file with `d2t` and/or `t2d` (what `save` writes), or with a `counts`
          tensor [Vt] (a token-count table; needs `vd`),
        - a `torch.save` file: SpecForge's `{"d2t", "t2d"}` dict, or a `{token_id: count}` dict
          (SpecForge/speculators token frequencies; needs `vd` and `vt`).
        `vt`, when given, is checked against the map (e.g. the target's vocab size).
        """
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"vocab map not found: {path}")
        if path.is_dir():
            if (path / "d2t.npy").exists() or (path / "t2d.npy").exists():
                found = _load_npy_pair(path)
            else:
                found = _load_checkpoint_dir(path)
        elif path.suffix == ".npy":
            found = _load_npy_pair(path.parent)
        elif path.suffix == ".safetensors":
            found = _read_safetensors(path, ("d2t", "t2d", "counts"))
        else:
            found = _load_torch_file(path)
        source = str(path)
        if "counts" in found:
            if vd is None:
                raise VocabMapError(f"{source}: a token-count table; give vd (the draft vocab size)")
            counts = found["counts"]
            if isinstance(counts, dict):
                counts = counts_from_dict(counts, vt, source)
            built = cls.from_counts(counts, vd, vt, source)
        elif "d2t" in found and "t2d" in found:
            built = cls.from_pair(found["d2t"], found["t2d"], source)
        elif "t2d" in found:
            built = cls.from_t2d(found["t2d"], source)
        elif "d2t" in found:
            map_vt = found.get("vt", vt)
            if map_vt is None:
                raise VocabMapError(f"{source}: only d2t is stored and nothing says Vt; pass vt")
            built = cls.from_d2t(found["d2t"], map_vt, source)
        else:
            raise VocabMapError(f"{source}: holds no vocab map (no d2t, t2d or counts)")
        if vd is not None and "counts" not in found and built.vd != vd:
            raise VocabMapError(f"{source}: the map has Vd {built.vd}, expected {vd}")
        if vt is not None:
            built.check_vt(vt)
        if "config_vd" in found and found["config_vd"] != built.vd:
            raise VocabMapError(
                f"{source}: config.json says draft_vocab_size {found['config_vd']} "
                f"but d2t/t2d hold Vd {built.vd}"
            )
        if "vt" in found:
            built.check_vt(found["vt"], "its config.json")
        return built

    def save(self, path: str | os.PathLike) -> Path:
        """Write `{d2t, t2d}` as safetensors (atomically; refuses to replace an existing file)."""
        path = Path(path)
        if path.exists():
            raise FileExistsError(f"{path} exists; vocab maps are never overwritten")
        tmp = staging_path(path, folder=False)
        try:
            metadata = {"vd": str(self.vd), "vt": str(self.vt)}
            save_safetensors({"d2t": self.d2t, "t2d": self.t2d}, tmp, metadata=metadata)
            os.replace(shareable(tmp), path)  # safetensors writes its file private (0600)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    def coverage(self, counts: torch.Tensor) -> float:
        """Share of the counted token mass that falls on this map's tokens."""
        table = check_counts(counts, self.vt, self.source)
        total = int(table.sum())
        return int(table[self.draft_ids].sum()) / total if total else 0.0


def coverage_by_size(counts: torch.Tensor, heldout: torch.Tensor) -> torch.Tensor:
    """float64 [Vt]: entry n - 1 is the share of the `heldout` token mass that the map
    `from_counts(counts, n)` holds, for every size n at once (tokens taken in the order `from_counts` takes
    them)."""
    table = _as_int64(counts, "counts", "counts")
    held = check_counts(heldout, table.numel(), "held-out counts")
    total = int(held.sum())
    if not total:
        raise VocabMapError("held-out counts: no tokens counted, so no share of them can be covered")
    most_frequent_first = torch.sort(-table, stable=True).indices
    return held[most_frequent_first].cumsum(0).to(torch.float64) / total


# ---------------------------------------------------------------------- file readers


def _read_safetensors(path: Path, names: tuple[str, ...]) -> dict:
    """Those of `names` the file holds."""
    held = read_safetensors_header(path, VocabMapError).tensors
    return read_safetensors(path, [name for name in names if name in held], VocabMapError)


def _load_npy_pair(folder: Path) -> dict:
    found = {}
    for name in ("d2t", "t2d"):
        file = folder / f"{name}.npy"
        if file.exists():
            try:
                found[name] = torch.from_numpy(np.load(file, allow_pickle=False))
            except ValueError as err:
                raise VocabMapError(f"{file}: not a plain numpy array: {err}") from err
    return found


def _load_checkpoint_dir(folder: Path) -> dict:
    """d2t/t2d straight from a checkpoint's safetensors (sharded or not), plus sizes from config."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise VocabMapError(f"{folder}: no d2t.npy/t2d.npy and no *.safetensors: not a checkpoint or map")
    found: dict = {}
    for file in files:
        found.update(_read_safetensors(file, ("d2t", "t2d")))
    config_path = folder / "config.json"
    if config_path.exists():
        config = json.loads(config_path.read_text())
        layer_config = config.get("transformer_layer_config") or {}
        vt = layer_config.get("vocab_size", config.get("vocab_size"))
        if vt is not None:
            found["vt"] = int(vt)
        if config.get("draft_vocab_size") is not None:
            found["config_vd"] = int(config["draft_vocab_size"])
    return found


def _load_torch_file(path: Path) -> dict:
    obj = load_weights_only(path, VocabMapError)
    if isinstance(obj, dict) and ("d2t" in obj or "t2d" in obj):
        return {name: obj[name] for name in ("d2t", "t2d") if name in obj}
    if isinstance(obj, dict) and obj and all(isinstance(k, int) for k in obj):
        return {"counts": obj}
    raise VocabMapError(f"{path}: expected a {{'d2t', 't2d'}} dict or a {{token_id: count}} dict")


def counts_from_dict(freq: dict[int, int], vt: int | None, source: str) -> torch.Tensor:
    """A `{token_id: count}` dict (SpecForge/speculators) as a dense int64 [Vt] table."""
    if vt is None:
        raise VocabMapError(f"{source}: a {{token_id: count}} dict does not say Vt; pass vt")
    ids = torch.tensor(list(freq.keys()), dtype=torch.int64)
    bad = (ids < 0) | (ids >= vt)
    if bool(bad.any()):
        raise VocabMapError(f"{source}: token id {int(ids[bad][0])} out of range [0, {vt})")
    table = torch.zeros(vt, dtype=torch.int64)
    table[ids] = torch.tensor(list(freq.values()), dtype=torch.int64)
    return table


def check_counts(counts, vt: int, source: str) -> torch.Tensor:
    table = _as_int64(counts, source, "counts")
    if table.numel() != vt:
        raise VocabMapError(f"{source}: the count table has {table.numel()} entries, the map's Vt is {vt}")
    if bool((table < 0).any()):
        raise VocabMapError(f"{source}: negative token count at target id {int((table < 0).nonzero()[0])}")
    return table


def load_counts(path: str | os.PathLike, vt: int | None = None) -> torch.Tensor:
    """A token-count table: safetensors with `counts` [Vt], or a torch.save `{token_id: count}` dict."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token-count table not found: {path}")
    found = _read_safetensors(path, ("counts",)) if path.suffix == ".safetensors" else _load_torch_file(path)
    if "counts" not in found:
        raise VocabMapError(f"{path}: holds no 'counts' table")
    counts = found["counts"]
    if isinstance(counts, dict):
        return counts_from_dict(counts, vt, str(path))
    return check_counts(counts, vt if vt is not None else torch.as_tensor(counts).numel(), str(path))


# ---------------------------------------------------------------------- diff


@dataclass
class VocabDiff:
    """How two maps relate: position by position, as sets, and (with counts) by token mass."""

    label_a: str
    label_b: str
    vt: int
    vd_a: int
    vd_b: int
    positions_compared: int  # min(vd_a, vd_b)
    positions_equal: int  # draft positions that map to the same target token in both
    first_divergence: int | None  # first draft position that differs; None if none does
    intersection: int
    only_in_a: int
    only_in_b: int
    union: int
    coverage_a: float | None = None  # share of counted token mass on A's tokens
    coverage_b: float | None = None
    counted_tokens: int | None = None
    agree: torch.Tensor = field(repr=False, default=None)  # bool [positions_compared], for figures

    def to_dict(self) -> dict:
        data = {k: v for k, v in self.__dict__.items() if k != "agree"}
        data["summary"] = self.summary()
        return data

    def summary(self) -> str:
        first = self.first_divergence
        where = "no divergence" if first is None else f"first divergence at {first}"
        text = f"{self.positions_equal} of {self.positions_compared} positions agree ({where})"
        if self.vd_a != self.vd_b:
            text += f" [A has Vd {self.vd_a}, B has Vd {self.vd_b}]"
        text += f"; {self.intersection:,} shared tokens; {self.only_in_a:,} only in A"
        text += f"; {self.only_in_b:,} only in B"
        if self.coverage_a is not None:
            text += (
                f"; A covers {100 * self.coverage_a:.2f}% and B {100 * self.coverage_b:.2f}% of "
                f"{self.counted_tokens:,} counted tokens"
            )
        return text


def diff(
    a: VocabMap, b: VocabMap, counts=None, label_a: str | None = None, label_b: str | None = None
) -> VocabDiff:
    """Compare two maps over the same target vocabulary; `counts` [Vt] adds token-mass coverage."""
    b.check_vt(a.vt, f"the other map ({a.source})")
    compared = min(a.vd, b.vd)
    agree = a.draft_ids[:compared] == b.draft_ids[:compared]
    differing = (~agree).nonzero()
    if differing.numel():
        first = int(differing[0])
    else:
        first = compared if a.vd != b.vd else None
    in_a, in_b = a.t2d, b.t2d
    result = VocabDiff(
        label_a=label_a or a.source,
        label_b=label_b or b.source,
        vt=a.vt,
        vd_a=a.vd,
        vd_b=b.vd,
        positions_compared=compared,
        positions_equal=int(agree.sum()),
        first_divergence=first,
        intersection=int((in_a & in_b).sum()),
        only_in_a=int((in_a & ~in_b).sum()),
        only_in_b=int((in_b & ~in_a).sum()),
        union=int((in_a | in_b).sum()),
        agree=agree,
    )
    if counts is not None:
        table = check_counts(counts, a.vt, "token counts")
        result.coverage_a = a.coverage(table)
        result.coverage_b = b.coverage(table)
        result.counted_tokens = int(table.sum())
    return result
