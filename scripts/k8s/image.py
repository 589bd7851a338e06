"""Write a docker-archive tarball (what `ctr images import` reads) from a root directory: no registry, no engine.

usage: python3 image.py ROOTFS REFERENCE OUT.tar ENTRYPOINT_JSON CMD_JSON
One layer, every entry owned by 0:0 with mtime 0, so the same tree always gives the same image id.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tarfile


def layer(rootfs: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory, subdirectories, files in os.walk(rootfs):
            subdirectories.sort()
            for name in sorted(subdirectories) + sorted(files):
                path = os.path.join(directory, name)
                info = tar.gettarinfo(path, arcname=os.path.relpath(path, rootfs))
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                if info.isreg():
                    with open(path, "rb") as data:
                        tar.addfile(info, data)
                else:
                    tar.addfile(info)
    return buffer.getvalue()


def main(rootfs: str, reference: str, out: str, entrypoint: object, cmd: object) -> None:
    data = layer(rootfs)
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "Entrypoint": entrypoint, "Cmd": cmd,
                   "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(data).hexdigest()]},
        "history": [{"created_by": "coldsnap-provider scripts/k8s/image.py"}],
    }, sort_keys=True).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [reference], "Layers": ["layer.tar"]}]).encode()
    with tarfile.open(out + ".tmp", "w") as tar:
        for name, payload in (("layer.tar", data), (config_name, config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5]))
