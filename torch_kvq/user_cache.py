"""Where torch-kvq keeps files it fetches or converts once (trained models, the text corpus).

``$TORCH_KVQ_CACHE`` when set, else ``~/.cache/torch_kvq``. Each user has a sub-folder of its own
(``models/``, ``corpus/``). No torch import.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "TORCH_KVQ_CACHE"


def cache_dir(sub: str) -> Path:
    """``<root>/<sub>``, created if missing; the root is ``$TORCH_KVQ_CACHE`` or
    ``~/.cache/torch_kvq``."""
    root = os.environ.get(ENV)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "torch_kvq"
    path = base / sub
    path.mkdir(parents=True, exist_ok=True)
    return path
