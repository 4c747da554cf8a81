"""The ZeRO family side by side: communication, model-state placement and loss per layout.

    python bench/zero_family.py [--worlds 2 4] [--steps 10] [--d-model 64]

Each layout trains the same MoE GPT (4 layers, MoE every 2nd, 4 experts top-2) from the same
weights on the same global batches for --steps steps with all ranks as data parallel (dp=W):
ZeRO 0-3, each offload mode, ZeRO++ qwZ / qgZ / hpZ, and Adafactor (plain, ZeRO-3, ZeRO-3
offloaded). Printed for rank 0:
  comm MB/step   the communication ledger's bytes of the last step by kind (gather = ZeRO
                 parameter all-gathers, rs = gradient reduce-scatters, ar = all-reduces);
                 xnode = gather bytes whose group spans nodes, with the W ranks treated as
                 nodes of 2 (LOCAL_WORLD_SIZE=2, as torchrun on 2-GPU nodes would say)
  state MB       model_state_bytes of the first step: params / grads / optimizer (fp32
                 masters included) and the device they are on; "host" marks the offloaded
                 optimizer, whose tensors live on the host device (here the training device
                 is the CPU too, so both are "cpu")
  dloss          max over steps of |loss - baseline| / baseline, the baseline being ZeRO-0
                 with the same optimizer at the same world
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.config import ModelConfig, MoEConfig  # noqa: E402
from trainer.memory import model_state_bytes  # noqa: E402
from tests.dist import dense_common as dc  # noqa: E402
from tests.dist.harness import run_distributed  # noqa: E402
from optim.adafactor import Adafactor  # noqa: E402


def _layouts(world):
    z = lambda **kw: dict(dp=world, **kw)  # noqa: E731
    rows = [("zero0", z(), "adamw"), ("zero1", z(zero=1), "adamw"), ("zero2", z(zero=2), "adamw"),
            ("zero3", z(zero=3), "adamw"),
            ("zero1 offload=opt", z(zero=1, offload="optimizer"), "adamw"),
            ("zero2 offload=opt", z(zero=2, offload="optimizer"), "adamw"),
            ("zero3 offload=opt", z(zero=3, offload="optimizer"), "adamw"),
            ("zero3 offload=params", z(zero=3, offload="params"), "adamw"),
            ("zero3 qwZ", z(zero=3, zeropp_quantize_weights=True), "adamw"),
            ("zero2 qgZ", z(zero=2, zeropp_quantize_grads=True), "adamw"),
            ("zero3 qgZ", z(zero=3, zeropp_quantize_grads=True), "adamw"),
            ("zero3 qwZ+qgZ", z(zero=3, zeropp_quantize_weights=True, zeropp_quantize_grads=True), "adamw")]
    if world >= 4:
        rows += [("zero3 hpZ=2", z(zero=3, zeropp_hpz=2), "adamw"),
                 ("zero3 hpZ=2+qwZ", z(zero=3, zeropp_hpz=2, zeropp_quantize_weights=True), "adamw")]
    rows += [("adafactor zero0", z(), "adafactor"), ("adafactor zero3", z(zero=3), "adafactor"),
             ("adafactor zero3 offload=opt", z(zero=3, offload="optimizer"), "adafactor")]
    return rows


def _configs(d_model):
    model_cfg = ModelConfig(vocab_size=64, d_model=d_model, n_layers=4, n_heads=4, d_ff=2 * d_model,
                            max_seq_len=dc.S)
    return model_cfg, MoEConfig(num_experts=4, top_k=2, every=2)


def _adafactor(params):
    return Adafactor(params, lr=dc.LR)


def _worker(rank, world, layouts, steps, d_model):
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    out = {}
    for name, spec, opt in layouts:
        seen = {}

        def inspect(par, optimizer, step, comm):
            seen["comm"], seen["xnode"] = comm, par.ledger.take_inter_node()
            if step == 0:
                seen["state"] = model_state_bytes(par.model, par.grads(), optimizer)
        make = _adafactor if opt == "adafactor" else dc.adamw
        losses = dc.train_layout(world, spec, *_configs(d_model), inspect=inspect, steps=steps,
                                 make_optimizer=make)
        out[name] = {"losses": [loss for loss, _ in losses], **seen}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--d-model", type=int, default=64)
    args = ap.parse_args()
    mb = 2 ** 20
    kinds = {"gather": "zero_param_gather", "rs": "zero_grad_reduce_scatter", "ar": "dp_grad_reduce",
             "a2a": "expert_all_to_all"}
    print(f"{'W':>2} {'layout':<28}{'comm MB/step:':>14}" + "".join(f"{k:>8}" for k in kinds)
          + f"{'xnode':>8}{'state MB:':>11}{'params':>8}{'grads':>8}{'optim':>8}  {'where':<10}{'dloss':>9}")
    for world in args.worlds:
        layouts = _layouts(world)
        res = run_distributed(_worker, world, layouts, args.steps, args.d_model, timeout=1200)[0]
        for name, spec, opt in layouts:
            r = res[name]
            base = res["zero0" if opt == "adamw" else "adafactor zero0"]["losses"]
            dloss = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], base))
            st = {k: sum(v.values()) for k, v in r["state"].items()}
            where = "host" if spec.get("offload", "none") != "none" else "device"
            where += "/" + ",".join(sorted(r["state"]["optimizer"]))
            print(f"{world:>2} {name:<28}{'':>14}" + "".join(f"{r['comm'].get(k, 0) / mb:>8.3f}" for k in kinds.values())
                  + f"{r['xnode'].get('zero_param_gather', 0) / mb:>8.3f}{'':>11}"
                  + f"{st['params'] / mb:>8.3f}{st['grads'] / mb:>8.3f}{st['optimizer'] / mb:>8.3f}  {where:<10}{dloss:>9.1e}")


if __name__ == "__main__":
    main()
