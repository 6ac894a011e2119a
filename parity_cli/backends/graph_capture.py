"""Inside ONNX Runtime and OpenVINO: every norm parity reads in an exported graph (its input and
output tensors, sources.onnx_graph / sources.openvino_ir) made an extra output of a copy of the
model, and the copy run by the runtime itself on real tokens, with the runtime's own optimiser
(ORT's fusions into SimplifiedLayerNormalization, OpenVINO's into RMS / MVN) and its own precision.

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


def feeds(inputs, tokens: list[int]) -> dict:
    """The model's inputs (name, element numpy dtype, shape with None for a dynamic axis) fed as a
    language model's, or one line naming the input nothing here knows how to fill."""
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
        elif "past" in low or "cache" in low:  # an empty cache: batch 1, no positions yet
            dims = [1 if k == 0 else (0 if d is None else d) for k, d in enumerate(shape)]
            out[name] = np.zeros(dims, dtype=dtype)
        else:
            raise InputError(f"the model's input '{name}' is none a language model's (input_ids, attention_mask, "
                             "position_ids, token_type_ids, past key/values); nothing here can feed it")
    return out


def record(model, runtime: str, text: str | None, tokens: list[int] | None, max_tokens: int) -> dict:
    if tokens is None:
        tokens = tokenize(model, text)
    tokens = tokens[:max_tokens]
    if not tokens:
        raise InputError("the text has no tokens")
    return (_onnxruntime if runtime == "onnxruntime" else _openvino)(Path(model), tokens)


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
    have = {o.name for o in model.graph.output}
    for name in dict.fromkeys(t for n in norms for t in n.ends):
        if name not in have:
            model.graph.output.append(onnx.ValueInfoProto(name=name))
    try:
        session = _external_session(model, path) if _external(model) else _session(model, "cpu")
        inputs = [(i.name, _numpy_type(i.type), [d if isinstance(d, int) else None for d in i.shape])
                  for i in session.get_inputs()]
        values = session.run(None, feeds(inputs, tokens))
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{path}: ONNX Runtime could not run it: {' '.join(str(exc).split())[:240]}") from None
    got = dict(zip([o.name for o in session.get_outputs()], values))
    nodes = [_node(n, got[n.ends[0]], got[n.ends[1]], n.dtype, "the graph")
             for n in norms if n.ends[0] in got and n.ends[1] in got]
    return {"nodes": nodes, "tokens": len(tokens),
            "version": distribution_version("onnxruntime"), "backend": "CPUExecutionProvider"}


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


def _openvino(path: Path, tokens: list[int]) -> dict:
    import numpy as np

    from parity_cli.backends.openvino_runtime import _type_name, compile_config, core
    from parity_cli.sources.openvino_ir import find_norms, is_openvino_ir, read_model

    if not is_openvino_ir(path):
        raise InputError(f"{path}: --runtime openvino runs an OpenVINO IR (.xml beside its .bin)")
    model, ops = read_model(path)
    norms = [n for n in find_norms(model, ops, path, {}) if n.kind in KINDS]
    try:
        added = model.add_outputs([o for n in norms for o in n.ends])
        where = {(o.get_node().get_friendly_name(), o.get_index()): k for k, o in enumerate(model.outputs)}
        index = [where[(o.get_node().get_friendly_name(), o.get_index())] for o in added]
        compiled = core().compile_model(model, "CPU", compile_config(None, 2))
        inputs = [(i.get_any_name(), _ov_numpy(i.get_element_type()),
                   [None if d.is_dynamic else d.get_length() for d in i.get_partial_shape()])
                  for i in compiled.inputs]
        result = compiled(feeds(inputs, tokens))
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{path}: OpenVINO could not run it: {' '.join(str(exc).split())[:240]}") from None
    precision = _type_name(compiled.get_property("INFERENCE_PRECISION_HINT"))
    computes = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}.get(precision, "float32")
    nodes = []
    for k, n in enumerate(norms):
        x, y = (np.asarray(result[compiled.outputs[index[2 * k + j]]]) for j in (0, 1))
        nodes.append(_node(n, x, y, computes if n.dtype == "float32" else n.dtype, "the IR"))
    return {"nodes": nodes, "tokens": len(tokens), "version": distribution_version("openvino"),
            "backend": f"CPU plugin, inference precision {precision}"}


def _ov_numpy(element_type):
    import numpy as np

    return {"i64": np.int64, "i32": np.int32, "f32": np.float32, "f16": np.float16, "boolean": np.bool_}.get(
        element_type.get_type_name(), np.float32)
