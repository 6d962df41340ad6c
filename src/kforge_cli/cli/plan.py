"""`kforge plan`: the planner's commands (the work: engine.plan; trials, which launch training: engine.trials).

`kforge plan [show]` prints the memory and step-time plan of the settings given, `plan search`
the fastest layouts that fit (and writes the best as a profile), `plan trial` runs the best
layouts for a few steps and measures them (locally, under srun, or as an sbatch sweep), and
`plan calibrate` fits the cost model's constants to those measurements. Settings overrides
follow the subcommand's options, as for every command: `kforge plan search -p h100x64 --model.n_layers=48`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from typer.core import TyperGroup

from kforge_cli.cli.options import OVERRIDES, ConfigOpt, ProfileOpt, echo_err, resolve


class _ShowByDefault(TyperGroup):
    """`kforge plan ARGS` is `kforge plan show ARGS` unless ARGS start with a subcommand (or ask for help)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = ["show", *args]
        return super().parse_args(ctx, args)


plan_app = typer.Typer(cls=_ShowByDefault, no_args_is_help=False)


def register(app: typer.Typer) -> None:
    app.add_typer(plan_app, name="plan")


@plan_app.callback()
def plan_group() -> None:
    """Plan a job without a GPU: memory per GPU and step time (`show`, the default), the fastest layouts
    (`search`), measured trials of the best (`trial`) and the cost model fitted to them (`calibrate`).

    Every step time printed is the same cost model's (compute, exposed communication by kind,
    pipeline bubble, optimizer step), so a layout gets the same number whichever command prints it.
    """


WorldSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--world-size", "-n", help="Processes the job runs with (default: slurm.nodes x slurm.gpus_per_node)."
    ),
]
FormatOpt = Annotated[Literal["table", "json"], typer.Option("--format", help="A table, or JSON.")]
MfuOpt = Annotated[
    float | None,
    typer.Option(
        "--mfu", help="The model FLOP utilisation the step time assumes (default: plan.mfu, else the GPU table's)."
    ),
]
GlobalBatchOpt = Annotated[
    int | None,
    typer.Option("--global-batch", help="Sequences per step every layout keeps (default: the profile's)."),
]
MemoryShareOpt = Annotated[
    float,
    typer.Option(
        "--memory-share",
        help="Keep layouts whose planned peak is within this share of the GPU's memory "
        "(above 0.9 the plan calls it tight: allocator fragmentation may still OOM).",
    ),
]


MAX_TRIAL_STEPS = 100_000  # a trial measures step time: hundreds of steps are plenty
MAX_TRIALS = 100
MAX_TOP = 1000
MAX_GLOBAL_BATCH = 1 << 40


def _check_numbers(
    world: int, mfu: float | None, top: int, batch: int | None, share: float, trial: int, steps: int
) -> None:
    """The numeric options, each within its documented range (exit 2), before anything is computed from them."""
    import math

    from kforge_cli.errors import InvalidInputError
    from kforge_cli.settings.infrastructure import MAX_WORLD_SIZE

    if not 1 <= world <= MAX_WORLD_SIZE:
        raise InvalidInputError(f"--world-size must be from 1 to {MAX_WORLD_SIZE:,}, kforge's maximum (got {world})")
    if mfu is not None and not (math.isfinite(mfu) and 0 < mfu <= 1):
        raise InvalidInputError(f"--mfu must be a number in (0, 1], e.g. 0.4 (got {mfu})")
    if not (math.isfinite(share) and 0 < share <= 1):
        raise InvalidInputError(f"--memory-share must be a number in (0, 1] (got {share})")
    for name, value, least, most in (
        ("--top", top, 1, MAX_TOP),
        ("--global-batch", batch, 1, MAX_GLOBAL_BATCH),
        ("--best", trial, 0, MAX_TRIALS),
        ("--steps", steps, 2, MAX_TRIAL_STEPS),
    ):
        if value is not None and not least <= value <= most:
            raise InvalidInputError(f"{name} must be from {least} to {most:,} (got {value})")


def _settings(ctx: typer.Context, profile: str | None, config: Path | None, world_size: int | None) -> tuple[Any, int]:
    from kforge_cli.errors import InvalidInputError

    resolved = resolve(profile, config, list(ctx.args), for_run=False)
    n = world_size if world_size is not None else resolved.settings.slurm.world_size
    if n < 1:
        raise InvalidInputError(f"--world-size must be >= 1 (got {n})")
    return resolved.settings, n


@plan_app.command("show", context_settings=OVERRIDES)
def show(
    ctx: typer.Context,
    profile: ProfileOpt = None,
    config: ConfigOpt = None,
    world_size: WorldSizeOpt = None,
    rank: Annotated[int, typer.Option("--rank", help="The rank whose memory is planned.")] = 0,
    fmt: FormatOpt = "table",
    mfu: MfuOpt = None,
) -> None:
    """The plan of the settings given: mesh, pipeline stages, rank R's memory per GPU with its verdict,
    and the predicted step time with its parts. Exit 1 when it does not fit the GPU.

    `kforge plan -p llama70b-h100x64 --rank 9`; `validate-config --plan` prints the same.
    """
    from kforge_cli.settings import resolve_dims

    settings, n = _settings(ctx, profile, config, world_size)
    _check_numbers(n, mfu, 1, None, 0.9, 0, 2)
    resolve_dims(settings, n)
    print_plan(settings, n, rank, fmt, mfu)


def print_plan(settings: Any, world_size: int, rank: int, fmt: str | None, mfu: float | None) -> None:
    """Build rank ``rank``'s plan (imports torch) and print it; exit 1 when it does not fit."""
    from kforge_cli.engine.plan.planner import build_plan
    from kforge_cli.engine.plan.report import format_plan, plan_json

    result = build_plan(settings, world_size, rank, mfu=mfu)
    typer.echo(plan_json(result) if fmt == "json" else format_plan(result))
    if not result.fits:
        raise typer.Exit(1)


def _search(settings: Any, n: int, *, top: int, global_batch: int | None, mfu: float | None, share: float) -> Any:
    from kforge_cli.engine.plan.search import search_layouts

    return search_layouts(settings, n, top=top, global_batch=global_batch, mfu=mfu, memory_share=share)


def _print_search(result: Any, fmt: str, top: int) -> None:
    from kforge_cli.engine.plan.search import format_search

    if fmt == "json":
        data = result.as_dict()
        data["top"] = data["top"][:top]
        typer.echo(json.dumps(data, indent=2))
    else:
        typer.echo(format_search(result, top))


@plan_app.command("search", context_settings=OVERRIDES)
def search(
    ctx: typer.Context,
    profile: ProfileOpt = None,
    config: ConfigOpt = None,
    world_size: WorldSizeOpt = None,
    fmt: FormatOpt = "table",
    mfu: MfuOpt = None,
    top: Annotated[int, typer.Option("--top", help="How many layouts to print.")] = 5,
    global_batch: GlobalBatchOpt = None,
    memory_share: MemoryShareOpt = 0.9,
    write_profile: Annotated[
        Path | None, typer.Option("--write-profile", help="Write the best layout as a profile FILE.toml.")
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="With --write-profile: replace FILE.")] = False,
) -> None:
    """The fastest valid layouts (tp, pp and schedule, cp, ep, FSDP/HSDP, micro-batch, AC) whose memory
    plan fits, each with its predicted step and its parts, and the settings' own layout for comparison.
    Exit 1 when none fits.

    `--write-profile best.toml` writes the best as a profile: `kforge plan --profile best.toml` prints
    the same step time.
    """
    from kforge_cli.cli.plan_profile import check_profile_target, write_best_profile

    settings, n = _settings(ctx, profile, config, world_size)
    if write_profile is not None:
        check_profile_target(write_profile, overwrite=overwrite)  # before the search, not after it
    _check_numbers(n, mfu, top, global_batch, memory_share, 0, 2)
    result = _search(settings, n, top=top, global_batch=global_batch, mfu=mfu, share=memory_share)
    _print_search(result, fmt, top)
    if not result.top:
        raise typer.Exit(1)
    if write_profile is not None:
        path = write_best_profile(settings, result.top[0], write_profile, overwrite=overwrite)
        typer.echo(f"wrote {path}: kforge plan --profile {path}", err=fmt == "json")


@plan_app.command("trial", context_settings=OVERRIDES)
def trial(
    ctx: typer.Context,
    profile: ProfileOpt = None,
    config: ConfigOpt = None,
    world_size: WorldSizeOpt = None,
    fmt: FormatOpt = "table",
    mfu: MfuOpt = None,
    best: Annotated[int, typer.Option("--best", help="Run the K best layouts of the search (K).")] = 3,
    steps: Annotated[int, typer.Option("--steps", help="Training steps per trial.")] = 10,
    global_batch: GlobalBatchOpt = None,
    memory_share: MemoryShareOpt = 0.9,
    trial_dir: Annotated[
        Path | None,
        typer.Option("--trial-dir", help="A new directory for the trial runs (default runs/plan-trials-*)."),
    ] = None,
    sbatch: Annotated[
        bool,
        typer.Option("--sbatch", help="Write a SLURM script that runs the search and the trials with srun, instead."),
    ] = False,
) -> None:
    """Search, then train the K best layouts for N steps each (`kforge train`, locally or with srun inside
    an allocation) and print predicted beside measured, ranked by the measurement. Results go to
    TRIAL_DIR/trials.json, what `kforge plan calibrate` fits.

    `--sbatch` writes TRIAL_DIR/sweep.sbatch, which runs this command inside one allocation.
    """
    from kforge_cli.engine.trials.runner import failed_trials, format_trials, run_trials, write_sweep_script
    from kforge_cli.errors import InvalidInputError

    if best < 1 or steps < 2:
        raise InvalidInputError(
            f"plan trial needs --best K >= 1 and --steps N >= 2 (got --best {best} --steps {steps})"
        )
    _check_numbers(world_size or 1, mfu, 1, global_batch, memory_share, best, steps)
    settings, n = _settings(ctx, profile, config, world_size)
    _check_numbers(n, mfu, 1, global_batch, memory_share, best, steps)
    if sbatch:  # before searching: the job itself searches, inside its allocation
        _, text = write_sweep_script(settings, sys.argv[1:], trial_dir, say=echo_err)
        typer.echo(text, nl=False)
        return
    result = _search(settings, n, top=best, global_batch=global_batch, mfu=mfu, share=memory_share)
    _print_search(result, fmt, best)
    if not result.top:
        raise typer.Exit(1)
    results = run_trials(settings, result, result.top[:best], steps, trial_dir, say=echo_err)
    typer.echo(format_trials(results, steps), err=fmt == "json")
    failed = failed_trials(results)
    if failed:  # the command fails with them: a sweep's caller must not take a missing number for a result
        typer.echo(f"{len(failed)} of {len(results)} trials failed; see {', '.join(t.log for t in failed)}", err=True)
        raise typer.Exit(1)


@plan_app.command("calibrate")
def calibrate(
    trial_dir: Annotated[Path, typer.Argument(help="A directory kforge plan trial wrote (its --trial-dir).")],
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Write the fit as a profile FILE.toml: the trials' profile plus the fitted plan table.",
        ),
    ] = None,
    write_profile: Annotated[
        Path | None, typer.Option("--write-profile", help="Replace the plan table of this existing profile file.")
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="With --output: replace FILE.")] = False,
    fmt: FormatOpt = "table",
) -> None:
    """Fit the cost model's constants (plan.mfu, the collective bandwidth, the overlap shares,
    plan.full_speed_tokens) to the measured trials and print them as a [plan] section.

    `--output fit.toml` writes a profile that extends the trials' profile with that section (a
    profile can `extends` it); `--write-profile FILE` puts the section into FILE (e.g. the profile
    `plan search --write-profile` wrote). No hidden file: the constants apply where a profile says so.
    """
    from kforge_cli.cli.plan_profile import check_profile_target
    from kforge_cli.common.files import atomic_write, read_text_capped
    from kforge_cli.engine.plan.calibrate import calibrate as fit
    from kforge_cli.engine.plan.calibrate import format_calibration, fragment_toml, plan_toml, with_plan_section
    from kforge_cli.errors import InvalidInputError

    if output is not None and write_profile is not None:
        raise InvalidInputError("give --output or --write-profile, not both")
    if output is not None:
        output = check_profile_target(output, overwrite=overwrite, option="--output")
    if write_profile is not None and not Path(write_profile).is_file():
        raise InvalidInputError(f"--write-profile {write_profile}: no such profile file (--output writes a new one)")
    result = fit(trial_dir)
    if fmt == "json":
        typer.echo(json.dumps(result.as_dict(), indent=2))
    else:
        typer.echo(format_calibration(result))
        typer.echo("\n" + plan_toml(result), nl=False)
    if output is not None:
        atomic_write(output, fragment_toml(result).encode())
        echo_err(f'wrote {output}: a profile can `extends = "{output.resolve()}"`; check: kforge plan -p {output}')
    if write_profile is not None:
        text = read_text_capped(write_profile, 2**20, "profile")
        atomic_write(Path(write_profile), with_plan_section(text, result).encode())
        echo_err(f"wrote the fitted [plan] into {write_profile}")
