"""The target: the model a drafter drafts for.

model (a Hugging Face target: aux hidden states, verifier logits on the draft vocab, its fingerprint), direct
(a Llama-like target's decoder layers called directly, in fewer kernels, for the batched engine),
decode_attention (the compiled decoding steps' attention on a CPU, a C++ kernel built on first use), zoo (the
embedded targets: SmolLM2-135M-Instruct from its wheel, tiny-llama for tests).

Imports the ground floor and the drafter.
"""
