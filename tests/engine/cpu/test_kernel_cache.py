"""The compiled kernels' cache (engine/cpu/kernels.py): a directory that others could write is
never loaded from, a library whose bytes changed is built again rather than loaded, the key
names the CPU on any architecture, and a compile that fails or hangs leaves nothing behind."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import stat
import time
from pathlib import Path

import pytest

from engine.cpu import kernels

KERNEL = "layer_ops"  # the quickest to build


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A private ``XDG_CACHE_HOME``; skips without a C compiler. Returns the kernels' cache."""
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(kernels, "_REFUSED", set(), raising=False)
    return kernels.cache_dir()


def _built(cache: Path) -> Path:
    """A build of KERNEL in ``cache``, where it is safe."""
    path = kernels.build(KERNEL)
    assert path is not None and path.parent == cache
    return path


# -- the directory ------------------------------------------------------------------------------


def test_a_new_cache_is_private_whatever_the_umask(cache: Path) -> None:
    before = os.umask(0o002)
    try:
        _built(cache)
    finally:
        os.umask(before)
    for path in (cache, cache.parent):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_cache_others_can_write_is_never_loaded_from(
    cache: Path, caplog: pytest.LogCaptureFixture, mode: int
) -> None:
    planted = _built(cache)  # a build that would be taken, were the directory trusted
    cache.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="engine"):
        path = kernels.build(KERNEL)
        assert kernels.build(KERNEL) == path
    assert path is not None and path.parent != cache  # built privately, and it works
    assert kernels._load(KERNEL, kernels.LayerOps) is not None
    assert sorted(cache.iterdir()) == [planted]  # nothing read from or written to it
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per directory
    assert str(cache) in warnings[0] and "writable by group or others" in warnings[0]


def test_a_cache_above_which_others_can_write_is_refused(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _built(cache)
    cache.parent.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="engine"):
        path = kernels.build(KERNEL)
    assert path is not None and path.parent != cache
    assert f"{cache.parent} is writable by group or others" in caplog.text


def test_a_sticky_base_directory_is_allowed(cache: Path) -> None:
    """Like /tmp: others may write the directory the cache lives in, but not rename ours."""
    base = cache.parent.parent
    base.mkdir(parents=True)
    base.chmod(0o1777)
    _built(cache)
    base.chmod(0o777)
    assert kernels.build(KERNEL).parent != cache  # type: ignore[union-attr]


def test_a_cache_owned_by_another_user_is_refused(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root can give a directory to another user")
    _built(cache)
    os.chown(cache, 54321, -1)
    with caplog.at_level(logging.WARNING, logger="engine"):
        path = kernels.build(KERNEL)
    assert path is not None and path.parent != cache
    assert f"{cache} is owned by uid 54321" in caplog.text


# -- the library's digest -----------------------------------------------------------------------


def test_a_build_is_named_by_the_digest_of_its_bytes(cache: Path) -> None:
    import hashlib

    path = _built(cache)
    assert path.stem.endswith("-" + hashlib.sha256(path.read_bytes()).hexdigest())
    assert not stat.S_IMODE(path.stat().st_mode) & 0o022


def test_a_tampered_build_is_built_again_not_loaded(cache: Path) -> None:
    path = _built(cache)
    tampered = bytearray(path.read_bytes())
    tampered[len(tampered) // 2] ^= 0xFF
    path.write_bytes(bytes(tampered))
    again = kernels.build(KERNEL)
    assert again is not None and kernels._verified(again)
    assert again.read_bytes() != bytes(tampered)
    assert [p for p in cache.iterdir() if p.read_bytes() == bytes(tampered)] == []


def test_a_build_others_can_write_is_built_again(cache: Path) -> None:
    path = _built(cache)
    path.chmod(0o777)
    again = kernels.build(KERNEL)
    assert again is not None and kernels._verified(again)
    assert not stat.S_IMODE(again.stat().st_mode) & 0o022


def test_a_library_changed_after_its_check_is_not_loaded(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _built(cache)
    tampered = bytearray(path.read_bytes())
    tampered[-1] ^= 0xFF
    path.write_bytes(bytes(tampered))
    loaded: list[str] = []
    monkeypatch.setattr(kernels, "build", lambda name: path)
    monkeypatch.setattr(ctypes, "CDLL", lambda name, *a, **k: loaded.append(name))
    assert kernels._load(KERNEL, kernels.LayerOps) is None
    assert loaded == []


# -- the CPU's identity -------------------------------------------------------------------------

ARM = """processor\t: 0
BogoMIPS\t: {mips}
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid{extra}
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: {part}
CPU revision\t: 1
"""


def _cpuinfo(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_arm_cpus_get_keys_of_their_own(tmp_path: Path) -> None:
    """/proc/cpuinfo on ARM has no ``flags`` or ``model name``: its own lines name the CPU."""
    n1 = _cpuinfo(tmp_path, "n1", ARM.format(mips="50.00", extra="", part="0xd0c"))
    v1 = _cpuinfo(tmp_path, "v1", ARM.format(mips="50.00", extra=" sve", part="0xd0c"))
    a72 = _cpuinfo(tmp_path, "a72", ARM.format(mips="50.00", extra="", part="0xd08"))
    reboot = _cpuinfo(tmp_path, "n1b", ARM.format(mips="48.00", extra="", part="0xd0c"))
    keys = [kernels._cpu_identity(None, p) for p in (n1, v1, a72)]
    assert len(set(keys)) == 3 and all(keys)
    assert kernels._cpu_identity(None, reboot) == keys[0]  # BogoMIPS is not the CPU


def _fake_compiler(tmp_path: Path, name: str, cc1_line: str) -> str:
    """A compiler whose driver reports ``cc1_line`` for ``-E -v``."""
    script = tmp_path / name
    script.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do [ "$a" = -E ] && { echo ' + repr(cc1_line) + " >&2; exit 0; }; done\n"
        "exit 1\n"
    )
    script.chmod(0o755)
    return str(script)


def test_without_cpuinfo_the_compilers_native_target_is_the_key(tmp_path: Path) -> None:
    empty = _cpuinfo(tmp_path, "empty", "")
    missing = tmp_path / "missing"
    real = shutil.which(os.environ.get("CC") or "cc")
    if real is not None:
        native = kernels._native_target(real)
        assert "-m" in native  # e.g. -march=znver3 -mavx2 ... or -target-cpu neoverse-n1
        assert native in kernels._cpu_identity(real, empty)
    gcc_a = _fake_compiler(tmp_path, "gcc-a", " /usr/lib/gcc/cc1 -E - -march=armv8.2-a+sve")
    gcc_b = _fake_compiler(tmp_path, "gcc-b", " /usr/lib/gcc/cc1 -E - -march=armv8.2-a")
    clang_a = _fake_compiler(
        tmp_path,
        "clang-a",
        '"/usr/bin/clang" "-cc1" "-triple" "aarch64-unknown-linux-gnu" "-target-cpu" '
        '"neoverse-v1" "-target-feature" "+sve" "-fdebug-compilation-dir=/here"',
    )
    clang_b = _fake_compiler(
        tmp_path,
        "clang-b",
        '"/usr/bin/clang" "-cc1" "-triple" "aarch64-unknown-linux-gnu" "-target-cpu" '
        '"neoverse-n1" "-target-feature" "+neon" "-fdebug-compilation-dir=/here"',
    )
    clang_a_elsewhere = _fake_compiler(
        tmp_path,
        "clang-a2",
        '"/usr/bin/clang" "-cc1" "-triple" "aarch64-unknown-linux-gnu" "-target-cpu" '
        '"neoverse-v1" "-target-feature" "+sve" "-fdebug-compilation-dir=/elsewhere"',
    )
    keys = [
        kernels._cpu_identity(cc, path)
        for cc in (gcc_a, gcc_b, clang_a, clang_b)
        for path in (empty, missing)
    ]
    assert len(set(keys)) == 4 and all(keys)
    assert kernels._cpu_identity(clang_a_elsewhere, empty) == kernels._cpu_identity(clang_a, empty)
    assert "-target-cpu neoverse-v1" in kernels._cpu_identity(clang_a, empty)


def test_no_word_on_the_cpu_means_no_shared_build(
    cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(kernels, "CPUINFO", tmp_path / "missing")
    monkeypatch.setattr(kernels, "_native_target", lambda compiler: "")
    path = kernels.build(KERNEL)
    assert path is not None and path.parent != cache


# -- a compile that fails or hangs --------------------------------------------------------------

COMPILER = """#!/bin/sh
for a in "$@"; do
  case "$a" in
    --version) echo "fake-cc 1.0"; exit 0 ;;
    -E) echo " /fake/cc1 -E - -march=fake" >&2; exit 0 ;;
  esac
done
prev=""
for a in "$@"; do [ "$prev" = -o ] && out="$a"; prev="$a"; done
echo half > "$out"
echo part > "${TMPDIR:-/tmp}/cc-fake-part.s"
(sleep 1; echo late > "$out.late") &
[ "$FAKE_CC" = fail ] && { echo "error: no" >&2; exit 1; }
sleep 30
"""


@pytest.mark.parametrize("how", ["timeout", "fail"])
def test_a_compile_that_fails_or_hangs_leaves_nothing(
    cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, how: str
) -> None:
    """Nor does what the compiler started: its process group goes with it."""
    script = tmp_path / "cc"
    script.write_text(COMPILER)
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))
    monkeypatch.setenv("FAKE_CC", how)
    monkeypatch.setattr(kernels, "COMPILE_TIMEOUT_S", 0.5, raising=False)
    started = time.monotonic()
    assert kernels.build(KERNEL) is None
    assert time.monotonic() - started < 10
    time.sleep(1.5)  # past the moment the compiler's child would have written
    assert cache.is_dir()
    assert list(cache.rglob("*")) == []


def test_no_build_is_kept_beside_the_sources() -> None:
    """Builds live in the per-machine cache; one beside the sources is for some other CPU."""
    here = kernels.CSRC.parent
    assert sorted(here.glob("*.so")) == [] and sorted(kernels.CSRC.glob("*.so")) == []
