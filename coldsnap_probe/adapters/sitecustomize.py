"""Put this folder on PYTHONPATH to opt a server into ColdSnap's weight hydration (coldsnap_probe._adopt).

Inert unless COLDSNAP_HYDRATION_SOCKET is set. The package itself must be importable (its parent folder on
PYTHONPATH too). Python imports only one `sitecustomize`: the next one on the path (a distribution's) is run
after ours, so nothing it did is lost.
"""

import importlib.machinery
import importlib.util
import os
import sys

try:
    from coldsnap_probe._adopt import install

    install()
except ImportError as exc:  # the adapter is optional: the server runs as without it
    sys.stderr.write(f"coldsnap adapter not installed: {exc}\n")

_here = os.path.dirname(os.path.abspath(__file__))
_next = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _next is not None and _next.loader is not None:
    _module = importlib.util.module_from_spec(_next)
    _next.loader.exec_module(_module)
