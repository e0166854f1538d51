"""Decoding: speculative decoding and how τ is measured.

batches (B sequences in one KV cache per model: the target's and the drafter's), speculate (batched
speculative and target-only decoding on them, chain and tree), probe (a drafter measured on
prompts: τ as engines count it, speed), intervals (bootstrap intervals of τ, paired comparisons), engines
(the same through vLLM and SGLang), evaluate (05's logic: drafters x benchmarks, the K sweep, learning
curves).

Imports the ground floor, the drafter, the target and data.
"""
