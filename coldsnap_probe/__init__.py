"""coldsnap_probe: the code that runs inside capsules (feature probes, admission, workers).

It must run with a capsule's own python3 plus cuda-python/pynvml: it imports nothing
from the daemon, anyio, aiodocker or msgspec.
"""

__all__: tuple[str, ...] = ()
