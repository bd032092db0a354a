"""The use cases (setup, optimize, simulate, run, resume) over every backend: the layers wired together.

Nothing here decides anything on its own; it loads the run config and data, picks the cost model,
hands them to the optimizer, the scheduler and a backend, and writes the artifacts. No module here
imports torch: a job reaches the torch backend through the registry (``dflop.backends.get_backend``).
"""
