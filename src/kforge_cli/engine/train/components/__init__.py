"""Loop components: what acts around the step (docs/architecture.md, "Loop components").

The protocol (`LoopComponent`, `Components`, `Rewind`, `Stop`) is defined next to the session
its methods receive (`engine.train.session`, which says when the loop calls what) and
re-exported here; the components kforge ships are the other modules of this package, listed
for a configuration by `registry.components_for`.
"""

from kforge_cli.engine.train.session import Components, LoopComponent, Rewind, Status, Stop, Verdict

__all__ = ["Components", "LoopComponent", "Rewind", "Status", "Stop", "Verdict"]
