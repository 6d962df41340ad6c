"""Every evaluation (layer 7, beside ``train/``): in-loop eval loss (``in_loop``), downstream multiple
choice (``downstream``, ``mc_tasks``), ``kforge eval`` tasks (``tasks``: held-out, MC, the lm-eval adapter
and task files) and bits per byte."""
