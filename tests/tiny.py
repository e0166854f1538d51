"""The tiny drafter the tests build on: small enough to run anywhere, with every size distinct, so that a
mixed-up dimension fails loudly."""

from __future__ import annotations

from eagle3lib.drafter.config import DrafterConfig
from eagle3lib.target import direct

TINY_DRAFTER = dict(
    hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
    vocab_size=64, draft_vocab_size=24, target_hidden_size=40, aux_layer_ids=[1, 3, 4],
)


def tiny_drafter_config(**overrides) -> DrafterConfig:
    """`TINY_DRAFTER` with `overrides`."""
    return DrafterConfig(**{**TINY_DRAFTER, **overrides})


def count_compiled_steps(monkeypatch) -> list:
    """The shapes of the input ids of every forward through the compiled graph (`DirectDecoder.into_buffers`)
    from now on, in order."""
    steps = []
    into_buffers = direct.DirectDecoder.into_buffers
    monkeypatch.setattr(direct.DirectDecoder, "into_buffers",
                        lambda self, ids, *a: steps.append(ids.shape) or into_buffers(self, ids, *a))
    return steps
