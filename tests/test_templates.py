"""Real chat templates (tests/fixtures/chat_templates/, where each came from is in its README) on a small
tokenizer given each family's special tokens: every record shape is read and masked as the target generates
it after its generation prompt, or skipped with its cause; none is silently wrong."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle3lib.data import sources
from eagle3lib.data.conversations import ChatRenderer, ReadStats, RenderError, parse_record
from eagle3lib.target import zoo

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
DS = {"bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>"}
DS_CALLS = ("<｜tool▁calls▁begin｜> <｜tool▁call▁begin｜> <｜tool▁sep｜> <｜tool▁call▁end｜> "
            "<｜tool▁calls▁end｜>").split()
KIMI = "<|im_system|> <|im_user|> <|im_assistant|> <|im_middle|>".split()
KIMI_CALLS = ("<|tool_calls_section_begin|> <|tool_call_begin|> <|tool_call_argument_begin|> "
              "<|tool_call_end|> <|tool_calls_section_end|>").split()
QWEN = "<|im_start|> <think> </think> <tool_call> </tool_call>".split()
FAMILIES = {  # special tokens, the end of turn the model stops at, the thinking switch where there is one
    "llama-3.1": dict(bos="<|begin_of_text|>", eos="<|eot_id|>", stops=["<|eot_id|>", "<|eom_id|>"],
                      tokens=["<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>"]),
    "qwen3": dict(eos="<|im_end|>", stops=["<|im_end|>"], tokens=QWEN),
    "qwen3-thinking-2507": dict(eos="<|im_end|>", stops=["<|im_end|>"], tokens=QWEN),
    "deepseek-v3.1": dict(**DS, stops=[DS["eos"]], thinking={"thinking": True},
                          tokens=["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", *DS_CALLS,
                                  "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]),
    "deepseek-r1": dict(**DS, stops=[DS["eos"]],
                        tokens=["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", *DS_CALLS,
                                "<｜tool▁outputs▁begin｜>", "<｜tool▁output▁begin｜>",
                                "<｜tool▁output▁end｜>", "<｜tool▁outputs▁end｜>"]),
    "kimi-k2-thinking": dict(eos="<|im_end|>", stops=["<|im_end|>"], tokens=[*KIMI, "<think>", "</think>",
                                                                             *KIMI_CALLS]),
    "kimi-k2-instruct": dict(eos="<|im_end|>", stops=["<|im_end|>"], tokens=[*KIMI, *KIMI_CALLS]),
}
CALL = {"id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
SHAPES = {
    "plain, two turns": {"messages": [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Red."}]},
    "the same reply twice": {"messages": [
        {"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "Again."}, {"role": "assistant", "content": "Yes."}]},
    "reasoning on every turn": {"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "reasoning_content": "Two and two.", "content": "4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "reasoning": "Three and three.", "content": "6"}]},
    "a tool call and its result": {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": CALL["id"], "name": "get_weather", "content": "Sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny."}]},
    "content parts": {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]}]},
    "ShareGPT system, function call and observation": {
        "system": "Be brief.", "tools": json.dumps(TOOLS), "conversations": [
            {"from": "human", "value": "Weather in Paris?"},
            {"from": "function_call", "value": json.dumps({"name": "get_weather",
                                                           "arguments": '{"city": "Paris"}'})},
            {"from": "observation", "value": "Sunny"},
            {"from": "gpt", "value": "Sunny."}]},
    "developer role and a turn out of the loss": {"messages": [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Bonjour.", "weight": 0},
        {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "De rien."}]},
    "a system message mid-conversation": {"messages": [
        {"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."},
        {"role": "system", "content": "Now answer in capitals."},
        {"role": "user", "content": "Bye."}, {"role": "assistant", "content": "BYE."}]},
}
# What each family's template cannot render as it would be generated: skipped, with the cause (asserted).
CANNOT = {
    ("llama-3.1", "reasoning on every turn"): "does not render a turn's reasoning",
    ("kimi-k2-instruct", "reasoning on every turn"): "does not render a turn's reasoning",
    # this template closes a tool-calling turn only after a second call: the model's end of turn is unknown
    ("deepseek-r1", "a tool call and its result"): "does not end an assistant turn",
    ("deepseek-r1", "ShareGPT system, function call and observation"): "does not end an assistant turn",
}


@pytest.fixture(scope="module")
def tokenizers():
    folder = zoo.resolve("zoo:tiny-llama")
    made = {}
    for family, spec in FAMILIES.items():
        tokenizer = AutoTokenizer.from_pretrained(folder)
        special = {"additional_special_tokens": [*spec["tokens"], *spec["stops"]], "eos_token": spec["eos"]}
        if "bos" in spec:
            special["bos_token"] = spec["bos"]
        tokenizer.add_special_tokens(special)
        tokenizer.chat_template = (TEMPLATES / f"{family}.jinja").read_bytes().decode()
        made[family] = tokenizer
    return made


def renderer(tokenizers, family: str, thinking: bool = False, turns: str = "auto") -> ChatRenderer:
    tokenizer = tokenizers[family]
    stops = [tokenizer.convert_tokens_to_ids(t) for t in FAMILIES[family]["stops"]]
    kwargs = FAMILIES[family].get("thinking", {}) if thinking else {}
    return ChatRenderer(tokenizer, stops, template_kwargs=kwargs, turns=turns)


def read(record: dict):
    conversation, skipped = parse_record(record, "test:1", Counter())
    assert skipped is None, skipped
    return conversation


def template(tokenizer, conversation, messages, prompt: bool, kwargs) -> str:
    """apply_chat_template of the messages, tool-call arguments given as vLLM gives them (an object), or as
    text to a template that joins them as text (DeepSeek's), an empty content to one that cannot take null."""
    shown = [{k: v for k, v in m.items() if k != "train"} for m in messages]
    forms = ((json.loads, None), (lambda a: a, None), (json.loads, ""), (lambda a: a, ""))
    for arguments, null in forms:
        def call(c, arguments=arguments):
            return {**c, "function": {**c["function"], "arguments": arguments(c["function"]["arguments"])}}

        given = [{**m, "content": null if m["content"] is None else m["content"],
                  "tool_calls": [call(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
                 for m in shown]
        try:
            return tokenizer.apply_chat_template(given, tools=list(conversation.tools) or None,
                                                 tokenize=False, add_generation_prompt=prompt, **kwargs)
        except Exception:
            continue
    raise AssertionError("no form of these messages renders")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_shape_is_masked_as_generated_or_skipped_with_its_cause(tokenizers, family, shape):
    thinking = "reasoning" in shape
    chat = renderer(tokenizers, family, thinking)
    tokenizer, conversation = tokenizers[family], read(SHAPES[shape])
    if (family, shape) in CANNOT:
        with pytest.raises(RenderError, match=CANNOT[(family, shape)]):
            chat.samples(conversation, 4096)
        return
    samples = chat.samples(conversation, 4096)
    messages = list(conversation.messages)
    trained = chat.trained_turns(messages)
    kwargs = chat.kwargs
    for sample in samples:
        text = tokenizer.decode(sample.input_ids)
        learnt = [tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m])]
        if sample.turn is None:  # one sample: the conversation exactly as the template renders it
            assert text == template(tokenizer, conversation, messages, False, kwargs)
            spans = [chat.completion(messages, k, conversation.tools)[1] for k in trained]
            assert learnt == ["".join(spans)]
        else:  # one turn: its prompt as served, then what the model emits
            prompt, emitted = chat.completion(messages, sample.turn, conversation.tools)
            assert prompt == template(tokenizer, conversation, messages[: sample.turn], True, kwargs)
            assert text == prompt + emitted and learnt == [emitted]
    for k in trained:  # every trained turn ends with the end of turn the model stops at, its content inside
        emitted = chat.completion(messages, k, conversation.tools)[1]
        assert emitted.endswith(tuple(FAMILIES[family]["stops"])), emitted
        content = messages[k]["content"] or ""
        assert content.strip() in emitted, (content, emitted)
        if messages[k].get("tool_calls"):  # the call, as the template writes it, is what the model emits
            assert "get_weather" in emitted and "Paris" in emitted, emitted
    assert not [k for k, m in enumerate(messages) if m.get("train") is False and k in trained]
    if shape == "the same reply twice":  # two spans, one per turn: never the later copy twice
        assert len(trained) == 2 and sum(sample.loss_mask.count(True) for sample in samples) > 0


@pytest.mark.parametrize("family, emitted", [  # the second turn, as each model emits it after its prompt
    ("qwen3", "<think>\nThree and three.\n</think>\n\n6<|im_end|>"),
    ("qwen3-thinking-2507", "Three and three.\n</think>\n\n6<|im_end|>"),  # its prompt pre-fills "<think>\n"
    ("deepseek-r1", "Three and three.</think>6<｜end▁of▁sentence｜>"),  # pre-fill "<think>\n"; history cut
    ("deepseek-v3.1", "Three and three.</think>6<｜end▁of▁sentence｜>"),  # thinking: pre-fill "<think>"
    ("kimi-k2-thinking", "<think>Three and three.</think>6<|im_end|>"),  # history: an empty <think></think>
])
def test_reasoning_is_trained_as_emitted_and_history_as_served(tokenizers, family, emitted):
    chat = renderer(tokenizers, family, thinking=True)
    conversation = read(SHAPES["reasoning on every turn"])
    samples = chat.samples(conversation, 4096)
    assert [s.turn for s in samples] == [1, 3]  # each rewrites the first turn in the second's history
    tokenizer = tokenizers[family]
    last = samples[-1]
    learnt = tokenizer.decode([t for t, m in zip(last.input_ids, last.loss_mask, strict=True) if m])
    assert learnt == emitted
    history = tokenizer.decode(last.input_ids[: last.loss_mask.index(True)])
    assert "Three and three." not in history


def test_a_non_text_part_is_skipped_by_name_and_one_bad_record_never_stops_a_file(tokenizers, tmp_path):
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                          {"role": "assistant", "content": "A cat."}]}
    two_calls = {"messages": [{"role": "user", "content": "Weather?"},
                              {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]},
                              {"role": "tool", "content": "Sunny"},
                              {"role": "assistant", "content": "Sunny."}]}
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (image, two_calls, SHAPES["plain, two turns"])) + "\n")
    stats, cut = ReadStats(), Counter()
    chat = renderer(tokenizers, "llama-3.1")  # Llama 3.1's template refuses two tool calls in one turn
    from eagle3lib.data.conversations import read_conversations

    samples = list(sources.conversation_samples(chat, read_conversations(path, stats), 4096, cut, stats))
    assert len(samples) == 1
    assert stats.skipped["content part of type 'image_url' (this target reads text only)"] == 1
    assert stats.skipped["the chat template refuses it"] == 1
    assert stats.first_skipped["the chat template refuses it"].startswith(f"{path}:2")


def test_per_turn_samples_on_request_and_a_long_message_is_counted_not_tokenized_whole(tokenizers):
    chat = renderer(tokenizers, "qwen3", turns="per-turn")
    assert [s.turn for s in chat.samples(read(SHAPES["plain, two turns"]), 4096)] == [1, 3]
    huge = {"messages": [{"role": "user", "content": "word " * 400_000},
                         {"role": "assistant", "content": "Ok."}]}
    sample = renderer(tokenizers, "qwen3").samples(read(huge), 64)[0]
    assert len(sample.input_ids) == 64 and sample.cut_tokens > 350_000 and sample.cut_loss_tokens > 0
