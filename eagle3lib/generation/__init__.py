"""Generation: the target makes training data.

regenerate (every assistant turn answered by the target itself, resumable, with a manifest), capture (the
target's hidden states written into a data folder: 00's steps per corpus), online (the same computed in the
training loop, with the text kept as tokens).

Imports the ground floor, the drafter, the target, data and decoding.
"""
