"""The control socket's capture verbs: list, inspect, remove and collect the node's capture store.

The store and its rules are ``coldsnap_runtime``'s (``DockerBackend.captures``); this module applies who may
do what: a manager reaches the captures of the images its sessions recorded (the image ledger's owner, the
image-ownership rule of ``backend/_base.py``), and another manager's capture is answered as absent; root and
the daemon's uid reach every capture, and only they collect (a collection touches every manager's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from coldsnap_runtime.errors import RequestRejected

from ._control import CaptureCollect, CaptureInspect, CaptureList, CaptureRemove, CaptureVerb
from ._listener import is_admin

if TYPE_CHECKING:
    from coldsnap_runtime.backend import Captures

__all__ = ("capture_verb",)


async def capture_verb(captures: Captures | None, request: CaptureVerb, uid: int) -> Any:
    """Answer one capture verb for the peer `uid`."""
    operation = str(request.__struct_config__.tag)
    if captures is None:
        raise RequestRejected(f"{operation}: this daemon's engine has no capture store")
    who = None if is_admin(uid) else uid
    match request:
        case CaptureList():
            return [msgspec.to_builtins(info) for info in await captures.describe(uid=who)]
        case CaptureInspect(capture=capture):
            return msgspec.to_builtins((await captures.describe(capture, uid=who))[0])
        case CaptureRemove(capture=capture):
            await captures.remove(capture, uid=who)
            return {"capture": capture, "removed": True}
        case CaptureCollect(max_bytes=max_bytes, older_than_s=older_than_s):
            if who is not None:
                raise RequestRejected(f"capture-gc: uid {uid} may not collect the node's capture store (root and "
                                      "the daemon's account may; `capture rm` removes your own)")
            if max_bytes is None and older_than_s is None:
                raise RequestRejected("capture-gc: give max_bytes, older_than_s or both (the rule to collect by)")
            return msgspec.to_builtins(await captures.collect(max_bytes=max_bytes, older_than_s=older_than_s))
    raise TypeError(f"unhandled capture verb {request!r}")  # pragma: no cover
