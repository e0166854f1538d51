"""B sequences decoding together in one KV cache each: the target's and the drafter's.

Column c of a cache holds one position of every sequence, and `valid[b, c]` says whether it is part of
sequence b: left padding and rejected drafts stay as masked holes instead of being cut out row by row, and are
compacted away when they dominate. The target's cache layers append into spare room of a buffer
(`AppendLayer`) instead of concatenating at every step; its prompts are prefilled packed where its head allows
(`TargetBatch.prefill`), and a prefill is kept for every drafter probed on the same prompts (`PrefillCache`).
What runs on these batches, the drafts, the verification and the decoding loops, is `decoding.speculate`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from eagle3lib.data.readers import first_fit_decreasing
from eagle3lib.target import direct

# Targets whose logits are their output embedding applied to the final-normed states, nothing after it (no
# soft-capping or scaling): their prompts are prefilled packed, the head applied to each prompt's last state
PLAIN_HEAD_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# A packed prefill row, or the longest prompt if longer: its attention is computed whole, across prompts too,
# so its cost grows with the square of the row (32 ShareGPT first turns, 2,168 tokens, bf16 on one thread:
# 3.9 s in rows of 1,024, 2.4 s in rows of 373, the longest prompt)
PREFILL_ROW_TOKENS = 256
# Tokens a prefill forward computes at most, the rows beyond it going to further forwards: larger activations
# are fresh memory at every kernel (page faults), smaller ones are reused (256 ShareGPT first turns, 19,701
# tokens, bf16 on 2 cores: 10.1 s in one forward, 7.3-8.1 s in forwards of at most 2,048 or 4,096)
PREFILL_FORWARD_TOKENS = 2048
# A batch's prompts that all begin with at least this many of the same tokens (a chat template's system
# prompt: SmolLM2's 24 open every ShareGPT first turn, a third of 256 of them) have them computed once, their
# keys and values copied to every row (a direct decoder's packed prefill)
SHARED_PREFIX_TOKENS = 8


def sync(device: torch.device) -> None:
    """Wait for the device, so that a time taken after it counts the work queued before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compact_columns(valid: Tensor, tensors: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """Move each row's valid cache columns (dim 2 of [B, heads, C, head_dim] tensors) to the end, in order.

    Attention is indifferent to the order of its keys (positions are in the rotary embedding already), so
    this only drops the holes that rejected drafts and prompt padding leave. Right-aligned, a shorter row's
    holes stay in front, where `key_runs` lets its attention skip them.
    """
    counts = valid.sum(1)
    width = int(counts.max())
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices[:, -width:]
    index = order.to(tensors[0].device)[:, None, :, None]
    moved = [t.gather(2, index.expand(t.shape[0], t.shape[1], width, t.shape[3])) for t in tensors]
    return torch.arange(width, device=valid.device)[None] >= (width - counts)[:, None], moved


# An attention call's fixed cost, in the work of one row reading one key column: an estimate (about 20 µs
# of call and slicing against about 40 ns a row and column, SmolLM2-135M in bf16 on the 2-core Xeon)
RUN_COST_COLUMNS = 512


def key_runs(first: list[int], width: int) -> list[tuple[int, int, int]]:
    """The batch's rows cut into consecutive runs [(first row, end row, first column)], each attending from
    its rows' earliest valid column on, at the least cost: rows x columns read, plus `RUN_COST_COLUMNS` a run.
    `first[b]` is row b's first valid column of `width`. Rows sorted by prompt length (as the engine's
    batches are) make few runs with little left padding each."""
    rows = len(first)
    best = [0] * (rows + 1)  # best[j]: the least cost of rows [0, j)
    cut = [0] * (rows + 1)
    for end in range(1, rows + 1):
        start_column, best[end] = width, None
        for start in range(end - 1, -1, -1):
            start_column = min(start_column, first[start])
            cost = best[start] + (end - start) * (width - start_column) + RUN_COST_COLUMNS
            if best[end] is None or cost < best[end]:
                best[end], cut[end] = cost, start
    runs, end = [], rows
    while end:
        start = cut[end]
        runs.append((start, end, min(first[start:end])))
        end = start
    return runs[::-1]


def _holes_dominate(valid: Tensor) -> bool:
    """Compact once more than half of the columns are holes (and there are enough to matter)."""
    return valid.shape[1] > 2 * int(valid.sum(1).max()) + 32


class PrefillCache:
    """The target's prefill of prompt batches, kept so that every drafter and depth probed on the same
    prompts reuses it instead of recomputing it (on a CPU the prefill of long chat prompts costs as much as
    the decoding). A reused prefill is charged the seconds it took when it ran, so speeds stay honest."""

    def __init__(self) -> None:
        self.found: dict = {}


class AppendLayer(DynamicLayer):
    """A KV cache layer that writes new columns into spare room of a buffer instead of concatenating:
    HF's `DynamicLayer` copies the whole layer cache at every step. `keys` and `values` are views of the
    buffer's filled columns. Cropping shortens the views, so the next step writes over the columns cropped
    away and never over columns still in view (a reused prefill keeps such views, see `TargetBatch`); a
    view replaced from outside (batch selection, compaction) is moved into a new buffer on the next step."""

    room = 256  # spare columns allocated with every new buffer

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.buffers: tuple[Tensor, Tensor] | None = None

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        (keys, values), filled = self.grow(key_states.shape, value_states.shape, key_states)
        end = filled + key_states.shape[-2]
        keys[..., filled:end, :], values[..., filled:end, :] = key_states, value_states
        self.advance(end)
        return self.keys, self.values

    def grow(self, key_shape: tuple, value_shape: tuple, like: Tensor) -> tuple[tuple[Tensor, Tensor], int]:
        """The buffers, with room for the new columns of keys and values of these shapes [B, heads, n, D]
        after the filled ones (moved into new buffers of `like`'s dtype and device if not), and how many
        columns are filled. Whoever writes the new columns calls `advance` after."""
        filled = self.get_seq_length()
        end = filled + key_shape[-2]
        if not self._appendable(end):
            self.buffers = tuple(
                self._new_buffer(old, shape, like, filled, end + self.room)
                for old, shape in ((self.keys, key_shape), (self.values, value_shape))
            )
        return self.buffers, filled

    def advance(self, end: int) -> None:
        """The views now reach column `end` of the buffers."""
        self.keys, self.values = (buffer[..., :end, :] for buffer in self.buffers)

    def adopt(self, keys: Tensor, values: Tensor, filled: int) -> None:
        """Start from buffers whose first `filled` columns are already written (a prefill's)."""
        self.lazy_initialization(keys[..., :filled, :], values[..., :filled, :])
        self.buffers = (keys, values)
        self.keys, self.values = keys[..., :filled, :], values[..., :filled, :]

    def _appendable(self, end: int) -> bool:
        """The views are still views of the buffer, and it has room for `end` columns."""
        if self.buffers is None:
            return False
        keys = self.buffers[0]
        return end <= keys.shape[-2] and self.keys.data_ptr() == keys.data_ptr()

    @staticmethod
    def _new_buffer(old: Tensor, shape: tuple, like: Tensor, filled: int, columns: int) -> Tensor:
        buffer = like.new_empty(shape[0], shape[1], columns, shape[3])
        if filled:
            buffer[..., :filled, :] = old
        return buffer


class TargetBatch:
    """B sequences decoding together in one Hugging Face KV cache.

    Column c of the cache holds one position of every sequence, and `valid[b, c]` says whether it is part of
    sequence b: left padding of short prompts and rejected drafts stay in the cache as masked holes instead
    of being cut out row by row. Every forward passes its own 4D mask (the valid columns, plus the tree's
    ancestors among the new ones) and explicit position ids, so each sequence computes exactly what it
    would alone. Trailing columns no sequence kept are cropped; holes are compacted when they dominate. A
    Llama-like target's forwards call its layers directly (`target.direct`), others go through its HF modules.

    A finished sequence leaves the caller's view at once, but its row stays in the cache, fed a placeholder
    and ignored, until a quarter of the rows are such: cutting rows out copies the whole cache (at batch 256
    of 500-column ShareGPT prompts and replies, 2.9 GB), which each finishing sequence used to pay.
    """

    gives_choices = False  # verify gives logits (`RecordedTarget` gives the greedy choices)

    def __init__(self, model: PreTrainedModel, aux_layer_ids: list[int], compiled: bool = False):
        self.model, self.aux_layer_ids = model, aux_layer_ids
        self._layers = model.get_decoder().layers
        self.cache = DynamicCache(config=model.config)
        if all(type(layer) is DynamicLayer for layer in self.cache.layers):  # sliding-window layers stay HF's
            self.cache.layers = [AppendLayer() for _ in self.cache.layers]
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # [rows, columns], finished rows still held included
        self._lengths = torch.zeros(0, dtype=torch.long)  # [rows] committed tokens: the next position
        self._live: Tensor | None = None  # the rows of the sequences still decoding; None: every row
        # runs of rows attending past their left padding (`key_runs`): on a CPU, where attention's work is
        # its columns read, and only through the attention that takes them (`target.model`)
        self._skips_padding = (model.device.type == "cpu"
                               and model.config._attn_implementation == "sdpa_shared_kv")
        self._first: Tensor | None = None  # [rows] the first column each reads (`_first_read_columns`)
        self._runs: list[tuple[int, int, int]] | None = None  # of the current rows and columns
        # compiled: a target the direct decoder cannot run is refused by it, not run through HF
        self._direct = direct.DirectDecoder(model, compiled) if compiled or direct.supports(model) else None

    @property
    def _compiled(self) -> bool:
        """The decoding steps run through the direct decoder's compiled graph."""
        return self._direct is not None and self._direct.compiled is not None

    def _forward(
        self, input_ids: Tensor, allowed: Tensor, positions: Tensor, last_logits_only: bool = False,
        cache: DynamicCache | None = None, states: bool = False, runs: list | None = None,
        spans: list | None = None, prefix: DynamicCache | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Logits [B, n, Vt] (n = 1 with `last_logits_only`; with `states`, the final-normed states [B, n, Ht]
        instead) and aux states [B, n, A*Ht] (None without aux layers) of n new columns, written to `cache`
        (the batch's own by default). `spans`: a prefill's prompts in each row (`DirectDecoder`), for a
        direct decoder to attend within them only, and to every column of `prefix` (the keys and values of
        the tokens they all begin with); others read the mask, which says the same.

        The aux states are the decoder layers' outputs taken with hooks, as `Target.capture` takes them for
        training data (HF's output_hidden_states puts the final-normed state where the last layer's output
        would be)."""
        device, dtype = self.model.device, self.model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        mask, cache = mask[:, None].to(device), self.cache if cache is None else cache
        input_ids, positions = input_ids.to(device), positions.to(device)
        if self._direct is None:
            out, kept = self._hf_forward(input_ids, mask, positions, cache, last_logits_only, states, runs)
            return out, torch.cat(kept, dim=-1) if kept else None
        if self._compiled and cache is self.cache:
            out, kept = self._into_buffers(input_ids, mask, positions, self._first.to(device))
        else:
            out, kept = self._direct(input_ids, mask, positions, cache, self.aux_layer_ids, runs, spans,
                                     prefix)
        if not states:
            out = self.model.get_output_embeddings()(out[:, -1:] if last_logits_only else out)
        return out, torch.cat(kept, dim=-1) if kept else None

    def _into_buffers(self, input_ids: Tensor, mask: Tensor, positions: Tensor, first: Tensor
                      ) -> tuple[Tensor, list[Tensor]]:
        """The compiled decoder's forward (`DirectDecoder.into_buffers`) into the cache's buffers, grown where
        they have no room for the new columns, row b's attention reading from column first[b] on."""
        layers, new = self.cache.layers, input_ids.shape[1]
        grown = [layer.grow((*layer.keys.shape[:2], new, layer.keys.shape[3]),
                            (*layer.values.shape[:2], new, layer.values.shape[3]), layer.keys)
                 for layer in layers]
        keys, values = [pair[0] for pair, _ in grown], [pair[1] for pair, _ in grown]
        filled = grown[0][1]
        out, kept = self._direct.into_buffers(input_ids, mask, positions, keys, values, filled, first,
                                              self.aux_layer_ids)
        for layer in layers:
            layer.advance(filled + new)
        return out, kept

    def _hf_forward(self, input_ids: Tensor, mask: Tensor, positions: Tensor, cache: DynamicCache,
                    last_logits_only: bool, states: bool, runs: list | None) -> tuple[Tensor, list[Tensor]]:
        """`_forward` through Hugging Face's modules, the aux states taken with hooks."""
        outputs: dict[int, Tensor] = {}

        def keep(layer_id: int):
            def hook(module, args, output):
                outputs[layer_id] = output[0] if isinstance(output, tuple) else output

            return hook

        handles = [self._layers[i].register_forward_hook(keep(i)) for i in set(self.aux_layer_ids)]
        inputs = {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions,
                  "use_cache": True, "past_key_values": cache}
        if runs is not None:
            inputs["key_runs"] = runs
        try:
            if states:
                out = self.model.get_decoder()(**inputs).last_hidden_state
            else:
                out = self.model(**inputs, logits_to_keep=1 if last_logits_only else 0).logits
        finally:
            for handle in handles:
                handle.remove()
        return out, [outputs[i] for i in self.aux_layer_ids]

    def prefill(
        self, prompts: list[list[int]], reuse: PrefillCache | None = None
    ) -> tuple[Tensor, Tensor | None, float]:
        """The prompts through the target: last-position logits [B, Vt], aux states [B, W, A*Ht] (sequence
        b's in its last len(prompt b) rows) and the seconds it took (when `reuse` already held this batch:
        the seconds it took then).

        Where the target's logits are its head over its final states (`PLAIN_HEAD_MODELS`), whole prompts
        are computed packed, laid into rows of `PREFILL_ROW_TOKENS` (or the longest prompt) with attention
        within each prompt and positions restarting with each, so that no padding is computed (32 ShareGPT
        first turns: 2,168 tokens where left padding computes 32 x the longest); other targets get one
        prompt a row. The keys and values then go into the cache left-padded to the longest prompt. Where a
        direct decoder packs them, the tokens every prompt begins with (`SHARED_PREFIX_TOKENS` or more: a
        system prompt) are computed once and their keys, values and aux states copied to every row."""
        key = (tuple(map(tuple, prompts)), tuple(self.aux_layer_ids))
        if reuse is not None and key in reuse.found:
            logits, aux, kv, self.valid, self._lengths, seconds = reuse.found[key]
            self._first = self._runs = self._live = None
            for i, (keys, values) in enumerate(kv):  # later rounds never write into these tensors in place
                self.cache.update(keys, values, i)
            return logits, aux, seconds
        sync(self.model.device)
        start = time.perf_counter()
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        pack = self.model.config.get_text_config().model_type in PLAIN_HEAD_MODELS
        device = self.model.device
        shared, prefix = 0, None
        if pack and self._direct is not None and len(prompts) > 1:
            shared = min(len(os.path.commonprefix(prompts)), min(lengths) - 1)  # each keeps its last token
            if shared >= SHARED_PREFIX_TOKENS:
                prefix, prefix_aux = self._prefill_prefix(prompts[0][:shared])
            else:
                shared = 0
        # each prompt's own tokens, after the shared ones
        pieces = [(n - shared, b, 0) for b, n in enumerate(lengths)]
        rows = (first_fit_decreasing(pieces, max(width - shared, PREFILL_ROW_TOKENS)) if pack
                else [[p] for p in pieces])
        row_width = max(sum(n for n, _, _ in row) for row in rows)
        input_ids = torch.zeros(len(rows), row_width, dtype=torch.long)
        positions = torch.zeros(len(rows), row_width, dtype=torch.long)
        allowed = torch.eye(row_width, dtype=torch.bool).repeat(len(rows), 1, 1)  # padding sees itself
        # each prompt token's place in the packed rows (row, column) and in the cache (sequence, column)
        packed_row, packed_column, cache_row, cache_column = [], [], [], []
        ends = [0] * len(prompts)  # where each prompt's last token is in those lists
        spans: list[list[tuple[int, int]]] = [[] for _ in rows]  # each row's prompts: (first column, tokens)
        for r, row in enumerate(rows):
            offset = 0 if pack else row_width - row[0][0]  # one prompt a row: left-padded, its end last
            for n, b, _ in row:
                spans[r].append((offset, n))
                span = slice(offset, offset + n)
                input_ids[r, span] = torch.tensor(prompts[b][shared:])
                positions[r, span] = torch.arange(shared, shared + n)
                allowed[r, span, span] = torch.ones(n, n, dtype=torch.bool).tril()
                packed_row += [r] * n
                packed_column += range(offset, offset + n)
                cache_row += [b] * n
                cache_column += range(width - n, width)
                ends[b] = len(packed_row) - 1
                offset += n
        here = (torch.tensor(packed_row, device=device), torch.tensor(packed_column, device=device))
        there = (torch.tensor(cache_row, device=device), torch.tensor(cache_column, device=device))
        starts = torch.tensor([width - n for n in lengths])
        padding = (torch.arange(width)[None] < starts[:, None]).nonzero().to(device).unbind(1)
        appends = all(isinstance(layer, AppendLayer) for layer in self.cache.layers)
        cached: list[tuple[Tensor, Tensor]] = []  # per layer [B, Hkv, columns, D], written group by group
        outs, auxes = [], []
        step = max(1, PREFILL_FORWARD_TOKENS // row_width)
        for first in range(0, len(rows), step):
            group = slice(first, first + step)
            packed = DynamicCache(config=self.model.config)
            out, packed_aux = self._forward(input_ids[group], allowed[group], positions[group], not pack,
                                            cache=packed, states=pack, spans=spans[group], prefix=prefix)
            outs.append(out)
            auxes.append(packed_aux)
            if not cached:  # left padding zeroed: masked, but it must not be NaN (0 x NaN is NaN)
                columns = width + AppendLayer.room if appends else width
                for layer in packed.layers:
                    pair = [states.new_empty(len(prompts), states.shape[1], columns, states.shape[3])
                            for states in (layer.keys, layer.values)]
                    for buffer in pair:
                        buffer[padding[0], :, padding[1]] = 0
                    cached.append(pair)
            mine = (here[0] >= first) & (here[0] < first + step)
            source, destination = (here[0][mine] - first, here[1][mine]), (there[0][mine], there[1][mine])
            for (keys, values), layer in zip(cached, packed.layers, strict=True):
                for buffer, states in ((keys, layer.keys), (values, layer.values)):
                    buffer[destination[0], :, destination[1]] = states[source[0], :, source[1]]
        out = torch.cat(outs)
        packed_aux = None if auxes[0] is None else torch.cat(auxes)
        if prefix is not None:  # the shared tokens go to each row's first `shared` columns after its padding
            count = len(prompts)
            rows_of = torch.arange(count).repeat_interleave(shared)
            columns_of = (starts[:, None] + torch.arange(shared)).flatten()
            shared_at = (rows_of.to(device), columns_of.to(device))
            for (keys, values), layer in zip(cached, prefix.layers, strict=True):
                for buffer, states in ((keys, layer.keys), (values, layer.values)):
                    buffer[shared_at[0], :, shared_at[1]] = states[0].transpose(0, 1).repeat(count, 1, 1)
        for i, (keys, values) in enumerate(cached):
            if appends:  # written in place: no second copy of the whole cache
                self.cache.layers[i].adopt(keys, values, width)
            else:
                self.cache.update(keys, values, i)
        aux = None
        if packed_aux is not None:
            aux = packed_aux.new_zeros(len(prompts), width, packed_aux.shape[-1])
            aux[there] = packed_aux[here]
            if prefix is not None:
                aux[shared_at] = prefix_aux[0].repeat(count, 1)
        if pack:
            logits = self.model.get_output_embeddings()(out[here[0][ends], here[1][ends]])
        else:  # row b is sequence b
            logits = out[:, -1]
        self.valid = torch.arange(width)[None] >= starts[:, None]
        self._lengths = torch.tensor(lengths)
        self._first = self._runs = self._live = None
        sync(device)
        seconds = time.perf_counter() - start
        if reuse is not None:
            kv = [(layer.keys, layer.values) for layer in self.cache.layers]
            reuse.found[key] = (logits, aux, kv, self.valid, self._lengths, seconds)
        return logits, aux, seconds

    def _prefill_prefix(self, tokens: list[int]) -> tuple[DynamicCache, Tensor | None]:
        """The keys and values of `tokens`, which every prompt of a prefill begins with, and their aux states
        [1, n, A*Ht] (None without aux layers): computed once for all."""
        n = len(tokens)
        cache = DynamicCache(config=self.model.config)
        _, aux = self._forward(torch.tensor([tokens]), torch.ones(1, n, n, dtype=torch.bool).tril(),
                               torch.arange(n)[None], cache=cache, states=True, spans=[[(0, n)]])
        return cache, aux

    @property
    def lengths(self) -> Tensor:
        """[B] committed tokens of each sequence still decoding (= its next token's position)."""
        return self._lengths if self._live is None else self._lengths[self._live]

    def _all_rows(self, live: Tensor, placeholder: Tensor) -> Tensor:
        """`live` ([B, ...], one entry a sequence still decoding) laid into every row the cache holds, the
        finished ones given `placeholder`."""
        if self._live is None:
            return live
        found = placeholder.expand(len(self._lengths), *live.shape[1:]).clone()
        found[self._live] = live
        return found

    def _first_read_columns(self) -> Tensor:
        """[rows] the first cache column each row's attention needs: its first valid one; a finished row's
        last valid one (its output is ignored, and no crop removes a column a row kept)."""
        valid = self.valid.to(torch.int8)
        first = valid.argmax(1)
        if self._live is not None:
            finished = torch.ones(len(first), dtype=torch.bool)
            finished[self._live] = False
            first[finished] = (valid.shape[1] - 1 - valid.flip(1).argmax(1))[finished]
        return first

    def verify(self, tokens: Tensor, ancestors: Tensor, depths: Tensor) -> tuple[Tensor, Tensor | None]:
        """Score a tree per sequence (tokens [B, N], node 0 the root) in one forward: each node sees its
        sequence's committed columns, its ancestors and itself, at position = committed + depth."""
        nodes = tokens.shape[1]
        tokens = self._all_rows(tokens, torch.zeros(1, nodes, dtype=tokens.dtype))
        ancestors = self._all_rows(ancestors, torch.eye(nodes, dtype=torch.bool)[None])
        depths = self._all_rows(depths, torch.zeros(1, nodes, dtype=depths.dtype))
        committed = self.valid[:, None, :].expand(len(tokens), nodes, self.valid.shape[1])
        allowed = torch.cat([committed, ancestors], dim=2)
        if self._first is None and (self._compiled or self._skips_padding):  # stale: compacted, or rows left
            self._first = self._first_read_columns()
            if not self._compiled:  # compiled steps read each row from its first column, eager ones in runs
                self._runs = key_runs(self._first.tolist(), self.valid.shape[1])
        logits, aux = self._forward(tokens, allowed, self._lengths[:, None] + depths, runs=self._runs)
        if self._live is None:
            return logits, aux
        live = self._live.to(logits.device)
        return logits[live], None if aux is None else aux[live]

    def commit(self, kept: Tensor) -> None:
        """Keep the verified nodes (bool [B, N]) of the last `verify` in each sequence."""
        kept = self._all_rows(kept, torch.zeros(1, kept.shape[1], dtype=torch.bool))
        self.valid = torch.cat([self.valid, kept], dim=1)
        self._lengths = self._lengths + kept.sum(1)
        used = int(self.valid.any(0).nonzero().max()) + 1  # a chain's rejected tail is cut off outright
        if used < self.valid.shape[1]:
            self.cache.crop(used - self.valid.shape[1])  # a negative count drops that many from the end
            self.valid = self.valid[:, :used]
        if _holes_dominate(self.valid):
            layers = self.cache.layers
            tensors = [t for layer in layers for t in (layer.keys, layer.values)]
            self.valid, moved = compact_columns(self.valid, tensors)
            self._first = self._runs = None
            for layer, keys, values in zip(layers, moved[0::2], moved[1::2], strict=True):
                layer.keys, layer.values = keys, values

    def select(self, rows: Tensor) -> None:
        """Keep only these sequences (finished ones drop out of the batch; their rows are cut out of the cache
        once they are a quarter of it)."""
        live = rows if self._live is None else self._live[rows]
        if 4 * (len(self._lengths) - len(live)) < len(self._lengths):
            self._live, self._first, self._runs = live, None, None
            return
        self.cache.batch_select_indices(live.to(self.model.device))
        self.valid, self._lengths = self.valid[live], self._lengths[live]
        self._first = self._runs = self._live = None


@dataclass
class Recording:
    """One prompt decoded greedily by the target alone, kept to replay speculation against (`RecordedTarget`):
    `tokens` its greedy tokens, decoded past where the output ends (its end token or max_new_tokens) by the
    deepest draft a replay may need; `aux` [len(prompt) + len(tokens) - 1, A*Ht] the aux states of every
    position the target computed (the prompt's, then each new token's as it was fed back)."""

    prompt: list[int]
    tokens: list[int]
    aux: Tensor
    aux_layer_ids: list[int]
    overrun: int  # tokens decoded past the output's end


class RecordedTarget:
    """`TargetBatch`'s part in greedy speculation, answered from the target's recorded greedy decoding instead
    of a forward pass: a tree node on the recorded path gets the target's next token after it and its aux
    state, as a verification would give them. Greedy speculation then accepts exactly the drafts a real
    verification accepts where the target's states agree (in exact arithmetic always; in floating point a
    near tie can flip), at the cost of the drafter alone.

    `verify` returns the target's greedy choices [B, N] where `TargetBatch` returns logits (`gives_choices`);
    `prefill` takes a `reuse` it has no use for, as `TargetBatch.prefill` does."""

    gives_choices = True

    def __init__(self, recordings: list[Recording]):
        self.recordings = recordings
        self._rows = list(range(len(recordings)))  # the recordings of the sequences still decoding
        self._root = [0] * len(recordings)  # each sequence's root: an index into its recorded tokens
        self._paths = [torch.tensor(r.tokens) for r in recordings]

    def prefill(self, prompts: list[list[int]], reuse: PrefillCache | None = None
                ) -> tuple[Tensor, Tensor, float]:
        """The greedy first tokens [B], the prompts' aux states [B, W, A*Ht] as `TargetBatch.prefill` lays
        them out (sequence b's in its last len(prompt b) rows), and no seconds."""
        if [r.prompt for r in self.recordings] != prompts:
            raise ValueError("the recordings are of other prompts than those speculated on")
        width = max(map(len, prompts))
        aux = self.recordings[0].aux.new_zeros(len(prompts), width, self.recordings[0].aux.shape[-1])
        for b, r in enumerate(self.recordings):
            aux[b, width - len(r.prompt):] = r.aux[: len(r.prompt)]
        return torch.tensor([r.tokens[0] for r in self.recordings]), aux, 0.0

    @property
    def lengths(self) -> Tensor:
        return torch.tensor([len(self.recordings[b].prompt) + self._root[b] for b in self._rows])

    def verify(self, tokens: Tensor, ancestors: Tensor, depths: Tensor) -> tuple[Tensor, Tensor]:
        """Each node's greedy successor [B, N] and aux state [B, N, A*Ht] (-1 and zero where the node's
        token is not the recorded one at its depth), for trees (tokens [B, N], node 0 the root) as
        `TargetBatch.verify` takes them; the ancestor masks are not needed."""
        choices = torch.full(tokens.shape, -1, dtype=torch.long)
        aux = self.recordings[0].aux.new_zeros(*tokens.shape, self.recordings[0].aux.shape[-1])
        for i, b in enumerate(self._rows):
            recorded, root = self.recordings[b], self._root[b]
            deepest = root + int(depths[i].max()) + 1
            if deepest >= len(recorded.tokens):
                raise RuntimeError(
                    f"a draft reaches recorded token {deepest} of a recording of {len(recorded.tokens)}: "
                    "record with an overrun of at least the draft depth"
                )
            path = self._paths[b]
            # nodes holding the recorded token at their depth; their ancestors need no check: acceptance walks
            # from the root through matching children only, so it reaches none whose ancestors do not match
            nodes = (tokens[i] == path[root + depths[i]]).nonzero().flatten()
            choices[i, nodes] = path[root + depths[i][nodes] + 1]
            aux[i, nodes] = recorded.aux[len(recorded.prompt) + root + depths[i][nodes]]
        return choices, aux

    def commit(self, kept: Tensor) -> None:
        for i, b in enumerate(self._rows):
            self._root[b] += int(kept[i].sum())

    def select(self, rows: Tensor) -> None:
        self._rows = [self._rows[i] for i in rows.tolist()]


class DrafterBatch:
    """The drafter's KV cache for B sequences, with valid columns as in `TargetBatch`: each sequence appends a
    different number of committed rows per round, shorter ones padded with masked rows."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.cache = drafter.new_cache()
        self.valid = torch.zeros(0, 0, dtype=torch.bool)

    def feed(
        self, input_ids: Tensor, hidden: Tensor, positions: Tensor, rows_valid: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Append committed rows ([B, P], causal among themselves, each sequence's first; padding rows where
        `rows_valid` is False): logits [B, Vd] and layer_out [B, H] of each sequence's last row, what drafting
        goes on from (the head over every row of a prompt cost as much as the rest of the drafter)."""
        batch, rows = input_ids.shape
        if self.valid.shape[0] != batch:  # the first feed of a batch
            self.valid = torch.zeros(batch, 0, dtype=torch.bool)
        cached = self.valid[:, None, :].expand(batch, rows, self.valid.shape[1])
        causal = torch.ones(rows, rows, dtype=torch.bool).tril()
        new = rows_valid[:, None, :] & causal | torch.eye(rows, dtype=torch.bool)
        allowed = torch.cat([cached, new], dim=2).to(input_ids.device)
        layer_out = self.drafter.layer(input_ids, hidden, positions, self.cache, allowed)
        self.valid = torch.cat([self.valid, rows_valid], dim=1)
        if _holes_dominate(self.valid):
            self.valid, (self.cache.keys, self.cache.values) = compact_columns(
                self.valid, [self.cache.keys, self.cache.values]
            )
        last = layer_out[torch.arange(batch), (rows_valid.sum(1) - 1).to(layer_out.device)]
        return self.drafter.compute_logits(last), last

    def select(self, rows: Tensor) -> None:
        if self.cache.keys is None:  # a sequence finished on its prefill token: nothing fed yet
            return
        rows_there = rows.to(self.cache.keys.device)
        self.cache.keys, self.cache.values = self.cache.keys[rows_there], self.cache.values[rows_there]
        self.valid = self.valid[rows]
