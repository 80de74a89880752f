"""Paddle tensors at the package's edges: paddle <-> torch through DLPack, paddle <-> NumPy for the oracle.

One conversion path on every device. DLPack carries every dtype the contract uses, bfloat16 included (checked
with paddlepaddle 3.3.1 and torch 2.13 on CPU), so ``to_torch`` / ``to_paddle`` are zero-copy on CPU and GPU
alike and the CPU tests run the very code a GPU call runs. Only the stream handling below is GPU-only.

Streams (GPU)
    Paddle and torch each keep their own "current stream" per device, and Paddle's default compute stream is
    not torch's. ``stream_scope`` makes them one: inside it torch's current stream *is* Paddle's current
    stream (``torch.cuda.ExternalStream`` on Paddle's raw stream pointer), so torch kernels launched by a
    backend queue behind the Paddle work that produced their inputs, and the Paddle work after the call queues
    behind them. No host synchronisation. The DLPack handshake (``__dlpack__(stream=consumer_stream)``, done
    by ``torch.from_dlpack`` and ``paddle.from_dlpack``) then sees producer and consumer on the same stream
    and adds nothing; outside ``stream_scope`` the same handshake still orders the two streams with an event.
    Memory torch allocates inside the scope belongs to Paddle's stream in torch's caching allocator, so
    handing it to Paddle (which frees it when its tensor dies) is safe on that stream.
    paddlepaddle-gpu is not installed on our GPU test machine: this GPU branch is written to the two
    libraries' documented stream APIs but is not exercised by our tests (see README, "Paddle").
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import torch


def import_paddle():
    """``import paddle``, without the "No ccache found" warning its import prints (it concerns building C++
    extensions, which this package never does); ImportError names the extra to install."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
            import paddle
    except ImportError as e:
        raise ImportError(f"the Paddle frontend needs paddlepaddle: pip install 'sparse-mqa-testkit[paddle]' ({e})"
                          ) from e
    return paddle


def is_paddle_tensor(x) -> bool:
    """True for a ``paddle.Tensor``, without importing paddle."""
    return type(x).__module__.split(".")[0] == "paddle" and hasattr(x, "place")


def to_torch(x, name: str = "tensor"):
    """A paddle tensor as a torch tensor sharing its memory (DLPack); None stays None.

    The autograd link is cut (``detach``): gradients are the business of the caller's autograd (a
    ``paddle.autograd.PyLayer``).
    """
    if x is None:
        return None
    if not is_paddle_tensor(x):
        raise ValueError(f"{name} must be a paddle.Tensor, got {type(x).__module__}.{type(x).__name__}")
    try:
        return torch.from_dlpack(x.detach())
    except Exception as e:  # e.g. a dtype DLPack cannot carry: still name the argument
        raise ValueError(f"{name} ({x.dtype} on {x.place}) cannot be handed to torch through DLPack: {e}") from e


def to_paddle(t, name: str = "tensor"):
    """A torch tensor as a paddle tensor sharing its memory (DLPack); None stays None."""
    paddle = import_paddle()
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__module__}.{type(t).__name__}")
    try:
        return paddle.from_dlpack(t.detach())
    except Exception as e:
        raise ValueError(f"{name} ({t.dtype} on {t.device}) cannot be handed to paddle through DLPack: {e}") from e


def to_numpy(x) -> np.ndarray | None:
    """A paddle tensor as a NumPy array (a copy on the host); bfloat16 becomes ``ml_dtypes.bfloat16``.

    Paddle's own ``.numpy()`` returns a bfloat16 tensor's raw bits as uint16; they are reinterpreted here.
    """
    if x is None:
        return None
    if not is_paddle_tensor(x):
        raise ValueError(f"expected a paddle.Tensor, got {type(x).__module__}.{type(x).__name__}")
    a = x.detach().cpu().numpy()
    if str(x.dtype) == "paddle.bfloat16":
        import ml_dtypes

        a = a.view(ml_dtypes.bfloat16)
    return a


def from_numpy(a, place: str = "cpu"):
    """A NumPy array (``ml_dtypes.bfloat16`` included) as a paddle tensor on ``place`` ("cpu", "gpu:0", ...)."""
    paddle = import_paddle()

    if a is None:
        return None
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":  # paddle takes no ml_dtypes arrays: carry the raw bits (NaN payloads too)
        t = paddle.to_tensor(np.ascontiguousarray(a).view(np.uint16), place=place).view(paddle.bfloat16)
    else:
        t = paddle.to_tensor(np.ascontiguousarray(a), place=place)
    return t


def case_tensors(case, place: str = "cpu") -> dict:
    """``case.inputs()`` as paddle tensors with kernel dtypes on ``place`` (sm_scale and d_v stay numbers)."""
    x = case.inputs()
    return {k: (v if k in ("sm_scale", "d_v") else from_numpy(v, place)) for k, v in x.items()}


@contextlib.contextmanager
def stream_scope(x):
    """Make torch's current stream Paddle's current stream on ``x``'s GPU for the duration (no-op on CPU).

    Run a torch computation on paddle tensors, and the DLPack conversions in and out, inside this scope.
    """
    if x is None or not x.place.is_gpu_place():
        yield
        return

    paddle = import_paddle()

    dev = x.place.gpu_device_id()
    ptr = int(paddle.device.current_stream(f"gpu:{dev}").stream_base.raw_stream)
    # 0 is the legacy default stream, which is torch's default stream too
    stream = torch.cuda.default_stream(dev) if ptr == 0 else torch.cuda.ExternalStream(ptr, device=dev)
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        yield
