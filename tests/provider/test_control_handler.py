"""Lifecycle after the operation: the control socket's workload verbs, limited to the caller's own (issue 14 item 4)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from typing import Any

import anyio

from tests.conftest import docker
from tests.helpers import EXEC_AS_NOBODY, ROOT, Session, control_as, running_daemon

NOBODY = 65534


def run_detached(session: Session, name: str, image: str, text: str) -> Any:
    return session.runtime("workload-run", check=True, workload={
        "name": name, "image": image, "detached": True,
        "command": ["sh", "-c", f"echo {text}; exec sleep 300"]})


async def test_workload_verbs_reach_only_the_callers_workloads_across_sessions(busybox_image: str) -> None:
    suffix = os.urandom(3).hex()
    mine, theirs = f"wl-root-{suffix}", f"wl-nobody-{suffix}"
    async with running_daemon(f"{EXEC_AS_NOBODY}[server]\ncontrol_uids = [{NOBODY}]\n") as daemon:
        os.chmod(daemon.state_dir / "control.sock", 0o666)
        root_a = await daemon.open_session()
        opened = control_as(NOBODY, daemon.state_dir, {"operation": "session-open", "session": f"op-n-{suffix}",
                                                       "hosts": ["localhost"]})
        assert opened["ok"], opened
        nobody = Session(socket=opened["result"]["socket"], token=opened["result"]["token"],
                         session=opened["result"]["session"])
        try:
            await run_detached(root_a, mine, busybox_image, "hello-root")
            await run_detached(nobody, theirs, busybox_image, "hello-nobody")

            # A second session of the same manager resolves the name run by the first.
            root_b = await daemon.open_session()
            inspected = await root_b.runtime("workload-inspect", name=mine, check=True)
            assert inspected.runtime.workload.running  # type: ignore[union-attr]

            listed = {w["name"]: w for w in await daemon.control(operation="workload-list")}
            assert {mine, theirs} <= set(listed)
            assert listed[theirs]["labels"]["io.coldsnap-provider.manager-uid"] == str(NOBODY)

            def as_nobody(**request: Any) -> dict[str, Any]:
                return control_as(NOBODY, daemon.state_dir, request)

            names = [w["name"] for w in (await anyio.to_thread.run_sync(
                lambda: as_nobody(operation="workload-list")))["result"]]
            assert theirs in names and mine not in names
            refused = await anyio.to_thread.run_sync(lambda: as_nobody(operation="workload-inspect", name=mine))
            assert refused["ok"] is False
            # Another manager's workload is absent to this one: the runtime-v1 answer (issue 37, finding 3).
            assert refused["error"] == f"workload-inspect: no such workload: {mine}"
            refused = await anyio.to_thread.run_sync(lambda: as_nobody(operation="workload-stop", name=mine))
            assert refused["ok"] is False and refused["error"] == f"workload-stop: no such workload: {mine}"
            assert docker("inspect", "-f", "{{.State.Running}}", mine).stdout.strip() == b"true"

            with anyio.fail_after(10):
                while True:
                    logs = await anyio.to_thread.run_sync(lambda: as_nobody(operation="workload-logs", name=theirs))
                    if base64.b64decode(logs["result"]["output"]) == b"hello-nobody\n":
                        break
                    await anyio.sleep(0.1)
            stopped = await anyio.to_thread.run_sync(
                lambda: as_nobody(operation="workload-stop", name=theirs, timeout_s=1))
            assert stopped == {"format": 1, "id": "as-uid", "ok": True, "result": {"name": theirs, "stopped": True}}
            state = await daemon.control(operation="workload-inspect", name=theirs)
            assert state["running"] is False and state["state"] == "exited"

            # The CLI verbs, as an administrator.
            def cli(*args: str) -> subprocess.CompletedProcess[bytes]:
                return subprocess.run([sys.executable, "-m", "coldsnap_provider", "workload", *args,
                                       "--state-dir", str(daemon.state_dir)], capture_output=True, cwd=ROOT,
                                      check=False, timeout=60)

            listed_cli = cli("list", "-o", "json")
            assert listed_cli.returncode == 0 and {mine, theirs} <= {w["name"] for w in json.loads(listed_cli.stdout)}
            assert cli("logs", mine).stdout == b"hello-root\n"
            assert json.loads(cli("inspect", mine, "-o", "json").stdout)["running"] is True
            missing = cli("inspect", f"wl-absent-{suffix}")
            assert missing.returncode == 1 and b"no such workload" in missing.stderr
        finally:
            docker("rm", "-f", mine, theirs, check=False)


async def test_workload_verbs_refuse_bad_names_naming_the_field() -> None:
    async with running_daemon() as daemon:
        reply = await anyio.to_thread.run_sync(lambda: subprocess.run(
            [sys.executable, "-m", "coldsnap_provider", "workload", "inspect", "bad name\n",
             "--state-dir", str(daemon.state_dir)], capture_output=True, text=True, timeout=60))
        assert reply.returncode == 1 and "$.name" in reply.stderr
