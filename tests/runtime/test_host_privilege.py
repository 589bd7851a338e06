"""`privileged` under host-capabilities when the engine fails to answer the capability probe: nothing is kept of a
failure (review 2026-12-02, finding 6). The engine is the real dockerd behind a proxy that answers the first probe
create with a server error, as an engine restarting or overloaded does; the proxy runs with a capability fewer in
its bounding set, so the daemon, reading the bounding set of the process serving its engine socket, probes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest

from coldsnap_runtime.backend import DockerBackend
from coldsnap_runtime.backend._gpus import HostPolicy
from coldsnap_runtime.backend._host_privilege import engine_process
from coldsnap_runtime.backend._translate import capability_names
from coldsnap_runtime.errors import RuntimeFailed
from coldsnap_runtime.schema import WorkloadSpec
from tests.runtime.conftest import container_exists, uniq

pytestmark = pytest.mark.usefixtures("no_leftovers")

# One thread per client connection. A probe create (the probe's image in its body) is answered 500 while
# failures last; any other request goes to the engine on a connection of its own, marked to close after it.
_PROXY = r"""
import socket, sys, threading
path, failures = sys.argv[1], int(sys.argv[2])
lock = threading.Lock()

def request(conn):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None, b""
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return head, body

def serve(conn):
    global failures
    with conn:
        while True:
            head, body = request(conn)
            if head is None:
                return
            if head.startswith(b"POST ") and b"/containers/create" in head.split(b"\r\n")[0] \
                    and b"CAPABILITY-PROBE" in body:
                with lock:
                    failing, failures = failures > 0, failures - 1
                print("probe", "failed" if failing else "passed", flush=True)
                if failing:
                    message = b'{"message":"context deadline exceeded"}'
                    conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(message), message))
                    continue
            lines = [l for l in head.split(b"\r\n") if not l.lower().startswith(b"connection:")]
            with socket.socket(socket.AF_UNIX) as engine:
                engine.connect("/var/run/docker.sock")
                engine.sendall(b"\r\n".join(lines) + b"\r\nConnection: close\r\n\r\n" + body)
                while chunk := engine.recv(65536):
                    conn.sendall(chunk)
            return

listener = socket.socket(socket.AF_UNIX)
listener.bind(path)
listener.listen(64)
print("ready", flush=True)
while True:
    threading.Thread(target=serve, args=(listener.accept()[0],), daemon=True).start()
"""


@pytest.fixture
def failing_engine(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """The proxy's socket, serving from a process whose bounding set is the engine's less one capability."""
    engine = engine_process("/var/run/docker.sock")
    if engine is None:
        pytest.skip("the engine's process cannot be read from here")
    names = [name for name in capability_names(engine[0], 40) if name != "CAP_SYS_RESOURCE"][:-1]
    bounding = "-all," + ",".join("+" + name.removeprefix("CAP_").lower() for name in names)
    path = Path(f"/tmp/cs-capproxy-{uniq('p')}.sock")
    proxy = subprocess.Popen(["setpriv", f"--bounding-set={bounding}", sys.executable, "-c", _PROXY, str(path), "1"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert proxy.stdout is not None and proxy.stdout.readline() == "ready\n"
        yield path, proxy
    finally:
        proxy.kill()
        proxy.wait()
        path.unlink(missing_ok=True)


async def test_an_engine_failing_the_capability_probe_is_named_and_asked_again_at_the_next_run(
        failing_engine: tuple[Path, subprocess.Popen[str]], busybox_image: str) -> None:
    """Regression: review 2026-12-02, finding 6 (the engine's server error was taken as its answer, for the life
    of the engine process: every later privileged run was created with capabilities nobody had checked)."""
    path, proxy = failing_engine
    name = uniq("privprobe")
    spec = msgspec.convert({"name": name, "image": busybox_image, "detached": True, "privileged": True,
                            "command": ["sleep", "30"]}, WorkloadSpec)
    async with DockerBackend(url=f"unix://{path}", host_policy=HostPolicy(privileged="host-capabilities")) as backend:
        with pytest.raises(RuntimeFailed, match=r"privileged: the container engine did not say which capabilities "
                                                r"it can name \(.*context deadline exceeded\); nothing was created"):
            await backend.workload_run(spec, allow_pull=False)
        assert not container_exists(name)
        try:
            await backend.workload_run(spec, allow_pull=False)  # asked again: the engine answers this time
        finally:
            await backend.workload_remove(name)
    proxy.kill()
    assert proxy.stdout is not None
    seen = await anyio.to_thread.run_sync(proxy.stdout.read)
    # One probe stopped the first run at once; the second run asked again, until the engine's verdict.
    assert seen.startswith("probe failed\nprobe passed\n"), seen
