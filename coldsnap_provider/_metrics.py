"""What the daemon counts: one private Prometheus registry, and the only place a metric is named.

Every label value is drawn from a fixed set known at import (the protocol's operations and
actions, the wire error codes, the worker's phase names, the backend kinds) or from the configuration
(remote, Kubernetes and this node's host names): a client that sends an unknown operation, or a
capsule that reports an unknown phase, cannot create a series. Sessions, tokens, workload and image
names and paths never become labels (docs/metrics.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import ALLOWUTF8
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import Collector

from coldsnap_runtime.schema import RuntimeRequest

from . import __version__
from ._control import ControlRequest
from ._envelope import Request

__all__ = ("OPENMETRICS_CONTENT_TYPE", "TEXT_CONTENT_TYPE", "Metrics", "bounded")

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Anything else a client sends (undecodable, unknown) is counted under this value.
OTHER = "other"


def _tags(union: object) -> frozenset[str]:
    return frozenset(str(t.__struct_config__.tag) for t in get_args(union))


SESSION_OPERATIONS = _tags(Request)
CONTROL_OPERATIONS = _tags(ControlRequest)
ACTIONS = _tags(RuntimeRequest)
# `ok`, the wire error codes, `rejected` (ok:false without a code: a request refused before it ran)
# and `internal` (a bug: see the daemon log).
OUTCOMES = frozenset({"ok", "runtime_failed", "not_found", "path_not_found", "rejected", "internal"})
PROBE_DRIVERS = frozenset({"auto", "n580", "n610"})
PROBE_RESULTS = frozenset({"admitted", "refused", "failed"})
# The phases the capture and restore workers time (coldsnap_probe/_worker.py), as this daemon names them.
CAPTURE_PHASES = frozenset({"engine_quiesce", "device_release", "cuda_lock", "cuda_checkpoint", "criu_dump"})
RESTORE_PHASES = frozenset({"criu_restore", "cuda_restore", "all_pages_in", "device_hydration", "hydration",
                            "communicator_recreate",
                            "restore_total", "ready_total"})
REPORT_MODES = frozenset({"full", "hydrate", "interposer", "full-lazy-pages", "hydrate-lazy-pages",
                          "interposer-lazy-pages"})
REJECT_REASONS = frozenset({"not_regular", "too_large", "malformed", "too_many", "unreadable"})

# Requests take from a millisecond (capabilities) to many minutes (image builds, synchronous runs). Few
# buckets: every one is a line per label set in every scrape (the 5 ms scrape budget, bench/metrics_scrape.py).
_REQUEST_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.5, 2.5, 10.0, 60.0, 600.0, float("inf"))
# Worker phases: a CUDA lock takes milliseconds, a CRIU restore of a 64 GiB engine tens of seconds.
_PHASE_BUCKETS = (0.01, 0.05, 0.25, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 30.0, 60.0, 300.0, float("inf"))


def bounded(value: str, allowed: frozenset[str]) -> str:
    """`value` when it is one of `allowed`, else ``other``: no client or capsule input makes a new series."""
    return value if value in allowed else OTHER


class _RemoteCollector(Collector):
    """coldsnap_provider_remote_up{host}: read from the remote links at scrape time."""

    def __init__(self, states: Callable[[], Iterable[tuple[str, bool]]]) -> None:
        self._states = states

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("coldsnap_provider_remote_up",
                                   "1 when the SSH link to the remote node serving this host is up, else 0",
                                   labels=["host"])
        for host, up in self._states():
            family.add_metric([host], 1.0 if up else 0.0)
        yield family


class _BackendCollector(Collector):
    """coldsnap_provider_backend_up{backend, host}: the last answers of the backend probe (_health.py)."""

    def __init__(self, states: Callable[[], Iterable[tuple[str, str, bool]]]) -> None:
        self._states = states

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("coldsnap_provider_backend_up",
                                   "1 when the backend serving this host answered the last probe, else 0",
                                   labels=["backend", "host"])
        for backend, host, up in self._states():
            family.add_metric([backend, host], 1.0 if up else 0.0)
        yield family


# The capture store's tiers (coldsnap_runtime/backend/_captures.py TIERS): a fixed set.
CAPTURE_TIERS = frozenset({"tree", "disk", "registry"})


class _CaptureTierCollector(Collector):
    """coldsnap_provider_capture_store_{read_bytes,hits}_total{tier}: read from the node's store at scrape time."""

    def __init__(self, tiers: Callable[[], Iterable[tuple[str, int, int]]]) -> None:
        self._tiers = tiers

    def collect(self) -> Iterator[CounterMetricFamily]:
        read = CounterMetricFamily("coldsnap_provider_capture_store_read_bytes",
                                   "Bytes of capture data read from each tier of the node's capture store for "
                                   "workloads and pulls (disk: chunks made into files; registry: chunks fetched)",
                                   labels=["tier"])
        hits = CounterMetricFamily("coldsnap_provider_capture_store_hits",
                                   "Captures served from each tier (tree: files already made; disk: made from "
                                   "chunks on disk; registry: chunks fetched by a pull)", labels=["tier"])
        for tier, count, hit in self._tiers():
            read.add_metric([bounded(tier, CAPTURE_TIERS)], float(count))
            hits.add_metric([bounded(tier, CAPTURE_TIERS)], float(hit))
        yield read
        yield hits


class _HydratorStageCollector(Collector):
    """coldsnap_provider_hydrator_stage_{bytes,stages}_total{tier}: the node hydrators' own counts, as the daemon
    last read them (_hydrator_stages.py: its STAGE_TIERS are the only `tier` values), never a capsule's report."""

    def __init__(self, tiers: Callable[[], Iterable[tuple[str, int, int]]]) -> None:
        self._tiers = tiers

    def collect(self) -> Iterator[CounterMetricFamily]:
        read = CounterMetricFamily("coldsnap_provider_hydrator_stage_bytes",
                                   "Bytes the node hydrators in metrics.hydrator_sockets read for the device dumps "
                                   "they staged, by the tier that served them (ram: the hydrator's page-locked RAM "
                                   "tier; disk: the dump files)", labels=["tier"])
        stages = CounterMetricFamily("coldsnap_provider_hydrator_stages",
                                     "Device dump stages those hydrators filled, by the tier that served them "
                                     "(ram: a hit of the RAM tier; a stage that joined a load: the tier that "
                                     "served most of its bytes)", labels=["tier"])
        for tier, count, staged in self._tiers():
            read.add_metric([tier], float(count))
            stages.add_metric([tier], float(staged))
        yield read
        yield stages


class Metrics:
    """The daemon's metrics; the handlers, the session manager and the report collector feed it."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        Gauge("coldsnap_provider_build_info", "The running daemon's version (always 1)", ["version"],
              registry=registry).labels(version=__version__).set(1)
        self._requests = Counter("coldsnap_provider_requests", "Requests answered, by socket and outcome",
                                 ["socket", "operation", "action", "outcome"], registry=registry)
        self._durations = Histogram("coldsnap_provider_request_duration_seconds",
                                    "Time from the request line to the reply", ["socket", "operation", "action"],
                                    buckets=_REQUEST_BUCKETS, registry=registry)
        # The label children of each request's series, looked up once (labels() validates and locks every call).
        # Invariant: keys are drawn from the bounded sets above, so this never outgrows the series themselves.
        self._children: dict[tuple[str, str, str, str], tuple[Counter, Histogram]] = {}
        self.sessions = Gauge("coldsnap_provider_sessions", "Open provider sessions", registry=registry)
        self.connections = Gauge("coldsnap_provider_connections",
                                 "Connections being served on the session and control sockets", registry=registry)
        self._probes = Counter("coldsnap_provider_probe", "Host feature probes run through the control socket",
                               ["driver", "result", "cached"], registry=registry)
        self._phases = {
            kind: Histogram(f"coldsnap_{kind}_phase_seconds", f"{kind.capitalize()} phases timed by the "
                            "in-capsule worker, from the reports of the units this daemon ran", ["phase", "mode"],
                            buckets=_PHASE_BUCKETS, registry=registry)
            for kind in ("capture", "restore")
        }
        self._reports = Counter("coldsnap_provider_capsule_reports", "Capsule worker reports accepted, by kind",
                                ["kind"], registry=registry)
        self._rejected = Counter("coldsnap_provider_capsule_reports_rejected",
                                 "Capsule reports refused (not a regular file, too large, malformed, too many)",
                                 ["reason"], registry=registry)
        for reason in REJECT_REASONS:  # present at 0 from the start, so that rate() sees the first one
            self._rejected.labels(reason=reason)

    def watch(self, *, sessions: Callable[[], int], connections: Callable[[], int],
              remotes: Callable[[], Iterable[tuple[str, bool]]] | None = None,
              backends: Callable[[], Iterable[tuple[str, str, bool]]] | None = None,
              capture_tiers: Callable[[], Iterable[tuple[str, int, int]]] | None = None,
              hydrator_stages: Callable[[], Iterable[tuple[str, int, int]]] | None = None) -> None:
        """Gauges read from their owners at scrape time (nothing to keep in step)."""
        self.sessions.set_function(lambda: float(sessions()))
        self.connections.set_function(lambda: float(connections()))
        if remotes is not None:
            self.registry.register(_RemoteCollector(remotes))
        if backends is not None:
            self.registry.register(_BackendCollector(backends))
        if capture_tiers is not None:
            self.registry.register(_CaptureTierCollector(capture_tiers))
        if hydrator_stages is not None:
            self.registry.register(_HydratorStageCollector(hydrator_stages))

    def request(self, *, socket: str, operation: str, action: str, outcome: str, seconds: float) -> None:
        if socket == "session":
            operation = bounded(operation, SESSION_OPERATIONS)
        else:
            operation = bounded(operation, CONTROL_OPERATIONS)
        key = (socket, operation, bounded(action, ACTIONS) if action else "", bounded(outcome, OUTCOMES))
        if (children := self._children.get(key)) is None:
            children = self._children[key] = (self._requests.labels(*key), self._durations.labels(*key[:3]))
        children[0].inc()
        children[1].observe(seconds)

    def probe(self, *, driver: str, result: str, cached: bool) -> None:
        self._probes.labels(driver=bounded(driver, PROBE_DRIVERS), result=bounded(result, PROBE_RESULTS),
                            cached="true" if cached else "false").inc()

    def phases(self, kind: str, mode: str, seconds: dict[str, float]) -> None:
        """One accepted worker report: each known phase it timed (unknown ones are not counted)."""
        known = CAPTURE_PHASES if kind == "capture" else RESTORE_PHASES
        histogram = self._phases[kind]
        mode = bounded(mode, REPORT_MODES)
        for phase, value in seconds.items():
            if phase in known:
                histogram.labels(phase=phase, mode=mode).observe(value)
        self._reports.labels(kind=kind).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason=bounded(reason, REJECT_REASONS)).inc()

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition for a request's Accept header: OpenMetrics when asked for, else the text format."""
        if "application/openmetrics-text" in accept:
            # Every name here is a legacy Prometheus name, so "allow-utf-8" writes the same bytes as the default
            # "underscores" escaping, without re-escaping each sample's name character by character (1.8x faster).
            body = generate_openmetrics(self.registry, escaping=ALLOWUTF8)  # type: ignore[no-untyped-call]
            return body, OPENMETRICS_CONTENT_TYPE
        return generate_latest(self.registry), TEXT_CONTENT_TYPE
