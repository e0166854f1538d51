"""τ along training: every arm measured on validation prompts disjoint from 05's, drafter/ chosen by that τ,
early stopping, the source drafter as-is beside them, L2-SP, and what the curves say in training tokens."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from eagle3lib import files
from eagle3lib.data import benchmarks
from eagle3lib.data.layout import DataError
from eagle3lib.decoding import curves, evaluate
from eagle3lib.drafter.checkpoint import CheckpointError, load_drafter
from eagle3lib.reports import publish
from eagle3lib.training import train
from eagle3lib.training.trainer import TrainingError
from tests.test_online import recipe

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SOURCE = "tests/fixtures/speculate/tiny_llama_drafter"
BENCHMARKS = [{"name": "code", "corpus": "stdlib-code", "num_prompts": 3},
              {"name": "prose", "corpus": "pydoc-prose", "num_prompts": 3}]


def curve_recipe(**train_overrides):
    settings = dict(drafter=SOURCE, arms=["scratch", "drafter", "drafter-l2sp"], l2sp=1e-3, steps=8,
                    validation_prompts=2, validation_new_tokens=8, curve_points=3, check_enforce=False)
    params = recipe("online", **(settings | train_overrides))
    params["evaluate"]["benchmarks"] = BENCHMARKS
    params["probe"].update(batch_size=2, steps=2, num_draft_tokens=3)
    return params


@pytest.fixture(scope="module")
def curve_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("curves") / "04_finetune"
    return out, train.train_arms(curve_recipe(), out)


@pytest.mark.parametrize("corpus", ["humaneval", "stdlib-code", "pydoc-prose", "sharegpt"])
def test_the_validation_draw_shares_no_prompt_with_the_test_draw(corpus):
    test = benchmarks.questions(corpus, 24, draw="test")
    validation = benchmarks.questions(corpus, 16, draw="validation")
    assert len(test) == 24 and len(validation) == 16
    assert not {q.id for q in test} & {q.id for q in validation}
    assert not {q.turns for q in test} & {q.turns for q in validation}
    benchmarks.check_disjoint_draws(corpus, 24, 16)


def test_draws_that_would_overlap_are_refused():
    with pytest.raises(DataError, match="would share"):
        benchmarks.check_disjoint_draws("humaneval", 100, 80)
    params = curve_recipe(validation_prompts=100)
    params["evaluate"]["benchmarks"] = [{"name": "he", "corpus": "humaneval", "num_prompts": 100}]
    with pytest.raises(DataError, match="humaneval"):
        train.train_arms(params, "/nonexistent/never-written")


def test_curve_steps_start_at_zero_and_double_up_to_the_last():
    assert curves.curve_steps(64, 6) == [0, 2, 4, 8, 16, 32, 64]
    assert curves.curve_steps(8, 3) == [0, 2, 4, 8]
    assert curves.curve_steps(3, 6) == [0, 1, 2, 3]


def test_every_arm_is_measured_along_training_and_its_drafter_is_the_chosen_point(curve_run):
    out, results = curve_run
    source = json.loads((out / curves.VALIDATION_FILE).read_text())["source"]
    assert set(source["benchmarks"]) == {"code", "prose"}
    for arm, result in results.items():
        points = curves.read_points(out / arm)
        assert [p["step"] for p in points] == [0, 2, 4, 8], arm
        assert [p["tokens"] for p in points] == sorted(p["tokens"] for p in points)
        assert points[0]["tokens"] == 0
        assert all(set(p["benchmarks"]) == {"code", "prose"} for p in points)
        chosen = curves.chosen_point(points, "first")
        assert result.chosen["step"] == chosen["step"] and result.chosen["rule"] == "first"
        # drafter/ holds the chosen point's weights, drafter-last/ the final ones
        kept = load_drafter(out / arm / "drafter", strict=True)[0].state_dict()
        point = load_drafter(out / arm / "points" / f"step_{chosen['step']:06d}", strict=True)[0].state_dict()
        assert all(torch.equal(kept[k], point[k]) for k in kept)
        assert (out / arm / "drafter-last").is_dir()
        # only the chosen and the latest points keep their folders
        kept_points = {p.name for p in (out / arm / "points").iterdir()}
        assert kept_points == {f"step_{chosen['step']:06d}", "step_000008"}
    # a warm start's first point is the remapped drafter, measured before any step
    assert results["drafter"].chosen is not None
    lines = curves.findings({arm: curves.read_points(out / arm) for arm in results}, source["benchmarks"])
    assert any("scratch needed" in line for line in lines)
    assert any("above the source drafter as-is" in line for line in lines)
    old_domain = [line for line in lines if "prose (the old domain)" in line]
    assert len(old_domain) == 2 and all("against the source drafter as-is" in line for line in old_domain)


def test_l2sp_pulls_towards_the_warm_start_and_only_its_arm_has_it(curve_run):
    out, results = curve_run
    penalized = [m for m in results["drafter-l2sp"].metrics if "l2sp_penalty" in m]
    assert penalized and all(m["l2sp_penalty"] > 0 for m in penalized)
    assert not any("l2sp_penalty" in m for m in results["drafter"].metrics)


def test_early_stop_ends_an_arm_after_measurements_without_gain(tmp_path):
    params = curve_recipe(arms=["scratch"], steps=32, curve_points=6, early_stop=1, select_by="first")
    out = tmp_path / "04_finetune"
    result = train.train_arms(params, out)["scratch"]
    points = curves.read_points(out / "scratch")
    waited = curves.measurements_without_gain(points, "first")
    assert result.steps == points[-1]["step"]
    assert result.steps == 32 or waited == 1


def test_resume_drops_the_points_measured_after_the_checkpoint(tmp_path, curve_run):
    out, _ = curve_run
    copy = tmp_path / "04_finetune"
    shutil.copytree(out, copy)
    arm = copy / "scratch"
    (arm / "summary.json").unlink()
    cut = curves.read_points(arm)
    recorder = train.CurveRecorder(arm, None, None, curve_recipe()["train"], train.Processes(), print)
    recorder.restore(4)
    assert [p["step"] for p in curves.read_points(arm)] == [p["step"] for p in cut if p["step"] <= 4]
    assert all(int(p.name.removeprefix("step_")) <= 4 for p in (arm / "points").iterdir())


def test_a_bad_select_rule_or_l2sp_is_refused():
    with pytest.raises(TrainingError, match="select_by"):
        train.check_settings(curve_recipe(select_by="best")["train"])
    with pytest.raises(TrainingError, match="l2sp"):
        train.check_settings(curve_recipe(l2sp=0.0)["train"])


def test_a_published_record_keeps_the_curves_and_refuses_an_edit(tmp_path, curve_run):
    out, _ = curve_run
    run = tmp_path / "run"
    shutil.copytree(out, run / "04_finetune")
    (run / "params.yaml").write_text(yaml.safe_dump(curve_recipe()))
    provenance = {"notebooks": ["04_finetune"], "git commit": "abc1234", "machine": "a test machine"}
    (run / "metrics.json").write_text(json.dumps({"provenance": [provenance]}))
    folder = publish.publish_curves(run, tmp_path / "records" / "curve", command="eagle3 run test")
    record = publish.read_record(folder)
    assert record["commit"] == "abc1234" and record["machine"] == "a test machine"
    arms = ("drafter", "drafter-l2sp", "scratch")
    assert record["arms"] == {arm: curves.read_points(out / arm) for arm in arms}
    assert record["findings"] == curves.findings(record["arms"], record["source"])
    assert (folder / publish.CURVES_FIGURE).stat().st_size > 0
    assert record["stopped"] == {} and all(record["last_leg_seconds"].values())
    # a drafter published from the run carries its validation curve as its learning curve, with the figure
    drafter = publish.publish(run, "scratch", tmp_path / "drafter", command="eagle3 run test")
    validation = publish.verify(drafter)["validation_curve"]
    assert validation["budget"] == json.loads((out / curves.VALIDATION_FILE).read_text())["budget"]
    assert [(p["step"], p["tokens"]) for p in validation["points"]] == [
        (p["step"], p["tokens"]) for p in record["arms"]["scratch"]]
    assert [p["benchmarks"]["code"]["tau"] for p in validation["points"]] == [
        p["benchmarks"]["code"]["tau"] for p in record["arms"]["scratch"]]
    assert (drafter / publish.VALIDATION_FIGURE).stat().st_size > 0
    with pytest.raises(FileExistsError):
        publish.publish_curves(run, folder, command="again")
    # an arm stopped mid-run (no summary.json): its measured points published, where its log stopped said
    (run / "04_finetune" / "scratch" / "summary.json").unlink()
    cut = publish.read_record(publish.publish_curves(run, tmp_path / "records" / "cut", command="cut"))
    last = files.read_json_lines(out / "scratch" / "metrics.jsonl")[-1]["step"]
    assert cut["stopped"] == {"scratch": last} and cut["last_leg_seconds"]["scratch"] is None
    assert cut["arms"]["scratch"] == record["arms"]["scratch"]
    edited = json.loads((folder / publish.CURVES).read_text()) | {"commit": "edited"}
    (folder / publish.CURVES).write_text(json.dumps(edited))
    with pytest.raises(CheckpointError, match=publish.CURVES):
        publish.read_record(folder)


def test_a_cost_comparison_charges_regenerated_data_what_making_it_took(tmp_path, curve_run):
    """Two records of the same arms, one trained on regenerated conversations (manifests beside them give
    the seconds regeneration took), one on a named corpus that costs nothing to make: each point's core-hours
    are its tokens at the arm's training cost, plus the regenerated tokens at their making's cost, charged up
    to the data's size."""
    out, _ = curve_run
    regenerated = tmp_path / "conversations"
    regenerated.mkdir()
    for name, seconds, tokens in (("part-00", 30.0, 1000), ("part-01", 10.0, 600)):
        (regenerated / f"{name}.jsonl.gz").write_bytes(b"")
        manifest = {"counts": {"seconds": seconds, "template_tokens": tokens}}
        (regenerated / f"{name}.manifest.json").write_text(json.dumps(manifest))
    records = {}
    arms = [("regenerated", str(regenerated), "a test CPU"), ("original", "stdlib-code", "a test CPU"),
            ("elsewhere", "stdlib-code", "another CPU")]  # the last: its core-hours are not theirs
    for label, corpus, cpu in arms:
        run = tmp_path / label
        shutil.copytree(out, run / "04_finetune")
        recipe = curve_recipe()
        recipe["data"]["corpus"] = corpus
        (run / "params.yaml").write_text(yaml.safe_dump(recipe))
        provenance = {"notebooks": ["04_finetune"], "git commit": "abc1234",
                      "machine": f"{cpu}, 3 threads"}
        (run / "metrics.json").write_text(json.dumps({"provenance": [provenance]}))
        records[label] = publish.publish_curves(run, tmp_path / "records" / label, command="eagle3 run test")
    elsewhere = records.pop("elsewhere")
    mixed = {"regenerated": records["regenerated"], "elsewhere": elsewhere, "original": records["original"]}
    named = (r"not comparable: .*regenerated .* trained on a test CPU; "
             r".*elsewhere .* trained on another CPU; "
             r".*original .* trained on a test CPU")  # every record, not only those read before the odd one
    with pytest.raises(publish.PublishError, match=named):
        publish.publish_cost_comparison(mixed, tmp_path / "records" / "mixed", command="test",
                                        regeneration_cores=2)
    assert not (tmp_path / "records" / "mixed").exists()
    folder = publish.publish_cost_comparison(records, tmp_path / "records" / "costs", command="test",
                                             regeneration_cores=2)
    publish.check_published(folder)
    arms = json.loads((folder / publish.COMPARISON).read_text())["arms"]
    record = publish.read_record(records["regenerated"])
    seconds = publish.training_seconds(out / "scratch")
    assert record["training_seconds"]["scratch"] == seconds
    points = record["arms"]["scratch"]
    train_cost = seconds * 3 / points[-1]["tokens"]
    for label, data_cost in (("regenerated", 2 * 40.0 / 1600), ("original", 0.0)):
        arm = arms[f"{label} scratch"]
        assert arm["train_core_seconds_per_token"] == train_cost
        assert arm["data_core_seconds_per_token"] == data_cost
        cap = 1600 if data_cost else 0
        assert [p["core_hours"] for p in arm["points"]] == [
            (p["tokens"] * train_cost + min(p["tokens"], cap) * data_cost) / 3600 for p in points]
    assert points[-1]["tokens"] > 1600  # the cap was met: a second pass costs no more regeneration
    assert (folder / publish.COMPARISON_FIGURE).stat().st_size > 0
    paired = json.loads((folder / publish.COMPARISON).read_text())["paired"]  # the same arms: no difference
    assert paired and all("not distinguishable" in line and "+0.00" in line for line in paired)


def test_a_run_measured_nowhere_along_training_has_no_record(tmp_path):
    (tmp_path / "04_finetune" / "scratch").mkdir(parents=True)
    with pytest.raises(publish.PublishError, match="validation_prompts"):
        publish.publish_curves(tmp_path, tmp_path / "record", command="x")


def test_a_multi_turn_draw_asks_a_held_out_conversations_first_user_turns_in_order():
    one, two = (benchmarks.questions("sharegpt", 4, turns=turns) for turns in (1, 2))
    assert all(len(q.turns) == 1 for q in one) and all(len(q.turns) == 2 for q in two)
    held = {c.id: c for c in benchmarks.split_conversations("sharegpt", "heldout", 0.1)}
    assert all(list(q.turns) == held[q.id].user_turns()[:2] for q in two)
    parsed = benchmarks.Benchmark.parse("sharegpt:32:2")
    assert parsed == benchmarks.Benchmark("sharegpt (2 turns)", "sharegpt", 32, 2)
    assert benchmarks.Benchmark.parse("humaneval:8") == benchmarks.Benchmark("humaneval", "humaneval", 8)
    for corpus in ("humaneval", "stdlib-code"):
        with pytest.raises(DataError, match="more than 1 takes a conversation corpus"):
            benchmarks.questions(corpus, 4, turns=2)
    with pytest.raises(DataError, match="expected CORPUS:N or CORPUS:N:TURNS"):
        benchmarks.Benchmark.parse("sharegpt")


def test_eagle3_coverage_measures_the_map_of_each_size_on_held_out_replies(tmp_path, capsys):
    from eagle3lib import cli
    from eagle3lib.data.conversations import ChatRenderer
    from eagle3lib.data.sources import dataset_report
    from eagle3lib.drafter.vocab import VocabMap
    from eagle3lib.files import file_sha256
    from eagle3lib.target.model import Target
    from tests.test_conversations import conversation_file

    corpus, out = conversation_file(tmp_path, n=40), tmp_path / "coverage"
    args = ["coverage", str(corpus), "--target", "zoo:tiny-llama", "--benchmark", "sharegpt:3", "--sizes",
            "64,8", "--max-new-tokens", "6", "--batch-size", "2", "--seq-len", "64"]
    assert cli.main([*args, "-o", str(out)]) == 0
    record = json.loads((out / "coverage.json").read_text())
    replies, heldout, train = record["rows"][0]["coverage"]
    assert replies.startswith("the target's replies (sharegpt, 3 prompts)") and "in sample" in train
    target = Target.load("zoo:tiny-llama", dtype=torch.float32)
    renderer = ChatRenderer(target.tokenizer, target.stop_token_ids)
    found = {split: dataset_report(str(corpus), renderer, 64, 0.1, split) for split in ("train", "heldout")}
    counts = {split: f.loss_token_counts(target.vocab_size) for split, f in found.items()}
    assert record["conversations"]["kept"] == found["train"].stats.kept == 40
    assert record["samples"] == {split: f.samples_read for split, f in found.items()}
    assert found["heldout"].samples and record["loss_tokens"]["train"] == found["train"].loss_tokens
    for row, vd in zip(record["rows"], (8, 64), strict=True):  # sorted
        vocab_map = VocabMap.from_counts(counts["train"], vd)
        assert row["vd"] == vd and row["coverage"][train] == vocab_map.coverage(counts["train"])
        assert row["coverage"][heldout] == vocab_map.coverage(counts["heldout"])
    assert record["counted_tokens"][replies] <= 3 * 6 and record["counted_tokens"][heldout] > 0
    for points in record["curves"].values():
        shares = [share for _, share in points]
        assert shares == sorted(shares) and shares[-1] == 1.0  # the whole vocabulary holds every token
    sha = json.loads((out / "provenance.json").read_text())["sha256"]
    assert sha == {name: file_sha256(out / name) for name in ("coverage.json", "coverage.png")}
    assert "| 8 |" in capsys.readouterr().out
    assert cli.main(["coverage", "stdlib-code", "--target", "zoo:tiny-llama"]) == 2
    assert "'stdlib-code' is a document corpus" in capsys.readouterr().err


def test_a_tau_table_measures_every_benchmark_at_every_setting_with_its_interval(tmp_path):
    from eagle3lib import cli

    out = tmp_path / "table.json"
    assert cli.main(["table", SOURCE, "--target", "zoo:tiny-llama", "--benchmark", "humaneval:2",
                     "--benchmark", "sharegpt:2:2", "--setting", "3/1/4", "--setting", "2/2/4",
                     "--max-new-tokens", "8", "--batch-size", "2", "-o", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [(r["benchmark"], r["setting"], r["prompts"]) for r in record["rows"]] == [
        ("humaneval", "3/1/4", 2), ("humaneval", "2/2/4", 2),
        ("sharegpt (2 turns)", "3/1/4", 4), ("sharegpt (2 turns)", "2/2/4", 4)]  # both turns of each
    for row in record["rows"]:
        assert row["tau_low"] <= row["tau"] <= row["tau_high"] and len(row["acceptance_per_position"]) == int(
            row["setting"][0])
    assert "vLLM num_speculative_tokens 3" in record["rows"][0]["engines"]
    coverage = {(row["benchmark"], row["vd_coverage"]) for row in record["rows"]}  # one per benchmark
    assert len(coverage) == 2 and all(0 <= share <= 1 for _, share in coverage)
    assert "a tree" in record["rows"][1]["engines"] and record["machine"] and record["commit"]
    with pytest.raises(ValueError, match="expected STEPS/TOPK/NUM_DRAFT_TOKENS"):
        evaluate.parse_setting("3")
