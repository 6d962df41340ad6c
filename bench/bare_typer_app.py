"""A bare Typer app with the same five subcommands as kforge: the baseline for cli_startup.py."""

import typer

app = typer.Typer(no_args_is_help=True)


@app.command()
def train() -> None:
    """Train."""


@app.command()
def resume() -> None:
    """Resume."""


@app.command("convert-mot")
def convert_mot() -> None:
    """Convert."""


@app.command("inspect-ckpt")
def inspect_ckpt() -> None:
    """Inspect."""


@app.command("validate-config")
def validate_config() -> None:
    """Validate."""


if __name__ == "__main__":
    app()
