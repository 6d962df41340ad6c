"""Every evaluation (layer 6): in-loop eval loss, downstream multiple choice, ``kforge eval`` tasks
(held-out, MC, the lm-eval adapter and task files) and bits per byte."""
