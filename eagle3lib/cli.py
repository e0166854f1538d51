"""`eagle3`: one command per single operation; each subcommand is a small function below.

Each subcommand registers itself in `COMMANDS` with `@command(name, help, arguments)`;
heavy imports happen inside the handlers so `eagle3 --help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable, str]] = {}


def command(name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None]):
    """Register the decorated `handler(args) -> exit code` as `eagle3 <name>`."""

    def register(handler: Callable) -> Callable:
        COMMANDS[name] = (arguments, handler, help)
        return handler

    return register


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("params", help="a recipe under params/, e.g. params/demo.yaml")
    p.add_argument("--only", help="comma-separated notebook numbers, e.g. 00,04")
    p.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                   help="override one parameter, e.g. -p train.steps=50 (repeatable)")
    p.add_argument("--name", help="run name: outputs/<name>/ (default: run.name from the params)")
    p.add_argument("--overwrite", action="store_true", help="reuse an existing run folder")


def check_notebook_settings(params: dict, notebooks: list[str]) -> None:
    """Refuse, naming each notebook and key, any setting one of `notebooks` (e.g. "04_finetune") would refuse
    itself, perhaps hours into a run; each check is the one that notebook's step runs when it starts."""
    from eagle3lib import capture, engines, remap, train
    from eagle3lib.runs import ParamsError

    checks = {
        "00_prepare_data": [capture.check_prepare_settings, train.check_stand_in_settings],
        "01_probe_drafter": [engines.check_probe_settings],
        "03_remap_lm_head": [remap.check_remap_settings],
        "04_finetune": [lambda params: train.check_settings(params["train"])],
        "05_evaluate": [engines.check_evaluate_settings],
    }
    problems = []
    for notebook in notebooks:
        try:
            for check in checks.get(notebook, []):
                check(params)
        except ValueError as err:
            problems.append(f"{notebook}: {err}")
    if problems:
        raise ParamsError("; ".join(problems))


@command("run", "execute the numbered notebooks with papermill into outputs/<run>/", _run_arguments)
def _run(args: argparse.Namespace) -> int:
    from eagle3lib import report, runs

    overrides = list(args.param)
    if args.name:
        overrides.append(f"run.name={args.name}")
    params = runs.load_params(args.params, overrides)
    run_dir = runs.OUTPUTS_DIR / params["run"]["name"]
    only = args.only.split(",") if args.only else None
    # every selected notebook's settings, before the first starts
    check_notebook_settings(params, [notebook.stem for notebook in runs.notebook_paths(only)])
    failure = None
    try:
        runs.run_notebooks(args.params, run_dir, overrides, only=only, overwrite=args.overwrite)
    except runs.NotebookFailed as err:
        failure = err
    summary = report.write_summary(run_dir)
    report.render_html(run_dir)
    index = report.render_index(run_dir)
    print(f"eagle3 run: summary {summary}")
    print(f"eagle3 run: executed notebooks in {run_dir}, HTML in {run_dir / 'html'}")
    print(f"eagle3 run: front page {index}")
    if failure:
        print(f"eagle3 run: {failure}", file=sys.stderr)
        return 1
    return 0


def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", nargs="?",
                   help="a run folder (default: the latest finished run under outputs/, by its summary.md)")
    p.add_argument("--check", action="store_true",
                   help="fail on what a reader would trip over: progress walls, stray stderr, broken links")
    p.add_argument("--screenshots", action="store_true",
                   help="screenshot index.html and each notebook page with headless Chromium into "
                        "<run>/screenshots/; fail if a page does not render")
    p.add_argument("--chromium", default="chromium", help="the Chromium binary (default: chromium)")


@command("report", "write a run's summary.md, notebook HTML pages and front page index.html again",
         _report_arguments)
def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from eagle3lib import report

    try:
        run_dir = Path(args.run_dir) if args.run_dir else report.latest_run()
    except FileNotFoundError as err:
        print(f"eagle3 report: {err}; name a run folder", file=sys.stderr)
        return 2
    if not (run_dir / "params.yaml").is_file():
        print(f"eagle3 report: {run_dir} is not a run folder (no params.yaml)", file=sys.stderr)
        return 2
    report.write_summary(run_dir)
    report.render_html(run_dir)
    print(f"eagle3 report: front page {report.render_index(run_dir)}")
    failed = False
    if args.check:
        problems = report.reader_problems(run_dir)
        for problem in problems:
            print(f"eagle3 report: {problem}", file=sys.stderr)
        print(f"eagle3 report: {len(problems)} problem(s) a reader would meet in {run_dir}")
        failed = bool(problems)
    if args.screenshots:
        try:
            for shot in report.screenshots(run_dir, args.chromium):
                where = (f"first figure at {shot.first_figure_px:,} px" if shot.first_figure_px is not None
                         else "no figure")
                late = "" if shot.figure_on_screen else f": none in the first {report.SCREEN_HEIGHT:,} px"
                print(f"eagle3 report: screenshot {shot.png} ({where}{late})")
        except RuntimeError as err:
            print(f"eagle3 report: {err}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("params", help="a recipe under params/ (its train section: arms, data, vocab map, steps)")
    p.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                   help="override one parameter, e.g. -p train.steps=50 (repeatable)")
    p.add_argument("-o", "--out", help="output folder, one subfolder per arm (default: "
                   "outputs/<run.name>/04_finetune)")
    p.add_argument("--run-dir", help="the run that '@step/...' paths refer to (default: the output's parent)")
    p.add_argument("--resume", action="store_true", help="continue each arm from its latest checkpoint")


@command("train", "fine-tune the recipe's arms (04_finetune without the notebook; torchrun when "
         "train.nproc > 1)", _train_arguments)
def _train(args: argparse.Namespace) -> int:
    from eagle3lib import train

    params, out, run_dir = train.recipe_for_training(args.params, args.param, args.out, args.run_dir)
    results = train.train_arms(params, out, run_dir=run_dir, resume=args.resume)
    print(f"eagle3 train: {train.findings(results)}")
    for arm, result in results.items():
        print(f"eagle3 train: {arm}: drafter {result.drafter}")
    return 0


def _publish_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run folder whose notebook 04 trained the arm (and 05 measured it)")
    p.add_argument("--arm", default="scratch", help="the arm under RUN_DIR/04_finetune/ (default: scratch)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--command", required=True, help="the command that made the run, recorded as it is")
    p.add_argument("-o", "--out", required=True, help="the new drafter folder (refused if it exists)")


@command("publish", "copy a trained drafter out of its run with its provenance (command, commit, recipe, "
         "training curve, measured τ, weights hash)", _publish_arguments)
def _publish(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from eagle3lib import publish

    out = publish.publish(Path(args.run_dir), args.arm, Path(args.out), command=args.command,
                          dtype=getattr(torch, args.dtype))
    print(f"eagle3 publish: {out} ({publish.verify(out)['sha256']})")
    return 0


def _diff_vocab_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="map A: a drafter checkpoint folder or a map file (d2t/t2d)")
    p.add_argument("b", help="map B: same kinds as A")
    p.add_argument("--counts", help="token-count table (safetensors 'counts' [Vt]) for coverage")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")


@command("diff-vocab", "compare two vocab maps: agreement, overlap, coverage", _diff_vocab_arguments)
def _diff_vocab(args: argparse.Namespace) -> int:
    import json

    from eagle3lib import vocab

    a, b = vocab.VocabMap.load(args.a), vocab.VocabMap.load(args.b)
    counts = vocab.load_counts(args.counts, a.vt) if args.counts else None
    result = vocab.diff(a, b, counts)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.summary())
    return 0


def _remap_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="the drafter checkpoint folder to move")
    p.add_argument("--to-map", required=True, metavar="MAP_OR_CKPT",
                   help="the new vocab map: a map file (d2t/t2d) or another drafter checkpoint")
    p.add_argument("--target", help="target head for --missing verifier (and the proof's embedding): a data "
                   "folder or target_head.safetensors, a Hugging Face folder, or zoo:<name>")
    p.add_argument("--missing", default="mean", choices=["verifier", "mean", "zeros", "random"],
                   help="rows for tokens the old map lacks (default: mean)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy and the proof's inputs")
    p.add_argument("-o", "--out", required=True, help="output checkpoint folder (written in SRC's layout)")


@command("remap", "move a drafter's lm_head rows onto a new vocab map, with an exact proof", _remap_arguments)
def _remap(args: argparse.Namespace) -> int:
    from eagle3lib import remap

    _, report = remap.remap_checkpoint(
        args.src, args.to_map, args.out, target=args.target, missing=args.missing, seed=args.seed
    )
    print(report.summary())
    print(f"eagle3 remap: wrote {args.out} and {args.out}/remap_report.json")
    return 0


CONFIG_HELP = ("the drafter's config.json when the checkpoint has none beside it (a SpecForge 0.2 "
               "{run}-step{N}/training_state.pt: the run's draft config JSON)")


def _inspect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a drafter checkpoint folder (SGLang or speculators layout) or a SpecForge "
                   "training_state.pt")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--json", action="store_true", help="print everything as JSON")


@command("inspect", "describe a drafter checkpoint: layout, config, tensors, vocab map, engines that compute "
         "it faithfully", _inspect_arguments)
def _inspect(args: argparse.Namespace) -> int:
    import json

    from eagle3lib import checkpoint

    info = checkpoint.inspect_checkpoint(args.path, config=args.config)
    print(json.dumps(info, indent=2) if args.json else checkpoint.format_inspection(info))
    return 0 if info["report"]["ok"] else 1


def _convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a drafter checkpoint folder or a SpecForge training_state.pt")
    p.add_argument("--to", required=True, choices=["sglang", "speculators"], help="the layout to write")
    p.add_argument("-o", "--output", required=True, help="the new checkpoint folder (must not exist)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--target", help="the target (Hugging Face folder, data folder or "
                   "target_head.safetensors): its embedding for a speculators-layout export of a drafter "
                   "without one; a model folder is also recorded as verifier.name_or_path")
    p.add_argument("--allow-engine-mismatch", action="store_true",
                   help="write even when an engine reading that layout would compute something else (e.g. "
                   "norm_before_residual=true, which SGLang and SpecForge ignore)")


@command("convert", "rewrite a drafter checkpoint in the SGLang or speculators layout", _convert_arguments)
def _convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from eagle3lib import checkpoint
    from eagle3lib.remap import load_target_head

    embedding = verifier = None
    if args.target:
        embedding = load_target_head(args.target)["embed_tokens.weight"]
        if (Path(args.target) / "config.json").is_file():  # a model folder, not only its head
            verifier = str(Path(args.target).resolve())
    try:
        report = checkpoint.convert(
            args.src, args.output, args.to, overwrite=args.overwrite, config=args.config,
            target_embedding=embedding, verifier=verifier, allow_engine_mismatch=args.allow_engine_mismatch,
        )
    except FileExistsError as err:
        print(f"eagle3 convert: error: {err}", file=sys.stderr)
        return 2
    print(f"eagle3 convert: {report.path} ({report.layout}; {report.summary()}) → {args.output} ({args.to})")
    for note in report.notes:
        print(f"eagle3 convert: note: {note}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_arguments, handler, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        add_arguments(p)
        p.set_defaults(handler=handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from eagle3lib.runs import ParamsError, RunExistsError

    try:
        code = args.handler(args) or 0
        sys.stdout.flush()  # a reader gone (`eagle3 inspect ... | head`) shows here, not in Python's exit
        return code
    except BrokenPipeError:
        # nobody reads the rest: stop quietly, stdout on /dev/null so that the flush at exit fails no more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ParamsError, RunExistsError, OSError, ValueError) as err:  # OSError: e.g. "writing PATH: ..."
        print(f"eagle3 {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
