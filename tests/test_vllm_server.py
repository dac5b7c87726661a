"""Server mode without CUDA, the parts that need no engine (the engine tier runs the server: tests/test_vllm.py):
the loopback wire format, the construction-time refusals, and the command where vLLM is not installed."""

from __future__ import annotations

import importlib.util
import socket
import threading

import pytest
import torch

from grpo_variants import ConfigError, GRPOVariantConfig
from grpo_variants.rollout.vllm_server import receive_tensors, send_tensors


class _Recording:
    """A socket stand-in that records the size of every write and forwards it."""

    def __init__(self, sock):
        self.sock, self.writes = sock, []

    def sendall(self, data):
        self.writes.append(len(data))
        self.sock.sendall(data)


def test_tensors_cross_the_loopback_stream_exactly_in_bounded_chunks():
    torch.manual_seed(0)
    tensors = [("model.embed_tokens.weight", torch.randn(300, 64)), ("a.bias", torch.randn(7).to(torch.bfloat16)),
               ("b.half", torch.randn(3, 5).half()), ("steps", torch.arange(10)), ("empty", torch.empty(0, 4)),
               ("strided", torch.randn(8, 6).t())]  # non-contiguous: sent as its values
    sender, receiver = socket.socketpair()
    recorder = _Recording(sender)
    result = {}
    thread = threading.Thread(target=lambda: result.update(sent=send_tensors(recorder, iter(tensors), chunk_bytes=4096)))
    thread.start()
    received = list(receive_tensors(receiver))
    thread.join(timeout=30)
    sender.close()
    receiver.close()
    assert [n for n, _ in received] == [n for n, _ in tensors]
    for (_, want), (_, got) in zip(tensors, received, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    assert result["sent"] == (len(tensors), total)
    # bounded: no write larger than a chunk (headers are a few hundred bytes), and the big tensor took several
    assert max(recorder.writes) <= 4096 and len(recorder.writes) > total // 4096


def test_a_stream_written_in_parts_ends_once():
    sender, receiver = socket.socketpair()
    parts = [[("a", torch.ones(3))], [("b", torch.zeros(2, 2)), ("c", torch.arange(4))]]

    def write():
        for part in parts:
            send_tensors(sender, iter(part), end=False)
        send_tensors(sender, iter(()))  # the end mark alone

    thread = threading.Thread(target=write)
    thread.start()
    received = list(receive_tensors(receiver))
    thread.join(timeout=30)
    sender.close()
    receiver.close()
    assert [n for n, _ in received] == ["a", "b", "c"] and torch.equal(received[2][1], torch.arange(4))


def test_a_stream_cut_in_the_middle_of_a_tensor_is_an_error():
    class Sink:
        data = bytearray()

        def sendall(self, chunk):
            self.data += bytes(chunk)

    sink = Sink()
    send_tensors(sink, iter([("w", torch.ones(1000))]))
    a, b = socket.socketpair()
    a.sendall(sink.data[: len(sink.data) // 2])
    a.close()
    with pytest.raises(ConnectionError, match="middle of a tensor"):
        list(receive_tensors(b))
    b.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, server mode uses TRL's NCCL sync to any host")
def test_server_mode_without_cuda_refuses_a_server_on_another_machine():
    with pytest.raises(ConfigError, match="loopback") as info:
        GRPOVariantConfig(output_dir="o", use_vllm=True, vllm_mode="server", vllm_server_base_url="http://10.1.2.3:8000")
    assert "\n" not in str(info.value) and "grpo-variants vllm-serve" in str(info.value)
    with pytest.raises(ConfigError, match="vllm_server_host"):
        GRPOVariantConfig(output_dir="o", use_vllm=True, vllm_mode="server", vllm_server_host="gpu-box")
    for local in ("http://127.0.0.1:8001", "http://localhost:8000"):
        GRPOVariantConfig(output_dir="o", use_vllm=True, vllm_mode="server", vllm_server_base_url=local)
    GRPOVariantConfig(output_dir="o", use_vllm=True, vllm_mode="server")  # TRL's default host, 0.0.0.0: this machine


def test_server_mode_refuses_the_colocated_engine_fields():
    with pytest.raises(ConfigError, match="--enforce-eager") as info:
        GRPOVariantConfig(output_dir="o", use_vllm=True, vllm_mode="server", vllm_enforce_eager=True)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="-- --kv-cache-memory-bytes 268435456") as info:
        GRPOVariantConfig(output_dir="o", use_vllm=True, vllm_mode="server", vllm_kv_cache_memory_bytes=256 << 20)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "256MiB"])
def test_a_kv_cache_size_that_is_not_a_positive_byte_count_is_refused(value):
    with pytest.raises(ConfigError, match=r"vllm_kv_cache_memory_bytes=.* must be a positive number of bytes") as info:
        GRPOVariantConfig(output_dir="o", use_vllm=True, vllm_kv_cache_memory_bytes=value)
    assert "\n" not in str(info.value)
    GRPOVariantConfig(output_dir="o", use_vllm=True, vllm_kv_cache_memory_bytes=256 << 20)  # colocate: taken


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed: the command would serve")
def test_vllm_serve_without_vllm_says_how_to_install_it(capsys):
    from grpo_variants.cli import main

    assert main(["vllm-serve", "--model", "toy"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "vLLM is not installed" in err and "make setup-vllm" in err
