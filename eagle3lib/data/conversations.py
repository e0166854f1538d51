"""Conversation datasets: records read from ShareGPT or OpenAI-style files, rendered by the target's own chat
template into token ids and a loss mask over the assistant turns.

Files: `.json` (an array of records) or `.jsonl` (a record per line), optionally gzipped, or a folder of
them. Each record is detected on its own (docs/data.md §1):
- ShareGPT: `conversations`, a list of `{from, value}` (roles human, user, gpt, assistant, chatgpt, bing,
  bard, system);
- OpenAI: `messages`, a list of `{role, content}` (also SpecForge's `conversations` of `{role, content}`,
  the form regenerated files are written in).
Malformed input is refused, naming the file, the line or byte, and the key; it is never cut silently.
Conversations that are well formed but hold nothing to learn are skipped and counted by reason, and turns
that cannot be used (an assistant turn before the first user turn, a turn out of order) are dropped and
counted, as SpecForge's parser does.

Rendering: the loss mask is exactly the tokens of every assistant turn (or only the last one), its content
plus the end-of-turn token the model stops at, and never the template's role headers or the user and system
text. Each assistant turn is located as inference produces it: the conversation before it rendered with the
generation prompt is the prompt, the assistant's content follows. The text is tokenized piece by piece at
those boundaries, so the loss tokens are what the target would generate.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from eagle3lib.data.layout import DataError
from eagle3lib.files import check_recorded_hash

# Every role seen in the real ShareGPT files, and OpenAI's, mapped to the three a chat template knows.
ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant",
}
SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
LOSS_TURNS = ("all", "last")


class ConversationError(DataError):
    """A conversation file that cannot be read as it is: not JSON, truncated, a missing key, an unknown role,
    content that is not a string. The message names the file, the line or byte, and the key."""


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[dict, ...]  # {"role": "system" | "user" | "assistant", "content": str}, roles in order
    where: str  # file:line (or file, record N at byte B): where the record came from

    @property
    def split_key(self) -> str:
        """What the held-out split hashes: ShareGPT's split files cut long chats into parts `<id>_0`,
        `<id>_1`, which must land on the same side."""
        return re.sub(r"_\d+$", "", self.id)

    def user_turns(self) -> list[str]:
        return [m["content"] for m in self.messages if m["role"] == "user"]

    def system_prompt(self) -> str | None:
        return self.messages[0]["content"] if self.messages and self.messages[0]["role"] == "system" else None


@dataclass
class ReadStats:
    """What a reader saw: conversations read and kept, skipped by reason, turns dropped by reason."""

    read: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    dropped_turns: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"read": self.read, "kept": self.kept, "skipped": dict(self.skipped),
                "dropped_turns": dict(self.dropped_turns), "notes": list(self.notes)}


# ---------------------------------------------------------------- files


def manifest_path(file: Path) -> Path:
    """The manifest beside a regenerated conversation file: `<stem>.manifest.json`."""
    stem = file.name.removesuffix(".gz").removesuffix(".jsonl")
    return file.with_name(f"{stem}.manifest.json")


def check_shipped(file: Path) -> None:
    """A conversation file with a finished manifest beside it (a regenerated dataset, e.g. under datasets/)
    must still be what the manifest's hash says."""
    manifest = manifest_path(file)
    if manifest.is_file():
        recorded = json.loads(manifest.read_text())
        if recorded.get("complete") and recorded.get("sha256"):
            check_recorded_hash(file, recorded["sha256"], manifest, ConversationError)


def conversation_files(path: str | Path) -> list[Path]:
    """A file, or the conversation files of a folder in name order (regeneration manifests beside them,
    `*.manifest.json`, are not conversations)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir()
                       if p.is_file() and p.name.endswith(SUFFIXES) and not p.name.endswith(".manifest.json"))
        if not files:
            raise ConversationError(f"{path}: no conversation files ({', '.join(SUFFIXES)}) in this folder")
        return files
    if not path.is_file():
        raise ConversationError(f"{path}: no such conversation file or folder")
    if not path.name.endswith(SUFFIXES):
        raise ConversationError(f"{path}: not a conversation file (expected {', '.join(SUFFIXES)})")
    return [path]


def _text(path: Path) -> str:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    except (OSError, EOFError) as err:
        raise ConversationError(f"{path}: cannot be read: {err}") from err
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConversationError(f"{path}: byte {err.start}: not UTF-8 text") from err


def records(path: Path, allow_truncated: bool = False, notes: list[str] | None = None
            ) -> Iterator[tuple[dict, str]]:
    """(record, where) of one file. `allow_truncated` reads a JSON array that stops mid-record up to its
    last complete record (the ShareGPT wheel's file) and says so in `notes`; otherwise that is an error."""
    text = _text(path)
    if path.name.removesuffix(".gz").endswith(".jsonl"):
        for number, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 may sit in a string
            if line.strip():
                try:
                    yield json.loads(line), f"{path}:{number}"
                except json.JSONDecodeError as err:
                    raise ConversationError(
                        f"{path}:{number}: not JSON ({err.msg} at column {err.colno})") from err
        return
    yield from _array_records(path, text, allow_truncated, notes if notes is not None else [])


def _array_records(path: Path, text: str, allow_truncated: bool, notes: list[str]
                   ) -> Iterator[tuple[dict, str]]:
    decoder, position = json.JSONDecoder(), _skip_space(text, 0)
    if text[position : position + 1] != "[":
        raise ConversationError(f"{path}: byte {position}: expected a JSON array of records ('['), "
                                f"found {text[position:position + 20]!r}")
    position, number = _skip_space(text, position + 1), 0
    while True:
        if position >= len(text) or text[position] != "]" and _truncated_at(text, position):
            message = (f"{path}: the file stops inside record {number + 1} (byte {position} of {len(text)}): "
                       f"truncated")
            if not allow_truncated:
                raise ConversationError(message)
            notes.append(f"{message}; its {number:,} complete records before that byte are read")
            return
        if text[position] == "]":
            return
        try:
            record, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError as err:
            raise ConversationError(f"{path}: record {number + 1} at byte {position}: not JSON "
                                    f"({err.msg} at byte {err.pos})") from err
        number += 1
        yield record, f"{path}, record {number} at byte {position}"
        position = _skip_space(text, end)
        if text[position : position + 1] == ",":
            position = _skip_space(text, position + 1)
        elif text[position : position + 1] not in ("]", ""):
            raise ConversationError(f"{path}: byte {position}: expected ',' or ']' after record {number}")


def _truncated_at(text: str, position: int) -> bool:
    """Does the record starting at `position` run into the end of the text (rather than being malformed)?"""
    try:
        json.JSONDecoder().raw_decode(text, position)
    except json.JSONDecodeError as err:
        return err.msg.startswith("Unterminated string") or err.pos >= len(text.rstrip())
    return False


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def read_conversations(
    path: str | Path, stats: ReadStats | None = None, allow_truncated: bool = False
) -> Iterator[Conversation]:
    """The usable conversations of a file or folder, in file order; `stats` counts what was skipped."""
    stats = stats if stats is not None else ReadStats()
    for file in conversation_files(path):
        check_shipped(file)
        for record, where in records(file, allow_truncated, stats.notes):
            stats.read += 1
            conversation, skipped = parse_record(record, where, stats.dropped_turns)
            if skipped:
                stats.skipped[skipped] += 1
                continue
            stats.kept += 1
            yield conversation


def parse_record(record, where: str, dropped: Counter) -> tuple[Conversation | None, str | None]:
    """(conversation, None), or (None, why it was skipped). Malformed records raise ConversationError."""
    if not isinstance(record, dict):
        raise ConversationError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    key = "messages" if "messages" in record else "conversations" if "conversations" in record else None
    if key is None:
        raise ConversationError(f"{where}: no 'conversations' (ShareGPT) or 'messages' (OpenAI) key; "
                                f"keys: {sorted(record)}")
    turns = record[key]
    if not isinstance(turns, list):
        raise ConversationError(f"{where}: '{key}' must be a list of turns, got {type(turns).__name__}")
    messages = [_message(turn, f"{where}: {key}[{i}]") for i, turn in enumerate(turns)]
    conversation_id = record.get("id")
    if conversation_id is not None and not isinstance(conversation_id, str | int):
        raise ConversationError(
            f"{where}: 'id' must be a string or a number, got {type(conversation_id).__name__}")
    if conversation_id is None:  # stable across machines and file orders: the content itself
        conversation_id = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]
    if any(not m["content"].strip() for m in messages):
        return None, "empty content"
    kept = _in_turn_order(messages, dropped)
    if not any(m["role"] == "assistant" for m in kept):
        return None, "no assistant turn"
    return Conversation(str(conversation_id), tuple(kept), where), None


def _message(turn, where: str) -> dict:
    if not isinstance(turn, dict):
        raise ConversationError(f"{where}: a turn must be an object, got {type(turn).__name__}")
    if "from" in turn and "value" in turn:
        role_key, content_key = "from", "value"
    elif "role" in turn and "content" in turn:
        role_key, content_key = "role", "content"
    else:
        raise ConversationError(f"{where}: expected the keys from/value (ShareGPT) or role/content (OpenAI), "
                                f"got {sorted(turn)}")
    role, content = turn[role_key], turn[content_key]
    if role not in ROLES:
        raise ConversationError(f"{where}.{role_key}: unknown role {role!r} (known: {', '.join(ROLES)})")
    if not isinstance(content, str):
        raise ConversationError(f"{where}.{content_key}: expected a string, got {type(content).__name__}")
    return {"role": ROLES[role], "content": content}


def _in_turn_order(messages: list[dict], dropped: Counter) -> list[dict]:
    """A system prompt first (if any), then user and assistant turns alternating from a user turn. Assistant
    turns before the first user turn are dropped; the conversation is cut at the first turn out of order."""
    kept = messages[:1] if messages and messages[0]["role"] == "system" else []
    rest = messages[len(kept):]
    while rest and rest[0]["role"] == "assistant":
        dropped["assistant turn before the first user turn"] += 1
        rest = rest[1:]
    expected = "user"
    for i, message in enumerate(rest):
        if message["role"] != expected:
            dropped["cut at a turn out of order (" + message["role"] + " after "
                    + ("assistant" if expected == "user" else "user") + ")"] += len(rest) - i
            break
        kept.append(message)
        expected = "assistant" if expected == "user" else "user"
    return kept


# ---------------------------------------------------------------- rendering


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[bool]
    cut_tokens: int = 0  # tokens past seq_len, cut off
    cut_loss_tokens: int = 0


class ChatRenderer:
    """A tokenizer's chat template, with the loss spans of assistant turns (see the module docstring)."""

    def __init__(self, tokenizer, stop_token_ids: Iterable[int], loss_turns: str = "all"):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("the target's tokenizer has no chat template: conversations cannot be rendered")
        if loss_turns not in LOSS_TURNS:
            raise DataError(f"data.loss_turns must be one of {', '.join(LOSS_TURNS)}, got {loss_turns!r}")
        self.tokenizer, self.loss_turns = tokenizer, loss_turns
        self.stop_texts = sorted({tokenizer.convert_ids_to_tokens(int(i)) for i in stop_token_ids}, key=len,
                                 reverse=True)

    def text(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The conversation so far with the generation prompt: what the target answers."""
        return self._ids(self.text(messages, add_generation_prompt=True))

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def loss_spans(self, conversation: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text (trailing user turns left out) and the character spans in the loss."""
        messages = list(conversation.messages)
        while messages and messages[-1]["role"] != "assistant":
            messages.pop()
        full = self.text(messages)
        assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        chosen = assistant[-1:] if self.loss_turns == "last" else assistant
        spans = []
        for k in chosen:
            prompt = self.text(messages[:k], add_generation_prompt=True)
            if not full.startswith(prompt):
                raise DataError(f"{conversation.where}: the chat template renders the conversation before "
                                f"assistant turn {k} differently once the turn is added: its spans cannot be "
                                "found")
            start, end = _content_span(full, messages[k]["content"], len(prompt), conversation.where, k)
            end += next((len(stop) for stop in self.stop_texts if full.startswith(stop, end)), 0)
            spans.append((start, end))
        return full, spans

    def render(self, conversation: Conversation, seq_len: int) -> Rendered:
        """Token ids and loss mask, cut to `seq_len` tokens (what was cut is counted)."""
        full, spans = self.loss_spans(conversation)
        ids: list[int] = []
        mask: list[bool] = []
        position = 0
        for start, end in spans:
            for piece, in_loss in ((full[position:start], False), (full[start:end], True)):
                piece_ids = self._ids(piece) if piece else []
                ids += piece_ids
                mask += [in_loss] * len(piece_ids)
            position = end
        tail = self._ids(full[position:]) if position < len(full) else []
        ids += tail
        mask += [False] * len(tail)
        cut = max(0, len(ids) - seq_len)
        return Rendered(ids[:seq_len], mask[:seq_len], cut, sum(mask[seq_len:]))


def _content_span(full: str, content: str, offset: int, where: str, turn: int) -> tuple[int, int]:
    """Where an assistant turn's content sits right after its prompt (templates that trim it: stripped)."""
    if full.startswith(content, offset):
        return offset, offset + len(content)
    stripped = content.strip()
    start = full.find(stripped, offset)
    if start < 0:
        raise DataError(f"{where}: the chat template does not render assistant turn {turn}'s content as it "
                        "is: its loss span cannot be located")
    return start, start + len(stripped)
