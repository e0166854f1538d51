"""Run parameters, run folders and the papermill driver.

Every notebook and `eagle3 run` read parameters through `load_params`: the defaults live in
`DEFAULTS` (the one place), a YAML recipe under `params/` overrides them, `key=value` overrides
go on top, and any key that is not in `DEFAULTS` is refused before any work starts (papermill
itself only warns about unknown parameters).
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from eagle3lib.files import REPO_ROOT, atomic_write_text, make_folder, resolve_path
from eagle3lib.progress import HEADLESS

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
OUTPUTS_DIR = REPO_ROOT / "outputs"

# The defaults of every parameter, grouped by the step that reads them. A recipe in params/
# overrides any subset; keys outside this tree are refused.
DEFAULTS: dict[str, Any] = {
    "run": {
        "name": "default",  # outputs/<name>/ unless a run folder is given explicitly
        "seed": 0,
        "device": "auto",  # auto | cpu | cuda
    },
    "stand_in": {  # 00_prepare_data: with data.source_corpus set, a source drafter trained on that corpus
        # stands in for one made for another target; cached, and left at @00_prepare_data/source_drafter
        "steps": 200,  # its optimizer steps (every other setting from `train`)
    },
    "probe": {  # 01_probe_drafter (and the prompts and decoding 05_evaluate shares), eagle3lib.speculate
        # the target and its dtype come from the `target` section; the drafter runs in the same dtype
        "backend": "builtin",  # builtin (eagle3lib.speculate) | vllm (make vllm-setup) | sglang (a server)
        "drafter": "",  # drafter checkpoint folder (SGLang or speculators layout)
        # held-out prompts from: pydoc-prose | stdlib-code | sharegpt | humaneval | a conversation file or
        # folder (first user turns) | a prompt file (.jsonl: {"prompt"} or MT-Bench {"turns"} per line)
        "corpus": "pydoc-prose",
        "num_prompts": 16,
        "prompt_chars": 600,  # each prompt: the opening of a held-out document, at most this long
        "chat": True,  # wrap each prompt in the target's chat template
        "max_new_tokens": 64,
        "steps": 3,  # draft depth K (SGLang num_steps, vLLM num_speculative_tokens)
        "topk": 1,  # 1 = chain; > 1 = tree (builtin only)
        "num_draft_tokens": None,  # tree budget incl. the root; null = steps + 1 (chain), 1 + topk*steps
        "temperature": 0.0,  # 0 = greedy; > 0: rejection sampling keeps the target's distribution
        "batch_size": 8,  # builtin: prompts decoded together (τ and outputs do not depend on it; speed does)
        "batch1_prompts": 4,  # 01 also decodes this many prompts one at a time: speed at batch 1; 0 = not
        "dtype": "",  # the target's dtype while probing; "" = target.dtype (float32: greedy output exact)
        "sglang_url": "http://127.0.0.1:30000",  # backend sglang: a server started with EAGLE3
    },
    "evaluate": {  # 05_evaluate: drafters side by side on probe's target, prompts and decoding settings
        # one entry per drafter: {name: ..., path: checkpoint folder}; the integrator resolves null paths
        "drafters": [{"name": "drafter", "path": None}],
        # every drafter on each: [{name, corpus (as probe.corpus), num_prompts (0: all of a prompt file or
        # humaneval)}]; [] = probe.corpus alone. The K sweep and the figures use the first.
        "benchmarks": [],
        "sample_tokens": 48,  # generated tokens shown per drafter for the first prompt
        "sweep_steps": [1, 2, 3, 4, 5],  # the K sweep: chain depths tried per drafter; [] = no sweep
        "sweep_batch_size": 1,  # the sweep decodes one prompt at a time: one user's latency
        "sweep_prompts": 4,  # the first benchmark's first prompts the sweep decodes
        "sweep_tree": {"steps": 3, "topk": 2, "num_draft_tokens": 6},  # one small tree too; steps 0 = none
    },
    "target": {  # the target model (00_prepare_data and every step that runs it), eagle3lib.target
        "spec": "zoo:smollm2-135m-instruct",  # a local HF folder, a cached HF model id, or zoo:<name>
        "dtype": "auto",  # auto (bf16 on GPUs and CPUs with bf16 units, else float32) | float32 | bfloat16
        "aux_layer_ids": [],  # eagle3lib numbering (id i = output of decoder layer i); [] = [1, N//2-1, N-4]
        "cache_dir": "",  # converted zoo models; "" = $EAGLE3LIB_CACHE or ~/.cache/eagle3lib/zoo
    },
    "data": {  # 00_prepare_data, eagle3lib.data and eagle3lib.zoo
        # the run's data, in 00_prepare_data/ itself: documents (stdlib-code | pydoc-prose) or conversations
        # (sharegpt | a .json/.jsonl[.gz] file or folder of ShareGPT or OpenAI `messages` records)
        "corpus": "stdlib-code",
        "source_corpus": "",  # also prepare 00_prepare_data/source/ (to train a source drafter on); "" = none
        "num_tokens": 200000,  # tokens captured per corpus
        # documents: raw (as they are) | self-distill (chat prompts answered by the target);
        # conversations: conversation (their own assistant turns) | regenerate (the target's replies instead)
        "text": "raw",
        "loss_turns": "all",  # conversations: every assistant turn in the loss | last (SpecForge's option)
        "max_new_tokens": 128,  # self-distill and regenerate: reply length
        "regenerate": {  # data.text regenerate (eagle3lib.regenerate): the target's replies, turn by turn
            "engine": "builtin",  # builtin (the target here) | vllm (make vllm-setup) | server (OpenAI API)
            "temperature": 0.0,  # 0 = greedy
            "batch_size": 32,  # replies decoded together (builtin), requests in flight (server)
            "max_turns": 0,  # user turns answered per conversation; 0 = all
            "max_prompt_tokens": 2048,  # a longer prompt ends its conversation there
            "dtype": "auto",  # builtin: the target's own; vllm: auto = bfloat16
            "url": "",  # server: e.g. http://127.0.0.1:30000 (SGLang or vLLM, OpenAI-compatible)
            "model": "",  # server: the model name it serves; "" = target.spec
        },
        "prompt_chars": 600,  # self-distill: characters of a document in each prompt
        "seq_len": 512,  # tokens per sample (longer documents are cut into windows)
        "batch_size": 8,  # sequences per capture forward
        "dtype": "bfloat16",  # stored hidden states: bfloat16 | float16 | float32
        "shard_tokens": 32768,  # tokens per shard; writer and reader hold about one shard in memory
        "heldout_fraction": 0.1,  # documents kept out of training (evaluation prompts come from them)
        "draft_vocab_size": 32000,  # Vd of each vocab map built from the token counts (EAGLE-3 releases: 32k)
    },
    "vocab": {  # 02_diff_vocab_maps, eagle3lib.vocab
        "map_a": "",  # map file or drafter checkpoint; "" = remap.source_drafter's map
        "map_b": "",  # the new map; "" = the one 00_prepare_data wrote in this run
        "counts": "",  # token counts (safetensors `counts` [Vt]); "" = 00_prepare_data's in this run
        "label_a": "source drafter",
        "label_b": "new map",
    },
    "remap": {  # 03_remap_lm_head, eagle3lib.remap: source_drafter moved onto vocab.map_b
        "source_drafter": "",  # drafter checkpoint folder (SGLang or speculators layout)
        "missing": "mean",  # rows for tokens the old map lacks: verifier | mean | zeros | random
        "target": "",  # the target head for `verifier` and the proof: data folder, HF folder or zoo:...
    },
    "train": {  # 04_finetune, eagle3lib.train
        "arms": ["scratch"],  # a drafter per entry, same data and budget: scratch|drafter|drafter-no-remap
        # offline: from hidden states captured first (00_prepare_data, or a SpecForge/speculators dump);
        # online: the target runs in the loop on the `data` section's text (kept in <out>/online_data/)
        "data_mode": "offline",
        "data": "",  # offline data folder; "" = the one 00_prepare_data wrote in this run
        # SpecForge/speculators dumps only, which carry neither: the target's embed/norm/lm_head weights
        # (a target_head.safetensors) and the layers the dump holds (eagle3lib numbering)
        "target_head": "",
        "aux_layer_ids": [],
        "vocab_map": "",  # the draft vocab to train for (map file or checkpoint); "" = the data folder's map
        "drafter": "",  # checkpoint the warm-start arms begin from
        "allow_no_remap": False,  # drafter-no-remap reproduces the scrambled-labels bug: refused unless true
        "remap_missing": "verifier",  # rows for tokens the drafter's map lacks: verifier|mean|zeros|random
        "train_lm_head": True,  # SpecForge trains lm_head; speculators freezes it
        "ttt_steps": 7,  # K unrolled train-time-test steps
        "step_decay": 0.8,  # loss weight of step k is step_decay**k
        "steps": 200,  # optimizer steps per arm
        "batch_size": 8,  # sequences per optimizer step, all processes and micro-batches together
        "micro_batch_size": 1,  # sequences per forward; accumulation = batch_size / (micro x nproc)
        "seq_len": 512,
        "lr": 3e-4,
        "betas": [0.9, 0.95],
        "weight_decay": 0.0,
        "warmup_steps": 20,
        "min_lr_ratio": 0.1,  # cosine decay ends at lr x min_lr_ratio
        "max_grad_norm": 0.5,  # 0 = no clipping
        "dtype": "auto",  # auto (bf16 autocast on GPUs and CPUs with AMX, else fp32) | fp32 | bf16
        "nproc": 1,  # > 1: data-parallel under torchrun (gloo on CPU, nccl on GPU)
        "log_every": 10,  # steps between metrics.jsonl entries
        "checkpoint_every": 100,  # 0 = only the final drafter
        "keep_checkpoints": 2,
        "check_batches": 4,  # batches of the step-0 check
        "check_enforce": True,  # a warm start that fails the step-0 check stops
        "save_speculators": False,  # also save the final drafter in the speculators layout
        "scratch": {  # the scratch arm's sizes; null = copy the warm-start drafter's
            "num_attention_heads": None,
            "num_key_value_heads": None,
            "head_dim": None,
            "intermediate_size": None,
            "rms_norm_eps": None,
            "rope_theta": None,
            "max_position_embeddings": None,
        },
    },
}


class ParamsError(ValueError):
    """A params file or override that does not fit DEFAULTS."""


class _ParamsLoader(yaml.SafeLoader):
    """`yaml.safe_load`, except that numbers with an exponent and no dot or no exponent sign (3e-4, 1.5e3) are
    numbers: YAML 1.1 reads them as strings, and they are what people type."""


_ParamsLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


def _read_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_ParamsLoader)


def check_run_name(where: str, key: str, name: str) -> None:
    """A run name is one folder under outputs/: a '/', a '..' or an absolute path would write elsewhere."""
    if not name or name == "." or "/" in name or ".." in name or os.path.isabs(name):
        raise ParamsError(
            f"{where}: key '{key}' is {name!r}; a run name is one folder name under outputs/, without '/' "
            "or '..'"
        )


# Checks of single values beyond their type, by dotted key.
VALUE_CHECKS = {"run.name": check_run_name}


def _check_type(where: str, key: str, default: Any, value: Any) -> Any:
    if default is None or value is None:
        return value
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, str):
        ok = isinstance(value, str)
    elif isinstance(default, list):
        ok = isinstance(value, list | tuple)
        value = list(value) if ok else value
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ParamsError(
            f"{where}: key '{key}' expects {type(default).__name__} (default {default!r}), "
            f"got {type(value).__name__} {value!r}"
        )
    return value


def _merge(where: str, base: dict, update: dict, prefix: str = "") -> None:
    """Merge `update` into `base` in place, refusing keys `base` does not have."""
    if not isinstance(update, dict):
        raise ParamsError(f"{where}: '{prefix or 'top level'}' must be a mapping, got {update!r}")
    for key, value in update.items():
        dotted = f"{prefix}{key}"
        if key not in base:
            known = ", ".join(sorted(base))
            raise ParamsError(f"{where}: unknown key '{dotted}' (known here: {known})")
        if isinstance(base[key], dict):
            _merge(where, base[key], value, prefix=f"{dotted}.")
        else:
            base[key] = _check_type(where, dotted, base[key], value)
            if dotted in VALUE_CHECKS and base[key] is not None:
                VALUE_CHECKS[dotted](where, dotted, base[key])


def parse_override(text: str) -> dict:
    """`'train.lr=3e-4'` → `{'train': {'lr': 0.0003}}`; the value is read as YAML."""
    if "=" not in text:
        raise ParamsError(f"override {text!r}: expected key=value, e.g. train.steps=100")
    key, raw = text.split("=", 1)
    try:
        value = _read_yaml(raw)
    except yaml.YAMLError as err:
        reason = getattr(err, "problem", None) or " ".join(str(err).split())
        raise ParamsError(f"override {text!r}: the value is not valid YAML ({reason})") from err
    nested: dict = {}
    node = nested
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return nested


def load_params(
    params_file: str | os.PathLike | None = None,
    overrides: dict | list[str] | None = None,
) -> dict:
    """DEFAULTS ← params file ← overrides, every key checked; returns a fresh nested dict."""
    params = copy.deepcopy(DEFAULTS)
    if params_file is not None:
        path = resolve_path(params_file)
        if not path.is_file():
            raise ParamsError(f"params file not found: {path}")
        try:
            recipe = _read_yaml(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ParamsError(f"{path}: not valid YAML: {err}") from err
        _merge(str(path), params, recipe)
    for override in _as_override_dicts(overrides):
        _merge("override", params, override)
    return params


def _as_override_dicts(overrides: dict | list[str] | None) -> list[dict]:
    if not overrides:
        return []
    if isinstance(overrides, dict):
        return [overrides]
    return [parse_override(item) for item in overrides]


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
        path = run_path(run_dir, params)
        path.mkdir(parents=True, exist_ok=True)
        saved = path / "params.yaml"
        if saved.exists() and not overwrite:
            previous = yaml.safe_load(saved.read_text())
            if previous != params:
                raise RunExistsError(
                    f"{saved} holds different params from this run's; choose another run folder "
                    "or pass overwrite=True"
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
                    f"{path} already holds a previous run's outputs; use another run folder "
                    "or overwrite=True"
                )
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
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
    """The repository's HEAD, with '+changes' when the work tree differs from it. A copy of the work tree
    without its .git (a GPU host it was copied to) reports what $EAGLE3LIB_GIT_COMMIT says it is, with
    '(stated)'; else 'unknown'."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "HEAD")
    if not head:
        stated = os.environ.get(GIT_COMMIT_VARIABLE)
        return f"{stated} (stated)" if stated else "unknown"
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

    output.parent.mkdir(parents=True, exist_ok=True)
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
            )
    except papermill.PapermillExecutionError as err:
        cell = f"#{err.exec_count}" if err.exec_count is not None else f"index {err.cell_index}"
        raise NotebookFailed(notebook, output, cell, f"{err.ename}: {err.evalue}") from err
    return time.perf_counter() - start


def check_positive(section: str, settings: dict, keys: tuple[str, ...]) -> None:
    """Refuse the settings among `keys` of `section` that are below 1, naming each."""
    small = [f"{section}.{key} ({settings[key]})" for key in keys if settings[key] < 1]
    if small:
        raise ParamsError(f"{', '.join(small)} must be at least 1")


LOCK_FILE = ".lock"


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold the run folder for the block: another `eagle3 run` on it is refused before it writes anything. The
    lock (flock on `run_dir/.lock`) goes with the process holding it, so a killed run leaves none behind."""
    with open(make_folder(run_dir) / LOCK_FILE, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "process unknown"
            raise RunExistsError(
                f"{run_dir} is in use by another run ({holder}); let it end or choose another run name"
            ) from None
        handle.truncate(0)
        handle.write(f"process {os.getpid()}\n")
        handle.flush()
        yield


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
        override_dict: dict = {}
        for item in _as_override_dicts(overrides):
            _deep_update(override_dict, item)
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
                    "overrides": override_dict,
                    "overwrite": overwrite,
                },
                progress_bar=True,
            )
            walls = run.read_metrics().get("wall_seconds", {})
            run.write_metrics("wall_seconds", {**walls, notebook.stem: seconds})
            print(f"[eagle3 run] {notebook.name} done in {seconds:.1f} s", flush=True)
    return run.path


def _deep_update(base: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value

