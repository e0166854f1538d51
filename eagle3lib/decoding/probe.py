"""The probe harness: τ, per-position acceptance and speed of a drafter on a set of prompts, counted as the
engines count them (docs/formats.md §6), against the target decoding the same prompts alone.

Prompts are decoded `batch_size` at a time, grouped by length so that left padding wastes little
(`batches_by_length`); every prompt draws its random numbers from its own generator, so τ and the outputs do
not depend on the batching. `probe` speculates with `decoding.speculate`, decodes the target-only baseline
(or reuses one given), and returns the metrics with τ's bootstrap interval (`eagle3lib.decoding.intervals`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from eagle3lib.decoding import intervals
from eagle3lib.decoding.speculate import (
    BatchOutput,
    DraftSettings,
    Generation,
    PrefillCache,
    SpeculativeDecoder,
    decode_target_only,
)
from eagle3lib.progress import progress


def acceptance_metrics(accepted: list[int], depth: int) -> dict:
    """τ and per-position acceptance from the accepted-draft count of each verification (vLLM's counters:
    num_drafts, num_accepted_tokens, num_accepted_tokens_per_pos)."""
    verify_steps = len(accepted)
    if verify_steps == 0:
        raise ValueError("no verification step ran (max_new_tokens 1?): τ is undefined")
    total = sum(accepted)
    per_position = [sum(a >= d for a in accepted) / verify_steps for d in range(1, depth + 1)]
    return {
        "tau": 1 + total / verify_steps,
        "num_drafts": verify_steps,
        "num_accepted_tokens": total,
        "acceptance_per_position": per_position,
    }


def speed_metrics(spec: list[BatchOutput], target: list[BatchOutput] | None, tau: float) -> dict:
    """Throughput of both decoders on the same prompts and batches, the draft/verify split, speedups and
    ideal speedup.

    speedup is end to end: both decoders' tokens over their seconds, the prefill they share included (on a
    CPU, prefilling chat prompts costs about as much as decoding 64 tokens, which halves any speedup);
    decode_speedup leaves the prefill and the token it yields out of both: what speculation changes.
    ideal_speedup = τ · (target-only step) / (draft + verify per round): what τ allows at the measured
    step costs of a batch, decode phase only; efficiency = speedup / ideal, what the shared prefill (and any
    overhead) leaves of it. Efficiency rises above 1 when speculation is slower than the target alone: the
    shared prefill then dilutes the slowdown.
    """
    def total(outputs: list[BatchOutput], key: str) -> float:
        return sum(o.seconds[key] for o in outputs)

    def tokens(outputs: list[BatchOutput]) -> int:
        return sum(len(g.tokens) for o in outputs for g in o.generations)

    def decoded(outputs: list[BatchOutput]) -> int:  # every sequence's first token comes from the prefill
        return tokens(outputs) - sum(len(o.generations) for o in outputs)

    rounds = sum(o.rounds for o in spec)
    out = {
        "tokens": tokens(spec),
        "tokens_per_s": tokens(spec) / total(spec, "total"),
        "prefill_s": total(spec, "prefill"),
        "draft_s": total(spec, "draft"),
        "verify_s": total(spec, "verify"),
        "decode_tokens_per_s": decoded(spec) / (total(spec, "draft") + total(spec, "verify")),
        "draft_ms_per_round": 1e3 * total(spec, "draft") / rounds,
        "verify_ms_per_round": 1e3 * total(spec, "verify") / rounds,
    }
    if target:
        step_s = total(target, "decode") / max(sum(o.rounds for o in target), 1)
        ideal = tau * step_s / ((total(spec, "draft") + total(spec, "verify")) / rounds)
        target_rate = tokens(target) / total(target, "total")
        speedup = out["tokens_per_s"] / target_rate
        target_decode_rate = decoded(target) / total(target, "decode")
        out |= {
            "target_tokens_per_s": target_rate,
            "target_decode_tokens_per_s": target_decode_rate,
            "target_ms_per_step": 1e3 * step_s,
            "speedup": speedup,
            "decode_speedup": out["decode_tokens_per_s"] / target_decode_rate,
            "ideal_speedup": ideal,
            "efficiency": speedup / ideal,
        }
    return out


@dataclass
class ProbeResult:
    metrics: dict
    spec: list[Generation]
    target: list[Generation] | None
    baseline: list[BatchOutput] | None  # the target-only batches, to reuse for other drafters and depths


def decode_baseline(
    model: PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_id: int | None = None,
    seed: int = 0,
    batch_size: int = 8,
    reuse: PrefillCache | None = None,
    record: tuple[list[int], int] | None = None,
    compiled: bool = False,
) -> list[BatchOutput]:
    """The target alone on the prompts, in the batches `probe` uses: one baseline serves every drafter and
    depth compared on these prompts. `record`: also keep the recordings replays need (see
    `decode_target_only`); `compiled`: its steps through the compiled graph."""
    return [
        decode_target_only(
            model, [prompts[i] for i in batch], max_new_tokens, temperature, eos_token_id,
            _seeded(model, seed, batch), reuse, record, compiled,
        )
        for batch in batches_by_length(prompts, batch_size)
    ]


def _replayable(baseline: list[BatchOutput] | None, aux_layer_ids: list[int], depth: int) -> bool:
    """The baseline holds recordings of these aux states, decoded far enough past each end for drafts of
    `depth`."""
    return baseline is not None and all(
        out.recordings is not None
        and all(r.aux_layer_ids == aux_layer_ids and r.overrun >= depth for r in out.recordings)
        for out in baseline
    )


def batches_by_length(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """Prompt indices in batches of similar length: left padding to the longest of a batch wastes little."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def _seeded(model: PreTrainedModel, seed: int, batch: list[int]) -> list[torch.Generator]:
    """Prompt i draws from a generator seeded `seed + i`, whatever the batching."""
    return [torch.Generator(model.device).manual_seed(seed + i) for i in batch]


def _in_prompt_order(outputs: list[BatchOutput], batches: list[list[int]]) -> list[Generation]:
    found = {i: g for batch, out in zip(batches, outputs, strict=True) for i, g in zip(batch, out.generations,
                                                                                       strict=True)}
    return [found[i] for i in range(len(found))]


def probe(
    model: PreTrainedModel,
    drafter,
    prompts: list[list[int]],
    settings: DraftSettings,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    seed: int = 0,
    compare_target: bool = True,
    warmup: bool = True,
    batch_size: int = 8,
    baseline: list[BatchOutput] | None = None,
    reuse: PrefillCache | None = None,
    replay: bool = False,
    compiled: bool = False,
) -> ProbeResult:
    """Speculate on every prompt, `batch_size` prompts of similar length at a time, and compare with the
    target decoding the same batches alone (`baseline`, decoded here unless given); count as the engines
    do, with τ's 95 % bootstrap interval. `reuse` shares the target's prefill between probes of the same
    prompts (see `PrefillCache`).

    With greedy settings, `matches_target` is the share of prompts whose speculative output equals the
    target-only output token for token (1.0 unless floating point flips a near tie).

    `replay` (greedy only): the drafter speculates against the baseline's recordings (`RecordedTarget`), so
    the target decodes each prompt once for every drafter and depth measured on it; the accepted drafts are
    those real verifications accept where the target's states agree (float32; in bf16 real runs leave the
    target's own output at near ties), and nothing is timed (no speed metrics).

    `compiled`: the target's verifications and its steps alone both through the compiled graph (a Llama-like
    target, `target.direct`; compiled in the warm-up, untimed), so speculation and the baseline share a core.
    """
    if not prompts:
        raise ValueError("probe needs at least one prompt")
    batches = batches_by_length(prompts, batch_size)
    decoder = SpeculativeDecoder(model, drafter, settings, compiled)
    if replay:
        if settings.temperature != 0:
            raise ValueError(f"replay needs greedy settings; temperature is {settings.temperature}")
        record = (decoder.aux_layer_ids, settings.steps)
        if not _replayable(baseline, *record):
            baseline = decode_baseline(model, prompts, max_new_tokens, 0.0, eos_token_id, seed, batch_size,
                                       reuse, record, compiled)
        spec = [
            decoder.generate_batch([prompts[i] for i in batch], max_new_tokens, eos_token_id,
                                   recordings=out.recordings)
            for batch, out in zip(progress(batches, desc="replay", leave=False), baseline, strict=True)
        ]
    else:
        if baseline is not None and any(out.recordings is not None for out in baseline):
            baseline = None  # decoded past each end and keeping aux states: not the target alone's speed
        if warmup:  # first calls pay one-time allocation costs that would skew the timings
            first = [prompts[i][-16:] for i in batches[0]]  # short: a full prefill costs as much as a batch
            decoder.generate_batch(first, min(4, max_new_tokens))
            if compare_target and baseline is None:
                decode_target_only(model, first, min(4, max_new_tokens), compiled=compiled)
        spec = [
            decoder.generate_batch([prompts[i] for i in batch], max_new_tokens, eos_token_id,
                                   _seeded(model, seed, batch), reuse)
            for batch in progress(batches, desc="speculate", leave=False)
        ]
        if compare_target and baseline is None:
            baseline = decode_baseline(model, prompts, max_new_tokens, settings.temperature, eos_token_id,
                                       seed, batch_size, reuse, compiled=compiled)
    target = baseline if compare_target or replay else None
    spec_generations = _in_prompt_order(spec, batches)
    target_generations = _in_prompt_order(target, batches) if target else None
    per_prompt = [g.accepted for g in spec_generations]
    metrics = acceptance_metrics([a for accepted in per_prompt for a in accepted], settings.steps)
    interval = intervals.tau_interval(per_prompt, seed=seed)
    metrics |= {"tau_low": interval.low, "tau_high": interval.high, "tau_interval_unit": interval.unit}
    if not replay:
        metrics |= speed_metrics(spec, target, metrics["tau"])
    metrics |= {
        "steps": settings.steps,
        "topk": settings.topk,
        "num_draft_tokens": settings.num_draft_tokens,
        "temperature": settings.temperature,
        "prompts": len(prompts),
        "batch_size": batch_size,
        "replayed": replay,
        "accepted_per_prompt": per_prompt,
    }
    if target_generations is not None and settings.temperature == 0 and not replay:
        same = sum(s.tokens == t.tokens for s, t in zip(spec_generations, target_generations, strict=True))
        metrics["matches_target"] = same / len(spec_generations)
    return ProbeResult(metrics=metrics, spec=spec_generations, target=target_generations, baseline=target)
