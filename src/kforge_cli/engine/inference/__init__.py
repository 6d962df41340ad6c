"""engine.inference: what a researcher does with a checkpoint after training.

Sampling text (`kforge generate`) and scoring it (`kforge eval`) from any checkpoint
`load_model` opens, on one process. The top layer: it may use training's loss and
evaluation data so that an offline held-out loss is the training run's own number.
"""
