"""Regeneration: every assistant turn replaced by the target's own reply on the regenerated history, written
as it goes, resumable, with a manifest; through the built-in engine and an OpenAI-compatible server."""

from __future__ import annotations

import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from eagle3lib.data.conversations import ChatRenderer, Conversation, read_conversations
from eagle3lib.decoding.speculate import decode_target_only
from eagle3lib.generation import regenerate as regen
from eagle3lib.target.model import Target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SOURCE = [
    Conversation(
        "a",
        (
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"},
            {"role": "assistant", "content": "Red."},
        ),
        "test:1",
    ),
    Conversation(
        "b",
        ({"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "1 2 3"}),
        "test:2",
    ),
    Conversation(
        "c", ({"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}), "test:3"
    ),
]
SETTINGS = regen.RegenerationSettings(max_new_tokens=6, batch_size=2)
SOURCE_FACTS = {"corpus": "test", "path": "memory", "sha256": "0" * 64, "bytes": 0}


@pytest.fixture(scope="module")
def tiny() -> Target:
    return Target.load("zoo:tiny-llama", dtype="float32", device="cpu")


def run(tiny, out, settings=SETTINGS, source=SOURCE, **kwargs) -> dict:
    renderer = ChatRenderer(tiny.tokenizer, tiny.stop_token_ids)
    with regen.make_engine(settings, tiny, renderer, out.parent) as engine:
        return regen.regenerate(
            source, out, engine, renderer, settings, source=SOURCE_FACTS, target=tiny.describe(), **kwargs
        )


def test_every_assistant_turn_is_the_targets_own_reply_on_the_regenerated_history(tiny, tmp_path):
    manifest = run(tiny, tmp_path / "out.jsonl", chunk=2)
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", "b", "c"]
    renderer = ChatRenderer(tiny.tokenizer, tiny.stop_token_ids)
    first = records[0]["conversations"]
    assert [m["role"] for m in first] == ["system", "user", "assistant", "user", "assistant"]
    assert first[0]["content"] == "Be brief." and first[3]["content"] == "Another?"
    for turn in (2, 4):  # greedy replies, each to the history as regenerated before it
        prompt = renderer.prompt_ids(first[:turn])
        tokens = decode_target_only(tiny.model, [prompt], 6, eos_token_id=tiny.tokenizer.eos_token_id)
        reply = tokens.generations[0].tokens
        finished = reply[-1] == tiny.tokenizer.eos_token_id
        assert first[turn]["content"] == tiny.tokenizer.decode(reply[:-1] if finished else reply)
    assert first[2]["content"] != "Blue."
    counts = manifest["counts"]
    assert counts["conversations"] == 3 and counts["replies"] == 4
    assert counts["replies_rendered_unlike_emitted"] == 0  # SmolLM2's template renders a reply as it is
    assert manifest["complete"] and manifest["target"]["fingerprint"] == tiny.fingerprint
    assert manifest["settings"]["max_new_tokens"] == 6 and manifest["source"] == SOURCE_FACTS
    assert json.loads((tmp_path / "out.manifest.json").read_text()) == manifest
    # read back as a conversation file: SpecForge's `conversations` of role/content messages
    assert [c.id for c in read_conversations(tmp_path / "out.jsonl")] == ["a", "b", "c"]


def test_a_reply_cut_at_its_length_limit_trains_no_end_of_turn_it_never_emitted(tiny, tmp_path, monkeypatch):
    replies = iter([regen.Reply("Green and", 6, False), regen.Reply("Red.", 3, True)])
    monkeypatch.setattr(regen.BuiltinEngine, "replies",
                        lambda self, requests: [next(replies) for _ in requests])
    run(tiny, tmp_path / "out.jsonl", source=SOURCE[:1])
    written = next(read_conversations(tmp_path / "out.jsonl"))
    assert written.messages[2] == {"role": "assistant", "content": "Green and", "finished": False}
    assert written.messages[4] == {"role": "assistant", "content": "Red."}
    renderer = ChatRenderer(tiny.tokenizer, tiny.stop_token_ids)
    [sample] = renderer.samples(written, 4096)  # SmolLM2's template: one sample, both turns in the loss
    learnt = tiny.tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m])
    assert learnt == "Green andRed.<|im_end|>"  # the cut turn's <|im_end|> stays in the context only
    assert "Green and<|im_end|>" in tiny.tokenizer.decode(sample.input_ids)
    per_turn = ChatRenderer(tiny.tokenizer, tiny.stop_token_ids, turns="per-turn").samples(written, 4096)
    assert [tiny.tokenizer.decode([t for t, m in zip(s.input_ids, s.loss_mask, strict=True) if m])
            for s in per_turn] == ["Green and", "Red.<|im_end|>"]


def test_a_reply_the_template_renders_unlike_its_emission_is_counted(thinking, tmp_path, monkeypatch):
    """Qwen3's template strips the newlines around a turn's reasoning and before its content: a reply that
    emitted more trains a token unlike itself, and the manifest says how many did."""
    emitted = iter(["<think>\nA colour.\n</think>\n\nGreen.", "<think>\n\nA colour.\n</think>\n\n\nRed."])
    monkeypatch.setattr(regen.BuiltinEngine, "replies",
                        lambda self, requests: [regen.Reply(next(emitted), 9, True) for _ in requests])
    manifest = run(thinking, tmp_path / "out.jsonl", source=SOURCE[:1])
    assert manifest["counts"]["replies"] == 2 and manifest["counts"]["replies_rendered_unlike_emitted"] == 1


def test_an_interrupted_regeneration_continues_and_leaves_written_ones_untouched(tiny, tmp_path, monkeypatch):
    whole = tmp_path / "whole" / "out.jsonl.gz"
    whole.parent.mkdir()
    run(tiny, whole, chunk=1)
    out = tmp_path / "cut" / "out.jsonl.gz"
    out.parent.mkdir()
    calls = {"n": 0}
    original = regen.BuiltinEngine.replies

    def dies_on_the_third_call(self, requests):
        calls["n"] += 1
        if calls["n"] == 3:  # conversation a took two calls (two turns): b's first turn dies
            raise KeyboardInterrupt
        return original(self, requests)

    monkeypatch.setattr(regen.BuiltinEngine, "replies", dies_on_the_third_call)
    with pytest.raises(KeyboardInterrupt):
        run(tiny, out, chunk=1)
    monkeypatch.setattr(regen.BuiltinEngine, "replies", original)
    partial = regen.partial_path(out)
    assert not out.exists() and len(partial.read_text().splitlines()) == 1  # only finished files get the name
    first_line = partial.read_bytes()
    partial.write_bytes(first_line + b'{"id": "b", "conv')  # and a kill mid-write
    run(tiny, out, chunk=1)
    assert gzip.decompress(out.read_bytes()) == gzip.decompress(whole.read_bytes())
    assert gzip.decompress(out.read_bytes()).startswith(first_line)
    assert not partial.exists()


def dies_after(calls: int, monkeypatch):
    """The built-in engine's replies fail (a kill) from its `calls`-th call on."""
    original, made = regen.BuiltinEngine.replies, {"n": 0}

    def replies(self, requests):
        made["n"] += 1
        if made["n"] >= calls:
            raise KeyboardInterrupt
        return original(self, requests)

    monkeypatch.setattr(regen.BuiltinEngine, "replies", replies)


def test_a_partial_file_from_other_settings_is_refused(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out.jsonl"
    dies_after(3, monkeypatch)  # conversation a (two turns) is written and counted; b's first turn dies
    with pytest.raises(KeyboardInterrupt):
        run(tiny, out, chunk=1)
    monkeypatch.undo()
    hotter = regen.RegenerationSettings(max_new_tokens=6, batch_size=2, temperature=0.7)
    with pytest.raises(
        regen.RegenerationError,
        match=r"made with other inputs or settings \(settings: .*"
        r"'temperature': 0.0.* -> .*'temperature': 0.7",
    ):
        run(tiny, out, settings=hotter)


def test_a_run_that_wrote_nothing_leaves_nothing_to_block_the_next(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out.jsonl.gz"
    dies_after(1, monkeypatch)  # the first chunk dies: nothing answered, nothing written
    with pytest.raises(KeyboardInterrupt):
        run(tiny, out)
    assert not regen.partial_path(out).exists() and not regen.manifest_path(out).exists()
    monkeypatch.undo()
    bad = ["not a conversation", *SOURCE]  # a bad source stops the run at its first record
    with pytest.raises(AttributeError):
        run(tiny, out, source=bad, chunk=1)
    assert not regen.partial_path(out).exists() and not regen.manifest_path(out).exists()
    hotter = regen.RegenerationSettings(max_new_tokens=6, batch_size=2, temperature=0.7)
    assert run(tiny, out, settings=hotter, limit=1)["complete"]  # other settings: nothing was committed yet


def test_a_kill_between_a_chunk_and_its_manifest_update_is_regenerated_and_counted_once(tiny, tmp_path,
                                                                                      monkeypatch):
    whole = tmp_path / "whole.jsonl"
    reference = run(tiny, whole, chunk=1)
    out = tmp_path / "out.jsonl"
    writes = {"n": 0}
    original = regen.atomic_write_text

    def killed_at_the_second_commit(path, text):
        writes["n"] += 1
        if writes["n"] == 2:  # the second chunk is in the partial file, its count is not
            raise KeyboardInterrupt
        return original(path, text)

    monkeypatch.setattr(regen, "atomic_write_text", killed_at_the_second_commit)
    with pytest.raises(KeyboardInterrupt):
        run(tiny, out, chunk=1)
    assert len(regen.partial_path(out).read_text().splitlines()) == 2  # written, not counted
    monkeypatch.undo()
    manifest = run(tiny, out, chunk=1)
    lines = out.read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["a", "b", "c"]
    assert manifest["lines"] == 3 and manifest["counts"]["conversations"] == 3
    assert manifest["counts"]["replies"] == reference["counts"]["replies"] == 4
    assert out.read_text() == whole.read_text()


@pytest.mark.parametrize("kill", ["before the rename", "after the rename"])
def test_a_kill_around_the_final_rename_is_finished_by_the_same_command(tiny, tmp_path, monkeypatch, kill):
    out = tmp_path / "out.jsonl.gz"
    original_replace, original_unlink = regen.os.replace, Path.unlink

    def replace(src, dst):
        if kill == "before the rename" and Path(dst) == out:
            raise KeyboardInterrupt
        return original_replace(src, dst)

    def unlink(self, missing_ok=False):
        if kill == "after the rename" and self == regen.partial_path(out):
            raise KeyboardInterrupt
        return original_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(regen.os, "replace", replace)
    monkeypatch.setattr(Path, "unlink", unlink)
    with pytest.raises(KeyboardInterrupt):
        run(tiny, out)
    monkeypatch.undo()
    manifest = run(tiny, out)  # the same command, rerun
    assert manifest["complete"] and out.exists() and not regen.partial_path(out).exists()
    assert manifest["sha256"] == regen.file_sha256(out)
    assert [c.id for c in read_conversations(out)] == ["a", "b", "c"]


def test_two_regenerations_into_one_output_are_refused_while_one_runs(tiny, tmp_path):
    out = tmp_path / "out.jsonl"
    with regen.output_lock(out):
        with pytest.raises(regen.RegenerationError, match="being written by another regeneration"):
            run(tiny, out)
    assert not out.exists() and not regen.partial_path(out).exists()


@pytest.mark.parametrize("setting", [{"limit": -1}, {"limit": 0}, {"chunk": -3}, {"max_seconds": -1}])
def test_settings_that_are_not_sizes_are_refused_before_anything_is_written(tiny, tmp_path, setting):
    out = tmp_path / "out.jsonl"
    with pytest.raises(regen.RegenerationError, match=f"{next(iter(setting))} must be at least"):
        run(tiny, out, **setting)
    assert list(tmp_path.iterdir()) == []  # refused before even the lock


def test_limits_prompt_length_and_turns_are_counted(tiny, tmp_path):
    renderer = ChatRenderer(tiny.tokenizer, tiny.stop_token_ids)
    first_prompts = [len(renderer.prompt_ids(list(c.messages[: 3 if c.id == "a" else 1]))) for c in SOURCE]
    assert first_prompts[0] < min(first_prompts[1:])  # b and c get SmolLM2's longer default system prompt
    settings = regen.RegenerationSettings(
        max_new_tokens=4, batch_size=4, max_turns=1, max_prompt_tokens=first_prompts[0]
    )
    manifest = run(tiny, tmp_path / "out.jsonl", settings=settings)
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [len(r["conversations"]) for r in records] == [3]  # a: system, one answered turn
    counts = manifest["counts"]
    assert counts["skipped"] == {f"first prompt longer than {first_prompts[0]} tokens": 2}
    assert counts["turns_not_answered"] == {
        f"prompt longer than {first_prompts[0]} tokens": 2,
        "beyond max_turns": 1,
    }
    with pytest.raises(regen.RegenerationError, match=r"exists and was made otherwise \(limit: None -> 3\)"):
        run(tiny, tmp_path / "out.jsonl", settings=settings, limit=3)


class ChatServer(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint on loopback that answers with the number of messages it got."""

    seen: list = []

    def do_POST(self):  # noqa: N802 (the http.server API)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ChatServer.seen.append(body)
        answer = {
            "choices": [
                {
                    "message": {"content": f"reply to {len(body['messages'])} messages"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"completion_tokens": 4},
        }
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_a_server_engine_sends_the_regenerated_history(tiny, tmp_path):
    server = HTTPServer(("127.0.0.1", 0), ChatServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = regen.RegenerationSettings(
            engine="server",
            url=f"http://127.0.0.1:{server.server_port}",
            model="served-model",
            max_new_tokens=8,
            temperature=0.5,
        )
        manifest = run(tiny, tmp_path / "out.jsonl", settings=settings, source=SOURCE[:1])
    finally:
        server.shutdown()
    second = next(b for b in ChatServer.seen if len(b["messages"]) == 4)
    assert second["messages"][2] == {"role": "assistant", "content": "reply to 2 messages"}
    assert second["model"] == "served-model" and second["max_tokens"] == 8 and second["temperature"] == 0.5
    assert manifest["counts"]["reply_tokens"] == 8


def test_a_time_budget_finishes_the_file_with_what_was_written(tiny, tmp_path, monkeypatch):
    now, replies = [0.0], regen.BuiltinEngine.replies

    def ten_seconds_a_call(self, requests):
        now[0] += 10
        return replies(self, requests)

    monkeypatch.setattr(regen.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(regen.BuiltinEngine, "replies", ten_seconds_a_call)
    manifest = run(tiny, tmp_path / "out.jsonl", chunk=1, max_seconds=25)
    # a (two turns) ends at 20 s, b starts before 25 s and ends at 30 s, c does not start
    assert manifest["complete"] and manifest["counts"]["conversations"] == 2
    assert [json.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()] == [
        "a",
        "b",
    ]


# ---------------------------------------------------------------- thinking targets


QWEN3 = Path(__file__).parent / "fixtures" / "chat_templates" / "qwen3.jinja"


@pytest.fixture
def thinking(tiny, monkeypatch):
    """The tiny target with Qwen3's real template and its markers, as a thinking target renders."""
    tokenizer = tiny.tokenizer
    saved = tokenizer.chat_template
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tokenizer.chat_template = QWEN3.read_text()
    yield tiny
    tokenizer.chat_template = saved


@pytest.mark.parametrize("mode, reasoning, content", [
    ("save", "\nTwo and two.\n", "\n\n4"), ("drop", None, "\n\n4"),
    ("inline", None, "<think>\nTwo and two.\n</think>\n\n4")])
def test_a_replys_reasoning_is_saved_apart_dropped_or_left_inline(mode, reasoning, content):
    emitted = regen.Reply("<think>\nTwo and two.\n</think>\n\n4", 12, True)
    message = regen.assistant_message(emitted, mode)
    assert message.get("reasoning_content") == reasoning and message["content"] == content
    parsed = regen.Reply("4", 3, True, reasoning="Two and two.")  # a server's reasoning parser split it
    assert regen.assistant_message(parsed, "save") == {"role": "assistant", "content": "4",
                                                       "reasoning_content": "Two and two."}
    assert regen.assistant_message(parsed, "inline")["content"] == "<think>Two and two.</think>4"


def test_a_thinking_conversation_is_regenerated_and_trains_with_its_reasoning_in_the_loss(thinking, tmp_path,
                                                                                        monkeypatch):
    emitted = "<think>\nA colour is asked.\n</think>\n\nGreen."
    monkeypatch.setattr(regen.BuiltinEngine, "replies",
                        lambda self, requests: [regen.Reply(emitted, 9, True) for _ in requests])
    renderer = ChatRenderer(thinking.tokenizer, thinking.stop_token_ids)
    out = tmp_path / "out.jsonl"
    manifest = run(thinking, out, source=SOURCE[:1])
    assert manifest["settings"]["reasoning"] == "save" and manifest["settings"]["chat_template_kwargs"] == {}
    written = next(read_conversations(out))
    assert written.messages[2] == {"role": "assistant", "content": "\n\nGreen.",
                                   "reasoning_content": "\nA colour is asked.\n"}
    samples = renderer.samples(written, 4096)  # Qwen3 strips earlier reasoning from history: one per turn
    assert [s.turn for s in samples] == [2, 4]
    for sample in samples:
        learnt = thinking.tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True)
                                            if m])
        assert learnt == emitted + "<|im_end|>"  # exactly what the model emitted, its end of turn too


def test_an_unrenderable_conversation_is_counted_and_the_chunk_keeps_the_others_across_a_resume(
        tiny, tmp_path, monkeypatch):
    saved = tiny.tokenizer.chat_template
    refusing = "{% for m in messages %}{% if m.content == 'Count to three.' %}{{ raise_exception('no') }}" \
               "{% endif %}{% endfor %}" + saved
    tiny.tokenizer.chat_template = refusing
    try:
        out = tmp_path / "out.jsonl"
        dies_after(3, monkeypatch)  # a is answered (two calls) and committed; the chunk of b and c dies
        with pytest.raises(KeyboardInterrupt):
            run(tiny, out, chunk=1)
        monkeypatch.undo()
        manifest = run(tiny, out, chunk=2)  # resumed: b (refused by the template) and c in one chunk
    finally:
        tiny.tokenizer.chat_template = saved
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "c"]
    assert manifest["counts"]["skipped"] == {"the chat template refuses it": 1}


def test_compiled_builtin_decoding_writes_the_eager_replies_and_a_manifest_from_before_it_still_matches(
        tiny, tmp_path):
    """`compiled` (the builtin engine's steps through one compiled graph): the same float32 replies, recorded
    in the manifest; a finished file whose manifest predates the setting is the same regeneration (it
    decoded eagerly, the setting's default), not one made otherwise; other engines refuse it."""
    eager = run(tiny, tmp_path / "eager.jsonl")
    compiled = regen.RegenerationSettings(max_new_tokens=6, batch_size=2, compiled=True)
    assert run(tiny, tmp_path / "compiled.jsonl", compiled)["settings"]["compiled"] is True
    assert (tmp_path / "compiled.jsonl").read_text() == (tmp_path / "eager.jsonl").read_text()
    manifest_file = regen.manifest_path(tmp_path / "eager.jsonl")
    older = json.loads(manifest_file.read_text())
    del older["settings"]["compiled"]
    manifest_file.write_text(json.dumps(older))
    assert run(tiny, tmp_path / "eager.jsonl")["counts"] == eager["counts"]  # finished: nothing regenerated
    with pytest.raises(regen.RegenerationError, match="compiled decoding is the builtin engine's"):
        regen.RegenerationSettings(engine="vllm", compiled=True).check()
