"""The capture and restore worker (admission spec 7.2-7.4, single rank): CUDA checkpoint + CRIU.

Capture (n610, initialized CUDA state): find the CUDA processes of the tree, require `running`,
lock all, checkpoint all (state checked after every step), CRIU dump; on any failure the
processes are restored and unlocked in reverse order so the workload keeps running.

Capture (n580, pre-CUDA template): audit that no process of the tree maps the CUDA driver or
holds an NVIDIA device file, then a CPU-only CRIU dump; the restored process initializes CUDA
fresh.

Restore: CRIU restore leaving the tree stopped, then (n610) per CUDA process in reverse
inventory order: require `checkpointed`, restore, require `locked`, unlock, require
`running`; finally SIGCONT. On failure the restored tree is killed. With lazy pages, CRIU restores
the tree without its memory and `criu lazy-pages` fills it (userfaultfd) while the CUDA state comes
back; the tree is then held stopped until every page is in, and a daemon that fails kills it.
Timeline marks are taken by this (fresh) process, never by the restored one. The image directory is
only read.

Weight hydration (`hydration/`): with `hydration=<engine control socket>` the capture first asks
the engine to release its weight regions (the engine's fail-before-release gate; the manifest goes
into the images as `hydration.json`) and, if anything fails afterwards, to hydrate them back so the
workload keeps serving. A restore whose images hold `hydration.json` checks the weight sources
before CRIU runs, and after the CUDA unlock asks the engine to re-map, hydrate and verify; the
report's `hydration` gives bytes, seconds, GB/s and regions verified. When the engine hydrates through
a long-lived hydrator, the worker has it stage the weights on the engine's GPU while CRIU and CUDA
restore the process (`Stager`), so that the engine's hydration only maps and verifies them. A failed
hydration kills the restored tree: nothing half-hydrated serves.

Several ranks (tensor parallelism, spec 7.1-7.3): one worker per rank, meeting the others through a
`Coordinator` at every step, so that all ranks reach the capture point together and a failure on one
rank aborts all. A rank's communicators are handled by the graph policy (`plan_graph_policy`, default
per driver): under `recreate-from-plan` the engine is asked (its control socket, `engine=`) to destroy
its collective graphs and communicators before the CUDA lock, and the capture refuses a rank whose engine
still reports a live communicator (restoring one fails with CUDA_ERROR_NOT_SUPPORTED and loses the rank);
after restore the engine recreates them on a fresh store and re-captures its graphs. The graph record is
written into the images at capture and validated (digest recomputed) on every rank before anything is
restored. Every rank is restored paused; CUDA state is restored only once every rank's CRIU restore
exists; the ranks are then released together. A multi-rank dump leaves the tree stopped until every rank
has dumped, so a failed peer rolls every rank back to serving.

Where each part lives: `_capture.py` and `_restore.py` (the phases, each with its one rollback),
`_reports.py` (the typed reports and their JSON, docs/worker-reports.md), `_process.py` (the process tree,
CRIU, memory), `_engine.py` (the engine's control socket, the graph record), `_coordinator.py` (ranks).
This module is the worker's front: what the benches use. The command line imports `_capture` or `_restore`
alone, so that a restore worker does not load the capture side before its first mark (issue 22).
"""

from __future__ import annotations

from ._capture import capture
from ._engine import tp_execution
from ._process import anonymous_memory, image_digest, process_tree
from ._restore import restore

__all__ = ("anonymous_memory", "capture", "image_digest", "process_tree", "restore", "tp_execution")
