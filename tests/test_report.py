"""summary.md takes its numbers from metrics.json and its findings from the executed notebooks."""

from __future__ import annotations

import json

import nbformat

from eagle3lib import report, runs


def executed_notebook(path, found_text: str):
    nb = nbformat.v4.new_notebook()
    printed = nbformat.v4.new_code_cell("print(sentence)")
    printed.outputs = [nbformat.v4.new_output("stream", name="stdout", text=found_text + "\n")]
    heading = nbformat.v4.new_markdown_cell("## What we found")
    nb.cells = [nbformat.v4.new_markdown_cell("# 02"), heading, printed]
    nbformat.write(nb, path)


def test_summary_holds_metrics_findings_figures_and_times(tmp_path):
    run = runs.Run.open(tmp_path, runs.load_params())
    run.write_metrics("02_diff_vocab_maps", {"positions_equal": 22, "positions_compared": 2048,
                                             "first_divergence": 5, "intersection": 808, "only_in_a": 1240,
                                             "only_in_b": 1240})
    arm = {"initial_loss": 3.5, "initial_acc_0": 0.4, "final_loss": 2.0, "final_acc_0": 0.6,
           "predicted_tau": 1.9, "check_passed": True}
    run.write_metrics("04_finetune", {"arms": {"drafter": arm}})
    remapped = {"tau": 2.25, "tau_low": 2.1, "tau_high": 2.4, "speedup": 1.4}
    run.write_metrics("05_evaluate", {
        "backend": "builtin", "steps": 3, "prompts": 16,
        "drafters": {"fine-tuned with remap": remapped, "trained from scratch": {"tau": 1.5, "speedup": 0.9}},
        "best_setting": {"fine-tuned with remap": {"setting": "chain K=2", "tau": 2.0, "speedup": 1.5}},
        "calibration": {"fine-tuned with remap": {"predicted_tau": 2.5, "relative_error": 0.111}},
        "comparisons": ["fine-tuned with remap > trained from scratch (τ difference +0.75, ...)"],
    })
    run.write_metrics("wall_seconds", {"02_diff_vocab_maps": 12.0})
    executed_notebook(tmp_path / "02_diff_vocab_maps.ipynb", "22 of 2,048 positions agree.")
    (tmp_path / "02_diff_vocab_maps").mkdir()
    (tmp_path / "02_diff_vocab_maps" / "coverage.png").write_bytes(b"png")

    text = report.write_summary(tmp_path).read_text()
    assert "22 of 2,048 draft positions agree (first divergence at 5)" in text
    assert "| drafter | 3.500 | 0.400 | passed | 2.000 | 0.600 | 1.900 |" in text
    row = "| fine-tuned with remap | 2.25 [2.10, 2.40] | 1.40x | chain K=2 (2.00, 1.50x) | 2.50 (+11%) |"
    assert row in text
    assert "| trained from scratch | 1.50 | 0.90x | – | – |" in text
    assert "- fine-tuned with remap > trained from scratch (τ difference +0.75, ...)" in text
    assert "22 of 2,048 positions agree." in text  # the executed notebook's own words
    assert "![coverage](02_diff_vocab_maps/coverage.png)" in text
    assert "| 02_diff_vocab_maps | 12.0 |" in text
    assert json.loads((tmp_path / "metrics.json").read_text())["05_evaluate"]["steps"] == 3
    html = report.render_html(tmp_path)
    assert [p.name for p in html] == ["02_diff_vocab_maps.html"] and "positions agree" in html[0].read_text()
