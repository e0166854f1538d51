"""What a drafter checkpoint holds, as `eagle3 inspect` shows it: layout, architecture, every tensor, the
vocab map's sanity, the strict load report, and which serving and training projects compute it faithfully.
Imports the ground and the drafter's other modules."""

from __future__ import annotations

import os

from eagle3lib.drafter.checkpoint import VOCAB_MAP_KEYS, load_drafter
from eagle3lib.drafter.config import LAYOUT_READERS, DrafterConfig, aux_ids_to_vllm
from eagle3lib.drafter.vocab import VocabMap


def inspect_checkpoint(path: str | os.PathLike, config: str | os.PathLike | None = None) -> dict:
    """Everything `eagle3 inspect` shows: layout, architecture, tensors, vocab-map sanity, load report,
    and which projects compute the checkpoint faithfully.

    Loads non-strictly so that a broken checkpoint is described rather than refused (unreadable files,
    NaN/Inf and contradictory vocab maps still raise)."""
    drafter, report = load_drafter(path, strict=False, config=config)
    c = drafter.config
    vocab = VocabMap.from_pair(drafter.d2t, drafter.t2d, str(path))
    vocab_missing = any(key in report.missing for key in VOCAB_MAP_KEYS)
    sanity = {
        "vd": vocab.vd,
        "vt": vocab.vt,
        "d2t_t2d_agree": not vocab_missing,
        "first_draft_ids": vocab.draft_ids[:8].tolist(),
        "last_draft_ids": vocab.draft_ids[-8:].tolist(),
        "identity_positions": int((vocab.d2t == 0).sum()),  # draft id == target id
        "status": "missing: identity placeholder" if vocab_missing else "d2t and t2d present and consistent",
    }
    return {
        "path": str(path),
        "layout": report.layout,
        "config": c.to_dict(),
        "aux_layer_ids_vllm": aux_ids_to_vllm(c.aux_layer_ids) if c.aux_layer_ids is not None else None,
        "embedding": "carried by the checkpoint" if drafter.owns_embedding else "from the target",
        "tensors": report.tensors,
        "vocab_map": sanity,
        "engines": engine_faithfulness(c, report.layout),
        "report": report.to_dict(),
        "report_text": str(report),
    }


def format_inspection(info: dict) -> str:
    c = info["config"]
    flag_names = (
        "norm_before_residual", "fc_norm", "norm_before_lm_head", "feed_normed_hidden", "norm_before_fc"
    )
    flags = ", ".join(f"{k} {c[k]}" for k in flag_names)
    lines = [
        f"{info['path']}: {info['layout']} layout",
        f"  H {c['hidden_size']}, heads {c['num_attention_heads']} ({c['num_key_value_heads']} KV) x "
        f"{c['head_dim']}, intermediate {c['intermediate_size']}, Vt {c['vocab_size']}, "
        f"Vd {c['draft_vocab_size']}, Ht {c['target_hidden_size']}",
        f"  aux layer ids {c['aux_layer_ids']} (eagle3lib/SGLang numbering) = {info['aux_layer_ids_vllm']} "
        "(speculators/vLLM)",
        f"  {flags}",
        f"  rope theta {c['rope_theta']}, scaling {c['rope_scaling']}; embedding: {info['embedding']}",
        f"tensors ({len(info['tensors'])}):",
    ]
    width = max((len(key) for key, _, _ in info["tensors"]), default=0)
    lines += [f"  {key:<{width}}  {shape}  {dtype}" for key, shape, dtype in info["tensors"]]
    v = info["vocab_map"]
    lines.append(
        f"vocab map: {v['status']}; Vd {v['vd']} of Vt {v['vt']}, draft ids {v['first_draft_ids']} ... "
        f"{v['last_draft_ids']}, {v['identity_positions']} positions where draft id = target id"
    )
    lines.append("engines reading this layout:")
    for engine, reasons in info["engines"].items():
        verdict = "faithful" if not reasons else "COMPUTES ANOTHER FUNCTION: " + "; ".join(reasons)
        lines.append(f"  {engine}: {verdict}")
    lines.append("load report: " + info["report_text"])
    return "\n".join(lines)


def engine_faithfulness(config: DrafterConfig, layout: str) -> dict[str, list[str]]:
    """For each project that reads `layout`, why it computes this checkpoint differently (empty: faithful).
    An SGLang-layout config's aux ids are not read by vLLM, which then takes its defaults
    (docs/formats.md §2)."""
    mismatches = config.engine_mismatches()
    engines = {engine: list(mismatches[engine]) for engine in LAYOUT_READERS[layout]}
    if layout == "sglang" and config.aux_layer_ids is not None:
        engines["vLLM"].append(
            "reads no aux ids from this layout (uses its defaults 2, N//2, N-3 = eagle3lib [1, N//2-1, "
            f"N-4], not {config.aux_layer_ids} unless they are the target's defaults); serve a "
            "speculators-layout copy"
        )
    return engines
