"""All six notebooks chained the way params/demo.yaml chains them, on tiny models: `eagle3 run`'s path.

params/smoke.yaml alone points 01-05 at fixtures so each notebook can run by itself; here the same
recipe is wired like the demo (the stand-in source drafter from 00, its map diffed and remapped, three
arms fine-tuned from it, all evaluated) through "@step/..." run-relative paths.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat

import pytest
import torch

from eagle3lib import cli, files, runs
from eagle3lib.drafter.checkpoint import load_drafter
from eagle3lib.params import load_params
from eagle3lib.reports import publish, report

SOURCE = "@00_prepare_data/source_drafter"
CHAINED = {
    "stand_in": {"steps": 4},
    "vocab": {"map_b": "", "counts": "", "label_a": "source drafter", "label_b": "new map"},
    "remap": {"source_drafter": SOURCE, "missing": "verifier", "target": "@00_prepare_data"},
    "probe": {"drafter": SOURCE, "corpus": "stdlib-code"},
    "evaluate": {"drafters": [
        {"name": "source as-is", "path": SOURCE},
        {"name": "remapped warm start", "path": "@04_finetune/drafter/drafter"},
        {"name": "warm start without remap", "path": "@04_finetune/drafter-no-remap/drafter"},
        {"name": "scratch", "path": "@04_finetune/scratch/drafter"},
    ], "benchmarks": [
        {"name": "code", "corpus": "stdlib-code", "num_prompts": 2},
        {"name": "two-turn", "corpus": "tests/fixtures/benchmarks/questions.jsonl"},  # MT-Bench's form
        {"name": "humaneval", "corpus": "humaneval", "num_prompts": 2},
    ]},
    # zoo:tiny-llama is random, so no warm start can beat chance on its data: the check is reported only
    "train": {"arms": ["drafter", "drafter-no-remap", "scratch"], "drafter": SOURCE, "allow_no_remap": True,
              "check_enforce": False, "steps": 4, "checkpoint_every": 2},
}


pytestmark = pytest.mark.usefixtures("one_thread_kernels")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """The chained smoke run, executed once (minutes) for every test of this module that reads it."""
    folder = tmp_path_factory.mktemp("smoke")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EAGLE3LIB_CACHE", str(folder / "cache"))  # the stand-in is trained, not reused
        patch.setenv("OMP_NUM_THREADS", "1")  # one_thread_kernels, for a fixture that outlives one test
        return runs.run_notebooks("params/smoke.yaml", folder / "run", CHAINED)


def test_smoke_recipe_runs_all_six_notebooks_chained(smoke_run, tmp_path):
    run_dir = smoke_run
    metrics = runs.read_metrics(run_dir)
    steps = [p.stem for p in runs.notebook_paths()]
    assert list(metrics["wall_seconds"]) == steps
    assert set(steps) <= set(metrics)

    source = run_dir / "00_prepare_data" / "source_drafter"
    assert metrics["00_prepare_data"]["stand_in"]["steps"] == 4 and (source / "config.json").is_file()
    assert metrics["01_probe_drafter"]["drafter"] == str(source)
    assert metrics["01_probe_drafter"]["matches_target"] == 1.0  # greedy speculation is lossless
    diff = metrics["02_diff_vocab_maps"]
    assert diff["positions_compared"] == load_params("params/smoke.yaml")["data"]["draft_vocab_size"]
    assert diff["positions_equal"] < diff["positions_compared"]  # prose and code maps differ
    remap = metrics["03_remap_lm_head"]
    assert remap["proof"]["passed"] and remap["proof"]["max_abs_diff"] == 0.0
    assert remap["shared"] == diff["intersection"]
    assert set(metrics["04_finetune"]["arms"]) == {"drafter", "drafter-no-remap", "scratch"}
    for arm in metrics["04_finetune"]["arms"]:  # packed rows: nearly every computed position a real token
        logged = files.read_json_lines(run_dir / "04_finetune" / arm / "metrics.jsonl")
        assert logged and all(line["real_fraction"] >= 0.9 for line in logged), arm
    evaluation = metrics["05_evaluate"]
    assert list(evaluation["benchmarks"]) == ["code", "two-turn", "humaneval"]
    assert evaluation["prompts"] == {"code": 2, "two-turn": 4, "humaneval": 2}  # both turns of 2 questions
    assert "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in \
        evaluation["setting"] and "vLLM num_speculative_tokens 3" in evaluation["setting"]
    for evaluated in evaluation["benchmarks"].values():
        assert list(evaluated) == [entry["name"] for entry in CHAINED["evaluate"]["drafters"]]
        assert all(d["replayed"] for d in evaluated.values())  # greedy: replayed against the target
        assert all(d["tau_low"] <= d["tau"] <= d["tau_high"] and d["tau_interval_unit"] == "rounds"
                   for d in evaluated.values())  # 2 or 4 prompts: too few to resample prompts
        # every pair of the 4 drafters on the same prompts, per benchmark
    assert [len(found) for found in evaluation["comparisons"].values()] == [6, 6, 6]
    evaluated = evaluation["benchmarks"]["code"]
    assert set(evaluation["best_setting"]) == set(evaluated)
    assert set(evaluation["calibration"]) == {"remapped warm start", "warm start without remap", "scratch"}
    assert all((run_dir / figure).stat().st_size > 0 for figure in evaluation["figures"])

    # the scratch arm published as the repository ships drafters: bfloat16, provenance, a checked hash
    published = publish.publish(run_dir, "scratch", tmp_path / "published", command="pytest")
    record = publish.verify(published)
    assert record["command"] == "pytest" and record["steps"] == 4 and len(record["training_curve"]) == 2
    assert record["commit"] == metrics["provenance"][-1]["git commit"]  # the commit that ran 04
    assert record["measured"]["benchmarks"]["code"]["scratch"]["tau"] == evaluated["scratch"]["tau"]
    drafter, load_report = load_drafter(published, strict=True)
    assert drafter.lm_head.weight.dtype == torch.bfloat16 and not load_report.missing
    weights = published / "model.safetensors"
    stored = weights.read_bytes()
    weights.write_bytes(stored[:-1] + bytes([stored[-1] ^ 0xFF]))  # one changed byte
    with pytest.raises(ValueError, match="SHA-256"):
        publish.verify(published)

    summary = report.write_summary(run_dir).read_text()
    assert f"{diff['positions_equal']:,} of {diff['positions_compared']:,} draft positions agree" in summary
    assert "| warm start without remap |" in summary and "| drafter-no-remap |" in summary
    assert "| drafter | code (2) | two-turn (4) | humaneval (2) | mean τ |" in summary
    assert "## What we found" not in summary and "05_evaluate" in summary


def test_the_smoke_run_reads_as_a_report(smoke_run):
    """The executed notebooks, their HTML pages and the front page as a reader meets them."""
    run_dir = smoke_run
    report.write_summary(run_dir)
    pages = report.render_html(run_dir)
    index = report.render_index(run_dir)
    assert report.reader_problems(run_dir) == []

    # what the check passed is there: every notebook's page, every figure, one line per training loop
    notebooks = [p.stem for p in runs.notebook_paths()]
    assert [page.stem for page in pages] == notebooks
    front = index.read_text()
    figures = sorted(run_dir.glob("0[0-9]_*/*.png"))
    assert len(figures) >= 6 and all(f'src="{f.relative_to(run_dir)}"' in front for f in figures)
    assert all(f'href="html/{name}.html"' in front for name in notebooks)
    made_with = runs.read_metrics(run_dir)["provenance"]  # one record, or more if a commit came mid-run
    assert sorted(name for record in made_with for name in record["notebooks"]) == notebooks
    for record in made_with:
        assert re.fullmatch(r"[0-9a-f]{40}(\+changes)?", record["git commit"])
        assert record["git commit"] in front
        assert f"| transformers | {record['transformers']} |" in (run_dir / "summary.md").read_text()
    finetune = (run_dir / "04_finetune.ipynb").read_text()
    for arm in CHAINED["train"]["arms"]:
        assert len(re.findall(rf"{arm}: 4 steps in \d+:\d\d, loss [\d.]+, acc_0 [\d.]+ %", finetune)) == 1
    assert "capture stdlib-code: " in (run_dir / "00_prepare_data.ipynb").read_text()

    # readable by others: the umask's permissions, not a temporary file's 0600
    umask = os.umask(0)
    os.umask(umask)
    shared = [index, *pages, run_dir / "summary.md", run_dir / "metrics.json", *figures,
              run_dir / "04_finetune" / "scratch" / "drafter" / "model.safetensors"]
    modes = {str(path.relative_to(run_dir)): stat.S_IMODE(path.stat().st_mode) for path in shared}
    assert modes == {name: 0o666 & ~umask for name in modes}
    folders = [run_dir / "html", run_dir / "04_finetune" / "scratch" / "drafter"]
    assert all(stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask for folder in folders)


def test_curve_measures_every_checkpoint_against_the_tokens_it_had_trained_on(smoke_run, tmp_path):
    arm = shutil.copytree(smoke_run / "04_finetune" / "scratch", tmp_path / "scratch")
    assert cli.main(["curve", str(arm), "--target", "zoo:tiny-llama", "--benchmark", "stdlib-code:2",
                     "--max-new-tokens", "8", "--batch-size", "2"]) == 0
    curve = json.loads((arm / "learning_curve.json").read_text())
    logged = [json.loads(line) for line in (arm / "metrics.jsonl").read_text().splitlines()]
    rows = curve["benchmarks"]["stdlib-code"]
    assert [row["step"] for row in rows] == [2, 4]  # the checkpoint, then the final drafter
    assert [row["loss_tokens"] for row in rows] == [logged[0]["rows"], logged[0]["rows"] + logged[1]["rows"]]
    assert all(row["tau_low"] <= row["tau"] <= row["tau_high"] for row in rows)
    assert curve["prompts"] == {"stdlib-code": 2} and curve["max_new_tokens"] == 8 and curve["machine"]
    assert (arm / "learning_curve.png").stat().st_size > 0
    published = publish.publish(smoke_run, "scratch", tmp_path / "published", command="pytest")
    assert publish.verify(published)["learning_curve"] is None  # the run's own arm was not measured
    # a curve travels with the drafter published from the arm it was measured on
    run = shutil.copytree(smoke_run, tmp_path / "run", ignore=shutil.ignore_patterns("*.ipynb", "html"))
    shutil.copy(arm / "learning_curve.json", run / "04_finetune" / "scratch")
    published = publish.publish(run, "scratch", tmp_path / "with-curve", command="pytest")
    assert publish.verify(published)["learning_curve"] == curve


def test_cli_run_reports_a_failing_notebook(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runs, "OUTPUTS_DIR", tmp_path)
    # 02 needs 00's map when vocab.map_b is empty; running it alone must fail with the notebook's name
    code = cli.main(["run", "params/smoke.yaml", "--only", "02", "--name", "alone", "-p", "vocab.map_b="])
    err = capsys.readouterr()
    assert code == 1
    assert "02_diff_vocab_maps.ipynb failed in cell" in err.err
    assert str(tmp_path / "alone" / "02_diff_vocab_maps.ipynb") in err.err
    assert (tmp_path / "alone" / "summary.md").is_file()
    assert err.out.splitlines()[-1] == f"eagle3 run: front page {tmp_path / 'alone' / 'index.html'}"
    assert (tmp_path / "alone" / "html" / "02_diff_vocab_maps.html").is_file()  # the failure, readable
