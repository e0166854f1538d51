"""Where the work runs: the device, the machine's CPU, and the dtype `auto` means on it.

`auto` picks bfloat16 where the hardware computes it natively and float32 elsewhere, detected from the
CPU's flags, never assumed from one machine (bench/RESULTS.md names the machine of every figure):
CUDA GPUs with bf16, and CPUs with AMX-BF16 or AVX512-BF16 units, for inference (a target decoding, capturing,
probing) and for training (bf16 autocast, whose backward also reduces in bf16). Measured (bench/RESULTS.md §3,
§4): several times float32's capture throughput on an AVX512-BF16 CPU, faster decoding on an Intel Xeon with
AMX, 4x slower generation on an AMD EPYC without bf16 units; training at 1.55x float32's tokens/s on the AMX
Xeon and 1.4x on an AMD EPYC with AVX512-BF16 (no AMX).

On a CPU, memory comes from the C library's allocator, whose heap keeps what training frees until `trim_heap`
hands it back.
"""

from __future__ import annotations

import ctypes
import platform
from functools import cache
from pathlib import Path

import torch

# /proc/cpuinfo flags of bf16 units: Intel AMX tiles, and AVX-512's bf16 dot products
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: nothing to read, nothing assumed
        return ""


def cpu_flags() -> set[str]:
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model() -> str:
    """The CPU's model name as the OS reports it, e.g. 'Intel(R) Xeon(R) Processor' (named beside figures)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_description() -> str:
    """'Intel(R) Xeon(R) Processor, 2 threads, bf16 units: amx_bf16, avx512_bf16 (torch AVX512)', and the
    GPU where there is one."""
    units = [flag for flag in BF16_CPU_FLAGS if flag in cpu_flags()]
    found = (f"{cpu_model()}, {torch.get_num_threads()} threads, bf16 units: {', '.join(units) or 'none'} "
             f"(torch {torch.backends.cpu.get_cpu_capability()})")
    if torch.cuda.is_available():
        found += f"; GPU {torch.cuda.get_device_name()}"
    return found


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        found = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device {device!r} is not a device name (auto, cpu, cuda, cuda:N): {err}") from None
    if found.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no visible CUDA device"
        raise ValueError(f"device {device!r} asked for, but this machine runs {build}: use cpu or auto")
    return found


def fast_bf16(device: torch.device) -> bool:
    """Is bf16 the fast dtype on this device (what `auto` asks)?"""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and any(flag in cpu_flags() for flag in BF16_CPU_FLAGS)


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere False).

    glibc keeps freed blocks below its mmap threshold in its heap, and raises that threshold (up to 32 MiB)
    each time a larger mapped block is freed. CPU training allocates tensors of many sizes each step, so its
    heap fills with free blocks held between live ones: an online run (batch 4 x 1,024) grew from 3.8 to
    4.8 GB in 45 steps with 0.5 GB of live tensors; trimmed after every step it stayed at 1.9-2.0 GB at the
    same seconds a step, where a fixed 1 MiB threshold (every large tensor its own mapping) cost 1.7x the time
    (bench/bench_packing.py --allocator)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):  # not glibc: its allocator's own behaviour stands
        return False
