"""Hijacked attach/exec connections against the real dockerd: errors arrive already typed."""

from __future__ import annotations

import pytest

from coldsnap_runtime.backend._hijack import hijack
from coldsnap_runtime.errors import EngineRejected

SOCKET = "/var/run/docker.sock"


async def test_hijack_of_an_absent_container_is_engine_rejected_with_the_status() -> None:
    with pytest.raises(EngineRejected) as caught:
        await hijack(SOCKET, "/containers/" + "0" * 64 + "/attach", action="workload-run",
                     query={"stream": "1", "stdout": "1"})
    assert caught.value.status == 404 and caught.value.error_code == "runtime_failed"
    assert str(caught.value).startswith("workload-run failed: ") and "0" * 12 in str(caught.value)


async def test_hijack_of_an_unknown_endpoint_names_the_engines_answer() -> None:
    with pytest.raises(EngineRejected) as caught:
        await hijack(SOCKET, "/exec/not-an-exec/start", action="workload-exec", body={"Detach": False})
    assert caught.value.status == 404 and "not-an-exec" in caught.value.detail
