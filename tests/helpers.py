"""Test helpers: a real daemon subprocess and a client session as strict as the Go client."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from coldsnap_provider import Reply, call, call_control, exchange
from tests import unit_sandbox

ROOT = Path(__file__).resolve().parent.parent
_ids = itertools.count(1767225600000000001)


def _fresh_file(prefix: str) -> Path:
    fd, name = tempfile.mkstemp(prefix=prefix)
    os.close(fd)
    return Path(name)


_SHORT_DIRS: list[Path] = []


def short_dir(prefix: str = "cs-") -> Path:
    """A new directory in /tmp, for what holds a socket (a socket's path has at most 107 bytes, and pytest's own
    tree is deeper than that allows); it is removed with all it holds when the session ends (`remove_short_dirs`)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    _SHORT_DIRS.append(path)
    return path


def remove_short_dirs() -> None:
    """Remove every `short_dir` this process made (tests/conftest.py, when the session ends)."""
    while _SHORT_DIRS:
        shutil.rmtree(_SHORT_DIRS.pop(), ignore_errors=True)


def next_id() -> str:
    return str(next(_ids))


def refuse_engine(what: str) -> None:
    """Fail a test of the engine-free process (tests/engine-free.txt) that reaches for `what`: that process runs
    beside the main run, so an engine, the registry or a daemon used from it would race the main run's tests."""
    if os.environ.get("COLDSNAP_TEST_ENGINE_FREE") == "1":
        pytest.fail(f"{what} is used in the engine-free test process: take this module out of "
                    "tests/engine-free.txt (it then runs in the main run)", pytrace=False)


class Made:
    """What this pytest process's tests asked an engine for, so that the leftover check (tests/conftest.py,
    `no_leftovers`) judges only those: the engine is shared with other clients (another test run, an admin's own
    containers), whose containers are not this test's to count or remove.

    A container is this process's when its id or name is one the tests asked for (a workload name sent to a
    daemon, a name or id of the Docker CLI helper), it carries the instance label of a daemon or backend the tests
    started (every container an RPC owns does), or the label the CLI helper puts on what it creates.
    """

    LABEL = "io.coldsnap-tests.process"  # on containers the tests' `docker run/create` make
    INSTANCE_LABEL = "io.coldsnap-provider.instance"

    def __init__(self) -> None:
        self.token = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.marks: set[str] = set()

    def add(self, *marks: str) -> None:
        self.marks.update(m for m in marks if m)

    @staticmethod
    def instance(path: Path) -> str:
        """The instance label of a backend of a daemon serving `path`: the daemon's rule (_hosts.instance_id;
        tests/provider/test_leftovers.py holds the two equal)."""
        return hashlib.sha256(os.fsencode(path.absolute())).hexdigest()[:16]

    def daemon(self, state_dir: Path) -> None:
        """A daemon serving `state_dir`: its Docker backend's instance and its Kubernetes hosts' (_serve.py)."""
        self.add(self.instance(state_dir), self.instance(state_dir / "kubernetes"))

    def envelope(self, fields: dict[str, Any]) -> None:
        """The workload name of a `workload-run` sent to a daemon."""
        runtime = fields.get("runtime")
        if isinstance(runtime, dict) and isinstance(workload := runtime.get("workload"), dict):
            self.add(str(workload.get("name") or ""))

    def owns(self, info: dict[str, Any]) -> bool:
        """Whether an inspected container is one this process's tests made."""
        labels = (info.get("Config") or {}).get("Labels") or {}
        return (labels.get(self.LABEL) == self.token or labels.get(self.INSTANCE_LABEL, "") in self.marks
                or info.get("Id", "") in self.marks or str(info.get("Name", "")).lstrip("/") in self.marks)


MADE = Made()


@dataclass
class Session:
    """A provider session as the adapter sees it: socket, token, session id."""

    socket: str
    token: str
    session: str

    def envelope(self, operation: str, **fields: Any) -> dict[str, Any]:
        MADE.envelope(fields)
        return {"format": 1, "id": next_id(), "token": self.token, "session": self.session,
                "operation": operation, **fields}

    async def call(self, operation: str, *, check: bool = False, **fields: Any) -> Reply:
        return await call(self.socket, self.envelope(operation, **fields), check=check)

    async def runtime(self, action: str, *, host: str = "localhost", check: bool = False,
                      **fields: Any) -> Reply:
        return await self.call("runtime", host=host, runtime={"action": action, **fields}, check=check)

    async def raw(self, payload: bytes) -> bytes:
        # Abuse tests send what no JSON reader takes (depth past the recursion limit, bad UTF-8, ...).
        with contextlib.suppress(ValueError, AttributeError, RecursionError):
            MADE.envelope(json.loads(payload))
        return await exchange(self.socket, payload)

    async def exec_in_background(self, script: str, pid_file: Path) -> tuple[anyio.abc.SocketStream, int]:
        """Send an exec of `sh -c script` and leave it running; returns its connection and the pid
        the script wrote to `pid_file` (close the connection to cancel it)."""
        request = self.envelope("exec", host="localhost", arguments=["sh", "-c", script])
        stream = await anyio.connect_unix(self.socket)
        await stream.send(json.dumps(request).encode() + b"\n")
        await stream.send_eof()
        with anyio.fail_after(10):
            while not pid_file.exists() or not pid_file.read_text().strip():
                await anyio.sleep(0.05)
        return stream, int(pid_file.read_text())


@dataclass
class Daemon:
    state_dir: Path
    config_path: Path
    process: subprocess.Popen[bytes] | None = None
    log_path: Path = field(default_factory=lambda: _fresh_file("cs-log-"))
    unit: bool = field(default_factory=unit_sandbox.enabled)

    def start(self, *, env: dict[str, str] | None = None, wait: bool = True) -> None:
        refuse_engine("a daemon")
        MADE.daemon(self.state_dir)
        self._log = open(self.log_path, "ab")
        argv = [sys.executable, "-m", "coldsnap_provider", "serve", "--config", str(self.config_path),
                "--state-dir", str(self.state_dir), "--log-level", "debug"]
        unit_env: dict[str, str] = {}
        if self.unit:  # as the shipped systemd unit runs it (tests/unit_sandbox.py)
            unit_env = unit_sandbox.prepare(self.state_dir, self.config_path)
            argv = unit_sandbox.wrap(argv)
        self.process = subprocess.Popen(
            argv, stdout=self._log, stderr=self._log, env={**os.environ, **unit_env, **(env or {})},
        )
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"daemon exited {self.process.returncode}:\n{self.log()}")
            if "\"event\": \"ready\"" in self.log():
                return
            time.sleep(0.01)  # the suite starts a few hundred daemons: a coarser poll costs each its half
        raise TimeoutError(f"daemon not ready:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text()
        except FileNotFoundError:
            return ""

    def log_events(self) -> list[dict[str, Any]]:
        events = []
        for line in self.log().splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
        return events

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self._log.close()
        return code

    async def control(self, **request: Any) -> Any:
        return await call_control(self.state_dir, request)

    async def open_session(self, session: str | None = None, *, hosts: list[str] | None = None,
                           **extra: Any) -> Session:
        return await open_session(self.state_dir, session, hosts=hosts, **extra)


async def open_session(state_dir: Path, session: str | None = None, *, hosts: list[str] | None = None,
                       **extra: Any) -> Session:
    """A session from a running daemon's control socket, as a placement manager opens one."""
    result = await call_control(state_dir, {"operation": "session-open", "session": session or f"op-{next_id()[-6:]}",
                                            "hosts": hosts or ["localhost"], **extra})
    return Session(socket=result["socket"], token=result["token"], session=result["session"])


def write_config(directory: Path, text: str = "") -> Path:
    path = directory / "config.toml"
    path.write_text(text)
    return path


@contextlib.asynccontextmanager
async def running_daemon(config: str = "", *, state_dir: Path | None = None,
                         env: dict[str, str] | None = None, unit: bool | None = None) -> AsyncIterator[Daemon]:
    """A real `coldsnap-provider serve` subprocess with a short private state dir; `unit`: started as the
    shipped systemd unit starts it (tests/unit_sandbox.py; default: COLDSNAP_TEST_UNIT=1)."""
    own = state_dir is None
    state = state_dir or Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))
    conf_dir = Path(tempfile.mkdtemp(prefix="cs-conf-", dir="/tmp"))
    daemon = Daemon(state_dir=state, config_path=write_config(conf_dir, config),
                    unit=unit_sandbox.enabled() if unit is None else unit)
    await anyio.to_thread.run_sync(lambda: daemon.start(env=env))
    try:
        yield daemon
    finally:
        if daemon.process is not None and daemon.process.poll() is None:
            await anyio.to_thread.run_sync(daemon.stop)
        shutil.rmtree(conf_dir, ignore_errors=True)
        if own:
            shutil.rmtree(state, ignore_errors=True)
        daemon.log_path.unlink(missing_ok=True)


def module_daemon(credentials_file: Path | None, extra_config: str = "") -> Iterator[Daemon]:
    """A daemon for one test module (its fixtures yield from this), with a registry's credentials if given."""
    state = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))
    conf = Path(tempfile.mkdtemp(prefix="cs-conf-", dir="/tmp"))
    credentials = f'[registry]\ncredentials_file = "{credentials_file}"\n' if credentials_file else ""
    config = credentials + extra_config
    d = Daemon(state_dir=state, config_path=write_config(conf, config))
    d.start()
    try:
        yield d
    finally:  # also when the generator is closed early (contextlib.closing in a fixture that failed to set up)
        d.stop()
        d.log_path.unlink(missing_ok=True)
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(conf, ignore_errors=True)


def control_as(uid: int, state_dir: Path, request: dict[str, Any]) -> dict[str, Any]:
    """One control-socket exchange from a forked child running as `uid` (no exec needed)."""
    import socket as socket_module

    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        status = 1
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM) as sock:
                sock.connect(str(state_dir / "control.sock"))
                sock.sendall(json.dumps({"format": 1, "id": "as-uid", **request}).encode() + b"\n")
                sock.shutdown(socket_module.SHUT_WR)
                while chunk := sock.recv(65536):
                    os.write(write_fd, chunk)
            status = 0
        finally:
            os._exit(status)
    os.close(write_fd)
    chunks = []
    while chunk := os.read(read_fd, 65536):
        chunks.append(chunk)
    os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    assert status == 0, "child failed to talk to the control socket"
    answer: dict[str, Any] = json.loads(b"".join(chunks))
    return answer


def session_as(uid: int, daemon: Daemon, *, hosts: tuple[str, ...] = ("localhost",),
               prefix: str = "op-as") -> Session:
    """A session opened by a manager running as `uid` (the control socket is opened to it first)."""
    os.chmod(daemon.state_dir / "control.sock", 0o666)
    # the id's last 9 digits keep the session socket's path short (sun_path)
    answer = control_as(uid, daemon.state_dir, {"operation": "session-open", "session": f"{prefix}-{next_id()[-9:]}",
                                                "hosts": list(hosts)})
    assert answer["ok"], answer
    result = answer["result"]
    return Session(socket=result["socket"], token=result["token"], session=result["session"])


# Non-root managers (server.control_uids/control_gids) need an unprivileged exec.user (issue 24, finding 9).
EXEC_AS_NOBODY = "[exec]\nuser = 'nobody'\n"
