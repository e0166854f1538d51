"""Progress of long loops: live where someone watches, one line where a report keeps it.

Every loop in eagle3lib that takes long enough to want a bar goes through `progress`:

- in a terminal, a text tqdm bar; in an interactive Jupyter kernel, tqdm's widget bar (ipywidgets);
- in a kernel run headless for a report (`eagle3 run`, the tests, or any kernel started with
  `EAGLE3LIB_HEADLESS=1`), nothing while the loop runs and one line when it ends, e.g.
  "drafter: 40 steps in 2:13, loss 3.800, acc_0 33.8 %, tau 1.37". Every update of a live bar would
  otherwise stay in the executed notebook as a line of stderr; the driver shows each notebook's cell
  progress live instead.

The papermill driver (`eagle3lib.runs.execute_notebook`) sets `HEADLESS` for the kernels it starts: a flag
set by whoever starts the kernel is reliable where guessing from the kernel's surroundings is not.

Hugging Face prints bars of its own while eagle3lib loads a model (272 "Loading weights" updates per load,
"Writing model shards"); `quiet_hf_loading` turns them off inside eagle3lib's loading functions only.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

HEADLESS = "EAGLE3LIB_HEADLESS"


def headless() -> bool:
    """True in a kernel run for a report: its driver set `EAGLE3LIB_HEADLESS=1`."""
    return os.environ.get(HEADLESS) == "1"


def clock(seconds: float) -> str:
    """2:13 or 1:02:13."""
    minutes, seconds = divmod(int(round(seconds)), 60)
    if minutes >= 60:
        return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}"
    return f"{minutes}:{seconds:02d}"


class OneLine:
    """The part of tqdm's interface eagle3lib uses, printing one summary line to stdout on `close` (or when
    the iteration ends): "<desc>: <n> <unit> in <m:ss>[, <rate> <unit>/s][, <postfix key> <value>...]"; the
    unit "it" (tqdm's default) reads "steps"."""

    def __init__(self, iterable: Iterable | None = None, total: int | None = None, desc: str = "",
                 unit: str = "it", initial: int = 0, leave: bool = True, disable: bool = False):
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.n, self.initial, self.start, self.postfix = initial, initial, time.perf_counter(), {}
        # leave=False: a bar meant to vanish when done (an inner loop); disable: another process reports
        self.silent, self.closed = disable or not leave, False

    def __iter__(self) -> Iterator:
        if self.iterable is None:
            raise TypeError(f"progress {self.desc!r} was made without an iterable; call update() instead")
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> OneLine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, **values) -> None:
        self.postfix = values

    def line(self) -> str:
        seconds = time.perf_counter() - self.start
        unit = "steps" if self.unit == "it" else self.unit
        resumed = f" (resumed at {self.initial:,})" if self.initial else ""
        done = self.n - self.initial
        # a rate for counted things (tokens, tensors) coming faster than one a second; else the time says it
        rate = f", {done / seconds:,.0f} {unit}/s" if self.unit != "it" and done >= seconds > 0 else ""
        extra = "".join(f", {key} {value}" for key, value in self.postfix.items())
        return f"{self.desc}: {self.n:,} {unit}{resumed} in {clock(seconds)}{rate}{extra}"

    def close(self) -> None:
        if self.closed or self.silent:
            return
        self.closed = True
        print(self.line(), flush=True)


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
             initial: int = 0, leave: bool = True, disable: bool = False):
    """A progress bar over `iterable` (or, without one, advanced by `update(n)`; then call `close()` or use
    it as a context manager): live tqdm where someone watches, `OneLine` in a headless report kernel.

    `leave=False` for an inner loop whose bar should vanish: in a report it prints nothing at all. The
    returned object has tqdm's `update`, `set_postfix`, `close` and context-manager protocol."""
    settings = dict(total=total, desc=desc, unit=unit, initial=initial, leave=leave, disable=disable)
    if headless():
        return OneLine(iterable, **settings)
    return live_bar_class()(iterable, **settings)


def live_bar_class():
    """tqdm.auto's choice (a widget bar in Jupyter, text elsewhere), without its warning where ipywidgets
    is missing: it then falls back to the text bar, which is all a reader needs to know."""
    from tqdm import TqdmWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found", category=TqdmWarning)
        from tqdm.auto import tqdm
    return tqdm


@contextmanager
def quiet_hf_loading() -> Iterator[None]:
    """Hugging Face's own progress bars (transformers and huggingface_hub) off for the block, as they were
    afterwards: loading a model is quick, and its per-tensor bar is noise in a notebook."""
    from transformers.utils import logging as hf_logging

    if not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()
