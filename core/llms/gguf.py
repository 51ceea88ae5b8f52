"""GGUF files as served models: found, de-quantised once, cached as ordinary model directories.

A ``gguf:<path>`` or ``pkg:<module>`` spec names the file (docs/models.md). The first load
converts it through transformers into float32 and writes a model directory to the model cache,
keyed by the file's content digest; it is written under a temporary name and a lock file, so a
crash never leaves half a cache and two processes never convert one file (docs/core.md). A file
that cannot be served raises :class:`ModelSourceError` naming it. transformers and torch are
imported only when a file is converted."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from core.llms.demo import cache_root  # one cache: converted models beside built ones

logger = logging.getLogger(__name__)

_Mode = Literal["r", "r+", "c"]  # gguf.GGUFReader's modes

GGUF_PREFIX = "gguf:"
GGUF_MAGIC = b"GGUF"
DTYPE = "float32"  # de-quantised weights are exact in float32; the engine casts on load
CONVERSION_VERSION = 1  # bump when the conversion changes, so cached directories are redone
MARKER = "batchd-gguf.json"  # written last: a directory holding it is a complete conversion
_READ = 1 << 20
DIGESTS = ".digests.json"  # file identity -> content digest, in the cache root


class ModelSourceError(ValueError):
    """A model's files cannot be served: missing, not what they claim, unreadable."""


def package_gguf(module: str) -> Path | None:
    """The one ``.gguf`` file installed package ``module`` ships in its directory, found
    without importing it; None when the package ships none or is not installed."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted({p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf")})
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise ModelSourceError(
            f"package {module!r} ships several GGUF files ({names}); "
            f"serve one as gguf:{files[0].parent}/<file>"
        )
    return files[0] if files else None


def gguf_file(spec: str) -> Path | None:
    """The GGUF file ``spec`` names (``gguf:<path>``, a path ending in ``.gguf``, or
    ``pkg:<module>`` shipping one); None for any other spec."""
    if spec.startswith(GGUF_PREFIX):
        return Path(spec.removeprefix(GGUF_PREFIX)).expanduser()
    if spec.startswith("pkg:"):
        return package_gguf(spec.removeprefix("pkg:"))
    if spec.lower().endswith(".gguf") and not spec.startswith("demo:"):
        return Path(spec).expanduser()
    return None


def is_gguf(spec: str) -> bool:
    try:
        return gguf_file(spec) is not None
    except ModelSourceError:
        return True  # a package with several files: reported when the model loads


def source_key(path: Path, root: Path | None = None) -> str:
    """The SHA-256 of the file's whole content (16 hex digits), read once per version of the
    file: remembered in ``root``'s digest index under the file's identity (device, inode,
    size, modification and change times; the change time cannot be set back by anyone)."""
    st = path.stat()
    identity = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    index_path = (Path(root) if root else cache_root()) / DIGESTS
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    entry = index.get(str(path.resolve())) if isinstance(index, dict) else None
    if isinstance(entry, dict) and entry.get("identity") == identity:
        return str(entry["digest"])
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(_READ):
            digest.update(block)
    key = digest.hexdigest()[:16]
    index = index if isinstance(index, dict) else {}
    index[str(path.resolve())] = {"identity": identity, "digest": key}
    try:  # best effort: a lost entry only means the file is read again
        index_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = index_path.with_name(f"{DIGESTS}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index))
        tmp.replace(index_path)
    except OSError:
        logger.warning("could not remember the digest of %s in %s", path, index_path)
    return key


def _sync_tree(directory: Path) -> None:
    """fsync every file under ``directory`` and the directories themselves."""
    for sub, _dirs, files in os.walk(directory):
        for name in files:
            with open(os.path.join(sub, name), "rb") as fh:
                os.fsync(fh.fileno())
        _sync_dir(Path(sub))


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_file(path: Path) -> None:
    """Raise :class:`ModelSourceError` unless ``path`` is a readable file that starts like GGUF."""
    if not path.exists():
        raise ModelSourceError(f"GGUF file {path} does not exist")
    if not path.is_file():
        raise ModelSourceError(f"GGUF file {path} is not a file")
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelSourceError(f"GGUF file {path} cannot be read: {exc}") from exc
    if magic != GGUF_MAGIC:
        raise ModelSourceError(f"{path} is not a GGUF file (it does not start with 'GGUF')")


def cached_dir(path: Path, root: Path | None = None) -> Path:
    """Where the conversion of ``path`` is (or will be) cached."""
    root = Path(root) if root else cache_root()
    # The directory is written by this transformers major version (its tokenizer files are).
    transformers_major = importlib.metadata.version("transformers").split(".")[0]
    name = f"gguf-{path.stem}-{source_key(path, root)}-v{CONVERSION_VERSION}-tf{transformers_major}"
    return root / name


def converted_dir(
    path: Path, root: Path | None = None, say: Callable[[str], None] | None = None
) -> Path:
    """The model directory converted from GGUF file ``path``: from the cache, or converted now
    (``say`` reports what happens; default: this module's logger)."""
    say = say or logger.info
    path = Path(path).expanduser()
    check_file(path)
    target = cached_dir(path, root)
    if (target / MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if (target / MARKER).is_file():  # another process converted it meanwhile
            return target
        for stale in target.parent.glob(f".{target.name}-*"):  # a crashed earlier conversion
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # not a complete conversion (no marker): put aside, redo
            shutil.rmtree(target)
        say(
            f"de-quantising GGUF {path} to {DTYPE} (first load only); "
            f"caching the model directory in {target}"
        )
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other users
        try:
            info = _convert(path, tmp)
            info.update(
                source=str(path),
                size=path.stat().st_size,
                dtype=DTYPE,
                seconds=round(time.monotonic() - started, 1),
            )
            (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
            _sync_tree(tmp)  # durable before it is named: a power loss never leaves half
            tmp.rename(target)
            _sync_dir(target.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        say(
            f"GGUF {path.name}: {info.get('model_type')} with {info.get('parameters', 0) / 1e6:.0f}M "
            f"parameters, converted in {info['seconds']:.1f} s to {DTYPE} in {target}"
        )
    return target


def conversion_info(directory: Path) -> dict | None:
    """What the cache recorded of a converted directory (None: not a GGUF conversion)."""
    try:
        return json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _parse_once() -> Iterator[None]:
    """transformers parses the whole GGUF file again for the config, the tokenizer and the
    weights (seconds each, mostly the tokenizer's vocabulary), and builds gguf's tensor-name
    map once per module of the model (hundreds of times): while this conversion runs (under
    the lock), hand it one parsed read-only reader per file and one map per architecture."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[str, gguf.GGUFReader] = {}

    @functools.cache
    def tensor_name_map(arch: gguf.MODEL_ARCH, n_blocks: int) -> gguf.TensorNameMap:
        return name_map(arch, n_blocks)

    def reader(path: os.PathLike[str] | str, mode: _Mode = "r") -> gguf.GGUFReader:
        if mode != "r":
            return reader_class(path, mode)
        key = os.fspath(path)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    # A function stands in for the class: transformers only calls it.
    gguf.GGUFReader = reader  # type: ignore[misc,assignment]
    gguf.get_tensor_name_map = tensor_name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map  # type: ignore[misc]


def _convert(path: Path, out: Path) -> dict:
    """De-quantise ``path`` into an ordinary model directory ``out``; what it converted."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelSourceError(
            f"GGUF file {path}: reading it needs the {' and '.join(missing)} package(s) "
            f"(pip install {' '.join(missing)})"
        )
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(path.parent), path.name
    try:
        with _parse_once():
            tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    except Exception as exc:
        if "architecture" in str(exc) and "not supported" in str(exc):
            raise ModelSourceError(
                f"GGUF file {path}: transformers {transformers.__version__} cannot read its "
                f"architecture ({exc})"
            ) from exc
        raise ModelSourceError(
            f"GGUF file {path} cannot be read (corrupt or truncated?): {type(exc).__name__}: {exc}"
        ) from exc
    packed = sorted(
        {type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()}
    )
    if packed:  # weights left in GGUF blocks would not load as a plain model
        raise ModelSourceError(f"GGUF file {path}: transformers kept packed weights ({packed})")
    for pname, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ModelSourceError(
                f"GGUF file {path} is corrupt: weight {pname} de-quantises to non-finite values"
            )
    parameters = sum(p.numel() for p in model.parameters())
    # An ordinary model now: no quantizer, no quantization config in config.json.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch.float32
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {
        "model_type": model.config.model_type,
        "parameters": parameters,
        "transformers": transformers.__version__,
    }
