"""engine.observe.wandb_backend: how "auto" picks online or offline, run ids, exit codes.

No network: "reachable" is checked against sockets on 127.0.0.1. Real offline W&B runs
(config, every step, the same run id after a resume) are in tests/e2e/test_tracking_wandb.py.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kforge_cli.engine.observe.wandb_backend import WANDB_EXIT_CODES, choose_mode, has_api_key, new_run_id


@pytest.fixture
def listening() -> Iterator[int]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        yield server.getsockname()[1]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nobody listens once it is closed


def no_credentials(tmp_path: Path) -> dict[str, str]:
    return {"HOME": str(tmp_path), "NETRC": str(tmp_path / "missing-netrc")}


def test_explicit_setting_and_wandb_mode_env_win(tmp_path: Path) -> None:
    env = {**no_credentials(tmp_path), "WANDB_MODE": "offline"}
    assert choose_mode("online", env) == ("online", "metrics.wandb_mode = 'online'")
    assert choose_mode("offline", {}) == ("offline", "metrics.wandb_mode = 'offline'")
    assert choose_mode("auto", env) == ("offline", "WANDB_MODE=offline")
    assert choose_mode("auto", {"WANDB_MODE": "dryrun"}) == ("offline", "WANDB_MODE=dryrun")
    assert choose_mode("auto", {"WANDB_MODE": "disabled"})[0] == "disabled"


def test_auto_is_offline_without_an_api_key(tmp_path: Path, listening: int) -> None:
    env = {**no_credentials(tmp_path), "WANDB_BASE_URL": f"http://127.0.0.1:{listening}"}
    mode, why = choose_mode("auto", env)
    assert mode == "offline" and "no W&B API key" in why


def test_auto_is_offline_when_the_server_cannot_be_reached(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    env = {**no_credentials(tmp_path), "WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": url}
    assert choose_mode("auto", env) == ("offline", f"cannot reach {url}")


def test_auto_is_online_with_a_key_and_a_reachable_server(tmp_path: Path, listening: int) -> None:
    env = {**no_credentials(tmp_path), "WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": f"http://127.0.0.1:{listening}"}
    assert choose_mode("auto", env)[0] == "online"


def test_api_key_from_netrc_counts_only_for_its_host(tmp_path: Path) -> None:
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {'k' * 40}\n")
    netrc.chmod(0o600)
    env = {"HOME": str(tmp_path), "NETRC": str(netrc)}
    assert has_api_key("https://api.wandb.ai", env)
    assert not has_api_key("https://wandb.mycompany.com", env)
    assert not has_api_key("https://api.wandb.ai", no_credentials(tmp_path))
    assert has_api_key("https://api.wandb.ai", {**no_credentials(tmp_path), "WANDB_API_KEY": "x"})


def test_run_ids_and_exit_codes() -> None:
    ids = {new_run_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"[a-z0-9]{8}", i) for i in ids)
    assert WANDB_EXIT_CODES == {"completed": 0, "stopped": 75, "failed": 1}
