"""Issue 38 item 6: the CLI an admin uses on day 2, against a real daemon, real sockets and the real Docker Engine:
tables and -o json, exec output decoded (--raw for the bytes), logs --follow, rm, close --all, tokens off argv
(completion, man pages and --help: test_cli_help.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.conftest import docker
from tests.helpers import EXEC_AS_NOBODY, Daemon, control_as, module_daemon, running_daemon
from tests.helpers import ROOT as REPO
from tests.provider.test_cli_help import CLI, cli

NOBODY = 65534


async def in_thread(*args: str, **kwargs: Any) -> Any:
    return await anyio.to_thread.run_sync(lambda: cli(*args, **kwargs))


def cli_as(uid: int, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the CLI run as `uid`, in a forked child (the venv's interpreter is not
    one that uid may execute); the child runs the same `main` the script does."""
    out, err = (os.open(os.devnull, os.O_RDONLY), os.pipe(), os.pipe())[1:]
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 70
        try:
            os.dup2(out[1], 1)
            os.dup2(err[1], 2)
            sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)  # not pytest's capture
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            from coldsnap_provider.cli import main

            code = main(list(args))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(out[1])
    os.close(err[1])
    with os.fdopen(out[0]) as stdout, os.fdopen(err[0]) as stderr:
        texts = stdout.read(), stderr.read()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), *texts


async def opened(daemon: Daemon, session: str, tmp_path: Path) -> dict[str, str]:
    """A session opened by the CLI; its token in a 0600 file and the socket in the environment `call` reads."""
    result = await in_thread("session", "open", "--state-dir", str(daemon.state_dir), "--session", session,
                             "--host", "localhost", "-o", "json")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    token = tmp_path / f"{session}.token"
    token.write_text(answer["token"] + "\n")
    token.chmod(0o600)
    return {"COLDSNAP_HOST_PROVIDER_SOCKET": answer["socket"], "token_file": str(token),
            "token": answer["token"]}


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    """One daemon of the default configuration for this module's call, token and status tests, each on a session
    of its own (a start and a stop are about a second of the 2-core CI box); the workload tests start their own."""
    yield from module_daemon(None)


async def test_call_shows_exec_output_as_text_and_raw_writes_the_exact_bytes(daemon: Daemon, tmp_path: Path) -> None:
    s = await opened(daemon, "op-text", tmp_path)
    env = {"COLDSNAP_HOST_PROVIDER_SOCKET": s["COLDSNAP_HOST_PROVIDER_SOCKET"]}
    base = ("call", "--session", "op-text", "--token-file", s["token_file"])
    script = r'printf "h\303\251llo\n"; echo oops >&2'
    text = await in_thread(*base, "exec", json.dumps({"host": "localhost", "arguments": ["sh", "-c", script]}),
                           env=env)
    assert text.returncode == 0 and text.stdout == "héllo\n" and "oops" in text.stderr, text
    binary = json.dumps({"host": "localhost", "arguments": ["printf", r"\377\000x"]})
    raw = await in_thread(*base, "--raw", "exec", binary, env=env, text=False)
    assert raw.returncode == 0 and raw.stdout == b"\xff\x00x"
    decoded = await in_thread(*base, "exec", binary, env=env, text=False)
    assert decoded.stdout == "\ufffd\x00x".encode()  # a terminal never gets invalid UTF-8
    wire = await in_thread(*base, "-o", "json", "exec", binary, env=env)
    assert json.loads(wire.stdout)["output"] == "/wB4"  # base64 of the same bytes, as on the wire
    caps = await in_thread(*base, "capabilities", env=env)
    assert re.search(r"^capabilities: .*\bruntime-v1\b", caps.stdout, re.M), caps.stdout
    refused = await in_thread(*base, "runtime", '{"host":"localhost","runtime":{"action":"workload-inspect",'
                              '"name":"absent-cli-x"}}', env=env)
    assert refused.returncode == 1 and "not_found: " in refused.stderr and "absent-cli-x" in refused.stderr


async def test_tokens_come_from_a_private_file_or_the_environment(daemon: Daemon, tmp_path: Path) -> None:
    s = await opened(daemon, "op-token", tmp_path)
    env = {"COLDSNAP_HOST_PROVIDER_SOCKET": s["COLDSNAP_HOST_PROVIDER_SOCKET"]}
    base = ("call", "--session", "op-token", "capabilities")
    assert (await in_thread(*base, "--token-file", s["token_file"], env=env)).returncode == 0
    from_env = await in_thread(*base, env={**env, "COLDSNAP_HOST_PROVIDER_TOKEN": s["token"]})
    assert from_env.returncode == 0, from_env.stderr
    Path(s["token_file"]).chmod(0o644)
    shared = await in_thread(*base, "--token-file", s["token_file"], env=env)
    assert shared.returncode == 2 and "readable by every user (mode 0644)" in shared.stderr
    assert "not world-readable" in shared.stderr and shared.stdout == ""
    none = await in_thread(*base, env={**env, "COLDSNAP_HOST_PROVIDER_TOKEN": ""})
    assert none.returncode == 2 and "no token" in none.stderr
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    wrong.chmod(0o600)
    refused = await in_thread(*base, "--token-file", str(wrong), env=env)
    assert refused.returncode == 1
    assert refused.stderr == "coldsnap-provider: refused: host-provider session is unauthorized\n"


def _lines_with_times(process: subprocess.Popen[str]) -> list[tuple[float, str]]:
    assert process.stdout is not None
    return [(time.monotonic(), line) for line in process.stdout]


async def test_workload_verbs_table_follow_and_rm(busybox_image: str, tmp_path: Path) -> None:
    name = f"cli-day2-{os.getpid()}-{time.monotonic_ns()}"
    try:
        async with running_daemon() as daemon:
            state = ("--state-dir", str(daemon.state_dir))
            session = await daemon.open_session()
            await session.runtime("workload-run", check=True, workload={
                "name": name, "image": busybox_image, "detached": True,
                "command": ["sh", "-c", "for i in 1 2 3 4; do echo line $i; sleep 1; done"]})
            follower = subprocess.Popen([*CLI, "workload", "logs", "--follow", name, *state], cwd=REPO,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            lines = await anyio.to_thread.run_sync(lambda: _lines_with_times(follower))
            assert await anyio.to_thread.run_sync(lambda: follower.wait(30)) == 0
            assert [line for _, line in lines] == [f"line {i}\n" for i in range(1, 5)]
            assert lines[-1][0] - lines[0][0] > 2.0  # printed as the workload wrote them, not at its end

            listed = await in_thread("workload", "ls", *state)
            header, *rows = listed.stdout.splitlines()
            assert header.split() == ["NAME", "STATE", "IMAGE", "STARTED", "ID"]
            [row] = [r for r in rows if r.startswith(name + " ")]
            assert re.match(rf"{name} +exited \(0\) +{re.escape(busybox_image)} +(\d+ s ago|just now) +\w{{12}}$", row)
            [wire] = [w for w in json.loads((await in_thread("workload", "list", *state, "-o", "json")).stdout)
                      if w["name"] == name]
            assert wire["exit_code"] == 0 and re.match(r"\d{4}-\d\d-\d\dT", wire["started_at"])
            inspected = await in_thread("workload", "inspect", name, *state)
            assert re.search(r"^state: +exited \(0\)$", inspected.stdout, re.M), inspected.stdout
            assert "io.coldsnap-provider.manager-uid=0" in inspected.stdout
            tail = await in_thread("workload", "logs", "--tail", "2", name, *state)
            assert tail.stdout == "line 3\nline 4\n"

            removed = await in_thread("workload", "rm", name, *state)
            assert removed.returncode == 0 and removed.stdout == f"removed {name}\n"
            assert docker("inspect", name, check=False).returncode != 0
            again = await in_thread("workload", "rm", name, *state)
            assert again.returncode == 1 and again.stderr == (
                f"coldsnap-provider: workload-remove: no such workload: {name}\n")
            bad = await in_thread("workload", "logs", "--tail", "-1", name, *state)
            assert bad.returncode == 2 and "--tail" in bad.stderr and ">=0" in bad.stderr
    finally:
        docker("rm", "-f", name, check=False)


async def test_logs_follow_stops_at_ctrl_c_and_leaves_the_workload_running(busybox_image: str) -> None:
    name = f"cli-follow-{os.getpid()}-{time.monotonic_ns()}"
    try:
        async with running_daemon() as daemon:
            session = await daemon.open_session()
            await session.runtime("workload-run", check=True, workload={
                "name": name, "image": busybox_image, "detached": True,
                "command": ["sh", "-c", "echo started; exec sleep 300"]})
            follower = subprocess.Popen([*CLI, "workload", "logs", "-f", name, "--state-dir", str(daemon.state_dir)],
                                        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert follower.stdout is not None
            first = await anyio.to_thread.run_sync(follower.stdout.readline)
            assert first == "started\n"
            await anyio.sleep(1)
            assert follower.poll() is None  # still following a running workload
            follower.send_signal(signal.SIGINT)
            assert await anyio.to_thread.run_sync(lambda: follower.wait(10)) == 130
            assert docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip() == b"true"
    finally:
        docker("rm", "-f", name, check=False)


async def test_close_all_and_rm_reach_only_the_callers_own(busybox_image: str, tmp_path: Path) -> None:
    """As a manager (uid nobody, allowed on the control socket): `session close --all` closes its sessions only,
    `workload rm` of root's workload is "no such workload" and changes nothing; root's close --all closes all."""
    suffix = os.urandom(3).hex()
    mine = f"cli-rm-root-{suffix}"
    try:
        async with running_daemon(f"{EXEC_AS_NOBODY}[server]\ncontrol_uids = [{NOBODY}]\n") as daemon:
            os.chmod(daemon.state_dir / "control.sock", 0o666)
            state = ("--state-dir", str(daemon.state_dir))
            root_session = await daemon.open_session()
            await root_session.runtime("workload-run", check=True, workload={
                "name": mine, "image": busybox_image, "detached": True, "command": ["sleep", "300"]})
            for n in range(2):
                answer = control_as(NOBODY, daemon.state_dir, {"operation": "session-open",
                                                               "session": f"nobody-{n}", "hosts": ["localhost"]})
                assert answer["ok"], answer

            code, _, stderr = await anyio.to_thread.run_sync(lambda: cli_as(NOBODY, "workload", "rm", mine, *state))
            assert code == 1 and stderr == f"coldsnap-provider: workload-remove: no such workload: {mine}\n"
            assert docker("inspect", "-f", "{{.State.Running}}", mine).stdout.strip() == b"true"

            code, stdout, _ = await anyio.to_thread.run_sync(
                lambda: cli_as(NOBODY, "session", "close", "--all", *state, "-o", "json"))
            assert code == 0 and json.loads(stdout) == {"closed": ["nobody-0", "nobody-1"], "failed": []}
            assert [s["session"] for s in await daemon.control(operation="session-list")] == [root_session.session]
            neither = await in_thread("session", "close", *state)
            assert neither.returncode == 2 and "give session IDs or --all" in neither.stderr
            everything = await in_thread("session", "close", "--all", *state)
            assert everything.stdout == f"closed {root_session.session}\n"
            assert (await in_thread("session", "ls", *state)).stdout == "(none)\n"
    finally:
        docker("rm", "-f", mine, check=False)


async def test_status_is_a_table_for_people_and_json_for_scripts(daemon: Daemon) -> None:
    state = ("--state-dir", str(daemon.state_dir))
    text = await in_thread("status", *state)
    assert text.returncode == 0 and re.search(r"^healthy: +true$", text.stdout, re.M), text.stdout
    assert re.search(r"^BACKEND +HOST +UP +ERROR$", text.stdout, re.M)
    assert re.search(r"^docker +\S+ +yes +-$", text.stdout, re.M)
    wire = json.loads((await in_thread("status", *state, "-o", "json")).stdout)
    assert wire["healthy"] is True and wire["state_dir"] == str(daemon.state_dir)
    scripted = await in_thread("status", *state, env={"COLDSNAP_OUTPUT": "json"})
    assert json.loads(scripted.stdout)["healthy"] is True
    gone = await in_thread("status", "--state-dir", str(daemon.state_dir / "absent"))
    assert gone.returncode == 1 and gone.stderr.startswith("coldsnap-provider: cannot reach the daemon at ")


async def test_one_uid_follows_at_most_four_logs_at_once_and_a_stopped_workloads_last_lines_arrive(
        busybox_image: str) -> None:
    """Review findings: each followed look reads the whole log, so one uid may hold only FOLLOWERS_PER_UID
    follows at a time (the fifth is refused naming the limit, and a slot frees when a follow ends); and a
    workload that writes its last line and exits between two looks still gets that line to its follower."""
    from coldsnap_provider._log_follow import FOLLOWERS_PER_UID
    from coldsnap_provider.client import ControlClient, ReplyError

    name = f"cli-follow-cap-{os.getpid()}-{time.monotonic_ns()}"
    last = f"cli-follow-last-{os.getpid()}-{time.monotonic_ns()}"
    try:
        async with running_daemon() as daemon:
            session = await daemon.open_session()
            await session.runtime("workload-run", check=True, workload={
                "name": name, "image": busybox_image, "detached": True, "command": ["sh", "-c", "exec sleep 300"]})
            client = ControlClient(daemon.state_dir)
            async with anyio.create_task_group() as group:
                for _ in range(FOLLOWERS_PER_UID):
                    group.start_soon(lambda: client.logs_after(name, offset=0, wait_s=3))
                await anyio.sleep(1)
                try:
                    await client.logs_after(name, offset=0, wait_s=1)
                except ReplyError as exc:
                    assert f"already follows {FOLLOWERS_PER_UID} logs (the limit per uid)" in str(exc)
                else:
                    raise AssertionError("a fifth concurrent follow of one uid was answered")
            assert (await client.logs_after(name, offset=0, wait_s=0)).running  # the slots are free again
            await session.runtime("workload-run", check=True, workload={
                "name": last, "image": busybox_image, "detached": True,
                "command": ["sh", "-c", "echo first; sleep 1; echo the last line; exit 3"]})
            chunks = [chunk async for chunk in client.follow_logs(last)]
            assert b"".join(chunks) == b"first\nthe last line\n"
    finally:
        docker("rm", "-f", name, last, check=False)
