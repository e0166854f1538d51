"""Data-parallel training: `torchrun --nproc_per_node 2 -m eagle3lib.training.train` (gloo) gives what one
process gives with the same global batch."""

from __future__ import annotations

import pytest
import torch

from eagle3lib.drafter.checkpoint import load_drafter
from eagle3lib.training import train
from eagle3lib.training.trainer import TrainingError
from tests.test_train import data_folder, tiny_params  # noqa: F401  (data_folder is a fixture)

STEPS = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_two_processes_match_one_with_the_same_global_batch(tmp_path, data_folder, capsys):  # noqa: F811
    # one process: 4 sequences per step as 2 micro-batches of 2
    # in float32: bf16 autocast (`auto` on AMX CPUs) rounds differently with another micro-batch split
    single = train.train_arms(tiny_params(data_folder, steps=STEPS, log_every=1, micro_batch_size=2,
                                          dtype="fp32"), tmp_path / "single")["scratch"]
    # torchrun, two processes: 4 sequences per step as 2 ranks x 2 micro-batches of 1
    params = tiny_params(data_folder, steps=STEPS, log_every=1, micro_batch_size=1, nproc=2, dtype="fp32")
    double = train.train_arms(params, tmp_path / "ddp")["scratch"]
    followed = capsys.readouterr().out
    assert "launching:" in followed and "--nproc_per_node=2" in followed
    assert "[scratch] done" in followed  # the job's log was echoed here

    assert [m["step"] for m in double.metrics] == list(range(1, STEPS + 1))
    for a, b in zip(single.metrics, double.metrics, strict=True):
        for key in ("loss", "loss_0", "loss_3", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]) + 1e-6, (key, a[key], b[key])
        for key in ("acc_0", "full_acc_3", "rows"):
            assert a[key] == b[key], key
    assert single.metrics[-1]["loss"] < single.metrics[0]["loss"]
    x, _ = load_drafter(single.drafter, strict=True)
    y, _ = load_drafter(double.drafter, strict=True)
    for (name, a), (_, b) in zip(x.state_dict().items(), y.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_a_failing_job_reports_each_ranks_error(tmp_path, data_folder):  # noqa: F811
    (tmp_path / "empty").mkdir()  # a folder the recipe check lets through, which no reader can read
    params = tiny_params({**data_folder, "data": str(tmp_path / "empty")}, nproc=2)
    expected = r"(?s)torchrun exited with code.*rank 0\): .*empty"
    with pytest.raises(TrainingError, match=expected):
        train.train_arms(params, tmp_path / "out")
