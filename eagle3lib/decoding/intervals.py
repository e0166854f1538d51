"""How sure a measured τ is: bootstrap intervals, and paired comparisons of drafters on the same prompts.

τ is a ratio pooled the way engines count it, 1 + Σ accepted / Σ verifications, so the resampling unit is
a prompt (its accepted-draft total and its verification count move together). Prompts are the honest unit:
rounds within one prompt are correlated (a repetitive reply accepts round after round). With fewer than
`MIN_PROMPTS` prompts a prompt bootstrap has too few distinct resamples to mean much, and the interval is
taken over verification rounds instead, which understates the uncertainty; the unit is always reported.

Two drafters decoded on the same prompts are compared by a paired bootstrap: the same resampled prompts
for both, and the interval of the difference of their τ. "A > B" is stated only when that interval
excludes zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_PROMPTS = 8
SAMPLES = 4000
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    unit: str  # what was resampled: "prompts" or "rounds"
    n: int  # how many of them

    def __str__(self) -> str:
        return f"{self.estimate:.2f} [{self.low:.2f}, {self.high:.2f}]"


def _units(accepted_per_prompt: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(accepted drafts, verifications) per resampling unit, and the unit's name."""
    if not accepted_per_prompt or not any(accepted_per_prompt):
        raise ValueError("no verification round to compute τ from")
    if len(accepted_per_prompt) >= MIN_PROMPTS:
        accepted = torch.tensor([sum(a) for a in accepted_per_prompt], dtype=torch.float64)
        rounds = torch.tensor([len(a) for a in accepted_per_prompt], dtype=torch.float64)
        return accepted, rounds, "prompts"
    flat = torch.tensor([x for a in accepted_per_prompt for x in a], dtype=torch.float64)
    return flat, torch.ones_like(flat), "rounds"


def _resample_index(n: int, seed: int, samples: int) -> torch.Tensor:
    return torch.randint(n, (samples, n), generator=torch.Generator().manual_seed(seed))


def _percentiles(values: torch.Tensor, level: float) -> tuple[float, float]:
    tail = (1 - level) / 2
    low, high = torch.quantile(values, torch.tensor([tail, 1 - tail], dtype=values.dtype)).tolist()
    return low, high


def tau_interval(
    accepted_per_prompt: list[list[int]], *, seed: int = 0, samples: int = SAMPLES, level: float = LEVEL
) -> Interval:
    """τ over all prompts with its percentile bootstrap interval (see the module docstring for the unit)."""
    accepted, rounds, unit = _units(accepted_per_prompt)
    index = _resample_index(len(accepted), seed, samples)
    taus = 1 + accepted[index].sum(1) / rounds[index].sum(1)
    low, high = _percentiles(taus, level)
    return Interval(float(1 + accepted.sum() / rounds.sum()), low, high, unit, len(accepted))


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    difference: Interval  # τ(a) - τ(b)

    @property
    def verdict(self) -> str:
        if self.difference.low > 0:
            return f"{self.a} > {self.b}"
        if self.difference.high < 0:
            return f"{self.b} > {self.a}"
        return f"{self.a} and {self.b} are not distinguishable"

    def sentence(self) -> str:
        d = self.difference
        return (f"{self.verdict} (τ difference {d.estimate:+.2f}, 95 % interval "
                f"[{d.low:+.2f}, {d.high:+.2f}] over {d.n} paired {d.unit})")


def paired_comparison(
    a: str,
    accepted_a: list[list[int]],
    b: str,
    accepted_b: list[list[int]],
    *,
    seed: int = 0,
    samples: int = SAMPLES,
    level: float = LEVEL,
) -> Comparison:
    """τ(a) - τ(b) on the same prompts, with a paired bootstrap interval over prompts."""
    if len(accepted_a) != len(accepted_b):
        raise ValueError(
            f"paired comparison needs the same prompts: {a} has {len(accepted_a)}, {b} has {len(accepted_b)}"
        )
    if not accepted_a:
        raise ValueError("paired comparison of no prompts")
    sums = {}
    for name, per_prompt in ((a, accepted_a), (b, accepted_b)):
        sums[name] = (torch.tensor([sum(x) for x in per_prompt], dtype=torch.float64),
                      torch.tensor([len(x) for x in per_prompt], dtype=torch.float64))
    index = _resample_index(len(accepted_a), seed, samples)

    def tau(name: str, rows: torch.Tensor | None = None) -> torch.Tensor:
        accepted, rounds = sums[name]
        if rows is None:
            return 1 + accepted.sum() / rounds.sum()
        return 1 + accepted[rows].sum(-1) / rounds[rows].sum(-1)

    low, high = _percentiles(tau(a, index) - tau(b, index), level)
    estimate = float(tau(a) - tau(b))
    return Comparison(a, b, Interval(estimate, low, high, "prompts", len(accepted_a)))


def pairwise(accepted: dict[str, list[list[int]]], *, seed: int = 0) -> list[Comparison]:
    """Every pair of drafters (in the given order) compared on the same prompts."""
    names = list(accepted)
    return [
        paired_comparison(x, accepted[x], y, accepted[y], seed=seed)
        for i, x in enumerate(names) for y in names[i + 1 :]
    ]
