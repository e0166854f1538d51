"""Training: making drafters.

remap (a warm start's lm_head moved onto a new vocab map, with the exact-logit proof), loss (the TTT loss and
its metrics), trainer (TTT steps, schedule, checkpoints, bit-for-bit resume, one torchrun rank), train (the
experiment around it: arms, warm starts, the step-0 check; `python -m eagle3lib.training.train`).

Imports every floor below: the ground, the drafter, the target, data, decoding and generation.
"""
