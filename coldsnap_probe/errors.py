"""Every exception coldsnap_probe raises, in one tree.

    ProbeError                      anything this package raises on purpose
    ├── DriverError                 the CUDA driver layer (`_cuda.py` translates cuda-python and libcuda here)
    │   ├── CudaLibraryMissing      libcuda.so.1 or cuda-python cannot be loaded: a feature is `failed`
    │   ├── CudaUnavailable         a driver symbol is missing or uncallable: a feature is `unsupported`
    │   └── CudaError               a required driver call returned an error code
    ├── CanaryFailed                a canary's own check failed (its child, a state sequence, the bytes)
    ├── ProfileError (ValueError)   a profile, requirement list or qualification record is malformed
    │   └── UnknownDriver           the snapshot driver is neither n580 nor n610
    ├── AdmissionError              a profile is not admitted; the message is the controller's text
    │   └── FeatureNotPassed        a required feature is absent or did not pass
    ├── ContractError               a graph policy record or memory contract breaks a rule
    │   ├── MemoryCapabilityError   a memory contract is violated or a provider lacks a capability
    │   └── NotCanonical            a value has no canonical JSON (NaN or an infinity), so no digest
    ├── RecordInvalid (ValueError)  an images record is not the format-1 document its name promises
    ├── WorkerError                 a capture or restore step failed
    │   ├── RankAborted             a multi-rank activation was aborted (by a rank, or a peer never arrived)
    │   ├── CaptureRefused          this tree cannot be captured (every reason, before anything is locked)
    │   └── TargetRefused           this host cannot restore the capture (every mismatched fact, before any work)
    ├── HydrationError              weight hydration refused or failed (names the region when one is at fault)
    └── ChannelError                a JSON-line socket (`jsonline`) could not be reached, refused or answered badly

A canary never lets its errors escape: it turns them into a `failed` or `unsupported`
feature result whose reason is ``<Type>: <message>``, so the class names here are part of
the profile's text. `ProfileError` is also a `ValueError` because the daemon reports a bad
driver name or a malformed profile as a usage error. This module imports nothing: the
probe runs inside capsules that have only their own python3.
"""

from __future__ import annotations

__all__ = (
    "AdmissionError",
    "CanaryFailed",
    "CaptureRefused",
    "ChannelError",
    "ContractError",
    "CudaError",
    "CudaLibraryMissing",
    "CudaUnavailable",
    "DriverError",
    "FeatureNotPassed",
    "HydrationError",
    "MemoryCapabilityError",
    "NotCanonical",
    "ProbeError",
    "ProfileError",
    "RankAborted",
    "RecordInvalid",
    "TargetRefused",
    "UnknownDriver",
    "WorkerError",
)


class ProbeError(Exception):
    """The root: anything coldsnap_probe raises on purpose."""


class DriverError(ProbeError):
    """The CUDA driver layer failed; raised only by `_cuda.py`, the one place cuda-python errors are translated."""


class CudaLibraryMissing(DriverError):
    """libcuda.so.1 or cuda-python cannot be loaded: no CUDA here at all (the feature is `failed`)."""


class CudaUnavailable(DriverError):
    """A driver symbol is missing or cannot be called: a known implementation limit (`unsupported`)."""


class CudaError(DriverError):
    """A required driver call returned an error: ``<fn> failed: <CUDA_ERROR_NAME>: <error string>``."""

    def __init__(self, function: str, error_name: str, error_string: str) -> None:
        super().__init__(f"{function} failed: {error_name}: {error_string}")
        self.function, self.error_name, self.error_string = function, error_name, error_string


class CanaryFailed(ProbeError):
    """A canary's own check failed: its child misbehaved, a state sequence or the canary bytes were wrong."""


class ProfileError(ProbeError, ValueError):
    """A profile, requirement list or qualification record is malformed (the message names the rule)."""


class RecordInvalid(ProbeError, ValueError):
    """An images record is not the format-1 document its name promises (a ValueError, as the JSON decoder's are)."""


class UnknownDriver(ProfileError):
    """The snapshot driver selection is not exactly n580 or n610 (there is no `auto`)."""

    def __init__(self, driver: str) -> None:
        super().__init__(f"snapshot driver must be n580 or n610, got {driver!r}")
        self.driver = driver


class AdmissionError(ProbeError):
    """A profile is not admitted; the message is the controller's exact text."""


class FeatureNotPassed(AdmissionError):
    """A required feature has no result, or a result other than `passed` (Go `Requirements.Admit`)."""

    def __init__(self, feature: str, *, status: str = "unqualified", reason: str = "", failure_phase: str = "",
                 absent: bool = False) -> None:
        if absent:
            message = "destination profile contains no result"
        else:
            message = f"phase {failure_phase}: {reason}" if failure_phase else reason
        super().__init__(f"required feature {feature} is {status}: {message}")
        self.feature, self.status, self.absent = feature, status, absent


class ContractError(ProbeError):
    """A graph policy record or memory contract breaks a rule; the message names the rule."""


class MemoryCapabilityError(ContractError):
    """A memory contract is violated or a capability is missing; the message names which."""


class NotCanonical(ContractError):
    """A value has no canonical JSON (NaN or an infinity), so it cannot be digested."""


class WorkerError(ProbeError):
    """Capture or restore failed; the message says which step and why."""


class HydrationError(ProbeError):
    """Weight hydration was refused before anything was released, or failed before the engine served."""

    def __init__(self, message: str, *, region: str = "") -> None:
        super().__init__(f"region {region}: {message}" if region else message)
        self.region = region  # the weight region at fault, "" when the failure is not about one region


class ChannelError(ProbeError):
    """A JSON-line socket could not be created or reached, or its answer was not one JSON object."""


class RankAborted(WorkerError):
    """A multi-rank activation was aborted: by this rank, by a peer, or because a peer never arrived."""


class CaptureRefused(WorkerError):
    """This tree cannot be captured (`_cuda_ipc`); refused before anything was locked, released or dumped."""

    def __init__(self, reasons: list[dict[str, object]]) -> None:
        # `reasons`: one {"code", "pid", "command", ...the facts of that code} per process refused.
        super().__init__("capture refused before anything was locked or released: " + "; ".join(
            f"{r['code']} (process {r['pid']} `{str(r['command'])[:120]}`: "
            + ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("code", "pid", "command")) + ")"
            for r in reasons))
        self.reasons = tuple(reasons)


class TargetRefused(WorkerError):
    """This host cannot restore the capture (`_target.check_target`); nothing was restored, staged or started."""

    def __init__(self, mismatches: list[dict[str, object]]) -> None:
        # `mismatches`: one {"code", "fact", "captured", "current"} per fact; `seconds`: the checks' cost so far.
        super().__init__("not restoring on this host: " + "; ".join(
            f"{m['code']} ({m['fact']}: captured {m['captured']!r}, this host {m['current']!r})" for m in mismatches))
        self.mismatches = tuple(mismatches)
        self.seconds = 0.0
