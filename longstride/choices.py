"""Choice fields of the config schemas: an Enum per field, so a typo fails while the config is composed,
with the valid names listed (OmegaConf checks Enum-typed fields).

A Choice is also a str: it compares, hashes, formats and serialises (json, yaml) as its name, so the
code and every file it writes see plain strings."""
from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def names(cls) -> list[str]:
        return [m.value for m in cls]


class WandbMode(Choice):
    """wandb's run modes (training's logger and the eval commands)."""

    offline = "offline"
    online = "online"
    disabled = "disabled"
