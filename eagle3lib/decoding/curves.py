"""τ along training: measured on validation prompts while an arm trains, and what the curves answer.

- `Validation` decodes a drafter on each benchmark's validation draw (the last held-out questions of its
  source, never those 05 reports) with the target-only baseline decoded once: τ with its interval, and the
  per-prompt counts that paired comparisons need.
- `curve_steps`: where an arm is measured: the start, then steps doubling up to the last.
- `chosen_point`: the measured drafter a rule picks (the best first-benchmark τ, the best mean, the last).
- `findings`: the practitioner's answer in training tokens: how many tokens scratch needed to reach the warm
  start's τ at its start and at its end, from how many tokens a fine-tuned arm is above the source drafter
  as-is, and what training cost on the other benchmarks (forgetting).
- `learning_curve`: τ of a finished arm's kept checkpoints (`eagle3 curve`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from eagle3lib.data.benchmarks import Benchmark
from eagle3lib.decoding import intervals
from eagle3lib.decoding.evaluate import engine_terms, tau_text
from eagle3lib.decoding.speculate import DraftSettings
from eagle3lib.devices import machine_description

CURVE_FILE = "curve.jsonl"  # one measured point a line, in an arm's folder
VALIDATION_FILE = "validation.json"  # beside the arms: what a point costs, the source drafter as-is on it
SELECT_RULES = ("first", "mean", "last")
LEARNING_CURVE = "learning_curve.json"


def curve_steps(steps: int, points: int) -> list[int]:
    """0, then `points` steps doubling up to `steps` (ceil(steps / 2^(points-1)), ..., steps/2, steps),
    without repeats: with packed rows of nearly equal tokens, doublings of the training tokens."""
    found = [0] + [math.ceil(steps / 2 ** (points - 1 - i)) for i in range(points)]
    return sorted(set(found))


class Validation:
    """A target, each benchmark's validation prompts and their target-only decoding: `measure` a drafter."""

    def __init__(self, target, benchmarks: list[Benchmark], num_prompts: int, max_new_tokens: int,
                 settings: DraftSettings, batch_size: int, seed: int = 0, prompt_chars: int = 600,
                 template_kwargs: dict | None = None, compiled: bool = False):
        from eagle3lib.decoding import batches, engines

        self.target, self.settings, self.max_new_tokens = target, settings, max_new_tokens
        self.batch_size, self.seed, self.compiled = batch_size, seed, compiled
        reply = engines.target_replies(target, max_new_tokens, batch_size, compiled)
        self.prompts = {
            b.name: engines.probe_prompts(target.tokenizer, b.corpus, num_prompts, prompt_chars, True, reply,
                                          draw="validation", template_kwargs=template_kwargs, turns=b.turns)
            for b in benchmarks
        }
        self.num_prompts = num_prompts
        self._reuse = {name: batches.PrefillCache() for name in self.prompts}
        self._baseline: dict[str, list | None] = dict.fromkeys(self.prompts)

    @property
    def budget(self) -> str:
        """What one measured point costs, in decoding."""
        return (f"{len(self.prompts)} benchmark(s) x {self.num_prompts} validation prompts x "
                f"{self.max_new_tokens} new tokens, {engine_terms(self.settings)}")

    def measure(self, drafter: Path) -> dict[str, dict]:
        """{benchmark: τ, its interval and the accepted drafts per prompt} of the drafter folder `drafter`."""
        from eagle3lib.decoding import engines

        found = {}
        for name, prompts in self.prompts.items():
            result = engines.probe("builtin", self.target, drafter, prompts, self.settings,
                                   self.max_new_tokens, seed=self.seed, batch_size=self.batch_size,
                                   baseline=self._baseline[name], reuse=self._reuse[name],
                                   replay=self.settings.temperature == 0, compiled=self.compiled)
            self._baseline[name] = result.baseline
            m = result.metrics
            found[name] = {key: m[key] for key in ("tau", "tau_low", "tau_high", "accepted_per_prompt")}
        return found


# ---------------------------------------------------------------- reading and choosing points


def read_points(arm_folder: Path) -> list[dict]:
    """The measured points of an arm (`curve.jsonl`), in step order."""
    from eagle3lib import files

    path = Path(arm_folder) / CURVE_FILE
    return files.read_json_lines(path) if path.exists() else []


def read_curves(out: Path, arms) -> tuple[dict[str, list[dict]], dict[str, dict] | None]:
    """({arm: its points} of the arms measured under `out`, the source drafter as-is per benchmark or None);
    ({}, None) when nothing was measured."""
    found = {arm: points for arm in arms if (points := read_points(Path(out) / arm))}
    record = Path(out) / VALIDATION_FILE
    source = json.loads(record.read_text())["source"] if record.exists() else None
    return found, source and source["benchmarks"]


def title(out: Path) -> str:
    """The figure's title: what one point cost, from the run's record."""
    record = Path(out) / VALIDATION_FILE
    budget = json.loads(record.read_text())["budget"] if record.exists() else "not measured"
    return f"validation τ along training ({budget})"


def score(point: dict, rule: str) -> float:
    """What `rule` ranks a point by: the first benchmark's τ, or the mean τ over the benchmarks."""
    taus = [m["tau"] for m in point["benchmarks"].values()]
    return taus[0] if rule == "first" else sum(taus) / len(taus)


def chosen_point(points: list[dict], rule: str) -> dict:
    """The point `rule` picks: the last for `last`, else the best score (the earliest of equals)."""
    if rule not in SELECT_RULES:
        raise ValueError(f"train.select_by must be one of {', '.join(SELECT_RULES)}, got {rule!r}")
    if rule == "last":
        return points[-1]
    return max(points, key=lambda p: (score(p, rule), -p["step"]))


def measurements_without_gain(points: list[dict], rule: str) -> int:
    """How many measurements since the best one (by `rule`, or the first benchmark for `last`)."""
    best = chosen_point(points, "first" if rule == "last" else rule)
    return sum(p["step"] > best["step"] for p in points)


# ---------------------------------------------------------------- what the curves answer


def tokens_to_reach(points: list[dict], benchmark: str, tau: float) -> int | None:
    """The training tokens of the first point whose τ on `benchmark` reaches `tau`; None if none does."""
    return next((p["tokens"] for p in points if p["benchmarks"][benchmark]["tau"] >= tau), None)


def tokens_text(tokens: int | None, budget: int) -> str:
    if tokens is None:
        return f"≥ {budget:,} tokens (not reached)"
    return f"{tokens:,} tokens"


def compared(a: dict, b: dict, seed: int = 0) -> intervals.Comparison:
    """τ(a) - τ(b) on the same validation prompts, paired."""
    return intervals.paired_comparison("a", a["accepted_per_prompt"], "b", b["accepted_per_prompt"],
                                       seed=seed)


def findings(arms: dict[str, list[dict]], source: dict[str, dict] | None) -> list[str]:
    """Sentences in training tokens: tokens saved by each warm start, where it passes the source drafter
    as-is (paired interval above zero), and what the benchmarks after the first (the old domain) lost or
    gained, in training and against the source drafter as-is."""
    lines = []
    scratch = arms.get("scratch")
    warm = {arm: points for arm, points in arms.items() if arm != "scratch" and points}
    for arm, points in warm.items():
        benchmarks = list(points[0]["benchmarks"])
        new_domain, budget = benchmarks[0], points[-1]["tokens"]
        start, end = points[0]["benchmarks"][new_domain], points[-1]["benchmarks"][new_domain]
        if scratch:
            at_start = tokens_to_reach(scratch, new_domain, start["tau"])
            at_end = tokens_to_reach(scratch, new_domain, end["tau"])
            scratch_budget = scratch[-1]["tokens"]
            lines.append(
                f"{arm} on {new_domain}: τ {start['tau']:.2f} at the start and {end['tau']:.2f} after "
                f"{budget:,} training tokens; scratch needed {tokens_text(at_start, scratch_budget)} to "
                f"reach the start and {tokens_text(at_end, scratch_budget)} to reach the end"
            )
        if source:
            passing = next((p for p in points if compared(p["benchmarks"][new_domain], source[new_domain])
                            .difference.low > 0), None)
            lines.append(
                f"{arm} on {new_domain}: above the source drafter as-is ({source[new_domain]['tau']:.2f}) "
                + (f"from {passing['tokens']:,} training tokens on (paired interval above zero)" if passing
                   else f"not within {budget:,} training tokens (no paired interval above zero)")
            )
        for old_domain in benchmarks[1:]:
            first, last = points[0]["benchmarks"][old_domain], points[-1]["benchmarks"][old_domain]
            line = (f"{arm} on {old_domain} (the old domain): τ {first['tau']:.2f} → {last['tau']:.2f} over "
                    f"{budget:,} tokens, {change_text(compared(last, first))}")
            if source:
                line += (f"; against the source drafter as-is ({source[old_domain]['tau']:.2f}), "
                         f"{change_text(compared(last, source[old_domain]))}")
            lines.append(line)
    return lines


def change_text(change: intervals.Comparison) -> str:
    """'forgetting -0.12 [-0.20, -0.05]' when the paired interval lies below zero, 'a gain' above it."""
    d = change.difference
    verdict = "forgetting" if d.high < 0 else "a gain" if d.low > 0 else "no change the prompts can tell"
    return f"{verdict} {d.estimate:+.2f} [{d.low:+.2f}, {d.high:+.2f}]"


# ---------------------------------------------------------------- a finished arm's checkpoints


def learning_curve(
    arm_folder: Path,
    target,
    tokenizer,
    benchmarks: list[Benchmark],
    settings: DraftSettings,
    max_new_tokens: int,
    batch_size: int,
    log: Callable[[str], None] = print,
    compiled: bool = False,
) -> dict:
    """τ of every checkpoint a trained arm kept and of its final drafter, per benchmark, against the tokens in
    the loss it had trained on by then (the `rows` of its metrics.jsonl): what more training data buys.
    Written to `<arm>/learning_curve.json`. `compiled`: the target's steps through the compiled graph."""
    from eagle3lib import files
    from eagle3lib.decoding import batches, engines

    arm_folder = Path(arm_folder)
    logged = files.read_json_lines(arm_folder / "metrics.jsonl")
    final_step = json.loads((arm_folder / "summary.json").read_text())["steps"]
    checkpoints = sorted(arm_folder.glob("checkpoints/step_*"))
    points = [(int(p.name.removeprefix("step_")), p / "drafter") for p in checkpoints]
    if not points or points[-1][0] != final_step:
        points.append((final_step, arm_folder / "drafter"))
    reply = engines.target_replies(target, max_new_tokens, batch_size, compiled)
    found = {}
    for benchmark in benchmarks:
        prompts = engines.probe_prompts(tokenizer, benchmark.corpus, benchmark.num_prompts, 600, True, reply,
                                        turns=benchmark.turns)
        reuse, baseline, rows = batches.PrefillCache(), None, []
        for step, drafter in points:
            result = engines.probe("builtin", target, drafter, prompts, settings, max_new_tokens,
                                   batch_size=batch_size, baseline=baseline, reuse=reuse,
                                   replay=settings.temperature == 0, compiled=compiled)
            baseline, m = result.baseline, result.metrics
            loss_tokens = sum(entry["rows"] for entry in logged if entry["step"] <= step)
            rows.append({"step": step, "loss_tokens": loss_tokens, "tau": m["tau"], "tau_low": m["tau_low"],
                         "tau_high": m["tau_high"]})
            log(f"{benchmark.name}: step {step} ({loss_tokens:,} loss tokens): τ {tau_text(m)}")
        found[benchmark.name] = rows
    curve = {
        "setting": engine_terms(settings),
        "machine": machine_description(),
        "max_new_tokens": max_new_tokens,
        "prompts": {b.name: b.num_prompts for b in benchmarks},
        "benchmarks": found,
    }
    files.atomic_write_text(arm_folder / LEARNING_CURVE, json.dumps(curve, indent=1) + "\n")
    return curve
