"""image-build of a capsule that carries a capture: its large files go to the node's capture store.

A build context carries a capture when a directory in it holds the worker's ``capture.json``; every
regular file of at least :data:`STORE_MIN_BYTES` under such a directory is *stored*: its bytes go into the
node's store as chunks (zeros skipped, present chunks not written again; CRIU's page images cut by content,
:data:`CUT_BY_CONTENT`, up to ``chunking.CUT_MAX_BYTES`` of them in all, every file's chunks counted against it; every
other file in 64 MiB pieces from its start) and the image gets a small
stub in its place. Two labels say where the bytes are: :data:`CAPTURE_LABEL` names the capture (the digest
of its registry artifact, ``store.artifact_manifest``) and :data:`FILES_LABEL` maps each path the stubs take
in the image to the capture's file (base64url JSON: a label value the Dockerfile can neither expand nor
unquote). ``workload-run`` mounts the store's files over the stubs, read-only, so the workload sees the
files it would have seen; ``image-push``/``image-pull`` move the capture beside the image.

Where each file lands comes from the build's own Dockerfile (the classic builder's ``COPY`` rules,
``WORKDIR`` included). Anything this reading cannot place with certainty (a multi-stage build, ``ADD``, a
``COPY`` with flags, wildcards or variables over the capture, a ``RUN`` after the capture is copied) keeps
every byte in the image instead, exactly as before: the store is an optimisation, never a different image.
The context tar is the one ``_archive.py`` packed as the session's owner: the daemon reads nothing else.
"""

from __future__ import annotations

import base64
import fnmatch
import io
import json
import posixpath
import re
import tarfile
from typing import IO

from ..chunking import CHUNK_BYTES, CUT_MAX_BYTES, MIN_BYTES
from ..dockerfile import instructions
from ..store import CaptureData, CaptureStore, StoredFile, artifact_manifest
from ._buildctx import DOCKERFILE_PATH

__all__ = ("CAPTURE_LABEL", "FILES_LABEL", "STORE_MIN_BYTES", "STUB_HEAD", "destinations", "image_files",
           "store_context", "stub")

CAPTURE_LABEL = "io.coldsnap-provider.capture"
FILES_LABEL = "io.coldsnap-provider.capture-files"
CAPTURE_MARKER = "capture.json"  # the worker's report in every images directory (coldsnap_probe/_capture.py)
STORE_MIN_BYTES = 1 << 20  # smaller files stay in the image: a mount each would cost more than they do
# Every stub starts so; the rest names its capture and file (:func:`stub`).
STUB_HEAD = b"coldsnap-provider: this file's bytes are in the node's capture store (image label " + \
    CAPTURE_LABEL.encode() + b")\n"
# CRIU's page images (pages-<n>.img): their pages shift between two captures of the same model, so they are cut by
# content (coldsnap_runtime/chunking.py); a device dump's segment files start at their region's start, so the same
# weights are the same 64 MiB chunks (and the chunks of the dumps' own sha256-64m digests).
CUT_BY_CONTENT = re.compile(r"pages-\d+\.img")
_INSTRUCTION = re.compile(r"\s*(\w+)\s+(.*)", re.DOTALL)
_WILDCARD = re.compile(r"[*?\[]")


def _copy_arguments(rest: str) -> tuple[list[str], list[str]] | None:
    """(flags, paths) of a COPY/ADD; None when its JSON form does not parse."""
    words = rest.strip().split()
    flags = []
    while words and words[0].startswith("--"):
        flags.append(words.pop(0))
    body = " ".join(words)
    if body.startswith("["):
        try:
            items = json.loads(body)
        except ValueError:
            return None
        return flags, [str(item) for item in items]
    return flags, words


def _placed(source: str, stored: str, many: bool, destination: str) -> str | None:
    """Where COPY `source` ... `destination` puts the context file `stored` (None: it does not)."""
    source = posixpath.normpath("/" + source).lstrip("/")
    if source == stored:
        return posixpath.join(destination, posixpath.basename(stored)) if many or destination.endswith("/") \
            else destination
    if source in ("", ".") or stored.startswith(source + "/"):
        return posixpath.join(destination, stored[len(source) + 1:] if source else stored)
    return None


def destinations(dockerfile: str, stored: set[str]) -> dict[str, str] | None:
    """Image path -> context path of each `stored` file the Dockerfile copies into the image; None when the
    Dockerfile does something with them this reading cannot follow (the caller then keeps the bytes)."""
    found: dict[str, str] = {}
    workdir, stages = "/", 0
    for line in instructions(dockerfile):
        match = _INSTRUCTION.fullmatch(line)
        if match is None or line.lstrip().startswith("#"):
            continue
        keyword, rest = match.group(1).upper(), match.group(2)
        if keyword == "FROM":
            stages, workdir = stages + 1, "/"
            if found:
                return None  # a later stage: the copies so far are in an intermediate image
        elif keyword == "WORKDIR":
            workdir = posixpath.join(workdir, rest.strip())
            if "$" in rest:
                return None
        elif keyword == "RUN" and found:
            return None  # it could read or change the files while they are stubs
        elif keyword in ("COPY", "ADD"):
            parsed = _copy_arguments(rest)
            if parsed is None:
                return None
            flags, paths = parsed
            if any(flag.startswith("--from") for flag in flags) or len(paths) < 2:
                continue
            sources, destination = paths[:-1], posixpath.join(workdir, paths[-1])
            for source in sources:
                for path in stored:
                    if _WILDCARD.search(source) or "$" in source + destination:
                        if _WILDCARD.search(source) and not any(
                                fnmatch.fnmatch(part, source.lstrip("./")) for part in _ancestors(path)):
                            continue
                        return None
                    target = _placed(source, path, len(sources) > 1, destination)
                    if target is None:
                        continue
                    if keyword == "ADD" or flags:
                        return None
                    found[posixpath.normpath(target)] = path
    return found


def _ancestors(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]


def image_files(labels: dict[str, str]) -> tuple[str, dict[str, str]] | None:
    """(capture, image path -> capture file) from an image's labels; None for an image without a capture."""
    capture = labels.get(CAPTURE_LABEL)
    if not capture:
        return None
    try:
        files = json.loads(base64.urlsafe_b64decode(labels.get(FILES_LABEL, "").encode()))
    except ValueError:
        files = None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise ValueError(f"image label {FILES_LABEL} is not a map of paths")
    return capture, files


def stub(capture: str, path: str) -> bytes:
    """The stub that stands for file `path` of `capture` in an image: each names its own file, so a derived image
    that moves one stub over another's path is seen at run time (review 2026-12-02, finding 9)."""
    return STUB_HEAD + f"capture {capture}\nfile {path}\n".encode()


def _candidates(members: list[tarfile.TarInfo]) -> set[str]:
    roots = {posixpath.dirname(m.name) for m in members if m.isfile() and posixpath.basename(m.name) == CAPTURE_MARKER}
    return {m.name for m in members if m.isfile() and not m.issparse() and m.size >= STORE_MIN_BYTES
            and any(root == "" or m.name.startswith(root + "/") for root in roots)}


def store_context(source: IO[bytes], out: IO[bytes], store: CaptureStore) -> str | None:
    """Copy the context tar `source` to `out` with its stored files as stubs, their bytes put in `store` and
    the capture recorded; the capture's id, or None (nothing written) when the context carries no capture
    the Dockerfile places with certainty. Blocking: run it in a worker thread."""
    with tarfile.open(fileobj=source, mode="r:") as tar:
        members = [_normalised(m) for m in tar.getmembers()]
        by_name = {m.name: m for m in members}
        wanted = _candidates(members)
        dockerfile = by_name.get(DOCKERFILE_PATH)
        if not wanted or dockerfile is None:
            return None
        reader = tar.extractfile(dockerfile)
        assert reader is not None
        text = reader.read().decode("utf-8", "replace")
        placed = destinations(text, wanted)
        if not placed:
            return None
        stored_names = set(placed.values())
        # The files' bytes first: the capture's id (each stub names it) is known once all are in the store. Held
        # until it is recorded: a collection meanwhile never deletes a chunk this build stored or found present.
        files: list[StoredFile] = []
        cut_left = CUT_MAX_BYTES  # the capture's page images cut by content in all: its manifest's bound
        with store.holding() as hold:
            for member in members:
                if member.name in stored_names:
                    # Read from the spool where the member's bytes lie: tarfile's reader copies each read twice.
                    source.seek(member.offset_data)
                    # In MIN_BYTES chunk-equivalents, every file's chunks: a file cut by content lists at most one
                    # per MIN_BYTES and one shorter, another one per CHUNK_BYTES (review 14: many small page images,
                    # or large dumps beside them, went past the manifest's 4 MiB).
                    by_content = CUT_BY_CONTENT.fullmatch(posixpath.basename(member.name)) is not None and \
                        member.size + MIN_BYTES <= cut_left
                    cut_left -= member.size + MIN_BYTES if by_content else -(-member.size // CHUNK_BYTES) * MIN_BYTES
                    files.append(store.ingest(member.name, member.size, member.mode, source, by_content=by_content,
                                              hold=hold))
            document = CaptureData(files=sorted(files, key=lambda f: f.path),
                                   format=2 if any(f.lengths is not None for f in files) else 1)
            data_bytes = json.dumps(_plain(document), sort_keys=True, separators=(",", ":")).encode()
            capture = store.record(artifact_manifest(data_bytes, document.files), data_bytes)
        with tarfile.open(fileobj=out, mode="w:", format=tarfile.PAX_FORMAT) as filtered:
            for member in members:
                if member.name in stored_names:
                    content = stub(capture, member.name)
                    member.size = len(content)
                    filtered.addfile(member, io.BytesIO(content))
                elif member is not dockerfile:
                    filtered.addfile(member, tar.extractfile(member) if member.isfile() else None)
            label = base64.urlsafe_b64encode(json.dumps(placed, sort_keys=True).encode()).decode()
            text = text.rstrip("\n") + f"\nLABEL {CAPTURE_LABEL}={capture} {FILES_LABEL}={label}\n"
            encoded = text.encode()
            dockerfile.size = len(encoded)
            filtered.addfile(dockerfile, io.BytesIO(encoded))
    return capture


def _plain(document: CaptureData) -> dict[str, object]:
    """The data document as JSON wants it; `lengths` only where a file has them (a format-1 document stays as a daemon
    before format 2 wrote it, and so does its capture's id)."""
    return {"format": document.format,
            "files": [{"path": f.path, "size": f.size, "mode": f.mode, "chunks": f.chunks}
                      | ({"lengths": f.lengths} if f.lengths is not None else {}) for f in document.files]}


def _normalised(member: tarfile.TarInfo) -> tarfile.TarInfo:
    member.name = posixpath.normpath(member.name).lstrip("/") if member.name not in ("", ".") else member.name
    return member
