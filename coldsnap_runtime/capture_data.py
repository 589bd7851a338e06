"""A capture's data document and artifact manifest: the format the node's store records and a registry carries.

A capture is an OCI artifact: a manifest whose config is the capture's *data document* (its files, each a list of
chunks: a digest, or None for zeros; a file cut by content lists each chunk's length, format 2) and whose layers are
its distinct non-zero chunks. What a registry or an image's context brings is checked here before the store or a
pull acts on it (:func:`decode_data`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

import msgspec

from .chunking import CHUNK_BYTES
from .errors import StoreError

__all__ = ("CAPTURE_MEDIA_TYPE", "CHUNK_MEDIA_TYPE", "DATA_MEDIA_TYPE", "HEX", "OCI_MANIFEST", "CaptureData",
           "StoredFile", "artifact_manifest", "decode_data", "digest_name", "manifest_blobs")

CAPTURE_MEDIA_TYPE = "application/vnd.coldsnap-provider.capture.v1"
DATA_MEDIA_TYPE = "application/vnd.coldsnap-provider.capture.data.v1+json"
CHUNK_MEDIA_TYPE = "application/vnd.coldsnap-provider.chunk.v1"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
HEX = frozenset("0123456789abcdef")


class StoredFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One file of a capture: its path inside the capture, size, mode, its chunks (None: zeros) and, for a file
    cut by content, each chunk's length (None: 64 MiB each, the last one the rest)."""

    path: str
    size: int
    mode: int
    chunks: list[str | None]
    lengths: list[int] | None = None

    def spans(self) -> list[tuple[str | None, int, int]]:
        """Each chunk with its offset in the file and its length."""
        lengths = self.lengths if self.lengths is not None else \
            [min(CHUNK_BYTES, self.size - i * CHUNK_BYTES) for i in range(len(self.chunks))]
        spans, offset = [], 0
        for chunk, length in zip(self.chunks, lengths, strict=True):
            spans.append((chunk, offset, length))
            offset += length
        return spans


class CaptureData(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A capture's data document: the files the store holds for it (the artifact's config blob)."""

    files: list[StoredFile]
    format: int = 1


def digest_name(digest: str) -> str:
    """The hex of a sha256 digest (a blob's or a capture's name in the store); anything else is refused, naming it."""
    algorithm, _, hexa = digest.partition(":")
    if algorithm != "sha256" or len(hexa) != 64 or not set(hexa) <= HEX:
        raise StoreError(f"{digest!r} is not a sha256 digest")
    return hexa


def artifact_manifest(data: bytes, files: Iterable[StoredFile]) -> bytes:
    """The OCI manifest (artifact) of a capture whose data document is `data`: its distinct chunks as layers.
    Deterministic, so the image's label can name its digest before anything is pushed."""
    sizes: dict[str, int] = {}
    for stored in files:
        for chunk, _, length in stored.spans():
            if chunk is not None:
                sizes[chunk] = length
    document = {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": CAPTURE_MEDIA_TYPE,
        "config": {"mediaType": DATA_MEDIA_TYPE, "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
                   "size": len(data)},
        "layers": [{"mediaType": CHUNK_MEDIA_TYPE, "digest": d, "size": s} for d, s in sorted(sizes.items())],
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def _one_length_each(document: CaptureData) -> None:
    """Refuse a document that gives one chunk two lengths: one digest is one run of bytes, and the pull would fetch it
    twice, each checked against another size, its tree fail as if the node's blob were corrupt."""
    seen: dict[str, int] = {}
    for stored in document.files:
        for chunk, _, length in stored.spans():
            if chunk is not None and seen.setdefault(chunk, length) != length:
                raise StoreError(f"capture data document: {stored.path}: chunk {chunk} is {length} bytes long here, "
                                 f"{seen[chunk]} elsewhere; one chunk has one length")


def decode_data(data: bytes) -> CaptureData:
    """The data document `data`, checked: what a registry or a manager's image may hold is refused here, naming the
    field and the rule."""
    try:
        decoded = msgspec.json.decode(data, type=CaptureData)
    except msgspec.ValidationError as exc:
        raise StoreError(f"capture data document: {exc}") from exc
    if decoded.format not in (1, 2):
        raise StoreError(f"capture data document: format {decoded.format} is not one this daemon reads (1 or 2)")
    for stored in decoded.files:
        # One file, one name: "./a", "a/" and "a//b" are the files "a" and "a/b" on disk, and two names of one
        # file let a pull write two chunks at one place, listing a home that holds another chunk's bytes (review17).
        parts = stored.path.split("/")
        if stored.path.startswith("/") or any(part in ("", ".", "..") for part in parts) or "\0" in stored.path:
            raise StoreError(f"capture data document: file path {stored.path!r} must be relative, without .. "
                             "or a NUL byte, and name its file one way (no empty or . part)")
        if stored.lengths is not None:
            if decoded.format < 2 or len(stored.lengths) != len(stored.chunks) or sum(stored.lengths) != \
                    stored.size or not all(0 < n <= CHUNK_BYTES for n in stored.lengths):
                raise StoreError(f"capture data document: {stored.path}: lengths must be given in format 2, one "
                                 f"per chunk, each 1 to {CHUNK_BYTES}, summing to its size {stored.size}")
        elif stored.size < 0 or len(stored.chunks) != -(-stored.size // CHUNK_BYTES):
            raise StoreError(f"capture data document: {stored.path}: {len(stored.chunks)} chunks for "
                             f"{stored.size} bytes")
        for chunk in stored.chunks:
            if chunk is not None:
                digest_name(chunk)
    _one_length_each(decoded)
    return decoded


def manifest_blobs(manifest: bytes, data: bytes) -> list[tuple[str, int]]:
    """The blobs (digest, size) a capture's manifest names, its data document `data` first, checked against that
    document: a registry's manifest may name any blob of any size, and a push sends each from the node's store (where
    another manager's capture may hold it) to the registry the pushing manager names (review17). A layer the document
    does not name as a chunk of that length is refused, naming it; a manifest may name fewer (a registry lacking
    some, which the pull then fails naming the blob)."""
    try:
        document = json.loads(manifest)
        config = (str(document["config"]["digest"]), int(document["config"]["size"]))
        layers = [(str(layer["digest"]), int(layer["size"])) for layer in document["layers"]]
    except (ValueError, TypeError, KeyError, ArithmeticError, RecursionError) as exc:
        raise StoreError(f"capture manifest: not a capture's ({exc!r})") from exc
    if config != ("sha256:" + hashlib.sha256(data).hexdigest(), len(data)):
        raise StoreError(f"capture manifest: its config {config[0]} ({config[1]} bytes) is not its data document")
    lengths = {chunk: length for stored in decode_data(data).files for chunk, _, length in stored.spans()
               if chunk is not None}
    for digest, size in layers:
        if lengths.get(digest) != size:
            raise StoreError(f"capture manifest: layer {digest} ({size} bytes) is not a chunk of its data document"
                             + (f" ({lengths[digest]} bytes there)" if digest in lengths else ""))
    return [config, *layers]
