"""Is the CUDA path right, and how fast is it: one command on a GPU host (`make gpu-check`).

    make setup && make gpu-check                      # = .venv/bin/python bench/gpu_check.py
    .venv/bin/python bench/gpu_check.py [--seq-len 2048] [--ttt-steps 7] [--steps 3] [--skip-tests]

On one CUDA device (the current one), in order:
1. the CUDA cases of tests/test_model.py (`pytest -k cuda`): fused vs blocked vs plain masked TTT attention,
   forward and backward, in float32 and bfloat16; the speculators fixtures (step 0 and TTT) and the
   bf16-autocast unroll gradients on the device; greedy speculative decoding identical to the target's own
   in float32. Their CPU twins run under `make test`.
2. a training step of a Kimi-K2.5-shaped drafter (H 7,168, 64 heads x 128, intermediate 12,288, Vt 163,840,
   Vd 32,000, T 2,048, 7 TTT steps, bf16 autocast, lm_head frozen as speculators trains it) through the
   trainer's own code, on the fused kernel and on the blocked path: the two must give the same loss and
   gradient norm; then tokens/s and peak `torch.cuda.max_memory_allocated` of each, next to what
   bench/memory_plan.py predicts for the same step (traced on fake tensors); measured and predicted must
   agree within MEMORY_TOLERANCE.
3. when `.venv-bench` exists (`make bench-venv`): speculators 0.9.0's Eagle3DraftModel on the same weights
   and batch (bench/bench_vs_speculators.py builds it), in a child process of that venv: tokens/s and peak.
4. decoding: which serving engines the host has (vLLM, SGLang: installed or not, their versions), then
   SmolLM2-135M-Instruct in bf16 replying to ShareGPT first turns through the built-in engine, eager and
   compiled, as `eagle3 regenerate` drives it (bench/bench_regenerate.py's measurement): reply tokens/s at
   `--decode-batch`, against the goal of DECODING_GOAL at batch 256.

Every check runs; the script ends with the failed ones named and exits 1 if there are any. Without a CUDA
device it says so and exits 0: nothing was checked.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import bench_regenerate
import bench_vs_speculators
import memory_plan
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from eagle3lib.data.conversations import ChatRenderer
from eagle3lib.data.readers import TrainingData
from eagle3lib.drafter import ttt_attention
from eagle3lib.drafter.config import default_aux_layer_ids
from eagle3lib.drafter.vocab import VocabMap
from eagle3lib.params import load_params
from eagle3lib.target.model import Target
from eagle3lib.training import arms
from eagle3lib.training.trainer import Processes, Trainer

ROOT = Path(__file__).resolve().parent.parent
BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
GIB = 2**30
KIMI = {"hidden": 7168, "heads": 64, "kv_heads": 64, "head_dim": 128, "intermediate": 12288, "vt": 163_840,
        "vd": 32_000}
# fused vs blocked on one batch from the same weights, bf16 autocast: relative differences allowed
LOSS_TOLERANCE, GRAD_NORM_TOLERANCE = 1e-2, 5e-2
MEMORY_TOLERANCE = 0.15  # |measured / predicted - 1| for the peak of a step
DECODING_GOAL = 25_000  # reply tokens/s of SmolLM2-135M in bf16 at batch 256 on one GPU (issue 40)


class Checks:
    """Named checks: each runs, its failure is recorded with the reason, the summary names them."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def expect(self, ok: bool, name: str, detail: str) -> None:
        print(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}")
        if not ok:
            self.failed.append(name)

    @contextlib.contextmanager
    def running(self, name: str):
        try:
            yield
        except Exception as error:  # a crash fails the check it happened in; the others still run
            print(f"  [FAIL] {name}: {type(error).__name__}: {error}")
            self.failed.append(name)


# ----------------------------------------------------------------------------- 1. the tests on CUDA


def run_cuda_tests(checks: Checks) -> None:
    print("\n1. tests on CUDA: pytest tests/test_model.py -k cuda", flush=True)
    command = [sys.executable, "-m", "pytest", "tests/test_model.py", "-k", "cuda", "-q", "-rfEs",
               "-p", "no:cacheprovider"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    print("\n".join("    " + line for line in done.stdout.strip().splitlines()[-25:]))
    skipped = "skipped" in done.stdout.splitlines()[-1] if done.stdout.strip() else False
    checks.expect(done.returncode == 0 and not skipped, "CUDA tests (pytest tests/test_model.py -k cuda)",
                  "all passed, none skipped" if done.returncode == 0 and not skipped else
                  f"exit status {done.returncode}{', some skipped' if skipped else ''}: see the lines above")


# ----------------------------------------------------------------------------- 2. the training step


def shape_args(args: argparse.Namespace) -> argparse.Namespace:
    """memory_plan's options for the step this script runs."""
    return argparse.Namespace(**KIMI, seq_len=args.seq_len, ttt_steps=args.ttt_steps, micro_batch=1,
                              dtype="bf16", data_dtype="bfloat16", train_lm_head=False)


def predicted_peak(shape: argparse.Namespace, kernel: ttt_attention.PrefixAttentionKernel | None) -> int:
    """Bytes memory_plan traces for a step after the first: held tensors + the step's peak. `kernel` None: the
    CPU's fused kernel on fake tensors, whose outputs are the CUDA kernels' (out and a float32 lse)."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    forced = ttt_attention.forced_prefix_kernel(kernel) if kernel else contextlib.nullcontext()
    trainer, head, batch = memory_plan.build_trainer(shape, fake)
    with fake, forced:
        tracker, _ = memory_plan.trace_steps(trainer, head, batch, shape)
        drafter = trainer.drafter
        held = memory_plan.unique_bytes([*drafter.parameters(), *drafter.buffers(), trainer.draft_head,
                                         *batch.values()])
    return held + tracker.peak


def build_on_device(shape: argparse.Namespace, device: torch.device, seed: int = 0):
    """The scratch arm's Trainer on the device (random target head, random batch of one sequence) as a real
    run builds it, and the verifier's pre-norm states of the batch (what speculators takes)."""
    generator = torch.Generator(device).manual_seed(seed)
    H, T, vt, vd = shape.hidden, shape.seq_len, shape.vt, shape.vd
    vocab_map = VocabMap.from_ids(torch.arange(vd) * (vt // vd), vt)
    head = {name: torch.randn(rows, H, generator=generator, device=device, dtype=torch.bfloat16) * 0.02
            for name, rows in (("embed_tokens.weight", vt), ("lm_head.weight", vt))}
    head["norm.weight"] = torch.ones(H, device=device, dtype=torch.bfloat16)
    sizes = {"num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
             "head_dim": shape.head_dim, "intermediate_size": shape.intermediate, "rms_norm_eps": 1e-6,
             "rope_theta": 1e6, "max_position_embeddings": 262_144}
    t = load_params(None, {"run": {"device": device.type}, "train": {
        "seq_len": T, "ttt_steps": shape.ttt_steps, "micro_batch_size": 1, "batch_size": 1, "dtype": "bf16",
        "train_lm_head": False, "checkpoint_every": 0, "scratch": sizes}})["train"]
    aux_ids = default_aux_layer_ids(61)
    data = TrainingData(None, vocab_map, head, H, vt, aux_ids, "Kimi-K2.5-shaped random target")
    with torch.device(device):
        drafter, _ = arms.init_drafter("scratch", t, data, seed=seed)
    trainer = Trainer(drafter, data, t, seed, None, Processes(device=device), log=lambda m: None)
    head["lm_head.weight"] = head["lm_head.weight"].cpu()  # a real run keeps it on the host, as the plan does
    pre_norm = torch.randn(1, T, H, generator=generator, device=device, dtype=torch.bfloat16)
    last = F.rms_norm(pre_norm.float(), (H,), head["norm.weight"].float(), 1e-6)
    draft_ids = vocab_map.draft_ids.to(device)
    batch = {
        "input_ids": torch.randint(0, vt, (1, T), generator=generator, device=device),
        "aux_hidden_states": torch.randn(1, T, len(aux_ids) * H, generator=generator, device=device,
                                         dtype=torch.bfloat16),
        "last_hidden_state": last.to(torch.bfloat16),
        "target_argmax": draft_ids[(last @ trainer.draft_head.T).argmax(-1)],  # inside the draft vocab
        "loss_mask": torch.ones(1, T, dtype=torch.long, device=device),
        "attention_mask": torch.ones(1, T, dtype=torch.long, device=device),
    }
    return trainer, head, batch, pre_norm


def forced(kernel: ttt_attention.PrefixAttentionKernel | None):
    """The path `kernel` names (None: the device's own choice, its fused kernel)."""
    return ttt_attention.forced_prefix_kernel(kernel) if kernel else contextlib.nullcontext()


def compare_paths(trainer: Trainer, batch: dict, checks: Checks) -> None:
    """Forward and backward of one batch from the same weights (no optimizer step in between) on the fused
    and on the blocked path: the same loss per TTT step and gradient norm."""
    first = {}
    for name, kernel in (("fused", None), ("blocked", ttt_attention.BLOCKED_KERNEL)):
        with forced(kernel):
            sums, grad_norm, *_ = trainer._optimizer_step(batch)
        trainer.optimizer.zero_grad(set_to_none=True)
        first[name] = (sums[0].cpu(), grad_norm)  # row 0: each TTT step's cross-entropy sum
    (ce_fused, norm_fused), (ce_blocked, norm_blocked) = first["fused"], first["blocked"]
    loss_error = float(((ce_fused - ce_blocked).abs() / ce_blocked.abs()).max())
    norm_error = abs(norm_fused - norm_blocked) / norm_blocked
    checks.expect(loss_error <= LOSS_TOLERANCE, "fused vs blocked: loss per TTT step",
                  f"max relative difference {loss_error:.1e} (allowed {LOSS_TOLERANCE:.0e})")
    checks.expect(norm_error <= GRAD_NORM_TOLERANCE, "fused vs blocked: gradient norm",
                  f"{norm_fused:.5f} vs {norm_blocked:.5f}, relative difference {norm_error:.1e} "
                  f"(allowed {GRAD_NORM_TOLERANCE:.0e})")


def timed_steps(step, steps: int, device: torch.device) -> tuple[float, int]:
    """Median seconds of `steps` calls after one warm-up (which makes the AdamW state), and their peak
    allocated bytes."""
    step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), torch.cuda.max_memory_allocated(device)


def training_step(args: argparse.Namespace, device: torch.device, checks: Checks) -> dict:
    shape = shape_args(args)
    print(f"\n2. training step: Kimi-K2.5-shaped drafter (H {shape.hidden:,}, {shape.heads}/{shape.kv_heads} "
          f"heads x {shape.head_dim}, interm. {shape.intermediate:,}, Vt {shape.vt:,}, Vd {shape.vd:,}), "
          f"1 x T {shape.seq_len:,}, {shape.ttt_steps} TTT steps, bf16 autocast, lm_head frozen", flush=True)
    kernels = {"fused": None, "blocked": ttt_attention.BLOCKED_KERNEL}
    with checks.running("memory plan (bench/memory_plan.py)"):
        predicted = {name: predicted_peak(shape, kernel) for name, kernel in kernels.items()}
    trainer, head, batch, pre_norm = build_on_device(shape, device)
    q = torch.empty(1, shape.heads, shape.seq_len, shape.head_dim, device=device, dtype=torch.bfloat16)
    kv = torch.empty(1, shape.kv_heads, shape.seq_len, shape.head_dim, device=device, dtype=torch.bfloat16)
    print(f"  fused kernel for these inputs: {ttt_attention.prefix_attention_kernel(q, kv, kv).name}")
    with checks.running("fused vs blocked training step"):
        compare_paths(trainer, batch, checks)
    results, tokens = {}, int(batch["attention_mask"].sum())
    step = functools.partial(bench_vs_speculators.eagle3lib_step, trainer, batch)
    for name in kernels:
        with checks.running(f"timed steps on the {name} path"), forced(kernels[name]):
            seconds, peak = timed_steps(step, args.steps, device)
            results[name] = {"tokens_per_s": tokens / seconds, "step_s": seconds, "peak_bytes": peak}
            plan = predicted.get(name)
            versus = f"; memory plan {plan / GIB:.2f} GiB ({peak / plan:.2f}x)" if plan else ""
            print(f"  eagle3lib, {name:>7}: {tokens / seconds:9.1f} tokens/s (median step {seconds:.3f} s of "
                  f"{args.steps}), peak {peak / GIB:.2f} GiB allocated{versus}")
            if plan:
                checks.expect(abs(peak / plan - 1) <= MEMORY_TOLERANCE, f"peak memory vs plan ({name})",
                              f"measured {peak / GIB:.2f} GiB, predicted {plan / GIB:.2f} GiB "
                              f"(allowed ±{MEMORY_TOLERANCE:.0%})")
    if len(results) == 2:
        speed = results["blocked"]["step_s"] / results["fused"]["step_s"]
        print(f"  fused / blocked: {speed:.2f}x the speed, "
              f"{results['fused']['peak_bytes'] / results['blocked']['peak_bytes']:.2f}x the peak")
    return results


# ----------------------------------------------------------------------------- 3. speculators


def speculators_child(args: argparse.Namespace, device: torch.device) -> None:
    """In .venv-bench: speculators' model from the same seed's drafter and batch; prints one JSON line."""
    shape = shape_args(args)
    trainer, head, batch, pre_norm = build_on_device(shape, device)
    side = bench_vs_speculators.speculators_side(trainer, head, batch, pre_norm, args.speculators_attn,
                                                 shape.ttt_steps)
    tokens = int(batch["attention_mask"].sum())
    del trainer, head, batch  # speculators holds its own copies of what it needs
    torch.cuda.empty_cache()
    side.model.to(device)
    side.inputs = {key: value.to(device) for key, value in side.inputs.items()}

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            side.step()

    seconds, peak = timed_steps(step, args.steps, device)
    print(json.dumps({"tokens_per_s": tokens / seconds, "step_s": seconds, "peak_bytes": peak}))


def against_speculators(args: argparse.Namespace, ours: dict, checks: Checks) -> None:
    print(f"\n3. speculators 0.9.0 (attention {args.speculators_attn}), same weights and batch", flush=True)
    if not BENCH_PYTHON.exists():
        print("  skipped: no .venv-bench (make bench-venv makes it)")
        return
    command = [str(BENCH_PYTHON), __file__, "--speculators-child", "--seq-len", str(args.seq_len),
               "--ttt-steps", str(args.ttt_steps), "--steps", str(args.steps),
               "--speculators-attn", args.speculators_attn]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        checks.expect(False, "speculators step", f"child failed:\n{done.stderr[-3000:]}")
        return
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"  speculators:   {theirs['tokens_per_s']:9.1f} tokens/s (median step {theirs['step_s']:.3f} s), "
          f"peak {theirs['peak_bytes'] / GIB:.2f} GiB allocated")
    if "fused" in ours:
        speed = theirs["step_s"] / ours["fused"]["step_s"]
        print(f"  eagle3lib (fused) / speculators: {speed:.2f}x the speed, "
              f"{ours['fused']['peak_bytes'] / theirs['peak_bytes']:.2f}x the peak")


# ----------------------------------------------------------------------------- 4. decoding


def serving_engines() -> dict[str, str | None]:
    """The serving engines installed beside this Python: name -> version, None where absent."""
    found = {}
    for name in ("vllm", "sglang"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def decoding(args: argparse.Namespace, device: torch.device, checks: Checks) -> None:
    engines = serving_engines()
    print(f"\n4. decoding: {bench_regenerate.TARGET} in bf16, {args.decode_prompts} ShareGPT first turns x "
          f"{args.decode_tokens} new tokens at most, greedy, batch {args.decode_batch}", flush=True)
    print("  serving engines here: " + ", ".join(f"{name} {version}" if version else f"{name} not installed"
                                                 for name, version in engines.items()))
    target = Target.load(bench_regenerate.TARGET, dtype="bfloat16", device=device)
    renderer = ChatRenderer(target.tokenizer, target.stop_token_ids)
    batch = bench_regenerate.requests(renderer, args.decode_prompts, 384)
    fastest = 0.0
    for name in ("builtin", "builtin-compiled"):
        with checks.running(f"decoding ({name})"):
            tokens, seconds, ready = bench_regenerate.measure(
                name, target, renderer, batch, args.decode_batch, args.decode_batch, args.decode_tokens)
            fastest = max(fastest, tokens / seconds)
            print(f"  {name:>16}: {tokens:,} reply tokens in {seconds:.1f} s = {tokens / seconds:,.0f} tok/s "
                  f"(warm-up call {ready:.0f} s, not counted)", flush=True)
    if fastest:
        checks.expect(fastest >= DECODING_GOAL, f"decoding speed at batch {args.decode_batch}",
                      f"{fastest:,.0f} reply tokens/s, the goal {DECODING_GOAL:,} at batch 256")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per path (after 1 warm-up)")
    parser.add_argument("--skip-tests", action="store_true", help="only the timed training step")
    parser.add_argument("--speculators-attn", default="sdpa", choices=["eager", "sdpa"])
    parser.add_argument("--speculators-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--decode-prompts", type=int, default=512, help="4. decoding: ShareGPT first turns")
    parser.add_argument("--decode-tokens", type=int, default=128, help="4. decoding: new tokens at most")
    parser.add_argument("--decode-batch", type=int, default=256, help="4. decoding: replies decoded together")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda}): nothing was checked. Run it on a GPU host.")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    if args.speculators_child:
        speculators_child(args, device)
        return 0
    props = torch.cuda.get_device_properties(device)
    print(f"gpu-check on {props.name} (sm {props.major}.{props.minor}, {props.total_memory / GIB:.0f} GiB), "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    checks, start = Checks(), time.perf_counter()
    if not args.skip_tests:
        run_cuda_tests(checks)
    ours = {}
    with checks.running("training step"):
        ours = training_step(args, device, checks)
    torch.cuda.empty_cache()  # the trainer is gone; give its cached blocks back before the next process
    with checks.running("speculators step"):
        against_speculators(args, ours, checks)
    torch.cuda.empty_cache()
    with checks.running("decoding"):
        decoding(args, device, checks)
    print(f"\ngpu-check took {time.perf_counter() - start:.0f} s")
    if checks.failed:
        print("FAILED: " + "; ".join(checks.failed))
        return 1
    print("PASSED: every check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
