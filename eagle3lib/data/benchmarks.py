"""Evaluation prompts (notebooks 01 and 05): where they come from, and how they become the target's input.

A benchmark's `corpus` is one of:
- a zoo text corpus (`stdlib-code`, `pydoc-prose`): openings of held-out documents, asked about in a chat
  turn;
- a conversation corpus (`sharegpt`, or a conversation file or folder): the first user turn (and system
  prompt) of held-out conversations, never in the training split;
- `humaneval`: the HumanEval problems, asked as SpecForge's benchmark asks;
- a prompt file (`.jsonl`, optionally `.gz`): one `{"prompt": str}` per line, or MT-Bench's `question.jsonl`
  (`{"question_id", "category", "turns": [str, ...]}`), whose turns are asked in order, each on the target's
  own reply to the turn before (as SGLang's MT-Bench benchmark does).

Two draws never share a question: `test` takes a source's first questions (what 05 reports), `validation`
its last ones (what training measures τ on to choose its checkpoint); asking for more than the two leave
apart between them is refused.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from eagle3lib.data import corpora
from eagle3lib.data.corpora import INSTRUCTIONS, corpus_kind, split_conversations
from eagle3lib.data.layout import DataError
from eagle3lib.files import resolve_path

PROMPT_KEYS = ("prompt", "turns")
DRAWS = ("test", "validation")


@dataclass(frozen=True)
class Question:
    id: str
    turns: tuple[str, ...]  # user turns, asked in order
    system: str | None = None


@dataclass(frozen=True)
class Benchmark:
    name: str
    corpus: str
    num_prompts: int  # 0 = every question the source holds (prompt files, humaneval)
    turns: int = 1  # conversation corpora: the first user turns asked in order (2: MT-Bench style)

    @classmethod
    def from_params(cls, entry: dict, where: str) -> Benchmark:
        if not isinstance(entry, dict) or not {"name", "corpus"} <= set(entry) <= {
            "name",
            "corpus",
            "num_prompts",
            "turns",
        }:
            raise DataError(f"{where}: expected {{name, corpus, num_prompts, turns}}, got {entry!r}")
        return cls(str(entry["name"]), str(entry["corpus"]), int(entry.get("num_prompts", 0)),
                   int(entry.get("turns", 1)))

    @classmethod
    def parse(cls, text: str) -> Benchmark:
        """A command line's `CORPUS:N` or `CORPUS:N:TURNS` (e.g. sharegpt:32:2, MT-Bench style)."""
        head, _, last = text.rpartition(":")
        if not head or not last.isdigit():
            raise DataError(f"benchmark {text!r}: expected CORPUS:N or CORPUS:N:TURNS, e.g. sharegpt:32:2")
        corpus, _, count = head.rpartition(":")
        if not (corpus and count.isdigit()):
            return cls(head, head, int(last))
        turns = int(last)
        return cls(corpus if turns == 1 else f"{corpus} ({turns} turns)", corpus, int(count), turns)


def check_corpus(corpus: str, key: str) -> None:
    """A name the zoo knows, or a file or folder that exists; else a ValueError naming `key`."""
    known = (*corpora.CORPORA, *corpora.CONVERSATION_CORPORA, *corpora.PROMPT_SETS)
    if corpus in known or resolve_path(corpus).exists():
        return
    known = ", ".join((*corpora.CORPORA, *corpora.CONVERSATION_CORPORA, *corpora.PROMPT_SETS))
    raise ValueError(f"{key} {corpus!r}: neither a corpus the zoo knows ({known}) nor an existing file or "
                     "folder")


def is_prompt_file(corpus: str) -> bool:
    """A `.jsonl` file whose first record holds `prompt` or `turns` (not `conversations`/`messages`)."""
    path = resolve_path(corpus)
    if corpus in corpora.CORPORA or corpus in corpora.PROMPT_SETS or corpus in corpora.CONVERSATION_CORPORA:
        return False
    if not path.is_file() or not path.name.removesuffix(".gz").endswith(".jsonl"):
        return False
    number, first = next(((n, line) for n, line in enumerate(_lines(path), 1) if line.strip()), (0, "{}"))
    try:
        record = json.loads(first)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{number}: not JSON ({err.msg} at column {err.colno}): neither a prompt "
                        "file nor conversations") from err
    return isinstance(record, dict) and bool(set(record) & set(PROMPT_KEYS))


def _lines(path: Path) -> list[str]:
    """A JSON lines file's lines (gunzipped for .gz), split at newlines only: JSON strings may hold U+2028
    and other characters splitlines() breaks at. Failures name the file."""
    raw = path.read_bytes()
    try:
        data = gzip.decompress(raw) if path.name.endswith(".gz") else raw
    except (OSError, EOFError) as err:
        raise DataError(f"{path}: not a readable gzip file ({err})") from err
    try:
        return data.decode("utf-8").split("\n")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from err


def prompt_file_questions(path: Path) -> list[Question]:
    questions = []
    for number, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: not JSON ({err.msg} at column {err.colno})") from err
        if not isinstance(record, dict) or not set(record) & set(PROMPT_KEYS):
            raise DataError(f"{where}: expected a 'prompt' string or MT-Bench 'turns' list")
        turns = record["turns"] if "turns" in record else [record["prompt"]]
        if (
            not isinstance(turns, list)
            or not turns
            or not all(isinstance(t, str) and t.strip() for t in turns)
        ):
            raise DataError(
                f"{where}: '{'turns' if 'turns' in record else 'prompt'}' must hold non-empty strings"
            )
        questions.append(Question(str(record.get("question_id", record.get("id", number))), tuple(turns)))
    return questions


def questions(
    corpus: str, num_prompts: int, prompt_chars: int = 600, heldout_fraction: float = 0.1, seed: int = 0,
    draw: str = "test", turns: int = 1,
) -> list[Question]:
    """The first `num_prompts` questions of a source (0: all of a prompt file or of humaneval); with
    `draw="validation"` its last `num_prompts`, in their order. `turns` > 1 (conversation corpora): the
    held-out conversations with at least that many user turns, their first `turns` asked in order."""
    if draw not in DRAWS:
        raise DataError(f"draw must be one of {', '.join(DRAWS)}, got {draw!r}")
    if turns != 1 and (turns < 1 or corpus == corpora.HUMANEVAL or is_prompt_file(corpus)
                       or corpus_kind(corpus) != "conversations"):
        raise DataError(f"corpus {corpus!r}: turns {turns} (more than 1 takes a conversation corpus)")
    if draw == "validation" and not num_prompts:
        raise DataError(f"corpus {corpus!r}: a validation draw needs num_prompts")
    if corpus == corpora.HUMANEVAL:
        found = [Question(task, (text,)) for task, text in corpora.humaneval_prompts()]
    elif is_prompt_file(corpus):
        found = prompt_file_questions(resolve_path(corpus))
    elif corpus_kind(corpus) == "documents":
        if not num_prompts:
            raise DataError(f"corpus {corpus!r}: give num_prompts (its held-out documents are many)")
        docs = corpora.split_documents(corpus, "heldout", heldout_fraction, seed)
        chosen = docs if draw == "validation" else islice(docs, num_prompts)
        found = [Question(d.id, (f"{INSTRUCTIONS[corpus]}\n\n{corpora.opening(d.text, prompt_chars)}",))
                 for d in chosen]
    else:
        if not num_prompts:
            raise DataError(f"corpus {corpus!r}: give num_prompts (its held-out conversations are many)")
        held = (c for c in split_conversations(corpus, "heldout", heldout_fraction)
                if len(c.user_turns()) >= turns)
        found = [Question(c.id, tuple(c.user_turns()[:turns]), c.system_prompt())
                 for c in (held if draw == "validation" else islice(held, num_prompts))]
    if num_prompts and len(found) < num_prompts:
        raise DataError(
            f"corpus {corpus!r} holds {len(found)} evaluation prompts; {num_prompts} were asked for"
        )
    if not num_prompts:
        return found
    return found[-num_prompts:] if draw == "validation" else found[:num_prompts]


def check_disjoint_draws(corpus: str, test_prompts: int, validation_prompts: int, prompt_chars: int = 600,
                         heldout_fraction: float = 0.1, turns: int = 1) -> None:
    """Refuse a test and a validation draw of `corpus` that would share a question (a source holding fewer
    than both together), naming both counts."""
    test = questions(corpus, test_prompts, prompt_chars, heldout_fraction, turns=turns)
    validation = questions(corpus, validation_prompts, prompt_chars, heldout_fraction, draw="validation",
                           turns=turns)
    shared = {q.id for q in test} & {q.id for q in validation}
    if shared:
        raise DataError(
            f"corpus {corpus!r}: its {len(test)} evaluation and {validation_prompts} validation prompts "
            f"would share {len(shared)} (e.g. {sorted(shared)[0]}); lower one of them"
        )


def chat_ids(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Messages as the target's chat input, in the recipe's thinking mode (`data.chat_template_kwargs`)."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            **(template_kwargs or {}))
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def prompt_ids(
    tokenizer, found: list[Question], reply: Callable[[list[list[int]]], list[str]] | None = None,
    template_kwargs: dict | None = None,
) -> list[list[int]]:
    """Every turn of every question as the target's chat input, turn by turn: the first turns, then each
    later turn on the conversation so far with `reply`'s answers (the target's own) to the turn before."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the target's tokenizer has no chat template; these prompts are chat turns")
    histories = [[{"role": "system", "content": q.system}] if q.system else [] for q in found]
    prompts: list[list[int]] = []
    prompts_of_turn: dict[int, list[int]] = {}
    for turn in range(max(len(q.turns) for q in found)):
        asked = [i for i, q in enumerate(found) if turn < len(q.turns)]
        if turn and reply is None:
            raise DataError(
                "a multi-turn benchmark needs the target's own replies to earlier turns; this "
                "backend cannot give them (use probe.backend builtin)"
            )
        if turn:
            earlier = [prompts_of_turn[i] for i in asked]
            for i, text in zip(asked, reply(earlier), strict=True):
                histories[i].append({"role": "assistant", "content": text})
        for i in asked:
            histories[i].append({"role": "user", "content": found[i].turns[turn]})
        prompts_of_turn = {i: chat_ids(tokenizer, histories[i], template_kwargs) for i in asked}
        prompts += [prompts_of_turn[i] for i in asked]
    return prompts


def plain_ids(
    tokenizer, corpus: str, num_prompts: int, prompt_chars: int, heldout_fraction: float = 0.1, seed: int = 0
) -> list[list[int]]:
    """Held-out document openings without a chat template (`probe.chat: false`, text corpora only)."""
    if corpus_kind(corpus) != "documents" or is_prompt_file(corpus):
        known = ", ".join(corpora.CORPORA)
        raise DataError(f"probe.chat false takes a text corpus ({known}), not {corpus!r}")
    texts = corpora.heldout_prompts(
        corpus, num_prompts, max_chars=prompt_chars, heldout_fraction=heldout_fraction, seed=seed
    )
    return [list(tokenizer(text)["input_ids"]) for text in texts]
