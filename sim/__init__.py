"""SimPy executor of pipeline programs (installed as dflop.sim)."""
