"""The EAGLE-3 drafter: one Llama decoder layer on top of the target's hidden states (docs/formats.md §1).

Read top to bottom: the drafter, then its decoder layer, attention, MLP, norms, rotary embedding and the KV
cache of incremental decoding. The attention of train-time test (one diagonal per unrolled step over the
step-0 prefix, O(T) memory) and its kernels are `eagle3lib.drafter.ttt_attention`.

Module and parameter names are the SGLang checkpoint keys (`fc.weight`, `midlayer.self_attn.q_proj.weight`,
`norm.weight`, `lm_head.weight`, buffers `d2t`, `t2d`), so `state_dict()` is the checkpoint.

One draft step, for token ids `x` and hidden states `h` (the target's aux states on step 0, the drafter's
own pre-norm output afterwards):
    h   = fc(h)                                  only when h has the aux width A*Ht
                                                 (fc_norm, EAGLE-3.1: each Ht-wide aux state RMS-normed first)
    a   = cat[input_layernorm(E[x]), hidden_norm(h)]          width 2H
    r   = hidden_norm(h) if norm_before_residual else h
    h1  = r + o_proj(attention(q_proj(a), k_proj(a), v_proj(a)))     causal, RoPE
    out = h1 + mlp(post_attention_layernorm(h1))                     fed to the next step
    logits = lm_head(norm(out))                                      over the Vd draft tokens
With `feed_normed_hidden` (EAGLE-3.1) norm(out) is the state fed to the next step; with
`norm_before_lm_head` false (a SpecForge option) logits are lm_head(out).
Draft token j is target token j + d2t[j].

Alignment (as vLLM and speculators): row t gets the aux state of position t with the embedding of token
t+1, at position id t+1, and predicts token t+2.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from eagle3lib.drafter.config import DrafterConfig
from eagle3lib.drafter.ttt_attention import Segments, TTTCache


class Eagle3Drafter(nn.Module):
    """The EAGLE-3 drafter. `embed_tokens=True` gives it its own embedding (a checkpoint that carries one);
    otherwise attach the target's with `attach_embedding`, which is frozen and never saved."""

    def __init__(self, config: DrafterConfig, *, embed_tokens: bool = False):
        super().__init__()
        config.check()
        self.config = config
        if embed_tokens:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.embed_tokens.requires_grad_(False)  # a copy of the target's; both trainers freeze it
        if config.fc_norm:  # one norm per aux state, as SpecForge and speculators key them: fc_norm.{i}
            self.fc_norm = nn.ModuleList(
                RMSNorm(config.target_hidden_size, config.rms_norm_eps) for _ in range(config.num_aux_layers)
            )
        self.fc = nn.Linear(config.fc_in_features, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        # The vocab map (identity on the first Vd ids until a real one is loaded).
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)
        self.rotary_emb = RotaryEmbedding(config)
        self.apply(self.init_module)

    @staticmethod
    def init_module(module: nn.Module, std: float = 0.02) -> None:
        """Initialise one module as Hugging Face Llama does (SpecForge trains from this init)."""
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    # ---------------------------------------------------------------- embedding and vocab map

    @property
    def owns_embedding(self) -> bool:
        """True when the drafter carries its own `embed_tokens` (saved with it)."""
        return "embed_tokens" in self._modules

    def attach_embedding(self, embedding: nn.Embedding | torch.Tensor) -> None:
        """Use the target's input embedding [Vt, H] (frozen, a non-persistent buffer: never saved).

        Replaces an embedding the checkpoint carried, as SGLang and vLLM take the target's."""
        weight = embedding.weight if isinstance(embedding, nn.Embedding) else embedding
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"embedding of shape {list(weight.shape)} does not fit this drafter: expected "
                f"{list(expected)}"
            )
        if self.owns_embedding:
            del self.embed_tokens
        self.register_buffer("target_embedding", weight.detach(), persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.owns_embedding:
            return self.embed_tokens(input_ids)
        if getattr(self, "target_embedding", None) is None:
            raise RuntimeError(
                "this drafter has no token embedding: attach the target's with drafter.attach_embedding(...)"
            )
        return F.embedding(input_ids, self.target_embedding)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocab ids → target vocab ids (id + d2t[id])."""
        return draft_ids + self.d2t[draft_ids]

    # ---------------------------------------------------------------- one draft step

    def project_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """`fc` on the target's aux states (width A*Ht); the drafter's own states (width H) pass as is."""
        hidden = hidden.to(self.fc.weight.dtype)
        width = hidden.shape[-1]
        if width == self.fc.in_features and width != self.config.hidden_size:
            if self.config.fc_norm:
                chunks = hidden.split(self.config.target_hidden_size, dim=-1)
                normed = [norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)]
                hidden = torch.cat(normed, dim=-1)
            return self.fc(hidden)
        if width == self.config.hidden_size:
            return hidden
        c = self.config
        raise ValueError(
            f"hidden states of width {width}: expected the target's aux states ({c.num_aux_layers} x "
            f"{c.target_hidden_size} = {self.fc.in_features}) or the drafter's own ({c.hidden_size})"
        )

    def layer(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DraftCache | TTTCache,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The state [B, T, H] one draft step feeds to the next: its output, normed when
        `feed_normed_hidden` (EAGLE-3.1); `compute_logits` takes it as it is."""
        if (
            input_ids.dim() != 2
            or hidden.shape[:2] != input_ids.shape
            or position_ids.shape != input_ids.shape
        ):
            raise ValueError(
                f"input_ids {list(input_ids.shape)}, hidden {list(hidden.shape)} and position_ids "
                f"{list(position_ids.shape)} must share [B, T]"
            )
        hidden = self.project_hidden(hidden)
        cos, sin = self.rotary_emb(position_ids, hidden.dtype)
        embeds = self.embed(input_ids).to(hidden.dtype)
        out = self.midlayer(embeds, hidden, cos, sin, cache, attention_mask)
        return self.norm(out) if self.config.feed_normed_hidden else out

    def compute_logits(self, layer_out: torch.Tensor) -> torch.Tensor:
        """Logits of a state from `layer`: already normed when it feeds norm(out) forward."""
        if self.config.feed_normed_hidden or not self.config.norm_before_lm_head:
            return self.lm_head(layer_out)
        return self.lm_head(self.norm(layer_out))

    @staticmethod
    def default_position_ids(input_ids: torch.Tensor) -> torch.Tensor:
        """1..T per row: the embedded token t+1 sits at position t+1 (as speculators numbers them)."""
        T = input_ids.shape[1]
        return torch.arange(1, T + 1, device=input_ids.device).expand_as(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Step-0 logits [B, T, Vd]: row t pairs aux state t with token t+1 and predicts token t+2."""
        if position_ids is None:
            position_ids = self.default_position_ids(input_ids)
        return self.compute_logits(self.layer(input_ids, aux_hidden_states, position_ids, DraftCache()))

    # ---------------------------------------------------------------- train-time test

    def unroll_steps(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        steps: int,
        position_ids: torch.Tensor | None = None,
        segments: Segments | None = None,
    ) -> Iterator[torch.Tensor]:
        """Yield the state [B, T, H] each TTT step 0..steps-1 feeds forward (see `layer`), teacher-forced.

        Step k embeds the ground truth shifted by k more (0 past the end), at positions advanced by k, with
        the previous step's pre-norm output as the hidden state. One step at a time, and without logits: a
        trainer applies `compute_logits` to the rows it grades (at step k, the last k rows have no target)
        and takes each step's loss without holding every step's logits. A packed row's documents are kept
        apart by `segments` (their rows) and `position_ids` (restarting with each); rows whose shifted token
        has left their document compute garbage that no other row reads, and no loss may grade.
        """
        if position_ids is None:
            position_ids = self.default_position_ids(input_ids)
        cache = TTTCache(segments)
        hidden = aux_hidden_states
        for k in range(steps):
            tokens = F.pad(input_ids[:, k:], (0, min(k, input_ids.shape[1])), value=0)
            hidden = self.layer(tokens, hidden, position_ids + k, cache)
            yield hidden

    def unroll(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        steps: int,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Train-time test: (logits [K, B, T, Vd], layer_outs [K, B, T, H]) for K = `steps`."""
        layer_outs = list(self.unroll_steps(input_ids, aux_hidden_states, steps, position_ids))
        return torch.stack([self.compute_logits(out) for out in layer_outs]), torch.stack(layer_outs)

    # ---------------------------------------------------------------- incremental decoding

    @staticmethod
    def new_cache() -> DraftCache:
        return DraftCache()

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DraftCache,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add t positions to `cache` and return (logits [B, t, Vd], layer_out [B, t, H]).

        `hidden` is [B, t, A*Ht] (target aux states, `fc` applied) or [B, t, H] (the drafter's own output).
        `attention_mask` is bool [B, t, len(cache)+t], True where a new position may attend (trees); the
        default is every cached position plus the new ones causally.
        """
        layer_out = self.layer(input_ids, hidden, position_ids, cache, attention_mask)
        return self.compute_logits(layer_out), layer_out


class Eagle3DecoderLayer(nn.Module):
    """`midlayer`: the decoder layer that reads [input_layernorm(embedding), hidden_norm(hidden)]."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Eagle3MLP(config)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: DraftCache | TTTCache,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)
        hidden = residual + self.self_attn(x, cos, sin, cache, attention_mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Attention(nn.Module):
    """Grouped-query attention whose q/k/v projections read the 2H-wide [embedding, hidden] input."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(2 * config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: DraftCache | TTTCache,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = cache.attend(q, k, v, attention_mask)  # [B, heads, T, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class Eagle3MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, as the drafter's norms and a target's final norm compute it, in float32."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin of the rotary embedding at given positions.

    The inverse frequencies are computed on first use per device (not kept as a buffer), so a drafter built
    on the meta device by the loader needs nothing re-initialised. Scaled variants (llama3, linear, yarn) use
    transformers' own functions.
    """

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        self._inv_freq: dict[torch.device, tuple[torch.Tensor, float]] = {}

    def inv_freq(self, device: torch.device) -> tuple[torch.Tensor, float]:
        if device not in self._inv_freq:
            config = self.config
            rope_type = config.rope_parameters["rope_type"]
            if rope_type == "default":
                exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float32, device=device)
                inv_freq, scaling = 1.0 / (config.rope_theta ** (exponents / config.head_dim)), 1.0
            else:
                from transformers import LlamaConfig
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                hf_config = LlamaConfig(
                    hidden_size=config.hidden_size,
                    num_attention_heads=config.num_attention_heads,
                    head_dim=config.head_dim,
                    max_position_embeddings=config.max_position_embeddings,
                    rope_parameters=config.rope_parameters,
                )
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, device)
            self._inv_freq[device] = (inv_freq.float(), float(scaling))
        return self._inv_freq[device]

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scaling = self.inv_freq(position_ids.device)
        freqs = position_ids.float()[..., None] * inv_freq  # [B, T, head_dim/2]
        angles = torch.cat([freqs, freqs], dim=-1)
        return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, head_dim]; cos/sin [B, T, head_dim]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


class DraftCache:
    """Keys and values of the drafter's one layer during speculation.

    Positions are kept in the order they were added; `crop(n)` drops everything after the first n (rejected
    drafts). `attend` appends the new keys/values, then attends with the given mask.
    """

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # [B, kv_heads, n, head_dim]
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def crop(self, n: int) -> None:
        if not 0 <= n <= len(self):
            raise ValueError(f"cannot crop a draft cache of {len(self)} positions to {n}")
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :n], self.values[:, :, :n]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        cached, new = len(self), q.shape[2]
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        if attention_mask is None:
            if cached == 0:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            # default: every cached position, plus the new ones causally
            attention_mask = torch.ones(new, cached + new, dtype=torch.bool, device=q.device).tril(cached)
            attention_mask = attention_mask[None]
        expected = (q.shape[0], new, cached + new)
        if (
            attention_mask.dtype != torch.bool
            or attention_mask.shape[1:] != expected[1:]
            or (attention_mask.shape[0] not in (1, expected[0]))
        ):
            raise ValueError(
                f"attention_mask must be bool [B, t, cached+t] = {list(expected)}, got "
                f"{attention_mask.dtype} {list(attention_mask.shape)}"
            )
        return F.scaled_dot_product_attention(
            q, self.keys, self.values, attn_mask=attention_mask[:, None], enable_gqa=True
        )
