"""A real HTTP peer on 127.0.0.1 that misbehaves as a registry might: it accepts one connection in a thread, runs
the test's `serve` body on it, and refuses every later connection at once (a client's best-effort clean-up request,
such as the DELETE of an unfinished upload, gets its answer without waiting)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

# What a test's peer does with the one connection: `done` is set when the test leaves the block, and a peer that
# would go on sending for ever stops then.
Serve = Callable[[socket.socket, threading.Event], None]


@contextlib.contextmanager
def one_peer(serve: Serve, path: str, *, scheme: str = "http") -> Iterator[str]:
    """Listen on 127.0.0.1, yield `scheme://127.0.0.1:<port><path>`; on leaving, set `done`, close the listener and
    join the thread (its socket errors are the client's hang-up, not the test's failure)."""
    server = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def accept_one() -> None:
        with contextlib.suppress(OSError):
            peer, _ = server.accept()
            server.close()
            with peer:
                serve(peer, done)

    thread = threading.Thread(target=accept_one, daemon=True)
    thread.start()
    try:
        yield f"{scheme}://127.0.0.1:{server.getsockname()[1]}{path}"
    finally:
        done.set()
        server.close()
        thread.join(10)
