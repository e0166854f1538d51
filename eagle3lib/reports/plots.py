"""The figures the notebooks show: one function per figure.

Each function draws one figure from eagle3lib results, saves it as a PNG when given a path (notebooks save
into their step folder), and returns the matplotlib Figure (Jupyter displays it).
"""

from __future__ import annotations

import math
import os
import textwrap

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure

from eagle3lib import devices
from eagle3lib.drafter.vocab import VocabDiff, VocabMap


def _finish(fig: Figure, path: str | os.PathLike | None) -> Figure:
    """Lay out, name the machine in a corner (a speed is one machine's, not another's), and save."""
    fig.tight_layout(rect=(0, 0.035, 1, 1))
    fig.text(0.995, 0.005, f"drawn on {devices.machine_description()}", ha="right", va="bottom", fontsize=6.5,
             color="grey")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


# ---------------------------------------------------------------------- speculative decoding (01, 05)


def acceptance_by_position(results: dict[str, dict], path: str | os.PathLike | None = None) -> Figure:
    """Per drafter: the share of verifications that accepted at least k draft tokens, k = 1..K (vLLM's
    per-position acceptance), with τ in the legend."""
    fig, axis = plt.subplots(figsize=(7.5, 4.2))
    depth = 1
    for name, metrics in results.items():
        rates = metrics.get("acceptance_per_position")
        if rates is None:  # SGLang reports no per-position counts
            axis.plot([], [], " ", label=f"{name}: τ {metrics['tau']:.2f} (no per-position counts)")
            continue
        depth = max(depth, len(rates))
        axis.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{name}: τ {metrics['tau']:.2f}")
    axis.set_xticks(range(1, depth + 1))
    axis.set_ylim(-0.02, 1.02)
    axis.set_xlabel("draft position k")
    axis.set_ylabel("share of verifications accepting ≥ k drafts")
    axis.set_title("acceptance by draft position", fontsize=10)
    axis.legend(fontsize=9)
    axis.grid(alpha=0.3)
    return _finish(fig, path)


def speculation_costs(results: dict[str, dict], path: str | os.PathLike | None = None) -> Figure:
    """Per drafter, the milliseconds of one round (drafting and verification) next to what plain decoding
    spends on the same τ tokens: speculation pays off where the bar is shorter than the dashed mark."""
    fig, axis = plt.subplots(figsize=(7.5, 2.0 + 0.6 * len(results)))
    names = list(results)
    rows = range(len(names))
    draft = [results[n]["draft_ms_per_round"] for n in names]
    verify = [results[n]["verify_ms_per_round"] for n in names]
    axis.barh(rows, draft, color="tab:orange", label="draft")
    axis.barh(rows, verify, left=draft, color="tab:blue", label="verify")
    for row, name in zip(rows, names, strict=True):
        metrics = results[name]
        if "target_ms_per_step" in metrics:
            plain = metrics["tau"] * metrics["target_ms_per_step"]
            axis.plot([plain, plain], [row - 0.4, row + 0.4], color="black", linestyle="--")
    axis.plot([], [], color="black", linestyle="--", label="target alone, τ tokens")
    axis.set_yticks(list(rows), names)
    axis.invert_yaxis()  # the first drafter on top
    axis.set_xlabel("ms per round")
    axis.set_title("cost of one speculation round", fontsize=10)
    axis.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, frameon=False)
    return _finish(fig, path)


def tau_and_speedup(results: dict[str, dict], path: str | os.PathLike | None = None) -> Figure:
    """τ with its 95 % interval (where measured), measured speedup over the target alone, and the ideal
    speedup those τ and step costs allow."""
    names = list(results)
    keys = [("tau", "τ (95 % interval)"), ("speedup", "speedup"), ("ideal_speedup", "ideal speedup")]
    keys = [(key, label) for key, label in keys if all(key in results[n] for n in names)]  # replays: τ
    fig, axis = plt.subplots(figsize=(max(6.0, 1.6 * len(names) + 2), 4.2))
    width = 0.8 / len(keys)
    for i, (key, label) in enumerate(keys):
        values = [results[n].get(key, float("nan")) for n in names]
        errors = None
        if key == "tau" and all(results[n].get("tau_low") is not None for n in names):
            errors = [[v - results[n]["tau_low"] for v, n in zip(values, names, strict=True)],
                      [results[n]["tau_high"] - v for v, n in zip(values, names, strict=True)]]
        places = [x + (i - (len(keys) - 1) / 2) * width for x in range(len(names))]
        bars = axis.bar(places, values, width, label=label, yerr=errors, capsize=4 if errors else 0)
        axis.bar_label(bars, fmt="%.2f", fontsize=8, padding=2)
    axis.axhline(1.0, color="grey", linewidth=1)
    axis.set_xticks(range(len(names)), names, rotation=15, ha="right")
    axis.set_title("acceptance length and speedup on the same prompts", fontsize=10)
    axis.legend(fontsize=9)
    return _finish(fig, path)


def benchmark_taus(metrics: dict[str, dict[str, dict]], path: str | os.PathLike | None = None) -> Figure:
    """τ with its 95 % interval per benchmark (groups) and drafter (bars): notebook 05's table as a figure."""
    benchmarks = list(metrics)
    drafters = list(metrics[benchmarks[0]])
    fig, axis = plt.subplots(figsize=(max(6.5, 1.2 * len(benchmarks) * len(drafters) + 2), 4.2))
    width = 0.8 / len(drafters)
    for i, drafter in enumerate(drafters):
        found = [metrics[b][drafter] for b in benchmarks]
        values = [m["tau"] for m in found]
        errors = None
        if all(m.get("tau_low") is not None for m in found):
            errors = [[m["tau"] - m["tau_low"] for m in found], [m["tau_high"] - m["tau"] for m in found]]
        bars = axis.bar([x + (i - (len(drafters) - 1) / 2) * width for x in range(len(benchmarks))], values,
                        width, label=drafter, yerr=errors, capsize=3 if errors else 0)
        axis.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    axis.axhline(1.0, color="grey", linewidth=1)
    axis.set_xticks(range(len(benchmarks)), benchmarks)
    axis.set_ylabel("τ (95 % interval over prompts)")
    axis.set_title("acceptance length per benchmark", fontsize=10)
    axis.legend(fontsize=8)
    return _finish(fig, path)


def learning_curve(curve: dict, path: str | os.PathLike | None = None) -> Figure:
    """τ (95 % interval) against the tokens in the loss trained on, per benchmark; a benchmark's point in
    `curve["reference"]` (another run's drafter, e.g. the one shipped, with its `label`) as a star."""
    fig, axis = plt.subplots(figsize=(7.5, 4.2))
    for name, rows in curve["benchmarks"].items():
        x = [r["loss_tokens"] for r in rows]
        y = [r["tau"] for r in rows]
        errors = [[r["tau"] - r["tau_low"] for r in rows], [r["tau_high"] - r["tau"] for r in rows]]
        label = f"{name} ({curve['prompts'][name]} prompts)"
        line = axis.errorbar(x, y, yerr=errors, marker="o", capsize=3, label=label)
        reference = curve.get("reference", {}).get(name)
        if reference:
            spread = [[reference["tau"] - reference["tau_low"]], [reference["tau_high"] - reference["tau"]]]
            axis.errorbar([reference["loss_tokens"]], [reference["tau"]], yerr=spread, fmt="*", markersize=12,
                          capsize=3, color=line.lines[0].get_color(), label=f"{name}: {reference['label']}")
    axis.set_xscale("log")
    axis.set_xlabel("tokens in the loss trained on (log scale)")
    axis.set_ylabel("τ, 95 % interval")
    axis.set_title(f"learning curve: {curve['setting'].split(' (')[0]}", fontsize=9)
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    return _finish(fig, path)


def training_curves(arms: dict[str, list[dict]], source: dict[str, dict] | None = None, title: str = "",
                    path: str | os.PathLike | None = None) -> Figure:
    """τ along training on the validation prompts, one panel per benchmark: one line per arm with its 95 %
    intervals against the training tokens (log scale; each arm's start drawn at the left edge), and the
    source drafter as-is as a band."""
    names = list(next(iter(arms.values()))[0]["benchmarks"])
    fig, panels = plt.subplots(1, len(names), figsize=(6.2 * len(names), 4.4), squeeze=False, sharey=True)
    positive = [p["tokens"] for points in arms.values() for p in points if p["tokens"] > 0]
    start = min(positive) / 2 if positive else 1
    for axis, name in zip(panels[0], names, strict=True):
        if source and name in source:
            m = source[name]
            axis.axhspan(m["tau_low"], m["tau_high"], color="grey", alpha=0.2)
            axis.axhline(m["tau"], color="grey", linewidth=1, label=f"source drafter as-is {m['tau']:.2f}")
        for arm, points in arms.items():
            x = [max(p["tokens"], start) for p in points]
            rows = [p["benchmarks"][name] for p in points]
            y = [r["tau"] for r in rows]
            errors = [[r["tau"] - r["tau_low"] for r in rows], [r["tau_high"] - r["tau"] for r in rows]]
            axis.errorbar(x, y, yerr=errors, marker="o", capsize=3, label=f"{arm} ({y[0]:.2f} → {y[-1]:.2f})")
        axis.set_xscale("log")
        axis.set_xlabel("training tokens (log scale; the start at the left edge)")
        axis.set_title(name, fontsize=10)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    panels[0][0].set_ylabel("validation τ, 95 % interval")
    if title:
        width = int(11 * 6.2 * len(names))  # characters of a 10-point title that fit the figure
        fig.suptitle("\n".join(textwrap.fill(line, width) for line in title.split("\n")), fontsize=10)
    return _finish(fig, path)


def cost_curves(arms: dict[str, list[dict]], path: str | os.PathLike | None = None) -> Figure:
    """τ along training of arms trained on different data, one panel per benchmark and two views: against
    training tokens (what the data teaches per token) and against CPU core-hours with the data's making
    included (what it buys per hour). Each point: `core_hours`, `tokens`, `benchmarks` with 95 % intervals."""
    names = list(next(iter(arms.values()))[0]["benchmarks"])
    fig, panels = plt.subplots(len(names), 2, figsize=(12, 4.4 * len(names)), squeeze=False, sharey="row")
    for row, name in zip(panels, names, strict=True):
        for axis, key, label in ((row[0], "tokens", "training tokens"),
                                 (row[1], "core_hours", "CPU core-hours, making the data included")):
            for arm, points in arms.items():
                shown = [p for p in points if p[key] > 0]
                rows = [p["benchmarks"][name] for p in shown]
                y = [r["tau"] for r in rows]
                errors = [[r["tau"] - r["tau_low"] for r in rows], [r["tau_high"] - r["tau"] for r in rows]]
                axis.errorbar([p[key] for p in shown], y, yerr=errors, marker="o", capsize=3,
                              label=f"{arm} ({y[-1]:.2f} at {shown[-1][key]:,.3g})")
            axis.set_xscale("log")
            axis.set_xlabel(f"{label} (log scale)")
            axis.set_title(f"{name}: validation τ, 95 % interval", fontsize=10)
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
    return _finish(fig, path)


def depth_sweep(sweeps: dict[str, dict[str, dict]], path: str | os.PathLike | None = None) -> Figure:
    """Per drafter, across the draft settings of the K sweep: τ with its interval (left) and the measured
    wall-clock speedup over the target alone (right; the best setting of each drafter marked)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, sweep in sweeps.items():
        labels = list(sweep)
        x = range(len(labels))
        tau = [sweep[k]["tau"] for k in labels]
        low = [t - sweep[k]["tau_low"] for t, k in zip(tau, labels, strict=True)]
        high = [sweep[k]["tau_high"] - t for t, k in zip(tau, labels, strict=True)]
        left.errorbar(x, tau, yerr=[low, high], marker="o", capsize=3, label=name)
        speedup = [sweep[k]["speedup"] for k in labels]
        (line,) = right.plot(x, speedup, marker="o", label=name)
        best = max(range(len(labels)), key=speedup.__getitem__)
        right.plot([best], [speedup[best]], marker="*", markersize=14, color=line.get_color())
    for axis, title in ((left, "τ (95 % interval)"), (right, "speedup over the target alone (★ best)")):
        axis.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
        axis.set_title(title, fontsize=10)
        axis.grid(alpha=0.3)
    right.axhline(1.0, color="grey", linewidth=1)
    left.legend(fontsize=8)
    return _finish(fig, path)


def tau_calibration(rows: dict[str, dict], path: str | os.PathLike | None = None) -> Figure:
    """Predicted τ (training's per-step accuracies) against measured τ (decoding held-out prompts), with
    the measured interval; points under the diagonal are drafters training was too optimistic about."""
    fig, axis = plt.subplots(figsize=(5.6, 5.0))
    top = 1.0
    for name, row in rows.items():
        measured = row["measured_tau"]
        error = None
        if row["tau_low"] is not None:
            error = [[measured - row["tau_low"]], [row["tau_high"] - measured]]
        axis.errorbar([row["predicted_tau"]], [measured], yerr=error, marker="o", capsize=3,
                      label=f"{name} ({row['relative_error']:+.0%})")
        top = max(top, row["predicted_tau"], row["tau_high"] or measured)
    axis.plot([1, top * 1.05], [1, top * 1.05], color="grey", linewidth=1, linestyle="--")
    axis.set_xlabel("predicted τ (training batches, teacher-forced)")
    axis.set_ylabel("measured τ (held-out prompts, speculative decoding)")
    axis.set_title("predicted vs measured τ (relative error of the prediction)", fontsize=10)
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    return _finish(fig, path)


# ---------------------------------------------------------------------- vocab maps (notebooks 02, 03)


def vocab_agreement_by_position(
    result: VocabDiff, path: str | os.PathLike | None = None, bins: int = 100
) -> Figure:
    """Where two maps agree along the draft positions: share agreeing per window, and the running count."""
    agree = result.agree.float()
    n = agree.numel()
    edges = torch.linspace(0, n, min(bins, n) + 1).round().long()
    starts, ends = edges[:-1], edges[1:]
    running = torch.cat([torch.zeros(1), agree.cumsum(0)])
    share = (running[ends] - running[starts]) / (ends - starts)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    top.stairs(share.numpy(), edges.numpy(), fill=True, alpha=0.6)
    top.set_ylim(0, 1.05)
    top.set_ylabel("share of positions\nthat agree")
    top.set_title(
        f"{result.label_a} vs {result.label_b}: {result.positions_equal:,} of {n:,} draft positions map to "
        "the same target token",
        fontsize=10,
    )
    bottom.plot(torch.arange(1, n + 1).numpy(), running[1:].numpy(), label="positions agreeing so far")
    bottom.plot([0, n], [0, n], color="grey", linestyle=":", label="every position agrees")
    bottom.set_xlabel("draft position")
    bottom.set_ylabel("agreeing positions")
    if result.first_divergence is not None:
        for axis in (top, bottom):
            axis.axvline(result.first_divergence, color="crimson", linewidth=1)
        bottom.annotate(
            f"first divergence at {result.first_divergence}",
            (result.first_divergence, n * 0.5),
            xytext=(8, 0),
            textcoords="offset points",
            color="crimson",
            fontsize=9,
        )
    bottom.legend(loc="center right", fontsize=9)
    return _finish(fig, path)


def vocab_coverage(
    maps: dict[str, VocabMap], counts: torch.Tensor, path: str | os.PathLike | None = None
) -> Figure:
    """Cumulative share of the counted tokens each map covers, its tokens taken from most to least frequent,
    against the best any map of that size could do (the top tokens of these counts)."""
    counts = counts.to(torch.float64)
    total = float(counts.sum())
    fig, axis = plt.subplots(figsize=(8, 4.5))
    largest = max(m.vd for m in maps.values())
    best = counts.sort(descending=True).values[:largest].cumsum(0) / total
    axis.plot(torch.arange(1, largest + 1).numpy(), best.numpy(), color="grey", linestyle="--",
              label=f"top {largest:,} of these counts: {float(best[-1]):.1%}")
    for label, vocab in maps.items():
        covered = counts[vocab.draft_ids].sort(descending=True).values.cumsum(0) / total
        label = f"{label}: {float(covered[-1]):.1%}"
        axis.plot(torch.arange(1, vocab.vd + 1).numpy(), covered.numpy(), label=label)
    axis.set_xscale("log")
    axis.set_ylim(0, 1.02)
    axis.set_xlabel("draft tokens, most frequent first (log scale)")
    axis.set_ylabel("share of counted tokens covered")
    axis.set_title(f"coverage of {int(total):,} counted target tokens", fontsize=10)
    axis.legend(loc="lower right", fontsize=9)
    axis.grid(alpha=0.3)
    return _finish(fig, path)


def coverage_by_vd(found: dict, path: str | os.PathLike | None = None) -> Figure:
    """`evaluate.vocab_coverage`: the share of each held-out text that the map of each size Vd holds, built
    from the training split's counts; the measured sizes marked."""
    fig, axis = plt.subplots(figsize=(8, 4.5))
    for label, points in found["curves"].items():
        sizes, shares = zip(*points, strict=True)
        axis.plot(sizes, shares, label=label, linestyle=":" if "in sample" in label else "-")
    for row in found["rows"]:
        axis.axvline(row["vd"], color="grey", alpha=0.25, linewidth=0.8)
    axis.set_xscale("log")
    axis.set_ylim(0, 1.01)
    axis.set_xlabel("draft vocabulary size Vd: the most frequent tokens of the training replies (log scale)")
    axis.set_ylabel("share of the text's tokens in the map")
    axis.set_title(f"draft vocabulary coverage, maps from {found['corpus']}'s training split "
                   f"({found['loss_tokens']['train']:,} loss tokens)", fontsize=10)
    axis.legend(loc="lower right", fontsize=9)
    axis.grid(alpha=0.3)
    return _finish(fig, path)


def remap_row_moves(old: VocabMap, new: VocabMap, path: str | os.PathLike | None = None) -> Figure:
    """Where lm_head rows went: old vs new draft position of each shared token, and how far rows moved."""
    sources = old.target_to_draft[new.draft_ids]
    shared = sources >= 0
    new_positions = torch.arange(new.vd)[shared]
    old_positions = sources[shared]
    stayed = old_positions == new_positions
    filled = int((~shared).sum())
    dropped = old.vd - int(shared.sum())
    shift = new_positions - old_positions
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [1.4, 1]})
    left.scatter(new_positions[~stayed].numpy(), shift[~stayed].numpy(), s=3, rasterized=True,
                 label=f"moved: {int((~stayed).sum()):,}")
    left.scatter(new_positions[stayed].numpy(), shift[stayed].numpy(), s=3, color="black", rasterized=True,
                 label=f"in place: {int(stayed.sum()):,}")
    # newly filled positions as ticks along the bottom edge (they have no old row, hence no shift)
    left.plot(torch.arange(new.vd)[~shared].numpy(), [0.03] * filled, "|", color="crimson", markersize=10,
              transform=left.get_xaxis_transform(), label=f"newly filled: {filled:,} (ticks)")
    left.plot([], [], " ", label=f"dropped: {dropped:,} old rows")
    left.set_xlabel("draft position under the new map")
    left.set_ylabel("new position − old position")
    left.set_title("where each shared token's lm_head row came from", fontsize=10)
    left.legend(loc="best", fontsize=8, markerscale=3)

    right.hist(shift.numpy(), bins=60, color="tab:blue")
    right.set_xlabel("new position − old position")
    right.set_ylabel("rows")
    right.set_title(f"how far the {int(shared.sum()):,} shared rows moved", fontsize=10)
    return _finish(fig, path)


# ---------------------------------------------------------------------- data (notebook 00)


def token_frequency(counts: dict[str, torch.Tensor], path: str | os.PathLike | None = None) -> Figure:
    """Rank-frequency of the tokens counted under the loss mask, one line per corpus (log-log)."""
    fig, axis = plt.subplots(figsize=(8, 4.5))
    for label, table in counts.items():
        seen = table[table > 0].sort(descending=True).values.double()
        share = seen / seen.sum()
        axis.plot(torch.arange(1, len(seen) + 1).numpy(), share.numpy(),
                  label=f"{label}: {len(seen):,} distinct of {int(seen.sum()):,} tokens")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("token rank")
    axis.set_ylabel("share of counted tokens")
    axis.set_title("token frequency under the loss mask", fontsize=10)
    axis.legend(fontsize=9)
    axis.grid(alpha=0.3)
    return _finish(fig, path)


def top_tokens_coverage(
    counts: dict[str, torch.Tensor],
    vd: int,
    argmax_counts: dict[str, torch.Tensor] | None = None,
    path: str | os.PathLike | None = None,
) -> Figure:
    """How much a draft vocab of the top-k counted tokens covers, against k, with Vd marked: the share of
    input tokens (solid) and, dashed, of the target's own predictions (the positions a drafter with that
    map can be trained on, since predictions outside the draft vocab are masked out)."""
    fig, axis = plt.subplots(figsize=(8, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (label, table), color in zip(counts.items(), colors, strict=False):
        order = table.sort(descending=True, stable=True).indices
        ks = torch.arange(1, len(order) + 1)
        covered = table[order].double().cumsum(0) / table.sum()
        axis.plot(ks.numpy(), covered.numpy(), color=color,
                  label=f"{label} inputs: {float(covered[vd - 1]):.1%} at Vd")
        if argmax_counts is not None:
            predicted = argmax_counts[label][order].double().cumsum(0) / argmax_counts[label].sum()
            axis.plot(ks.numpy(), predicted.numpy(), color=color, linestyle="--",
                      label=f"{label} target predictions: {float(predicted[vd - 1]):.1%} at Vd")
    axis.axvline(vd, color="grey", linestyle=":", label=f"Vd = {vd:,}")
    axis.set_xscale("log")
    axis.set_ylim(0, 1.02)
    axis.set_xlabel("draft vocab size k (the k most frequent input tokens)")
    axis.set_ylabel("share covered")
    axis.set_title("coverage of the top-k tokens", fontsize=10)
    axis.legend(fontsize=8, loc="lower right")
    axis.grid(alpha=0.3)
    return _finish(fig, path)


# ---------------------------------------------------------------------- fine-tuning (notebook 04)


def ttt_step_curves(
    metrics: dict[str, list[dict]], path: str | os.PathLike | None = None
) -> Figure:
    """Loss and accuracy of every TTT step over training, one column per arm (metrics.jsonl entries)."""
    arms = list(metrics)
    steps = sum(key.startswith("acc_") for key in metrics[arms[0]][0])
    colors = plt.cm.viridis(torch.linspace(0, 0.9, steps).numpy())
    fig, axes = plt.subplots(2, len(arms), figsize=(4.2 * len(arms) + 0.6, 6.5), sharex=True, squeeze=False)
    for column, arm in enumerate(arms):
        x = [m["step"] for m in metrics[arm]]
        top, bottom = axes[0, column], axes[1, column]
        for k in range(steps):
            losses = [math.nan if m[f"loss_{k}"] is None else m[f"loss_{k}"] for m in metrics[arm]]
            top.plot(x, losses, color=colors[k], label=f"step {k}")  # a window without loss tokens: a gap
            bottom.plot(x, [m[f"acc_{k}"] for m in metrics[arm]], color=colors[k], label=f"step {k}")
        top.set_title(arm, fontsize=10)
        top.set_yscale("log")
        bottom.set_ylim(0, 1)
        bottom.set_xlabel("optimizer step")
        for axis in (top, bottom):
            axis.grid(alpha=0.3)
    axes[0, 0].set_ylabel("cross-entropy per TTT step")
    axes[1, 0].set_ylabel("acc_k: draft argmax = target argmax")
    axes[0, -1].legend(fontsize=8, loc="upper right")
    return _finish(fig, path)


def finetune_arms(
    metrics: dict[str, list[dict]], chance_loss: float, path: str | os.PathLike | None = None
) -> Figure:
    """The arms side by side over training: step-0 loss against ln(Vd), acc_0, and the predicted τ."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for arm, curve in metrics.items():
        x = [m["step"] for m in curve]
        for axis, key in zip(axes, ("loss_0", "acc_0", "tau"), strict=True):
            axis.plot(x, [math.nan if m[key] is None else m[key] for m in curve], label=arm)
    axes[0].axhline(chance_loss, color="crimson", linestyle="--", linewidth=1, label="ln(Vd): uniform guess")
    axes[0].set_ylabel("cross-entropy, TTT step 0")
    axes[1].set_ylabel("acc_0")
    axes[1].set_ylim(0, 1)
    axes[2].set_ylabel("predicted τ = 1 + Σ_k full_acc_k")
    for axis in axes:
        axis.set_xlabel("optimizer step")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("same data, same budget: how each starting point trains", fontsize=11)
    return _finish(fig, path)


def step0_check(checks: dict[str, dict], path: str | os.PathLike | None = None) -> Figure:
    """Where each arm starts: loss_0 against ln(Vd), acc_0 against always proposing the commonest token."""
    arms = list(checks)
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(8.0, 2.6 * len(arms) + 3), 4))
    colors = ["grey" if not checks[a]["warm_start"] else "tab:green" if checks[a]["passed"] else "crimson"
              for a in arms]
    bars = left.bar(arms, [checks[a]["loss_0"] for a in arms], color=colors)
    left.bar_label(bars, fmt="%.2f", fontsize=8)
    left.axhline(checks[arms[0]]["chance_loss"], color="black", linestyle="--", linewidth=1,
                 label=f"ln(Vd) = {checks[arms[0]]['chance_loss']:.2f}")
    left.set_ylabel("cross-entropy before training (step 0)")
    left.legend(fontsize=8)
    bars = right.bar(arms, [checks[a]["acc_0"] for a in arms], color=colors)
    right.bar_label(bars, fmt="%.3f", fontsize=8)
    right.axhline(max(checks[a]["baseline_acc"] for a in arms), color="black", linestyle="--", linewidth=1,
                  label="always the commonest token")
    right.set_ylabel("acc_0 before training")
    right.legend(fontsize=8)
    for axis in (left, right):
        axis.tick_params(axis="x", labelrotation=15)
    fig.suptitle("step-0 check (green: warm start passed, red: warm start failed, grey: fresh drafter)",
                 fontsize=11)
    return _finish(fig, path)
