"""Server mode on CPU: the loopback weight sync's time per update, toy model and SmolLM2-135M.

Runs in the engine environment (``make setup-vllm``; ``.venv-vllm/bin/python benchmarks/vllm_server_sync.py``);
elsewhere it says so and exits 0. For each model, one after the other: starts ``grpo-variants vllm-serve`` (float32,
eager) on a free port of 127.0.0.1, loads the same checkpoint with transformers (float32), then ``--syncs`` times:
scales every weight by 1.001 and streams all of them to the server with the trainer's client
(``LoopbackVLLMClient.update_named_params``, what ``sync_weights()`` calls). Reports per sync the wall seconds seen by
the trainer, the trainer process's CPU seconds, the server's own seconds (receive + reload + tied-layer
re-processing), the bytes streamed; after the last sync, the largest |log-prob| difference between the server and the
transformers model on a fixed sequence (float32 both: float noise); and, for scale, the seconds ``save_pretrained``
takes to write the same weights (what a sync through the disk would write at every update). The server is stopped
at the end of each model. Writes benchmarks/results/vllm_server_sync.json and .md; the load average is recorded
(the machine is shared: compare the rows of one run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure(name: str, path: str, syncs: int, workdir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_variants.rollout.vllm_server import LoopbackVLLMClient, ServerProcess

    server = ServerProcess(path, log_path=workdir / f"{name}-server.log")
    try:
        started = server.wait_ready()
        client = LoopbackVLLMClient(base_url=server.url)
        client.init_communicator(device="cpu")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        metadata = [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in model.named_parameters()]
        rows = []
        for _ in range(syncs):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.001)
            wall, cpu = time.perf_counter(), time.process_time()
            client.update_named_params(metadata, ((n, p.data) for n, p in model.named_parameters()))
            client.reset_prefix_cache()
            rows.append({"wall_s": time.perf_counter() - wall, "trainer_cpu_s": time.process_time() - cpu,
                         "server_s": client.last_sync["server"]["seconds"], "bytes": client.last_sync["bytes"],
                         "tensors": client.last_sync["tensors"]})
        sequence = [(7 * i + 3) % model.config.vocab_size for i in range(32)]
        served = client.get_sequence_logprobs([sequence], [1], top_logprobs=1)["actual_logprobs"][0]
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0, :-1].float().log_softmax(-1)
        local = logits.gather(1, torch.tensor(sequence[1:]).view(-1, 1)).flatten()
        gap = (torch.tensor([row[0] for row in served]) - local).abs().max().item()
        with tempfile.TemporaryDirectory() as tmp:
            wall = time.perf_counter()
            model.save_pretrained(tmp)
            save_s = time.perf_counter() - wall
        return {"model": name, "server_start_s": started, "syncs": rows, "max_abs_logprob_gap_vs_transformers": gap,
                "save_pretrained_s": save_s}
    finally:
        server.stop()


def write_markdown(results: dict, path: Path) -> None:
    head = (f"grpo-variants vllm-serve (float32, eager), the trainer's client in one process; load average before "
            f"{results['load_average_before'][0]:.1f}, after {results['load_average_after'][0]:.1f} "
            f"({os.cpu_count()} cores).")
    columns = ("| model | MB per sync | tensors | sync wall s (min-max) | trainer CPU s | server s | save_pretrained s "
               "| server start s | max abs log-prob gap, server vs transformers |")
    lines = ["# Server mode on CPU: loopback weight sync per update", "", head, "", columns,
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results["models"]:
        walls = [s["wall_s"] for s in r["syncs"]]
        cpus = [s["trainer_cpu_s"] for s in r["syncs"]]
        servers = [s["server_s"] for s in r["syncs"]]
        lines.append(f"| {r['model']} | {r['syncs'][0]['bytes'] / 1e6:.1f} | {r['syncs'][0]['tensors']} | "
                     f"{min(walls):.2f}-{max(walls):.2f} | {min(cpus):.2f}-{max(cpus):.2f} | "
                     f"{min(servers):.2f}-{max(servers):.2f} | {r['save_pretrained_s']:.2f} | "
                     f"{r['server_start_s']:.0f} | {r['max_abs_logprob_gap_vs_transformers']:.2g} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--models", default="toy,smollm2")
    parser.add_argument("--out", default=str(HERE / "results" / "vllm_server_sync.json"))
    args = parser.parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        print("skipped: vLLM is not installed in this environment; run `make setup-vllm`, then "
              "`.venv-vllm/bin/python benchmarks/vllm_server_sync.py` (docs/vllm.md)")
        return 0
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped benchmark stops its server (finally)
    from grpo_variants.tasks import toy
    from grpo_variants.tasks.models import smollm2

    paths = {"toy": lambda: str(toy.prepare(task="addition", verbose=False).model_path),
             "smollm2": lambda: str(smollm2(verbose=False))}
    results = {"load_average_before": os.getloadavg(), "models": []}
    logs = Path(tempfile.mkdtemp(prefix="vllm_server_sync-"))
    print(f"server logs: {logs}", flush=True)
    for name in args.models.split(","):
        results["models"].append(measure(name, paths[name](), args.syncs, logs))
        print(json.dumps(results["models"][-1]), flush=True)
    results["load_average_after"] = os.getloadavg()
    out = Path(args.out)
    out.write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(results, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
