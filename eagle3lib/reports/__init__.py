"""Reports: what a run shows and what the project ships.

plots (the notebooks' figures), report (a run's summary.md, index.html, HTML pages, screenshots), publish (a
trained drafter shipped with its provenance and weights hash).

Imports every floor below; only the `eagle3` command (cli) imports it.
"""
