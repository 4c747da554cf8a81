"""parallel.precision=fp8: bf16 autocast everywhere (parallel/precision.py) plus FP8 GEMMs.

  expert banks   the routed experts, shared experts and dense FFNs (all ExpertBank, one
                 expert each for the dense ones) run DeepSeek-V3's fine-grained recipe
                 (moe/fp8.py: activations per 1 x 128 tile, weights per 128 x 128 block,
                 fp32 accumulation, backward in FP8 too): torchao's grouped blockwise FP8
                 GEMM where it runs for real (CUDA SM90+ with deep_gemm), else the
                 emulation (dequantize, fp32 GEMM), bit-for-bit the kernel's quantization
  nn.Linear      the attention projections (and any other Linear of the blocks) through
                 torchao's float8 training (its Float8Linear, as convert_to_float8_training
                 swaps them in; the toolkit's N(0, init_std) init kept) with the recipe
                 parallel.fp8_recipe picks: tensorwise (default: one scale per tensor, the
                 fastest on H100) or rowwise (one scale per row, more accurate with
                 outliers); torchao's emulation where the device has no FP8 matmul (CPU,
                 GPUs before compute capability 8.9)
  kept           the embedding, the output head, norms and routers (their logits decide
                 the routing) stay in bf16/fp32, as the peers keep them
The master weights stay fp32 and keep their names (torchao's Float8Linear keeps `weight`),
so checkpoints are the bf16 run's and load without FP8.
"""
import dataclasses
import functools

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from models.layers import Linear
from moe import Router
from moe.experts import ExpertBank
from moe.fp8 import bank_recipe, device_fp8_kernels
from moe.fp8_rowwise import rowwise_pays
from moe.layer import MoELayer

from .mesh import default_device_type
from .plan import FP8_RECIPES
LINEAR_MULTIPLE = 16   # torchao's FP8 matmul needs both dims of a Linear divisible by 16


def fp8_matmul_available(device: torch.device) -> bool:
    """Whether torch has FP8 tensor-core matmuls here (moe/fp8.py fp8_kernels: CUDA, compute
    capability >= 8.9)."""
    return device_fp8_kernels(device).matmul


def _kept(model) -> set:
    """ids of the Linears that stay out of FP8: the output head and every router's."""
    out = {id(m) for r in model.modules() if isinstance(r, Router) for m in r.modules()}
    head = getattr(model, "lm_head", None)
    if head is not None:
        out |= {id(m) for m in head.modules()}
    return out


def _torchao_float8(device: torch.device) -> tuple:
    """torchao.float8's (Float8Linear, Float8LinearConfig, swap_linear_layers). Where its CUDA
    kernels cannot load (a CPU build of torch) its import warns about each .so and torch
    about an Enum it registers; neither matters to the emulation, so they stay quiet there."""
    from moe.quiet import quiet_torchao_import
    with quiet_torchao_import(device.type != "cuda"):
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.float8_linear_utils import swap_linear_layers
    return Float8Linear, Float8LinearConfig, swap_linear_layers


def target_device(model: nn.Module, meshes=None) -> torch.device:
    """Where the model will run: its parameters' device, or -- built on meta and materialised
    later by parallelize's init_fn, as train.py does -- the meshes' device type, else this
    process's default (cuda when it has a GPU)."""
    device = next(model.parameters()).device
    if device.type != "meta":
        return device
    return torch.device(meshes.dense.device_type if meshes is not None else default_device_type())


def linear_pays(m: nn.Linear, rows: int, compiled: bool) -> tuple:
    """(pays, why) for a Linear in FP8 rather than bf16 on rows of a micro-batch, by the banks'
    cost model (moe/fp8_rowwise.py rowwise_pays, one expert holding every row): the
    quantization of input, output gradient and weight against the FP8 GEMMs' saving."""
    out_f, in_f = m.weight.shape
    return rowwise_pays(in_f, out_f, rows, compiled, rows_of="a micro-batch")


def apply_fp8(model: nn.Module, recipe: str, meshes=None, rows=None, compiled: bool = False) -> None:
    """Every ExpertBank to fine-grained FP8, every other nn.Linear of the model but the head
    and the routers to torchao's float8 training (module docstring); torchao emulates unless
    the device the model will run on (target_device) has FP8 matmuls. Runs before tensor
    parallelism, which then splits the Float8Linears with the ordinary column/row styles:
    activations move in bf16, and each FP8 scale is computed on the DTensor, so an amax over
    a split dim is reduced across the tp group -- every rank quantizes with one process's
    scales (check_split_linears checks the slices afterwards). Raises ValueError naming the
    field where a dimension does not tile. rows (the tokens of a micro-batch), where the device
    has FP8 matmuls: a Linear whose shape cannot gain there (linear_pays) stays bf16."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"parallel.fp8_recipe={recipe!r}; use one of {', '.join(FP8_RECIPES)}")
    device = target_device(model, meshes)
    for bank in (m for m in model.modules() if isinstance(m, ExpertBank)):
        bank.set_fp8(True, bank_recipe(recipe))
        bank.set_fp8_device(device)
    kept = _kept(model)
    linears = [(n, m) for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and id(m) not in kept]
    for name, m in linears:
        _check_linear_shape(name, m.weight.shape)
    if rows is not None and fp8_matmul_available(device):
        linears = [(n, m) for n, m in linears if linear_pays(m, rows, compiled)[0]]
    if not linears:
        return
    Float8Linear, Float8LinearConfig, swap_linear_layers = _torchao_float8(device)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe),
                                 emulate=not fp8_matmul_available(device))

    def to_float8(mod: nn.Linear) -> nn.Module:
        new = Float8Linear.from_float(mod, config=config)   # the same weight and bias
        if isinstance(mod, Linear):   # keep the toolkit's N(0, init_std) init for init_weights
            new.init_std = mod.init_std
            new.reset_parameters = functools.partial(Linear.reset_parameters, new)
        return new

    chosen = {id(m) for _, m in linears}
    swap_linear_layers(model, to_float8, module_filter_fn=lambda mod, fqn: id(mod) in chosen)


def _check_linear_shape(name: str, shape, tp_note: str = "") -> None:
    out_f, in_f = shape
    if in_f % LINEAR_MULTIPLE or out_f % LINEAR_MULTIPLE:
        raise ValueError(f"parallel.precision=fp8: {name} is [{out_f}, {in_f}]{tp_note}, not a "
                         f"multiple of {LINEAR_MULTIPLE} (torchao's FP8 matmul); change "
                         f"model.d_model / model.n_heads / model.n_kv_heads{' / parallel.tp' if tp_note else ''} "
                         f"or use bf16")


def check_split_linears(model: nn.Module) -> None:
    """After tensor parallelism: each rank's slice of every split Float8Linear still tiles by
    16 (only the dims tp split can have shrunk; replicated Linears were checked whole)."""
    from torchao.float8.float8_linear import Float8Linear   # imported by apply_fp8 already
    for name, m in model.named_modules():
        if isinstance(m, Float8Linear) and isinstance(m.weight, DTensor):
            _check_linear_shape(name, m.weight.to_local().shape, " on each tensor-parallel rank")


def fp8_lines(model: nn.Module, tokens_per_micro: int, device: torch.device,
              compiled: bool) -> list:
    """precision=fp8, after apply_fp8: which GEMMs run FP8 on `device` and why, one line per
    distinct shape (the run's first lines; bench/fp8.py): the banks under the rowwise recipe
    (moe/fp8_rowwise.py rowwise_choice: a routed bank's expert sees tokens x top_k / experts
    rows a micro-batch, a dense or shared one every token), and the blocks' Linears, which
    stay bf16 where linear_pays says their shape cannot gain."""
    lines = _bank_lines(model, tokens_per_micro, device, compiled)
    if not fp8_matmul_available(device):
        return lines + [f"fp8: the blocks' Linears emulated on {device.type} (FP8 matmuls need "
                        f"CUDA compute capability 8.9+)"]
    kept, seen = _kept(model), set()
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m) not in kept and tuple(m.weight.shape) not in seen:
            seen.add(tuple(m.weight.shape))
            on = type(m).__name__ == "Float8Linear"
            why = linear_pays(m, tokens_per_micro, compiled)[1]
            lines.append(f"fp8 Linear: {'FP8' if on else 'stays bf16'} {why}")
    return lines


def _bank_lines(model, tokens_per_micro, device, compiled) -> list:
    if not any(isinstance(m, ExpertBank) and m.fp8_recipe == "rowwise" for m in model.modules()):
        return []
    routed = {id(m.experts): m.router.top_k for m in model.modules() if isinstance(m, MoELayer)}
    real = device_fp8_kernels(device).rowwise
    if not real:
        return [f"fp8 rowwise: every expert-bank GEMM emulated on {device.type} (the tests' "
                f"reference; torch._scaled_grouped_mm runs on CUDA SM90+)"]
    seen, lines = set(), []
    for bank in (m for m in model.modules() if isinstance(m, ExpertBank)):
        E, D, F = bank.w1.shape
        rows = tokens_per_micro * routed.get(id(bank), E)   # the rows the whole bank runs
        if (D, F, rows / E) in seen:
            continue
        seen.add((D, F, rows / E))
        (up, down, _), whys = bank.fp8_choice(rows, real, compiled)
        for on, why in zip((up, down), whys):
            lines.append(f"fp8 rowwise: {'FP8' if on else 'stays bf16'} {why}")
    return lines
