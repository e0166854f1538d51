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
aux state at position t with token t+1 and carries position id t+1, as in training (FORMATS.md §1).

Prompts are decoded one at a time (batch 1), the setting in which engines report τ per request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from eagle3lib.config import default_aux_layer_ids

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


def select_tokens(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """Greedy (temperature 0) or sampled next token(s) from logits [..., V]."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
    return flat.reshape(probs.shape[:-1])


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

    @property
    def samples_drafts(self) -> bool:
        return self.temperature > 0 and self.topk == 1 and self.sample_drafts


def draft_tree(
    drafter,
    cache,
    root_token: int,
    root_logits: Tensor,
    root_layer_out: Tensor,
    root_position: int,
    settings: DraftSettings,
    generator: torch.Generator | None = None,
) -> DraftTree:
    """Grow the candidate tree from the drafter's last committed row; the drafter cache is left as found.

    Each level feeds the k best nodes of the previous one (token, the layer_out of the row that proposed it,
    position = root_position + depth) with a mask that lets each see the committed cache, its ancestors'
    rows and itself. Candidates are ranked by cumulative log-probability; ties go to the shallower node, so
    the kept set always contains each kept node's parent.
    """
    committed = len(cache)
    draft_ids = drafter.draft_to_target(torch.arange(len(drafter.d2t), device=root_logits.device))
    vocab = drafter.config.vocab_size
    k = settings.topk
    # candidates, in order of creation (hence by depth): target token, parent candidate (-1 = root), score
    tokens: list[Tensor] = []
    parents: list[int] = []
    scores: list[Tensor] = []
    depths: list[int] = []
    probs: list[Tensor] = []

    def propose(logits: Tensor, parent_scores: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Children of each row of logits [m, Vd]: draft ids [m, c], scores [m, c], their q in target ids."""
        logp = torch.log_softmax(logits.float(), -1)
        if settings.samples_drafts:
            q = torch.softmax(logits.float() / settings.temperature, -1)
            ids = torch.multinomial(q, 1, generator=generator)
            q_target = q.new_zeros(q.shape[0], vocab).index_copy_(1, draft_ids, q)
            return ids, parent_scores[:, None] + logp.gather(1, ids), q_target
        top, ids = logp.topk(k, dim=-1)
        return ids, parent_scores[:, None] + top, None

    ids, child_scores, q = propose(root_logits[None], root_logits.new_zeros(1, dtype=torch.float))
    frontier = []
    for j in range(ids.shape[1]):
        frontier.append(len(tokens))
        tokens.append(draft_ids[ids[0, j]])
        parents.append(-1)
        scores.append(child_scores[0, j])
        depths.append(1)
        if q is not None:
            probs.append(q[0])
    frontier_hidden = root_layer_out[None].expand(len(frontier), -1)
    row_of: dict[int, int] = {}  # candidate → its row in the drafter cache (beyond `committed`)

    for depth in range(2, settings.steps + 1):
        fed = len(row_of)
        mask = torch.zeros(len(frontier), committed + fed + len(frontier), dtype=torch.bool)
        mask[:, :committed] = True
        for i, node in enumerate(frontier):
            ancestor = parents[node]
            while ancestor >= 0:
                mask[i, committed + row_of[ancestor]] = True
                ancestor = parents[ancestor]
            mask[i, committed + fed + i] = True
        positions = torch.full((1, len(frontier)), root_position + depth - 1, device=root_logits.device)
        logits, layer_out = drafter.step(
            torch.stack([tokens[n] for n in frontier])[None],
            frontier_hidden[None],
            positions,
            cache,
            attention_mask=mask[None].to(root_logits.device),
        )
        for i, node in enumerate(frontier):
            row_of[node] = fed + i
        parent_scores = torch.stack([scores[n] for n in frontier])
        ids, child_scores, q = propose(logits[0], parent_scores)
        # the next frontier: the k best children over all frontier nodes (a chain: the only child)
        best = child_scores.flatten().topk(min(k, child_scores.numel())).indices.tolist()
        first_new = len(tokens)
        for i, node in enumerate(frontier):
            for j in range(ids.shape[1]):
                tokens.append(draft_ids[ids[i, j]])
                parents.append(node)
                scores.append(child_scores[i, j])
                depths.append(depth)
                if q is not None:
                    probs.append(q[i])
        frontier = [first_new + b for b in best]
        frontier_hidden = layer_out[0, [b // ids.shape[1] for b in best]]
    cache.crop(committed)

    keep = settings.num_draft_tokens - 1
    order = torch.sort(torch.stack(scores), descending=True, stable=True).indices[:keep]
    chosen = sorted(order.tolist())  # creation order: parents before children
    node_of = {candidate: i + 1 for i, candidate in enumerate(chosen)}
    tree_parents = [-1]
    for candidate in chosen:
        parent = parents[candidate]
        if parent >= 0 and parent not in node_of:
            raise RuntimeError(f"draft tree selection kept candidate {candidate} without its parent {parent}")
        tree_parents.append(node_of[parent] if parent >= 0 else 0)
    root = torch.tensor([root_token], device=root_logits.device)
    return DraftTree(
        tokens=torch.cat([root, torch.stack([tokens[c] for c in chosen])]),
        parents=tree_parents,
        depths=torch.tensor([0] + [depths[c] for c in chosen], device=root_logits.device),
        draft_probs=torch.stack([torch.zeros_like(probs[0])] + [probs[c] for c in chosen]) if probs else None,
    )


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


def accept_path(
    tree: DraftTree, logits: Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Walk the tree against the target's logits [N, Vt]: (accepted nodes from the root, bonus token)."""
    children = tree.children()
    tokens = tree.tokens.tolist()
    path = [0]
    if temperature == 0:
        choice = logits.argmax(-1).tolist()
        while True:
            node = path[-1]
            match = [c for c in children[node] if tokens[c] == choice[node]]
            if not match:
                return path, choice[node]
            path.append(match[0])
    while True:
        node = path[-1]
        kids = children[node]
        p = torch.softmax(logits[node].float() / temperature, -1)
        kid_probs = tree.draft_probs[kids] if tree.draft_probs is not None and kids else None
        accepted, token = rejection_sample(p, [tokens[c] for c in kids], kid_probs, generator)
        if accepted is None:
            return path, token
        path.append(kids[accepted])


def tree_attention_mask(tree: DraftTree, cached: int, dtype: torch.dtype, device) -> Tensor:
    """Additive 4D mask [1, 1, N, cached + N]: every node sees the cache, its ancestors and itself."""
    allowed = torch.ones(len(tree), cached + len(tree), dtype=torch.bool)
    allowed[:, cached:] = tree.ancestor_mask()
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def keep_cache_positions(cache: DynamicCache, start: int, keep: list[int]) -> None:
    """Keep cache entries [0, start) and then start + keep[i]; drop the rest (rejected tree nodes)."""
    if keep == list(range(len(keep))):
        surplus = cache.get_seq_length() - start - len(keep)
        if surplus > 0:
            cache.crop(-surplus)  # transformers 5: a negative count removes that many from the end
        return
    index = torch.tensor(keep) + start
    for layer in cache.layers:
        index = index.to(layer.keys.device)
        layer.keys = torch.cat([layer.keys[:, :, :start], layer.keys.index_select(2, index)], dim=2)
        layer.values = torch.cat([layer.values[:, :, :start], layer.values.index_select(2, index)], dim=2)




# ---------------------------------------------------------------- decoding


@dataclass
class Generation:
    """One prompt's output and what it cost."""

    tokens: list[int]  # new tokens, prompt excluded
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted at each verification
    seconds: dict[str, float] = field(default_factory=dict)  # prefill, draft, verify / decode, total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _finish(tokens: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    tokens = tokens[:max_new_tokens]
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[: tokens.index(eos_token_id) + 1]
    return tokens


def _done(tokens: list[int], max_new_tokens: int, eos_token_id: int | None) -> bool:
    return len(tokens) >= max_new_tokens or (eos_token_id is not None and eos_token_id in tokens)


@torch.no_grad()
def generate_target_only(
    model: PreTrainedModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> Generation:
    """Plain autoregressive decoding with a KV cache: the baseline speculation has to beat."""
    device = model.device
    cache = DynamicCache(config=model.config)
    _sync(device)
    start = time.perf_counter()
    logits = model(torch.tensor([prompt_ids], device=device), past_key_values=cache, use_cache=True).logits
    tokens = [int(select_tokens(logits[0, -1], temperature, generator))]
    _sync(device)
    prefill = time.perf_counter() - start
    while not _done(tokens, max_new_tokens, eos_token_id):
        last = torch.tensor([[tokens[-1]]], device=device)
        logits = model(last, past_key_values=cache, use_cache=True).logits
        tokens.append(int(select_tokens(logits[0, -1], temperature, generator)))
    _sync(device)
    total = time.perf_counter() - start
    return Generation(
        tokens=_finish(tokens, max_new_tokens, eos_token_id),
        seconds={"prefill": prefill, "decode": total - prefill, "total": total},
    )


class SpeculativeDecoder:
    """A target (HF CausalLM) and an EAGLE-3 drafter decoding together; see the module docstring."""

    def __init__(self, model: PreTrainedModel, drafter, settings: DraftSettings):
        check_pair(model, drafter)
        # the engines embed draft inputs with the target's embedding, even when the checkpoint carries a copy
        drafter.attach_embedding(model.get_input_embeddings())
        self.model = model.eval()
        self.drafter = drafter.eval()
        self.settings = settings
        num_layers = model.config.get_text_config().num_hidden_layers
        self.aux_layer_ids = aux_layer_ids_for(drafter.config, num_layers)
        self._layers = model.get_decoder().layers

    def _target_forward(self, input_ids: Tensor, cache: DynamicCache, **kwargs) -> tuple[Tensor, Tensor]:
        """Logits [t, Vt] and aux states [t, A*Ht] of new positions. The aux states are the decoder layers'
        outputs taken with hooks, as `Target.capture` takes them for training data (HF's
        output_hidden_states puts the final-normed state where the last layer's output would be)."""
        outputs: dict[int, Tensor] = {}

        def keep(layer_id: int):
            def hook(module, args, output):
                outputs[layer_id] = output[0] if isinstance(output, tuple) else output

            return hook

        handles = [self._layers[i].register_forward_hook(keep(i)) for i in set(self.aux_layer_ids)]
        try:
            logits = self.model(input_ids, past_key_values=cache, use_cache=True, **kwargs).logits
        finally:
            for handle in handles:
                handle.remove()
        return logits[0], torch.cat([outputs[i] for i in self.aux_layer_ids], dim=-1)[0]

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Generation:
        settings, device = self.settings, self.model.device
        drafter_dtype = next(self.drafter.parameters()).dtype
        seconds = {"prefill": 0.0, "draft": 0.0, "verify": 0.0}
        target_cache = DynamicCache(config=self.model.config)
        drafter_cache = self.drafter.new_cache()
        _sync(device)
        start = time.perf_counter()
        logits, aux = self._target_forward(torch.tensor([prompt_ids], device=device), target_cache)
        root = int(select_tokens(logits[-1], settings.temperature, generator))
        tokens = [root]
        accepted: list[int] = []
        # rows the drafter has not seen yet: aux state of position t with token t+1, position id t+1
        pending_ids = torch.tensor(prompt_ids[1:] + [root], device=device)
        pending_aux = aux
        committed = len(prompt_ids)  # = target cache length = position of the root token
        _sync(device)
        seconds["prefill"] = time.perf_counter() - start

        while not _done(tokens, max_new_tokens, eos_token_id):
            tick = time.perf_counter()
            positions = torch.arange(committed - len(pending_ids) + 1, committed + 1, device=device)
            draft_logits, layer_out = self.drafter.step(
                pending_ids[None], pending_aux[None].to(drafter_dtype), positions[None], drafter_cache
            )
            tree = draft_tree(
                self.drafter, drafter_cache, root, draft_logits[0, -1], layer_out[0, -1], committed,
                settings, generator,
            )
            _sync(device)
            tock = time.perf_counter()
            seconds["draft"] += tock - tick

            if tree.is_chain:  # HF's own causal mask and positions: the attention kernels' fast path
                logits, aux = self._target_forward(tree.tokens[None], target_cache)
            else:
                mask = tree_attention_mask(tree, committed, self.model.dtype, device)
                positions = (tree.depths + committed)[None]
                logits, aux = self._target_forward(
                    tree.tokens[None], target_cache, attention_mask=mask, position_ids=positions
                )
            path, bonus = accept_path(tree, logits, settings.temperature, generator)
            keep_cache_positions(target_cache, committed, path)
            new = tree.tokens[path[1:]].tolist() + [bonus]
            accepted.append(len(path) - 1)
            tokens += new
            pending_ids = torch.tensor(new, device=device)
            pending_aux = aux[path]
            committed += len(path)
            root = bonus
            _sync(device)
            seconds["verify"] += time.perf_counter() - tock
        seconds["total"] = time.perf_counter() - start
        tokens = _finish(tokens, max_new_tokens, eos_token_id)
        return Generation(tokens=tokens, accepted=accepted, seconds=seconds)


# ---------------------------------------------------------------- metrics


def acceptance_metrics(accepted: list[int], depth: int) -> dict:
    """τ and per-position acceptance from the accepted-draft count of each verification (vLLM's counters:
    num_drafts, num_accepted_tokens, num_accepted_tokens_per_pos)."""
    verify_steps = len(accepted)
    if verify_steps == 0:
        raise ValueError("no verification step ran (max_new_tokens 1?): τ is undefined")
    total = sum(accepted)
    per_position = [sum(a >= d for a in accepted) / verify_steps for d in range(1, depth + 1)]
    return {
        "tau": 1 + total / verify_steps,
        "num_drafts": verify_steps,
        "num_accepted_tokens": total,
        "acceptance_per_position": per_position,
    }


def speed_metrics(spec: list[Generation], target: list[Generation] | None, tau: float) -> dict:
    """Throughput of both decoders on the same prompts, the draft/verify split, speedup and ideal speedup.

    ideal_speedup = τ · (target-only step) / (draft + verify per round): what τ allows at the measured
    step costs, decode phase only; efficiency = measured / ideal, what the prefill both decoders share (and
    any overhead) leaves of it. Efficiency rises above 1 when speculation is slower than the target alone:
    the shared prefill then dilutes the slowdown.
    """
    spec_tokens = sum(len(g.tokens) for g in spec)
    rounds = sum(len(g.accepted) for g in spec)
    spec_seconds = {key: sum(g.seconds[key] for g in spec) for key in ("prefill", "draft", "verify", "total")}
    out = {
        "tokens": spec_tokens,
        "tokens_per_s": spec_tokens / spec_seconds["total"],
        "prefill_s": spec_seconds["prefill"],
        "draft_s": spec_seconds["draft"],
        "verify_s": spec_seconds["verify"],
        "draft_ms_per_round": 1e3 * spec_seconds["draft"] / rounds,
        "verify_ms_per_round": 1e3 * spec_seconds["verify"] / rounds,
    }
    if target:
        target_tokens = sum(len(g.tokens) for g in target)
        target_total = sum(g.seconds["total"] for g in target)
        decode_steps = sum(len(g.tokens) - 1 for g in target)
        step_s = sum(g.seconds["decode"] for g in target) / max(decode_steps, 1)
        ideal = tau * step_s / ((spec_seconds["draft"] + spec_seconds["verify"]) / rounds)
        speedup = out["tokens_per_s"] / (target_tokens / target_total)
        out |= {
            "target_tokens_per_s": target_tokens / target_total,
            "target_ms_per_step": 1e3 * step_s,
            "speedup": speedup,
            "ideal_speedup": ideal,
            "efficiency": speedup / ideal,
        }
    return out


@dataclass
class ProbeResult:
    metrics: dict
    spec: list[Generation]
    target: list[Generation] | None


def probe(
    model: PreTrainedModel,
    drafter,
    prompts: list[list[int]],
    settings: DraftSettings,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    seed: int = 0,
    compare_target: bool = True,
    warmup: bool = True,
) -> ProbeResult:
    """Speculate on every prompt (and decode it with the target alone), then count as the engines do.

    With greedy settings, `matches_target` is the share of prompts whose speculative output equals the
    target-only output token for token (1.0 unless floating point flips a near tie).
    """
    if not prompts:
        raise ValueError("probe needs at least one prompt")
    decoder = SpeculativeDecoder(model, drafter, settings)
    device = model.device
    if warmup:  # first calls pay one-time allocation costs that would skew the timings
        decoder.generate(prompts[0], min(4, max_new_tokens))
        generate_target_only(model, prompts[0], min(4, max_new_tokens))
    spec, target = [], []
    for i, prompt in enumerate(tqdm(prompts, desc="speculate", leave=False)):
        generator = torch.Generator(device).manual_seed(seed + i)
        spec.append(decoder.generate(prompt, max_new_tokens, eos_token_id, generator))
        if compare_target:
            generator = torch.Generator(device).manual_seed(seed + i)
            target.append(generate_target_only(
                model, prompt, max_new_tokens, settings.temperature, eos_token_id, generator
            ))
    metrics = acceptance_metrics([a for g in spec for a in g.accepted], settings.steps)
    metrics |= speed_metrics(spec, target or None, metrics["tau"])
    metrics |= {
        "steps": settings.steps,
        "topk": settings.topk,
        "num_draft_tokens": settings.num_draft_tokens,
        "temperature": settings.temperature,
        "prompts": len(prompts),
    }
    if compare_target and settings.temperature == 0:
        same = sum(s.tokens == t.tokens for s, t in zip(spec, target, strict=True))
        metrics["matches_target"] = same / len(spec)
    return ProbeResult(metrics=metrics, spec=spec, target=target or None)
