"""Hidden-state data folders: their format, and where a run keeps them (docs/data.md §3).

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

`data.sources` makes the training text, `generation.capture` writes folders (through the target) and
`data.readers` reads them into batches, as it reads SpecForge and speculators dumps, which is how large
targets are captured with a serving engine.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

from eagle3lib.files import read_safetensors, read_safetensors_header
from eagle3lib.runs import PREPARE_DATA

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


# safetensors' names of the dtypes hidden states are stored in
STORED_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def load_target_head(
    spec: str | os.PathLike, keys: tuple[str, ...] = HEAD_KEYS
) -> tuple[dict[str, Tensor], float | None]:
    """The target's head weights `keys` (of `HEAD_KEYS`) and its final norm's eps: from a
    `target_head.safetensors`, or a data folder holding one, else from the model `spec` names (a Hugging Face
    folder or zoo:<name>)."""
    path = Path(spec)
    file = path / TARGET_HEAD_FILE if path.is_dir() else path
    if not (file.is_file() and file.suffix == ".safetensors"):
        from eagle3lib.target.model import Target

        target = Target.load(spec, device="cpu")
        weights = target.head_weights()
        return {key: weights[key] for key in keys}, target.rms_norm_eps
    header = read_safetensors_header(file, DataError)
    missing = [k for k in keys if k not in header.tensors]
    if missing:
        raise DataError(f"{file}: lacks {', '.join(missing)}")
    eps = header.metadata.get("rms_norm_eps")
    return read_safetensors(file, keys, DataError), None if eps is None else float(eps)


# ---------------------------------------------------------------- a run's prepared data


def prepared_dir(run_dir: str | os.PathLike, which: str = "main") -> Path:
    """Where 00_prepare_data put a run's data: `main` (data.corpus) is the step folder itself, with its
    vocab map and token counts at the top; `source` (data.source_corpus) is its `source/` subfolder."""
    if which not in ("main", "source"):
        raise ValueError(f"which must be 'main' or 'source', got {which!r}")
    step = Path(run_dir) / PREPARE_DATA
    return step if which == "main" else step / SOURCE_SUBDIR


def load_token_counts(folder: str | os.PathLike) -> tuple[Tensor, Tensor]:
    """(input-token counts, target-argmax counts) under the loss mask, each [Vt], of a data folder."""
    file = Path(folder) / TOKEN_COUNTS_FILE
    tables = read_safetensors(file, ["counts", "argmax_counts"], DataError)
    return tables["counts"], tables["argmax_counts"]
