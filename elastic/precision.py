"""Mixed precision: the dtypes a worker computes and all-reduces in, and fp16's GradScaler.

Weights, gradients and optimizer state stay fp32; only the arithmetic inside
:meth:`MixedPrecision.autocast` runs in bf16 or fp16. bf16 has fp32's range, so its gradients
need no scaling. fp16 does: small gradients underflow to zero, so the loss is multiplied by a
dynamic scale before backward, and a step whose gradients overflowed to inf/nan is skipped and
the scale halved. That scale is training state like the weights (:meth:`MixedPrecision.tensors`):
checkpoints and the state sync carry it, so a resumed or resized job goes on with the scale it
had. The gradient all-reduce dtype (``comm.grad_dtype``) is separate: the DDP comm hook casts
each bucket to it (:class:`elastic.ddp_hook.DDPHook`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from elastic.config import ConfigError, GradDtype, Precision, problem

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_of(choice: Precision | GradDtype) -> torch.dtype:
    """The torch dtype a resolved precision or a gradient dtype stands for."""
    if choice == Precision.auto:
        raise ValueError("resolve trainer.precision=auto first (resolve_precision)")
    return _DTYPES[str(choice)]


def resolve_precision(
    requested: Precision, device: torch.device, bf16_supported: bool | None = None
) -> Precision:
    """The precision this worker computes in: ``auto`` is bf16 on a GPU with native bf16, else fp32.

    fp32 otherwise, because a CPU's bf16 matmuls are rarely faster, and an old GPU only emulates
    bf16.

    ``bf16_supported`` is whether the CUDA device has native bf16; None asks the device. An
    explicit bf16 on a GPU without it is refused: emulated bf16 is slower than fp32, which is
    not what anyone asking for bf16 wants. On the CPU every precision works (autocast on the CPU
    and ``GradScaler("cpu")``), so nothing is refused there.
    """
    if device.type != "cuda":
        return Precision.fp32 if requested == Precision.auto else requested
    if bf16_supported is None:
        bf16_supported = torch.cuda.is_bf16_supported(including_emulation=False)
    if requested == Precision.auto:
        return Precision.bf16 if bf16_supported else Precision.fp32
    if requested == Precision.bf16 and not bf16_supported:
        raise ConfigError(
            problem(
                "trainer.precision",
                str(requested),
                f"GPU {device} has no native bf16 (it needs compute capability 8.0 or newer)",
                "set trainer.precision=fp16 (with a loss scaler) or trainer.precision=auto",
            )
        )
    return requested


def resolve_channels_last(requested: bool | None, device: torch.device) -> bool:
    """Whether convolutions run in NHWC (channels_last): ``requested``, or by device for None.

    None is on for CUDA, whose tensor-core kernels want NHWC, and off for the CPU, where NCHW is
    as fast or faster."""
    return device.type == "cuda" if requested is None else requested


class MixedPrecision:
    """Autocast and, for fp16, the GradScaler of one worker; built from a resolved precision.

    Why a skipped fp16 step is the same decision on every rank: the scaler looks at gradients
    only in :meth:`step`, after backward, and backward returns only once DDP's all-reduce has
    made every rank's gradients the same sum (an inf or nan on any rank makes the sum inf or nan
    on all of them; an overflow in the hook's fp16 cast likewise). So every rank finds the same
    inf/nan, skips or takes the same step and updates its scale the same way: the replicas and
    their scalers stay identical without a collective of their own.
    """

    def __init__(self, precision: Precision, device: torch.device) -> None:
        self.precision = precision
        self.device = device
        self.dtype = dtype_of(precision)
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == Precision.fp16)
        if self.scaler.is_enabled():
            # The scaler makes its state on the first scale(); made now instead, so that a state
            # loaded or broadcast before the first step can be copied into it in place.
            self.scaler._lazy_init_scale_growth_tracker(device)

    def autocast(self) -> AbstractContextManager[object]:
        """The forward (and the loss) run inside this; fp32 runs as written."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The scaler's state: the very tensors it updates in place; empty without a scaler.

        They are the scale, and the count of good steps since it last changed."""
        if not self.scaler.is_enabled():
            return {}
        return {
            "scaler.scale": self.scaler._scale,
            "scaler.growth_tracker": self.scaler._growth_tracker,
        }

    def backward(self, loss: torch.Tensor) -> None:
        """Backward from ``loss``, multiplied by the scale under fp16 (unchanged otherwise)."""
        self.scaler.scale(loss).backward()

    def step(
        self, optimizer: torch.optim.Optimizer, clip: Callable[[], object] | None = None
    ) -> bool:
        """Unscale the gradients, step ``optimizer`` if they are finite, and update the scale.

        Returns whether the step was taken: it is not when they hold an inf or nan. ``clip``
        (``optim.clip_grad_norm``) runs on the unscaled gradients, just before the step.

        Whether it was taken is read from the scaler's own inf/nan findings for ``optimizer``,
        the values its ``step`` just decided with, before ``update`` clears them. (The scale
        alone cannot tell: once it has shrunk to zero, or grown to inf, it no longer changes.)
        """
        if not self.scaler.is_enabled():
            if clip is not None:
                clip()
            optimizer.step()
            return True
        if clip is not None:
            self.scaler.unscale_(optimizer)  # a norm of the true gradients, not the scaled ones
            clip()
        self.scaler.step(optimizer)
        found = self.scaler._found_inf_per_device(optimizer)
        taken = not any(bool(v.item()) for v in found.values())
        self.scaler.update()
        return taken
