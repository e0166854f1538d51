"""The drafter: what an EAGLE-3 drafter is and how it is stored.

config (DrafterConfig, each layout's config.json, aux-layer numbering, what each engine computes), vocab (the
d2t/t2d map), model (the drafter, its parameter names the SGLang checkpoint keys), ttt_attention (the
attention of train-time test), checkpoint (strict loading with a report, atomic saving, layout conversion),
inspection (`eagle3 inspect`).

Imports the ground floor only (files, progress, devices, params, runs).
"""
