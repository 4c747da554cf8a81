"""The trainer's view of a parallel layout: which ranks share data, how gradients are
reduced and clipped. Built on parallel/ (plan, meshes, parallelize) when the layout needs
it; one process and plain data parallelism also work with the small fallback here.

P ranks. Only this object knows about groups; the loop calls its methods.
"""
import torch
import torch.distributed as dist

from moe.aux import moe_layers as _moe_layers


class Layout:
    """dp_rank/dp_size: this rank's share of the global batch. Gradient reduction is done by
    hooks parallelize() installed (or by `sync_grads` in the fallback)."""

    def __init__(self, ctx, plan, meshes=None, parallel_api=True):
        self.ctx, self.plan, self.meshes, self.api = ctx, plan, meshes, parallel_api
        if meshes is not None:
            self.dp_rank, self.dp_size = meshes.rank("dp"), plan.dp
        else:
            self.dp_rank, self.dp_size = ctx.rank, ctx.world_size

    def prepare_optimizer(self, model, optimizer):
        if not self.api:
            return optimizer
        from parallel.apply import prepare_optimizer
        return prepare_optimizer(model, optimizer)

    def after_load(self, model) -> None:
        """Re-copy loaded weights into ZeRO-1/2 master slices (they are copies made when the
        optimizer was sharded, so loading the model alone would leave them stale)."""
        state = getattr(model, "moekit_parallel", None)
        zero = getattr(state, "zero_state", None)
        if zero is None:
            return
        zero.refresh_from_params()

    def checkpoint_transforms(self, model):
        """(transform, untransform) for checkpoint.save/load, or (None, None).

        Under expert parallelism each rank holds experts [r*E/P, (r+1)*E/P) of every MoE layer
        as a plain local tensor under the same name. Wrapped as DTensors over the (edp, ep)
        mesh (Shard(0) over ep, replicated over edp), DCP records the full [E, ...] tensors
        and reshards them for any other layout; untransform unwraps them again.
        """
        if self.meshes is None or self.plan.ep == 1:
            return None, None
        from torch.distributed.tensor import DTensor, Replicate, Shard
        mesh = self.meshes.expert["edp", "ep"]
        ep = self.plan.ep
        names = {f"{lname}.experts.{pname}" for lname, layer in _moe_layers(model)
                 for pname, _ in layer.experts.named_parameters()}

        def wrap(t):
            if not isinstance(t, torch.Tensor) or isinstance(t, DTensor) or t.dim() == 0:
                return t
            shape = (t.shape[0] * ep, *t.shape[1:])
            return DTensor.from_local(t, mesh, [Replicate(), Shard(0)], run_check=False,
                                      shape=shape, stride=torch.empty(shape, device="meta").stride())

        def unwrap(t):
            return t.to_local() if isinstance(t, DTensor) else t

        def transform(model_sd, optim_sd):
            model_sd = {k: wrap(v) if k in names else v for k, v in model_sd.items()}
            state = {k: ({n: wrap(v) for n, v in st.items()} if k in names else st)
                     for k, st in optim_sd["state"].items()}
            return model_sd, {**optim_sd, "state": state}

        def untransform(model_sd, optim_sd):
            model_sd = {k: unwrap(v) for k, v in model_sd.items()}
            state = {k: {n: unwrap(v) for n, v in st.items()} for k, st in optim_sd["state"].items()}
            return model_sd, {**optim_sd, "state": state}

        return transform, untransform

    # ----------------------------------------------------------- gradients
    def set_grad_sync(self, model, enabled: bool) -> None:
        """Under accumulation, reduce only in the last micro-batch's backward."""
        if self.api:
            from parallel.apply import set_requires_gradient_sync
            set_requires_gradient_sync(model, enabled)

    def sync_grads(self, model) -> None:
        if self.api or not self.ctx.distributed:
            return  # parallelize() reduces gradients at the end of backward
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.ctx.world_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def clip_grad_norm(self, model, max_norm: float) -> float:
        """Global gradient norm (before clipping), each element counted once; clips when > 0."""
        if self.api:
            from parallel.grads import clip_grad_norm_, grad_norm
            return float(clip_grad_norm_(model, max_norm) if max_norm > 0 else grad_norm(model))
        params = [p for p in model.parameters() if p.grad is not None]
        limit = max_norm if max_norm > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, limit))

    # ----------------------------------------------------------- reductions
    def mean_over_data(self, values: torch.Tensor) -> torch.Tensor:
        """Average per-rank values over all ranks (replicas of one data shard hold equal values)."""
        if not self.ctx.distributed:
            return values
        out = values.clone()
        dist.all_reduce(out)
        return out / self.ctx.world_size

    def sum_load(self, load_E: torch.Tensor) -> torch.Tensor:
        """Expert loads summed over the ranks that route distinct tokens."""
        if not self.ctx.distributed:
            return load_E
        group = self.meshes.group("pool") if self.meshes is not None else None
        out = load_E.clone()
        dist.all_reduce(out, group=group)
        return out


def build_layout(ctx, plan, model, loss_fn=None, init_fn=None):
    """Apply the plan to `model` in place (parallel.apply.parallelize) and return its Layout.

    Without parallel/apply (an older checkout), one process and plain data parallelism still
    run on the fallback gradient all-reduce above; other layouts need it.
    """
    try:
        from parallel.apply import parallelize
        from parallel.mesh import build_meshes
    except ImportError:
        if (plan.tp, plan.pp, plan.ep, plan.zero) != (1, 1, 1, 0) or plan.precision != "fp32":
            raise
        if init_fn is not None:
            init_fn(model)
        return Layout(ctx, plan, parallel_api=False)
    meshes = build_meshes(plan, ctx.device.type) if ctx.distributed else None
    parallelize(model, plan, meshes, loss_fn=loss_fn, init_fn=init_fn)
    return Layout(ctx, plan, meshes)
