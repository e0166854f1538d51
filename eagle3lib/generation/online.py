"""Online training data: the target runs inside the training loop, and no hidden states are stored.

SpecForge's and speculators' default for targets that fit beside the drafter. Only the token text is
kept, in `<train out>/online_data/` (`train.data_mode: online`):
- `text.safetensors`: `input_ids`, `loss_mask` and `sample_lengths`, the samples in the order a capture
  would write them (8 bytes a token, where hidden states take about 13 KB a token at H 576 in bf16);
- `token_counts.safetensors` (`counts`: input tokens under the loss mask) and `vocab_map.safetensors`
  built from them, unless `train.vocab_map` names a map;
- `manifest.json`: the target, the data settings that made the text, and its size.
A resumed or repeated run reuses the folder (a self-distilled text is generated once) after checking that
the recipe still describes it.

`OnlineReader` (a `readers.BatchReader`) yields the batches `readers.FolderReader` yields from a capture of
the same text: the text is cut into the shards `DataWriter` would write and read in the same seeded order,
into the same windows; the target computes each batch's hidden states when the batch is asked for, only for
this process's rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from eagle3lib import files
from eagle3lib.data.layout import TOKEN_COUNTS_FILE, VOCAB_MAP_FILE, DataError
from eagle3lib.data.readers import (
    BatchPlanner,
    BatchReader,
    TrainingData,
    collate,
    reading_order,
    shard_sizes,
    training_vocab_map,
    window,
)
from eagle3lib.drafter.vocab import VocabMap
from eagle3lib.generation.capture import REGENERATED_DIR, capture_pools, parse_dtype, training_text
from eagle3lib.params import ONLINE_TEXT_KEYS
from eagle3lib.progress import progress as progress_bar
from eagle3lib.target.model import Target

FORMAT = "eagle3lib-text"
FOLDER = "online_data"
TEXT_FILE = "text.safetensors"


def make_text(target: Target, data: dict, seed: int, folder: Path) -> Path:
    """Write the online text folder for the recipe's `data` section (written aside, then renamed; a
    regeneration goes beside it, `regenerated/`, so that an interrupted one continues)."""
    samples, provenance = training_text(target, data, seed, folder.parent / REGENERATED_DIR)
    kept = []
    progress = progress_bar(total=data["num_tokens"], unit="tok", desc=f"online text {data['corpus']}")
    for pool in capture_pools(samples, data["num_tokens"], data["batch_size"]):
        kept += pool
        progress.update(sum(len(s.input_ids) for s in pool))
    progress.close()
    input_ids = torch.cat([s.input_ids for s in kept])
    loss_mask = torch.cat([s.loss_mask for s in kept])
    counts = torch.bincount(input_ids[loss_mask], minlength=target.vocab_size)
    manifest = {
        "format": FORMAT,
        "target": target.describe(),
        "seed": seed,
        "settings": {key: data[key] for key in ONLINE_TEXT_KEYS},
        "provenance": provenance,
        "num_samples": len(kept),
        "num_tokens": len(input_ids),
        "num_loss_tokens": int(loss_mask.sum()),
    }
    with files.staged_folder(folder) as staging:
        files.save_safetensors({"input_ids": input_ids, "loss_mask": loss_mask,
                               "sample_lengths": torch.tensor([len(s.input_ids) for s in kept])},
                              staging / TEXT_FILE)
        files.save_safetensors({"counts": counts}, staging / TOKEN_COUNTS_FILE)
        VocabMap.from_counts(counts, data["draft_vocab_size"], target.vocab_size, str(folder)).save(
            staging / VOCAB_MAP_FILE)
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return folder


def check_text(folder: Path, target: Target, data: dict, seed: int) -> dict:
    """The folder's manifest, or a DataError naming what the recipe now says differently."""
    manifest = json.loads((folder / "manifest.json").read_text())
    wanted = {key: data[key] for key in ONLINE_TEXT_KEYS}
    changed = [f"data.{key} {manifest['settings'].get(key)!r} -> {value!r}"
               for key, value in wanted.items() if manifest["settings"].get(key) != value]
    if manifest["seed"] != seed:
        changed.append(f"run.seed {manifest['seed']} -> {seed}")
    if manifest["target"]["fingerprint"] != target.fingerprint:
        changed.append(f"target {manifest['target']['name']} -> {target.name} (another fingerprint)")
    if changed:
        raise DataError(
            f"{folder}: this online text was made with other settings ({'; '.join(changed)}); "
            "train into another output folder, or put the recipe back"
        )
    return manifest


class OnlineReader(BatchReader):
    """A capture's batches, with the hidden states computed by the target as each batch is asked for."""

    format = FORMAT

    def __init__(self, folder: Path, target: Target, aux_layer_ids: list[int], dtype: torch.dtype,
                 manifest: dict):
        self.path, self.target, self.dtype = folder, target, dtype
        self.manifest = {**manifest, "aux_layer_ids": aux_layer_ids}
        text = files.read_safetensors(folder / TEXT_FILE, error=DataError)
        self.lengths = text["sample_lengths"].tolist()
        self.texts = list(zip(text["input_ids"].split(self.lengths), text["loss_mask"].split(self.lengths),
                              strict=True))
        self.shards = shard_sizes(self.lengths, manifest["settings"]["shard_tokens"])

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    def lengths_in_order(self, shuffle: bool, seed: int) -> Iterator[tuple[int, int]]:
        first = [0, *torch.tensor(self.shards).cumsum(0).tolist()]
        return ((self.lengths[first[s] + i], first[s] + i)
                for s, indices in reading_order(self.shards, shuffle, seed) for i in indices)

    def batches(
        self, batch_size: int, seq_len: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
        skip: int = 0, rows: slice | None = None, packing: bool = False,
    ) -> Iterator[dict[str, Tensor]]:
        """Skipped batches and other processes' rows cost no target forward."""
        order = self.lengths_in_order(shuffle, seed)
        for n, plan in enumerate(BatchPlanner(batch_size, seq_len, drop_last, packing).plans(order)):
            if n < skip:
                continue
            mine = plan[rows or slice(None)]
            # a sample cut into windows across two batches is computed twice: cheaper than holding it
            keys = list(dict.fromkeys(key for row in mine for key, _ in row))
            computed = self._forward(keys)
            yield collate([[window(computed[key], start, seq_len) for key, start in row] for row in mine],
                          seq_len if packing else None)

    @torch.no_grad()
    def _forward(self, keys: list[int]) -> dict[int, dict[str, Tensor]]:
        """The samples as a capture stores them, states in data.dtype: each sample computed alone, as a
        right-padded row of target forwards that group samples of similar length (a packed batch holds
        samples of every length: padding them all to the longest would waste most of the target's work)."""
        by_length = sorted(keys, key=lambda key: self.lengths[key])
        samples = {}
        for group in length_groups([self.lengths[key] for key in by_length]):
            chosen = [by_length[i] for i in group]
            padded = collate([[{"input_ids": self.texts[key][0]}] for key in chosen])
            captured = self.target.capture(padded["input_ids"], padded["attention_mask"], self.aux_layer_ids)
            device = captured.last_hidden_state.device
            for row, key in enumerate(chosen):
                n = self.lengths[key]
                input_ids, loss_mask = self.texts[key]
                samples[key] = {
                    "input_ids": input_ids.to(device),
                    "loss_mask": loss_mask.to(device),
                    "target_argmax": captured.target_argmax[row, :n],
                    "aux_hidden_states": captured.aux_hidden_states[row, :n].to(self.dtype),
                    "last_hidden_state": captured.last_hidden_state[row, :n].to(self.dtype),
                }
        return samples


def length_groups(lengths: list[int], slack: float = 1.25) -> Iterator[list[int]]:
    """Indices of ascending `lengths` in consecutive groups, each as small a padded forward as can be: a
    group closes before padding its samples to its longest would cost more than `slack` x their tokens."""
    group: list[int] = []
    for i, length in enumerate(lengths):
        if group and (len(group) + 1) * length > slack * (sum(lengths[j] for j in group) + length):
            yield group
            group = []
        group.append(i)
    if group:
        yield group


def ensure_text(params: dict, out: Path, target: Target) -> dict:
    """The manifest of `out/online_data/`: made when missing, else checked against the recipe."""
    folder = Path(out) / FOLDER
    if not folder.exists():
        make_text(target, params["data"], params["run"]["seed"], folder)
    return check_text(folder, target, params["data"], params["run"]["seed"])


def online_training_data(params: dict, out: Path, device: torch.device, main: bool = True,
                         barrier=lambda: None) -> TrainingData:
    """The trainer's inputs for `train.data_mode: online`: the recipe's target (loaded on `device`), the
    text folder `out/online_data/` (made by the main process when missing; `train_arms` makes it before
    it launches torchrun, so that no rank waits on a long self-distillation), and the vocab map
    (`train.vocab_map`, else the text's own)."""
    target = Target.from_params(params["target"], device)
    manifest = ensure_text(params, out, target) if main else None
    barrier()
    folder = Path(out) / FOLDER
    manifest = manifest or check_text(folder, target, params["data"], params["run"]["seed"])
    aux_layer_ids = target.check_aux_layer_ids(params["target"]["aux_layer_ids"] or None)
    dtype = parse_dtype(params["data"]["dtype"], "data.dtype")
    reader = OnlineReader(folder, target, aux_layer_ids, dtype, manifest)
    return TrainingData(
        reader=reader,
        vocab_map=training_vocab_map(params["train"], folder, target.vocab_size),
        head=target.head_weights(),
        target_hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        aux_layer_ids=aux_layer_ids,
        target=target.name,
        verifier=manifest["target"]["name"],
    )
