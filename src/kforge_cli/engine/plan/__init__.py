"""The planner (layer 4, beside ``checkpoint/``): memory plan, cost model and layout search.

It sums the memory and communication terms that each parallelism (``parallel/``) and each
model family (``families/``) exports; it sits below ``train/`` so a job can re-plan at start.
"""
