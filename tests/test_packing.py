"""Packed training rows: several documents in a row train exactly as each document alone in a row of its own
(the same loss sums, rows and gradients), and rows come out nearly full; freed tensors go back to the
system."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from eagle3lib.data.readers import BatchPlanner, collate, first_fit_decreasing
from eagle3lib.drafter.model import Eagle3Drafter
from eagle3lib.drafter.vocab import VocabMap
from eagle3lib.training.loss import Targets
from eagle3lib.training.trainer import TTTObjective, row_segments
from tests.tiny import TINY_DRAFTER, tiny_drafter_config

VT, VD, HT = TINY_DRAFTER["vocab_size"], TINY_DRAFTER["draft_vocab_size"], TINY_DRAFTER["target_hidden_size"]
STEPS = 4  # reaches 4 tokens past a row: across every boundary of the short documents below


def document(length: int, seed: int, loss: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, VT, (length,), generator=g),
        "loss_mask": torch.full((length,), loss) & (torch.rand(length, generator=g) < 0.9),
        "aux_hidden_states": torch.randn(length, 3 * HT, generator=g, dtype=torch.float64).float(),
        "last_hidden_state": torch.randn(length, HT, generator=g, dtype=torch.float64).float(),
        # mostly draft tokens: the map below keeps the first VD ids
        "target_argmax": torch.randint(0, VD + 4, (length,), generator=g),
    }


@pytest.fixture(scope="module")
def objective():
    torch.manual_seed(0)
    drafter = Eagle3Drafter(tiny_drafter_config())
    drafter.attach_embedding(torch.randn(VT, TINY_DRAFTER["hidden_size"]))
    vocab = VocabMap.from_ids(torch.arange(VD), VT)
    head = torch.randn(VT, HT)
    return TTTObjective(drafter, STEPS, vocab.draft_ids), head[vocab.draft_ids], vocab.t2d


def run(objective, batch: dict) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The step sums of a batch and the gradient of their cross-entropy sum."""
    model, draft_head, t2d = objective
    model.zero_grad(set_to_none=True)
    sums = model(batch, Targets.from_batch(batch, draft_head, t2d), row_segments(batch))
    sums.ce.sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    detached = [sums.ce.detach(), sums.ce_rows, sums.rows, sums.correct, sums.full_correct]
    return detached, grads


def assert_same(a, b) -> None:
    (sums_a, grads_a), (sums_b, grads_b) = a, b
    torch.testing.assert_close(sums_a[0], sums_b[0], rtol=1e-5, atol=1e-5)  # the loss: float32 sums
    for x, y in zip(sums_a[1:], sums_b[1:], strict=True):  # rows and hits: counts, exactly
        assert torch.equal(x, y), (x, y)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("padding", [0, 3])
def test_a_packed_row_trains_as_its_documents_alone(objective, padding):
    docs = [document(n, seed) for seed, n in enumerate((7, 12, 5))]
    packed = collate([docs], width=sum(len(d["input_ids"]) for d in docs) + padding)
    alone = collate([[d] for d in docs])  # one document a row, right-padded: the unpacked reference
    assert row_segments(packed) is not None and "position_ids" in packed
    assert_same(run(objective, packed), run(objective, alone))
    # and document by document: the row with only document i in the loss grades what i alone is graded
    for i, doc in enumerate(docs):
        only_i = [d if j == i else {**d, "loss_mask": torch.zeros_like(d["loss_mask"])}
                  for j, d in enumerate(docs)]
        assert_same(run(objective, collate([only_i], width=packed["input_ids"].shape[1])),
                    run(objective, collate([[doc]])))


def test_two_packed_rows_train_as_their_documents_alone(objective):
    rows = [[document(9, 10), document(4, 11), document(6, 12)], [document(15, 13), document(3, 14)]]
    packed = collate(rows, width=20)
    alone = collate([[d] for row in rows for d in row])
    assert_same(run(objective, packed), run(objective, alone))


def test_first_fit_decreasing_fills_rows_and_keeps_reading_order_within_a_row():
    pieces = [(length, key, 0) for key, length in enumerate([5, 9, 3, 7, 2, 6, 4])]
    rows = first_fit_decreasing(pieces, 10)
    assert sorted(p for row in rows for p in row) == sorted(pieces)
    assert all(sum(p[0] for p in row) <= 10 for row in rows)
    assert len(rows) == 4  # 36 tokens: 4 rows of 10 is the least
    assert all([p[1] for p in row] == sorted(p[1] for p in row) for row in rows)


def test_packed_plans_are_deterministic_cover_every_window_and_fill_their_rows():
    rng = random.Random(0)
    lengths = [rng.randint(20, 700) for _ in range(300)] + [2500]  # one sample longer than seq_len
    seq_len, batch_size = 1024, 4

    def plan():
        return list(BatchPlanner(batch_size, seq_len, packing=True).plans(
            (length, key) for key, length in enumerate(lengths)))

    first = plan()
    assert first == plan()
    windows = sorted(w for batch in first for row in batch for w in row)
    expected = sorted((key, start) for key, n in enumerate(lengths) for start in range(0, n, seq_len))
    assert windows == expected

    def size(key, start):
        return min(seq_len, lengths[key] - start)

    fills = [sum(size(*w) for w in row) for batch in first for row in batch]
    assert max(fills) <= seq_len
    assert sum(fills) / (len(fills) * seq_len) >= 0.95
    assert all(len(batch) == batch_size for batch in first[:-1])


# freed 2 MiB tensors between live ones, after an 8 MiB one was freed: how many bytes go back to the system
RETURNED = """
import sys, torch
from eagle3lib.devices import trim_heap
def resident():
    status = open("/proc/self/status").read().splitlines()
    return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
big = torch.ones(8 << 20, dtype=torch.uint8)
del big  # glibc now keeps blocks up to 8 MiB in its heap
kept, freed = [], []
for i in range(64):
    (kept if i % 2 else freed).append(torch.ones(2 << 20, dtype=torch.uint8))
before = resident()
freed.clear()
if sys.argv[1] == "trimmed" and not trim_heap() and resident() == before:
    print("not glibc"); sys.exit()
print(before - resident())
"""


def test_a_cpu_trainer_gives_freed_tensors_back_where_glibc_would_keep_them():
    def returned(mode: str) -> str:
        done = subprocess.run([sys.executable, "-c", RETURNED, mode], capture_output=True, text=True,
                              check=True)
        return done.stdout.strip()

    trimmed = returned("trimmed")
    if trimmed == "not glibc":
        pytest.skip("the C library is not glibc: its heap is not the one trim_heap trims")
    assert int(returned("default")) < 16 << 20  # the cause: 64 MiB freed, kept by the heap
    assert int(trimmed) >= 48 << 20  # the 32 freed 2 MiB tensors, handed back
