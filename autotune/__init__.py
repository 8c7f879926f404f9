"""Autotuner of zenflow_triton, installed as ``zenflow_triton.autotune``."""

__all__: list[str] = []
