"""bf16 moments (``state_dtype="bfloat16"``) for the numba host AdamW (:mod:`.cpu_adamw`): stochastic rounding, the
twin of :func:`.reference.moment_noise` / :func:`.reference.bf16_stochastic`.

Moments arrive as float32 arrays, or bf16 as uint16 bits (``flat_view``). Every helper has an fp32 overload that
reduces to a plain load or store, so the fp32 kernels compile to what they were (no hash, no step read).
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload, register_jitable

from ._numba_utils import U16, U32, blend, f32_bits

__all__ = ["moment_noise", "store_moment", "store_moment_masked"]

_SR_SEED = U32(0x2545F491)  # reference.SR_SEED


@register_jitable
def _hash(i, step):
    """reference.moment_noise: lowbias32 of (index ^ rotate(step, 16) ^ seed), all mod 2^32."""
    s = U32(step)
    x = U32(U32(U32(i) ^ U32(U32(s << U16) | U32(s >> U16))) ^ _SR_SEED)
    x = U32(x ^ U32(x >> U16))
    x = U32(x * U32(0x7FEB352D))
    x = U32(x ^ U32(x >> U32(15)))
    x = U32(x * U32(0x846CA68B))
    return U32(x ^ U32(x >> U16))


@register_jitable
def _sr_bf16(x, noise):
    """reference.bf16_stochastic on one element: bf16 bits (uint32) of ``x`` with 16 noise bits added below the cut."""
    r = U32(U32(f32_bits(x) + noise) >> U16)
    return U32(0x7FC0) if x != x else r


def moment_noise(m, i, step):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(moment_noise)
def _moment_noise_impl(m, i, step):
    if m.dtype == types.uint16:
        return lambda m, i, step: _hash(i, step)
    return lambda m, i, step: U32(0)


def store_moment(arr, i, x, noise):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(store_moment)
def _store_moment_impl(arr, i, x, noise):
    if arr.dtype == types.uint16:

        def store_bf16(arr, i, x, noise):
            arr[i] = np.uint16(_sr_bf16(x, noise))

        return store_bf16

    def store_f32(arr, i, x, noise):
        arr[i] = x

    return store_f32


def store_moment_masked(arr, i, x, old, noise, mask):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(store_moment_masked)
def _store_moment_masked_impl(arr, i, x, old, noise, mask):
    # ``old`` is the raw element as loaded (float32, or the uint16 bits): blended back where ``mask`` is 0.
    if arr.dtype == types.uint16:

        def store_bf16(arr, i, x, old, noise, mask):
            arr[i] = np.uint16(U32(_sr_bf16(x, noise) & mask) | U32(U32(old) & U32(~mask)))

        return store_bf16

    def store_f32(arr, i, x, old, noise, mask):
        arr[i] = blend(x, old, mask)

    return store_f32
