"""Peer launchers: a server comes up on its port, its whole process group goes on exit, and a peer
that cannot start fails with the reason and its log, never silently.

These use a stand-in server (a few lines of Python answering /v1/models, with a child process of
its own, as vLLM has its engine core) so they run in seconds; the real peers are started by the
`vllm_server` / `llamacpp_server` fixtures of conftest.py.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time

import httpx
import pytest

from workbench.external.peers import LlamaCppServer, PeerServer, PeerStartError, free_port, peer_python

FAKE = textwrap.dedent("""
    import http.server, json, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("child", child.pid, flush=True)
    if sys.argv[2] == "crash":
        raise SystemExit("ImportError: no module named vllm._C")
    time.sleep(float(sys.argv[3]))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "fake-model"}]}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def _fake(tmp_path, mode: str = "ok", delay: float = 0.0, **kw) -> PeerServer:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE)
    port = free_port()
    return PeerServer("fake", [sys.executable, str(script), str(port), mode, str(delay)], port=port,
                      log_path=tmp_path / "server.log", status=False, **kw)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its parent is gone for our purposes
        return f.read().split(")")[-1].split()[0] != "Z"


def test_server_answers_on_its_port_and_its_whole_group_is_stopped(tmp_path):
    with _fake(tmp_path, delay=0.5) as srv:
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == "fake-model"
        assert srv.model_id == "fake-model" and srv.startup_s >= 0.5
        leader = srv.proc.pid
        child = int(srv.log_path.read_text().split()[1])
        assert _alive(child)
    deadline = time.monotonic() + 5
    while (_alive(child) or _alive(leader)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(leader) and not _alive(child), "the server's child outlived it"
    srv.stop()  # idempotent


def test_a_crash_at_start_up_fails_with_the_exit_code_and_the_log_tail(tmp_path):
    with pytest.raises(PeerStartError) as err:
        _fake(tmp_path, mode="crash").start()
    assert "exited with code 1" in str(err.value)
    assert "no module named vllm._C" in err.value.log_tail
    child = int(err.value.log_tail.split()[1])
    time.sleep(0.2)
    assert not _alive(child)


def test_a_server_that_never_answers_times_out_in_bounded_time(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(PeerStartError, match="did not answer within 1 s"):
        _fake(tmp_path, delay=60, start_timeout=1.0).start()
    assert time.monotonic() - t0 < 15


def test_missing_venv_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_LLAMACPP_PYTHON", str(tmp_path / "nowhere" / "python"))
    assert peer_python("llamacpp") == tmp_path / "nowhere" / "python"
    with pytest.raises(PeerStartError, match="make peers"):
        LlamaCppServer(tmp_path / "model.gguf").start()
    with pytest.raises(ValueError, match="allowed"):
        peer_python("sglang")


def test_a_server_that_dies_later_is_reported_with_its_exit_status_and_log(tmp_path):
    with _fake(tmp_path) as srv:
        assert srv.check_alive() is srv
        os.kill(srv.proc.pid, 9)
        srv.proc.wait(5)
        with pytest.raises(PeerStartError, match="not running .exit status -9") as err:
            srv.check_alive()
        assert "child" in err.value.log_tail
