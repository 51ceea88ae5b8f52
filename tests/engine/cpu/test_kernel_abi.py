"""The kernels' boundary (engine/cpu/csrc/batchd.h, engine/cpu/abi.py): the ctypes declarations
agree with the one header, field by field and function by function; the builds treat warnings
as errors and carry the flags their arithmetic relies on; the kernels run on torch's own OpenMP
runtime (one libgomp in the process, not two)."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
import torch

from engine.cpu import abi, kernels

HEADER = kernels.CSRC / "batchd.h"
SCALARS = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "int": ctypes.c_int32}
SCALARS |= {"float": ctypes.c_float}


def _code() -> str:
    """The header without its comments and preprocessor lines."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    return "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))


def _ctype(declaration: str) -> tuple[str, object]:
    """(name, ctypes type) of one C declaration such as ``const int64_t *lens``."""
    match = re.fullmatch(r"\s*(?:const\s+)?(\w+)\s*(\**)\s*(\w*)\s*", declaration)
    assert match, declaration
    base, stars, name = match.groups()
    if stars:
        struct = abi.STRUCTS.get(base)
        return name, ctypes.POINTER(struct) if struct else ctypes.c_void_p
    return name, SCALARS[base]


def _structs() -> dict[str, list[tuple[str, object]]]:
    found = {}
    for body, name in re.findall(r"typedef struct \{(.*?)\}\s*(\w+);", _code(), flags=re.S):
        fields = []
        for declaration in filter(str.strip, body.split(";")):
            base = re.match(r"\s*((?:const\s+)?\w+)", declaration)
            assert base, declaration
            for part in declaration[base.end() :].split(","):
                fields.append(_ctype(base.group(1) + " " + part))
        found[name] = fields
    return found


def _prototypes() -> dict[str, tuple[object, list[object]]]:
    found = {}
    pattern = r"(\w+)\s+(batchd_\w+)\(([^)]*)\);"
    for ret, name, params in re.findall(pattern, re.sub(r"\s+", " ", _code())):
        types = [] if params.strip() == "void" else [_ctype(p)[1] for p in params.split(",")]
        found[name] = (None if ret == "void" else SCALARS[ret], types)
    return found


def test_every_struct_of_the_header_is_declared_once_alike() -> None:
    structs = _structs()
    assert set(structs) == set(abi.STRUCTS)
    for name, fields in structs.items():
        declared = abi.STRUCTS[name]._fields_
        assert [(f, t) for f, t in declared] == fields, name


def test_every_function_of_the_header_has_its_prototype() -> None:
    prototypes = _prototypes()
    assert set(prototypes) == set(abi.PROTOTYPES)
    for name, (ret, args) in prototypes.items():
        want_ret, want_args = abi.PROTOTYPES[name]
        assert want_ret == ret, name
        assert len(want_args) == len(args), name
        for a, b in zip(want_args, args, strict=True):
            assert _same(a, b), (name, a, b)


def _same(a: object, b: object) -> bool:
    return a is b or (
        getattr(a, "_type_", None) is not None
        and getattr(a, "_type_", 0) == getattr(b, "_type_", 1)
    )


def test_the_builds_treat_warnings_as_errors_and_carry_their_flags() -> None:
    assert {"-Wall", "-Wextra", "-Werror"} <= set(kernels.FLAGS)
    assert kernels.SOURCE_FLAGS["layer_ops"] == ("-ffp-contract=off",)
    for source in kernels.CSRC.glob("*.[ch]"):
        assert "#pragma GCC optimize" not in source.read_text(), source.name
        assert '#include "batchd.h"' in source.read_text() or source.suffix == ".h", source.name


def test_a_warning_fails_the_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A source that compiles with a warning is not built, so never loaded."""
    if kernels.build("sgemm") is None:
        pytest.skip("no C compiler here")
    source = tmp_path / "csrc"
    source.mkdir()
    for f in kernels.CSRC.glob("*.h"):
        (source / f.name).write_bytes(f.read_bytes())
    (source / "warns.c").write_text("int batchd_warns(void) { int unused; return 0; }\n")
    monkeypatch.setattr(kernels, "CSRC", source)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert kernels.build("warns") is None


def test_the_kernels_share_torchs_openmp_runtime() -> None:
    """Built with -fopenmp and loaded after torch, every kernel's OpenMP regions run on the
    runtime torch loaded: one libgomp in the process's memory map."""
    loaded = [
        kernels.decode_attention(),
        kernels.prefill_attention(),
        kernels.layer_ops(),
        kernels.sgemm(),
        kernels.bgemm(),
    ]
    if not any(loaded):
        pytest.skip("no kernel built here")
    torch.ones(1000).sum()  # torch's own runtime in use
    maps = Path("/proc/self/maps").read_text().splitlines()
    gomp = {ln.split()[-1] for ln in maps if re.search(r"libgomp[^/]*\.so", ln.split()[-1])}
    assert len(gomp) == 1, gomp
