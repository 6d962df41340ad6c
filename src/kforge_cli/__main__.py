"""`python -m kforge_cli ...` (what `torchrun -m kforge_cli train ...` runs)."""

from kforge_cli.cli.app import main

if __name__ == "__main__":
    main()
