"""The `litert` built-in: the family's norm as Google's path to phones runs it. The family's own
transformers module class (else the `hf` transcription of its numerics) is converted by
`litert_torch.convert` (torch.export, lowered to TFLite ops through MLIR) and the .tflite bytes are run
by LiteRT's interpreter (`ai_edge_litert.interpreter.Interpreter`, XNNPACK delegate on CPU), as
`litert_torch` exports a Hugging Face model for a phone.

What it computes (litert-torch 0.10.0, ai-edge-litert 2.3.0, read from the converted graphs): a
LayerNorm becomes MEAN, SQUARED_DIFFERENCE, MEAN, ADD, RSQRT (the variance from x - mean, two passes);
an RMSNorm is the module's own ops. What the converter cannot convert is refused with its own line,
on both paths: a module holding bfloat16 parameters ("Got unsupported ScalarType BFloat16"), a float16
LayerNorm ("expects operand and result to have compatible element type"), a float16 BatchNorm (its
flatbuffer is not written).

A program is converted once per module class, width, dtype and eps, with the gain (and bias) as
program inputs. The converter's native_layer_norm lowering needs static shapes, so a program takes
64 rows (fewer where 64 would pass 64 MiB); more are run in pieces and fewer padded with zeros, which
a row-wise norm allows.

It loads beside torch 2.13 with `pip install --no-deps litert-torch litert-converter ai-edge-litert
ai-edge-quantizer litert-lm-builder xdsl` (xdsl 0.28 pins typing-extensions < 4.13; --no-deps keeps
yours) and jax, jaxlib, immutabledict, backports.strenum and multipledispatch from the test extra."""

from __future__ import annotations

import contextlib
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

NAME = "litert"
INSTALL = ("pip install --no-deps litert-torch==0.10.0 litert-converter==0.5.0 ai-edge-litert==2.3.0 "
           "ai-edge-quantizer==0.10.0 litert-lm-builder==0.18.1 xdsl==0.28.0 && pip install jax jaxlib immutabledict "
           "backports.strenum multipledispatch (xdsl pins an old typing-extensions; --no-deps keeps yours)")
RUNTIME = Runtime(
    "litert", "the family's module class converted by litert_torch.convert (TFLite ops) and run by LiteRT's "
    "interpreter (XNNPACK on CPU)", package="litert_torch", install=INSTALL, requires=("litert_torch", "ai_edge_litert"),
    distributions=("litert-torch",), needs="LiteRT (litert-torch and ai-edge-litert)",
    public="litert_torch.convert of the module, run as the converted model (LiteRTModel.__call__)", order=85,
    start_seconds=5.0)  # litert-torch, jax and its MLIR converter; a first conversion
DTYPES = ("float32", "float16")  # bfloat16: no deployment converts it (check_layer says why)
ROWS = 64  # the rows a converted program takes (its shapes are static), fewer where a row is wide
_PLAN_BYTES = 1 << 26  # and the bytes a piece of rows holds at most
_PROGRAMS: dict = {}
_WARM: set = set()  # the runners whose first invoke (XNNPACK's delegate, and its log line) is past


def version() -> str | None:
    return distribution_version("litert-torch")


def describe(device: str = "cpu") -> dict:
    if device.startswith("cuda"):
        raise InputError(f"--candidate litert runs LiteRT's CPU interpreter (XNNPACK), not {device}")
    return {"runtime": f"{version()}, {distribution_version('ai-edge-litert')}", "backend": "XNNPACK delegate",
            "kernel": "litert_torch.convert of the family's module -> .tflite, run by ai_edge_litert's Interpreter",
            "computes_in": "the graph's dtypes"}


def check_layer(layer, dtype: str | None = None) -> None:
    if dtype == "bfloat16":  # prepare feeds the tensors as inputs and could: no deployment can (public_path)
        raise InputError("--candidate litert: litert_torch.convert converts no module holding bfloat16 parameters "
                         "(\"Got unsupported ScalarType BFloat16\"); a bfloat16 model is converted at float32")
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"--candidate litert: LiteRT computes {', '.join(DTYPES)} here, not {dtype}")


def _rows(width: int) -> int:
    return max(1, min(ROWS, _PLAN_BYTES // (4 * max(1, width))))


@contextlib.contextmanager
def _quiet():
    """The converter's progress lines (stdout), absl's and XNNPACK's logging (stderr) and torch.export's
    deprecation noise: the runtime's chatter, not parity's output."""
    with warnings.catch_warnings(), native_stderr_muted(1, 2):
        warnings.simplefilter("ignore")
        yield


def _convert(module, example: tuple, layer):
    """(the converted model, its .tflite bytes): both made here, so that the converter's refusal of a
    norm (at conversion or at writing the flatbuffer) is one line naming the layer."""
    import litert_torch

    try:
        with _quiet(), cia_ops_materialized_once():
            converted = litert_torch.convert(module.eval(), example)
            return converted, bytes(converted.model_content())
    except (Exception, SystemExit) as exc:  # the converter's refusal of this norm: its first line, the layer named
        said = type(exc).__name__ + (": " + str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "")
        raise InputError(f"litert: litert_torch.convert cannot convert {layer.name} ({layer.kind}) at "
                         f"{str(example[0].dtype).removeprefix('torch.')}: {said}") from None


def _numpy(t):
    import numpy as np

    return np.ascontiguousarray(t.detach().cpu().numpy())


def _torch(a, like):
    import numpy as np
    import torch

    return torch.from_numpy(np.asarray(a)).to(dtype=like.dtype, device=like.device)


def _in_pieces(x, call, rows: int):
    """call(exactly `rows` rows) over x's rows: the last piece padded with zero rows, dropped after."""
    import torch

    flat = x.reshape(-1, x.shape[-1])
    out = []
    for i in range(0, flat.shape[0], rows):
        piece = flat[i:i + rows]
        padded = torch.cat([piece, piece.new_zeros(rows - piece.shape[0], piece.shape[1])]) if piece.shape[0] < rows \
            else piece
        out.append(call(padded.contiguous())[:piece.shape[0]])
    y = torch.cat(out) if out else flat.clone()
    return y.reshape(*x.shape[:-1], y.shape[-1])


def prepare(layer, weight, bias, eps: float, eager):
    """`eager`: the family's norm as a function of x (its transformers module, or the hf
    transcription); converted here and run by LiteRT's interpreter, the tensors as inputs."""
    import torch

    check_layer(layer, str(weight.dtype).removeprefix("torch."))
    example = torch.zeros(_rows(layer.width), layer.width, dtype=weight.dtype)
    module = module_in(eager)
    named = [] if module is None else [(n, t.detach()) for n, t in (*module.named_parameters(),
                                                                     *module.named_buffers()) if t.is_floating_point()]
    key = (*program_key(module, layer, weight.dtype, eps, named), example.shape[0]) if module is not None else None
    if key is None or key not in _PROGRAMS:
        if module is not None:
            names = [n for n, _ in named]
            holder = with_holder(module, eager)

            class Program(torch.nn.Module):
                def forward(self, x, *state):  # the module's tensors swapped for the inputs
                    return torch.func.functional_call(holder, {f"module.{n}": t for n, t in zip(names, state)}, (x,))
        else:
            class Program(torch.nn.Module):
                def forward(self, x):
                    return eager(x)
        with torch.no_grad():
            program = _interpreter(_convert(Program(), (example, *[t for _, t in named]), layer))
        if key is None:
            return _runner(program, [], example)
        _PROGRAMS[key] = program
    return _runner(_PROGRAMS[key], [t.contiguous() for _, t in named], example)


def _interpreter(converted):
    """The converted program's .tflite bytes in LiteRT's interpreter: its default signature's runner
    (which holds its interpreter)."""
    from ai_edge_litert.interpreter import Interpreter

    with _quiet():
        return Interpreter(model_content=converted[1]).get_signature_runner()


def _runner(runner, state: list, example):
    """x -> y in pieces of the program's rows; its first invoke (where XNNPACK's delegate is made, and
    logs) runs muted, on the example."""
    fed = {f"args_{i + 1}": _numpy(t) for i, t in enumerate(state)}

    def call(rows):
        return _torch(runner(args_0=_numpy(rows), **fed)["output_0"], rows)

    if id(runner) not in _WARM:
        with _quiet():
            call(example)
        _WARM.add(id(runner))
    return lambda x: _in_pieces(x, call, example.shape[0])


_PUBLIC: dict = {}


def public_path(layer, weight, bias, eps: float):
    """The same norm through LiteRT's public path, as a deployment takes it, written apart from
    prepare (issue 46's differential truth): the model's own module with its tensors as parameters
    (backends.deployed), `litert_torch.convert(module, (x,))`, and the converted model called as
    litert_torch documents it (LiteRTModel.__call__, its own interpreter). One program per layer,
    its tensors baked in; as many rows a call as prepare's. Built once per layer, dtype and eps."""
    import torch

    from parity_cli.backends.deployed import Built, fingerprint, norm_module

    check_layer(layer)  # a bfloat16 module goes to the converter, whose refusal is the fact check_layer states
    built = _PUBLIC.setdefault("built", Built())

    rows = _rows(layer.width)
    example = torch.zeros(rows, layer.width, dtype=weight.dtype)

    def convert():
        with torch.no_grad():
            converted, _ = _convert(norm_module(layer, weight, bias, eps), (example,), layer)
        with _quiet():  # its first call makes the interpreter and XNNPACK's delegate, which log
            converted(_numpy(example))
        return converted

    converted = built.get((fingerprint(layer, weight, bias, eps), rows), convert)
    return lambda x: _in_pieces(x, lambda piece: _torch(converted(_numpy(piece)), piece), rows)
