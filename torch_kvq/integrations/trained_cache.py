"""The converted cache of a GGUF source: dequantized once into an HF checkpoint folder.

Apart from ``trained`` so that the loader stays small; ``trained``'s module docstring describes
the cache's layout, its marker and when it is rebuilt.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from torch_kvq.integrations.trained_sources import (
    SHIPPED,
    _file_sha256,
    _need,
    _resolve,
    _Source,
    shipped_gguf,
)
from torch_kvq.user_cache import cache_dir

MARKER = "kvq-complete.json"


def _cache_folder(key: tuple[str, int]) -> Path:
    sha, size = key
    return cache_dir("models") / f"gguf-{sha[:16]}-{size}"


def _complete(folder: Path) -> bool:
    """Whether ``folder`` holds every file its marker lists, at the listed sizes."""
    try:
        listed = json.loads((folder / MARKER).read_text())["files"]
        return bool(listed) and all(
            (folder / name).stat().st_size == size for name, size in listed.items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _gguf_for(src: _Source) -> Path:
    if src.gguf is not None:
        return src.gguf
    gguf = shipped_gguf(src.label)
    m = SHIPPED[src.label]
    if src.label == "smollm2-135m" and _file_sha256(gguf) != m.sha256:  # Gemma's: assemble()
        raise ValueError(
            f"{gguf}: sha256 differs from the pinned {m.sha256}; reinstall the package"
        )
    return gguf


def _convert(src: _Source, final: Path) -> None:
    """Dequantize the GGUF (fp32) and save model and tokenizer into ``final`` atomically."""
    _need("transformers", "gguf", "accelerate")
    import transformers

    from torch_kvq.progress import activity

    gguf = _gguf_for(src)
    kw: dict[str, Any] = {}
    try:  # transformers 5.x may keep GGUF blocks packed: ask for a plain float model
        from transformers import GgufConfig

        kw["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # 4.x always dequantizes
        pass
    what = f"converting {gguf.name} once (dequantizing its weights) into {final.parent}"
    with _quiet(transformers), activity(what):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, **kw
        )
        tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _save(src, model, tok, final)


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """transformers' own progress bars off (ours says what happens), restored after."""
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()


def _save(src: _Source, model: Any, tok: Any, final: Path) -> None:
    """``save_pretrained`` model and tokenizer into a temporary folder, list its files in the
    marker, then rename it to ``final`` (replacing an incomplete one)."""
    import transformers

    odd = {p.dtype for p in model.parameters()} - {torch.float32}
    if odd or getattr(model, "hf_quantizer", None) is not None:
        raise RuntimeError(f"{src.label}: transformers left quantized weights ({odd or 'gguf'})")
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".convert-") as tmp:
        out = Path(tmp) / "model"
        model.save_pretrained(str(out))
        tok.save_pretrained(str(out))
        files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
        meta = {"source": src.label, "sha256": src.key[0], "size": src.key[1]}  # type: ignore[index]
        meta |= {"transformers": transformers.__version__, "files": files}
        (out / MARKER).write_text(json.dumps(meta, indent=1) + "\n")
        if final.exists():
            shutil.rmtree(final)
        out.rename(final)


def converted_folder(source: str | Path, *, rebuild: bool = False) -> Path:
    """The HF checkpoint folder ``source`` loads from: the folder itself, or a GGUF's converted
    cache (built when missing or incomplete, or when ``rebuild``)."""
    return _converted(_resolve(source), rebuild)


def _converted(src: _Source, rebuild: bool) -> Path:
    if src.folder is not None:
        return src.folder
    final = _cache_folder(src.key)  # type: ignore[arg-type]
    if not rebuild and _complete(final):
        return final
    with _lock(final):  # one process converts; the others wait, then find it complete
        if rebuild or not _complete(final):
            if final.exists():
                print(f"torch_kvq: rebuilding the model cache {final}", file=sys.stderr)
            _convert(src, final)
    return final


@contextlib.contextmanager
def _lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``<folder>.lock`` (POSIX ``flock``; none where unavailable)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(folder.with_name(folder.name + ".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


__all__ = ["converted_folder"]
