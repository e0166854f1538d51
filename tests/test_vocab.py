"""VocabMap: SpecForge/speculators construction, encodings, loading every format, validation, diff."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3lib import cli
from eagle3lib.drafter.vocab import VocabMap, VocabMapError, coverage_by_size, diff, load_counts

FIXTURES = Path(__file__).parent / "fixtures" / "speculators-0.9.0"


@pytest.fixture(scope="module")
def pair() -> dict:
    return load_file(FIXTURES / "vocab_pair.safetensors")


def rule_by_hand(counts: list[int], vd: int) -> list[int]:
    """The docs/formats.md §3 rule written the slow, obvious way: seen tokens by (-count, id), top Vd,
    pad with the lowest unused ids, sort ascending."""
    seen = sorted((tid for tid, c in enumerate(counts) if c > 0), key=lambda tid: (-counts[tid], tid))
    chosen = seen[:vd]
    unused = (tid for tid in range(len(counts)) if tid not in set(chosen))
    while len(chosen) < vd:
        chosen.append(next(unused))
    return sorted(chosen)


# ---------------------------------------------------------------- construction from counts


def test_from_counts_reproduces_speculators_maps_exactly(pair):
    for name in ("A", "B"):
        built = VocabMap.from_counts(pair[f"freq_{name}"], 4000, 32000)
        assert torch.equal(built.d2t, pair[f"d2t_{name}"])
        assert torch.equal(built.t2d, pair[f"t2d_{name}"])


def test_from_counts_reproduces_the_tiny_drafters_map():
    reference = load_file(FIXTURES / "sglang_tiny_reference.safetensors")
    built = VocabMap.from_counts(reference["vocab_freq"], 96)
    assert torch.equal(built.d2t, reference["d2t"]) and torch.equal(built.t2d, reference["t2d"])


@pytest.mark.parametrize("seed", range(6))
def test_from_counts_ties_to_lower_id_and_pads_with_lowest_unused_ids(seed):
    generator = torch.Generator().manual_seed(seed)
    vt, vd = 300, 40
    # few distinct count values → many ties; with seeds 3..5 fewer than Vd tokens are seen → padding
    seen = 60 if seed < 3 else 25
    counts = torch.zeros(vt, dtype=torch.int64)
    where = torch.randperm(vt, generator=generator)[:seen]
    counts[where] = torch.randint(1, 4, (seen,), generator=generator)
    built = VocabMap.from_counts(counts, vd, vt)
    assert built.draft_ids.tolist() == rule_by_hand(counts.tolist(), vd)


def test_padding_and_ties_on_a_hand_made_table():
    # ids 5 and 2 tie at count 3 (2 wins for the last slot); then nothing else is seen
    counts = torch.tensor([0, 0, 3, 0, 9, 3, 0, 0])
    assert VocabMap.from_counts(counts, 2).draft_ids.tolist() == [2, 4]
    # Vd 5 > 3 seen tokens: pad with the lowest unused ids 0 and 1
    assert VocabMap.from_counts(counts, 5).draft_ids.tolist() == [0, 1, 2, 4, 5]


def test_from_counts_refuses_bad_tables():
    with pytest.raises(VocabMapError, match="negative token count at target id 1"):
        VocabMap.from_counts(torch.tensor([3, -1, 2]), 2)
    with pytest.raises(VocabMapError, match="Vd 5 must be in"):
        VocabMap.from_counts(torch.tensor([3, 1, 2]), 5)
    with pytest.raises(VocabMapError, match="3 entries, expected Vt 4"):
        VocabMap.from_counts(torch.tensor([3, 1, 2]), 2, vt=4)


# ---------------------------------------------------------------- encodings


def test_encodings_agree(pair):
    m = VocabMap.from_pair(pair["d2t_A"], pair["t2d_A"])
    assert (m.vd, m.vt) == (4000, 32000)
    assert torch.equal(torch.arange(m.vd) + m.d2t, m.t2d.nonzero().flatten())
    assert torch.equal(m.target_to_draft[m.draft_ids], torch.arange(m.vd))
    assert int((m.target_to_draft >= 0).sum()) == m.vd and int((m.target_to_draft == -1).sum()) == m.vt - m.vd
    assert m.d2t.dtype == torch.int64 and m.t2d.dtype == torch.bool
    assert VocabMap.from_d2t(pair["d2t_A"], 32000) == m == VocabMap.from_t2d(pair["t2d_A"])
    assert VocabMap.from_t2d(pair["t2d_A"].to(torch.uint8)) == m
    assert VocabMap.from_ids(m.draft_ids, 32000) == m
    assert VocabMap.from_ids(m.draft_ids, 32001) != m


@pytest.mark.parametrize(
    "ids, vt, message",
    [
        ([1, 3, 3, 7], 10,
         r"1 duplicate target id\(s\) in the map, e.g. target id 3 again at draft position 2"),
        ([1, 3, 12, 13], 10,
         r"2 draft id\(s\) out of range \[0, 10\), first at draft position 2: target id 12"),
        ([-1, 3], 10, r"out of range \[0, 10\), first at draft position 0: target id -1"),
        ([4, 3, 7], 10, r"not ascending at draft position 1 \(target id 3 after 4\)"),
        ([], 10, r"the map is empty"),
        ([0, 1, 2], 2, r"Vd 3 is larger than the target vocab Vt 2"),
    ],
)
def test_bad_ids_are_refused_with_the_problem_named(ids, vt, message):
    with pytest.raises(VocabMapError, match=message):
        VocabMap.from_ids(torch.tensor(ids, dtype=torch.int64), vt, source="maps/bad.pt")
    with pytest.raises(VocabMapError, match=r"^maps/bad\.pt: "):
        VocabMap.from_ids(torch.tensor(ids, dtype=torch.int64), vt, source="maps/bad.pt")


def test_float_ids_and_2d_ids_are_refused():
    with pytest.raises(VocabMapError, match="d2t must hold integers, got dtype torch.float32"):
        VocabMap.from_d2t(torch.zeros(3), 10)
    with pytest.raises(VocabMapError, match=r"d2t must be 1-D, got shape \[1, 3\]"):
        VocabMap.from_d2t(torch.zeros(1, 3, dtype=torch.int64), 10)


def test_d2t_t2d_disagreement_and_length_mismatch(pair):
    d2t, t2d = pair["d2t_A"].clone(), pair["t2d_A"]
    with pytest.raises(VocabMapError, match="d2t has 3999 entries but t2d marks 4000 tokens"):
        VocabMap.from_pair(d2t[:-1], t2d, source="x.pt")
    d2t[10] += 1  # position 10 now names a token t2d does not list there
    message = r"x.pt: d2t and t2d disagree at 1 draft position\(s\), first at 10: "
    with pytest.raises(VocabMapError, match=message + "d2t says target id 82, t2d puts target id 81 there"):
        VocabMap.from_pair(d2t, t2d, source="x.pt")


def test_vt_mismatch_with_the_target(pair):
    m = VocabMap.from_t2d(pair["t2d_A"], source="maps/a.safetensors")
    assert m.check_vt(32000) is m
    message = "maps/a.safetensors: the map is for Vt 32000 but the target has Vt 49152"
    with pytest.raises(VocabMapError, match=message):
        m.check_vt(49152)


# ---------------------------------------------------------------- files


def test_load_from_drafter_checkpoints_in_both_layouts():
    for name in ("sglang_tiny", "speculators_tiny"):
        reference = load_file(FIXTURES / f"{name}_reference.safetensors")
        m = VocabMap.load(FIXTURES / name)
        assert torch.equal(m.d2t, reference["d2t"]) and torch.equal(m.t2d, reference["t2d"])
        assert m.source == str(FIXTURES / name)
    with pytest.raises(VocabMapError, match="the map is for Vt 512 but the target has Vt 49152"):
        VocabMap.load(FIXTURES / "sglang_tiny", vt=49152)


def test_load_a_checkpoint_with_d2t_only_takes_vt_from_its_config(tmp_path, pair):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"d2t": pair["d2t_B"], "lm_head.weight": torch.zeros(4000, 2)}, ckpt / "model.safetensors")
    (ckpt / "config.json").write_text(json.dumps({"vocab_size": 32000, "draft_vocab_size": 4000}))
    assert VocabMap.load(ckpt) == VocabMap.from_t2d(pair["t2d_B"])
    (ckpt / "config.json").write_text(json.dumps({"vocab_size": 32000, "draft_vocab_size": 3000}))
    with pytest.raises(VocabMapError, match="config.json says draft_vocab_size 3000 but d2t/t2d hold Vd"):
        VocabMap.load(ckpt)


def test_load_specforge_dict_numpy_pair_and_saved_file(tmp_path, pair):
    expected = VocabMap.from_t2d(pair["t2d_A"])
    torch.save({"d2t": pair["d2t_A"], "t2d": pair["t2d_A"]}, tmp_path / "vocab_mapping.pt")
    assert VocabMap.load(tmp_path / "vocab_mapping.pt") == expected
    np.save(tmp_path / "d2t.npy", pair["d2t_A"].numpy())
    np.save(tmp_path / "t2d.npy", pair["t2d_A"].numpy())
    assert VocabMap.load(tmp_path) == expected
    assert VocabMap.load(tmp_path / "t2d.npy") == expected
    saved = expected.save(tmp_path / "map.safetensors")
    assert VocabMap.load(saved) == expected
    stored = load_file(saved)
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool
    with pytest.raises(FileExistsError, match="never overwritten"):
        expected.save(saved)


def test_load_token_count_tables(tmp_path, pair):
    with pytest.raises(VocabMapError, match="vocab_pair.safetensors: holds no vocab map"):
        VocabMap.load(FIXTURES / "vocab_pair.safetensors", vd=4000)  # its keys are d2t_A, freq_A, ...
    save_file({"counts": pair["freq_B"]}, tmp_path / "token_counts.safetensors")
    from_table = VocabMap.load(tmp_path / "token_counts.safetensors", vd=4000)
    assert from_table == VocabMap.from_t2d(pair["t2d_B"])
    with pytest.raises(VocabMapError, match="token_counts.safetensors: a token-count table; give vd"):
        VocabMap.load(tmp_path / "token_counts.safetensors")
    freq = {int(t): int(c) for t, c in enumerate(pair["freq_B"].tolist()) if c}
    torch.save(freq, tmp_path / "token_freq.pt")
    assert VocabMap.load(tmp_path / "token_freq.pt", vd=4000, vt=32000) == from_table
    assert torch.equal(load_counts(tmp_path / "token_freq.pt", vt=32000), pair["freq_B"])
    assert torch.equal(load_counts(tmp_path / "token_counts.safetensors"), pair["freq_B"])


def test_bad_files_are_refused_naming_the_file(tmp_path, pair):
    torch.save({"d2t": torch.tensor([0, 0, 0]), "t2d": torch.tensor([True, False, True, True])},
               tmp_path / "dup.pt")
    with pytest.raises(VocabMapError, match=r"dup.pt: d2t and t2d disagree"):
        VocabMap.load(tmp_path / "dup.pt")
    save_file({"d2t": torch.tensor([0, 0, 0]), "t2d": torch.ones(4, dtype=torch.bool)},
              tmp_path / "len.safetensors")
    with pytest.raises(VocabMapError, match=r"len.safetensors: d2t has 3 entries but t2d marks 4 tokens"):
        VocabMap.load(tmp_path / "len.safetensors")
    save_file({"x": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(VocabMapError, match=r"other.safetensors: holds no vocab map"):
        VocabMap.load(tmp_path / "other.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(VocabMapError, match=r"junk.safetensors: not a readable safetensors file"):
        VocabMap.load(tmp_path / "junk.safetensors")
    with pytest.raises(FileNotFoundError, match="vocab map not found"):
        VocabMap.load(tmp_path / "missing")
    torch.save({"d2t": torch.tensor([0, 1])}, tmp_path / "d2t_only.pt")
    with pytest.raises(VocabMapError, match="only d2t is stored and nothing says Vt"):
        VocabMap.load(tmp_path / "d2t_only.pt")
    assert VocabMap.load(tmp_path / "d2t_only.pt", vt=5).draft_ids.tolist() == [0, 2]


# ---------------------------------------------------------------- diff


def test_diff_matches_the_reference_pair_exactly(pair):
    expected = json.loads((FIXTURES / "vocab_pair_expected.json").read_text())
    a = VocabMap.from_pair(pair["d2t_A"], pair["t2d_A"])
    b = VocabMap.from_pair(pair["d2t_B"], pair["t2d_B"])
    result = diff(a, b)
    for key, value in expected["counts"].items():
        assert getattr(result, key.lower()) == value, key
    assert result.first_divergence == expected["first_differing_draft_position"]
    assert result.summary() == (
        "224 of 4000 positions agree (first divergence at 4); 3,608 shared tokens; "
        "392 only in A; 392 only in B"
    )
    assert result.agree.shape == (4000,) and int(result.agree.sum()) == 224
    assert not bool(result.agree[4]) and bool(result.agree[:4].all())


def test_diff_with_counts_reports_token_mass_coverage(pair):
    a, b = VocabMap.from_t2d(pair["t2d_A"]), VocabMap.from_t2d(pair["t2d_B"])
    freq = pair["freq_A"]
    result = diff(a, b, counts=freq)
    total = int(freq.sum())
    assert result.counted_tokens == total
    assert result.coverage_a == int(freq[pair["t2d_A"]].sum()) / total
    assert result.coverage_b == int(freq[pair["t2d_B"]].sum()) / total
    # A is the top 4000 of freq_A, so no map of 4000 tokens covers more of it
    best = int(freq.sort(descending=True).values[:4000].sum()) / total
    assert result.coverage_a == best > result.coverage_b
    assert "A covers 86.53% and B 86.14% of 43,658,588 counted tokens" in result.summary()
    with pytest.raises(VocabMapError, match="token counts: the count table has 5 entries, the map's Vt is"):
        diff(a, b, counts=torch.ones(5, dtype=torch.int64))


def test_diff_of_identical_maps_different_sizes_and_vt():
    a = VocabMap.from_ids(torch.tensor([1, 4, 6]), 10, "a")
    assert diff(a, a).first_divergence is None and diff(a, a).positions_equal == 3
    longer = VocabMap.from_ids(torch.tensor([1, 4, 6, 8]), 10, "longer")
    result = diff(a, longer)
    assert (result.positions_compared, result.positions_equal, result.first_divergence) == (3, 3, 3)
    assert (result.intersection, result.only_in_a, result.only_in_b, result.union) == (3, 0, 1, 4)
    assert "[A has Vd 3, B has Vd 4]" in result.summary()
    with pytest.raises(VocabMapError, match=r"other: the map is for Vt 11 but the other map \(a\) has Vt 10"):
        diff(a, VocabMap.from_ids(torch.tensor([1]), 11, "other"))


def test_cli_diff_vocab(tmp_path, pair, capsys):
    VocabMap.from_t2d(pair["t2d_A"]).save(tmp_path / "a.safetensors")
    torch.save({"d2t": pair["d2t_B"], "t2d": pair["t2d_B"]}, tmp_path / "b.pt")
    save_file({"counts": pair["freq_B"]}, tmp_path / "counts.safetensors")
    assert cli.main(["diff-vocab", str(tmp_path / "a.safetensors"), str(tmp_path / "b.pt")]) == 0
    assert capsys.readouterr().out.startswith("224 of 4000 positions agree (first divergence at 4); 3,608")
    args = ["diff-vocab", str(tmp_path / "a.safetensors"), str(tmp_path / "b.pt"), "--counts",
            str(tmp_path / "counts.safetensors"), "--json"]
    assert cli.main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["union"] == 4392 and printed["coverage_b"] > printed["coverage_a"]
    shutil.copy(FIXTURES / "sglang_tiny" / "model.safetensors", tmp_path / "small.safetensors")
    assert cli.main(["diff-vocab", str(tmp_path / "a.safetensors"), str(tmp_path / "small.safetensors")]) == 2
    assert "the map is for Vt 512 but the other map" in capsys.readouterr().err


def test_coverage_by_size_is_the_map_of_every_size_measured_at_once():
    counts = torch.tensor([5, 0, 3, 3, 0, 7, 1, 0])  # a tie (ids 2 and 3) and unseen tokens
    heldout = torch.tensor([1, 4, 0, 2, 1, 3, 0, 5])
    curve = coverage_by_size(counts, heldout)
    assert curve.tolist() == [VocabMap.from_counts(counts, n).coverage(heldout) for n in range(1, 9)]
    assert curve[2] == 4 / 16 and curve[-1] == 1.0  # ids 5, 0, 2 first: the tie goes to the lower id
    with pytest.raises(VocabMapError, match="held-out counts: no tokens counted"):
        coverage_by_size(counts, torch.zeros(8, dtype=torch.long))
    with pytest.raises(VocabMapError, match="held-out counts: the count table has 5 entries"):
        coverage_by_size(counts, heldout[:5])
