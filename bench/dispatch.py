"""Benchmark: bytes of the expert all-to-all per token per MoE layer, and step time, for each
moe.dispatch_dtype (moe/wire.py), against the fp32 rows moekit sent before it existed.

Shapes: T tokens per rank, D model dim (DeepSeek-V3's h = 7168), F expert d_ff (small: the
subject is the exchange), E experts, K top-k, P ranks.

Measured (P spawned processes, gloo on CPU; NCCL with one GPU per rank): one MoELayer with
its experts over the P ranks, forward + backward. Per mode:
  B/token    the ledger's expert_all_to_all bytes this rank handed over (dispatch and
             combine, forward and backward; the count table included) per token
  ratio      B/token over fp32's, and the planner's ratio from parallel/planner/comm.py's
             a2a_row_bytes (they must agree)
  step ms    median wall time of forward + backward (slowest rank); 2 shared CPU cores time
             the casts and the copies, not a network: read the bytes
  err        the layer output's relative error against the bf16 mode, ||y - y_bf16|| /
             ||y_bf16|| (the same weights and tokens)
Every mode runs under bf16 autocast (the experts compute in bf16), so only the wire differs:
fp32 is what moekit sent before the option, auto resolves to bf16.
Then the planner's figure for a whole model: DeepSeek-V3 (top-8 of 256 experts, EP64 over 8
nodes of 8 GPUs, uniform routing: 7/8 of a token's copies go to another node) in bytes per
token per MoE layer across nodes, forward + backward, for each mode. The issue's 401 KB for
bf16 is this count.

Second table, node-aware dispatch (moe.dispatch, moe.max_nodes): 8 ranks declared as 8
nodes of one rank (parallel.gpus_per_node=1), 8 experts each (E=64), top-8, D=7168: per mode
  B/token across  the ledger's bytes to other nodes (take_a2a_nodes: every all-to-all of the
             layer, forward and backward, count tables included) per token, over all ranks
  ratio      over flat fp32's
  planner    parallel/planner/expert_nodes.py's across-node bytes per token for this shape,
             given the measured nodes per token (nu), over its flat fp32 figure
  nu         distinct nodes a token's experts lie on (measured from the routing)
  step ms, err vs bf16   as above (err against flat bf16: hierarchical changes the combine's
             summation order; max_nodes changes the routing itself, so its err is not a wire
             error)
Then the planner's DeepSeek-V3 figure (EP64 over 8 nodes, 256 experts, uniform routing) per
token per MoE layer across nodes for the same modes.

Run:  python bench/dispatch.py            (P=2, T=256, D=7168, F=64, E=16, K=8; then P=8,
                                           T=128, E=64; ~3 minutes)
      python bench/dispatch.py --quick    (D=512, T=64; seconds)
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe import MoELayer  # noqa: E402
from parallel.expert import apply_expert_parallel  # noqa: E402
from parallel.ledger import CommLedger  # noqa: E402
from moe.nodes import expert_nodes  # noqa: E402
from parallel.planner.comm import a2a_row_bytes  # noqa: E402
from parallel.planner.expert_nodes import EpNodes, expert_a2a_bytes  # noqa: E402
from tests.dist.harness import run_distributed  # noqa: E402

MODES = ("fp32", "bf16", "fp8", "auto")  # auto under bf16 autocast


def _timed(layer, x, ledger, cfg, dev):
    """(the last output, median seconds of forward + backward over the measured iterations);
    the ledger holds the last iteration's bytes (each iteration takes the previous ones)."""
    times = []
    for it in range(cfg["warmup"] + cfg["iters"]):
        ledger.take(), ledger.take_a2a_nodes()
        dist.barrier()
        t0 = time.perf_counter()
        with ledger.recording(), torch.autocast(dev.type, dtype=torch.bfloat16):
            y = layer(x)
            y.float().square().mean().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if it >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
    return y, statistics.median(times)


def _worker(rank, world, cfg):
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg["T"] // 16, 16, cfg["D"], generator=g).to(dev).requires_grad_()
    out, ys = {}, {}
    for mode in MODES:
        torch.manual_seed(0)
        layer = MoELayer(cfg["D"], cfg["F"], cfg["E"], top_k=cfg["K"], activation="swiglu",
                         dispatch_dtype=mode).to(dev)
        apply_expert_parallel(layer, dist.group.WORLD)
        ledger = CommLedger({"ep": dist.group.WORLD})
        y, step = _timed(layer, x, ledger, cfg, dev)
        ys[mode] = y.detach().float()
        out[mode] = dict(bytes=ledger.take().get("expert_all_to_all", 0), step=step)
    for mode in MODES:
        out[mode]["err"] = float((ys[mode] - ys["bf16"]).norm() / ys["bf16"].norm())
    return out


NODE_MODES = (("flat", "fp32", 0), ("flat", "bf16", 0), ("flat", "fp8", 0),
              ("hierarchical", "bf16", 0), ("hierarchical", "fp8", 0), ("hierarchical", "fp8", 4))


def _node_worker(rank, world, cfg):
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg["T"] // 16, 16, cfg["D"], generator=g).to(dev).requires_grad_()
    nodes = expert_nodes(range(world), 1)
    out, ys = {}, {}
    for mode in NODE_MODES:
        dispatch, wire, M = mode
        torch.manual_seed(0)
        layer = MoELayer(cfg["D"], cfg["F"], cfg["E"], top_k=cfg["K"], activation="swiglu",
                         dispatch_dtype=wire, dispatch=dispatch, max_nodes=M or None).to(dev)
        apply_expert_parallel(layer, dist.group.WORLD, ranks_per_node=1)
        ledger = CommLedger({"ep": dist.group.WORLD}, ranks_per_node=1)
        y, step = _timed(layer, x, ledger, cfg, dev)
        split = ledger.take_a2a_nodes().get("expert_all_to_all", {})
        ids = layer.router(x.detach().reshape(-1, 16, cfg["D"]), None).expert_A.view(-1, cfg["K"])
        node_TK = ids // (cfg["E"] // nodes.num_nodes)
        nu = float(sum(len(set(r)) for r in node_TK.tolist())) / node_TK.shape[0]
        ys[mode] = y.detach().float()
        out[mode] = dict(inter=sum(split.get("inter_node", {}).values()), nu=nu, step=step)
    base = ys[("flat", "bf16", 0)]
    for mode in NODE_MODES:
        out[mode]["err"] = float((ys[mode] - base).norm() / base.norm())
    return out


def _planner_inter(mode, P, E, K, D, nu, tokens=4096) -> float:
    """expert_nodes.py's across-node bytes per token (one rank per node: f = 1/P)."""
    dispatch, wire, _ = mode
    rows = a2a_row_bytes(wire, "bf16", D)
    return expert_a2a_bytes(dispatch, tokens, tokens * K, 1.0, nu, EpNodes(P, 1, P), E, rows, 1)[1] / tokens


def _node_table(P: int, cfg: dict) -> None:
    print(f"\nnode-aware dispatch: P={P} ranks as {P} declared nodes, T={cfg['T']}/rank D={cfg['D']} "
          f"E={cfg['E']} K={cfg['K']}, bf16 autocast")
    results = run_distributed(_node_worker, P, cfg, timeout=1800)
    first = NODE_MODES[0]
    base = sum(r[first]["inter"] for r in results)
    nu0 = sum(r[first]["nu"] for r in results) / P
    plan0 = _planner_inter(first, P, cfg["E"], cfg["K"], cfg["D"], nu0)
    print(f"{'dispatch':<13} {'wire':<5} {'max_nodes':>9} {'B/token across':>15} {'ratio':>7} "
          f"{'planner':>8} {'nu':>5} {'step ms':>8} {'err vs bf16':>12}")
    for mode in NODE_MODES:
        inter = sum(r[mode]["inter"] for r in results)
        nu = sum(r[mode]["nu"] for r in results) / P
        planner = _planner_inter(mode, P, cfg["E"], cfg["K"], cfg["D"], nu) / plan0
        step = max(r[mode]["step"] for r in results)
        print(f"{mode[0]:<13} {mode[1]:<5} {mode[2] or '-':>9} {inter / (P * cfg['T']):>15.0f} "
              f"{inter / base:>7.3f} {planner:>8.3f} {nu:>5.2f} {step * 1e3:>8.1f} "
              f"{results[0][mode]['err']:>12.2e}")


def _deepseek_v3_nodes() -> None:
    """The planner's DeepSeek-V3 figure per token per MoE layer across nodes, each node mode."""
    from types import SimpleNamespace

    from parallel.planner.expert_nodes import nodes_per_token
    ep = EpNodes(64, 8, 8)
    print("planner, DeepSeek-V3 (EP64 over 8 nodes of 8 GPUs, 256 experts, top-8, uniform "
          "routing): bytes per token per MoE layer across nodes, forward + backward")
    for mode in NODE_MODES:
        moe = SimpleNamespace(num_experts=256, top_k=8, max_nodes=mode[2])
        nu = nodes_per_token(SimpleNamespace(moe_cfg=moe, nodes_per_token=0), ep)
        rows = a2a_row_bytes(mode[1], "bf16", 7168)
        inter = expert_a2a_bytes(mode[0], 4096, 4096 * 8, 1.0, nu, ep, 256, rows, 1)[1] / 4096
        print(f"  {mode[0]:<13} {mode[1]:<5} max_nodes {mode[2] or '-':<2} nu {nu:.2f}  "
              f"{inter / 1e3:>7.1f} KB")


def _deepseek_v3_table() -> None:
    D, K, remote = 7168, 8, 7 / 8
    print(f"\nplanner, DeepSeek-V3 (h={D}, top-{K}, EP64 over 8 nodes, uniform routing): "
          f"bytes per token per MoE layer across nodes, forward + backward")
    base = None
    for mode, precision in (("fp32", "fp32"), ("auto", "bf16"), ("fp8", "bf16")):
        disp, comb, bwd = a2a_row_bytes(mode, precision, D)
        per_token = K * remote * (disp + comb + 2 * bwd)
        base = base or per_token
        print(f"  {mode:<5} under {precision:<5} {per_token / 1e3:>8.1f} KB  {per_token / base:.3f} of fp32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="toy sizes, seconds")
    ap.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    args = ap.parse_args()
    cfg = dict(T=256, D=7168, F=64, E=16, K=8, warmup=1, iters=3)
    if args.quick:
        cfg.update(T=64, D=512, warmup=1, iters=2)
    P = args.world
    print(f"P={P} T={cfg['T']}/rank D={cfg['D']} F={cfg['F']} E={cfg['E']} K={cfg['K']} swiglu, "
          f"fwd+bwd, median of {cfg['iters']} (slowest rank); every mode under bf16 autocast")
    results = run_distributed(_worker, P, cfg, timeout=900)
    table = P * cfg["E"] * 8   # each rank's count exchange

    def rows_bytes(mode):  # all ranks: rows sent = rows received, whatever the routing
        return sum(r[mode]["bytes"] - table for r in results)
    base = rows_bytes("fp32")
    f32 = a2a_row_bytes("fp32", "fp32", cfg["D"])
    print(f"{'mode':<6} {'B/token':>10} {'ratio':>7} {'planner':>8} {'step ms':>8} {'err vs bf16':>12}")
    for mode in MODES:
        disp, comb, bwd = a2a_row_bytes(mode, "bf16", cfg["D"])
        planner = (disp + comb + 2 * bwd) / (f32[0] + f32[1] + 2 * f32[2])
        step = max(r[mode]["step"] for r in results)
        print(f"{mode:<6} {rows_bytes(mode) / (P * cfg['T']):>10.0f} {rows_bytes(mode) / base:>7.3f} "
              f"{planner:>8.3f} {step * 1e3:>8.1f} {results[0][mode]['err']:>12.2e}")
    _deepseek_v3_table()
    node_cfg = dict(cfg, T=128 if not args.quick else 32, E=64)
    _node_table(8, node_cfg)
    _deepseek_v3_nodes()


if __name__ == "__main__":
    main()
