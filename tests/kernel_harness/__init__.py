"""Linux stand-ins for a Mac: the Metal source MLX would compile, a clang type
check of it, and a CPU emulation that runs it.

Every path starts from a ``kernels.Launch``: the source is captured by tracing
``kernels.run_metal`` with ``verbose=True`` under ``mx.export_function`` (MLX
prints the full generated kernel without needing Metal), so the check and the
harness see exactly the text a Mac would compile for that dispatch.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from dflash_mlx import kernels

HERE = Path(__file__).resolve().parent
SHIM = HERE / "metal_shim.h"
EMU = HERE / "metal_emu.h"
CACHE = Path(tempfile.gettempdir()) / "dflash_kernel_harness"
TIMEOUT_S = 60


def _capture_stdout(fn) -> str:
    """Run fn with file descriptor 1 redirected: MLX prints from C++."""
    libc = __import__("ctypes").CDLL(None)
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(1)
        libc.fflush(None)
        os.dup2(tmp.fileno(), 1)
        try:
            fn()
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        return tmp.read().decode()


def generated_source(
    launch: kernels.Launch, source: str | None = None, header: str | None = None
) -> str:
    """The complete Metal source MLX generates for this dispatch.

    ``source``/``header`` replace the files in metal/ (tests break kernels this way).
    """
    kernel = kernels.build_kernel(launch.kernel, source, header)

    def traced(*inputs: mx.array) -> list[mx.array]:
        return kernels.run_metal(replace(launch, inputs=inputs), verbose=True, kernel=kernel)

    out = _capture_stdout(lambda: mx.export_function(lambda *_: None, traced, *launch.inputs))
    match = re.search(r"Generated source code for `\w+`:\n```\n(.*?)```", out, re.S)
    if match is None:
        raise RuntimeError(f"no generated source in MLX output:\n{out}")
    return match.group(1)


def normalize(source: str) -> str:
    """Make MLX's Metal source acceptable C++ for both clang and g++.

    Two Metal-only constructs are rewritten: attributes on the explicit
    instantiation (C++ forbids them there) and kernel-scope threadgroup
    declarations, which become function statics (shared by the threadgroup).
    """
    source = re.sub(r"^template \[\[host_name\(\"\w+\"\)\]\] \[\[kernel\]\] ", "template ", source, flags=re.M)
    return re.sub(r"^(\s*)threadgroup\b", r"\1static threadgroup", source, flags=re.M)


@functools.cache
def _libclang():
    import clang
    import clang.cindex as cindex

    if not cindex.Config.loaded:
        cindex.Config.set_library_file(str(Path(clang.__file__).parent / "native" / "libclang.so"))
    return cindex


def clang_errors(source: str) -> list[str]:
    """Errors from type-checking a generated kernel against the Metal shim."""
    cindex = _libclang()
    name = str(HERE / "kernel.metal.cpp")
    tu = cindex.Index.create().parse(
        name,
        args=["-x", "c++", "-std=c++17", "-fsyntax-only", "-include", str(SHIM)],
        unsaved_files=[(name, normalize(source))],
    )
    return [str(d) for d in tu.diagnostics if d.severity >= cindex.Diagnostic.Error]


# -- CPU harness --------------------------------------------------------------

_PARAM = re.compile(r"^\s*(.+?)\s*\b(\w+)\s*\[\[(\w+)(?:\((\d+)\))?\]\],?$")


def harness_program(source: str) -> str:
    """A C++ program running the generated kernel on a job file (see metal_emu.h)."""
    sig = re.search(r"\[\[kernel\]\] void (\w+)\((.*?)\) \{", source, re.S)
    inst = re.search(r"decltype\((\w+)(<.*?>)\)", source)
    if sig is None or inst is None:
        raise RuntimeError("unrecognised generated kernel source")
    args = []
    for line in sig.group(2).splitlines():
        if not line.strip():
            continue
        ctype, name, attr, slot = _PARAM.match(line).groups()
        args.append(f"({ctype})buffers[{slot}]" if attr == "buffer" else f"id.{attr}")
    call = f"{sig.group(1)}{inst.group(2)}({', '.join(args)})"
    return (
        '#include "metal_emu.h"\n'
        f"{normalize(source)}\n"
        "static void dispatch(uint3 grid, uint3 tg, void** buffers) {\n"
        f"  emu::run_grid(grid, tg, [&](const emu::Ids& id) {{ {call}; }});\n"
        "}\n"
        "int main(int argc, char** argv) { return emu::main(argc, argv, dispatch); }\n"
    )


CXXFLAGS = ["-std=c++20", "-O1", "-pthread", "-Wno-attributes"]


def _build(cmd: list[str], output: Path) -> None:
    tmp = output.with_name(f"{output.name}.{os.getpid()}.tmp")
    result = subprocess.run([*cmd, "-o", str(tmp)], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"harness compile failed:\n{result.stderr}")
    tmp.replace(output)  # atomic: concurrent sessions never see half a file


@functools.cache
def _pch_dir() -> Path:
    """A precompiled metal_emu.h: halves each kernel's compile (std headers)."""
    key = hashlib.sha256((EMU.read_text() + str(CXXFLAGS)).encode()).hexdigest()[:20]
    pch_dir = CACHE / f"pch_{key}"
    pch = pch_dir / "metal_emu.h.gch"
    if not pch.exists():
        pch_dir.mkdir(parents=True, exist_ok=True)
        _build(["g++", *CXXFLAGS, "-x", "c++-header", str(EMU)], pch)
    return pch_dir


def compile_program(program: str) -> Path:
    """Build (once per distinct program, cached across sessions) and return the binary."""
    key = hashlib.sha256((program + EMU.read_text() + str(CXXFLAGS)).encode()).hexdigest()[:20]
    binary = CACHE / f"kernel_{key}"
    if not binary.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        src = CACHE / f"kernel_{key}.cpp"
        src.write_text(program)
        # g++ takes metal_emu.h.gch from the first include dir holding it.
        _build(["g++", *CXXFLAGS, f"-I{_pch_dir()}", f"-I{HERE}", str(src)], binary)
    return binary


def _to_bytes(a: mx.array) -> bytes:
    a = mx.contiguous(a)
    if a.dtype in (mx.float16, mx.bfloat16):
        a = a.view(mx.uint16)
    return np.array(a).tobytes()


def _from_bytes(raw: bytes, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    if dtype in (mx.float16, mx.bfloat16):
        return mx.array(np.frombuffer(raw, np.uint16).reshape(shape)).view(dtype)
    np_dtype = {mx.float32: np.float32, mx.int32: np.int32, mx.uint32: np.uint32}[dtype]
    return mx.array(np.frombuffer(raw, np_dtype).reshape(shape))


# Outputs start as this byte so that an element the kernel never writes shows up.
POISON = 0xA5


def run(
    launch: kernels.Launch, source: str | None = None, header: str | None = None
) -> list[mx.array]:
    """A Runner (see kernels.make_ops) executing the kernel in the CPU harness;
    ``source``/``header`` replace the files from metal/."""
    binary = compile_program(harness_program(generated_source(launch, source, header)))
    inputs = [_to_bytes(a) for a in launch.inputs]
    outputs = [
        bytes([POISON]) * (int(np.prod(shape, dtype=np.int64)) * dtype.size)
        for shape, dtype in zip(launch.output_shapes, launch.output_dtypes)
    ]
    buffers = inputs + outputs
    head = np.array([*launch.grid, *launch.threadgroup, len(buffers), *map(len, buffers)], np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        job, result = Path(tmp) / "job", Path(tmp) / "result"
        job.write_bytes(head.tobytes() + b"".join(buffers))
        subprocess.run([str(binary), str(job), str(result)], check=True, timeout=TIMEOUT_S)
        raw = result.read_bytes()
    offset = sum(map(len, inputs))
    arrays = []
    for out, shape, dtype in zip(outputs, launch.output_shapes, launch.output_dtypes):
        arrays.append(_from_bytes(raw[offset : offset + len(out)], shape, dtype))
        offset += len(out)
    return arrays


def harness_ops(**config: int) -> kernels.KernelOps:
    """KernelOps running every kernel through the CPU harness."""
    return kernels.make_ops("harness", run, **config)
