"""`--sbatch`: the generated job script, its config.toml, validation, and submit errors (no SLURM needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kforge_cli.cli.app import main
from kforge_cli.cli.resume import resolve_continuation
from kforge_cli.errors import ConfigError, InvalidInputError
from kforge_cli.settings import load_settings
from kforge_cli.slurm import SbatchError, parse_time_limit, submit_script, write_job
from kforge_cli.slurm import submit as submit_module
from kforge_cli.slurm.template import fill, find_template, placeholders

PY = "/opt/env/bin/python"


def directives(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 1800),
        ("5:30", 330),
        ("01:00:00", 3600),
        ("48:00:00", 172800),
        ("2-12", 216000),
        ("1-02:03", 93780),
        ("1-00:00:01", 86401),
        ("UNLIMITED", None),
        ("infinite", None),
    ],
)
def test_parse_time_limit_reads_every_slurm_format(text: str, seconds: int | None) -> None:
    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize("text", ["1h", "", "1:2:3:4", "-5", "1-"])
def test_parse_time_limit_refuses_what_slurm_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="is not a SLURM time"):
        parse_time_limit(text)


def test_h100x64_script_asks_for_one_task_per_gpu_on_8_nodes_with_requeue_and_an_early_signal(tmp_path: Path) -> None:
    settings = load_settings(profile="h100x64", overrides=[f"--train.run_dir={tmp_path / 'run'}"]).settings
    files = write_job(settings, python=PY, workdir=tmp_path)
    run = (tmp_path / "run").resolve()
    script = files.script.read_text()
    assert directives(script) == [
        "--job-name=kforge",
        "--nodes=8",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--cpus-per-task=12",
        "--mem=0",
        "--time=48:00:00",
        "--requeue",
        "--signal=USR1@300",
        "--open-mode=append",
        f"--output={run}/logs/slurm-%j.out",
        f"--chdir={tmp_path.resolve()}",
    ]
    assert script.startswith("#!/bin/bash\n") and "{{" not in script and files.script.stat().st_mode & 0o111
    assert f"     {PY} -m kforge_cli train --run-dir {run} &\n" in script
    assert "srun --kill-on-bad-exit=1 --cpus-per-task=12 \\\n" in script
    assert '--output="$RUN_DIR/logs/srun_rank%t.out"' in script
    assert "export MASTER_PORT=$((15000 + SLURM_JOB_ID % 10000))" in script  # = launcher.port_from_job_id
    assert "scontrol requeue" in script and "75)" in script
    assert (run / "logs").is_dir() and files.run_dir == run and files.config == run / "config.toml"


def test_config_toml_is_the_resolved_settings_and_reloads_identically_as_the_jobs_profile(tmp_path: Path) -> None:
    settings = load_settings(
        profile="h200x8", overrides=["--optimizer.lr=1e-4", f"--train.run_dir={tmp_path}/r"]
    ).settings
    files = write_job(settings, python=PY, workdir=tmp_path)
    reloaded = load_settings(profile=str(files.config), overrides=[f"--train.run_dir={files.run_dir}"]).settings
    expected = settings.model_copy(deep=True)
    expected.train.run_dir = str(files.run_dir)
    assert reloaded.model_dump() == expected.model_dump()
    assert reloaded.optimizer.lr == 1e-4 and reloaded.profile == "h200x8"


def test_cpu_job_has_no_gpu_request_and_optional_options_and_environment_appear_when_set(tmp_path: Path) -> None:
    settings = load_settings(
        overrides=[
            f"--train.run_dir={tmp_path / 'run'}",
            "--slurm.partition=batch",
            "--slurm.account=proj-42",
            "--slurm.qos=high",
            "--slurm.constraint=h100&ib",
            "--slurm.network_interface=ib0",
            '--slurm.extra_sbatch=["--exclusive", "#SBATCH --reservation=r1"]',
            "--slurm.env.NCCL_DEBUG=WARN",
            "--slurm.env.MY_FLAGS=a b",
            "--slurm.job_name=my run",
        ]
    ).settings
    script = write_job(settings, python=PY, workdir=tmp_path).script.read_text()
    lines = directives(script)
    assert not any(line.startswith("--gpus") for line in lines)  # cpu-debug: gpu_type = "cpu"
    assert lines[:3] == ['--job-name="my run"', "--nodes=1", "--ntasks-per-node=1"]
    for option in ("--partition=batch", "--account=proj-42", "--qos=high", "--constraint=h100&ib"):
        assert option in lines
    assert lines[-2:] == ["--exclusive", "--reservation=r1"]
    assert "export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0\n" in script
    assert "export NCCL_DEBUG=WARN\nexport MY_FLAGS='a b'\n" in script


def test_no_early_signal_when_signal_before_s_is_zero(tmp_path: Path) -> None:
    settings = load_settings(
        overrides=[
            f"--train.run_dir={tmp_path}",
            "--slurm.signal_before_s=0",
            '--resilience.shutdown_signals=["SIGTERM"]',
        ]
    ).settings
    lines = directives(write_job(settings, python=PY, workdir=tmp_path).script.read_text())
    assert "--requeue" in lines and not any(line.startswith("--signal") for line in lines)


def test_settings_that_cannot_work_are_all_reported_and_nothing_is_written(tmp_path: Path) -> None:
    settings = load_settings(
        overrides=[
            f"--train.run_dir={tmp_path / 'run'}",
            '--slurm.time_limit="00:04:00"',
            "--slurm.signal_before_s=300",
            '--resilience.shutdown_signals=["SIGTERM"]',
            '--slurm.extra_sbatch=["exclusive"]',
            "--slurm.partition=a b",
            "--slurm.env.1BAD=x",
        ]
    ).settings
    with pytest.raises(ConfigError) as info:
        write_job(settings, python=PY, workdir=tmp_path)
    paths = [issue.path for issue in info.value.issues]
    assert paths == [
        "slurm.partition",
        "slurm.signal_before_s",
        "resilience.shutdown_signals",
        "slurm.extra_sbatch[0]",
        "slurm.env.1BAD",
    ]
    assert "300 s is not before the time limit 00:04:00 (240 s)" in str(info.value)
    assert not (tmp_path / "run").exists()
    bad_time = load_settings(overrides=[f"--train.run_dir={tmp_path / 'run'}", "--slurm.time_limit=2h"]).settings
    with pytest.raises(ConfigError, match="slurm.time_limit: '2h' is not a SLURM time"):
        write_job(bad_time, python=PY, workdir=tmp_path)


def test_setup_lines_run_before_srun_and_the_jobs_own_python_runs_the_tasks(tmp_path: Path) -> None:
    setup = ["module load cuda/12", "source /scratch/me/venv/bin/activate"]
    settings = load_settings(
        overrides=[
            f"--train.run_dir={tmp_path / 'run'}",
            f"--slurm.setup={json.dumps(setup)}",
            "--slurm.env.DATA=$HOME/data ${USER}-x $(echo pwned) `echo no`",
            "--slurm.expand_env=true",
        ]
    ).settings
    script = write_job(settings, workdir=tmp_path).script.read_text()
    block = "set +u\nmodule load cuda/12\nsource /scratch/me/venv/bin/activate\nset -u\n"
    assert block in script and script.index(block) < script.index("srun ")
    command = next(line for line in script.splitlines() if "-m kforge_cli train" in line)
    assert command.strip().startswith("python -m kforge_cli train") and sys.executable not in script
    export = next(line for line in script.splitlines() if line.startswith("export DATA="))
    shell = subprocess.run(
        ["bash", "-c", f'{export}; printf %s "$DATA"'],
        env={"HOME": "/home/me", "USER": "me", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert shell.stdout == "/home/me/data me-x $(echo pwned) `echo no`"  # variables expand, commands do not run
    plain = load_settings(overrides=[f"--train.run_dir={tmp_path / 'r2'}", "--slurm.env.DATA=$HOME/x"]).settings
    text = write_job(plain, workdir=tmp_path).script.read_text()
    assert "export DATA='$HOME/x'" in text and f"{sys.executable} -m kforge_cli train" in text  # no setup: as before


def test_multi_node_profiles_without_partition_or_account_warn(
    capsys: pytest.CaptureFixture[str], data_stub: Path
) -> None:
    code, _, err = run_cli(["validate-config", "-p", "h100x64", f"--data.path={data_stub}"], capsys)
    assert code == 0, err
    assert "warning: slurm.partition: not set for an 8-node job" in err and "warning: slurm.account" in err
    code, _, err = run_cli(
        ["validate-config", "-p", "h100x64", f"--data.path={data_stub}", "--slurm.partition=p", "--slurm.account=a"],
        capsys,
    )
    assert code == 0 and "warning: slurm." not in err


def test_the_shipped_template_uses_every_value_and_a_site_template_with_a_typo_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped = find_template()
    assert placeholders(shipped.read_text()) == {
        "kforge_version",
        "run_dir",
        "run_dir_q",
        "sbatch_directives",
        "env_exports",
        "setup",
        "cpus_per_task",
        "command",
        "ckpt_root_q",
        "max_hang_requeues",
        "max_excluded_nodes",
        "exclude_command",
    }
    assert fill("a {{ x }} b {{y}}", {"x": "1", "y": "$2", "z": "unused"}) == "a 1 b $2"
    site = tmp_path / "site"
    site.mkdir()
    (site / "job.sbatch.tmpl").write_text("#!/bin/bash\n{{sbatch_directives}}\nsrun {{comand}}\n")
    monkeypatch.setenv("KFORGE_SLURM_TEMPLATE_PATH", str(site))
    assert find_template() == site / "job.sbatch.tmpl"
    settings = load_settings(overrides=[f"--train.run_dir={tmp_path / 'run'}"]).settings
    with pytest.raises(InvalidInputError, match=r"job.sbatch.tmpl: unknown placeholder\(s\) comand; known: "):
        write_job(settings, python=PY, workdir=tmp_path)


def test_dry_run_prints_the_script_without_slurm_and_uses_this_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no sbatch, no srun
    code, out, err = run_cli(["train", "--sbatch", "--train.max_steps=70"], capsys)
    assert code == 0, err
    [run] = list((tmp_path / "runs").iterdir())
    assert run.name.startswith("cpu-debug-")
    assert out == (run / "job.sbatch").read_text() and f"--run-dir {run}" in out and sys.executable in out
    assert f"submit with: sbatch {run / 'job.sbatch'}" in err
    assert load_settings(profile=str(run / "config.toml")).settings.train.max_steps == 70


def test_submit_without_sbatch_is_a_clear_error_naming_the_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code, out, err = run_cli(["train", "--sbatch", "--submit", "--run-dir", str(tmp_path / "run")], capsys)
    script = tmp_path / "run" / "job.sbatch"
    assert code == 1 and out == ""
    assert err.strip().splitlines()[-1] == (
        f"error: cannot submit: 'sbatch' not found on PATH (not a SLURM login node?); "
        f"the script is {script}: submit it with `sbatch {script}` where SLURM is available"
    )
    assert script.is_file()


def _fake_sbatch(monkeypatch: pytest.MonkeyPatch, rc: int, stdout: str, stderr: str) -> list[list[str]]:
    calls: list[list[str]] = []

    def fake_run(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, rc, stdout, stderr)

    monkeypatch.setattr(submit_module.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(submit_module.subprocess, "run", fake_run)
    return calls


def test_submit_returns_the_parsable_job_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_sbatch(monkeypatch, 0, "4242;cluster1\n", "")
    assert submit_script(tmp_path / "job.sbatch") == "4242"
    assert calls == [["/usr/bin/sbatch", "--parsable", str(tmp_path / "job.sbatch")]]


def test_a_refused_script_shows_sbatchs_message_and_the_script_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_sbatch(monkeypatch, 1, "", "sbatch: error: invalid partition specified: nosuch\n")
    with pytest.raises(SbatchError) as info:
        submit_script(tmp_path / "job.sbatch")
    assert str(info.value).startswith(
        f"sbatch refused {tmp_path / 'job.sbatch'} (exit code 1):\n  sbatch: error: invalid partition specified: nosuch\n"
    )


def test_resume_sbatch_keeps_the_runs_config_records_overrides_beside_it_and_refuses_shape_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert run_cli(["train", "--sbatch", "--run-dir", str(run), "--model.dim=64"], capsys)[0] == 0
    original = (run / "config.toml").read_bytes()
    code, _, err = run_cli(["resume", str(run), "--sbatch", "--train.max_steps=999"], capsys)
    assert code == 2 and f"nothing to resume: {run}/checkpoints holds no complete checkpoint" in err
    assert not (run / "config_changes.jsonl").exists()
    code, out, err = run_cli(
        ["resume", str(run), "--sbatch", "--train.max_steps=999", "--checkpoint.resume=auto"], capsys
    )
    assert code == 0, err
    assert (run / "config.toml").read_bytes() == original  # written once, when the run started
    [record] = [json.loads(line) for line in (run / "config_changes.jsonl").read_text().splitlines()]
    assert record["changes"] == {"train.max_steps": {"from": 300, "to": 999}}
    saved = resolve_continuation(run, [], command="train").settings  # what the job's `kforge train --run-dir` uses
    assert (saved.model.dim, saved.train.max_steps, saved.checkpoint.resume) == (64, 999, "auto")
    assert f"train --run-dir {run}\n" in out or f"train --run-dir {run} &" in out
    fake_checkpoint(run, 5)
    code, _, err = run_cli(["resume", str(run), "--sbatch", "--model.dim=32"], capsys)
    assert code == 2 and "model.dim: 64 -> 32 would change the model's shape (the run has 64)" in err
    assert (run / "config.toml").read_bytes() == original and len(
        (run / "config_changes.jsonl").read_text().splitlines()
    ) == 1


def fake_checkpoint(run: Path, step: int) -> None:
    path = run / "checkpoints" / f"step_{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (path / "kforge_commit.json").write_text(json.dumps({"step": step, "dcp_dirs": ["."]}))


def test_train_sbatch_refuses_a_run_dir_whose_checkpoint_has_another_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert run_cli(["train", "--sbatch", "--run-dir", str(run), "--model.dim=64"], capsys)[0] == 0
    fake_checkpoint(run, 5)
    before = (run / "config.toml").read_text()
    code, _, err = run_cli(["train", "--sbatch", "--run-dir", str(run), "--model.dim=32"], capsys)
    assert code == 2 and "model.dim: 64 -> 32 would change the model's shape (the run has 64)" in err
    assert (run / "config.toml").read_text() == before
    assert (
        run_cli(["train", "--sbatch", "--run-dir", str(run), "--model.dim=64", "--train.max_steps=90"], capsys)[0] == 0
    )
    assert (run / "config.toml").read_text() == before
    assert "max_steps" in (run / "config_changes.jsonl").read_text()


def test_a_rank_stopping_on_a_signal_survives_the_follow_up_sigterm_of_srun_kill_on_bad_exit() -> None:
    """srun --kill-on-bad-exit SIGTERMs the step when the first rank exits 75; the others are in teardown."""
    import os
    import signal

    from kforge_cli.engine.resilience import ShutdownHandler

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        quiet = ShutdownHandler(["SIGTERM", "SIGUSR1"]).install()
        quiet.close()  # no signal received: the previous handlers are back
        assert {sig: signal.getsignal(sig) for sig in previous} == previous
        stopping = ShutdownHandler(["SIGTERM", "SIGUSR1"]).install()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stopping.should_stop() and stopping.signal_name == "SIGUSR1"
        stopping.close()
        os.kill(os.getpid(), signal.SIGTERM)  # would end this test process with the default handler
        assert stopping.signal_name == "SIGUSR1" and signal.getsignal(signal.SIGTERM) == stopping._on_signal
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_a_newline_in_any_value_of_the_script_is_refused_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    evil = tmp_path / "sb\ntouch PWNED #"
    code, _, err = run_cli(["train", "--run-dir", str(evil), "--sbatch"], capsys)
    assert code == 2 and "train.run_dir" in err and "control character" in err
    for arg in ("--slurm.job_name=a\nb", '--slurm.env.X="a\\nb"', '--slurm.extra_sbatch=["--exclusive\\n#x"]'):
        with pytest.raises(ConfigError, match="control character"):
            load_settings(overrides=[arg], use_env=False)
    settings = load_settings(overrides=[f"--train.run_dir={tmp_path / 'run'}"], use_env=False).settings
    with pytest.raises(ConfigError, match=r"working directory: .*control character"):
        write_job(settings, python=PY, workdir=evil)
    with pytest.raises(ConfigError, match=r"python executable: .*control character"):
        write_job(settings, python="/opt/py\nthon", workdir=tmp_path)
    assert not evil.exists() and not (tmp_path / "run" / "job.sbatch").exists()


def test_sbatch_claims_default_run_dirs_like_train_and_refuses_a_foreign_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("time.strftime", lambda fmt: "20260101-000000")  # two jobs written in the same second
    first, second = (write_job(load_settings(use_env=False).settings, python=PY) for _ in range(2))
    assert (first.run_dir.name, second.run_dir.name) == ("cpu-debug-20260101-000000", "cpu-debug-20260101-000000-2")
    for files in (first, second):
        assert f"--run-dir {files.run_dir}" in files.script.read_text()
        assert load_settings(profile=str(files.config)).settings.train.run_dir == str(files.run_dir)
    project = tmp_path / "my_project"
    project.mkdir()
    (project / "config.toml").write_text("[tool.black]\nline-length = 100\n")
    code, out, err = run_cli(["train", "--sbatch", "--run-dir", str(project)], capsys)
    assert code == 2 and "is not a kforge run directory" in err and "Traceback" not in err and out == ""
    assert sorted(p.name for p in project.iterdir()) == ["config.toml"]
    assert (project / "config.toml").read_text() == "[tool.black]\nline-length = 100\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli(["train", "--sbatch", "--run-dir", str(empty)], capsys)[0] == 0  # empty or a kforge run: fine
    assert run_cli(["train", "--sbatch", "--run-dir", str(empty)], capsys)[0] == 0


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(0o755)


def test_the_script_requeues_a_hung_job_until_hangs_repeat_without_a_new_checkpoint(tmp_path: Path) -> None:
    """srun exits 76 (the hang watchdog): requeue, at most resilience.hang_max_requeues times in a row at
    the same checkpoint; a new checkpoint in between starts the count again."""
    settings = load_settings(
        overrides=[f"--train.run_dir={tmp_path / 'run'}", "--resilience.hang_max_requeues=2"]
    ).settings
    script = write_job(settings, python=PY, workdir=tmp_path).script
    bin_dir, requeues = tmp_path / "bin", tmp_path / "requeues"
    bin_dir.mkdir()
    _stub(bin_dir, "srun", "exit 76")
    _stub(bin_dir, "scontrol", f'[ "$1" = requeue ] && echo "$2" >> {requeues}; [ "$1" = show ] && echo n1; exit 0')
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n1", "SLURM_NTASKS": "2"}
    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.mkdir(parents=True)

    def attempt(latest: str) -> tuple[int, str]:
        (ckpt / "latest").write_text(latest + "\n")
        r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
        return r.returncode, r.stdout

    outcomes = [attempt("step_4"), attempt("step_4"), attempt("step_8"), attempt("step_8"), attempt("step_8")]
    assert [code for code, _ in outcomes] == [0, 0, 0, 0, 76], outcomes
    assert requeues.read_text().split() == ["42"] * 4
    assert "hung 3 times in a row without a new checkpoint; not requeueing" in outcomes[-1][1]
