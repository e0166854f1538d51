"""A run's `summary.md` and HTML renderings, built from what the executed notebooks recorded.

Every number here is read from `metrics.json` or from the executed notebooks themselves (the text
their "What we found" cell printed); nothing is retyped. Each step's figures are the PNGs in its folder.
"""

from __future__ import annotations

from pathlib import Path

from eagle3lib import runs
from eagle3lib.evaluate import tau_text


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def key_numbers(metrics: dict) -> list[str]:
    """The experiment's answer in a few lines and tables: map agreement, remap, arms, τ per drafter."""
    lines: list[str] = []
    diff = metrics.get("02_diff_vocab_maps", {})
    if "positions_equal" in diff:
        lines.append(
            f"- Map agreement: {diff['positions_equal']:,} of {diff['positions_compared']:,} draft positions "
            f"agree (first divergence at {diff['first_divergence']}); {diff['intersection']:,} tokens "
            f"shared, {diff['only_in_a']:,} only in map A, {diff['only_in_b']:,} only in map B."
        )
    remap = metrics.get("03_remap_lm_head", {})
    if "moved" in remap:
        proof = remap.get("proof") or {}
        verdict = "passed" if proof.get("passed") else "FAILED"
        lines.append(
            f"- Remap: {remap['moved']:,} rows moved, {remap['in_place']:,} in place, {remap['filled']:,} "
            f"filled ({remap['missing']}), {remap['dropped']:,} dropped; proof: max |logit difference| "
            f"{proof.get('max_abs_diff')} over the shared tokens ({verdict})."
        )
    probe = metrics.get("01_probe_drafter", {})
    if "tau" in probe:
        lines.append(f"- Probe of the source drafter ({probe['backend']}, {probe['steps']} steps): "
                     f"τ {tau_text(probe)}.")
    arms = metrics.get("04_finetune", {}).get("arms", {})
    if arms:
        lines += ["", "| fine-tuning arm | loss_0 at step 0 | acc_0 at step 0 | step-0 check | loss_0 at end "
                  "| acc_0 at end | predicted τ |", "|---|---|---|---|---|---|---|"]
        for name, arm in arms.items():
            check = {True: "passed", False: "FAILED"}.get(arm.get("check_passed"), "–")
            if name == "scratch":
                check = "reference only"
            elif name == "drafter-no-remap" and arm.get("check_passed") is False:
                check = "failed: the bug, reproduced"
            lines.append(
                f"| {name} | {_fmt(arm['initial_loss'])} | {_fmt(arm['initial_acc_0'])} | {check} | "
                f"{_fmt(arm['final_loss'])} | {_fmt(arm['final_acc_0'])} | {_fmt(arm['predicted_tau'])} |"
            )
    evaluate = metrics.get("05_evaluate", {})
    if evaluate.get("drafters"):
        best = evaluate.get("best_setting", {})
        calibration = evaluate.get("calibration", {})
        setting = f"{evaluate['backend']}, K {evaluate['steps']}, {evaluate.get('prompts', '?')} prompts"
        lines += ["", f"| drafter ({setting}) | τ [95 % interval] | speedup | fastest setting (τ, speedup) "
                  "| predicted τ |",
                  "|---|---|---|---|---|"]
        for name, d in evaluate["drafters"].items():
            fastest = (f"{best[name]['setting']} ({best[name]['tau']:.2f}, {best[name]['speedup']:.2f}x)"
                       if name in best else "–")
            row = calibration.get(name)
            predicted = f"{row['predicted_tau']:.2f} ({row['relative_error']:+.0%})" if row else "–"
            speedup = f"{d['speedup']:.2f}x" if "speedup" in d else "–"
            lines.append(f"| {name} | {tau_text(d)} | {speedup} | {fastest} | {predicted} |")
        if evaluate.get("comparisons"):
            lines += ["", "Paired comparisons on the same prompts (95 % bootstrap intervals):", ""]
            lines += [f"- {sentence}" for sentence in evaluate["comparisons"]]
    return lines



def findings(notebook: Path) -> str:
    """What the executed notebook printed under its "What we found" heading ("" if it did not get there)."""
    import nbformat

    cells = nbformat.read(notebook, as_version=4).cells
    headings = [i for i, c in enumerate(cells)
                if c.cell_type == "markdown" and c.source.strip().lower().startswith("## what we found")]
    heading = headings[0] if headings else None
    if heading is None:
        return ""
    return "\n".join(
        output.get("text", "").strip()
        for cell in cells[heading + 1:] if cell.cell_type == "code"
        for output in cell.get("outputs", []) if output.get("output_type") == "stream"
    ).strip()


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
    for notebook in sorted(run_dir.glob("[0-9][0-9]_*.ipynb")):
        step = notebook.stem
        report = f"Report: [{notebook.name}]({notebook.name}), [HTML](html/{step}.html)"
        lines += [f"## {step}", "", report, ""]
        found = findings(notebook)
        if found:
            lines += [found, ""]
        figures = sorted((run_dir / step).glob("*.png"))
        lines += [f"![{fig.stem}]({fig.relative_to(run_dir)})" for fig in figures]
        lines.append("")
    lines += ["## Parameters", "", "```yaml", params.rstrip(), "```", ""]
    lines += ["## Made with", "", *[f"- {name}: {version}" for name, version in provenance().items()], ""]
    path = run_dir / "summary.md"
    runs.atomic_write_text(path, "\n".join(lines))
    return path


def provenance() -> dict[str, str]:
    """The code and packages that produced a run (read when its summary is written)."""
    import sys
    from importlib.metadata import PackageNotFoundError, version

    found = {"git commit": runs.git_commit(), "python": sys.version.split()[0]}
    for package in ("torch", "transformers", "safetensors", "papermill"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 70rem; margin: 2rem auto; padding: 0 1rem; }}
img {{ max-width: 100%; border: 1px solid #ddd; margin: 0.5rem 0; }}
table {{ border-collapse: collapse; margin: 0.8rem 0; }}
th, td {{ border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: left; }}
pre {{ background: #f6f6f6; padding: 0.8rem; overflow-x: auto; }}
</style></head>
<body>
{body}
</body></html>
"""


def render_index(run_dir: Path) -> Path:
    """`<run_dir>/index.html`: the run's front page, summary.md rendered with its figures inline and links
    to each notebook's HTML page."""
    import mistune

    summary = (run_dir / "summary.md").read_text()
    body = mistune.create_markdown(plugins=["table"])(summary)
    path = run_dir / "index.html"
    runs.atomic_write_text(path, PAGE.format(title=f"eagle3lib run {run_dir.name}", body=body))
    return path


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]


def screenshots(run_dir: Path, chromium: str = "chromium", height: int = 2400) -> list[Path]:
    """Headless Chromium's view of index.html and each notebook page, as PNGs in `<run_dir>/screenshots/`;
    raises RuntimeError naming the page that did not render."""
    import subprocess
    import tempfile

    pages = [run_dir / "index.html", *sorted((run_dir / "html").glob("*.html"))]
    out = run_dir / "screenshots"
    out.mkdir(exist_ok=True)
    shots = []
    for page in pages:
        shot = out / f"{page.stem}.png"
        with tempfile.TemporaryDirectory(prefix="eagle3-chromium-") as profile:
            done = subprocess.run(
                [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size=1280,{height}",
                 f"--screenshot={shot}", page.resolve().as_uri()],
                capture_output=True, text=True, timeout=120,
            )
        if done.returncode != 0 or not shot.is_file() or shot.stat().st_size < 10_000:
            raise RuntimeError(f"{page} did not render (chromium exit {done.returncode}): "
                               f"{done.stderr[-500:]}")
        shots.append(shot)
    return shots


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
