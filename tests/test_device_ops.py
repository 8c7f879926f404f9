"""kernels/device_ops.py (which module serves which backend, and the protocol all three satisfy) and
kernels/hyperparams.py (the one validator of Adam's hyperparameters)."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math
import os
import re

import pytest
import torch

from zenflow_triton.kernels import AdamHyperparams, DeviceOps, load_device_ops, reference
from zenflow_triton.kernels.hyperparams import require_hyperparams

CPU = torch.device("cpu")
META = torch.device("meta")
OPS = ("column_sumsq_", "fused_step_", "fused_steps_", "merge_")
HP = AdamHyperparams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _public_params(fn) -> list[tuple[str, inspect._ParameterKind, object]]:
    """(name, kind, default) of each parameter, without self and the underscored test knobs of the Triton ones."""
    params = inspect.signature(fn).parameters.values()
    return [(p.name, p.kind, p.default) for p in params if p.name != "self" and not p.name.startswith("_")]


def assert_satisfies_protocol(ops: object) -> None:
    assert isinstance(ops, DeviceOps)
    for name in OPS:
        fn = getattr(ops, name)
        assert callable(fn), name
        assert _public_params(fn) == _public_params(getattr(DeviceOps, name)), name


# --- load_device_ops ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", [CPU, META])
def test_torch_backend_is_the_reference(device) -> None:
    ops = load_device_ops("torch", device)
    assert ops is reference
    assert_satisfies_protocol(ops)


def test_numba_backend_and_auto_on_cpu_are_the_numba_ops() -> None:
    from zenflow_triton.kernels import numba_device_ops

    assert load_device_ops("numba", CPU) is numba_device_ops
    assert load_device_ops("auto", CPU) is numba_device_ops
    assert_satisfies_protocol(numba_device_ops)


def test_auto_off_cpu_and_cuda_is_torch() -> None:
    assert load_device_ops("auto", META) is reference


def test_numba_needs_cpu_tensors() -> None:
    msg = "backend='numba' runs the device-side ops on CPU tensors; the parameters are on meta"
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        load_device_ops("numba", META)


@pytest.mark.parametrize("device", [CPU, META])
def test_triton_off_cuda_needs_the_interpreter(monkeypatch, device) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    msg = (f"backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported to run the "
           f"kernels on {device} tensors; use backend='torch' for {device} tensors")
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        load_device_ops("triton", device)


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
def test_triton_backend_under_the_interpreter_is_the_launchers() -> None:
    from zenflow_triton.kernels import colnorm, fused_step, merge, triton_device_ops

    ops = load_device_ops("triton", CPU)
    assert ops is triton_device_ops
    assert (ops.column_sumsq_, ops.fused_step_, ops.fused_steps_, ops.merge_) == (
        colnorm.column_sumsq_, fused_step.fused_step_, fused_step.fused_steps_, merge.merge_)
    assert sorted(triton_device_ops.__all__) == sorted(OPS)
    assert_satisfies_protocol(ops)


@pytest.mark.gpu
def test_auto_on_cuda_is_triton() -> None:
    from zenflow_triton.kernels import triton_device_ops

    assert load_device_ops("auto", torch.device("cuda")) is triton_device_ops


def _fused_step_args() -> dict:
    return dict(param=torch.zeros(4, 6), grad=torch.zeros(4, 6), score=torch.zeros(6),
                slot=torch.tensor([-1, 0, -1, -1, -1, 1], dtype=torch.int32),
                col_step=torch.ones(6, dtype=torch.int32), master=torch.zeros(4, 2), exp_avg=torch.zeros(4, 2),
                exp_avg_sq=torch.zeros(4, 2), acc=torch.zeros(4, 6), accumulate=False)


def test_every_implementation_rejects_loose_hyperparameters_alike() -> None:
    """A dict where the record belongs is a TypeError naming ``hp``, the same from every implementation."""
    from zenflow_triton.kernels import cpu_adamw, numba_device_ops

    fused = [reference.fused_step_, numba_device_ops.fused_step_]
    if HAS_TRITON:
        from zenflow_triton.kernels import fused_step

        fused.append(fused_step.fused_step_)  # the hp check comes before the device check: nothing launches
    loose = dataclasses.asdict(HP)
    errors = []
    for fn in fused:
        args = _fused_step_args()
        param, grad = args.pop("param"), args.pop("grad")
        with pytest.raises(TypeError) as info:
            fn(param, grad, **args, hp=loose)
        errors.append(str(info.value))
    for fn in (reference.host_adamw_, cpu_adamw.host_adamw_):
        z = torch.zeros(3, 4)
        with pytest.raises(TypeError) as info:
            fn(z, z.clone(), z.clone(), z.clone(), count=1, slot=torch.full((4,), -1, dtype=torch.int32),
               col_step=torch.ones(4, dtype=torch.int32), hp=loose)
        errors.append(str(info.value))
    with pytest.raises(TypeError) as info:
        reference.adam_update_foreach_([torch.zeros(2)], [torch.zeros(2)], [torch.zeros(2)], [torch.zeros(2)],
                                       step=1, hp=loose)
    errors.append(str(info.value))
    assert errors == ["hp must be an AdamHyperparams, got dict"] * len(errors)


# --- AdamHyperparams ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(lr=torch.tensor(1e-3)), "Invalid lr: a Tensor learning rate is not supported; pass a Python float"),
        (dict(lr="0.1"), "Invalid lr: '0.1' (a finite Python float)"),
        (dict(lr=float("nan")), "Invalid lr: nan (a finite Python float)"),
        (dict(lr=float("inf")), "Invalid lr: inf (a finite Python float)"),
        (dict(lr=-1e-3), "Invalid lr: -0.001"),
        (dict(beta1=1.0), "Invalid beta parameter at index 0: 1.0"),
        (dict(beta1=-0.1), "Invalid beta parameter at index 0: -0.1"),
        (dict(beta1=float("nan")), "Invalid beta parameter at index 0: nan"),
        (dict(beta2=1.0), "Invalid beta parameter at index 1: 1.0"),
        (dict(beta2=torch.tensor(0.5)), "Invalid beta parameter at index 1: tensor(0.5000)"),
        (dict(beta2=None), "Invalid beta parameter at index 1: None"),
        (dict(eps=-1e-8), "Invalid epsilon value: -1e-08"),
        (dict(eps=float("inf")), "Invalid epsilon value: inf"),
        (dict(eps=torch.tensor(1e-8)), "Invalid epsilon value: tensor(1.0000e-08)"),
        (dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
        (dict(weight_decay=float("nan")), "Invalid weight_decay value: nan"),
        (dict(weight_decay="0"), "Invalid weight_decay value: '0'"),
        (dict(decoupled=1), "Invalid decoupled: 1 (a bool)"),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={v!r}" for k, v in v.items()),
)
def test_invalid_values_raise_with_torch_style_messages(change, message) -> None:
    with pytest.raises(ValueError) as info:
        dataclasses.replace(HP, **change)
    assert str(info.value) == message


def test_valid_corners_are_kept_as_given() -> None:
    hp = AdamHyperparams(lr=1, beta1=0, beta2=0.0, eps=0, weight_decay=0)
    assert (hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.decoupled) == (1, 0, 0.0, 0, 0, True)
    assert type(hp.lr) is int and type(hp.eps) is int  # stored unconverted: the math sees what the user passed
    assert AdamHyperparams(lr=0.0, beta1=math.nextafter(1.0, 0.0), beta2=0.5, eps=1.0, weight_decay=2.0,
                           decoupled=False).decoupled is False


def test_frozen_hashable_and_replace_revalidates() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        HP.lr = 1.0  # type: ignore[misc]
    twin = AdamHyperparams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    assert twin == HP and hash(twin) == hash(HP) and len({twin, HP}) == 1
    assert dataclasses.replace(HP, decoupled=False) != HP
    with pytest.raises(ValueError, match="Invalid lr"):
        dataclasses.replace(HP, lr=-1.0)


def test_from_group_reads_a_torch_param_group() -> None:
    group = {"params": [], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "other": 1}
    assert AdamHyperparams.from_group(group, decoupled=True) == HP
    assert AdamHyperparams.from_group({**group, "betas": [0.9, 0.999]}, decoupled=False) == dataclasses.replace(
        HP, decoupled=False)
    with pytest.raises(TypeError):
        AdamHyperparams.from_group(group, True)  # type: ignore[misc]  # decoupled is keyword-only


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(betas=(0.9,)), "Invalid betas: (0.9,) (a pair of floats)"),
        (dict(betas=0.9), "Invalid betas: 0.9 (a pair of floats)"),
        (dict(betas=(0.9, 0.99, 0.5)), "Invalid betas: (0.9, 0.99, 0.5) (a pair of floats)"),
        (dict(betas=(0.9, 1.5)), "Invalid beta parameter at index 1: 1.5"),
        (dict(lr=-1), "Invalid lr: -1"),
        (dict(eps=-1.0), "Invalid epsilon value: -1.0"),
    ],
    ids=["one-beta", "scalar-betas", "three-betas", "beta2", "lr", "eps"],
)
def test_from_group_rejects_bad_groups(change, message) -> None:
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, **change}
    with pytest.raises(ValueError) as info:
        AdamHyperparams.from_group(group, decoupled=True)
    assert str(info.value) == message


def test_require_hyperparams() -> None:
    assert require_hyperparams(HP) is HP
    with pytest.raises(TypeError, match="^hp must be an AdamHyperparams, got tuple$"):
        require_hyperparams((1e-3, 0.9, 0.999, 1e-8, 0.0))
