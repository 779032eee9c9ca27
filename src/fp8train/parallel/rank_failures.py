"""When a rank fails: record its error in the rendezvous store, and raise on the others a
:class:`RankFailedError` that names it (``report_rank_failures``), in place of the backend's
error for a collective that a peer broke off or never joined.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
from typing import Iterator

import torch.distributed as dist

__all__ = ["RankFailedError", "report_rank_failures"]

logger = logging.getLogger(__name__)

_FAILURES_KEY = "fp8train/failed_ranks"  # lines "<rank>\t<error>", appended by each rank that raises
_STORE_TIMEOUT = datetime.timedelta(seconds=5)  # a store lookup never holds a failing run up for long
_MAX_SUMMARY = 500
# What gloo raises (a plain RuntimeError) when a peer's connection closes or a collective times out.
_GLOO_COLLECTIVE_FAILURE = re.compile(r"gloo/transport|Connection (closed|reset) by peer|Timed out waiting")
_TIMED_OUT = re.compile(r"tim(ed|ing)\s?out|timeout", re.IGNORECASE)


class RankFailedError(RuntimeError):
    """A collective could not finish because another rank raised, exited, was killed, or did
    not join it within the process group's timeout (``--dist_timeout``).

    Attributes:
        rank: the rank that raised this.
        failed_ranks: the ranks that failed, as far as this rank can tell; empty when it
            cannot (then the other ranks' logs, or torchrun's "Root Cause", say).
    """

    def __init__(self, message: str, rank: int = -1, failed_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.rank, self.failed_ranks = rank, tuple(failed_ranks)

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.failed_ranks)


@contextlib.contextmanager
def report_rank_failures(timeout_seconds: float | None = None) -> Iterator[None]:
    """Around code that runs collectives on the default process group: when one fails
    because of another rank, raise an error that names that rank.

    A rank whose code raises inside the block first records its error in the store of the
    ``env://`` rendezvous (``MASTER_ADDR:MASTER_PORT``: rank 0's, or torchrun's agent's),
    then lets it propagate unchanged; when its process exits, its connections close and
    the ranks waiting for it in a collective fail at once. Each of those raises
    :class:`RankFailedError` naming the rank from its record; without a record (a rank
    that was killed, or that hangs and so fails the collective after the group's timeout)
    it names the other rank of a two-rank group, else points at the other ranks' logs.
    A no-op without a process group of more than one rank.

    Args:
        timeout_seconds: the group's collective timeout, quoted in the messages.

    Raises:
        RankFailedError: a collective failed because of another rank; the backend's own
            error is its ``__cause__``.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store = _connect_failure_store()
    try:
        yield
    except RankFailedError:
        raise
    except BaseException as error:
        if not _is_collective_failure(error):
            _record_failure(store, rank, error)
            raise
        reports = _read_failures(store)
        raise _rank_failed_error(error, rank, world_size, reports, timeout_seconds) from error


def _is_collective_failure(error: BaseException) -> bool:
    """The backend's error for a collective that a peer broke off or never joined (nccl and
    the store raise ``DistError``s; gloo a ``RuntimeError`` from its transport)."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and _GLOO_COLLECTIVE_FAILURE.search(str(error)) is not None


def _connect_failure_store() -> dist.Store | None:
    """A client of the rendezvous store, or None (not ``env://``, or unreachable)."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not address or not port.isdigit():
        return None
    try:
        store = dist.TCPStore(address, int(port), is_master=False, timeout=_STORE_TIMEOUT)
    except RuntimeError as error:  # DistNetworkError, DistStoreError
        logger.debug("rank failures will not be named: no store at %s:%s (%s)", address, port, error)
        return None
    return store


def _record_failure(store: dist.Store | None, rank: int, error: BaseException) -> None:
    if store is None:
        return
    summary = " ".join(f"{type(error).__name__}: {error}".split()).rstrip(" :")[:_MAX_SUMMARY]
    try:
        store.append(_FAILURES_KEY, f"{rank}\t{summary}\n")
    except RuntimeError as store_error:  # the store's host is gone: the peers fall back
        logger.debug("could not record rank %d's failure in the store: %s", rank, store_error)


def _read_failures(store: dist.Store | None) -> dict[int, str]:
    """``{rank: error summary}`` of the ranks that recorded a failure (first record wins)."""
    if store is None:
        return {}
    try:
        if not store.check([_FAILURES_KEY]):
            return {}
        text = store.get(_FAILURES_KEY).decode(errors="replace")
    except RuntimeError:  # the store's host was the rank that failed
        return {}
    reports: dict[int, str] = {}
    for line in text.splitlines():
        rank_text, _, summary = line.partition("\t")
        if rank_text.isdigit():
            reports.setdefault(int(rank_text), summary)
    return reports


def _rank_failed_error(
    error: BaseException, rank: int, world_size: int, reports: dict[int, str], timeout_seconds: float | None
) -> RankFailedError:
    backend = (str(error).strip().splitlines() or [type(error).__name__])[0]
    timeout = f"--dist_timeout={timeout_seconds:g} s" if timeout_seconds else "the process group's timeout"
    peers = [r for r in range(world_size) if r != rank]
    if reports:
        failed = tuple(sorted(reports))
        causes = "; ".join(f"rank {r} failed with {reports[r]}" for r in failed)
        message = f"rank {rank}: a collective failed because {causes} (its traceback is in the log of {_ranks(failed)})"
    else:
        failed = tuple(peers) if len(peers) == 1 else ()
        who = f"rank {peers[0]}" if failed else "another rank"
        if _TIMED_OUT.search(str(error)):
            message = (
                f"rank {rank}: {who} did not join a collective within {timeout}: it is stuck, or in a "
                "different collective (raise --dist_timeout if it is only slow)"
            )
        else:
            message = (
                f"rank {rank}: a collective failed because {who} exited or was killed without recording an "
                "error (a signal, out of memory, a crash in native code, or its record was in its own store)"
            )
        logs = f"the log of {who}" if failed else "the other ranks' logs"
        message += f"; see {logs}, or the 'Root Cause' in torchrun's report"
    return RankFailedError(f"{message}\nbackend error: {backend}", rank, failed)


def _ranks(ranks: tuple[int, ...]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
