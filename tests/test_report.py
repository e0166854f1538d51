"""summary.md takes its numbers from metrics.json and its findings from the executed notebooks."""

from __future__ import annotations

import json
import os
import shutil

import matplotlib.figure
import nbformat
import pytest

from eagle3lib import cli, runs
from eagle3lib.params import load_params
from eagle3lib.reports import report


def executed_notebook(path, found_text: str):
    nb = nbformat.v4.new_notebook()
    printed = nbformat.v4.new_code_cell("print(sentence)")
    printed.outputs = [nbformat.v4.new_output("stream", name="stdout", text=found_text + "\n")]
    heading = nbformat.v4.new_markdown_cell("## What we found")
    nb.cells = [nbformat.v4.new_markdown_cell("# 02"), heading, printed]
    nbformat.write(nb, path)


def test_summary_holds_metrics_findings_figures_and_times(tmp_path):
    run = runs.Run.open(tmp_path, load_params())
    run.write_metrics("02_diff_vocab_maps", {"positions_equal": 22, "positions_compared": 2048,
                                             "first_divergence": 5, "intersection": 808, "only_in_a": 1240,
                                             "only_in_b": 1240})
    arm = {"initial_loss": 3.5, "initial_acc_0": 0.4, "final_loss": 2.0, "final_acc_0": 0.6,
           "predicted_tau": 1.9, "check_passed": True}
    run.write_metrics("04_finetune", {"arms": {"drafter": arm}})
    remapped = {"tau": 2.25, "tau_low": 2.1, "tau_high": 2.4, "speedup": 1.4, "decode_speedup": 1.8}
    run.write_metrics("05_evaluate", {
        "backend": "builtin", "steps": 3, "setting": "SGLang 3/1/4", "max_new_tokens": 64,
        "prompts": {"sharegpt": 16, "humaneval": 8},
        "benchmarks": {"sharegpt": {"fine-tuned with remap": remapped,
                                    "trained from scratch": {"tau": 1.5, "speedup": 0.9}},
                       "humaneval": {"fine-tuned with remap": {"tau": 2.75},
                                     "trained from scratch": {"tau": 1.7}}},
        "best_setting": {"fine-tuned with remap": {"setting": "chain K=2", "tau": 2.0, "speedup": 1.5,
                                                   "decode_speedup": 1.9}},
        "calibration": {"fine-tuned with remap": {"predicted_tau": 2.5, "relative_error": 0.111}},
        "comparisons": {"sharegpt": ["fine-tuned with remap > trained from scratch (τ difference +0.75)"]},
    })
    run.write_metrics("wall_seconds", {"02_diff_vocab_maps": 12.0})
    executed_notebook(tmp_path / "02_diff_vocab_maps.ipynb", "22 of 2,048 positions agree.")
    (tmp_path / "02_diff_vocab_maps").mkdir()
    (tmp_path / "02_diff_vocab_maps" / "coverage.png").write_bytes(b"png")

    text = report.write_summary(tmp_path).read_text()
    assert "22 of 2,048 draft positions agree (first divergence at 5)" in text
    assert "| drafter | 3.500 | 0.400 | passed | 2.000 | 0.600 | 1.900 |" in text
    assert "| drafter | sharegpt (16) | humaneval (8) | mean τ |" in text
    row = ("| fine-tuned with remap | 2.25 [2.10, 2.40] | 2.75 | 2.50 | 1.40x (1.80x in decoding) "
           "| chain K=2: 2.00, 1.50x (1.90x in decoding) | 2.50 (+11%) |")
    assert row in text
    assert "| trained from scratch | 1.50 | 1.70 | 1.60 | 0.90x | – | – |" in text
    assert "- sharegpt: fine-tuned with remap > trained from scratch (τ difference +0.75)" in text
    assert "22 of 2,048 positions agree." in text  # the executed notebook's own words
    assert "![coverage](02_diff_vocab_maps/coverage.png)" in text
    assert "| 02_diff_vocab_maps | 12.0 |" in text
    assert json.loads((tmp_path / "metrics.json").read_text())["05_evaluate"]["steps"] == 3
    html = report.render_html(tmp_path)
    assert [p.name for p in html] == ["02_diff_vocab_maps.html"] and "positions agree" in html[0].read_text()


def stream(name: str, text: str):
    return nbformat.v4.new_output("stream", name=name, text=text)


def test_reader_problems_name_progress_walls_noise_and_broken_figures_but_not_real_warnings(tmp_path):
    run = runs.Run.open(tmp_path, load_params())
    runs.record_provenance(run, ["04_finetune"])
    nb = nbformat.v4.new_notebook()
    cells = [nbformat.v4.new_code_cell(f"cell_{i}()") for i in range(8)]
    cells[0].outputs = [stream("stdout", "drafter: 40 steps in 2:13, loss 3.800, acc_0 33.8 %\n")]
    cells[1].outputs = [stream("stderr", "".join(f"\rdrafter:  {i}%|▍  | {i}/40 [00:0{i % 10}<00:10, 3.1it/s]"
                                                 for i in range(40)))]
    cells[2].outputs = [stream("stderr", "/x/tqdm/auto.py:21: TqdmWarning: IProgress not found. Please "
                                         "update jupyter.\n  from .autonotebook import tqdm\n")]
    cells[3].outputs = [stream("stderr", "/x/train.py:9: UserWarning: the step-0 check failed for drafter\n"
                                         "  warnings.warn(message)\n")]
    cells[4].outputs = [stream("stderr", "Loading weights: 100%|██████████| 272/272\n")]
    widget = {"text/plain": "  0%|     | 0/40", "application/vnd.jupyter.widget-view+json": {"model_id": "x"}}
    cells[5].outputs = [nbformat.v4.new_output("display_data", data=widget)]
    cells[6].outputs = [nbformat.v4.new_output("error", ename="ValueError", evalue="bad", traceback=[])]
    cells[7].outputs = [stream("stdout", "".join(f"step {i}: 1/4 [00:01<00:02, 7it/s]\n" for i in range(3)))]
    nb.cells = cells
    nbformat.write(nb, tmp_path / "04_finetune.ipynb")
    (tmp_path / "04_finetune").mkdir()
    (tmp_path / "04_finetune" / "curve.png").write_bytes(b"")  # a figure that was never drawn
    report.write_summary(tmp_path)
    report.render_html(tmp_path)
    report.render_index(tmp_path)

    problems = report.reader_problems(tmp_path)
    assert [p.split(":")[0] for p in problems] == [
        "04_finetune.ipynb cell 1", "04_finetune.ipynb cell 2", "04_finetune.ipynb cell 4",
        "04_finetune.ipynb cell 5", "04_finetune.ipynb cell 7", "index.html"], problems
    assert "40 lines of progress updates" in problems[0]
    assert "tells the reader nothing: TqdmWarning: IProgress not found" in problems[1]
    assert "stderr that is not a warning" in problems[2] and "widget" in problems[3]
    assert "3 lines of progress updates" in problems[4]  # a wall on stdout is still a wall
    assert problems[5] == "index.html: <img> 04_finetune/curve.png is empty"
    # the real warning (cell 3), the error (cell 6) and the final line (cell 0) stay, unflagged

    (tmp_path / "html" / "04_finetune.html").unlink()
    assert "html/04_finetune.html is missing (report.render_html)" in report.reader_problems(tmp_path)[0]


def test_the_front_page_shows_the_summary_with_its_figures_links_and_provenance(tmp_path):
    run = runs.Run.open(tmp_path, load_params())
    runs.record_provenance(run, ["02_diff_vocab_maps"])
    executed_notebook(tmp_path / "02_diff_vocab_maps.ipynb", "22 of 2,048 positions agree.")
    (tmp_path / "02_diff_vocab_maps").mkdir()
    figure = tmp_path / "02_diff_vocab_maps" / "coverage.png"
    figure.write_bytes(b"\x89PNG not empty")
    report.write_summary(tmp_path)
    report.render_html(tmp_path)
    page = report.render_index(tmp_path).read_text()
    assert '<img src="02_diff_vocab_maps/coverage.png" alt="coverage"' in page
    assert '<a href="html/02_diff_vocab_maps.html">HTML</a>' in page
    assert "22 of 2,048 positions agree." in page
    made_with = runs.read_metrics(tmp_path)["provenance"]
    assert made_with[0]["notebooks"] == ["02_diff_vocab_maps"]
    assert f"<td>{made_with[0]['git commit']}</td>" in page and "<td>torch</td>" in page
    assert report.reader_problems(tmp_path) == []


def test_the_latest_run_is_the_latest_finished_one(tmp_path):
    for name in ("older", "newer", "still-running"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "params.yaml").write_text("{}")
    (tmp_path / "newer" / "summary.md").write_text("# newer")
    (tmp_path / "older" / "summary.md").write_text("# older")
    os.utime(tmp_path / "older" / "summary.md", (1, 1))
    assert report.latest_run(tmp_path) == tmp_path / "newer"
    with pytest.raises(FileNotFoundError, match="no finished run under"):
        report.latest_run(tmp_path / "older")


def test_made_with_is_recorded_per_notebook_and_split_when_the_facts_change(tmp_path, monkeypatch):
    run = runs.Run.open(tmp_path, load_params())
    runs.record_provenance(run, ["00_prepare_data"])
    runs.record_provenance(run, ["01_probe_drafter"])
    assert [r["notebooks"] for r in runs.read_metrics(tmp_path)["provenance"]] == [
        ["00_prepare_data", "01_probe_drafter"]]
    monkeypatch.setattr(runs, "git_commit", lambda: "f" * 40)  # a commit between two `eagle3 run --only`
    runs.record_provenance(run, ["05_evaluate"])
    records = runs.read_metrics(tmp_path)["provenance"]
    assert [r["notebooks"] for r in records] == [["00_prepare_data", "01_probe_drafter"], ["05_evaluate"]]
    table = report.made_with(runs.read_metrics(tmp_path))
    assert table[0] == "| | 00_prepare_data, 01_probe_drafter | 05_evaluate |"
    assert f"| git commit | {records[0]['git commit']} | {'f' * 40} |" in table
    assert report.made_with({})[0].startswith("Not recorded (these notebooks were not executed by `eagle3")


@pytest.mark.skipif(shutil.which("chromium") is None, reason="no chromium (make report-check installs it)")
def test_screenshots_show_each_page_and_refuse_a_blank_one(tmp_path):
    runs.Run.open(tmp_path, load_params())
    executed_notebook(tmp_path / "02_diff_vocab_maps.ipynb", "22 of 2,048 positions agree.")
    (tmp_path / "02_diff_vocab_maps").mkdir()
    figure = matplotlib.figure.Figure(figsize=(4, 3))
    figure.gca().plot([0, 1], [1, 0])
    figure.savefig(tmp_path / "02_diff_vocab_maps" / "coverage.png")  # on the front page, not the notebook's
    report.write_summary(tmp_path)
    report.render_html(tmp_path)
    report.render_index(tmp_path)
    shots = report.screenshots(tmp_path)
    assert [s.png.name for s in shots] == ["index.png", "02_diff_vocab_maps.png"]
    assert all(not report.is_blank(shot.png) for shot in shots)
    assert shots[0].figure_on_screen and 0 < shots[0].first_figure_px < report.SCREEN_HEIGHT  # index: inline
    assert shots[1].first_figure_px is None and not shots[1].figure_on_screen  # the page has no figure
    (tmp_path / "html" / "02_diff_vocab_maps.html").write_text("<html><body></body></html>")
    with pytest.raises(RuntimeError, match="02_diff_vocab_maps.html rendered as a blank page"):
        report.screenshots(tmp_path)


def test_cli_report_renders_checks_and_names_what_is_wrong(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "outputs" / "myrun"
    runs.Run.open(run_dir, load_params())
    executed_notebook(run_dir / "02_diff_vocab_maps.ipynb", "22 of 2,048 positions agree.")
    (run_dir / "02_diff_vocab_maps").mkdir()
    (run_dir / "02_diff_vocab_maps" / "coverage.png").write_bytes(b"")
    monkeypatch.setattr(runs, "OUTPUTS_DIR", tmp_path / "outputs")

    assert cli.main(["report", "--check"]) == 2  # the latest finished run: none yet, so it must be named
    assert "no finished run under" in capsys.readouterr().err
    assert cli.main(["report", str(run_dir), "--check"]) == 1
    printed = capsys.readouterr()
    assert f"front page {run_dir / 'index.html'}" in printed.out and "1 problem(s)" in printed.out
    assert "index.html: <img> 02_diff_vocab_maps/coverage.png is empty" in printed.err
    (run_dir / "02_diff_vocab_maps" / "coverage.png").write_bytes(b"\x89PNG drawn")
    assert cli.main(["report", "--check"]) == 0  # now the latest finished run, and nothing wrong
    assert cli.main(["report", str(tmp_path), "--check"]) == 2
    assert "is not a run folder (no params.yaml)" in capsys.readouterr().err
