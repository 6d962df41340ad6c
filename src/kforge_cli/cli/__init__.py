"""The Typer application: one module per subcommand. Imports no torch at module level."""
