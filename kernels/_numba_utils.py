"""numba building blocks shared by the host AdamW (``cpu_adamw.py``) and the device-side ops for CPU tensors
(``numba_device_ops.py``): scalar intrinsics, bf16/fp16 rounding by integer arithmetic, gradient loads and snapshot
stores for every dtype, one element of AdamW with torch's rounding, and the packing of its scalar hyperparameters.

Importing this module imports numba; ``zenflow_triton.kernels`` itself never does.

numba's ``cache=True`` watches only the file that defines a jitted function, not the files of the helpers it
inlines: after editing this module, delete the cached ``*.nbi``/``*.nbc`` of ``cpu_adamw`` and
``numba_device_ops`` under ``kernels/__pycache__`` (or touch those two files), or their kernels keep the old code.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload, register_jitable

from .hyperparams import AdamHyperparams

# Every numba kernel module imports this one, and two threads launch their parallel regions at once: the worker's
# host AdamW beside the adder's host add (accumulate="host", on any device), or beside the training thread's device
# ops on CPU tensors. numba's workqueue layer aborts the process on that; omp and tbb allow it. Ask for a safe layer
# unless the user already chose one (numba decides at the first parallel launch): where neither loads, that launch
# raises numba's error naming the layers instead of aborting.
if numba.config.THREADING_LAYER == "default":
    numba.config.THREADING_LAYER = "threadsafe"

# Start numba's thread pool now, on import, and give torch back its thread count. Started lazily by the first
# parallel launch (in a capture hook during some backward, or a window), the omp layer's launch sets the calling
# thread's OpenMP thread count, which torch reads as its own: torch.set_num_threads(1) became numba's pool size
# mid-run, at a step that depends on where the process started, so a run resumed in a new process summed its
# reductions in another order than the uninterrupted one (issue 30, item 4). Started here, the process state is the
# same whether or not a checkpoint was loaded.
_torch_threads = torch.get_num_threads()
try:
    numba.np.ufunc.parallel._launch_threads()
except ValueError:  # no safe layer loads: the first parallel launch raises numba's error naming them
    pass
if torch.get_num_threads() != _torch_threads:
    torch.set_num_threads(_torch_threads)

__all__ = [
    "U1",
    "U13",
    "U16",
    "U32",
    "adamw_elem",
    "adamw_moments",
    "bf16_bits_array",
    "bf16_round",
    "bits_f32",
    "f16_bits_array",
    "f16_round",
    "f32_bits",
    "flat_view",
    "fma",
    "load_grad",
    "scalar_hyperparams",
    "store_snap",
    "store_snap_masked",
]


# --- intrinsics: fma and bit casts, which numba does not expose as scalar operations ----------------------------------


@intrinsic
def fma(typingctx, a, b, c):
    """``a * b + c`` rounded once (``llvm.fma.f32``, one ``vfmadd`` per 8 lanes when the loop vectorizes)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen


@intrinsic
def f32_bits(typingctx, x):
    """The IEEE bits of a float32 as uint32."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def bits_f32(typingctx, u):
    """The float32 whose IEEE bits are the low 32 bits of the integer ``u``."""
    if not isinstance(u, types.Integer):
        return None
    sig = types.float32(u)

    def codegen(context, builder, signature, args):
        (x,) = args
        width = signature.args[0].bitwidth
        if width > 32:
            x = builder.trunc(x, ir.IntType(32))
        elif width < 32:
            x = builder.zext(x, ir.IntType(32))
        return builder.bitcast(x, ir.FloatType())

    return sig, codegen


# --- conversions ------------------------------------------------------------------------------------------------------
# All arithmetic stays in uint32 (every constant typed) so the vectorized loop runs 8 lanes per AVX2 op, not 4.
# Helpers are register_jitable (numba overloads): callable from jitted code only, so numba builds no Python or
# cfunc wrapper for them (less to compile: 4.0 s per kernel specialization, from 6.4 s with inlined njit helpers).

U32 = np.uint32  # numba widens uint32 arithmetic to 64 bits; truncating every step lets LLVM keep 8 lanes
U1 = U32(1)
U13 = U32(13)
U16 = U32(16)
_BF16_QNAN = U32(0x7FC0)  # c10::BFloat16's NaN (torch's scalar path; its AVX2 path gives 0xFFFF)


@register_jitable
def bf16_round(x):
    """float32 -> bf16 bits (uint32), round to nearest even by integer arithmetic; NaN -> 0x7FC0."""
    u = f32_bits(x)
    r = U32(U32(u + U32(U32(u >> U16) & U1)) + U32(0x7FFF)) >> U16
    return _BF16_QNAN if x != x else U32(r)


@register_jitable
def f16_round(x):
    """float32 -> IEEE fp16 bits (uint32), round to nearest even, as ``vcvtps2ph`` / ``torch.Tensor.half()``.

    Normal results round the mantissa by integer arithmetic (a carry rolls into the exponent, up to inf at
    65520); subnormal results let the FPU round: ``|x| + 0.5`` has a ulp of 2^-24, the fp16 subnormal step.
    NaN keeps its sign and top payload bits and becomes quiet, like the hardware conversion.
    """
    u = f32_bits(x)
    sign = U32(u >> U16) & U32(0x8000)
    a = u & U32(0x7FFFFFFF)
    t = U32(a - U32(0x38000000))  # rebias the exponent 127 -> 15 (garbage when a is small: not selected then)
    normal = U32(U32(t + U32(U32(t >> U13) & U1)) + U32(0x0FFF)) >> U13
    sub = U32(f32_bits(bits_f32(a) + np.float32(0.5)) - U32(0x3F000000))
    h = U32(normal) if a >= U32(0x38800000) else sub  # 0x38800000 = 2^-14, the smallest normal fp16
    h = U32(0x7C00) if a >= U32(0x47800000) else h  # |x| >= 65536 (from 65520 the carry gives inf)
    h = U32(U32(0x7E00) | U32(a >> U13)) & U32(0x7FFF) if a > U32(0x7F800000) else h
    return U32(sign | h)


@njit(nogil=True, cache=True)
def bf16_bits_array(x):
    """bf16 bits (uint16) of a float32 array, by the kernel's rounding (for tests)."""
    out = np.empty(x.shape[0], np.uint16)
    for i in range(x.shape[0]):
        out[i] = np.uint16(bf16_round(x[i]))
    return out


@njit(nogil=True, cache=True)
def f16_bits_array(x):
    """fp16 bits (uint16) of a float32 array, by the kernel's rounding (for tests)."""
    out = np.empty(x.shape[0], np.uint16)
    for i in range(x.shape[0]):
        out[i] = np.uint16(f16_round(x[i]))
    return out


# Gradient and snapshot dtypes arrive as numpy views: fp32 as float32, bf16 as uint16, fp16 as int16 (numba has no
# float16 on the CPU; the two 16-bit formats are told apart by the signedness of their integer view).


def load_grad(grad, i):  # pragma: no cover - typing stub, replaced by the overload below inside numba
    raise NotImplementedError


@overload(load_grad)
def _load_grad_impl(grad, i):
    if grad.dtype == types.float32:
        return lambda grad, i: grad[i]
    if grad.dtype == types.uint16:
        return lambda grad, i: bits_f32(U32(U32(grad[i]) << U16))
    if grad.dtype == types.int16:  # fp16 (the device-side ops for CPU tensors read fp16 models' gradients)

        def load_f16(grad, i):
            h = U32(np.uint16(grad[i]))
            sign = (h & U32(0x8000)) << U16
            e = (h >> U32(10)) & U32(0x1F)
            mant = h & U32(0x3FF)
            if e == U32(0):  # zero or subnormal: mant * 2^-24 is exact in fp32
                mag = np.float32(mant) * np.float32(5.9604644775390625e-08)
                return -mag if sign else mag
            if e == U32(0x1F):  # inf or NaN: keep the payload, quiet bit included
                return bits_f32(sign | U32(0x7F800000) | (mant << U13))
            return bits_f32(sign | ((e + U32(112)) << U32(23)) | (mant << U13))

        return load_f16
    return None


def store_snap(snap, i, p):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(store_snap)
def _store_snap_impl(snap, i, p):
    if isinstance(snap, types.NoneType):
        return lambda snap, i, p: None
    if snap.dtype == types.float32:

        def store_f32(snap, i, p):
            snap[i] = p

        return store_f32
    if snap.dtype == types.uint16:

        def store_bf16(snap, i, p):
            snap[i] = np.uint16(bf16_round(p))

        return store_bf16
    if snap.dtype == types.int16:

        def store_f16(snap, i, p):
            snap[i] = np.int16(f16_round(p))

        return store_f16
    return None


def store_snap_masked(snap, i, p, mask):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(store_snap_masked)
def _store_snap_masked_impl(snap, i, p, mask):
    """store_snap for a masked (mixed) run of the host kernel: ``p`` where ``mask`` is set, else the old value."""
    # ``mask`` is 0xFFFFFFFF (store) or 0 (keep the old value). The 16-bit formats blend with integer and/or: a
    # select between 16-bit loads made LLVM's cost model refuse to vectorize the loop (bf16 mixed runs: 5.0 ns per
    # element, 1.5 with and/or; one thread, data in L3).
    if isinstance(snap, types.NoneType):
        return lambda snap, i, p, mask: None
    if snap.dtype == types.float32:

        def store_f32(snap, i, p, mask):
            snap[i] = blend(p, snap[i], mask)

        return store_f32
    if snap.dtype == types.uint16:

        def store_bf16(snap, i, p, mask):
            snap[i] = np.uint16(U32(bf16_round(p) & mask) | U32(U32(snap[i]) & U32(~mask)))

        return store_bf16
    if snap.dtype == types.int16:

        def store_f16(snap, i, p, mask):
            old = U32(np.uint16(snap[i]))
            snap[i] = np.int16(np.uint16(U32(f16_round(p) & mask) | U32(old & U32(~mask))))

        return store_f16
    return None


# --- one element of AdamW ---------------------------------------------------------------------------------------------


@register_jitable(error_model="numpy")
def adamw_moments(p, m, v, g, decay, l2, coupled, w, base_is_m, b2, omb2):
    """Decay and moments of one element, with torch's CPU rounding (fma where torch's kernels use one)."""
    p = p * decay  # decoupled decay; decay == 1 (exact) for Adam-L2 or weight_decay == 0
    g = fma(l2, p, g) if coupled else g  # g.add(p, alpha=wd)
    # lerp_: torch computes fma(w, g - m, m) for w < 0.5, else fma(w - 1, g - m, g), w - 1 folded into ``w``.
    m = fma(w, g - m, m if base_is_m else g)
    v = fma(omb2 * g, g, v * b2)  # mul_(beta2).addcmul_(g, g, value=1 - beta2)
    return p, m, v


@register_jitable(error_model="numpy")
def adamw_elem(p, m, v, g, ss, bc2, decay, l2, coupled, w, base_is_m, b2, omb2, eps):
    """One element of torch.optim.AdamW with torch's denominator ``sqrt(v) / bc2 + eps`` (``bc2`` is
    sqrt(1 - beta2^step)): the device-side ops' (numba_device_ops.py). The host kernel has its own denominator
    (cpu_adamw.py's ``_adamw_step``)."""
    p, m, v = adamw_moments(p, m, v, g, decay, l2, coupled, w, base_is_m, b2, omb2)
    denom = math.sqrt(v) / bc2 + eps
    return p - (ss * m) / denom, m, v  # addcdiv_(m, denom, value=-step_size)


# --- host side: zero-copy views and the scalar arguments --------------------------------------------------------------


def flat_view(t: torch.Tensor) -> np.ndarray:
    """Zero-copy 1-D numpy view; bf16 as uint16 bits, fp16 as int16 bits (see the overloads above)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).reshape(-1)
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy().reshape(-1)
    return t.numpy().reshape(-1)  # contiguous (checked), so numpy's reshape is a view


def scalar_hyperparams(count: int, hp: AdamHyperparams) -> tuple:
    """The AdamW kernels' scalar arguments, rounded to float32 exactly where torch rounds them (a Python scalar
    meeting an fp32 tensor): (scale, count, divide, decay, l2, coupled, w, base_is_m, beta2, 1 - beta2, eps, ones),
    for a gradient that is the sum of ``count`` gradients. ``adamw_elem`` takes items 3 to 10."""
    lr, beta1, beta2, eps, weight_decay, decoupled = hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.decoupled
    pow2 = (count & (count - 1)) == 0  # 1 / count is exact: multiply instead of divide (same result, no divider)
    scale = np.float32(1.0 / count) if pow2 else np.float32(1.0)
    w = np.float32(1.0 - beta1)
    base_is_m = bool(abs(w) < 0.5)  # torch's lerp switches formula at weight 0.5
    if not base_is_m:
        w = np.float32(w - np.float32(1.0))
    wd = float(weight_decay)
    coupled = bool(not decoupled and wd != 0.0)
    decay = np.float32(1.0 - lr * wd) if decoupled and wd != 0.0 else np.float32(1.0)
    return (scale, np.float32(count), not pow2, decay, np.float32(wd), coupled, w, base_is_m, np.float32(beta2),
            np.float32(1.0 - beta2), np.float32(eps), np.uint32(0xFFFFFFFF))


@register_jitable
def blend(new, old, mask):
    """``new`` where ``mask`` is all ones, else ``old``, bit for bit.

    Integer and/or rather than a select: LLVM turns ``a[i] = new if keep else a[i]`` into a masked store
    (``vmaskmovps``), which is slow on AMD Zen. A minimal AdamW loop, 16K elements in L2, one thread: 0.40
    ns/element updating every column, 0.77 with the masked store, 0.58 with and/or on a mask LLVM cannot prove to
    be all-ones-or-zero (see ``cpu_adamw._run_mixed``).
    """
    return bits_f32(U32(U32(f32_bits(new) & mask) | U32(f32_bits(old) & U32(~mask))))
