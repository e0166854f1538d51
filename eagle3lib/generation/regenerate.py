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
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3lib.data.conversations import ChatRenderer, Conversation, ConversationError, manifest_path
from eagle3lib.data.layout import DataError
from eagle3lib.files import atomic_write_text, file_sha256, held
from eagle3lib.progress import progress
from eagle3lib.runs import git_commit

FORMAT = "eagle3lib-regenerated"
ENGINES = ("builtin", "vllm", "server")


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
        if problems:
            raise RegenerationError("regeneration settings: " + "; ".join(problems))


@dataclass
class Reply:
    text: str
    tokens: int  # tokens generated, the stop token included
    finished: bool  # ended with a stop token (else cut at max_new_tokens)


@dataclass
class Request:
    messages: list[dict]  # the conversation so far, ending with the user turn to answer
    prompt_ids: list[int]  # those messages in the target's chat template with the generation prompt
    seed: int


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
        self.stop = target.tokenizer.eos_token_id

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
                                     settings.temperature, self.stop, generators)
            for i, generation in zip(batch, out.generations, strict=True):
                found[i] = self._reply(generation.tokens)
        return [found[i] for i in range(len(requests))]

    def _reply(self, tokens: list[int]) -> Reply:
        finished = bool(tokens) and tokens[-1] == self.stop
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
        body = {"model": self.model, "messages": request.messages, "max_tokens": self.settings.max_new_tokens,
                "temperature": self.settings.temperature, "seed": request.seed}
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
        return Reply(choice["message"]["content"] or "", answer.get("usage", {}).get("completion_tokens", 0),
                     choice.get("finish_reason") == "stop")


def make_engine(settings: RegenerationSettings, target, renderer: ChatRenderer, work_dir: Path) -> Engine:
    """The engine `settings.engine` names, for `target` (a `target.model.Target`; vllm and server use
    only its name, tokenizer and stop tokens)."""
    settings.check()
    if settings.engine == "builtin":
        if settings.dtype not in ("auto", str(target.dtype).removeprefix("torch.")):
            raise RegenerationError(f"the builtin engine decodes with the target as loaded ({target.dtype}): "
                                    f"set target.dtype to {settings.dtype}, or the regeneration's to auto")
        return BuiltinEngine(target, settings)
    if settings.engine == "vllm":
        from eagle3lib.decoding.engines import target_folder

        max_model_len = settings.max_prompt_tokens + settings.max_new_tokens + 8
        return VllmEngine(target_folder(target.name), renderer.tokenizer, target.stop_token_ids, settings,
                          Path(work_dir) / "vllm.log", max_model_len)
    return ServerEngine(settings, settings.model or target.name)


def settings_from_data(data: dict, seed: int) -> RegenerationSettings:
    """The regeneration a recipe's `data` section asks for (`data.regenerate`, data.max_new_tokens)."""
    return RegenerationSettings(max_new_tokens=data["max_new_tokens"], seed=seed, **data["regenerate"])


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
    done_ids, counts = _resume(partial, manifest_file, identity)
    manifest = {**identity, "limit": limit, "enough_tokens": enough_tokens, "command": command,
                "commit": git_commit(), "complete": False, "lines": len(done_ids), "counts": counts}
    skipped, unanswered = Counter(counts["skipped"]), Counter(counts["turns_not_answered"])
    stream = _after(iter(conversations), done_ids)
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
        manifest["lines"] = counts["conversations"]
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


def _finished(out: Path, wanted: dict) -> dict | None:
    """The manifest of a regeneration finished with `wanted`'s inputs, settings and size, if there is one:
    the file in place, or staged with the hash its complete manifest records (a kill before the rename:
    renamed now). None when there is nothing finished to return."""
    manifest_file, staged = manifest_path(out), staged_path(out)
    manifest = json.loads(manifest_file.read_text()) if manifest_file.exists() else {}
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
                "template_tokens": 0, "skipped": {}, "turns_not_answered": {}, "seconds": 0.0}


def _resume(partial: Path, manifest_file: Path, identity: dict) -> tuple[list[str], dict]:
    """(the ids already written, the counts so far), after checking that the earlier run used this source,
    target and settings (a new limit or token budget may differ). A run that wrote nothing leaves nothing to
    continue: it starts afresh whatever it was."""
    earlier = json.loads(manifest_file.read_text()) if manifest_file.exists() else None
    if not partial.exists() or not earlier or not earlier.get("lines"):
        if partial.exists() and not earlier:
            raise RegenerationError(f"{partial} has no manifest ({manifest_file}) beside it: cannot tell "
                                    "what made it; move it away to start again")
        partial.unlink(missing_ok=True)
        return [], json.loads(json.dumps(EMPTY_COUNTS))
    changed = [f"{key}: {earlier.get(key)!r} -> {value!r}" for key, value in identity.items()
               if earlier.get(key) != value]
    if changed:
        raise RegenerationError(f"{partial} was made with other inputs or settings ({'; '.join(changed)}); "
                                "put them back to continue it, or write to another file")
    return read_partial(partial, earlier["lines"]), earlier["counts"]


def _after(stream: Iterator[Conversation], done_ids: list[str]) -> Iterator[Conversation]:
    """The conversations after those already written, checking that the source still gives them in order."""
    if not done_ids:
        return stream
    done = set(done_ids)
    last = done_ids[-1]
    for conversation in stream:
        if conversation.id == last:
            return stream
        if conversation.id not in done:
            continue  # skipped last time (too long a prompt): skipped again
    raise RegenerationError(f"the source no longer holds conversation {last!r}, the last one written: the "
                            "partial file does not belong to it")


def _regenerate_chunk(
    batch: list[Conversation], engine, renderer: ChatRenderer, settings: RegenerationSettings, counts: dict,
    unanswered: Counter, seq_len: int,
) -> Iterator[tuple[dict | None, str | None, int]]:
    """(record, None, tokens in the template) per conversation, or (None, why it was skipped, 0)."""
    histories = [[m] if m["role"] == "system" else [] for m in (c.messages[0] for c in batch)]
    users = [c.user_turns()[: settings.max_turns or None] for c in batch]
    open_ = [True] * len(batch)
    for turn in range(max(len(u) for u in users)):
        requests, owners = [], []
        for i, conversation in enumerate(batch):
            if not open_[i] or turn >= len(users[i]):
                continue
            messages = [*histories[i], {"role": "user", "content": users[i][turn]}]
            prompt_ids = renderer.prompt_ids(messages)
            if len(prompt_ids) > settings.max_prompt_tokens:
                open_[i] = False
                unanswered[f"prompt longer than {settings.max_prompt_tokens} tokens"] += len(users[i]) - turn
                continue
            requests.append(Request(messages, prompt_ids, reply_seed(settings.seed, conversation.id, turn)))
            owners.append(i)
        if not requests:
            break
        for i, request, reply in zip(owners, requests, engine.replies(requests), strict=True):
            histories[i] = [*request.messages, {"role": "assistant", "content": reply.text}]
            counts["replies"] += 1
            counts["reply_tokens"] += reply.tokens
            counts["replies_cut_at_max_new_tokens"] += not reply.finished
    for conversation, history, user_turns in zip(batch, histories, users, strict=True):
        unanswered["beyond max_turns"] += len(conversation.user_turns()) - len(user_turns)
        if not any(m["role"] == "assistant" for m in history):
            yield None, f"first prompt longer than {settings.max_prompt_tokens} tokens", 0
            continue
        record = {"id": conversation.id, "conversations": history}
        rendered = Conversation(conversation.id, tuple(history), conversation.where)
        yield record, None, len(renderer.render(rendered, seq_len).input_ids)


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
