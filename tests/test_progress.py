"""Progress bars: live where someone watches, one line per loop in a report kernel, Hugging Face's quiet."""

from __future__ import annotations

import re

from eagle3lib import progress, runs
from eagle3lib.target.model import Target


def test_headless_progress_prints_one_final_line(monkeypatch, capsys):
    monkeypatch.setenv(progress.HEADLESS, "1")
    bar = progress.progress(total=40, desc="drafter")
    for step in range(40):
        bar.update(1)
        bar.set_postfix(loss="3.800", acc_0=f"{step:.1f} %")
    assert capsys.readouterr().out == ""  # nothing while it runs
    bar.close()
    bar.close()  # closing twice prints once
    assert re.fullmatch(r"drafter: 40 steps in 0:0\d, loss 3\.800, acc_0 39\.0 %\n", capsys.readouterr().out)

    assert list(progress.progress(range(3), desc="prompts")) == [0, 1, 2]  # iterating closes it
    assert capsys.readouterr().out.startswith("prompts: 3 steps in 0:00\n")
    with progress.progress(total=5, unit="tok", desc="capture", initial=2) as tokens:
        tokens.update(3)
    assert re.fullmatch(r"capture: 5 tok \(resumed at 2\) in 0:00, [\d,]+ tok/s\n", capsys.readouterr().out)

    assert list(progress.progress(range(3), desc="inner", leave=False)) == [0, 1, 2]
    progress.progress(total=3, desc="another process's", disable=True).close()
    assert capsys.readouterr().out == ""  # bars meant to vanish, and other ranks' bars, print nothing


def test_where_someone_watches_progress_is_tqdm(monkeypatch, capsys):
    monkeypatch.delenv(progress.HEADLESS, raising=False)
    bar = progress.progress(range(2), desc="live")
    assert not isinstance(bar, progress.OneLine) and type(bar).__module__.startswith("tqdm")
    assert list(bar) == [0, 1]
    assert "live: 100%" in capsys.readouterr().err  # tqdm's own bar, on stderr where a terminal shows it


def test_the_papermill_driver_marks_its_kernels_headless(monkeypatch):
    monkeypatch.delenv(progress.HEADLESS, raising=False)
    assert not progress.headless()
    with runs.headless_kernels():
        assert progress.headless()
    assert not progress.headless()


def test_loading_a_target_prints_no_hugging_face_bars(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    Target.load("zoo:tiny-llama", dtype="float32", device="cpu", cache_dir=tmp_path)  # built, then loaded
    Target.load("zoo:tiny-llama", dtype="float32", device="cpu", cache_dir=tmp_path)  # loaded from the cache
    printed = capfd.readouterr()
    assert "Loading weights" not in printed.err and "%|" not in printed.err + printed.out
    assert hf_logging.is_progress_bar_enabled()  # as it was: only eagle3lib's loading is quiet


def test_the_line_gives_a_rate_only_for_things_counted_faster_than_one_a_second(monkeypatch):
    monkeypatch.setenv(progress.HEADLESS, "1")
    slow = progress.progress(total=4, desc="evaluate", unit="drafters")
    slow.update(4)
    slow.start -= 130  # as if 2:10 had passed
    assert slow.line() == "evaluate: 4 drafters in 2:10"
    fast = progress.progress(total=2600, desc="capture", unit="tok")
    fast.update(2600)
    fast.start -= 130
    assert fast.line() == "capture: 2,600 tok in 2:10, 20 tok/s"
