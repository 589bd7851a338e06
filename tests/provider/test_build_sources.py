"""image-build's remote sources (issue 37, finding 4): the engine fetches an ``ADD`` URL in the host's network
namespace, so a restricted profile refuses them before anything reaches it.

Against the real dockerd, with a real HTTP server bound to this host's 127.0.0.1.
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Registry, docker
from tests.helpers import EXEC_AS_NOBODY, next_id, running_daemon, session_as, short_dir

pytestmark = pytest.mark.usefixtures("no_leftovers")

NOBODY = 65534
SECRET = b"served-only-on-the-host-loopback\n"


class _Loopback(http.server.BaseHTTPRequestHandler):
    requests: list[str] = []

    def do_GET(self) -> None:
        type(self).requests.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", str(len(SECRET)))
        self.end_headers()
        self.wfile.write(SECRET)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def loopback() -> Iterator[tuple[int, list[str]]]:
    """(port, the paths requested) of an HTTP server bound to 127.0.0.1 only."""
    handler = type("Handler", (_Loopback,), {"requests": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], handler.requests
    server.shutdown()
    server.server_close()


def _build(dockerfile: str, context: str, tag: str) -> dict[str, object]:
    return {"dockerfile": base64.b64encode(dockerfile.encode()).decode(), "context": context, "tag": tag}


def _image_exists(tag: str) -> bool:
    return docker("image", "inspect", tag, check=False).returncode == 0


def _hidden_forms(base: str, url: str) -> list[tuple[str, int]]:
    """(Dockerfile, the line its ADD starts on): one ADD of `url` per way the builder reads it."""
    host, path = url.split("/", 3)[2], url.split("/", 3)[3]
    return [
        (f"FROM {base}\nADD {url} /x\n", 2),
        (f"FROM {base}\nRUN true\nadd --chown=1:1 {url} /x\n", 3),  # lower case, a flag
        (f"FROM {base}\nADD \\\n  # a comment inside\n\n  ht\\\ntp://{host}/{path} /x\n", 2),  # joined, no space
        (f"# escape=`\nFROM {base}\nADD `\n  {url} /x\n", 3),  # the backtick escape directive
        (f'FROM {base}\nADD ["{url}", "/x"]\n', 2),  # JSON form
        (f'FROM {base} AS one\nRUN true\nFROM {base}\nADD "{url}" /x\n', 4),  # quoted, second stage
        (f"FROM {base}\nONBUILD ADD {url} /x\n", 2),  # runs in every build FROM this image
    ]


async def test_build_remote_sources_refused_under_capsule_before_the_engine_fetches(
        busybox_image: str, loopback: tuple[int, list[str]], tmp_path: Path) -> None:
    """Regression: #37 (finding 4): `ADD http://127.0.0.1:...` made dockerd read a host-loopback service for a
    capsule manager (the policy checked only the tag)."""
    port, requests = loopback
    url = f"http://127.0.0.1:{port}/secret"
    audit = tmp_path / "audit.jsonl"
    context = short_dir("cs-bs-")
    context.chmod(0o755)
    tag = f"coldsnap-capsule/bs-{next_id()[-9:]}:1"
    config = f'{EXEC_AS_NOBODY}[server]\ncontrol_uids = [{NOBODY}]\n[audit]\nfile = "{audit}"\n'
    async with running_daemon(config) as daemon:
        session = session_as(NOBODY, daemon)
        for dockerfile, line in _hidden_forms(busybox_image, url):
            reply = await session.runtime("image-build", build=_build(dockerfile, str(context), tag))
            assert not reply.ok and not reply.error_code, dockerfile  # a plain refusal
            assert str(reply.error).startswith(f"build.dockerfile line {line}: "), (dockerfile, reply.error)
            assert "127.0.0.1" in str(reply.error) and "profile capsule refuses remote build sources" in str(
                reply.error)
        variable = await session.runtime("image-build", build=_build(
            f"FROM {busybox_image}\nARG SOURCE\nADD $SOURCE /x\n", str(context), tag) | {"arguments": {"SOURCE": url}})
        assert not variable.ok and str(variable.error).startswith("build.dockerfile line 3: ADD $SOURCE: ")
        local = await session.runtime("image-build", build=_build(
            f"FROM {busybox_image}\nRUN true\n", str(context), tag))  # the rule refuses only remote sources
        assert local.ok, local.error
        refusals = [e for e in daemon.log_events() if e.get("event") == "admission" and e.get("decision") == "refused"]
    assert requests == []  # the engine never fetched
    docker("image", "rm", "-f", tag, check=False)
    assert {e["rule"] for e in refusals} == {"build-remote-sources"} and len(refusals) == 8
    events = [json.loads(text) for text in audit.read_text().splitlines()]
    builds = [e for e in events if e["action"] == "image-build"]
    assert [(e["outcome"], e["decision"]) for e in builds] == [("rejected", "refused")] * 8 + [("ok", "admitted")]
    assert all(e["profile"] == "capsule" and e["uid"] == NOBODY for e in builds)


async def test_build_remote_sources_still_fetched_under_unrestricted(
        busybox_image: str, loopback: tuple[int, list[str]]) -> None:
    """Root's `unrestricted` profile builds as before: the engine fetches the URL (from the host's loopback)."""
    port, requests = loopback
    context = str(short_dir("cs-bs-"))
    tag = f"coldsnap-capsule/bs-{next_id()[-9:]}:1"
    try:
        async with running_daemon() as daemon:
            session = await daemon.open_session()
            reply = await session.runtime("image-build", build=_build(
                f"FROM {busybox_image}\nADD http://127.0.0.1:{port}/secret /secret\n", context, tag))
            assert reply.ok, reply.error
            run = await session.runtime("workload-run", workload={
                "name": "", "image": tag, "remove_after_exit": True, "command": ["cat", "/secret"]})
        assert run.ok and run.runtime.output == SECRET  # type: ignore[union-attr]
        assert requests == ["/secret"]
    finally:
        docker("image", "rm", "-f", tag, check=False)


async def test_build_run_step_cannot_reach_the_host_loopback(
        busybox_image: str, loopback: tuple[int, list[str]]) -> None:
    """Why only ADD is refused: a RUN step runs in a build container on the default bridge, whose 127.0.0.1 is
    its own, and the host's loopback is not routed from the bridge (route_localnet off), so the server bound to
    the host's 127.0.0.1 is reached neither way (measured for docs/threat-model.md)."""
    port, requests = loopback
    context = str(short_dir("cs-bs-"))
    tag = f"coldsnap-capsule/bs-{next_id()[-9:]}:1"
    request = "printf 'GET /from-run HTTP/1.0\\r\\n\\r\\n'"
    try:
        async with running_daemon() as daemon:
            session = await daemon.open_session()
            reply = await session.runtime("image-build", build=_build(
                f"FROM {busybox_image}\n"
                f"RUN {request} | nc -w 3 127.0.0.1 {port} > /direct; {request} | nc -w 3 "
                f"$(ip route | awk '/default/ {{print $3}}') {port} > /gateway; true\n", context, tag))
            assert reply.ok, reply.error
            run = await session.runtime("workload-run", workload={
                "name": "", "image": tag, "remove_after_exit": True, "command": ["cat", "/direct", "/gateway"]})
        assert run.ok and run.runtime.output == b""  # type: ignore[union-attr]
        assert requests == []
    finally:
        docker("image", "rm", "-f", tag, check=False)


async def test_build_from_a_base_whose_onbuild_trigger_adds_a_url_refused_under_capsule(
        busybox_image: str, loopback: tuple[int, list[str]], registry: Registry) -> None:
    """A base image's ONBUILD triggers run in the build FROM it, and the engine fetches an ADD of a URL among
    them like one in the Dockerfile (measured: `FROM` such an image read the host-loopback server). A capsule
    manager gets such an image without writing the ONBUILD itself (image-pull of any image its profile
    admits), so the backend checks the bases' triggers: resident, or pulled first when the build pulls."""
    port, requests = loopback
    context = short_dir("cs-bs-")
    context.chmod(0o755)
    (context / "Dockerfile").write_text(f"FROM {busybox_image}\nONBUILD ADD http://127.0.0.1:{port}/trigger /t\n")
    base = f"{registry.address}/capsules/onbuild-{next_id()[-9:]}:1"
    tag = f"coldsnap-capsule/bs-{next_id()[-9:]}:1"
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    subprocess.run(["docker", "build", "-q", "-t", base, str(context)], env=env, check=True, capture_output=True)
    (context / "Dockerfile").unlink()
    config = (f'{EXEC_AS_NOBODY}[server]\ncontrol_uids = [{NOBODY}]\n'
              f'[registry]\ncredentials_file = "{registry.credentials_file}"\n')
    try:
        async with running_daemon(config) as daemon:
            session = session_as(NOBODY, daemon)
            resident = await session.runtime("image-build", build=_build(f"FROM {base}\n", str(context), tag))
            root = await daemon.open_session()
            assert (await root.runtime("image-push", image=base)).ok
            docker("image", "rm", base)
            pulled = await session.runtime("image-build", build=_build(f"FROM {base}\n", str(context), tag)
                                           | {"pull": True})
        for reply in (resident, pulled):
            assert not reply.ok and not reply.error_code, reply.error
            assert reply.error == (
                f"build.dockerfile: FROM {base}: its ONBUILD trigger ADD http://127.0.0.1:{port}/trigger would have "
                "the engine fetch from the network itself, in the host's network namespace; this manager's profile "
                "refuses remote build sources (build_remote_sources)")
        assert requests == [] and not _image_exists(tag)
    finally:
        docker("image", "rm", "-f", base, tag, check=False)
