"""`kforge prepare-data`: text/JSONL/local HF datasets -> token shards (separate from the training
loader, which only reads what this writes). `pipeline` runs it; `inputs` and `hf_source` split the
inputs into record-range work units; `encode_worker` tokenises one unit in a worker process."""

from kforge_cli.engine.data.prepare.prepare_run import PrepareResult, prepare_data

__all__ = ["PrepareResult", "prepare_data"]
