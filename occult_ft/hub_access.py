"""Whether the Hugging Face Hub can be reached, and whether a repo is in the local Hub cache, without
the Hub libraries (standard library only, so commands answer before anything heavy is imported).

The Hub libraries retry a failed connection for over a minute and log every try; occult_ft asks once,
with a short timeout, and then either reads the cache in offline mode or stops with one line naming
the endpoint and the reason (`occult_ft.commands._common.check_hub_sources`, `occult_ft.hub`).
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "hub_endpoint",
    "hub_cache",
    "is_cached",
    "offline_requested",
    "offline_variable",
    "offline_refusal",
    "hub_unreachable",
    "go_offline",
]


def hub_endpoint() -> str:
    """The Hub's URL: `HF_ENDPOINT`, else https://huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hub_cache() -> str:
    """The Hub cache directory, resolved as huggingface_hub does (HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return os.path.join(os.path.expanduser(home), "hub")


def _datasets_cache() -> str:
    if os.environ.get("HF_DATASETS_CACHE"):
        return os.path.expanduser(os.environ["HF_DATASETS_CACHE"])
    return os.path.join(os.path.dirname(hub_cache()), "datasets")


def _non_empty(folder: str) -> bool:
    try:
        with os.scandir(folder) as entries:
            return any(True for _ in entries)
    except OSError:
        return False


def is_cached(repo_id: str, kind: str = "models") -> bool:
    """Whether a snapshot of `repo_id` is cached (`kind`: models or datasets; a dataset also counts when
    the datasets library's own cache holds it)."""
    if _non_empty(os.path.join(hub_cache(), f"{kind}--{repo_id.replace('/', '--')}", "snapshots")):
        return True
    return kind == "datasets" and _non_empty(os.path.join(_datasets_cache(), repo_id.replace("/", "___")))


def offline_variable() -> str | None:
    """The variable that turns offline mode on, read as huggingface_hub reads it (HF_HUB_OFFLINE when set
    and non-empty, else TRANSFORMERS_OFFLINE; a true value is 1, ON, YES or TRUE), or None."""
    var = "HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"
    return var if os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE") else None


def offline_requested() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set to a true value."""
    return offline_variable() is not None


def offline_refusal(what: str) -> str | None:
    """The one line refusing `what` (e.g. "pushing to the Hub") in offline mode, else None: which variable
    turned it on and how to turn it off. Said before anything tries the network, whose own error would
    blame name resolution."""
    var = offline_variable()
    if var is None:
        return None
    return (
        f"{what}: offline mode is on ({var}={os.environ[var]}), so the Hub is not contacted; unset {var} "
        f"(or set {var}=0) to go online, then run it again"
    )


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """None when the Hub endpoint answers (any HTTP status, through the proxy settings of the
    environment), else the reason, after a single try."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(hub_endpoint(), method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return getattr(reason, "strerror", None) or str(reason) or type(exc).__name__
    return None


def go_offline() -> None:
    """Offline mode for the Hub libraries: they read it at import, so it is set in the environment for
    those not imported yet and on the ones already imported."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    for module in ("huggingface_hub.constants", "datasets.config"):
        if module in sys.modules:
            sys.modules[module].HF_HUB_OFFLINE = True  # type: ignore[attr-defined]
