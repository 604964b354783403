"""Reading a dotenv file, shared by the settings loader and the command-line client (which must
not pay for importing pydantic)."""

from __future__ import annotations

from pathlib import Path


def read_env_file(path: str | Path) -> dict[str, str]:
    """KEY=value pairs of an env file (dotenv syntax: quotes, `export`, comments), keys as
    written; {} when the file does not exist."""
    p = Path(path)
    if not p.is_file():
        return {}
    from dotenv import dotenv_values

    return {k: v for k, v in dotenv_values(p).items() if v is not None}
