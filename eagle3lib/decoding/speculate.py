"""Speculative decoding with a Hugging Face target and an EAGLE-3 drafter, measured as the engines count it.

One round, as SGLang and vLLM run EAGLE-3:
1. draft: the drafter appends to its KV cache the rows the last verification committed (the target's aux
   hidden states of the accepted positions, each paired with the token that followed), then grows a tree
   from its last row, feeding its own `layer_out` back: EAGLE-2 style, the top-k children of each of the
   k best nodes per level for `steps` levels, of which the `num_draft_tokens - 1` most probable are kept
   (a chain is the tree with topk 1 and num_draft_tokens = steps + 1).
2. verify: the target scores the whole tree in one forward pass over its KV cache (tree attention mask,
   position = depth), accepts the longest path it agrees with plus one token of its own (the bonus), and
   both KV caches are cut back to the committed tokens.

Between rounds the target cache holds every committed token but the last one (the "root", fed with the
next verification), and the drafter cache holds one row per target cache entry: row t pairs the target's
aux state at position t with token t+1 and carries position id t+1, as in training (docs/formats.md §1).

Prompts decode in batches (`SpeculativeDecoder.generate_batch`): the target and the drafter each keep one
KV cache for the batch (`decoding.batches`), every sequence accepts its own number of drafts per round, and
finished sequences leave the batch. A sequence computes what it would alone, so τ and the outputs do not
depend on the batch size; speed does.

Measuring a drafter with this (prompts in batches, the target-only baseline, τ and speed) is
`eagle3lib.decoding.probe`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedModel

from eagle3lib.decoding.batches import (
    DrafterBatch,
    PrefillCache,
    RecordedTarget,
    Recording,
    TargetBatch,
    sync,
)
from eagle3lib.drafter.config import default_aux_layer_ids
from eagle3lib.target.model import fast_argmax

# ---------------------------------------------------------------- checks before any decoding


def check_compatible(
    drafter_config,
    *,
    target_vocab_size: int,
    target_hidden_size: int,
    target_num_layers: int,
    drafter_name: str = "drafter",
    target_name: str = "target",
) -> None:
    """Refuse a drafter/target pair that cannot speculate together, naming the mismatch."""
    problems = []
    if drafter_config.vocab_size != target_vocab_size:
        problems.append(
            f"vocab_size (Vt): {drafter_name} has {drafter_config.vocab_size}, "
            f"{target_name} has {target_vocab_size}"
        )
    if drafter_config.target_hidden_size != target_hidden_size:
        problems.append(
            f"target_hidden_size: {drafter_name} expects {drafter_config.target_hidden_size}, "
            f"{target_name} hidden_size is {target_hidden_size}"
        )
    aux_ids = drafter_config.aux_layer_ids
    outside = [i for i in aux_ids or [] if not 0 <= i < target_num_layers]
    if outside:
        problems.append(
            f"aux_layer_ids {list(aux_ids)} of {drafter_name}: {outside} outside the "
            f"{target_num_layers} decoder layers (0..{target_num_layers - 1}) of {target_name}"
        )
    if problems:
        raise ValueError("drafter and target do not fit: " + "; ".join(problems))


def aux_layer_ids_for(drafter_config, target_num_layers: int) -> list[int]:
    """The drafter's aux ids, or EAGLE-3's default for the target when its config names none."""
    ids = drafter_config.aux_layer_ids
    return list(ids) if ids is not None else default_aux_layer_ids(target_num_layers)


def check_pair(model: PreTrainedModel, drafter) -> None:
    """`check_compatible` for loaded models, plus the draft vocab and the embedding the drafter will use."""
    text_config = model.config.get_text_config()
    check_compatible(
        drafter.config,
        target_vocab_size=model.get_output_embeddings().weight.shape[0],
        target_hidden_size=text_config.hidden_size,
        target_num_layers=text_config.num_hidden_layers,
    )
    draft_ids = drafter.draft_to_target(torch.arange(len(drafter.d2t), device=drafter.d2t.device))
    if draft_ids.min() < 0 or draft_ids.max() >= drafter.config.vocab_size:
        raise ValueError(
            f"drafter d2t maps draft ids to target ids {draft_ids.min().item()}..{draft_ids.max().item()}, "
            f"outside the target vocab 0..{drafter.config.vocab_size - 1}"
        )
    embedding = model.get_input_embeddings().weight
    if embedding.shape != (drafter.config.vocab_size, drafter.config.hidden_size):
        raise ValueError(
            f"the target's embed_tokens {list(embedding.shape)} does not fit the drafter "
            f"(vocab_size {drafter.config.vocab_size}, hidden_size {drafter.config.hidden_size})"
        )


# ---------------------------------------------------------------- the draft tree


@dataclass
class DraftTree:
    """Node 0 is the root (the last committed token); parents precede their children."""

    tokens: Tensor  # [N] target ids
    parents: list[int]  # parent node of each node, -1 for the root
    depths: Tensor  # [N] 0 for the root
    draft_probs: Tensor | None  # [N, Vt] distribution each node was sampled from; None: chosen by top-k

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def is_chain(self) -> bool:
        return all(parent == node - 1 for node, parent in enumerate(self.parents))

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                kids[parent].append(node)
        return kids

    def ancestor_mask(self) -> Tensor:
        """[N, N] bool: row i is True at i and at each ancestor of i (what node i may attend to)."""
        mask = torch.eye(len(self), dtype=torch.bool)
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                mask[node] |= mask[parent]
        return mask


def sample_rows(logits: Tensor, temperature: float, generators: list[torch.Generator | None]) -> Tensor:
    """One token per row of logits [B, V], greedy (temperature 0) or sampled, row b with its own generator
    (so a row's token does not depend on the batch around it): one uniform draw a row, then every row's
    inverse CDF at once. A multinomial a row took about 40 % of a batch-256 decoding step on a CPU.

    The CDF is a float32 cumulative sum: a token whose probability is below half a float32 step of the sum
    before it (< 3e-8 once the sum passes 0.5) is never drawn, nor is one of probability 0."""
    if temperature == 0:
        return fast_argmax(logits)
    if len(generators) != logits.shape[0]:
        raise ValueError(f"{len(generators)} generators for {logits.shape[0]} rows of logits: give one a row")
    cdf = torch.softmax(logits.float() / temperature, -1).cumsum_(-1)
    total = cdf[:, -1:]
    if not torch.isfinite(total).all():
        rows = (~torch.isfinite(total[:, 0])).nonzero()[:, 0].tolist()
        raise ValueError(f"logits rows {rows} have no finite softmax at temperature {temperature}: "
                         "nothing to sample")
    draws = torch.cat([torch.rand(1, generator=g, device=logits.device if g is None else g.device)
                       for g in generators]).to(cdf.device)[:, None]
    # strictly below the total: the first column whose sum exceeds the draw then exists, and its token added
    # to the sum, so it has a probability above 0
    below = torch.minimum(draws * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, below, right=True)[:, 0]


@dataclass
class DraftSettings:
    """SGLang's `steps / topk / num_draft_tokens`; chain drafting is topk 1, num_draft_tokens steps + 1."""

    steps: int = 3
    topk: int = 1
    num_draft_tokens: int | None = None  # None: steps + 1 for a chain, 1 + topk * steps for a tree
    temperature: float = 0.0
    # temperature > 0 with a chain: sample drafts from the drafter and verify against its probabilities
    # (Leviathan et al.); False: take its top-1 and verify as a point mass, as SGLang and vLLM do.
    sample_drafts: bool = True

    def __post_init__(self) -> None:
        if self.steps < 1 or self.topk < 1:
            raise ValueError(f"steps ({self.steps}) and topk ({self.topk}) must be at least 1")
        if self.num_draft_tokens is None:
            self.num_draft_tokens = self.steps + 1 if self.topk == 1 else 1 + self.topk * self.steps
        most = 1 + self.topk + (self.steps - 1) * self.topk**2
        if not 2 <= self.num_draft_tokens <= most:
            raise ValueError(
                f"num_draft_tokens {self.num_draft_tokens} must be in 2..{most} for steps {self.steps}, "
                f"topk {self.topk} (the root plus at most that many candidates)"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @classmethod
    def from_probe(cls, probe: dict) -> DraftSettings:
        """The decoding a recipe's `probe` section asks for (01, and 05 for every drafter)."""
        return cls(steps=probe["steps"], topk=probe["topk"], num_draft_tokens=probe["num_draft_tokens"],
                   temperature=probe["temperature"])

    @property
    def samples_drafts(self) -> bool:
        return self.temperature > 0 and self.topk == 1 and self.sample_drafts


# ---------------------------------------------------------------- drafting


def draft_trees(
    batch: DrafterBatch,
    root_tokens: Tensor,
    root_logits: Tensor,
    root_layer_out: Tensor,
    root_positions: Tensor,
    settings: DraftSettings,
    generators: list[torch.Generator | None],
) -> list[DraftTree]:
    """Grow each sequence's candidate tree from its last committed drafter row; the cache is left as found.

    Each level feeds the k best nodes of the previous one (token, the layer_out of the row that proposed it,
    position = root position + depth) with a mask that lets each see its sequence's committed rows, its
    ancestors' rows and itself. Candidates are ranked by cumulative log-probability; ties go to the
    shallower node, so the kept set always contains each kept node's parent. Every sequence has the same
    number of candidates per level (only their parents differ), so the levels are [B, ...] tensors.
    """
    drafter, cache = batch.drafter, batch.cache
    device = root_logits.device
    size, committed = len(root_tokens), len(cache)
    propose = ChildProposer(drafter, settings, generators)
    ids, child_scores, q = propose(root_logits[:, None], torch.zeros(size, 1, device=device))
    candidates = Candidates.first_level(propose.draft_ids[ids.flatten(1)], child_scores, q, settings)
    first = ids.shape[-1]
    frontier = torch.arange(first).expand(size, first)
    frontier_hidden = root_layer_out[:, None].expand(size, first, root_layer_out.shape[-1])
    for depth in range(2, settings.steps + 1):
        width = frontier.shape[1]
        fed = (depth - 2) * width  # drafter rows the earlier levels of this tree added to the cache
        allowed = candidates.attention_mask(frontier, batch.valid, fed)
        positions = (root_positions + depth - 1)[:, None].expand(size, width)
        logits, layer_out = drafter.step(
            candidates.tokens.gather(1, frontier.to(device)), frontier_hidden, positions.to(device), cache,
            attention_mask=allowed.to(device),
        )
        candidates.mark_fed(frontier, fed)
        ids, child_scores, q = propose(logits, candidates.scores.gather(1, frontier.to(device)))
        count = candidates.add(frontier, propose.draft_ids[ids.flatten(1)], child_scores, q, depth)
        # the next frontier: each sequence's k best children (a chain: its only child)
        children = ids.shape[-1]
        best = child_scores.flatten(1).topk(min(settings.topk, width * children), dim=1).indices.cpu()
        frontier = count + best
        frontier_hidden = layer_out[torch.arange(size)[:, None], (best // children).to(device)]
    cache.crop(committed)
    return candidates.trees(root_tokens, settings.num_draft_tokens - 1)


class ChildProposer:
    """The children the drafter proposes from logits [B, m, Vd]: its top-k (or, sampling a chain, one child
    drawn from each sequence's own generator), with their cumulative log-probabilities."""

    def __init__(self, drafter, settings: DraftSettings, generators: list[torch.Generator | None]):
        self.settings, self.generators = settings, generators
        self.vocab = drafter.config.vocab_size
        self.draft_ids = drafter.draft_to_target(torch.arange(len(drafter.d2t), device=drafter.d2t.device))

    def __call__(self, logits: Tensor, parent_scores: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """(draft ids [B, m, c], scores [B, m, c], the distribution they were drawn from over target ids
        [B, m, Vt] or None when chosen by top-k)."""
        logp = torch.log_softmax(logits.float(), -1)
        if self.settings.samples_drafts:  # a chain (m = 1)
            q = torch.softmax(logits.float() / self.settings.temperature, -1)
            ids = torch.stack([torch.multinomial(row, 1, generator=generator)
                               for row, generator in zip(q, self.generators, strict=True)])
            q_target = q.new_zeros(*q.shape[:2], self.vocab).index_copy_(2, self.draft_ids, q)
            return ids, parent_scores[..., None] + logp.gather(2, ids), q_target
        top, ids = logp.topk(self.settings.topk, dim=-1)
        return ids, parent_scores[..., None] + top, None


@dataclass
class Candidates:
    """Every candidate drafted so far for B sequences, in creation order (parents before children)."""

    tokens: Tensor  # [B, M] target ids
    scores: Tensor  # [B, M] cumulative log-probabilities
    parent: Tensor  # [B, most] parent candidate, -1 for a child of the root
    row_of: Tensor  # [B, most] the drafter row it was fed as, beyond the committed ones (-1: not fed)
    depths: list[int]  # per candidate, the same for every sequence
    probs: Tensor | None  # [B, M, Vt] what each was drawn from (sampled chains), else None

    @classmethod
    def first_level(cls, tokens: Tensor, child_scores: Tensor, q: Tensor | None, settings: DraftSettings
                    ) -> Candidates:
        size, first = tokens.shape
        most = first + (settings.steps - 1) * settings.topk * first
        return cls(
            tokens=tokens, scores=child_scores.flatten(1),
            parent=torch.full((size, most), -1, dtype=torch.long),
            row_of=torch.full((size, most), -1, dtype=torch.long),
            depths=[1] * first, probs=q.expand(size, first, q.shape[-1]) if q is not None else None,
        )

    def attention_mask(self, frontier: Tensor, valid: Tensor, fed: int) -> Tensor:
        """bool [B, width, committed + fed + width] for feeding `frontier`: each node sees its sequence's
        committed rows (`valid`), the rows its ancestors were fed as, and itself."""
        size, width = frontier.shape
        committed = valid.shape[1]
        allowed = torch.zeros(size, width, committed + fed + width, dtype=torch.bool)
        allowed[:, :, :committed] = valid[:, None, :]
        ancestor = self.parent.gather(1, frontier)
        while (ancestor >= 0).any():
            b, i = (ancestor >= 0).nonzero(as_tuple=True)
            allowed[b, i, committed + self.row_of[b, ancestor[b, i]]] = True
            ancestor = torch.where(ancestor >= 0, self.parent.gather(1, ancestor.clamp(min=0)), ancestor)
        allowed[:, torch.arange(width), committed + fed + torch.arange(width)] = True
        return allowed

    def mark_fed(self, frontier: Tensor, fed: int) -> None:
        """Record the drafter rows the frontier's nodes were fed as, after the `fed` of earlier levels."""
        size, width = frontier.shape
        self.row_of.scatter_(1, frontier, (fed + torch.arange(width)).expand(size, width).contiguous())

    def add(
        self, frontier: Tensor, tokens: Tensor, child_scores: Tensor, q: Tensor | None, depth: int
    ) -> int:
        """Append the children (tokens [B, width * c]) of the frontier's nodes; returns the first's index."""
        size, width, children = child_scores.shape
        count = self.tokens.shape[1]
        self.tokens = torch.cat([self.tokens, tokens], dim=1)
        self.scores = torch.cat([self.scores, child_scores.flatten(1)], dim=1)
        born = frontier[:, :, None].expand(size, width, children).flatten(1)
        self.parent[:, count : count + born.shape[1]] = born
        self.depths += [depth] * (width * children)
        if q is not None:
            self.probs = torch.cat([self.probs, q], dim=1)
        return count

    def trees(self, root_tokens: Tensor, keep: int) -> list[DraftTree]:
        """Each sequence's tree: the root and its `keep` best candidates, parents before children."""
        size, device = len(root_tokens), self.tokens.device
        order = torch.sort(self.scores, dim=1, descending=True, stable=True).indices[:, :keep].cpu()
        chosen = order.sort(dim=1).values  # creation order: parents before children
        node_of = torch.full((size, self.tokens.shape[1]), -1, dtype=torch.long)
        node_of.scatter_(1, chosen, torch.arange(1, keep + 1).expand(size, keep).contiguous())
        chosen_parent = self.parent[:, : self.tokens.shape[1]].gather(1, chosen)
        tree_parent = torch.where(chosen_parent >= 0, node_of.gather(1, chosen_parent.clamp(min=0)), 0)
        if (tree_parent < 0).any():
            raise RuntimeError("draft tree selection kept a candidate without its parent")
        roots = root_tokens[:, None].to(device)
        tree_tokens = torch.cat([roots, self.tokens.gather(1, chosen.to(device))], dim=1)
        root_depths = torch.zeros(size, 1, dtype=torch.long)
        tree_depths = torch.cat([root_depths, torch.tensor(self.depths)[chosen]], dim=1)
        probs = None
        if self.probs is not None:
            probs = self.probs[torch.arange(size)[:, None], chosen.to(device)]
            probs = torch.cat([torch.zeros_like(probs[:, :1]), probs], dim=1)
        return [
            DraftTree(
                tokens=tree_tokens[b], parents=[-1] + tree_parent[b].tolist(), depths=tree_depths[b],
                draft_probs=probs[b] if probs is not None else None,
            )
            for b in range(size)
        ]


# ---------------------------------------------------------------- verification


def rejection_sample(
    p: Tensor, candidates: list[int], candidate_probs: Tensor | None, generator: torch.Generator | None
) -> tuple[int | None, int]:
    """One tree node of sampled verification: (index of the accepted candidate or None, token).

    Candidate i was drawn from `candidate_probs[i]` ([m, V]; None: chosen deterministically, i.e. a point
    mass on it). Accept it with probability min(1, p/q); on rejection continue with the residual
    norm(max(p - q, 0)); if all are rejected, sample the residual. The returned token is distributed
    exactly as p whatever the drafts (recursive rejection sampling, SpecInfer / EAGLE).
    """
    p = p.float()
    for i, token in enumerate(candidates):
        if candidate_probs is None:
            q = torch.zeros_like(p)
            q[token] = 1.0
        else:
            q = candidate_probs[i].float()
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[token] < p[token]:
            return i, token
        p = torch.clamp(p - q, min=0.0)
        p = p / p.sum()
    return None, int(torch.multinomial(p, 1, generator=generator))


def accept_greedy(tree: DraftTree, choice: list[int]) -> tuple[list[int], int]:
    """Walk the tree along the target's greedy choice at each node: (accepted nodes from the root, bonus
    token)."""
    children = tree.children()
    tokens = tree.tokens.tolist()
    path = [0]
    while True:
        node = path[-1]
        match = [c for c in children[node] if tokens[c] == choice[node]]
        if not match:
            return path, choice[node]
        path.append(match[0])


def accept_sampled(
    tree: DraftTree, logits: Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Walk the tree against the target's logits [N, Vt] by rejection sampling: (accepted nodes from the root,
    bonus token)."""
    children = tree.children()
    tokens = tree.tokens.tolist()
    path = [0]
    while True:
        node = path[-1]
        kids = children[node]
        p = torch.softmax(logits[node].float() / temperature, -1)
        kid_probs = tree.draft_probs[kids] if tree.draft_probs is not None and kids else None
        accepted, token = rejection_sample(p, [tokens[c] for c in kids], kid_probs, generator)
        if accepted is None:
            return path, token
        path.append(kids[accepted])


# ---------------------------------------------------------------- decoding


@dataclass
class Generation:
    """One prompt's output and how it was accepted."""

    tokens: list[int]  # new tokens, prompt excluded
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted at each verification


@dataclass
class BatchOutput:
    """Prompts decoded together, and what the batch cost (its rounds are shared by its sequences)."""

    generations: list[Generation]
    seconds: dict[str, float]  # prefill, draft, verify (speculative) or decode (target only), total
    rounds: int  # forward passes after the prefill: verifications, or target-only decoding steps
    recordings: list[Recording] | None = None  # target only, asked for: what speculation replays against


def _stops(eos_token_id: int | Iterable[int] | None) -> frozenset[int]:
    """The token ids a sequence ends at: one id, several (a generation config's list), or none."""
    if eos_token_id is None:
        return frozenset()
    return frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)


def _finish(tokens: list[int], max_new_tokens: int, eos_token_id: int | Iterable[int] | None) -> list[int]:
    tokens = tokens[:max_new_tokens]
    stops = _stops(eos_token_id)
    end = next((i for i, token in enumerate(tokens) if token in stops), None)
    return tokens if end is None else tokens[: end + 1]


def _done(tokens: list[int], max_new_tokens: int, eos_token_id: int | Iterable[int] | None) -> bool:
    return len(tokens) >= max_new_tokens or not _stops(eos_token_id).isdisjoint(tokens)


def _generators(generators: list[torch.Generator | None] | None, count: int) -> list[torch.Generator | None]:
    if generators is None:
        return [None] * count
    if len(generators) != count:
        raise ValueError(f"{len(generators)} generators for {count} prompts: give one per prompt")
    return list(generators)


@torch.no_grad()
def decode_target_only(
    model: PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_id: int | Iterable[int] | None = None,
    generators: list[torch.Generator | None] | None = None,
    reuse: PrefillCache | None = None,
    record: tuple[list[int], int] | None = None,
    compiled: bool = False,
) -> BatchOutput:
    """Plain autoregressive decoding of a batch with a KV cache: the baseline speculation has to beat.

    `record` = (aux layer ids, overrun) also keeps each sequence's `Recording`, decoded `overrun` tokens past
    its end (replayed drafts may reach beyond it). `compiled`: the decoding steps through one compiled graph
    of a Llama-like target (`target.direct.DirectDecoder`; the first step of a process compiles it, about a
    minute for SmolLM2-135M on 2 cores)."""
    generators = _generators(generators, len(prompts))
    device = model.device
    aux_layer_ids, overrun = record or ([], 0)
    batch = TargetBatch(model, aux_layer_ids=aux_layer_ids, compiled=compiled)
    logits, aux, prefill = batch.prefill(prompts, reuse)
    start = time.perf_counter()
    tokens = [[token] for token in sample_rows(logits, temperature, generators).tolist()]
    states = [[aux[b, aux.shape[1] - len(p):]] for b, p in enumerate(prompts)] if record else None
    active, rounds = list(range(len(prompts))), 0
    one = torch.ones(1, 1, 1, dtype=torch.bool)
    while True:
        ended = [t[: max(0, len(t) - overrun)] for t in tokens] if overrun else tokens  # without the overrun
        still = [i for i, seq in enumerate(active) if not _done(ended[seq], max_new_tokens, eos_token_id)]
        if not still:
            break
        if len(still) < len(active):
            batch.select(torch.tensor(still))
            active = [active[i] for i in still]
        last = torch.tensor([[tokens[seq][-1]] for seq in active])
        depth = torch.zeros(len(active), 1, dtype=torch.long)
        logits, aux = batch.verify(last, one.expand(len(active), 1, 1), depth)
        if states is not None:
            for i, seq in enumerate(active):
                states[seq].append(aux[i])
        # one device sync for the batch, not one a sequence (a GPU)
        chosen = sample_rows(logits[:, -1], temperature, [generators[seq] for seq in active]).tolist()
        for i, seq in enumerate(active):
            tokens[seq].append(chosen[i])
        batch.commit(torch.ones(len(active), 1, dtype=torch.bool))
        rounds += 1
    sync(device)
    total = prefill + time.perf_counter() - start
    return BatchOutput(
        generations=[Generation(tokens=_finish(t, max_new_tokens, eos_token_id)) for t in tokens],
        seconds={"prefill": prefill, "decode": total - prefill, "total": total},
        rounds=rounds,
        recordings=None if states is None else [
            Recording(prompt, t, torch.cat(s), aux_layer_ids, overrun)
            for prompt, t, s in zip(prompts, tokens, states, strict=True)
        ],
    )


def generate_target_only(
    model: PreTrainedModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_id: int | Iterable[int] | None = None,
    generator: torch.Generator | None = None,
) -> Generation:
    """`decode_target_only` for one prompt."""
    out = decode_target_only(model, [prompt_ids], max_new_tokens, temperature, eos_token_id, [generator])
    return out.generations[0]


class SpeculativeDecoder:
    """A target (HF CausalLM) and an EAGLE-3 drafter decoding together; see the module docstring."""

    def __init__(self, model: PreTrainedModel, drafter, settings: DraftSettings, compiled: bool = False):
        """`compiled`: the target's verifications through one compiled graph, as `decode_target_only`'s
        steps (a Llama-like target; the first verification of a process compiles it)."""
        check_pair(model, drafter)
        # the engines embed draft inputs with the target's embedding, even when the checkpoint carries a copy
        drafter.attach_embedding(model.get_input_embeddings())
        self.model = model.eval()
        self.drafter = drafter.eval()
        self.settings, self.compiled = settings, compiled
        num_layers = model.config.get_text_config().num_hidden_layers
        self.aux_layer_ids = aux_layer_ids_for(drafter.config, num_layers)

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        eos_token_id: int | Iterable[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> Generation:
        """`generate_batch` for one prompt."""
        return self.generate_batch([prompt_ids], max_new_tokens, eos_token_id, [generator]).generations[0]

    @torch.no_grad()
    def generate_batch(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        eos_token_id: int | Iterable[int] | None = None,
        generators: list[torch.Generator | None] | None = None,
        reuse: PrefillCache | None = None,
        recordings: list[Recording] | None = None,
    ) -> BatchOutput:
        """Decode prompts together; each sequence accepts its own number of drafts per round and leaves the
        batch when it is done. Sequence b draws its random numbers from `generators[b]` in the order it would
        alone, so a batch gives each prompt what decoding it alone gives. `reuse` keeps and reuses the
        target's prefill of these prompts. `recordings` (greedy only): the target's recorded decoding of the
        prompts answers every verification (`RecordedTarget`) and the target computes nothing."""
        settings, device, eos = self.settings, self.model.device, eos_token_id
        temperature = settings.temperature
        if recordings is not None and temperature != 0:
            raise ValueError(f"replaying recordings needs greedy decoding; temperature is {temperature}")
        generators = _generators(generators, len(prompts))
        drafter_dtype = next(self.drafter.parameters()).dtype
        if recordings is None:
            target = TargetBatch(self.model, self.aux_layer_ids, compiled=self.compiled)
        else:
            target = RecordedTarget(recordings)
        drafter = DrafterBatch(self.drafter)
        logits, aux, prefill = target.prefill(prompts, reuse)
        seconds = {"prefill": prefill, "draft": 0.0, "verify": 0.0}
        start = time.perf_counter()
        if target.gives_choices:
            roots = logits.tolist()
        else:
            roots = sample_rows(logits, temperature, generators).tolist()
        tokens = [[root] for root in roots]
        accepted: list[list[int]] = [[] for _ in prompts]
        # rows the drafter has not seen yet, per batch row: aux state of position t with token t+1, position
        # id t+1 (from `first_position` on), as in training
        pending_ids = [list(p[1:]) + [root] for p, root in zip(prompts, roots, strict=True)]
        pending_aux = [aux[b, aux.shape[1] - len(p) :] for b, p in enumerate(prompts)]
        first_position = [1] * len(prompts)
        active, rounds = list(range(len(prompts))), 0

        while True:
            still = [i for i, seq in enumerate(active) if not _done(tokens[seq], max_new_tokens, eos)]
            if not still:
                break
            if len(still) < len(active):
                rows = torch.tensor(still)
                target.select(rows)
                drafter.select(rows)
                active, roots = [active[i] for i in still], [roots[i] for i in still]
                pending_ids = [pending_ids[i] for i in still]
                pending_aux = [pending_aux[i] for i in still]
                first_position = [first_position[i] for i in still]
            tick = time.perf_counter()
            size, width = len(active), max(len(p) for p in pending_ids)
            ids = torch.zeros(size, width, dtype=torch.long)
            hidden = pending_aux[0].new_zeros(size, width, pending_aux[0].shape[-1])
            positions = torch.zeros(size, width, dtype=torch.long)
            rows_valid = torch.zeros(size, width, dtype=torch.bool)
            for i, (row_ids, row_aux) in enumerate(zip(pending_ids, pending_aux, strict=True)):
                n = len(row_ids)
                ids[i, :n], hidden[i, :n], rows_valid[i, :n] = torch.tensor(row_ids), row_aux, True
                positions[i, :n] = torch.arange(first_position[i], first_position[i] + n)
            draft_logits, layer_out = drafter.feed(
                ids.to(device), hidden.to(drafter_dtype), positions.to(device), rows_valid
            )
            trees = draft_trees(
                drafter, torch.tensor(roots), draft_logits, layer_out, target.lengths, settings,
                [generators[seq] for seq in active],
            )
            sync(device)
            tock = time.perf_counter()
            seconds["draft"] += tock - tick

            logits, aux = target.verify(
                torch.stack([t.tokens for t in trees]), torch.stack([t.ancestor_mask() for t in trees]),
                torch.stack([t.depths for t in trees]).cpu(),
            )
            if temperature == 0:  # the target's choice at every node: one argmax for the batch
                choices = (logits if target.gives_choices else fast_argmax(logits)).tolist()
            kept = torch.zeros(size, len(trees[0]), dtype=torch.bool)
            for i, (seq, tree) in enumerate(zip(active, trees, strict=True)):
                if temperature == 0:
                    path, bonus = accept_greedy(tree, choices[i])
                else:
                    path, bonus = accept_sampled(tree, logits[i], temperature, generators[seq])
                kept[i, path] = True
                new = tree.tokens[path[1:]].tolist() + [bonus]
                accepted[seq].append(len(path) - 1)
                tokens[seq] += new
                pending_ids[i], pending_aux[i] = new, aux[i, path]
                first_position[i] = int(target.lengths[i]) + 1
                roots[i] = bonus
            target.commit(kept)
            rounds += 1
            sync(device)
            seconds["verify"] += time.perf_counter() - tock
        seconds["total"] = prefill + time.perf_counter() - start
        generations = [
            Generation(tokens=_finish(t, max_new_tokens, eos_token_id), accepted=a)
            for t, a in zip(tokens, accepted, strict=True)
        ]
        return BatchOutput(generations=generations, seconds=seconds, rounds=rounds)
