"""The use cases (setup, optimize, simulate, run, resume) over every backend: the layers wired together.

Nothing here decides anything on its own; it loads the run config and data, picks the cost model,
hands them to the optimizer, the scheduler and a backend, and writes the artifacts. Only the torch
run's modules (``train``, ``resume``) import torch, and the CLI imports them only for a torch run.
"""
