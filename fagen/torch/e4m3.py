"""flash_attn_func's FP8 arguments: q, k and v in torch.float8_e4m3fn with flash-attn's
q_descale, k_descale and v_descale (fagen.runtime.e4m3 says what the kernels do with them), the
checks an FP8 call must pass and the descales as the runtime takes them."""

from typing import Optional

import torch

from ..runtime.e4m3 import Descales

FP8_DTYPE_NAMES = {torch.float8_e4m3fn: "e4m3"}
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def is_fp8_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descales: tuple) -> bool:
    """Whether q, k, v make an FP8 call; refuses FP8 mixed with other dtypes, and descales beside
    fp16/bf16 inputs. Every call asks, so the common answer (no FP8) comes first."""
    fp8 = (q.dtype in FP8_DTYPE_NAMES, k.dtype in FP8_DTYPE_NAMES, v.dtype in FP8_DTYPE_NAMES)
    if fp8 == (False, False, False):
        q_descale, k_descale, v_descale = descales
        if q_descale is not None or k_descale is not None or v_descale is not None:
            given = next(name for name, t in zip(DESCALE_NAMES, descales) if t is not None)
            raise ValueError(f"fagen.flash_attn_func: {given} is for float8_e4m3fn q, k, v (it multiplies "
                             f"their stored values); these are {q.dtype}: leave the descales None")
        return False
    if fp8 != (True, True, True):
        raise TypeError(f"fagen.flash_attn_func: FP8 attention takes q, k and v all float8_e4m3fn, got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    return True


def check_fp8_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, other_options: dict[str, bool]) -> None:
    """Refuses what an FP8 call cannot do: the options the FP8 kernels do not take
    (`other_options`: each name and whether the call asks for it), and gradients (the FP8
    kernels are forward only)."""
    asked = [name for name, on in other_options.items() if on]
    if asked:
        raise NotImplementedError(f"fagen.flash_attn_func: {asked[0]} is not supported with float8_e4m3fn "
                                  "inputs (fagen's FP8 kernels take causal and window_size masks, no score "
                                  "modifier or custom mask)")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError("fagen.flash_attn_func: float8_e4m3fn inputs have no backward (fagen's FP8 "
                                  "kernels are forward only): call it under torch.no_grad() or with "
                                  "q, k, v detached")


def _broadcasts(shape: tuple, batch: int, heads_kv: int) -> bool:
    """Whether a descale of `shape` covers (batch, nheads_kv): one value, or 2-D with each size
    either the call's or 1 (that size's stride is then taken as 0)."""
    if len(shape) < 2:
        return shape in ((), (1,))
    return len(shape) == 2 and shape[0] in (1, batch) and shape[1] in (1, heads_kv)


def check_descales(q: torch.Tensor, k: torch.Tensor, descales: tuple, batch: Optional[int] = None,
                   caller: str = "fagen.flash_attn_func") -> None:
    """flash-attn's descale shapes (also run at trace time): fp32 on q's device, of shape
    (batch, nheads_kv) or one that broadcasts to it (_broadcasts). batch: q.shape[0] unless given
    (a packed q's rows are not its batch)."""
    batch, heads_kv = q.shape[0] if batch is None else batch, k.shape[2]
    for name, t in zip(DESCALE_NAMES, descales):
        if t is None:
            continue
        if t.dtype != torch.float32 or not _broadcasts(tuple(t.shape), batch, heads_kv):
            raise ValueError(f"{caller}: {name} must be a float32 tensor of shape (batch, nheads_kv) = "
                             f"({batch}, {heads_kv}) or one that broadcasts to it: (), (1,), (1, 1), "
                             f"(1, nheads_kv), (batch, 1); got {t.dtype} {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{caller}: {name} must be on q's device {q.device}, got {t.device}")


def runtime_descales(descales: tuple[Optional[torch.Tensor], ...]) -> Descales:
    """Checked descales as the kernels read them, in place: a 2-D one by its own strides, those
    of its size-1 dimensions (broadcast) 0; one value by strides 0."""
    fields = {}
    for tensor_name, t in zip("qkv", descales):
        if t is None:
            continue
        fields[tensor_name] = t.data_ptr()
        if t.dim() == 2:
            batch_stride, head_stride = (0 if size == 1 else stride for size, stride in zip(t.shape, t.stride()))
            fields[f"{tensor_name}_batch_stride"], fields[f"{tensor_name}_head_stride"] = batch_stride, head_stride
    return Descales(**fields)
