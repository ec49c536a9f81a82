"""`python -m fast.cli ...`, the command line's former home, kept for the torchrun commands that name it: the same
as `python -m fast`."""

from fast.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
