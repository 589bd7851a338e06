"""The real shim loading conformance providers, each in a subprocess so a crash is caught."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from nccl_shim import AdmissionError, capability_names, decide_graph_policy, missing_capabilities
from nccl_shim._abi import InPlaceV1, ProviderV1, ResourcesV1
from nccl_shim._lib import Shim
from tests.helpers import ROOT

ID_231 = {"COLDSNAP_NCCL_PROVIDER_ID": "nccl-2.31.2-1+coldsnap.12", "COLDSNAP_NCCL_PROVIDER_REVISION": "12",
          "COLDSNAP_NCCL_DLSYM_BRIDGE_ABI": "1"}
IN_PLACE_ENV = {"COLDSNAP_NCCL_IN_PLACE_MODE": "net-reconnect-v1", "NCCL_IB_DISABLE": "1",
                "COLDSNAP_NCCL_IN_PLACE_EXPERIMENT": "1"}


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """The caller's environment without provider expectations (the shim's own location stays)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COLDSNAP_NCCL", "NCCL_")) or k == "COLDSNAP_NCCL_SHIM_LIBRARY"}
    return {**env, **extra}


def inspect(library: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    done = subprocess.run([sys.executable, "-m", "nccl_shim", "inspect", "--library", library, "--json", *args],
                          capture_output=True, text=True, cwd=ROOT, env=clean_env(env or {}), check=False)
    assert done.returncode in (0, 3), done.stderr  # never a crash
    return done.returncode, json.loads(done.stdout)


def lifecycle(library: str, scenario: str, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "tests.shim._lifecycle", library, scenario], capture_output=True,
                          text=True, cwd=ROOT, env=clean_env(env), check=False)
    assert done.returncode == 0, done.stderr
    return {s["step"]: s for s in json.loads(done.stdout)}


def test_layout_compiled_into_the_shim_matches_the_python_mirrors() -> None:
    shim = Shim(None)
    for table, mirror, size in ((0, ProviderV1, 96), (1, InPlaceV1, 56), (2, ResourcesV1, 32)):
        compiled_size, offsets = shim.layout(table)
        assert compiled_size == ctypes.sizeof(mirror) == size
        assert offsets == [getattr(mirror, name).offset for name, _ in mirror._fields_]


def test_231_like_provider_is_admitted_and_reports_its_identity(providers: dict[str, str]) -> None:
    code, report = inspect(providers["v2_31"], env=ID_231)
    assert code == 0 and report["admitted"] is True and report["error"] is None
    ident = report["identity"]
    assert ident["provider_id"] == "nccl-2.31.2-1+coldsnap.12" and ident["struct_size"] == 96
    assert ident["compiled_nccl_version"] == ident["loaded_nccl_version"] == 23102
    assert ident["capability_mask"] == 0x3BFF and len(report["capabilities"]) == 13
    assert ident["slots"] == ["prepare", "restore", "network_reset", "network_init", "ib_status"]
    # Without COLDSNAP_NCCL_IN_PLACE_MODE the in-place query answers 5: present, but refusing.
    assert report["in_place"] == {"status": "query-error", "result": 5, "meaning": "ncclInvalidUsage",
                                  "struct_size": 0, "abi_major": 0, "abi_minor": 0, "slots": []}
    assert report["resources"]["status"] == "absent"


def test_in_place_admission_needs_the_mode_the_transport_and_controller_admission(providers: dict[str, str]) -> None:
    code, report = inspect(providers["v2_31"], "--in-place", env=ID_231)
    assert code == 3 and report["rule"] == "4a.12"
    assert report["error"] == "coldsnapNcclInPlaceQuery failed with ncclResult_t=5 (ncclInvalidUsage)"
    code, report = inspect(providers["v2_31"], "--in-place", env={**ID_231, **IN_PLACE_ENV})
    assert code == 0 and report["in_place"]["status"] == "present" and len(report["in_place"]["slots"]) == 5
    no_admission = {**IN_PLACE_ENV, "COLDSNAP_NCCL_IN_PLACE_EXPERIMENT": "0"}
    code, report = inspect(providers["v2_31"], env={**ID_231, **no_admission})
    assert code == 3 and "requires controller admission" in report["error"]
    code, report = inspect(providers["v2_31"], env={**ID_231, "COLDSNAP_NCCL_IN_PLACE_MODE": "other"})
    assert code == 3 and report["rule"] == "4a.1"


def test_230_like_provider_never_gains_in_place(providers: dict[str, str]) -> None:
    env = {"COLDSNAP_NCCL_PROVIDER_ID": "nccl-2.30.7-1+coldsnap.1", "COLDSNAP_NCCL_PROVIDER_REVISION": "1",
           "COLDSNAP_NCCL_DLSYM_BRIDGE_ABI": "1"}
    code, report = inspect(providers["v2_30"], env=env)
    assert code == 0 and report["in_place"]["status"] == "absent" and report["identity"]["capability_mask"] == 0x1FF
    code, report = inspect(providers["v2_30"], "--in-place", env={**env, **IN_PLACE_ENV})
    assert code == 3 and report["error"] == "NCCL provider lacks coldsnapNcclInPlaceQuery"


@pytest.mark.parametrize(("variant", "args", "env", "rule", "message"), [
    ("truncated", [], ID_231, "4a.3", "NCCL provider ABI is truncated: struct_size 64 < 96"),
    ("abi2", [], ID_231, "4a.4", "NCCL provider ABI major mismatch: 2 != 1"),
    ("loaded_mismatch", [], ID_231, "4a.8", "NCCL provider compiled/loaded version mismatch: 23102 != 23101"),
    ("v2_31", ["--require", "nvls-in-place-replay,cuda-graph,device-api-state-retention"], ID_231, "4a.9",
     "NCCL provider lacks required capabilities: device-api-state-retention, nvls-in-place-replay"),
    ("v2_31", [], {**ID_231, "COLDSNAP_NCCL_PROVIDER_ID": ""}, "4a.6",
     "COLDSNAP_NCCL_PROVIDER_ID is not set: the expected provider is unknown"),
    ("v2_31", [], {**ID_231, "COLDSNAP_NCCL_PROVIDER_ID": "nccl-2.31.2-1+coldsnap.11"}, "4a.6",
     "NCCL provider id 'nccl-2.31.2-1+coldsnap.12' != expected 'nccl-2.31.2-1+coldsnap.11'"),
    ("v2_31", [], {**ID_231, "COLDSNAP_NCCL_PROVIDER_REVISION": "0"}, "4a.7",
     "COLDSNAP_NCCL_PROVIDER_REVISION must be a decimal greater than 0"),
    ("v2_31", [], {**ID_231, "COLDSNAP_NCCL_DLSYM_BRIDGE_ABI": "2"}, "4a.13", "NCCL dlsym bridge ABI mismatch: 1 != 2"),
])
def test_identity_rules_reject_with_the_named_rule(providers: dict[str, str], variant: str, args: list[str],
                                                   env: dict[str, str], rule: str, message: str) -> None:
    code, report = inspect(providers[variant], *args, env=env)
    assert code == 3 and report["admitted"] is False
    assert report["rule"] == rule and report["error"] == message


def test_unknown_capability_names_are_usage_errors(providers: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-m", "nccl_shim", "inspect", "--library", providers["v2_31"],
                           "--require", "cuda-graph,warp-drive"], capture_output=True, text=True, cwd=ROOT,
                          check=False)
    assert done.returncode == 2 and "unknown required NCCL provider capabilities: warp-drive" in done.stderr


def test_a_library_that_cannot_load_is_not_admitted(tmp_path: object) -> None:
    code, report = inspect("/nonexistent/libnccl-provider.so")
    assert code == 3 and "library could not be loaded" in report["error"]


def test_in_place_lifecycle_guards_state_before_touching_the_provider(providers: dict[str, str]) -> None:
    steps = lifecycle(providers["v2_31"], "in-place", {**ID_231, **IN_PLACE_ENV})
    assert steps["resume-first"]["result"]["shim_error"] == -4 and steps["resume-first"]["calls"] == 0
    assert steps["suspend"]["result"] == 0 and steps["suspend"]["state"] == ["suspended", "idle"]
    assert steps["suspend-again"]["result"]["shim_error"] == -4 and steps["suspend-again"]["calls"] == 1
    assert steps["prepare-while-suspended"]["result"]["shim_error"] == -4
    assert steps["detach"]["state"] == ["transport-detached", "idle"]
    assert steps["evidence-detached"]["result"]["state"] == "transport-detached"
    assert steps["evidence-detached"]["result"]["qualified"] is False
    assert steps["resume"]["result"] == 0 and steps["resume"]["calls"] == 4
    assert steps["evidence-active"]["result"]["generation"] == 1
    assert steps["evidence-wrong-state"]["result"]["admission_error"] == "4b"


def test_recreate_lifecycle_guards(providers: dict[str, str]) -> None:
    steps = lifecycle(providers["v2_31"], "recreate", ID_231)
    assert steps["restore-first"]["result"]["shim_error"] == -4 and steps["restore-first"]["calls"] == 0
    assert steps["prepare"]["result"] == 0 and steps["prepare"]["state"] == ["active", "prepared"]
    assert steps["prepare-again"]["result"]["shim_error"] == -4
    assert steps["suspend-while-prepared"]["result"]["shim_error"] == -4
    assert steps["network-reset"]["result"] == 0 and steps["restore"]["result"] == 0
    assert steps["restore-again"]["result"]["shim_error"] == -4  # terminal after the first attempt
    assert steps["restore-again"]["calls"] == 3


def test_evidence_over_64k_and_malformed_evidence_are_refused(providers: dict[str, str]) -> None:
    env = {**ID_231, **IN_PLACE_ENV}
    huge = lifecycle(providers["huge_evidence"], "evidence", env)["evidence"]["result"]
    assert huge["shim_error"] == -8 and "evidence exceeds 65536 bytes" in huge["message"]
    bad = lifecycle(providers["bad_evidence"], "evidence", env)["evidence"]["result"]
    assert bad["admission_error"] == "4b" and "not UTF-8 JSON" in bad["message"]


def test_resources_inventory_admission(providers: dict[str, str]) -> None:
    steps = lifecycle(providers["resources"], "resources", ID_231)
    assert steps["recreate"]["result"]["admitted"] is True and steps["in-place"]["result"]["mode"] == "in-place"
    assert steps["bad-mode"]["result"][0] == 4
    assert steps["mode-mismatch"]["result"]["admission_error"] == "4c"
    _, report = inspect(providers["resources"], env=ID_231)
    assert report["resources"]["status"] == "present" and report["resources"]["slots"] == ["inspect", "evidence_json"]


def test_capabilities_by_name() -> None:
    assert capability_names(0x1FF)[:2] == ["communicator-unwrap", "coordinator-protocol-v1"]
    assert missing_capabilities(0x1FF, ["cuda-graph", "full-network-reset", "graph-resource-retention"]) == [
        "cuda-graph", "graph-resource-retention"]
    with pytest.raises(AdmissionError, match="unknown required NCCL provider capabilities: nope"):
        missing_capabilities(0x1FF, ["nope"])


@pytest.mark.parametrize(("requested", "workers", "admitted", "effective", "decision", "unknown"), [
    ("disabled", 4, True, "disabled", "requested_policy_is_supported", False),
    ("recreate-from-plan", 2, True, "recreate-from-plan", "requested_policy_is_supported", True),
    ("preserve-exec", 1, True, "recreate-from-plan", "graph_exec_preservation_is_unqualified", True),
    ("preserve-exec", 2, True, "recreate-from-plan", "provider_reconstructs_communicator", True),
    ("preserve-nccl-exec", 1, True, "recreate-from-plan", "graph_exec_preservation_is_unqualified", True),
    ("preserve-nccl-exec", 2, True, "preserve-nccl-exec", "qualified_exact_nccl_in_place", False),
    ("preserve-nccl-exec", 2, False, "recreate-from-plan", "graph_exec_preservation_is_unqualified", True),
])
def test_graph_policy_table(requested: str, workers: int, admitted: bool, effective: str, decision: str,
                            unknown: bool) -> None:
    result = decide_graph_policy(requested, workers, in_place_admitted=admitted,
                                 in_place_reason="NCCL provider lacks coldsnapNcclInPlaceQuery")
    assert (result.policy_effective, result.decision) == (effective, decision)
    assert result.resource_audit.unknown_dependencies is unknown
    if requested == "preserve-nccl-exec" and workers == 2 and not admitted:
        assert "lacks coldsnapNcclInPlaceQuery" in result.reason
    with pytest.raises(ValueError, match="graph policy must be one of"):
        decide_graph_policy("preserve-everything", 2, in_place_admitted=True)
