"""Getting MoE aux losses into the training loss, for any model holding MoELayers.

Two routes, use one of them:
  loss = task_loss + collect_aux_loss(model)      # explicit (train.py does this)
  inject_aux_loss(model)                           # once; then plain task_loss.backward()
                                                   # also back-propagates every aux loss
The second suits Hugging Face training code that only sees `outputs.loss`. Injected layers
are skipped by collect_aux_loss (unless include_injected=True, e.g. for logging), so the
two routes can never count an aux loss twice.
"""
import torch

from .layer import MoELayer

_FLAG = "aux_loss_injected"  # instance attribute set on injected MoELayers


def moe_layers(model) -> list:
    """[(qualified name, MoELayer)] in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoELayer)]


def collect_aux_loss(model, include_injected: bool = False) -> torch.Tensor:
    """Sum of the weighted aux losses of every MoELayer's last forward (a scalar tensor)."""
    losses = [m.aux_loss for _, m in moe_layers(model)
              if include_injected or not getattr(m, _FLAG, False)]
    if not losses:
        return torch.zeros(())
    return torch.stack([loss.to(losses[0].device).float() for loss in losses]).sum()


class _AddAuxGrad(torch.autograd.Function):
    """Identity on y; its backward also starts the aux loss's backward with gradient 1."""

    @staticmethod
    def forward(ctx, y, aux):
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad_y):
        return grad_y, grad_y.new_ones(ctx.aux_shape, dtype=ctx.aux_dtype)


def _inject_hook(module, args, output):
    aux = module.aux_loss
    if not (torch.is_grad_enabled() and aux.requires_grad and output.requires_grad):
        return output
    return _AddAuxGrad.apply(output, aux)


def inject_aux_loss(model) -> list:
    """Make every MoELayer's aux loss reach the backward pass of whatever uses its output.

    Returns the hook handles (handle.remove() undoes it for that layer; then also
    `del layer.aux_loss_injected`). The gradient added is exactly that of adding the layer's
    weighted aux_loss to the final loss once, provided the output reaches the loss.
    """
    handles = []
    for _, layer in moe_layers(model):
        if getattr(layer, _FLAG, False):
            continue
        handles.append(layer.register_forward_hook(_inject_hook))
        setattr(layer, _FLAG, True)
    return handles


def set_balance_group(model, group) -> None:
    """Hand every MoELayer the data-parallel group its micro_batch/global_batch balance
    losses count tokens over (moe/losses.py); None: this process only."""
    for _, layer in moe_layers(model):
        layer.set_balance_group(group)


def reset_balance_windows(model) -> None:
    """Start a new global_batch balance window in every MoELayer: call once per optimizer
    step, before its first micro-batch."""
    for _, layer in moe_layers(model):
        layer.reset_balance_window()
