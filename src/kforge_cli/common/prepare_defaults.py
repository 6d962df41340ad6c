"""`kforge prepare-data` defaults, shared by the CLI's options and the engine's function.

A module of plain constants outside `kforge_cli.settings`, so that `kforge prepare-data --help`
(and therefore `kforge --help`) does not import the settings model (pydantic, pydantic-settings).
"""

PREPARE_TOKENIZER = "byte"
PREPARE_VAL_FRACTION = 0.01
PREPARE_SHARD_TOKENS = 100_000_000
PREPARE_TEXT_FIELD = "text"
