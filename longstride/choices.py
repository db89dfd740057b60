"""Choice fields of the config schemas: an Enum per field, so a typo fails while the config is composed,
with the valid names listed (OmegaConf checks Enum-typed fields).

A Choice is also a str: it compares, hashes, formats and serialises (json, yaml) as its name, so the
code and every file it writes see plain strings."""
from __future__ import annotations

import os
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


def check_wandb(mode: str, field: str) -> None:
    """wandb's online mode without credentials on this machine is refused before compute, naming `field`: wandb
    would fail only when the run or the eval starts logging."""
    if str(mode) == "online" and not _wandb_key():
        raise ValueError(f"{field}=online needs a wandb login on this machine (wandb login, or WANDB_API_KEY); or "
                         f"use {field}=offline (wandb sync later) or disabled")


def _wandb_key() -> bool:
    """Whether wandb could find credentials, by the places it reads: WANDB_API_KEY or WANDB_IDENTITY_TOKEN_FILE, an
    api_key in its settings file (`wandb login --host`), or `wandb login`'s netrc entry for its host (by host name or
    host:port)."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    settings = os.path.join(os.path.expanduser(os.environ.get("WANDB_CONFIG_DIR", "~/.config/wandb")), "settings")
    try:
        with open(settings) as f:
            if "api_key" in f.read():
                return True
    except OSError:
        pass
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    try:
        hosts = netrc.netrc(os.environ.get("NETRC")).hosts
    except (OSError, netrc.NetrcParseError):
        return False
    return url.hostname in hosts or url.netloc in hosts
