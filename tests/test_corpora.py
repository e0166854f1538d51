"""The corpora on every machine: offline, split by a hash of each id, disjoint and deterministic."""

from __future__ import annotations

from itertools import islice

import pytest

from eagle3lib.data import corpora


@pytest.mark.parametrize("corpus", corpora.CORPORA)
def test_corpus_splits_are_disjoint_and_deterministic(corpus):
    train = list(islice(corpora.split_documents(corpus, "train"), 60))
    heldout = list(islice(corpora.split_documents(corpus, "heldout"), 6))
    assert len(train) == 60 and len(heldout) == 6
    assert not {d.id for d in train} & {d.id for d in heldout}
    assert [d.id for d in islice(corpora.split_documents(corpus, "train"), 60)] == [d.id for d in train]
    # the split of a document does not depend on the stream order (seed)
    reseeded = list(islice(corpora.split_documents(corpus, "heldout", seed=7), 6))
    assert all(corpora.is_heldout(d.id, 0.1) for d in reseeded)
    assert [d.id for d in reseeded] != [d.id for d in heldout]


def test_heldout_prompts(monkeypatch):
    prompts = corpora.heldout_prompts("stdlib-code", 8, max_chars=300)
    assert len(prompts) == 8 and all(0 < len(p) <= 300 for p in prompts)
    assert corpora.heldout_prompts("stdlib-code", 8, max_chars=300) == prompts
    train_texts = {d.text[:300] for d in islice(corpora.split_documents("stdlib-code", "train"), 500)}
    assert not any(p in train_texts for p in prompts)
    prose = corpora.heldout_prompts("pydoc-prose", 4)
    assert all(p.count(" ") > 10 for p in prose)  # sentences, not code
    monkeypatch.setattr(corpora, "split_documents", lambda *a, **k: iter([corpora.Document("x", "only one")]))
    with pytest.raises(ValueError, match="only 1 held-out"):
        corpora.heldout_prompts("stdlib-code", 2)


def test_unknown_corpus():
    with pytest.raises(corpora.CorpusError, match="stdlib-code"):
        next(corpora.documents("wikipedia"))
