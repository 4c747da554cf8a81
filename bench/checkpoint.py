"""How long a checkpoint stalls training: synchronous vs asynchronous saves (checkpoint.async).

    python bench/checkpoint.py [--d-model 512] [--layers 4] [--experts 8] [--repeats 3]

One process, the toolkit's own save path (trainer/checkpoint.py begin_save / finish_save) on a
GPT-MoE with AdamW state (weights + 2 moments: what a real checkpoint holds). For each save it
times what the training loop waits for:
  sync   the whole save (DCP write, RNG, trainer.json, manifest with sha256, fsync, rename);
  async  begin_save (the host copy of the state and DCP's planning), then the training steps
         run while the writer thread writes (their slowdown against steps with no save in
         flight is the price of sharing the cores), then finish_save once the write is done
         (the manifest and rename: the part still paid on the main thread).
Prints the medians and the stall ratio. On a GPU the host copy is a device-to-host transfer
into pinned memory and the write never touches the device: the CPU figures here are the
upper bound of the async stall (every byte is also copied once on the host).
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(d_model: int, layers: int, experts: int):
    import models
    from models.config import ModelConfig, MoEConfig
    from parallel.apply import parallelize
    from parallel.plan import ParallelPlan
    m = ModelConfig(vocab_size=256, d_model=d_model, n_layers=layers, n_heads=d_model // 64,
                    d_ff=4 * d_model, max_seq_len=128)
    model = models.init_weights(models.build_model(m, MoEConfig(num_experts=experts, top_k=2)), 0, "cpu")
    par = parallelize(model, ParallelPlan().validate(1))
    opt = torch.optim.AdamW(par.model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (4, 128))

    def step():
        opt.zero_grad(set_to_none=True)
        par.model(x).float().logsumexp(-1).mean().backward()
        opt.step()
    step()  # the optimizer state exists
    return par, opt, step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import warnings

    from trainer import checkpoint
    from trainer.distributed import DistContext
    warnings.filterwarnings("ignore", message=".*assuming the intent is to")
    torch.manual_seed(0)
    par, opt, step = build(args.d_model, args.layers, args.experts)
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "")
    n_params = sum(p.numel() for p in par.model.parameters())
    base = []
    for _ in range(3):
        t = time.perf_counter()
        step()
        base.append(time.perf_counter() - t)
    sync, stall, during, finish, size = [], [], [], [], 0
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.repeats):
            t = time.perf_counter()
            path = checkpoint.save(ctx, d, 2 * i + 1, par, opt, {}, keep=1)
            sync.append(time.perf_counter() - t)
            size = sum(f.stat().st_size for f in path.iterdir())
            t = time.perf_counter()
            pending = checkpoint.begin_save(ctx, d, 2 * i + 2, par, opt, {}, background=True)
            stall.append(time.perf_counter() - t)
            while not pending.written():
                t = time.perf_counter()
                step()
                during.append(time.perf_counter() - t)
            t = time.perf_counter()
            checkpoint.finish_save(ctx, pending, keep=1)
            finish.append(time.perf_counter() - t)
    med = statistics.median
    s, a = med(sync), med(stall) + med(finish)
    print(f"model: {n_params / 1e6:.1f}M parameters, checkpoint {size / 1e6:.0f} MB (weights + AdamW state)")
    print(f"sync save: training waits {s:.2f} s per checkpoint")
    print(f"async save: training waits {med(stall):.2f} s (host copy + planning) + {med(finish):.2f} s "
          f"(manifest, rename) = {a:.2f} s; {len(during)} steps ran during the writes at "
          f"{med(during):.2f} s each vs {med(base):.2f} s without a save in flight")
    print(f"stall ratio async / sync: {a / s:.2f} ({s / a:.1f}x less waiting)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
