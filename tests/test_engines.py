"""Engine probes: pairs checked before any engine starts, vLLM's aux-id numbering, vLLM's counters, and the
SGLang client against a local HTTP server that answers as SGLang's /generate does.

The real vLLM run (minutes, a 3.4 GB venv) is `make vllm-check`, not part of this suite.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3lib.decoding import engines, evaluate
from eagle3lib.drafter.checkpoint import save_drafter
from eagle3lib.drafter.config import read_config
from eagle3lib.drafter.model import Eagle3Drafter
from eagle3lib.params import ParamsError
from tests.tiny import tiny_drafter_config


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny HF target folder: 4 layers, H 32, Vt 64."""
    folder = tmp_path_factory.mktemp("target")
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def save_tiny_drafter(folder, layout="sglang", vocab=64, hidden=32, aux=(0, 1, 3)):
    config = tiny_drafter_config(
        hidden_size=hidden, intermediate_size=64, vocab_size=vocab, draft_vocab_size=16,
        target_hidden_size=None, aux_layer_ids=list(aux) if aux is not None else None,
    )
    torch.manual_seed(0)
    return save_drafter(Eagle3Drafter(config), folder, layout, engines=("vLLM",))  # vLLM brings the embedding


def test_the_vllm_venv_is_looked_for_where_make_vllm_setup_makes_it():
    root = engines.VLLM_PYTHON.parents[2]
    assert "VLLM_VENV := .venv-vllm" in (root / "Makefile").read_text()
    assert engines.VLLM_PYTHON == root / ".venv-vllm" / "bin" / "python"


def test_mismatched_checkpoints_are_refused_before_the_engine_starts(target_dir, tmp_path):
    cases = {
        r"vocab_size \(Vt\): drafter .* has 80, target .* has 64": dict(vocab=80),
        "target_hidden_size: drafter .* expects 48, target .* hidden_size is 32": dict(hidden=48),
        r"aux_layer_ids \[1, 2, 5\] of drafter .*: \[5\] outside the 4 decoder layers": dict(aux=(1, 2, 5)),
    }
    no_venv = tmp_path / "no-venv" / "python"
    for i, (message, change) in enumerate(cases.items()):
        drafter = save_tiny_drafter(tmp_path / f"bad{i}", **change)
        with pytest.raises(ValueError, match=message):  # raised before looking for the vLLM venv
            engines.vllm_probe(target_dir, drafter, [[1, 2]], steps=3, max_new_tokens=4, python=no_venv)
    good = save_tiny_drafter(tmp_path / "good")
    with pytest.raises(FileNotFoundError, match="make vllm-setup"):
        engines.vllm_probe(target_dir, good, [[1, 2]], steps=3, max_new_tokens=4, python=no_venv)


def test_sglang_layout_aux_ids_are_served_to_vllm_in_its_numbering(tmp_path):
    sglang = save_tiny_drafter(tmp_path / "sglang", layout="sglang", aux=(0, 1, 3))
    config, layout, _ = read_config(sglang)
    served, notes = engines.vllm_ready_drafter(sglang, layout, config, tmp_path)
    raw = json.loads((served / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3"
    assert raw["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]  # vLLM: state entering layer i
    assert read_config(served)[0].aux_layer_ids == [0, 1, 3] and "does not read them" in notes[0]
    for folder, layout in ((save_tiny_drafter(tmp_path / "spec", layout="speculators"), "speculators"),
                           (save_tiny_drafter(tmp_path / "default", aux=None), "sglang")):
        config, _, _ = read_config(folder)
        assert engines.vllm_ready_drafter(folder, layout, config, tmp_path) == (folder, [])


def test_vllm_counters_give_tau_and_per_position_acceptance():
    metrics = engines.spec_metrics(
        {"num_drafts": 10, "num_accepted_tokens": 14, "num_accepted_tokens_per_pos": [7, 5, 2]}, steps=3
    )
    assert metrics["tau"] == 2.4
    assert metrics["acceptance_per_position"] == [0.7, 0.5, 0.2]
    with pytest.raises(RuntimeError, match="num_drafts is 0"):
        engines.spec_metrics(dict(num_drafts=0, num_accepted_tokens=0, num_accepted_tokens_per_pos=[]), 2)


class FakeSGLang(BaseHTTPRequestHandler):
    """Answers /generate the way SGLang does (meta_info with completion_tokens and spec_verify_ct)."""

    requests: list[dict] = []
    speculative = True

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeSGLang.requests.append({"path": self.path, **body})
        n = body["sampling_params"]["max_new_tokens"]
        meta = {"prompt_tokens": len(body["input_ids"]), "completion_tokens": n}
        if FakeSGLang.speculative:
            meta["spec_verify_ct"] = len(body["input_ids"])  # a number the test can predict
        answer = json.dumps({"text": "", "output_ids": list(range(n)), "meta_info": meta}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def sglang_server():
    FakeSGLang.requests, FakeSGLang.speculative = [], True
    server = HTTPServer(("127.0.0.1", 0), FakeSGLang)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_sglang_client_counts_tau_as_sglang_does(sglang_server):
    prompts = [[1, 2, 3, 4], [5, 6]]
    result = engines.sglang_probe(sglang_server + "/", prompts, max_new_tokens=12, temperature=0.0)
    assert result.metrics["tau"] == (12 + 12) / (4 + 2)  # Σ completion_tokens / Σ spec_verify_ct
    assert result.metrics["tokens"] == 24 and result.outputs == [list(range(12))] * 2
    first = FakeSGLang.requests[0]
    assert first["path"] == "/generate" and first["input_ids"] == [1, 2, 3, 4]
    assert first["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


def test_sglang_client_refuses_a_server_without_speculation(sglang_server):
    FakeSGLang.speculative = False
    with pytest.raises(RuntimeError, match="no spec_verify_ct .* without speculative decoding"):
        engines.sglang_probe(sglang_server, [[1, 2]], max_new_tokens=4)


def test_sglang_client_names_an_unreachable_server():
    with pytest.raises(ConnectionError, match="no SGLang server reachable"):
        engines.sglang_probe("http://127.0.0.1:9", [[1, 2]], max_new_tokens=4, timeout_s=5)


def test_drafter_entries_are_checked_by_place():
    found = engines.drafter_entries([{"name": "a", "path": "x/a"}, {"name": "b", "path": "/abs/b"}])
    assert list(found) == ["a", "b"] and str(found["b"]) == "/abs/b" and found["a"].is_absolute()
    first = {"name": "a", "path": "x"}
    bad = {
        r"evaluate.drafters\[1\] \('scratch'\): path is None": [first, {"name": "scratch", "path": None}],
        r"drafters\[1\]: name must be a non-empty string not used": [first, {"name": "a", "path": "y"}],
        r"evaluate.drafters\[0\]: expected a mapping": [{"name": "a"}],
        "evaluate.drafters is empty": [],
    }
    for message, entries in bad.items():
        with pytest.raises(ParamsError, match=message):
            engines.drafter_entries(entries)


def test_markdown_table_shows_what_each_backend_measured():
    table = evaluate.markdown_table({
        "builtin": {"tau": 2.5, "tau_low": 2.25, "tau_high": 2.75, "acceptance_per_position": [0.8, 0.5],
                    "tokens_per_s": 10.0, "speedup": 1.7},
        "sglang": {"tau": 3.0, "acceptance_per_position": None, "tokens_per_s": 50.0},
    })
    lines = table.splitlines()
    assert lines[0].startswith("| drafter | τ [95 % interval] | accept by position | tok/s")
    assert lines[2].startswith("| builtin | 2.50 [2.25, 2.75] | 0.80 / 0.50 | 10.0 | – | 1.70× |")
    assert lines[3].startswith("| sglang | 3.00 | – | 50.0 |")


def test_compiled_steps_reach_every_builtin_probe(monkeypatch, capsys, tmp_path):
    """`probe.compiled` runs 05's target steps through the compiled graph: the target's replies to earlier
    turns, the replayed benchmark's recorded baseline and the batch-1 sweep's verifications; `eagle3 probe
    --compiled` its verifications. In float32 τ and every output are the eager engine's. An engine that is not
    built in refuses it by its key."""
    from eagle3lib import cli
    from eagle3lib.params import load_params
    from tests.tiny import count_compiled_steps

    params = load_params("params/smoke.yaml", [
        "evaluate.benchmarks=[{name: mt, corpus: sharegpt, num_prompts: 1, turns: 2}]",
        "evaluate.sweep_steps=[3]", "evaluate.sweep_tree={steps: 0}", "probe.max_new_tokens=12",
    ])
    drafters = engines.drafter_entries(params["evaluate"]["drafters"][:1])
    target, tokenizer = engines.open_target("zoo:tiny-llama", "builtin", "float32", "cpu")
    eager = evaluate.evaluate_drafters(params, drafters, target, tokenizer, tmp_path, log=lambda line: None)
    steps = count_compiled_steps(monkeypatch)
    assert not steps
    params["probe"]["compiled"] = True
    ours = evaluate.evaluate_drafters(params, drafters, target, tokenizer, tmp_path, log=lambda line: None)
    assert ours.outputs == eager.outputs and ours.metrics["mt"] == eager.metrics["mt"]
    assert [m["tau"] for m in ours.sweeps["fixture A (SGLang layout)"].values()] == [
        m["tau"] for m in eager.sweeps["fixture A (SGLang layout)"].values()]
    assert {columns for _, columns in steps} == {1, 4}  # one-token steps, the sweep's verifications of K 3

    del steps[:]
    monkeypatch.setattr(engines, "open_target", lambda *args: (target, tokenizer))  # compiled once a model
    probe = ["probe", str(next(iter(drafters.values()))), "--target", "zoo:tiny-llama", "--corpus",
             "stdlib-code", "--num-prompts", "2", "--max-new-tokens", "10", "--batch-size", "1", "--json"]
    assert cli.main(probe) == 0 and not steps
    assert cli.main([*probe, "--compiled"]) == 0 and steps
    eager_line, compiled_line = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert eager_line.pop("speedup") > 0 and compiled_line.pop("speedup") > 0  # timed: not comparable
    assert compiled_line == eager_line and compiled_line["matches_target"] == 1.0

    params["probe"]["backend"] = "vllm"
    with pytest.raises(ValueError, match="probe.compiled is the builtin engine's"):
        engines.check_probe_settings(params, drafter=False)
