"""`python -m fast ...`: the `fast` command (what torchrun starts on every machine)."""

from fast.tools.cli import main

raise SystemExit(main())
