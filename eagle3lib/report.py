"""A run's `summary.md` and HTML renderings, built from what the executed notebooks recorded.

Every number here is read from `metrics.json`, which the notebooks write; nothing is retyped.
A step's metrics may carry `found` (the sentence its "What we found" cell printed) and
`figures` (paths relative to the run folder); both are shown under the step's heading.
"""

from __future__ import annotations

from pathlib import Path

from eagle3lib import runs


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def key_numbers(metrics: dict) -> list[str]:
    """The experiment's answer in a few tables: map agreement, fine-tuning arms, τ per drafter."""
    lines: list[str] = []
    diff = metrics.get("02_diff_vocab_maps", {})
    if "positions_equal" in diff:
        lines += [
            f"- Map agreement: {diff['positions_equal']} of {diff['draft_vocab_size']} draft positions "
            f"agree; {diff['intersection']} tokens shared.",
        ]
    arms = metrics.get("04_finetune", {}).get("arms", {})
    if arms:
        lines += ["", "| fine-tuning arm | loss step 0 | acc_0 step 0 | loss end | acc_0 end | predicted τ |",
                  "|---|---|---|---|---|---|"]
        for name, arm in arms.items():
            lines.append(
                f"| {name} | {_fmt(arm['initial_loss'])} | {_fmt(arm['initial_acc_0'])} | "
                f"{_fmt(arm['final_loss'])} | {_fmt(arm['final_acc_0'])} | {_fmt(arm['predicted_tau'])} |"
            )
    drafters = metrics.get("05_evaluate", {}).get("drafters", {})
    if drafters:
        engines = sorted({engine for d in drafters.values() for engine in d.get("tau", {})})
        lines += ["", "| drafter | " + " | ".join(f"τ ({e})" for e in engines) + " | speedup |",
                  "|---|" + "---|" * (len(engines) + 1)]
        for name, d in drafters.items():
            taus = " | ".join(_fmt(d.get("tau", {}).get(e, "–")) for e in engines)
            lines.append(f"| {name} | {taus} | {_fmt(d.get('speedup', '–'))} |")
    return lines


def write_summary(run_dir: Path) -> Path:
    """Write `<run_dir>/summary.md` from its metrics.json; returns the path."""
    metrics = runs.read_metrics(run_dir)
    params = (run_dir / "params.yaml").read_text() if (run_dir / "params.yaml").exists() else ""
    lines = [f"# Run `{run_dir.name}`", ""]
    numbers = key_numbers(metrics)
    if numbers:
        lines += ["## Key numbers", "", *numbers, ""]
    walls = metrics.get("wall_seconds", {})
    if walls:
        lines += ["## Wall time", "", "| notebook | seconds |", "|---|---|"]
        lines += [f"| {name} | {seconds:.1f} |" for name, seconds in walls.items()]
        lines += [f"| total | {sum(walls.values()):.1f} |", ""]
    for step, values in metrics.items():
        if step == "wall_seconds" or not isinstance(values, dict):
            continue
        lines += [f"## {step}", "", f"Report: [{step}.ipynb]({step}.ipynb) ([HTML](html/{step}.html))", ""]
        if values.get("found"):
            lines += [values["found"], ""]
        lines += [f"![{Path(fig).stem}]({fig})" for fig in values.get("figures", [])]
        lines.append("")
    lines += ["## Parameters", "", "```yaml", params.rstrip(), "```", ""]
    path = run_dir / "summary.md"
    runs.atomic_write_text(path, "\n".join(lines))
    return path


def render_html(run_dir: Path) -> list[Path]:
    """Render each executed notebook of the run to `<run_dir>/html/<name>.html`."""
    import nbformat
    from nbconvert import HTMLExporter

    exporter = HTMLExporter()
    written = []
    for notebook in sorted(run_dir.glob("[0-9][0-9]_*.ipynb")):
        body, _ = exporter.from_notebook_node(nbformat.read(notebook, as_version=4))
        target = run_dir / "html" / f"{notebook.stem}.html"
        runs.atomic_write_text(target, body)
        written.append(target)
    return written
