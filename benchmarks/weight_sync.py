"""Weight sync trainer -> engine through each path of `ray.weight_sync`, in one run (issue 17).

    python benchmarks/weight_sync.py --out DIR                # Qwen3-0.6B shape, real 151,936 vocabulary, 2 GPUs
    python benchmarks/weight_sync.py --tiny --out /tmp/ws     # CPU smoke test (gloo broadcast, object store)
    python benchmarks/weight_sync.py --local --out DIR        # the local backend: host state dict vs on-device

Two Ray actors: a "trainer" holding fp32 weights (as the trainer's master weights) and an "engine" holding
a bf16 copy (as a rollout engine on a GPU), on different GPUs for `broadcast` and `object_store`, on one
GPU (half each) for `ipc`. Each path moves every tensor and loads it into the engine model with copy_,
through the backend's own code (agentopd.backends.weight_sync; the object-store path as
RayBackend._sync_object_store: a full fp32 state dict on the host through Ray's store). The engine's
weights are checked against the trainer's after every path. Seconds are the best of --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

SHAPES = {  # hidden, layers, heads, kv heads, head_dim, intermediate, vocab
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144, 151936),
    "tiny": (64, 2, 2, 1, 32, 128, 1000),
}


def model(shape: str, dtype: torch.dtype, device: str, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    h, layers, heads, kv, hd, inter, vocab = SHAPES[shape]
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=hd, intermediate_size=inter, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen3ForCausalLM(cfg).to(dtype)


class Side:
    """One end of the sync: the trainer (fp32) or the engine (bf16 on a GPU, fp32 on CPU)."""

    def __init__(self, shape: str, role: str):
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.float32 if role == "trainer" or self.device == "cpu" else torch.bfloat16
        self.model = model(shape, dtype, self.device, seed=0 if role == "trainer" else 1)
        self.dtype = torch.bfloat16 if self.device == "cuda" else torch.float32  # what engines hold
        self.group = self.store = self.shared = None

    def layout(self):
        from agentopd.backends.weight_sync import WeightLayout

        return WeightLayout.of(self.model, self.dtype)

    def host(self, world: int):
        from agentopd.backends.weight_sync import WeightGroup

        self.store, addr, port = WeightGroup.host(world)
        return addr, port

    def join(self, addr: str, port: int, rank: int, world: int) -> None:
        from agentopd.backends.weight_sync import WeightGroup

        self.group = WeightGroup.join(addr, port, rank, world, torch.device(self.device), store=self.store)

    def _named(self):
        from agentopd.trainer.checkpoint import unique_state

        return ((name, t.detach()) for name, t, first in unique_state(self.model) if name == first)

    def _load(self, state_dict) -> float:
        own = self.model.state_dict()
        with torch.no_grad():
            for name, t in state_dict.items():
                own[name].copy_(t)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    # broadcast
    def send(self, layout) -> float:
        self.group.send(layout, self._named())
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def receive(self, layout) -> float:
        return self._load(self.group.receive(layout))

    # object store (RayBackend._sync_object_store: a full fp32 state dict on the host)
    def host_state_dict(self) -> dict:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def load(self, state_dict) -> float:
        return self._load(state_dict)

    # ipc
    def share(self, layout):
        from agentopd.backends.weight_sync import flatten, ipc_handle

        self.shared = flatten(layout, self._named(), torch.device(self.device))
        torch.cuda.synchronize()
        return ipc_handle(self.shared)

    def load_ipc(self, handle, layout) -> float:
        from agentopd.backends.weight_sync import from_ipc

        return self._load(layout.views(from_ipc(handle)))

    def unshare(self) -> None:
        self.shared = None

    def checksum(self) -> float:
        return float(sum(p.detach().float().sum() for p in self.model.parameters()))

    def gpu(self) -> list:
        import ray

        return [str(g) for g in ray.get_gpu_ids()]


def local_paths(shape: str, repeats: int) -> list[dict]:
    """The local backend's sync in one process (trainer and fast engine on one device): the host state dict
    (`Trainer.state_dict_for_engine`, what LocalBackend did) against the parameters on the device
    (`Trainer.full_tensors`, what it does on a GPU now), each loaded by `FastEngine.update_weights`."""
    import asyncio

    from agentopd.engines.fast.engine import FastEngine
    from agentopd.trainer import Trainer, TrainerConfig

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m = model(shape, torch.float32, "cpu", seed=0)
    engine_model = model(shape, torch.float32, "cpu", seed=1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    engine = FastEngine(engine_model, device=device, dtype=dtype, max_batch_size=8, max_model_len=2048, kv_cache_gb=1.0, cuda_graphs=False)
    trainer = Trainer(m, TrainerConfig(), device=device)
    loop = asyncio.new_event_loop()

    def host() -> float:
        t0 = time.perf_counter()
        loop.run_until_complete(engine.update_weights(trainer.state_dict_for_engine()))
        return time.perf_counter() - t0

    def on_device() -> float:
        t0 = time.perf_counter()
        loop.run_until_complete(engine.update_weights(dict(trainer.full_tensors())))
        return time.perf_counter() - t0

    rows = []
    for name, fn in (("local: host state dict (before)", host), ("local: parameters on the device (now)", on_device)):
        fn()
        best = min(fn() for _ in range(repeats))
        want = trainer.hf.state_dict()["model.layers.0.mlp.up_proj.weight"].to(dtype)
        same = torch.equal(engine.runner.params["model.layers.0.mlp.up_proj.weight"].cpu(), want.cpu())
        rows.append({"path": name, "gpus": str(device), "seconds": best, "rel_diff": 0.0 if same else 1.0})
    loop.run_until_complete(engine.close())
    loop.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--shape", default="qwen3-0.6b", choices=SHAPES)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--local", action="store_true", help="only the local backend's two paths (no Ray)")
    args = ap.parse_args()
    shape = "tiny" if args.tiny else args.shape
    gpus = torch.cuda.device_count()
    if args.local:
        from agentopd.backends.weight_sync import WeightLayout

        rows = local_paths(shape, args.repeats)
        layout = WeightLayout.of(model(shape, torch.float32, "meta", seed=0), torch.bfloat16 if gpus else torch.float32)
        return report(args, shape, rows, layout, gpus, suffix="_local")
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(include_dashboard=False, log_to_driver=True, num_cpus=4)
    remote = ray.remote(Side)
    rows = []

    def pair(gpu_each: float):
        opts = {"num_cpus": 1, "num_gpus": gpu_each}
        trainer, engine = remote.options(**opts).remote(shape, "trainer"), remote.options(**opts).remote(shape, "engine")
        return trainer, engine, ray.get([trainer.gpu.remote(), engine.gpu.remote()])

    def check(trainer, engine) -> float:
        a, b = ray.get([trainer.checksum.remote(), engine.checksum.remote()])
        return abs(a - b) / max(abs(a), 1e-9)

    def best(fn) -> float:
        return min(fn() for _ in range(args.repeats))

    # broadcast and object store: trainer and engine on GPUs of their own
    trainer, engine, where = pair(1.0 if gpus >= 2 else 0.0)
    layout = ray.get(trainer.layout.remote())
    world = 2
    addr, port = ray.get(trainer.host.remote(world))
    ray.get([trainer.join.remote(addr, port, 0, world), engine.join.remote(addr, port, 1, world)])

    def broadcast() -> float:
        t0 = time.perf_counter()
        ray.get([trainer.send.remote(layout), engine.receive.remote(layout)])
        return time.perf_counter() - t0

    def object_store() -> float:
        t0 = time.perf_counter()
        ref = trainer.host_state_dict.remote()
        ray.get(ref)  # the gather (rank 0's host copy) is part of the path
        ray.get(engine.load.remote(ref))
        return time.perf_counter() - t0

    for name, fn in (("broadcast", broadcast), ("object_store", object_store)):
        fn()  # warm-up (NCCL communicator set-up, allocator)
        rows.append({"path": name, "gpus": where, "seconds": best(fn), "rel_diff": check(trainer, engine)})
    ray.kill(trainer)
    ray.kill(engine)

    if gpus >= 1:  # ipc: one GPU, half each
        trainer, engine, where = pair(0.5)

        def ipc() -> float:
            t0 = time.perf_counter()
            handle = ray.get(trainer.share.remote(layout))
            ray.get(engine.load_ipc.remote(handle, layout))
            ray.get(trainer.unshare.remote())
            return time.perf_counter() - t0

        ipc()
        rows.append({"path": "ipc", "gpus": where, "seconds": best(ipc), "rel_diff": check(trainer, engine)})

    report(args, shape, rows, layout, gpus)
    ray.shutdown()


def report(args, shape: str, rows: list[dict], layout, gpus: int, suffix: str = "") -> None:
    params = layout.numel
    dev = torch.cuda.get_device_name() if gpus else "cpu"
    title = f"# Weight sync trainer -> engine, {shape} ({params / 1e6:.0f}M parameters, {layout.nbytes / 2**20:,.0f} MiB in {layout.dtype}), {dev}"
    header = f"| path | GPUs (trainer, engine) | seconds (best of {args.repeats}) | GB/s of engine weights | engine vs trainer checksum |"
    lines = [title, "", f"command: `python benchmarks/weight_sync.py {' '.join(sys.argv[1:])}`", "", header, "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['path']} | {r['gpus']} | {r['seconds']:.3f} | {layout.nbytes / r['seconds'] / 1e9:.1f} | {r['rel_diff']:.1e} |")
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"weight_sync_{shape}{suffix}.md").write_text(text + "\n")
    (args.out / f"weight_sync_{shape}{suffix}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
