"""Offloaded gradient checkpointing for HF decoder layers, for accel.hf.apply(offload_checkpoints=True).

Gradient checkpointing keeps each checkpointed layer's input on the GPU until the layer's backward recomputes it
([B, T, D] a layer: 28 × 2048 × 3072 bf16 = 0.33 GiB at the 3B shape). `checkpoint` (the signature of HF's
`_gradient_checkpointing_func`: the layer's forward with its keyword arguments bound, then its positional ones,
the hidden state first) keeps that input in pinned host memory instead:

  forward   the layer under no_grad; its input copied to a pinned host buffer on a side stream (the copy waits
            for the input's producer; the input's memory is not reused before the copy ran: record_stream) while
            the layer runs; nothing else kept but references to the other arguments (RoPE tables, masks, the
            image's cross-attention states: shared by every layer, not copied)
  backward  the input copied back on the side stream (the compute stream waits for that copy only), the copy
            back of the layer backwarded next started at once so it overlaps this layer's recompute and backward;
            then the layer recomputed with gradients and backpropagated: the input's gradient, and those of any
            other argument that requires one (a trainable projector's cross-attention states)

The recompute runs under the forward's RNG state (CPU and the input's GPU) and autocast state, as
torch.utils.checkpoint's does, so dropout draws the same mask twice. The output requires a gradient even where no
input does (the layer's own parameters may train), as torch's non-reentrant checkpoint's. A layer is backwarded at
most once (retain_graph through it raises). On CPU the "host copy" is a clone: the same logic, no memory saved.
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import torch

_streams: dict = {}  # CUDA device -> the side stream of the copies to and from the host
_last = None  # weakref to the latest HostCopy: the layer forwarded before the next one, backwarded after it
_anchor = None  # a leaf that requires a gradient: makes the output require one where no input does
_host = {"current": 0, "peak": 0}  # bytes of layer inputs held on the host


def host_bytes() -> dict:
    """{"current", "peak"}: bytes of layer inputs held on the host now and at most since reset_host_peak()."""
    return dict(_host)


def reset_host_peak() -> None:
    _host["peak"] = _host["current"]


def side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device)
    return stream


class HostCopy:
    """A layer input held on the host: pinned, filled on the side stream (CUDA); a clone (CPU). An autograd leaf
    that requires a gradient (the embedding output, which transformers' enable_input_require_grads makes one) is
    kept as it is: the graph holds it anyway. `prev`: the copy made before this one (weak), whose copy back this
    one's backward starts."""

    def __init__(self, x: torch.Tensor):
        global _last
        self.device, self.prev, self.back, self.counted = x.device, _last, None, 0
        if x.is_leaf and x.requires_grad:
            self.host, self.back = x, (x, None)
            return
        if x.is_cuda:
            stream = side_stream(x.device)
            stream.wait_stream(torch.cuda.current_stream(x.device))  # x is written
            self.host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                self.host.copy_(x, non_blocking=True)
            x.record_stream(stream)  # x's memory is not handed out again before the copy ran
        else:
            self.host = x.detach().clone()
        self.counted = self.host.nbytes
        _host["current"] += self.counted
        _host["peak"] = max(_host["peak"], _host["current"])
        _last = weakref.ref(self)

    def prefetch(self) -> None:
        """Start the copy back to the device (once)."""
        if self.back is not None or self.host is None:
            return
        if not self.device.type == "cuda":
            self.back = (self.host, None)
            return
        stream = side_stream(self.device)
        x = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)  # the compute stream's memory
        stream.wait_stream(torch.cuda.current_stream(self.device))  # ... which queued work may still be using
        with torch.cuda.stream(stream):
            x.copy_(self.host, non_blocking=True)
            done = stream.record_event()
        x.record_stream(stream)
        self.back = (x, done)

    def take(self) -> torch.Tensor:
        """The input on its device (the compute stream waits for the copy back); the host copy is released, and the
        copy back of the previous layer's input started."""
        if self.host is None:
            raise RuntimeError("accel.hf.offload: a layer's backward ran twice (retain_graph through an offloaded "
                               "checkpoint is not supported)")
        self.prefetch()
        x, done = self.back
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        self.back = None
        self.release()
        prev = self.prev() if self.prev is not None else None
        if prev is not None:
            prev.prefetch()
        return x

    def release(self) -> None:
        if self.host is not None:
            _host["current"] -= self.counted
            self.host = None

    def __del__(self):
        self.release()


def tensors_in(obj):
    """The tensors in obj (a tensor, or tuples / lists / dicts of them, nested)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)


def substitute(obj, new: dict):
    """obj with each tensor t whose id(t) is in `new` replaced by new[id(t)] (tuples, lists, dicts rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return new.get(id(obj), obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(substitute(o, new) for o in obj)
    if isinstance(obj, dict):
        return {k: substitute(o, new) for k, o in obj.items()}
    return obj


def autocast_states(device_type: str) -> list:
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in {"cpu", device_type}]


class _Offloaded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, rest, x, *leaves):
        # rest: the positional arguments after x; leaves: every tensor in `rest` or function's bound keywords
        # that requires a gradient (and the anchor)
        ctx.set_materialize_grads(False)
        ctx.function, ctx.rest, ctx.leaves = function, rest, leaves
        ctx.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(x.device) if x.is_cuda else None)
        ctx.autocast = (autocast_states(x.device.type), torch.is_autocast_cache_enabled())
        ctx.copy = HostCopy(x)
        ctx.x_requires_grad = x.requires_grad
        out = function(x, *rest)
        ctx.tuple_out = isinstance(out, tuple)
        if not ctx.tuple_out and not isinstance(out, torch.Tensor):
            raise TypeError(f"accel.hf.offload: a checkpointed layer returned {type(out).__name__}, expected a "
                            "tensor or a tuple")
        return out

    @staticmethod
    def backward(ctx, *grads):
        x = ctx.copy.take().detach().requires_grad_(ctx.x_requires_grad)  # the host copy is released
        leaves = [t.detach().requires_grad_(True) for t in ctx.leaves]
        new = {id(t): n for t, n in zip(ctx.leaves, leaves)}
        function, rest = ctx.function, substitute(ctx.rest, new)
        if isinstance(function, functools.partial) and new:
            function = functools.partial(function.func, *substitute(function.args, new),
                                         **substitute(function.keywords, new))
        ctx.function = ctx.rest = ctx.leaves = None
        cpu_rng, gpu_rng = ctx.rng
        devices = [x.device] if gpu_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"), contextlib.ExitStack() as stack:
            torch.set_rng_state(cpu_rng)
            if gpu_rng is not None:
                torch.cuda.set_rng_state(gpu_rng, x.device)
            states, cache = ctx.autocast
            for device_type, enabled, dtype in states:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
            with torch.enable_grad():
                out = function(x, *rest)
        outs = out if ctx.tuple_out else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, x.grad if ctx.x_requires_grad else None, *(t.grad for t in leaves))


def checkpoint(function, *args, **kwargs):
    """HF's `_gradient_checkpointing_func(function, *args)` with the layer's input (args[0]) offloaded to the host
    until its backward (see the module's docstring). Where there is no such input (a floating tensor as the first
    positional argument) or keyword arguments come (torch's checkpoint options), torch's non-reentrant checkpoint
    runs instead; without gradients the layer just runs."""
    if not torch.is_grad_enabled():
        return function(*args)
    if kwargs or not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
        kwargs.setdefault("use_reentrant", False)
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)
    bound = function.keywords if isinstance(function, functools.partial) else {}
    leaves = [t for t in (*tensors_in(args[1:]), *tensors_in(bound), *tensors_in(getattr(function, "args", ())))
              if t.requires_grad]
    if not args[0].requires_grad and not leaves:
        global _anchor
        if _anchor is None:
            _anchor = torch.empty(0, requires_grad=True)
        leaves = [_anchor]
    return _Offloaded.apply(function, args[1:], args[0], *leaves)


def install(layer: torch.nn.Module) -> bool:
    """`layer` (an HF GradientCheckpointingLayer) checkpoints through `checkpoint` where its gradient checkpointing
    is on (enable it before: transformers' gradient_checkpointing_enable sets every layer's function anew)
    -> whether it changed now."""
    current = vars(layer).get("_gradient_checkpointing_func")
    if not getattr(layer, "gradient_checkpointing", False) or current is None or current is checkpoint:
        return False
    layer.llama32_checkpoint = current
    layer._gradient_checkpointing_func = checkpoint
    return True


def uninstall(layer: torch.nn.Module) -> bool:
    """Undo install() -> whether `layer` checkpointed through `checkpoint` until now."""
    original = vars(layer).pop("llama32_checkpoint", None)
    if original is None or vars(layer).get("_gradient_checkpointing_func") is not checkpoint:
        return False
    layer._gradient_checkpointing_func = original
    return True
