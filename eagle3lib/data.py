"""Hidden-state data folders: their format, and the readers (ours, SpecForge's dumps, speculators' dumps).

A data folder holds
- `shard_NNNNN.safetensors`: samples concatenated along the token axis, unshifted (row t is position t):
  `input_ids` [N] int64, `loss_mask` [N] bool, `aux_hidden_states` [N, A*H], `last_hidden_state`
  [N, H] (after the target's final norm), `target_argmax` [N] int64 (over the full vocabulary), and
  `sample_lengths` [S] int64 (N = their sum);
- `token_counts.safetensors`: `counts` [Vt] int64, input tokens under the loss mask (what SpecForge and
  speculators build vocab maps from), and `argmax_counts` [Vt], the target's predictions there;
- `target_head.safetensors`: the target's `embed_tokens.weight`, `norm.weight`, `lm_head.weight`;
- `manifest.json`: the target (name, fingerprint, sizes), aux ids and their numbering, where the last
  hidden state was taken, dtype, counts, and the shard list. Readers check it against the shards.

`eagle3lib.sources` makes the training text and `eagle3lib.capture` writes folders (through the target);
this module reads them, and also takes SpecForge dumps (`data_*.ckpt`) and speculators dumps
(`hs_*.safetensors`), which is how large targets are captured with a serving engine: `DataReader` reads
the three formats into one batch format, and the dump readers are its methods.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from eagle3lib.files import load_weights_only, read_safetensors, read_safetensors_header, resolve_path
from eagle3lib.model import rms_norm
from eagle3lib.runs import PREPARE_DATA
from eagle3lib.vocab import VocabMap

FORMAT = "eagle3lib-hidden-states"
FORMAT_VERSION = 1
AUX_CONVENTION = "eagle3lib: id i = output of decoder layer i = HF hidden_states[i+1] (SGLang numbering)"
LAST_HIDDEN = "post_norm"
SHARD_KEYS = (
    "input_ids",
    "loss_mask",
    "aux_hidden_states",
    "last_hidden_state",
    "target_argmax",
    "sample_lengths",
)
HEAD_KEYS = ("embed_tokens.weight", "norm.weight", "lm_head.weight")
SOURCE_SUBDIR = "source"  # 00_prepare_data/source/: data.source_corpus, for training the source drafter
VOCAB_MAP_FILE = "vocab_map.safetensors"
TOKEN_COUNTS_FILE = "token_counts.safetensors"
TARGET_HEAD_FILE = "target_head.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class DataError(ValueError):
    """A data folder or dump that is malformed or does not fit what it is used with."""


# ---------------------------------------------------------------- reading


_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def load_target_head(
    spec: str | os.PathLike, keys: tuple[str, ...] = HEAD_KEYS
) -> tuple[dict[str, Tensor], float | None]:
    """The target's head weights `keys` (of `HEAD_KEYS`) and its final norm's eps: from a
    `target_head.safetensors`, or a data folder holding one, else from the model `spec` names (a Hugging Face
    folder or zoo:<name>)."""
    path = Path(spec)
    file = path / TARGET_HEAD_FILE if path.is_dir() else path
    if not (file.is_file() and file.suffix == ".safetensors"):
        from eagle3lib.target import Target

        target = Target.load(spec, device="cpu")
        weights = target.head_weights()
        return {key: weights[key] for key in keys}, target.rms_norm_eps
    header = read_safetensors_header(file, DataError)
    missing = [k for k in keys if k not in header.tensors]
    if missing:
        raise DataError(f"{file}: lacks {', '.join(missing)}")
    eps = header.metadata.get("rms_norm_eps")
    return read_safetensors(file, keys, DataError), None if eps is None else float(eps)


class DataReader:
    """Training batches from a data folder, a SpecForge dump or a speculators dump.

    - eagle3lib folder (`manifest.json`): the manifest is checked against every shard on opening.
    - SpecForge (`data_*.ckpt`, any depth): `input_ids`, `loss_mask`, `hidden_state` [1, T, H] (after the
      final norm), `aux_hidden_state` [1, T, A*H].
    - speculators (`hs_*.safetensors`, any depth): `token_ids` [T], `hidden_states` [T, A+1, H], the last
      slot the verifier's state before the final norm. speculators keeps loss masks in its Arrow dataset,
      which is not read here: a file's own `loss_mask` is used, else `assume_full_loss_mask=True` must be
      passed to train on every position.
    Dumps carry no target argmax and no aux ids: `target` (a loaded Target) or `head` (a
    target_head.safetensors) supplies the head that computes the argmax (and, for speculators, the final
    norm); `aux_layer_ids` (eagle3lib numbering) records which layers the dump holds.
    `target`, when given, is also checked against the data (fingerprint, sizes, aux ids).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        target=None,
        *,
        head: str | os.PathLike | None = None,
        aux_layer_ids: list[int] | None = None,
        assume_full_loss_mask: bool = False,
    ):
        self.path = Path(path)
        if not self.path.is_dir():
            raise DataError(f"{self.path}: data folder not found")
        self._target, self._head_path, self._head = target, head, None
        self.assume_full_loss_mask = assume_full_loss_mask
        if (self.path / "manifest.json").is_file():
            self.format = "eagle3lib"
            self.manifest = self._check_manifest()
            self._head_path = self.path / TARGET_HEAD_FILE
            if aux_layer_ids is not None and list(aux_layer_ids) != self.manifest["aux_layer_ids"]:
                raise DataError(
                    f"{self.path}: holds aux layers {self.manifest['aux_layer_ids']}, "
                    f"not the {list(aux_layer_ids)} asked for"
                )
        else:
            self.format, self.files = self._find_dump()
            self.manifest = self._dump_manifest(aux_layer_ids)
        if target is not None:
            self.check_target(target)

    # ------------------------------------------------------------------ facts

    @property
    def aux_layer_ids(self) -> list[int] | None:
        return self.manifest["aux_layer_ids"]

    @property
    def hidden_size(self) -> int:
        return self.manifest["hidden_size"]

    @property
    def num_aux_layers(self) -> int:
        return self.manifest["num_aux_layers"] if self.format != "eagle3lib" else len(self.aux_layer_ids)

    @property
    def vocab_size(self) -> int:
        if self.manifest.get("vocab_size") is None:
            self.manifest["vocab_size"] = self.head["lm_head.weight"].shape[0]
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
            where = self.path / "manifest.json" if self.format == "eagle3lib" else self.path
            raise DataError(f"{where}: the data does not fit target {target.name}: " + "; ".join(problems))

    def token_counts(self) -> Tensor:
        """Input-token counts under the loss mask, [Vt] int64 (for VocabMap.from_counts)."""
        if self.format == "eagle3lib":
            file = self.path / TOKEN_COUNTS_FILE
            counts = read_safetensors(file, ["counts"], DataError)["counts"]
            if counts.shape != (self.vocab_size,):
                raise DataError(
                    f"{file}: counts has shape {list(counts.shape)}, expected [{self.vocab_size}]"
                )
            return counts
        counts = torch.zeros(self.vocab_size, dtype=torch.long)
        for sample in self.samples():
            counts += torch.bincount(sample["input_ids"][sample["loss_mask"]], minlength=self.vocab_size)
        return counts

    # ------------------------------------------------------------------ eagle3lib folders

    def _check_manifest(self) -> dict:
        file = self.path / "manifest.json"
        try:
            manifest = json.loads(file.read_text())
        except json.JSONDecodeError as err:
            raise DataError(f"{file}: not valid JSON: {err}") from err
        required = (
            "format",
            "version",
            "target",
            "aux_layer_ids",
            "last_hidden",
            "dtype",
            "hidden_size",
            "vocab_size",
            "num_samples",
            "num_tokens",
            "shards",
        )
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
        if manifest["dtype"] not in _ST_DTYPES.values():
            raise DataError(f"{file}: dtype {manifest['dtype']!r} is not float32, bfloat16 or float16")
        listed = [s["file"] for s in manifest["shards"]]
        on_disk = sorted(p.name for p in self.path.glob("shard_*.safetensors"))
        if sorted(listed) != on_disk:
            raise DataError(f"{file}: lists shards {listed} but the folder holds {on_disk}")
        hidden, width = manifest["hidden_size"], len(manifest["aux_layer_ids"]) * manifest["hidden_size"]
        for entry in manifest["shards"]:
            self._check_shard(self.path / entry["file"], entry, hidden, width, manifest["dtype"])
        for key in ("num_samples", "num_tokens"):
            total = sum(s[key] for s in manifest["shards"])
            if total != manifest[key]:
                raise DataError(f"{file}: {key} is {manifest[key]} but the shards add up to {total}")
        for name, shapes in (
            (TOKEN_COUNTS_FILE, {"counts": [manifest["vocab_size"]]}),
            (
                TARGET_HEAD_FILE,
                {
                    "embed_tokens.weight": [manifest["vocab_size"], hidden],
                    "norm.weight": [hidden],
                    "lm_head.weight": [manifest["vocab_size"], hidden],
                },
            ),
        ):
            if not (self.path / name).is_file():
                raise DataError(f"{self.path / name}: missing from the data folder")
            header = read_safetensors_header(self.path / name, DataError).tensors
            for key, shape in shapes.items():
                if key not in header or header[key][0] != shape:
                    found = header[key][0] if key in header else "nothing"
                    raise DataError(f"{self.path / name}: {key} should be {shape}, found {found}")
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
            if _ST_DTYPES.get(header[key][1]) != dtype:
                raise DataError(f"{shard}: {key} is {header[key][1]}, the manifest says {dtype}")
        lengths = read_safetensors(shard, ["sample_lengths"], DataError)["sample_lengths"]
        if int(lengths.sum()) != n or bool((lengths < 1).any()):
            raise DataError(f"{shard}: sample_lengths add up to {int(lengths.sum())}, not its {n} tokens")

    def _shard_samples(self, entry: dict, order: list[int]) -> Iterator[dict[str, Tensor]]:
        tensors = read_safetensors(self.path / entry["file"], error=DataError)
        lengths = tensors.pop("sample_lengths")
        starts = torch.cumsum(lengths, 0) - lengths
        for i in order:
            start, n = int(starts[i]), int(lengths[i])
            yield {k: v[start : start + n] for k, v in tensors.items()}

    # ------------------------------------------------------------------ dumps of other tools

    def _find_dump(self) -> tuple[str, list[Path]]:
        for fmt, pattern in (("specforge", "data_*.ckpt"), ("speculators", "hs_*.safetensors")):
            files = sorted(self.path.rglob(pattern), key=_index_in_name)
            if files:
                return fmt, files
        raise DataError(
            f"{self.path}: no manifest.json, no SpecForge data_*.ckpt and no speculators "
            "hs_*.safetensors files: not a data folder"
        )

    def _dump_manifest(self, aux_layer_ids: list[int] | None) -> dict:
        first = self._read_dump(self.files[0], check_widths=False)
        hidden = first["last_hidden_state"].shape[-1]
        num_aux = first["aux_hidden_states"].shape[-1] // hidden
        if aux_layer_ids is not None and len(aux_layer_ids) != num_aux:
            raise DataError(
                f"{self.files[0]}: holds {num_aux} aux states per token, but aux_layer_ids "
                f"{list(aux_layer_ids)} names {len(aux_layer_ids)}"
            )
        return {
            "format": self.format,
            "target": None,
            "hidden_size": hidden,
            "num_aux_layers": num_aux,
            "aux_layer_ids": None if aux_layer_ids is None else list(aux_layer_ids),
            "aux_layer_convention": AUX_CONVENTION,
            "last_hidden": LAST_HIDDEN,
            "vocab_size": None,
            "dtype": dtype_name(first["aux_hidden_states"].dtype),
            "num_samples": len(self.files),
        }

    def _read_dump(self, file: Path, check_widths: bool = True) -> dict[str, Tensor]:
        """One dump file as a sample with our keys (target_argmax not yet added); shapes checked, and
        hidden widths against the first file's."""
        if self.format == "specforge":
            raw = load_weights_only(file, DataError)
            need = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
            if not isinstance(raw, dict) or any(k not in raw for k in need):
                found = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
                raise DataError(f"{file}: a SpecForge sample needs keys {list(need)}, found {found}")
            sample = {
                "input_ids": raw["input_ids"].reshape(-1),
                "loss_mask": raw["loss_mask"].reshape(-1),
                "last_hidden_state": _squeeze_batch(raw["hidden_state"], file, "hidden_state"),
                "aux_hidden_states": _squeeze_batch(raw["aux_hidden_state"], file, "aux_hidden_state"),
            }
        else:
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
            sample = {
                "input_ids": raw["token_ids"].reshape(-1),
                "loss_mask": loss_mask,
                "aux_hidden_states": states[:, :-1].flatten(1),
                "last_hidden_state": states[:, -1],
            }
        length = sample["input_ids"].shape[0]
        for key, value in sample.items():
            if value.shape[0] != length:
                raise DataError(f"{file}: {key} covers {value.shape[0]} positions, input ids {length}")
        if check_widths:
            hidden, num_aux = self.hidden_size, self.num_aux_layers
            if (
                sample["last_hidden_state"].shape[-1] != hidden
                or sample["aux_hidden_states"].shape[-1] != num_aux * hidden
            ):
                raise DataError(
                    f"{file}: hidden states of widths {sample['last_hidden_state'].shape[-1]} / "
                    f"{sample['aux_hidden_states'].shape[-1]}, but {self.files[0].name} has {hidden} / "
                    f"{num_aux * hidden}"
                )
        sample["input_ids"], sample["loss_mask"] = sample["input_ids"].long(), sample["loss_mask"].bool()
        return sample

    def _complete_dump_sample(self, sample: dict[str, Tensor]) -> dict[str, Tensor]:
        """Add what dumps lack: the normed last state (speculators) and the target argmax over Vt."""
        head = self.head
        last = sample["last_hidden_state"]
        if self.format == "speculators":
            if self._eps is None:
                raise DataError(f"{self._head_path}: no rms_norm_eps in its metadata; pass target= instead")
            last = rms_norm(last, head["norm.weight"].to(last.dtype), self._eps)
        weight = head["lm_head.weight"].float()
        argmax = torch.cat([(part.float() @ weight.T).argmax(-1) for part in last.split(1024)])
        return {**sample, "last_hidden_state": last, "target_argmax": argmax}

    # ------------------------------------------------------------------ iteration

    def samples(self, shuffle: bool = False, seed: int = 0) -> Iterator[dict[str, Tensor]]:
        """Every sample as unpadded [T, ...] tensors; with `shuffle`, shards (or files) and the samples
        within each shard come in a seeded random order (memory stays at one shard)."""
        if self.format == "eagle3lib":
            shards = self.manifest["shards"]
            for s, order in reading_order([entry["num_samples"] for entry in shards], shuffle, seed):
                yield from self._shard_samples(shards[s], order)
        else:
            for i, _ in reading_order([1] * len(self.files), shuffle, seed):
                yield self._complete_dump_sample(self._read_dump(self.files[i]))

    def batches(
        self, batch_size: int, seq_len: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
        skip: int = 0, rows: slice | None = None,
    ) -> Iterator[dict[str, Tensor]]:
        """Training batches: `input_ids`, `loss_mask`, `aux_hidden_states`, `last_hidden_state`,
        `target_argmax` and `attention_mask` (bool), each [B, T, ...] with T ≤ seq_len, right-padded.

        A sample longer than seq_len is cut into consecutive windows of seq_len (nothing is dropped;
        each window keeps the hidden states captured with the full context). `skip` passes over the first
        batches (a resumed epoch); `rows` keeps those rows of each batch (one process's share).
        """
        held: dict[int, dict[str, Tensor]] = {}

        def numbered() -> Iterator[tuple[int, int]]:
            for i, sample in enumerate(self.samples(shuffle, seed)):
                held[i] = sample
                yield sample["input_ids"].shape[0], i

        for n, plan in enumerate(window_plans(numbered(), batch_size, seq_len, drop_last)):
            if n >= skip:
                yield collate([window(held[key], start, seq_len) for key, start in plan[rows or slice(None)]])
            for key in [key for key in held if key < plan[-1][0]]:  # only the last sample can go on
                del held[key]

    def __repr__(self) -> str:
        return (
            f"DataReader({str(self.path)!r}, format={self.format}, samples={self.num_samples}, "
            f"H={self.hidden_size}, aux={self.aux_layer_ids})"
        )


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


def window_plans(
    samples: Iterator[tuple[int, int]], batch_size: int, seq_len: int, drop_last: bool = False
) -> Iterator[list[tuple[int, int]]]:
    """Batches as plans: lists of (sample key, start) windows of at most seq_len tokens, from (length,
    key) pairs in reading order; a sample longer than seq_len gives consecutive windows."""
    if batch_size < 1 or seq_len < 2:
        raise DataError(f"batch_size must be ≥ 1 and seq_len ≥ 2, got {batch_size} and {seq_len}")
    pending: list[tuple[int, int]] = []
    for length, key in samples:
        for start in range(0, length, seq_len):
            pending.append((key, start))
            if len(pending) == batch_size:
                yield pending
                pending = []
    if pending and not drop_last:
        yield pending


def window(sample: dict[str, Tensor], start: int, seq_len: int) -> dict[str, Tensor]:
    return {key: value[start : start + seq_len] for key, value in sample.items()}


def collate(samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Right-padded [B, T, ...] tensors and a bool `attention_mask`, on the samples' device."""
    width = max(s["input_ids"].shape[0] for s in samples)
    device = samples[0]["input_ids"].device
    batch = {}
    for key, first in samples[0].items():
        out = torch.zeros((len(samples), width, *first.shape[1:]), dtype=first.dtype, device=device)
        for row, sample in enumerate(samples):
            out[row, : sample[key].shape[0]] = sample[key]
        batch[key] = out
    batch["attention_mask"] = torch.zeros((len(samples), width), dtype=torch.bool, device=device)
    for row, sample in enumerate(samples):
        batch["attention_mask"][row, : sample["input_ids"].shape[0]] = True
    return batch


# ---------------------------------------------------------------- a run's prepared data


@dataclass
class TrainingData:
    """The data folder and what the trainer needs from it besides batches."""

    reader: DataReader
    vocab_map: VocabMap
    head: dict[str, torch.Tensor]  # the target's embed_tokens / norm / lm_head weights
    target_hidden_size: int
    vocab_size: int
    aux_layer_ids: list[int]
    target: str  # the target's name, for messages


def prepared_dir(run_dir: str | os.PathLike, which: str = "main") -> Path:
    """Where 00_prepare_data put a run's data: `main` (data.corpus) is the step folder itself, with its
    vocab map and token counts at the top; `source` (data.source_corpus) is its `source/` subfolder."""
    if which not in ("main", "source"):
        raise ValueError(f"which must be 'main' or 'source', got {which!r}")
    step = Path(run_dir) / PREPARE_DATA
    return step if which == "main" else step / SOURCE_SUBDIR


def training_data(train: dict, run_dir: str | os.PathLike | None):
    """The trainer's inputs: `train.data` (else this run's 00_prepare_data) and `train.vocab_map` (else
    that data folder's vocab map)."""
    if train["data"]:
        folder = resolve_path(train["data"])
    elif run_dir is not None:
        folder = prepared_dir(run_dir)
    else:
        raise DataError("train.data is empty and there is no run folder to take 00_prepare_data's data from")
    # a SpecForge or speculators dump carries no target head and no aux ids: the recipe names them
    head = resolve_path(train["target_head"]) if train["target_head"] else None
    reader = DataReader(folder, head=head, aux_layer_ids=train["aux_layer_ids"] or None)
    return TrainingData(
        reader=reader,
        vocab_map=training_vocab_map(train, folder, reader.vocab_size),
        head=reader.head,
        target_hidden_size=reader.hidden_size,
        vocab_size=reader.vocab_size,
        aux_layer_ids=list(reader.aux_layer_ids),
        target=(reader.manifest.get("target") or {}).get("name") or str(folder),
    )


def training_vocab_map(train: dict, folder: Path, vocab_size: int) -> VocabMap:
    """The draft vocab to train for: `train.vocab_map`, else the map of the data in `folder`."""
    path = resolve_path(train["vocab_map"]) if train["vocab_map"] else folder / VOCAB_MAP_FILE
    if not path.exists():
        raise DataError(f"{path}: no vocab map (set train.vocab_map, or prepare the data with one)")
    return VocabMap.load(path, vt=vocab_size)


def load_token_counts(folder: str | os.PathLike) -> tuple[Tensor, Tensor]:
    """(input-token counts, target-argmax counts) under the loss mask, each [Vt], of a data folder."""
    file = Path(folder) / TOKEN_COUNTS_FILE
    tables = read_safetensors(file, ["counts", "argmax_counts"], DataError)
    return tables["counts"], tables["argmax_counts"]
