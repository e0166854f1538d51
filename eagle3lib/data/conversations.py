"""Conversation datasets: records read from ShareGPT or OpenAI-style files, rendered by the target's own chat
template into token ids and a loss mask over the assistant turns.

Files: `.json` (an array of records) or `.jsonl` (a record per line), optionally gzipped, or a folder of
them. Each record is detected on its own (docs/data.md §1):
- ShareGPT: `conversations`, a list of `{from, value}` (roles human, user, gpt, assistant, chatgpt, bing,
  bard, system; `function_call` (a JSON `{name, arguments}`) and `observation`, the tool call and its result),
  with an optional top-level `system` prompt and `tools` list;
- OpenAI: `messages`, a list of `{role, content}` (also SpecForge's `conversations` of `{role, content}`,
  the form regenerated files are written in), with what agentic and reasoning data carry: `reasoning_content`
  (or `reasoning`), `tool_calls`, `tool` messages with `tool_call_id` / `name`, content given as a list of
  `{"type": "text", "text"}` parts, the `developer` role (a system prompt), and a record-level `tools` list.
Any turn may say `weight: 0` or `loss: false`: it stays in the context and out of the loss.
Malformed input is refused, naming the file, the line or byte, and the key; it is never cut silently.
Conversations that are well formed but hold nothing to learn, or that this text-only target cannot read (an
image part), are skipped and counted by reason, and turns that cannot be used (an assistant turn before the
first user turn, a turn out of order) are dropped and counted, as SpecForge's parser does.

Rendering (`ChatRenderer`): the target's own chat template, given the record's `tools` and the recipe's
template switches (`data.chat_template_kwargs`, e.g. `{enable_thinking: true}`). An assistant turn is trained
on what the model emits after its generation prompt: its reasoning, the end-of-thinking marker, its content,
its tool calls and the end-of-turn token it stops at; never the template's role headers or the user, system
and tool text. That completion is read off the template itself, never searched for in the text: the
conversation before the turn rendered with the generation prompt is the prompt, and the conversation up to
the turn rendered with it last, past that prompt, is the completion (a template that pre-fills `<think>` in
its generation prompt, or renders a last turn without the reasoning it was given, has the reasoning put back
between its own markers). Where a template renders every trained turn in the whole conversation exactly as
it would be generated, the conversation is one sample with a loss span per turn; where it rewrites history
(Qwen3 and DeepSeek-R1 drop earlier turns' reasoning, DeepSeek-V3.1 cuts before `</think>`), each trained turn
becomes its own sample, its history rendered as serving renders it (`data.turns: per-turn` asks for that
always). A record the template cannot render is skipped and counted, naming its place and cause; one bad
record never stops a file. The text is tokenized piece by piece at the span boundaries, so the loss tokens
are what the target would generate.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from eagle3lib.data.layout import DataError
from eagle3lib.files import check_recorded_hash

# Every role seen in the real ShareGPT files, and OpenAI's, mapped to the four a chat template knows.
ROLES = {
    "system": "system", "developer": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "function_call": "assistant",
    "tool": "tool", "observation": "tool", "function": "tool", "ipython": "tool",
}
SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
LOSS_TURNS = ("all", "last")
TURNS = ("auto", "per-turn")
# The keys of a message a chat template reads; `train` (a turn in the loss or not) is this project's own.
TEMPLATE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")


class Skip(Exception):
    """A well-formed record this target cannot learn from; the message is the reason it is counted under."""


class ConversationError(DataError):
    """A conversation file that cannot be read as it is: not JSON, truncated, a missing key, an unknown role,
    content that is not a string. The message names the file, the line or byte, and the key."""


@dataclass(frozen=True)
class Conversation:
    id: str
    # {"role": "system" | "user" | "assistant" | "tool", "content": str, and as the record gives them
    # "reasoning_content", "tool_calls", "tool_call_id", "name", "train": False}, in turn order
    messages: tuple[dict, ...]
    where: str  # file:line (or file, record N at byte B): where the record came from
    tools: tuple[dict, ...] = ()  # the record's tool declarations, for the template
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
    first_skipped: dict[str, str] = field(default_factory=dict)  # reason -> where it was first seen

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] += 1
        self.first_skipped.setdefault(reason, where)

    def as_dict(self) -> dict:
        return {"read": self.read, "kept": self.kept, "skipped": dict(self.skipped),
                "first_skipped": dict(self.first_skipped), "dropped_turns": dict(self.dropped_turns),
                "notes": list(self.notes)}


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
                stats.skip(skipped, where)
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
    try:
        messages = [_message(turn, f"{where}: {key}[{i}]") for i, turn in enumerate(turns)]
    except Skip as skip:
        return None, str(skip)
    system = record.get("system")
    if system is not None:  # ShareGPT's top-level system prompt
        if not isinstance(system, str):
            raise ConversationError(f"{where}.system: expected a string, got {type(system).__name__}")
        if system.strip() and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": system})
    tools = _tools(record.get("tools"), f"{where}.tools")
    conversation_id = record.get("id")
    if conversation_id is not None and not isinstance(conversation_id, str | int):
        raise ConversationError(
            f"{where}: 'id' must be a string or a number, got {type(conversation_id).__name__}")
    if conversation_id is None:  # stable across machines and file orders: the content itself
        conversation_id = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]
    if any(_empty(m) for m in messages):
        return None, "empty content"
    _name_calls(messages)
    kept = _in_turn_order(messages, dropped)
    if not any(m["role"] == "assistant" for m in kept):
        return None, "no assistant turn"
    if not any(m["role"] == "assistant" and m.get("train", True) for m in kept):
        return None, "no assistant turn in the loss (weight 0 or loss false on every one)"
    return Conversation(str(conversation_id), tuple(kept), where, tools), None


def _name_calls(messages: list[dict]) -> None:
    """Give tool calls without an id one (`functions.NAME:N`, N counting the conversation's calls: the form
    Kimi's template writes and reads), and a tool result without a `tool_call_id` the id of the call before
    it: ShareGPT's function_call/observation pairs carry neither."""
    count, last = 0, None
    for message in messages:
        for call in message.get("tool_calls", []):
            call.setdefault("id", f"functions.{call['function']['name']}:{count}")
            count, last = count + 1, call["id"]
        if message["role"] == "tool" and last and "tool_call_id" not in message:
            message["tool_call_id"] = last


def _empty(message: dict) -> bool:
    """Nothing said: no content, and no tool call or reasoning in its place."""
    return not (message["content"] or "").strip() and not message.get("tool_calls") and not message.get(
        "reasoning_content")


def _message(turn, where: str) -> dict:
    if not isinstance(turn, dict):
        raise ConversationError(f"{where}: a turn must be an object, got {type(turn).__name__}")
    if "from" in turn and "value" in turn:
        role_key, content_key = "from", "value"
    elif "role" in turn and ("content" in turn or "tool_calls" in turn):
        role_key, content_key = "role", "content"
    else:
        raise ConversationError(f"{where}: expected the keys from/value (ShareGPT) or role/content (OpenAI), "
                                f"got {sorted(turn)}")
    role = turn[role_key]
    if role not in ROLES:
        raise ConversationError(f"{where}.{role_key}: unknown role {role!r} (known: {', '.join(ROLES)})")
    message = {"role": ROLES[role], "content": _content(turn.get(content_key), f"{where}.{content_key}")}
    if role == "function_call":  # ShareGPT's tool call: its value is the call
        call = _sharegpt_call(turn[content_key], where)
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
    reasoning = turn.get("reasoning_content", turn.get("reasoning"))
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise ConversationError(
                f"{where}.reasoning_content: expected a string, got {type(reasoning).__name__}")
        if reasoning and message["role"] != "assistant":
            raise ConversationError(f"{where}: reasoning on a {role} turn; only assistant turns reason")
        if reasoning:
            message["reasoning_content"] = reasoning
    if turn.get("tool_calls"):
        if message["role"] != "assistant" or not isinstance(turn["tool_calls"], list):
            raise ConversationError(f"{where}.tool_calls: expected a list on an assistant turn")
        message["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{i}]")
                                 for i, call in enumerate(turn["tool_calls"])]
        if turn.get(content_key) is None:  # a call alone: templates tell it from a call beside text by null
            message["content"] = None
    for key in ("tool_call_id", "name"):
        if turn.get(key) is not None and message["role"] == "tool":
            message[key] = str(turn[key])
    if turn.get("weight", 1) == 0 or turn.get("loss", True) is False:
        message["train"] = False
    if turn.get("finished") is False and message["role"] == "assistant":
        message["finished"] = False  # a reply cut at its length limit (regenerated data): no end of turn
    return message


def _content(content, where: str) -> str:
    """A turn's text: a string, null (read as "", kept null on a tool-calling turn), or OpenAI's content
    parts (text parts joined; any other kind skips the record, naming it)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                if kind is None:
                    raise ConversationError(f"{where}[{i}]: a content part must be an object with a 'type'")
                raise Skip(f"content part of type {kind!r} (this target reads text only)")
            texts.append(part["text"])
        return "".join(texts)
    raise ConversationError(f"{where}: expected a string, got {type(content).__name__}")


def _tool_call(call, where: str) -> dict:
    """An OpenAI tool call, as the record gives it: its arguments stay a JSON string or an object, whichever
    the data holds (templates differ in which they expect; one that cannot render a form skips the record)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or "name" not in function:
        raise ConversationError(f"{where}: expected {{'type': 'function', 'function': {{name, arguments}}}}")
    return {**call, "type": call.get("type", "function")}


def _sharegpt_call(value, where: str) -> dict:
    """ShareGPT's `function_call` value, `{"name", "arguments"}` (or its JSON text), as an OpenAI call."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConversationError(f"{where}.value: a function_call must be JSON ({err.msg})") from err
    if not isinstance(value, dict) or "name" not in value:
        raise ConversationError(f"{where}.value: a function_call must hold a name and its arguments")
    return _tool_call({"type": "function", "function": {"name": value["name"],
                                                        "arguments": value.get("arguments", {})}}, where)


def _tools(tools, where: str) -> tuple[dict, ...]:
    """A record's tool declarations (a list, or its JSON text as ShareGPT files keep it)."""
    if tools is None or tools == "":
        return ()
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise ConversationError(f"{where}: not JSON ({err.msg})") from err
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ConversationError(f"{where}: expected a list of tool declarations")
    return tuple(tools)


# What may follow each role once the first user turn has come (a system message may come anywhere).
NEXT_ROLES = {"user": {"assistant"}, "assistant": {"user", "tool"}, "tool": {"tool", "assistant", "user"}}


def _in_turn_order(messages: list[dict], dropped: Counter) -> list[dict]:
    """System prompts first (if any), then from the first user turn on: user, assistant (tool calls may be
    answered by tool results, which the assistant follows), system messages anywhere. Assistant and tool
    turns before the first user turn are dropped; the conversation is cut at the first turn out of order."""
    start = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    kept, rest = messages[:start], messages[start:]
    while rest and rest[0]["role"] in ("assistant", "tool"):
        dropped[f"{rest[0]['role']} turn before the first user turn"] += 1
        rest = rest[1:]
    previous = None
    for i, message in enumerate(rest):
        role = message["role"]
        if role != "system" and previous is not None and role not in NEXT_ROLES[previous]:
            dropped[f"cut at a turn out of order ({role} after {previous})"] += len(rest) - i
            break
        if role == "tool" and previous == "assistant" and not kept[-1].get("tool_calls"):
            dropped["cut at a turn out of order (tool result without a tool call)"] += len(rest) - i
            break
        kept.append(message)
        previous = role if role != "system" else previous
    return kept


# ---------------------------------------------------------------- rendering


def _as_object(call: dict) -> dict:
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return call  # not JSON: the template gets the text as it is
    return {**call, "function": {**call["function"], "arguments": arguments}}


def _as_text(call: dict) -> dict:
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        return call
    return {**call, "function": {**call["function"], "arguments": json.dumps(arguments, ensure_ascii=False)}}

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # the reasoning markers of Qwen3, DeepSeek-R1/V3.1, Kimi
SLICE = 1 << 16  # characters tokenized at once beyond seq_len, where the text is only counted


class RenderError(DataError):
    """A conversation the target's chat template cannot render as it would be served: it is skipped and
    counted under `reason`, never trained as something else."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[bool]
    cut_tokens: int = 0  # tokens past seq_len, cut off (far past it: counted in slices of SLICE characters)
    cut_loss_tokens: int = 0
    turn: int | None = None  # the message a per-turn sample trains; None: every trained turn


class ChatRenderer:
    """A tokenizer's chat template, with the loss spans of assistant turns (see the module docstring)."""

    def __init__(self, tokenizer, stop_token_ids: Iterable[int], loss_turns: str = "all",
                 template_kwargs: dict | None = None, turns: str = "auto"):
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise DataError("the target's tokenizer has no chat template: conversations cannot be rendered")
        if loss_turns not in LOSS_TURNS:
            raise DataError(f"data.loss_turns must be one of {', '.join(LOSS_TURNS)}, got {loss_turns!r}")
        if turns not in TURNS:
            raise DataError(f"data.turns must be one of {', '.join(TURNS)}, got {turns!r}")
        self.tokenizer, self.loss_turns, self.turns = tokenizer, loss_turns, turns
        self.kwargs = dict(template_kwargs or {})
        self.reasons = THINK_CLOSE in str(template)  # the template knows reasoning markers
        self.stop_texts = sorted({tokenizer.convert_ids_to_tokens(int(i)) for i in stop_token_ids}, key=len,
                                 reverse=True)

    def text(self, messages, add_generation_prompt: bool = False, tools=()) -> str:
        """The template's rendering of `messages` (and their `tools`), with the recipe's switches. A tool call
        reaches it as vLLM hands calls to templates: its arguments an object and a call alone with null
        content; a template that fails on those (DeepSeek's join arguments as text, V3.1 reads the content
        as text) gets the JSON text and an empty content instead, in that order."""
        shown = [{key: m[key] for key in TEMPLATE_KEYS if key in m} for m in messages]
        forms = [(_as_object, None), (_as_text, None), (_as_object, ""), (_as_text, "")]
        failure = None
        for arguments, null in forms if any(m.get("tool_calls") for m in shown) else forms[:1]:
            given = [{**m, "tool_calls": [arguments(call) for call in m["tool_calls"]],
                      "content": null if m["content"] is None else m["content"]} if m.get("tool_calls") else m
                     for m in shown]
            try:
                return self.tokenizer.apply_chat_template(
                    given, tools=list(tools) or None, tokenize=False,
                    add_generation_prompt=add_generation_prompt, **self.kwargs)
            except Exception as err:  # jinja's errors and the template's raise_exception: the record's cause
                failure = err
        raise RenderError("the chat template refuses it", f"{type(failure).__name__}: {failure}") from failure

    def prompt_ids(self, messages, tools=()) -> list[int]:
        """The conversation so far with the generation prompt: what the target answers."""
        return self._ids(self.text(messages, add_generation_prompt=True, tools=tools))

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def trained_turns(self, messages) -> list[int]:
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant" and m.get("train", True)]
        return turns[-1:] if self.loss_turns == "last" else turns

    def completion(self, messages, k: int, tools=()) -> tuple[str, str]:
        """(the prompt of assistant turn k, what the model emits after it through its end-of-turn token, or
        up to it where the turn was cut at a length limit: `finished: false`), both read off the template."""
        prompt = self.text(messages[:k], add_generation_prompt=True, tools=tools)
        as_last = self.text(messages[: k + 1], tools=tools)
        reasoning = messages[k].get("reasoning_content", "")
        shared = len(os.path.commonprefix([prompt, as_last]))
        for marker in (THINK_OPEN, THINK_CLOSE):  # "<think>" and "</think>" share "<": never cut inside one
            inside = prompt.find(marker, max(0, shared - len(marker) + 1))
            if 0 <= inside < shared < inside + len(marker):
                shared = inside
        if shared == len(prompt):
            emitted = as_last[shared:]
        else:  # the generation prompt pre-fills what the rendered turn leaves out (DeepSeek-R1's "<think>\n")
            prefill, rendered = prompt[shared:], as_last[shared:]
            if not (self.reasons and THINK_OPEN in prefill):
                raise RenderError("the chat template renders an assistant turn unlike its generation prompt",
                                  f"turn {k}: {prefill!r} vs {rendered[:40]!r}")
            emitted = reasoning + (rendered if rendered.startswith(THINK_CLOSE) else THINK_CLOSE + rendered)
            reasoning = ""
        if reasoning and reasoning.strip() not in emitted:  # a template that shows no reasoning for this turn
            empty = THINK_OPEN + THINK_CLOSE
            if not (self.reasons and empty in emitted):
                raise RenderError("the chat template does not render a turn's reasoning",
                                  f"turn {k}: what the model emitted cannot be told")
            emitted = emitted.replace(empty, THINK_OPEN + reasoning + THINK_CLOSE, 1)
        stops = [(emitted.find(stop), stop) for stop in self.stop_texts if stop in emitted]
        if not stops:
            raise RenderError("the chat template does not end an assistant turn with an end-of-turn token",
                              f"turn {k}: {emitted[-60:]!r}")
        at, stop = min(stops)  # the model stops there: what the template adds after it is not emitted
        if messages[k].get("finished", True) is False:  # cut at its length limit: it did not stop there
            return prompt, emitted[:at]
        return prompt, emitted[: at + len(stop)]

    def samples(self, conversation: Conversation, seq_len: int) -> list[Rendered]:
        """The conversation as training samples, each cut to `seq_len` tokens (what was cut is counted): one
        with a loss span per trained turn where the template renders the whole conversation as every turn
        would be generated, else one per trained turn with its own history (module docstring). Raises
        RenderError for a conversation the template cannot render so."""
        messages = list(conversation.messages)
        while messages and messages[-1]["role"] != "assistant":
            messages.pop()
        turns = self.trained_turns(messages)
        parts = {k: self.completion(messages, k, conversation.tools) for k in turns}
        if self.turns == "auto":
            full = self.text(messages, tools=conversation.tools)
            spans = [(len(prompt), len(prompt) + len(emitted)) for prompt, emitted in parts.values()]
            if all(full.startswith(prompt) and full.startswith(emitted, start)
                   for (prompt, emitted), (start, _) in zip(parts.values(), spans, strict=True)):
                pieces, position = [], 0
                for start, end in spans:
                    pieces += [(full[position:start], False), (full[start:end], True)]
                    position = end
                return [self._tokens([*pieces, (full[position:], False)], seq_len)]
        return [self._tokens([(prompt, False), (emitted, True)], seq_len, turn=k)
                for k, (prompt, emitted) in parts.items()]

    def _tokens(self, pieces: list[tuple[str, bool]], seq_len: int, turn: int | None = None) -> Rendered:
        """Token ids and loss mask of text pieces tokenized one by one, the first `seq_len` kept; the rest is
        counted, never tokenized whole (a 10 MB message would cost gigabytes)."""
        rendered = Rendered([], [], turn=turn)
        for text, in_loss in pieces:
            room = seq_len - len(rendered.input_ids)
            kept, total = self._ids_within(text, room)
            rendered.input_ids += kept
            rendered.loss_mask += [in_loss] * len(kept)
            rendered.cut_tokens += total - len(kept)
            rendered.cut_loss_tokens += (total - len(kept)) if in_loss else 0
        return rendered

    def _ids_within(self, text: str, room: int) -> tuple[list[int], int]:
        """(the first `room` token ids of `text`, how many it has in all). A text far longer than the room is
        tokenized as a prefix with a margin (the first `room` tokens of a prefix are those of the whole, a
        margin of 64 tokens before its cut) and counted beyond it in slices cut at whitespace."""
        if not text:
            return [], 0
        long = max(room, 0) * 32 + SLICE
        if len(text) <= long:
            ids = self._ids(text)
            return ids[: max(room, 0)], len(ids)
        head = text[:long]
        ids = self._ids(head)
        if len(ids) < room + 64:  # a dense text: the prefix did not reach the cut, tokenize it all
            ids = self._ids(text)
            return ids[:room], len(ids)
        return ids[: max(room, 0)], len(ids) + self._count(text[long:])

    def _count(self, text: str) -> int:
        total, position = 0, 0
        while position < len(text):
            end = min(len(text), position + SLICE)
            if end < len(text):  # cut at whitespace, where a token boundary is
                space = max(text.rfind(" ", position, end), text.rfind("\n", position, end))
                end = space if space > position else end
            total += len(self._ids(text[position:end]))
            position = end
        return total
