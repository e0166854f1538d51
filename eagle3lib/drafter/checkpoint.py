"""Read, check and write EAGLE-3 drafter checkpoints in the SGLang and speculators layouts
(docs/formats.md §2).

`load_drafter(path, strict=True)` reads a folder (config.json + weights) and returns the drafter with a
`LoadReport` that accounts for every tensor in the files:
- loaded: placed into the drafter, under its own name or **renamed** (speculators' `layers.0.*` →
  `midlayer.*`); `embed_tokens.weight`, when the checkpoint carries one, is loaded into the drafter's own
  `embed_tokens` and counted as loaded (a speculators checkpoint reads "14 loaded"); a checkpoint without
  one is not missing anything, the embedding then comes from the target (`attach_embedding`);
- skipped by design, with the reason: `d2t` and `t2d` are the vocab map, checked against each other and
  the config and loaded into the drafter's map buffers; stale RoPE `inv_freq` buffers;
- missing, unexpected, or shape-mismatched (expected vs found).
Strict loading raises on any of the last three, naming each; `strict=False` loads the rest, initialises
what is missing, and reports it. Unreadable files, NaN/Inf or integer weights and vocab maps that contradict
the config or themselves are refused in either mode: the engines load such checkpoints silently (SGLang drops
unknown keys and keeps missing ones random), this loader never does.

Weights are read from `model.safetensors`, sharded safetensors with `model.safetensors.index.json`,
`pytorch_model.bin` (or its sharded index), loaded with `weights_only=True`, or a SpecForge
`training_state.pt`. SpecForge 0.2's `CheckpointManager` writes `{run}-step{N}/training_state.pt` alone:
the weights under `draft_state_dict` (no embedding), no config.json, so the run's draft config JSON is given
(`config=`, `--config`) or found beside it (the step folder, then the run folder). Older trainers wrote that
file next to `model.safetensors` with only optimizer and scheduler state; it is then summarised in the report
and the weights come from `model.safetensors`.

`save_drafter` writes a temporary folder beside the destination and renames it into place. A speculators-
layout save carries the token embedding (the drafter's own or the attached target's), as speculators itself
saves it: speculators loads a checkpoint without one with a NaN embedding and no warning. `convert` and
`save_drafter(..., engines=...)` refuse an export that a project reading that layout would compute
differently (`DrafterConfig.engine_mismatches`), unless `allow_engine_mismatch`.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle3lib.drafter.config import (
    LAYOUT_READERS,
    LAYOUTS,
    DrafterConfig,
    read_config,
    write_config,
)
from eagle3lib.drafter.model import Eagle3Drafter
from eagle3lib.drafter.vocab import VocabMap
from eagle3lib.files import (
    atomic_write_text,
    check_recorded_hash,
    describe_occupant,
    load_weights_only,
    read_safetensors,
    save_safetensors,
    staged_folder,
)

VOCAB_MAP_KEYS = ("d2t", "t2d")
# a published drafter's record (reports.publish writes it): the SHA-256 of its weights, checked on every load
PROVENANCE = "provenance.json"
# Where a training_state.pt keeps the drafter's weights: SpecForge 0.2's CheckpointManager, then older forms.
TRAINING_STATE_WEIGHT_KEYS = ("draft_state_dict", "model", "model_state_dict", "state_dict", "draft_model")
SPECULATORS_PREFIX, SGLANG_PREFIX = "layers.0.", "midlayer."
# Weight sources, in the order they are preferred when a folder holds several.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "training_state.pt",
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, contradicts its config, or fails a strict load."""


@dataclass
class LoadReport:
    path: str
    layout: str
    files: list[str]
    tensors: list[tuple[str, list[int], str]] = field(default_factory=list)  # every (key, shape, dtype)
    loaded: list[str] = field(default_factory=list)  # drafter names that received a checkpoint tensor
    renamed: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint key, drafter name)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint key, reason)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, list[int], list[int]]] = field(default_factory=list)  # (key, expected, found)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def summary(self) -> str:
        """E.g. "13 loaded, 2 skipped (d2t, t2d), 0 missing, 0 unexpected"."""
        loaded = f"{len(self.loaded)} loaded"
        if self.renamed:
            loaded += f" ({len(self.renamed)} renamed)"
        skipped = f"{len(self.skipped)} skipped"
        if self.skipped:
            skipped += f" ({', '.join(key for key, _ in self.skipped)})"
        parts = [loaded, skipped, f"{len(self.missing)} missing", f"{len(self.unexpected)} unexpected"]
        if self.mismatched:
            parts.append(f"{len(self.mismatched)} shape-mismatched")
        return ", ".join(parts)

    def problems(self, config: DrafterConfig | None = None) -> list[str]:
        """One line per missing, unexpected or mismatched tensor; with `config`, mismatches name the field."""
        mismatched = [
            f"shape-mismatched {key}: expected {exp}, found {found}"
            + (_shape_hint(canonical_name(key), config) if config else "")
            for key, exp, found in self.mismatched
        ]
        return (
            [f"missing {key}" for key in self.missing]
            + [f"unexpected {k}" for k in self.unexpected]
            + mismatched
        )

    def __str__(self) -> str:
        lines = [f"{self.path} ({self.layout} layout, from {', '.join(self.files)}): {self.summary()}"]
        renamed_to = {to for _, to in self.renamed}
        lines += [f"  loaded      {name}" for name in self.loaded if name not in renamed_to]
        lines += [f"  renamed     {key} → {name}" for key, name in self.renamed]
        lines += [f"  skipped     {key}: {reason}" for key, reason in self.skipped]
        lines += [f"  MISSING     {key}" for key in self.missing]
        lines += [f"  UNEXPECTED  {key}" for key in self.unexpected]
        lines += [
            f"  MISMATCHED  {key}: expected {exp}, found {found}" for key, exp, found in self.mismatched
        ]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {**asdict(self), "summary": self.summary(), "ok": self.ok}


# ----------------------------------------------------------------------------- layout and files


def detect_layout(path: str | os.PathLike) -> str:
    """The layout, "sglang" or "speculators", that the checkpoint folder's config.json describes."""
    return read_config(_folder(Path(path)))[1]


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def _folder(path: Path) -> Path:
    """The checkpoint folder of `path`: itself, or the folder of a weight file given alone."""
    if not path.exists():
        raise FileNotFoundError(f"no drafter checkpoint at {path}")
    if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
        raise CheckpointError(f"{path} is a file, not a drafter checkpoint: give its folder, or one of its "
                              f"weight files ({', '.join(WEIGHT_FILES)})")
    return path if path.is_dir() else path.parent


def _weight_sources(path: Path) -> tuple[Path, list[str]]:
    """(the weight file to read, notes): `path` is a checkpoint folder or one of its weight files."""
    if path.is_file():
        return path, []
    present = [name for name in WEIGHT_FILES if (path / name).is_file()]
    if not present:
        others = sorted(p.name for p in path.glob("*.safetensors"))
        hint = f" (found {', '.join(others)} without model.safetensors.index.json)" if others else ""
        raise CheckpointError(f"{path}: no weights ({' / '.join(WEIGHT_FILES)}){hint}")
    chosen = path / present[0]
    notes = [f"also present, not read: {name}" for name in present[1:] if name != "training_state.pt"]
    return chosen, notes


def read_tensors(file: Path) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """All tensors of one weight source → (tensors by key, files read, notes)."""
    name = file.name
    if name.endswith(".index.json"):
        return _read_index(file)
    if name.endswith(".safetensors"):
        return read_safetensors(file, error=CheckpointError), [name], []
    if name == "training_state.pt":
        return _read_training_state(file)
    return _read_torch_state_dict(file), [name], []


def _torch_load(file: Path) -> object:
    # SpecForge pickles its command-line arguments into its training states
    return load_weights_only(file, CheckpointError, allow=(argparse.Namespace,))


def _tensor_dict(value: object) -> dict[str, torch.Tensor] | None:
    if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
        return value
    return None


def _read_torch_state_dict(file: Path) -> dict[str, torch.Tensor]:
    content = _torch_load(file)
    tensors = _tensor_dict(content)
    if tensors is None:
        kind = type(content).__name__
        keys = f" with keys {sorted(map(str, content))[:8]}" if isinstance(content, dict) else ""
        raise CheckpointError(f"{file}: expected a flat {{name: tensor}} state dict, got a {kind}{keys}")
    return tensors


def _read_index(file: Path) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    try:
        weight_map = json.loads(file.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file}: not a weight index with a 'weight_map' ({err})") from err
    tensors: dict[str, torch.Tensor] = {}
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        shard_file = file.parent / shard
        if not shard_file.is_file():
            raise CheckpointError(f"{file}: shard {shard} is listed but {shard_file} does not exist")
        if shard.endswith(".safetensors"):
            shard_tensors = read_safetensors(shard_file, error=CheckpointError)
        else:
            shard_tensors = _read_torch_state_dict(shard_file)
        for key, tensor in shard_tensors.items():
            if key in tensors:
                raise CheckpointError(f"{shard_file}: tensor {key} is also in another shard")
            tensors[key] = tensor
    for key, shard in weight_map.items():
        if key not in tensors:
            raise CheckpointError(f"{file}: {key} is listed in {shard} but that shard does not hold it")
    return tensors, [file.name, *shards], []


def _read_training_state(file: Path) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    state = _torch_load(file)
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: expected a dict, got {type(state).__name__}")
    tensors = _tensor_dict(state)
    for key in TRAINING_STATE_WEIGHT_KEYS:
        tensors = tensors or _tensor_dict(state.get(key))
    if tensors is None:
        raise CheckpointError(
            f"{file}: holds no model weights (keys: {', '.join(sorted(map(str, state)))}; weights are looked "
            f"for under {', '.join(TRAINING_STATE_WEIGHT_KEYS)}); an older SpecForge kept only optimizer and "
            "scheduler state there, with the weights beside it in model.safetensors"
        )
    # SpecForge's training wrapper names the drafter "draft_model"
    tensors = {key.removeprefix("draft_model."): value for key, value in tensors.items()}
    return tensors, [file.name], [describe_training_state(state)]


def describe_training_state(state: dict) -> str:
    """One line about a SpecForge training_state.pt: progress and what the optimizer state covers."""
    optimizer = state.get("optimizer_state_dict") or state.get("optimizer") or {}
    moments = optimizer.get("state", {}) if isinstance(optimizer, dict) else {}
    groups = optimizer.get("param_groups", []) if isinstance(optimizer, dict) else []
    lr = groups[0].get("lr") if groups else None
    return (
        f"training_state.pt: epoch {state.get('epoch')}, global_step {state.get('global_step')}, optimizer "
        f"state for {len(moments)} tensors, lr {lr}"
    )


# ----------------------------------------------------------------------------- loading


def canonical_name(key: str) -> str:
    """Checkpoint key → drafter parameter name (speculators' `layers.0.*` is SGLang's `midlayer.*`)."""
    if key.startswith(SPECULATORS_PREFIX):
        return SGLANG_PREFIX + key.removeprefix(SPECULATORS_PREFIX)
    return key


def _skip_reason(key: str) -> str | None:
    if key in VOCAB_MAP_KEYS:
        return "vocab-map buffer: checked with its partner and the config, loaded into the drafter's map"
    if key.endswith("rotary_emb.inv_freq"):
        return "RoPE frequencies are recomputed from the config"
    return None


def _check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    for key, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
            raise CheckpointError(f"{where}: tensor {key} holds {nan} NaN and {inf} Inf values")


def _vocab_map(
    tensors: dict[str, torch.Tensor], config: DrafterConfig, where: str, report: LoadReport
) -> VocabMap:
    """The drafter's map from d2t/t2d, refusing any contradiction with the config or between the two."""
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is not None and t2d is not None:
        vocab = VocabMap.from_pair(d2t, t2d, where)
    elif d2t is not None:
        vocab = VocabMap.from_d2t(d2t, config.vocab_size, where)
        report.notes.append("t2d absent: derived from d2t")
    elif t2d is not None:
        vocab = VocabMap.from_t2d(t2d, where)
        report.notes.append(
            "d2t absent: derived from t2d (SGLang and vLLM read d2t; a saved copy will have it)"
        )
    else:  # reported as missing by the caller unless Vd = Vt, where the identity is the right map
        if config.draft_vocab_size == config.vocab_size:
            report.notes.append("no d2t/t2d: identity map, as the draft vocab is the whole target vocab")
        return VocabMap.from_ids(torch.arange(config.draft_vocab_size), config.vocab_size, where)
    if vocab.vt != config.vocab_size:
        raise CheckpointError(
            f"{where}: t2d has length {vocab.vt} but config vocab_size (Vt) is {config.vocab_size}"
        )
    if vocab.vd != config.draft_vocab_size:
        raise CheckpointError(
            f"{where}: the vocab map has {vocab.vd} draft tokens but config draft_vocab_size is "
            f"{config.draft_vocab_size}"
        )
    return vocab


def _shape_hint(name: str, config: DrafterConfig) -> str:
    hints = {
        "lm_head.weight": f"rows = draft_vocab_size {config.draft_vocab_size}",
        "fc.weight": f"columns = {config.num_aux_layers} aux layers x target_hidden_size "
        f"{config.target_hidden_size}",
        "embed_tokens.weight": f"rows = vocab_size {config.vocab_size}",
    }
    return f" ({hints[name]} in config.json)" if name in hints else ""


def _common_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    sizes: Counter[torch.dtype] = Counter()
    for tensor in tensors.values():
        if tensor.is_floating_point():
            sizes[tensor.dtype] += tensor.numel()
    return sizes.most_common(1)[0][0] if sizes else torch.float32


def config_source(folder: Path, config: str | os.PathLike | None) -> tuple[Path, list[str]]:
    """The config.json that describes the checkpoint in `folder`, with a note when it is not the folder's:
    `config` when given, else `folder/config.json`, else (a SpecForge 0.2 step folder) the run folder's."""
    if config is not None:
        return Path(config), [f"config from {config}"]
    if (folder / "config.json").is_file():
        return folder, []
    beside = folder.parent / "config.json"
    if (folder / "training_state.pt").is_file() and beside.is_file():
        return beside, [f"config from the run folder: {beside}"]
    raise CheckpointError(
        f"{folder}: no config.json (nor {beside}); a SpecForge 0.2 training checkpoint carries none: give "
        "the run's draft config JSON (--config PATH, or config=PATH)"
    )


def check_published(folder: Path) -> None:
    """A published drafter (a `provenance.json` beside its weights) must still hold the weights it records."""
    record_file = folder / PROVENANCE
    if record_file.is_file():
        for name, recorded in json.loads(record_file.read_text()).get("sha256", {}).items():
            check_recorded_hash(folder / name, recorded, record_file, CheckpointError)


def load_drafter(
    path: str | os.PathLike,
    *,
    strict: bool = True,
    dtype: torch.dtype | None = None,
    config: str | os.PathLike | None = None,
) -> tuple[Eagle3Drafter, LoadReport]:
    """Load a drafter checkpoint (folder, or one of its weight files) → (drafter, report).

    `config` is the config.json (or its folder) to use when the checkpoint has none beside its weights, as
    SpecForge 0.2 training checkpoints do. `dtype` casts every weight; by default they keep the
    checkpoint's dtype (the most common one when several are mixed, with a note).
    """
    path = Path(path)
    folder = _folder(path)
    config_path, config_notes = config_source(folder, config)
    config, layout, notes = read_config(config_path)
    notes = config_notes + notes
    weights_file, source_notes = _weight_sources(path)
    check_published(folder)
    tensors, files, read_notes = read_tensors(weights_file)
    if weights_file.name != "training_state.pt" and (folder / "training_state.pt").is_file():
        try:  # only described: the weights come from the file above
            read_notes.append(describe_training_state(_torch_load(folder / "training_state.pt")))
        except CheckpointError as err:
            read_notes.append(f"training_state.pt not described: {err}")
    where = str(weights_file)
    report = LoadReport(path=str(path), layout=layout, files=files, notes=notes + source_notes + read_notes)
    report.tensors = [
        (key, list(t.shape), str(t.dtype).removeprefix("torch.")) for key, t in sorted(tensors.items())
    ]
    _check_finite(tensors, where)

    has_embedding = "embed_tokens.weight" in tensors
    with torch.device("meta"):
        drafter = Eagle3Drafter(config, embed_tokens=has_embedding)
    expected = {name: list(t.shape) for name, t in drafter.state_dict().items() if name not in VOCAB_MAP_KEYS}
    weight_dtype = dtype or _common_dtype(tensors)

    to_assign: dict[str, torch.Tensor] = {}
    for key, tensor in sorted(tensors.items()):
        reason = _skip_reason(key)
        if reason is not None:
            report.skipped.append((key, reason))
            continue
        name = canonical_name(key)
        if name in expected and not tensor.is_floating_point():  # load_state_dict would fail without a name
            raise CheckpointError(
                f"{where}: tensor {key} is {str(tensor.dtype).removeprefix('torch.')}; the drafter's {name} "
                "takes floating-point weights"
            )
        if name not in expected:
            report.unexpected.append(key)
        elif name in to_assign:  # e.g. both layers.0.x and midlayer.x
            report.unexpected.append(key)
            report.notes.append(f"{key}: a second tensor for {name}, not loaded")
        elif list(tensor.shape) != expected[name]:
            report.mismatched.append((key, expected[name], list(tensor.shape)))
        else:
            if name != key:
                report.renamed.append((key, name))
            if tensor.is_floating_point() and tensor.dtype != weight_dtype:
                if dtype is None:
                    report.notes.append(f"{key}: {tensor.dtype} cast to {weight_dtype}")
                tensor = tensor.to(weight_dtype)
            to_assign[name] = tensor
            report.loaded.append(name)
    report.missing += [
        name for name in expected if name not in to_assign and not _already_reported(name, report)
    ]
    if not any(key in tensors for key in VOCAB_MAP_KEYS) and config.draft_vocab_size < config.vocab_size:
        # without d2t the engines propose draft ids as if they were target ids (vLLM #18909: tau 1.12)
        report.missing += list(VOCAB_MAP_KEYS)
    if strict and not report.ok:
        problems = "; ".join(report.problems(config))
        raise CheckpointError(
            f"{where}: strict load failed ({report.summary()}): {problems}. Load with strict=False to see "
            "the full report."
        )
    vocab = _vocab_map(tensors, config, where, report)
    to_assign["d2t"], to_assign["t2d"] = vocab.d2t, vocab.t2d
    drafter.load_state_dict(to_assign, strict=False, assign=True)
    _initialise_missing(drafter, weight_dtype)
    return drafter, report


def _already_reported(name: str, report: LoadReport) -> bool:
    return any(canonical_name(key) == name for key, _, _ in report.mismatched)


def _initialise_missing(drafter: Eagle3Drafter, dtype: torch.dtype) -> None:
    """Give every parameter a non-strict load left on the meta device a fresh initialisation."""
    for module in drafter.modules():
        if any(p.is_meta for p in module.parameters(recurse=False)):
            module.to_empty(device="cpu", recurse=False)
            module.to(dtype)
            Eagle3Drafter.init_module(module)


# ----------------------------------------------------------------------------- saving


def checkpoint_tensors(
    drafter: Eagle3Drafter, layout: str, require_embedding: bool = True
) -> dict[str, torch.Tensor]:
    """The drafter's tensors under `layout`'s key names. The speculators layout also gets the attached target
    embedding as `embed_tokens.weight` (speculators saves and needs it; without one, and with
    `require_embedding`, it is refused); the SGLang layout never does (SGLang and vLLM take the target's)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    tensors = {}
    for name, tensor in drafter.state_dict().items():
        key = name
        if layout == "speculators" and name.startswith(SGLANG_PREFIX):
            key = SPECULATORS_PREFIX + name.removeprefix(SGLANG_PREFIX)
        tensors[key] = tensor.detach().to("cpu").contiguous().clone()
    if layout == "speculators" and "embed_tokens.weight" not in tensors:
        embedding = getattr(drafter, "target_embedding", None)
        if embedding is not None:
            weight_dtype = drafter.lm_head.weight.dtype
            tensors["embed_tokens.weight"] = embedding.detach().to("cpu", weight_dtype).clone()
        elif require_embedding:
            raise CheckpointError(
                "a speculators-layout checkpoint needs the target's token embedding (speculators loads "
                "one without embed_tokens.weight with a NaN embedding and no warning); this drafter carries "
                "none: attach the target's (drafter.attach_embedding, or --target on eagle3 convert)"
            )
    return tensors


def save_drafter(
    drafter: Eagle3Drafter,
    path: str | os.PathLike,
    layout: str = "sglang",
    *,
    overwrite: bool = False,
    engines: Sequence[str] | None = None,
    allow_engine_mismatch: bool = False,
    files: dict[str, str] | None = None,
) -> Path:
    """Write `path/` (config.json + model.safetensors, and the text `files` by name, e.g. a remap report) in
    `layout`, atomically: a temporary folder beside it is filled, then renamed into place. An existing folder
    is refused unless `overwrite`.

    eagle3lib reads back everything it writes, so its own checkpoints (`engines=None`) are saved whatever the
    engines do. An export names the projects it is for (`engines`, e.g. `LAYOUT_READERS[layout]`) and is
    refused (EngineMismatchError) when one of them would compute something else, unless
    `allow_engine_mismatch` (`convert` reports them). A speculators-layout save needs the
    token embedding unless it is for vLLM alone (vLLM takes the target's)."""
    path = Path(path)
    if os.path.lexists(path) and not overwrite:
        raise FileExistsError(
            f"{describe_occupant(path)}; refusing to overwrite a checkpoint (pass overwrite=True)"
        )
    if engines is not None:
        drafter.config.check_engines(layout, f"export to {path}", allow_engine_mismatch, engines)
        if layout == "speculators" and "speculators" in engines and not drafter.config.verifier:
            raise CheckpointError(
                f"export to {path}: verifier.name_or_path is unknown, and speculators' from_pretrained reads "
                "the verifier's config from it (a null crashes it): give the target's model folder "
                "(--target, or set drafter.config.verifier)"
            )
    for_speculators = engines is None or "speculators" in engines
    tensors = checkpoint_tensors(drafter, layout, require_embedding=for_speculators)
    _check_finite(tensors, f"drafter to be saved at {path}")
    VocabMap.from_pair(tensors["d2t"], tensors["t2d"], f"drafter to be saved at {path}").check_vt(
        drafter.config.vocab_size, "the config"
    )
    dtype = str(drafter.lm_head.weight.dtype).removeprefix("torch.")
    with staged_folder(path, replace=overwrite) as staging:
        save_safetensors(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        write_config(drafter.config, staging, layout, dtype)
        for name, text in (files or {}).items():
            atomic_write_text(staging / name, text)
    return path


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    layout: str,
    *,
    overwrite: bool = False,
    config: str | os.PathLike | None = None,
    target_embedding: torch.Tensor | None = None,
    verifier: str | None = None,
    allow_engine_mismatch: bool = False,
    engines: Sequence[str] | None = None,
) -> LoadReport:
    """Load `src` strictly (with `config` when it has none beside it) and export it to `dst` in `layout` for
    `engines` (default: every project that reads `layout`, `LAYOUT_READERS`); returns the load report, with
    the export's notes added.

    `target_embedding` (the target's embed_tokens weight) is what a speculators-layout export needs when the
    checkpoint carries no embedding; `verifier` the target's model folder or name that speculators records
    (`eagle3 convert --target` reads both from a target)."""
    drafter, report = load_drafter(src, strict=True, config=config)
    if target_embedding is not None and not drafter.owns_embedding:
        drafter.attach_embedding(target_embedding)
    if verifier is not None:
        drafter.config.verifier = verifier
    engines = LAYOUT_READERS[layout] if engines is None else engines
    where = f"export of {src} to {dst}"
    report.notes += drafter.config.check_engines(layout, where, allow_engine_mismatch, engines)
    allow = allow_engine_mismatch
    save_drafter(drafter, dst, layout, overwrite=overwrite, engines=engines, allow_engine_mismatch=allow)
    if layout == "speculators" and not drafter.config.verifier:  # an export for vLLM alone
        report.notes.append("verifier.name_or_path unknown: written as null (vLLM does not read it)")
    return report
