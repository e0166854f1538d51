"""Runs: a run's folder and its steps, metrics.json, provenance, and the papermill driver.

A run is one folder `outputs/<run>/` holding the params it was made with (`eagle3lib.params`), one folder
per step (the notebook of the same name writes there), the executed notebooks, and `metrics.json`, where
each step records its numbers under its own name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from eagle3lib.files import REPO_ROOT, atomic_write_text, held, make_folder, resolve_path
from eagle3lib.params import ParamsError, load_params, override_dict
from eagle3lib.progress import HEADLESS

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
OUTPUTS_DIR = REPO_ROOT / "outputs"

# A run's steps, in order: each is the notebook `notebooks/<step>.ipynb`, the folder `<run>/<step>/` it
# writes, and its entry in metrics.json.
PREPARE_DATA = "00_prepare_data"
PROBE_DRAFTER = "01_probe_drafter"
DIFF_VOCAB_MAPS = "02_diff_vocab_maps"
REMAP_LM_HEAD = "03_remap_lm_head"
FINETUNE = "04_finetune"
EVALUATE = "05_evaluate"
STEPS = (PREPARE_DATA, PROBE_DRAFTER, DIFF_VOCAB_MAPS, REMAP_LM_HEAD, FINETUNE, EVALUATE)

RUN_PREFIX = "@"  # "@04_finetune/scratch/drafter" = that path inside the run folder


def resolve_run_paths(params: dict, run_dir: Path) -> dict:
    """A copy of `params` with every string "@<path>" replaced by `<run_dir>/<path>`.

    Recipes name what earlier notebooks of the same run produce this way (the source drafter from 00,
    the arms of 04), so one recipe serves any run folder."""
    if isinstance(params, dict):
        return {key: resolve_run_paths(value, run_dir) for key, value in params.items()}
    if isinstance(params, list):
        return [resolve_run_paths(value, run_dir) for value in params]
    if isinstance(params, str) and params.startswith(RUN_PREFIX):
        return str(Path(run_dir) / params[len(RUN_PREFIX):])
    return params


class RunExistsError(FileExistsError):
    pass


def run_path(run_dir: str | os.PathLike | None, params: dict) -> Path:
    """The run folder: `run_dir`, else `outputs/<run.name>/`."""
    return resolve_path(run_dir) if run_dir else OUTPUTS_DIR / params["run"]["name"]


class Run:
    """One run folder `outputs/<name>/`: the params used, metrics.json, one folder per notebook.

    A step's folder is never overwritten: asking for one that already has files raises unless
    the run was opened with `overwrite=True`.
    """

    def __init__(self, path: Path, params: dict, overwrite: bool = False):
        self.path = path
        self.params = resolve_run_paths(params, path)
        self.overwrite = overwrite

    @classmethod
    def open(cls, run_dir: str | os.PathLike | None, params: dict, overwrite: bool = False) -> Run:
        path = make_folder(run_path(run_dir, params))
        saved = path / "params.yaml"
        if saved.exists() and not overwrite:
            previous = yaml.safe_load(saved.read_text())
            if previous != params:
                raise RunExistsError(
                    f"{saved} holds different params from this run's; choose another run folder, or "
                    "replace its outputs (eagle3 run/train --overwrite, overwrite=True in a notebook)"
                )
        else:
            atomic_write_text(saved, yaml.safe_dump(params, sort_keys=False))
        return cls(path, params, overwrite)

    def step_dir(self, step: str) -> Path:
        """The folder of one notebook's outputs, fresh: refuses to reuse a non-empty one."""
        path = self.path / step
        if path.exists() and any(path.iterdir()):
            if not self.overwrite:
                raise RunExistsError(
                    f"{path} already holds a previous run's outputs; use another run folder, or replace "
                    "them (eagle3 run/train --overwrite, overwrite=True in a notebook)"
                )
            shutil.rmtree(path)
        make_folder(path)
        return path

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.json"

    def read_metrics(self) -> dict:
        return read_metrics(self.path)

    def write_metrics(self, step: str, metrics: dict | list) -> dict:
        """Record `metrics` under `step` in metrics.json (other steps' entries are kept)."""
        everything = self.read_metrics()
        everything[step] = metrics
        atomic_write_text(self.metrics_path, json.dumps(everything, indent=2, default=_jsonable) + "\n")
        return everything


def read_metrics(run_dir: str | os.PathLike) -> dict:
    path = Path(run_dir) / "metrics.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"metrics value of type {type(value).__name__} is not JSON-serialisable: {value!r}")


GIT_COMMIT_VARIABLE = "EAGLE3LIB_GIT_COMMIT"


def git_commit() -> str:
    """The repository's HEAD, with '+changes' when the work tree differs from it; 'unknown' without git.
    A copy of the work tree on another machine (a lent GPU host) says what $EAGLE3LIB_GIT_COMMIT states,
    with '(stated)': its own .git, if it has one, need not be the copy's (one such copy held a stale one)."""
    stated = os.environ.get(GIT_COMMIT_VARIABLE)
    if stated:
        return f"{stated} (stated)"

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


PROVENANCE_PACKAGES = ("torch", "transformers", "safetensors", "numpy", "papermill", "eagle3lib")


def provenance() -> dict[str, str]:
    """What is producing a run now: the commit, Python and the versions of the packages that matter."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from eagle3lib.devices import machine_description

    found = {"git commit": git_commit(), "python": platform.python_version(),
             "machine": machine_description()}
    for package in PROVENANCE_PACKAGES:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def record_provenance(run: Run, notebooks: list[str]) -> list[dict]:
    """Add `notebooks` to metrics.json's "provenance": a list of {"notebooks": [...], commit, versions}, one
    entry per set of facts (a run continued later with --only under another commit gets a second one)."""
    facts = provenance()
    records = run.read_metrics().get("provenance", [])
    if records and {k: v for k, v in records[-1].items() if k != "notebooks"} == facts:
        records[-1]["notebooks"] += [name for name in notebooks if name not in records[-1]["notebooks"]]
    else:
        records.append({"notebooks": list(notebooks), **facts})
    run.write_metrics("provenance", records)
    return records


# ---------------------------------------------------------------- papermill driver


class NotebookFailed(RuntimeError):
    def __init__(self, notebook: Path, output: Path, cell: str, error: str):
        self.notebook, self.output, self.cell, self.error = notebook, output, cell, error
        super().__init__(
            f"notebook {notebook.name} failed in cell {cell}: {error}\n"
            f"partial executed notebook: {output}"
        )


def notebook_paths(only: list[str] | None = None) -> list[Path]:
    """The numbered notebooks in order; `only` picks by number prefix, e.g. ['00', '04']."""
    paths = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
    if only:
        unknown = [n for n in only if not any(p.name.startswith(f"{n}_") for p in paths)]
        if unknown:
            raise ParamsError(f"no notebook numbered {', '.join(unknown)} in {NOTEBOOKS_DIR}")
        paths = [p for p in paths if p.name[:2] in only]
    return paths


# Set for the kernels papermill starts (they inherit this process's environment): eagle3lib's progress bars
# print one line per loop instead of an update per step (eagle3lib.progress).
KERNEL_ENV = {HEADLESS: "1"}


@contextmanager
def headless_kernels() -> Iterator[None]:
    """KERNEL_ENV in this process's environment for the block (kernels started in it inherit it)."""
    saved = {key: os.environ.get(key) for key in KERNEL_ENV}
    os.environ.update(KERNEL_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def execute_notebook(
    notebook: Path, output: Path, parameters: dict, cwd: Path | None = None, progress_bar: bool = False
) -> float:
    """Execute one notebook with papermill; returns wall seconds or raises NotebookFailed."""
    import papermill

    make_folder(output.parent)
    start = time.perf_counter()
    try:
        with headless_kernels():
            papermill.execute_notebook(
                str(notebook),
                str(output),
                parameters=parameters,
                cwd=str(cwd or notebook.parent),
                kernel_name="python3",
                progress_bar=progress_bar,
                log_output=False,
                # the kernel's own log (a TCP-transport warning at start, "KeyboardInterrupt caught" at
                # shutdown) is not the run's: a cell's error reaches the run through the notebook
                extra_arguments=["--IPKernelApp.log_level=CRITICAL"],
            )
    except papermill.PapermillExecutionError as err:
        cell = f"#{err.exec_count}" if err.exec_count is not None else f"index {err.cell_index}"
        raise NotebookFailed(notebook, output, cell, f"{err.ename}: {err.evalue}") from err
    return time.perf_counter() - start


LOCK_FILE = ".lock"


def run_lock(run_dir: Path):
    """Hold the run folder for the block: another `eagle3 run` on it is refused before it writes anything. The
    lock (flock on `run_dir/.lock`) goes with the process holding it, so a killed run leaves none behind."""
    return held(Path(run_dir) / LOCK_FILE, lambda holder: RunExistsError(
        f"{run_dir} is in use by another run ({holder}); let it end or choose another run name"))


def run_notebooks(
    params_file: str | os.PathLike,
    run_dir: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
    only: list[str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Validate the params, then execute the numbered notebooks in order into the run folder."""
    params = load_params(params_file, overrides)  # fails here, before any work, on a bad key
    path = run_path(run_dir, params)
    with run_lock(path):
        run = Run.open(path, params, overwrite=overwrite)
        overrides_for_kernels = override_dict(overrides)
        for notebook in notebook_paths(only):
            output = run.path / notebook.name
            if output.exists() and not overwrite:
                raise RunExistsError(f"{output} exists from a previous run; use another run name")
            print(f"[eagle3 run] {notebook.name} → {output}", flush=True)
            record_provenance(run, [notebook.stem])
            seconds = execute_notebook(
                notebook,
                output,
                {
                    "params_file": str(resolve_path(params_file)),
                    "run_dir": str(run.path),
                    "overrides": overrides_for_kernels,
                    "overwrite": overwrite,
                },
                progress_bar=True,
            )
            walls = run.read_metrics().get("wall_seconds", {})
            run.write_metrics("wall_seconds", {**walls, notebook.stem: seconds})
            print(f"[eagle3 run] {notebook.name} done in {seconds:.1f} s", flush=True)
    return run.path


