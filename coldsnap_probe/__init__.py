"""coldsnap_probe: the code that runs inside capsules (feature probes, admission, cache, workers).

It must run with a capsule's own python3 plus cuda-python/pynvml: it imports nothing
from the daemon, anyio, aiodocker or msgspec. Probe values are frozen dataclasses
(`Profile`, `FeatureResult`, `Requirements`, `Contract`, `Qualification`) converted to and
from JSON only by their `from_json`/`to_json`; the profile functions the daemon calls
(`decode_profile`, `attach_criu`, `admit`, `read_cached`, `write_cached`) take and give the
JSON documents it relays. Errors: `coldsnap_probe.errors` (root `ProbeError`).

Each name is imported on first use (PEP 562): `python -m coldsnap_probe restore` then loads the restore's modules
and not the profile's or the capture's, which a restore would otherwise pay for before its first mark (issue 22).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what each name is, for mypy and readers; at run time `__getattr__` imports it
    from ._cache import cache_key as cache_key
    from ._cache import read_cached as read_cached
    from ._cache import write_cached as write_cached
    from ._contracts import CONTRACTS as CONTRACTS
    from ._contracts import contract as contract
    from ._contracts import requirements as requirements
    from ._criu_restore_log import restore_phases as restore_phases
    from ._criu_stats import dump_stats as dump_stats
    from ._features import admit as admit
    from ._features import admit_profile as admit_profile
    from ._features import apply_qualification as apply_qualification
    from ._features import attach_criu as attach_criu
    from ._features import decode_profile as decode_profile
    from ._features import qualify as qualify
    from ._features import validate_profile as validate_profile
    from ._features import with_criu as with_criu
    from ._graph import POLICIES as GRAPH_POLICIES
    from ._graph import RECIPE_MODES as RECIPE_MODES
    from ._graph import GraphPlan as GraphPlan
    from ._graph import GraphResolution as GraphResolution
    from ._graph import ResourceAudit as ResourceAudit
    from ._graph import default_graph_policy as default_graph_policy
    from ._graph import graph_record as graph_record
    from ._graph import plan_graph_policy as plan_graph_policy
    from ._graph import resolve_graph_policy as resolve_graph_policy
    from ._graph import validate_graph_record as validate_graph_record
    from ._held_tree import stop_tree as stop_tree
    from ._held_tree import wait_stopped as wait_stopped
    from ._host import boot_id as boot_id
    from ._model import FEATURE_IDS as FEATURE_IDS
    from ._model import STATUSES as STATUSES
    from ._model import Contract as Contract
    from ._model import FeatureResult as FeatureResult
    from ._model import Profile as Profile
    from ._model import Qualification as Qualification
    from ._model import QualificationScope as QualificationScope
    from ._model import Requirements as Requirements
    from ._process import anonymous_memory as anonymous_memory
    from ._process import image_digest as image_digest
    from ._process import pids_by_argv as pids_by_argv
    from ._thread_hold import ThreadHold as ThreadHold
    from .errors import AdmissionError as AdmissionError
    from .errors import ContractError as ContractError
    from .errors import ProbeError as ProbeError
    from .errors import ProfileError as ProfileError
    from .hydration import WeightArena as WeightArena
    from .hydration import WeightRegion as WeightRegion
    from .hydration import chunk_digests as chunk_digests
    from .hydration import combine_digests as combine_digests
    from .hydration import region_digest as region_digest
    from .jsonline import request as hydration_request

# Public name -> "module" (the same name there) or "module:name".
_EXPORTS = MappingProxyType({
    "boot_id": "._host",
    "cache_key": "._cache",
    "read_cached": "._cache",
    "write_cached": "._cache",
    "CONTRACTS": "._contracts",
    "contract": "._contracts",
    "requirements": "._contracts",
    "admit": "._features",
    "admit_profile": "._features",
    "apply_qualification": "._features",
    "attach_criu": "._features",
    "decode_profile": "._features",
    "qualify": "._features",
    "validate_profile": "._features",
    "with_criu": "._features",
    "GRAPH_POLICIES": "._graph:POLICIES",
    "RECIPE_MODES": "._graph",
    "GraphPlan": "._graph",
    "GraphResolution": "._graph",
    "ResourceAudit": "._graph",
    "default_graph_policy": "._graph",
    "graph_record": "._graph",
    "plan_graph_policy": "._graph",
    "resolve_graph_policy": "._graph",
    "validate_graph_record": "._graph",
    "FEATURE_IDS": "._model",
    "STATUSES": "._model",
    "Contract": "._model",
    "FeatureResult": "._model",
    "Profile": "._model",
    "Qualification": "._model",
    "QualificationScope": "._model",
    "Requirements": "._model",
    "restore_phases": "._criu_restore_log",
    "dump_stats": "._criu_stats",
    "anonymous_memory": "._process",
    "image_digest": "._process",
    "pids_by_argv": "._process",
    "stop_tree": "._held_tree",
    "wait_stopped": "._held_tree",
    "ThreadHold": "._thread_hold",
    "AdmissionError": ".errors",
    "ContractError": ".errors",
    "ProbeError": ".errors",
    "ProfileError": ".errors",
    "WeightArena": ".hydration",
    "WeightRegion": ".hydration",
    "chunk_digests": ".hydration",
    "combine_digests": ".hydration",
    "region_digest": ".hydration",
    "hydration_request": ".jsonline:request",
})

__all__ = (
    "CONTRACTS",
    "FEATURE_IDS",
    "GRAPH_POLICIES",
    "RECIPE_MODES",
    "STATUSES",
    "AdmissionError",
    "Contract",
    "ContractError",
    "FeatureResult",
    "GraphPlan",
    "GraphResolution",
    "ProbeError",
    "Profile",
    "ProfileError",
    "Qualification",
    "QualificationScope",
    "Requirements",
    "ResourceAudit",
    "ThreadHold",
    "WeightArena",
    "WeightRegion",
    "admit",
    "admit_profile",
    "anonymous_memory",
    "apply_qualification",
    "attach_criu",
    "boot_id",
    "cache_key",
    "chunk_digests",
    "combine_digests",
    "contract",
    "decode_profile",
    "default_graph_policy",
    "dump_stats",
    "graph_record",
    "hydration_request",
    "image_digest",
    "pids_by_argv",
    "plan_graph_policy",
    "qualify",
    "read_cached",
    "region_digest",
    "requirements",
    "resolve_graph_policy",
    "restore_phases",
    "stop_tree",
    "validate_graph_record",
    "validate_profile",
    "wait_stopped",
    "with_criu",
    "write_cached",
)


if not TYPE_CHECKING:  # mypy sees only the imports above: a misspelt name is then an error, not Any

    def __getattr__(name: str) -> Any:
        """`name` imported from its module on first use, then kept as this module's attribute."""
        try:
            module, _, attribute = _EXPORTS[name].partition(":")
        except KeyError:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
        # __import__, not importlib.import_module: `python -X importtime` then shows what each first use costs.
        value = getattr(__import__(module.lstrip("."), globals(), None, [attribute or name], 1), attribute or name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})
