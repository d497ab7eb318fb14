"""One copier per node: the first task to take the node lock stages; the others adopt its result.

If a user starts several stage-in tasks on one node (``--ntasks-per-node=4``), exactly one copies;
the others wait on the same lock and, when it is released, adopt the result the copier wrote
beside it: its report, or its failure re-raised as the same error class (so the exit code and
``except`` clauses match). A copier killed by ``kill -9`` leaves no fresh result; the next task
then does the work itself, which skips whatever is already staged.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from stager.errors import exit_code_for, one_line, rebuild_error
from stager.layout import PARTIAL_SUFFIX, StagedDataset
from stager.stagein.options import StageInOptions
from stager.stagein.report import StageInReport
from stager.storage.dest import ensure_private_dir
from stager.storage.lock import NodeLock
from stager.storage.paths import discard

__all__ = ["run_once_per_node", "attach_report"]


def attach_report(exc: BaseException, report: StageInReport) -> None:
    """Let the caller (the CLI, waiting tasks) see what was done before ``exc`` stopped it."""
    exc.report = report  # type: ignore[attr-defined]


def run_once_per_node(
    staged: StagedDataset,
    options: StageInOptions,
    work: Callable[[Callable[[], None]], StageInReport],
    *,
    spec: str = "",
) -> StageInReport:
    """Run ``work()`` as this node's only copier of ``staged``; tasks that waited adopt its result.

    A result is adopted only if it staged the same ``spec`` (what was asked for); a task that
    waited on another dataset's copier under the same name does the work itself, which then
    refuses the name (see :func:`stager.stagein.guards.check_same_source`). ``work`` attaches its
    report to any exception it raises (:func:`attach_report`), and calls the heartbeat it is
    given as it makes progress, so that waiting tasks can tell a slow copier from a hung one.
    """
    ensure_private_dir(staged.root)
    ensure_private_dir(staged.dir)
    wait_started = time.time()
    with NodeLock(staged.lock_path, timeout_s=options.lock_timeout_s, read_only_ok=True) as lock:
        if lock.contended:
            adopted = _adopt(staged, wait_started, spec)
            if adopted is not None:
                return adopted
        try:
            report = work(lock.heartbeat)
        except Exception as exc:
            failed: StageInReport | None = getattr(exc, "report", None)
            if failed is not None:
                failed.exit_code = exit_code_for(exc)
                _write_result(staged, failed, exc)
            raise
        # An interrupt (Ctrl-C, SIGTERM) leaves no result: a task that waited did not ask for
        # it to stop, and takes the lock and finishes the staging itself, as after a kill -9.
        _write_result(staged, report, None)
        return report


def _adopt(staged: StagedDataset, wait_started: float, spec: str) -> StageInReport | None:
    """The result of the copier we waited for, if it finished after we started waiting and
    staged the same spec."""
    try:
        payload = json.loads(staged.result_path.read_text())
    except (OSError, ValueError):
        return None
    if payload.get("finished_at", 0) < wait_started:
        return None  # stale, from an earlier run; the holder died: do the work ourselves
    report = StageInReport.from_json(payload["report"])
    if report.spec != spec:
        return None  # another source under this name: not ours to adopt
    report.role = "waiter"
    if report.exit_code != 0:
        message = payload.get("error") or "the copier on this node failed"
        raise rebuild_error(payload.get("error_class", "StagerError"), message)
    return report


def _write_result(staged: StagedDataset, report: StageInReport, exc: BaseException | None) -> None:
    """Publish the result for waiting tasks; best effort.

    On a full or read-only scratch this write fails too, and must not mask the error being
    reported: a waiter that finds no fresh result takes the lock and re-plans, which skips
    what is staged.
    """
    path = staged.result_path
    tmp = path.with_name(f"{path.name}.{os.getpid()}{PARTIAL_SUFFIX}")
    payload = {
        "finished_at": time.time(),
        "error": one_line(exc) if exc is not None else "",
        "error_class": type(exc).__name__ if exc is not None else "",
        "report": report.to_json(),
    }
    try:
        tmp.write_text(json.dumps(payload))
        tmp.replace(path)
    except BaseException as failure:  # a Ctrl-C or SIGTERM mid-write too: no .partial left
        discard(tmp)
        if not isinstance(failure, OSError):
            raise
