"""`python -m nccl_shim inspect` (`__main__.py`): identity, in-place status and the admission verdict."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.shim._support import ID_231, IN_PLACE_ENV, inspect


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
