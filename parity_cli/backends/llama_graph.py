"""Inside llama.cpp: every norm node of the graph llama.cpp itself builds for a GGUF, recorded on real
tokens by its eval callback (`cb_eval` in llama_context_params, what llama-eval-callback prints).

For each RMS_NORM / NORM node: the rows of its input (src[0]), the rows of what llama.cpp goes on
with (the MUL by the gain and the ADD of the bias that build_norm appends), the eps from the op's
own parameters, and the gain and bias tensors it attached, by their GGUF names and with the values
llama.cpp holds. Nothing is recomputed here: the figures are the runtime's.

Two decodes of each chunk of tokens: the first learns the graph (which node feeds each norm: ggml
may compute a norm in place over its input, so the input is read when its own node is done), the
second asks the scheduler for exactly those nodes. The KV cells of the first are removed before the
second, so both see the same graph. All tokens are outputs, so the last block is not cut to the
last token. llama.cpp's C API through ctypes into the xllamacpp wheel (its struct layouts checked
against the defaults llama.cpp returns before anything is loaded)."""

from __future__ import annotations

import ctypes
import os

from parity_cli.backends import distribution_version
from parity_cli.errors import InputError
from parity_cli.sampling import RowSample

NAME = "llama.cpp"
_GGML_TYPES = {0: "float32", 1: "float16", 30: "bfloat16"}
_NORM_OPS = ("RMS_NORM", "NORM")
_LIB: list = []
_c = ctypes
_void = _c.c_void_p


class _Tensor(_c.Structure):  # ggml.h: struct ggml_tensor
    pass


_Tensor._fields_ = [("type", _c.c_int), ("buffer", _void), ("ne", _c.c_int64 * 4), ("nb", _c.c_size_t * 4),
                    ("op", _c.c_int), ("op_params", _c.c_int32 * 16), ("flags", _c.c_int32),
                    ("src", _c.POINTER(_Tensor) * 10), ("view_src", _c.POINTER(_Tensor)), ("view_offs", _c.c_size_t),
                    ("data", _void), ("name", _c.c_char * 64), ("extra", _void), ("padding", _c.c_char * 8)]


class _ModelParams(_c.Structure):  # llama.h: struct llama_model_params, the fields parity sets, then room
    _fields_ = [("devices", _void), ("tensor_buft_overrides", _void), ("n_gpu_layers", _c.c_int32),
                ("split_mode", _c.c_int), ("_rest", _c.c_uint8 * 488)]


class _ContextParams(_c.Structure):  # llama.h: struct llama_context_params, up to the last field parity reads
    # The structs are passed by value and returned through a hidden pointer: room past what a build
    # declares is never read, so fields a later llama.cpp appends (xllamacpp 2026.10 has 8 bytes more
    # than llama.h of llama-cpp-python 0.3.36 after abort_callback_data) change nothing here.
    _fields_ = [("n_ctx", _c.c_uint32), ("n_batch", _c.c_uint32), ("n_ubatch", _c.c_uint32),
                ("n_seq_max", _c.c_uint32), ("n_rs_seq", _c.c_uint32), ("n_outputs_max", _c.c_uint32),
                ("n_outputs_max_per_seq", _c.c_uint32), ("n_threads", _c.c_int32), ("n_threads_batch", _c.c_int32),
                ("ctx_type", _c.c_int), ("rope_scaling_type", _c.c_int), ("pooling_type", _c.c_int),
                ("attention_type", _c.c_int), ("flash_attn_type", _c.c_int), ("rope_freq_base", _c.c_float),
                ("rope_freq_scale", _c.c_float), ("yarn_ext_factor", _c.c_float), ("yarn_attn_factor", _c.c_float),
                ("yarn_beta_fast", _c.c_float), ("yarn_beta_slow", _c.c_float), ("yarn_orig_ctx", _c.c_uint32),
                ("defrag_thold", _c.c_float), ("cb_eval", _void), ("cb_eval_user_data", _void),
                ("type_k", _c.c_int), ("type_v", _c.c_int), ("_rest", _c.c_uint8 * 400)]


class _Batch(_c.Structure):  # llama.h: struct llama_batch
    _fields_ = [("n_tokens", _c.c_int32), ("token", _c.POINTER(_c.c_int32)), ("embd", _void),
                ("pos", _c.POINTER(_c.c_int32)), ("n_seq_id", _c.POINTER(_c.c_int32)),
                ("seq_id", _c.POINTER(_c.POINTER(_c.c_int32))), ("logits", _c.POINTER(_c.c_int8))]


_EVAL = _c.CFUNCTYPE(_c.c_bool, _c.POINTER(_Tensor), _c.c_bool, _void)
_LOG = _c.CFUNCTYPE(None, _c.c_int, _c.c_char_p, _void)


def version() -> str | None:
    return distribution_version("xllamacpp")


def _signatures(lib) -> None:
    for name, res, args in (
            ("llama_backend_init", None, []), ("llama_model_default_params", _ModelParams, []),
            ("llama_context_default_params", _ContextParams, []),
            ("llama_model_load_from_file", _void, [_c.c_char_p, _ModelParams]), ("llama_model_free", None, [_void]),
            ("llama_init_from_model", _void, [_void, _ContextParams]), ("llama_free", None, [_void]),
            ("llama_model_get_vocab", _void, [_void]),
            ("llama_tokenize", _c.c_int32, [_void, _c.c_char_p, _c.c_int32, _c.POINTER(_c.c_int32), _c.c_int32,
                                            _c.c_bool, _c.c_bool]),
            ("llama_batch_init", _Batch, [_c.c_int32, _c.c_int32, _c.c_int32]), ("llama_batch_free", None, [_Batch]),
            ("llama_decode", _c.c_int32, [_void, _Batch]), ("llama_get_memory", _void, [_void]),
            ("llama_memory_seq_rm", _c.c_bool, [_void, _c.c_int32, _c.c_int32, _c.c_int32]),
            ("llama_log_set", None, [_LOG, _void]), ("llama_model_n_ctx_train", _c.c_int32, [_void]),
            ("llama_vocab_n_tokens", _c.c_int32, [_void]),
            ("ggml_op_name", _c.c_char_p, [_c.c_int]), ("ggml_nbytes", _c.c_size_t, [_c.POINTER(_Tensor)]),
            ("ggml_get_name", _c.c_char_p, [_c.POINTER(_Tensor)]),
            ("ggml_backend_tensor_get", None, [_c.POINTER(_Tensor), _void, _c.c_size_t, _c.c_size_t]),
            ("ggml_set_name", _void, [_void, _c.c_char_p]),
            ("ggml_new_tensor_2d", _void, [_void, _c.c_int, _c.c_int64, _c.c_int64]), ("ggml_free", None, [_void])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    from parity_cli.backends.ggml_kernels import _InitParams

    lib.ggml_init.restype, lib.ggml_init.argtypes = _void, [_InitParams]


def _laid_out_as_known(lib) -> str | None:
    """Why the structs above are not llama.cpp's in this build, or None. The defaults llama.cpp
    returns (llama-context.cpp, llama-model.cpp) must sit where the layout puts them."""
    c, m = lib.llama_context_default_params(), lib.llama_model_default_params()
    expected = {"n_ctx": 512, "n_batch": 2048, "n_ubatch": 512, "n_seq_max": 1, "n_outputs_max_per_seq": 1,
                "n_threads": 4, "yarn_ext_factor": -1.0, "yarn_beta_slow": -1.0, "yarn_orig_ctx": 0,
                "defrag_thold": -1.0, "cb_eval": None, "cb_eval_user_data": None, "type_k": 1, "type_v": 1}
    wrong = [k for k, v in expected.items() if getattr(c, k) != v]
    if m.devices or m.tensor_buft_overrides or m.n_gpu_layers != -1 or m.split_mode != 1:
        wrong.append("llama_model_params")
    if not _tensor_laid_out_as_known(lib):
        wrong.append("ggml_tensor")
    return ", ".join(wrong) or None


def _tensor_laid_out_as_known(lib) -> bool:
    """A tensor ggml makes (7 x 3 float32, named by ggml_set_name) read back through _Tensor: its
    type, shape, strides and name where the layout says."""
    from parity_cli.backends.ggml_kernels import _InitParams

    ctx = lib.ggml_init(_InitParams(1 << 16, None, True))
    if not ctx:
        return False
    try:
        t = lib.ggml_new_tensor_2d(ctx, 0, 7, 3)
        lib.ggml_set_name(t, b"parity-layout")
        s = _c.cast(t, _c.POINTER(_Tensor)).contents
        return (s.type == 0 and tuple(s.ne) == (7, 3, 1, 1) and tuple(s.nb[:2]) == (4, 28) and s.op == 0
                and s.name == b"parity-layout" and lib.ggml_get_name(_c.byref(s)) == b"parity-layout")
    finally:
        lib.ggml_free(ctx)


def _lib():
    if not _LIB:
        from parity_cli.backends.ggml_kernels import INSTALL, library

        os.environ.setdefault("GGML_NO_BACKTRACE", "1")
        lib = _c.CDLL(str(library()))
        _signatures(lib)
        wrong = _laid_out_as_known(lib)
        if wrong:
            raise InputError(f"--runtime llama.cpp: xllamacpp {version()} lays out llama.cpp's structs otherwise than "
                             f"parity reads them ({wrong}); {INSTALL}, the version parity was built against")
        lib.llama_log_set(_LOG_SINK, None)
        lib.llama_backend_init()
        _LIB.append(lib)
    return _LIB[0]


_LOG_LINES: list = []


def _log(level, text, user_data):  # llama.cpp's log kept for an error's reason, never printed
    _LOG_LINES.append((text or b"").decode("utf-8", "replace"))
    del _LOG_LINES[:-200]


_LOG_SINK = _LOG(_log)


def _last_error() -> str:
    lines = [line.strip() for line in "".join(_LOG_LINES).splitlines() if line.strip()]
    said = [line for line in lines if "error" in line.lower() or "failed" in line.lower()]
    return (said or lines or ["no reason logged"])[-1][:300]


def _rows(lib, t):
    """A tensor's elements as (rows, ne0) float32, through its strides (a view is read where it lies)."""
    import numpy as np

    if t.type not in _GGML_TYPES:
        raise RuntimeError(f"tensor {t.name.decode()} of ggml type {t.type}: not read")
    dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[_GGML_TYPES[t.type]]
    size = lib.ggml_nbytes(_c.byref(t))  # the span of the elements through the strides
    raw = np.empty(size, np.uint8)
    lib.ggml_backend_tensor_get(_c.byref(t), raw.ctypes.data, 0, size)
    flat = raw.view(dtype)
    shape = tuple(int(t.ne[k]) for k in (3, 2, 1, 0))
    strides = tuple(int(t.nb[k]) for k in (3, 2, 1, 0))
    a = np.lib.stride_tricks.as_strided(flat, shape=shape, strides=strides).reshape(-1, shape[-1]).copy()
    if t.type == 30:  # bfloat16 bits: the upper half of a float32
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


class _Graph:
    """What the first decode of a chunk learns: the nodes in the order the scheduler asks for them,
    each norm with the node that feeds it and the nodes that apply its gain and bias."""

    def __init__(self, lib):
        self.lib = lib
        self.order: list = []  # (name, op name) by ordinal
        self.where: dict = {}  # node address -> ordinal
        self.nodes: list = []  # the tensors themselves (valid while the graph is)

    def ask(self, t) -> None:
        node = t.contents
        self.where[_c.addressof(node)] = len(self.order)
        self.order.append((node.name.decode("utf-8", "replace"), self.lib.ggml_op_name(node.op).decode()))
        self.nodes.append(node)

    def norms(self) -> list[dict]:
        """Each norm node: its ordinal, op, eps, the ordinal of its input (None: a leaf, read at the
        norm), and the chain build_norm appends: MUL by a gain, ADD of a bias, each a model tensor."""
        consumers: dict = {}
        for k, node in enumerate(self.nodes):
            for s in node.src:
                if s:
                    consumers.setdefault(_c.addressof(s.contents), []).append(k)
        found = []
        for k, (name, op) in enumerate(self.order):
            if op not in _NORM_OPS:
                continue
            node = self.nodes[k]
            eps = _c.cast(_c.pointer(node.op_params), _c.POINTER(_c.c_float))[0]
            src = node.src[0].contents
            entry = {"ordinal": k, "name": name, "op": op, "eps": float(eps),
                     "input": self.where.get(_c.addressof(src)), "input_tensor": src, "tail": k,
                     "gain": None, "bias": None, "chain": [f"{op} {name}"]}
            tail = k
            for role, op_name in (("gain", "MUL"), ("bias", "ADD")):
                after = [j for j in consumers.get(_c.addressof(self.nodes[tail]), []) if self.order[j][1] == op_name]
                if len(after) != 1:
                    break
                j = after[0]
                other = [s.contents for s in self.nodes[j].src[:2]
                         if s and _c.addressof(s.contents) != _c.addressof(self.nodes[tail])]
                if len(other) != 1 or _c.addressof(other[0]) in self.where:  # a model tensor, not a node
                    break
                entry[role] = other[0]
                entry["chain"].append(f"{op_name} {other[0].name.decode()} -> {self.order[j][0]}")
                tail = j
            entry["tail"] = tail
            # read now: the graph's own structs may be rebuilt by the next decode
            entry["dtype"] = _GGML_TYPES.get(src.type, f"ggml type {src.type}")
            entry["gain"], entry["bias"] = _param(self.lib, entry["gain"]), _param(self.lib, entry["bias"])
            found.append(entry)
        return found


def record(path, tokens: list[int] | None, text: str | None, max_tokens: int, chunk: int = 256,
           threads: int = 2, rows_per_layer: int = 96, seed: int = 0) -> dict:
    """record_here() in a child interpreter (`python -m parity_cli.backends.llama_graph DIR`, which
    imports neither torch nor numpy's users): llama.cpp is C++ reading an untrusted file, and an
    exception it does not catch (a text its vocabulary cannot encode, a tensor its loader rejects)
    aborts the process; here that is one line naming what llama.cpp last said. A fork would inherit
    torch's OpenMP pool, which ggml's own OpenMP then waits on forever. The rows come back as .npy
    files (no pickle), the rest as JSON."""
    import json
    import signal
    import subprocess
    import sys
    import tempfile

    import numpy as np

    with tempfile.TemporaryDirectory(prefix="parity-llama-") as tmp:
        with open(os.path.join(tmp, "args.json"), "w") as fh:
            json.dump({"path": os.path.abspath(path), "tokens": tokens, "text": text, "max_tokens": max_tokens, "chunk": chunk,
                       "threads": threads, "rows_per_layer": rows_per_layer, "seed": seed, "parent": os.getpid()}, fh)
        # this parity_cli, first: `-m` also puts the working directory on the path, so the child runs in
        # its own temporary directory, where no other parity_cli can be found first
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
        with open(os.path.join(tmp, "stderr"), "wb") as err:
            done = subprocess.run([sys.executable, "-m", "parity_cli.backends.llama_graph", tmp],
                                  stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env, cwd=tmp)
        result_path = os.path.join(tmp, "result.json")
        if not os.path.exists(result_path):
            said = _said(os.path.join(tmp, "stderr"))
            code = done.returncode
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            raise InputError(f"{path}: llama.cpp stopped ({how}) while running it" + (f": {said}" if said else ""))
        with open(result_path) as fh:
            result = json.load(fh)
        if "input_error" in result:
            raise InputError(result["input_error"])
        if "error" in result:
            raise InputError(f"{path}: recording inside llama.cpp failed: {result['error'][:300]}")
        out = result["ok"]
        for k, node in enumerate(out["nodes"]):
            for part in ("x", "y"):
                node[part] = np.load(os.path.join(tmp, f"{k}.{part}.npy"), allow_pickle=False)
            for part in ("gain", "bias"):
                if node[part] is not None:
                    node[part] = (node[part][0], np.load(os.path.join(tmp, f"{k}.{part}.npy"), allow_pickle=False),
                                  node[part][2])
        return out


def _child(tmp: str) -> None:
    """The child's side of record(): its arguments from DIR/args.json, its answer in DIR."""
    import json

    import numpy as np

    with open(os.path.join(tmp, "args.json")) as fh:
        args = json.load(fh)
    from parity_cli.lifetime import die_with_parent

    die_with_parent(args.get("parent"))  # kill -9 of parity: this one goes at once, not after llama.cpp's chunk
    try:
        out = record_here(args["path"], args["tokens"], args["text"], args["max_tokens"], args["chunk"],
                          args["threads"], args["rows_per_layer"], args["seed"])
        for k, node in enumerate(out["nodes"]):
            for part in ("x", "y"):
                np.save(os.path.join(tmp, f"{k}.{part}.npy"), node.pop(part), allow_pickle=False)
            for part in ("gain", "bias"):
                if node[part] is not None:
                    np.save(os.path.join(tmp, f"{k}.{part}.npy"), node[part][1], allow_pickle=False)
                    node[part] = [node[part][0], None, node[part][2]]
        result = {"ok": out}
    except InputError as exc:
        result = {"input_error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - said by the parent, in one line
        result = {"error": f"{type(exc).__name__}: {exc}"}
    with open(os.path.join(tmp, "result.json"), "w") as fh:
        json.dump(result, fh)


def _said(path: str) -> str:
    """The last telling line a dead child wrote (a C++ exception's what(), llama.cpp's error)."""
    try:
        with open(path, "rb") as fh:
            lines = [line.strip() for line in fh.read()[-4000:].decode("utf-8", "replace").splitlines()]
    except OSError:
        return ""
    lines = [line for line in lines if line]
    told = [line for line in lines if "what()" in line or "error" in line.lower() or "terminate" in line]
    return (told or lines or [""])[-1][:240]


def record_here(path, tokens: list[int] | None, text: str | None, max_tokens: int, chunk: int = 256,
                threads: int = 2, rows_per_layer: int = 96, seed: int = 0) -> dict:
    """{"nodes": [per norm node: name, op, eps, gain/bias (name, float32 values, stored type), chain,
    dtype, x, y (the kept rows as float32 arrays), seen (finite input rows the node gave)], "tokens":
    n, "version": ...} for the GGUF at `path`, on `tokens` or `text` (tokenized by the GGUF's own
    vocabulary, llama_tokenize). Rows are sampled chunk by chunk (sampling.RowSample): memory is
    rows_per_layer pairs a node whatever the number of tokens."""
    lib = _lib()
    _LOG_LINES.clear()
    mp = lib.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = lib.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise InputError(f"{path}: llama.cpp could not load it: {_last_error()}")
    try:
        vocab = lib.llama_model_get_vocab(model)
        if tokens is None:
            raw = text.encode("utf-8")
            buf = (_c.c_int32 * (len(raw) + 8))()
            n = lib.llama_tokenize(vocab, raw, len(raw), buf, len(buf), True, False)
            if n < 0:
                raise InputError(f"{path}: llama.cpp could not tokenize the text ({-n} tokens needed)")
            tokens = list(buf[:n])
        n_vocab = lib.llama_vocab_n_tokens(vocab)
        bad = [t for t in tokens if not 0 <= t < n_vocab]
        if bad:
            raise InputError(f"token id {bad[0]} is outside {path}'s vocabulary of {n_vocab}")
        tokens = tokens[:max_tokens]
        if not tokens:
            raise InputError("the text has no tokens")
        n_ctx, cut = len(tokens), None
        train = lib.llama_model_n_ctx_train(model)
        if 0 < train < n_ctx:  # whole sequences as the model was trained: no position past its context
            cut = f"{n_ctx} tokens cut to the model's context of {train} (its context_length)"
            n_ctx = train
            tokens = tokens[:n_ctx]
        # every token is an output (the last block is not cut to the last one): the logits buffer is
        # n_vocab floats a token, so a chunk is bounded to 256 MiB of them
        step = max(1, min(chunk, n_ctx, (64 << 20) // max(1, n_vocab)))
        out = _run(lib, model, tokens, n_ctx, step, threads, path, rows_per_layer, seed)
        if cut:
            out["note"] = cut
        return out
    finally:
        lib.llama_model_free(model)


def _run(lib, model, tokens, n_ctx, step, threads, path, rows_per_layer: int, seed: int) -> dict:
    import random

    rng = random.Random(seed)

    cp = lib.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = max(n_ctx, 8), step, step
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = 0  # disabled: the plain attention graph on every CPU
    state = {"graph": None, "want": {}, "k": 0, "at": None, "got": {}, "error": None}

    def callback(t, ask, user_data):
        try:
            if state["graph"] is not None:  # the first decode: learn, compute everything in one go
                state["graph"].ask(t)
                return False
            if ask:
                state["at"] = state["k"]
                state["k"] += 1
                want = state["want"].get(state["at"])
                if want is not None and t.contents.name.decode("utf-8", "replace") != want:
                    raise RuntimeError(f"llama.cpp built another graph on the second decode (node {state['at']}: "
                                       f"{t.contents.name.decode()} where {want} was)")
                return want is not None
            state["got"][state["at"]] = _rows(lib, t.contents)
            return True
        except BaseException as exc:  # noqa: BLE001 - nothing may unwind through C; said after the decode
            state["error"] = exc
            return False

    cb = _EVAL(callback)
    cp.cb_eval = _c.cast(cb, _void)
    ctx = lib.llama_init_from_model(model, cp)
    if not ctx:
        raise InputError(f"{path}: llama.cpp could not make a context: {_last_error()}")
    nodes: dict = {}
    try:
        mem = lib.llama_get_memory(ctx)
        for start in range(0, len(tokens), step):
            part = tokens[start:start + step]
            batch = lib.llama_batch_init(len(part), 0, 1)
            try:
                batch.n_tokens = len(part)
                for i, tok in enumerate(part):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, start + i, 1
                    batch.seq_id[i][0], batch.logits[i] = 0, 1
                graph = state["graph"] = _Graph(lib)
                _decode(lib, ctx, batch, state, path)
                norms = graph.norms()
                # a norm fed by a leaf (an input the runtime set) is read now, before the second decode
                leaf = {n["ordinal"]: _rows(lib, n["input_tensor"]) for n in norms if n["input"] is None}
                lib.llama_memory_seq_rm(mem, 0, start, -1)
                state["graph"], state["k"], state["got"] = None, 0, {}
                state["want"] = {}
                for n in norms:
                    for key in ("input", "tail"):
                        if n[key] is not None:
                            state["want"][n[key]] = graph.order[n[key]][0]
                _decode(lib, ctx, batch, state, path)
                for n in norms:
                    x = leaf[n["ordinal"]] if n["input"] is None else state["got"].get(n["input"])
                    y = state["got"].get(n["tail"])
                    if x is None or y is None or x.shape != y.shape:
                        continue
                    # a weightless node has no tensor to name it: its place in the graph does
                    key = n["gain"][0] if n["gain"] is not None else f"{n['op']} {n['name']} #{n['ordinal']}"
                    if key not in nodes:
                        nodes[key] = ({"node": n["name"], "op": n["op"], "eps": n["eps"], "chain": n["chain"],
                                       "gain": n["gain"], "bias": n["bias"], "dtype": n["dtype"], "width": x.shape[1],
                                       "nonfinite": 0},
                                      RowSample.of(rows_per_layer, rng))
                    _keep(*nodes[key], x, y, n["op"])
            finally:
                lib.llama_batch_free(batch)
    finally:
        lib.llama_free(ctx)
    return {"nodes": [_kept(entry, sample) for entry, sample in nodes.values()], "tokens": len(tokens),
            "version": version(), "chunk": step}


def _keep(entry: dict, sample, x, y, op: str) -> None:
    """A chunk's finite input rows, each with its output, into the node's sample (q: the mean square,
    or the variance for a NORM node, as the check computes it)."""
    import numpy as np

    finite = np.isfinite(x).all(-1)
    entry["nonfinite"] += int((~finite).sum())
    x, y = x[finite].astype(np.float64), y[finite]
    centred = x - x.mean(-1, keepdims=True) if op == "NORM" else x
    sample.add(np.concatenate([x.astype(np.float32), y], -1), (centred * centred).mean(-1))


def _kept(entry: dict, sample) -> dict:
    import numpy as np

    rows = sample.kept()
    both = np.stack(rows) if rows else np.zeros((0, 2 * entry["width"]), np.float32)
    width, nonfinite = entry.pop("width"), entry.pop("nonfinite")
    return {**entry, "x": both[:, :width], "y": both[:, width:], "seen": sample.seen + nonfinite}


def _decode(lib, ctx, batch, state, path) -> None:
    status = lib.llama_decode(ctx, batch)
    if state["error"] is not None:
        exc, state["error"] = state["error"], None
        raise exc
    if status != 0:
        raise InputError(f"{path}: llama_decode returned {status}: {_last_error()}")


def _param(lib, t):
    """(GGUF name, float32 values, the type it is stored in) of a model tensor the graph attached."""
    if t is None:
        return None
    return t.name.decode("utf-8", "replace"), _rows(lib, t).reshape(-1), _GGML_TYPES[t.type]


if __name__ == "__main__":
    import sys

    _child(sys.argv[1])
