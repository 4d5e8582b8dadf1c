"""Peers for side-by-side benchmarks: vLLM's own OpenAI server and vLLM's agentic-api gateway.

Both on the same model, KV size, block size and CPU threads as loopserve's engine
(`VLLM_CPU_OMP_THREADS_BIND` set to every core: by default vLLM's server keeps one core
for its API process and computes on the rest, which would measure thread counts).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator, Optional

from cluster.bench.local import free_port

# vLLM's own server (its process and its children get the torch-extension guard through
# `expand_startup_env`; the `vllm` console script looks up a distribution vllm-cpu lacks).
_PEER_MAIN = ("import sys, runpy; sys.argv[0] = 'vllm-api-server'; "
              "runpy.run_module('vllm.entrypoints.openai.api_server', run_name='__main__', alter_sys=True)")


def _wait(url: str, proc: subprocess.Popen, what: str, timeout: float = 600) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited during start-up (code {proc.returncode})")
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not answer in {timeout:.0f}s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextmanager
def _served(cmd: list[str], env: dict[str, str], port: int, what: str, log_path: Optional[str]) -> Iterator[str]:
    """A server process in its own session, answered on /health, stopped (and waited for) on exit."""
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url + "/health", proc, what)
        yield url
    finally:
        _stop(proc)
        if log is not subprocess.DEVNULL:
            log.close()


@contextmanager
def vllm_server(model_dir: str, *, served_name: str, max_len: int, block_size: int = 32, kv_gib: int = 1,
                dtype: str = "auto", kv_blocks: Optional[int] = None, eager: bool = True,
                log_path: Optional[str] = None, threads_bind: Optional[str] = None) -> Iterator[str]:
    """vLLM's own server (`/v1/responses` with its store on); yields its base URL. `eager`: no graph
    capture (`--enforce-eager`), as loopserve's engine runs on a CPU unless its config says otherwise.
    `threads_bind`: its VLLM_CPU_OMP_THREADS_BIND (default: every core; "auto" is vLLM's own default)."""
    from cluster.torch_extras import expand_startup_env

    port = free_port()
    threads = threads_bind or f"0-{(os.cpu_count() or 1) - 1}"
    # As vLLM's server starts on its own: no OpenMP count from the benchmark's process (vLLM sizes its
    # worker's pool from the binding; one inherited would also size its other processes' pools).
    inherited = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env = expand_startup_env({**inherited, "VLLM_ENABLE_RESPONSES_API_STORE": "1",
                              "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": threads})
    cmd = [sys.executable, "-c", _PEER_MAIN, "--model", model_dir, "--port", str(port), "--host", "127.0.0.1",
           "--served-model-name", served_name, "--dtype", dtype, "--max-model-len", str(max_len),
           "--enable-prefix-caching", "--block-size", str(block_size), "--seed", "0"]
    cmd += ["--num-gpu-blocks-override", str(kv_blocks)] if kv_blocks else []
    cmd += ["--enforce-eager"] if eager else []
    with _served(cmd, env, port, "vLLM's server", log_path) as url:
        yield url


@contextmanager
def agentic_api(vllm_url: str, log_path: Optional[str] = None) -> Iterator[str]:
    """vLLM's agentic-api gateway (Responses API, HTTP and WebSocket mode) in front of `vllm_url`."""
    exe = shutil.which("agentic-api") or os.path.join(os.path.dirname(sys.executable), "agentic-api")
    if not os.path.exists(exe):
        raise RuntimeError("agentic-api is not installed (pip install agentic-api==0.9.0)")
    home = tempfile.mkdtemp(prefix="agentic-api-")
    port = free_port()
    env = {**os.environ, "AGENTIC_API_HOME": home, "DATABASE_URL": f"sqlite://{home}/store.db?mode=rwc",
           "OPENAI_API_KEY": os.environ.get("OPENAI_API_KEY", "sk-local")}
    cmd = [exe, "serve", "--vllm-base-url", vllm_url + "/v1", "--host", "127.0.0.1", "--port", str(port)]
    try:
        with _served(cmd, env, port, "agentic-api", log_path) as url:
            yield url
    finally:
        shutil.rmtree(home, ignore_errors=True)


_METRIC = re.compile(r"^(vllm:[a-z_:]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$")


def vllm_metrics(url: str) -> dict[str, float]:
    """vLLM's Prometheus counters summed over labels (preemptions, queue time, prefix-cache hits)."""
    import httpx

    out: dict[str, float] = {}
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out
