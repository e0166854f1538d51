"""Run parameters: one typed section per step, each setting with its default, what it means and its roles.

Every notebook and `eagle3 run` read parameters through `load_params`: the defaults are the sections below
(`DEFAULTS` is them as one nested dict, the form the code reads), a YAML recipe under `params/` overrides
any of them, `key=value` overrides go on top, and any key that is not a setting here is refused before any
work starts (papermill itself only warns about unknown parameters).

A setting's roles are flags in its field's metadata; the key lists the code checks are derived from them
(`keys_with`), never kept by hand:
- `resume_free` (train): does not change what is computed, so a resumed run may set it differently;
- `decides_text` (data): decides an online run's text, and so its batches (a reused `online_data/` folder
  is checked against these);
- `decides_stand_in` (data, train): decides the weights of the stand-in source drafter, and so its cache key;
- `at_least`: the smallest value that works, refused by the step that reads the section before any work;
- `check`: a function `(where, key, value)` refusing a value beyond its type, when the recipe is read.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable
from dataclasses import Field, asdict, dataclass, field, fields, is_dataclass
from typing import Any

import yaml

from eagle3lib.files import resolve_path


class ParamsError(ValueError):
    """A params file or override that does not fit the sections below."""


def check_run_name(where: str, key: str, name: str) -> None:
    """A run name is one folder under outputs/: a '/', a '..' or an absolute path would write elsewhere."""
    if not name or name == "." or "/" in name or ".." in name or os.path.isabs(name):
        raise ParamsError(
            f"{where}: key '{key}' is {name!r}; a run name is one folder name under outputs/, without '/' "
            "or '..'"
        )


def setting(default: Any, doc: str, **roles: Any) -> Any:
    """A field of a section: its default, what it means, and its roles (see the module docstring)."""
    metadata = {"doc": doc, **roles}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def subsection(cls: type, doc: str, **roles: Any) -> Any:
    """A field holding a nested section (a mapping in recipes, refused keys and all)."""
    return field(default_factory=cls, metadata={"doc": doc, **roles})


@dataclass
class RunSection:
    """Every step."""

    name: str = setting(
        "default", "outputs/<name>/ unless a run folder is given explicitly", check=check_run_name
    )
    seed: int = setting(0, "every seeded choice: held-out split, initialisation, batch order, sampling")
    device: str = setting("auto", "auto | cpu | cuda")


@dataclass
class StandInSection:
    """00_prepare_data: with data.source_corpus set, a source drafter trained on that corpus stands in for one
    made for another target; cached, and left at @00_prepare_data/source_drafter."""

    steps: int = setting(200, "its optimizer steps (every other setting from `train`)")


@dataclass
class ProbeSection:
    """01_probe_drafter (and the prompts and decoding 05_evaluate shares), decoding.speculate; the target and
    its dtype come from the `target` section, and the drafter runs in the same dtype."""

    backend: str = setting(
        "builtin", "builtin (eagle3lib.decoding.speculate) | vllm (make vllm-setup) | sglang (a server)"
    )
    drafter: str = setting("", "drafter checkpoint folder (SGLang or speculators layout)")
    corpus: str = setting(
        "pydoc-prose",
        "held-out prompts from: pydoc-prose | stdlib-code | sharegpt | humaneval | a conversation file or "
        'folder (first user turns) | a prompt file (.jsonl: {"prompt"} or MT-Bench {"turns"} per line)',
    )
    num_prompts: int = setting(16, "prompts decoded", at_least=1)
    prompt_chars: int = setting(
        600, "each prompt: the opening of a held-out document, at most this long", at_least=1
    )
    chat: bool = setting(True, "wrap each prompt in the target's chat template")
    max_new_tokens: int = setting(64, "tokens generated per prompt", at_least=1)
    steps: int = setting(3, "draft depth K (SGLang num_steps, vLLM num_speculative_tokens)")
    topk: int = setting(1, "1 = chain; > 1 = tree (builtin only)")
    num_draft_tokens: int | None = setting(
        None, "tree budget incl. the root; null = steps + 1 (chain), 1 + topk*steps"
    )
    temperature: float = setting(0.0, "0 = greedy; > 0: rejection sampling keeps the target's distribution")
    batch_size: int = setting(
        8, "builtin: prompts decoded together (τ and outputs do not depend on it; speed does)", at_least=1
    )
    batch1_prompts: int = setting(
        4, "01 also decodes this many prompts one at a time: speed at batch 1; 0 = not"
    )
    dtype: str = setting(
        "", 'the target\'s dtype while probing; "" = target.dtype (float32: greedy output exact)'
    )
    compiled: bool = setting(
        False, "builtin: the target's steps and verifications through one compiled graph (a Llama-like "
        "target; up to four compilations a process, one row or more, one token or K+1, about a minute each "
        "on 2 cores: for long probes)"
    )
    sglang_url: str = setting("http://127.0.0.1:30000", "backend sglang: a server started with EAGLE3")


@dataclass
class SweepTree:
    """The one small tree of 05's K sweep."""

    steps: int = setting(3, "its depth; 0 = no tree")
    topk: int = setting(2, "children per node")
    num_draft_tokens: int = setting(6, "its budget incl. the root")


@dataclass
class EvaluateSection:
    """05_evaluate: drafters side by side on probe's target, prompts and decoding settings."""

    drafters: list = setting(
        [{"name": "drafter", "path": None}],
        "one entry per drafter: {name: ..., path: checkpoint folder}; the integrator resolves null paths",
    )
    benchmarks: list = setting(
        [],
        "every drafter on each: [{name, corpus (as probe.corpus), num_prompts (0: all of a prompt file or "
        "humaneval), turns (conversations: the first user turns asked in order, 2 = MT-Bench style)}]; [] = "
        "probe.corpus alone. The K sweep and the figures use the first.",
    )
    sample_tokens: int = setting(48, "generated tokens shown per drafter for the first prompt")
    sweep_steps: list = setting([1, 2, 3, 4, 5], "the K sweep: chain depths tried per drafter; [] = no sweep")
    sweep_batch_size: int = setting(1, "the sweep decodes one prompt at a time: one user's latency")
    sweep_prompts: int = setting(4, "the first benchmark's first prompts the sweep decodes")
    sweep_tree: SweepTree = subsection(SweepTree, "one small tree too; steps 0 = none")
    replay: bool = setting(
        True,
        "greedy builtin benchmarks: each drafter replayed against the target's recorded decoding of the "
        "prompts (the drafts real verification accepts, bf16's near ties aside; the target decodes a "
        "benchmark once; untimed: the sweep measures speed); false: every drafter verified by the target, "
        "timed at probe.batch_size",
    )
    record: str = setting(
        "", 'a committed record of τ along training (records/<name>, eagle3 publish-curves) shown beside the '
        'run\'s own; "" = none'
    )


@dataclass
class TargetSection:
    """The target model (00_prepare_data and every step that runs it), eagle3lib.target.model."""

    spec: str = setting("zoo:smollm2-135m-instruct", "a local HF folder, a cached HF model id, or zoo:<name>")
    dtype: str = setting(
        "auto", "auto (bf16 on GPUs and CPUs with bf16 units, else float32) | float32 | bfloat16"
    )
    aux_layer_ids: list = setting(
        [], "eagle3lib numbering (id i = output of decoder layer i); [] = [1, N//2-1, N-4]"
    )
    cache_dir: str = setting("", 'converted zoo models; "" = $EAGLE3LIB_CACHE or ~/.cache/eagle3lib/zoo')


@dataclass
class RegenerateSection:
    """data.text regenerate (eagle3lib.generation.regenerate): the target's replies, turn by turn."""

    engine: str = setting(
        "builtin", "builtin (the target here) | vllm (make vllm-setup) | server (OpenAI API)"
    )
    temperature: float = setting(0.0, "0 = greedy")
    batch_size: int = setting(32, "replies decoded together (builtin), requests in flight (server)")
    max_turns: int = setting(0, "user turns answered per conversation; 0 = all")
    max_prompt_tokens: int = setting(2048, "a longer prompt ends its conversation there")
    dtype: str = setting("auto", "builtin: the target's own; vllm: auto = bfloat16")
    url: str = setting("", "server: e.g. http://127.0.0.1:30000 (SGLang or vLLM, OpenAI-compatible)")
    model: str = setting("", 'server: the model name it serves; "" = target.spec')
    reasoning: str = setting(
        "save", "a reply's reasoning: save (apart, as a reasoning parser returns it) | drop | inline"
    )
    compiled: bool = setting(
        False, "builtin: decode through one compiled graph (a Llama-like target; about a minute to compile, "
        "then 1.3x the eager steps at batch 32 on a 2-core Xeon)"
    )


@dataclass
class DataSection:
    """00_prepare_data, generation.capture and data.corpora; online training reads its text from here too."""

    corpus: str = setting(
        "stdlib-code",
        "the run's data, in 00_prepare_data/ itself: documents (stdlib-code | pydoc-prose) or conversations "
        "(sharegpt | a .json/.jsonl[.gz] file or folder of ShareGPT or OpenAI `messages` records)",
        decides_text=True,
    )
    source_corpus: str = setting(
        "",
        'also prepare 00_prepare_data/source/ (to train a source drafter on); "" = none',
        decides_stand_in=True,
    )
    num_tokens: int = setting(
        200000, "tokens captured per corpus", decides_text=True, decides_stand_in=True, at_least=1
    )
    text: str = setting(
        "raw",
        "documents: raw (as they are) | self-distill (chat prompts answered by the target); conversations: "
        "conversation (their own assistant turns) | regenerate (the target's replies instead)",
        decides_text=True,
        decides_stand_in=True,
    )
    loss_turns: str = setting(
        "all",
        "conversations: every assistant turn in the loss | last (SpecForge's option)",
        decides_text=True,
        decides_stand_in=True,
    )
    chat_template_kwargs: dict = setting(
        {},
        "switches of the target's chat template for every rendering (training text, regeneration, probe and "
        "05's prompts), e.g. {enable_thinking: true} (Qwen3) or {thinking: true} (DeepSeek-V3.1)",
        decides_text=True,
        decides_stand_in=True,
    )
    turns: str = setting(
        "auto",
        "conversations: auto (one sample a conversation where the template renders its history as it was "
        "generated, one a turn where it rewrites it) | per-turn (always one sample per trained turn)",
        decides_text=True,
        decides_stand_in=True,
    )
    max_new_tokens: int = setting(
        128, "self-distill and regenerate: reply length", decides_text=True, decides_stand_in=True, at_least=1
    )
    regenerate: RegenerateSection = subsection(
        RegenerateSection,
        "data.text regenerate: how the replies are made",
        decides_text=True,
        decides_stand_in=True,
    )
    prompt_chars: int = setting(
        600,
        "self-distill: characters of a document in each prompt",
        decides_text=True,
        decides_stand_in=True,
        at_least=1,
    )
    seq_len: int = setting(
        512,
        "tokens per sample (longer documents are cut into windows)",
        decides_text=True,
        decides_stand_in=True,
        at_least=1,
    )
    batch_size: int = setting(8, "sequences per capture forward", decides_text=True, at_least=1)
    dtype: str = setting(
        "bfloat16", "stored hidden states: bfloat16 | float16 | float32", decides_stand_in=True
    )
    shard_tokens: int = setting(
        32768,
        "tokens per shard; writer and reader hold about one shard in memory",
        decides_text=True,
        at_least=1,
    )
    heldout_fraction: float = setting(
        0.1,
        "documents kept out of training (evaluation prompts come from them)",
        decides_text=True,
        decides_stand_in=True,
    )
    draft_vocab_size: int = setting(
        32000,
        "Vd of each vocab map built from the token counts (EAGLE-3 releases: 32k)",
        decides_text=True,
        decides_stand_in=True,
        at_least=1,
    )


@dataclass
class VocabSection:
    """02_diff_vocab_maps, eagle3lib.drafter.vocab."""

    map_a: str = setting("", 'map file or drafter checkpoint; "" = remap.source_drafter\'s map')
    map_b: str = setting("", 'the new map; "" = the one 00_prepare_data wrote in this run')
    counts: str = setting("", 'token counts (safetensors `counts` [Vt]); "" = 00_prepare_data\'s in this run')
    label_a: str = setting("source drafter", "map A's name in the figures")
    label_b: str = setting("new map", "map B's name in the figures")


@dataclass
class RemapSection:
    """03_remap_lm_head, eagle3lib.training.remap: source_drafter moved onto vocab.map_b."""

    source_drafter: str = setting("", "drafter checkpoint folder (SGLang or speculators layout)")
    missing: str = setting("mean", "rows for tokens the old map lacks: verifier | mean | zeros | random")
    target: str = setting(
        "", "the target head for `verifier` and the proof: data folder, HF folder or zoo:..."
    )


@dataclass
class ScratchSizes:
    """The scratch arm's sizes; null = copy the warm-start drafter's."""

    num_attention_heads: int | None = setting(None, "query heads")
    num_key_value_heads: int | None = setting(None, "key/value heads (grouped-query attention)")
    head_dim: int | None = setting(None, "width of one head")
    intermediate_size: int | None = setting(None, "the MLP's width")
    rms_norm_eps: float | None = setting(None, "the norms' epsilon")
    rope_theta: float | None = setting(None, "RoPE base")
    max_position_embeddings: int | None = setting(None, "longest position the config declares")


@dataclass
class TrainSection:
    """04_finetune, eagle3lib.training.train and eagle3lib.training.trainer."""

    arms: list = setting(
        ["scratch"],
        "a drafter per entry, same data and budget: scratch|drafter|drafter-no-remap",
        resume_free=True,
    )
    data_mode: str = setting(
        "offline",
        "offline: from hidden states captured first (00_prepare_data, or a SpecForge/speculators dump); "
        "online: the target runs in the loop on the `data` section's text (kept in <out>/online_data/)",
        decides_stand_in=True,
    )
    data: str = setting("", 'offline data folder; "" = the one 00_prepare_data wrote in this run')
    target_head: str = setting(
        "",
        "SpecForge/speculators dumps only, which carry neither: the target's embed/norm/lm_head weights (a "
        "target_head.safetensors)",
        decides_stand_in=True,
    )
    aux_layer_ids: list = setting(
        [], "... and the layers the dump holds (eagle3lib numbering)", decides_stand_in=True
    )
    vocab_map: str = setting(
        "", 'the draft vocab to train for (map file or checkpoint); "" = the data folder\'s map'
    )
    drafter: str = setting("", "checkpoint the warm-start arms begin from")
    allow_no_remap: bool = setting(
        False, "drafter-no-remap reproduces the scrambled-labels bug: refused unless true"
    )
    remap_missing: str = setting(
        "verifier", "rows for tokens the drafter's map lacks: verifier|mean|zeros|random"
    )
    train_lm_head: bool = setting(
        True, "SpecForge trains lm_head; speculators freezes it", decides_stand_in=True
    )
    ttt_steps: int = setting(7, "K unrolled train-time-test steps", decides_stand_in=True, at_least=1)
    step_decay: float = setting(0.8, "loss weight of step k is step_decay**k", decides_stand_in=True)
    steps: int = setting(200, "optimizer steps per arm", at_least=1)
    batch_size: int = setting(
        8,
        "sequences per optimizer step, all processes and micro-batches together",
        decides_stand_in=True,
        at_least=1,
    )
    micro_batch_size: int = setting(
        1,
        "sequences per forward; accumulation = batch_size / (micro x nproc)",
        decides_stand_in=True,
        at_least=1,
    )
    seq_len: int = setting(512, "tokens per training row", decides_stand_in=True, at_least=2)
    packing: bool = setting(
        True,
        "fill each row of seq_len with whole samples, each attending and graded as if alone (false: one "
        "sample a row, padded)",
        decides_stand_in=True,
    )
    lr: float = setting(3e-4, "peak learning rate", decides_stand_in=True)
    betas: list = setting([0.9, 0.95], "AdamW's betas", decides_stand_in=True)
    weight_decay: float = setting(0.0, "AdamW's weight decay", decides_stand_in=True)
    warmup_steps: int = setting(20, "linear warmup to lr", decides_stand_in=True, at_least=0)
    min_lr_ratio: float = setting(0.1, "cosine decay ends at lr x min_lr_ratio", decides_stand_in=True)
    max_grad_norm: float = setting(0.5, "0 = no clipping", decides_stand_in=True)
    dtype: str = setting(
        "auto",
        "auto (bf16 autocast on GPUs and CPUs with AMX or AVX512-BF16, else fp32) | fp32 | bf16",
        decides_stand_in=True,
    )
    nproc: int = setting(
        1, "> 1: data-parallel under torchrun (gloo on CPU, nccl on GPU)", resume_free=True, at_least=1
    )
    log_every: int = setting(10, "steps between metrics.jsonl entries", resume_free=True, at_least=1)
    checkpoint_every: int = setting(100, "0 = only the final drafter", resume_free=True, at_least=0)
    keep_checkpoints: int = setting(2, "checkpoints kept, the newest", resume_free=True, at_least=1)
    check_batches: int = setting(4, "batches of the step-0 check", resume_free=True, at_least=1)
    check_enforce: bool = setting(True, "a warm start that fails the step-0 check stops", resume_free=True)
    save_speculators: bool = setting(
        False, "also save the final drafter in the speculators layout", resume_free=True
    )
    l2sp: float = setting(
        0.0,
        "L2-SP: adds l2sp/2 x the squared distance of the trained weights from the warm start (after its "
        "remap) to the loss; 0 = off. With arm drafter-l2sp in train.arms, that arm alone gets it",
    )
    validation_prompts: int = setting(
        0,
        "τ along training: prompts per benchmark of evaluate.benchmarks, drawn from the end of the held-out "
        "questions (disjoint from 05's); 0 = no measurement, the drafter is the last weights",
        at_least=0,
    )
    validation_new_tokens: int = setting(64, "new tokens a validation prompt is decoded for", at_least=1)
    curve_points: int = setting(
        6, "measurements after the start, at steps doubling up to train.steps (steps/32 .. steps for 6)",
        at_least=1,
    )
    select_by: str = setting(
        "first",
        "which measured drafter becomes drafter/: first (best τ on the first benchmark), mean (best mean τ "
        "over the benchmarks) or last",
    )
    early_stop: int = setting(
        0, "stop an arm after this many measurements without a better validation τ; 0 = never", at_least=0
    )
    scratch: ScratchSizes = subsection(
        ScratchSizes, "the scratch arm's sizes; null = copy the warm-start drafter's", decides_stand_in=True
    )


@dataclass
class Params:
    """Every section, grouped by the step that reads it."""

    run: RunSection = subsection(RunSection, "every step")
    stand_in: StandInSection = subsection(StandInSection, "00_prepare_data's stand-in source drafter")
    probe: ProbeSection = subsection(ProbeSection, "01_probe_drafter and the decoding 05 shares")
    evaluate: EvaluateSection = subsection(EvaluateSection, "05_evaluate")
    target: TargetSection = subsection(TargetSection, "the target model")
    data: DataSection = subsection(DataSection, "00_prepare_data and online text")
    vocab: VocabSection = subsection(VocabSection, "02_diff_vocab_maps")
    remap: RemapSection = subsection(RemapSection, "03_remap_lm_head")
    train: TrainSection = subsection(TrainSection, "04_finetune")


# The defaults of every parameter as the nested plain dict the code reads. A recipe in params/ overrides any
# subset; keys outside this tree are refused.
DEFAULTS: dict[str, Any] = asdict(Params())


# ---------------------------------------------------------------- roles, derived


def keys_with(section: type, role: str) -> tuple[str, ...]:
    """The settings of `section` (a section dataclass) that play `role`, in their order."""
    return tuple(f.name for f in fields(section) if f.metadata.get(role))


def section_class(name: str) -> type:
    """The dataclass of the top-level section `name` (e.g. "train")."""
    return next(f.default_factory for f in fields(Params) if f.name == name)


def minimums(name: str) -> dict[str, int]:
    """{key: its smallest working value} of the top-level section `name`, for the settings that have one."""
    return {f.name: f.metadata["at_least"] for f in fields(section_class(name)) if "at_least" in f.metadata}


def value_checks(section: type = Params, prefix: str = "") -> dict[str, Callable[[str, str, Any], None]]:
    """{dotted key: its `check`} over the whole tree."""
    found = {}
    for f in fields(section):
        if _is_section(f):
            found |= value_checks(f.default_factory, f"{prefix}{f.name}.")
        elif "check" in f.metadata:
            found[f"{prefix}{f.name}"] = f.metadata["check"]
    return found


def free_mappings(section: type = Params, prefix: str = "") -> tuple[str, ...]:
    """The dotted keys of the settings whose value is a mapping of the recipe's own keys (not a section)."""
    found, defaults = (), section()
    for f in fields(section):
        if _is_section(f):
            found += free_mappings(f.default_factory, f"{prefix}{f.name}.")
        elif isinstance(getattr(defaults, f.name), dict):
            found += (f"{prefix}{f.name}",)
    return found


def _is_section(f: Field) -> bool:
    return callable(f.default_factory) and is_dataclass(f.default_factory)


RESUME_FREE = keys_with(TrainSection, "resume_free")
ONLINE_TEXT_KEYS = keys_with(DataSection, "decides_text")
STAND_IN_DATA_KEYS = keys_with(DataSection, "decides_stand_in")
STAND_IN_TRAIN_KEYS = keys_with(TrainSection, "decides_stand_in")
VALUE_CHECKS = value_checks()
FREE_MAPPINGS = free_mappings()


def check_positive(section: str, settings: dict) -> None:
    """Refuse the settings of `section` that are below their smallest working value, naming each."""
    small = [
        f"{section}.{key} ({settings[key]}) must be at least {low}"
        for key, low in minimums(section).items()
        if settings[key] < low
    ]
    if small:
        raise ParamsError("; ".join(small))


# ---------------------------------------------------------------- reading recipes


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
        if dotted in FREE_MAPPINGS:  # keys of the recipe's own (a template's switches): merged, unchecked
            base[key] = {**base[key], **_check_type(where, dotted, base[key], value)}
        elif isinstance(base[key], dict):
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


def override_dict(overrides: dict | list[str] | None) -> dict:
    """Every override merged into one nested dict: what `eagle3 run` hands each notebook."""
    merged: dict = {}
    for item in _as_override_dicts(overrides):
        _deep_update(merged, item)
    return merged


def _deep_update(base: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
