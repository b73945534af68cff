"""`python -m minillm ...` = the `minillm` command (torchrun needs a module: `torchrun ... -m minillm serve`)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
