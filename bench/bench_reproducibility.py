"""What bit-exact arithmetic costs: MKL's strict conditional numerical reproducibility against none.

    .venv/bin/python bench/bench_reproducibility.py [--repeats 3] [--steps 4]

eagle3lib sets `MKL_CBWR=AUTO,STRICT` when imported (unless the environment already sets MKL_CBWR), so that a
run and its resumed copy compute the same bits on AVX-512 CPUs (README, "Resume"). MKL reads the variable
once, when it first runs, so each measurement is its own process: the float32 TTT training step
(`bench_train.py`, MKL's sgemm) and the float32 target forward of capture (`bench_capture.py`), with
`MKL_CBWR=OFF` (MKL's own default: no reproducibility mode) and with `AUTO,STRICT`, alternating, medians
reported. bf16 products run on oneDNN, not MKL, and are unaffected.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from eagle3lib.devices import machine_description

BENCH = Path(__file__).resolve().parent
MODES = ("OFF", "AUTO,STRICT")


def measure(script: str, args: list[str], pattern: str, mode: str) -> float:
    env = {**os.environ, "MKL_CBWR": mode}
    done = subprocess.run([sys.executable, str(BENCH / script), *args], env=env, capture_output=True,
                          text=True, check=True)
    found = re.search(pattern, done.stdout)
    if not found:
        raise RuntimeError(f"{script} printed no figure matching {pattern!r}:\n{done.stdout}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed training steps per run")
    args = parser.parse_args()
    print(machine_description())
    cases = {
        "training step, fp32 (tokens/s)": ("bench_train.py", ["--steps", str(args.steps), "--dtype", "fp32"],
                                           r"training: (\d+) tokens/s"),
        "target forward with capture, fp32 (tokens/s)": ("bench_capture.py",
                                                         ["--dtypes", "float32", "--repeats", "3"],
                                                         r"wall time: .*capture\s+(\d+) tok/s"),
    }
    for label, (script, script_args, pattern) in cases.items():
        figures = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                figures[mode].append(measure(script, script_args, pattern, mode))
        off, strict = (statistics.median(figures[mode]) for mode in MODES)
        runs = "; ".join(f"{mode}: {', '.join(f'{v:g}' for v in values)}" for mode, values in figures.items())
        print(f"{label}: MKL_CBWR=OFF {off:g}, AUTO,STRICT {strict:g} "
              f"(ratio {strict / off:.3f}; runs {runs})")


if __name__ == "__main__":
    main()
