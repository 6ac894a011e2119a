"""Real exports for the ONNX tests: the checkpoint's norm layers as the real transformers (or
torch) module classes, at their real module paths, loaded with the checkpoint's weights, then
torch.onnx.export (TorchScript or dynamo) and, where asked, ONNX Runtime's transformer optimizer.

The model applies every norm to an input of its width and chains them with a residual add, so
the optimizer sees the pattern it fuses into SkipSimplifiedLayerNormalization."""

from __future__ import annotations

import importlib

import torch

from parity_cli.backends.exporting import cia_ops_materialized_once


def _norm_class(layer):
    if layer.hf_class is None:
        return None
    module, _, attr = layer.hf_class.rpartition(".")
    return getattr(importlib.import_module(module), attr)


class Seq(torch.nn.Module):
    """A module-tree node that calls its children in order, so an exporter sees each norm at its
    real path (model -> layers -> 0 -> input_layernorm), as in the real model's forward."""

    def forward(self, state):
        for child in self.children():
            if isinstance(child, Seq):
                state = child(state)
                continue
            streams, outs = state
            k = [s.shape[-1] for s in streams].index(child.weight.shape[-1])
            y = child(streams[k])
            streams = streams[:k] + [streams[k] + y] + streams[k + 1:]  # a residual stream: x + y
            state = (streams, outs + [y])
        return state


# the order the models' own forward calls a block's norms in (read from modeling_gemma3, _llama,
# _qwen3, _bert, _gpt2): a value-paired graph is checked against that order, so the harness runs it
FORWARD_ROLES = ("embeddings.LayerNorm", "input_layernorm", "self_attn.q_norm", "self_attn.k_norm",
                 "attention.output.LayerNorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "output.LayerNorm", "ln_1", "ln_2")


def forward_key(name: str) -> tuple:
    import re

    block = re.search(r"\.(\d+)\.", name)
    where = int(block.group(1)) if block else (-1 if "embed" in name else 1 << 30)
    return (where, next((k for k, role in enumerate(FORWARD_ROLES) if name.endswith(role)), len(FORWARD_ROLES)))


class Norms(Seq):
    def __init__(self, layers, swap_class=None, eps=None):
        super().__init__()
        for layer in sorted(layers, key=lambda layer: forward_key(layer.name)):
            cls = swap_class or _norm_class(layer)
            if cls is torch.nn.LayerNorm:
                mod = cls(layer.dim, eps=(eps or {}).get(layer.name, layer.eps.value), bias=layer.bias is not None)
            else:
                mod = cls(layer.dim, eps=(eps or {}).get(layer.name, layer.eps.value))
            with torch.no_grad():
                mod.weight.copy_(layer.weight.float())
                if layer.bias is not None:
                    mod.bias.copy_(layer.bias.float())
            parent = self
            parts = layer.name.split(".")
            for p in parts[:-1]:
                if not hasattr(parent, p):
                    parent.add_module(p, Seq())
                parent = getattr(parent, p)
            parent.add_module(parts[-1], mod)

    def forward(self, *xs):
        _, outs = super().forward((list(xs), []))
        return tuple(outs)


def export(ckpt_dir, out, exporter="torchscript", drop=(), swap_class=None, eps=None, half=False, optimize=False,
           external=False, opset=None):
    """Exports the checkpoint's norms to `out`; returns the path."""
    from parity_cli import api
    from parity_cli.model.layers import discover_layers

    ckpt, fam, resolved = api.load(ckpt_dir)
    layers = [l for l in discover_layers(ckpt, fam, resolved).layers if l.name not in drop]
    model = Norms(layers, swap_class, eps).eval()
    dims = sorted({l.dim for l in layers}, reverse=True)  # distinct widths: one input each
    dtype = torch.float16 if half else torch.float32
    if half:
        model = model.half()
    inputs = tuple(torch.randn(1, 4, d, dtype=dtype) for d in dims)
    kwargs = {"dynamo": exporter == "dynamo", "opset_version": opset or (18 if exporter == "dynamo" else 17)}
    if exporter == "dynamo":
        kwargs["optimize"] = True
    import warnings

    with warnings.catch_warnings(), cia_ops_materialized_once():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, str(out), **kwargs)
    if optimize:
        from onnxruntime.transformers import optimizer

        opt = optimizer.optimize_model(str(out), model_type="bert", num_heads=0, hidden_size=0, opt_level=0)
        opt.save_model_to_file(str(out))
    if external:
        import onnx

        m = onnx.load(str(out))
        onnx.save(m, str(out), save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin",
                  size_threshold=0)
    return out


class Wrapper(torch.nn.Module):
    """A model exported inside another module, as a user's export script often does: every
    initializer and node path gains a prefix (`m.model.layers.0.input_layernorm.weight`)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, *xs):
        return self.m(*xs)


def export_wrapped(ckpt_dir, out, exporter="torchscript", swap=None):
    """The checkpoint's norms exported inside a Wrapper, the gains of the two layers named in
    `swap` exchanged first (a conversion that wrote them to the wrong layers)."""
    import contextlib
    import io
    import warnings

    from parity_cli import api
    from parity_cli.model.layers import discover_layers

    ckpt, fam, resolved = api.load(ckpt_dir)
    layers = discover_layers(ckpt, fam, resolved).layers
    model = Norms(layers).eval()
    if swap:
        mods = dict(model.named_modules())
        a, b = mods[swap[0]].weight, mods[swap[1]].weight
        with torch.no_grad():
            saved = a.clone()
            a.copy_(b)
            b.copy_(saved)
    dims = sorted({l.dim for l in layers}, reverse=True)
    inputs = tuple(torch.randn(1, 4, d) for d in dims)
    kwargs = {"dynamo": exporter == "dynamo", "opset_version": 18 if exporter == "dynamo" else 17}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            cia_ops_materialized_once():
        warnings.simplefilter("ignore")
        torch.onnx.export(Wrapper(model), inputs, str(out), **kwargs)
    return out


def strip_names(path):
    """Every initializer renamed `w{k}`, node names and metadata cleared: a graph whose names and
    paths say nothing of the layers (as after some optimizers), so norms pair by value."""
    import onnx

    model = onnx.load(str(path))
    renamed = {t.name: f"w{k}" for k, t in enumerate(model.graph.initializer)}
    for t in model.graph.initializer:
        t.name = renamed[t.name]
    for node in model.graph.node:
        node.name = ""
        del node.metadata_props[:]
        for k, name in enumerate(node.input):
            if name in renamed:
                node.input[k] = renamed[name]
    onnx.save(model, str(path))
    return path


def cast_reduction(path, scope: str, to: str = "float16"):
    """Pow -> Cast(to) -> ReduceMean -> Cast(float32) -> Add(eps) in the one norm whose node names
    hold `scope`: what a mixed-precision converter inserts around a reduction it keeps in half."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(path))
    nodes = list(model.graph.node)
    (mean,) = [n for n in nodes if n.op_type == "ReduceMean" and scope in n.name
               and any(p.op_type == "Pow" and p.output[0] == n.input[0] for p in nodes)]
    q = mean.output[0]
    low = getattr(TensorProto, to.upper())
    before = helper.make_node("Cast", [mean.input[0]], [mean.input[0] + "_low"], to=low, name=mean.name + "_cast_in")
    after = helper.make_node("Cast", [q + "_low"], [q], to=TensorProto.FLOAT, name=mean.name + "_cast_out")
    mean.input[0] = mean.input[0] + "_low"
    mean.output[0] = q + "_low"
    k = nodes.index(mean)
    del model.graph.node[:]
    model.graph.node.extend(nodes[:k] + [before, mean, after] + nodes[k + 1:])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


# --- a whole transformers ResNet (BatchNorm2d after every Conv) -----------------------------------


def export_resnet(hf_dir, out, fold=False, image=32):
    """The checkpoint's ResNetModel in eval mode, exported as a user does (TorchScript, opset 17).
    torch.onnx.export folds every eval-mode BatchNorm into the Conv before it unless
    do_constant_folding=False: `fold` is the exporter's default, which leaves no BatchNormalization."""
    import contextlib
    import io
    import warnings

    from transformers import ResNetModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = ResNetModel.from_pretrained(str(hf_dir)).eval()
    x = torch.randn(1, model.config.num_channels, image, image, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(out), dynamo=False, opset_version=17, do_constant_folding=fold,
                          input_names=["pixel_values"])
    return out


def batch_norm_node(model, layer: str):
    """The BatchNormalization node whose scale is `layer.weight`."""
    (node,) = [n for n in model.graph.node if n.op_type == "BatchNormalization" and n.input[1] == f"{layer}.weight"]
    return node


def plant_batch_norm(path, out, eps=None, scale=None, training=()):
    """A copy of an export with faults planted in BatchNormalization nodes, each named by its
    checkpoint layer: eps {layer: epsilon}; scale {(layer, operand, channel): factor} multiplies
    one channel of an operand (running_mean, running_var, ...); training: layers switched to
    training_mode=1 (with the two running-statistics outputs the op then requires)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path))
    for layer, value in (eps or {}).items():
        node = batch_norm_node(model, layer)
        kept = [a for a in node.attribute if a.name != "epsilon"]
        del node.attribute[:]
        node.attribute.extend(kept + [helper.make_attribute("epsilon", float(value))])
    inits = {t.name: t for t in model.graph.initializer}
    for (layer, operand, channel), factor in (scale or {}).items():
        t = inits[f"{layer}.{operand}"]
        arr = numpy_helper.to_array(t).copy()
        arr[channel] *= factor
        t.CopyFrom(numpy_helper.from_array(arr, t.name))
    for layer in training:
        node = batch_norm_node(model, layer)
        kept = [a for a in node.attribute if a.name != "training_mode"]
        del node.attribute[:]
        node.attribute.extend(kept + [helper.make_attribute("training_mode", 1)])
        node.output.extend([f"{layer}.batch_mean", f"{layer}.batch_var"])
    onnx.checker.check_model(model)
    onnx.save(model, str(out))
    return out


def fold_batch_norm(path, out, layer: str):
    """A copy of an export whose one BatchNorm is folded into the Conv before it, as an exporter's
    constant folding does: W' = W * s / sqrt(var + eps) per output channel, B' = (B - mean) * s /
    sqrt(var + eps) + b, computed here in float64; the BatchNormalization node and its operands gone."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    node = batch_norm_node(model, layer)
    (conv,) = [n for n in model.graph.node if node.input[0] in n.output]
    assert conv.op_type == "Conv"
    inits = {t.name: t for t in model.graph.initializer}
    s, b, mean, var = (numpy_helper.to_array(inits[name]).astype(np.float64) for name in node.input[1:5])
    eps = next(a.f for a in node.attribute if a.name == "epsilon")
    factor = s / np.sqrt(var + eps)
    w = numpy_helper.to_array(inits[conv.input[1]]).astype(np.float64)
    conv_bias = numpy_helper.to_array(inits[conv.input[2]]).astype(np.float64) if len(conv.input) > 2 else 0.0
    folded_w = numpy_helper.from_array((w * factor[:, None, None, None]).astype(np.float32), f"onnx::Conv_folded_{layer}")
    folded_b = numpy_helper.from_array(((conv_bias - mean) * factor + b).astype(np.float32), f"onnx::Conv_bias_{layer}")
    old = set(conv.input[1:])
    del conv.input[1:]
    conv.input.extend([folded_w.name, folded_b.name])
    for n in model.graph.node:  # the BatchNorm's consumers read the Conv
        for k, name in enumerate(n.input):
            if name == node.output[0]:
                n.input[k] = conv.output[0]
    for o in model.graph.output:
        assert o.name != node.output[0]
    model.graph.node.remove(node)
    gone = old | set(node.input[1:5])
    kept = [t for t in model.graph.initializer if t.name not in gone]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + [folded_w, folded_b])
    onnx.checker.check_model(model)
    onnx.save(model, str(out))
    return out


def half_node(path, scope: str, op: str = "LayerNormalization"):
    """The one `op` node whose name holds `scope` computed in float16 inside a float32 graph: x, the
    gain and the bias cast to float16 before it, its output cast back to float32 (what a
    mixed-precision converter does to a node it keeps in half)."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(path))
    nodes = list(model.graph.node)
    (node,) = [n for n in nodes if n.op_type == op and scope in n.name]
    casts = []
    for k, name in enumerate(node.input):
        if name:
            casts.append(helper.make_node("Cast", [name], [f"{name}__f16_{node.name}"], to=TensorProto.FLOAT16,
                                          name=f"{node.name}_in{k}"))
            node.input[k] = casts[-1].output[0]
    y = node.output[0]
    node.output[0] = y + "__f16"
    back = helper.make_node("Cast", [node.output[0]], [y], to=TensorProto.FLOAT, name=node.name + "_out")
    k = nodes.index(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes[:k] + casts + [node, back] + nodes[k + 1:])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path
