"""`fast stop`: end a live run (`run.membership = "live"`) cleanly, as `run.max_time` would: its members end together at
their next boundary, write their records, and the launcher its summary (exit code 0). A fixed run stops with Ctrl-C
or SIGTERM to its launcher, and goes on with `fast train --resume`.

    fast stop RUN_DIR                           a run of this machine: its address and secret are in RUN_DIR
    fast stop --address HOST:PORT --token-file F  another machine's
"""

from __future__ import annotations

from pathlib import Path

from fast.errors import ConfigError
from fast.runtime.membership import Access, read_secret, request_stop
from fast.tools.join import live_run


def stop(run_dir: str | Path | None = None, *, address: str | None = None, token_file: str | Path | None = None) -> str:
    """Ask the run to end; returns its membership address once the run has taken the request."""
    if run_dir is not None:
        found, secret_file = live_run("fast stop", Path(run_dir))
        address, token_file = address or found, token_file or secret_file
    if address is None or token_file is None:
        raise ConfigError("fast stop: give the run's folder, or --address HOST:PORT and --token-file F")
    request_stop(Access.parse(address, read_secret("fast stop", Path(token_file))))
    return address
