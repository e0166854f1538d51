"""Training batches from hidden states, one small reader per format behind one interface (`BatchReader`).

- `FolderReader`: eagle3lib's own data folders (`data.layout` describes them; `manifest.json` is checked
  against every shard on opening);
- `SpecForgeDumpReader`: SpecForge's `data_*.ckpt` files (any depth): `input_ids`, `loss_mask`,
  `hidden_state` [1, T, H] (after the final norm), `aux_hidden_state` [1, T, A*H];
- `SpeculatorsDumpReader`: speculators' `hs_*.safetensors` files (any depth): `token_ids` [T],
  `hidden_states` [T, A+1, H], the last slot the verifier's state before the final norm. speculators keeps
  loss masks in its Arrow dataset, which is not read here: a file's own `loss_mask` is used, else
  `assume_full_loss_mask=True` must be passed to train on every position;
- `eagle3lib.generation.online.OnlineReader`: no stored states, the target computes them for each batch.
`open_reader` picks the reader a folder's files call for. Every reader yields the same batches from the same
samples: shards (or files) and the samples within them in a seeded order, each sample cut into windows of
at most `seq_len` tokens, laid into rows (`BatchPlanner`) and collated (`collate`):
- packed (`packing=True`, training's default): each row of `seq_len` tokens holds whole windows, first fit
  decreasing over a pool of a few rows' worth in reading order, so that nearly every computed position is a
  real token; `position_ids` restart at 0 for each window, which is how the trainer keeps each to itself;
- one window a row, right-padded to the batch's longest (`packing=False`).
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from eagle3lib.data.layout import (
    AUX_CONVENTION,
    FORMAT,
    FORMAT_VERSION,
    LAST_HIDDEN,
    SHARD_KEYS,
    STORED_DTYPES,
    TARGET_HEAD_FILE,
    TOKEN_COUNTS_FILE,
    VOCAB_MAP_FILE,
    DataError,
    dtype_name,
    load_target_head,
    prepared_dir,
)
from eagle3lib.drafter.model import rms_norm
from eagle3lib.drafter.vocab import VocabMap
from eagle3lib.files import load_weights_only, read_safetensors, read_safetensors_header, resolve_path


class BatchReader(ABC):
    """What the trainer reads: training batches, and what the data says about itself (`manifest`: the target
    it was captured from where known, aux layer ids and sizes)."""

    format: ClassVar[str]
    path: Path
    manifest: dict

    @property
    def aux_layer_ids(self) -> list[int] | None:
        return self.manifest["aux_layer_ids"]

    @property
    @abstractmethod
    def hidden_size(self) -> int: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def num_samples(self) -> int: ...

    @abstractmethod
    def batches(
        self, batch_size: int, seq_len: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
        skip: int = 0, rows: slice | None = None, packing: bool = False,
    ) -> Iterator[dict[str, Tensor]]:
        """Training batches: `input_ids`, `loss_mask`, `aux_hidden_states`, `last_hidden_state`,
        `target_argmax`, `attention_mask` (bool: a real token) and `position_ids` (restarting at 0 with each
        window), each [B, T, ...] with T ≤ seq_len.

        A sample longer than seq_len is cut into consecutive windows of seq_len (nothing is dropped;
        each window keeps the hidden states captured with the full context). With `packing`, a row holds as
        many whole windows as fit in seq_len (`BatchPlanner`); without, one. `skip` passes over the first
        batches (a resumed epoch); `rows` keeps those rows of each batch (one process's share).
        """

    def lengths_in_order(self, shuffle: bool, seed: int) -> Iterator[tuple[int, int]] | None:
        """(length, key) of every sample in the order an epoch reads them, without reading the samples; None
        where the lengths are known only by reading every sample (a SpecForge or speculators dump)."""
        return None

    def batches_per_epoch(self, batch_size: int, seq_len: int, seed: int, packing: bool) -> int | None:
        """How many whole batches `batches(..., drop_last=True)` gives in the epoch of `seed`: the planner
        over the lengths alone (seconds for 15k samples); None where the lengths are not known cheaply."""
        order = self.lengths_in_order(True, seed)
        if order is None:
            return None
        return sum(1 for _ in BatchPlanner(batch_size, seq_len, True, packing).plans(order))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.path)!r}, samples={self.num_samples}, H={self.hidden_size}, "
            f"aux={self.aux_layer_ids})"
        )


class StoredStatesReader(BatchReader):
    """Hidden states read from files, sample by sample; the head weights computing the target's argmax and
    the target the data fits are checked against the data."""

    def __init__(self, path: Path, manifest: dict, head_path: str | os.PathLike | None, target):
        self.path, self.manifest = path, manifest
        self._head_path, self._target, self._head = head_path, target, None
        if target is not None:
            self.check_target(target)

    @property
    def hidden_size(self) -> int:
        return self.manifest["hidden_size"]

    @property
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    @property
    def num_samples(self) -> int:
        return self.manifest["num_samples"]

    @property
    def head(self) -> dict[str, Tensor]:
        """The target's embed_tokens / norm / lm_head weights."""
        if self._head is None:
            self._head, self._eps = self._load_head()
        return self._head

    def _load_head(self) -> tuple[dict[str, Tensor], float | None]:
        if self._head_path is not None:
            head, eps = load_target_head(self._head_path)
        elif self._target is not None:
            head, eps = self._target.head_weights(), self._target.rms_norm_eps
        else:
            raise DataError(
                f"{self.path}: a {self.format} dump carries no target head; pass target= (a Target) "
                "or head= (a target_head.safetensors) to compute the target's argmax"
            )
        width = head["lm_head.weight"].shape[1]
        if width != self.hidden_size:
            raise DataError(
                f"{self.path}: the target head has hidden size {width}, the data {self.hidden_size}"
            )
        return head, eps

    def check_target(self, target) -> None:
        """Refuse a target other than the one the data was captured from (or one that cannot fit it)."""
        problems = []
        if target.hidden_size != self.hidden_size:
            problems.append(f"hidden size {target.hidden_size} vs the data's {self.hidden_size}")
        recorded = self.manifest.get("target") or {}
        if recorded.get("vocab_size") is not None and recorded["vocab_size"] != target.vocab_size:
            problems.append(f"vocab size {target.vocab_size} vs the data's {recorded['vocab_size']}")
        if recorded.get("fingerprint") and recorded["fingerprint"] != target.fingerprint:
            problems.append(
                f"fingerprint {target.fingerprint} vs the data's {recorded['fingerprint']} "
                f"(captured from {recorded.get('name')})"
            )
        if self.aux_layer_ids is not None and max(self.aux_layer_ids) >= target.num_layers:
            problems.append(f"aux layers {self.aux_layer_ids} outside its {target.num_layers} layers")
        if problems:
            raise DataError(
                f"{self.described_at}: the data does not fit target {target.name}: " + "; ".join(problems)
            )

    @property
    def described_at(self) -> Path:
        """Where what the data says about itself is written, for messages."""
        return self.path

    def token_counts(self) -> Tensor:
        """Input-token counts under the loss mask, [Vt] int64 (for VocabMap.from_counts)."""
        counts = torch.zeros(self.vocab_size, dtype=torch.long)
        for sample in self.samples():
            counts += torch.bincount(sample["input_ids"][sample["loss_mask"]], minlength=self.vocab_size)
        return counts

    @abstractmethod
    def samples(self, shuffle: bool = False, seed: int = 0) -> Iterator[dict[str, Tensor]]:
        """Every sample as unpadded [T, ...] tensors; with `shuffle`, shards (or files) and the samples
        within each shard come in a seeded random order (memory stays at one shard)."""

    def batches(
        self, batch_size: int, seq_len: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
        skip: int = 0, rows: slice | None = None, packing: bool = False,
    ) -> Iterator[dict[str, Tensor]]:
        held: dict[int, dict[str, Tensor]] = {}

        def numbered() -> Iterator[tuple[int, int]]:
            for i, sample in enumerate(self.samples(shuffle, seed)):
                held[i] = sample
                yield sample["input_ids"].shape[0], i

        planner = BatchPlanner(batch_size, seq_len, drop_last, packing)
        for n, plan in enumerate(planner.plans(numbered())):
            if n >= skip:
                mine = plan[rows or slice(None)]
                yield collate([[window(held[key], start, seq_len) for key, start in row] for row in mine],
                              seq_len if packing else None)
            for key in [key for key in held if key not in planner.pending]:
                del held[key]


def open_reader(
    path: str | os.PathLike,
    target=None,
    *,
    head: str | os.PathLike | None = None,
    aux_layer_ids: list[int] | None = None,
    assume_full_loss_mask: bool = False,
) -> StoredStatesReader:
    """The reader for what `path` holds: an eagle3lib data folder (`manifest.json`), else a SpecForge or a
    speculators dump.

    Dumps carry no target argmax and no aux ids: `target` (a loaded Target) or `head` (a target head file,
    see `data.load_target_head`) supplies the head that computes the argmax (and, for speculators, the final
    norm); `aux_layer_ids` (eagle3lib numbering) records which layers the dump holds. `target`, when given,
    is also checked against the data (fingerprint, sizes, aux ids)."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"{path}: data folder not found")
    if (path / "manifest.json").is_file():
        return FolderReader(path, target, aux_layer_ids)
    if files := _dump_files(path, SpecForgeDumpReader.pattern):
        return SpecForgeDumpReader(path, files, target, head, aux_layer_ids)
    if files := _dump_files(path, SpeculatorsDumpReader.pattern):
        return SpeculatorsDumpReader(path, files, target, head, aux_layer_ids, assume_full_loss_mask)
    raise DataError(
        f"{path}: no manifest.json, no SpecForge data_*.ckpt and no speculators "
        "hs_*.safetensors files: not a data folder"
    )


# ---------------------------------------------------------------- eagle3lib's own folders


class FolderReader(StoredStatesReader):
    """An eagle3lib data folder: shards of samples, checked against its manifest when opened."""

    format = "eagle3lib"

    def __init__(self, path: Path, target=None, aux_layer_ids: list[int] | None = None):
        manifest = self._check_manifest(path)
        if aux_layer_ids is not None and list(aux_layer_ids) != manifest["aux_layer_ids"]:
            raise DataError(
                f"{path}: holds aux layers {manifest['aux_layer_ids']}, "
                f"not the {list(aux_layer_ids)} asked for"
            )
        super().__init__(path, manifest, path / TARGET_HEAD_FILE, target)

    @property
    def described_at(self) -> Path:
        return self.path / "manifest.json"

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_layer_ids)

    def token_counts(self) -> Tensor:
        file = self.path / TOKEN_COUNTS_FILE
        counts = read_safetensors(file, ["counts"], DataError)["counts"]
        if counts.shape != (self.vocab_size,):
            raise DataError(f"{file}: counts has shape {list(counts.shape)}, expected [{self.vocab_size}]")
        return counts

    def lengths_in_order(self, shuffle: bool, seed: int) -> Iterator[tuple[int, int]]:
        shards, key = self.manifest["shards"], 0
        for s, order in reading_order([entry["num_samples"] for entry in shards], shuffle, seed):
            lengths = read_safetensors(self.path / shards[s]["file"], ["sample_lengths"], DataError)
            for i in order:
                yield int(lengths["sample_lengths"][i]), key
                key += 1

    def samples(self, shuffle: bool = False, seed: int = 0) -> Iterator[dict[str, Tensor]]:
        shards = self.manifest["shards"]
        for s, order in reading_order([entry["num_samples"] for entry in shards], shuffle, seed):
            tensors = read_safetensors(self.path / shards[s]["file"], error=DataError)
            lengths = tensors.pop("sample_lengths")
            starts = torch.cumsum(lengths, 0) - lengths
            for i in order:
                start, n = int(starts[i]), int(lengths[i])
                yield {k: v[start : start + n] for k, v in tensors.items()}

    @classmethod
    def _check_manifest(cls, path: Path) -> dict:
        file = path / "manifest.json"
        try:
            manifest = json.loads(file.read_text())
        except json.JSONDecodeError as err:
            raise DataError(f"{file}: not valid JSON: {err}") from err
        required = ("format", "version", "target", "aux_layer_ids", "last_hidden", "dtype", "hidden_size",
                    "vocab_size", "num_samples", "num_tokens", "shards")
        missing = [k for k in required if k not in manifest]
        if missing:
            raise DataError(f"{file}: lacks {', '.join(missing)}")
        if manifest["format"] != FORMAT or manifest["version"] != FORMAT_VERSION:
            raise DataError(
                f"{file}: format {manifest['format']!r} v{manifest['version']}, expected {FORMAT!r} "
                f"v{FORMAT_VERSION}"
            )
        if manifest["last_hidden"] != LAST_HIDDEN:
            raise DataError(
                f"{file}: last_hidden is {manifest['last_hidden']!r}; this reader needs {LAST_HIDDEN!r}"
            )
        if manifest["dtype"] not in STORED_DTYPES.values():
            raise DataError(f"{file}: dtype {manifest['dtype']!r} is not float32, bfloat16 or float16")
        listed = [s["file"] for s in manifest["shards"]]
        on_disk = sorted(p.name for p in path.glob("shard_*.safetensors"))
        if sorted(listed) != on_disk:
            raise DataError(f"{file}: lists shards {listed} but the folder holds {on_disk}")
        hidden, width = manifest["hidden_size"], len(manifest["aux_layer_ids"]) * manifest["hidden_size"]
        for entry in manifest["shards"]:
            cls._check_shard(path / entry["file"], entry, hidden, width, manifest["dtype"])
        for key in ("num_samples", "num_tokens"):
            total = sum(s[key] for s in manifest["shards"])
            if total != manifest[key]:
                raise DataError(f"{file}: {key} is {manifest[key]} but the shards add up to {total}")
        vocab = manifest["vocab_size"]
        head_shapes = {
            "embed_tokens.weight": [vocab, hidden], "norm.weight": [hidden], "lm_head.weight": [vocab, hidden]
        }
        for name, shapes in ((TOKEN_COUNTS_FILE, {"counts": [vocab]}), (TARGET_HEAD_FILE, head_shapes)):
            if not (path / name).is_file():
                raise DataError(f"{path / name}: missing from the data folder")
            header = read_safetensors_header(path / name, DataError).tensors
            for key, shape in shapes.items():
                if key not in header or header[key][0] != shape:
                    found = header[key][0] if key in header else "nothing"
                    raise DataError(f"{path / name}: {key} should be {shape}, found {found}")
        return manifest

    @staticmethod
    def _check_shard(shard: Path, entry: dict, hidden: int, width: int, dtype: str) -> None:
        header = read_safetensors_header(shard, DataError).tensors
        missing = [k for k in SHARD_KEYS if k not in header]
        if missing:
            raise DataError(f"{shard}: lacks {', '.join(missing)}")
        n = entry["num_tokens"]
        expected = {
            "input_ids": [n],
            "loss_mask": [n],
            "target_argmax": [n],
            "aux_hidden_states": [n, width],
            "last_hidden_state": [n, hidden],
            "sample_lengths": [entry["num_samples"]],
        }
        for key, shape in expected.items():
            if header[key][0] != shape:
                raise DataError(f"{shard}: {key} has shape {header[key][0]}, the manifest implies {shape}")
        for key in ("aux_hidden_states", "last_hidden_state"):
            if STORED_DTYPES.get(header[key][1]) != dtype:
                raise DataError(f"{shard}: {key} is {header[key][1]}, the manifest says {dtype}")
        lengths = read_safetensors(shard, ["sample_lengths"], DataError)["sample_lengths"]
        if int(lengths.sum()) != n or bool((lengths < 1).any()):
            raise DataError(f"{shard}: sample_lengths add up to {int(lengths.sum())}, not its {n} tokens")


# ---------------------------------------------------------------- dumps of other tools


class DumpReader(StoredStatesReader):
    """A dump of another tool: one sample per file, without the target's argmax (computed here from the
    target's head) and without aux ids (named by the caller)."""

    pattern: ClassVar[str]  # the dump's file names

    def __init__(self, path: Path, files: list[Path], target, head: str | os.PathLike | None,
                 aux_layer_ids: list[int] | None):
        self.files = files
        first = self._read_file(files[0])
        hidden = first["last_hidden_state"].shape[-1]
        num_aux = first["aux_hidden_states"].shape[-1] // hidden
        if aux_layer_ids is not None and len(aux_layer_ids) != num_aux:
            raise DataError(
                f"{files[0]}: holds {num_aux} aux states per token, but aux_layer_ids "
                f"{list(aux_layer_ids)} names {len(aux_layer_ids)}"
            )
        manifest = {
            "format": self.format,
            "target": None,
            "hidden_size": hidden,
            "num_aux_layers": num_aux,
            "aux_layer_ids": None if aux_layer_ids is None else list(aux_layer_ids),
            "aux_layer_convention": AUX_CONVENTION,
            "last_hidden": LAST_HIDDEN,
            "vocab_size": None,
            "dtype": dtype_name(first["aux_hidden_states"].dtype),
            "num_samples": len(files),
        }
        super().__init__(path, manifest, head, target)

    @property
    def vocab_size(self) -> int:
        if self.manifest.get("vocab_size") is None:  # a dump does not say: the target head does
            self.manifest["vocab_size"] = self.head["lm_head.weight"].shape[0]
        return self.manifest["vocab_size"]

    @property
    def num_aux_layers(self) -> int:
        return self.manifest["num_aux_layers"]

    @abstractmethod
    def _read_raw(self, file: Path) -> dict[str, Tensor]:
        """One file as a sample with `input_ids`, `loss_mask`, `aux_hidden_states`, `last_hidden_state`."""

    def _read_file(self, file: Path) -> dict[str, Tensor]:
        """One dump file as a sample with our keys (target_argmax not yet added), positions checked."""
        sample = self._read_raw(file)
        length = sample["input_ids"].shape[0]
        for key, value in sample.items():
            if value.shape[0] != length:
                raise DataError(f"{file}: {key} covers {value.shape[0]} positions, input ids {length}")
        sample["input_ids"], sample["loss_mask"] = sample["input_ids"].long(), sample["loss_mask"].bool()
        return sample

    def _check_widths(self, sample: dict[str, Tensor], file: Path) -> None:
        """Hidden widths against the first file's."""
        hidden, num_aux = self.hidden_size, self.num_aux_layers
        last, aux = sample["last_hidden_state"].shape[-1], sample["aux_hidden_states"].shape[-1]
        if last != hidden or aux != num_aux * hidden:
            raise DataError(
                f"{file}: hidden states of widths {last} / {aux}, but {self.files[0].name} has {hidden} / "
                f"{num_aux * hidden}"
            )

    def _last_hidden_state(self, last: Tensor) -> Tensor:
        """The dump's last state as eagle3lib stores it: after the target's final norm."""
        return last

    def samples(self, shuffle: bool = False, seed: int = 0) -> Iterator[dict[str, Tensor]]:
        for i, _ in reading_order([1] * len(self.files), shuffle, seed):
            sample = self._read_file(self.files[i])
            self._check_widths(sample, self.files[i])
            last = self._last_hidden_state(sample["last_hidden_state"])
            weight = self.head["lm_head.weight"].float()
            argmax = torch.cat([(part.float() @ weight.T).argmax(-1) for part in last.split(1024)])
            yield {**sample, "last_hidden_state": last, "target_argmax": argmax}


class SpecForgeDumpReader(DumpReader):
    format = "specforge"
    pattern = "data_*.ckpt"

    def _read_raw(self, file: Path) -> dict[str, Tensor]:
        raw = load_weights_only(file, DataError)
        need = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
        if not isinstance(raw, dict) or any(k not in raw for k in need):
            found = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
            raise DataError(f"{file}: a SpecForge sample needs keys {list(need)}, found {found}")
        return {
            "input_ids": raw["input_ids"].reshape(-1),
            "loss_mask": raw["loss_mask"].reshape(-1),
            "last_hidden_state": _squeeze_batch(raw["hidden_state"], file, "hidden_state"),
            "aux_hidden_states": _squeeze_batch(raw["aux_hidden_state"], file, "aux_hidden_state"),
        }


class SpeculatorsDumpReader(DumpReader):
    format = "speculators"
    pattern = "hs_*.safetensors"

    def __init__(self, path: Path, files: list[Path], target, head: str | os.PathLike | None,
                 aux_layer_ids: list[int] | None, assume_full_loss_mask: bool = False):
        self.assume_full_loss_mask = assume_full_loss_mask
        super().__init__(path, files, target, head, aux_layer_ids)

    def _read_raw(self, file: Path) -> dict[str, Tensor]:
        raw = read_safetensors(file, error=DataError)
        if "hidden_states" not in raw or "token_ids" not in raw:
            raise DataError(
                f"{file}: a speculators sample needs hidden_states and token_ids, found {sorted(raw)}"
            )
        states = raw["hidden_states"]
        if states.dim() != 3 or states.shape[1] < 2:
            raise DataError(f"{file}: hidden_states has shape {list(states.shape)}, expected [T, A+1, H]")
        if "loss_mask" in raw:
            loss_mask = raw["loss_mask"].reshape(-1)
        elif self.assume_full_loss_mask:
            loss_mask = torch.ones(states.shape[0], dtype=torch.bool)
        else:
            raise DataError(
                f"{file}: no loss_mask (speculators keeps it in its Arrow dataset); pass "
                "assume_full_loss_mask=True to train on every position"
            )
        return {
            "input_ids": raw["token_ids"].reshape(-1),
            "loss_mask": loss_mask,
            "aux_hidden_states": states[:, :-1].flatten(1),
            "last_hidden_state": states[:, -1],
        }

    def _last_hidden_state(self, last: Tensor) -> Tensor:
        """speculators stores the verifier's state before its final norm (docs/formats.md §4)."""
        head = self.head
        if self._eps is None:
            raise DataError(f"{self._head_path}: no rms_norm_eps in its metadata; pass target= instead")
        return rms_norm(last, head["norm.weight"].to(last.dtype), self._eps)


def _dump_files(path: Path, pattern: str) -> list[Path]:
    return sorted(path.rglob(pattern), key=_index_in_name)


def _index_in_name(path: Path) -> tuple[int, str]:
    """data_12.ckpt / hs_12.safetensors → 12, so files come in their generation order."""
    digits = path.stem.rsplit("_", 1)[-1]
    return (int(digits) if digits.isdigit() else -1, str(path))


def _squeeze_batch(tensor: Tensor, file: Path, key: str) -> Tensor:
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        return tensor[0]
    if tensor.dim() == 2:
        return tensor
    raise DataError(f"{file}: {key} has shape {list(tensor.shape)}, expected [1, T, width] or [T, width]")


# ---------------------------------------------------------------- batches and windows, every reader's


def reading_order(shard_sizes: list[int], shuffle: bool, seed: int) -> Iterator[tuple[int, list[int]]]:
    """(shard, its sample indices) in the order an epoch reads them: as stored, or with `shuffle` the
    shards and then the samples within each in a seeded random order (memory stays at one shard)."""
    generator = torch.Generator().manual_seed(seed)
    count = len(shard_sizes)
    for s in torch.randperm(count, generator=generator).tolist() if shuffle else range(count):
        size = shard_sizes[s]
        yield s, torch.randperm(size, generator=generator).tolist() if shuffle else list(range(size))


def shard_sizes(lengths: list[int], shard_tokens: int) -> list[int]:
    """Samples per shard when samples of these lengths are written in order: a shard closes as soon as it
    holds `shard_tokens` tokens (`DataWriter`'s rule; the online reader reads text in the same shards)."""
    sizes, count, tokens = [], 0, 0
    for length in lengths:
        count, tokens = count + 1, tokens + length
        if tokens >= shard_tokens:
            sizes.append(count)
            count, tokens = 0, 0
    return sizes + [count] if count else sizes


class BatchPlanner:
    """Batches as plans, from (length, key) pairs in reading order: rows, each a list of (sample key, start)
    windows of at most seq_len tokens (a sample longer than seq_len gives consecutive windows).

    Without `packing` a row is one window. With it, windows wait in a pool until it holds `pool_rows` rows'
    worth of tokens, are laid first fit decreasing into rows of seq_len, and the rows go out in batches; the
    pool's least filled quarter of rows stays behind for the next round, so rows come out nearly full.
    Deterministic in the order and the lengths alone. While `plans` runs, `pending` holds the keys of the
    samples a later batch still needs: a reader may forget the others."""

    def __init__(self, batch_size: int, seq_len: int, drop_last: bool = False, packing: bool = False,
                 pool_rows: int | None = None):
        if batch_size < 1 or seq_len < 2:
            raise DataError(f"batch_size must be ≥ 1 and seq_len ≥ 2, got {batch_size} and {seq_len}")
        self.batch_size, self.seq_len, self.drop_last, self.packing = batch_size, seq_len, drop_last, packing
        self.pool_rows = pool_rows or max(2 * batch_size, 8)
        self.pending: set[int] = set()

    def plans(self, samples: Iterator[tuple[int, int]]) -> Iterator[list[list[tuple[int, int]]]]:
        ready: list[list[tuple[int, int, int]]] = []  # rows waiting to fill a batch
        pool: list[tuple[int, int, int]] = []  # (length, key, start) windows not in a row yet
        for length, key in samples:
            self.pending.add(key)
            starts = range(0, length, self.seq_len)
            pool += [(min(self.seq_len, length - start), key, start) for start in starts]
            if not self.packing:
                ready, pool = ready + [[piece] for piece in pool], []
            elif sum(piece[0] for piece in pool) >= self.pool_rows * self.seq_len:
                rows = first_fit_decreasing(pool, self.seq_len)
                keep = max(1, len(rows) // 4)
                ready, pool = ready + rows[:-keep], [piece for row in rows[-keep:] for piece in row]
            while len(ready) >= self.batch_size:
                yield self._plan(ready[: self.batch_size], ready[self.batch_size :], pool)
                ready = ready[self.batch_size :]
        ready += first_fit_decreasing(pool, self.seq_len) if pool else []
        while ready and (len(ready) >= self.batch_size or not self.drop_last):
            yield self._plan(ready[: self.batch_size], ready[self.batch_size :], [])
            ready = ready[self.batch_size :]

    def _plan(self, rows, later_rows, pool) -> list[list[tuple[int, int]]]:
        self.pending = {key for row in later_rows for _, key, _ in row} | {key for _, key, _ in pool}
        return [[(key, start) for _, key, start in row] for row in rows]


def first_fit_decreasing(pieces: list[tuple[int, int, int]], capacity: int) -> list[list[tuple]]:
    """(length, key, start) pieces in rows of at most `capacity` tokens: longest first (ties in reading
    order), each into the first row it fits, rows in the order they were opened; within a row, pieces in
    reading order."""
    order = sorted(range(len(pieces)), key=lambda i: -pieces[i][0])
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        length = pieces[i][0]
        for r, room in enumerate(free):
            if length <= room:
                rows[r].append(i)
                free[r] -= length
                break
        else:
            rows.append([i])
            free.append(capacity - length)
    return [[pieces[i] for i in sorted(row)] for row in rows]


def window(sample: dict[str, Tensor], start: int, seq_len: int) -> dict[str, Tensor]:
    return {key: value[start : start + seq_len] for key, value in sample.items()}


def collate(rows: list[list[dict[str, Tensor]]], width: int | None = None) -> dict[str, Tensor]:
    """[B, T, ...] tensors from rows of windows laid end to end, zero-padded to `width` (default: the
    longest row), with a bool `attention_mask` (a real token) and `position_ids` that restart at 0 with
    each window and with the padding, on the windows' device."""
    lengths = [[piece["input_ids"].shape[0] for piece in row] for row in rows]
    width = width or max(sum(row) for row in lengths)
    first = rows[0][0]
    device = first["input_ids"].device
    batch = {key: torch.zeros((len(rows), width, *value.shape[1:]), dtype=value.dtype, device=device)
             for key, value in first.items()}
    batch["attention_mask"] = torch.zeros((len(rows), width), dtype=torch.bool, device=device)
    batch["position_ids"] = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for r, (row, row_lengths) in enumerate(zip(rows, lengths, strict=True)):
        start = 0
        for piece, length in zip(row, row_lengths, strict=True):
            for key, value in piece.items():
                batch[key][r, start : start + length] = value
            batch["position_ids"][r, start : start + length] = torch.arange(length, device=device)
            start += length
        batch["attention_mask"][r, :start] = True
        batch["position_ids"][r, start:] = torch.arange(width - start, device=device)
    return batch


@dataclass
class TrainingData:
    """What the trainer reads: batches, and what it needs besides them."""

    reader: BatchReader
    vocab_map: VocabMap
    head: dict[str, torch.Tensor]  # the target's embed_tokens / norm / lm_head weights
    target_hidden_size: int
    vocab_size: int
    aux_layer_ids: list[int]
    target: str  # the target's name, for messages
    verifier: str | None = None  # the target the data was captured from, where the data names it


def training_vocab_map(train: dict, folder: Path, vocab_size: int) -> VocabMap:
    """The draft vocab to train for: `train.vocab_map`, else the map of the data in `folder`."""
    path = resolve_path(train["vocab_map"]) if train["vocab_map"] else folder / VOCAB_MAP_FILE
    if not path.exists():
        raise DataError(f"{path}: no vocab map (set train.vocab_map, or prepare the data with one)")
    return VocabMap.load(path, vt=vocab_size)


def offline_training_data(train: dict, run_dir: str | os.PathLike | None) -> TrainingData:
    """The trainer's inputs from captured hidden states: `train.data` (else this run's 00_prepare_data) and
    `train.vocab_map` (else that data folder's vocab map)."""
    if train["data"]:
        folder = resolve_path(train["data"])
    elif run_dir is not None:
        folder = prepared_dir(run_dir)
    else:
        raise DataError("train.data is empty and there is no run folder to take 00_prepare_data's data from")
    # a SpecForge or speculators dump carries no target head and no aux ids: the recipe names them
    head = resolve_path(train["target_head"]) if train["target_head"] else None
    reader = open_reader(folder, head=head, aux_layer_ids=train["aux_layer_ids"] or None)
    captured_from = (reader.manifest.get("target") or {}).get("name")
    return TrainingData(
        reader=reader,
        vocab_map=training_vocab_map(train, folder, reader.vocab_size),
        head=reader.head,
        target_hidden_size=reader.hidden_size,
        vocab_size=reader.vocab_size,
        aux_layer_ids=list(reader.aux_layer_ids),
        target=captured_from or str(folder),
        verifier=captured_from,
    )
