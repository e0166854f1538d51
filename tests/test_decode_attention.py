"""The compiled decoding steps' attention (`target.decode_attention`): SDPA's result over each row's own
columns, reading none before them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagle3lib.target.decode_attention import decode_attention


def case(dtype: torch.dtype, dim: int, news: int, columns: int = 41, seed: int = 0):
    """Query [5, 6, news, dim] over a cache of 2 KV heads (3 query heads each) in buffers with spare room;
    rows starting at columns 0 to columns - 1 (counts around multiples of 16), one row with a hole."""
    generator = torch.Generator().manual_seed(seed)
    rows = 5
    query = torch.randn(rows, 6, news, dim, generator=generator).to(dtype)
    keys, values = (torch.randn(rows, 2, columns + 7, dim, generator=generator).to(dtype)[:, :, :columns]
                    for _ in range(2))
    first = torch.tensor([0, 9, columns - 16, columns - 1, columns - 17])
    allowed = (torch.arange(columns)[None, None, None] >= first[:, None, None, None]).repeat(1, 1, news, 1)
    allowed[1, 0, :, 12] = False  # a rejected draft's hole
    mask = torch.zeros(rows, 1, news, columns, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return query, keys, values, mask, first


def reference(query, keys, values, mask) -> torch.Tensor:
    out = F.scaled_dot_product_attention(query.double(), keys.double(), values.double(),
                                         attn_mask=mask.double(), scale=0.3, enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dim", [64, 24])  # 64: the vectorised path where the CPU has AVX-512; 24: the other
@pytest.mark.parametrize("news", [1, 3])
def test_it_gives_sdpa_attention(dim, news):
    query, keys, values, mask, first = case(torch.float32, dim, news)
    out = decode_attention(query, keys, values, mask, first, 0.3)
    assert out.shape == (5, news, 6, dim) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(query, keys, values, mask), rtol=2e-6, atol=2e-6)
    query, keys, values, mask, first = case(torch.bfloat16, dim, news)
    out = decode_attention(query, keys, values, mask, first, 0.3)
    # bf16 inputs, float32 inside, one rounding of the output
    torch.testing.assert_close(out.double(), reference(query, keys, values, mask).bfloat16().double(),
                               rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("dim", [64, 24])
def test_no_column_before_a_rows_first_is_read(dim):
    """NaN keys and values before each row's first column change nothing; a NaN key from it on, even at a
    masked hole, makes the row's output NaN, as in SDPA (read, not skipped)."""
    query, keys, values, mask, first = case(torch.float32, dim, 2)
    clean = decode_attention(query, keys, values, mask, first, 0.3)
    for b, start in enumerate(first.tolist()):
        keys[b, :, :start] = values[b, :, :start] = float("nan")
    assert torch.equal(decode_attention(query, keys, values, mask, first, 0.3), clean)
    keys[1, :, 12] = float("nan")  # row 1's hole
    out = decode_attention(query, keys, values, mask, first, 0.3)
    assert out[1].isnan().all() and torch.equal(out[[0, 2, 3, 4]], clean[[0, 2, 3, 4]])


def test_bad_inputs_are_refused_by_name():
    query, keys, values, mask, first = case(torch.float32, 64, 1)
    with pytest.raises(RuntimeError, match="row 3 starts at column 41 of 41"):
        decode_attention(query, keys, values, mask, torch.tensor([0, 0, 0, 41, 0]), 0.3)
    with pytest.raises(RuntimeError, match="share one dtype"):
        decode_attention(query, keys.bfloat16(), values, mask, first, 0.3)
    with pytest.raises(RuntimeError, match="not a multiple of"):
        decode_attention(query[:, :5], keys, values, mask, first, 0.3)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        decode_attention(query.half(), keys.half(), values.half(), mask.half(), first, 0.3)
