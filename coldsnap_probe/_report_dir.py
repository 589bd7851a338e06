"""Leave a worker report where the daemon that ran this unit collects it (``COLDSNAP_REPORT_DIR``).

The coldsnap-provider daemon mounts a per-unit directory into the workloads it runs and names
it in ``COLDSNAP_REPORT_DIR``; it reads each report once (phase timings for its metrics) and
removes it. The file appears whole or not at all (written under a dot name, then renamed). A
worker without the variable, or one that cannot write there, carries on: the report on stdout
is the one that counts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

__all__ = ("ENV", "leave_report")

ENV = "COLDSNAP_REPORT_DIR"


def leave_report(report: dict[str, Any]) -> None:
    directory = os.environ.get(ENV, "")
    if not directory:
        return
    name = f"{report.get('kind', 'report')}-{os.getpid()}-{time.time_ns()}.json"
    temporary = os.path.join(directory, f".{name}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w") as out:
            json.dump(report, out, sort_keys=True)
        os.rename(temporary, os.path.join(directory, name))
    except OSError as exc:
        sys.stderr.write(f"warning: report not left in {ENV}={directory}: {exc}\n")
