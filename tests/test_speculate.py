"""Speculative decoding: lossless greedy decoding, distribution-preserving sampling, τ as engines count it.

The rigged pair. A "successor" target whose next token is a fixed function f of the current token: its
decoder layers add nothing (o_proj and down_proj zero), embeddings are one-hot, and lm_head row j is
the sum of e_x over the x with f(x) = j. The drafter is given weights by hand that compute the same f
one step ahead: fc copies the first aux state (the one-hot of token t), attention adds nothing, the MLP
maps one-hot(x) to one-hot(f(x)) (one SiLU unit per token), and lm_head scores draft token j by
f(y) = its target id. It runs the real drafter code (fc on step 0, its own layer_out afterwards, KV
cache, d2t mapping of a draft vocab that is a strict subset of the target's), so τ = K + 1 tests the
whole drafting path, not a patched-in oracle. Random weights in the target's layers (`noise`) make it
deviate from f now and then: acceptance becomes mixed, which exercises rejections at every depth.

Tiny models run single-threaded here: with two threads on two busy cores, thread hand-offs cost more
than these matrices.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer

from eagle3lib.decoding import batches, probe, speculate
from eagle3lib.decoding.speculate import DraftSettings, DraftTree, SpeculativeDecoder
from eagle3lib.drafter.checkpoint import load_drafter, save_drafter
from eagle3lib.drafter.config import DrafterConfig
from eagle3lib.drafter.model import Eagle3Drafter
from eagle3lib.target import zoo
from eagle3lib.target.model import Target
from tests.tiny import count_compiled_steps

V = 32  # target vocab = hidden size (one-hot embeddings)
AUX = [0, 1, 3]
SMOKE_DRAFTER = Path(__file__).parent / "fixtures" / "speculate" / "tiny_llama_drafter"


def successor(vocab: int = V, seed: int = 0) -> tuple[list[int], list[int]]:
    """f as a list, and the draft vocab S (odd ids): f cycles through S; ids outside S jump into it."""
    draft_ids = list(range(1, vocab, 2))
    order = torch.randperm(len(draft_ids), generator=torch.Generator().manual_seed(seed)).tolist()
    cycle = [draft_ids[i] for i in order]
    f = [cycle[x % len(cycle)] for x in range(vocab)]
    for i, x in enumerate(cycle):
        f[x] = cycle[(i + 1) % len(cycle)]
    return f, draft_ids


def successor_target(f: list[int], noise: float = 0.0, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=V, hidden_size=V, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, rms_norm_eps=1e-6,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(V))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.normal_(0.0, noise)  # noise 0: the layer adds exactly nothing
            layer.mlp.down_proj.weight.normal_(0.0, noise)
        head = torch.zeros(V, V)
        head[f, torch.arange(V)] = 1.0
        model.lm_head.weight.copy_(head)
    return model


def drafter_config(vocab: int = V, hidden: int = V, draft_vocab: int = V // 2, aux=AUX) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=V,
        vocab_size=vocab, draft_vocab_size=draft_vocab, rms_norm_eps=1e-6, target_hidden_size=hidden,
        aux_layer_ids=list(aux),
    )


def set_vocab_map(drafter: Eagle3Drafter, draft_ids: list[int]) -> None:
    ids = torch.tensor(draft_ids)
    drafter.d2t.copy_(ids - torch.arange(len(ids)))
    drafter.t2d.zero_()
    drafter.t2d[ids] = True


def successor_drafter(f: list[int], draft_ids: list[int]) -> Eagle3Drafter:
    torch.manual_seed(1)
    drafter = Eagle3Drafter(drafter_config()).eval()
    set_vocab_map(drafter, draft_ids)
    eye = torch.eye(V)
    gate_scale = 4.0
    # post_attention_layernorm(one-hot) = sqrt(V) * one-hot; unit x fires silu(g*sqrt(V)) * sqrt(V)
    unit = torch.nn.functional.silu(torch.tensor(gate_scale * math.sqrt(V))) * math.sqrt(V)
    with torch.no_grad():
        drafter.fc.weight.copy_(torch.cat([eye, torch.zeros(V, 2 * V)], dim=1))
        drafter.midlayer.self_attn.o_proj.weight.zero_()
        drafter.midlayer.mlp.gate_proj.weight.copy_(gate_scale * eye)
        drafter.midlayer.mlp.up_proj.weight.copy_(eye)
        drafter.midlayer.mlp.down_proj.weight.copy_((eye[:, f] - eye) / unit)
        head = torch.zeros(len(draft_ids), V)
        for j, target_id in enumerate(draft_ids):
            head[j, [y for y in range(V) if f[y] == target_id]] = 1.0
        drafter.lm_head.weight.copy_(head)
    return drafter


def random_pair(vocab: int, draft_vocab: int, seed: int = 0, head_scale: float = 1.0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    drafter = Eagle3Drafter(drafter_config(vocab=vocab, hidden=32, draft_vocab=draft_vocab)).eval()
    draft_ids = torch.randperm(vocab)[:draft_vocab].sort().values.tolist()
    set_vocab_map(drafter, draft_ids)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(head_scale)
    return model, drafter


pytestmark = pytest.mark.usefixtures("one_torch_thread")


PROMPT = [3, 8, 0, 5, 22]
SETTINGS = {
    "chain-3": DraftSettings(steps=3),
    "chain-5": DraftSettings(steps=5),
    "tree-4x3-8": DraftSettings(steps=4, topk=3, num_draft_tokens=8),
    "tree-3x2": DraftSettings(steps=3, topk=2),
}


# ---------------------------------------------------------------- greedy: lossless


@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_speculation_reproduces_target_decoding(name):
    settings = SETTINGS[name]
    f, draft_ids = successor()
    model = successor_target(f, noise=0.3)
    decoder = SpeculativeDecoder(model, successor_drafter(f, draft_ids), settings)
    accepted = []
    for prompt in (PROMPT, [30, 1, 2], [7] * 9):
        expected = speculate.generate_target_only(model, prompt, 40).tokens
        out = decoder.generate(prompt, 40)
        assert out.tokens == expected
        accepted += out.accepted
    # the pair agrees often but not always: both full acceptance and rejections were exercised
    assert 0 in accepted and settings.steps in accepted and len(set(accepted)) >= 3


@pytest.mark.parametrize("name", ["chain-3", "tree-4x3-8"])
def test_greedy_speculation_random_pair(name):
    model, drafter = random_pair(vocab=64, draft_vocab=24)
    decoder = SpeculativeDecoder(model, drafter, SETTINGS[name])
    for prompt in ([1, 2, 3], [60, 7, 7, 41, 9, 0]):
        assert decoder.generate(prompt, 40).tokens == speculate.generate_target_only(model, prompt, 40).tokens


PROMPTS = [PROMPT, [30, 1, 2], [7] * 9, [4]]  # different lengths: left padding in a batch


@pytest.mark.parametrize("name", list(SETTINGS))
def test_batched_greedy_equals_target_and_single_sequence_runs(name):
    """Every prompt of a batch decodes to the target's own greedy output, accepting exactly the drafts it
    accepts alone, while the batch's sequences accept different numbers per round and finish apart."""
    settings = SETTINGS[name]
    f, draft_ids = successor()
    model = successor_target(f, noise=0.3)
    decoder = SpeculativeDecoder(model, successor_drafter(f, draft_ids), settings)
    batch = decoder.generate_batch(PROMPTS, 40)
    for prompt, out in zip(PROMPTS, batch.generations, strict=True):
        assert out.tokens == speculate.generate_target_only(model, prompt, 40).tokens
        assert out.accepted == decoder.generate(prompt, 40).accepted
    assert len({tuple(g.accepted[:3]) for g in batch.generations}) > 1  # ragged rounds were exercised
    # an eos token: the sequences that meet it leave the batch early, the others go on unchanged
    eos = batch.generations[2].tokens[24]
    early = decoder.generate_batch(PROMPTS, 40, eos_token_id=eos)
    assert min(len(g.tokens) for g in early.generations) < 40
    for prompt, out in zip(PROMPTS, early.generations, strict=True):
        assert out.tokens == speculate.generate_target_only(model, prompt, 40, eos_token_id=eos).tokens


def test_compiled_verification_reproduces_target_decoding(monkeypatch):
    """Speculation whose verifications run through the compiled graph (`SpeculativeDecoder(compiled=True)`),
    chains and trees, decodes every prompt of a batch to the target's own greedy output accepting what eager
    verification accepts, sequences leaving at an end token mid-batch, every verification compiled."""
    f, draft_ids = successor()
    model = successor_target(f, noise=0.3)
    drafter = successor_drafter(f, draft_ids)
    compiled_steps = count_compiled_steps(monkeypatch)
    eos = speculate.generate_target_only(model, PROMPTS[2], 40).tokens[24]
    for name in ("chain-3", "tree-4x3-8"):
        eager = SpeculativeDecoder(model, drafter, SETTINGS[name]).generate_batch(PROMPTS, 40, eos)
        assert compiled_steps == []
        decoder = SpeculativeDecoder(model, drafter, SETTINGS[name], compiled=True)
        ours = decoder.generate_batch(PROMPTS, 40, eos)
        assert len(compiled_steps) == ours.rounds == eager.rounds
        assert min(len(g.tokens) for g in ours.generations) < 40  # some left the batch early
        for prompt, theirs, mine in zip(PROMPTS, eager.generations, ours.generations, strict=True):
            alone = speculate.generate_target_only(model, prompt, 40, eos_token_id=eos)
            assert mine.tokens == theirs.tokens == alone.tokens
            assert mine.accepted == theirs.accepted
        compiled_steps.clear()


@pytest.mark.parametrize("name", ["chain-3", "tree-4x3-8"])
def test_batched_random_pair_and_hf_generate(name):
    """Against Hugging Face's own greedy `generate` (one prompt at a time, no padding), for both decoders."""
    model, drafter = random_pair(vocab=64, draft_vocab=24)
    decoder = SpeculativeDecoder(model, drafter, SETTINGS[name])
    prompts = [[1, 2, 3], [60, 7, 7, 41, 9, 0], [5]]
    spec = decoder.generate_batch(prompts, 30).generations
    plain = speculate.decode_target_only(model, prompts, 30).generations
    for prompt, s, t in zip(prompts, spec, plain, strict=True):
        with torch.no_grad():
            ids = torch.tensor([prompt])  # an explicit mask: token 0 in a prompt is no padding
            hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                                pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
        assert s.tokens == t.tokens == hf


# ---------------------------------------------------------------- replay: verification from a recording


def _replayed(decoder, model, prompts, max_new_tokens, eos=None):
    record = (decoder.aux_layer_ids, decoder.settings.steps)
    recorded = speculate.decode_target_only(model, prompts, max_new_tokens, eos_token_id=eos, record=record)
    return decoder.generate_batch(prompts, max_new_tokens, eos, recordings=recorded.recordings)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_replay_accepts_exactly_what_verification_accepts(name):
    """Against the target's recorded greedy decoding, every sequence of a batch accepts the drafts the
    target's verification accepts, round by round, and ends with the same tokens; with an end token that
    finishes some sequences mid-batch too."""
    f, draft_ids = successor()
    model = successor_target(f, noise=0.3)
    decoder = SpeculativeDecoder(model, successor_drafter(f, draft_ids), SETTINGS[name])
    for eos in (None, decoder.generate_batch(PROMPTS, 40).generations[2].tokens[24]):
        real = decoder.generate_batch(PROMPTS, 40, eos).generations
        replayed = _replayed(decoder, model, PROMPTS, 40, eos).generations
        assert [g.accepted for g in replayed] == [g.accepted for g in real]
        assert [g.tokens for g in replayed] == [g.tokens for g in real]
        accepted = [a for g in real for a in g.accepted]
        assert 0 in accepted and SETTINGS[name].steps in accepted  # rejections and full acceptance alike


@pytest.mark.parametrize("name", ["chain-3", "tree-4x3-8"])
def test_replay_of_a_random_pair_in_float64(name):
    model, drafter = random_pair(vocab=64, draft_vocab=24, head_scale=30.0)
    model, drafter = model.double(), drafter.double()
    decoder = SpeculativeDecoder(model, drafter, SETTINGS[name])
    prompts = [[1, 2, 3], [60, 7, 7, 41, 9, 0], [5]]
    real = decoder.generate_batch(prompts, 30).generations
    replayed = _replayed(decoder, model, prompts, 30).generations
    assert [g.accepted for g in replayed] == [g.accepted for g in real]


def test_probe_replays_each_depth_from_one_recording_and_times_nothing():
    f, draft_ids = successor()
    model = successor_target(f, noise=0.3)
    drafter = successor_drafter(f, draft_ids)
    baseline = None
    for name in ("chain-3", "chain-5", "tree-3x2"):  # chain-5 needs a deeper overrun: recorded again
        settings = SETTINGS[name]
        real = probe.probe(model, drafter, PROMPTS, settings, 40, batch_size=3, warmup=False)
        replayed = probe.probe(model, drafter, PROMPTS, settings, 40, batch_size=3, baseline=baseline,
                               replay=True)
        baseline = replayed.baseline
        assert all(r.overrun >= settings.steps for out in baseline for r in out.recordings)
        assert replayed.metrics["accepted_per_prompt"] == real.metrics["accepted_per_prompt"]
        assert replayed.metrics["tau"] == real.metrics["tau"] and replayed.metrics["replayed"]
        assert "speedup" not in replayed.metrics and "matches_target" not in replayed.metrics
        assert [g.tokens for g in replayed.spec] == [g.tokens for g in real.target]
    # a real probe does not time itself against a recording (decoded past each end)
    again = probe.probe(model, drafter, PROMPTS, SETTINGS["chain-3"], 40, batch_size=3, baseline=baseline)
    assert again.baseline is not baseline and again.baseline[0].recordings is None


def test_replay_refuses_sampling_and_drafts_beyond_the_recording():
    f, draft_ids = successor()
    model = successor_target(f, noise=0.3)
    decoder = SpeculativeDecoder(model, successor_drafter(f, draft_ids), SETTINGS["chain-5"])
    short = speculate.decode_target_only(model, PROMPTS, 40, record=(decoder.aux_layer_ids, 2))
    with pytest.raises(RuntimeError, match="overrun of at least the draft depth"):
        decoder.generate_batch(PROMPTS, 40, recordings=short.recordings)
    sampled = SpeculativeDecoder(model, successor_drafter(f, draft_ids), DraftSettings(temperature=0.7))
    with pytest.raises(ValueError, match="greedy"):
        sampled.generate_batch(PROMPTS, 40, recordings=short.recordings)
    with pytest.raises(ValueError, match="other prompts"):
        decoder.generate_batch(PROMPTS[::-1], 40, recordings=short.recordings)


def test_probe_counts_the_same_at_every_batch_size():
    f, draft_ids = successor()
    model = successor_target(f, noise=0.3)
    drafter = successor_drafter(f, draft_ids)
    results = [
        probe.probe(model, drafter, PROMPTS, SETTINGS["tree-3x2"], 30, warmup=False, batch_size=n).metrics
        for n in (1, 3, 4)
    ]
    for key in ("tau", "num_drafts", "num_accepted_tokens", "acceptance_per_position", "accepted_per_prompt",
                "matches_target", "tau_low", "tau_high"):
        assert results[0][key] == results[1][key] == results[2][key], key
    assert results[0]["matches_target"] == 1.0 and results[0]["tau_interval_unit"] == "rounds"
    assert results[0]["tau_low"] <= results[0]["tau"] <= results[0]["tau_high"]
    # a prefill kept from the first probe serves the next ones: same outputs, its seconds charged again
    reuse = batches.PrefillCache()
    first = probe.probe(model, drafter, PROMPTS, SETTINGS["chain-3"], 30, warmup=False, reuse=reuse)
    again = probe.probe(model, drafter, PROMPTS, SETTINGS["chain-3"], 30, warmup=False, reuse=reuse,
                            baseline=first.baseline)
    assert len(reuse.found) == 2  # the prefill with the drafter's aux layers, and without (target only)
    assert [g.tokens for g in again.spec] == [g.tokens for g in first.spec]
    assert again.metrics["accepted_per_prompt"] == first.metrics["accepted_per_prompt"]
    assert again.metrics["prefill_s"] == first.metrics["prefill_s"] > 0


def test_eos_stops_both_decoders_at_the_same_place():
    f, draft_ids = successor()
    model = successor_target(f)
    eos = f[f[f[PROMPT[-1]]]]  # the third generated token
    spec = SpeculativeDecoder(model, successor_drafter(f, draft_ids), DraftSettings(steps=5))
    expected = speculate.generate_target_only(model, PROMPT, 20, eos_token_id=eos).tokens
    assert expected[-1] == eos and len(expected) == 3
    assert spec.generate(PROMPT, 20, eos_token_id=eos).tokens == expected


# ---------------------------------------------------------------- τ of rigged and random drafters


@pytest.mark.parametrize("name", list(SETTINGS))
def test_rigged_drafter_gets_tau_k_plus_one(name):
    settings = SETTINGS[name]
    f, draft_ids = successor()
    model = successor_target(f)
    result = probe.probe(model, successor_drafter(f, draft_ids), [PROMPT, [0, 4]], settings, 33)
    assert result.metrics["tau"] == settings.steps + 1
    assert result.metrics["acceptance_per_position"] == [1.0] * settings.steps
    assert result.metrics["matches_target"] == 1.0
    # the output is f iterated, and the draft vocab (odd ids) maps back to target ids through d2t
    x, expected = PROMPT[-1], []
    for _ in range(33):
        x = f[x]
        expected.append(x)
    assert result.spec[0].tokens == expected


def test_random_drafter_gets_tau_near_one():
    model, drafter = random_pair(vocab=512, draft_vocab=128, seed=3)
    prompts = [[5, 100, 7], [300, 2, 2, 90], [17]]
    metrics = probe.probe(model, drafter, prompts, DraftSettings(steps=4), 24, warmup=False).metrics
    assert 1.0 <= metrics["tau"] < 1.1
    assert metrics["matches_target"] == 1.0


SMOLLM2 = zoo.cache_dir() / f"{zoo.SMOLLM2}-v{zoo.RECIPE_VERSION}"


@pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(), reason="zoo:smollm2-135m-instruct not built")
def test_greedy_speculation_is_lossless_on_smollm2():
    """The real architecture (30 layers, GQA 9/3, tied embeddings) in float32, chain and tree, with a random
    drafter (bench/bench_speculate.py reports the same check with a trained one)."""
    target = Target.load("zoo:smollm2-135m-instruct", dtype="float32", device="cpu")
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.for_target(target.config, draft_vocab_size=2048)).eval()
    prompt = target.tokenizer("def fibonacci(n):\n    ")["input_ids"]
    expected = speculate.generate_target_only(target.model, prompt, 8).tokens
    for settings in (DraftSettings(steps=3), DraftSettings(steps=3, topk=2, num_draft_tokens=5)):
        assert SpeculativeDecoder(target.model, drafter, settings).generate(prompt, 8).tokens == expected


# ---------------------------------------------------------------- what the drafter and target are fed


def test_drafter_is_fed_exactly_as_in_training():
    """Every step-0 row the drafter computed while speculating (incrementally, across rounds, with rejected
    drafts cropped from its cache) equals the full-sequence forward on what training data holds (the aux
    states `Target.capture` records). AUX includes the target's last layer (3 of 0..3), whose output HF's
    output_hidden_states would replace by the final-normed state."""
    f, draft_ids = successor()
    model = successor_target(f, noise=0.3)
    torch.manual_seed(5)
    drafter = Eagle3Drafter(drafter_config()).eval()  # random: its logits depend on every input
    set_vocab_map(drafter, draft_ids)
    decoder = SpeculativeDecoder(model, drafter, DraftSettings(steps=3, topk=2))
    rows = {}
    layer = drafter.layer

    def recording_layer(input_ids, hidden, position_ids, cache, attention_mask=None):
        layer_out = layer(input_ids, hidden, position_ids, cache, attention_mask)
        if hidden.shape[-1] == drafter.config.fc_in_features:  # step 0: target features
            logits = drafter.compute_logits(layer_out[0])
            for position, row in zip(position_ids[0].tolist(), logits, strict=True):
                rows[position] = row
        return layer_out

    drafter.layer = recording_layer
    out = decoder.generate(PROMPT, 30)
    sequence = torch.tensor([PROMPT + out.tokens])
    capture = Target(model, tokenizer=None, name="successor").capture(sequence, aux_layer_ids=AUX)
    aux = capture.aux_hidden_states
    with torch.no_grad():
        reference = drafter(sequence[:, 1:], aux[:, :-1])[0]  # row t: position t + 1
    # one step-0 row per committed position, each computed once (the last round's rows are never needed)
    assert sorted(rows) == list(range(1, len(rows) + 1)) and len(rows) >= 25
    for position, row in rows.items():
        torch.testing.assert_close(row, reference[position - 1], atol=2e-5, rtol=1e-4)


def test_tree_verification_scores_each_node_as_its_own_sequence():
    """One masked forward over a batch's cache + a tree per sequence gives each node the logits of its own
    prefix + its path, with prefixes of different lengths (left padding) in the batch."""
    torch.manual_seed(0)
    model, _ = random_pair(vocab=64, draft_vocab=8)
    prefixes = [[4, 9, 33, 1], [17, 2]]
    trees = [
        DraftTree(tokens=torch.tensor([12, 5, 7, 40, 41, 2, 63]), parents=[-1, 0, 0, 1, 1, 3, 2],
                  depths=torch.tensor([0, 1, 1, 2, 2, 3, 2]), draft_probs=None),
        DraftTree(tokens=torch.tensor([3, 3, 8, 50, 9, 1, 1]), parents=[-1, 0, 1, 2, 0, 4, 3],
                  depths=torch.tensor([0, 1, 2, 3, 1, 2, 4]), draft_probs=None),
    ]
    batch = batches.TargetBatch(model, aux_layer_ids=[])
    with torch.no_grad():
        batch.prefill(prefixes)
        logits, _ = batch.verify(
            torch.stack([t.tokens for t in trees]), torch.stack([t.ancestor_mask() for t in trees]),
            torch.stack([t.depths for t in trees]),
        )
        for b, (prefix, tree) in enumerate(zip(prefixes, trees, strict=True)):
            for node in range(len(tree)):
                path, walk = [], node
                while walk >= 0:
                    path.insert(0, tree.tokens[walk].item())
                    walk = tree.parents[walk]
                alone = model(torch.tensor([prefix + path])).logits[0, -1]
                torch.testing.assert_close(logits[b, node], alone, atol=1e-5, rtol=1e-4)
        # keeping non-contiguous paths leaves each sequence's cache holding prefix + its path
        kept = torch.zeros(2, 7, dtype=torch.bool)
        kept[0, [0, 2, 6]] = True
        kept[1, [0, 4]] = True
        batch.commit(kept)
        sequences = [prefixes[0] + [12, 7, 63], prefixes[1] + [3, 9]]
        one = torch.ones(2, 1, 1, dtype=torch.bool)
        next_logits, _ = batch.verify(torch.tensor([[8], [8]]), one, torch.zeros(2, 1, dtype=torch.long))
        for b, sequence in enumerate(sequences):
            alone = model(torch.tensor([sequence + [8]])).logits[0, -1]
            torch.testing.assert_close(next_logits[b, 0], alone, atol=1e-5, rtol=1e-4)


def prefilled(monkeypatch, model, prompts: list[list[int]], pack: bool
              ) -> tuple[batches.TargetBatch, list, tuple]:
    """The prompts prefilled packed (a direct decoder's prompts in shared rows) or one a row, with the shapes
    of the input ids of every forward it took."""
    monkeypatch.setattr(batches, "PLAIN_HEAD_MODELS", frozenset({"llama"} if pack else ()))
    batch, shapes = batches.TargetBatch(model, aux_layer_ids=[0, 2]), []
    forward = batch._forward
    monkeypatch.setattr(batch, "_forward",
                        lambda ids, *a, **k: shapes.append(ids.shape) or forward(ids, *a, **k))
    with torch.no_grad():
        return batch, shapes, batch.prefill(prompts)


def assert_same_prefill(batch: batches.TargetBatch, alone: batches.TargetBatch, found: tuple,
                        expected: tuple) -> None:
    """The same valid columns, lengths, last logits and aux states, keys and values in every valid column, and
    zeros in the cache's padding."""
    assert torch.equal(batch.valid, alone.valid) and torch.equal(batch.lengths, alone.lengths)
    valid = alone.valid
    torch.testing.assert_close(found[0], expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(found[1][valid], expected[1][valid], rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(batch.cache.layers, alone.cache.layers, strict=True):
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            torch.testing.assert_close(a.transpose(1, 2)[valid], b.transpose(1, 2)[valid], rtol=1e-5,
                                       atol=1e-6)
            assert not a.transpose(1, 2)[~valid].any() and not b.transpose(1, 2)[~valid].any()


@pytest.mark.parametrize("forward_tokens", [4096, 20])
def test_a_packed_prefill_computes_what_one_prompt_a_row_computes(monkeypatch, forward_tokens):
    """Prompts packed into one row (attention within each, positions restarting), or into rows computed by
    several forwards, leave the same cache, aux states and last logits as each prompt alone in its own
    left-padded row, and never compute padding; the cache's padding is zeros."""
    model, _ = random_pair(vocab=64, draft_vocab=24)
    prompts = [[1, 2, 3], [60, 7, 7, 41, 9, 0], [5], list(range(9, 29))]
    monkeypatch.setattr(batches, "PREFILL_FORWARD_TOKENS", forward_tokens)
    monkeypatch.setattr(batches, "PREFILL_ROW_TOKENS", 256 if forward_tokens > 20 else 8)

    packed, packed_shapes, (logits, aux, _) = prefilled(monkeypatch, model, prompts, pack=True)
    alone, alone_shapes, (logits_alone, aux_alone, _) = prefilled(monkeypatch, model, prompts, pack=False)
    if forward_tokens > 20:
        assert packed_shapes == [(1, 30)] and alone_shapes == [(4, 20)]  # 30 prompt tokens against 4 x 20
    else:  # rows [20] and [6, 3, 1], a forward each; one prompt a row: 4 forwards of 1 x 20
        assert packed_shapes == [(1, 20)] * 2 and alone_shapes == [(1, 20)] * 4
    assert_same_prefill(packed, alone, (logits, aux), (logits_alone, aux_alone))


def test_prompts_beginning_alike_share_the_prefill_of_what_they_share(monkeypatch):
    """Prompts that all begin with the same tokens (a system prompt) have those computed once and copied to
    every row: the cache, aux states and last logits are those of one prompt a row, each prompt's own tokens
    computed packed, and greedy decoding of the batch gives each prompt's tokens alone."""
    model, _ = random_pair(vocab=64, draft_vocab=24)
    system = list(range(30, 40))
    prompts = [system + [1, 2, 3], system + [60, 7, 7, 41, 9, 0], system + [5], system + list(range(9, 29))]
    shared, shared_shapes, (logits, aux, _) = prefilled(monkeypatch, model, prompts, pack=True)
    alone, alone_shapes, (logits_alone, aux_alone, _) = prefilled(monkeypatch, model, prompts, pack=False)
    assert shared_shapes == [(1, 10), (1, 30)] and alone_shapes == [(4, 30)]  # 10 + 30 tokens against 4 x 30
    assert_same_prefill(shared, alone, (logits, aux), (logits_alone, aux_alone))
    monkeypatch.setattr(batches, "PLAIN_HEAD_MODELS", frozenset({"llama"}))
    together = speculate.decode_target_only(model, prompts, 12).generations
    assert [g.tokens for g in together] == [speculate.generate_target_only(model, p, 12).tokens
                                            for p in prompts]
    # fewer shared tokens than SHARED_PREFIX_TOKENS: each prompt computed whole
    monkeypatch.setattr(batches, "SHARED_PREFIX_TOKENS", 11)
    assert prefilled(monkeypatch, model, prompts, pack=True)[1] == [(1, 70)]


def test_compacting_a_cache_keeps_what_each_sequence_attends_to():
    valid = torch.tensor([[False, True, False, True], [True, True, False, False],
                          [False, False, True, False]])
    keys = torch.arange(3 * 4, dtype=torch.float).reshape(3, 1, 4, 1)
    compact, (moved,) = batches.compact_columns(valid, [keys])
    # right-aligned, in order: a shorter row's holes stay in front, where its attention can skip them
    assert compact.tolist() == [[True, True], [True, True], [False, True]]
    assert moved[:, 0, :, 0].tolist()[:2] == [[1.0, 3.0], [4.0, 5.0]] and moved[2, 0, 1, 0] == 10.0


def test_key_runs_cut_rows_where_skipping_padding_pays():
    cost = batches.RUN_COST_COLUMNS
    assert cost < 900  # the cases below assume a run costs less than the padding it skips
    assert batches.key_runs([900, 900, 0, 0], 1000) == [(0, 2, 900), (2, 4, 0)]
    assert batches.key_runs([10, 0], 1000) == [(0, 2, 0)]  # 10 columns skipped do not pay for a call
    # rows out of length order: a run for the middle row alone would cost more than it skips
    assert batches.key_runs([0, 900, 0], 1000) == [(0, 3, 0)]
    assert batches.key_runs([900], 1000) == [(0, 1, 900)]


def test_rows_attending_past_their_padding_decode_as_alone(monkeypatch):
    """With a run of rows for every prompt length (each row's attention starting at its own first column,
    `key_runs`), target-only and speculative decoding of a batch give each prompt exactly its output alone."""
    monkeypatch.setattr(batches, "RUN_COST_COLUMNS", 0)  # a run wherever a row starts later than the last
    made = []

    def spied(first, width):
        made.append(runs := real(first, width))
        return runs

    real = batches.key_runs
    monkeypatch.setattr(batches, "key_runs", spied)
    model, drafter = random_pair(vocab=64, draft_vocab=24)
    model.set_attn_implementation("sdpa_shared_kv")
    prompts = [[5], [1, 2, 3], [8, 9, 10, 11, 12, 13], [60, 7, 7, 41, 9, 0, 12, 33, 2, 5, 6, 7]]
    alone = [speculate.generate_target_only(model, p, 30).tokens for p in prompts]
    plain = speculate.decode_target_only(model, prompts, 30).generations
    assert [g.tokens for g in plain] == alone
    assert max(len(runs) for runs in made) == 4  # every row its own run
    for name in ("chain-3", "tree-4x3-8"):
        made.clear()
        spec = SpeculativeDecoder(model, drafter, SETTINGS[name]).generate_batch(prompts, 30).generations
        assert [g.tokens for g in spec] == alone
        assert max(len(runs) for runs in made) > 1


def test_finished_sequences_held_in_the_cache_change_nothing(monkeypatch):
    """Sequences that finish stay in the cache as ignored rows until they are a quarter of it, their attention
    reading only what they wrote since: every prompt of a batch of 8 still decodes, target-only and
    speculatively, to exactly its output alone."""
    monkeypatch.setattr(batches, "RUN_COST_COLUMNS", 0)  # a run wherever it saves a column
    held, skipped = [], []
    select, first_read = batches.TargetBatch.select, batches.TargetBatch._first_read_columns

    def spied_select(self, rows):
        select(self, rows)
        held.append(self._live is not None)

    def spied_first_read(self):
        first = first_read(self)
        skipped.append(bool((first > self.valid.to(torch.int8).argmax(1)).any()))
        return first

    monkeypatch.setattr(batches.TargetBatch, "select", spied_select)
    monkeypatch.setattr(batches.TargetBatch, "_first_read_columns", spied_first_read)
    model, drafter = random_pair(vocab=64, draft_vocab=24)
    model.set_attn_implementation("sdpa_shared_kv")
    prompts = [[5], [1, 2, 3], [8, 9, 10], [60, 7, 7, 41], [4, 4], [33, 2, 9, 17, 50], [12], [40, 41]]
    eos = speculate.generate_target_only(model, prompts[0], 30).tokens[6]
    alone = [speculate.generate_target_only(model, p, 30, eos_token_id=eos).tokens for p in prompts]
    assert 1 < sum(len(t) < 30 for t in alone) < len(prompts)  # some finish early, at different steps
    plain = speculate.decode_target_only(model, prompts, 30, eos_token_id=eos).generations
    assert [g.tokens for g in plain] == alone
    assert True in held and False in held  # rows were held, then cut out once a quarter had finished
    assert any(skipped)  # held rows skipped their history
    for name in ("chain-3", "tree-4x3-8"):
        decoder = SpeculativeDecoder(model, drafter, SETTINGS[name])
        assert [g.tokens for g in decoder.generate_batch(prompts, 30, eos_token_id=eos).generations] == alone


def test_append_layer_holds_what_hf_dynamic_layer_holds():
    """Appends past the buffer's room, crops, batch selection and a replaced view (as compaction does)
    leave the in-place cache holding exactly what HF's concatenating one holds."""
    torch.manual_seed(0)
    appended, concatenated = batches.AppendLayer(), DynamicLayer()
    appended.room = 3  # runs out of room every few steps

    def both(action):
        for layer in (appended, concatenated):
            action(layer)
        assert torch.equal(appended.keys, concatenated.keys)
        assert torch.equal(appended.values, concatenated.values)

    def append(batch: int, columns: int):
        new = torch.randn(batch, 2, columns, 8), torch.randn(batch, 2, columns, 8)
        both(lambda layer: layer.update(*new))

    for columns in [5, 1, 4, 1, 2, 1, 1, 3]:
        append(4, columns)
        both(lambda layer: layer.crop(-1))
    both(lambda layer: layer.batch_select_indices(torch.tensor([0, 2, 3])))
    append(3, 2)
    replaced = appended.keys[:, :, [0, 2, 4]].clone(), appended.values[:, :, [0, 2, 4]].clone()
    for layer in (appended, concatenated):
        layer.keys, layer.values = (t.clone() for t in replaced)
    append(3, 1)
    assert appended.keys.shape == (3, 2, 4, 8)


def test_draft_tree_shapes():
    model, drafter = random_pair(vocab=64, draft_vocab=24)
    decoder = SpeculativeDecoder(model, drafter, DraftSettings(steps=4, topk=3, num_draft_tokens=9))
    batch = batches.DrafterBatch(drafter)
    with torch.no_grad():
        hidden = torch.randn(2, 5, drafter.config.fc_in_features)
        positions = torch.arange(1, 6)[None].expand(2, 5)
        rows_valid = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
        root_logits, root_out = batch.feed(torch.tensor([[1, 2, 3, 4, 5], [9, 8, 7, 0, 0]]), hidden,
                                           positions, rows_valid)  # of each sequence's last valid row
        roots = torch.tensor([5, 7])
        vocab = set(drafter.draft_to_target(torch.arange(24)).tolist())
        for settings in (decoder.settings, DraftSettings(steps=4)):
            trees = speculate.draft_trees(batch, roots, root_logits, root_out, torch.tensor([5, 3]), settings,
                                          [None, None])
            assert len(batch.cache) == 5
            for tree in trees:
                assert len(tree) == settings.num_draft_tokens
                assert all(0 <= p < node for node, p in enumerate(tree.parents) if node > 0)
                assert all(tree.depths[n] == tree.depths[p] + 1 for n, p in enumerate(tree.parents) if n > 0)
                assert int(tree.depths.max()) <= settings.steps
                assert set(tree.tokens[1:].tolist()) <= vocab
        assert [tree.parents for tree in trees] == [[-1, 0, 1, 2, 3]] * 2  # topk 1: a chain
        # level 1 of a tree holds the drafter's top-3 tokens after each root
        wide = speculate.draft_trees(batch, roots, root_logits, root_out, torch.tensor([5, 3]),
                                     decoder.settings, [None, None])
        for b, tree in enumerate(wide):
            top3 = drafter.draft_to_target(root_logits[b].topk(3).indices).tolist()
            assert sorted(tree.tokens[tree.depths == 1].tolist()) == sorted(top3)


# ---------------------------------------------------------------- sampling: the target's distribution


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(χ² ≥ observed) for observed counts against expected probabilities (cells with E < 5 pooled)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.double), statistic / 2))


def test_rejection_sample_preserves_target_distribution():
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    q = torch.tensor([0.5, 0.1, 0.3, 0.05, 0.05])
    generator = torch.Generator().manual_seed(0)
    draws = 5000
    for case in ("sampled draft", "top-2 point masses"):
        counts = torch.zeros(5)
        for _ in range(draws):
            if case == "sampled draft":
                draft = int(torch.multinomial(q, 1, generator=generator))
                _, token = speculate.rejection_sample(p, [draft], q[None], generator)
            else:
                _, token = speculate.rejection_sample(p, [0, 2], None, generator)
            counts[token] += 1
        assert chi_square_p_value(counts, p) > 1e-3, (case, counts / draws)
        # the drafts' own distribution is far from p: the test can tell the two apart
        assert chi_square_p_value(counts, q) < 1e-12


def test_sampled_rows_draw_from_each_rows_distribution_with_its_own_generator():
    """`sample_rows`: the softmax at the temperature, row by row; a token of probability 0 never; each row's
    token the same alone as inside any batch; a row with nothing to sample refused by its index."""
    logits = torch.tensor([2.0, 1.0, 0.0, -math.inf, 0.5, -math.inf])
    probs = (logits / 0.7).softmax(-1)
    rows = 6000
    tokens = speculate.sample_rows(logits.expand(rows, -1), 0.7,
                                   [torch.Generator().manual_seed(i) for i in range(rows)])
    counts = torch.bincount(tokens, minlength=6).float()
    assert counts[3] == counts[5] == 0
    assert chi_square_p_value(counts, probs) > 1e-3, counts / rows
    assert chi_square_p_value(counts, (logits / 1.4).softmax(-1)) < 1e-12  # it can tell temperatures apart
    mixed = torch.randn(5, 50) * 3
    together = speculate.sample_rows(mixed, 0.7, [torch.Generator().manual_seed(i) for i in range(5)])
    alone = [int(speculate.sample_rows(mixed[i:i + 1], 0.7, [torch.Generator().manual_seed(i)]))
             for i in range(5)]
    assert together.tolist() == alone
    one_hot = torch.full((3, 9), -math.inf)
    one_hot[[0, 1, 2], [0, 4, 8]] = 0.0  # the first, a middle and the last token: each row's only one
    assert speculate.sample_rows(one_hot, 1.0, [None] * 3).tolist() == [0, 4, 8]
    assert torch.equal(speculate.sample_rows(mixed, 0.0, [None] * 5), mixed.argmax(-1))
    with pytest.raises(ValueError, match=r"logits rows \[1\] have no finite softmax"):
        speculate.sample_rows(torch.stack([logits, torch.full((6,), -math.inf)]), 0.7, [None, None])
    with pytest.raises(ValueError, match="2 generators for 5 rows"):
        speculate.sample_rows(mixed, 0.7, [None, None])


def test_sampled_target_decoding_is_the_same_for_a_prompt_alone_and_in_a_batch():
    model, _ = random_pair(vocab=64, draft_vocab=24)
    prompts = [[1, 2, 3], [60, 7, 7, 41, 9, 0], [5]]

    def seeded(indices):
        return [torch.Generator().manual_seed(100 + i) for i in indices]

    batch = speculate.decode_target_only(model, prompts, 30, 0.8, generators=seeded(range(3))).generations
    for i, prompt in enumerate(prompts):
        alone = speculate.decode_target_only(model, [prompt], 30, 0.8, generators=seeded([i])).generations[0]
        assert alone.tokens == batch[i].tokens
    greedy = speculate.decode_target_only(model, prompts, 30).generations
    assert all(s.tokens != g.tokens for s, g in zip(batch, greedy, strict=True))  # it did sample


@pytest.mark.parametrize("topk", [1, 2])
def test_sampled_speculation_preserves_target_distribution(topk):
    """Token counts over a long sampled generation vs the sum of the target's exact next-token
    probabilities at each generated position (computed afterwards in one plain forward pass).

    Under the null hypothesis each token is drawn from the target's distribution given its past, so the
    count deviations are a sum of martingale differences whose covariance is Σ_t diag(p_t) - p_t p_tᵀ: the
    quadratic form below is χ² with V - 1 degrees of freedom (Pearson's test for non-identical draws).
    """
    model, drafter = random_pair(vocab=8, draft_vocab=6, seed=2, head_scale=60.0)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # a target distribution far from uniform, and unlike the drafter's
    settings = DraftSettings(steps=2, topk=topk, temperature=1.0)
    prompts = [[1, 6, 3], [2], [7, 7, 0, 5], [1, 6, 3]]
    decoder = SpeculativeDecoder(model, drafter, settings)
    seeds = [10 * topk + i for i in range(len(prompts))]
    outs = decoder.generate_batch(
        prompts, 150, generators=[torch.Generator().manual_seed(seed) for seed in seeds]
    ).generations
    deviation, covariance = torch.zeros(8, dtype=torch.double), torch.zeros(8, 8, dtype=torch.double)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.tokens])).logits[0, len(prompt) - 1 : -1]
        p = logits.double().softmax(-1)  # [150, V]: the target's distribution at each generated position
        deviation += torch.nn.functional.one_hot(torch.tensor(out.tokens), 8).sum(0).double() - p.sum(0)
        covariance += (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]).sum(0)
    statistic = deviation @ torch.linalg.pinv(covariance) @ deviation
    p_value = float(torch.special.gammaincc(torch.tensor(3.5, dtype=torch.double), statistic / 2))
    assert p_value > 1e-3, (statistic, deviation)
    # drafts were both accepted and rejected, and the drafter alone would have produced other counts
    accepted = [a for out in outs for a in out.accepted]
    assert 0 < sum(accepted) < len(accepted) * settings.steps
    # each sequence drew its numbers as it would alone: the batch gives the single-sequence samples
    alone = decoder.generate(prompts[1], 150, generator=torch.Generator().manual_seed(seeds[1]))
    assert alone.tokens == outs[1].tokens and alone.accepted == outs[1].accepted
    q_first = drafter.draft_to_target(torch.arange(6))
    assert p.max(-1).values.mean() < 0.9 and len(set(q_first.tolist())) == 6


# ---------------------------------------------------------------- bad input, settings, metrics


def test_mismatched_pairs_are_refused_before_decoding():
    f, draft_ids = successor()
    model = successor_target(f)
    cases = {
        r"vocab_size \(Vt\): drafter has 40, target has 32": drafter_config(vocab=40),
        "target_hidden_size: drafter expects 48": drafter_config(hidden=48),
        r"\[4, 7\] outside the 4 decoder layers": drafter_config(aux=[1, 4, 7]),
    }
    for message, config in cases.items():
        with pytest.raises(ValueError, match=message):
            SpeculativeDecoder(model, Eagle3Drafter(config), DraftSettings())
    broken = successor_drafter(f, draft_ids)
    broken.d2t[-1] = 100
    with pytest.raises(ValueError, match="outside the target vocab"):
        SpeculativeDecoder(model, broken, DraftSettings())


def test_draft_settings_defaults_and_limits():
    assert DraftSettings(steps=5).num_draft_tokens == 6
    assert DraftSettings(steps=3, topk=4).num_draft_tokens == 13
    with pytest.raises(ValueError, match="num_draft_tokens 30 must be in 2..7"):
        DraftSettings(steps=2, topk=2, num_draft_tokens=30)
    with pytest.raises(ValueError, match="steps"):
        DraftSettings(steps=0)


def test_acceptance_metrics_count_as_vllm():
    metrics = probe.acceptance_metrics([0, 3, 1, 2, 3], depth=3)
    assert metrics["tau"] == 1 + 9 / 5
    assert metrics["num_drafts"] == 5 and metrics["num_accepted_tokens"] == 9
    assert metrics["acceptance_per_position"] == [4 / 5, 3 / 5, 2 / 5]
    with pytest.raises(ValueError, match="no verification step"):
        probe.acceptance_metrics([], depth=3)


def test_probe_reports_speed_and_ideal_speedup():
    f, draft_ids = successor()
    model = successor_target(f, noise=0.3)
    drafter = successor_drafter(f, draft_ids)
    metrics = probe.probe(model, drafter, [PROMPT], DraftSettings(steps=3), 20).metrics
    for key in ("tokens_per_s", "target_tokens_per_s", "speedup", "ideal_speedup", "efficiency",
                "draft_ms_per_round", "verify_ms_per_round", "target_ms_per_step"):
        assert metrics[key] > 0, key
    expected_ideal = metrics["tau"] * metrics["target_ms_per_step"] / (
        metrics["draft_ms_per_round"] + metrics["verify_ms_per_round"]
    )
    assert metrics["ideal_speedup"] == pytest.approx(expected_ideal)
    assert metrics["tokens"] == 20


def test_speedups_end_to_end_and_in_decoding():
    """The prefill (and the first token it yields) counts in `speedup`, not in `decode_speedup`."""
    tokens = [speculate.Generation(tokens=list(range(10)), accepted=[]) for _ in range(2)]
    spec = speculate.BatchOutput(tokens, {"prefill": 5.0, "draft": 1.0, "verify": 3.0, "total": 9.0}, 4)
    target = speculate.BatchOutput(tokens, {"prefill": 5.0, "decode": 8.0, "total": 13.0}, 9)
    metrics = probe.speed_metrics([spec], [target], tau=2.0)
    assert metrics["speedup"] == pytest.approx(13.0 / 9.0)
    assert metrics["decode_tokens_per_s"] == 18 / 4.0 and metrics["target_decode_tokens_per_s"] == 18 / 8.0
    assert metrics["decode_speedup"] == 2.0
    assert metrics["ideal_speedup"] == pytest.approx(2.0 * (8.0 / 9) / (4.0 / 4))


# ---------------------------------------------------------------- the smoke fixture


def tiny_llama_drafter(seed: int) -> Eagle3Drafter:
    """The drafters params/smoke.yaml probes `zoo:tiny-llama` with (random weights, a random 256-token draft
    vocab): sized for that target, so notebooks 01 and 05 run the real pipeline in seconds."""
    config = DrafterConfig.for_target(LlamaConfig(**zoo.TINY_LLAMA_CONFIG), draft_vocab_size=256)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(config)
    generator = torch.Generator().manual_seed(seed)
    draft_ids = torch.randperm(config.vocab_size, generator=generator)[:256].sort().values
    set_vocab_map(drafter, draft_ids.tolist())
    return drafter


# (folder, seed, layout); if the recipe changes: save_drafter(tiny_llama_drafter(seed), folder, layout,
# engines=FIXTURE_READERS[layout]). The speculators-layout one is for vLLM alone (which takes the target's
# embedding), so it carries none: a tiny-llama embedding would be 12 MB.
FIXTURE_READERS = {"sglang": None, "speculators": ("vLLM",)}
SMOKE_DRAFTERS = [
    (SMOKE_DRAFTER, 0, "sglang"),
    (SMOKE_DRAFTER.with_name("tiny_llama_drafter_b"), 1, "speculators"),
]


@pytest.mark.parametrize("folder, seed, layout", SMOKE_DRAFTERS)
def test_smoke_fixture_drafters_are_what_their_recipe_builds(tmp_path, folder, seed, layout):
    save_drafter(tiny_llama_drafter(seed), tmp_path / "drafter", layout, engines=FIXTURE_READERS[layout])
    committed, report = load_drafter(folder)
    rebuilt, _ = load_drafter(tmp_path / "drafter")
    assert report.layout == layout and committed.config == rebuilt.config
    for (name, a), (_, b) in zip(committed.state_dict().items(), rebuilt.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
