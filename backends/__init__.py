"""Execution backends (installed as dflop.backends): the simulator and the torch runtime."""

from dflop.backends.base import (BACKENDS, Backend, BackendResult, ScheduledBatch, ObservedStep, get_backend)

__all__ = ["BACKENDS", "Backend", "BackendResult", "ScheduledBatch", "ObservedStep", "get_backend"]
