"""Conformance provider libraries, built once per session with the system compiler."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT

VARIANTS = {
    "v2_31": [],
    "v2_30": ["-DNO_IN_PLACE"],
    "truncated": ["-DTRUNCATED"],
    "abi2": ["-DABI_MAJOR=2u"],
    "loaded_mismatch": ["-DLOADED_VERSION=23101"],
    "resources": ["-DWITH_RESOURCES"],
}


@pytest.fixture(scope="session")
def providers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("providers")
    built = {}
    for name, flags in VARIANTS.items():
        path = out / f"lib{name}.so"
        subprocess.run(["gcc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared",
                        f"-I{ROOT / 'nccl_shim' / 'include'}", *flags, str(Path(__file__).with_name(
                            "conformance_provider.c")), "-o", str(path), "-ldl"], check=True)
        built[name] = str(path)
    return built
