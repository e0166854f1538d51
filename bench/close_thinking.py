"""A vLLM logits processor that makes a model which never learnt to think close its reasoning on cue.

Loaded into `vllm serve` by bench/vllm_server_check.py (`--logits-processors close_thinking:CloseThinking`,
bench/ on PYTHONPATH; it runs in the vLLM venv). Every reply emits the closing tokens EAGLE3_THINK_CLOSING
(comma-separated ids, the template's "\\n</think>\\n\\n") from its token number EAGLE3_THINK_AFTER on (counted
from 0); before them it cannot end its turn, and outside them it never emits `</think>` (the closing's second
id) or `<think>` (EAGLE3_THINK_START_ID: the template pre-fills it). As a thinking model's never do, its
reasoning and its content do not open with a newline (EAGLE3_LEADING_NEWLINE_IDS: the tokens that start with
one) and its reasoning does not end with one (EAGLE3_TRAILING_NEWLINE_IDS) before the closing: the template
strips those when it renders the turn. Every other token is the model's own greedy choice.
EAGLE3_TURN_END_IDS (comma-separated) are the ids that end a turn.
"""

from __future__ import annotations

import os

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates


def _ids(name: str) -> list[int]:
    return [int(i) for i in os.environ[name].split(",")]


class CloseThinking(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.after = int(os.environ["EAGLE3_THINK_AFTER"])
        self.closing = _ids("EAGLE3_THINK_CLOSING")
        self.markers = [self.closing[1], int(os.environ["EAGLE3_THINK_START_ID"])]
        self.turn_ends = _ids("EAGLE3_TURN_END_IDS")
        self.leading = _ids("EAGLE3_LEADING_NEWLINE_IDS")
        self.trailing = _ids("EAGLE3_TRAILING_NEWLINE_IDS")
        self.outputs: dict[int, list[int]] = {}  # batch row -> that request's output ids (vLLM's live list)

    def is_argmax_invariant(self) -> bool:
        return False  # it decides greedy tokens

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.outputs, batch_update, lambda params, prompt, output: output)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, output in self.outputs.items():
            at = len(output) - self.after
            if 0 <= at < len(self.closing):
                logits[row] = float("-inf")
                logits[row, self.closing[at]] = 0.0
                continue
            logits[row, self.markers] = float("-inf")
            if at in (-self.after, len(self.closing)):  # the first token of the reasoning, of the content
                logits[row, self.leading] = float("-inf")
            if at == -1:  # the last of the reasoning
                logits[row, self.trailing] = float("-inf")
            if at <= len(self.closing):  # at least one token of content after the closing
                logits[row, self.turn_ends] = float("-inf")
        return logits
