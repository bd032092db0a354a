"""Bounds on what dflop reads, in one place: beyond them an input is refused with a clear error
instead of failing later with a RecursionError, an overflow or a MemoryError."""

MAX_DEPTH = 64
"""Deepest nesting of lists and mappings in an input file (dflop's own files nest a few levels;
a parser recursing into thousands would fail with a RecursionError instead)."""
MAX_INT = 2**53
"""Largest magnitude of an integer in a spec: every integer up to it is exact as a float too."""
MAX_FLOAT = 1e30
"""Largest magnitude of a real number in a spec, far beyond any hardware or model figure, so that
the product of two of them (GiB to bytes, FLOPs over FLOP/s) stays finite."""
MAX_FILE_BYTES = 2**34
"""Largest input file read (16 GiB): a manifest of MAX_SAMPLES long conversations fits; a sparse
file of terabytes is refused before it is read."""
MAX_SIZE = 2**20
"""Largest architecture size (layers, hidden width, heads, vocabulary, tokens per tile): many
times any published model's, small enough that a cost stays finite."""
MAX_SECONDS = 86_400.0
"""Longest time limit (one day), within what timers and waits accept."""
MAX_SAMPLES = 10_000_000
"""Samples drawn from a synthetic mix or read from a dataset (each costs about 0.5 kB in memory)."""
MAX_GLOBAL_BATCH = 1_000_000
"""Samples per optimizer step (every candidate plan holds a few global batches in memory)."""
MAX_PREDICTION_ERROR = 3.0
"""Largest per-sample prediction error (the sigma of a lognormal cost factor): at 3 one standard
deviation is a factor of 20 on a sample's cost, far beyond any cost model worth planning with."""
MAX_STEPS = 100_000
"""Steps simulated in one run (every step's events are kept in one trace)."""
MAX_GPUS = 1_000_000
"""GPUs (and nodes) of a cluster: beyond any machine built, small enough to search plans for."""
