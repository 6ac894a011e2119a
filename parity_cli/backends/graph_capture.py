"""Inside ONNX Runtime and OpenVINO: every norm parity reads in an exported graph (its input and
output tensors, sources.onnx_graph / sources.openvino_ir) made an extra output of a copy of the
model, and the copy run by the runtime itself on real tokens, with the runtime's own optimiser
(ORT's fusions into SimplifiedLayerNormalization, OpenVINO's into RMS / MVN) and its own precision.

ORT's Skip(Simplified)LayerNormalization normalises input + skip (+ bias): its inputs and its
input_skip_bias_sum output are read too, and the row recorded is that sum as the kernel forms it.
OpenVINO runs at the inference precision asked (`parity capture --precision`) or its plugin's
default, and the precision the compiled model reports is the one recorded.

The graph is fed as exporters write language models: input_ids, and where the graph asks for them
an all-ones attention_mask, position_ids 0..n-1, token_type_ids of zeros and empty past key/value
caches. The tokens are given, or the text is tokenized with the tokenizer.json beside the model."""

from __future__ import annotations

from pathlib import Path

from parity_cli.backends import distribution_version
from parity_cli.errors import InputError

KINDS = ("rms_norm", "layer_norm")  # what a capture records (the norms a runtime's LM graph has)
MAX_TOKENIZER_BYTES = 64 << 20  # a 262k-entry vocabulary's tokenizer.json is about 33 MB


def tokenize(model, text: str) -> list[int]:
    """The text's token ids by the tokenizer.json next to the model (the `tokenizers` library: a
    file of data, no code)."""
    from parity_cli.sources.jsonfile import regular_file

    found = Path(model).parent / "tokenizer.json"
    if not found.exists():
        raise InputError(f"{model}: no tokenizer.json beside it to tokenize the text; give --tokens FILE")
    regular_file(found, "the tokenizer", MAX_TOKENIZER_BYTES, f"over the {MAX_TOKENIZER_BYTES >> 20} MiB a tokenizer "
                 "may have")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(found)).encode(text).ids
    except Exception as exc:
        raise InputError(f"{found}: not a tokenizer the tokenizers library reads ({type(exc).__name__})") from None


def _head_size(model) -> int | None:
    """A cache's head size where the graph leaves it symbolic (ONNX Runtime GenAI's builder names it
    kv_cache_dim): from genai_config.json beside the model, else config.json's head_dim or
    hidden_size / num_attention_heads. Read as every JSON input is (bounded, a regular file: a FIFO
    or an oversized one is one line), nothing executed; a file that is not there says nothing."""
    from parity_cli.sources.jsonfile import load

    folder = Path(model).parent
    read = {name: load(folder / name, f"the {name}") for name in ("genai_config.json", "config.json")
            if (folder / name).exists() or (folder / name).is_symlink()}
    for value in (_dig(read.get("genai_config.json"), "model", "decoder", "head_size"),
                  _dig(read.get("config.json"), "head_dim")):
        if type(value) is int and 0 < value <= 1 << 16:
            return value
    config = read.get("config.json")
    hidden, heads = _dig(config, "hidden_size"), _dig(config, "num_attention_heads")
    if type(hidden) is int and type(heads) is int and 0 < heads <= hidden:
        return hidden // heads
    return None


def _dig(tree, *keys):
    for key in keys:
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def feeds(inputs, tokens: list[int], model=None) -> dict:
    """The model's inputs (name, element numpy dtype, shape: an int, a symbolic name, or None for a
    dynamic axis) fed as a language model's, or one line naming the input nothing here knows how to
    fill. An empty cache has no past positions; a symbolic head size is the model's (_head_size)."""
    import numpy as np

    n = len(tokens)
    out = {}
    for name, dtype, shape in inputs:
        low = name.lower()
        if "input_ids" in low:
            out[name] = np.asarray([tokens], dtype=dtype)
        elif "attention_mask" in low:
            out[name] = np.ones((1, n), dtype=dtype)
        elif "position_ids" in low:
            out[name] = np.arange(n, dtype=dtype)[None]
        elif "token_type_ids" in low:
            out[name] = np.zeros((1, n), dtype=dtype)
        elif low == "beam_idx":  # optimum-intel's stateful export: the cache is the model's own state,
            out[name] = np.zeros(1, dtype=dtype)  # empty in a fresh request; the one row continues beam 0
        elif "past" in low or "cache" in low:  # an empty cache: batch 1, no positions yet
            dims = []
            for k, d in enumerate(shape):
                if isinstance(d, int):
                    dims.append(d)
                elif k == 0:
                    dims.append(1)
                elif isinstance(d, str) and k == len(shape) - 1 and not any(w in d for w in ("seq", "past")):
                    head = _head_size(model) if model is not None else None
                    if head is None:
                        raise InputError(f"the cache input '{name}' leaves its last axis '{d}' symbolic, and no "
                                         "genai_config.json or config.json beside the model gives its head size")
                    dims.append(head)
                else:
                    dims.append(0)
            out[name] = np.zeros(dims, dtype=dtype)
        else:
            raise InputError(f"the model's input '{name}' is none a language model's (input_ids, attention_mask, "
                             "position_ids, token_type_ids, past key/values); nothing here can feed it")
    return out


def record(model, runtime: str, text: str | None, tokens: list[int] | None, max_tokens: int,
           precision: str | None = None) -> dict:
    """`precision`: OpenVINO's inference precision (f32, bf16, f16), None for what its plugin runs."""
    if tokens is None:
        tokens = tokenize(model, text)
    tokens = tokens[:max_tokens]
    if not tokens:
        raise InputError("the text has no tokens")
    if runtime == "onnxruntime":
        return _onnxruntime(Path(model), tokens)
    if runtime == "litert":
        return _litert(Path(model), tokens)
    return _openvino(Path(model), tokens, precision)


def _node(norm, x, y, dtype: str, source: str) -> dict:
    import numpy as np

    def stored(t):
        return str(t.dtype).removeprefix("torch.") if not norm.offset else "float32"

    gain = None if norm.weight is None else (norm.names[0] if norm.names else norm.name,
                                             (norm.weight.double() + norm.offset).float().numpy(), stored(norm.weight))
    bias = None if norm.bias is None else (f"{norm.name}.bias", norm.bias.float().numpy(), stored(norm.bias))
    return {"layer": norm.name, "node": f"{norm.form} {norm.names[0] if norm.names else norm.name}",
            "op": norm.form, "kind": norm.kind,
            "eps": float(norm.eps), "eps_source": f"{source}: {norm.eps_source}", "chain": [norm.form],
            "gain": gain, "bias": bias, "dtype": dtype,
            "x": np.asarray(x, dtype=np.float32).reshape(-1, norm.dim),
            "y": np.asarray(y, dtype=np.float32).reshape(-1, norm.dim)}


def _onnxruntime(path: Path, tokens: list[int]) -> dict:
    import onnx

    from parity_cli.backends.onnx_runtime import _session
    from parity_cli.sources.onnx_graph import find_norms, is_onnx, load_model

    if not is_onnx(path):
        raise InputError(f"{path}: --runtime onnxruntime runs an .onnx file")
    model = load_model(path)  # the graph alone: a model's external data stays where it is
    norms = [n for n in find_norms(model, path, {}) if n.kind in KINDS and n.ends]
    skips = _skip_ends(model, norms)
    have = {o.name for o in model.graph.output}
    wanted = [t for n in norms for t in n.ends] + [t for ends in skips.values() for t in ends if t]
    for name in dict.fromkeys(wanted):
        if name not in have:
            model.graph.output.append(onnx.ValueInfoProto(name=name))
    try:
        session = _external_session(model, path) if _external(model) else _session(model, "cpu")
        inputs = [(i.name, _numpy_type(i.type), [d if isinstance(d, (int, str)) else None for d in i.shape])
                  for i in session.get_inputs()]
        values = session.run(None, feeds(inputs, tokens, path))
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{path}: ONNX Runtime could not run it: {' '.join(str(exc).split())[:240]}") from None
    got = dict(zip([o.name for o in session.get_outputs()], values))
    nodes = []
    for n in norms:
        if n.ends[1] in skips:  # what a Skip op normalises is its input + skip (+ bias), not its first input
            ends = skips[n.ends[1]]
            if all(t in got for t in ends if t) and n.ends[1] in got:
                nodes.append(_skip_node(path, n, got, ends, n.dtype))
        elif n.ends[0] in got and n.ends[1] in got:
            nodes.append(_node(n, got[n.ends[0]], got[n.ends[1]], n.dtype, "the graph"))
    return {"nodes": nodes, "tokens": len(tokens),
            "version": distribution_version("onnxruntime"), "backend": "CPUExecutionProvider"}


def _litert(path: Path, tokens: list[int]) -> dict:
    """Every norm's input and output tensors as LiteRT's interpreter leaves them
    (experimental_preserve_all_tensors), the graph run on the tokens by TFLite's built-in kernels: a
    graph handed to the XNNPACK delegate keeps no intermediate tensor to read. A converted graph's
    shapes are static: the tokens are repeated up to its sequence length, or cut to it."""
    import numpy as np

    from parity_cli.sources.tflite_graph import find_norms, is_tflite, read_graph

    if not is_tflite(path):
        raise InputError(f"{path}: --runtime litert runs a .tflite file")
    norms = [n for n in find_norms(read_graph(path)) if n.kind in KINDS]
    try:
        from ai_edge_litert.interpreter import Interpreter, OpResolverType

        interpreter = Interpreter(model_path=str(path), experimental_preserve_all_tensors=True,
                                  experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
        interpreter.allocate_tensors()
        inputs = interpreter.get_input_details()
        if len(inputs) != 1 or not np.issubdtype(inputs[0]["dtype"], np.integer):
            raise InputError(f"{path}: the graph takes {len(inputs)} inputs "
                             f"({', '.join(str(i['name']) for i in inputs[:4])}); --runtime litert feeds one, the "
                             "token ids")
        shape = [int(d) for d in inputs[0]["shape"]]
        n = shape[-1]
        ids = (tokens * (n // len(tokens) + 1))[:n]
        interpreter.set_tensor(inputs[0]["index"], np.asarray(ids, dtype=inputs[0]["dtype"]).reshape(shape))
        interpreter.invoke()
        nodes = [_node(norm, interpreter.get_tensor(norm.ends[0]), interpreter.get_tensor(norm.ends[1]), norm.dtype,
                       "the graph") for norm in norms]
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{path}: LiteRT's interpreter could not run it: {' '.join(str(exc).split())[:240]}") from None
    return {"nodes": nodes, "tokens": n, "version": distribution_version("ai-edge-litert"),
            "backend": "TFLite built-in kernels (XNNPACK off: a delegated graph keeps no intermediate tensor)",
            **({"note": f"the graph's {n} positions: the {len(tokens)} tokens repeated"} if len(tokens) < n else {})}


SUM_SUFFIX = "__parity_input_skip_bias_sum"


def _skip_ends(model, norms) -> dict:
    """Each Skip(Simplified)LayerNormalization norm's output -> (its input, skip, bias (or ""), its
    input_skip_bias_sum output), all made readable: the node's own inputs (after any Cast into it: the
    op binds them to one type T) through an Identity each, and the sum output (output 3) given a name
    where the graph leaves it out. The node itself is edited in this copy of the graph only."""
    from onnx import helper

    from parity_cli.sources.onnx_graph import SKIP_EXTRA

    by_output = {node.output[0]: node for node in model.graph.node
                 if node.op_type in SKIP_EXTRA and node.output and node.output[0]}
    out, extra = {}, []
    for n in norms:
        node = by_output.get(n.ends[1])
        if node is None or n.form != node.op_type:
            continue
        skip, folded = SKIP_EXTRA[node.op_type]
        names = [node.input[0], node.input[skip], node.input[folded] if len(node.input) > folded else ""]
        read = []
        for k, name in enumerate(names):
            if not name:
                read.append("")
                continue
            read.append(f"{n.ends[1]}__parity_{('input', 'skip', 'bias')[k]}")
            extra.append(helper.make_node("Identity", [name], [read[-1]], name=read[-1]))
        if len(node.output) < 4 or not node.output[3]:
            while len(node.output) < 3:
                node.output.append("")
            if len(node.output) < 4:
                node.output.append(n.ends[1] + SUM_SUFFIX)
            else:
                node.output[3] = n.ends[1] + SUM_SUFFIX
        out[n.ends[1]] = (*read, node.output[3])
    model.graph.node.extend(extra)  # after every producer: the node list stays in topological order
    return out


def _ort_skip_sum(path: Path, a, skip, bias):
    """input + skip (+ bias) as ONNX Runtime's CPU Skip(Simplified)LayerNormalization kernel forms
    the row it normalises (contrib_ops/cpu/skip_layer_norm.cc): in float32, the skip added first and
    then the bias, each sum rounded to float32; float16 operands are widened to float32 and added
    there (the sum it hands on is that rounded to float16; the row it normalises is not). A skip
    smaller than the input is read at (row offset modulo its size), as the kernel broadcasts it."""
    import numpy as np

    rows = np.asarray(a)
    dim = rows.shape[-1]
    rows = rows.reshape(-1, dim)
    flat = np.asarray(skip).reshape(-1)
    if not flat.size or flat.size % dim or rows.size % flat.size:
        raise InputError(f"{path}: a Skip node's skip of {flat.size} values does not fit rows of width {dim}")
    s = flat[(np.arange(rows.shape[0])[:, None] * dim) % flat.size + np.arange(dim)]
    total = rows.astype(np.float32) + s.astype(np.float32)
    if bias is not None:
        total = total + np.asarray(bias).reshape(-1).astype(np.float32)
    return total


def _skip_node(path: Path, norm, got: dict, ends: tuple, dtype: str) -> dict:
    """A Skip op's node: x the sum it normalises (_ort_skip_sum of the inputs it was given), y its
    output, and `sum` the input_skip_bias_sum it handed on to the rest of the graph (the residual
    stream), judged against x when the capture is read, so a residual that differs from the inputs'
    sum beyond its dtype's rounding is seen even where the normalised output is right. A half
    graph's x is the float32 sum its kernel normalises: wider than the node's dtype (`rows_in`)."""
    import numpy as np

    a, skip, bias, total = (got[t] if t else None for t in ends)
    node = _node(norm, _ort_skip_sum(path, a, skip, bias), got[norm.ends[1]], dtype, "the graph")
    node["sum"] = np.asarray(total, dtype=np.float32).reshape(-1, norm.dim)
    added = ends[3] == norm.ends[1] + SUM_SUFFIX
    node["sum_output"] = "input_skip_bias_sum (output 3, added by parity)" if added else ends[3]
    node["chain"] = ["input + skip" + (" + bias" if bias is not None else ""), norm.form]
    if dtype != "float32" and not _holds(node["x"], dtype):
        node["rows_in"] = "float32"
    return node


def _external(model) -> list[str]:
    """The files the graph's external tensors live in (relative to the model), each once."""
    import onnx

    found = []
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            where = next((e.value for e in t.external_data if e.key == "location"), None)
            if where is not None and where not in found:
                found.append(where)
    return found


def _external_session(model, path: Path):
    """A graph whose weights live in external files (an LLM's, past protobuf's 2 GB): the copy with
    its extra outputs goes to ONNX Runtime as bytes, told the folder its data files are in, so they
    are read where they are (ORT refuses a location that leaves that folder)."""
    import onnxruntime as ort

    for where in _external(model):
        if not (path.parent / where).is_file():
            raise InputError(f"{path}: external data '{where}' is not a file beside the model; refused")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _numpy_type(onnx_type: str):
    import numpy as np

    return {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
            "tensor(float16)": np.float16, "tensor(bool)": np.bool_}.get(onnx_type, np.float32)


# OpenVINO's element types as the dtypes a capture's rows are computed in
OV_COMPUTES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


def _openvino(path: Path, tokens: list[int], precision: str | None = None) -> dict:
    """The IR run by the CPU plugin at `precision` (None: the plugin's own default, bf16 on a CPU
    with avx512_bf16/AMX). The precision the compiled model really runs at is read back from it (a
    CPU without bf16 or f16 support runs f32 whatever was asked) and is the dtype each float32 norm
    of the IR is judged at; rows the plugin hands out as float32 values it did not round to that
    dtype (a node it kept at f32) say so (`rows_in`), rather than being passed off as its values."""
    import numpy as np

    from parity_cli.backends.openvino_runtime import PRECISIONS, _type_name, compile_config, core
    from parity_cli.sources.openvino_ir import find_norms, is_openvino_ir, read_model

    if precision is not None and precision not in PRECISIONS:
        raise InputError(f"--precision: '{precision}' is not one of {', '.join(PRECISIONS)}")
    if not is_openvino_ir(path):
        raise InputError(f"{path}: --runtime openvino runs an OpenVINO IR (.xml beside its .bin)")
    model, ops = read_model(path)
    norms = [n for n in find_norms(model, ops, path, {}) if n.kind in KINDS]
    try:
        default = _type_name(core().get_property("CPU", "INFERENCE_PRECISION_HINT"))
    except Exception:
        default = None
    try:
        added = model.add_outputs([o for n in norms for o in n.ends])
        where = {(o.get_node().get_friendly_name(), o.get_index()): k for k, o in enumerate(model.outputs)}
        index = [where[(o.get_node().get_friendly_name(), o.get_index())] for o in added]
        compiled = core().compile_model(model, "CPU", compile_config(precision, 2))
        inputs = [(i.get_any_name(), _ov_numpy(i.get_element_type()),
                   [None if d.is_dynamic else d.get_length() for d in i.get_partial_shape()])
                  for i in compiled.inputs]
        result = compiled(feeds(inputs, tokens))
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{path}: OpenVINO could not run it: {' '.join(str(exc).split())[:240]}") from None
    running = _type_name(compiled.get_property("INFERENCE_PRECISION_HINT"))
    computes = OV_COMPUTES.get(running, "float32")
    nodes = []
    for k, n in enumerate(norms):
        x, y = (np.asarray(result[compiled.outputs[index[2 * k + j]]]) for j in (0, 1))
        dtype = computes if n.dtype == "float32" else n.dtype
        node = _node(n, x, y, dtype, "the IR")
        name = _model_name(n)
        if name != node["layer"]:  # the IR's gain is an OpenVINO constant id: the model's own name for the norm
            node["layer"], node["node"] = name, f"{n.form} {name}"
        if dtype != "float32" and not all(_holds(node[part], dtype) for part in ("x", "y")):
            node["rows_in"] = "float32"
        nodes.append(node)
    said = {"asked": precision, "runs": running, "plugin_default": default,
            "source": f"--precision {precision}" if precision else "the plugin's default on this CPU"}
    note = None
    if running != "f32":  # what the verdict is then of
        note = (f"openvino: every op may round to {running}; --precision f32 captures the kernels at full precision")
    return {"nodes": nodes, "tokens": len(tokens), "version": distribution_version("openvino"),
            "backend": f"CPU plugin, inference precision {running}", "precision": said, "note": note}


# a name OpenVINO makes up for a node the model did not name: its type and a counter (Constant_6245,
# Multiply_1020, Constant_13449_compressed)
_MADE_UP = r"[A-Z][A-Za-z0-9]*_\d+(_compressed)?"


def _model_name(norm) -> str:
    """The norm's name as the model gives it: what the IR says of its gain or node path (its usual
    name); where that is only a made-up constant id (the ONNX frontend drops the name of the last
    norm's gain, whose output is the model's output), the name the model gives the norm's output
    (`last_hidden_state`); the constant id only where nothing else names it."""
    import re

    if not re.fullmatch(_MADE_UP, norm.name) or not norm.ends:
        return norm.name
    out = norm.ends[1]
    for name in [*sorted(out.get_names()), out.get_node().get_friendly_name()]:
        if name and not re.fullmatch(_MADE_UP, name):
            return name
    return norm.name


def _holds(rows, dtype: str) -> bool:
    """Whether every finite value of the float32 rows is a value of `dtype`."""
    import numpy as np
    import torch

    t = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
    finite = torch.isfinite(t)
    return bool((t.to(getattr(torch, dtype)).float() == t)[finite].all())


def _ov_numpy(element_type):
    import numpy as np

    return {"i64": np.int64, "i32": np.int32, "f32": np.float32, "f16": np.float16, "boolean": np.bool_}.get(
        element_type.get_type_name(), np.float32)
