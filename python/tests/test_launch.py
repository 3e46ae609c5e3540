"""linrope.torch.launch: a group's exits and outputs, the deadline that kills a hang, the grace
period after a failed rank, and the torchrun command."""
import signal
import sys
import time

import pytest

from linrope.torch.launch import (GroupTimeout, environment, free_port, run_group,
                                  torchrun_command)


def python(code):
    return [sys.executable, "-c", code]


def test_every_rank_exit_and_output_in_order():
    exits = run_group([python("print('rank 0')"),
                       python("import sys; print('rank 1'); sys.exit(3)")], timeout=60)
    assert [e.returncode for e in exits] == [0, 3]
    assert exits[0].output == "rank 0\n" and exits[1].output == "rank 1\n"


def test_a_hang_is_killed_at_the_deadline_with_its_output():
    started = time.monotonic()
    with pytest.raises(GroupTimeout, match=r"rank\(s\) 1 still running after 1 s") as error:
        run_group([python("print('done')"),
                   python("print('waiting', flush=True); import time; time.sleep(600)")],
                  timeout=1)
    assert time.monotonic() - started < 30
    exits = error.value.exits
    assert exits[0].returncode == 0
    assert exits[1].returncode == -signal.SIGKILL and exits[1].output == "waiting\n"
    assert "waiting" in str(error.value)


def test_after_a_failed_rank_its_peers_have_the_grace_period():
    started = time.monotonic()
    with pytest.raises(GroupTimeout, match="still running 0.5 s after rank 0 failed"):
        run_group([python("import sys; sys.exit(1)"), python("import time; time.sleep(600)")],
                  timeout=120, grace=0.5)
    assert time.monotonic() - started < 30
    # Peers that fail too within the grace period end the group normally.
    exits = run_group([python("import sys; sys.exit(1)"), python("import sys; sys.exit(1)")],
                      timeout=60, grace=30)
    assert [e.returncode for e in exits] == [1, 1]


def test_what_a_rank_starts_is_killed_with_it(tmp_path):
    # The rank starts a child that would outlive it, then hangs: both are killed.
    marker = tmp_path / "child-alive"
    child = ("import time, pathlib; time.sleep(3); pathlib.Path(%r).write_text('x')" %
             str(marker))
    parent = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', %r]); "
              "time.sleep(600)" % child)
    with pytest.raises(GroupTimeout):
        run_group([python(parent)], timeout=1)
    time.sleep(4)
    assert not marker.exists()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="at least one command"):
        run_group([], timeout=1)
    with pytest.raises(ValueError, match="expected timeout > 0"):
        run_group([python("pass")], timeout=0)


def test_environment_and_torchrun_command():
    env = environment(threads=2, pythonpath=["/a", "/b"], EXTRA=7)
    assert env["OMP_NUM_THREADS"] == "2" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["PYTHONPATH"].split(":")[:2] == ["/a", "/b"] and env["EXTRA"] == "7"
    port = free_port()
    assert 0 < port < 65536
    command = torchrun_command(["-m", "training", "--quick"], 2, port)
    assert command[0] == sys.executable
    assert command[command.index("--nproc_per_node") + 1] == "2"
    assert command[command.index("--master_port") + 1] == str(port)
    assert command[-3:] == ["-m", "training", "--quick"]
