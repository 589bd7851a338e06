"""Run in a subprocess by the tests: drive one provider through the shim and print what happened."""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

from nccl_shim import ProviderNotAdmitted, Shim, ShimCallFailed, admit_evidence, admit_resources


def attempt(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except ShimCallFailed as exc:
        return {"shim_error": exc.code, "message": str(exc)}
    except ProviderNotAdmitted as exc:
        return {"admission_error": exc.rule, "message": str(exc)}


def main(library: str, scenario: str) -> None:
    shim = Shim(library)
    provider = ctypes.CDLL(library)
    calls = provider.conformance_calls
    steps: list[Any] = []

    def record(label: str, value: Any) -> None:
        steps.append({"step": label, "result": value, "calls": calls(), "state": list(shim.state())})

    if scenario == "in-place":
        record("resume-first", attempt(shim.in_place_call, "resume"))
        record("suspend", attempt(shim.in_place_call, "suspend"))
        record("suspend-again", attempt(shim.in_place_call, "suspend"))
        record("prepare-while-suspended", attempt(shim.recreate_call, "prepare"))
        record("detach", attempt(shim.in_place_call, "detach"))
        record("evidence-detached", attempt(lambda: admit_evidence(shim.in_place_evidence(), "transport-detached")))
        record("reattach", attempt(shim.in_place_call, "reattach"))
        record("resume", attempt(shim.in_place_call, "resume"))
        record("evidence-active", attempt(lambda: admit_evidence(shim.in_place_evidence(), "active")))
        record("evidence-wrong-state", attempt(lambda: admit_evidence(shim.in_place_evidence(), "suspended")))
    elif scenario == "recreate":
        record("restore-first", attempt(shim.recreate_call, "restore"))
        record("prepare", attempt(shim.recreate_call, "prepare"))
        record("prepare-again", attempt(shim.recreate_call, "prepare"))
        record("suspend-while-prepared", attempt(shim.in_place_call, "suspend"))
        record("network-reset", attempt(shim.recreate_call, "network_reset"))
        record("restore", attempt(shim.recreate_call, "restore"))
        record("restore-again", attempt(shim.recreate_call, "restore"))
    elif scenario == "evidence":
        record("evidence", attempt(lambda: admit_evidence(shim.in_place_evidence(), "active")))
    elif scenario == "resources":
        record("recreate", attempt(lambda: admit_resources(*shim.resources_inspect(0), "recreate")))
        record("in-place", attempt(lambda: admit_resources(*shim.resources_inspect(1), "in-place")))
        record("bad-mode", attempt(lambda: [shim.resources_inspect(99)[0]]))
        record("mode-mismatch", attempt(lambda: admit_resources(*shim.resources_inspect(0), "in-place")))
    print(json.dumps(steps))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
