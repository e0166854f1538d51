"""Data folders: streaming writer and reader round trip, validation errors, capture, dumps of other tools."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3lib.data import corpora, sources
from eagle3lib.data.layout import DataError
from eagle3lib.data.readers import open_reader
from eagle3lib.generation import capture
from eagle3lib.generation.capture import DataWriter
from eagle3lib.params import DEFAULTS
from eagle3lib.target.model import Target

H, A, VT = 8, 3, 50
TARGET_INFO = {
    "name": "synthetic",
    "fingerprint": "0123abcd",
    "num_layers": 6,
    "hidden_size": H,
    "vocab_size": VT,
    "rms_norm_eps": 1e-5,
    "dtype": "float32",
}


def synthetic_samples(lengths: list[int], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(0, VT, (n,), generator=g),
            "loss_mask": torch.rand(n, generator=g) > 0.3,
            "aux_hidden_states": torch.randn(n, A * H, generator=g),
            "last_hidden_state": torch.randn(n, H, generator=g),
            "target_argmax": torch.randint(0, VT, (n,), generator=g),
        }
        for n in lengths
    ]


def synthetic_head(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed_tokens.weight": torch.randn(VT, H, generator=g),
        "norm.weight": torch.rand(H, generator=g) + 0.5,
        "lm_head.weight": torch.randn(VT, H, generator=g),
    }


def write_folder(path: Path, samples, shard_tokens: int = 20, dtype=torch.float32) -> Path:
    with DataWriter(
        path,
        target=TARGET_INFO,
        aux_layer_ids=[1, 2, 3],
        head=synthetic_head(),
        dtype=dtype,
        shard_tokens=shard_tokens,
        provenance={"test": True},
    ) as writer:
        for s in samples:
            writer.add(**s)
        return writer.close()


@pytest.fixture
def folder(tmp_path) -> tuple[Path, list[dict]]:
    samples = synthetic_samples([7, 12, 3, 25, 9, 2])
    return write_folder(tmp_path / "data", samples), samples


def test_round_trip_through_shards(folder):
    path, samples = folder
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["num_samples"] == 6 and manifest["num_tokens"] == 58
    assert manifest["num_loss_tokens"] == sum(int(s["loss_mask"].sum()) for s in samples)
    assert manifest["aux_layer_ids"] == [1, 2, 3] and manifest["last_hidden"] == "post_norm"
    assert manifest["target"]["fingerprint"] == "0123abcd" and manifest["dtype"] == "float32"
    assert len(manifest["shards"]) == 3  # 20-token shards: 7+12+3, 25, 9+2
    assert [s["num_tokens"] for s in manifest["shards"]] == [22, 25, 11]
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json",
        "shard_00000.safetensors",
        "shard_00001.safetensors",
        "shard_00002.safetensors",
        "target_head.safetensors",
        "token_counts.safetensors",
    ]

    reader = open_reader(path)
    assert (reader.hidden_size, reader.vocab_size, reader.aux_layer_ids) == (H, VT, [1, 2, 3])
    for got, want in zip(reader.samples(), samples, strict=True):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    expected_counts = sum(torch.bincount(s["input_ids"][s["loss_mask"]], minlength=VT) for s in samples)
    assert torch.equal(reader.token_counts(), expected_counts)
    assert torch.equal(
        load_file(path / "token_counts.safetensors")["argmax_counts"],
        sum(torch.bincount(s["target_argmax"][s["loss_mask"]], minlength=VT) for s in samples),
    )
    assert torch.equal(reader.head["lm_head.weight"], synthetic_head()["lm_head.weight"])


def test_batches_pad_and_cut_long_samples_into_windows(folder):
    path, samples = folder
    batches = list(open_reader(path).batches(batch_size=4, seq_len=10, shuffle=False))
    # windows: 7 | 10 2 | 3 | 10 10 5 | 9 | 2  → 9 windows → batches of 4, 4, 1
    assert [b["input_ids"].shape for b in batches] == [(4, 10), (4, 10), (1, 2)]
    first = batches[0]
    assert set(first) == {
        "input_ids",
        "loss_mask",
        "aux_hidden_states",
        "last_hidden_state",
        "target_argmax",
        "attention_mask",
        "position_ids",
    }
    assert first["position_ids"][1].tolist() == list(range(10))
    assert first["position_ids"][0, 7:].tolist() == [0, 1, 2]  # the padding counts from 0 on its own
    assert first["aux_hidden_states"].shape == (4, 10, A * H) and first["last_hidden_state"].shape == (
        4,
        10,
        H,
    )
    assert first["attention_mask"].sum(1).tolist() == [7, 10, 2, 3]
    assert torch.equal(first["input_ids"][1], samples[1]["input_ids"][:10])
    assert torch.equal(first["aux_hidden_states"][2, :2], samples[1]["aux_hidden_states"][10:])
    assert not first["loss_mask"][0, 7:].any() and (first["input_ids"][0, 7:] == 0).all()


def test_shuffle_is_seeded_and_covers_everything(folder):
    path, samples = folder
    reader = open_reader(path)
    one = [s["input_ids"].tolist() for s in reader.samples(shuffle=True, seed=3)]
    assert one == [s["input_ids"].tolist() for s in reader.samples(shuffle=True, seed=3)]
    assert one != [s["input_ids"].tolist() for s in reader.samples(shuffle=True, seed=4)]
    assert sorted(one) == sorted(s["input_ids"].tolist() for s in samples)


def test_writer_refuses_an_existing_folder_and_leaves_nothing_on_failure(tmp_path, folder):
    path, _ = folder
    with pytest.raises(FileExistsError, match="never overwritten"):
        write_folder(path, synthetic_samples([3]))
    target = tmp_path / "broken"
    with pytest.raises(DataError, match="aux_hidden_states has shape"):
        with DataWriter(target, target=TARGET_INFO, aux_layer_ids=[1, 2, 3], head=synthetic_head()) as writer:
            bad = synthetic_samples([4])[0]
            bad["aux_hidden_states"] = bad["aux_hidden_states"][:, :H]
            writer.add(**bad)
    assert not target.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".broken")]
    with pytest.raises(DataError, match="outside the vocabulary"):
        with DataWriter(target, target=TARGET_INFO, aux_layer_ids=[1, 2, 3], head=synthetic_head()) as writer:
            bad = synthetic_samples([4])[0]
            bad["input_ids"][0] = VT
            writer.add(**bad)


def test_bf16_storage(tmp_path):
    samples = synthetic_samples([5, 6])
    path = write_folder(tmp_path / "bf16", samples, dtype=torch.bfloat16)
    got = list(open_reader(path).samples())
    assert got[0]["aux_hidden_states"].dtype == torch.bfloat16
    assert torch.equal(got[1]["last_hidden_state"], samples[1]["last_hidden_state"].bfloat16())


# ---------------------------------------------------------------- validation


def test_truncated_shard_is_named(folder):
    path, _ = folder
    shard = path / "shard_00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(DataError, match="shard_00001.safetensors.*truncated"):
        open_reader(path)


def test_shard_with_other_shapes_is_named(folder):
    path, _ = folder
    shard = path / "shard_00002.safetensors"
    tensors = load_file(shard)
    tensors["aux_hidden_states"] = tensors["aux_hidden_states"][:, : 2 * H].contiguous()
    save_file(tensors, shard)
    with pytest.raises(DataError, match=r"shard_00002.safetensors: aux_hidden_states has shape \[11, 16\]"):
        open_reader(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.update(num_tokens=59), "num_tokens is 59 but the shards add up to 58"),
        (lambda m: m["shards"].pop(), "lists shards"),
        (lambda m: m.update(dtype="int8"), "dtype 'int8'"),
        (lambda m: m.update(hidden_size=H + 1), "shard_00000.safetensors: aux_hidden_states has shape"),
        (lambda m: m.pop("aux_layer_ids"), "lacks aux_layer_ids"),
        (lambda m: m.update(last_hidden="pre_norm"), "last_hidden is 'pre_norm'"),
    ],
)
def test_manifest_disagreeing_with_the_shards_is_refused(folder, edit, message):
    path, _ = folder
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=message):
        open_reader(path)


def test_missing_side_files_and_non_folders(folder, tmp_path):
    path, _ = folder
    (path / "token_counts.safetensors").unlink()
    with pytest.raises(DataError, match="token_counts.safetensors: missing"):
        open_reader(path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="manifest.json: not valid JSON"):
        open_reader(path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not a data folder"):
        open_reader(tmp_path / "empty")


class FakeTarget:
    name, num_layers, hidden_size, vocab_size, fingerprint = "other", 6, H, VT, "0123abcd"


def test_the_target_trained_against_must_be_the_captured_one(folder):
    path, _ = folder
    open_reader(path, FakeTarget())  # the same one: fine
    other = FakeTarget()
    other.fingerprint = "ffff0000"
    with pytest.raises(DataError, match="manifest.json.*fingerprint ffff0000 vs the data's 0123abcd"):
        open_reader(path, other)
    other = FakeTarget()
    other.hidden_size, other.num_layers = 2 * H, 3
    with pytest.raises(
        DataError, match=r"hidden size 16 vs the data's 8.*aux layers \[1, 2, 3\] outside its 3"
    ):
        open_reader(path, other)


# ---------------------------------------------------------------- capture from a real (tiny) target


@pytest.fixture(scope="module")
def tiny() -> Target:
    return Target.load("zoo:tiny-llama", dtype="float32", device="cpu")


def test_prepare_raw_text_matches_a_fresh_capture(tiny, tmp_path):
    data = {**DEFAULTS["data"], "corpus": "stdlib-code", "num_tokens": 300, "seq_len": 64,
            "batch_size": 3, "dtype": "float32", "shard_tokens": 128}
    path = capture.prepare(tiny, data, tmp_path / "code")
    reader = open_reader(path, tiny)
    assert reader.manifest["num_tokens"] >= 300 and len(reader.manifest["shards"]) >= 2
    assert reader.manifest["provenance"]["corpus"] == "stdlib-code"
    assert reader.aux_layer_ids == tiny.default_aux_layer_ids
    for sample in list(reader.samples())[:3]:
        assert sample["loss_mask"].all()  # raw text: every token is learnt
        fresh = tiny.capture(sample["input_ids"][None])
        # the stored sample was captured inside a padded batch: same values up to float rounding
        torch.testing.assert_close(
            sample["aux_hidden_states"], fresh.aux_hidden_states[0], rtol=1e-4, atol=1e-5
        )
        torch.testing.assert_close(
            sample["last_hidden_state"], fresh.last_hidden_state[0], rtol=1e-4, atol=1e-5
        )
    assert torch.equal(reader.head["lm_head.weight"], tiny.lm_head.weight)
    # the text is the training split's documents, in stream order (the pool is sorted by length)
    texts = [d.text for d in islice(corpora.split_documents("stdlib-code", "train"), 20)]
    assert all(any(tiny.tokenizer.decode(s["input_ids"]) in t for t in texts) for s in reader.samples())


def test_self_distilled_samples_learn_only_the_reply(tiny):
    generator = sources.self_distilled_samples(
        tiny, "pydoc-prose", seq_len=256, max_new_tokens=6, prompt_chars=120, batch_size=2
    )
    samples = [next(generator), next(generator)]
    docs = list(islice(corpora.split_documents("pydoc-prose", "train"), 2))
    for sample, doc in zip(samples, docs, strict=True):
        asked = f"{corpora.INSTRUCTIONS['pydoc-prose']}\n\n{corpora.opening(doc.text, 120)}"
        prompt = sources.chat_prompt_ids(tiny.tokenizer, [{"role": "user", "content": asked}])
        assert sample.input_ids[: len(prompt)].tolist() == prompt
        assert not sample.loss_mask[: len(prompt)].any() and sample.loss_mask[len(prompt) :].all()
        assert 1 <= len(sample.input_ids) - len(prompt) <= 6
    with pytest.raises(DataError, match="no room for a reply"):
        next(sources.self_distilled_samples(tiny, "pydoc-prose", seq_len=20, max_new_tokens=4,
                                            prompt_chars=400))


# ---------------------------------------------------------------- SpecForge and speculators dumps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.fixture
def head_file(tmp_path) -> Path:
    path = tmp_path / "target_head.safetensors"
    save_file(synthetic_head(), path, metadata={"rms_norm_eps": "1e-05"})
    return path


def write_specforge_dump(root: Path, samples) -> None:
    """As SpecForge's prepare_hidden_states.py saves: rows_<a>-<b>/data_<i>.ckpt dicts."""
    for i, s in enumerate(samples):
        folder = root / f"rows_{(i // 2) * 2}-{(i // 2) * 2 + 2}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "input_ids": s["input_ids"],
                "loss_mask": s["loss_mask"].long(),
                "hidden_state": s["last_hidden_state"][None],
                "aux_hidden_state": s["aux_hidden_states"][None],
            },
            folder / f"data_{i}.ckpt",
        )


def test_specforge_dump(tmp_path, head_file):
    samples = synthetic_samples([6, 9, 4])
    write_specforge_dump(tmp_path / "dump", samples)
    with pytest.raises(DataError, match="no target head"):
        list(open_reader(tmp_path / "dump").samples())
    reader = open_reader(tmp_path / "dump", head=head_file, aux_layer_ids=[1, 2, 3])
    assert (reader.format, reader.hidden_size, reader.num_samples, reader.vocab_size) == (
        "specforge",
        H,
        3,
        VT,
    )
    lm_head = synthetic_head()["lm_head.weight"]
    for got, want in zip(reader.samples(), samples, strict=True):
        assert torch.equal(got["aux_hidden_states"], want["aux_hidden_states"])
        assert torch.equal(got["last_hidden_state"], want["last_hidden_state"])  # SpecForge's is post-norm
        assert torch.equal(got["loss_mask"], want["loss_mask"]) and got["loss_mask"].dtype == torch.bool
        assert torch.equal(got["target_argmax"], (want["last_hidden_state"] @ lm_head.T).argmax(-1))
    batch = next(reader.batches(batch_size=3, seq_len=8, shuffle=False))
    assert batch["aux_hidden_states"].shape == (3, 8, A * H)
    expected = sum(torch.bincount(s["input_ids"][s["loss_mask"]], minlength=VT) for s in samples)
    assert torch.equal(reader.token_counts(), expected)


def test_specforge_dump_errors_name_the_file(tmp_path, head_file):
    samples = synthetic_samples([6, 9])
    write_specforge_dump(tmp_path / "dump", samples)
    bad = tmp_path / "dump" / "rows_0-2" / "data_1.ckpt"
    torch.save(
        {
            "input_ids": samples[1]["input_ids"],
            "loss_mask": samples[1]["loss_mask"],
            "hidden_state": samples[1]["last_hidden_state"][None],
            "aux_hidden_state": samples[1]["aux_hidden_states"][None, :, : 2 * H],
        },
        bad,
    )
    with pytest.raises(DataError, match="data_1.ckpt: hidden states of widths 8 / 16"):
        list(open_reader(tmp_path / "dump", head=head_file).samples())
    torch.save({"input_ids": samples[1]["input_ids"]}, bad)
    with pytest.raises(DataError, match="data_1.ckpt: a SpecForge sample needs keys"):
        list(open_reader(tmp_path / "dump", head=head_file).samples())
    with pytest.raises(DataError, match="holds 3 aux states per token"):
        open_reader(tmp_path / "dump", head=head_file, aux_layer_ids=[1, 2])


def test_speculators_dump(tmp_path, head_file):
    samples = synthetic_samples([5, 8])
    dump = tmp_path / "hidden_states"
    dump.mkdir()
    pre_norm = [
        torch.randn(len(s["input_ids"]), H, generator=torch.Generator().manual_seed(i))
        for i, s in enumerate(samples)
    ]
    for i, (s, last) in enumerate(zip(samples, pre_norm, strict=True)):
        states = torch.cat([s["aux_hidden_states"].reshape(-1, A, H), last[:, None]], dim=1)  # [T, 4, H]
        save_file({"hidden_states": states, "token_ids": s["input_ids"]}, dump / f"hs_{i}.safetensors")
    with pytest.raises(DataError, match="hs_0.safetensors: no loss_mask.*assume_full_loss_mask"):
        list(open_reader(dump, head=head_file).samples())
    reader = open_reader(dump, head=head_file, assume_full_loss_mask=True)
    assert (reader.format, reader.num_aux_layers, reader.hidden_size) == ("speculators", 3, H)
    head = synthetic_head()
    for got, want, last in zip(reader.samples(), samples, pre_norm, strict=True):
        assert torch.equal(got["aux_hidden_states"], want["aux_hidden_states"])
        assert got["loss_mask"].all()
        normed = rms_norm(last, head["norm.weight"], 1e-5)  # speculators stores it before the final norm
        torch.testing.assert_close(got["last_hidden_state"], normed, rtol=1e-6, atol=1e-6)
        assert torch.equal(
            got["target_argmax"], (got["last_hidden_state"] @ head["lm_head.weight"].T).argmax(-1)
        )
    save_file(
        {"hidden_states": torch.zeros(4, H), "token_ids": torch.zeros(4, dtype=torch.long)},
        dump / "hs_2.safetensors",
    )
    with pytest.raises(DataError, match=r"hs_2.safetensors: hidden_states has shape \[4, 8\]"):
        list(open_reader(dump, head=head_file, assume_full_loss_mask=True).samples())
