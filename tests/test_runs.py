"""Params are strict, run folders are never overwritten, and notebooks run headless."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import threading
from types import SimpleNamespace

import nbformat
import pytest
import torch
import yaml
from safetensors.torch import save_file

from eagle3lib import cli, files, runs
from eagle3lib.data.layout import DataError
from eagle3lib.generation import capture
from eagle3lib.params import DEFAULTS, ParamsError, load_params, parse_override
from tests.notebook_harness import run_notebook


def write_yaml(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults_come_back_when_no_file_is_given():
    assert load_params() == DEFAULTS
    assert load_params() is not DEFAULTS


def test_misspelled_key_is_refused_naming_key_and_file(tmp_path):
    recipe = write_yaml(tmp_path / "typo.yaml", {"run": {"sed": 3}})
    with pytest.raises(ParamsError, match=r"typo\.yaml: unknown key 'run\.sed'"):
        load_params(recipe)


def test_unknown_section_is_refused(tmp_path):
    recipe = write_yaml(tmp_path / "typo.yaml", {"trian": {"steps": 3}})
    with pytest.raises(ParamsError, match="unknown key 'trian'"):
        load_params(recipe)


def test_wrong_type_is_refused(tmp_path):
    recipe = write_yaml(tmp_path / "bad.yaml", {"run": {"seed": "zero"}})
    with pytest.raises(ParamsError, match=r"bad\.yaml: key 'run\.seed' expects int"):
        load_params(recipe)


def test_overrides_apply_on_top_of_the_file(tmp_path):
    recipe = write_yaml(tmp_path / "r.yaml", {"run": {"seed": 3, "name": "x"}})
    params = load_params(recipe, ["run.seed=7"])
    assert params["run"] == {**DEFAULTS["run"], "seed": 7, "name": "x"}
    assert load_params(recipe, {"run": {"name": "y"}})["run"]["name"] == "y"
    with pytest.raises(ParamsError, match="unknown key 'run.seeed'"):
        load_params(recipe, ["run.seeed=1"])
    with pytest.raises(ParamsError, match="key=value"):
        parse_override("run.seed")


def test_every_committed_recipe_is_valid():
    recipes = sorted(files.REPO_ROOT.glob("params/*.yaml"))
    assert recipes, "params/ holds no recipe"
    for recipe in recipes:
        load_params(recipe)


def test_run_folder_keeps_previous_outputs(tmp_path):
    params = load_params()
    run = runs.Run.open(tmp_path / "run", params)
    step = run.step_dir("00_x")
    (step / "result.txt").write_text("first")
    with pytest.raises(runs.RunExistsError, match="previous run"):
        runs.Run.open(tmp_path / "run", params).step_dir("00_x")
    changed = load_params(overrides=["run.seed=5"])
    with pytest.raises(runs.RunExistsError, match="different params"):
        runs.Run.open(tmp_path / "run", changed)
    assert (step / "result.txt").read_text() == "first"
    again = runs.Run.open(tmp_path / "run", params, overwrite=True).step_dir("00_x")
    assert list(again.iterdir()) == []


def test_metrics_merge_by_step(tmp_path):
    run = runs.Run.open(tmp_path, load_params())
    run.write_metrics("a", {"x": 1})
    run.write_metrics("b", {"y": [1, 2]})
    assert runs.read_metrics(tmp_path) == {"a": {"x": 1}, "b": {"y": [1, 2]}}


def make_notebook(path, body: str):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell(
        'params_file = "params/smoke.yaml"\nrun_dir = "outputs/dev"\noverrides = {}\noverwrite = False'
    )
    params.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# probe"), params, nbformat.v4.new_code_cell(body)]
    nbformat.write(nb, path)
    return path


def test_harness_runs_a_notebook_with_injected_params(tmp_path):
    notebook = make_notebook(
        tmp_path / "99_probe.ipynb",
        "from eagle3lib import runs\n"
        "from eagle3lib.params import load_params\n"
        "params = load_params(params_file, overrides)\n"
        "run = runs.Run.open(run_dir, params, overwrite=overwrite)\n"
        "run.write_metrics('99_probe', {'seed': params['run']['seed'], 'name': params['run']['name']})",
    )
    metrics = run_notebook("99_probe", tmp_path / "run", overrides={"run": {"seed": 11}}, notebook=notebook)
    assert metrics == {"seed": 11, "name": "smoke"}
    assert (tmp_path / "run" / "99_probe.ipynb").exists()


def test_a_notebook_run_prints_no_kernel_log(tmp_path, capfd):
    notebook = make_notebook(tmp_path / "97_quiet.ipynb", "x = 1")
    runs.execute_notebook(notebook, tmp_path / "out.ipynb", {"run_dir": str(tmp_path)})
    printed = "".join(capfd.readouterr())
    assert "[IPKernelApp]" not in printed and "KeyboardInterrupt" not in printed


def test_failing_notebook_names_the_cell_and_the_partial_output(tmp_path):
    notebook = make_notebook(tmp_path / "98_fail.ipynb", "raise RuntimeError('boom')")
    output = tmp_path / "out.ipynb"
    with pytest.raises(runs.NotebookFailed) as err:
        runs.execute_notebook(notebook, output, {"run_dir": str(tmp_path)})
    assert "98_fail.ipynb" in str(err.value) and "RuntimeError: boom" in str(err.value)
    assert str(output) in str(err.value) and output.exists()


def test_cli_run_refuses_a_misspelled_key_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runs, "OUTPUTS_DIR", tmp_path / "outputs")
    recipe = write_yaml(tmp_path / "typo.yaml", {"run": {"nmae": "x"}})
    assert cli.main(["run", str(recipe)]) == 2
    assert "unknown key 'run.nmae'" in capsys.readouterr().err
    assert not (tmp_path / "outputs").exists()


def test_run_relative_paths_resolve_into_the_run_folder(tmp_path):
    params = load_params(overrides={"run": {"name": "@not-a-path-key-but-resolved"}})
    params["evaluate"] = {"drafters": [{"name": "a", "path": "@04_finetune/scratch/drafter"}]}
    run = runs.Run(tmp_path, params)
    assert run.params["evaluate"]["drafters"][0]["path"] == str(tmp_path / "04_finetune/scratch/drafter")
    assert params["evaluate"]["drafters"][0]["path"] == "@04_finetune/scratch/drafter", "input left as it was"


def test_written_files_and_folders_follow_the_umask(tmp_path):
    """Reports and checkpoints are shared: not the private modes mkstemp/mkdtemp give (0600/0700)."""
    old = os.umask(0o022)
    try:
        files.atomic_write_text(tmp_path / "summary.md", "text")
        with files.staged_folder(tmp_path / "drafter") as staging:
            (staging / "config.json").write_text("{}")
            save_file({"weight": torch.zeros(2)}, staging / "model.safetensors")  # safetensors writes 0600
    finally:
        os.umask(old)
    assert (tmp_path / "summary.md").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "drafter").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "drafter" / "model.safetensors").stat().st_mode & 0o777 == 0o644


# ----------------------------------------------------------------------------- faults (issue 28)


@pytest.mark.parametrize("name", ["../../escape", "ABSOLUTE/escape", "..", "a/b"])
def test_a_run_name_cannot_escape_outputs(tmp_path, capsys, monkeypatch, name):
    name = name.replace("ABSOLUTE", str(tmp_path / "abs"))
    monkeypatch.setattr(runs, "OUTPUTS_DIR", tmp_path / "outputs")
    monkeypatch.setattr(runs, "execute_notebook", lambda *args, **kwargs: pytest.fail("a notebook started"))
    assert cli.main(["run", "params/smoke.yaml", "--name", name, "--only", "02"]) == 2
    refused = f"key 'run.name' is {name!r}; a run name is one folder name under outputs/, without '/' or '..'"
    assert capsys.readouterr().err == f"eagle3 run: error: override: {refused}\n"
    assert list(tmp_path.iterdir()) == []
    recipe = write_yaml(tmp_path / "escape.yaml", {"run": {"name": name}})
    with pytest.raises(ParamsError, match=re.escape(f"{recipe}: {refused}")):
        load_params(recipe)


@pytest.mark.parametrize("override, reason", [
    ("train.lr=[1,", "expected the node content, but found '<stream end>'"),
    ("train.lr=!!python/object/apply:os.system ['true']",
     "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.system'"),
])
def test_a_malformed_override_is_named(capsys, override, reason):
    assert cli.main(["train", "params/smoke.yaml", "-p", override]) == 2
    assert capsys.readouterr().err == (
        f"eagle3 train: error: override {override!r}: the value is not valid YAML ({reason})\n"
    )


def test_numbers_people_type_are_numbers(tmp_path):
    """YAML 1.1 reads 3e-4 (no dot) and 1.5e3 (no exponent sign) as strings; params read them as numbers."""
    for typed, value in [("3e-4", 3e-4), ("1.5e3", 1500.0), ("1E-5", 1e-5), ("-2e2", -200.0), ("0.5", 0.5)]:
        assert load_params(None, [f"train.lr={typed}"])["train"]["lr"] == value
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  lr: 3e-4\n  max_grad_norm: 1e0\n")
    assert load_params(recipe)["train"]["lr"] == 3e-4
    assert load_params(recipe)["train"]["max_grad_norm"] == 1.0
    assert load_params(None, ["run.name=e5"])["run"]["name"] == "e5"


@pytest.mark.parametrize("only, override, refused", [
    ("02,04", "train.ttt_steps=0", "04_finetune: train.ttt_steps must be an integer >= 1, got 0"),
    ("00", "data.draft_vocab_size=100000",
     "00_prepare_data: data.draft_vocab_size 100000 exceeds the vocab size 49152 of the target "
     "zoo:tiny-llama"),
    ("00", "train.ttt_steps=0",
     "00_prepare_data: the stand-in source drafter (data.source_corpus) trains with train.ttt_steps must be "
     "an integer >= 1, got 0"),
    ("01", "probe.topk=0",
     "01_probe_drafter: probe.steps, topk, num_draft_tokens, temperature: steps (3) and topk (0) must be at "
     "least 1"),
    ("03", "remap.missing=copy",
     "03_remap_lm_head: remap.missing must be one of verifier, mean, zeros, random, got 'copy'"),
    ("05", "evaluate.sweep_steps=[0]", "05_evaluate: evaluate.sweep_steps or evaluate.sweep_tree"),
    ("04,05", "probe.num_prompts=0", "05_evaluate: probe.num_prompts (0) must be at least 1"),
    ("01", "probe.corpus=nowhere.jsonl",
     "01_probe_drafter: probe.corpus 'nowhere.jsonl': neither a corpus the zoo knows"),
    ("05", "evaluate.benchmarks=[{name: x, corpus: sharegpt-typo, num_prompts: 4}]",
     "05_evaluate: evaluate.benchmarks[0].corpus 'sharegpt-typo': neither"),
    ("00", "data.text=conversation",
     "00_prepare_data: data.text 'conversation' reads conversations, but data.corpus 'stdlib-code' holds "
     "documents"),
])
def test_every_selected_notebooks_settings_are_checked_before_the_first_starts(tmp_path, capsys, monkeypatch,
                                                                                only, override, refused):
    monkeypatch.setattr(runs, "OUTPUTS_DIR", tmp_path / "outputs")
    monkeypatch.setattr(runs, "execute_notebook", lambda *args, **kwargs: pytest.fail("a notebook started"))
    assert cli.main(["run", "params/smoke.yaml", "--only", only, "-p", override]) == 2
    assert capsys.readouterr().err.startswith(f"eagle3 run: error: {refused}")
    assert not (tmp_path / "outputs").exists()


def test_prepare_refuses_a_draft_vocab_larger_than_the_targets_before_capturing(tmp_path, monkeypatch):
    params = load_params("params/smoke.yaml", ["data.draft_vocab_size=50000"])
    monkeypatch.setattr(capture, "prepare", lambda *args, **kwargs: pytest.fail("the capture started"))
    with pytest.raises(DataError, match="data.draft_vocab_size 50000 exceeds the vocab size 49152 of the"):
        capture.prepare_for_run(SimpleNamespace(vocab_size=49152), params, "main", tmp_path)


def test_a_run_folder_is_locked_while_a_run_uses_it(tmp_path, monkeypatch):
    """Two runs with one name at once: the second is refused before it writes anything."""
    started, release, written = threading.Event(), threading.Event(), []

    def slow_notebook(notebook, output, parameters, **kwargs):
        started.set()
        release.wait(10)
        written.append(output)
        output.write_text("{}")
        return 0.0

    monkeypatch.setattr(runs, "execute_notebook", slow_notebook)
    first = threading.Thread(target=runs.run_notebooks, args=("params/smoke.yaml", tmp_path / "run"),
                             kwargs={"only": ["02"]})
    first.start()
    try:
        assert started.wait(10)
        in_use = f"{tmp_path / 'run'} is in use by another run (process {os.getpid()}); let it end or choose"
        with pytest.raises(runs.RunExistsError, match=re.escape(in_use)):
            runs.run_notebooks("params/smoke.yaml", tmp_path / "run", only=["02"])
    finally:
        release.set()
        first.join()
    assert written == [tmp_path / "run" / "02_diff_vocab_maps.ipynb"]
    with pytest.raises(runs.RunExistsError, match="exists from a previous run"):  # the lock went with the run
        runs.run_notebooks("params/smoke.yaml", tmp_path / "run", only=["02"])


def test_a_save_clears_the_staging_killed_saves_left(tmp_path):
    ended = subprocess.Popen(["true"])
    ended.wait()
    killed = [tmp_path / f".drafter.{ended.pid}.k1ll3d.tmp", tmp_path / f".drafter.{ended.pid}.k1ll3d.old"]
    for folder in killed:
        folder.mkdir()
        (folder / "model.safetensors").write_text("half")
    (tmp_path / f".summary.md.{ended.pid}.k1ll3d.tmp").write_text("half")
    running = tmp_path / f".drafter.{os.getpid()}.busy.tmp"  # a save in progress: not touched
    older = tmp_path / ".drafter.abcd1234.tmp"  # staged by an older eagle3lib: whose, nobody can tell
    running.mkdir()
    older.mkdir()
    named = f"{tmp_path}: .drafter.abcd1234.tmp left by an interrupted save of drafter; remove them once no"
    with pytest.warns(UserWarning, match=re.escape(named)):
        with files.staged_folder(tmp_path / "drafter") as staging:
            (staging / "config.json").write_text("{}")
    files.atomic_write_text(tmp_path / "summary.md", "text")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([older.name, running.name, "drafter",
                                                                 "summary.md"])


def test_append_line_writes_a_whole_line_or_none(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    files.append_line(path, '{"step": 1}')
    calls = []

    def disk_full(fd, data):  # the disk fills up after five bytes of the line
        calls.append(data)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data[:5])

    real_write = os.write
    monkeypatch.setattr(os, "write", disk_full)
    with pytest.raises(OSError, match=rf"^writing {re.escape(str(path))}: No space left on device$"):
        files.append_line(path, '{"step": 2, "loss": 1.5}')
    monkeypatch.undo()
    assert calls[0] == b'{"step": 2, "loss": 1.5}\n'  # one write for the whole line
    assert path.read_text() == '{"step": 1}\n'
