"""Move a drafter to a new vocab map: every `lm_head` row goes to its token's new draft position.

Why only `lm_head`: row j of `lm_head.weight` [Vd, H] scores draft token j, i.e. target token
`j + d2t[j]`, so its meaning is tied to the map. Everything else is not (docs/formats.md §3): `fc`, the
decoder layer and the norms read hidden states, and `embed_tokens` [Vt, H] is indexed by *target*
token id (the drafter embeds the target's tokens), so its rows already sit at their tokens'
positions under any map. Moving them would corrupt it; it is kept as it is. (The issue's "embed_tokens
row" would only move for an embedding indexed by draft position, a layout no EAGLE-3 engine or trainer
uses: SGLang, vLLM, SpecForge and speculators all build it with `vocab_size` = Vt rows.)

Tokens the old map lacks get rows by policy (`MISSING_POLICIES`); tokens the new map lacks are dropped.

The proof (`prove_logits_preserved`): on random inputs, both drafters' pre-norm layer outputs must be
bitwise equal (the body is untouched), and for every token in both maps the source's logit equals the
remapped drafter's logit exactly. Each side computes its token columns with the same matmul on
identically shaped operands (the source's rows gathered in token order, the remapped drafter's rows
gathered in the same token order), so a correct remap gives max |difference| = 0, not merely small: a
GEMM may round a column differently depending on where it sits in a wider output (seen on CPU in
float64), which is why the proof does not compare slices of the full [.., Vd] logits. Those full
forward logits are compared too and reported, for information.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle3lib.data.layout import TOKEN_COUNTS_FILE, VOCAB_MAP_FILE, load_target_head, prepared_dir
from eagle3lib.drafter.model import Eagle3Drafter
from eagle3lib.drafter.vocab import VocabMap
from eagle3lib.files import describe_occupant, resolve_path
from eagle3lib.params import ParamsError
from eagle3lib.runs import PREPARE_DATA

MISSING_POLICIES = ("verifier", "mean", "zeros", "random")
POLICY_NAMES = ", ".join(MISSING_POLICIES)
# rows per slice when statistics or the proof walk over an lm_head (bounds temporary memory)
CHUNK_ROWS = 4096


class RemapError(ValueError):
    """A remap that cannot be done as asked (wrong sizes, unknown policy, missing target head)."""


@dataclass
class LogitProof:
    """The remap proof on random inputs: body bitwise unchanged, shared tokens' logits exactly equal."""

    tokens_checked: int  # tokens present in both maps
    rows_checked: int  # batch x sequence positions of random inputs
    seed: int
    body_identical: bool  # pre-norm layer outputs bitwise equal
    max_abs_diff: float  # over every shared token's logit at every position (must be 0)
    forward_max_abs_diff: float  # the same columns sliced from each drafter's full forward, for information
    embedding: str  # which token embedding the random inputs went through
    passed: bool

    def summary(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        return (
            f"proof {verdict}: {self.tokens_checked:,} shared tokens x {self.rows_checked} random positions, "
            f"max |logit difference| = {self.max_abs_diff:g} (body identical: {self.body_identical}; "
            f"full-forward columns differ by at most {self.forward_max_abs_diff:g})"
        )


@dataclass
class RemapReport:
    vt: int
    vd_old: int
    vd_new: int
    shared: int  # tokens in both maps
    in_place: int  # shared tokens whose draft position did not change
    moved: int  # shared tokens whose row moved to another draft position
    filled: int  # tokens only in the new map: rows made by `missing`
    dropped: int  # tokens only in the old map: rows discarded
    missing: str
    seed: int
    embed_tokens: str  # what happened to the drafter's own embedding, if it carries one
    proof: LogitProof | None = None

    def summary(self) -> str:
        text = (
            f"remapped lm_head {self.vd_old} → {self.vd_new} rows: {self.moved:,} moved, {self.in_place:,} "
            f"in place, {self.filled:,} newly filled ({self.missing}), {self.dropped:,} dropped"
        )
        return text + (f"; {self.proof.summary()}" if self.proof else "")

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["summary"] = self.summary()
        return data


def source_positions(old: VocabMap, new: VocabMap) -> torch.Tensor:
    """int64 [Vd_new]: the old draft position of each new position's token, -1 where the old map lacks it."""
    new.check_vt(old.vt, f"the old map ({old.source})")
    return old.target_to_draft[new.draft_ids]


def _mean_row(weight: torch.Tensor) -> torch.Tensor:
    """The mean row [H] in float32, summed in row slices so a bf16 matrix is never upcast whole."""
    total = torch.zeros(weight.shape[1], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], CHUNK_ROWS):
        total += weight[start : start + CHUNK_ROWS].sum(0, dtype=torch.float32)
    return total / weight.shape[0]


def fill_rows(
    policy: str,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    target_head: torch.Tensor | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """Rows [len(token_ids), H] for target tokens the old map lacked, made by `policy`.

    verifier: the target's own lm_head row for the token (`target_head` [Vt, H]), what speculators
    initialises its draft head with; mean: the mean of the old rows; zeros; random: normal with the old
    rows' standard deviation, from a generator seeded with `seed`.
    """
    count, hidden = token_ids.numel(), weight.shape[1]
    if policy == "verifier":
        if target_head is None:
            raise RemapError(
                f"missing='verifier' needs the target's lm_head weight for {count} token(s) the old map "
                "lacks; give the target (or choose missing='mean', 'zeros' or 'random')"
            )
        if target_head.dim() != 2 or target_head.shape[1] != hidden:
            raise RemapError(
                f"the target's lm_head has shape {list(target_head.shape)}; rows of width H={hidden} needed"
            )
        if count and int(token_ids.max()) >= target_head.shape[0]:
            raise RemapError(f"the target's lm_head has {target_head.shape[0]} rows, fewer than the map's Vt")
        rows = target_head[token_ids.to(target_head.device)]
    elif policy == "mean":
        rows = _mean_row(weight).expand(count, hidden)
    elif policy == "zeros":
        rows = torch.zeros(count, hidden)
    elif policy == "random":
        generator = torch.Generator().manual_seed(seed)
        rows = torch.randn(count, hidden, generator=generator) * float(weight.std())  # one pass, no copy
    else:
        raise RemapError(f"unknown missing-row policy {policy!r}; choose one of {POLICY_NAMES}")
    return rows.to(device=weight.device, dtype=weight.dtype)


def remap_rows(
    weight: torch.Tensor,
    old: VocabMap,
    new: VocabMap,
    missing: str = "mean",
    target_head: torch.Tensor | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """`weight` [Vd_old, H] under map `old` → [Vd_new, H] under `new`, rows moved by one gather.

    Peak memory is the two matrices: the gather writes straight into the new one.
    """
    if missing not in MISSING_POLICIES:
        raise RemapError(f"unknown missing-row policy {missing!r}; choose one of {POLICY_NAMES}")
    if weight.dim() != 2 or weight.shape[0] != old.vd:
        raise RemapError(f"lm_head.weight has shape {list(weight.shape)}; the old map needs [{old.vd}, H]")
    sources = source_positions(old, new).to(weight.device)
    moved = torch.empty(new.vd, weight.shape[1], dtype=weight.dtype, device=weight.device)
    torch.index_select(weight, 0, sources.clamp(min=0), out=moved)
    to_fill = (sources < 0).nonzero().flatten()
    if to_fill.numel():
        moved[to_fill] = fill_rows(missing, weight, new.draft_ids[to_fill.cpu()], target_head, seed)
    return moved


def drafter_map(drafter: Eagle3Drafter, source: str = "drafter") -> VocabMap:
    """The map in a drafter's d2t/t2d buffers (checked: they must agree)."""
    return VocabMap.from_pair(drafter.d2t.cpu(), drafter.t2d.cpu(), source=f"{source} (d2t/t2d buffers)")


def remap_drafter(
    drafter: Eagle3Drafter,
    new_map: VocabMap,
    missing: str = "mean",
    target_head: torch.Tensor | None = None,
    seed: int = 0,
    prove: bool = True,
) -> tuple[Eagle3Drafter, RemapReport]:
    """A drafter for `new_map` whose shared tokens score exactly as under the old map.

    The new drafter shares every tensor except `lm_head.weight`, `d2t` and `t2d` with `drafter` (they are
    unchanged by definition, and this keeps peak memory near two lm_head copies); deep-copy it before
    training both. The proof runs on random inputs unless `prove=False`.
    """
    old_map = drafter_map(drafter)
    new_map.check_vt(drafter.config.vocab_size, "the drafter")
    sources = source_positions(old_map, new_map)
    shared = sources >= 0
    new_weight = remap_rows(drafter.lm_head.weight.detach(), old_map, new_map, missing, target_head, seed)

    config = dataclasses.replace(drafter.config, draft_vocab_size=new_map.vd)
    carries_embedding = _carries_embedding(drafter)
    with torch.device("meta"):
        remapped = Eagle3Drafter(config, embed_tokens=carries_embedding)
    state = drafter.state_dict()
    device = drafter.d2t.device
    state.update({"lm_head.weight": new_weight, "d2t": new_map.d2t.to(device), "t2d": new_map.t2d.to(device)})
    remapped.load_state_dict(state, strict=True, assign=True)
    if getattr(drafter, "target_embedding", None) is not None:
        remapped.attach_embedding(drafter.target_embedding)
    remapped.train(drafter.training)

    report = RemapReport(
        vt=new_map.vt,
        vd_old=old_map.vd,
        vd_new=new_map.vd,
        shared=int(shared.sum()),
        in_place=int((sources == torch.arange(new_map.vd)).sum()),
        moved=int((shared & (sources != torch.arange(new_map.vd))).sum()),
        filled=int((~shared).sum()),
        dropped=old_map.vd - int(shared.sum()),
        missing=missing,
        seed=seed,
        embed_tokens=(
            "carried, kept as is (indexed by target token id, independent of the map)"
            if carries_embedding
            else "not carried (the target's is used)"
        ),
    )
    if prove:
        report.proof = prove_logits_preserved(drafter, remapped, seed=seed)
    return remapped, report


def _carries_embedding(drafter: Eagle3Drafter) -> bool:
    return "embed_tokens" in drafter._modules


@contextlib.contextmanager
def _some_embedding(drafters: list[Eagle3Drafter], seed: int):
    """Attach a seeded random embedding to drafters that have none, for the proof's inputs only."""
    bare = [d for d in drafters if not _carries_embedding(d) and getattr(d, "target_embedding", None) is None]
    if not bare:
        yield "the drafter's own" if _carries_embedding(drafters[0]) else "the attached target embedding"
        return
    config, reference = bare[0].config, bare[0].lm_head.weight
    generator = torch.Generator().manual_seed(seed + 1)
    weight = torch.randn(config.vocab_size, config.hidden_size, generator=generator) * 0.02
    for drafter in bare:
        drafter.attach_embedding(weight.to(device=reference.device, dtype=reference.dtype))
    try:
        yield "random (seeded; the drafter carries none and none was attached)"
    finally:
        for drafter in bare:
            del drafter.target_embedding


@torch.no_grad()
def prove_logits_preserved(
    source: Eagle3Drafter, remapped: Eagle3Drafter, batch: int = 2, seq_len: int = 16, seed: int = 0
) -> LogitProof:
    """Check on random inputs that every token in both maps gets exactly the same logit from both drafters."""
    old_map, new_map = drafter_map(source, "source drafter"), drafter_map(remapped, "remapped drafter")
    new_map.check_vt(old_map.vt, "the source drafter")
    token_ids = (old_map.t2d & new_map.t2d).nonzero().flatten()
    device = source.lm_head.weight.device
    old_rows = old_map.target_to_draft[token_ids].to(device)
    new_rows = new_map.target_to_draft[token_ids].to(device)

    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, old_map.vt, (batch, seq_len), generator=generator).to(device)
    aux = torch.randn(batch, seq_len, source.fc.in_features, generator=generator)
    aux = aux.to(device=device, dtype=source.fc.weight.dtype)
    positions = Eagle3Drafter.default_position_ids(input_ids)
    with _some_embedding([source, remapped], seed) as embedding:
        out_source = source.layer(input_ids, aux, positions, source.new_cache())
        out_remapped = remapped.layer(input_ids, aux, positions, remapped.new_cache())
        forward_source, forward_remapped = source(input_ids, aux), remapped(input_ids, aux)
    normed_source, normed_remapped = source.norm(out_source), remapped.norm(out_remapped)

    # torch.maximum keeps a nan (a broken drafter), and nan == 0 is False: it cannot pass by accident
    max_diff = forward_diff = torch.zeros((), dtype=torch.float64, device=device)
    for start in range(0, token_ids.numel(), CHUNK_ROWS):
        rows = slice(start, start + CHUNK_ROWS)
        logits_source = F.linear(normed_source, source.lm_head.weight[old_rows[rows]])
        logits_remapped = F.linear(normed_remapped, remapped.lm_head.weight[new_rows[rows]])
        max_diff = torch.maximum(max_diff, _max_abs_diff(logits_source, logits_remapped))
        sliced = _max_abs_diff(forward_source[..., old_rows[rows]], forward_remapped[..., new_rows[rows]])
        forward_diff = torch.maximum(forward_diff, sliced)
    body_identical = torch.equal(out_source, out_remapped)
    return LogitProof(
        tokens_checked=token_ids.numel(),
        rows_checked=batch * seq_len,
        seed=seed,
        body_identical=body_identical,
        max_abs_diff=float(max_diff),
        forward_max_abs_diff=float(forward_diff),
        embedding=embedding,
        passed=body_identical and float(max_diff) == 0.0,
    )


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double() - b.double()).abs().amax()


def check_remap_settings(params: dict) -> None:
    """Refuse 03_remap_lm_head's settings that cannot work, naming the key, before anything is loaded."""
    if params["remap"]["missing"] not in MISSING_POLICIES:
        raise RemapError(f"remap.missing must be one of {POLICY_NAMES}, got {params['remap']['missing']!r}")


def remap_checkpoint(
    source: str | os.PathLike,
    to_map: str | os.PathLike,
    out: str | os.PathLike,
    *,
    target: str | os.PathLike | None = None,
    missing: str = "mean",
    seed: int = 0,
) -> tuple[Eagle3Drafter, RemapReport]:
    """`eagle3 remap`: load `source` strictly, move it onto the map in `to_map` (a map file or another
    checkpoint), prove it, and write it to `out` in the source's layout with `out/remap_report.json`.

    `target` (see `data.load_target_head`) supplies the rows for missing='verifier' and, for a drafter that
    carries no embedding, the token embedding the proof runs through. A failed proof writes nothing.
    """
    from eagle3lib.drafter import checkpoint

    out = Path(out)
    if os.path.lexists(out):
        raise RemapError(f"{describe_occupant(out)}; a remapped drafter never overwrites a checkpoint")
    drafter, _ = checkpoint.load_drafter(source, strict=True)
    vt = drafter.config.vocab_size
    new_map = VocabMap.load(to_map, vt=vt)
    target_head = None
    if target is not None:
        head, _ = load_target_head(target, ("lm_head.weight", "embed_tokens.weight"))
        for name, tensor in head.items():
            if tensor.dim() != 2 or tensor.shape != (vt, drafter.config.hidden_size):
                raise RemapError(
                    f"target {target}: {name} has shape {list(tensor.shape)}, the drafter needs "
                    f"[Vt {vt}, H {drafter.config.hidden_size}]"
                )
        target_head = head["lm_head.weight"]
        if not _carries_embedding(drafter):
            drafter.attach_embedding(head["embed_tokens.weight"])
    remapped, report = remap_drafter(drafter, new_map, missing, target_head, seed)
    if not report.proof.passed:
        raise RemapError(f"{source} → {to_map}: {report.proof.summary()}; nothing written")
    # the report goes into the staged folder: `out` never exists without it
    checkpoint.save_drafter(remapped, out, layout=checkpoint.detect_layout(source),
                            files={"remap_report.json": json.dumps(report.to_dict(), indent=2) + "\n"})
    return remapped, report


def notebook_inputs(params: dict, run_dir: str | os.PathLike, names: tuple[str, ...]) -> dict[str, Path]:
    """The files notebooks 02 and 03 read (`names` of: source_drafter, map_a, map_b, counts): the paths in
    params, or where earlier steps of the run put them.

    `vocab.map_a` defaults to `remap.source_drafter`'s map; `vocab.map_b` and `vocab.counts` default to the
    map and token counts 00_prepare_data writes.
    """
    prepared = prepared_dir(run_dir)
    vocab, remap = params["vocab"], params["remap"]
    source = resolve_path(remap["source_drafter"]) if remap["source_drafter"] else None
    candidates = {
        "source_drafter": source,
        "map_a": resolve_path(vocab["map_a"]) if vocab["map_a"] else source,
        "map_b": resolve_path(vocab["map_b"]) if vocab["map_b"] else prepared / VOCAB_MAP_FILE,
        "counts": resolve_path(vocab["counts"]) if vocab["counts"] else prepared / TOKEN_COUNTS_FILE,
    }
    found = {}
    for name in names:
        path = candidates[name]
        if path is None:
            raise ParamsError(f"set remap.source_drafter (a drafter checkpoint folder) for {name}")
        if not path.exists():
            raise FileNotFoundError(
                f"{path} does not exist (the {name} input); run {PREPARE_DATA} first or set it in the params"
            )
        found[name] = path
    return found
