"""A one-node SLURM cluster on this machine, for the tests: munged, slurmctld and slurmd from
Debian's packages, every file under one temporary directory, every daemon stopped by PID.

The daemons run in the foreground (``-D``/``-F``) as children of the test process, so their
PIDs are known without pid files and nothing outlives the session. Clients find the cluster
through ``SLURM_CONF`` (see :attr:`LocalSlurm.env`); a job inherits it from the submitting
environment, so ``srun`` and ``scontrol`` inside the job script talk to this cluster too.

With ``node_names`` the cluster has several SLURM nodes on this one host, one ``slurmd -N NAME``
each on its own port (SLURM's "multiple slurmd", which Debian's 22.05 packages allow): jobs then
span nodes, and a node can be excluded.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
COMMANDS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "munged")
FINISHED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL")
CRED_EXPIRE_S = 5  # a requeued job waits this long before it may start again (SLURM's default: 120)


def install_reason() -> str | None:
    """Install SLURM with apt-get when it is missing; None when it is there, else why it cannot be."""
    if all(shutil.which(c) for c in COMMANDS):
        return None
    if os.geteuid() != 0:
        return f"SLURM is not installed and installing it needs root (apt-get install {' '.join(PACKAGES)})"
    if shutil.which("apt-get") is None:
        return f"SLURM is not installed and there is no apt-get to install {' '.join(PACKAGES)}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900, check=False)
    if proc.returncode != 0:  # a stale package index: refresh once
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=900, check=False)
        proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900, check=False)
    if proc.returncode != 0 or not all(shutil.which(c) for c in COMMANDS):
        return f"could not install SLURM ({' '.join(install)}): {proc.stderr.strip()[-500:]}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_id_with_free_port(base: int = 15000, span: int = 10000) -> int:
    """A first job id whose job script's MASTER_PORT (``base + id % span``) is free now: a second cluster
    (or another one on this machine) starts at job 1 too, and its job would take the same port."""
    for _ in range(200):
        port = base + 100 + secrets.randbelow(span - 100)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port - base
    raise RuntimeError(f"no free port in {base + 100}..{base + span}")


def _node_line() -> tuple[str, int]:
    """This host's node name (as slurmd sees it) and CPU count, from `slurmd -C`."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True, timeout=60).stdout
    name = re.search(r"NodeName=(\S+)", out)
    cpus = re.search(r"\bCPUs=(\d+)", out)
    if name is None or cpus is None:
        raise RuntimeError(f"unexpected `slurmd -C` output: {out!r}")
    return name.group(1), int(cpus.group(1))


@dataclass
class LocalSlurm:
    """The running cluster: its directory, config and daemons."""

    root: Path
    node_names: tuple[str, ...] = ()  # several SLURM nodes on this host (one slurmd each); () = one, the host
    first_job_id: int = 1
    node: str = ""
    cpus: int = 0
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment for clients (sbatch, kforge --submit) and, through them, for jobs."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _node_lines(self) -> list[str]:
        if not self.node_names:
            return [
                f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
                f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            ]
        return [
            *(
                f"NodeName={n} NodeHostname={self.node} NodeAddr=127.0.0.1 Port={_free_port()} CPUs={self.cpus} "
                "State=UNKNOWN"
                for n in self.node_names
            ),
            f"PartitionName=debug Nodes={','.join(self.node_names)} Default=YES MaxTime=INFINITE State=UP",
        ]

    def write_conf(self) -> None:
        self.node, actual_cpus = _node_line()
        self.cpus = max(actual_cpus, 2)  # two tasks of one CPU; config_overrides allows more than the host has
        r = self.root
        each = "-%n" if self.node_names else ""  # one spool, pid and log file per slurmd
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=kforgetest",
                    f"SlurmctldHost={self.node}(127.0.0.1)",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={r / 'munge' / 'munge.socket'},cred_expire={CRED_EXPIRE_S}",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}{each}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd'}{each}.pid",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd'}{each}.log",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1",
                    "SlurmdParameters=config_overrides",
                    "MailProg=/bin/true",
                    "ReturnToService=2",
                    "KillWait=30",
                    "MinJobAge=600",
                    "JobRequeue=1",
                    f"FirstJobId={self.first_job_id}",
                    *self._node_lines(),
                    "",
                ]
            )
        )

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.root / "log" / f"{name}.console").open("wb")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def start(self) -> None:
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(mode=0o700, parents=True, exist_ok=True)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.write_conf()
        m = r / "munge"
        self._spawn(
            "munged",
            [
                "munged",
                "-F",
                "--force",
                f"--socket={m / 'munge.socket'}",
                f"--key-file={key}",
                f"--pid-file={m / 'munged.pid'}",
                f"--log-file={m / 'munged.log'}",
                f"--seed-file={m / 'munged.seed'}",
            ],
        )
        self._wait(lambda: (m / "munge.socket").exists(), 20, "munged did not create its socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, 30, "slurmctld did not answer")
        if not self.node_names:
            self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf)])
        for n in self.node_names:
            (r / f"spool-{n}").mkdir(mode=0o700, exist_ok=True)
            self._spawn(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", str(self.conf)])
        self._wait(self._node_idle, 30, "the node did not become idle")

    def _node_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
        return out == ["idle"] * max(len(self.node_names), 1)

    def _wait(self, ready: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}: {self.logs()}")
            if ready():  # type: ignore[operator]
                return
            time.sleep(0.2)
        raise RuntimeError(f"{what} within {timeout} s: {self.logs()}")

    def logs(self) -> str:
        parts = []
        for f in [*sorted((self.root / "log").glob("*")), self.root / "munge" / "munged.log"]:
            if f.is_file():
                parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=60, check=check)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_job(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        """Poll until the job is in one of `states`; its record then."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout} s: {info}")

    def wait_gone(self, job_id: str, timeout: float) -> None:
        """Poll until squeue no longer lists the job (finished, including its completing phase)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T", check=False).stdout.strip()
            if state in FINISHED or not state:
                return
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still listed by squeue after {timeout} s: {self.job(job_id)}")

    def stop(self) -> None:
        """Cancel what still runs, then stop every daemon we started, by PID (slurmd first)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--user", "root", check=False)
            deadline = time.monotonic() + 45
            while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
                time.sleep(0.5)
        for name in (*(n for n in self.procs if n.startswith("slurmd")), "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
