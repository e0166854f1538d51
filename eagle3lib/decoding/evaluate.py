"""Drafters side by side on the same benchmarks (notebook 05): τ with intervals per benchmark, paired
verdicts, the draft depth that pays on this machine, and the τ training predicted against the τ measured.

`evaluate_drafters` runs it all and returns an `Evaluation`, which knows its own table, verdicts, findings and
the metrics it stores; the run's summary reads those back through `summary_lines`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagle3lib.data.benchmarks import Benchmark
from eagle3lib.decoding import intervals
from eagle3lib.decoding.speculate import DraftSettings
from eagle3lib.devices import machine_description


def depth_grid(steps: list[int], tree: dict, temperature: float = 0.0) -> dict[str, DraftSettings]:
    """The K sweep: one chain per depth in `steps`, plus one small tree (`tree.steps` 0: none)."""
    grid = {f"chain K={k}": DraftSettings(steps=k, temperature=temperature) for k in steps}
    if tree["steps"]:
        settings = DraftSettings(
            steps=tree["steps"],
            topk=tree["topk"],
            num_draft_tokens=tree["num_draft_tokens"],
            temperature=temperature,
        )
        grid[f"tree {settings.steps}x{settings.topk} ({settings.num_draft_tokens})"] = settings
    return grid


def best_setting(sweep: dict[str, dict]) -> str:
    """The setting with the highest wall-clock speedup over the target alone (the same setting in decoding
    alone: the prefill both share is the same for every setting)."""
    return max(sweep, key=lambda label: sweep[label]["speedup"])


def training_metrics(drafter: str | Path) -> dict | None:
    """The metrics training recorded for a drafter on its own data after its last step (the step-0 check's
    batches, teacher-forced): from its arm's summary.json beside it (notebook 04) or the provenance.json a
    shipped drafter carries; None when neither is there."""
    folder = Path(drafter)
    for path in (folder.parent / "summary.json", folder / "provenance.json"):
        if path.is_file():
            return json.loads(path.read_text())["final_check"]["metrics"]
    return None


def predicted_tau(metrics: dict, steps: int) -> float | None:
    """Chain τ at depth `steps` from training's per-step accuracies: 1 + Σ_{k<steps} full_acc_k (None when
    training unrolled fewer steps)."""
    if f"full_acc_{steps - 1}" not in metrics:
        return None
    return 1.0 + sum(metrics[f"full_acc_{k}"] for k in range(steps))


def calibration(measured: dict[str, dict], drafters: dict[str, Path], steps: int) -> dict[str, dict]:
    """Per drafter with training metrics: predicted τ, measured τ with its interval, relative error."""
    rows = {}
    for name, path in drafters.items():
        found = training_metrics(path)
        predicted = predicted_tau(found, steps) if found else None
        if predicted is None:
            continue
        m = measured[name]
        rows[name] = {
            "predicted_tau": predicted,
            "measured_tau": m["tau"],
            "tau_low": m.get("tau_low"),
            "tau_high": m.get("tau_high"),
            "relative_error": predicted / m["tau"] - 1,
            "acc_0": found["acc_0"],
            "acceptance_1": m["acceptance_per_position"][0],
        }
    return rows


def comparisons_of(measured: dict[str, dict], seed: int = 0) -> list[intervals.Comparison]:
    """Every pair of drafters by a paired bootstrap over the prompts they all decoded."""
    per_prompt = {
        name: m["accepted_per_prompt"] for name, m in measured.items() if m.get("accepted_per_prompt")
    }
    return intervals.pairwise(per_prompt, seed=seed)


def tau_text(metrics: dict) -> str:
    """'1.52 [1.41, 1.63]' where an interval was measured, else '1.52'."""
    if metrics.get("tau_low") is None:
        return f"{metrics['tau']:.2f}"
    return f"{metrics['tau']:.2f} [{metrics['tau_low']:.2f}, {metrics['tau_high']:.2f}]"


def speedup_text(metrics: dict) -> str:
    """'1.05x (1.31x in decoding)': end to end, and without the shared prefill where that was measured."""
    text = f"{metrics['speedup']:.2f}x"
    if metrics.get("decode_speedup") is not None:
        text += f" ({metrics['decode_speedup']:.2f}x in decoding)"
    return text


def calibration_sentence(name: str, row: dict) -> str:
    """Where a prediction's gap comes from, in numbers: the first draft position (training's acc_0 on its own
    batches vs acceptance at position 1 on held-out prompts: a shift of data) against the later positions
    (teacher forcing in training, the drafter's own drafts when decoding)."""
    first_gap = row["acc_0"] - row["acceptance_1"]
    text = (
        f"{name}: predicted τ {row['predicted_tau']:.2f}, measured {row['measured_tau']:.2f} "
        f"({row['relative_error']:+.0%}); position 1: {row['acc_0']:.0%} on training batches vs "
        f"{row['acceptance_1']:.0%} accepted on held-out prompts"
    )
    if abs(row["relative_error"]) <= 0.10:
        return text + " — within 10 %."
    if abs(first_gap) >= 0.05:
        return text + (
            " — most of the gap is already at position 1: the held-out prompts are not the training data."
        )
    return text + (
        " — position 1 agrees, so the gap is in the later positions: training feeds them the true "
        "tokens (teacher forcing), decoding feeds the drafter's own drafts."
    )


def best_settings(sweeps: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Per drafter: its fastest setting, with τ and speedup there and at the probe's own setting."""
    found = {}
    for name, sweep in sweeps.items():
        label = best_setting(sweep)
        keys = (
            "tau",
            "tau_low",
            "tau_high",
            "speedup",
            "decode_speedup",
            "ideal_speedup",
            "batch_size",
            "draft_ms_per_round",
            "verify_ms_per_round",
            "target_ms_per_step",
        )
        found[name] = {"setting": label} | {key: sweep[label][key] for key in keys}
    return found


def markdown_table(results: dict[str, dict]) -> str:
    """One row per probe: τ, acceptance at each position, speed and speedup where measured."""
    columns = [
        ("tau", "τ [95 % interval]", "{:.2f}"),
        ("acceptance_per_position", "accept by position", None),
        ("tokens_per_s", "tok/s", "{:.1f}"),
        ("target_tokens_per_s", "target tok/s", "{:.1f}"),
        ("speedup", "speedup", "{:.2f}×"),
        ("decode_speedup", "in decoding", "{:.2f}×"),
        ("ideal_speedup", "ideal", "{:.2f}×"),
        ("efficiency", "efficiency", "{:.0%}"),
    ]
    lines = ["| drafter | " + " | ".join(title for _, title, _ in columns) + " |"]
    lines.append("|---" * (len(columns) + 1) + "|")
    for name, metrics in results.items():
        cells = []
        for key, _, form in columns:
            value = metrics.get(key)
            if value is None:
                cells.append("–")
            elif key == "tau":
                cells.append(tau_text(metrics))
            elif form is None:
                cells.append(" / ".join(f"{v:.2f}" for v in value))
            else:
                cells.append(form.format(value))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def engine_terms(settings: DraftSettings) -> str:
    """The decoding setting as the serving engines are configured for it."""
    sglang = (
        f"SGLang --speculative-num-steps {settings.steps} --speculative-eagle-topk {settings.topk} "
        f"--speculative-num-draft-tokens {settings.num_draft_tokens}"
    )
    if settings.topk == 1:
        return (
            f"{sglang} (chain, {settings.steps}/1/{settings.num_draft_tokens}); vLLM num_speculative_tokens "
            f"{settings.steps}"
        )
    return f"{sglang} (a tree; vLLM drafts chains only)"


def parse_setting(text: str) -> DraftSettings:
    """SGLang's `steps/topk/num_draft_tokens` (3/1/4: a chain of 3; 5/4/16: a tree), greedy."""
    parts = text.split("/")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        raise ValueError(f"setting {text!r}: expected STEPS/TOPK/NUM_DRAFT_TOKENS, e.g. 3/1/4 or 5/4/16")
    steps, topk, num_draft_tokens = map(int, parts)
    return DraftSettings(steps=steps, topk=topk, num_draft_tokens=num_draft_tokens)


def setting_label(settings: DraftSettings) -> str:
    return f"{settings.steps}/{settings.topk}/{settings.num_draft_tokens}"


def tau_table(target, tokenizer, drafter: Path, benchmarks: list[Benchmark], grid: list[DraftSettings],
              max_new_tokens: int, batch_size: int, template_kwargs: dict | None = None,
              log: Callable[[str], None] = print, compiled: bool = False) -> list[dict]:
    """τ of one drafter on every benchmark at every setting (built-in engine), each with its 95 % interval,
    the acceptance at each draft position and the setting in SGLang's and vLLM's terms; the target decodes
    each benchmark's prompts alone once (the speedup beside τ, at `batch_size`), and the share of its tokens
    inside the drafter's draft vocabulary is the coverage (a token outside it is never accepted). `compiled`:
    the target's steps through the compiled graph."""
    import torch

    from eagle3lib.decoding import batches, engines
    from eagle3lib.drafter.vocab import VocabMap

    vocab_map = VocabMap.load(drafter)
    reply = engines.target_replies(target, max_new_tokens, batch_size, compiled)
    rows = []
    for benchmark in benchmarks:
        prompts = engines.probe_prompts(tokenizer, benchmark.corpus, benchmark.num_prompts, 600, True, reply,
                                        template_kwargs=template_kwargs, turns=benchmark.turns)
        reuse, baseline = batches.PrefillCache(), None
        for settings in grid:
            start = time.perf_counter()
            result = engines.probe("builtin", target, drafter, prompts, settings, max_new_tokens,
                                   batch_size=batch_size, baseline=baseline, reuse=reuse, compiled=compiled)
            baseline, m = result.baseline, result.metrics
            replies = torch.tensor([t for tokens in result.target_outputs for t in tokens], dtype=torch.long)
            rows.append({
                "benchmark": benchmark.name, "corpus": benchmark.corpus, "questions": benchmark.num_prompts,
                "turns": benchmark.turns, "prompts": m["prompts"], "setting": setting_label(settings),
                "engines": engine_terms(settings), "tau": m["tau"], "tau_low": m["tau_low"],
                "tau_high": m["tau_high"], "acceptance_per_position": m["acceptance_per_position"],
                "speedup": m.get("speedup"), "seconds": time.perf_counter() - start,
                "vd_coverage": vocab_map.coverage(torch.bincount(replies, minlength=vocab_map.vt)),
            })
            log(f"{benchmark.name} at {setting_label(settings)}: τ {tau_text(m)} on {m['prompts']} prompts "
                f"({rows[-1]['seconds']:.0f} s)")
    return rows


def tau_table_markdown(rows: list[dict]) -> str:
    """Benchmarks down, settings across: τ [95 % interval]; each setting's engine terms under the table."""
    settings = list(dict.fromkeys(row["setting"] for row in rows))
    cells = {(row["benchmark"], row["setting"]): tau_text(row) for row in rows}
    prompts = {row["benchmark"]: row["prompts"] for row in rows}
    lines = ["| benchmark | prompts | " + " | ".join(f"τ at {s}" for s in settings) + " |",
             "|---" * (len(settings) + 2) + "|"]
    for benchmark in dict.fromkeys(row["benchmark"] for row in rows):
        lines.append(f"| {benchmark} | {prompts[benchmark]} | "
                     + " | ".join(cells.get((benchmark, s), "–") for s in settings) + " |")
    terms = {row["setting"]: row["engines"] for row in rows}
    coverage = {row["benchmark"]: row["vd_coverage"] for row in rows}
    return "\n".join(lines + [""] + [f"- {s}: {terms[s]}" for s in settings] + [
        "- the target's own tokens inside the draft vocabulary: "
        + "; ".join(f"{b} {share:.1%}" for b, share in coverage.items())])


def vocab_coverage(target, renderer, corpus: str, benchmark: Benchmark, max_new_tokens: int,
                   batch_size: int, seq_len: int, sizes: list[int], heldout_fraction: float = 0.1,
                   compiled: bool = False) -> dict:
    """Which draft vocabulary size Vd to train: the maps 00_prepare_data would build from a conversation
    corpus's training split at every size, each measured by the share of held-out text it holds (a token
    outside the map is never accepted). Held out: the target's own greedy replies to `benchmark`'s prompts
    (what speculation drafts), and the held-out conversations' own replies; the training replies themselves
    beside them (in sample, the most any map of that size holds of them). With each size's lm_head in bf16."""
    import torch

    from eagle3lib.data.corpora import corpus_kind
    from eagle3lib.data.layout import DataError
    from eagle3lib.data.sources import dataset_report
    from eagle3lib.decoding import engines, probe
    from eagle3lib.drafter.vocab import coverage_by_size

    if corpus_kind(corpus) != "conversations":
        raise DataError(f"{corpus!r} is a document corpus: its maps are measured on conversations' replies")
    vt = target.vocab_size
    if not 0 < min(sizes) <= max(sizes) <= vt:
        raise ValueError(f"draft vocabulary sizes must be in [1, Vt {vt}], got {sizes}")
    reads = {split: dataset_report(corpus, renderer, seq_len, heldout_fraction, split)
             for split in ("train", "heldout")}
    counts = {split: found.loss_token_counts(vt) for split, found in reads.items()}
    reply = engines.target_replies(target, max_new_tokens, batch_size, compiled)
    prompts = engines.probe_prompts(target.tokenizer, benchmark.corpus, benchmark.num_prompts, 600, True,
                                    reply, template_kwargs=renderer.kwargs, turns=benchmark.turns)
    decoded = probe.decode_baseline(target.model, prompts, max_new_tokens, eos_token_id=target.stop_token_ids,
                                    batch_size=batch_size, compiled=compiled)
    replies = [token for out in decoded for generation in out.generations for token in generation.tokens]
    held = {
        f"the target's replies ({benchmark.name}, {len(prompts)} prompts)": torch.bincount(
            torch.tensor(replies, dtype=torch.long), minlength=vt),
        "held-out conversations' replies": counts["heldout"],
        "the training replies (in sample)": counts["train"],
    }
    curves = {label: coverage_by_size(counts["train"], table) for label, table in held.items()}
    points = sorted({round(float(x)) for x in torch.logspace(0, math.log10(vt), 96)} | set(sizes))
    return {
        "corpus": corpus, "benchmark": benchmark.name, "prompts": len(prompts),
        "max_new_tokens": max_new_tokens, "seq_len": seq_len, "heldout_fraction": heldout_fraction, "vt": vt,
        "conversations": {"read": reads["train"].stats.read, "kept": reads["train"].stats.kept,
                          "skipped": dict(reads["train"].stats.skipped),
                          "held_out": reads["train"].heldout},
        "samples": {split: found.samples_read for split, found in reads.items()},
        "loss_tokens": {split: found.loss_tokens for split, found in reads.items()},
        "counted_tokens": {label: int(table.sum()) for label, table in held.items()},
        "rows": [{"vd": n, "lm_head_megabytes_bf16": n * target.hidden_size * 2 / 2**20,
                  "coverage": {label: float(curve[n - 1]) for label, curve in curves.items()}}
                 for n in sizes],
        "curves": {label: [[n, float(curve[n - 1])] for n in points] for label, curve in curves.items()},
    }


def vocab_coverage_markdown(found: dict) -> str:
    """Sizes down, held-out texts across: the share each map holds."""
    labels = list(found["rows"][0]["coverage"])
    lines = ["| Vd | lm_head (bf16) | " + " | ".join(labels) + " |", "|---" * (len(labels) + 2) + "|"]
    for row in found["rows"]:
        lines.append(f"| {row['vd']:,} | {row['lm_head_megabytes_bf16']:.1f} MB | "
                     + " | ".join(f"{row['coverage'][label]:.1%}" for label in labels) + " |")
    return "\n".join(lines)


def check_evaluate_settings(params: dict) -> None:
    """Refuse 05_evaluate's settings that cannot work, naming the key, before a target is loaded: the
    drafters, the benchmarks, the K sweep and the decoding it shares with `probe`."""
    from eagle3lib.data.benchmarks import check_corpus
    from eagle3lib.decoding import engines

    engines.check_probe_settings(params, drafter=False)
    engines.drafter_entries(params["evaluate"]["drafters"])
    for i, benchmark in enumerate(benchmarks_of(params)):
        check_corpus(benchmark.corpus, f"evaluate.benchmarks[{i}].corpus")
    e = params["evaluate"]
    try:
        depth_grid(e["sweep_steps"], e["sweep_tree"], params["probe"]["temperature"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"evaluate.sweep_steps or evaluate.sweep_tree ({e['sweep_tree']}): {err}") from err
    if e["sweep_batch_size"] < 1 or e["sweep_prompts"] < 1:
        raise ValueError("evaluate.sweep_batch_size and evaluate.sweep_prompts must be at least 1")


def benchmarks_of(params: dict) -> list[Benchmark]:
    """`evaluate.benchmarks`, or the probe's own prompts as the one benchmark."""
    entries = params["evaluate"]["benchmarks"]
    if not entries:
        p = params["probe"]
        return [Benchmark(p["corpus"], p["corpus"], p["num_prompts"])]
    found = [Benchmark.from_params(entry, f"evaluate.benchmarks[{i}]") for i, entry in enumerate(entries)]
    names = [b.name for b in found]
    if len(set(names)) != len(names):
        raise ValueError(f"evaluate.benchmarks: names must differ, got {names}")
    return found


@dataclass
class Evaluation:
    """Every drafter on every benchmark with the same target and decoding settings."""

    backend: str
    settings: DraftSettings
    max_new_tokens: int
    prompts: dict[str, int]  # benchmark -> prompts decoded (every turn of a multi-turn question counts)
    metrics: dict[str, dict[str, dict]]  # benchmark -> drafter -> probe metrics
    outputs: dict[str, dict[str, list[list[int]]]]  # benchmark -> drafter -> generated tokens per prompt
    comparisons: dict[str, list[intervals.Comparison]]  # benchmark -> paired comparisons
    sweeps: dict[str, dict[str, dict]] = field(default_factory=dict)  # drafter -> setting -> metrics
    calibration: dict[str, dict] = field(default_factory=dict)

    @property
    def first(self) -> dict[str, dict]:
        """The first benchmark's metrics per drafter: the one the sweep and the per-drafter figures use."""
        return next(iter(self.metrics.values()))

    @property
    def best(self) -> dict[str, dict]:
        return best_settings(self.sweeps) if self.sweeps else {}

    def table(self) -> str:
        """Drafters x benchmarks, τ [95 % interval], and the mean over benchmarks (the EAGLE-3 paper's and
        SpecForge's layout)."""
        names = list(self.metrics)
        drafters = list(self.first)
        head = "| drafter | " + " | ".join(f"{n} ({self.prompts[n]})" for n in names) + " | mean τ |"
        lines = [head, "|---" * (len(names) + 2) + "|"]
        for drafter in drafters:
            cells = [tau_text(self.metrics[n][drafter]) for n in names]
            mean = sum(self.metrics[n][drafter]["tau"] for n in names) / len(names)
            lines.append(f"| {drafter} | " + " | ".join(cells) + f" | {mean:.2f} |")
        return "\n".join(lines)

    def verdicts(self) -> list[str]:
        return [f"{name}: {c.sentence()}" for name, found in self.comparisons.items() for c in found]

    def findings(self) -> list[str]:
        lines = [
            f"{engine_terms(self.settings)}; {self.max_new_tokens} new tokens per prompt; τ with 95 % "
            "intervals over prompts:"
        ]
        for name, per_drafter in self.metrics.items():
            ranked = sorted(per_drafter, key=lambda d: per_drafter[d]["tau"], reverse=True)
            lines.append(
                f"{name} ({self.prompts[name]} prompts): "
                + "; ".join(f"{d} {tau_text(per_drafter[d])}" for d in ranked)
                + "."
            )
        verdicts = [f"{name}: {c.verdict}" for name, found in self.comparisons.items() for c in found]
        if verdicts:
            lines.append("Paired: " + "; ".join(verdicts) + ".")
        for drafter, b in self.best.items():
            lines.append(
                f"{drafter} is fastest at {b['setting']} at batch {b['batch_size']}: τ {b['tau']:.2f}, "
                f"{speedup_text(b)} the target alone."
            )
        lines += fastest_lines(self.best, machine_description())[1:]
        for drafter, row in self.calibration.items():
            lines.append(
                f"{drafter}: predicted τ {row['predicted_tau']:.2f} vs measured {row['measured_tau']:.2f} "
                f"({row['relative_error']:+.0%})."
            )
        return lines

    def to_metrics(self) -> dict:
        """What metrics.json keeps of 05 (the summary reads it back with `summary_lines`)."""
        keys = (
            "tau",
            "tau_low",
            "tau_high",
            "tau_interval_unit",
            "acceptance_per_position",
            "tokens_per_s",
            "target_tokens_per_s",
            "speedup",
            "decode_speedup",
            "ideal_speedup",
            "efficiency",
            "matches_target",
            "replayed",
        )
        return {
            "backend": self.backend,
            "steps": self.settings.steps,
            "topk": self.settings.topk,
            "num_draft_tokens": self.settings.num_draft_tokens,
            "setting": engine_terms(self.settings),
            "max_new_tokens": self.max_new_tokens,
            "prompts": self.prompts,
            "benchmarks": {
                name: {d: {k: m[k] for k in keys if m.get(k) is not None} for d, m in drafters.items()}
                for name, drafters in self.metrics.items()
            },
            "comparisons": {name: [c.sentence() for c in found] for name, found in self.comparisons.items()},
            "best_setting": self.best,
            "calibration": self.calibration,
            "machine": machine_description(),
        }


def fastest_lines(best: dict[str, dict], machine: str) -> list[str]:
    """The fastest setting of the fastest drafter at the sweep's batch, and what bounds it on this machine:
    the cost of a (K+1)-token verification against a one-token step, and the speedup τ allows there."""
    if not best:
        return []
    name = max(best, key=lambda d: best[d]["speedup"])
    b = best[name]
    if b.get("verify_ms_per_round") is None:  # a record from before the sweep kept its step costs
        return [
            "",
            f"Fastest on {machine}: {name} at {b['setting']}, τ {b['tau']:.2f}, {speedup_text(b)} the "
            "target alone.",
        ]
    verify_cost = b["verify_ms_per_round"] / b["target_ms_per_step"]
    return [
        "",
        f"Fastest at batch {b['batch_size']} on {machine}: {name} at {b['setting']}, τ {b['tau']:.2f}, "
        f"{speedup_text(b)} the target alone. Here a verification costs {verify_cost:.2f}x a one-token "
        f"step ({b['verify_ms_per_round']:.1f} vs {b['target_ms_per_step']:.1f} ms) and drafting "
        f"{b['draft_ms_per_round']:.1f} ms a round, so τ {b['tau']:.2f} allows at most "
        f"{b['ideal_speedup']:.2f}x in decoding.",
    ]


def summary_lines(stored: dict) -> list[str]:
    """The run summary's lines for 05, from what `Evaluation.to_metrics` stored: τ per benchmark and its mean,
    the speedup at the probe's setting and the fastest setting (first benchmark), predicted τ, verdicts."""
    benchmarks = stored.get("benchmarks") or {}
    if not benchmarks:
        return []
    names = list(benchmarks)
    first = benchmarks[names[0]]
    best, calibration = stored.get("best_setting", {}), stored.get("calibration", {})
    lines = [
        "",
        f"τ per benchmark ({stored['backend']}; {stored['setting']}; {stored['max_new_tokens']} new tokens; "
        f"95 % intervals over prompts); speeds on {names[0]}:",
        "",
        "| drafter | "
        + " | ".join(f"{n} ({stored['prompts'][n]})" for n in names)
        + " | mean τ | speedup (in decoding) | fastest setting: τ, speedup | predicted τ |",
        "|---" * (len(names) + 5) + "|",
    ]
    for drafter in first:
        cells = [tau_text(benchmarks[n][drafter]) for n in names]
        mean = sum(benchmarks[n][drafter]["tau"] for n in names) / len(names)
        speedup = speedup_text(first[drafter]) if "speedup" in first[drafter] else "–"
        fastest = best.get(drafter)
        fastest = f"{fastest['setting']}: {fastest['tau']:.2f}, {speedup_text(fastest)}" if fastest else "–"
        row = calibration.get(drafter)
        predicted = f"{row['predicted_tau']:.2f} ({row['relative_error']:+.0%})" if row else "–"
        lines.append(
            f"| {drafter} | " + " | ".join(cells) + f" | {mean:.2f} | {speedup} | {fastest} | {predicted} |"
        )
    lines += fastest_lines(best, stored.get("machine", "this machine"))
    sentences = [f"{name}: {s}" for name, found in stored.get("comparisons", {}).items() for s in found]
    if sentences:
        lines += ["", "Paired comparisons on the same prompts (95 % bootstrap intervals):", ""]
        lines += [f"- {sentence}" for sentence in sentences]
    return lines


def evaluate_drafters(
    params: dict, drafters: dict[str, Path], target, tokenizer, out: Path, log: Callable[[str], None] = print
) -> Evaluation:
    """Probe every drafter on every benchmark (`evaluate.benchmarks`) with `probe`'s target and settings,
    compare them pairwise per benchmark, sweep draft depths on the first benchmark (builtin), and set the τ
    training predicted beside the τ measured."""
    from eagle3lib.decoding import batches, engines

    p, e = params["probe"], params["evaluate"]
    dtype = p["dtype"] or params["target"]["dtype"]
    settings = DraftSettings.from_probe(p)
    builtin = p["backend"] == "builtin"
    replay = builtin and e["replay"] and settings.temperature == 0
    if builtin and e["replay"] and not replay:
        log(f"temperature {settings.temperature}: every drafter is verified by the target (replay is greedy)")
    reply = engines.target_replies(target, p["max_new_tokens"], p["batch_size"], p["compiled"])
    metrics, outputs, comparisons, prompt_counts, first_prompts = {}, {}, {}, {}, None
    for benchmark in benchmarks_of(params):
        prompts = engines.probe_prompts(
            tokenizer, benchmark.corpus, benchmark.num_prompts, p["prompt_chars"], p["chat"], reply,
            template_kwargs=params["data"]["chat_template_kwargs"], turns=benchmark.turns,
        )
        prompt_counts[benchmark.name] = len(prompts)
        reuse = batches.PrefillCache() if builtin else None  # one target prefill serves every probe
        state = {"baseline": None}  # one target-only decoding of the prompts serves every drafter

        def probe(path, draft_settings, work_dir, prompts=prompts, reuse=reuse, state=state):
            result = engines.probe(
                p["backend"],
                target,
                path,
                prompts,
                draft_settings,
                p["max_new_tokens"],
                dtype=dtype,
                sglang_url=p["sglang_url"],
                work_dir=work_dir,
                seed=params["run"]["seed"],
                batch_size=p["batch_size"],
                baseline=state["baseline"],
                reuse=reuse,
                replay=replay,
                compiled=p["compiled"],
            )
            state["baseline"] = result.baseline
            return result

        found = {}
        for i, (name, path) in enumerate(drafters.items()):
            found[name] = probe(path, settings, out / f"engine_{benchmark.name}_{i}")
            log(
                f"{benchmark.name}: {name}: τ {tau_text(found[name].metrics)}; "
                + "; ".join(found[name].notes)
            )
        metrics[benchmark.name] = {name: r.metrics for name, r in found.items()}
        outputs[benchmark.name] = {name: r.outputs for name, r in found.items()}
        comparisons[benchmark.name] = comparisons_of(metrics[benchmark.name], seed=params["run"]["seed"])
        first_prompts = first_prompts or prompts
    evaluation = Evaluation(
        p["backend"], settings, p["max_new_tokens"], prompt_counts, metrics, outputs, comparisons
    )
    if builtin and e["sweep_steps"]:
        evaluation.sweeps = sweep_depths(params, drafters, target, first_prompts[: e["sweep_prompts"]], log)
    evaluation.calibration = calibration(evaluation.first, drafters, settings.steps)
    return evaluation


def sweep_depths(
    params: dict,
    drafters: dict[str, Path],
    target,
    prompts: list[list[int]],
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, dict]]:
    """Every drafter at every setting of the K sweep, `evaluate.sweep_batch_size` prompts at a time (1: one
    user's latency, where a CPU's speculation pays; a batch of 16 is compute-bound here) on `prompts`."""
    from eagle3lib.decoding import batches, engines

    p, e = params["probe"], params["evaluate"]
    grid = depth_grid(e["sweep_steps"], e["sweep_tree"], p["temperature"])
    reuse, baseline, sweeps = batches.PrefillCache(), None, {}
    for name, path in drafters.items():
        sweeps[name] = {}
        for label, settings in grid.items():
            result = engines.probe(
                "builtin",
                target,
                path,
                prompts,
                settings,
                p["max_new_tokens"],
                seed=params["run"]["seed"],
                batch_size=e["sweep_batch_size"],
                baseline=baseline,
                reuse=reuse,
                compiled=p["compiled"],
            )
            baseline, sweeps[name][label] = result.baseline, result.metrics
        log(
            f"{name} at batch {e['sweep_batch_size']}: "
            + "; ".join(f"{label} τ {m['tau']:.2f} {m['speedup']:.2f}x" for label, m in sweeps[name].items())
        )
    return sweeps
