"""A bank of expert FFNs run as grouped matmuls over contiguous per-expert row slices.

Shapes: N dispatched rows (sorted by expert), n rows of one expert, D model dim, F ffn dim,
E local experts.
"""
import dataclasses

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .activations import ACTIVATIONS, Activation, check_activation
from .cast_once import readers
from .fusion import is_plain
from .fp8 import check_block_dims, device_fp8_kernels, fp8_matmul, grouped_fp8_ffn, grouped_fp8_kernel
from .fp8_rowwise import rowwise_choice, rowwise_fp8_ffn, scaled_grouped_kernel
from .grouped_mm import EXPERT_IMPLS, grouped_mm_ffn, resolve_impl, unsupported_reason
from .row_gates import add_gated_bias, gate_bias_grad, gate_column, weighted, weighted_act, weighted_backward

__all__ = ["ACTIVATIONS", "ExpertBank", "DenseFFN", "grouped_ffn", "check_activation",
           "check_experts_impl", "pad_rows"]


def pad_rows(y_kD: torch.Tensor, n: int) -> torch.Tensor:
    """y with zero rows appended up to n rows (the dropped assignments' rows)."""
    if y_kD.shape[0] >= n:
        return y_kD
    return torch.cat([y_kD, y_kD.new_zeros(n - y_kD.shape[0], y_kD.shape[-1])])


def check_experts_impl(experts_impl: str) -> None:
    if experts_impl not in EXPERT_IMPLS:
        raise ValueError(f"experts_impl={experts_impl!r} is not supported; use one of {EXPERT_IMPLS}")


def _affine(x_nD, w_DF, b_F, out=None):
    if b_F is None:
        return torch.mm(x_nD, w_DF) if out is None else torch.mm(x_nD, w_DF, out=out)
    return torch.addmm(b_F, x_nD, w_DF) if out is None else torch.addmm(b_F, x_nD, w_DF, out=out)


def _row(p, e):
    return None if p is None else p[e]


def _colmajor_hidden(x_ND, n: int) -> bool:
    """Whether expert e's [n, F] hidden buffers should be column-major.

    Measured on this project's CPUs (MKL sgemm, 2 threads): with few rows per expert
    (n = 128..256, e.g. E=128 at T=8192, k=2) a column-major [n, F] output makes aten call
    MKL in the orientation it threads well: 10-30% faster per expert FFN (fwd+bwd); neutral
    from n ~ 1024, so the cut is at 512. oneDNN's bf16 path gets slower, and CUDA has its own heuristics: row-major there.
    """
    return x_ND.device.type == "cpu" and x_ND.dtype in (torch.float32, torch.float64) and n <= 512


def _hidden(x_ND, n: int, f: int, colmajor: bool):
    return x_ND.new_empty(f, n).t() if colmajor else x_ND.new_empty(n, f)


class _GroupedFFN(torch.autograd.Function):
    """All experts' FFNs in one autograd node; outputs and gradients written in place.

    Why not plain ops: autograd would cat the expert outputs and, worse, stack per-expert
    weight gradients into a fresh [E, D, F] tensor (a full extra copy of every weight
    gradient per step, growing with E). Here each expert's output matmul writes straight
    into its rows of y (out=), each weight-gradient matmul into its expert's slice, and the
    backward runs the activation's own backward (moe/activations.py). Saved per expert, like
    autograd would: the pre-activations h1 (and h3) and the w2 input a (a computed again in
    backward instead under act.recompute).
    """

    @staticmethod
    def forward(ctx, x_ND, counts, act, w1, w2, w3, b1, b2, b3, gate_N=None):
        gated = act.gated
        y_ND = x_ND.new_empty(x_ND.shape[0], w2.shape[-1])
        saved, lo = [], 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            x, F_ = x_ND[lo:lo + n], w1.shape[-1]
            cm = _colmajor_hidden(x_ND, n)
            h1 = _affine(x, w1[e], _row(b1, e), out=_hidden(x_ND, n, F_, cm))
            h3 = _affine(x, w3[e], _row(b3, e), out=_hidden(x_ND, n, F_, cm)) if gated else None
            if gate_N is None:
                a = act(h1, h3)
                _affine(a, w2[e], _row(b2, e), out=y_ND[lo:lo + n])
            else:  # moe.gates_in_experts: (g a) W2 + g b2, a computed again in backward
                a = None
                torch.mm(weighted(act, h1, h3, gate_N[lo:lo + n]), w2[e], out=y_ND[lo:lo + n])
                if b2 is not None:
                    y_ND[lo:lo + n].addcmul_(gate_column(gate_N[lo:lo + n], h1.dtype), b2[e].unsqueeze(0))
            saved += [h1, h3, None if act.recompute else a]
            lo += n
        ctx.counts, ctx.act = counts, act
        ctx.has_bias = (b1 is not None, b2 is not None, b3 is not None)
        ctx.save_for_backward(x_ND, w1, w2, w3, b2, gate_N, *saved)
        return y_ND

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy_ND):
        x_ND, w1, w2, w3, b2, gate_N, *saved = ctx.saved_tensors
        dy_ND = dy_ND.contiguous()
        need_x, need_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[3:9])
        dx_ND = torch.empty_like(x_ND) if need_x else None
        dg_N = gate_N.new_zeros(gate_N.shape) if gate_N is not None and ctx.needs_input_grad[9] else None
        dw = [None if w is None or not need_w else torch.empty_like(w) for w in (w1, w2, w3)]
        db = [x_ND.new_empty(len(ctx.counts), w.shape[-1]) if has and need_w else None
              for has, w in zip(ctx.has_bias, (w1, w2, w3))]
        lo, i = 0, 0
        for e, n in enumerate(ctx.counts):
            if n == 0:  # an idle expert's gradient is exactly zero
                for g in dw + db:
                    if g is not None:
                        g[e].zero_()
                continue
            h1, h3, a = saved[i:i + 3]
            i += 3
            x, dy = x_ND[lo:lo + n], dy_ND[lo:lo + n]
            da_buf = _hidden(x_ND, n, h1.shape[-1], _colmajor_hidden(x_ND, n))
            da = torch.mm(dy, w2[e].t(), out=da_buf)
            g = None
            if gate_N is not None:  # gates in the experts: one op gives dh, dg and g a
                g = gate_column(gate_N[lo:lo + n], h1.dtype)
                dh1, dh3, dg, a = weighted_backward(ctx.act, da, h1, h3, gate_N[lo:lo + n])
                if dg_N is not None:
                    dg_N[lo:lo + n] = dg if b2 is None else dg + gate_bias_grad(dy, b2[e])
            else:
                if a is None:  # moe_act: computed again rather than kept
                    a = ctx.act(h1, h3)
                dh1, dh3 = ctx.act.backward(da, h1, h3)
            if need_w:
                torch.mm(a.t(), dy, out=dw[1][e])
                torch.mm(x.t(), dh1, out=dw[0][e])
                if dh3 is not None:
                    torch.mm(x.t(), dh3, out=dw[2][e])
                for gb, src in zip(db, (dh1, dy if g is None else dy * g, dh3)):
                    if gb is not None:
                        torch.sum(src, 0, out=gb[e])
            if need_x:
                torch.mm(dh1, w1[e].t(), out=dx_ND[lo:lo + n])
                if dh3 is not None:
                    dx_ND[lo:lo + n].addmm_(dh3, w3[e].t())
            lo += n
        return (dx_ND, None, None, *dw, *db, dg_N)


def grouped_ffn(x_ND, counts, activation, w1, w2, w3=None, b1=None, b2=None, b3=None, gate_N=None):
    """Expert e's FFN on rows [sum(counts[:e]), sum(counts[:e+1])) of x_ND, all in one node.
    `activation`: a name of ACTIVATIONS or an Activation (clamped_swiglu's constants).
    gate_N: fp32 [N] or None: each row's routing gate, applied inside (moe/row_gates.py)."""
    act = activation if isinstance(activation, Activation) else Activation(activation)
    if sum(counts) != x_ND.shape[0]:
        raise ValueError(f"counts sum to {sum(counts)} but x_ND has {x_ND.shape[0]} rows; "
                         "counts[e] must be the number of rows of expert e")
    return _GroupedFFN.apply(x_ND, tuple(int(c) for c in counts), act, w1, w2, w3, b1, b2, b3,
                             gate_N)


class ExpertBank(nn.Module):
    """`num_local` experts with weights w1 [E, D, F], w2 [E, F, D] (and w3 [E, D, F] if gated).

    `forward(x_ND, counts)` runs expert e on rows [sum(counts[:e]), sum(counts[:e+1])); an
    expert with no rows costs nothing. Optional biases b1 [E, F], b2 [E, D], b3 [E, F] exist so
    dense FFNs with biases (GPT-2, BERT, GPT-OSS experts) can be held exactly.
    activation="clamped_swiglu" (GPT-OSS) uses swiglu_alpha and swiglu_limit (moe/activations.py).

    experts_impl: "loop" runs the fused per-expert loop below (`grouped_ffn`); "grouped_mm"
    one `torch._grouped_mm` per projection (moe/grouped_mm.py; counts stay a long tensor on
    the device, no host sync); "auto" (default) the measured-faster one for the device and
    dtype (moe/grouped_mm.py AUTO_IMPL). Weights that are DTensors (tensor parallelism) or of
    another dtype than the input run a third path of plain differentiable ops. Every path
    runs every activation through the same `Activation` (moe/activations.py). `counts` may
    be a long tensor or a list of ints.
    """

    def __init__(self, num_local: int, d_model: int, d_ff: int, activation: str = "gelu",
                 bias: bool = False, init_std: float = 0.02, out_init_std=None, *,
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                 experts_impl: str = "auto"):
        super().__init__()
        check_experts_impl(experts_impl)
        self.experts_impl = experts_impl
        self.act = Activation(activation, float(swiglu_alpha), float(swiglu_limit))
        self.activation, self.gated = activation, self.act.gated
        self.init_std = init_std
        self.out_init_std = init_std if out_init_std is None else out_init_std
        self.fp8 = False  # parallel.precision=fp8 (set_fp8)
        self.fp8_recipe = "blockwise"
        self.fp8_where_it_pays = True
        self.fp8_kernels = None
        self.set_cast_cache(True)
        self.w1 = nn.Parameter(torch.empty(num_local, d_model, d_ff))
        self.w2 = nn.Parameter(torch.empty(num_local, d_ff, d_model))
        self.w3 = nn.Parameter(torch.empty(num_local, d_model, d_ff)) if self.gated else None
        self.b1 = nn.Parameter(torch.empty(num_local, d_ff)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_local, d_model)) if bias else None
        self.b3 = nn.Parameter(torch.empty(num_local, d_ff)) if bias and self.gated else None
        self.reset_parameters()

    def set_recompute_act(self, on: bool) -> None:
        """Keep only the pre-activations and compute the activation again in backward
        (parallel.recompute_modules=moe_act)."""
        self.act = dataclasses.replace(self.act, recompute=on)

    def set_fp8(self, on: bool, recipe: str = "blockwise", where_it_pays: bool = True) -> None:
        """Run the bank's GEMMs in FP8 (parallel.precision=fp8). recipe "blockwise": every GEMM
        in fine-grained FP8 (moe/fp8.py: 1 x 128 activation tiles, 128 x 128 weight blocks);
        "rowwise": forward and dgrad on torch's grouped scaled matmul with rowwise scales, the
        weight gradient in bf16 (moe/fp8_rowwise.py), whole weights only (no tp/etp split: a
        row's scale would span the ranks). Under rowwise, on a GPU that runs the
        kernel, a projection whose shape cannot gain stays bf16 (fp8_choice) unless
        where_it_pays is False; the CPU emulation runs every projection in FP8."""
        if recipe not in ("blockwise", "rowwise"):
            raise ValueError(f"bank FP8 recipe {recipe!r}; use blockwise or rowwise")
        if on and recipe == "blockwise":
            check_block_dims(*self.w1.shape[1:], where="expert bank's w1 [d_model, d_ff]")
        if on and recipe == "rowwise" and any(d % 16 for d in self.w1.shape[1:]):
            raise ValueError(f"rowwise FP8 needs the expert bank's d_model and d_ff to be multiples "
                             f"of 16 (got {list(self.w1.shape[1:])}); change moe.d_ff / model.d_model "
                             f"or train in bf16")
        self.fp8, self.fp8_recipe, self.fp8_where_it_pays = on, recipe, where_it_pays
        self.fp8_kernels = None   # set_fp8_device: the kernels, asked once outside any graph

    def set_fp8_device(self, device: torch.device) -> None:
        """Ask which FP8 kernels `device` runs now (moe/fp8.py device_fp8_kernels: a package
        lookup torch.compile cannot trace), not in every forward."""
        self.fp8_kernels = device_fp8_kernels(device)

    def fp8_choice(self, rows: int, real_kernel: bool, compiled: bool) -> tuple:
        """((w1, w2, w3) in FP8 or not, why per projection) for a rowwise-FP8 forward of `rows`
        rows: every projection where the kernel is emulated (CPU: the tests' reference) or
        where_it_pays is off; else where rowwise_pays says the shape gains (rowwise_choice)."""
        if not self.fp8_where_it_pays:
            return (True, True, True), ()
        return rowwise_choice(*self.w1.shape[1:], rows / self.w1.shape[0], real_kernel, compiled)

    @property
    def num_local(self) -> int:
        return self.w1.shape[0]

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w1, std=self.init_std)
        nn.init.normal_(self.w2, std=self.out_init_std)
        for p in (self.w3,):
            if p is not None:
                nn.init.normal_(p, std=self.init_std)
        for p in (self.b1, self.b2, self.b3):
            if p is not None:
                nn.init.zeros_(p)

    def _per_expert(self, p):
        # unbind once: its backward stacks all expert grads in one allocation, where indexing
        # w[e] per expert would allocate a full-size zero gradient per expert.
        return None if p is None else p.unbind(0)

    def impl_for(self, x_ND: torch.Tensor) -> str:
        """The path forward takes for this input: "grouped_mm", "loop" (fused loop) or "ops"
        (plain differentiable ops: DTensor or mixed-dtype weights)."""
        params = (self.w1, self.w2, self.w3, self.b1, self.b2, self.b3)
        dev = x_ND.device.type
        autocast = torch.is_autocast_enabled(dev)
        if not _plain(x_ND, params, same_dtype=not autocast):
            return "ops"
        dt = torch.get_autocast_dtype(dev) if autocast else x_ND.dtype
        impl = resolve_impl(self.experts_impl, x_ND.device, dt, *self.w1.shape[1:])
        if impl == "loop" and self.experts_impl == "auto" and torch.compiler.is_compiling() \
                and unsupported_reason(x_ND.device, dt, *self.w1.shape[1:]) is None:
            return "grouped_mm"  # the loop reads its counts on the host: a graph break
        return impl

    def weights(self) -> tuple:
        """(w1, w2, w3, b1, b2, b3), None where absent: what forward's `params` replaces."""
        return (self.w1, self.w2, self.w3, self.b1, self.b2, self.b3)

    def forward(self, x_ND: torch.Tensor, counts, extend=None, padded: bool = False,
                gate_N=None) -> torch.Tensor:
        """extend(weights) -> weights to run: called here, inside this module's forward (where
        FSDP2 has unsharded the parameters), with `weights()`; it may append expert rows
        (the expert-parallel dispatcher appends replicas of other ranks' experts). counts
        has one entry per row of the weights run. padded: x_ND may hold rows past
        sum(counts) (dropped assignments kept for static shapes); their outputs are zero.
        gate_N: None, or each row's routing gate (fp32 [N], differentiable) to scale its
        expert's hidden by before the output projection (moe.gates_in_experts:
        moe/row_gates.py)."""
        params = self.weights() if extend is None else tuple(extend(self.weights()))
        if len(counts) != params[0].shape[0]:
            raise ValueError(f"counts has {len(counts)} entries for {params[0].shape[0]} local experts")
        impl = "fp8" if self.fp8 else self.impl_for(x_ND)
        on_device = impl == "grouped_mm" or (impl == "fp8" and self.fp8_recipe == "rowwise"
                                             and not padded)
        if not on_device and isinstance(counts, torch.Tensor):
            counts = counts.tolist()  # the loops slice on the host
        if impl != "grouped_mm" and padded and sum(counts) < x_ND.shape[0]:
            kept = sum(counts)
            return pad_rows(self.forward(x_ND[:kept], counts, lambda _: params,
                                         gate_N=None if gate_N is None else gate_N[:kept]),
                            x_ND.shape[0])
        if impl == "fp8":
            return self._forward_fp8(x_ND, counts, params, gate_N)
        if impl == "ops":
            return self._forward_ops(x_ND, counts, params, gate_N=gate_N)
        dev = x_ND.device.type
        if torch.is_autocast_enabled(dev):
            # autocast would run every matmul in its low dtype: cast once (the weights once per
            # optimizer step, _cast_weights) and run the fused path with it off
            dt = torch.get_autocast_dtype(dev)
            x_ND, params = x_ND.to(dt), self._cast_weights(params, dt)
            with torch.autocast(dev, enabled=False):
                return self._fused(impl, x_ND, counts, params, padded, gate_N)
        return self._fused(impl, x_ND, counts, params, padded, gate_N)

    def set_cast_cache(self, on: bool) -> None:
        """Keep the compute-dtype copy of the weights between micro-batches (default on);
        ZeRO-3 turns it off: its weights are gathered per forward and cast after the gather."""
        self.cast_cache = on
        self._casts = {}

    def _cast_weights(self, params: tuple, dt) -> tuple:
        """params in dtype dt, differentiably (fp32 masters get fp32 grads). A parameter's cast
        is made once and reused while the parameter is unchanged: the optimizer's in-place
        step bumps its version, a new storage changes its address."""
        if torch.compiler.is_compiling():  # a graph casts in place; and no guard on the
            return tuple(None if p is None else p.to(dt) for p in params)  # params' ids
        own = {id(p) for p in self.weights() if p is not None}
        cache = self.cast_cache
        return tuple(None if p is None else p if p.dtype == dt else
                     _CachedCast.apply(p, self._cast_of(p, dt)) if cache and id(p) in own
                     else p.to(dt) for p in params)

    def _cast_of(self, p, dt):
        key = (id(p), dt)
        stamp = (p._version, p.data_ptr())
        hit = self._casts.get(key)
        if hit is None or hit[0] != stamp:
            with torch.no_grad():
                hit = (stamp, p.detach().to(dt))
            self._casts[key] = hit
        return hit[1]

    def _fused(self, impl, x_ND, counts, params, padded=False, gate_N=None):
        if impl == "loop":
            return grouped_ffn(x_ND, counts, self.act, *params, gate_N=gate_N)
        return grouped_mm_ffn(x_ND, counts, self.act, *params, padded=padded, gate_N=gate_N)

    def _forward_ops(self, x_ND: torch.Tensor, counts: list, params: tuple = None,
                     linear=None, gate_N=None) -> torch.Tensor:
        """Reference path from plain differentiable ops: DTensor weights (tensor parallelism),
        mixed dtypes; linear(x, w, b) runs each GEMM (default _linear; _fp8_linear under
        precision=fp8). Slower: autograd stacks per-expert weight grads and cats."""
        linear = linear or _linear
        params = self.weights() if params is None else params
        if x_ND.shape[0] == 0:  # nothing routed here: an empty result still tied to the weights
            return x_ND @ params[0][0, :, :0] @ params[1][0, :0, :]
        w1, w2, w3, b1, b2, b3 = (self._per_expert(p) for p in params)
        gates = [None] * len(counts) if gate_N is None else torch.split(gate_N, counts)
        outs = []
        for e, x_nD in enumerate(torch.split(x_ND, counts)):
            if counts[e] == 0:
                continue
            x1, x3 = readers(x_nD, 2) if self.gated else (x_nD, None)   # one low-precision copy
            h_nF = linear(x1, w1[e], None if b1 is None else b1[e])
            h3_nF = linear(x3, w3[e], None if b3 is None else b3[e]) if self.gated else None
            args = (self.act, h_nF, h3_nF, w2[e], None if b2 is None else b2[e], linear, gates[e])
            # moe_act on this path: the activation and w2 computed again in backward
            outs.append(checkpoint(_act_out, *args, use_reentrant=False) if self.act.recompute
                        else _act_out(*args))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _forward_fp8(self, x_ND: torch.Tensor, counts, params: tuple, gate_N=None) -> torch.Tensor:
        """Each expert's GEMMs in fine-grained FP8, their inputs, the biases and the activation
        in the compute dtype (autocast's, bf16 under precision=fp8): torchao's grouped FP8
        kernel where it runs for real (moe/fp8.py grouped_fp8_kernel: CUDA SM90+ with DeepGEMM,
        bf16, plain tensors), else the emulation (fp8_matmul) per expert."""
        dev = x_ND.device.type
        if x_ND.shape[0] == 0:  # the empty result, still tied to the weights
            return self._forward_ops(x_ND, counts.tolist() if isinstance(counts, torch.Tensor)
                                     else counts, params, gate_N=gate_N)
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x_ND.dtype
        if self.fp8_recipe == "rowwise":
            if not _plain(x_ND, params, same_dtype=False):  # plan validation refuses tp/etp
                raise ValueError("rowwise FP8 banks take whole weights: a row's scale would span "
                                 "the tensor-parallel ranks; set parallel.fp8_recipe=tensorwise")
            kernels = self.fp8_kernels or device_fp8_kernels(x_ND.device)
            fp8, _ = self.fp8_choice(x_ND.shape[0], kernels.rowwise, torch.compiler.is_compiling())
            with torch.autocast(dev, enabled=False):
                return rowwise_fp8_ffn(scaled_grouped_kernel(x_ND.device, kernels),
                                       x_ND.to(torch.bfloat16), counts, self.act, *params,
                                       fp8=fp8, gate_N=gate_N).to(dt)
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else counts
        kernel = grouped_fp8_kernel(x_ND.device) if dt == torch.bfloat16 else None
        with torch.autocast(dev, enabled=False):
            if kernel is not None and _plain(x_ND, params, same_dtype=False):
                return grouped_fp8_ffn(kernel, x_ND.to(dt), counts, self.act, *params, gate_N=gate_N)
            return self._forward_ops(x_ND.to(dt), counts, params, _fp8_linear, gate_N)


class _CachedCast(torch.autograd.Function):
    """p as its cached copy `cast` (another dtype); the gradient goes back in p's dtype."""

    @staticmethod
    def forward(ctx, p, cast):
        ctx.dtype = p.dtype
        return cast.detach()

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dtype), None


def _linear(x_nK, w_KN, b_N):
    return x_nK @ w_KN if b_N is None else torch.addmm(b_N, x_nK, w_KN)


def _fp8_linear(x_nK, w_KN, b_N):
    y = fp8_matmul(x_nK, w_KN)
    return y if b_N is None else y + b_N.to(y.dtype)


def _act_out(act, h_nF, h3_nF, w2_FD, b2_D, linear=_linear, g_n=None):
    if g_n is None:
        return linear(act(h_nF, h3_nF), w2_FD, b2_D)
    y = linear(weighted_act(act, h_nF, h3_nF, g_n), w2_FD, None)   # moe/row_gates.py
    return y if b2_D is None else add_gated_bias(y, b2_D.unsqueeze(0), g_n)


def _plain(x_ND, params, same_dtype: bool = True) -> bool:
    """The fused path needs ordinary (not DTensor) tensors on one device (and of one dtype)."""
    ps = [p for p in params if p is not None]
    return all(is_plain(t) and t.device == x_ND.device
               and (t.dtype == x_ND.dtype or not same_dtype) for t in [x_ND] + ps)


class DenseFFN(nn.Module):
    """A plain FFN with the same activations (used for dense blocks and shared experts).

    output_gate=True adds `gate` [1, D]: the output is scaled per token by sigmoid(x @ gate.T)
    (Qwen2-MoE's shared_expert_gate).
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", bias: bool = False,
                 init_std: float = 0.02, *, output_gate: bool = False, **glu_kwargs):
        super().__init__()
        self.bank = ExpertBank(1, d_model, d_ff, activation, bias, init_std, **glu_kwargs)
        self.gate = nn.Parameter(torch.empty(1, d_model)) if output_gate else None
        if self.gate is not None:
            nn.init.normal_(self.gate, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TD = x.reshape(-1, x.shape[-1])
        y_TD = self.bank(x_TD, [x_TD.shape[0]])
        if self.gate is not None:
            y_TD = torch.sigmoid(x_TD @ self.gate.to(x_TD.dtype).t()) * y_TD
        return y_TD.reshape(x.shape)
