"""Rendering `RUN_DIR/job.sbatch` from the `slurm` settings and the template.

The script asks for one task per GPU on every node (`--ntasks-per-node = gpus_per_node`),
(``--nodes=MIN-MAX`` with ``slurm.min_nodes``: the job starts on what it gets and `kforge train`
re-plans for it), `--requeue`, and a signal `slurm.signal_before_s` seconds before the time limit sent to every
job step (plain `--signal=USR1@N`, not `B:`: verified on a real SLURM to reach every training
rank through srun, while the batch shell is left alone). Each task runs `kforge train` on the
run's saved config; the template turns exit code 75 (signal) and 76 (hang) into a requeue.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from pathlib import Path

from kforge_cli import __version__
from kforge_cli.errors import ConfigError, ConfigIssue, InvalidInputError
from kforge_cli.rundir.layout import RunDir
from kforge_cli.settings import JobSettings
from kforge_cli.settings.hook_policy import allow_flag
from kforge_cli.settings.infrastructure import SlurmSettings
from kforge_cli.settings.section import control_character, describe_character
from kforge_cli.slurm.template import fill, find_template, placeholders

MAX_SIGNAL_S = 0xFFFF  # sbatch's limit on --signal=SIG@seconds
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_TIME_FORMATS = (
    re.compile(r"(?P<m>\d+)\Z"),
    re.compile(r"(?P<m>\d+):(?P<s>\d+)\Z"),
    re.compile(r"(?P<h>\d+):(?P<m>\d+):(?P<s>\d+)\Z"),
    re.compile(r"(?P<d>\d+)-(?P<h>\d+)\Z"),
    re.compile(r"(?P<d>\d+)-(?P<h>\d+):(?P<m>\d+)\Z"),
    re.compile(r"(?P<d>\d+)-(?P<h>\d+):(?P<m>\d+):(?P<s>\d+)\Z"),
)


def parse_time_limit(text: str) -> int | None:
    """SLURM's --time formats in seconds ('30' is minutes, '1-12' is days-hours); None = unlimited.

    Raises ValueError for anything SLURM would refuse.
    """
    value = text.strip()
    if value.upper() in ("UNLIMITED", "INFINITE"):
        return None
    for pattern in _TIME_FORMATS:
        match = pattern.match(value)
        if match:
            parts = {"d": 0, "h": 0, "m": 0, "s": 0} | {k: int(v) for k, v in match.groupdict().items()}
            return ((parts["d"] * 24 + parts["h"]) * 60 + parts["m"]) * 60 + parts["s"]
    raise ValueError(f"{text!r} is not a SLURM time (minutes, HH:MM:SS, D-HH:MM:SS, ...)")


def _signal_names(settings: JobSettings) -> set[str]:
    return {s.upper().removeprefix("SIG") for s in settings.resilience.shutdown_signals}


def slurm_issues(settings: JobSettings) -> list[ConfigIssue]:
    """What would make the generated script wrong or refused; empty when it is fine."""
    s = settings.slurm
    issues: list[ConfigIssue] = []
    for name in ("job_name", "partition", "account", "qos", "constraint", "mem", "time_limit", "network_interface"):
        value = getattr(s, name)
        spaces_ok = name == "job_name"  # quoted in its #SBATCH line
        if value is not None and (not value.strip() or "\n" in value or (not spaces_ok and re.search(r"\s", value))):
            rule = "non-empty and on one line" if spaces_ok else "non-empty, without whitespace"
            issues.append(ConfigIssue(f"slurm.{name}", f"{value!r} must be {rule}"))
    limit: int | None = None
    try:
        limit = parse_time_limit(s.time_limit)
    except ValueError as exc:
        issues.append(ConfigIssue("slurm.time_limit", str(exc)))
    if s.signal_before_s > 0:
        if s.signal_before_s > MAX_SIGNAL_S:
            issues.append(ConfigIssue("slurm.signal_before_s", f"SLURM allows at most {MAX_SIGNAL_S} seconds"))
        if limit is not None and s.signal_before_s >= limit:
            issues.append(
                ConfigIssue(
                    "slurm.signal_before_s",
                    f"{s.signal_before_s} s is not before the time limit {s.time_limit} ({limit} s); lower it",
                )
            )
        if "USR1" not in _signal_names(settings):
            issues.append(
                ConfigIssue(
                    "resilience.shutdown_signals",
                    "must include SIGUSR1: the job script asks SLURM for USR1 before the time limit, "
                    "which would kill the ranks instead of stopping them (or set slurm.signal_before_s=0)",
                )
            )
    for i, line in enumerate(s.extra_sbatch):
        option = line.strip().removeprefix("#SBATCH").strip()
        if not option.startswith("-") or "\n" in option:
            issues.append(
                ConfigIssue(f"slurm.extra_sbatch[{i}]", f"{line!r} is not an sbatch option like '--exclusive'")
            )
    for key in s.env:
        if not _ENV_NAME.match(key):
            issues.append(ConfigIssue(f"slurm.env.{key}", "is not a valid environment variable name"))
    for i, line in enumerate(s.setup):
        if "\n" in line or "\r" in line:
            issues.append(ConfigIssue(f"slurm.setup[{i}]", "must be one line (give each command as its own item)"))
    return issues


def _directive(option: str, value: object | None = None) -> str:
    if value is None:
        return f"#SBATCH --{option}"
    text = str(value)
    if control_character(text) is not None:  # slurm_issues/_unsafe_paths refuse these first: never a 2nd line
        raise ConfigError(
            [ConfigIssue(f"slurm ({option})", f"{text!r} holds a control character or other unprintable one")]
        )
    if re.search(r"[\s\"']", text):
        text = '"' + text.replace('"', '\\"') + '"'
    return f"#SBATCH --{option}={text}"


def sbatch_directives(slurm: SlurmSettings, run_dir: Path, workdir: Path) -> list[str]:
    """The `#SBATCH` lines: the job's shape, limits, requeue, early signal, logs, then extra lines."""
    lines = [
        _directive("job-name", slurm.job_name),
        _directive("nodes", nodes_request(slurm)),
        _directive("ntasks-per-node", slurm.gpus_per_node),
    ]
    if slurm.gpu_type.lower() != "cpu":
        lines.append(_directive("gpus-per-node", slurm.gpus_per_node))
    lines.append(_directive("cpus-per-task", slurm.cpus_per_task))
    if slurm.mem is not None:
        lines.append(_directive("mem", slurm.mem))
    lines.append(_directive("time", slurm.time_limit))
    for option in ("partition", "account", "qos", "constraint"):
        value = getattr(slurm, option)
        if value is not None:
            lines.append(_directive(option, value))
    from kforge_cli.slurm.exclude import excluded_nodes  # here: `python -m kforge_cli.slurm.exclude` runs it fresh

    excluded = excluded_nodes(run_dir, slurm.max_excluded_nodes)
    if excluded:  # a new job (kforge resume --sbatch) leaves behind what the run's earlier jobs excluded
        lines.append(_directive("exclude", ",".join(excluded)))
    lines.append(_directive("requeue"))
    if slurm.signal_before_s > 0:
        lines.append(_directive("signal", f"USR1@{slurm.signal_before_s}"))
    lines += [
        _directive("open-mode", "append"),
        _directive("output", RunDir(run_dir).slurm_log()),
        _directive("chdir", workdir),
    ]
    for line in slurm.extra_sbatch:
        lines.append("#SBATCH " + line.strip().removeprefix("#SBATCH").strip())
    return lines


def nodes_request(slurm: SlurmSettings) -> str:
    """``--nodes``: ``MIN-MAX`` with the shrink policy (slurm.min_nodes: start on what is free), else N."""
    if slurm.min_nodes is not None and slurm.min_nodes < slurm.nodes:
        return f"{slurm.min_nodes}-{slurm.nodes}"
    return str(slurm.nodes)


def env_exports(slurm: SlurmSettings) -> list[str]:
    """`export` lines: the network interface for NCCL and gloo, then `slurm.env`."""
    lines = []
    if slurm.network_interface:
        iface = shlex.quote(slurm.network_interface)
        lines.append(f"export NCCL_SOCKET_IFNAME={iface} GLOO_SOCKET_IFNAME={iface}")
    quote = expandable if slurm.expand_env else shlex.quote
    lines += [f"export {key}={quote(value)}" for key, value in slurm.env.items()]
    return lines


_PARAMETER = re.compile(r"\$[A-Za-z_][A-Za-z0-9_]*|\$\{[A-Za-z_][A-Za-z0-9_]*\}")


def expandable(value: str) -> str:
    """``value`` double-quoted so the shell expands its ``$NAME``/``${NAME}`` and nothing else.

    Everything else that is special inside double quotes (``\\ " ` $``) is escaped, so a
    ``$(command)`` or a backtick stays text.
    """
    out, pos = ['"'], 0
    for match in _PARAMETER.finditer(value):
        out.append(_escape_double(value[pos : match.start()]))
        out.append(match.group(0))
        pos = match.end()
    out.append(_escape_double(value[pos:]))
    out.append('"')
    return "".join(out)


def _escape_double(text: str) -> str:
    return re.sub(r'([\\"`$])', r"\\\1", text)


def setup_lines(slurm: SlurmSettings) -> list[str]:
    """`slurm.setup`, verbatim: shell commands the user wrote to prepare the job's environment."""
    return [line.strip() for line in slurm.setup if line.strip()]


def _setup_block(slurm: SlurmSettings) -> str:
    lines = setup_lines(slurm)
    if not lines:
        return ""
    # module and conda scripts read unset variables: run them without `set -u`.
    return "\n".join(["set +u", *lines, "set -u"])


def task_python(slurm: SlurmSettings, default: str) -> str:
    """The tasks' interpreter: slurm.python, else `python` of the environment slurm.setup activates, else ``default``."""
    if slurm.python:
        return slurm.python
    return "python" if setup_lines(slurm) else default


def train_command(run_dir: Path, python: str, hooks: Sequence[str] = ()) -> list[str]:
    """What every task runs: `kforge train --run-dir RUN_DIR`, which continues the run with its saved settings.

    With no other arguments `kforge train` on an existing run takes the run's config.toml plus
    its accepted changes (config_changes.jsonl, e.g. a `kforge resume --sbatch
    --train.max_steps=N`), starts it when it has no checkpoint yet and resumes it otherwise,
    so a requeued job continues where the last one stopped. ``hooks`` (allowed when the script
    was written) are named in ``--allow-hooks``: a config.toml edited later to name other
    modules is refused by the job instead of importing them.
    """
    return [python, "-m", "kforge_cli", "train", "--run-dir", str(run_dir), *allow_flag(hooks)]


def exclude_command(run_dir: Path, python: str, slurm: SlurmSettings) -> list[str]:
    """The job script's exclusion decision (`kforge_cli.slurm.exclude`); the script adds --from and --partition-nodes.

    The nodes the job needs: ``slurm.min_nodes`` when it may shrink, else ``slurm.nodes``."""
    return [
        python,
        "-m",
        "kforge_cli.slurm.exclude",
        str(run_dir),
        "--max",
        str(slurm.max_excluded_nodes),
        "--need-nodes",
        str(slurm.min_nodes or slurm.nodes),
    ]  # fmt: skip (a job that may shrink needs only slurm.min_nodes)


def _unsafe_paths(run_dir: Path, python: str, workdir: Path) -> list[ConfigIssue]:
    """Paths that enter the script unquoted (a comment, #SBATCH values) must be one line of printable text.

    Settings already refuse unprintable characters; these paths can also come from the working
    directory or the Python executable, so they are checked here too.
    """
    named = {"train.run_dir": str(run_dir), "working directory": str(workdir), "python executable": python}
    return [
        ConfigIssue(
            name,
            f"{value!r} holds a control character or other unprintable one, {describe_character(hit[0])}; it cannot "
            "go into a job script",
        )
        for name, value in named.items()
        if (hit := control_character(value)) is not None
    ]


def render_sbatch(settings: JobSettings, run_dir: Path, *, python: str, workdir: Path) -> str:
    """The job script for `settings` in `run_dir` (absolute); raises ConfigError when the settings cannot work."""
    from kforge_cli.settings.task_code import consented_code

    issues = _unsafe_paths(run_dir, python, workdir) + slurm_issues(settings)
    if issues:
        raise ConfigError(issues, header="cannot write an sbatch script")
    template = find_template()
    if setup_lines(settings.slurm) and "setup" not in placeholders(template.read_text()):
        raise InvalidInputError(f"sbatch template {template} has no {{{{setup}}}} placeholder for slurm.setup")
    values = {
        "kforge_version": __version__,
        "run_dir": str(run_dir),
        "run_dir_q": shlex.quote(str(run_dir)),
        "sbatch_directives": "\n".join(sbatch_directives(settings.slurm, run_dir, workdir)),
        "env_exports": "\n".join(env_exports(settings.slurm)),
        "setup": _setup_block(settings.slurm),
        "cpus_per_task": str(settings.slurm.cpus_per_task),
        "command": shlex.join(train_command(run_dir, python, consented_code(settings))),
        "ckpt_root_q": shlex.quote(str(RunDir(run_dir).checkpoint_root(settings))),
        "max_hang_requeues": str(settings.resilience.hang_max_requeues),
        "max_excluded_nodes": str(settings.slurm.max_excluded_nodes),
        "exclude_command": shlex.join(exclude_command(run_dir, python, settings.slurm)),
    }
    return fill(template.read_text(), values, template)
