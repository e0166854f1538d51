"""Training text: documents as they are (raw), or chat prompts answered by the target (self-distilled)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

import torch
from torch import Tensor

from eagle3lib import zoo
from eagle3lib.data import DataError

# What a user's chat prompt asks of the target for each corpus (self-distillation).
INSTRUCTIONS = {
    "stdlib-code": "Explain what this Python code does, then suggest one improvement.",
    "pydoc-prose": "Explain the following passage from the Python documentation in your own words.",
}


@dataclass
class Sample:
    """One training sequence before capture: token ids and which of them the drafter learns."""

    input_ids: Tensor  # [T] int64
    loss_mask: Tensor  # [T] bool
    doc_id: str


def raw_samples(
    tokenizer, corpus: str, seq_len: int, heldout_fraction: float = 0.1, seed: int = 0
) -> Iterator[Sample]:
    """Training documents as plain text, cut into windows of at most `seq_len` tokens; every token is
    in the loss (the drafter learns the target's predictions on human text)."""
    for doc in zoo.split_documents(corpus, "train", heldout_fraction, seed):
        ids = torch.tensor(tokenizer(doc.text)["input_ids"], dtype=torch.long)
        for start in range(0, len(ids), seq_len):
            window = ids[start : start + seq_len]
            if len(window) >= 2:  # a single token predicts nothing
                yield Sample(window, torch.ones(len(window), dtype=torch.bool), f"{doc.id}@{start}")


def chat_prompt_ids(tokenizer, text: str, corpus: str) -> list[int]:
    """A document opening as a user turn in the target's chat template, ready for the reply."""
    if corpus not in INSTRUCTIONS:
        raise DataError(f"no chat instruction for corpus {corpus!r}; known: {', '.join(INSTRUCTIONS)}")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the target's tokenizer has no chat template; use data.text=raw for this target")
    message = f"{INSTRUCTIONS[corpus]}\n\n{text}"
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True
    )
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@torch.no_grad()
def self_distilled_samples(
    target,
    corpus: str,
    seq_len: int,
    max_new_tokens: int,
    prompt_chars: int = 600,
    batch_size: int = 8,
    heldout_fraction: float = 0.1,
    seed: int = 0,
) -> Iterator[Sample]:
    """Chat prompts made from training documents, answered by the target itself (greedy), as SpecForge's
    and speculators' regeneration does; the loss mask covers the response tokens only."""
    tokenizer = target.tokenizer
    eos = target.model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids))
    docs = zoo.split_documents(corpus, "train", heldout_fraction, seed)
    while batch := list(islice(docs, batch_size)):
        prompts = [chat_prompt_ids(tokenizer, zoo.opening(d.text, prompt_chars), corpus) for d in batch]
        too_long = [len(p) for p in prompts if len(p) + 1 > seq_len]
        if too_long:
            raise DataError(
                f"a chat prompt of {max(too_long)} tokens leaves no room for a reply in data.seq_len "
                f"{seq_len}; lower data.prompt_chars ({prompt_chars}) or raise data.seq_len"
            )
        width = max(len(p) for p in prompts)  # left padding, so that every reply starts at column `width`
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        generated = target.model.generate(
            input_ids=input_ids.to(target.device),
            attention_mask=attention_mask.to(target.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )[:, width:].cpu()
        for doc, prompt, reply in zip(batch, prompts, generated.tolist(), strict=True):
            ends = [i for i, token in enumerate(reply) if token in eos_ids]
            reply = reply[: ends[0] + 1] if ends else reply  # keep the end-of-turn token: drafters learn it
            ids = (prompt + reply)[:seq_len]
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[len(prompt) :] = True
            yield Sample(torch.tensor(ids), mask, doc.id)
