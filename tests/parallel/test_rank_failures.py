"""A rank that raises, is killed or hangs: its peers fail fast with a ``RankFailedError``
naming it (``report_rank_failures``), bounded by ``init_distributed``'s timeout."""

import math
import pickle
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from fp8train.parallel.distributed import RankFailedError, init_distributed, report_rank_failures

from ..helpers.rank_failures import FAILING_STEP, MAX_EXIT_SECONDS, fail, run_ranks

NUM_STEPS = 6
DIST_TIMEOUT_SECONDS = 2.0


def _all_reduce_steps(rank: int, results, failing_rank: int, mode: str, timeout_seconds: float) -> None:
    """``NUM_STEPS`` all-reduces, with ``failing_rank`` failing by ``mode`` in one of them;
    every rank writes what it raised to ``results[rank]`` and lets it propagate."""
    init_distributed(torch.device("cpu"), timeout_seconds=timeout_seconds)
    try:
        with report_rank_failures(timeout_seconds):
            for step in range(NUM_STEPS):
                if rank == failing_rank and step == FAILING_STEP:
                    fail(mode, results, hang_seconds=timeout_seconds + 2)
                dist.all_reduce(torch.ones(16))
    except Exception as error:
        results[rank] = {"type": type(error).__name__, "message": str(error),
                         "failed_ranks": getattr(error, "failed_ranks", None), "raised_at": time.monotonic()}
        raise


@pytest.mark.heavy
def test_a_rank_that_raises_is_named_by_its_peer_which_exits_at_once():
    run = run_ranks(_all_reduce_steps, 1, "raise", 60.0)
    assert run.exitcodes == [1, 1]
    assert run.results[1]["type"] == "RuntimeError"  # the failing rank keeps its own error
    assert run.results[0]["type"] == "RankFailedError"
    assert run.results[0]["failed_ranks"] == (1,)
    message = run.results[0]["message"]
    assert "rank 0: a collective failed because rank 1 failed with RuntimeError: injected failure" in message
    assert run.seconds_to_exit(0) < MAX_EXIT_SECONDS


@pytest.mark.slow  # the raising rank's case runs by default
def test_a_killed_rank_is_named_by_its_peer_which_exits_at_once():
    run = run_ranks(_all_reduce_steps, 1, "kill", 60.0)
    assert run.exitcodes == [1, -signal.SIGKILL]
    assert run.results[0]["type"] == "RankFailedError"
    assert run.results[0]["failed_ranks"] == (1,)
    assert "rank 1 exited or was killed without recording an error" in run.results[0]["message"]
    assert "Connection" in run.results[0]["message"]  # the backend's own words follow
    assert run.seconds_to_exit(0) < MAX_EXIT_SECONDS


@pytest.mark.slow  # waits out the timeout
def test_a_rank_that_never_joins_fails_its_peer_after_the_timeout():
    run = run_ranks(_all_reduce_steps, 1, "hang", DIST_TIMEOUT_SECONDS)
    assert run.exitcodes[0] == 1
    assert run.results[0]["failed_ranks"] == (1,)
    message = run.results[0]["message"]
    assert f"rank 1 did not join a collective within --dist_timeout={DIST_TIMEOUT_SECONDS:g} s" in message
    assert DIST_TIMEOUT_SECONDS <= run.seconds_to_exit(0) < DIST_TIMEOUT_SECONDS + MAX_EXIT_SECONDS


@pytest.mark.heavy
def test_rank_0_which_hosts_the_store_is_named_when_it_raises():
    # Without torchrun, rank 0 hosts the store, and it may go before the peer reads rank 0's record.
    run = run_ranks(_all_reduce_steps, 0, "raise", 60.0)
    assert run.exitcodes == [1, 1]
    # Rank 0's record is found if its store outlives its gloo connections (it usually does).
    assert run.results[1]["failed_ranks"] == (0,)
    message = run.results[1]["message"]
    assert re.search(r"^rank 1: a collective failed because rank 0 (failed with RuntimeError|exited)", message)
    assert run.seconds_to_exit(1) < MAX_EXIT_SECONDS


@pytest.mark.slow
def test_of_three_ranks_both_survivors_name_the_one_that_raised():
    run = run_ranks(_all_reduce_steps, 2, "raise", 60.0, world_size=3)
    assert run.exitcodes == [1, 1, 1]
    for survivor in (0, 1):
        assert run.results[survivor]["failed_ranks"] == (2,)
        assert "because rank 2 failed with RuntimeError: injected failure" in run.results[survivor]["message"]
        assert run.seconds_to_exit(survivor) < MAX_EXIT_SECONDS


def test_without_a_process_group_errors_pass_through_unchanged():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="Connection closed by peer") as raised:
        with report_rank_failures(30.0):
            raise RuntimeError("gloo/transport/tcp/pair.cc: Connection closed by peer")
    assert type(raised.value) is RuntimeError


def test_rank_failed_error_pickles_with_its_ranks():
    error = pickle.loads(pickle.dumps(RankFailedError("rank 0: rank 1 failed", 0, (1,))))
    assert (str(error), error.rank, error.failed_ranks) == ("rank 0: rank 1 failed", 0, (1,))


@pytest.mark.parametrize(
    "timeout_seconds, error",
    [(0, ValueError), (-1.0, ValueError), (math.inf, ValueError), (math.nan, ValueError),
     (True, TypeError), ("600", TypeError)],
)
def test_init_distributed_rejects_a_timeout_that_is_not_a_positive_number(timeout_seconds, error):
    with pytest.raises(error, match=r"timeout_seconds=.* must be a finite number of seconds > 0"):
        init_distributed(torch.device("cpu"), timeout_seconds=timeout_seconds)
