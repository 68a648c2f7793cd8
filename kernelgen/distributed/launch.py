"""The launcher: `python -m kernelgen.distributed --nproc-per-node N script.py args...`, torchrun's flags.

It starts one process per GPU of this node and gives each RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, KERNELGEN_DIST_TOKEN, and NCCL_NVLS_ENABLE=0 (NCCL's NVLink multicast stays off in
every process).  SIGINT / SIGTERM / SIGHUP are passed on to every rank.  When one rank fails, the launcher
stops the others and exits non-zero, naming the rank: a crashed rank never leaves the rest hanging in a
collective.
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

from kernelgen import settings

POLL_S = 0.05
GRACE_S = 5.0  # how long the other ranks get to exit after SIGTERM before SIGKILL
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def int_at_least(lo):
    """An argparse type: an int >= lo (argparse turns the ArgumentTypeError into a usage error naming the flag)."""
    def parse(text):
        try:
            n = int(text)
        except ValueError:
            n = lo - 1
        if n < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}")
        return n
    return parse


_positive, _nonnegative = int_at_least(1), int_at_least(0)


def _port(text):
    n = _nonnegative(text)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 0..65535, got {text!r}")
    return n


def parser():
    ap = argparse.ArgumentParser(prog="python -m kernelgen.distributed",
                                 description="start one training process per GPU (torchrun's flags)")
    ap.add_argument("--nproc-per-node", "--nproc_per_node", type=_positive, required=True,
                    help="processes on this node, one per GPU")
    ap.add_argument("--nnodes", type=_positive, default=1, help="nodes in the job (default 1)")
    ap.add_argument("--node-rank", "--node_rank", type=_nonnegative, default=0, help="this node's index")
    ap.add_argument("--master-addr", "--master_addr", default="127.0.0.1", help="rank 0's host (default 127.0.0.1)")
    ap.add_argument("--master-port", "--master_port", type=_port, default=0,
                    help="rank 0's TCP port (default: a free one; needed with --nnodes > 1)")
    ap.add_argument("-m", "--module", action="store_true", help="run `script` as a module, as python -m does")
    ap.add_argument("script", help="the training script (or module, with -m)")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return ap


def check_args(ap, args):
    if args.node_rank >= args.nnodes:
        ap.error(f"--node-rank must be < --nnodes ({args.nnodes}), got {args.node_rank}")
    if args.nnodes > 1 and args.master_port == 0:
        ap.error("--master-port is required with --nnodes > 1 (every node must name the same port)")


def free_port():
    """A TCP port nobody listens on now (rank 0 binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_envs(args, base=None):
    """One environment per local process: the job's layout, the rendezvous token, NCCL_NVLS_ENABLE=0."""
    base = dict(settings.process_environment() if base is None else base)
    n = args.nproc_per_node
    port = args.master_port or free_port()
    # one token per job: a single-node job makes its own; nodes of a multi-node job must agree, so there it
    # comes from the environment (KERNELGEN_DIST_TOKEN) or, failing that, from the rendezvous address
    token = base.get("KERNELGEN_DIST_TOKEN") or (secrets.token_hex(16) if args.nnodes == 1
                                                  else f"{args.master_addr}:{port}")
    envs = []
    for local in range(n):
        env = dict(base, RANK=str(args.node_rank * n + local), LOCAL_RANK=str(local), WORLD_SIZE=str(n * args.nnodes),
                   LOCAL_WORLD_SIZE=str(n), MASTER_ADDR=args.master_addr, MASTER_PORT=str(port),
                   KERNELGEN_DIST_TOKEN=token, NCCL_NVLS_ENABLE="0")
        envs.append(env)
    return envs


def command(args):
    head = [sys.executable, "-u"] + (["-m", args.script] if args.module else [args.script])
    return head + list(args.args)


def _describe(code):
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _signal_all(procs, sig):
    """Send `sig` to the process group of every rank still running (a rank's own workers get it too)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:  # it exited between the poll and the kill
                pass


def _stop(procs, sig=signal.SIGTERM):
    """Signal every rank still running (its whole process group: a rank's own workers go too), then wait
    GRACE_S for them and SIGKILL what is left."""
    _signal_all(procs, sig)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def supervise(procs, ranks, out=None):
    """Wait for every rank; the first failure stops the rest.  Returns the launcher's exit code."""
    out = sys.stderr if out is None else out
    running = dict(zip(ranks, procs))
    while running:
        for rank, p in list(running.items()):
            code = p.poll()
            if code is None:
                continue
            del running[rank]
            if code != 0:
                print(f"kernelgen.distributed: rank {rank} (pid {p.pid}) {_describe(code)}; stopping the other "
                      f"{len(running)} rank(s)", file=out, flush=True)
                _stop(list(running.values()))
                return code if code > 0 else 128 - code
        time.sleep(POLL_S)
    return 0


def launch(args, out=None):
    """Start the ranks of this node and supervise them; forwards signals while they run."""
    envs, cmd = rank_envs(args), command(args)
    procs, ranks = [], []
    previous = {}

    def forward(signum, _frame):
        _signal_all(procs, signum)

    for sig in FORWARDED:
        previous[sig] = signal.signal(sig, forward)
    try:
        for env in envs:
            # each rank leads its own process group, so a signal reaches its workers and a terminal's Ctrl-C
            # reaches the ranks once, through forward(), not twice
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
            ranks.append(int(env["RANK"]))
        return supervise(procs, ranks, out)
    except BaseException:
        _stop(procs)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    return launch(args)
