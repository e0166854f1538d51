"""Fixtures shared by several test files."""

import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError


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


@pytest.fixture
def full_disk(monkeypatch):
    """safetensors' save_file failing as it does on a full disk (its message, seen on a 64 KiB tmpfs)."""

    def save_file(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
