"""The bundled Docker Engine's state for the GPU-machine scripts, over its API socket (the slim bundle has no CLI).

    python3 scripts/_docker_api.py SOCKET wait|images|containers
wait: until the engine answers (30 s), then its version; images: repository:tag and size of each image;
containers: how many containers exist (running or not).
"""

from __future__ import annotations

import http.client
import json
import socket
import sys
import time
from typing import Any


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=10)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.path)


def get(path: str, url: str) -> Any:
    connection = _UnixConnection(path)
    try:
        connection.request("GET", url)
        response = connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise OSError(f"GET {url}: {response.status} {body[:200]!r}")
        return json.loads(body)
    finally:
        connection.close()


def main(path: str, what: str) -> int:
    if what == "wait":
        deadline = time.monotonic() + 30
        while True:
            try:
                version = get(path, "/version")
                break
            except OSError:
                if time.monotonic() > deadline:
                    print(f"the Docker Engine at {path} did not answer within 30 s")
                    return 1
                time.sleep(0.5)
        print(f"engine {version['Version']} api {version['ApiVersion']}")
    elif what == "images":
        for image in get(path, "/images/json"):
            for tag in image.get("RepoTags") or ["<none>"]:
                print(f"{tag} {image['Size'] / 1e6:.0f}MB")
    elif what == "containers":
        print(len(get(path, "/containers/json?all=1")))
    else:
        print(f"unknown request {what!r}: wait, images or containers")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
