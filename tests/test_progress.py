"""Progress in a report kernel: one line when the loop ends, nothing while it runs."""

from __future__ import annotations

from eagle3lib import progress, runs


def test_headless_progress_prints_one_final_line(monkeypatch, capsys):
    monkeypatch.setenv(progress.HEADLESS, "1")
    bar = progress.progress(total=40, desc="drafter", initial=0)
    for _ in range(40):
        bar.update(1)
        bar.set_postfix(loss="3.800")
    assert capsys.readouterr().out == ""  # nothing while it runs
    bar.close()
    bar.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("drafter: 40 steps in 0:0")
    assert lines[0].endswith("loss 3.800")
    assert list(progress.progress(range(3), desc="quiet", leave=False)) == [0, 1, 2]
    with progress.progress(total=5, unit="tok", desc="capture") as tokens:
        tokens.update(5)
    assert capsys.readouterr().out.startswith("capture: 5 tok in 0:00, ")


def test_the_papermill_driver_marks_its_kernels_headless(monkeypatch):
    monkeypatch.delenv(progress.HEADLESS, raising=False)
    assert not progress.headless()
    with runs.headless_kernels():
        assert progress.headless()
    assert not progress.headless()
    assert not isinstance(progress.progress(range(2)), progress.OneLine)  # tqdm where someone watches
