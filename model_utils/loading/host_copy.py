"""A GPU model's weights in host memory: one page-locked buffer for all of them (HostCopy),
and the walk over every tensor a model's weights consist of (model_weights, move_weights),
bitsandbytes' 4-bit quantization state included. Parking (parked_models.py) moves a model
into such a buffer and back."""

from __future__ import annotations

import logging
import time

import torch

from model_utils.memory import GB

log = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


class HostCopy:
    """Every weight of a GPU model in one host buffer, page-locked by registering it with CUDA.

    Not torch's pinned tensors: its pinned-memory cache rounds each block up to a power of two
    (up to twice a weight's size) and keeps freed blocks for the life of the process, so the
    host memory of parked models stayed taken after they were dropped (BENCHMARKS.md,
    "Switching modes"). A registered buffer holds what the weights need and goes back to the
    system with the last view into it."""

    ALIGN = 256  # bytes: each weight starts at a multiple of this from the buffer's start

    def __init__(self, tensors: list[torch.Tensor], spare: HostCopy | None = None):
        """`spare`: the buffer of a copy whose weights went back to the GPU, reused (it must
        hold needed_bytes(tensors)): a fresh buffer's pages are faulted in and locked one by
        one, which takes longer than the copy itself."""
        # Offsets in the order the tensors are given: copy() is handed them in that order.
        self._places: list[tuple[int, int]] = []
        total = 0
        for tensor in tensors:
            size = _span(tensor) * tensor.element_size()
            self._places.append((total, size))
            total += -(-size // self.ALIGN) * self.ALIGN
        self._places.reverse()
        if spare is not None:
            if spare.buffer.numel() < total:
                raise ValueError("the spare buffer is smaller than the weights")
            self.buffer, self.pinned = spare.buffer, spare.pinned
            spare.buffer, spare.pinned = None, False  # handed over, not released
        else:
            self.buffer = torch.empty(total, dtype=torch.uint8)
            self.pinned = _register(self.buffer)

    @classmethod
    def blank(cls, nbytes: int) -> HostCopy:
        """A page-locked buffer of `nbytes` holding nothing yet: a spare made ahead of need."""
        copy = cls([])
        copy.buffer = torch.empty(nbytes, dtype=torch.uint8)
        copy.pinned = _register(copy.buffer)
        return copy

    @classmethod
    def needed_bytes(cls, tensors: list[torch.Tensor]) -> int:
        return sum(-(-_span(t) * t.element_size() // cls.ALIGN) * cls.ALIGN for t in tensors)

    @property
    def gb(self) -> float:
        buffer = self.buffer  # read once: a switch may release it while a status poll reads
        return buffer.numel() / GB if buffer is not None else 0.0

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """The next tensor's place in the buffer (same dtype, shape and strides), its copy
        under way."""
        start, size = self._places.pop()
        if size != _span(tensor) * tensor.element_size():
            raise RuntimeError("a weight changed size between sizing and copying")
        host = self.buffer[start:start + size].view(tensor.dtype).as_strided(
            tensor.shape, tensor.stride())
        return host.copy_(tensor, non_blocking=self.pinned)

    def release(self) -> None:
        """Unregister the buffer: after the weights left it, or before a dropped model's views
        into it go (the memory itself goes with the last of them)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False
        self.buffer = None



def _register(buffer: torch.Tensor) -> bool:
    """Page-lock `buffer` in place; False (it stays pageable, the copies synchronous) where
    CUDA refuses, e.g. a locked-memory limit.

    The pages are faulted in first, by torch's threads writing them all at once: cudaHostRegister
    would fault them in one by one on a single thread, the slower part of locking a fresh buffer
    (torch's own host allocator does the same with `pinned_use_cuda_host_register`)."""
    if not torch.cuda.is_available() or buffer.numel() == 0:
        return False
    start = time.perf_counter()
    buffer.zero_()  # a parallel fill: every page faulted in, on all of torch's threads
    faulted = time.perf_counter()
    # Portable: page-locked for every device's context, not only the current one's.
    error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(),
                                                     CUDA_HOST_REGISTER_PORTABLE))
    if error:
        log.warning("parked weights are not page-locked (cudaHostRegister error %d)", error)
    else:
        log.info("a host buffer of %.2f GB: pages faulted in %.2f s (%d threads), locked in "
                 "%.2f s", buffer.numel() / GB, faulted - start, torch.get_num_threads(),
                 time.perf_counter() - faulted)
    return error == 0


def _span(tensor: torch.Tensor) -> int:
    """Elements from a tensor's first to its last, whatever its strides (non-negative)."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


def is_4bit(tensor: torch.Tensor) -> bool:
    # By name: bitsandbytes is imported only by the modes that use it.
    return type(tensor).__name__ == "Params4bit"


# The tensors of a bitsandbytes QuantState (and of its nested state2, with double quant).
QUANT_STATE_TENSORS = ("absmax", "code", "offset")


def _quant_state_slots(model: torch.nn.Module) -> list[tuple[object, str]]:
    """(object, attribute) of every tensor the 4-bit weights' quantization states hold, each
    state once (a layer and its weight share one)."""
    states, slots = {}, []
    for parameter in model.parameters():
        if is_4bit(parameter) and (state := parameter.quant_state) is not None:
            states.setdefault(id(state), state)
    for state in states.values():
        for holder in filter(None, (state, getattr(state, "state2", None))):
            slots += [(holder, name) for name in QUANT_STATE_TENSORS
                      if isinstance(getattr(holder, name, None), torch.Tensor)]
    return slots


def model_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """What move_weights will hand its function, in the same order."""
    return [p.data for p in model.parameters()] + [
        b for m in model.modules() for b in m._buffers.values() if b is not None] + [
        getattr(holder, name) for holder, name in _quant_state_slots(model)]


def move_weights(model: torch.nn.Module, to) -> None:
    """Every parameter, buffer and 4-bit quantization state tensor of `model` to to(tensor), in
    place: the modules keep their Parameter and state objects (tied weights stay tied) and
    their buffers' names."""
    with torch.no_grad():
        slots = _quant_state_slots(model)  # found before the weights move: by their states
        for parameter in model.parameters():
            parameter.data = to(parameter.data)
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = to(buffer)
        for holder, name in slots:
            setattr(holder, name, to(getattr(holder, name)))
