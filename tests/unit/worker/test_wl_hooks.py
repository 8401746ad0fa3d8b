"""Init hooks with real shared libraries built by gcc at test time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from weightlift.api.model import InitHooks
from weightlift.local.models import build_hook_library
from weightlift.worker.hooks import INIT_SYMBOL, HookError, resolve_library, run_init_hooks

RECORDING = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
static const char *LOG = "@LOG@";
static void rec(const char *what, const char *dir, int dev, void *h) {
    FILE *f = fopen(LOG, "a");
    if (!f) return;
    fprintf(f, "%s|%s|%d|%llu\n", what, dir, dev, (unsigned long long)(uintptr_t)h);
    fclose(f);
}
void *triton_pytorch_model_init(const char *model_dir, int device_index) {
    int *s = malloc(sizeof(int));
    *s = device_index;
    rec("init", model_dir, device_index, s);
    return s;
}
void triton_pytorch_model_release(void *h) {
    rec("release", "-", *(int *)h, h);
    free(h);
}
"""

MISSING_SYMBOL = r"""
int some_other_function(void) { return 42; }
"""

INIT_ONLY = r"""
void *triton_pytorch_model_init(const char *model_dir, int device_index) { return 0; }
"""


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    (d / "hooks").mkdir(parents=True)
    return d


def test_recording_library_init_and_release(model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    build_hook_library(model_dir / "hooks" / "librec.so", RECORDING.replace("@LOG@", str(log)))
    session = run_init_hooks(InitHooks(library="hooks/librec.so"), str(model_dir), [0, 1, 3])
    lines = log.read_text().splitlines()
    assert [ln.split("|")[:3] for ln in lines] == [
        ["init", str(model_dir), "0"],
        ["init", str(model_dir), "1"],
        ["init", str(model_dir), "3"],
    ]
    handles = [int(ln.split("|")[3]) for ln in lines]
    assert [session.handles[d] for d in (0, 1, 3)] == handles
    assert all(r.ok for r in session.reports) and [r.device_index for r in session.reports] == [
        0,
        1,
        3,
    ]
    assert session.release() == []
    released = log.read_text().splitlines()[3:]
    assert [(ln.split("|")[0], ln.split("|")[2], int(ln.split("|")[3])) for ln in released] == [
        ("release", "0", handles[0]),
        ("release", "1", handles[1]),
        ("release", "3", handles[2]),
    ]
    assert session.release() == []  # idempotent: no double free
    assert len(log.read_text().splitlines()) == 6


def test_missing_init_symbol_fails_closed(model_dir: Path) -> None:
    build_hook_library(model_dir / "hooks" / "libnosym.so", MISSING_SYMBOL)
    with pytest.raises(HookError) as ei:
        run_init_hooks(InitHooks(library="hooks/libnosym.so"), str(model_dir), [0])
    msg = str(ei.value)
    assert INIT_SYMBOL in msg and "libnosym.so" in msg and str(model_dir) in msg
    assert ei.value.permanent


def test_missing_symbol_not_required_reports(model_dir: Path) -> None:
    build_hook_library(model_dir / "hooks" / "libnosym.so", MISSING_SYMBOL)
    s = run_init_hooks(InitHooks(library="hooks/libnosym.so", required=False), str(model_dir), [0])
    assert len(s.reports) == 1 and not s.reports[0].ok and INIT_SYMBOL in s.reports[0].message


def test_release_symbol_is_optional(model_dir: Path) -> None:
    build_hook_library(model_dir / "hooks" / "libinit.so", INIT_ONLY)
    s = run_init_hooks(InitHooks(library="hooks/libinit.so"), str(model_dir), [0])
    assert s.handles == {0: None}
    assert s.release() == []


def test_missing_library(model_dir: Path) -> None:
    with pytest.raises(HookError, match=r"not found .*triton_pytorch_model_init.*model dir"):
        run_init_hooks(InitHooks(library="hooks/nope.so"), str(model_dir), [0])


def test_not_a_shared_library(model_dir: Path) -> None:
    (model_dir / "hooks" / "bad.so").write_text("not an ELF file")
    with pytest.raises(HookError, match=r"cannot load init hook library .*bad\.so"):
        run_init_hooks(InitHooks(library="hooks/bad.so"), str(model_dir), [0])


def test_escaping_the_model_dir_is_refused(model_dir: Path, tmp_path: Path) -> None:
    outside = build_hook_library(tmp_path / "evil" / "libevil.so", INIT_ONLY)
    with pytest.raises(HookError, match="outside the model dir"):
        resolve_library("../evil/libevil.so", model_dir)
    with pytest.raises(HookError, match="outside the model dir"):
        resolve_library(str(outside), model_dir)
    os.symlink(outside, model_dir / "hooks" / "link.so")
    with pytest.raises(HookError, match="outside the model dir"):
        resolve_library("hooks/link.so", model_dir)
    # explicitly allowed (trusted images)
    assert resolve_library(str(outside), model_dir, allow_outside=True) == outside.resolve()
    s = run_init_hooks(
        InitHooks(library=str(outside), allow_outside_model_dir=True), str(model_dir), [0]
    )
    assert s.reports[0].ok
    s.release()
