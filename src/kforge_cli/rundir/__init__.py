"""The run directory: one torch-free home for its layout and its rules.

`kforge train`, `--sbatch`, `kforge resume`, `kforge runs` and the engine all name, claim,
recognise, lock and read a run directory through this package, and it imports neither
torch nor the engine nor the CLI (an import-linter contract):

- :mod:`.layout`: :class:`RunDir` (every file name in a run), default names, claiming,
  what makes a directory a kforge run, the checkpoint root.
- :mod:`.checkpoints`: the checkpoint directories inside it (``step_N``, the commit
  marker, ``latest``, retention).
- :mod:`.saved_config`: ``config.toml`` (written once, when the run starts) and the
  accepted changes recorded beside it.
- :mod:`.fingerprint`: the model-shaping part of a configuration and its hash.
- :mod:`.lock`: one live run per directory.
"""
