"""Captured training steps: a step function recorded once as a CUDA graph and replayed (issue 30).

    step = kernelgen.nn.graphs.CapturedStep(train_step, x, labels)   # warms up, then captures
    for xb, yb in batches:
        loss = step(xb, yb)      # xb, yb copied into the captured inputs; the graph replayed

A step of a small network is launch-bound: every op is Python and a kernel launch (5-30 us of host time each), and
the GPU waits for the host.  A replay launches the whole step - forward, backward, loss scaling, optimizer - with one
driver call.  What it asks of the step, and how:
- The step runs on a stream of its own (cuda_launch.on_stream): nn's kernels, copies and allocations, and the
  convolutions (stream=).  runtime/arena.py keeps free lists per stream, so that stream's pool is the graph's: the
  memory the capture allocated and dropped is handed out again only to work on that stream - the replays, in the
  order they run it (torch.cuda.graph's private memory pool; runtime/capture.py lets the convolutions' pooled
  outputs be captured there).
- `warmup` steps run first, uncaptured (they train: torch's warm-up does too): every kernel compiles and every
  convolution plans there - a capture cannot compile -, and a GradScaler moves its state to the device.
- Warm-up and capture run in graph mode (cuda_launch.graph_mode): nothing is read back to the host to decide
  anything; GradScaler's skip of a step with an inf/nan gradient is the optimizer kernels' (amp.py, cuda_optim.py).
- The graph reads its inputs from arrays made here and writes the outputs the capture returned: each replay
  writes those same arrays, so read (or copy) them before the next call.
- A replay repeats what the capture recorded: shapes, the learning rate, the loss scale's *array* (its value
  changes on the device).  Adam's step count lives on the host, so Adam refuses graph mode.
Where capture fails - an op that reads back to the host or runs on the default stream invalidates it - or in the
CUDA simulator, each call runs the function instead (on the stream, in graph mode), with `captured` False and
`reason` saying why.  The constructor trains `warmup` steps (on the example inputs); each call one more.
"""
from __future__ import annotations

import ctypes

from kernelgen.nn.tensor import Tensor, _on_device, device_kernels
from kernelgen.runtime.capture import raw_handle, set_private_pool
from kernelgen.runtime.driver import check_driver, libcuda

_CAPTURE_RELAXED = 2  # CUstreamCaptureMode: the step allocates from its pool while capturing (an allocation is
                      # not a stream operation), as PyTorch's allocator relaxes the mode around cudaMalloc


def _array(a):
    """The array of a Tensor, or `a` itself."""
    return a.data if isinstance(a, Tensor) else a


def _device_array(i, a):
    """inputs[i]'s array; TypeError where it is on the host."""
    data = _array(a)
    if not _on_device(data):
        raise TypeError(f"inputs[{i}] must be a device Tensor or array, got {type(a).__name__} on the host")
    return data


class CapturedStep:
    """`fn(*inputs)` - a training step on device Tensors / arrays - warmed up `warmup` times, captured once, then
    replayed by each call on new inputs of the same shapes and dtypes; a call returns what the capture's fn
    returned (the same objects every call, rewritten by each replay)."""

    def __init__(self, fn, *inputs, warmup: int = 3):
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be an int >= 1 (the capture cannot compile), got {warmup!r}")
        for i, a in enumerate(inputs):
            _device_array(i, a)
        ops = device_kernels()
        self._fn, self._ops = fn, ops
        self._stream = ops.new_stream()
        self._handle = raw_handle(self._stream)
        self._exec = self._graph = None
        set_private_pool(self._handle, True)
        with ops.on_stream(self._stream):
            self._inputs = [self._like(a) for a in inputs]
        self._copy_in(inputs)
        for _ in range(warmup):
            self._run()
        self._stream.synchronize()
        self.captured, self.reason, self._outputs = False, None, None
        if ops.SIM:
            self.reason = "the CUDA simulator has no graphs"
            return
        try:  # (a capture runs nothing: the warm-up steps are all the constructor trains)
            self._capture()
            self.captured = True
        except Exception as e:  # (fn ran `warmup` times: what fails now is the capture)
            self.reason = f"{type(e).__name__}: {e}"

    def _like(self, a):
        """A device array (or Tensor, keeping requires_grad) of a's shape and dtype: the graph's input."""
        data = _array(a)
        arr = self._ops.empty(tuple(data.shape), data.dtype)
        return Tensor(arr, a.requires_grad) if isinstance(a, Tensor) else arr

    def _copy_in(self, inputs):
        if len(inputs) != len(self._inputs):
            raise TypeError(f"expected {len(self._inputs)} inputs, got {len(inputs)}")
        for i, (a, mine) in enumerate(zip(inputs, self._inputs)):
            src, dst = _device_array(i, a), _array(mine)
            if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
                raise ValueError(f"inputs[{i}] must have the captured shape {tuple(dst.shape)} and dtype {dst.dtype}, "
                                 f"got {tuple(src.shape)} {src.dtype}")
        with self._ops.on_stream(self._stream):  # (a blocking stream: the copies wait for the default stream's work)
            for a, mine in zip(inputs, self._inputs):
                src, dst = _array(a), _array(mine)
                self._ops.copy_into(self._ops.view(dst, (dst.size,)), self._ops.view(src, (src.size,)))

    def _run(self):
        with self._ops.on_stream(self._stream), self._ops.graph_mode():
            return self._fn(*self._inputs)

    def _capture(self):
        cu, handle = libcuda(), self._handle
        check_driver(cu.cuStreamBeginCapture_v2(handle, _CAPTURE_RELAXED), "cuStreamBeginCapture")
        graph = ctypes.c_void_p()
        try:
            outputs = self._run()
        finally:  # (ended on an error too: the stream must not stay in capture mode)
            ended = cu.cuStreamEndCapture(handle, ctypes.byref(graph))
        if ended or not graph.value:
            if graph.value:
                cu.cuGraphDestroy(graph)
            raise RuntimeError(f"the step could not be captured (cuStreamEndCapture: CUDA error {ended}): an op read "
                               f"back to the host or ran on another stream")
        self._graph = graph
        executable = ctypes.c_void_p()
        check_driver(cu.cuGraphInstantiateWithFlags(ctypes.byref(executable), graph, 0), "cuGraphInstantiate")
        self._exec, self._outputs = executable, outputs

    def __call__(self, *inputs):
        """Copy `inputs` into the graph's and replay the step; what the capture's step returned, rewritten."""
        self._copy_in(inputs)
        if self._exec is None:
            self._outputs = self._run()
        else:
            check_driver(libcuda().cuGraphLaunch(self._exec, self._handle), "cuGraphLaunch")
        return self._outputs

    def synchronize(self):
        """Wait for the step's work (the replays) to finish."""
        self._stream.synchronize()

    def __del__(self):
        try:
            cu = libcuda()
            if self._exec is not None:
                cu.cuGraphExecDestroy(self._exec)
            if self._graph is not None:
                cu.cuGraphDestroy(self._graph)
            set_private_pool(self._handle, False)
        except Exception:  # (at interpreter exit the driver may be gone first)
            pass
