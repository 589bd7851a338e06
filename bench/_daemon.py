"""A real `coldsnap-provider serve` for the benches, and a session on it, through the public client alone
(`coldsnap_provider.call`, `call_control`, `exchange`). bench/ is a client of the daemon as a placement manager is:
it imports no test code (tests may import bench, never the reverse), so the leftover bookkeeping and the systemd
unit sandbox of tests/helpers.py are not here: a bench's daemon runs as a plain child process."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from coldsnap_provider import Reply, call, call_control, exchange

_ids = itertools.count(int(time.time() * 1_000_000))


def next_id() -> str:
    """A request id no other request of this process has."""
    return str(next(_ids))


@dataclass
class Session:
    """A provider session as the adapter sees it: socket, token, session id."""

    socket: str
    token: str
    session: str

    def envelope(self, operation: str, **fields: Any) -> dict[str, Any]:
        return {"format": 1, "id": next_id(), "token": self.token, "session": self.session,
                "operation": operation, **fields}

    async def call(self, operation: str, *, check: bool = False, **fields: Any) -> Reply:
        return await call(self.socket, self.envelope(operation, **fields), check=check)

    async def runtime(self, action: str, *, host: str = "localhost", check: bool = False, **fields: Any) -> Reply:
        return await self.call("runtime", host=host, runtime={"action": action, **fields}, check=check)

    async def raw(self, payload: bytes) -> bytes:
        """Bytes sent as they are (the abuse benches send what no JSON reader takes); the reply's bytes."""
        return await exchange(self.socket, payload)


async def open_session(state_dir: Path, session: str | None = None, *, hosts: list[str] | None = None,
                       **extra: Any) -> Session:
    """A session from a running daemon's control socket, as a placement manager opens one."""
    result = await call_control(state_dir, {"operation": "session-open", "session": session or f"op-{next_id()[-6:]}",
                                            "hosts": hosts or ["localhost"], **extra})
    return Session(socket=result["socket"], token=result["token"], session=result["session"])


@dataclass
class Daemon:
    """`coldsnap-provider serve` as a child process, its log in a file of its own."""

    state_dir: Path
    config_path: Path
    process: subprocess.Popen[bytes] | None = None
    cwd: Path | None = None  # where it starts: `-m` imports the daemon found there first (another checkout's)
    log_path: Path = field(default_factory=lambda: Path(tempfile.mkstemp(prefix="cs-bench-log-")[1]))

    def start(self, *, env: dict[str, str] | None = None, timeout: float = 20.0) -> None:
        """Start it and wait for its `ready` event (an early exit or a silent daemon is an error with its log)."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "coldsnap_provider", "serve", "--config", str(self.config_path),
                 "--state-dir", str(self.state_dir), "--log-level", "debug"],
                stdout=log, stderr=log, env={**os.environ, **(env or {})}, cwd=self.cwd)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"daemon exited {self.process.returncode}:\n{self.log()}")
            if '"event": "ready"' in self.log():
                return
            time.sleep(0.05)
        raise TimeoutError(f"daemon not ready:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text()
        except FileNotFoundError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal it and wait; killed when it outlives `timeout`."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()

    async def control(self, **request: Any) -> Any:
        return await call_control(self.state_dir, request)

    async def open_session(self, session: str | None = None, *, hosts: list[str] | None = None,
                           **extra: Any) -> Session:
        return await open_session(self.state_dir, session, hosts=hosts, **extra)


@contextlib.asynccontextmanager
async def running_daemon(config: str = "", *, state_dir: Path | None = None,
                         env: dict[str, str] | None = None, cwd: Path | None = None) -> AsyncIterator[Daemon]:
    """A real `coldsnap-provider serve` with `config` as its configuration and a short private state dir (or
    `state_dir`, kept afterwards), started in `cwd` (another checkout: its daemon); stopped, and what it was given
    removed, on the way out."""
    own = state_dir is None
    state = state_dir or Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))
    conf_dir = Path(tempfile.mkdtemp(prefix="cs-conf-", dir="/tmp"))
    (conf_dir / "config.toml").write_text(config)
    daemon = Daemon(state_dir=state, config_path=conf_dir / "config.toml", cwd=cwd)
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

