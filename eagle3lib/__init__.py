"""eagle3lib: move EAGLE-3 drafters between targets and vocab maps, and prove it worked."""

import os

# Bit-exact resume needs bit-exact arithmetic: on AVX-512 CPUs MKL's matrix products otherwise round
# differently with the memory alignment of their operands, so two runs of the same recipe drift apart by
# 1e-8 (README, "Dtypes, machines and exact resume"). MKL reads this when it first runs, so it is set before
# any torch work.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# torch's CPU allocator caches nothing: a batch's KV cache and a step's activations are fresh pages, each one
# faulted in on first touch (a third of a multi-turn regeneration's prefill). With this, allocations of 2 MB
# or more ask for transparent huge pages (where the kernel's THP mode is `madvise` or `always`; elsewhere it
# changes nothing): 78 MB allocated and filled in 10 ms against 31-52, batch-256 regeneration +5-10 %
# (bench/RESULTS.md §10). Read at torch's first such allocation, so it is set before any torch work.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
