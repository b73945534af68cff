"""`python -m minillm.cli ...` = the `minillm` command."""

from . import main

if __name__ == "__main__":
    raise SystemExit(main())
