"""eagle3lib: move EAGLE-3 drafters between targets and vocab maps, and prove it worked."""

import os

# Bit-exact resume needs bit-exact arithmetic: on AVX-512 CPUs MKL's matrix products otherwise round
# differently with the memory alignment of their operands, so two runs of the same recipe drift apart by
# 1e-8 (README, "Dtypes, machines and exact resume"). MKL reads this when it first runs, so it is set before
# any torch work.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
