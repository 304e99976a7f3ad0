"""Facts about the host the process runs on: the memory available to it."""
from __future__ import annotations

import os

from specrt.errors import ConfigError

ENV_AVAILABLE = "SPECRT_MEM_AVAILABLE_BYTES"  # overrides MemAvailable (an integer number of bytes)


def env_bytes(name: str) -> int | None:
    """The number of bytes environment variable `name` holds, None when it is unset or empty; ConfigError
    when it is not an integer >= 0."""
    env = os.environ.get(name, "").strip()
    if not env:
        return None
    try:
        value = int(env)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{name} must be a number of bytes (an integer >= 0), got {env!r}")
    return value


def available_bytes() -> int | None:
    """Memory available to a new allocation: $SPECRT_MEM_AVAILABLE_BYTES, else MemAvailable, else None."""
    env = env_bytes(ENV_AVAILABLE)
    if env is not None:
        return env
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
