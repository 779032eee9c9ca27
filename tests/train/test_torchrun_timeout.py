"""The torchrun launcher of the tests ends a run that outlives its timeout, workers included.

torchrun starts each worker in a session of its own: killing torchrun's process group left a
hung worker running and holding the output pipes, and the test then waited on them for good
(a rank of ``fp8train train --strategy ddp`` deadlocked at exit did so)."""

import time

import pytest

from .torchrun import run_torchrun

MAX_SECONDS = 60  # torchrun's start, the timeout, and its stop of the worker


@pytest.mark.heavy  # a subprocess or a JAX compile of seconds: CI's second leg runs it (default run under 6 minutes)
def test_a_hung_worker_fails_the_test_instead_of_hanging_it(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(600)\n")
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="did not finish in 2 s"):
        run_torchrun([str(script)], timeout=2, nproc=1)
    assert time.monotonic() - started < MAX_SECONDS
