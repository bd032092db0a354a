"""Execution backends (installed as dflop.backends)."""
