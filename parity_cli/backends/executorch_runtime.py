"""The `executorch` built-in: the family's norm as PyTorch's path to phones runs it. The family's own
transformers module class (else the `hf` transcription of its numerics) is captured with
torch.export, lowered with to_edge_transform_and_lower and the XNNPACK partitioner, serialised to
an ExecuTorch program (.pte bytes) and executed by the ExecuTorch runtime's pybindings, as
optimum-executorch exports a Hugging Face model.

What runs where (executorch 1.5.1, read from the lowered graphs): XNNPACK takes the float32 and
float16 elementwise ops (the square, + eps, rsqrt, the products); the mean over the row, the
dtype casts, a bfloat16 product and LayerNorm itself (native_layer_norm) stay on ExecuTorch's
portable CPU kernels. The program is the model's own graph; what differs from eager torch is the
kernels that compute it.

A program is exported once per module class, width, dtype and eps, with the gain (and bias,
running statistics) as program inputs rather than baked constants: the same ops on the same
values, and a 253-layer model costs a handful of exports (about 2 s each) instead of one a layer.
The row count is dynamic up to a bound that keeps ExecuTorch's memory plan (sized for the largest
shape) near 64 MiB a tensor; more rows are run in pieces of that size, which a row-wise norm allows.

It loads beside torch 2.13 with `pip install --no-deps executorch torchao` (its wheel pins an older
torch; the runtime and the exporter need only flatbuffers, ruamel.yaml, pyyaml and tabulate besides)."""

from __future__ import annotations

import warnings

from parity_cli.backends import Runtime, distribution_version
from parity_cli.backends.exporting import (
    cia_ops_materialized_once,
    module_in,
    native_stderr_muted,
    program_key,
    with_holder,
)
from parity_cli.errors import InputError

NAME = "executorch"
INSTALL = ("pip install --no-deps executorch==1.5.1 'torchao>=0.18,<0.19' && pip install flatbuffers "
           "ruamel.yaml pyyaml tabulate (its wheel pins an older torch; --no-deps keeps yours)")
RUNTIME = Runtime(
    "executorch", "the family's module class exported with torch.export, lowered to the XNNPACK delegate and run by "
    "the ExecuTorch runtime", package="executorch", install=INSTALL, needs="the ExecuTorch runtime",
    public="torch.export + to_edge_transform_and_lower(XNNPACK), run by executorch.runtime", order=80,
    start_seconds=7.0)  # executorch.runtime imports executorch.exir; a first lowering
DTYPES = ("float32", "bfloat16", "float16")
_PROGRAMS: dict = {}
_KEEP: list = []
_PLAN_BYTES = 1 << 26  # ExecuTorch plans memory for the largest shape a dynamic dimension allows


def version() -> str | None:
    return distribution_version("executorch")


def describe(device: str = "cpu") -> dict:
    if device.startswith("cuda"):
        raise InputError(f"--candidate executorch runs ExecuTorch's CPU runtime (XNNPACK, portable kernels), "
                         f"not {device}")
    return {"runtime": version(), "backend": "XNNPACK delegate, portable kernels for the rest",
            "kernel": "torch.export of the family's module -> to_edge_transform_and_lower(XnnpackPartitioner) "
                      "-> ExecuTorch program, run by executorch.runtime",
            "computes_in": "the graph's dtypes: float32/float16 elementwise ops in XNNPACK; the row mean, casts, "
                           "bfloat16 products and native_layer_norm in the portable kernels"}


def check_layer(layer, dtype: str | None = None) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"--candidate executorch: XNNPACK and the portable kernels compute {', '.join(DTYPES)} "
                         f"here, not {dtype}")


def _export(fn, example: tuple, rows: int):
    """fn(x, *state) -> an ExecuTorch method (the lowered program, loaded by the runtime)."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime
    from torch.export import Dim, export

    class Program(torch.nn.Module):
        def forward(self, x, *state):
            return fn(x, *state)

    rows_dim = {0: Dim("rows", min=1, max=rows)}
    shapes = (rows_dim, (None,) * (len(example) - 1)) if len(example) > 1 else (rows_dim,)
    with torch.no_grad(), warnings.catch_warnings(), cia_ops_materialized_once():
        # executorch 1.5 still calls pytree APIs that torch 2.13 deprecates: its noise, not a finding
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        exported = export(Program().eval(), example, dynamic_shapes=shapes, strict=False)
        buffer = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()]).to_executorch().buffer
    with native_stderr_muted():  # XNNPACK's CPU probe prints each file it could not read (cpuinfo_utils.cpp)
        program = Runtime.get().load_program(buffer)
        method = program.load_method("forward")
    _KEEP.append((buffer, program))  # a method outlives neither its program nor the bytes it was read from
    return method


def prepare(layer, weight, bias, eps: float, eager):
    """`eager`: the family's norm as a function of x (its transformers module, or the hf
    transcription); exported and lowered here, run by the ExecuTorch runtime."""
    import torch

    check_layer(layer)
    width = layer.width
    rows = max(1, min(4096, _PLAN_BYTES // (4 * max(1, width))))
    example = torch.zeros(2, width, dtype=weight.dtype)
    module = module_in(eager)
    if module is not None:  # its tensors become inputs: one program for every layer like it
        named = [(n, t.detach()) for n, t in (*module.named_parameters(), *module.named_buffers())
                 if t.is_floating_point()]
        key = (*program_key(module, layer, weight.dtype, eps, named), rows)  # rows: the plan's largest batch
        if key not in _PROGRAMS:
            names = [n for n, _ in named]
            holder = with_holder(module, eager)

            def functional(x, *state):  # the module's tensors swapped for the inputs, whatever wraps it
                return torch.func.functional_call(holder, {f"module.{n}": t for n, t in zip(names, state)}, (x,))

            _PROGRAMS[key] = _export(functional, (example, *[t for _, t in named]), rows)
        method, state = _PROGRAMS[key], [t.contiguous() for _, t in named]
    else:
        method, state = _export(lambda x: eager(x), (example,), rows), []

    def run(x):
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        pieces = [method.execute([flat[i:i + rows].contiguous(), *state])[0] for i in range(0, flat.shape[0], rows)]
        out = torch.cat(pieces) if pieces else flat.clone()
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return run


_PUBLIC: dict = {}


def public_path(layer, weight, bias, eps: float):
    """The same norm through ExecuTorch's public path, as a deployment takes it, written apart from
    prepare (issue 46's differential truth): the model's own module with its tensors as parameters
    (backends.deployed), `torch.export.export` of it, `to_edge_transform_and_lower` with the
    XnnpackPartitioner, `.to_executorch()`, and the program loaded and run by
    `executorch.runtime.Runtime`. One program per layer, its tensors baked in as the exported
    module's own (prepare feeds them as program inputs to share one program between layers); the
    rows dynamic up to the same memory-plan bound, more run in pieces. Built once per layer, dtype
    and eps (parity prepares a candidate once per probe set)."""
    import torch

    from parity_cli.backends.deployed import Built, fingerprint

    rows = max(2, min(4096, _PLAN_BYTES // (4 * max(1, layer.width))))
    built = _PUBLIC.setdefault("built", Built())
    method = built.get(fingerprint(layer, weight, bias, eps), lambda: _public_program(layer, weight, bias, eps, rows))

    def run(x):
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = [method.execute([flat[i:i + rows].contiguous()])[0] for i in range(0, flat.shape[0], rows)]
        y = torch.cat(out) if out else flat.clone()
        return y.reshape(*x.shape[:-1], y.shape[-1])

    return run


def _public_program(layer, weight, bias, eps: float, rows: int):
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from parity_cli.backends.deployed import norm_module

    module = norm_module(layer, weight, bias, eps)
    example = (torch.zeros(2, layer.width, dtype=weight.dtype, device=weight.device),)
    with torch.no_grad(), warnings.catch_warnings(), cia_ops_materialized_once():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        exported = torch.export.export(module, example, dynamic_shapes=({0: torch.export.Dim("rows", min=1, max=rows)},))
        program = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()]).to_executorch()
    buffer = program.buffer
    with native_stderr_muted():
        loaded = Runtime.get().load_program(buffer)
        method = loaded.load_method("forward")
    _KEEP.append((buffer, loaded))  # a method outlives neither its program nor the bytes it was read from
    return method
