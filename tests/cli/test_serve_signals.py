"""``vtprune serve`` stops its vLLM server: SIGTERM / SIGINT are forwarded to the child, which is waited for (and
killed after a grace period), so the port is free once ``vtprune serve`` has exited. A fake server stands in
for vLLM: it listens on the port and records the signal it got."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vtprune.vllm.serve import run_server

WORKER = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
    "time.sleep(600)\n"
)
FAKE = f"WORKER = {WORKER!r}\n" + """\
import os, signal, socket, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", port))
server.listen()
marker = os.environ["FAKE_MARKER"]
def stop(signum, frame):
    open(marker, "w").write(f"signal {signum}")
    server.close()
    sys.exit(0)
handler = signal.SIG_IGN if os.environ.get("FAKE_IGNORE") else stop
signal.signal(signal.SIGTERM, handler)
signal.signal(signal.SIGINT, handler)
if os.environ.get("FAKE_WORKER"):  # like vLLM's EngineCore: a process of its own that outlives a SIGTERM
    import subprocess
    subprocess.Popen([sys.executable, "-c", WORKER, marker + ".worker"])
    while not os.path.exists(marker + ".worker") or not open(marker + ".worker").read():
        time.sleep(0.05)
open(marker + ".ready", "w").write(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def fake(tmp_path) -> Path:
    """An executable fake server (``FAKE --port P``, or as ``python -m vllm... --port P``)."""
    path = tmp_path / "fake-python"
    path.write_text(f"#!{sys.executable}\n{FAKE}")
    path.chmod(0o755)
    return path


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _wait_for(path: Path, seconds: float = 30.0) -> str:
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return path.read_text()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _signal_self_when_ready(marker: Path, signum: int, sent: list | None = None) -> threading.Thread:
    def send() -> None:
        _wait_for(Path(f"{marker}.ready"), 120)
        if sent is not None:
            sent.append(time.monotonic())
        os.kill(os.getpid(), signum)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_serve_stops_the_server_and_frees_the_port(fake, tmp_path, signum):
    port, marker = _free_port(), tmp_path / "marker"
    _signal_self_when_ready(marker, signum)
    code = run_server([str(fake), "--port", str(port)], {**os.environ, "FAKE_MARKER": str(marker)})
    pid = int(Path(f"{marker}.ready").read_text())
    assert code == 128 + signum
    assert marker.read_text() == f"signal {int(signum)}"  # the server got the same signal
    assert _gone(pid) and _port_is_free(port)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # serve's handlers are removed again


def test_a_server_that_ignores_the_signal_is_killed_after_the_grace_period(fake, tmp_path):
    port, marker = _free_port(), tmp_path / "marker"
    sent: list[float] = []
    _signal_self_when_ready(marker, signal.SIGTERM, sent)
    env = {**os.environ, "FAKE_MARKER": str(marker), "FAKE_IGNORE": "1"}
    code = run_server([str(fake), "--port", str(port)], env, grace_s=0.5)
    pid = int(Path(f"{marker}.ready").read_text())
    # from the signal to the end: the 0.5 s grace and the kill (the server's start-up is not timed)
    assert code == 128 + signal.SIGTERM and time.monotonic() - sent[0] < 20
    assert _gone(pid) and _port_is_free(port) and not marker.exists()


def test_the_server_exit_status_is_serves_own(fake, tmp_path):
    script = tmp_path / "fails"
    script.write_text(f"#!{sys.executable}\nraise SystemExit(3)\n")
    script.chmod(0o755)
    assert run_server([str(script)]) == 3


def test_killing_vtprune_serve_frees_the_port(fake, tmp_path):
    """The whole command: ``vtprune serve FOLDER --port P`` with the fake as vLLM's Python, then SIGTERM."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"]}))
    port, marker = _free_port(), tmp_path / "marker"
    env = {**os.environ, "VTPRUNE_VLLM_PYTHON": str(fake), "FAKE_MARKER": str(marker), "OMP_NUM_THREADS": "1"}
    serve = subprocess.Popen([sys.executable, "-m", "vtprune.cli", "serve", str(folder), "--port", str(port)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid = int(_wait_for(Path(f"{marker}.ready"), 120))
        serve.send_signal(signal.SIGTERM)
        _, err = serve.communicate(timeout=60)
    finally:
        if serve.poll() is None:
            serve.kill()
    assert serve.returncode == 128 + signal.SIGTERM, err
    assert marker.read_text() == f"signal {int(signal.SIGTERM)}" and _gone(pid) and _port_is_free(port), err


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting for its reaper (it holds no memory and no port)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return _gone(pid)
    return state in ("Z", "X")


def test_the_servers_engine_processes_are_killed_with_it(fake, tmp_path):
    """A server that outlives the grace is killed with its whole process group: a worker it started that
    ignores SIGTERM (as vLLM's EngineCore did during start-up) is gone too."""
    port, marker = _free_port(), tmp_path / "marker"
    _signal_self_when_ready(marker, signal.SIGTERM)
    env = {**os.environ, "FAKE_MARKER": str(marker), "FAKE_IGNORE": "1", "FAKE_WORKER": "1"}
    worker = None
    try:
        code = run_server([str(fake), "--port", str(port)], env, grace_s=0.5)
        worker = int(Path(f"{marker}.worker").read_text())
        deadline = time.monotonic() + 30  # SIGKILL is delivered at once; this only bounds a broken test
        while not _dead(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert code == 128 + signal.SIGTERM and _dead(worker) and _port_is_free(port)
    finally:
        if worker is not None and not _dead(worker):
            os.kill(worker, signal.SIGKILL)  # the one process this test started and left behind
