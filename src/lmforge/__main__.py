"""`python -m lmforge ...` (what `torchrun -m lmforge` runs)."""

from lmforge.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
