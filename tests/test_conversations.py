"""Conversation datasets: records read with named errors and counted skips, and loss masks that cover exactly
the assistant turns, checked by decoding, for SmolLM2's real chat template and a Llama-3-style one."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest
from transformers import AutoTokenizer

from eagle3lib.data import corpora, sources
from eagle3lib.data.conversations import (
    ChatRenderer,
    Conversation,
    ConversationError,
    ReadStats,
    read_conversations,
)
from eagle3lib.data.layout import DataError
from eagle3lib.params import load_params
from eagle3lib.target import zoo

CHAT = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "What is a drafter?"},
    {"role": "assistant", "content": "A small model that proposes tokens for a larger one to verify."},
    {"role": "user", "content": "And τ?"},
    {"role": "assistant", "content": "Tokens per verification, the bonus token included."},
]

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + "
    "'<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's real tokenizer and chat template (zoo:tiny-llama carries them)."""
    return AutoTokenizer.from_pretrained(zoo.resolve("zoo:tiny-llama"))


@pytest.fixture(scope="module")
def llama3_tokenizer(smollm2_tokenizer, tmp_path_factory):
    """A Llama-3-style template (header tokens, <|eot_id|> ending each turn, content trimmed) on a tokenizer
    built here: SmolLM2's vocabulary with Llama 3's special tokens added."""
    folder = tmp_path_factory.mktemp("llama3-style")
    smollm2_tokenizer.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"],
        }
    )
    tokenizer.chat_template = LLAMA3_TEMPLATE
    return tokenizer


def loss_spans(tokenizer, ids: list[int], mask: list[bool]) -> list[str]:
    """The text of each run of masked tokens."""
    spans, current = [], []
    for token, in_loss in zip(ids, mask, strict=True):
        if in_loss:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    if current:
        spans.append(tokenizer.decode(current))
    return spans


def conversation(messages=CHAT, id_="c1") -> Conversation:
    return Conversation(id_, tuple(messages), "test")


@pytest.mark.parametrize("messages", [CHAT, CHAT[1:]], ids=["system prompt", "template's default system"])
def test_smollm2_mask_is_exactly_the_assistant_turns(smollm2_tokenizer, messages):
    renderer = ChatRenderer(smollm2_tokenizer, [smollm2_tokenizer.eos_token_id])
    rendered = renderer.samples(conversation(messages), seq_len=4096)[0]
    assistant = [m["content"] for m in messages if m["role"] == "assistant"]
    assert loss_spans(smollm2_tokenizer, rendered.input_ids, rendered.loss_mask) == [
        f"{content}<|im_end|>" for content in assistant
    ]
    # the whole sequence is the template's own text, token for token where no span boundary falls
    text = smollm2_tokenizer.apply_chat_template(list(messages), tokenize=False)
    assert smollm2_tokenizer.decode(rendered.input_ids) == text
    assert "You are a helpful AI assistant" in text or messages[0]["role"] == "system"
    last = ChatRenderer(smollm2_tokenizer, [smollm2_tokenizer.eos_token_id], loss_turns="last")
    only_last = last.samples(conversation(messages), seq_len=4096)[0]
    assert only_last.input_ids == rendered.input_ids
    spans = loss_spans(smollm2_tokenizer, only_last.input_ids, only_last.loss_mask)
    assert spans == [f"{assistant[-1]}<|im_end|>"]


def test_llama3_style_mask_keeps_headers_out(llama3_tokenizer):
    eot = llama3_tokenizer.convert_tokens_to_ids("<|eot_id|>")
    renderer = ChatRenderer(llama3_tokenizer, [eot])
    # the template trims contents: the span is the trimmed content
    padded = [dict(m, content=f"  {m['content']}\n") if m["role"] == "assistant" else m for m in CHAT]
    rendered = renderer.samples(conversation(padded), seq_len=4096)[0]
    spans = loss_spans(llama3_tokenizer, rendered.input_ids, rendered.loss_mask)
    assert spans == [f"{m['content']}<|eot_id|>" for m in CHAT if m["role"] == "assistant"]
    masked = [t for t, m in zip(rendered.input_ids, rendered.loss_mask, strict=True) if m]
    header = llama3_tokenizer.convert_tokens_to_ids(["<|start_header_id|>", "<|end_header_id|>"])
    assert not set(header) & set(masked)
    text = llama3_tokenizer.decode(rendered.input_ids)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")


def test_long_conversations_are_cut_and_counted(smollm2_tokenizer):
    renderer = ChatRenderer(smollm2_tokenizer, [smollm2_tokenizer.eos_token_id])
    whole = renderer.samples(conversation(), seq_len=4096)[0]
    cut = Counter()
    samples = list(sources.conversation_samples(renderer, iter([conversation()]), 50, cut))
    assert samples[0].input_ids.tolist() == whole.input_ids[:50]
    assert cut["samples cut at seq_len"] == 1 and cut["tokens cut"] == len(whole.input_ids) - 50
    assert cut["loss tokens cut"] == sum(whole.loss_mask[50:])
    none_left = Counter()
    assert list(sources.conversation_samples(renderer, iter([conversation()]), 20, none_left)) == []
    assert none_left["skipped: no loss token within seq_len"] == 1


def write(path, records, form="jsonl"):
    if form == "jsonl":
        text = "\n".join(json.dumps(r) for r in records) + "\n"
    else:
        text = json.dumps(records, indent=1)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


SHAREGPT = {
    "id": "abc_0",
    "conversations": [
        {"from": "gpt", "value": "(a reply left over from an earlier part)"},
        {"from": "human", "value": "Hello"},
        {"from": "gpt", "value": "Hi!"},
        {"from": "human", "value": "Bye"},
        {"from": "bard", "value": "Goodbye."},
    ],
}
OPENAI = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
}


def test_both_forms_are_read_per_record_from_json_jsonl_gz_and_folders(tmp_path):
    skipped = [
        {"id": "x", "conversations": [{"from": "human", "value": "only a question"}]},
        {"id": "y", "messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "?"}]},
        {
            "id": "z",
            "conversations": [
                {"from": "human", "value": "a"},
                {"from": "human", "value": "b"},
                {"from": "gpt", "value": "c"},
            ],
        },
    ]
    folder = tmp_path / "data"
    folder.mkdir()
    write(folder / "a.json", [SHAREGPT, OPENAI], form="json")
    write(folder / "b.jsonl.gz", [OPENAI, *skipped])
    stats = ReadStats()
    found = list(read_conversations(folder, stats))
    assert [c.id for c in found][0] == "abc_0" and len(found) == 3
    assert found[0].messages == (
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye."},
    )
    assert found[1].messages[0] == {"role": "system", "content": "Be brief."}
    assert found[1].id == found[2].id  # no id: a hash of the content, the same on every machine
    assert found[2].where == f"{folder / 'b.jsonl.gz'}:1"
    assert stats.read == 6 and stats.kept == 3
    assert stats.skipped == {"no assistant turn": 2, "empty content": 1}
    assert stats.dropped_turns == {
        "assistant turn before the first user turn": 1,
        "cut at a turn out of order (user after user)": 2,
    }


@pytest.mark.parametrize(
    "records, text, message",
    [
        (None, '{"messages": []}\nnot json\n', r"b.jsonl:2: not JSON \(Expecting value at column 1\)"),
        (
            [{"id": 1, "conversations": [{"from": "narrator", "value": "x"}]}],
            None,
            r"b.jsonl:1: conversations\[0\].from: unknown role 'narrator'",
        ),
        (
            [OPENAI, {"messages": [{"role": "user", "content": ["a", "list"]}]}],
            None,
            r"b.jsonl:2: messages\[0\].content\[0\]: a content part must be an object with a .type.",
        ),
        (
            [{"conversation": []}],
            None,
            r"b.jsonl:1: no 'conversations' \(ShareGPT\) or 'messages' \(OpenAI\) key",
        ),
        ([{"messages": [{"speaker": "user"}]}], None, r"messages\[0\]: expected the keys from/value"),
    ],
)
def test_malformed_records_are_refused_with_their_position_and_key(tmp_path, records, text, message):
    path = tmp_path / "b.jsonl"
    path.write_text(text) if text else write(path, records)
    with pytest.raises(ConversationError, match=message):
        list(read_conversations(path))


def test_a_truncated_file_is_refused_never_cut(tmp_path):
    text = json.dumps([SHAREGPT, OPENAI, OPENAI])
    path = tmp_path / "cut.json"
    path.write_text(text[:-40])
    cut_at = text.index('{"messages"', text.index('{"messages"') + 1)
    with pytest.raises(
        ConversationError, match=rf"cut.json: the file stops inside record 3 \(byte {cut_at} "
    ):
        list(read_conversations(path))
    stats = ReadStats()
    assert len(list(read_conversations(path, stats, allow_truncated=True))) == 2  # only for the known wheel
    assert "its 2 complete records before that byte are read" in stats.notes[0]
    (tmp_path / "garbled.json").write_text('[{"messages": [}]')
    with pytest.raises(ConversationError, match=r"garbled.json: record 1 at byte 1: not JSON"):
        list(read_conversations(tmp_path / "garbled.json"))


def test_heldout_split_keeps_the_parts_of_one_chat_together(tmp_path):
    parts = [
        {"id": f"chat{n}_{part}", "messages": OPENAI["messages"]} for n in range(40) for part in range(3)
    ]
    path = write(tmp_path / "parts.jsonl", parts)
    heldout = list(corpora.split_conversations(str(path), "heldout", 0.3))
    train = list(corpora.split_conversations(str(path), "train", 0.3))
    assert len(heldout) + len(train) == 120 and heldout and train
    assert not {c.split_key for c in heldout} & {c.split_key for c in train}
    assert all(len([c for c in heldout if c.split_key == key]) == 3 for key in {c.split_key for c in heldout})


def test_sharegpt_wheel_reads_its_complete_conversations():
    stats = ReadStats()
    found = sum(1 for _ in read_conversations(corpora.dataset_path("sharegpt"), stats, allow_truncated=True))
    assert stats.read == 17_671 and found == stats.kept
    assert "stops inside record 17672" in stats.notes[0] and "17,671 complete records" in stats.notes[0]
    with pytest.raises(ConversationError, match="truncated"):  # the same file from a user: refused
        list(read_conversations(corpora.dataset_path("sharegpt")))


def test_text_kind_must_fit_the_corpus():
    sources.check_text_kind("sharegpt", "regenerate")
    with pytest.raises(
        DataError,
        match="data.text 'raw' reads documents, but data.corpus 'sharegpt' holds "
        "conversations: use conversation or regenerate",
    ):
        sources.check_text_kind("sharegpt", "raw")
    with pytest.raises(DataError, match="holds evaluation prompts"):
        sources.check_text_kind("humaneval", "conversation")
    assert len(corpora.humaneval_prompts()) == 164


def conversation_file(tmp_path, n=24):
    records = [
        {
            "id": f"q{i}",
            "conversations": [
                {"from": "human", "value": f"Question {i}: what is {i} + {i}?"},
                {"from": "gpt", "value": f"It is {2 * i}."},
                {"from": "human", "value": "Sure?"},
                {"from": "gpt", "value": "Yes."},
            ],
        }
        for i in range(n)
    ]
    return write(tmp_path / "chats.jsonl", records)


@pytest.mark.parametrize("text", ["conversation", "regenerate"])
def test_prepare_reads_conversations_and_reports_what_it_read(tmp_path, text):
    from eagle3lib.data.readers import open_reader
    from eagle3lib.generation.capture import REGENERATED_DIR, prepare_for_run
    from eagle3lib.target.model import Target

    path = conversation_file(tmp_path)
    params = load_params(
        None,
        {
            "run": {"device": "cpu"},
            "target": {"spec": "zoo:tiny-llama", "dtype": "float32"},
            "data": {
                "corpus": str(path),
                "text": text,
                "num_tokens": 400,
                "seq_len": 64,
                "batch_size": 4,
                "dtype": "float32",
                "heldout_fraction": 0.2,
                "draft_vocab_size": 64,
                "max_new_tokens": 5,
                "regenerate": {"batch_size": 8},
            },
        },
    )
    target = Target.load("zoo:tiny-llama", dtype="float32", device="cpu")
    found = prepare_for_run(target, params, "main", tmp_path / "run")
    assert found["conversations"]["read"] >= 1 and found["conversations"]["skipped"] == {}
    reader = open_reader(tmp_path / "run" / "00_prepare_data", target)
    train_ids = {c.id for c in corpora.split_conversations(str(path), "train", 0.2)}
    renderer = ChatRenderer(target.tokenizer, target.stop_token_ids)
    samples = list(reader.samples())
    if text == "conversation":
        assert found["loss_tokens"] == sum(int(s["loss_mask"].sum()) for s in samples)
        by_text = {tuple(renderer.samples(c, 64)[0].input_ids): c.id for c in read_conversations(path)}
        assert {by_text[tuple(s["input_ids"].tolist())] for s in samples} <= train_ids  # held-out never used
    else:
        regenerated = tmp_path / "run" / REGENERATED_DIR / "main" / "regenerated.jsonl"
        assert found["regenerated"] == str(regenerated)
        written = list(read_conversations(regenerated))
        assert {c.id for c in written} <= train_ids
        originals = {c.id: c for c in read_conversations(path)}
        assert all(c.messages[0] == originals[c.id].messages[0] for c in written)  # the user's turn, kept
        assert all(c.messages[1]["content"] != originals[c.id].messages[1]["content"] for c in written)
        manifest = json.loads(regenerated.with_name("regenerated.manifest.json").read_text())
        assert manifest["complete"] and manifest["source"]["file"] == path.name  # no machine's folder


def test_eagle3_dataset_shows_what_the_drafter_learns(tmp_path, capsys):
    from eagle3lib import cli

    path = conversation_file(tmp_path, n=12)
    args = ["dataset", str(path), "--target", "zoo:tiny-llama", "--seq-len", "64", "--split", "all"]
    assert cli.main([*args, "--json", "--limit", "2"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (
        shown["read"] == 2 and shown["skipped"] == {} and [s["id"] for s in shown["samples"]] == ["q0", "q1"]
    )
    tokenizer = AutoTokenizer.from_pretrained(zoo.resolve("zoo:tiny-llama"))
    first = shown["samples"][0]
    assert len(first["input_ids"]) == 64
    assert (
        loss_spans(tokenizer, first["input_ids"], [bool(m) for m in first["loss_mask"]])[0]
        == "It is 0.<|im_end|>"
    )
    assert cli.main([*args, "--show", "1"]) == 0
    text = capsys.readouterr().out
    assert (
        "conversations read: 2; kept 2" in text and "cut: none" in text and "samples: 2; tokens 128" in text
    )
    assert "«It is 2.<|im_end|>»" in text and "<|im_start|>user\nQuestion 1" in text
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": 3}]}\n')
    assert cli.main(["dataset", str(tmp_path / "bad.jsonl"), "--target", "zoo:tiny-llama"]) == 2
    assert "bad.jsonl:1: messages[0].content: expected a string, got int" in capsys.readouterr().err


def test_eagle3_regenerate_writes_then_reuses_a_complete_file(tmp_path, capsys):
    from eagle3lib import cli

    path = conversation_file(tmp_path, n=6)
    out = tmp_path / "regen" / "chats.jsonl.gz"
    args = [
        "regenerate",
        str(path),
        "-o",
        str(out),
        "--target",
        "zoo:tiny-llama",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "4",
        "--max-turns",
        "1",
        "--split",
        "all",
    ]
    assert cli.main(args) == 0
    assert "6 conversations, 6 replies" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "regen" / "chats.manifest.json").read_text())
    assert manifest["command"].startswith("eagle3 regenerate ") and manifest["source"]["split"] == "all"
    assert [len(c.messages) for c in read_conversations(out)] == [2] * 6
    assert cli.main(args) == 0  # complete with the same settings: nothing to do
    assert cli.main([*args[:-2], "--split", "train"]) == 2
    assert "exists and was made otherwise" in capsys.readouterr().err


def test_a_text_corpus_is_regenerated_as_chat_prompts(tmp_path, capsys):
    from eagle3lib import cli

    out = tmp_path / "functions.jsonl"
    args = [
        "regenerate",
        "stdlib-functions",
        "-o",
        str(out),
        "--target",
        "zoo:tiny-llama",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "3",
        "--limit",
        "2",
    ]
    assert cli.main(args) == 0
    written = list(read_conversations(out))
    first = next(corpora.split_documents("stdlib-functions", "train"))
    assert written[0].id == first.id and len(written) == 2
    user, assistant = written[0].messages
    assert user["content"] == f"{corpora.HUMANEVAL_INSTRUCTION}\n\n{first.text}"
    assert (
        first.text.startswith("```python\ndef ") and '"""' in first.text and assistant["role"] == "assistant"
    )
    manifest = json.loads((tmp_path / "functions.manifest.json").read_text())
    assert manifest["source"]["corpus"] == "stdlib-functions" and manifest["source"]["split"] == "train"


def test_online_training_reads_conversations_as_00_does(tmp_path):
    from eagle3lib import runs
    from eagle3lib.files import read_safetensors
    from eagle3lib.generation import online
    from eagle3lib.target.model import Target

    path = conversation_file(tmp_path)
    params = runs.load_params(
        None,
        {
            "run": {"device": "cpu"},
            "target": {"spec": "zoo:tiny-llama", "dtype": "float32"},
            "data": {
                "corpus": str(path),
                "text": "conversation",
                "loss_turns": "last",
                "num_tokens": 300,
                "seq_len": 64,
                "batch_size": 4,
                "heldout_fraction": 0.2,
                "draft_vocab_size": 64,
            },
            "train": {"data_mode": "online"},
        },
    )
    target = Target.load("zoo:tiny-llama", dtype="float32", device="cpu")
    manifest = online.ensure_text(params, tmp_path / "04_finetune", target)
    assert (
        manifest["provenance"]["conversations"]["skipped"] == {}
        and manifest["provenance"]["loss_turns"] == "last"
    )
    text = read_safetensors(tmp_path / "04_finetune" / online.FOLDER / online.TEXT_FILE)
    renderer = ChatRenderer(target.tokenizer, target.stop_token_ids, loss_turns="last")
    train_ids = {c.id for c in corpora.split_conversations(str(path), "train", 0.2)}
    rendered = {c.id: renderer.samples(c, 64)[0] for c in read_conversations(path) if c.id in train_ids}
    for ids, mask in zip(
        text["input_ids"].split(text["sample_lengths"].tolist()),
        text["loss_mask"].split(text["sample_lengths"].tolist()),
        strict=True,
    ):
        match = [r for r in rendered.values() if r.input_ids == ids.tolist()]
        assert match and match[0].loss_mask == mask.tolist()  # the same samples 00 would capture
        assert loss_spans(target.tokenizer, ids.tolist(), mask.tolist()) == [
            "Yes.<|im_end|>"
        ]  # the last turn only


def test_a_line_separator_inside_a_string_is_not_a_new_record(tmp_path):
    # json.dumps(ensure_ascii=False), as regenerated files are written, leaves U+2028 raw in a string
    record = {
        "messages": [{"role": "user", "content": "a\u2028b"}, {"role": "assistant", "content": "c\x85d"}]
    }
    path = tmp_path / "raw.jsonl"
    path.write_text(json.dumps(record, ensure_ascii=False) + "\n")
    (found,) = read_conversations(path)
    assert found.messages[0]["content"] == "a\u2028b" and found.messages[1]["content"] == "c\x85d"
