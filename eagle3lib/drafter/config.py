"""`DrafterConfig`: one description of an EAGLE-3 drafter, read from and written to each layout's config.json.

Two layouts exist (docs/formats.md §2):
- SGLang / SpecForge / EAGLE / AQ-MedAI: a flat Llama config, `architectures: ["LlamaForCausalLMEagle3"]`,
  aux ids under `eagle_config`.
- speculators (vLLM's training library): `speculators_model_type: "eagle3"`, the decoder layer's settings
  under `transformer_layer_config`, flags at the top level.

Aux-layer ids. eagle3lib has one convention: id i = the output of target decoder layer i = Hugging Face
`hidden_states[i + 1]` (SGLang's numbering). speculators and vLLM number the state *entering* layer i, so
the same layers carry ids one larger there; `aux_ids_to_vllm` / `aux_ids_from_vllm` convert when a
speculators config is written or read.

`norm_before_residual` defaults differ between engines, so it is always written explicitly. When a file
lacks it: SGLang has no such option (it behaves as False) and vLLM's Llama EAGLE-3 model reads a missing
key as False, so an SGLang-layout config without the key means False; vLLM's speculators config reader
fills in True (the speculators class itself defaults to False), and vLLM is what serves that layout, so a
speculators-layout config without the key means True. Either assumption is reported as a note.

`norm_output` means different things per project (docs/formats.md §2), so eagle3lib keeps two flags of its
own:
- `norm_before_lm_head`: logits = lm_head(norm(out)) rather than lm_head(out). SpecForge's `norm_output`
  (default true) is this flag; SGLang, vLLM and speculators always apply the norm.
- `feed_normed_hidden` (EAGLE-3.1): the state fed to the next draft step is norm(out), not out. speculators',
  vLLM's and SGLang's `norm_output` (default false) is this flag; SpecForge always feeds `out`.
An SGLang-layout config is read by SGLang, vLLM and SpecForge alike, so a standard drafter is written
without `norm_output` (each project's default is then the standard computation) and any other combination
is written with the key eagle3lib reads back (`FEED_NORMED_KEY`) plus the `norm_output` value most engines
agree on; `engine_mismatches` says which project computes something else.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3lib.files import atomic_write_text

SGLANG_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHITECTURES = ("Eagle3DraftModel", "Eagle3Speculator")
LAYOUTS = ("sglang", "speculators")
# The SGLang layout keeps speculators_config's fields (verifier, proposal length) under this key so that
# speculators → sglang → speculators loses nothing. Not "speculators_config": vLLM reads any config with
# that key as the speculators layout.
SPECULATION_KEY = "eagle3lib_speculation"
# Which state an SGLang-layout drafter feeds to its next step, as eagle3lib wrote it: "norm_output" alone is
# ambiguous there (SpecForge reads it as "norm before lm_head", SGLang and vLLM as "feed post-norm states").
FEED_NORMED_KEY = "eagle3lib_feed_normed_hidden"
# The speculators layout has no flag for logits without the final norm; eagle3lib writes this one for it.
NORM_BEFORE_LM_HEAD_KEY = "eagle3lib_norm_before_lm_head"
# The projects that compute a drafter from each layout's files.
LAYOUT_READERS = {"sglang": ("SGLang", "vLLM", "SpecForge"), "speculators": ("vLLM", "speculators")}
# SGLang, vLLM and SpecForge build `fc` as 3 x target_hidden_size, whatever the config says.
ENGINE_AUX_LAYERS = 3

# RoPE variants whose frequencies depend only on the config (computed with transformers' own functions);
# "dynamic" and "longrope" change with the sequence length and are refused.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ConfigError(ValueError):
    """A drafter config that is malformed, contradicts itself, or asks for something eagle3lib cannot do."""


class EngineMismatchError(ConfigError):
    """An export that a serving or training project reading that layout would compute differently."""


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers for an N-layer target, in eagle3lib's numbering: [1, N//2-1, N-4]."""
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if not all(a < b for a, b in zip(ids, ids[1:], strict=False)) or ids[0] < 0:
        raise ConfigError(
            f"a {num_layers}-layer target has no distinct default aux layers ({ids}); give aux_layer_ids "
            "explicitly"
        )
    return ids


def aux_ids_to_vllm(ids: list[int]) -> list[int]:
    """eagle3lib/SGLang ids (output of layer i) → speculators/vLLM ids (state entering layer i+1)."""
    return [i + 1 for i in ids]


def aux_ids_from_vllm(ids: list[int]) -> list[int]:
    """speculators/vLLM ids → eagle3lib/SGLang ids."""
    return [i - 1 for i in ids]


@dataclass
class DrafterConfig:
    hidden_size: int  # H
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # Vt, the target's vocab
    draft_vocab_size: int  # Vd
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Hugging Face form with "rope_type"; None = plain RoPE
    max_position_embeddings: int = 2048
    target_hidden_size: int | None = None  # Ht; None means H
    aux_layer_ids: list[int] | None = None  # eagle3lib numbering; None = the engine's default for the target
    norm_before_residual: bool = False  # residual is hidden_norm(h) instead of h (speculators/vLLM option)
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm on each aux state (width Ht) before `fc`
    norm_before_lm_head: bool = True  # logits = lm_head(norm(out)); SpecForge's norm_output
    feed_normed_hidden: bool = False  # EAGLE-3.1: norm(out) is fed to the next step; speculators' norm_output
    # An option eagle3lib cannot honour yet: refused when set, never ignored.
    norm_before_fc: bool = False
    num_hidden_layers: int = 1
    hidden_act: str = "silu"
    # speculators_config fields, kept so speculators → sglang → speculators keeps them.
    speculative_tokens: int = 3
    verifier: str | None = None  # the target's name or path
    verifier_architectures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.aux_layer_ids is not None:
            self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            scaling.setdefault("rope_type", scaling.pop("type", "default"))
            scaling.pop("rope_theta", None)
            self.rope_scaling = None if scaling["rope_type"] == "default" and len(scaling) == 1 else scaling

    @property
    def num_aux_layers(self) -> int:
        """A: how many target hidden states `fc` takes (EAGLE-3 uses 3 when the config names none)."""
        return len(self.aux_layer_ids) if self.aux_layer_ids is not None else 3

    @property
    def fc_in_features(self) -> int:
        return self.num_aux_layers * self.target_hidden_size

    @property
    def rope_parameters(self) -> dict:
        """RoPE settings in the form transformers 5 uses (`rope_theta` inside)."""
        return {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}

    def check(self, where: str = "DrafterConfig") -> None:
        """Raise ConfigError naming `where` and the option for anything malformed or unsupported."""
        if self.norm_before_fc:
            raise ConfigError(
                f"{where}: norm_before_fc=true is not supported by eagle3lib's drafter (it would compute "
                "something else than the checkpoint was trained for); refusing instead of ignoring it"
            )
        if self.feed_normed_hidden and not self.norm_before_lm_head:
            raise ConfigError(
                f"{where}: a drafter that feeds norm(out) forward (EAGLE-3.1) and takes logits without the "
                "final norm exists in no reference project; refusing the combination"
            )
        if self.num_hidden_layers != 1:
            raise ConfigError(
                f"{where}: num_hidden_layers={self.num_hidden_layers}; eagle3lib supports one-layer "
                "EAGLE-3 drafters only (extra layers, SGLang's additional_layers.*, are not implemented)"
            )
        if self.hidden_act != "silu":
            raise ConfigError(f"{where}: hidden_act={self.hidden_act!r} is not supported (only 'silu')")
        rope_type = self.rope_parameters["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"{where}: rope type {rope_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        sizes = {
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{where}: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{where}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(
                f"{where}: draft_vocab_size={self.draft_vocab_size} exceeds vocab_size={self.vocab_size}"
            )
        if self.aux_layer_ids is not None:
            ids = self.aux_layer_ids
            if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
                raise ConfigError(
                    f"{where}: aux layer ids {ids} (eagle3lib numbering) must be distinct and >= 0"
                )

    def to_dict(self) -> dict:
        return asdict(self)

    def engine_mismatches(self) -> dict[str, list[str]]:
        """For each project (SGLang, vLLM, SpecForge, speculators), why it would compute another function
        than this drafter's, read from its code (docs/formats.md §2); an empty list means it is faithful."""
        reasons: dict[str, list[str]] = {"SGLang": [], "vLLM": [], "SpecForge": [], "speculators": []}
        if self.num_aux_layers != ENGINE_AUX_LAYERS:
            for engine in ("SGLang", "vLLM", "SpecForge"):
                reasons[engine].append(
                    f"{self.num_aux_layers} aux layers: it builds fc for {ENGINE_AUX_LAYERS} x "
                    "target_hidden_size"
                )
        if self.norm_before_residual:
            for engine in ("SGLang", "SpecForge"):
                reasons[engine].append(
                    "ignores norm_before_residual=true (takes the residual before hidden_norm)"
                )
        if not self.norm_before_lm_head:
            for engine in ("SGLang", "vLLM", "speculators"):
                reasons[engine].append("always applies the final norm before lm_head (this drafter does not)")
        if self.feed_normed_hidden:
            reasons["SpecForge"].append(
                "always feeds the pre-norm state to the next step (this EAGLE-3.1 drafter feeds norm(out))"
            )
        if self.target_hidden_size != self.hidden_size:
            reasons["speculators"].append(
                f"builds fc (and fc_norm) from hidden_size {self.hidden_size}, not target_hidden_size "
                f"{self.target_hidden_size}"
            )
        return reasons

    def check_engines(
        self, layout: str, where: str, allow_mismatch: bool = False, engines: Sequence[str] | None = None
    ) -> list[str]:
        """Refuse (EngineMismatchError) a `layout` export that a project reading that layout (or only those
        in `engines`) would compute differently, naming the flags and projects; with `allow_mismatch`, return
        the same lines as notes."""
        mismatches = self.engine_mismatches()
        readers = [e for e in LAYOUT_READERS[layout] if engines is None or e in engines]
        lines = [f"{engine} {reason}" for engine in readers for reason in mismatches[engine]]
        if lines and not allow_mismatch:
            raise EngineMismatchError(
                f"{where}: refusing a {layout}-layout export that would compute something else: "
                f"{'; '.join(lines)}. Export to "
                f"{'the speculators layout' if layout == 'sglang' else 'another layout'} or pass "
                "--allow-engine-mismatch (allow_engine_mismatch=True) to write it anyway"
            )
        return [f"engine mismatch allowed: {line}" for line in lines]

    @classmethod
    def for_target(
        cls,
        target_config: Any,
        draft_vocab_size: int,
        aux_layer_ids: list[int] | None = None,
        norm_before_residual: bool = False,
    ) -> DrafterConfig:
        """A drafter shaped like one decoder layer of a Hugging Face Llama-style target config."""
        heads = target_config.num_attention_heads
        rope = dict(getattr(target_config, "rope_parameters", None) or {})
        rope_theta = float(rope.pop("rope_theta", getattr(target_config, "rope_theta", 10000.0)))
        return cls(
            hidden_size=target_config.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
            intermediate_size=target_config.intermediate_size,
            vocab_size=target_config.vocab_size,
            draft_vocab_size=draft_vocab_size,
            rms_norm_eps=float(target_config.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope or getattr(target_config, "rope_scaling", None),
            max_position_embeddings=target_config.max_position_embeddings,
            target_hidden_size=target_config.hidden_size,
            aux_layer_ids=(
                aux_layer_ids
                if aux_layer_ids is not None
                else default_aux_layer_ids(target_config.num_hidden_layers)
            ),
            norm_before_residual=norm_before_residual,
        )


# ----------------------------------------------------------------------------- reading


def read_config(path: str | Path) -> tuple[DrafterConfig, str, list[str]]:
    """Read a drafter's config.json (or the folder holding it) → (config, layout, notes).

    `layout` is "sglang" or "speculators"; `notes` lists every default that had to be assumed.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no drafter config: {file} does not exist")
    try:
        raw = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{file}: not valid JSON ({err})") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    layout = config_layout(raw, str(file))
    notes: list[str] = []
    reader = _from_speculators if layout == "speculators" else _from_sglang
    config = reader(raw, str(file), notes)
    config.check(str(file))
    return config, layout, notes


def config_layout(raw: dict, where: str) -> str:
    """Which layout a parsed config.json belongs to; unknown architectures are refused."""
    architectures = raw.get("architectures") or []
    if "speculators_model_type" in raw or "transformer_layer_config" in raw:
        kind = raw.get("speculators_model_type")
        if kind != "eagle3":
            raise ConfigError(
                f"{where}: speculators_model_type={kind!r}; only 'eagle3' drafters are supported"
            )
        return "speculators"
    if any(a in SGLANG_ARCHITECTURES for a in architectures):
        return "sglang"
    known = ", ".join(SGLANG_ARCHITECTURES + SPECULATORS_ARCHITECTURES)
    raise ConfigError(
        f"{where}: architectures={architectures!r} is not an EAGLE-3 drafter this project knows ({known}); a "
        "drafter labelled with its target's class (e.g. LlamaForCausalLM) also fails to load in SGLang"
    )


_REQUIRED = object()


def _number(raw: dict, key: str, where: str, kind: type = int, default: Any = _REQUIRED) -> Any:
    """`raw[key]` as `kind`, or `default` when it is absent or null (a required key without one), naming the
    file and the key when it is not a number."""
    value = raw.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ConfigError(f"{where}: required key '{key}' is missing")
        return default
    if kind is int:
        return _whole(value, key, where)
    try:
        return kind(value)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {key} must be a number, got {value!r}") from err


def _whole(value: Any, key: str, where: str) -> int:
    """A size or an id: an integer as JSON writes one (64, or 64.0), never a fraction silently cut."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ConfigError(f"{where}: {key} must be a whole number, got {value!r}")
    return int(value)


def _layer_ids(raw: dict, key: str, where: str) -> list[int] | None:
    """The aux layer ids under `key` (None when absent), naming the file and key unless they are integers."""
    ids = raw.get(key)
    if ids is None:
        return None
    if not isinstance(ids, list):
        raise ConfigError(f"{where}: {key} must be a list of integers, got {ids!r}")
    return [_whole(i, key, where) for i in ids]


def _refuse_biases(raw: dict, where: str) -> None:
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise ConfigError(f"{where}: {key}=true is not supported (EAGLE-3 drafters have no biases)")


def _read_rope(raw: dict, where: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from `rope_theta`/`rope_scaling` or transformers 5's `rope_parameters`."""
    parameters = raw.get("rope_parameters")
    if parameters is not None:
        if not isinstance(parameters, dict) or "rope_theta" not in parameters:
            raise ConfigError(
                f"{where}: rope_parameters must be an object with rope_theta, got {parameters!r}"
            )
        scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
        return _number(parameters, "rope_theta", where, float), scaling
    return _number(raw, "rope_theta", where, float, 10000.0), raw.get("rope_scaling")


def _layer_fields(raw: dict, where: str) -> dict:
    """The decoder-layer settings shared by both layouts (flat in SGLang's, nested in speculators')."""
    _refuse_biases(raw, where)
    hidden_size = _number(raw, "hidden_size", where)
    heads = _number(raw, "num_attention_heads", where)
    rope_theta, rope_scaling = _read_rope(raw, where)
    return dict(
        hidden_size=hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=_number(raw, "num_key_value_heads", where, default=None) or heads,
        head_dim=_number(raw, "head_dim", where, default=None) or hidden_size // heads,
        intermediate_size=_number(raw, "intermediate_size", where),
        vocab_size=_number(raw, "vocab_size", where),
        rms_norm_eps=_number(raw, "rms_norm_eps", where, float, 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=_number(raw, "max_position_embeddings", where, default=2048),
        num_hidden_layers=_number(raw, "num_hidden_layers", where, default=1),
        hidden_act=str(raw.get("hidden_act", "silu")),
    )


def _from_sglang(raw: dict, where: str, notes: list[str]) -> DrafterConfig:
    fields = _layer_fields(raw, where)
    eagle_config = raw.get("eagle_config") or {}
    if eagle_config.get("use_aux_hidden_state") is False:
        raise ConfigError(
            f"{where}: eagle_config.use_aux_hidden_state=false is an EAGLE-1/2 drafter, not EAGLE-3"
        )
    aux = _layer_ids(eagle_config, "eagle_aux_hidden_state_layer_ids", f"{where} (eagle_config)")
    if aux is None:
        notes.append("no eagle_aux_hidden_state_layer_ids: engines use the target's default [1, N//2-1, N-4]")
    if "norm_before_residual" not in raw:
        notes.append("norm_before_residual absent: False (SGLang semantics; vLLM reads this layout the same)")
    if "draft_vocab_size" not in raw:
        notes.append("draft_vocab_size absent: equal to vocab_size, as SGLang assumes")
    return DrafterConfig(
        **fields,
        draft_vocab_size=_number(raw, "draft_vocab_size", where, default=None) or fields["vocab_size"],
        target_hidden_size=raw.get("target_hidden_size"),
        aux_layer_ids=aux,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        norm_before_fc=bool(raw.get("norm_before_fc", False)),
        fc_norm=bool(raw.get("fc_norm", False)),
        **_sglang_output_flags(raw, notes),
        **_read_speculation(raw.get(SPECULATION_KEY) or {}, f"{where} ({SPECULATION_KEY})"),
    )


def _sglang_output_flags(raw: dict, notes: list[str]) -> dict:
    """norm_before_lm_head and feed_normed_hidden of an SGLang-layout config (see the module docstring)."""
    norm_output = raw.get("norm_output")
    if FEED_NORMED_KEY in raw:  # written by eagle3lib: says which state the drafter feeds forward
        feed_normed = bool(raw[FEED_NORMED_KEY])
        norm_before_lm_head = feed_normed or norm_output is not False
        return dict(norm_before_lm_head=norm_before_lm_head, feed_normed_hidden=feed_normed)
    if norm_output is None:
        return dict(norm_before_lm_head=True, feed_normed_hidden=False)
    if norm_output:
        notes.append(
            "norm_output=true read as SpecForge trains it: final norm before lm_head, pre-norm state fed "
            "forward; SGLang and vLLM read it as EAGLE-3.1's post-norm feed (different draft steps >= 1)"
        )
    else:
        notes.append("norm_output=false read as SpecForge does: no final norm before lm_head")
    return dict(norm_before_lm_head=bool(norm_output), feed_normed_hidden=False)


def _read_speculation(block: dict, where: str) -> dict:
    """speculative_tokens and verifier from a speculators_config-shaped block."""
    proposals = block.get("proposal_methods") or [{}]
    verifier = block.get("verifier") or {}
    return dict(
        speculative_tokens=_number(proposals[0], "speculative_tokens", where, default=3),
        verifier=verifier.get("name_or_path"),
        verifier_architectures=list(verifier.get("architectures") or []),
    )


def _from_speculators(raw: dict, where: str, notes: list[str]) -> DrafterConfig:
    architectures = raw.get("architectures") or []
    if architectures and not any(a in SPECULATORS_ARCHITECTURES for a in architectures):
        raise ConfigError(
            f"{where}: architectures={architectures!r}; a speculators EAGLE-3 drafter is one of "
            f"{', '.join(SPECULATORS_ARCHITECTURES)}"
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError(f"{where}: transformer_layer_config is missing or not an object")
    if layer.get("model_type", "llama") != "llama":
        raise ConfigError(
            f"{where}: transformer_layer_config.model_type={layer.get('model_type')!r}; only Llama decoder "
            "layers are supported"
        )
    fields = _layer_fields(layer, f"{where} (transformer_layer_config)")
    aux = _layer_ids(raw, "eagle_aux_hidden_state_layer_ids", where)
    if aux is None:
        notes.append("no eagle_aux_hidden_state_layer_ids: vLLM uses the target's default (2, N//2, N-3)")
    if "norm_before_residual" not in raw:
        notes.append("norm_before_residual absent: True, as vLLM reads a speculators config")
    return DrafterConfig(
        **fields,
        draft_vocab_size=_number(raw, "draft_vocab_size", where),
        target_hidden_size=raw.get("target_hidden_size"),
        aux_layer_ids=aux_ids_from_vllm(aux) if aux is not None else None,
        norm_before_residual=bool(raw.get("norm_before_residual", True)),
        norm_before_fc=bool(raw.get("norm_before_fc", False)),
        fc_norm=bool(raw.get("fc_norm", False)),
        feed_normed_hidden=bool(raw.get("norm_output", False)),  # speculators' meaning (EAGLE-3.1)
        norm_before_lm_head=bool(raw.get(NORM_BEFORE_LM_HEAD_KEY, True)),
        **_read_speculation(raw.get("speculators_config") or {}, f"{where} (speculators_config)"),
    )


# ----------------------------------------------------------------------------- writing


def _layer_dict(config: DrafterConfig) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_act": config.hidden_act,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def _speculation_dict(config: DrafterConfig) -> dict:
    return {
        "algorithm": "eagle3",
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": config.speculative_tokens,
                "accept_tolerance": 0.0,
                "verifier_accept_k": 1,
            }
        ],
        "verifier": {"name_or_path": config.verifier, "architectures": list(config.verifier_architectures)},
    }


def to_sglang_dict(config: DrafterConfig, dtype: str = "float32") -> dict:
    """config.json of the SGLang layout, every flag explicit."""
    eagle_config: dict[str, Any] = {"use_aux_hidden_state": True}
    if config.aux_layer_ids is not None:  # SGLang uses the key whenever it exists: absent, not null
        eagle_config["eagle_aux_hidden_state_layer_ids"] = config.aux_layer_ids
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_layer_dict(config),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        # legacy keys: every engine version reads them (transformers 5 turns them into rope_parameters)
        "rope_theta": config.rope_theta,
        "rope_scaling": copy.deepcopy(config.rope_scaling),
        "eagle_config": eagle_config,
        "norm_before_residual": config.norm_before_residual,
        "norm_before_fc": config.norm_before_fc,
        "fc_norm": config.fc_norm,
        **_sglang_norm_output(config),
        SPECULATION_KEY: _speculation_dict(config),
        "torch_dtype": dtype,
    }


def _sglang_norm_output(config: DrafterConfig) -> dict:
    """`norm_output` for an SGLang-layout config: absent for a standard drafter (SpecForge's default true
    and SGLang's and vLLM's default false then all mean the standard computation); otherwise the value
    the engines that can compute the drafter read right, and eagle3lib's own unambiguous key."""
    if config.norm_before_lm_head and not config.feed_normed_hidden:
        return {}
    # feed_normed_hidden: SGLang and vLLM feed norm(out) on true (SpecForge cannot); no norm before
    # lm_head: SpecForge drops the norm on false (SGLang and vLLM cannot)
    return {"norm_output": config.feed_normed_hidden, FEED_NORMED_KEY: config.feed_normed_hidden}


def to_speculators_dict(config: DrafterConfig, dtype: str = "float32") -> dict:
    """config.json of the speculators layout, every flag explicit, aux ids in vLLM numbering."""
    layer = {**_layer_dict(config), "rope_parameters": config.rope_parameters}
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": (
            aux_ids_to_vllm(config.aux_layer_ids) if config.aux_layer_ids is not None else None
        ),
        "norm_before_residual": config.norm_before_residual,
        "norm_before_fc": config.norm_before_fc,
        "fc_norm": config.fc_norm,
        "norm_output": config.feed_normed_hidden,  # speculators' meaning (EAGLE-3.1)
        **({} if config.norm_before_lm_head else {NORM_BEFORE_LM_HEAD_KEY: False}),
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "transformer_layer_config": layer,
        "speculators_config": _speculation_dict(config),
        "dtype": dtype,
    }


def write_config(config: DrafterConfig, folder: str | Path, layout: str, dtype: str = "float32") -> Path:
    """Write `folder/config.json` in `layout` ("sglang" or "speculators")."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    raw = to_sglang_dict(config, dtype) if layout == "sglang" else to_speculators_dict(config, dtype)
    path = Path(folder) / "config.json"
    atomic_write_text(path, json.dumps(raw, indent=2) + "\n")
    return path
