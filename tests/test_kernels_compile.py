"""Type-check every generated Metal kernel with clang and a Metal shim, and show
that the check rejects kernels with real mistakes."""

from __future__ import annotations

import pytest

pytest.importorskip("clang.cindex")

import mlx.core as mx  # noqa: E402

import kernel_harness as H  # noqa: E402
from dflash_mlx import kernels  # noqa: E402


def _attention(dtype: mx.Dtype, D: int, R: int = 1) -> kernels.Launch:
    q = mx.zeros((R, 4, 4, D), dtype)
    kv = mx.zeros((R, 2, 12, D), dtype)
    lengths = mx.full((R,), 9, mx.int32)
    return kernels.plan_block_attention(q, kv, kv, scale=D**-0.5, sliding_window=None, lengths=lengths)


def _greedy(dtype: mx.Dtype, B: int, V: int, R: int = 1) -> kernels.Launch:
    return kernels.plan_greedy_accept(mx.zeros((R, B, V), dtype), mx.zeros((R, B - 1), mx.int32))


def _rejection(dtype: mx.Dtype, B: int, V: int, R: int = 1) -> kernels.Launch:
    return kernels.plan_rejection_accept(
        mx.zeros((R, B, V), dtype), mx.zeros((R, B - 1, V), dtype),
        mx.zeros((R, B - 1), mx.int32), mx.zeros((R, B)),
    )


DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}

# Every template instantiation that ships, plus tiny shapes: MLX binds inputs of
# fewer than 8 elements as `constant` instead of `device`, a different kernel
# (a few rows' lengths, proposals and uniforms; 8 rows or more: `device`).
LAUNCHES = {
    **{f"attention-{n}-D{D}": (_attention, (t, D)) for n, t in DTYPES.items() for D in (64, 128)},
    "attention-device-lengths": (_attention, (mx.float16, 64, 8)),
    **{f"greedy-{n}": (_greedy, (t, 8, 1000)) for n, t in DTYPES.items()},
    **{f"rejection-{n}": (_rejection, (t, 8, 1000)) for n, t in DTYPES.items()},
    "greedy-rows": (_greedy, (mx.bfloat16, 4, 1000, 3)),
    "rejection-rows": (_rejection, (mx.float16, 4, 1000, 3)),
    "greedy-constant-logits": (_greedy, (mx.float32, 1, 5)),
    "rejection-B1": (_rejection, (mx.float32, 1, 1000)),
    "rejection-B1-rows": (_rejection, (mx.float32, 1, 1000, 4)),
    "rejection-constant-q": (_rejection, (mx.float32, 3, 3)),
}


@pytest.mark.parametrize("name", LAUNCHES)
def test_generated_kernel_type_checks(name: str) -> None:
    plan, args = LAUNCHES[name]
    source = H.generated_source(plan(*args))
    assert "[[kernel]] void custom_kernel_dflash_" in source
    assert H.clang_errors(source) == []


def _edit(text: str, old: str, new: str) -> str:
    assert old in text, f"mutation anchor vanished: {old!r}"
    return text.replace(old, new, 1)


GREEDY = kernels.metal_source("greedy_accept.metal")
ATTENTION = kernels.metal_source("block_attention.metal")
REJECTION = kernels.metal_source("rejection_accept.metal")
HEADER = kernels.metal_source(kernels.HEADER)

# (launch, body, header, expected error fragment): each a mistake that would
# only surface when a Mac compiles the kernel at first dispatch.
BROKEN = {
    "type-error": (
        _greedy(mx.float32, 4, 100), _edit(GREEDY, "tg_argmax = index;", "tg_argmax = &index;"),
        None, "pointer to integer",
    ),
    "undeclared-variable": (
        _attention(mx.float32, 64), _edit(ATTENTION, "* scale[0]", "* softmax_scale[0]"),
        None, "undeclared identifier",
    ),
    "threadgroup-as-device": (
        _attention(mx.float16, 128),
        _edit(ATTENTION, "if (sg == 0) {", "device float* spill = tg_acc;\nif (sg == 0) {"),
        None, "'threadgroup float[",
    ),
    # What the kernel looked like before `auto`: fine for big inputs, broken
    # when MLX binds a small logits buffer as `constant`.
    "device-pointer-to-constant": (
        _greedy(mx.float32, 1, 5),
        _edit(GREEDY, "auto x = logits", "const device T* x = logits"),
        None, "'constant float const *'",
    ),
    # Fine once 8 rows or more bind lengths as `device`, broken for fewer.
    "lengths-as-device": (
        _attention(mx.float32, 64, 2),
        _edit(ATTENTION, "const int end =", "const device int32_t* row_lengths = lengths + batch;\nconst int end ="),
        None, "'constant int32_t const *'",
    ),
    "double-on-gpu": (
        _rejection(mx.float32, 4, 100), _edit(REJECTION, "float total = 0.0f;", "double total = 0.0;"),
        None, "poisoned",
    ),
    "template-param-of-other-kernel": (
        _attention(mx.bfloat16, 64), _edit(ATTENTION, "j += NSG", "j += NT"),
        None, "undeclared identifier",
    ),
    "header-call-arity": (
        _greedy(mx.float16, 4, 100), GREEDY,
        _edit(HEADER, "dflash_argmax_merge(best, index, other, other_index);",
              "dflash_argmax_merge(best, other, other_index);"),
        "no matching function",
    ),
    "bfloat-to-pointer": (
        _rejection(mx.bfloat16, 4, 100),
        _edit(REJECTION, "const float threshold =", "device float* bad = pn;\nconst float threshold ="),
        None, "cannot initialize",
    ),
}


@pytest.mark.parametrize("name", BROKEN)
def test_broken_kernel_is_rejected(name: str) -> None:
    launch, body, header, fragment = BROKEN[name]
    errors = H.clang_errors(H.generated_source(launch, body, header))
    assert errors, f"{name}: clang accepted a broken kernel"
    assert any(fragment in e for e in errors), errors
