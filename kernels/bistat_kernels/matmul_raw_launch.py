"""Triton's compiled-kernel launcher, called without its per-call Python.

:class:`_RawLauncher` calls the launcher that Triton's ``CompiledKernel.run`` wraps, in the calling
conventions of triton 3.6, 3.7 and 3.8 (:func:`_raw_launcher` finds it, or says that only ``run``
is known to be right); :class:`_TmaOperand` is what a direct launch passes where Triton's JIT call
passed a tensor descriptor. The launcher's plans (:mod:`bistat_kernels.matmul_persistent`) use
both.
"""

from __future__ import annotations

import torch


# ---- the compiled kernel's launcher, without Triton's per-call Python ---------------------------
#
# ``CompiledKernel.run`` (Triton's ``CudaLauncher``) allocates the kernel's scratch memory and,
# for a kernel with tensor-descriptor arguments, goes through a wrapper that expands every
# descriptor into the CUDA tensor map and the shape and strides the kernel takes, encoding the
# tensor map again on each call (``make_tensordesc_arg``). That is about 8 us per eager call on the
# H200's host for the two descriptors (kernels/results/host_cost_nvidia_h200.json: the m=1 rows,
# which use descriptor loads, against the m=16 rows, which do not). A tensor map is a function
# of the address, shape, strides and the kernel's block and swizzle only; a plan fixes all but the
# address, so :class:`_RawLauncher` keeps each expansion per address, using Triton's own
# ``make_tensordesc_arg`` to make it, and calls the launcher the wrapper calls. Three calling
# conventions are known: triton 3.6 (a launcher compiled per kernel, arguments flattened after
# the scratch pointers and the metadata) and triton 3.7/3.8 (one launcher for all kernels, the
# argument list last, after the kernel's argument annotations and signature). Anything else (no
# such wrapper, scratch memory, a sanitizer, descriptors Triton does not lower to tensor maps)
# keeps ``run``.

_DESCRIPTORS_KEPT = 64  # per operand of a plan; then the kept expansions start again


class _RawLauncher:
    """Launch one compiled kernel as Triton's ``CudaLauncher.__call__`` would, minus its Python."""

    __slots__ = ("launch", "listed", "coop", "pdl", "annotations", "signature", "metas", "make",
                 "kept")

    def __init__(self, launch, listed: bool, run, metas, make):
        self.launch, self.listed, self.metas, self.make = launch, listed, metas, make
        self.coop, self.pdl = run.launch_cooperative_grid, run.launch_pdl
        self.annotations = getattr(run, "arg_annotations", None)
        self.signature = getattr(run, "kernel_signature", None)
        self.kept: tuple[dict, ...] = tuple({} for _ in metas)

    def descriptor(self, i: int, base: torch.Tensor, shape: tuple, strides: tuple) -> list:
        """Descriptor argument ``i`` expanded as Triton expands it (kept per address)."""
        kept = self.kept[i]
        ptr = base.data_ptr()
        expanded = kept.get(ptr)
        if expanded is None:
            if len(kept) >= _DESCRIPTORS_KEPT:
                kept.clear()
            expanded = kept[ptr] = self.make(_TmaOperand(base, shape, strides), self.metas[i])
        return expanded

    def __call__(self, grid0: int, stream: int, function, packed, args: tuple) -> None:
        if self.listed:  # triton 3.7, 3.8: a list after expanding descriptors, else the tuple
            self.launch(grid0, 1, 1, stream, function, self.coop, self.pdl, packed, None, None,
                        None, None, None, self.annotations, self.signature,
                        list(args) if self.metas else args)
        else:  # triton 3.6
            self.launch(grid0, 1, 1, stream, function, self.coop, self.pdl, None, None, packed,
                        None, None, None, *args)


def _raw_launcher(compiled, tma: bool) -> _RawLauncher | None:
    """The launcher under ``compiled.run``, or None where only ``run`` is known to be right."""
    run = getattr(compiled, "run", None)
    launch = getattr(run, "launch", None)
    if launch is None or getattr(run, "gsan_enabled", False):
        return None
    if (getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
            or not hasattr(run, "launch_cooperative_grid") or not hasattr(run, "launch_pdl")):
        return None
    listed = hasattr(run, "arg_annotations") and hasattr(run, "kernel_signature")
    closure = getattr(launch, "__closure__", None)
    if not tma:
        # no descriptor: Triton's wrapper is the launcher itself (a C function)
        return None if closure else _RawLauncher(launch, listed, run, (), None)
    if not closure:
        return None
    cells = dict(zip(launch.__code__.co_freevars, (c.cell_contents for c in closure)))
    inner, metas = cells.get("launcher"), cells.get("tensordesc_meta")
    if inner is None or not metas or len(metas) != 2 or any(m is None for m in metas):
        return None
    make = cells.get("make_tensordesc_arg")  # triton 3.8 passes it in: (arg, meta, base_args)
    if make is not None:
        make3 = make
        make = lambda arg, meta: make3(arg, meta, None)  # noqa: E731 (its third argument is unused)
    else:
        import sys

        make = getattr(sys.modules.get(type(run).__module__), "make_tensordesc_arg", None)
        if make is None:
            return None
    return _RawLauncher(inner, listed, run, tuple(metas), make)


class _TmaOperand:
    """A 2-D operand as Triton's host-side tensor descriptor presents it to the launcher.

    The first launch of a kind passes real ``TensorDescriptor`` objects (Triton specialises on
    them); later direct launches pass this lighter object with the attributes the launcher reads
    (``base``, ``shape``, ``strides``, ``padding``; triton 3.8 also ``round_f32_to_tf32``, and
    ``element_strides`` in im2col mode). The launcher validated the alignment
    and strides a descriptor needs before choosing the tensor-memory path.
    """

    __slots__ = ("base", "shape", "strides", "padding")
    # read by triton 3.8's descriptor packing (tiled mode, no TF32 rounding of fp32 operands)
    round_f32_to_tf32 = False
    element_strides = None

    def __init__(self, base: torch.Tensor, shape: tuple[int, int], strides: tuple[int, int]):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, "zero"

    def descriptor(self, block: list[int]):
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor(self.base, list(self.shape), list(self.strides), block)
