"""Loop components: what acts around the step (see ``engine.train.loop`` and docs/architecture.md)."""
