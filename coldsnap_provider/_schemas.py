"""JSON Schemas generated from the msgspec Structs (never hand-edited).

``python -m coldsnap_provider._schemas [DIR]`` writes them; a test fails when the
committed files in ``schemas/`` drift from the Structs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from coldsnap_runtime.schema import RuntimeRequest, RuntimeResponse

from ._control import ControlReply, ControlRequest
from ._envelope import Reply, Request

__all__ = ("generate", "write")

_SCHEMAS: dict[str, Any] = {
    "envelope-request.schema.json": Request,
    "envelope-reply.schema.json": Reply,
    "runtime-request.schema.json": RuntimeRequest,
    "runtime-response.schema.json": RuntimeResponse,
    "control-request.schema.json": ControlRequest,
    "control-reply.schema.json": ControlReply,
}


def generate() -> dict[str, str]:
    """File name -> schema text (stable: sorted keys, trailing newline)."""
    out: dict[str, str] = {}
    for name, type_ in _SCHEMAS.items():
        schema = msgspec.json.schema(type_)
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["title"] = name.removesuffix(".schema.json")
        out[name] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return out


def write(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in generate().items():
        (directory / name).write_text(text)


if __name__ == "__main__":
    write(Path(sys.argv[1] if len(sys.argv) > 1 else "schemas"))
