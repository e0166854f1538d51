"""A Hugging Face causal LM as an EAGLE-3 target: aux hidden states, last hidden state, verifier logits.

Aux-layer id i is the output of decoder layer i (= HF `hidden_states[i + 1]`, SGLang's numbering). The
states are taken with forward hooks on the decoder layers during one forward pass of the base model:
HF's `output_hidden_states` would tie its last entry to the normed state, so id N-1 would silently be
something else. The last hidden state is the one after the final norm, as SpecForge stores it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from eagle3lib.devices import fast_bf16, resolve_device
from eagle3lib.drafter.config import default_aux_layer_ids
from eagle3lib.progress import quiet_hf_loading
from eagle3lib.target import zoo

# Config keys that change what the model computes; other keys (paths, versions, dtype) do not.
_ARCHITECTURE_KEYS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "tie_word_embeddings",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
)
# Positions per chunk when projecting onto the full vocabulary: bounds the [chunk, Vt] logits, and a
# chunk small enough to stay in cache makes the argmax nearly free (measured on a 2-core CPU: the
# argmax of 1024 rows at once cost +40 % of the lm_head matmul, of 256-row chunks +5 %).
_LOGITS_CHUNK = 256


def sdpa_shared_kv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                             key_runs=None, **kwargs):
    """HF's SDPA attention, except that masked grouped-query attention on the CPU lets SDPA share each KV
    head among its query heads (`enable_gqa`). HF copies every cached key and value num_key_value_groups
    times there, in every layer at every step: with a 4D mask (each decoding step of the batched engine)
    that copy was 55 % of a batch-16 step of SmolLM2-135M on 2 cores. The result is bit-identical.

    `key_runs` (the batched engine's, `decoding.batches.key_runs`): [(first row, end row, first column)]
    covering the batch; each run of rows attends only from its first column on, the columns before it being
    masked for all of its rows (a short prompt's left padding), instead of every row reading the longest
    prompt's width."""
    if key_runs is not None and attention_mask is not None and key_runs != [(0, query.shape[0], 0)]:
        outs = [sdpa_shared_kv_attention(module, query[a:b], key[a:b, :, c:], value[a:b, :, c:],
                                         attention_mask[a:b, ..., c:], dropout, scaling, **kwargs)[0]
                for a, b, c in key_runs]
        return torch.cat(outs), None
    groups = getattr(module, "num_key_value_groups", 1)
    plain = attention_mask is None or kwargs.get("position_bias") is not None
    if plain or groups == 1 or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("sdpa_shared_kv", sdpa_shared_kv_attention)
# HF builds no mask at all for an attention it has no mask function for: padding would be attended to
AttentionMaskInterface.register("sdpa_shared_kv", sdpa_mask)


class PackedLinear(nn.Module):
    """A CPU `nn.Linear` whose products run on a copy of its weight in oneDNN's blocked layout, packed once:
    on the 2-core AMX Xeon 1.5-1.8x `F.linear` at the 32 rows of batched decoding, 2-3x at 1-8 rows, 1.2x at
    prefill sizes (bench/RESULTS.md §10). `weight` stays the module's own parameter (tied heads, remaps and
    captures read it); the packed copy is made from it and must not outlive an edit of it."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 32),
                             persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Every `nn.Linear` of a CPU model in float32, or in bf16 where oneDNN has a bf16 path on this CPU
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only EPYC has none and keeps bf16 linears plain), replaced
    by a `PackedLinear`; how many."""
    if not torch.backends.mkldnn.is_available():
        return 0
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    kinds = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)
    found = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear
             and module.weight.device.type == "cpu" and module.weight.dtype in kinds]
    for name, module in found:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, PackedLinear(module))
    return len(found)


class TargetError(ValueError):
    """A target that cannot be loaded or used as asked (bad spec, layer id, shapes)."""


@dataclass
class Capture:
    """What one forward pass of the target gives the drafter; unshifted, one row per input position."""

    aux_hidden_states: Tensor  # [B, T, A*H], aux layers concatenated in the order of the ids
    last_hidden_state: Tensor  # [B, T, H], after the final norm
    target_argmax: Tensor  # [B, T] int64, argmax of the target's logits over the full vocabulary
    logits: Tensor | None = None  # [B, T, Vt] when asked for


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 where the device has bf16 matrix units (`devices.fast_bf16`), float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if fast_bf16(device) else torch.float32
    if dtype not in ("float32", "bfloat16", "float16"):
        raise TargetError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return getattr(torch, dtype)


class Target:
    """A loaded target model with its tokenizer. `name` is the spec it was loaded from."""

    def __init__(self, model: nn.Module, tokenizer, name: str):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        self._decoder = model.get_decoder()
        self._fingerprint: str | None = None

    @classmethod
    def load(
        cls,
        spec: str | os.PathLike,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        cache_dir: str | os.PathLike | None = None,
    ) -> Target:
        """`spec`: a local Hugging Face folder, a model id already in the local HF cache (nothing is
        downloaded), or `zoo:smollm2-135m-instruct` / `zoo:tiny-llama`."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        where = zoo.resolve(str(spec), cache_dir) if zoo.is_zoo_spec(spec) else spec
        device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, device)
        try:
            with quiet_hf_loading():
                model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, local_files_only=True)
                tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True)
        except OSError as err:
            raise TargetError(
                f"target {spec!r}: not a loadable local Hugging Face folder or cached model "
                f"(nothing is downloaded at run time): {err}"
            ) from err
        if model.config._attn_implementation == "sdpa":
            model.set_attn_implementation("sdpa_shared_kv")
        model = model.to(device)
        if device.type == "cpu":
            pack_linears(model)
        return cls(model, tokenizer, str(spec))

    @classmethod
    def from_params(cls, target: dict, device: str | torch.device) -> Target:
        """The target a recipe's `target` section names, on `device`."""
        cache_dir = target["cache_dir"] or None
        return cls.load(target["spec"], dtype=target["dtype"], device=device, cache_dir=cache_dir)

    # ------------------------------------------------------------------ shape facts

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def rms_norm_eps(self) -> float:
        return float(self.config.rms_norm_eps)

    @property
    def stop_token_ids(self) -> list[int]:
        return stop_token_ids(self.tokenizer, getattr(self.model.generation_config, "eos_token_id", None))

    @property
    def default_aux_layer_ids(self) -> list[int]:
        return default_aux_layer_ids(self.num_layers)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def norm(self) -> nn.Module:
        return self._decoder.norm

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def check_aux_layer_ids(self, aux_layer_ids: list[int] | None) -> list[int]:
        """The ids to capture (the default when None), refusing ones the target does not have."""
        ids = self.default_aux_layer_ids if aux_layer_ids is None else [int(i) for i in aux_layer_ids]
        if not ids:
            raise TargetError(f"target {self.name}: aux_layer_ids is empty")
        bad = [i for i in ids if not 0 <= i < self.num_layers]
        if bad:
            raise TargetError(
                f"target {self.name}: aux layer ids {bad} are outside its {self.num_layers} decoder layers "
                f"(valid ids 0..{self.num_layers - 1}, eagle3lib numbering: id i = output of layer i)"
            )
        return ids

    # ------------------------------------------------------------------ forward passes

    @torch.no_grad()
    def capture(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        aux_layer_ids: list[int] | None = None,
        return_logits: bool = False,
    ) -> Capture:
        """One forward pass: aux states at `aux_layer_ids`, the normed last state, the argmax over Vt.

        `attention_mask` may only mark right padding (0 after each sequence); padded positions hold garbage.
        Under causal attention a real position then sees real positions only, so the mask is not applied:
        SDPA's causal kernel skips the masked half that a dense mask makes it read (for rows of 2,048 tokens
        320 against 538 ms a layer on one core of an AMD EPYC in bf16, the result bit-identical).
        """
        ids = self.check_aux_layer_ids(aux_layer_ids)
        if input_ids.dim() != 2:
            raise TargetError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if attention_mask is not None:
            real = attention_mask.bool()
            lengths = real.sum(1, keepdim=True)
            if real.shape != input_ids.shape or not torch.equal(
                    real, torch.arange(real.shape[1], device=real.device) < lengths):
                raise TargetError(f"{self.name}: capture takes right padding only: attention_mask "
                                  f"{tuple(attention_mask.shape)} must be ones then zeros in each row of "
                                  f"input_ids {tuple(input_ids.shape)}")
        outputs: dict[int, Tensor] = {}

        def keep(layer_id: int):
            def hook(module, args, output):
                outputs[layer_id] = output[0] if isinstance(output, tuple) else output

            return hook

        handles = [self._decoder.layers[i].register_forward_hook(keep(i)) for i in sorted(set(ids))]
        try:
            last = self._decoder(input_ids=input_ids.to(self.device), use_cache=False).last_hidden_state
        finally:
            for handle in handles:
                handle.remove()
        aux = torch.cat([outputs[i] for i in ids], dim=-1)
        logits = self.lm_head(last) if return_logits else None
        argmax = fast_argmax(logits) if logits is not None else self.full_argmax(last)
        return Capture(aux, last, argmax, logits)

    @torch.no_grad()
    def full_argmax(self, last_hidden_state: Tensor) -> Tensor:
        """argmax over the full vocabulary of `lm_head(last_hidden_state)`, in chunks of positions."""
        flat = last_hidden_state.reshape(-1, last_hidden_state.shape[-1]).to(self.device, self.dtype)
        chunks = [fast_argmax(self.lm_head(part)) for part in flat.split(_LOGITS_CHUNK)]
        return torch.cat(chunks).reshape(last_hidden_state.shape[:-1])

    def verifier_logits(self, last_hidden_state: Tensor, token_ids: Tensor | None = None) -> Tensor:
        """The target's logits, restricted to `token_ids` (e.g. a vocab map's `draft_ids`) when given:
        only those rows of `lm_head` are multiplied, so the cost is Vd, not Vt."""
        weight = self.lm_head.weight
        if token_ids is not None:
            weight = weight[token_ids.to(weight.device)]
        return nn.functional.linear(last_hidden_state.to(weight.device, weight.dtype), weight)

    # ------------------------------------------------------------------ identity and head

    def head_weights(self) -> dict[str, Tensor]:
        """The tensors a drafter's trainer needs from the target (copies; tied weights stay separate)."""
        return {
            "embed_tokens.weight": self.embed_tokens.weight.detach().clone(),
            "norm.weight": self.norm.weight.detach().clone(),
            "lm_head.weight": self.lm_head.weight.detach().clone(),
        }

    @property
    def fingerprint(self) -> str:
        """A hash of the architecture config and of a fixed sample of every weight tensor.

        Samples are rounded to bfloat16 first, so one checkpoint loaded in float32 or bfloat16 has the
        same fingerprint; another checkpoint (a finetune, another size) has another one. Sampling keeps
        it cheap for very large targets.
        """
        if self._fingerprint is None:
            digest = hashlib.sha256()
            architecture = {k: getattr(self.config, k, None) for k in _ARCHITECTURE_KEYS}
            digest.update(json.dumps(architecture, sort_keys=True, default=str).encode())
            for name, tensor in sorted(self.model.state_dict().items()):
                flat = tensor.detach().reshape(-1)
                count = min(flat.numel(), 4096)  # evenly spaced, first and last included; integer steps
                picks = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
                sample = flat[picks].to(torch.bfloat16).cpu().view(torch.int16)
                digest.update(f"{name}:{tuple(tensor.shape)}:".encode())
                digest.update(sample.numpy().tobytes())
            self._fingerprint = digest.hexdigest()[:16]
        return self._fingerprint

    def describe(self) -> dict:
        """The facts a data manifest records about the target."""
        return {
            "name": self.name,
            "fingerprint": self.fingerprint,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    def __repr__(self) -> str:
        return (
            f"Target({self.name!r}, N={self.num_layers}, H={self.hidden_size}, Vt={self.vocab_size}, "
            f"dtype={self.dtype}, device={self.device})"
        )


def stop_token_ids(tokenizer, configured: int | list[int] | None) -> list[int]:
    """The tokens a reply ends with: the tokenizer's end of sequence and the generation config's."""
    configured = configured if isinstance(configured, list) else [configured]
    return sorted({i for i in [tokenizer.eos_token_id, *configured] if i is not None})


def fast_argmax(logits: Tensor) -> Tensor:
    """Index of the first maximum over the last dim, as `argmax`; `max(...).indices` is 2-4x faster on CPU
    for bf16 logits (measured on this project's CPU: [32, 49,152] 1.7 ms against 7.1 ms on one thread)."""
    return logits.max(-1).indices
