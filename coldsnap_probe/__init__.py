"""coldsnap_probe: the code that runs inside capsules (feature probes, admission, cache, workers).

It must run with a capsule's own python3 plus cuda-python/pynvml: it imports nothing
from the daemon, anyio, aiodocker or msgspec.
"""

from ._cache import cache_key as cache_key
from ._cache import read_cached as read_cached
from ._cache import write_cached as write_cached
from ._contracts import CONTRACTS as CONTRACTS
from ._contracts import contract as contract
from ._contracts import requirements as requirements
from ._features import FEATURE_IDS as FEATURE_IDS
from ._features import AdmissionError as AdmissionError
from ._features import ProfileError as ProfileError
from ._features import admit as admit
from ._features import apply_qualification as apply_qualification
from ._features import attach_criu as attach_criu
from ._features import decode_profile as decode_profile
from ._features import validate_profile as validate_profile
from ._features import validate_qualification as validate_qualification

__all__ = (
    "CONTRACTS",
    "FEATURE_IDS",
    "AdmissionError",
    "ProfileError",
    "admit",
    "apply_qualification",
    "attach_criu",
    "cache_key",
    "contract",
    "decode_profile",
    "read_cached",
    "requirements",
    "validate_profile",
    "validate_qualification",
    "write_cached",
)
