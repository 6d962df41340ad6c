"""engine.checkpoint (layer 3): DCP checkpoints, durable commit and `latest`, resume and warm start.

`CheckpointManager` saves and restores a run; `read_dcp_metadata`, `SafeFileSystemReader`
and `SafeLoadPlanner` open any DCP checkpoint without running code hidden in it (use them
for inspection and conversion too); `resolve_checkpoint` turns a run dir or step dir into
a complete checkpoint directory; `load_model_weights` is the weights-only warm start.
"""

from kforge_cli.engine.checkpoint.checkpoint_errors import CheckpointError, UnsafeCheckpointError
from kforge_cli.engine.checkpoint.dcp_io import load_from_dirs, load_model_weights, training_state_dict
from kforge_cli.engine.checkpoint.groups import CheckpointGroups
from kforge_cli.engine.checkpoint.manager import CheckpointManager, Restored, SaveRecord
from kforge_cli.engine.checkpoint.restore import HFLoader, RunParts
from kforge_cli.engine.checkpoint.safe_metadata import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata
from kforge_cli.rundir.checkpoints import dcp_dirs, is_complete, newest_complete, read_latest, resolve_checkpoint
from kforge_cli.rundir.fingerprint import changed_fields, fingerprint, shaping_config

__all__ = [
    "CheckpointError",
    "CheckpointGroups",
    "CheckpointManager",
    "HFLoader",
    "Restored",
    "RunParts",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "SaveRecord",
    "UnsafeCheckpointError",
    "changed_fields",
    "dcp_dirs",
    "fingerprint",
    "is_complete",
    "load_from_dirs",
    "load_model_weights",
    "newest_complete",
    "read_dcp_metadata",
    "read_latest",
    "resolve_checkpoint",
    "shaping_config",
    "training_state_dict",
]
