"""The run configuration: TOML in, typed and validated sections out, every error one line naming the key."""

from fast.config.schema import *  # noqa: F403
from fast.config.schema import _describe  # noqa: F401
