"""CUDA C++ kernels built at first use by NVRTC through `cuda-bindings` (no CUDA toolkit
needed) and loaded into torch's context: the build (one cubin per source and options,
cached on disk under $FP4ATTN_CACHE_DIR or ~/.cache/fp4attn, keyed by the source, the
headers it includes, the options and NVRTC's version; a build prints one line), and the
loaded function. Building
also runs without a GPU (the CPU compile checks); loading and launching need one.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

ARCH = "sm_90a"
CACHE_ENV = "FP4ATTN_CACHE_DIR"


def nvrtc():
    try:
        from cuda.bindings import nvrtc as module
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise RuntimeError("the CUDA kernels need NVRTC: pip install cuda-bindings nvidia-cuda-nvrtc "
                           "(the fp4attn[test] extra installs them)") from e
    return module


def driver():
    from cuda.bindings import driver as module

    return module


def check(result, what: str):
    """The value of a cuda-bindings call's (error, value...) result; raises on an error."""
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return result[1] if len(result) == 2 else result[1:]


def nvrtc_version() -> tuple[int, int]:
    return tuple(check(nvrtc().nvrtcVersion(), "nvrtcVersion"))


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "fp4attn") / "cuda"


@dataclass(frozen=True)
class Build:
    cubin: bytes
    log: str  # NVRTC's and ptxas's messages

    def spill_bytes(self) -> int:
        """Local-memory spill stores plus loads reported by ptxas (0 when none)."""
        pairs = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", self.log)
        return sum(int(a) + int(b) for a, b in pairs)

    def registers(self, function: str | None = None) -> int | None:
        """Registers a thread of `function` (None: the first one ptxas reports)."""
        log = self.log
        if function is not None:
            at = log.find(f"Compiling entry function '{function}'")
            if at < 0:
                return None
            log = log[at:]
        m = re.search(r"Used (\d+) registers", log)
        return int(m.group(1)) if m else None

    def serialized_wgmma(self) -> bool:
        """ptxas's note that it serialized the wgmmas (C7510-C7520: a lost pipeline)."""
        return "wgmma.mma_async instructions are serialized" in self.log


def options_for(defines: list[str]) -> list[str]:
    # -v: ptxas reports registers and spills in the log (read by the compile checks)
    return [f"--gpu-architecture={ARCH}", "-std=c++17", "--ptxas-options=-v", *defines]


_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def include_dirs(source_path: Path, options: list[str]) -> list[Path]:
    """Where NVRTC looks for a quoted include after the including file's own folder: the
    options' include paths in order, then the source's folder (compile_source adds it last)."""
    dirs = [Path(o.removeprefix("--include-path=").removeprefix("-I")) for o in options
            if o.startswith("--include-path=") or (o.startswith("-I") and len(o) > 2)]
    return [*dirs, source_path.parent]


def included_headers(source_path: Path, dirs: list[Path]) -> list[tuple[str, Path]]:
    """The headers `source_path` includes by quoted name, directly or through another header,
    each once, in the order found: (the name as written, the file). A header's own
    includes are looked up beside it first, then in `dirs` in order; the source's in `dirs`
    (NVRTC knows the source by name only). A name found nowhere is left out: NVRTC then
    fails to build. Every include counts, whether or not a preprocessor condition takes it."""
    found: list[tuple[str, Path]] = []
    seen: set[Path] = set()
    todo = [(source_path, True)]
    while todo:
        path, is_source = todo.pop(0)
        where = dirs if is_source else [path.parent, *dirs]
        for name in _QUOTED_INCLUDE.findall(path.read_text(errors="replace")):
            header = next((d / name for d in where if (d / name).is_file()), None)
            if header is None or header.resolve() in seen:
                continue
            seen.add(header.resolve())
            found.append((name, header))
            todo.append((header, False))
    return found


def cache_key(source_path: Path, options: list[str]) -> str:
    """The disk cache's key of a build: the source and every header it includes (by the name
    written and their bytes, not their place: the key does not depend on the install path),
    the options and NVRTC's version."""
    key = hashlib.sha256(source_path.read_bytes())
    for name, header in included_headers(source_path, include_dirs(source_path, options)):
        key.update(b"\0" + name.encode() + b"\0" + header.read_bytes())
    key.update(b"\0" + "\0".join(options).encode() + repr(nvrtc_version()).encode())
    return key.hexdigest()[:24]


def compile_source(source_path: Path, options: list[str], label: str, *, use_cache: bool = True,
                   announce: bool = True) -> Build:
    """The cubin of `source_path` built with `options`, from the disk cache or by NVRTC."""
    rtc = nvrtc()
    source = source_path.read_bytes()
    path = cache_dir() / f"{source_path.stem}-{cache_key(source_path, options)}.cubin"
    options = [*options, f"--include-path={source_path.parent}"]  # after the key: not tied to the install path
    if use_cache and path.exists():
        log_path = path.with_suffix(".log")
        return Build(path.read_bytes(), log_path.read_text() if log_path.exists() else "")
    if announce:
        print(f"fp4attn: compiling {label} with NVRTC ...", file=sys.stderr, flush=True)
    prog = check(rtc.nvrtcCreateProgram(source, source_path.name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        err = rtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        size = check(rtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = b" " * size
        rtc.nvrtcGetProgramLog(prog, log)
        log_text = log.decode(errors="replace").rstrip("\0 \n")
        if int(err) != 0:
            raise RuntimeError(f"NVRTC could not compile {source_path.name} ({label}):\n{log_text}")
        size = check(rtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        rtc.nvrtcGetCUBIN(prog, cubin)
    finally:
        rtc.nvrtcDestroyProgram(prog)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(cubin)
            path.with_suffix(".log").write_text(log_text)
            os.replace(tmp, path)  # atomic: concurrent builds of one variant never read half a file
        except OSError:
            pass  # a read-only home: the build still runs, uncached
    return Build(cubin, log_text)


_lock = threading.Lock()
_functions: dict[tuple, object] = {}


def load_function(key, build, name: str, device: torch.device, dynamic_shared: int = 0):
    """The kernel `name` of `build()`'s cubin loaded in the device's primary context
    (torch's), once per (device, key)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        fn = _functions.get((index, key))
        if fn is None:
            drv = driver()
            torch.cuda.init()
            with torch.cuda.device(index):
                torch.cuda.current_stream()  # makes torch's (primary) context current in this thread
                ctx = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
                if int(ctx) == 0:
                    dev = check(drv.cuDeviceGet(index), "cuDeviceGet")
                    ctx = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
                    check((drv.cuCtxSetCurrent(ctx)[0], None), "cuCtxSetCurrent")
                module = check(drv.cuModuleLoadData(build().cubin), "cuModuleLoadData")
                fn = check(drv.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")
                if dynamic_shared:
                    attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                    check((drv.cuFuncSetAttribute(fn, attr, dynamic_shared)[0], None), "cuFuncSetAttribute")
            _functions[(index, key)] = fn
    return fn


def tensor_map(base: int, dims: list[int], strides: list[int], box: list[int], swizzle_bytes: int) -> bytes:
    """A TMA descriptor (cuTensorMapEncodeTiled) of uint8 elements (dims innermost first, strides in bytes of
    dims 1..), as the 128 bytes the kernel's TensorMap holds."""
    drv = driver()
    swizzle = {64: drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
               128: drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B}[swizzle_bytes]
    tmap = check(drv.cuTensorMapEncodeTiled(
        drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8, len(dims), base,
        [drv.cuuint64_t(x) for x in dims], [drv.cuuint64_t(x) for x in strides],
        [drv.cuuint32_t(x) for x in box], [drv.cuuint32_t(1)] * len(dims),
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        f"cuTensorMapEncodeTiled(dims={dims}, box={box})")
    return ctypes.string_at(tmap.getPtr(), 128)
