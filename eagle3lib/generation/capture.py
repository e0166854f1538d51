"""Capture: the target reads training text, and its hidden states go into a data folder (see `data.layout`
for the format); 00_prepare_data's steps for one corpus."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from eagle3lib.data import corpora
from eagle3lib.data.conversations import LOSS_TURNS, ReadStats
from eagle3lib.data.corpora import conversation_source, split_conversations
from eagle3lib.data.layout import (
    AUX_CONVENTION,
    FORMAT,
    FORMAT_VERSION,
    HEAD_KEYS,
    LAST_HIDDEN,
    TARGET_HEAD_FILE,
    TOKEN_COUNTS_FILE,
    VOCAB_MAP_FILE,
    DataError,
    dtype_name,
    load_token_counts,
    prepared_dir,
)
from eagle3lib.data.readers import collate, open_reader
from eagle3lib.data.sources import (
    Sample,
    check_text_kind,
    check_thinking_mode,
    conversation_samples,
    raw_samples,
    renderer_for,
    self_distilled_samples,
)
from eagle3lib.drafter.vocab import VocabMap
from eagle3lib.files import make_folder, save_safetensors, shareable_tree, staging_path
from eagle3lib.generation.regenerate import make_engine, regenerate, settings_from_data, source_description
from eagle3lib.params import check_positive
from eagle3lib.progress import progress as progress_bar
from eagle3lib.target import zoo

# <run>/regenerated/<which>/: the target's replies 00_prepare_data wrote (data.text: regenerate)
REGENERATED_DIR = "regenerated"
REGENERATED_FILE = "regenerated.jsonl"


def parse_dtype(name: str, where: str) -> torch.dtype:
    if name not in ("float32", "bfloat16", "float16"):
        raise DataError(f"{where}: hidden-state dtype must be float32, bfloat16 or float16, got {name!r}")
    return getattr(torch, name)


class DataWriter:
    """Streams samples into a new data folder; memory holds at most one shard.

    Use as a context manager, or call `close()`; on an exception the partial folder is removed and
    `path` is never created. An existing `path` is refused (runs never overwrite earlier outputs).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        target: dict,
        aux_layer_ids: list[int],
        head: dict[str, Tensor],
        dtype: torch.dtype = torch.bfloat16,
        shard_tokens: int = 65536,
        provenance: dict | None = None,
    ):
        self.path = Path(path)
        # an empty folder (a fresh notebook step folder) may be taken; anything else is never overwritten
        if self.path.exists() and not (self.path.is_dir() and not any(self.path.iterdir())):
            raise FileExistsError(f"{self.path} exists; data folders are never overwritten")
        if shard_tokens < 1:
            raise DataError(f"shard_tokens must be positive, got {shard_tokens}")
        missing = [k for k in HEAD_KEYS if k not in head]
        if missing:
            raise DataError(f"target head lacks {', '.join(missing)}")
        self.target, self.aux_layer_ids = target, list(aux_layer_ids)
        self.hidden_size, self.vocab_size = int(target["hidden_size"]), int(target["vocab_size"])
        self.dtype, self.shard_tokens, self.provenance = dtype, shard_tokens, provenance or {}
        self._tmp = staging_path(self.path, folder=True)
        save_safetensors(
            {k: head[k].detach().contiguous().cpu() for k in HEAD_KEYS},
            self._tmp / TARGET_HEAD_FILE,
            metadata={
                "target": target["name"],
                "fingerprint": target["fingerprint"],
                "rms_norm_eps": repr(float(target["rms_norm_eps"])),
            },
        )
        self._buffer: list[dict[str, Tensor]] = []
        self._buffered = 0
        self.shards: list[dict] = []
        self.counts = torch.zeros(self.vocab_size, dtype=torch.long)
        self.argmax_counts = torch.zeros(self.vocab_size, dtype=torch.long)
        self.num_samples = self.num_tokens = self.num_loss_tokens = 0

    def add(
        self,
        input_ids: Tensor,
        loss_mask: Tensor,
        aux_hidden_states: Tensor,
        last_hidden_state: Tensor,
        target_argmax: Tensor,
    ) -> None:
        """One sample, unshifted, without padding: [T], [T], [T, A*H], [T, H], [T]."""
        length = input_ids.shape[0]
        expected = {
            "input_ids": (input_ids, (length,)),
            "loss_mask": (loss_mask, (length,)),
            "target_argmax": (target_argmax, (length,)),
            "aux_hidden_states": (aux_hidden_states, (length, len(self.aux_layer_ids) * self.hidden_size)),
            "last_hidden_state": (last_hidden_state, (length, self.hidden_size)),
        }
        for key, (tensor, shape) in expected.items():
            if tuple(tensor.shape) != shape:
                raise DataError(
                    f"sample {self.num_samples}: {key} has shape {list(tensor.shape)}, expected {list(shape)}"
                )
        input_ids, loss_mask = input_ids.long().cpu(), loss_mask.bool().cpu()
        target_argmax = target_argmax.long().cpu()
        for key, ids in (("input_ids", input_ids), ("target_argmax", target_argmax)):
            if length and not 0 <= int(ids.min()) <= int(ids.max()) < self.vocab_size:
                raise DataError(
                    f"sample {self.num_samples}: {key} outside the vocabulary [0, {self.vocab_size})"
                )
        self.counts += torch.bincount(input_ids[loss_mask], minlength=self.vocab_size)
        self.argmax_counts += torch.bincount(target_argmax[loss_mask], minlength=self.vocab_size)
        self._buffer.append(
            {
                "input_ids": input_ids,
                "loss_mask": loss_mask,
                "target_argmax": target_argmax,
                "aux_hidden_states": aux_hidden_states.detach().to("cpu", self.dtype),
                "last_hidden_state": last_hidden_state.detach().to("cpu", self.dtype),
            }
        )
        self._buffered += length
        self.num_samples += 1
        self.num_tokens += length
        self.num_loss_tokens += int(loss_mask.sum())
        if self._buffered >= self.shard_tokens:
            self._flush()

    def _flush(self) -> None:
        if not self._buffer:
            return
        name = f"shard_{len(self.shards):05d}.safetensors"
        tensors = {k: torch.cat([s[k] for s in self._buffer]) for k in self._buffer[0]}
        tensors["sample_lengths"] = torch.tensor(
            [len(s["input_ids"]) for s in self._buffer], dtype=torch.long
        )
        save_safetensors(tensors, self._tmp / name)
        self.shards.append({"file": name, "num_samples": len(self._buffer), "num_tokens": self._buffered})
        self._buffer, self._buffered = [], 0

    def close(self) -> Path:
        """Write the last shard, the token counts and the manifest; move the folder into place."""
        self._flush()
        if not self.shards:
            self.abort()
            raise DataError(f"{self.path}: no samples were written")
        save_safetensors(
            {"counts": self.counts, "argmax_counts": self.argmax_counts},
            self._tmp / TOKEN_COUNTS_FILE,
        )
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "target": self.target,
            "aux_layer_ids": self.aux_layer_ids,
            "aux_layer_convention": AUX_CONVENTION,
            "last_hidden": LAST_HIDDEN,
            "dtype": dtype_name(self.dtype),
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "num_loss_tokens": self.num_loss_tokens,
            "shards": self.shards,
            "provenance": self.provenance,
        }
        (self._tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if self.path.is_dir():  # the empty folder this writer was allowed to take
            self.path.rmdir()
        shareable_tree(self._tmp)  # safetensors writes its files private (0600)
        os.rename(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> DataWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def capture_to_folder(
    target,
    samples: Iterable[Sample],
    path: str | os.PathLike,
    *,
    num_tokens: int,
    aux_layer_ids: list[int] | None = None,
    batch_size: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    shard_tokens: int = 65536,
    provenance: dict | None = None,
) -> Path:
    """Run the target over samples until `num_tokens` tokens are captured; write a data folder.

    Samples are batched with right padding; a pool of batches is sorted by length first so that
    batches waste little on padding.
    """
    ids = target.check_aux_layer_ids(aux_layer_ids)
    label = (provenance or {}).get("corpus", Path(path).name)
    progress = progress_bar(total=num_tokens, unit="tok", desc=f"capture {label}")
    with DataWriter(
        path,
        target=target.describe(),
        aux_layer_ids=ids,
        head=target.head_weights(),
        dtype=dtype,
        shard_tokens=shard_tokens,
        provenance=provenance,
    ) as writer:
        for pool in capture_pools(samples, num_tokens, batch_size):
            for start in range(0, len(pool), batch_size):
                batch = pool[start : start + batch_size]
                # right padding: a causal model's real positions never see what fills the rest
                padded = collate([[{"input_ids": s.input_ids}] for s in batch])
                captured = target.capture(padded["input_ids"], padded["attention_mask"], ids)
                for row, sample in enumerate(batch):
                    n = len(sample.input_ids)
                    writer.add(
                        sample.input_ids,
                        sample.loss_mask,
                        captured.aux_hidden_states[row, :n],
                        captured.last_hidden_state[row, :n],
                        captured.target_argmax[row, :n],
                    )
                    progress.update(n)
        progress.close()
        return writer.close()


def capture_pools(samples: Iterable[Sample], num_tokens: int, batch_size: int) -> Iterator[list[Sample]]:
    """Samples until they hold `num_tokens` tokens, in the order capture writes them: pools of
    batch_size x 8 samples, each sorted by length so that batches waste little on padding."""
    samples, taken = iter(samples), 0
    while taken < num_tokens:
        pool = _take_tokens(samples, num_tokens - taken, batch_size * 8)
        if not pool:
            raise DataError(
                f"the text ran out after {taken} of the {num_tokens} tokens asked for; "
                "ask for fewer tokens or a larger corpus"
            )
        taken += sum(len(s.input_ids) for s in pool)
        yield sorted(pool, key=lambda s: len(s.input_ids))


def _take_tokens(samples: Iterator[Sample], tokens: int, max_samples: int) -> list[Sample]:
    """Up to `max_samples` samples, stopping once they hold `tokens` tokens (the last one may overshoot)."""
    taken, total = [], 0
    for sample in samples:
        taken.append(sample)
        total += len(sample.input_ids)
        if total >= tokens or len(taken) >= max_samples:
            break
    return taken


def prepare(target, data: dict, path: str | os.PathLike, *, aux_layer_ids: list[int] | None = None,
            seed: int = 0, corpus: str | None = None, work_dir: str | os.PathLike | None = None) -> Path:
    """Training text (`data`: the recipe's data section; `corpus` overrides data.corpus) through the target
    into a data folder. A regeneration is written to `work_dir` (default: beside `path`)."""
    data = {**data, "corpus": corpus or data["corpus"]}
    samples, provenance = training_text(target, data, seed, Path(work_dir or Path(path).parent))
    return capture_to_folder(
        target,
        samples,
        path,
        num_tokens=data["num_tokens"],
        aux_layer_ids=aux_layer_ids,
        batch_size=data["batch_size"],
        dtype=parse_dtype(data["dtype"], "data.dtype"),
        shard_tokens=data["shard_tokens"],
        provenance=provenance,
    )


def training_text(target, data: dict, seed: int, work_dir: Path) -> tuple[Iterator[Sample], dict]:
    """The training samples the `data` section describes (see `eagle3lib.data.sources`), and their provenance.

    For conversations the provenance holds `conversations` (read, skipped by reason, turns dropped) and `cut`
    (what seq_len cut): counters filled as the samples are read, so a manifest written after the capture
    holds the final counts. `regenerate` first writes the target's replies to `work_dir/regenerated.jsonl`
    (resumable), then reads them."""
    corpus, text, seq_len = data["corpus"], data["text"], data["seq_len"]
    check_text_kind(corpus, text)
    provenance = {"corpus": corpus, "split": "train", "heldout_fraction": data["heldout_fraction"],
                  "seed": seed, "text": text, "seq_len": seq_len}
    if text == "raw":
        provenance |= corpora.corpus_description(corpus)
        return raw_samples(target.tokenizer, corpus, seq_len, data["heldout_fraction"], seed), provenance
    if text == "self-distill":
        provenance |= corpora.corpus_description(corpus) | {
            "max_new_tokens": data["max_new_tokens"], "prompt_chars": data["prompt_chars"],
            "decoding": "greedy"}
        samples = self_distilled_samples(target, corpus, seq_len, data["max_new_tokens"],
                                         data["prompt_chars"], data["batch_size"], data["heldout_fraction"],
                                         seed)
        return samples, provenance
    check_thinking_mode(corpus, data["chat_template_kwargs"])
    renderer = renderer_for(target, data)
    stats, cut = ReadStats(), Counter()
    conversations = split_conversations(corpus, "train", data["heldout_fraction"], stats)
    if text == "regenerate":
        path = regenerate_for_training(target, data, seed, conversations, renderer, work_dir)
        provenance["regenerated"] = str(path)
        conversations = split_conversations(str(path), "train", data["heldout_fraction"], ReadStats())
    provenance |= {"loss_turns": data["loss_turns"], "chat_template_kwargs": data["chat_template_kwargs"],
                   "turns": data["turns"], "conversations": stats.__dict__, "cut": cut}
    return conversation_samples(renderer, conversations, seq_len, cut, stats), provenance


def regenerate_for_training(target, data: dict, seed: int, conversations, renderer, work_dir: Path) -> Path:
    """The target's replies to the training conversations, until they hold what the capture asks for, in
    `work_dir/regenerated.jsonl` (continued if an earlier run was interrupted, reused once complete)."""
    out = Path(work_dir) / REGENERATED_FILE
    settings = settings_from_data(data, seed)
    path, _ = conversation_source(data["corpus"])
    make_folder(out.parent)
    with make_engine(settings, target, renderer, out.parent) as engine:
        regenerate(conversations, out, engine, renderer, settings,
                   source=source_description(path, data["corpus"]), target=target.describe(),
                   enough_tokens=data["num_tokens"] + data["seq_len"], seq_len=data["seq_len"],
                   command="data.text: regenerate")
    return out


def corpora_to_prepare(params: dict) -> dict[str, str]:
    """{which: corpus} for 00_prepare_data: `main` always, `source` when data.source_corpus is set; each
    checked against data.text before any work."""
    found = {"main": params["data"]["corpus"]}
    if params["data"]["source_corpus"]:
        found["source"] = params["data"]["source_corpus"]
    for corpus in found.values():
        check_text_kind(corpus, params["data"]["text"])
    return found


def check_prepare_settings(params: dict, vocab_size: int | None = None) -> None:
    """Refuse 00_prepare_data's data settings that cannot work, naming the key, before anything is captured:
    corpora, text, sizes and dtype, and the draft vocab size against the target's vocab (`vocab_size`, else
    the one its config.json gives when that is at hand)."""
    settings = params["data"]
    corpora_to_prepare(params)  # each corpus against data.text
    if settings["loss_turns"] not in LOSS_TURNS:
        raise DataError(f"data.loss_turns must be one of {', '.join(LOSS_TURNS)}, "
                        f"got {settings['loss_turns']!r}")
    if settings["text"] == "regenerate":
        settings_from_data(settings, params["run"]["seed"]).check()
    parse_dtype(settings["dtype"], "data.dtype")
    check_positive("data", settings)
    if not 0 <= settings["heldout_fraction"] < 1:
        raise DataError(f"data.heldout_fraction must lie in [0, 1), got {settings['heldout_fraction']}")
    spec = params["target"]["spec"]
    if vocab_size is None:
        vocab_size = zoo.configured_vocab_size(spec, params["target"]["cache_dir"] or None)
    if vocab_size is not None and settings["draft_vocab_size"] > vocab_size:
        raise DataError(
            f"data.draft_vocab_size {settings['draft_vocab_size']} exceeds the vocab size {vocab_size} of "
            f"the target {spec}"
        )


def prepare_for_run(target, params: dict, which: str, run_dir: str | os.PathLike) -> dict:
    """00_prepare_data for one corpus: capture its data folder, build its vocab map from the counts, and
    return the numbers the notebook reports (with what was read, skipped and cut for conversations)."""
    check_prepare_settings(params, target.vocab_size)
    corpus = corpora_to_prepare(params)[which]
    settings = params["data"]
    folder = prepared_dir(run_dir, which)
    start = time.perf_counter()
    prepare(target, settings, folder, aux_layer_ids=params["target"]["aux_layer_ids"] or None,
            seed=params["run"]["seed"], corpus=corpus, work_dir=Path(run_dir) / REGENERATED_DIR / which)
    seconds = time.perf_counter() - start
    reader = open_reader(folder, target)
    counts, argmax_counts = load_token_counts(folder)
    vocab_map = VocabMap.from_counts(counts, settings["draft_vocab_size"], target.vocab_size, str(folder))
    vocab_map.save(folder / VOCAB_MAP_FILE)
    in_map = vocab_map.draft_ids
    manifest = reader.manifest
    return {
        "corpus": corpus,
        "folder": str(folder),
        "samples": manifest["num_samples"],
        "tokens": manifest["num_tokens"],
        "loss_tokens": manifest["num_loss_tokens"],
        "shards": len(manifest["shards"]),
        "seconds": round(seconds, 1),
        "tokens_per_second": round(manifest["num_tokens"] / seconds, 1),
        "megabytes": round(sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20, 1),
        "distinct_tokens": int((counts > 0).sum()),
        "draft_vocab_size": vocab_map.vd,
        "input_coverage": float(counts[in_map].sum() / counts.sum()),
        "prediction_coverage": float(argmax_counts[in_map].sum() / argmax_counts.sum()),
        "aux_layer_ids": manifest["aux_layer_ids"],
        "target": manifest["target"]["name"],
        "fingerprint": manifest["target"]["fingerprint"],
        **{key: manifest["provenance"][key] for key in ("conversations", "cut", "regenerated")
           if key in manifest["provenance"]},
    }
