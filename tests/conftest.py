"""Fixtures shared by several test files."""

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Tiny models on a shared 2-core machine: more threads only fight each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_thread_kernels(monkeypatch):
    """The same for notebook kernels and other child processes, which inherit OMP_NUM_THREADS."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
