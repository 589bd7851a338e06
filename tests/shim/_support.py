"""Shared by the shim tests: provider expectations and the subprocess runners (a crash is caught there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

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
