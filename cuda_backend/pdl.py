"""Programmatic dependent launch (Hopper's PDL) for our Triton kernels, and
where the kernels' modules get Triton from (``triton`` and ``tl`` are None
on CPU-only installs, which lack it).

A decode step is a chain of about a hundred kernels, each waiting for the
one before to finish and its results to reach memory before it even
launches. With PDL a kernel launches while its predecessor still runs: its
programs are placed, read what no earlier kernel writes (weights, a norm's
parameters), then wait (``griddepcontrol.wait``) until the predecessor has
finished and its writes are visible, and only then read its outputs or
write anything. Right after that wait each program lets the next kernel
launch in turn (``griddepcontrol.launch_dependents``), so at most two
kernels of the chain are ever resident. A kernel may instead let the next
one launch before it waits itself (``release``, then ``wait``): the norms
do where ``KernelConfig.early_norms`` says (and the split attention kernel
where ``KernelConfig.early_attention`` does, and a GEMM whose tile is
written with an ``e``, ``Tile.early``), so the GEMM after a norm is
placed, and reads its first weights, while the kernel before the norm
still runs (three of the chain resident). That is safe for the same
reason the rule below is: the next kernel's wait returns only once the
norm has ended, which it does only after its own predecessor has. The
step's first kernel, which gathers the rows' inputs (``step_inputs``),
releases the first layer as it starts and waits for nothing: it is its
graph's first.

The rule every kernel launched this way keeps (``enter`` is where):

- before ``enter``: loads of memory no kernel of the step writes, nothing
  else (no store: the predecessor may still read what it would overwrite);
- ``enter`` on every path of every program, before anything else (or
  ``release`` first and ``wait`` where ``enter`` would be).

A kernel launched plainly after one launched this way waits for it to end,
and a PDL kernel's end implies its predecessor's (it waited for it), so a
chain that mixes our kernels with cuBLAS' or torch's stays ordered.
``KernelConfig.pdl_rows`` turns it on for a decode step's smaller buckets
(``pdl_step``).
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = tl = None


def supported(device: torch.device | str) -> bool:
    """Whether ``device`` can launch this way: CUDA, compute capability 9
    or later (Hopper), and a Triton that exposes the instructions."""
    device = torch.device(device)
    if triton is None or device.type != "cuda" or not torch.cuda.is_available():
        return False
    if not hasattr(getattr(tl, "extra", None), "cuda") or not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(pdl: bool) -> dict:
    """The Triton launch keyword for a kernel whose ``PDL`` flag is ``pdl``."""
    return {"launch_pdl": True} if pdl else {}


if triton is not None:

    @triton.jit
    def enter(PDL: tl.constexpr):
        """Wait for the predecessor's results, then let the next kernel
        launch. A no-op for a kernel launched plainly (PDL False)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def release(PDL: tl.constexpr):
        """Let the next kernel launch now, before this one waits (``wait``
        must follow on every path). A no-op launched plainly."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def wait(PDL: tl.constexpr):
        """``enter`` for a kernel that ran ``release`` first."""
        if PDL:
            tl.extra.cuda.gdc_wait()
else:  # pragma: no cover - exercised where Triton is absent
    enter = release = wait = None
