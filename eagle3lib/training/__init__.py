"""Training: making drafters.

audit (a drafter against a new target before a single step: `eagle3 check`), remap (a warm start's lm_head
moved onto a new vocab map, with the exact-logit proof), arms (the drafter each arm starts from, and the
step-0 check), loss (the TTT loss and its metrics), trainer (TTT steps, schedule, checkpoints, L2-SP,
bit-for-bit resume, one torchrun rank), train (the experiment around it: every arm measured along training,
its drafter chosen by validation τ; `python -m eagle3lib.training.train`), relay (an unfinished run carried to
another machine: `eagle3 relay`, `eagle3 restore`).

Imports every floor below: the ground, the drafter, the target, data, decoding and generation.
"""
