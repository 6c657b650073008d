"""Process-level settings. Environment variables are read here, once, and nowhere else."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessSettings:
    home: Path  # cache directory: converted models, drafters, results


def settings_from_env() -> ProcessSettings:
    home = os.environ.get("SPECPOOL_HOME") or str(Path.home() / ".cache" / "specpool")
    return ProcessSettings(home=Path(home).expanduser())
