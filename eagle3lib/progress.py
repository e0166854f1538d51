"""Progress of long loops: live where someone watches, one line where a report keeps it.

In a terminal or an interactive JupyterLab, `progress` is tqdm (a widget bar in Jupyter). In a kernel that
papermill runs for a report (`eagle3 run`, the tests), every update of a bar would stay in the executed
notebook as its own line of stderr; there `progress` shows nothing while it runs and prints one line when
the loop ends ("capture stdlib-code: 24,000 tok in 1:52, 214 tok/s"), while the driver shows each
notebook's cell progress live. The driver marks those kernels with `HEADLESS` in their environment.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator

HEADLESS = "EAGLE3LIB_HEADLESS"


def headless() -> bool:
    return os.environ.get(HEADLESS) == "1"


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    if minutes >= 60:
        return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}"
    return f"{minutes}:{seconds:02d}"


class OneLine:
    """The parts of tqdm's interface eagle3lib uses, printing a single summary line on `close`."""

    def __init__(self, iterable: Iterable | None = None, total: int | None = None, desc: str = "",
                 unit: str = "it", initial: int = 0, disable: bool = False, leave: bool = True, **_ignored):
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.n, self.first, self.start, self.postfix = initial, initial, time.perf_counter(), {}
        self.silent, self.closed = disable or not leave, False  # leave=False: never meant to stay

    def __iter__(self) -> Iterator:
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

    def close(self) -> None:
        if self.closed or self.silent:
            return
        self.closed = True
        seconds = time.perf_counter() - self.start
        done = self.n - self.first
        rate = f", {done / seconds:,.0f} {self.unit}/s" if seconds > 0 and self.unit != "it" else ""
        extra = "".join(f", {key} {value}" for key, value in self.postfix.items())
        print(f"{self.desc}: {self.n:,} {self.unit if self.unit != 'it' else 'steps'} in {_clock(seconds)}"
              f"{rate}{extra}", flush=True)


def progress(iterable: Iterable | None = None, **kwargs):
    """tqdm where someone watches; `OneLine` in a headless report kernel (see the module docstring)."""
    if headless():
        return OneLine(iterable, **kwargs)
    from tqdm.auto import tqdm

    return tqdm(iterable, **kwargs)
