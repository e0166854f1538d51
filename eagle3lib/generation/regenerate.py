"""The target's own replies: every assistant turn of a conversation dataset replaced by what the target says,
turn by turn on the regenerated history (SpecForge's and speculators' practice), through one of three
engines:
- `builtin`: the target loaded here, batched greedy or sampled decoding (`speculate.decode_target_only`);
- `vllm`: vLLM in its own venv (`make vllm-setup`), one long-lived process fed batches of token ids;
- `server`: a running SGLang or vLLM server's OpenAI-compatible `/v1/chat/completions` (a GPU host).

The output is a conversation file, one record a line, `{"id", "conversations": [{"role", "content"}, ...]}`:
role/content messages under SpecForge's key, which SpecForge 0.2 and speculators 0.9 both read unchanged
(README, "Conversation data"). It is written as it goes to `<out>.partial` and resumable: a rerun with the
same source, target and settings continues with the next unanswered conversation and leaves the written
ones untouched; only a finished file gets its final name (gzipped when that ends in `.gz`). The manifest
beside it (`<stem>.manifest.json`) records the source file's hash, the target's fingerprint, the settings
and what was written and skipped.

The manifest is the commit point: it counts the records written (`lines`), and a rerun cuts the partial file
back to that count (a chunk written before a kill but not yet counted is regenerated). A finished file's
manifest is written, complete with the file's hash, before the file is renamed into place, so that a kill
between the two is finished by the rerun. One process at a time writes an output (a lock beside it); nothing
is written before the first chunk is answered.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eagle3lib.data.conversations import (
    TEMPLATE_KEYS,
    THINK_CLOSE,
    THINK_OPEN,
    ChatRenderer,
    Conversation,
    ConversationError,
    RenderError,
    manifest_path,
)
from eagle3lib.data.layout import DataError
from eagle3lib.files import atomic_write_text, file_sha256, held
from eagle3lib.progress import progress
from eagle3lib.runs import git_commit

FORMAT = "eagle3lib-regenerated"
ENGINES = ("builtin", "vllm", "server")
REASONING = ("save", "drop", "inline")  # where a reply's reasoning goes in the regenerated history


class RegenerationError(DataError):
    """A regeneration that cannot start or continue as asked: the message says what differs or failed."""


@dataclass(frozen=True)
class RegenerationSettings:
    engine: str = "builtin"  # builtin | vllm | server
    max_new_tokens: int = 512  # per reply
    temperature: float = 0.0  # 0: greedy
    seed: int = 0  # sampling: each reply draws from a seed of (seed, conversation id, turn)
    batch_size: int = 32  # replies decoded together (builtin), requests in flight (server)
    max_turns: int = 0  # user turns answered per conversation; 0: all
    max_prompt_tokens: int = 2048  # a longer prompt ends its conversation there (its earlier turns are kept)
    dtype: str = "auto"  # builtin and vllm: the target's dtype
    url: str = ""  # server: e.g. http://127.0.0.1:30000
    model: str = ""  # server: the model name it serves ("" = the target's spec)
    # the target's thinking mode: its chat template's switches, and where a reply's reasoning is kept
    chat_template_kwargs: dict = field(default_factory=dict)
    reasoning: str = "save"  # save: apart, in reasoning_content (as a parser gives it) | drop | inline
    # builtin: the decoding steps through one compiled graph (a Llama-like target, `target.direct`): 1.3x the
    # eager steps at batch 32 on the 2-core Xeon after about a minute's compilation (bench/RESULTS.md §10)
    compiled: bool = False

    def check(self) -> None:
        problems = []
        if self.engine not in ENGINES:
            problems.append(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.max_prompt_tokens < 1 or self.max_turns < 0:
            problems.append("max_new_tokens, batch_size and max_prompt_tokens must be >= 1, max_turns >= 0")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if self.engine == "server" and not self.url:
            problems.append("engine server needs a url (an SGLang or vLLM server, OpenAI-compatible)")
        if self.compiled and self.engine != "builtin":
            problems.append(f"compiled decoding is the builtin engine's, not {self.engine}'s")
        if self.reasoning not in REASONING:
            problems.append(f"reasoning must be one of {', '.join(REASONING)}, got {self.reasoning!r}")
        if not isinstance(self.chat_template_kwargs, dict):
            problems.append(f"chat_template_kwargs must be a mapping, got {self.chat_template_kwargs!r}")
        if problems:
            raise RegenerationError("regeneration settings: " + "; ".join(problems))


@dataclass
class Reply:
    text: str  # what the model emitted (its reasoning included, unless `reasoning` holds it apart)
    tokens: int  # tokens generated, the stop token included
    finished: bool  # ended with a stop token (else cut at max_new_tokens)
    reasoning: str | None = None  # a server's reasoning parser's reasoning_content
    tool_calls: list | None = None  # a server's tool parser's calls


@dataclass
class Request:
    messages: list[dict]  # the conversation so far, ending with the user turn to answer
    prompt_ids: list[int]  # those messages in the target's chat template with the generation prompt
    seed: int
    tools: tuple = ()  # the conversation's tool declarations


def assistant_message(reply: Reply, mode: str) -> dict:
    """The reply as the regenerated history holds it. Its reasoning is what the model emitted before the
    template's `</think>` (a leading `<think>` left out), saved apart in `reasoning_content` (`save`, as a
    serving stack's reasoning parser returns it, so that the template renders it back exactly and rewrites
    history as it does when served), dropped (`drop`), or left in the content as emitted (`inline`)."""
    text, reasoning = reply.text, reply.reasoning
    if reasoning is None and mode != "inline" and THINK_CLOSE in text:
        reasoning, _, text = text.partition(THINK_CLOSE)
        reasoning = reasoning.removeprefix(THINK_OPEN)
    elif reasoning is not None and mode == "inline":
        text = f"{THINK_OPEN}{reasoning}{THINK_CLOSE}{text}"
        reasoning = None
    message = {"role": "assistant", "content": text}
    if reasoning and mode == "save":
        message["reasoning_content"] = reasoning
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    if not reply.finished:  # cut at max_new_tokens: the model did not end its turn, so training must not
        message["finished"] = False  # teach the end-of-turn token the template writes after it
    return message


def rendered_as_emitted(renderer: ChatRenderer, messages: list[dict], answer: dict, reply: Reply,
                        mode: str, tools=()) -> bool:
    """Whether the template renders the new turn, where training reads it, as the model emitted it. A
    template that trims the content (Llama 3.1) or strips newlines around the reasoning (Qwen3) trains a
    reply that opens or ends with whitespace a token unlike its emission: counted, not silent. Replies whose
    reasoning is dropped or whose tool calls the template writes from their parsed form are not compared."""
    if mode == "drop" or reply.tool_calls:
        return True
    emitted = reply.text if reply.reasoning is None else reply.reasoning + THINK_CLOSE + reply.text
    try:
        _, rendered = renderer.completion([*messages, answer], len(messages), tools)
    except RenderError:
        return True  # the training side skips it and counts why
    if reply.finished:
        ends = [stop for stop in renderer.stop_texts if rendered.endswith(stop)]
        rendered = rendered.removesuffix(ends[0]) if ends else rendered
    return rendered == emitted


# ---------------------------------------------------------------- engines


class Engine:
    """What every engine is: `replies(requests)`, and a context manager that closes what it started."""

    def replies(self, requests: list[Request]) -> list[Reply]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BuiltinEngine(Engine):
    """The target in this process (`target.model.Target`), prompts of similar length decoded together."""

    def __init__(self, target, settings: RegenerationSettings):
        self.target, self.settings = target, settings
        self.stop = set(target.stop_token_ids)  # every id the generation config ends at, and the tokenizer's

    def replies(self, requests: list[Request]) -> list[Reply]:
        import torch

        from eagle3lib.decoding.probe import batches_by_length
        from eagle3lib.decoding.speculate import decode_target_only

        found: dict[int, Reply] = {}
        prompts = [r.prompt_ids for r in requests]
        for batch in batches_by_length(prompts, self.settings.batch_size):
            generators = [torch.Generator(self.target.device).manual_seed(requests[i].seed) for i in batch]
            settings = self.settings
            out = decode_target_only(self.target.model, [prompts[i] for i in batch], settings.max_new_tokens,
                                     settings.temperature, self.stop, generators, compiled=settings.compiled)
            for i, generation in zip(batch, out.generations, strict=True):
                found[i] = self._reply(generation.tokens)
        return [found[i] for i in range(len(requests))]

    def _reply(self, tokens: list[int]) -> Reply:
        finished = bool(tokens) and tokens[-1] in self.stop
        text = self.target.tokenizer.decode(tokens[:-1] if finished else tokens)
        return Reply(text, len(tokens), finished)


class VllmEngine(Engine):
    """vLLM (its own venv) as one long-lived process: token ids in and out (`engines.VllmGenerator`)."""

    def __init__(self, target_folder: Path, tokenizer, stop_ids: list[int], settings: RegenerationSettings,
                 log_path: Path, max_model_len: int):
        from eagle3lib.decoding.engines import VllmGenerator

        self.tokenizer, self.stop_ids, self.settings = tokenizer, set(stop_ids), settings
        dtype = "bfloat16" if settings.dtype == "auto" else settings.dtype
        self.worker = VllmGenerator(target_folder, dtype, max_model_len, settings.seed, log_path)

    def replies(self, requests: list[Request]) -> list[Reply]:
        outputs = self.worker.generate([r.prompt_ids for r in requests], self.settings.max_new_tokens,
                                       self.settings.temperature, [r.seed for r in requests],
                                       sorted(self.stop_ids))
        return [self._reply(tokens, finish) for tokens, finish in outputs]

    def _reply(self, tokens: list[int], finish: str) -> Reply:
        text_tokens = tokens[:-1] if tokens and tokens[-1] in self.stop_ids else tokens
        return Reply(self.tokenizer.decode(text_tokens), len(tokens), finish == "stop")

    def close(self) -> None:
        self.worker.close()


class ServerEngine(Engine):
    """A running SGLang or vLLM server's OpenAI-compatible chat endpoint: the server applies the template."""

    def __init__(self, settings: RegenerationSettings, model: str, timeout_s: float = 600):
        self.settings, self.model, self.timeout_s = settings, model, timeout_s
        self.endpoint = settings.url.rstrip("/") + "/v1/chat/completions"

    def replies(self, requests: list[Request]) -> list[Reply]:
        with ThreadPoolExecutor(max_workers=self.settings.batch_size) as pool:
            return list(pool.map(self._one, requests))

    def _one(self, request: Request) -> Reply:
        messages = [{key: m[key] for key in TEMPLATE_KEYS if key in m} for m in request.messages]
        body = {"model": self.model, "messages": messages, "max_tokens": self.settings.max_new_tokens,
                "temperature": self.settings.temperature, "seed": request.seed,
                "chat_template_kwargs": self.settings.chat_template_kwargs}
        if request.tools:
            body["tools"] = list(request.tools)
        http = urllib.request.Request(self.endpoint, data=json.dumps(body).encode(),
                                      headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(http, timeout=self.timeout_s) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise RegenerationError(f"{self.endpoint}: HTTP {err.code}: {err.read()[:300]!r}") from err
        except urllib.error.URLError as err:
            raise RegenerationError(f"{self.endpoint}: no server reachable ({err.reason})") from err
        choice = answer["choices"][0]
        message = choice["message"]
        reasoning = message.get("reasoning_content", message.get("reasoning"))  # a reasoning parser's split
        return Reply(message.get("content") or "", answer.get("usage", {}).get("completion_tokens", 0),
                     choice.get("finish_reason") in ("stop", "tool_calls"), reasoning,
                     message.get("tool_calls") or None)


def make_engine(settings: RegenerationSettings, target, renderer: ChatRenderer, work_dir: Path) -> Engine:
    """The engine `settings.engine` names, for `target` (a `target.model.Target`; vllm and server use
    only its name, tokenizer and stop tokens)."""
    settings.check()
    if settings.engine == "builtin":
        if settings.dtype not in ("auto", str(target.dtype).removeprefix("torch.")):
            raise RegenerationError(f"the builtin engine decodes with the target as loaded ({target.dtype}): "
                                    f"set target.dtype to {settings.dtype}, or the regeneration's to auto")
        from eagle3lib.target import direct

        if settings.compiled and not direct.supports(target.model):
            raise RegenerationError(f"compiled decoding needs a Llama-like target with full attention "
                                    f"(target.direct); {target.name} is {target.model.config.model_type}")
        return BuiltinEngine(target, settings)
    if settings.engine == "vllm":
        from eagle3lib.decoding.engines import target_folder

        max_model_len = settings.max_prompt_tokens + settings.max_new_tokens + 8
        return VllmEngine(target_folder(target.name), renderer.tokenizer, target.stop_token_ids, settings,
                          Path(work_dir) / "vllm.log", max_model_len)
    return ServerEngine(settings, settings.model or target.name)


def settings_from_data(data: dict, seed: int) -> RegenerationSettings:
    """The regeneration a recipe's `data` section asks for (`data.regenerate`, data.max_new_tokens), in its
    thinking mode (`data.chat_template_kwargs`)."""
    return RegenerationSettings(max_new_tokens=data["max_new_tokens"], seed=seed,
                                chat_template_kwargs=dict(data["chat_template_kwargs"]), **data["regenerate"])


@dataclass
class TargetFacts:
    """What the vllm and server engines need of a target, read from its folder without loading weights: its
    spec, tokenizer, stop tokens and a description for the manifest (the config file's hash standing in for
    the weights' fingerprint)."""

    name: str
    tokenizer: object
    stop_token_ids: list[int]
    folder: Path

    @classmethod
    def read(cls, spec: str, cache_dir: str = "") -> TargetFacts:
        from transformers import AutoTokenizer

        from eagle3lib.decoding.engines import target_folder
        from eagle3lib.target.model import stop_token_ids

        folder = target_folder(spec, cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        generation = folder / "generation_config.json"
        configured = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
        return cls(spec, tokenizer, stop_token_ids(tokenizer, configured), folder)

    def describe(self) -> dict:
        return {"name": self.name, "folder": str(self.folder),
                "config_sha256": file_sha256(self.folder / "config.json")}


# ---------------------------------------------------------------- the file


def partial_path(out: Path) -> Path:
    return out.with_name(out.name.removesuffix(".gz") + ".partial")


def staged_path(out: Path) -> Path:
    """The finished file before it is renamed into place."""
    return out.with_name(f".{out.name}.tmp")


def output_lock(out: Path):
    """Hold `out` for the block: a second regeneration into it is refused before it touches anything."""
    return held(out.with_name(f".{out.name}.lock"), lambda holder: RegenerationError(
        f"{out} is being written by another regeneration ({holder}); let it end, or write elsewhere"))


def read_partial(path: Path, lines: int) -> list[str]:
    """The ids of the first `lines` records written, the partial file cut back to them: a torn last line (a
    kill mid-write) and records a kill left uncounted by the manifest are dropped, and said so."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    records = raw.split(b"\n")[:-1]
    if len(records) < lines:
        raise RegenerationError(f"{path} holds {len(records)} records, its manifest counts {lines}: the "
                                "partial file is damaged; move it and its manifest away to start again")
    ids = []
    for number, line in enumerate(records[:lines], 1):
        try:
            ids.append(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise RegenerationError(f"{path}:{number}: not a regenerated record ({err}); the partial file is "
                                    "damaged: move it away to start again") from err
    kept = sum(len(line) + 1 for line in records[:lines])
    if kept < len(raw):
        print(f"[regenerate] {path}: dropping {len(records) - lines} record(s) written after the manifest's "
              f"last count, {len(raw) - kept} bytes in all (an interrupted run): they are regenerated")
        with open(path, "r+b") as handle:
            handle.truncate(kept)
    return ids


def regenerate(
    conversations: Iterable[Conversation],
    out: str | os.PathLike,
    engine,
    renderer: ChatRenderer,
    settings: RegenerationSettings,
    *,
    source: dict,
    target: dict,
    limit: int | None = None,
    enough_tokens: int | None = None,
    seq_len: int = 1 << 30,
    chunk: int | None = None,
    max_seconds: float | None = None,
    command: str = "",
) -> dict:
    """Regenerate `conversations` into the file `out` (see the module docstring); returns the manifest.

    `source` describes the input (path, sha256, corpus); `target` the target (name, fingerprint). Stops after
    `limit` conversations, or once the written conversations hold `enough_tokens` tokens in the target's chat
    template, each counted up to `seq_len` (00_prepare_data asks for what its capture needs). `chunk`
    conversations (default 4 batches) are regenerated together and appended at once; with `max_seconds`, no
    chunk starts after that many seconds (the file is finished with what was written: a lent machine's
    budget). A complete `out` made with the same inputs and settings is returned as it is.
    """
    deadline = time.perf_counter() + max_seconds if max_seconds else float("inf")
    settings.check()
    out = Path(out)
    if not out.name.endswith((".jsonl", ".jsonl.gz")):
        raise RegenerationError(f"{out}: a regenerated file is JSON lines: name it .jsonl or .jsonl.gz")
    for name, value, low in (("limit", limit, 1), ("chunk", chunk, 1), ("max_seconds", max_seconds, 0)):
        if value is not None and not value >= low:
            raise RegenerationError(f"{name} must be at least {low}, got {value}")
    identity = {"format": FORMAT, "source": source, "target": target, "settings": asdict(settings)}
    with output_lock(out):
        finished = _finished(out, {**identity, "limit": limit, "enough_tokens": enough_tokens})
        if finished:
            return finished
        return _regenerate(conversations, out, engine, renderer, settings, identity, limit=limit,
                           enough_tokens=enough_tokens, seq_len=seq_len,
                           chunk=chunk or 4 * settings.batch_size, deadline=deadline, command=command)


def _regenerate(conversations, out: Path, engine, renderer: ChatRenderer, settings: RegenerationSettings,
                identity: dict, *, limit, enough_tokens, seq_len, chunk, deadline, command) -> dict:
    partial, manifest_file = partial_path(out), manifest_path(out)
    done_ids, counts, last = _resume(partial, manifest_file, identity)
    manifest = {**identity, "limit": limit, "enough_tokens": enough_tokens, "command": command,
                "commit": git_commit(), "complete": False, "lines": len(done_ids), "last": last,
                "counts": counts}
    skipped, unanswered = Counter(counts["skipped"]), Counter(counts["turns_not_answered"])
    stream = _after(iter(conversations), last)
    unit, done = ("conv", len(done_ids)) if limit else ("tok", counts["template_tokens"])
    bar = progress(total=limit or enough_tokens, desc=f"regenerate → {out.name}", unit=unit, initial=done)
    while not _enough(counts, limit, enough_tokens) and time.perf_counter() < deadline:
        wanted = chunk if limit is None else min(chunk, limit - counts["conversations"])
        batch = [c for _, c in zip(range(wanted), stream, strict=False)]
        if not batch:
            break
        started = time.perf_counter()
        answered = list(_regenerate_chunk(batch, engine, renderer, settings, counts, unanswered, seq_len))
        with open(partial, "ab") as handle:  # made at the first chunk answered, not before
            for record, reason, tokens in answered:
                if reason:
                    skipped[reason] += 1
                    continue
                handle.write((json.dumps(record, ensure_ascii=False) + "\n").encode())  # one write per line
                counts["conversations"] += 1
                counts["template_tokens"] += tokens
                bar.update(1 if limit else tokens)
            handle.flush()
            os.fsync(handle.fileno())
        counts["seconds"] += time.perf_counter() - started
        counts |= {"skipped": dict(skipped), "turns_not_answered": dict(unanswered)}
        manifest |= {"lines": counts["conversations"], "last": batch[-1].id}  # written, and seen (skips too)
        atomic_write_text(manifest_file, json.dumps(manifest, indent=2) + "\n")  # the chunk's commit
    bar.close()
    counts["reply_tokens_per_s"] = counts["reply_tokens"] / max(counts["seconds"], 1e-9)
    staged = _stage_final(partial, out)
    manifest |= {"complete": True, "sha256": file_sha256(staged), "bytes": staged.stat().st_size}
    atomic_write_text(manifest_file, json.dumps(manifest, indent=2) + "\n")
    os.replace(staged, out)
    partial.unlink(missing_ok=True)
    return manifest


def _enough(counts: dict, limit: int | None, enough_tokens: int | None) -> bool:
    return (limit is not None and counts["conversations"] >= limit) or (
        enough_tokens is not None and counts["template_tokens"] >= enough_tokens)


def _read_manifest(manifest_file: Path) -> dict | None:
    """A manifest, a setting added since it was written read as its default (what the code that wrote it
    did)."""
    if not manifest_file.exists():
        return None
    manifest = json.loads(manifest_file.read_text())
    if isinstance(manifest.get("settings"), dict):
        manifest["settings"] = {**asdict(RegenerationSettings()), **manifest["settings"]}
    return manifest


def _finished(out: Path, wanted: dict) -> dict | None:
    """The manifest of a regeneration finished with `wanted`'s inputs, settings and size, if there is one:
    the file in place, or staged with the hash its complete manifest records (a kill before the rename:
    renamed now). None when there is nothing finished to return."""
    manifest_file, staged = manifest_path(out), staged_path(out)
    manifest = _read_manifest(manifest_file) or {}
    if not out.exists() and not (manifest.get("complete") and staged.exists()):
        return None
    changed = [f"{key}: {manifest.get(key)!r} -> {value!r}" for key, value in wanted.items()
               if manifest.get(key) != value]
    if not manifest.get("complete") or changed:
        why = "; ".join(changed) or "no complete manifest"
        raise RegenerationError(f"{out} exists and was made otherwise ({why}); remove it or write elsewhere")
    if not out.exists():
        found = file_sha256(staged)
        if found != manifest["sha256"]:
            raise RegenerationError(f"{staged}: the finished file staged before a kill has SHA-256 {found}, "
                                    f"its manifest {manifest['sha256']}: remove both and regenerate")
        os.replace(staged, out)
    partial_path(out).unlink(missing_ok=True)
    return manifest


EMPTY_COUNTS = {"conversations": 0, "replies": 0, "reply_tokens": 0, "replies_cut_at_max_new_tokens": 0,
                "replies_rendered_unlike_emitted": 0, "template_tokens": 0, "skipped": {},
                "turns_not_answered": {}, "seconds": 0.0}


def _resume(partial: Path, manifest_file: Path, identity: dict) -> tuple[list[str], dict, str | None]:
    """(the ids already written, the counts so far, the id of the last conversation a committed chunk held),
    after checking that the earlier run used this source, target and settings (a new limit or token budget
    may differ). A run that wrote nothing leaves nothing to continue: it starts afresh whatever it was."""
    earlier = _read_manifest(manifest_file)
    if not partial.exists() or not earlier or not earlier.get("lines"):
        if partial.exists() and not earlier:
            raise RegenerationError(f"{partial} has no manifest ({manifest_file}) beside it: cannot tell "
                                    "what made it; move it away to start again")
        partial.unlink(missing_ok=True)
        return [], json.loads(json.dumps(EMPTY_COUNTS)), None
    changed = [f"{key}: {earlier.get(key)!r} -> {value!r}" for key, value in identity.items()
               if earlier.get(key) != value]
    if changed:
        raise RegenerationError(f"{partial} was made with other inputs or settings ({'; '.join(changed)}); "
                                "put them back to continue it, or write to another file")
    done = read_partial(partial, earlier["lines"])
    counts = {**json.loads(json.dumps(EMPTY_COUNTS)), **earlier["counts"]}  # a count added since: from 0
    return done, counts, earlier.get("last", done[-1])


def _after(stream: Iterator[Conversation], last: str | None) -> Iterator[Conversation]:
    """The conversations after `last`, the last one a committed chunk held (written or skipped and counted:
    neither is done twice)."""
    if last is None:
        return stream
    for conversation in stream:
        if conversation.id == last:
            return stream
    raise RegenerationError(f"the source no longer holds conversation {last!r}, the last one regenerated: "
                            "the partial file does not belong to it")


def _asks(conversation: Conversation) -> list[list[dict]]:
    """What each regenerated reply answers: the user turn, with any system message since the last reply."""
    asks, pending = [], []
    for message in conversation.messages:
        if message["role"] == "assistant":
            asks, pending = asks + [pending], []
        else:
            pending.append(message)
    return asks + [pending] if any(m["role"] == "user" for m in pending) else asks


def _regenerate_chunk(
    batch: list[Conversation], engine, renderer: ChatRenderer, settings: RegenerationSettings, counts: dict,
    unanswered: Counter, seq_len: int,
) -> Iterator[tuple[dict | None, str | None, int]]:
    """(record, None, tokens in the template) per conversation, or (None, why it was skipped, 0): one that
    cannot be regenerated is counted, the others of the chunk are kept."""
    asks = [_asks(c) for c in batch]
    kept = [a[: settings.max_turns or None] for a in asks]
    trained = [[m.get("train", True) for m in c.messages if m["role"] == "assistant"] for c in batch]
    histories: list[list[dict]] = [[] for _ in batch]
    failed: list[str | None] = ["tool turns (the tools cannot be run while regenerating)"
                                if any(m["role"] == "tool" for m in c.messages) else None for c in batch]
    open_ = [reason is None for reason in failed]
    for turn in range(max(len(k) for k in kept)):
        requests, owners = [], []
        for i, conversation in enumerate(batch):
            if not open_[i] or turn >= len(kept[i]):
                continue
            messages = [*histories[i], *kept[i][turn]]
            try:
                prompt_ids = renderer.prompt_ids(messages, conversation.tools)
            except RenderError as err:
                open_[i], failed[i] = False, err.reason
                continue
            if len(prompt_ids) > settings.max_prompt_tokens:
                open_[i] = False
                unanswered[f"prompt longer than {settings.max_prompt_tokens} tokens"] += len(kept[i]) - turn
                continue
            seed = reply_seed(settings.seed, conversation.id, turn)
            requests.append(Request(messages, prompt_ids, seed, conversation.tools))
            owners.append(i)
        if not requests:
            break
        for i, request, reply in zip(owners, requests, engine.replies(requests), strict=True):
            answer = assistant_message(reply, settings.reasoning)
            if turn < len(trained[i]) and not trained[i][turn]:
                answer["weight"] = 0  # the source kept this turn out of the loss: so does its new form
            histories[i] = [*request.messages, answer]
            counts["replies"] += 1
            counts["reply_tokens"] += reply.tokens
            counts["replies_cut_at_max_new_tokens"] += not reply.finished
            counts["replies_rendered_unlike_emitted"] += not rendered_as_emitted(
                renderer, request.messages, answer, reply, settings.reasoning, request.tools)
    for conversation, history, ask, reason in zip(batch, histories, asks, failed, strict=True):
        unanswered["beyond max_turns"] += len(ask) - len(ask[: settings.max_turns or None])
        if reason:
            yield None, reason, 0
            continue
        if not any(m["role"] == "assistant" for m in history):
            yield None, f"first prompt longer than {settings.max_prompt_tokens} tokens", 0
            continue
        rendered = Conversation(conversation.id, tuple(_as_read(m) for m in history), conversation.where,
                                conversation.tools)
        try:
            tokens = sum(len(sample.input_ids) for sample in renderer.samples(rendered, seq_len))
        except RenderError as err:  # the regenerated history renders otherwise than it was asked: counted
            yield None, err.reason, 0
            continue
        record = {"id": conversation.id, "conversations": history}
        if conversation.tools:
            record["tools"] = list(conversation.tools)
        yield record, None, tokens


def _as_read(message: dict) -> dict:
    """A written message as a reader reads it back (`weight: 0` is `train: False`)."""
    shown = {key: message[key] for key in TEMPLATE_KEYS if key in message}
    return shown | ({"train": False} if message.get("weight") == 0 or message.get("train") is False else {})


def reply_seed(seed: int, conversation_id: str, turn: int) -> int:
    """Each reply's sampling seed: the same on a resumed run, whatever the batching."""
    return int(hashlib.sha256(f"{seed}:{conversation_id}:{turn}".encode()).hexdigest()[:8], 16)


def _stage_final(partial: Path, out: Path) -> Path:
    """The finished partial file beside its final name (gzipped when that ends in .gz), not yet renamed."""
    staged = staged_path(out)
    if not partial.exists():
        partial.touch()
    if out.name.endswith(".gz"):
        with open(partial, "rb") as source, gzip.open(staged, "wb", compresslevel=9) as target:
            shutil.copyfileobj(source, target)
    else:
        shutil.copyfile(partial, staged)
    return staged


def source_description(path: Path, corpus: str) -> dict:
    """What a regeneration read, the same on every machine: the corpus as named (`sharegpt`, or the path as
    given), its file's name, SHA-256 and size; never a machine's own folder."""
    if not path.is_file():
        raise ConversationError(f"{path}: regeneration reads one conversation file, not a folder")
    return {"corpus": corpus, "file": path.name, "sha256": file_sha256(path), "bytes": path.stat().st_size}
