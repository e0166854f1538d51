"""A run's `summary.md` and HTML renderings, built from what the executed notebooks recorded.

Every number here is read from `metrics.json` or from the executed notebooks themselves (the text
their "What we found" cell printed); nothing is retyped. Each step's figures are the PNGs in its folder.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from eagle3lib import files, runs
from eagle3lib.decoding.evaluate import summary_lines, tau_text


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def key_numbers(metrics: dict) -> list[str]:
    """The experiment's answer in a few lines and tables: map agreement, remap, arms, τ per drafter."""
    lines: list[str] = []
    diff = metrics.get(runs.DIFF_VOCAB_MAPS, {})
    if "positions_equal" in diff:
        lines.append(
            f"- Map agreement: {diff['positions_equal']:,} of {diff['positions_compared']:,} draft positions "
            f"agree (first divergence at {diff['first_divergence']}); {diff['intersection']:,} tokens "
            f"shared, {diff['only_in_a']:,} only in map A, {diff['only_in_b']:,} only in map B."
        )
    remap = metrics.get(runs.REMAP_LM_HEAD, {})
    if "moved" in remap:
        proof = remap.get("proof") or {}
        verdict = "passed" if proof.get("passed") else "FAILED"
        lines.append(
            f"- Remap: {remap['moved']:,} rows moved, {remap['in_place']:,} in place, {remap['filled']:,} "
            f"filled ({remap['missing']}), {remap['dropped']:,} dropped; proof: max |logit difference| "
            f"{proof.get('max_abs_diff')} over the shared tokens ({verdict})."
        )
    probe = metrics.get(runs.PROBE_DRAFTER, {})
    if "tau" in probe:
        lines.append(f"- Probe of the source drafter ({probe['backend']}, {probe['steps']} steps): "
                     f"τ {tau_text(probe)}.")
    arms = metrics.get(runs.FINETUNE, {}).get("arms", {})
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
    lines += summary_lines(metrics.get(runs.EVALUATE, {}))
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
    lines += ["## Made with", "", *made_with(metrics), ""]
    path = run_dir / "summary.md"
    files.atomic_write_text(path, "\n".join(lines))
    return path


def made_with(metrics: dict) -> list[str]:
    """The commit and package versions each notebook ran with (recorded by `eagle3 run` as it started it), a
    column per set; notebooks executed otherwise recorded none, and then this summary's own are given."""
    records = metrics.get("provenance") or []
    if not records:
        return ["Not recorded (these notebooks were not executed by `eagle3 run`); this summary was written "
                "with:", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in runs.provenance().items()]]
    facts = list(dict.fromkeys(key for record in records for key in record if key != "notebooks"))
    lines = ["| | " + " | ".join(", ".join(record["notebooks"]) for record in records) + " |",
             "|---" * (len(records) + 1) + "|"]
    lines += [f"| {fact} | " + " | ".join(str(record.get(fact, "–")) for record in records) + " |"
              for fact in facts]
    return lines


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
    """`<run_dir>/index.html`, the run's front page: summary.md (write_summary) rendered, its figures
    inline and links to each notebook's HTML page (render_html)."""
    import html

    import mistune

    summary = run_dir / "summary.md"
    if not summary.is_file():
        raise FileNotFoundError(f"{summary} is missing: the front page is rendered from it (write_summary)")
    body = mistune.create_markdown(plugins=["table"])(summary.read_text())
    path = run_dir / "index.html"
    files.atomic_write_text(path, PAGE.format(title=html.escape(f"eagle3lib run {run_dir.name}"), body=body))
    return path


def latest_run(outputs_dir: Path | None = None) -> Path:
    """The run folder whose summary.md is the newest: `eagle3 run` writes it when it ends (so a run still in
    its first invocation is passed over), `eagle3 report` when it renders a run again."""
    outputs_dir = outputs_dir or runs.OUTPUTS_DIR
    finished = sorted(outputs_dir.glob("*/summary.md"), key=lambda path: path.stat().st_mtime)
    if not finished:
        raise FileNotFoundError(f"no finished run under {outputs_dir}: none holds a summary.md yet")
    return finished[-1].parent


# ---------------------------------------------------------------- the run as a reader sees it

# A tqdm update: "40%|████", "16/40 [00:03<00:05", "7.62it/s]". One final line per loop is what a report
# keeps (eagle3lib.progress); two allow for a loop nested in another.
PROGRESS_UPDATE = re.compile(r"\d%\||\d+/\d+ \[\d|\d(?:it|s)/s\]")
MAX_PROGRESS_LINES = 2
# How `warnings` prints a warning: "<file>:<line>: <Category>: <message>".
PYTHON_WARNING = re.compile(r"^\S.*?:\d+: (\w*Warning): (.*)$", re.MULTILINE)
# Warnings that say nothing to a reader of the report (silenced where they arise; flagged if they return).
NOISE = {"TqdmWarning": "IProgress not found", "TqdmExperimentalWarning": ""}
WIDGET = "application/vnd.jupyter.widget-view+json"


def _output_problems(where: str, output: dict) -> list[str]:
    kind = output.get("output_type")
    if kind == "stream":
        text = output.get("text", "")
    elif kind in ("display_data", "execute_result"):
        if WIDGET in output.get("data", {}):
            return [f"{where}: a widget (a live progress bar?), which the saved report cannot show"]
        text = output.get("data", {}).get("text/plain", "")
    else:  # errors stay visible: they are the report of a failure
        return []
    problems = []
    updates = [line for line in text.replace("\r", "\n").splitlines() if PROGRESS_UPDATE.search(line)]
    if len(updates) > MAX_PROGRESS_LINES or "\r" in text:
        problems.append(f"{where}: {len(updates)} lines of progress updates, e.g. {updates[:2]}")
    if output.get("name") == "stderr":
        warned = PYTHON_WARNING.findall(text)
        noise = [f"{category}: {message}" for category, message in warned
                 if category in NOISE and NOISE[category] in message]
        if noise:
            problems.append(f"{where}: a warning that tells the reader nothing: {noise[0]}")
        elif not warned and not problems:
            problems.append(f"{where}: stderr that is not a warning: {text.strip()[:200]!r}")
    return problems


def notebook_problems(notebook: Path) -> list[str]:
    """What keeps a reader of one executed notebook from its results: walls of progress updates, widgets,
    stderr other than real warnings (Python warnings that are not known noise)."""
    import nbformat

    problems = []
    for number, cell in enumerate(nbformat.read(notebook, as_version=4).cells):
        for output in cell.get("outputs", []):
            problems += _output_problems(f"{notebook.name} cell {number}", output)
    return problems


class _References(HTMLParser):
    """Every src= and href= of a page, with its tag."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, str]] = []

    def handle_starttag(self, tag, attrs):
        self.found += [(tag, value) for name, value in attrs if name in ("src", "href") and value]


def link_problems(page: Path) -> list[str]:
    """References of an HTML page that do not resolve: a relative link or image whose file is missing or
    empty, an embedded (data:) image without data. Links to other sites are not followed."""
    import base64
    from urllib.parse import unquote, urlsplit

    parser = _References()
    parser.feed(page.read_text())
    problems = []
    for tag, reference in parser.found:
        parts = urlsplit(reference)
        if parts.scheme == "data":
            payload = reference.partition(",")[2]
            data = base64.b64decode(payload) if ";base64" in reference.partition(",")[0] else payload
            if not data:
                problems.append(f"{page.name}: an empty embedded <{tag}>")
        elif not parts.scheme and not parts.netloc and parts.path:
            target = page.parent / unquote(parts.path)
            if not target.is_file() or target.stat().st_size == 0:
                state = "empty" if target.is_file() else "missing"
                problems.append(f"{page.name}: <{tag}> {reference} is {state}")
    return problems


def reader_problems(run_dir: Path) -> list[str]:
    """Everything `notebook_problems` and `link_problems` find in a rendered run (its executed notebooks,
    html/ pages and index.html), and notebook pages or figures the front page does not show."""
    index = run_dir / "index.html"
    if not index.is_file():
        return [f"{index} is missing (report.render_index)"]
    notebooks = sorted(run_dir.glob("[0-9][0-9]_*.ipynb"))
    pages = [run_dir / "html" / f"{notebook.stem}.html" for notebook in notebooks]
    problems = [f"{page} is missing (report.render_html)" for page in pages if not page.is_file()]
    for notebook in notebooks:
        problems += notebook_problems(notebook)
    for page in [index, *(page for page in pages if page.is_file())]:
        problems += link_problems(page)
    parser = _References()
    parser.feed(index.read_text())
    shown = {reference for _, reference in parser.found}
    figures = [figure.relative_to(run_dir).as_posix()
               for notebook in notebooks for figure in sorted((run_dir / notebook.stem).glob("*.png"))]
    problems += [f"index.html does not link {page.relative_to(run_dir)}" for page in pages
                 if page.relative_to(run_dir).as_posix() not in shown]
    problems += [f"index.html does not show {figure}" for figure in figures if figure not in shown]
    return problems


# ---------------------------------------------------------------- screenshots

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]
SCREEN_WIDTH, SCREEN_HEIGHT = 1280, 2400  # about two screens: where a reader should meet the first figure
# Appended to a copy of a page: once it has loaded, the top of its first drawn image, in CSS pixels from the
# top of the page (-1: none), left on <body> for --dump-dom to show.
MEASURE_FIRST_FIGURE = """<script>window.addEventListener("load", () => {
  const drawn = [...document.images].filter((image) => image.naturalHeight > 0);
  const top = drawn.length ? drawn[0].getBoundingClientRect().top + window.scrollY : -1;
  document.body.setAttribute("data-first-figure", String(Math.round(top)));
});</script>"""


@dataclass(frozen=True)
class Screenshot:
    page: Path
    png: Path
    first_figure_px: int | None  # None: the page shows no figure

    @property
    def figure_on_screen(self) -> bool:
        return self.first_figure_px is not None and self.first_figure_px < SCREEN_HEIGHT


def is_blank(png: Path) -> bool:
    """True when nearly every pixel has one shade (a page that did not render), less than 0.1 % drawn."""
    from PIL import Image

    with Image.open(png) as image:
        histogram = image.convert("L").histogram()
    return max(histogram) > 0.999 * sum(histogram)


def _chromium(chromium: str, page: Path, action: str, profile: Path) -> str:
    """Run headless Chromium once on `page` (a fresh profile: nothing carried over); its stdout, or
    RuntimeError naming the page."""
    import subprocess

    command = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
               f"--window-size={SCREEN_WIDTH},{SCREEN_HEIGHT}", action, page.resolve().as_uri()]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"{page} did not render: {chromium} ran over {err.timeout} s") from err
    if done.returncode != 0:
        raise RuntimeError(f"{page} did not render ({chromium} exit {done.returncode}): "
                           f"{done.stderr.strip()[-500:]}")
    return done.stdout


def first_figure_px(page: Path, chromium: str, work: Path) -> int | None:
    """Where a reader meets the page's first figure, in pixels from its top at SCREEN_WIDTH (None: none)."""
    copy = work / "measure.html"
    # <base>: the copy, elsewhere, still finds the page's relative images
    head = re.compile(r"<head[^>]*>", re.IGNORECASE)
    text = page.read_text()
    if not head.search(text) or "</body>" not in text:
        raise RuntimeError(f"{page} is not a whole HTML page (no <head> or </body>)")
    text = head.sub(lambda m: f'{m.group(0)}<base href="{page.parent.resolve().as_uri()}/">', text, count=1)
    copy.write_text(text.replace("</body>", MEASURE_FIRST_FIGURE + "</body>", 1))
    dom = _chromium(chromium, copy, "--dump-dom", work / "measure-profile")
    found = re.search(r'data-first-figure="(-?\d+)"', dom)
    if found is None:
        raise RuntimeError(f"{page}: Chromium did not finish loading it (no measurement in its DOM)")
    return None if int(found.group(1)) < 0 else int(found.group(1))


def screenshots(run_dir: Path, chromium: str = "chromium") -> list[Screenshot]:
    """Headless Chromium's view of index.html and each notebook page (the first SCREEN_HEIGHT pixels), as
    PNGs in `<run_dir>/screenshots/`, with where each page's first figure is; raises RuntimeError naming a
    page that did not render."""
    import shutil
    import tempfile

    if shutil.which(chromium) is None:
        raise RuntimeError(f"no {chromium} here: install it (Debian: apt-get install -y chromium) or pass "
                           "--chromium PATH")
    pages = [run_dir / "index.html", *sorted((run_dir / "html").glob("*.html"))]
    out = run_dir / "screenshots"
    out.mkdir(exist_ok=True)
    shots = []
    for page in pages:
        if not page.is_file():
            raise RuntimeError(f"{page} is missing: render the run first (eagle3 report)")
        png = out / f"{'index' if page.name == 'index.html' else page.stem}.png"
        with tempfile.TemporaryDirectory(prefix="eagle3-chromium-") as work:
            fresh = Path(work) / "shot.png"  # written here first, then renamed: no half-written shots
            _chromium(chromium, page, f"--screenshot={fresh}", Path(work) / "profile")
            if not fresh.is_file():
                raise RuntimeError(f"{page} did not render: {chromium} wrote no screenshot")
            if is_blank(fresh):
                raise RuntimeError(f"{page} rendered as a blank page in {chromium}")
            figure = first_figure_px(page, chromium, Path(work))
            os.replace(files.shareable(fresh), png)
        shots.append(Screenshot(page, png, figure))
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
        files.atomic_write_text(target, body)
        written.append(target)
    return written
