"""Which errors are out-of-memory errors: a table of the forms PyTorch and its backends raise.

Each form names where it comes from, so that a new PyTorch release can be checked against the
table rather than against a growing list of fragments. Types are checked first; a message is
matched only in its exact family (a prefix such as "cuDNN error: " included), so that text
which merely mentions a status, like cuDNN v8's "Plan failed with a cudnnException: ...
CUDNN_STATUS_NOT_SUPPORTED" warning (aten/src/ATen/native/cudnn/Conv_v8.cpp), is not taken for
an out-of-memory error. The whole `__cause__`/`__context__` chain is searched: the Trainer,
accelerate and user code often re-raise.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Callable

__all__ = ["OomForm", "OOM_FORMS", "is_oom_error", "oom_form", "is_fatal_cuda_error"]

# cudaErrorMemoryAllocation (CUDA runtime) and hipErrorOutOfMemory (HIP) are both 2.
_ACCELERATOR_OOM_CODE = 2


@dataclass(frozen=True)
class OomForm:
    """One way an out-of-memory condition reaches Python."""

    name: str
    source: str  # where in PyTorch (or the library) the type or text comes from
    test: Callable[[BaseException], bool]


def _torch_type(name: str):
    torch = sys.modules.get("torch")  # never imported here: without torch there is no torch error
    return getattr(torch, name, None) if torch is not None else None


def _is_torch_oom(exc: BaseException) -> bool:
    cls = _torch_type("OutOfMemoryError")
    return cls is not None and isinstance(exc, cls)


def _is_accelerator_oom_code(exc: BaseException) -> bool:
    cls = _torch_type("AcceleratorError")
    if cls is None or not isinstance(exc, cls):
        return False
    return (getattr(exc, "error_code", None) == _ACCELERATOR_OOM_CODE
            and re.match(r"\s*(CUDA|HIP) error", str(exc)) is not None)


def _text(pattern: str) -> Callable[[BaseException], bool]:
    regex = re.compile(pattern)
    return lambda exc: regex.search(str(exc)) is not None


OOM_FORMS: tuple[OomForm, ...] = (
    # -- by type ----------------------------------------------------------------------------
    OomForm("torch.OutOfMemoryError",
            "c10::OutOfMemoryError, raised by the caching allocators (c10/cuda/CUDACachingAllocator.cpp, "
            "its HIP build, c10/xpu/XPUCachingAllocator.cpp, aten/src/ATen/mps/MPSAllocator.mm); "
            "torch.cuda.OutOfMemoryError is the same class",
            _is_torch_oom),
    OomForm("torch.AcceleratorError with an out-of-memory code",
            "c10::AcceleratorError carries the runtime's error code into Python (torch >= 2.8): "
            "cudaErrorMemoryAllocation / hipErrorOutOfMemory = 2",
            _is_accelerator_oom_code),
    OomForm("MemoryError",
            "Python's own host-RAM failure; colab_kit.OutOfMemoryError derives from it",
            lambda exc: isinstance(exc, MemoryError)),
    # -- by message family (also as a plain RuntimeError: older torch, or re-raised as text) --
    # The allocators' sentence without its period too: Composer's and Lightning's own tests raise a bare
    # RuntimeError("CUDA out of memory"), and wrappers re-raise it shortened (0.1 caught those).
    OomForm("CUDA caching allocator", "c10/cuda/CUDACachingAllocator.cpp: 'CUDA out of memory. Tried to allocate', "
            "or the bare 'CUDA out of memory' that test suites and wrappers raise",
            _text(r"\bCUDA out of memory\b")),
    OomForm("HIP caching allocator", "the HIP build of CUDACachingAllocator.cpp: 'HIP out of memory. Tried to allocate'",
            _text(r"\bHIP out of memory\b")),
    OomForm("XPU caching allocator", "c10/xpu/XPUCachingAllocator.cpp: 'XPU out of memory. Tried to allocate'",
            _text(r"\bXPU out of memory\b")),
    OomForm("MPS allocator", "aten/src/ATen/mps/MPSAllocator.mm: 'MPS backend out of memory'",
            _text(r"\bMPS backend out of memory\b")),
    OomForm("CUDA runtime API",
            "c10/cuda/CUDAException.cpp (C10_CUDA_CHECK): 'CUDA error: ' + cudaGetErrorString("
            "cudaErrorMemoryAllocation); torch.AcceleratorError since torch 2.8, RuntimeError before",
            _text(r"\bCUDA error: out of memory\b")),
    OomForm("CUDA driver API",
            "c10/cuda/driver_api.h (C10_CUDA_DRIVER_CHECK): 'CUDA driver error: ' + cuGetErrorString("
            "CUDA_ERROR_OUT_OF_MEMORY); the expandable-segments allocator path (cuMemCreate), which the "
            "kit turns on",
            _text(r"\bCUDA driver error: out of memory\b")),
    OomForm("HIP runtime API",
            "the HIP build of C10_CUDA_CHECK on ROCm: 'HIP error: ' + hipGetErrorString(hipErrorOutOfMemory), "
            "as torch.AcceleratorError",
            _text(r"\bHIP error: out of memory\b")),
    OomForm("cuBLAS handle or workspace",
            "aten/src/ATen/cuda/Exceptions.h (TORCH_CUDABLAS_CHECK): 'CUDA error: CUBLAS_STATUS_ALLOC_FAILED "
            "when calling `cublasCreate(handle)`'",
            _text(r"\bCUDA error: CUBLAS_STATUS_ALLOC_FAILED\b")),
    OomForm("cuDNN allocation",
            "aten/src/ATen/cuda/Exceptions.h (AT_CUDNN_CHECK): 'cuDNN error: CUDNN_STATUS_ALLOC_FAILED'",
            _text(r"\bcuDNN error: CUDNN_STATUS_ALLOC_FAILED\b")),
    OomForm("cuDNN workspace for a large batch",
            "AT_CUDNN_CHECK: 'cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed "
            "in a non-contiguous input.'; cuDNN's answer to a workspace it cannot allocate (Lightning's "
            "is_cudnn_snafu and accelerate's should_reduce_batch_size treat it as out of memory too)",
            _text(r"\bcuDNN error: CUDNN_STATUS_NOT_SUPPORTED\b")),
    OomForm("CPU allocator (Linux, macOS)",
            "c10/core/impl/alloc_cpu.cpp, posix_memalign failing: 'DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate N bytes. Error code 12 (Cannot allocate memory)'",
            _text(r"\bDefaultCPUAllocator: can't allocate memory\b")),
    OomForm("CPU allocator (Windows)",
            "c10/core/impl/alloc_cpu.cpp, _aligned_malloc failing: 'DefaultCPUAllocator: not enough memory: "
            "you tried to allocate N bytes.'",
            _text(r"\bDefaultCPUAllocator: not enough memory\b")),
)

# Errors that leave the CUDA context broken: never retried, they need a runtime restart.
_FATAL_CUDA = ("device-side assert", "illegal memory access", "unspecified launch failure",
               "misaligned address", "an illegal instruction", "cuda error: ", "hip error: ")


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def oom_form(exc: BaseException) -> OomForm | None:
    """The first form in `OOM_FORMS` that matches `exc` or an exception in its cause/context chain."""
    for error in _chain(exc):
        for form in OOM_FORMS:
            if form.test(error):
                return form
    return None


def is_oom_error(exc: BaseException) -> bool:
    """True for every out-of-memory error, anywhere in the exception's cause/context chain.

    Recognises `torch.OutOfMemoryError`, `torch.AcceleratorError` with CUDA's or HIP's
    out-of-memory code and `MemoryError` by type, and the exact message families of CUDA's
    runtime and driver APIs, cuBLAS, cuDNN, HIP, XPU, MPS and the CPU allocator (`OOM_FORMS`
    lists each with its source). False for device-side asserts, illegal memory accesses and
    other CUDA errors: those break the CUDA context and need a restart.

    Example:
        >>> is_oom_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
    """
    return oom_form(exc) is not None


def is_fatal_cuda_error(exc: BaseException) -> bool:
    """A CUDA (or HIP) error, not an OOM, after which the runtime must be restarted."""
    if is_oom_error(exc):
        return False
    return any(fragment in str(e).lower() for e in _chain(exc) for fragment in _FATAL_CUDA)
