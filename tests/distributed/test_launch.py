"""The launcher's arguments and environments, signal forwarding, and the rendezvous's errors: a missing rank is
named, a stray connection is ignored, a mismatched WORLD_SIZE is refused."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kernelgen.distributed import NumpyCommunicator, RendezvousError, init_process_group
from kernelgen.distributed import launch
from kernelgen.distributed.process_group import destroy_process_group, read_env
from kernelgen.distributed.store import TCPStore


def parse(*argv):
    ap = launch.parser()
    args = ap.parse_args(list(argv))
    launch.check_args(ap, args)
    return args


def test_torchrun_flags_and_script_arguments():
    args = parse("--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                 "--master-port", "29501", "train.py", "--lr", "0.1", "-x")
    assert (args.nproc_per_node, args.nnodes, args.node_rank, args.master_port) == (4, 2, 1, 29501)
    assert args.script == "train.py" and args.args == ["--lr", "0.1", "-x"]
    assert parse("--nproc_per_node=2", "s.py").nproc_per_node == 2  # torchrun's underscore spelling


@pytest.mark.parametrize("argv, what", [
    (["--nproc-per-node", "0", "s.py"], "--nproc-per-node"),
    (["--nproc-per-node", "two", "s.py"], "--nproc-per-node"),
    (["--nproc-per-node", "2", "--master-port", "70000", "s.py"], "--master-port"),
    (["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2", "--master-port", "1", "s.py"], "--node-rank"),
    (["--nproc-per-node", "2", "--nnodes", "2", "s.py"], "--master-port"),
    (["s.py"], "--nproc-per-node"),
])
def test_bad_arguments_are_usage_errors_naming_the_flag(argv, what, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    assert what in capsys.readouterr().err


def test_every_rank_gets_its_layout_and_nvls_off():
    args = parse("--nproc-per-node", "3", "--nnodes", "2", "--node-rank", "1", "--master-port", "29400", "s.py")
    envs = launch.rank_envs(args, base={"NCCL_NVLS_ENABLE": "1", "PATH": "/bin"})
    assert [e["RANK"] for e in envs] == ["3", "4", "5"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    for e in envs:
        assert e["WORLD_SIZE"] == "6" and e["LOCAL_WORLD_SIZE"] == "3" and e["MASTER_PORT"] == "29400"
        assert e["NCCL_NVLS_ENABLE"] == "0"  # forced off, whatever the caller had
        assert e["PATH"] == "/bin" and e["KERNELGEN_DIST_TOKEN"] == envs[0]["KERNELGEN_DIST_TOKEN"]
    single = launch.rank_envs(parse("--nproc-per-node", "2", "s.py"), base={})
    assert 0 < int(single[0]["MASTER_PORT"]) < 65536 and single[0]["MASTER_PORT"] == single[1]["MASTER_PORT"]
    assert launch.command(parse("--nproc-per-node", "2", "-m", "pkg.mod", "a"))[-3:] == ["-m", "pkg.mod", "a"]


def test_all_ranks_succeed(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("import os, sys\nopen(os.path.join(sys.argv[1], os.environ['RANK']), 'w').write("
                      "os.environ['WORLD_SIZE'] + os.environ['NCCL_NVLS_ENABLE'])\n")
    assert launch.main(["--nproc-per-node", "3", str(script), str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "ok.py") == ["0", "1", "2"]
    assert (tmp_path / "2").read_text() == "30"


def test_a_killed_rank_is_named(tmp_path, capsys):
    script = tmp_path / "k.py"
    script.write_text("import os, signal, time\nif os.environ['RANK'] == '2': os.kill(os.getpid(), signal.SIGKILL)\n"
                      "time.sleep(60)\n")
    t = time.monotonic()
    code = launch.main(["--nproc-per-node", "3", str(script)])
    assert code == 128 + signal.SIGKILL and time.monotonic() - t < 30
    assert "rank 2" in capsys.readouterr().err


def test_sigterm_reaches_every_rank(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import os, signal, sys, time\n"
                      "def bye(*_):\n    open(os.path.join(sys.argv[1], 'bye' + os.environ['RANK']), 'w').close()\n"
                      "    sys.exit(0)\nsignal.signal(signal.SIGTERM, bye)\n"
                      "open(os.path.join(sys.argv[1], 'up' + os.environ['RANK']), 'w').close()\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "kernelgen.distributed", "--nproc-per-node", "2", str(script),
                             str(tmp_path)])
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"up{r}").exists() for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert (tmp_path / "bye0").exists() and (tmp_path / "bye1").exists()


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rendezvous_timeout_names_the_missing_rank():
    port, errors = _port(), []
    joiner = threading.Thread(target=lambda: errors.append(_join(1, 3, port)))
    joiner.start()
    with pytest.raises(RendezvousError, match=r"rank\(s\) \[2\] never joined"):
        TCPStore(0, 3, "127.0.0.1", port, "tok", timeout=1.5)
    joiner.join()
    assert isinstance(errors[0], RendezvousError)


def _join(rank, world, port, token="tok"):
    try:
        return TCPStore(rank, world, "127.0.0.1", port, token, timeout=3)
    except RendezvousError as e:
        return e


def test_stray_connection_is_ignored_and_world_size_mismatch_refused():
    port, got = _port(), []
    t = threading.Thread(target=lambda: got.append(_join(1, 2, port)))
    stray = threading.Thread(target=lambda: got.append(_join(1, 2, port, token="other job")))
    t.start(), stray.start()
    store = TCPStore(0, 2, "127.0.0.1", port, "tok", timeout=5, welcome={"uid": [1, 2]})
    t.join(), stray.join()
    good = [s for s in got if isinstance(s, TCPStore)]
    assert len(good) == 1 and good[0].welcome == {"uid": [1, 2]}
    a = np.arange(4, dtype=np.float32)
    b = np.arange(4, dtype=np.float32) * 10
    t = threading.Thread(target=lambda: NumpyCommunicator(good[0]).all_reduce(b))
    t.start()
    NumpyCommunicator(store).all_reduce(a)
    t.join()
    np.testing.assert_array_equal(a, np.arange(4) * 11)
    np.testing.assert_array_equal(b, np.arange(4) * 11)
    store.close(), good[0].close()

    port = _port()
    t = threading.Thread(target=lambda: got.append(_join(1, 3, port)))
    t.start()
    with pytest.raises(RendezvousError, match="WORLD_SIZE 3"):
        TCPStore(0, 2, "127.0.0.1", port, "tok", timeout=5)
    t.join()


def test_init_process_group_reads_the_environment():
    with pytest.raises(RuntimeError, match="RANK is not set"):
        read_env({"WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="RANK must be < WORLD_SIZE"):
        read_env({"WORLD_SIZE": "2", "RANK": "2", "MASTER_PORT": "1"})
    with pytest.raises(ValueError, match="MASTER_PORT"):
        read_env({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "x"})
    with pytest.raises(ValueError, match="backend"):
        init_process_group(backend="gloo", env={"WORLD_SIZE": "1", "RANK": "0"})
    comm = init_process_group(backend="cpu", env={"WORLD_SIZE": "1", "RANK": "0"})
    try:
        assert (comm.rank, comm.world_size) == (0, 1)
        a = np.ones(3, np.float32)
        comm.all_reduce(a, op="avg")
        np.testing.assert_array_equal(a, 1)
    finally:
        destroy_process_group()


def test_nccl_backend_without_cupy_says_what_is_missing():
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="cupy"):
        init_process_group(backend="nccl", env={"WORLD_SIZE": "1", "RANK": "0"})
