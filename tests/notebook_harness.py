"""Execute a notebook headless with papermill, the way `eagle3 run` does, and return its metrics."""

from __future__ import annotations

from pathlib import Path

from eagle3lib import files, runs


def run_notebook(
    name: str,
    run_dir: Path,
    params_file: str = "params/smoke.yaml",
    overrides: dict | None = None,
    notebook: Path | None = None,
) -> dict:
    """Run `notebooks/<name>.ipynb` (or `notebook`) into `run_dir`; returns that step's metrics.

    Notebooks of one pipeline share `run_dir`, so call this in pipeline order.
    """
    source = notebook or runs.NOTEBOOKS_DIR / f"{name}.ipynb"
    runs.execute_notebook(
        source,
        Path(run_dir) / source.name,
        {
            "params_file": str(files.resolve_path(params_file)),
            "run_dir": str(run_dir),
            "overrides": overrides or {},
            "overwrite": False,
        },
    )
    metrics = runs.read_metrics(run_dir)
    assert name in metrics, f"{source.name} wrote no metrics under '{name}' in {run_dir}/metrics.json"
    return metrics[name]
