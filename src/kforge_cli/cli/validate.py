"""`kforge validate-config`: resolve, validate and explain a configuration (no torch without --plan)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import typer

from kforge_cli.cli.options import OVERRIDES, ConfigOpt, ProfileOpt, resolve

# The layout search, trials and --mfu moved to `kforge plan` (issue 45): each old flag -> the command now.
MOVED = {
    "--search": "kforge plan search",
    "--top": "kforge plan search --top N",
    "--global-batch": "kforge plan search --global-batch N",
    "--memory-share": "kforge plan search --memory-share X",
    "--write-profile": "kforge plan search --write-profile FILE",
    "--overwrite": "kforge plan search --write-profile FILE --overwrite",
    "--trial": "kforge plan trial --best K",
    "--steps": "kforge plan trial --steps N",
    "--trial-dir": "kforge plan trial --trial-dir DIR",
    "--sbatch": "kforge plan trial --sbatch",
    "--mfu": "kforge plan --mfu X",
}


def _refuse_moved(args: list[str]) -> None:
    """A plan flag that moved to `kforge plan` (left in the overrides: validate-config no longer has it): exit 2
    naming the command that has it now."""
    from kforge_cli.errors import InvalidInputError

    flag = next((a.partition("=")[0] for a in args if a.partition("=")[0] in MOVED), None)
    if flag is not None:
        raise InvalidInputError(
            f"validate-config {flag}: the layout search, trials and --mfu moved to `kforge plan`: use `{MOVED[flag]}` "
            "(see `kforge plan --help`); `validate-config --plan` still prints the plan"
        )


def register(app: typer.Typer) -> None:
    app.command("validate-config", context_settings=OVERRIDES)(validate_config)


def validate_config(
    ctx: typer.Context,
    profile: ProfileOpt = None,
    config: ConfigOpt = None,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size", "-n", help="Processes the job runs with (default: slurm.nodes x slurm.gpus_per_node)."
        ),
    ] = None,
    fmt: Annotated[
        Literal["toml", "json"] | None, typer.Option("--format", help="Print the resolved config as TOML or JSON.")
    ] = None,
    explain: Annotated[
        str | None, typer.Option("--explain", help="Describe one key (e.g. model.dim): type, default, value, source.")
    ] = None,
    plan: Annotated[
        bool, typer.Option("--plan", help="Also print the plan: what kforge plan prints (memory per GPU, step time).")
    ] = False,
    rank: Annotated[int, typer.Option("--rank", help="With --plan: the rank to report.")] = 0,
) -> None:
    """Check a configuration: fields, cross-section rules and world-size rules, all at once.

    Overrides follow the options: `kforge validate-config -p h100x64 --model.n_layers=48`.
    Exit code 0 when valid, 2 when not (every problem listed with its dotted key). With
    `--plan` (`--format json` prints only the plan), also what `kforge plan` prints, and 1 when
    the plan does not fit the GPU. The layout search, trials and calibration are `kforge plan`'s.
    """
    from kforge_cli.errors import InvalidInputError
    from kforge_cli.settings import resolve_dims
    from kforge_cli.settings.explain import explain_key, to_toml

    _refuse_moved(list(ctx.args))
    resolved = resolve(profile, config, list(ctx.args), for_run=explain is None)  # data checks too
    s = resolved.settings
    if explain:
        typer.echo(explain_key(resolved, explain))
        return
    n = world_size if world_size is not None else s.slurm.world_size
    if n < 1:
        raise InvalidInputError(f"--world-size must be >= 1 (got {n})")
    dims = resolve_dims(s, n)
    if plan and fmt not in (None, "json"):
        raise InvalidInputError(f"--plan prints a table, or JSON with --format json (got --format {fmt!r})")
    if plan and fmt == "json":
        pass  # only the plan's JSON, below
    elif fmt is not None:
        if fmt == "toml":
            typer.echo(to_toml(s), nl=False)
        elif fmt == "json":
            typer.echo(json.dumps(s.model_dump(mode="json"), indent=2))
        else:
            raise InvalidInputError(f"--format must be 'toml' or 'json' (got {fmt!r})")
    else:
        _print_summary(s, dims, n)
    if plan:
        from kforge_cli.cli.plan import print_plan

        if fmt != "json":
            typer.echo("")
        print_plan(s, n, rank, fmt, None)


def _print_summary(s: Any, dims: Any, n: int) -> None:
    """The valid configuration in a few lines: mesh, model size, MoE, tokens per step."""
    from kforge_cli.settings.explain import vision_param_counts

    m = s.model
    tokens = s.train.tokens_per_step(dims.dp)
    typer.echo(f"config is valid: profile {s.profile or '-'}, world size {n}")
    cp = f" cp={dims.cp}" if dims.cp > 1 else ""
    typer.echo(f"  mesh: pp={dims.pp} dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard}{cp} tp={dims.tp}")
    text = _text_params(s)
    vision = vision_param_counts(s)
    known = [v for v in vision.values() if v is not None]
    total = text + sum(known)
    typer.echo(
        f"  model: {total / 1e6:,.1f}M parameters, dim {m.dim}, {m.n_layers} layers, "
        f"{m.n_heads} heads ({m.kv_heads} kv), vocab {m.vocab_size}"
    )
    if vision and s.vlm is not None:  # vision parts are counted only for a VLM
        names = {"vision_encoder": "vision encoder", "adapter": "adapter", "decoder": f"{s.vlm.arch} layers"}
        shown = ", ".join(
            f"{names[k]} {'(from its checkpoint, not counted)' if v is None else f'{v / 1e6:,.2f}M'}"
            for k, v in vision.items()
        )
        typer.echo(f"    text decoder {text / 1e6:,.2f}M; the vision parts add: {shown}")
    if m.moe is not None:
        moe = m.moe
        typer.echo(
            f"  MoE: {m.param_count(active=True) / 1e6:,.1f}M active parameters per token, "
            f"{moe.num_experts} experts (top {moe.top_k}, {moe.num_shared_experts} shared)"
        )
    typer.echo(f"  tokens per step: {tokens:,} (global batch {tokens // s.train.seq_len} x {s.train.seq_len})")


def _text_params(s: Any) -> int:
    """The text model's parameter count; a family other than the default one is asked (imports torch)."""
    if s.model.family == "llama":
        return s.model.param_count()
    from kforge_cli.engine.families.registry import family_for

    return family_for(s.model).param_count(s.model)
