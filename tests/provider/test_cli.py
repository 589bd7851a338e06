"""The CLI forms other tools depend on."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from tests.conftest import BUSYBOX_IMAGE, docker
from tests.helpers import ROOT, Daemon, module_daemon, running_daemon

CLI = [sys.executable, "-m", "coldsnap_provider"]


def cli(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]


def test_version_prints_text_and_json() -> None:
    assert cli("version").stdout == "coldsnap-provider 0.1.0\n"
    result = cli("version", "-o", "json")
    assert result.returncode == 0 and json.loads(result.stdout) == {"version": "0.1.0"}


def test_check_config_names_unknown_keys_and_bad_types() -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write("[server]\nbogus = 1\n")
        f.flush()
        result = cli("check-config", f.name)
        assert result.returncode == 2 and "unknown field `bogus` - at `$.server`" in result.stderr
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write("[server]\nmax_connections = 0\n")
        f.flush()
        result = cli("check-config", f.name)
        assert result.returncode == 2 and "$.server.max_connections" in result.stderr


def test_embedded_default_config_checks_clean() -> None:
    default = Path(__file__).resolve().parents[2] / "coldsnap_provider" / "default-config.toml"
    result = cli("check-config", str(default), "-o", "json")
    assert result.returncode == 0 and json.loads(result.stdout)["config"]["server"]["max_connections"] == 512
    assert cli("check-config", str(default)).stdout == f"{default}: valid; every file it names is readable\n"


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    """One daemon of the default configuration for this module's tests of the session and run commands: each
    closes what it opened, and checks so (a start and a stop are about a second of the 2-core CI box)."""
    yield from module_daemon(None)


async def test_session_open_list_close_and_call(daemon: Daemon) -> None:
    state = str(daemon.state_dir)
    opened = await anyio.to_thread.run_sync(lambda: cli(
        "session", "open", "--state-dir", state, "--session", "op-cli", "--host", "localhost",
        "--host", "node-b", "--label", "sparkrun.cluster_id=c", "--cluster-id", "c", "-o", "json"))
    assert opened.returncode == 0, opened.stderr
    result = json.loads(opened.stdout)
    assert set(result) == {"session", "token", "socket", "environment"}
    assert result["environment"] == {"COLDSNAP_HOST_PROVIDER_SOCKET": result["socket"],
                                     "COLDSNAP_HOST_PROVIDER_TOKEN": result["token"]}
    call = await anyio.to_thread.run_sync(lambda: cli(
        "call", "--socket", result["socket"], f"--token={result['token']}", "--session", "op-cli",
        "exec", '{"host":"localhost","arguments":["echo","hi"]}', "-o", "json"))
    assert call.returncode == 0 and json.loads(call.stdout)["output"] == "aGkK"
    listed = await anyio.to_thread.run_sync(lambda: cli("session", "list", "--state-dir", state, "-o", "json"))
    assert [s["session"] for s in json.loads(listed.stdout)] == ["op-cli"]
    table = await anyio.to_thread.run_sync(lambda: cli("session", "ls", "--state-dir", state))
    assert table.stdout.splitlines()[0].split() == ["SESSION", "HOSTS", "UID", "CLUSTER", "LABELS", "OPENED"]
    assert re.fullmatch(r"op-cli +localhost,node-b +0 +c +sparkrun.cluster_id=c +(just now|\d s ago)",
                        table.stdout.splitlines()[1])
    closed = await anyio.to_thread.run_sync(lambda: cli("session", "close", "--state-dir", state, "op-cli"))
    assert closed.returncode == 0 and closed.stdout == "closed op-cli\n" and not Path(result["socket"]).exists()
    status = await anyio.to_thread.run_sync(lambda: cli("status", "--state-dir", state, "-o", "json"))
    assert json.loads(status.stdout)["sessions"] == 0


async def test_run_serves_the_controller_and_returns_its_status(daemon: Daemon) -> None:
    work = Path(tempfile.mkdtemp(prefix="cs-run-"))
    wrapper = controller(work, GOOD_CAPABILITIES)
    request = {"id": "req-run", "launch": {"units": [{"host": "localhost"}]}}
    (work / "request.json").write_text(json.dumps(request))
    script = (
        'cat > stdin.json; env > env.txt; '
        f'(cd {ROOT} && {sys.executable} -m coldsnap_provider call --session req-run capabilities -o json) '
        '> caps.json; exit 5'
    )
    result = await anyio.to_thread.run_sync(lambda: cli(
        "run", "--state-dir", str(daemon.state_dir), "--request", str(work / "request.json"),
        "--keep-env", "KEEP_ME", "--", str(wrapper), "sh", "-c", script, cwd=work,
        env={**os.environ, "HF_TOKEN": "secret", "AWS_SECRET_ACCESS_KEY": "secret", "KEEP_ME": "kept",
             "LC_ALL": "C.UTF-8"}))
    assert result.returncode == 5, result.stderr
    assert json.loads((work / "stdin.json").read_text()) == request
    env = dict(line.partition("=")[::2] for line in (work / "env.txt").read_text().splitlines() if "=" in line)
    assert "COLDSNAP_HOST_PROVIDER_SOCKET" in env and "HF_TOKEN" not in env
    # Regression: #24 finding 9: only an allow-list (and what the manager keeps) reaches the controller.
    assert "AWS_SECRET_ACCESS_KEY" not in env and env["KEEP_ME"] == "kept" and env["LC_ALL"] == "C.UTF-8"
    assert "secret" not in env.values()
    assert json.loads((work / "caps.json").read_text())["ok"] is True
    assert await daemon.control(operation="session-list") == []  # closed after the child exited


async def test_run_forwards_sigterm_to_the_controller_group(daemon: Daemon) -> None:
    work = Path(tempfile.mkdtemp(prefix="cs-run-"))
    (work / "request.json").write_text(json.dumps({"id": "req-term", "launch": {"units": [{"host": "h"}]}}))
    wrapper = controller(work, GOOD_CAPABILITIES)
    script = 'cat > /dev/null; trap "echo term > got; exit 3" TERM; touch started; while :; do sleep 0.1; done'
    process = subprocess.Popen([*CLI, "run", "--state-dir", str(daemon.state_dir), "--request",
                                str(work / "request.json"), "--", str(wrapper), "sh", "-c", script],
                               cwd=work)
    deadline = time.monotonic() + 20
    while not (work / "started").exists():
        assert time.monotonic() < deadline and process.poll() is None
        await anyio.sleep(0.05)
    assert [s["session"] for s in await daemon.control(operation="session-list")] == ["req-term"]
    process.send_signal(signal.SIGTERM)
    code = await anyio.to_thread.run_sync(process.wait, 20)
    assert code == 3 and (work / "got").read_text() == "term\n"
    assert await daemon.control(operation="session-list") == []


def test_default_state_dir_for_root_and_for_users(tmp_path: Path) -> None:
    from coldsnap_provider._config import default_state_dir

    assert default_state_dir(0, {}) == Path("/run/coldsnap-provider")
    assert default_state_dir(1000, {"XDG_RUNTIME_DIR": str(tmp_path)}) == tmp_path / "coldsnap-provider"
    assert default_state_dir(1000, {"XDG_RUNTIME_DIR": "/nonexistent"}) == Path("/tmp/coldsnap-provider-1000")
    assert default_state_dir(1000, {}) == Path("/tmp/coldsnap-provider-1000")


def test_serve_without_configuration_uses_the_embedded_default(tmp_path: Path) -> None:
    """Unconfigured and as root: the daemon binds /run/coldsnap-provider/control.sock and answers there."""
    state = Path("/run/coldsnap-provider")
    if (state / "control.sock").exists():
        pytest.skip("another daemon owns /run/coldsnap-provider")
    process = subprocess.Popen([*CLI, "serve"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            status = cli("status", "-o", "json")
            if status.returncode == 0:
                break
            assert time.monotonic() < deadline and process.poll() is None, status.stderr
            time.sleep(0.1)
        assert json.loads(status.stdout)["state_dir"] == str(state)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0
        shutil.rmtree(state, ignore_errors=True)


# --- run: controller negotiation (spec section 8) -----------------------------------------

GOOD_CAPABILITIES = {
    "format": 1,
    "kind": "coldsnap-controller-capabilities",
    "controller": {"version": "0.3.25"},
    "protocols": {"request_format": 1, "accepted_request_formats": [1], "host_provider_format": 1,
                  "timing_event_format": 1, "payload_validation_rpc_format": 1},
    "features": ["manager-host-provider", "manager-runtime-v1", "prepare-only-restore"],
}


def controller(work: Path, capabilities: object, *, exit_code: int = 0) -> Path:
    """A controller program: `capabilities` prints `capabilities` (and records its environment);
    anything else runs the rest of its argv (`controller sh -c SCRIPT`) and records that it ran."""
    text = capabilities if isinstance(capabilities, str) else json.dumps(capabilities, indent=2)
    script = work / "coldsnap"
    script.write_text(f"""#!/bin/sh
if [ "$1" = capabilities ]; then
  env > "{work}/capabilities-env.txt"
  cat <<'JSON'
{text}
JSON
  exit {exit_code}
fi
touch "{work}/controller-ran"
exec "$@"
""")
    script.chmod(0o755)
    return script


async def run_with(daemon: Daemon, capabilities: object, *extra: str, exit_code: int = 0,
                   script: str = "cat > /dev/null", env: dict[str, str] | None = None,
                   ) -> tuple[subprocess.CompletedProcess[str], Path, list[object]]:
    """`coldsnap-provider run` against `daemon`; returns the result, the work dir and the sessions the daemon
    listed while the controller ran (written by the controller itself)."""
    work = Path(tempfile.mkdtemp(prefix="cs-run-"))
    (work / "request.json").write_text(json.dumps({"id": "req-neg", "launch": {"units": [{"host": "localhost"}]}}))
    wrapper = controller(work, capabilities, exit_code=exit_code)
    listing = (f"{script}; cd {ROOT} && {sys.executable} -m coldsnap_provider session list -o json "
               f"--state-dir {daemon.state_dir} > {work}/sessions.json")
    result = await anyio.to_thread.run_sync(lambda: cli(
        "run", "--state-dir", str(daemon.state_dir), "--request", str(work / "request.json"), *extra,
        "--", str(wrapper), "sh", "-c", listing, cwd=work, env={**os.environ, **(env or {})}))
    assert await daemon.control(operation="session-list") == []
    sessions = json.loads((work / "sessions.json").read_text()) if (work / "sessions.json").exists() else []
    return result, work, sessions


async def test_run_negotiates_then_opens_the_session_with_labels_and_cluster_id(daemon: Daemon) -> None:
    result, work, sessions = await run_with(
        daemon, GOOD_CAPABILITIES, "--label", "sparkrun.cluster_id=c-7", "--label", "sparkrun.recipe=r",
        "--cluster-id", "c-7", env={"HF_TOKEN": "hf_secret", "HUGGING_FACE_HUB_TOKEN": "hf_secret"})
    assert result.returncode == 0, result.stderr
    assert (work / "controller-ran").exists()
    probe_env = (work / "capabilities-env.txt").read_text()
    assert "hf_secret" not in probe_env and "COLDSNAP_HOST_PROVIDER_TOKEN" not in probe_env
    [session] = sessions
    assert session["session"] == "req-neg" and session["cluster_id"] == "c-7"  # type: ignore[index]
    assert session["labels"] == {"sparkrun.cluster_id": "c-7", "sparkrun.recipe": "r"}  # type: ignore[index]


@pytest.mark.parametrize(("capabilities", "expected"), [
    pytest.param({**GOOD_CAPABILITIES, "features": ["manager-host-provider"]},
                 "features lacks 'manager-runtime-v1'", id="no-runtime-v1"),
    pytest.param({**GOOD_CAPABILITIES, "protocols": {"host_provider_format": 2}},
                 "protocols.host_provider_format is 2, not 1", id="format-2"),
    pytest.param({**GOOD_CAPABILITIES, "protocols": {"host_provider_format": 1.0}},
                 "protocols.host_provider_format is 1.0, not 1", id="format-float"),
    pytest.param({"format": 1}, "features lacks 'manager-runtime-v1'; protocols.host_provider_format is null",
                 id="old-controller"),
    pytest.param("coldsnap 0.3.19", "did not print a capabilities object", id="not-json"),
])
async def test_run_refuses_a_controller_missing_what_the_manager_needs(daemon: Daemon, capabilities: object,
                                                                       expected: str) -> None:
    result, work, sessions = await run_with(daemon, capabilities)
    assert result.returncode == 2 and "refusing the controller" in result.stderr and expected in result.stderr
    assert not (work / "controller-ran").exists() and sessions == []


async def test_run_refuses_a_controller_whose_capabilities_fails(daemon: Daemon) -> None:
    result, work, _ = await run_with(daemon, GOOD_CAPABILITIES, exit_code=3)
    assert result.returncode == 2 and "capabilities` exited 3" in result.stderr
    assert not (work / "controller-ran").exists()


async def test_run_refuses_a_controller_that_does_not_answer_in_time(daemon: Daemon) -> None:
    work = Path(tempfile.mkdtemp(prefix="cs-run-"))
    (work / "request.json").write_text(json.dumps({"id": "req-slow", "launch": {"units": [{"host": "h"}]}}))
    slow = work / "slow"
    slow.write_text("#!/bin/sh\nexec sleep 60\n")
    slow.chmod(0o755)
    result = await anyio.to_thread.run_sync(lambda: cli(
        "run", "--state-dir", str(daemon.state_dir), "--request", str(work / "request.json"),
        "--capabilities-timeout", "0.5", "--", str(slow), "restore"))
    assert await daemon.control(operation="session-list") == []
    assert result.returncode == 2 and "did not answer within 0.5 s" in result.stderr


def test_run_rejects_a_malformed_label() -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        f.write(json.dumps({"id": "x"}))
        f.flush()
        result = cli("run", "--request", f.name, "--label", "novalue", "--", "true")
    assert result.returncode == 2 and "expected KEY=VALUE" in result.stderr


async def test_readme_first_session_runs_as_written(tmp_path: Path) -> None:
    """README "First session", run by bash against a real daemon: only the binary, the image (the pull needs
    Docker Hub), the workload's name (one dockerd is shared) and the state directory are substituted."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("\n## First session\n", 1)[1]
    script = section.split("```sh\n", 1)[1].split("\n```", 1)[0]
    name = f"readme-hello-{os.getpid()}-{time.monotonic_ns()}"
    script = "\n".join(line for line in script.splitlines() if '"image-pull"' not in line)
    script = "\n".join(line.replace(" hello", f" {name}") if line.startswith("csp workload") else line
                       for line in script.splitlines())
    script = (script.replace(".venv/bin/coldsnap-provider", f"{sys.executable} -m coldsnap_provider")
              .replace("busybox:1.36", BUSYBOX_IMAGE).replace('"hello"', f'"{name}"'))
    try:
        async with running_daemon() as daemon:
            result = await anyio.to_thread.run_sync(lambda: subprocess.run(
                ["bash", "-e", "-o", "pipefail", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                env={**os.environ, "COLDSNAP_PROVIDER_STATE_DIR": str(daemon.state_dir), "PYTHONPATH": str(ROOT)},
                check=False))
    finally:
        docker("rm", "-f", name, check=False)  # the block removes it itself unless it failed half-way
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert re.search(r"^healthy: +true$", result.stdout, re.M) and re.search(r"^Linux \S+$", result.stdout, re.M)
    assert any(line.startswith("hello from ") for line in lines)
    assert re.search(r"^state: +exited \(0\)$", result.stdout, re.M)
    assert f"removed {name}" in lines and lines[-1] == "closed first-session"
    assert (tmp_path / "session.token").stat().st_mode & 0o077 == 0
    assert docker("inspect", name, check=False).returncode != 0  # `workload rm` removed it
