"""`kforge profiles`: the profiles `--profile NAME` can find; `kforge profiles show NAME`: one, resolved.

Reads TOML files only (no pydantic, no torch), so it answers as fast as `kforge --help`.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

profiles_app = typer.Typer(no_args_is_help=False)


def register(app: typer.Typer) -> None:
    app.add_typer(profiles_app, name="profiles")


@profiles_app.callback(invoke_without_command=True)
def profiles(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per profile.")] = False,
) -> None:
    """List the profiles kforge can find: name, description, and where each comes from.

    Profiles are looked up in $KFORGE_PROFILE_PATH (colon-separated directories), then
    ./profiles (a project's own), then the profiles shipped with kforge; the first file of
    a name wins and shadows the others. Use one with `kforge train --profile NAME`; see
    what it sets with `kforge profiles show NAME`.
    """
    if ctx.invoked_subcommand is not None:
        return
    from kforge_cli.settings.profiles import list_profiles

    entries = list_profiles()
    if as_json:
        for e in entries:
            record = {
                "name": e.name,
                "description": e.description,
                "source": e.source,
                "path": str(e.path),
                "extends": e.extends,
                "shadows": [str(p) for p in e.shadows],
            }
            typer.echo(json.dumps(record))
        return
    if not entries:
        typer.echo("no profiles found (looked in $KFORGE_PROFILE_PATH, ./profiles and the shipped ones)")
        return
    import textwrap

    width = max(len(e.name) for e in entries)
    indent = " " * (width + 2)
    for e in entries:  # the description wrapped under the name, every line within 100 columns
        origin = e.source if e.source != "$KFORGE_PROFILE_PATH" else f"{e.source} ({e.path.parent})"
        if e.source != "shipped":
            origin += f", {e.path}"
        extra = f"; extends {e.extends}" if e.extends else ""
        shadow = f"; shadows {', '.join(str(p) for p in e.shadows)}" if e.shadows else ""
        typer.echo(f"{e.name:<{width}}  [{origin}{extra}{shadow}]")
        text = e.description or "(no description)"
        lines = textwrap.wrap(text, 100, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)
        typer.echo("\n".join(lines))


@profiles_app.command("show")
def show(name: Annotated[str, typer.Argument(help="A profile name, or a path to a .toml file.")]) -> None:
    """Print profile NAME as TOML with everything it extends merged in (the profile's own settings).

    The header says which files it was built from. Every other setting keeps its default:
    `kforge validate-config --profile NAME --format toml` prints all of them.
    """
    import tomli_w

    from kforge_cli.settings.profiles import extends_chain, load_profile

    data, _ = load_profile(name)
    chain = extends_chain(name)
    typer.echo(f"# profile {name}: {chain[0]}")
    for path in chain[1:]:
        typer.echo(f"#   extends {path.stem}: {path}")
    typer.echo(tomli_w.dumps(data), nl=False)
