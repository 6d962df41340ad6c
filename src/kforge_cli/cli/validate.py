"""`kforge validate-config`: resolve, validate and explain a configuration (no torch without --plan)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from kforge_cli.cli.options import OVERRIDES, ConfigOpt, ProfileOpt, resolve


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
    plan: Annotated[bool, typer.Option("--plan", help="Also simulate the parallel plan and per-GPU memory.")] = False,
    rank: Annotated[int, typer.Option("--rank", help="With --plan: the rank to report.")] = 0,
    mfu: Annotated[
        float | None,
        typer.Option(
            "--mfu",
            help="With --plan: the model FLOP utilisation the step time assumes (default 0.4; with --search: "
            "plan.mfu, else the GPU table's).",
        ),
    ] = None,
    search: Annotated[
        bool,
        typer.Option(
            "--search", help="With --plan: search the layouts (tp, pp, cp, ep, FSDP/HSDP, micro-batch, AC) that fit."
        ),
    ] = False,
    top: Annotated[int, typer.Option("--top", help="With --search: how many layouts to print.")] = 5,
    global_batch: Annotated[
        int | None,
        typer.Option(
            "--global-batch", help="With --search: sequences per step every layout keeps (default: the profile's)."
        ),
    ] = None,
    memory_share: Annotated[
        float,
        typer.Option(
            "--memory-share",
            help="With --search: keep layouts whose planned peak is within this share of the GPU's memory "
            "(above 0.9 the plan calls it tight: allocator fragmentation may still OOM).",
        ),
    ] = 0.9,
    write_profile: Annotated[
        Path | None,
        typer.Option("--write-profile", help="With --search: write the best layout as a profile FILE.toml."),
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="With --write-profile: replace FILE.")] = False,
    trial: Annotated[
        int, typer.Option("--trial", help="With --search: run the K best layouts and measure them (K).")
    ] = 0,
    steps: Annotated[int, typer.Option("--steps", help="With --trial: training steps per trial.")] = 10,
    trial_dir: Annotated[
        Path | None,
        typer.Option(
            "--trial-dir", help="With --trial: a new directory for the trial runs (default runs/plan-trials-*)."
        ),
    ] = None,
    sbatch: Annotated[
        bool,
        typer.Option("--sbatch", help="With --trial: write a SLURM script that runs the search and trials with srun."),
    ] = False,
) -> None:
    """Check a configuration: fields, cross-section rules and world-size rules, all at once.

    Overrides follow the options: `kforge validate-config -p h100x64 --model.n_layers=48`.
    Exit code 0 when valid, 2 when not (every problem listed with its dotted key). With
    `--plan` (`--format json` prints only the plan), 1 when the plan does not fit the GPU.
    `--plan --search` lists the fastest layouts that fit (1 when none does), and can write
    the best as a profile (`--write-profile`) or measure the best K (`--trial K --steps N`).
    """
    from kforge_cli.errors import InvalidInputError
    from kforge_cli.settings import resolve_dims
    from kforge_cli.settings.explain import explain_key, to_toml

    resolved = resolve(profile, config, list(ctx.args), for_run=explain is None)  # data checks too
    s = resolved.settings
    if explain:
        typer.echo(explain_key(resolved, explain))
        return
    n = world_size if world_size is not None else s.slurm.world_size
    if n < 1:
        raise InvalidInputError(f"--world-size must be >= 1 (got {n})")
    if search or write_profile or trial or sbatch:
        if not (plan and search):
            raise InvalidInputError("--search, --write-profile, --trial and --sbatch go with --plan --search")
        if fmt not in (None, "json"):
            raise InvalidInputError(f"--search prints a table, or JSON with --format json (got --format {fmt!r})")
        from kforge_cli.cli.plan_search import search_command

        search_command(
            resolved,
            n,
            fmt=fmt,
            mfu=mfu,
            top=top,
            global_batch=global_batch,
            memory_share=memory_share,
            write_profile=write_profile,
            overwrite=overwrite,
            trial=trial,
            steps=steps,
            trial_dir=trial_dir,
            sbatch=sbatch,
            argv=sys.argv[1:],
        )
        return
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
        _plan(s, n, rank, fmt, 0.4 if mfu is None else mfu)


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
    if vision:
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


def _plan(settings: Any, world_size: int, rank: int, fmt: str | None, mfu: float) -> None:
    """Build rank ``rank``'s plan (imports torch) and print it; exit 1 when it does not fit."""
    from kforge_cli.engine.plan.planner import build_plan
    from kforge_cli.engine.plan.report import format_plan, plan_json

    result = build_plan(settings, world_size, rank, mfu=mfu)
    typer.echo(plan_json(result) if fmt == "json" else "\n" + format_plan(result))
    if not result.fits:
        raise typer.Exit(1)


def _text_params(s: Any) -> int:
    """The text model's parameter count; a family other than the default one is asked (imports torch)."""
    if s.model.family == "llama":
        return s.model.param_count()
    from kforge_cli.engine.families.registry import family_for

    return family_for(s.model).param_count(s.model)
