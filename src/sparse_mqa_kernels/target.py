"""What our TileLang kernels are compiled for: Hopper (sm_90a, for wgmma and the bulk copy engine), also on a
machine without a GPU, where the compile checks and ``precompile`` run."""

TARGET = {"kind": "cuda", "arch": "sm_90a"}
SMEM_LIMIT = 227 * 1024  # dynamic shared memory one block may use on sm_90
# How the compiled kernels are called: TVM-FFI launches on torch's current stream and allocates nothing (out_idx is
# None), which the streams, graph and allocations checks rely on. Pinned so that TILELANG_EXECUTION_BACKEND cannot
# swap in another launcher; "auto" resolves to the same one, and TileLang keys its cache on the resolved name, so
# the pin changes neither the generated code nor the cache keys.
EXECUTION_BACKEND = "tvm_ffi"
# The kernels copy rows 16 bytes at a time (cp.async, TMA): a tensor's first byte must sit on a 16-byte boundary
ALIGN_BYTES = 16


def kernel_ready(t):
    """``t`` contiguous and at a 16-byte aligned address, as the kernels read it: a copy only where needed (a view
    that starts inside its storage, at an odd element, would otherwise fault on the device)."""
    t = t.contiguous()
    return t if t.data_ptr() % ALIGN_BYTES == 0 else t.clone()


def sm_count(device) -> int:
    """The device's SMs (host-side properties, no device work): how many blocks a wave holds."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count
