"""Issue 39 item 3: the constants the interposer (C) and its Python clients share, read from the C header
(`hydration/interposer/constants.h`, compiled and printed by gcc) and checked against the Python values; and
the driver-ABI layouts the header asserts (`_Static_assert`s) hold where the library is built.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from coldsnap_probe.hydration._digests import CRC_PREFIX, DIGEST_CHUNK, DIGEST_PREFIX
from coldsnap_probe.hydration._interposer import (
    _SEGMENT_FILE,
    DUMP_KIND,
    ENV_DIGEST,
    ENV_SOCKET,
    GCC_FLAGS,
    POLICIES,
    SOURCES,
)
from coldsnap_probe.hydration._peer_files import STAGE_ALLOCATIONS
from coldsnap_probe.memory._device_dump import INTERPOSER_PAGE, STAGE_GROUP
from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

PRINTER = r"""
#include <stddef.h>
#include <stdio.h>
#include "cscu.h"
#include "dump.h"
#include "request.h"

int main(void)
{
    char first[32], other[32];
    snprintf(first, sizeof(first), CSCU_SEGMENT_FILE, (size_t)0);
    snprintf(other, sizeof(other), CSCU_SEGMENT_FILE, (size_t)4095);
    printf("{\"dump_kind\":\"%s\",\"segment_files\":[\"%s\",\"%s\"],\"segment\":%zu,\"digest_prefix\":\"%s\","
           "\"digest_chunk\":%zu,\"digest_text\":%zu,\"env_socket\":\"%s\",\"policies\":[\"%s\",\"%s\"],"
           "\"verify\":[\"%s\",\"%s\"],\"page_fds\":%d,\"staged_max\":%d,\"request_line\":%d,"
           "\"request_field\":%d,\"crc_prefix\":\"%s\",\"env_digest\":\"%s\",\"segment_chunks\":%zu,"
           "\"stage_group\":%zu}\n",
           CSCU_DUMP_KIND, first, other, CSCU_SEGMENT, CSCU_DIGEST_PREFIX, CSCU_DIGEST_CHUNK, CSCU_DIGEST_TEXT,
           CSCU_ENV_SOCKET, CSCU_POLICY_SAME_MODEL, CSCU_POLICY_SAME_GPU, CSCU_VERIFY_DIGEST, CSCU_VERIFY_SAMPLED,
           CSCU_PAGE_FDS, CSCU_STAGED_MAX, CSCU_REQUEST_LINE, CSCU_REQUEST_FIELD, CSCU_CRC_PREFIX, CSCU_ENV_DIGEST,
           CSCU_SEGMENT_CHUNKS, CSCU_STAGE_GROUP);
    return 0;
}
"""


@pytest.fixture(scope="module")
def header(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("constants")
    (folder / "print.c").write_text(PRINTER)
    subprocess.run(["gcc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-I", str(SOURCES), "-o",
                    str(folder / "print"), str(folder / "print.c")], check=True, capture_output=True, text=True)
    printed = subprocess.run([str(folder / "print")], check=True, capture_output=True, text=True).stdout
    return json.loads(printed)  # type: ignore[no-any-return]


def test_the_dump_format_is_the_one_python_reads(header: dict[str, Any]) -> None:
    assert header["dump_kind"] == DUMP_KIND
    assert all(_SEGMENT_FILE.fullmatch(name) for name in header["segment_files"]), header["segment_files"]
    assert header["segment"] % DIGEST_CHUNK == 0


def test_the_digest_format_is_one(header: dict[str, Any]) -> None:
    assert (header["digest_prefix"], header["digest_chunk"]) == (DIGEST_PREFIX, DIGEST_CHUNK)
    assert header["crc_prefix"] == CRC_PREFIX and header["env_digest"] == ENV_DIGEST
    assert header["segment_chunks"] == header["segment"] // DIGEST_CHUNK
    # The longer of the two texts of a full segment, NUL included: crc32-64m's 8 hex digits a chunk.
    assert header["digest_text"] == max(len(DIGEST_PREFIX) + 64, len(CRC_PREFIX) + 8 * header["segment_chunks"]) + 1


def test_the_control_socket_speaks_what_the_worker_sends(header: dict[str, Any]) -> None:
    assert header["env_socket"] == ENV_SOCKET
    assert tuple(header["policies"]) == POLICIES  # the default first
    assert header["verify"] == ["digest", "sampled"]  # _interposer.verification()'s answers
    assert header["page_fds"] == INTERPOSER_PAGE
    assert header["staged_max"] == STAGE_ALLOCATIONS
    assert header["stage_group"] == STAGE_GROUP  # how a stage copied from is laid out, both sides


def test_no_constant_is_left_in_the_sources_it_names(header: dict[str, Any]) -> None:
    """The values live in the header alone: no C file's code spells the shared strings out again."""
    for path in sorted(Path(SOURCES).glob("*.[ch]")):
        if path.name == "constants.h":
            continue
        text = re.sub(r"/\*.*?\*/|//[^\n]*", "", path.read_text(), flags=re.S)  # comments may name them
        for value in (header["dump_kind"], '"seg-', f'"{header["digest_prefix"]}', f'"{header["env_socket"]}"',
                      '"same-model"', '"same-gpu"', f'"{header["crc_prefix"]}', f'"{header["env_digest"]}"'):
            assert value not in text, f"{path.name} spells out {value} (use constants.h)"


def test_the_interposer_is_built_as_strictly_as_nccl_shim() -> None:
    """The interposer (built on the node, `_interposer.build_library`) gets every warning flag the shim's build
    (setup.py) gives it, -Werror included; only the dialect differs (gnu11: dlvsym, __typeof__)."""
    setup = ast.parse((ROOT / "setup.py").read_text())
    shim = next(ast.literal_eval(k.value) for node in ast.walk(setup) if isinstance(node, ast.Call)
                for k in node.keywords if k.arg == "extra_compile_args")
    assert "-Werror" in shim and {f for f in shim if not f.startswith("-std=")} <= set(GCC_FLAGS)
