"""Each process names itself in ps and top."""

import fast

job = fast.init(None)
with open("/proc/self/cmdline", "rb") as f:
    title = f.read().replace(b"\0", b" ").decode().strip()
expected = f"fast worker {job.rank}/{job.workers} {job.config.strategy.name}"
assert title.startswith(expected), (title, expected)
