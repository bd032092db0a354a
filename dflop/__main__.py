"""``python -m dflop``: the `dflop` command (how ``torchrun -m dflop run --backend torch`` starts each rank)."""

from dflop.cli.main import entry

if __name__ == "__main__":
    entry()
