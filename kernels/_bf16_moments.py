"""bf16 moments (``state_dtype="bfloat16"``) for the numba host AdamW (:mod:`.cpu_adamw`): stochastic rounding, the
twin of :func:`.reference.moment_noise` / :func:`.reference.bf16_stochastic`.

Moments arrive as float32 arrays, or bf16 as uint16 bits (``flat_view``). Every helper has an fp32 overload that
reduces to a plain load or store, so the fp32 kernels compile to what they were (no hash, no step read). Why the
helpers take their constants as run-time values and pick NaN on the input:
bench/results/host-bf16-moments-2026-12-07.md.

numba's ``cache=True`` watches only ``cpu_adamw.py``: after editing this module, touch that file (``_numba_utils``).
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload, register_jitable

from ._numba_utils import U1, U16, U32, blend, f32_bits, store_snap, store_snap_masked

__all__ = [
    "moment_noise", "noise_key", "run_step", "sr_consts", "store_moment", "store_moment_masked", "store_snapshot",
    "store_snapshot_masked",
]

_SR_SEED = U32(0x2545F491)  # reference.SR_SEED


@register_jitable
def _step_key(step):
    """The step's share of reference.moment_noise's hash input: rotate(step, 16) ^ seed (uint32)."""
    s = U32(step)
    return U32(U32(U32(s << U16) | U32(s >> U16)) ^ _SR_SEED)


@register_jitable
def _lowbias32(x, k1, k2):
    x = U32(x ^ U32(x >> U16))
    x = U32(x * k1)
    x = U32(x ^ U32(x >> U32(15)))
    x = U32(x * k2)
    return U32(x ^ U32(x >> U16))


@register_jitable
def _sr_bf16(x, noise, qnan):
    """reference.bf16_stochastic on one element: bf16 bits (uint32) of ``x`` with 16 noise bits added below the cut;
    ``qnan`` is 0x7FC00000."""
    # NaN replaces the input, not the result (0x7FC00000 + noise < 0x7FC10000 gives 0x7FC0 all the same): LLVM
    # narrowed a select on the result to 16 bits after the pack (vcmpunordps, vextractf128, vpackssdw, vpblendvb per
    # stream); on the input it stays one 32-bit vblendvps.
    u = qnan if x != x else f32_bits(x)
    return U32(U32(u + noise) >> U16)


def sr_consts(m, ones):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(sr_consts)
def _sr_consts_impl(m, ones):
    """The constants of the hash and the roundings, for the other helpers' ``c``: (lowbias32's two multipliers,
    0x7FC00000, 1, 0x7FFF) for bf16 moments, 0 (unused) for fp32 ones. ``ones`` is 0xFFFFFFFF at run time."""
    # Each ANDed with ``ones``: loop-invariant values LLVM hoists and keeps in a register or a stack slot that the
    # instruction reads. As literal constants, with every vector register taken, they were rematerialized inside the
    # loop, two instructions each (movabsq + vpbroadcastd: numba's large code model). The loops with bf16 snapshot,
    # instructions per 8 elements: dense 82 -> 72, mixed 105 -> 96.
    if m.dtype == types.uint16:
        return lambda m, ones: (U32(U32(0x7FEB352D) & ones), U32(U32(0x846CA68B) & ones),
                                U32(U32(0x7FC00000) & ones), U32(U1 & ones), U32(U32(0x7FFF) & ones))
    return lambda m, ones: U32(0)


def noise_key(m, step):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(noise_key)
def _noise_key_impl(m, step):
    if m.dtype == types.uint16:
        return lambda m, step: _step_key(step)
    return lambda m, step: U32(0)


def moment_noise(m, i32, key, c):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(moment_noise)
def _moment_noise_impl(m, i32, key, c):
    """reference.moment_noise of the element whose flat index is ``i32`` (mod 2^32, uint32) at the step whose
    ``noise_key`` is ``key``; 0 (unused) for fp32 moments."""
    if m.dtype == types.uint16:
        return lambda m, i32, key, c: _lowbias32(U32(i32 ^ key), c[0], c[1])
    return lambda m, i32, key, c: U32(0)


def run_step(m, slot, col_step, a):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(run_step)
def _run_step_impl(m, slot, col_step, a):
    """The step count of a uniform run of columns that starts at ``a``: its first updated column's (``slot < 0``; a
    run's first block has one), for ``noise_key``. fp32 moments need none: 0, and no scan."""
    if m.dtype == types.uint16:

        def first_updated(m, slot, col_step, a):
            while slot[a] >= 0:
                a += np.uint64(1)
            return col_step[a]

        return first_updated
    return lambda m, slot, col_step, a: U32(0)


def store_moment(arr, i, x, noise, c):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(store_moment)
def _store_moment_impl(arr, i, x, noise, c):
    if arr.dtype == types.uint16:

        def store_bf16(arr, i, x, noise, c):
            arr[i] = np.uint16(_sr_bf16(x, noise, c[2]))

        return store_bf16

    def store_f32(arr, i, x, noise, c):
        arr[i] = x

    return store_f32


def store_moment_masked(arr, i, x, old, noise, mask, c):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(store_moment_masked)
def _store_moment_masked_impl(arr, i, x, old, noise, mask, c):
    # ``old`` is the raw element as loaded (float32, or the uint16 bits): blended back where ``mask`` is 0.
    if arr.dtype == types.uint16:

        def store_bf16(arr, i, x, old, noise, mask, c):
            arr[i] = np.uint16(U32(_sr_bf16(x, noise, c[2]) & mask) | U32(U32(old) & U32(~mask)))

        return store_bf16

    def store_f32(arr, i, x, old, noise, mask, c):
        arr[i] = blend(x, old, mask)

    return store_f32


# --- the bf16 snapshot beside bf16 moments ----------------------------------------------------------------------------
# _numba_utils.bf16_round with the NaN select moved to its input, as in _sr_bf16 (0x7FC00000 rounds to 0x7FC0), and
# its constants from ``sr_consts``: the same bits, five instructions fewer per 8 elements. Only the bf16-moment
# kernels use it, so the fp32-moment kernels keep the code they were measured with.


@register_jitable
def _bf16_rne(x, c):
    u = c[2] if x != x else f32_bits(x)
    return U32(U32(U32(u + U32(U32(u >> U16) & c[3])) + c[4]) >> U16)


def _bf16_pair(m, snap):
    return m.dtype == types.uint16 and isinstance(snap, types.Array) and snap.dtype == types.uint16


def store_snapshot(m, snap, i, p, c):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(store_snapshot)
def _store_snapshot_impl(m, snap, i, p, c):
    """``_numba_utils.store_snap`` of the kernel whose moments are ``m``."""
    if _bf16_pair(m, snap):

        def store_bf16(m, snap, i, p, c):
            snap[i] = np.uint16(_bf16_rne(p, c))

        return store_bf16
    return lambda m, snap, i, p, c: store_snap(snap, i, p)


def store_snapshot_masked(m, snap, i, p, mask, c):  # pragma: no cover - typing stub
    raise NotImplementedError


@overload(store_snapshot_masked)
def _store_snapshot_masked_impl(m, snap, i, p, mask, c):
    """``_numba_utils.store_snap_masked`` of the kernel whose moments are ``m``."""
    if _bf16_pair(m, snap):

        def store_bf16(m, snap, i, p, mask, c):
            snap[i] = np.uint16(U32(_bf16_rne(p, c) & mask) | U32(U32(snap[i]) & U32(~mask)))

        return store_bf16
    return lambda m, snap, i, p, mask, c: store_snap_masked(snap, i, p, mask)
