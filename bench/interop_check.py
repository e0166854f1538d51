"""`make interop-check`: eagle3lib against the reference projects' code (speculators 0.9.0, SpecForge 0.2.0).

Runs in `.venv-interop` (both libraries installed; see the Makefile). For tiny random drafters of every flag
combination eagle3lib computes:
- eagle3lib saves each layout, speculators' `Eagle3DraftModel.from_pretrained` and SpecForge's
  `AutoDraftModel.from_pretrained` load it; an export eagle3lib refuses for that project must be refused;
- speculators and SpecForge save their own drafters (`save_pretrained`), eagle3lib loads them strictly;
and compares step-0 and every TTT step's logits (teacher-forced, float32, at most 1e-5 apart). Any warning
about missing or unexpected keys fails the check, except the one SpecForge's loader is documented to skip
(`embed_tokens.weight`, which SpecForge, like SGLang, takes from the target).

The inputs and `reference_*` helpers (sizes given as `sizes=`) are also used by
tests/fixtures/reference/make_fixtures.py, which commits small drafters made by both projects.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import tempfile
from pathlib import Path

# SpecForge compiles its RMSNorm; eager is exact and fast at these sizes
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eagle3lib.drafter.checkpoint import load_drafter, save_drafter
from eagle3lib.drafter.config import DrafterConfig, EngineMismatchError
from eagle3lib.drafter.model import Eagle3Drafter
from eagle3lib.drafter.vocab import VocabMap

TOLERANCE = 1e-5
TTT_STEPS = 3
SIZES = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
    vocab_size=512, draft_vocab_size=96, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
)
AUX_IDS = [1, 3, 4]  # eagle3lib numbering; [2, 4, 5] in speculators'


# ----------------------------------------------------------------------------- inputs and eagle3lib


def fixed_inputs(seed: int = 0, length: int = 12, sizes: dict = SIZES) -> dict[str, torch.Tensor]:
    """One row (speculators trains on packed batches of 1): tokens, aux states, a target embedding."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, sizes["vocab_size"], (1, length), generator=generator),
        "hidden_states": torch.randn(1, length, 3 * sizes["hidden_size"], generator=generator),
        "embedding": torch.randn(sizes["vocab_size"], sizes["hidden_size"], generator=generator),
        "d2t_ids": torch.randperm(sizes["vocab_size"], generator=generator)[: sizes["draft_vocab_size"]]
        .sort()
        .values,
    }


def randomise_norms(module: torch.nn.Module, seed: int) -> None:
    """Norm weights away from 1, so that a norm loaded into the wrong place (or dropped) shows in logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "norm" in name and parameter.dim() == 1:
                parameter.copy_(1 + 0.5 * torch.randn(parameter.shape, generator=generator))


def tiny_verifier(folder: Path, inputs: dict, sizes: dict = SIZES) -> Path:
    """A Llama target folder whose embedding is the inputs' one: speculators' from_pretrained reads the
    verifier named in the config (its config, embedding and lm_head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    layer_sizes = {k: v for k, v in sizes.items() if k != "draft_vocab_size"}
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**layer_sizes, num_hidden_layers=8, tie_word_embeddings=False))
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(inputs["embedding"])
    target.save_pretrained(str(folder))
    return folder


def eagle3lib_drafter(flags: dict, inputs: dict, seed: int) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(
        DrafterConfig(**SIZES, aux_layer_ids=AUX_IDS, verifier=inputs.get("verifier"), **flags)
    )
    randomise_norms(drafter, seed)
    vocab = VocabMap.from_ids(inputs["d2t_ids"], SIZES["vocab_size"])
    drafter.d2t.copy_(vocab.d2t)
    drafter.t2d.copy_(vocab.t2d)
    drafter.attach_embedding(inputs["embedding"])
    return drafter


def eagle3lib_logits(drafter: Eagle3Drafter, inputs: dict, first_position: int) -> torch.Tensor:
    """[K, T, Vd] logits of TTT steps 0..K-1 with positions first_position.. (RoPE is relative, but each
    reference numbers from its own origin: speculators from 1, SpecForge from 0)."""
    ids = inputs["input_ids"]
    positions = torch.arange(first_position, first_position + ids.shape[1])[None]
    with torch.no_grad():
        logits, _ = drafter.unroll(ids, inputs["hidden_states"], TTT_STEPS, positions)
    return logits[:, 0]


# ----------------------------------------------------------------------------- the reference projects


class KeyWarnings(logging.Handler):
    """Collects every log record that mentions missing, unexpected or newly initialised weights."""

    words = ("missing", "unexpected", "newly initialized", "not initialized", "not used", "mismatch")

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if any(word in message.lower() for word in self.words):
            self.messages.append(message)

    def __enter__(self) -> KeyWarnings:
        from transformers.utils import logging as hf_logging

        hf_logging.get_logger().addHandler(self)
        logging.getLogger().addHandler(self)
        try:  # speculators logs through loguru
            from loguru import logger

            def forward(message) -> None:
                self.emit(logging.makeLogRecord({"msg": str(message)}))

            self._loguru = logger.add(forward, level="WARNING")
        except ImportError:
            self._loguru = None
        return self

    def __exit__(self, *exc) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.get_logger().removeHandler(self)
        logging.getLogger().removeHandler(self)
        if self._loguru is not None:
            from loguru import logger

            logger.remove(self._loguru)


def reference_speculators_model(flags: dict, inputs: dict, seed: int, sizes: dict = SIZES):
    """A speculators `Eagle3DraftModel` built by speculators itself (random weights, norms randomised)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    layer = LlamaConfig(**{k: v for k, v in sizes.items() if k != "draft_vocab_size"}, num_hidden_layers=1)
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=sizes["draft_vocab_size"],
        norm_before_residual=flags["norm_before_residual"],
        fc_norm=flags["fc_norm"],
        norm_output=flags["feed_normed_hidden"],
        eagle_aux_hidden_state_layer_ids=[i + 1 for i in AUX_IDS],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=TTT_STEPS)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=inputs["verifier"], architectures=["LlamaForCausalLM"]),
        ),
    )
    torch.manual_seed(seed)
    model = eager_attention(Eagle3DraftModel(config))
    randomise_norms(model, seed)
    vocab = VocabMap.from_ids(inputs["d2t_ids"], sizes["vocab_size"])
    with torch.no_grad():
        model.embed_tokens.weight.copy_(inputs["embedding"])
    model.load_vocab_mappings(vocab.t2d, vocab.d2t)
    model.load_verifier_weights()  # lm_head from the verifier's rows, as speculators' trainer starts
    return model.eval()


def speculators_logits(model, inputs: dict) -> torch.Tensor:
    """[K, T, Vd] from speculators' own TTT forward (it returns tokens only: lm_head's outputs are kept)."""
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()[0]))
    ids = inputs["input_ids"]
    try:
        with torch.no_grad():
            model(inputs["hidden_states"], ids, torch.zeros_like(ids), ttt_steps=TTT_STEPS)
    finally:
        hook.remove()
    return torch.stack(captured)


def reference_specforge_model(flags: dict, inputs: dict, seed: int, sizes: dict = SIZES):
    """A SpecForge `LlamaForCausalLMEagle3` built by SpecForge itself; `norm_output` in its own meaning."""
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    config = LlamaConfig(**sizes, num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"],
                         fc_norm=flags["fc_norm"], norm_output=flags["norm_before_lm_head"],
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLMEagle3(config)
    randomise_norms(model, seed)
    vocab = VocabMap.from_ids(inputs["d2t_ids"], sizes["vocab_size"])
    with torch.no_grad():
        model.embed_tokens.weight.copy_(inputs["embedding"])
        model.d2t.copy_(vocab.d2t)
        model.t2d.copy_(vocab.t2d)
    return model.eval()


def specforge_logits(model, inputs: dict) -> torch.Tensor:
    """[K, T, Vd] through SpecForge's own pieces, chained as its trainer does (sdpa, teacher-forced)."""
    ids, hidden = inputs["input_ids"], inputs["hidden_states"]
    B, T = ids.shape
    positions = torch.arange(T)[None]
    mask = model.prepare_decoder_attention_mask(
        attention_mask=torch.ones(B, T, dtype=torch.bool), hidden_states=hidden, batch_size=B, seq_length=T,
        past_key_values_length=0,
    )
    cache: list[list[torch.Tensor]] = [[], []]
    steps = []
    with torch.no_grad():
        hidden = model.project_hidden_states(hidden)
        for k in range(TTT_STEPS):
            tokens = torch.nn.functional.pad(ids[:, k:], (0, k), value=0)
            embeds = model.embed_input_ids(tokens)
            hidden = model.backbone(embeds, hidden, cache, mask, positions)
            steps.append(model.compute_logits(hidden)[0])
    return torch.stack(steps)


def load_specforge(folder: Path, embedding: torch.Tensor):
    from specforge.modeling.auto import AutoDraftModel

    model = AutoDraftModel.from_pretrained(str(folder), torch_dtype=torch.float32)
    # transformers 5 builds the model on the meta device: SpecForge's RoPE cos/sin caches (non-persistent
    # buffers) come out uninitialised (NaN logits); SpecForge's own code rebuilds them like this
    model.midlayer.self_attn._init_rope()  # noqa: SLF001
    with torch.no_grad():  # SpecForge, like SGLang, takes the embedding from the target (load_embedding)
        model.embed_tokens.weight.copy_(embedding)
    return model.eval()


def load_speculators(folder: Path):
    from speculators.models.eagle3 import Eagle3DraftModel

    return eager_attention(Eagle3DraftModel.from_pretrained(str(folder))).eval()


def eager_attention(model):
    """speculators' dense-mask attention path: its default flex attention needs lengths in 128-blocks."""
    from speculators.models.attention import create_float_mask

    model._attn_impl = "eager"  # noqa: SLF001 (the switches speculators' __init__ sets from the config)
    model._create_mask_fn = create_float_mask  # noqa: SLF001
    model.config.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001
    for layer in model.layers:
        layer.self_attn.config._attn_implementation = "eager"  # noqa: SLF001
    return model


# ----------------------------------------------------------------------------- the check


def flag_combinations() -> list[dict]:
    combos = []
    for residual, fc_norm, lm_head_norm, feed in itertools.product((False, True), repeat=4):
        if feed and not lm_head_norm:
            continue  # refused by DrafterConfig: no project has it
        combos.append(dict(norm_before_residual=residual, fc_norm=fc_norm, norm_before_lm_head=lm_head_norm,
                           feed_normed_hidden=feed))
    return combos


def compare(name: str, ours: torch.Tensor, theirs: torch.Tensor, results: list) -> None:
    difference = (ours - theirs).abs().max().item()
    results.append((name, difference, difference <= TOLERANCE))
    print(f"{'ok  ' if difference <= TOLERANCE else 'FAIL'} {name}: max |logit difference| over step 0 and "
          f"{TTT_STEPS - 1} TTT steps {difference:.2e}")


def label(flags: dict) -> str:
    return ",".join(f"{k}={int(v)}" for k, v in flags.items())


def check(work: Path) -> list:
    results: list = []
    inputs = fixed_inputs()
    inputs["verifier"] = str(tiny_verifier(work / "verifier", inputs))
    for index, flags in enumerate(flag_combinations()):
        seed = 100 + index
        drafter = eagle3lib_drafter(flags, inputs, seed)
        mismatches = drafter.config.engine_mismatches()
        for project, layout, loader, first_position, logits_of in (
            ("speculators", "speculators", lambda f: load_speculators(f), 1, speculators_logits),
            ("SpecForge", "sglang", lambda f: load_specforge(f, inputs["embedding"]), 0, specforge_logits),
        ):
            folder = work / f"ours-{index}-{project}"
            name = f"eagle3lib -> {project} [{label(flags)}]"
            try:
                save_drafter(drafter, folder, layout, engines=(project,))
            except EngineMismatchError as err:
                refused = bool(mismatches[project])
                results.append((name, None, refused))
                print(f"{'ok  ' if refused else 'FAIL'} {name}: export refused ({str(err)[:90]}...)")
                continue
            if mismatches[project]:
                results.append((name, None, False))
                print(f"FAIL {name}: exported although {project} {mismatches[project]}")
                continue
            with KeyWarnings() as warnings:
                model = loader(folder)
            unexpected = [w for w in warnings.messages if not _skipped_embedding(project, w)]
            if unexpected:
                results.append((name, None, False))
                print(f"FAIL {name}: key warnings while loading: {unexpected}")
                continue
            ours = eagle3lib_logits(drafter, inputs, first_position)
            compare(name, ours, logits_of(model, inputs), results)

        # their drafters, loaded by eagle3lib
        for project, build, first_position, logits_of, representable in (
            ("speculators", reference_speculators_model, 1, speculators_logits, flags["norm_before_lm_head"]),
            ("SpecForge", reference_specforge_model, 0, specforge_logits,
             not flags["norm_before_residual"] and not flags["feed_normed_hidden"]),
        ):
            if not representable:
                continue  # the project has no such flag: nothing of theirs to load
            model = build(flags, inputs, seed)
            folder = work / f"theirs-{index}-{project}"
            model.save_pretrained(str(folder))
            ours, report = load_drafter(folder)  # strict: any missing/unexpected key raises
            ours.config.check()
            if not ours.owns_embedding:
                ours.attach_embedding(inputs["embedding"])
            name = f"{project} -> eagle3lib [{label(flags)}] ({report.summary()})"
            compare(name, eagle3lib_logits(ours, inputs, first_position), logits_of(model, inputs), results)
    return results


def _skipped_embedding(project: str, message: str) -> bool:
    """SpecForge's AutoDraftModel skips exactly this warning itself: the SGLang layout has no embedding."""
    return project == "SpecForge" and "embed_tokens.weight" in message and "missing" not in message.lower()


def main() -> int:
    from importlib.metadata import version

    import specforge  # noqa: F401
    import transformers

    print(f"speculators {version('speculators')}, specforge {version('specforge')}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="interop-") as work:
        results = check(Path(work))
    failed = [name for name, _, ok in results if not ok]
    worst = max((d for _, d, _ in results if d is not None), default=0.0)
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed (largest logit difference {worst:.2e}, "
          f"tolerance {TOLERANCE:g})")
    for name in failed:
        print(f"FAILED {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
