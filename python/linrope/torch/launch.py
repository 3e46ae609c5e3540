"""linrope.torch.launch: a group of local processes for torch.distributed on one machine.

Sequence and data parallelism are tested and measured with several processes on 127.0.0.1 (gloo),
and a group of processes fails in one way a single process does not: a rank that dies or waits
in a collective its peers never join leaves the others waiting for ever. Every multi-process
test, benchmark and experiment of linrope starts its ranks here, so that each group has

  * a free TCP port on 127.0.0.1 (free_port; the caller passes it to its ranks, or to torchrun),
  * every rank in a process group of its own (start_new_session), so that what a rank starts
    (torchrun's workers) is killed with it,
  * a deadline: past `timeout` seconds every rank still running is killed and GroupTimeout is
    raised with the end of each rank's output, instead of a hang;
  * optionally a grace period after the first rank that fails: its peers then have `grace`
    seconds to finish (most fail at once with the same error) before they are killed,
  * one environment (environment()): one OpenMP thread per rank by default, and passive OpenMP
    waiting, so that ranks sharing a few cores do not spin on each other's time slices.

    free_port() -> int
    environment(threads=1, pythonpath=(), **variables) -> dict
    run_group(commands, *, timeout, env=None, cwd=None, grace=None) -> [RankExit]
    torchrun_command(args, processes, port, *, nnodes=1, node_rank=0) -> [str]
"""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

__all__ = ["GroupTimeout", "RankExit", "environment", "free_port", "run_group", "torchrun_command"]


class RankExit(NamedTuple):
    """How one process of a group ended: its exit status (negative: killed by that signal; the
    group's own kills are SIGKILL) and everything it wrote to stdout and stderr."""
    returncode: int
    output: str


class GroupTimeout(RuntimeError):
    """Some ranks were still running at the deadline (all were then killed); `exits` holds every
    rank's RankExit, the killed ones with returncode -SIGKILL."""

    def __init__(self, message, exits):
        super().__init__(message)
        self.exits = exits


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(threads=1, pythonpath=(), **variables):
    """os.environ with OMP_NUM_THREADS=threads and OMP_WAIT_POLICY=PASSIVE (a waiting OpenMP
    thread sleeps instead of spinning for a descheduled peer), `pythonpath` ahead of any
    PYTHONPATH already set, and `variables` (strings) on top."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    paths = [str(p) for p in pythonpath] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                            if p]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update({k: str(v) for k, v in variables.items()})
    return env


def _tail(text, characters=3000):
    return text if len(text) <= characters else "..." + text[-characters:]


def run_group(commands, *, timeout, env=None, cwd=None, grace=None, poll=0.05):
    """Starts every command (a list of arguments each, one per rank) at once and waits for all.
    Returns a RankExit per command, in order, once every one has exited. Raises GroupTimeout
    (after killing every rank still running) if some are still running `timeout` seconds after
    the start, or, with `grace` set, `grace` seconds after the first rank exited with a non-zero
    status. Output goes to temporary files, not pipes: a rank that writes much never blocks."""
    if not commands:
        raise ValueError("run_group: expected at least one command")
    if timeout <= 0 or (grace is not None and grace < 0):
        raise ValueError("run_group: timeout is %r and grace %r but expected timeout > 0 and "
                         "grace >= 0 or None" % (timeout, grace))
    logs = [tempfile.TemporaryFile(mode="w+", prefix="linrope-rank-") for _ in commands]
    processes = []
    try:
        for command, log in zip(commands, logs):
            processes.append(subprocess.Popen(
                [str(a) for a in command], env=env, cwd=cwd, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        reason, timed_out, failed = "still running after %g s" % timeout, False, None
        while any(p.poll() is None for p in processes):
            now = time.monotonic()
            if grace is not None and failed is None:
                failed = next((r for r, p in enumerate(processes) if p.returncode), None)
                if failed is not None and now + grace < deadline:
                    deadline = now + grace
                    reason = "still running %g s after rank %d failed" % (grace, failed)
            if now > deadline:
                timed_out = True
                break
            time.sleep(poll)
    finally:
        for p in processes:
            if p.poll() is None:
                _kill(p)
    exits = []
    for p, log in zip(processes, logs):
        log.seek(0)
        exits.append(RankExit(p.returncode, log.read()))
        log.close()
    if timed_out:
        running = ", ".join(str(r) for r, e in enumerate(exits)
                            if e.returncode == -signal.SIGKILL)
        outputs = "\n".join("--- rank %d (exit %s) ---\n%s" % (r, e.returncode, _tail(e.output))
                            for r, e in enumerate(exits))
        raise GroupTimeout("run_group: rank(s) %s %s and were killed. Their output (end):\n%s"
                           % (running, reason, outputs), exits)
    return exits


def _kill(process):
    """SIGKILL to the rank's whole process group (what it started dies with it)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


# torch 1.13's torchrun under Python 3.11 (Debian 12) fails at start with "AttributeError:
# 'NoneType' object has no attribute 'get'" unless --redirects and --tee are both non-zero
# (Python 3.11 no longer iterates IntFlag's 0 or combined members, which its Std.from_str relies
# on): --redirects 1 --tee 1 copies each worker's stdout to a log file and to the console,
# prefixed with "[default<local rank>]:".
_TORCHRUN = ("-m", "torch.distributed.run", "--redirects", "1", "--tee", "1")


def torchrun_command(args, processes, port, *, nnodes=1, node_rank=0, python=None):
    """The command that runs `args` (e.g. ["-m", "training", ...]) under torchrun with
    `processes` workers per node, rendezvous at 127.0.0.1:port; --monitor_interval 0.5 so that
    the agent sees its workers end within half a second (5 s by default)."""
    return [python or sys.executable, *_TORCHRUN, "--nnodes", str(nnodes), "--node_rank",
            str(node_rank), "--nproc_per_node", str(processes), "--master_addr", "127.0.0.1",
            "--master_port", str(port), "--monitor_interval", "0.5", *args]
