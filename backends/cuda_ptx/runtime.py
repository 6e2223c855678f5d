"""The driver-API side of the ``cuda_ptx`` backend (GPU only): one device's context, modules and launches.

:class:`DeviceRuntime` owns one device's state: the primary context (torch's), the modules loaded with
``cuModuleLoadData`` and their ``CUfunction`` handles (dynamic shared memory raised with ``cuFuncSetAttribute``), and
launches on torch's current stream with ``cuLaunchKernel`` (or ``cuLaunchKernelEx`` with programmatic dependent
launch). Every driver call is checked (:func:`~._bindings.check_driver`). A launch allocates no device memory and
never synchronizes the host, so it can be captured in a CUDA graph. :func:`pdl_launch_config` builds the PDL launch
configuration (host structures only: built and checked without a GPU).
"""

from __future__ import annotations

import threading

import torch

from ._bindings import CONTEXT_ERRORS, CudaPtxError, DriverError, bindings, check_driver
from .args import PackedArgs
from .nvrtc import CompileCache, CompileTarget, Compiled, nvrtc_version, select_target
from .source import kernel_program
from .spec import KernelSpec, LaunchConfig

__all__ = ["DeviceRuntime", "pdl_launch_config"]


class DeviceRuntime:
    """One CUDA device's driver-API state for the backend.

    Uses torch's primary context of device ``index`` (retained with ``cuDevicePrimaryCtxRetain`` and
    made current when a thread has none), loads modules with ``cuModuleLoadData`` and keeps their
    functions per :class:`KernelSpec`.

    Args:
        index: torch / driver device ordinal.
        cache: the compile cache.
    Raises:
        DriverError: a driver call fails (the message names it).
    """

    def __init__(self, index: int, cache: CompileCache):
        driver, _ = bindings()
        self.index = int(index)
        self.cache = cache
        self._lock = threading.Lock()
        self._functions: dict[KernelSpec, object] = {}
        self._modules: list = []
        self._tls = threading.local()
        with torch.cuda.device(self.index):
            torch.cuda.init()
            check_driver(driver.cuInit(0), "cuInit")
            self._device = check_driver(driver.cuDeviceGet(self.index), "cuDeviceGet")
            self.compute_capability = torch.cuda.get_device_capability(self.index)
            self._ctx = check_driver(driver.cuDevicePrimaryCtxRetain(self._device), "cuDevicePrimaryCtxRetain")
            self._ctx_int = int(self._ctx)
            self.smem_optin = int(check_driver(driver.cuDeviceGetAttribute(
                driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, self._device),
                "cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)"))
            self.ensure_context()
        self.target: CompileTarget = select_target(self.compute_capability)
        # programmatic dependent launch: an sm_90+ device running code compiled for sm_90+ (the kernels'
        # griddepcontrol.wait exists only there; an older PTX fallback must not launch early). Fixed per
        # device: decided here, not on every launch
        arch = int("".join(ch for ch in self.target.arch if ch.isdigit()) or 0)
        self.pdl_supported: bool = self.compute_capability >= (9, 0) and arch >= 90

    def ensure_context(self) -> None:
        """Make this device's primary context current in the calling thread if it is not."""
        driver, _ = bindings()
        cur = check_driver(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(cur) != self._ctx_int:
            check_driver(driver.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def compiled(self, spec: KernelSpec) -> Compiled:
        """The spec's image for this device (compile cache)."""
        return kernel_program().cached(self.cache, spec.name, spec.options(), self.target)

    def function(self, spec: KernelSpec):
        """The loaded ``CUfunction`` of ``spec`` (compiling and loading on first use)."""
        fn = self._functions.get(spec)
        if fn is not None:
            return fn
        with self._lock:
            fn = self._functions.get(spec)
            if fn is None:
                fn = self._load(spec)
                self._functions[spec] = fn
        return fn

    def _load(self, spec: KernelSpec):
        driver, _ = bindings()
        with torch.cuda.device(self.index):
            self.ensure_context()
            compiled = self.compiled(spec)
            try:
                module = check_driver(driver.cuModuleLoadData(compiled.image), "cuModuleLoadData")
            except DriverError as e:
                if compiled.source == "disk":  # a stale or damaged cache entry: rebuild once
                    self.cache.invalidate(compiled)
                    compiled = self.compiled(spec)
                    module = check_driver(driver.cuModuleLoadData(compiled.image), "cuModuleLoadData")
                else:
                    hint = ""
                    if compiled.target.kind == "ptx":
                        hint = (f"; the image is PTX for {compiled.target.arch} from NVRTC {nvrtc_version()} (the device's "
                                "architecture has no NVRTC cubin target); a driver older than NVRTC rejects newer PTX")
                    raise DriverError(f"{e} while loading {spec.name}{hint}") from None
            self._modules.append(module)
            fn = check_driver(driver.cuModuleGetFunction(module, spec.entry.encode()), f"cuModuleGetFunction({spec.entry})")
            if spec.smem_bytes > 48 * 1024:
                if spec.smem_bytes > self.smem_optin:
                    raise CudaPtxError(f"{spec.name} needs {spec.smem_bytes} bytes of shared memory; the device allows "
                                       f"{self.smem_optin} per block")
                check_driver(driver.cuFuncSetAttribute(
                    fn, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, spec.smem_bytes),
                    f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={spec.smem_bytes})")
        return fn

    def launch(self, spec: KernelSpec, cfg: LaunchConfig, args: PackedArgs, stream: int, pdl: bool = False) -> None:
        """Launch ``spec`` on ``stream`` (torch's current stream handle). Launch only.

        ``pdl``: programmatic dependent launch (CUDA 12.x "PDL", as FlashInfer and TensorRT-LLM chain
        their decode kernels): ``cuLaunchKernelEx`` with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``,
        so the kernel may start before the previous kernel of the stream has finished; the kernel must
        begin with ``griddepcontrol.wait`` (the merge kernel does). Ignored unless
        ``pdl_supported``. Otherwise ``cuLaunchKernel``. Captured by CUDA graphs either way (a
        programmatic edge for ``pdl``).
        """
        self.launch_function(self.function(spec), spec.name, cfg, args.kernel_params, stream, pdl)

    def launch_function(self, fn, name: str, cfg: LaunchConfig, kernel_params: int, stream: int,
                        pdl: bool = False) -> None:
        """:meth:`launch` of a loaded function (``name`` its spec's, for errors) with the address of a packed
        ``kernelParams`` array (:attr:`PackedArgs.kernel_params`), after making this device's context current. The
        driver copies the parameters during the call.

        Raises:
            DriverError: the launch fails.
        """
        self.ensure_context()
        res, what = self._launch_raw(fn, cfg, kernel_params, stream, pdl)
        if (res[0] if type(res) is tuple else res) != 0:  # the message only on failure (formatting costs ~1 us)
            check_driver(res, self._launch_name(what, name, cfg))

    def launch_current(self, fn, name: str, cfg: LaunchConfig, kernel_params: int, stream: int,
                       pdl: bool = False) -> None:
        """:meth:`launch_function` without asking the driver for the calling thread's context first: the bound
        launch's path, where torch's current device is this runtime's (the query and its check cost ~1.5 us of a
        ~6 us launch on an H200 host). A function and a stream belong to one context, so where this device's
        context is not current (a thread that never used it: no context; a context of the user's own) the launch
        fails with nothing enqueued (``CUDA_ERROR_INVALID_CONTEXT`` or ``CUDA_ERROR_INVALID_HANDLE``); then
        :meth:`launch_function` makes the context current and launches again.

        Raises:
            DriverError: that second launch fails, or the first fails with any other error.
        """
        res, what = self._launch_raw(fn, cfg, kernel_params, stream, pdl)
        status = res[0] if type(res) is tuple else res
        if status != 0:
            if int(status) in CONTEXT_ERRORS:
                self.launch_function(fn, name, cfg, kernel_params, stream, pdl)
            else:
                check_driver(res, self._launch_name(what, name, cfg))

    def _launch_raw(self, fn, cfg: LaunchConfig, kernel_params: int, stream: int, pdl: bool) -> tuple:
        """One driver launch on the calling thread's context, unchecked: ``(result, the driver call's name)``;
        ``cuLaunchKernelEx`` with programmatic serialization where ``pdl`` and the device supports it."""
        driver, _ = bindings()
        if pdl and self.pdl_supported:
            return driver.cuLaunchKernelEx(self._pdl_config(cfg, stream), fn, kernel_params, 0), "cuLaunchKernelEx"
        return driver.cuLaunchKernel(fn, *cfg.grid, *cfg.block, cfg.smem, stream, kernel_params, 0), "cuLaunchKernel"

    @staticmethod
    def _launch_name(what: str, name: str, cfg: LaunchConfig) -> str:
        """A failed launch's description for :func:`check_driver`'s message."""
        pdl = ", pdl" if what == "cuLaunchKernelEx" else ""
        return f"{what}({name}, grid={cfg.grid}, block={cfg.block}, smem={cfg.smem}{pdl})"

    def _pdl_config(self, cfg: LaunchConfig, stream: int):
        """A ``CUlaunchConfig`` for ``cfg`` on ``stream`` with the programmatic-serialization attribute, cached per
        thread and (``cfg``, stream) (building one costs ~2 us of Python; at most 64 per thread, the cache starts
        again past that)."""
        cache = getattr(self._tls, "pdl", None)
        if cache is None:
            cache = self._tls.pdl = {}
        key = (cfg, stream)
        config = cache.get(key)
        if config is None:
            if len(cache) >= 64:
                cache.clear()
            config = cache[key] = pdl_launch_config(cfg, stream)
        return config


def pdl_launch_config(cfg: LaunchConfig, stream: int = 0):
    """``CUlaunchConfig`` of ``cfg`` (grid, block, dynamic shared memory) on ``stream`` with one
    attribute, ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 1`` (programmatic dependent
    launch). Host structures only: built and checked without a GPU."""
    driver, _ = bindings()
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = cfg.grid
    config.blockDimX, config.blockDimY, config.blockDimZ = cfg.block
    config.sharedMemBytes = cfg.smem
    config.hStream = driver.CUstream(stream)
    config.attrs = [attr]
    config.numAttrs = 1
    return config
