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

FAKE = """\
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
