"""Training text, as samples of token ids with a loss mask, from one of four kinds of `data.text`:
- `raw`: documents of a text corpus as they are, every token in the loss;
- `self-distill`: chat prompts made from documents, answered by the target (the reply in the loss);
- `conversation`: a conversation dataset (`sharegpt`, or a file or folder) rendered by the target's chat
  template, its own assistant turns in the loss (`eagle3lib.data.conversations`);
- `regenerate`: the same, with every assistant turn first replaced by the target's own reply
  (`eagle3lib.generation.regenerate`, written beside the data so that an interrupted run continues it).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

import torch
from torch import Tensor

from eagle3lib.data.conversations import (
    ChatRenderer,
    Conversation,
    ReadStats,
    RenderError,
    conversation_files,
    manifest_path,
    read_conversations,
)
from eagle3lib.data.corpora import (
    conversation_source,
    corpus_kind,
    is_heldout,
    split_conversations,
    split_documents,
)
from eagle3lib.data.layout import DataError
from eagle3lib.progress import progress

TEXT_KINDS = {"raw": "documents", "self-distill": "documents", "conversation": "conversations",
              "regenerate": "conversations"}


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
    for doc in split_documents(corpus, "train", heldout_fraction, seed):
        ids = torch.tensor(tokenizer(doc.text)["input_ids"], dtype=torch.long)
        for start in range(0, len(ids), seq_len):
            window = ids[start : start + seq_len]
            if len(window) >= 2:  # a single token predicts nothing
                yield Sample(window, torch.ones(len(window), dtype=torch.bool), f"{doc.id}@{start}")


def chat_prompt_ids(tokenizer, messages: tuple[dict, ...] | list[dict]) -> list[int]:
    """Messages in the target's chat template, ready for the reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the target's tokenizer has no chat template; use data.text=raw for this target")
    encoded = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
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
    asked = split_conversations(corpus, "train", heldout_fraction, prompt_chars=prompt_chars, seed=seed)
    while batch := list(islice(asked, batch_size)):
        prompts = [chat_prompt_ids(tokenizer, c.messages) for c in batch]
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
        for asking, prompt, reply in zip(batch, prompts, generated.tolist(), strict=True):
            ends = [i for i, token in enumerate(reply) if token in eos_ids]
            reply = reply[: ends[0] + 1] if ends else reply  # keep the end-of-turn token: drafters learn it
            ids = (prompt + reply)[:seq_len]
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[len(prompt) :] = True
            yield Sample(torch.tensor(ids), mask, asking.id)


# ---------------------------------------------------------------- conversations


def check_text_kind(corpus: str, text: str, key: str = "data") -> None:
    if text not in TEXT_KINDS:
        raise DataError(f"{key}.text must be one of {', '.join(TEXT_KINDS)}, got {text!r}")
    if TEXT_KINDS[text] != corpus_kind(corpus):
        fitting = [kind for kind, source in TEXT_KINDS.items() if source == corpus_kind(corpus)]
        raise DataError(f"{key}.text {text!r} reads {TEXT_KINDS[text]}, but {key}.corpus {corpus!r} holds "
                        f"{corpus_kind(corpus)}: use {' or '.join(fitting)}")


def check_thinking_mode(corpus: str, template_kwargs: dict) -> None:
    """Refuse training a regenerated dataset in another thinking mode than it was regenerated in: a drafter
    trained on replies without reasoning, served with it (or the reverse), loses most of its τ."""
    if corpus_kind(corpus) != "conversations":
        return
    path, _ = conversation_source(corpus)
    for file in conversation_files(path):
        manifest = manifest_path(file)
        if not manifest.is_file():
            continue
        made = json.loads(manifest.read_text()).get("settings", {}).get("chat_template_kwargs", {})
        if made != dict(template_kwargs):
            raise DataError(f"{file} was regenerated with chat_template_kwargs {made}, the recipe renders "
                            f"with {dict(template_kwargs)} (data.chat_template_kwargs): train and serve in "
                            "the mode the replies were made in, or regenerate them in this one")


def renderer_for(target, data: dict) -> ChatRenderer:
    """The chat template of `target` as the recipe's `data` section renders conversations."""
    return ChatRenderer(target.tokenizer, target.stop_token_ids, data["loss_turns"],
                        data["chat_template_kwargs"], data["turns"])


def conversation_samples(renderer: ChatRenderer, conversations: Iterator[Conversation], seq_len: int,
                         cut: Counter, stats: ReadStats | None = None) -> Iterator[Sample]:
    """Rendered conversations (a conversation whose template rewrites history gives one sample per trained
    turn), each cut to its first `seq_len` tokens; `cut` counts the samples cut, the tokens and loss tokens
    cut off, and those left with no loss token (skipped); a conversation the template cannot render is
    skipped and counted in `stats` by reason, with where it was first met."""
    stats = stats if stats is not None else ReadStats()
    for conversation in conversations:
        try:
            rendered = renderer.samples(conversation, seq_len)
        except RenderError as err:
            stats.skip(err.reason, f"{conversation.where} ({err})")
            continue
        for sample in rendered:
            if sample.cut_tokens:
                cut["samples cut at seq_len"] += 1
                cut["tokens cut"] += sample.cut_tokens
                cut["loss tokens cut"] += sample.cut_loss_tokens
            if not any(sample.loss_mask):
                cut["skipped: no loss token within seq_len"] += 1
                continue
            doc_id = conversation.id if sample.turn is None else f"{conversation.id}#{sample.turn}"
            yield Sample(torch.tensor(sample.input_ids), torch.tensor(sample.loss_mask), doc_id)


@dataclass
class DatasetReport:
    """What `eagle3 dataset` shows: what was read and skipped, and the samples a drafter would learn from."""

    stats: ReadStats
    cut: Counter
    heldout: int
    samples_read: int
    samples: list[Sample]  # kept when asked for
    tokens: int
    loss_tokens: int

    def loss_token_counts(self, vocab_size: int) -> Tensor:
        """int64 [vocab_size]: how often each token is in the loss of the kept samples, counted as
        00_prepare_data counts the tokens it builds its vocab map from."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for sample in self.samples:
            counts += torch.bincount(sample.input_ids[sample.loss_mask], minlength=vocab_size)
        return counts

    def as_dict(self) -> dict:
        return {"read": self.stats.read, "skipped": dict(self.stats.skipped),
                "dropped_turns": dict(self.stats.dropped_turns), "heldout": self.heldout,
                "cut": dict(self.cut), "notes": self.stats.notes, "samples_read": self.samples_read,
                "tokens": self.tokens, "loss_tokens": self.loss_tokens,
                "samples": [{"id": s.doc_id, "input_ids": s.input_ids.tolist(),
                             "loss_mask": s.loss_mask.int().tolist()} for s in self.samples]}


def dataset_report(corpus: str, renderer: ChatRenderer, seq_len: int, heldout_fraction: float, split: str,
                   limit: int | None = None, keep: bool = True) -> DatasetReport:
    """A conversation corpus read as 00_prepare_data reads it (`split` train; or heldout, or all), up to
    `limit` samples; `keep` False counts the samples without holding them."""
    stats, cut, heldout = ReadStats(), Counter(), Counter()
    path, truncated_ok = conversation_source(corpus)

    def chosen() -> Iterator[Conversation]:
        for conversation in read_conversations(path, stats, allow_truncated=truncated_ok):
            held = is_heldout(conversation.split_key, heldout_fraction)
            heldout["n"] += held
            if split == "all" or held == (split == "heldout"):
                yield conversation

    samples, count, tokens, loss_tokens = [], 0, 0, 0
    rendered = islice(conversation_samples(renderer, chosen(), seq_len, cut, stats), limit)
    for sample in progress(rendered, desc=f"{corpus} ({split})", unit="sample"):
        count += 1
        tokens += len(sample.input_ids)
        loss_tokens += int(sample.loss_mask.sum())
        if keep:
            samples.append(sample)
    return DatasetReport(stats, cut, heldout["n"], count, samples, tokens, loss_tokens)


def marked_text(tokenizer, sample: Sample, start: str = "«", end: str = "»") -> str:
    """A sample decoded, each run of loss tokens between `start` and `end`."""
    pieces, ids, mask = [], sample.input_ids.tolist(), sample.loss_mask.tolist()
    run_start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[run_start]:
            text = tokenizer.decode(ids[run_start:i])
            pieces.append(f"{start}{text}{end}" if mask[run_start] else text)
            run_start = i
    return "".join(pieces)
