"""The audit of a drafter against a new target before a single step (`eagle3 check`, notebook 01, and the
warm starts of 04): what silently breaks a move, compared value by value, each row PASS, WARN or FAIL with
both values and the fix.

- shapes: the drafter reads the target's hidden states and embedding and drafts its vocabulary;
- aux layers: within the target's depth, in each engine's numbering, a list shifted by one flagged;
- positions: RoPE θ, scaling and partial rotary against the target's; max_position_embeddings against the
  target's context (vLLM clamps RoPE at the drafter's, and acceptance collapses past it);
- norms and flags: what the chosen engine computes of this config (`DrafterConfig.engine_mismatches`);
- the vocab map: valid (in range, no duplicates, t2d matching d2t, the identity stored as zeros), how far it
  agrees with the map of the new data (the seed's 252 of 32,000), and how much of the new data's target
  tokens it can draft at all (coverage);
- chat template and thinking mode: the mode the drafter was trained in (its provenance) against the mode it
  will be served in;
- optionally, a quick probe: the drafter's τ on held-out prompts of the new data, as served as-is.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle3lib.drafter.checkpoint import PROVENANCE
from eagle3lib.drafter.config import (
    ENGINE_AUX_LAYERS,
    DrafterConfig,
    aux_ids_to_vllm,
    default_aux_layer_ids,
    read_config,
)
from eagle3lib.drafter.vocab import VocabMap
from eagle3lib.files import resolve_path

ENGINES = {"sglang": "SGLang", "vllm": "vLLM", "speculators": "speculators", "specforge": "SpecForge"}
STATUSES = ("PASS", "WARN", "FAIL")
COVERAGE_WARN = 0.95  # a map that cannot draft one target token in twenty caps τ visibly


@dataclass
class Row:
    check: str
    status: str  # PASS | WARN | FAIL
    compared: str  # what was compared, both values
    fix: str = ""  # the command or setting that mends it

    def line(self) -> str:
        fix = f"\n      fix: {self.fix}" if self.fix else ""
        return f"{self.status:4s}  {self.check}: {self.compared}{fix}"


@dataclass
class TargetConfig:
    """What the audit reads of a target: its config.json and its chat template, no weights."""

    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    rope_theta: float
    rope_scaling: dict | None
    partial_rotary_factor: float
    max_position_embeddings: int
    chat_template: str

    @classmethod
    def read(cls, spec: str) -> TargetConfig:
        from transformers import AutoConfig, AutoTokenizer

        from eagle3lib.decoding.engines import target_folder

        folder = target_folder(spec)
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or None
        if scaling and scaling.get("rope_type", scaling.get("type")) == "default" and len(scaling) == 1:
            scaling = None
        template = AutoTokenizer.from_pretrained(folder, local_files_only=True).chat_template or ""
        return cls(str(spec), config.num_hidden_layers, config.hidden_size, config.vocab_size, float(theta),
                   scaling, float(getattr(config, "partial_rotary_factor", 1.0) or 1.0),
                   int(config.max_position_embeddings), str(template))


def rows_of(rows: list[Row]) -> dict[str, int]:
    return {status: sum(r.status == status for r in rows) for status in STATUSES}


def audit(drafter: str | os.PathLike, target: TargetConfig, *, engine: str = "sglang",
          data_map: VocabMap | None = None, counts: torch.Tensor | None = None,
          serve_template_kwargs: dict | None = None) -> list[Row]:
    """Every check of a drafter checkpoint folder against `target`, for serving on `engine`; `data_map` and
    `counts` (target-token counts of the new data, [Vt]) add the map's agreement and coverage."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    folder = resolve_path(drafter)
    config, layout, _ = read_config(folder)
    raw = json.loads((folder / "config.json").read_text())
    rows = shapes(config, target) + aux_layers(config, layout, target, engine)
    rows += positions(config, raw, target) + flags(config, engine)
    rows += vocab_map(folder, config, data_map, counts)
    rows.append(thinking_mode(folder, target, serve_template_kwargs or {}))
    return rows


def _compare(check: str, drafter, target, fix: str, fail: bool = True) -> Row:
    same = drafter == target
    status = "PASS" if same else ("FAIL" if fail else "WARN")
    relation = "=" if same else "≠"
    return Row(check, status, f"drafter {drafter} {relation} target {target}", "" if same else fix)


def shapes(config: DrafterConfig, target: TargetConfig) -> list[Row]:
    refit = "a drafter for this target: train one (arm scratch) or take one made for it"
    rows = [
        _compare("hidden size (the target's embedding feeds the drafter)", config.hidden_size,
                 target.hidden_size, refit),
        _compare("target hidden size (the aux states fc reads)", config.target_hidden_size,
                 target.hidden_size, refit),
        _compare("target vocab size (Vt)", config.vocab_size, target.vocab_size, refit),
    ]
    heads = config.num_attention_heads * config.head_dim
    grouped = config.num_attention_heads % config.num_key_value_heads == 0
    rows.append(Row("heads", "PASS" if grouped else "FAIL",
                    f"{config.num_attention_heads} query / {config.num_key_value_heads} key-value heads x "
                    f"{config.head_dim} = {heads} (H {config.hidden_size})",
                    "" if grouped else "num_attention_heads must be a multiple of num_key_value_heads"))
    fc, three = config.fc_in_features, config.num_aux_layers == ENGINE_AUX_LAYERS
    rows.append(Row("aux count and fc width", "PASS" if three else "FAIL",
                    f"{config.num_aux_layers} aux states x Ht {config.target_hidden_size} = fc width {fc}; "
                    f"SGLang, vLLM and SpecForge build fc for {ENGINE_AUX_LAYERS}",
                    "" if three else "train a 3-aux-layer drafter"))
    return rows


def aux_layers(config: DrafterConfig, layout: str, target: TargetConfig, engine: str) -> list[Row]:
    ids = config.aux_layer_ids
    if ids is None:
        return [Row("aux layers", "PASS", f"none in config.json: the engine's default for a "
                                          f"{target.num_layers}-layer target")]
    outside = [i for i in ids if i >= target.num_layers]
    numbering = (f"eagle3lib/SGLang {ids} (output of layer i) = vLLM/speculators {aux_ids_to_vllm(ids)} "
                 f"(state entering layer i+1); this {layout}-layout config.json stores the "
                 f"{'former' if layout == 'sglang' else 'latter'}")
    rows = [Row("aux layers within the target", "FAIL" if outside else "PASS",
                f"{numbering}; the target has {target.num_layers} layers",
                f"ids {outside} do not exist: give the target's own aux layer ids" if outside else "")]
    try:
        default = default_aux_layer_ids(target.num_layers)
    except ValueError:
        return rows
    for shift in (1, -1):
        if ids == [d + shift for d in default]:
            rows.append(Row("aux layer numbering", "WARN",
                            f"{ids} is the target's EAGLE-3 default {default} shifted by {shift:+d}: a list "
                            "in the other project's numbering?",
                            "give ids as the output of layer i (SGLang, eagle3lib) in an sglang-layout "
                            "config, as the state entering layer i (vLLM) in a speculators one"))
    if engine == "vllm" and layout == "sglang":
        if ids == default:
            rows.append(Row("aux layers as vLLM reads them", "PASS",
                            f"the target's default {ids}, which vLLM takes from an sglang-layout config"))
        else:
            rows.append(Row("aux layers as vLLM reads them", "WARN",
                            f"vLLM reads no aux ids from an sglang-layout config and takes its default "
                            f"{aux_ids_to_vllm(default)}; this drafter was trained on {aux_ids_to_vllm(ids)} "
                            "(vLLM numbering)",
                            "serve a speculators-layout copy: eagle3 convert DRAFTER --to speculators "
                            "--target TARGET -o OUT"))
    return rows


def positions(config: DrafterConfig, raw: dict, target: TargetConfig) -> list[Row]:
    rows = [
        _compare("RoPE θ", config.rope_theta, target.rope_theta,
                 "set rope_theta in the drafter's config.json to the target's"),
        _compare("RoPE scaling", config.rope_scaling, target.rope_scaling,
                 "give the drafter the target's rope_scaling", fail=False),
    ]
    partial = float(raw.get("partial_rotary_factor", 1.0) or 1.0)
    rows.append(Row("partial rotary", "PASS" if partial == 1.0 == target.partial_rotary_factor else "FAIL",
                    f"drafter {partial} (eagle3lib, SGLang and vLLM's EAGLE-3 layer rotate the whole head), "
                    f"target {target.partial_rotary_factor}",
                    "" if partial == 1.0 == target.partial_rotary_factor else
                    "a drafter with partial rotary computes other positions than its engine: retrain"))
    short = config.max_position_embeddings < target.max_position_embeddings
    rows.append(Row("max positions", "WARN" if short else "PASS",
                    f"drafter max_position_embeddings {config.max_position_embeddings}, target "
                    f"{target.max_position_embeddings}" + ("; vLLM clamps the drafter's RoPE there, and "
                                                             "acceptance collapses past it" if short else ""),
                    f"set max_position_embeddings {target.max_position_embeddings} in the drafter's "
                    "config.json" if short else ""))
    return rows


def flags(config: DrafterConfig, engine: str) -> list[Row]:
    name = ENGINES[engine]
    reasons = config.engine_mismatches()[name]
    shown = (f"norm_before_residual {config.norm_before_residual}, fc_norm {config.fc_norm}, "
             f"norm_before_lm_head {config.norm_before_lm_head}, "
             f"feed_normed_hidden {config.feed_normed_hidden}")
    return [Row(f"norms and flags as {name} computes them", "FAIL" if reasons else "PASS",
                shown + ("; " + "; ".join(reasons) if reasons else ""),
                "serve on an engine that computes them (eagle3 inspect lists which)" if reasons else "")]


def vocab_map(folder: Path, config: DrafterConfig, data_map: VocabMap | None,
              counts: torch.Tensor | None) -> list[Row]:
    try:
        drafter_map = VocabMap.load(folder)
    except ValueError as err:
        from safetensors import safe_open

        hint = ""
        weights = folder / "model.safetensors"
        if weights.is_file():
            with safe_open(weights, "pt") as handle:
                if "d2t" in handle.keys():
                    d2t = handle.get_tensor("d2t")
                    if torch.equal(d2t, torch.arange(len(d2t))):
                        hint = "; d2t holds arange: d2t stores offsets, so the identity map is zeros"
        return [Row("vocab map valid", "FAIL", f"{err}{hint}",
                    "rebuild the map: eagle3 remap (or VocabMap.from_counts) writes d2t as offsets")]
    rows = [Row("vocab map valid", "PASS",
                f"Vd {drafter_map.vd} of Vt {drafter_map.vt}: in range, distinct, t2d matches d2t"
                + ("; the identity map (all offsets 0)" if bool((drafter_map.d2t == 0).all()) else ""))]
    if data_map is not None:
        vd = min(drafter_map.vd, data_map.vd)
        agree = int((drafter_map.draft_ids[:vd] == data_map.draft_ids[:vd]).sum())
        shared = len(set(drafter_map.draft_ids.tolist()) & set(data_map.draft_ids.tolist()))
        same = drafter_map == data_map
        rows.append(Row("vocab map against the new data's", "PASS" if same else "WARN",
                        f"{agree:,} of {data_map.vd:,} draft positions name the same token, {shared:,} "
                        "tokens in both" + ("" if same else ": lm_head rows must move (the seed's bug is "
                                                            "loading them in place)"),
                        "" if same else "eagle3 remap DRAFTER --to-map DATA_MAP --target TARGET -o OUT (04's "
                                        "arm drafter does it)"))
    if counts is not None:
        total = float(counts.sum())
        covered = float(counts[drafter_map.draft_ids].sum()) / max(total, 1.0)
        rows.append(Row("coverage of the new data", "PASS" if covered >= COVERAGE_WARN else "WARN",
                        f"the map can draft {covered:.1%} of the new data's {int(total):,} target tokens "
                        f"(a token outside it is never accepted)",
                        "" if covered >= COVERAGE_WARN else "remap onto the new data's map (eagle3 remap), "
                        "or a larger draft vocabulary"))
    return rows


def thinking_mode(folder: Path, target: TargetConfig, serve: dict) -> Row:
    record = folder / PROVENANCE
    if not record.is_file():
        return Row("chat template and thinking mode", "WARN",
                   f"no {PROVENANCE}: the mode the drafter was trained in is unknown; served with {serve}",
                   "check how its data was rendered (enable_thinking and the like) against how you serve")
    recipe = json.loads(record.read_text()).get("recipe", {}).get("data", {})
    trained = recipe.get("chat_template_kwargs", {})
    thinks = "</think>" in target.chat_template
    same = trained == serve
    return Row("chat template and thinking mode", "PASS" if same else "FAIL",
               f"trained with chat_template_kwargs {trained}, served with {serve}"
               + (" (the target's template thinks: <think> markers)" if thinks else ""),
               "" if same else "serve in the mode it was trained in, or fine-tune it on data regenerated in "
                               "the served mode (data.chat_template_kwargs)")


def report(rows: list[Row]) -> str:
    counted = rows_of(rows)
    lines = [row.line() for row in rows]
    lines.append(f"{counted['PASS']} passed, {counted['WARN']} warned, {counted['FAIL']} failed")
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict]:
    return [asdict(row) for row in rows]


def data_facts(data: str, target_spec: str, vd: int, vt: int, limit: int = 2000
               ) -> tuple[VocabMap, torch.Tensor, str]:
    """(the new data's vocab map, its target-token counts [Vt], what was read) from a data folder (its map and
    counts), a run folder (its 00_prepare_data), or a conversation corpus: its first `limit` training
    conversations rendered by the target's template, the tokens in the loss counted, a map of Vd built."""
    from eagle3lib.data.corpora import split_conversations
    from eagle3lib.data.layout import TOKEN_COUNTS_FILE, VOCAB_MAP_FILE, load_token_counts, prepared_dir
    from eagle3lib.data.sources import conversation_samples
    from eagle3lib.generation.regenerate import TargetFacts

    path = resolve_path(data)
    folder = prepared_dir(path) if (path / "00_prepare_data").is_dir() else path
    if (folder / TOKEN_COUNTS_FILE).is_file():
        counts, _ = load_token_counts(folder)
        found = folder / VOCAB_MAP_FILE
        data_map = VocabMap.load(found, vt=vt) if found.is_file() else VocabMap.from_counts(counts, vd, vt)
        return data_map, counts, f"{folder} (its token counts and vocab map)"
    from collections import Counter
    from itertools import islice

    from eagle3lib.data.conversations import ChatRenderer

    target = TargetFacts.read(target_spec)
    renderer = ChatRenderer(target.tokenizer, target.stop_token_ids)
    counts = torch.zeros(vt, dtype=torch.long)
    conversations = islice(split_conversations(data, "train", 0.1), limit)
    for sample in conversation_samples(renderer, conversations, 1 << 20, Counter()):
        counts += torch.bincount(sample.input_ids[sample.loss_mask], minlength=vt)
    return VocabMap.from_counts(counts, vd, vt, data), counts, f"{data} (its first {limit:,} conversations)"


def for_run(drafter: str | os.PathLike, params: dict, run_dir: str | os.PathLike) -> list[Row]:
    """The audit a run opens with (notebook 01): the drafter against the recipe's target, and against the
    data 00_prepare_data made in this run when there is some (its map and token counts)."""
    from eagle3lib.data.layout import TOKEN_COUNTS_FILE, prepared_dir

    target = TargetConfig.read(params["target"]["spec"])
    data_map = counts = None
    if (prepared_dir(run_dir) / TOKEN_COUNTS_FILE).is_file():
        config = read_config(resolve_path(drafter))[0]
        data_map, counts, _ = data_facts(str(run_dir), target.name, config.draft_vocab_size,
                                         target.vocab_size)
    return audit(drafter, target, data_map=data_map, counts=counts,
                 serve_template_kwargs=params["data"]["chat_template_kwargs"])
