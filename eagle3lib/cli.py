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


def whole(low: int):
    """An argparse type: an integer of at least `low` (argparse names the option in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def fraction(low: float, high: float, *, open_high: bool = False):
    """An argparse type: a number in [low, high] ([low, high) with `open_high`)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low <= value < high if open_high else low <= value <= high):
            raise argparse.ArgumentTypeError(
                f"must lie in [{low}, {high}{')' if open_high else ']'}, got {value}")
        return value

    return parse


def template_switches(text: str) -> dict:
    """An argparse type: a chat template's switches as a JSON object, e.g. '{"enable_thinking": true}'."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


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
    from eagle3lib import runs
    from eagle3lib.decoding import engines, evaluate
    from eagle3lib.generation import capture
    from eagle3lib.params import ParamsError
    from eagle3lib.training import remap, train

    checks = {
        runs.PREPARE_DATA: [capture.check_prepare_settings, train.check_stand_in_settings],
        runs.PROBE_DRAFTER: [engines.check_probe_settings],
        runs.REMAP_LM_HEAD: [remap.check_remap_settings],
        runs.FINETUNE: [lambda params: train.check_settings(params["train"])],
        runs.EVALUATE: [evaluate.check_evaluate_settings],
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
    from eagle3lib import runs
    from eagle3lib.params import load_params
    from eagle3lib.reports import report

    overrides = list(args.param)
    if args.name:
        overrides.append(f"run.name={args.name}")
    params = load_params(args.params, overrides)
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

    from eagle3lib.reports import report

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
    p.add_argument("--overwrite", action="store_true",
                   help="record these params in a run folder that holds another run's (params.yaml)")


@command("train", "fine-tune the recipe's arms (04_finetune without the notebook; torchrun when "
         "train.nproc > 1)", _train_arguments)
def _train(args: argparse.Namespace) -> int:
    from eagle3lib import runs
    from eagle3lib.params import load_params
    from eagle3lib.training import train

    params, out, run_dir = train.recipe_for_training(args.params, args.param, args.out, args.run_dir)
    train.check_recipe(params)  # before anything is written: a refused command leaves nothing behind
    # as `eagle3 run` does for its notebooks: what trained these arms, for `eagle3 publish`
    run = runs.Run.open(run_dir, load_params(args.params, args.param), overwrite=args.overwrite)
    runs.record_provenance(run, [runs.FINETUNE])
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

    from eagle3lib.reports import publish

    out = publish.publish(Path(args.run_dir), args.arm, Path(args.out), command=args.command,
                          dtype=getattr(torch, args.dtype))
    print(f"eagle3 publish: {out} ({publish.verify(out)['sha256']})")
    return 0


def _relay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="an unfinished online training run, e.g. outputs/chat-drafter-full (it "
                   "may be training now: each arm is carried at its latest checkpoint)")
    p.add_argument("--command", required=True, help="the command that trains the run, recorded as it is")
    p.add_argument("-o", "--out", required=True, help="the relay folder, e.g. relay/NAME (an older relay of "
                   "the same run is replaced, a newer one refused)")


@command("relay", "carry an unfinished online training run to another machine: each arm's latest checkpoint "
         "in bf16 without AdamW's moments, its chosen point, logs and curve (a folder to commit)",
         _relay_arguments)
def _relay(args: argparse.Namespace) -> int:
    from pathlib import Path

    from eagle3lib.training import relay

    record = relay.save(Path(args.run_dir), Path(args.out), command=args.command)
    size = sum((Path(args.out) / rel).stat().st_size for rel in record["sha256"])
    arms = ", ".join(f"{arm} at step {a['step']:,} of {a['steps']:,} ({a['tokens']:,} tokens)"
                     for arm, a in record["arms"].items())
    print(f"eagle3 relay: {args.out} ({size / 1e6:.1f} MB): {arms}")
    return 0


def _restore_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("relay_dir", help="a relay folder (eagle3 relay), e.g. relay/chat-drafter-full")
    p.add_argument("--run-dir", help="the run folder to make (default: outputs/<the relay's run>; must not "
                   "exist)")


@command("restore", "make the run folder a relay carries (the online text rebuilt and checked by hash); "
         "then `eagle3 train RECIPE --resume` continues it", _restore_arguments)
def _restore(args: argparse.Namespace) -> int:
    from pathlib import Path

    from eagle3lib.training import relay

    run_dir, record = relay.restore(Path(args.relay_dir), Path(args.run_dir) if args.run_dir else None)
    print(f"eagle3 restore: {run_dir}; continue it with: {record['command']} --resume")
    return 0


def _publish_curves_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run folder whose notebook 04 measured its arms along training "
                   "(train.validation_prompts > 0)")
    p.add_argument("--command", required=True, help="the command that made the run, recorded as it is")
    p.add_argument("-o", "--out", required=True, help="the new record folder, e.g. records/NAME (refused if "
                   "it exists)")


def _compare_costs_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("records", nargs="+", metavar="LABEL=RECORD",
                   help="committed curves records (eagle3 publish-curves), e.g. regenerated=records/A")
    p.add_argument("--regeneration-cores", type=int, required=True,
                   help="the CPU cores the regenerated data was made on (its manifests give seconds)")
    p.add_argument("--command", required=True, help="the command, recorded as it is")
    p.add_argument("-o", "--out", required=True, help="the new record folder (refused if it exists)")


@command("compare-costs", "τ per CPU core-hour of curves records trained on different data, the data's "
         "regeneration included (comparison.json, the figure, provenance)", _compare_costs_arguments)
def _compare_costs(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from eagle3lib.reports import publish

    records = {label: Path(path) for label, path in map(_label_and_path, args.records)}
    out = publish.publish_cost_comparison(records, Path(args.out), command=args.command,
                                          regeneration_cores=args.regeneration_cores)
    comparison = json.loads((out / publish.COMPARISON).read_text())
    for name, arm in comparison["arms"].items():
        last = arm["points"][-1]
        taus = ", ".join(f"{b} {m['tau']:.3f}" for b, m in last["benchmarks"].items())
        print(f"eagle3 compare-costs: {name}: {taus} at {last['tokens']:,} tokens, {last['core_hours']:.2f} "
              f"core-hours ({arm['train_core_seconds_per_token'] * 1e3:.2f} ms a token to train, "
              f"{arm['data_core_seconds_per_token'] * 1e3:.2f} to make)")
    return 0


def _label_and_path(item: str) -> tuple[str, str]:
    label, sep, path = item.partition("=")
    if not sep or not label or not path:
        raise SystemExit(f"eagle3 compare-costs: {item!r} is not LABEL=RECORD")
    return label, path


@command("publish-curves", "copy a run's τ along training out as a committed record (curves.json, the "
         "figure, provenance with their hashes)", _publish_curves_arguments)
def _publish_curves(args: argparse.Namespace) -> int:
    from pathlib import Path

    from eagle3lib.reports import publish

    out = publish.publish_curves(Path(args.run_dir), Path(args.out), command=args.command)
    record = publish.read_record(out)
    print(f"eagle3 publish-curves: {out} ({record['budget']})")
    for line in record["findings"]:
        print(f"  {line}")
    return 0


def _diff_vocab_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="map A: a drafter checkpoint folder or a map file (d2t/t2d)")
    p.add_argument("b", help="map B: same kinds as A")
    p.add_argument("--counts", help="token-count table (safetensors 'counts' [Vt]) for coverage")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")


@command("diff-vocab", "compare two vocab maps: agreement, overlap, coverage", _diff_vocab_arguments)
def _diff_vocab(args: argparse.Namespace) -> int:
    import json

    from eagle3lib.drafter import vocab

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
    from eagle3lib.training import remap

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

    from eagle3lib.drafter import inspection

    info = inspection.inspect_checkpoint(args.path, config=args.config)
    print(json.dumps(info, indent=2) if args.json else inspection.format_inspection(info))
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

    from eagle3lib.data.layout import load_target_head
    from eagle3lib.drafter import checkpoint

    embedding = verifier = None
    if args.target:
        embedding = load_target_head(args.target, ("embed_tokens.weight",))[0]["embed_tokens.weight"]
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


def _target_decoding_arguments(p: argparse.ArgumentParser) -> None:
    """How the built-in engine decodes: probe, curve and table share these."""
    p.add_argument("--max-new-tokens", type=whole(1), default=128)
    p.add_argument("--batch-size", type=whole(1), default=16)
    p.add_argument("--dtype", default="float32", help="the target's dtype (float32: greedy output exact)")
    p.add_argument("--device", default="auto")
    p.add_argument("--compiled", action="store_true", help="the target's steps through one compiled graph (a "
                   "Llama-like target; up to four compilations, one row or more, one token or K+1, about a "
                   "minute each on 2 cores)")


def _probe_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("drafters", nargs="+", help="drafter checkpoint folders (SGLang or speculators layout)")
    p.add_argument("--target", required=True, help="a local Hugging Face folder or zoo:<name>")
    p.add_argument("--corpus", required=True, help="the prompts, as probe.corpus: sharegpt, humaneval, "
                   "stdlib-code, pydoc-prose, a conversation file or a prompt file")
    p.add_argument("--num-prompts", type=whole(0), default=32, help="0: all of a prompt file or of humaneval")
    p.add_argument("--steps", type=whole(1), default=3, help="chain draft depth K")
    _target_decoding_arguments(p)
    p.add_argument("--json", action="store_true", help="one JSON object per drafter")


@command("probe", "τ of drafters on held-out prompts, as notebook 01 measures it (builtin engine, greedy)",
         _probe_arguments)
def _probe(args: argparse.Namespace) -> int:
    import json

    from eagle3lib.decoding import engines, evaluate
    from eagle3lib.decoding.batches import PrefillCache
    from eagle3lib.decoding.speculate import DraftSettings

    target, tokenizer = engines.open_target(args.target, "builtin", args.dtype, args.device)
    reply = engines.target_replies(target, args.max_new_tokens, args.batch_size, args.compiled)
    prompts = engines.probe_prompts(tokenizer, args.corpus, args.num_prompts, 600, True, reply)
    reuse, baseline = PrefillCache(), None
    for drafter in args.drafters:
        result = engines.probe("builtin", target, drafter, prompts, DraftSettings(steps=args.steps),
                               args.max_new_tokens, batch_size=args.batch_size, baseline=baseline,
                               reuse=reuse, compiled=args.compiled)
        baseline, m = result.baseline, result.metrics
        if args.json:
            keys = ("tau", "tau_low", "tau_high", "tau_interval_unit", "acceptance_per_position", "speedup",
                    "matches_target", "prompts")
            print(json.dumps({"drafter": drafter, "corpus": args.corpus, "steps": args.steps,
                              "max_new_tokens": args.max_new_tokens, **{k: m.get(k) for k in keys}}))
        else:
            print(f"eagle3 probe: {drafter}: τ {evaluate.tau_text(m)} on {m['prompts']} {args.corpus} "
                  f"prompts x {args.max_new_tokens} tokens, K {args.steps} ({result.notes[0]})")
    return 0


def _curve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("arm_folder", help="a trained arm, e.g. outputs/<run>/04_finetune/scratch (its "
                   "checkpoints/ and drafter/)")
    p.add_argument("--target", required=True, help="a local Hugging Face folder or zoo:<name>")
    p.add_argument("--benchmark", action="append", required=True, metavar="CORPUS:N[:TURNS]",
                   help="prompts to measure on, e.g. sharegpt:32, humaneval:32 or sharegpt:32:2 (the first "
                   "two user turns, MT-Bench style; repeatable)")
    p.add_argument("--steps", type=whole(1), default=3, help="chain draft depth K")
    _target_decoding_arguments(p)


@command("curve", "τ of a trained arm's checkpoints against the tokens it trained on (learning_curve.json)",
         _curve_arguments)
def _curve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from eagle3lib.data.benchmarks import Benchmark
    from eagle3lib.decoding import curves, engines
    from eagle3lib.decoding.speculate import DraftSettings
    from eagle3lib.reports import plots

    benchmarks = [Benchmark.parse(item) for item in args.benchmark]
    target, tokenizer = engines.open_target(args.target, "builtin", args.dtype, args.device)
    curve = curves.learning_curve(Path(args.arm_folder), target, tokenizer, benchmarks,
                                  DraftSettings(steps=args.steps), args.max_new_tokens, args.batch_size,
                                  log=lambda line: print(f"eagle3 curve: {line}", flush=True),
                                  compiled=args.compiled)
    plots.learning_curve(curve, Path(args.arm_folder) / "learning_curve.png")
    print(f"eagle3 curve: {Path(args.arm_folder) / curves.LEARNING_CURVE}")
    return 0


def _table_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("drafter", help="a drafter checkpoint folder")
    p.add_argument("--target", required=True, help="a local Hugging Face folder or zoo:<name>")
    p.add_argument("--benchmark", action="append", required=True, metavar="CORPUS:N[:TURNS]",
                   help="e.g. humaneval:32, sharegpt:32 (held-out first turns), sharegpt:32:2 (held-out "
                   "conversations' first two user turns, each on the target's own reply: MT-Bench style)")
    p.add_argument("--setting", action="append", required=True, metavar="STEPS/TOPK/DRAFT_TOKENS",
                   help="SGLang's terms: 3/1/4 and 7/1/8 are chains of 3 and 7, 5/4/16 a tree (repeatable)")
    _target_decoding_arguments(p)
    p.add_argument("--chat-template-kwargs", type=template_switches, default={}, metavar="JSON",
                   help="the thinking mode the prompts are rendered in")
    p.add_argument("-o", "--output", help="also write the table with its settings and machine as JSON")


@command("table", "τ table of one drafter: every benchmark at every setting, with intervals, in SGLang's and "
         "vLLM's terms", _table_arguments)
def _table(args: argparse.Namespace) -> int:
    import json
    import sys
    import time
    from pathlib import Path

    from eagle3lib.data.benchmarks import Benchmark
    from eagle3lib.decoding import engines, evaluate
    from eagle3lib.devices import machine_description
    from eagle3lib.files import atomic_write_text, file_sha256, resolve_path
    from eagle3lib.reports.publish import WEIGHTS
    from eagle3lib.runs import git_commit

    benchmarks = [Benchmark.parse(item) for item in args.benchmark]
    grid = [evaluate.parse_setting(item) for item in args.setting]
    start = time.perf_counter()
    target, tokenizer = engines.open_target(args.target, "builtin", args.dtype, args.device)
    rows = evaluate.tau_table(target, tokenizer, Path(args.drafter), benchmarks, grid, args.max_new_tokens,
                              args.batch_size, args.chat_template_kwargs,
                              log=lambda line: print(f"eagle3 table: {line}", flush=True),
                              compiled=args.compiled)
    machine = machine_description()
    print(f"\n{evaluate.tau_table_markdown(rows)}\n\n{args.drafter} on {args.target} ({target.dtype}), "
          f"{args.max_new_tokens} new tokens, batch {args.batch_size}, greedy; {machine}")
    if args.output:
        weights = resolve_path(args.drafter) / WEIGHTS
        record = {
            "drafter": args.drafter, "weights_sha256": file_sha256(weights) if weights.exists() else None,
            "target": args.target, "dtype": str(target.dtype).removeprefix("torch."),
            "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "compiled": args.compiled,
            "chat_template_kwargs": args.chat_template_kwargs, "machine": machine,
            "command": "eagle3 " + " ".join(sys.argv[1:]), "commit": git_commit(),
            "seconds": time.perf_counter() - start, "rows": rows,
        }
        atomic_write_text(resolve_path(args.output), json.dumps(record, indent=1) + "\n")
    return 0


def _coverage_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("corpus", help="a conversation corpus whose training split the maps are built from: "
                   "sharegpt, or a .json/.jsonl(.gz) file or folder")
    p.add_argument("--target", required=True, help="a local Hugging Face folder or zoo:<name>")
    p.add_argument("--benchmark", default="sharegpt:64", metavar="CORPUS:N[:TURNS]",
                   help="the held-out prompts the target replies to (default sharegpt:64)")
    p.add_argument("--sizes", type=lambda text: [whole(1)(item) for item in text.split(",")],
                   default="1024,2048,4096,8192,16384,32000", metavar="VD,VD,...",
                   help="the draft vocabulary sizes tabulated (EAGLE-3's releases: 32,000)")
    p.add_argument("--seq-len", type=whole(2), default=2048, help="tokens per sample (longer ones are cut)")
    p.add_argument("--chat-template-kwargs", type=template_switches, default={}, metavar="JSON",
                   help="the template's switches, e.g. '{\"enable_thinking\": true}'")
    _target_decoding_arguments(p)
    p.add_argument("-o", "--output", help="also write the record here: coverage.json, coverage.png and "
                   "provenance.json with their SHA-256")


@command("coverage", "which draft vocabulary size to train: the share of held-out target replies inside the "
         "map of each size", _coverage_arguments)
def _coverage(args: argparse.Namespace) -> int:
    import sys
    import time
    from pathlib import Path

    from eagle3lib.data.benchmarks import Benchmark
    from eagle3lib.data.conversations import ChatRenderer
    from eagle3lib.decoding import engines, evaluate
    from eagle3lib.devices import machine_description
    from eagle3lib.reports.publish import publish_coverage
    from eagle3lib.runs import git_commit

    start = time.perf_counter()
    target, _ = engines.open_target(args.target, "builtin", args.dtype, args.device)
    renderer = ChatRenderer(target.tokenizer, target.stop_token_ids, "all", args.chat_template_kwargs)
    found = evaluate.vocab_coverage(target, renderer, args.corpus, Benchmark.parse(args.benchmark),
                                    args.max_new_tokens, args.batch_size, args.seq_len,
                                    sorted(set(args.sizes)), compiled=args.compiled)
    machine = machine_description()
    print(f"{evaluate.vocab_coverage_markdown(found)}\n\nmaps from {args.corpus}'s training split "
          f"({found['loss_tokens']['train']:,} loss tokens); the target {args.target} "
          f"({target.dtype}) replied {args.max_new_tokens} tokens at most; {machine}")
    if args.output:
        record = {"target": args.target, "dtype": str(target.dtype).removeprefix("torch."),
                  "machine": machine, "command": "eagle3 " + " ".join(sys.argv[1:]), "commit": git_commit(),
                  "seconds": time.perf_counter() - start, **found}
        publish_coverage(record, Path(args.output))
    return 0


def _dataset_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a conversation file or folder (.json/.jsonl, optionally .gz), or sharegpt")
    p.add_argument("--target", required=True, help="whose chat template renders it: a local Hugging Face "
                   "folder or zoo:<name> (only its tokenizer is read)")
    p.add_argument("--seq-len", type=whole(2), default=2048, help="tokens per sample (longer ones are cut)")
    p.add_argument("--loss-turns", choices=["all", "last"], default="all",
                   help="every assistant turn in the loss, or only the last")
    p.add_argument("--chat-template-kwargs", type=template_switches, default={}, metavar="JSON",
                   help='the template\'s switches, e.g. \'{"enable_thinking": true}\'')
    p.add_argument("--turns", choices=["auto", "per-turn"], default="auto",
                   help="one sample a conversation where its template renders history as generated (auto), "
                        "or one per trained turn")
    p.add_argument("--split", choices=["train", "heldout", "all"], default="train",
                   help="the conversations 00 trains on (train, as a hash of each id decides), the held-out "
                        "ones, or all")
    p.add_argument("--heldout-fraction", type=fraction(0, 1, open_high=True), default=0.1)
    p.add_argument("--limit", type=whole(1), help="stop after this many samples")
    p.add_argument("--show", type=whole(0), metavar="I", help="print sample I decoded, its loss spans in «»")
    p.add_argument("--json", action="store_true", help="print one JSON object: read, skipped, samples "
                   "(id, input_ids, loss_mask) of the first --limit samples")


@command("dataset", "read a conversation dataset exactly as 00 would: what was read, skipped, cut and learnt",
         _dataset_arguments)
def _dataset(args: argparse.Namespace) -> int:
    import json

    from eagle3lib.data.conversations import ChatRenderer
    from eagle3lib.data.sources import dataset_report, marked_text
    from eagle3lib.generation.regenerate import TargetFacts

    target = TargetFacts.read(args.target)
    renderer = ChatRenderer(target.tokenizer, target.stop_token_ids, args.loss_turns,
                            args.chat_template_kwargs, args.turns)
    keep = args.json or args.show is not None
    limit = args.limit if args.show is None else max(args.limit or 0, args.show + 1)
    found = dataset_report(args.file, renderer, args.seq_len, args.heldout_fraction, args.split, limit, keep)
    if args.json:
        summary = found.as_dict()
        print(json.dumps({"read": summary["read"], "skipped": summary["skipped"],
                          "samples": summary["samples"][: args.limit]}))
        return 0
    stats = found.stats
    print(f"{args.file} with {args.target}'s chat template, split {args.split} "
          f"(held-out fraction {args.heldout_fraction}), seq_len {args.seq_len}, loss on {args.loss_turns} "
          "assistant turns")
    for note in stats.notes:
        print(f"  note: {note}")
    print(f"  conversations read: {stats.read:,}; kept {stats.kept:,}; of those held out: {found.heldout:,}")
    for title, counter in (("skipped", stats.skipped), ("turns dropped", stats.dropped_turns),
                           ("cut", found.cut)):
        reasons = ", ".join(f"{reason} {n:,}" for reason, n in counter.most_common())
        print(f"  {title}: {reasons or 'none'}")
    print(f"  samples: {found.samples_read:,}; tokens {found.tokens:,}, in the loss {found.loss_tokens:,} "
          f"({found.loss_tokens / max(found.tokens, 1):.1%})")
    if args.show is not None:
        if args.show >= len(found.samples):
            print(f"eagle3 dataset: error: no sample {args.show} (there are {len(found.samples)})",
                  file=sys.stderr)
            return 2
        sample = found.samples[args.show]
        print(f"\nsample {args.show} ({sample.doc_id}), loss spans in «»:\n")
        print(marked_text(target.tokenizer, sample))
    return 0


def _regenerate_arguments(p: argparse.ArgumentParser) -> None:
    from eagle3lib.generation.regenerate import ENGINES, RegenerationSettings

    defaults = RegenerationSettings()
    p.add_argument("file", help="a conversation file (.json/.jsonl, optionally .gz), sharegpt, or a zoo text "
                   "corpus (its documents become chat prompts, as for self-distillation)")
    p.add_argument("-o", "--output", required=True, help="the regenerated file: .jsonl or .jsonl.gz (a "
                   "manifest is written beside it; rerun the same command to continue an interrupted run)")
    p.add_argument("--target", required=True, help="a local Hugging Face folder or zoo:<name>")
    p.add_argument("--engine", choices=ENGINES, default=defaults.engine)
    p.add_argument("--url", default="", help="engine server: http://HOST:PORT of an SGLang or vLLM server")
    p.add_argument("--model", default="", help="engine server: the model name it serves (default: --target)")
    p.add_argument("--max-new-tokens", type=whole(1), default=defaults.max_new_tokens)
    p.add_argument("--temperature", type=fraction(0, 100), default=defaults.temperature, help="0 = greedy")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--batch-size", type=whole(1), default=defaults.batch_size)
    p.add_argument("--max-turns", type=whole(0), default=defaults.max_turns,
                   help="user turns answered; 0 = all")
    p.add_argument("--max-prompt-tokens", type=whole(1), default=defaults.max_prompt_tokens)
    p.add_argument("--dtype", default=defaults.dtype, help="builtin and vllm: auto | float32 | bfloat16")
    p.add_argument("--limit", type=whole(1), help="stop after this many conversations")
    p.add_argument("--skip", type=whole(0), default=0, help="leave out the first N conversations (another "
                   "run answers them: two machines, one dataset)")
    p.add_argument("--max-seconds", type=fraction(0, float("inf")), help="start no chunk after this many "
                   "seconds; the file is finished with what was written (a time-boxed machine)")
    p.add_argument("--chunk", type=whole(1), help="conversations regenerated and appended together (default: "
                   "4 x --batch-size): what an interruption can lose")
    p.add_argument("--split", choices=["train", "heldout", "all"], default="train",
                   help="which conversations: the training split (default), the held-out one, or all")
    p.add_argument("--heldout-fraction", type=fraction(0, 1, open_high=True), default=0.1)
    p.add_argument("--chat-template-kwargs", type=template_switches, default={}, metavar="JSON",
                   help='the thinking mode: the template\'s switches, e.g. \'{"enable_thinking": true}\'')
    p.add_argument("--reasoning", choices=["save", "drop", "inline"], default=defaults.reasoning,
                   help="a reply's reasoning: saved apart in reasoning_content, as a serving stack's "
                        "reasoning parser returns it (default), dropped, or left inline in the content")
    p.add_argument("--compiled", action="store_true", help="engine builtin: decode through one compiled "
                   "graph (a Llama-like target; about a minute to compile, then faster steps)")


@command("regenerate", "replace every assistant turn of a conversation dataset by the target's own reply",
         _regenerate_arguments)
def _regenerate(args: argparse.Namespace) -> int:
    import shlex
    from itertools import islice
    from pathlib import Path

    from eagle3lib import files
    from eagle3lib.data import corpora
    from eagle3lib.data.conversations import ChatRenderer, read_conversations
    from eagle3lib.generation import regenerate

    settings = regenerate.RegenerationSettings(
        engine=args.engine, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
        batch_size=args.batch_size, max_turns=args.max_turns, max_prompt_tokens=args.max_prompt_tokens,
        dtype=args.dtype, url=args.url, model=args.model, chat_template_kwargs=args.chat_template_kwargs,
        reasoning=args.reasoning, compiled=args.compiled)
    settings.check()
    if args.engine == "server":  # a GPU host's model: its tokenizer and config, not its weights, here
        target = regenerate.TargetFacts.read(args.target)
    else:  # loaded here for its fingerprint (vllm decodes with its own copy)
        from eagle3lib.target.model import Target

        target = Target.load(args.target, dtype=args.dtype if args.engine == "builtin" else "float32",
                             device="auto" if args.engine == "builtin" else "cpu")
    renderer = ChatRenderer(target.tokenizer, target.stop_token_ids,
                            template_kwargs=args.chat_template_kwargs)
    split = {"split": args.split, "heldout_fraction": args.heldout_fraction}
    if corpora.corpus_kind(args.file) == "documents":  # a zoo text corpus: its documents as chat prompts
        if args.split == "all":
            raise ValueError(f"{args.file}: a text corpus is regenerated by split (train or heldout)")
        source = corpora.corpus_description(args.file) | split
        conversations = corpora.split_conversations(args.file, args.split, args.heldout_fraction)
    else:
        path, truncated_ok = corpora.conversation_source(args.file)
        source = regenerate.source_description(path, args.file) | split
        if args.split == "all":
            conversations = read_conversations(path, allow_truncated=truncated_ok)
        else:
            conversations = corpora.split_conversations(args.file, args.split, args.heldout_fraction)
    if args.skip:
        source["skip"] = args.skip
        conversations = islice(conversations, args.skip, None)
    out = Path(args.output)
    files.make_folder(out.parent)
    command_line = "eagle3 regenerate " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    with regenerate.make_engine(settings, target, renderer, out.parent) as engine:
        manifest = regenerate.regenerate(conversations, out, engine, renderer, settings, source=source,
                                         target=target.describe(), limit=args.limit, chunk=args.chunk,
                                         max_seconds=args.max_seconds, command=command_line)
    counts = manifest["counts"]
    print(f"eagle3 regenerate: {out}: {counts['conversations']:,} conversations, {counts['replies']:,} "
          f"replies, {counts['reply_tokens']:,} reply tokens at {counts['reply_tokens_per_s']:.0f} tok/s; "
          f"skipped {counts['skipped'] or 'none'}; manifest {regenerate.manifest_path(out)}")
    return 0


def _check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("drafter", help="the drafter checkpoint folder to move")
    p.add_argument("--target", required=True, help="the new target: a Hugging Face folder or zoo:<name>")
    p.add_argument("--data", help="the new data: a data folder or run (its token counts and map), or a "
                   "conversation corpus (sharegpt, a file or folder: its loss tokens counted)")
    p.add_argument("--data-limit", type=whole(1), default=2000, help="conversations of --data read")
    p.add_argument("--engine", choices=["sglang", "vllm", "speculators", "specforge"], default="sglang",
                   help="the engine that will serve it: its numbering, its flags")
    p.add_argument("--chat-template-kwargs", type=template_switches, default={}, metavar="JSON",
                   help="the mode it will be served in, e.g. '{\"enable_thinking\": true}'")
    p.add_argument("--probe", type=whole(1), metavar="N", help="also measure its τ on N held-out prompts of "
                   "--data (or of sharegpt), as served as-is (builtin engine, chain K 3, 64 tokens)")
    p.add_argument("--json", action="store_true", help="the rows as JSON")


@command("check", "audit a drafter against a new target before a single step: shapes, aux layers, positions, "
         "flags, the vocab map against the new data, the thinking mode; non-zero exit on any FAIL",
         _check_arguments)
def _check(args: argparse.Namespace) -> int:
    import json

    from eagle3lib.drafter.config import read_config
    from eagle3lib.training import audit

    target = audit.TargetConfig.read(args.target)
    config = read_config(args.drafter)[0]
    data_map = counts = None
    if args.data:
        data_map, counts, read = audit.data_facts(args.data, args.target, config.draft_vocab_size,
                                                  target.vocab_size, args.data_limit)
        if not args.json:
            print(f"eagle3 check: the new data: {read}")
    rows = audit.audit(args.drafter, target, engine=args.engine, data_map=data_map, counts=counts,
                       serve_template_kwargs=args.chat_template_kwargs)
    if args.probe:
        rows.append(_probe_row(args))
    print(json.dumps(audit.as_json(rows), indent=1) if args.json else audit.report(rows))
    return 1 if audit.rows_of(rows)["FAIL"] else 0


def _probe_row(args: argparse.Namespace):
    from eagle3lib.data.corpora import corpus_kind
    from eagle3lib.decoding import engines
    from eagle3lib.decoding.evaluate import tau_text
    from eagle3lib.decoding.speculate import DraftSettings
    from eagle3lib.training.audit import Row

    corpus = args.data if args.data and corpus_kind(args.data) == "conversations" else "sharegpt"
    target, tokenizer = engines.open_target(args.target, "builtin", "float32", "auto")
    prompts = engines.probe_prompts(tokenizer, corpus, args.probe, 600, True,
                                    template_kwargs=args.chat_template_kwargs)
    result = engines.probe("builtin", target, args.drafter, prompts, DraftSettings(steps=3), 64)
    return Row("τ as served as-is", "PASS", f"{tau_text(result.metrics)} on {args.probe} held-out prompts of "
                                           f"{corpus} (chain K 3, 64 new tokens)")


def _accept_edit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a regenerated dataset file (its manifest beside it) or a published "
                   "drafter's folder or weights (its provenance.json)")


@command("accept-edit", "record the present SHA-256 of a shipped file edited on purpose, with the history "
         "of accepted edits", _accept_edit_arguments)
def _accept_edit(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from eagle3lib.data.conversations import manifest_path
    from eagle3lib.drafter.checkpoint import PROVENANCE
    from eagle3lib.files import accept_edit

    path = Path(args.path)
    folder = path if path.is_dir() else path.parent
    if path.is_file() and manifest_path(path).is_file():
        def put(record: dict, new: str) -> str:
            previous, record["sha256"], record["bytes"] = record.get("sha256"), new, path.stat().st_size
            return previous

        print(accept_edit(path, manifest_path(path), put))
        return 0
    record_file = folder / PROVENANCE
    if not record_file.is_file():
        raise ValueError(f"{path}: neither a manifest ({manifest_path(path).name}) nor a {PROVENANCE} "
                         "records a hash for it")
    names = [path.name] if path.is_file() else list(json.loads(record_file.read_text()).get("sha256", {}))
    for name in names:
        def put(record: dict, new: str, name=name) -> str:
            previous, record.setdefault("sha256", {})[name] = record.get("sha256", {}).get(name), new
            return previous

        print(accept_edit(folder / name, record_file, put))
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
    from eagle3lib.params import ParamsError
    from eagle3lib.runs import RunExistsError

    try:
        code = args.handler(args) or 0
        sys.stdout.flush()  # a reader gone (`eagle3 inspect ... | head`) shows here, not in Python's exit
        return code
    except BrokenPipeError:
        # nobody reads the rest: stop quietly, stdout on /dev/null so that the flush at exit fails no more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    # OSError: e.g. "writing PATH: ..."; DataError (conversations, regeneration) is a ValueError
    except (ParamsError, RunExistsError, OSError, ValueError) as err:
        print(f"eagle3 {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
