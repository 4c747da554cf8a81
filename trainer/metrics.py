"""Run logging on rank 0: run.dir/metrics.jsonl (one object per optimizer step), TensorBoard
scalars and per-MoE-layer routing statistics, and a progress bar (TTY) or plain lines.

E experts. Other ranks get the same object with every method a no-op.
"""
import json
import sys
import time
from pathlib import Path


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _progress_mode(kind: str) -> str:
    if kind == "auto":
        return "bar" if sys.stderr.isatty() else "plain"
    return kind


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop records after `last_step` (steps a resumed run will redo)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= last_step:
                keep.append(line)
        except json.JSONDecodeError:
            pass  # a line torn by a crash
    path.write_text("".join(k + "\n" for k in keep))


class MetricsLogger:
    def __init__(self, run_dir, log_cfg, total_steps: int, start_step: int, enabled: bool):
        self.enabled, self.cfg, self.total = enabled, log_cfg, total_steps
        self.start_step, self.t0 = start_step, time.perf_counter()
        self.bar = self.tb = self.jsonl = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        path = run_dir / "metrics.jsonl"
        truncate_jsonl(path, start_step)
        self.jsonl = open(path, "a")
        if log_cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1)
        self.mode = _progress_mode(log_cfg.progress)
        if self.mode == "bar":
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step",
                            dynamic_ncols=True, file=sys.stderr)

    def info(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        elif self.mode != "none":
            print(msg, flush=True)

    def log_step(self, record: dict) -> None:
        """record: step, loss, aux_loss, (mtp_loss_1 ... mtp_loss_K: each multi-token prediction
        depth's cross entropy, with model.mtp_depth), lr, grad_norm (None for a skipped step), tokens_per_s,
        tflops (model TFLOP/s per rank; + mfu where a peak is known, trainer/telemetry.py),
        comm_bytes {kind: bytes} (+ val_loss; comm_bytes_inter_node when the ledger knows of
        several nodes; comm_bytes_a2a_nodes {kind: {intra_node|inter_node: {dtype: bytes}}}
        of the all-to-alls, by where each peer sits; model_state_bytes on the first step; peak_mem_bytes on the measured
        steps, log.peak_mem_every, with peak_mem_reserved_bytes on CUDA; under fp16
        loss_scale and skipped; under parallel.a2a_overlap=1f1b a2a_exposed_s, the seconds the
        step's expert all-to-alls were waited for after the other micro-batch ran (on CUDA the
        stream's stall, timed by events; on gloo the host's wait), a2a_waits
        and a2a_handed, how many waits there were and how many handed over to it)."""
        if not self.enabled:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        step = record["step"]
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    tag = "val/loss" if k == "val_loss" else f"train/{k}"
                    self.tb.add_scalar(tag, v, step)
            for kind, n in record.get("comm_bytes", {}).items():
                self.tb.add_scalar(f"comm_bytes/{kind}", n, step)
            for kind, n in record.get("comm_bytes_inter_node", {}).items():
                self.tb.add_scalar(f"comm_bytes_inter_node/{kind}", n, step)
            for kind, where in record.get("comm_bytes_a2a_nodes", {}).items():
                for side, by_dtype in where.items():
                    for dtype, n in by_dtype.items():
                        self.tb.add_scalar(f"comm_bytes_a2a_nodes/{kind}/{side}/{dtype}", n, step)
            for category, by_device in record.get("model_state_bytes", {}).items():
                for device, n in by_device.items():
                    self.tb.add_scalar(f"model_state_bytes/{category}/{device}", n, step)
        self._show(record)

    def _show(self, r: dict) -> None:
        if self.bar is not None:
            self.bar.update(r["step"] - self.bar.n)
            post = {"loss": f"{r['loss']:.3f}", "tok/s": f"{r['tokens_per_s']:.0f}",
                    "TFLOP/s": f"{r['tflops']:.3g}"}
            if "mfu" in r:
                post["mfu"] = f"{r['mfu']:.1%}"
            if "val_loss" in r:
                post["val"] = f"{r['val_loss']:.3f}"
            self.bar.set_postfix(post, refresh=False)
        elif self.mode == "plain" and (r["step"] % self.cfg.every == 0 or r["step"] == self.total
                                       or "val_loss" in r):
            done = r["step"] - self.start_step
            eta = (time.perf_counter() - self.t0) / max(done, 1) * (self.total - r["step"])
            val = f" val_loss {r['val_loss']:.4f}" if "val_loss" in r else ""
            norm = "skipped" if r["grad_norm"] is None else f"{r['grad_norm']:.3f}"
            scale = f" scale {r['loss_scale']:g}" if "loss_scale" in r else ""
            mfu = f" mfu {r['mfu']:.1%}" if "mfu" in r else ""
            mtp = "/".join(f"{r[k]:.4f}" for k in sorted(r, key=_depth) if k.startswith("mtp_loss_"))
            mtp = f" mtp {mtp}" if mtp else ""
            print(f"step {r['step']}/{self.total} loss {r['loss']:.4f} aux {r['aux_loss']:.4f}{mtp} "
                  f"lr {r['lr']:.2e} grad_norm {norm}{scale} "
                  f"tok/s {r['tokens_per_s']:.0f} TFLOP/s {r['tflops']:.3g}{mfu}{val} "
                  f"eta {_fmt_eta(eta)}", flush=True)

    def log_moe(self, step: int, layer_stats: dict) -> None:
        """layer_stats: layer name -> moe.stats.RoutingStats summed over the data-parallel ranks."""
        if not self.enabled or self.tb is None:
            return
        for name, st in layer_stats.items():
            tag = f"moe/{name}"
            counts_E = st.kept_E.double().cpu()
            self.tb.add_scalar(f"{tag}/imbalance", st.imbalance, step)
            self.tb.add_scalar(f"{tag}/dropped_fraction", st.dropped_fraction, step)
            self.tb.add_scalar(f"{tag}/router_entropy", float(st.entropy), step)
            self.tb.add_scalar(f"{tag}/dead_experts", len(st.dead_experts), step)
            self._expert_histogram(f"{tag}/expert_load", counts_E, step)
            if st.rank_rows is not None and st.rank_rows.numel() > 1:
                # rows per expert-parallel rank (what the step waits for), and with hot-expert
                # replication (moe.replica_slots) what they would be without it
                self.tb.add_scalar(f"{tag}/rank_imbalance", st.rank_imbalance, step)
                for p, n in enumerate(st.rank_rows.tolist()):
                    self.tb.add_scalar(f"{tag}/rank_rows/{p}", n, step)
            if st.rank_rows_unreplicated is not None:
                self.tb.add_scalar(f"{tag}/rank_imbalance_unreplicated",
                                   st.rank_imbalance_unreplicated, step)
                for p, n0 in enumerate(st.rank_rows_unreplicated.tolist()):
                    self.tb.add_scalar(f"{tag}/rank_rows_unreplicated/{p}", n0, step)

    def _expert_histogram(self, tag: str, counts_E, step: int) -> None:
        # One bucket per expert id, so TensorBoard draws the load of each expert.
        E = counts_E.numel()
        ids = counts_E.new_tensor(range(E))
        total = float(counts_E.sum())
        if total == 0:
            return
        self.tb.add_histogram_raw(
            tag, min=0.0, max=float(E - 1), num=total, sum=float((ids * counts_E).sum()),
            sum_squares=float((ids * ids * counts_E).sum()),
            bucket_limits=[e + 0.5 for e in range(E)], bucket_counts=counts_E.tolist(),
            global_step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        self.jsonl.close()


def _depth(key: str) -> int:
    """mtp_loss_k's k (0 for other keys): the log line lists depths in order past 9."""
    tail = key.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else 0
