"""Build contexts for the classic builder, with BuildKit-style named contexts.

Docker's classic builder (the one every Engine API answers on ``POST /build``) has no
``--build-context``. We make each named context available inside the one context tar,
under ``.coldsnap-contexts/<name>/``, and rewrite the Dockerfile so that

* ``COPY --from=<name> src... dest`` copies ``.coldsnap-contexts/<name>/src...``, and
* ``FROM <name> [AS stage]`` becomes ``FROM scratch [AS stage]`` followed by
  ``COPY .coldsnap-contexts/<name>/ /`` (BuildKit's meaning of a directory used as a base).

Only names given as contexts are touched; stage names and images pass through. The
Dockerfile itself travels as ``.coldsnap-build/Dockerfile``. Like the Docker CLI, files
enter the tar owned by 0:0, symbolic links are archived as links (never followed) and the
main context's ``.dockerignore`` is honoured.

The context directories are host paths a manager named, so the daemon never reads them
itself: :func:`write_context_tar` runs ``_archive.py --pack`` in a child process that takes
the session's ``exec.user`` identity (``RuntimeContext.owner``) before it opens anything.
A manager can only build into an image what that identity could read anyway.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import IO

import anyio

from ..dockerfile import instructions
from ..errors import BuildContextError
from ._base import Owner

__all__ = ("DOCKERFILE_PATH", "base_images", "context_job", "rewrite_dockerfile", "write_context_tar")

CONTEXTS_DIR = ".coldsnap-contexts"
DOCKERFILE_PATH = ".coldsnap-build/Dockerfile"
_RESERVED = (CONTEXTS_DIR, DOCKERFILE_PATH.split("/")[0])
_INSTRUCTION = re.compile(r"(\s*)(\w+)(\s+)(.*)", re.DOTALL)  # fullmatch


def _logical_lines(text: str) -> list[str]:
    """Join backslash continuations as the builder does: lines end at "\\n" only (not at the other line
    breaks str.splitlines knows, which would let the policy read other lines than the engine), pieces join
    with nothing between, comments inside continuations are dropped."""
    out: list[str] = []
    pending = ""
    for raw in (line.removesuffix("\r") for line in text.removesuffix("\n").split("\n")):
        if pending and raw.lstrip().startswith("#"):
            continue
        stripped = raw.rstrip()
        if stripped.endswith("\\") and not raw.lstrip().startswith("#"):
            pending += stripped[:-1]
            continue
        out.append(pending + raw)
        pending = ""
    if pending:
        out.append(pending)
    return out


def _context_src(name: str, src: str) -> str:
    src = src.lstrip("/")
    return f"{CONTEXTS_DIR}/{name}/{src}" if src else f"{CONTEXTS_DIR}/{name}/"


def rewrite_dockerfile(text: str, contexts: dict[str, str]) -> str:
    if not contexts:
        return text
    result: list[str] = []
    for line in _logical_lines(text):
        m = _INSTRUCTION.fullmatch(line)
        if not m or line.lstrip().startswith("#"):
            result.append(line)
            continue
        indent, word, space, rest = m.groups()
        keyword = word.upper()
        if keyword == "FROM":
            result.extend(_rewrite_from(indent, rest, contexts) or [line])
        elif keyword == "COPY":
            result.append(_rewrite_copy(indent, word, space, rest, contexts) or line)
        elif keyword == "RUN" and re.search(r"--mount=[^\s]*from=", rest):
            raise BuildContextError("RUN --mount=from=... needs BuildKit; the classic builder cannot honour it")
        else:
            result.append(line)
    return "\n".join(result) + "\n"


def _rewrite_from(indent: str, rest: str, contexts: dict[str, str]) -> list[str] | None:
    tokens = rest.split()
    flags = [t for t in tokens if t.startswith("--")]
    args = [t for t in tokens if not t.startswith("--")]
    if not args or args[0] not in contexts:
        return None
    name = args[0]
    alias = f" AS {args[2]}" if len(args) >= 3 and args[1].upper() == "AS" else ""
    flag_text = (" ".join(flags) + " ") if flags else ""
    return [f"{indent}FROM {flag_text}scratch{alias}", f"{indent}COPY {_context_src(name, '')} /"]


def _rewrite_copy(indent: str, word: str, space: str, rest: str, contexts: dict[str, str]) -> str | None:
    tokens = rest.strip().split(" ")
    flags: list[str] = []
    while tokens and tokens[0].startswith("--"):
        flags.append(tokens.pop(0))
    source = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
    if source is None or source not in contexts:
        return None
    kept = [f for f in flags if not f.startswith("--from=")]
    body = " ".join(t for t in tokens if t)
    if body.startswith("["):
        try:
            items = json.loads(body)
        except ValueError as exc:
            raise BuildContextError(f"COPY --from={source}: malformed JSON form: {exc}") from exc
        items = [_context_src(source, s) for s in items[:-1]] + items[-1:]
        new_body = json.dumps(items)
    else:
        parts = body.split()
        if len(parts) < 2:
            raise BuildContextError(f"COPY --from={source} needs a source and a destination")
        new_body = " ".join([_context_src(source, s) for s in parts[:-1]] + parts[-1:])
    return f"{indent}{word}{space}{' '.join([*kept, new_body])}"


_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def base_images(text: str, arguments: dict[str, str]) -> list[str]:
    """Images the (rewritten) Dockerfile builds FROM: not stages, not scratch; ARGs substituted.

    The classic builder pulls a missing base even with pull=0, so the caller checks each
    of these is resident before a build that must not contact a registry.
    """
    args: dict[str, str] = {}
    stages: set[str] = set()
    bases: list[str] = []
    seen_from = False
    for line in instructions(text):  # under either escape: a base one reading hides is still checked
        m = _INSTRUCTION.fullmatch(line)
        if not m or line.lstrip().startswith("#"):
            continue
        keyword, rest = m.group(2).upper(), m.group(4).split()
        if keyword == "ARG" and not seen_from and rest:
            name, _, default = rest[0].partition("=")
            args[name] = arguments.get(name, default)
        elif keyword == "FROM":
            seen_from = True
            words = [t for t in rest if not t.startswith("--")]
            if not words:
                continue
            image = _VARIABLE.sub(lambda v: args.get(v.group(1) or v.group(2), ""), words[0])
            if image.lower() != "scratch" and image not in stages and image not in bases:
                bases.append(image)
            if len(words) >= 3 and words[1].upper() == "AS":
                stages.add(words[2])
    return bases


# The program that reads the context directories as the owner (run by path; see its docstring).
_PACK_PROGRAM = str(Path(__file__).with_name("_archive.py"))


def context_job(*, context: str, contexts: dict[str, str], dockerfile: bytes, max_bytes: int | None = None) -> bytes:
    """The pack job (``_archive.py --pack``) for a build: main context, named contexts, Dockerfile."""
    for name in contexts:
        if "/" in name or name in (".", ".."):
            raise BuildContextError(f"named context {name!r} must be a plain name")
    text = rewrite_dockerfile(dockerfile.decode("utf-8"), contexts)
    trees = [{"path": context, "prefix": "", "label": "context", "dockerignore": True, "reserved": list(_RESERVED)}]
    trees += [{"path": path, "prefix": f"{CONTEXTS_DIR}/{name}/", "label": f"contexts[{name!r}]",
               "dockerignore": False, "reserved": []} for name, path in sorted(contexts.items())]
    job: dict[str, object] = {"trees": trees, "files": [{"name": DOCKERFILE_PATH, "data": text}]}
    if max_bytes is not None:
        job["max_bytes"] = max_bytes
    return json.dumps(job).encode()


async def write_context_tar(out: IO[bytes], *, context: str, contexts: dict[str, str], dockerfile: bytes,
                            owner: Owner | None, max_bytes: int | None = None) -> None:
    """Write the whole build context (main, named contexts, Dockerfile) as one tar to the file `out`.

    `out` must be a real file (the child writes to its descriptor), e.g. a spool file.

    The directories are read by a child that is `owner` (None: the daemon's own identity)
    before it opens any of them; what it cannot read fails the build, naming the path.
    """
    try:
        job = context_job(context=context, contexts=contexts, dockerfile=dockerfile, max_bytes=max_bytes)
    except UnicodeDecodeError as exc:
        raise BuildContextError(f"the Dockerfile is not UTF-8: {exc}") from exc
    argv = [sys.executable, "-I", "-S", _PACK_PROGRAM, "--pack"]
    if owner is not None:
        argv += ["--as", f"{owner.uid}:{owner.gid}"]
    try:
        result = await anyio.run_process(argv, input=job, stdout=out, check=False, cwd="/",
                                         env={"PATH": os.defpath, "LC_ALL": "C.UTF-8"})
    except OSError as exc:
        raise BuildContextError(f"cannot start the context packer: {exc}") from exc
    if result.returncode != 0:
        lines = result.stderr.decode("utf-8", "replace").strip().splitlines()
        raise BuildContextError(lines[-1] if lines else f"the context packer exited {result.returncode}")
