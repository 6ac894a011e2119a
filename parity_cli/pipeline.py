"""The stages wired together: checkpoint -> layers -> probes -> implementations -> comparison
-> diagnosis -> report. parity_cli.api is the facade over it; the explain ladder reruns it."""

from __future__ import annotations

import dataclasses
import platform
from pathlib import Path

from parity_cli import __version__
from parity_cli.check import parallel
from parity_cli.check.parallel import resolve_jobs
from parity_cli.errors import AdapterError, InputError
from parity_cli.model.families import family_choice
from parity_cli.model.fingerprint import fingerprint
from parity_cli.model.installed import installed_version
from parity_cli.model.layers import unchecked
from parity_cli.model.load import load
from parity_cli.options import (
    ONE_PERCENT_Q_OVER_EPS,
    CheckOptions,
    candidate_args,
    check_device,
    dtype_name,
    is_oracle,
    reference_device,
    reference_dtype_for,
    stored_dtype,
    uses_transformers,
)
from parity_cli.report.grouping import g as _g
from parity_cli.report.replay import checkpoint_where, recorded_path, recorded_spec


def _config_name(ckpt) -> str:
    return str(ckpt.path) if ckpt.format == "gguf" else str(ckpt.path / "config.json")


def _eps_keys(ckpt, fam) -> str:
    if ckpt.format == "gguf":
        arch = getattr(ckpt, "architecture", "{arch}")
        return f"{arch}.attention.layer_norm_rms_epsilon, {arch}.attention.layer_norm_epsilon"
    return ", ".join(fam.eps_keys)


def _eps_dict(eps) -> dict:
    """eps with its source; a value stored as float32 (GGUF) also gives the decimal it came from."""
    out = {"value": eps.value, "source": eps.source}
    if eps.source.startswith("gguf:"):
        from parity_cli.sources.gguf import float32_decimal

        out.update(stored_as="float32", decimal=float32_decimal(eps.value))
    return out


def environment(device: str, threads: int | None = None, jobs: int | None = None) -> dict:
    import torch

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        # the release the families were read against at run time (model.installed): None where not installed
        "transformers": installed_version(),
        "platform": platform.platform(),
        "device_name": "cpu",
        "cuda": torch.version.cuda,
        # what the timing of this run rests on: the CPUs it may use, its workers and their threads
        "cpus": resolve_jobs("auto"),
        "jobs": jobs,
        "threads": threads,
    }
    env["torch_build"] = {"cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
                          "debug": torch.version.debug, "git": getattr(torch.version, "git_version", None)}
    if device.startswith("cuda"):
        dev = torch.device(device)
        props = torch.cuda.get_device_properties(dev)
        env["device_name"] = torch.cuda.get_device_name(dev)
        env["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                      "memory_gib": round(props.total_memory / 2**30, 1), "cuda_runtime": torch.version.cuda,
                      "cudnn": torch.backends.cudnn.version()}
    else:
        env["device_name"] = platform.processor() or platform.machine()
    return env


def inspect(path: str | Path, family: str | None = None, eps: float | None = None) -> dict:
    """What a check would run on, without running it: family, eps and its source, each layer's
    weight and the RMS below which eps attenuates its output by more than 1%."""
    import math

    from parity_cli.check.layer import running_summary, weight_stats
    from parity_cli.model.layers import discover_layers
    from parity_cli.sources.onnx_graph import is_onnx
    from parity_cli.sources.openvino_ir import is_openvino_ir

    if is_onnx(path):
        return _inspect_onnx(path)
    if is_openvino_ir(path):
        return _inspect_openvino(path)
    ckpt, fam, resolved = load(path, family, eps)
    found = discover_layers(ckpt, fam, resolved)
    warnings = list(found.warnings)
    if resolved.source == "family-default":
        warnings.append(f"eps is not in {_config_name(ckpt)} (looked for {_eps_keys(ckpt, fam)}); "
                        f"the family default {_g(resolved.value)} is assumed")
    if found.unmatched:
        warnings.append(f"{len(found.unmatched)} norm-like tensor(s) match no pattern of family '{fam.name}'")
    layers, nonfinite, nonpositive = [], [], []
    for layer in found.layers:
        stats = weight_stats(layer.weight)
        if layer.weightless:
            stats["stored"] = False
        gain = None if stats["min"] is None else {"min": layer.gain_offset + stats["min"],
                                                   "max": layer.gain_offset + stats["max"]}
        if stats["nonfinite"]:
            nonfinite.append((layer.name, stats["nonfinite"]))
        if gain is not None and gain["min"] <= 0:
            nonpositive.append((layer.name, gain["min"]))
        layers.append({
            "name": layer.name, "kind": layer.kind, "dim": layer.dim, "tower": layer.tower, "shape": list(layer.shape),
            "order": layer.order, "bias": layer.bias is not None,
            "eps": {"value": layer.eps.value, "source": layer.eps.source},
            "weight": stats, "gain": gain, "gain_offset": layer.gain_offset,
            "rms_1pct": math.sqrt(ONE_PERCENT_Q_OVER_EPS * layer.eps.value),
            "warnings": layer.warnings,
        })
        if layer.kind == "batch_norm":  # its q/eps is running_var / eps, read off the checkpoint
            layers[-1]["statistics"] = running_summary(layer, layer.eps.value)
        if layer.kind in ("group_norm", "gated_rms_norm"):  # what a port gets wrong with the eps
            layers[-1]["groups"] = layer.groups
    # one line per kind of condition, with how many layers and which: a healthy 109-layer model
    # must not print 77 lines about it
    from parity_cli.report.grouping import name_pattern
    from parity_cli.text import layer_count

    universe = [l.name for l in found.layers]
    notes = []
    if nonfinite:
        warnings.append(_nonfinite_words(nonfinite, universe))
    if nonpositive:
        names = [n for n, _ in nonpositive]
        notes.append(f"channels with effective gain <= 0 (lowest {min(v for _, v in nonpositive):.3g}) in "
                     f"{layer_count(len(names))} ({name_pattern(names, universe)}): common in trained weights, "
                     "and checked like any other gain")
    batch = [l for l in layers if "statistics" in l]
    if batch:
        low = min(batch, key=lambda l: l["statistics"]["running_var_over_eps"]["min"])
        under = sum(l["statistics"]["channels_attenuated_over_1pct"] for l in batch)
        total = sum(l["statistics"]["channels"] for l in batch)
        notes.append(f"BatchNorm q/eps is running_var / eps per channel: smallest "
                     f"{low['statistics']['running_var_over_eps']['min']:.3g} ({low['name']}, channel "
                     f"{low['statistics']['running_var_over_eps']['channel']}); {under} of {total} channels under "
                     f"{ONE_PERCENT_Q_OVER_EPS:.4g} (eps attenuates them by more than 1 %, and a wrong eps shows there)")
    return {
        "schema_version": 1,
        "tool": {"name": "parity-cli", "version": __version__},
        "checkpoint": {**checkpoint_where(ckpt), "format": ckpt.format, "family": fam.name,
                       "family_from": family_choice(family, fam, ckpt.model_type, ckpt.format,
                                             getattr(ckpt, "architecture", None)),
                       "family_source": fam.source_line,
                       "model_type": ckpt.model_type, "files": [f.name for f in ckpt.files],
                       "unmatched": found.unmatched, "unchecked": unchecked(ckpt, found, fam)},
        "eps": _eps_dict(resolved),
        "layers": layers,
        "warnings": warnings,
        "notes": notes,
    }


def _nonfinite_words(nonfinite: list, universe: list) -> str:
    """One warning for every layer whose stored gain holds NaN or inf: ((name, count), ...)."""
    from parity_cli.report.grouping import name_pattern
    from parity_cli.text import layer_count

    names = [n for n, _ in nonfinite]
    return (f"non-finite weight values in {layer_count(len(names))} ({name_pattern(names, universe)}): "
            f"{sum(c for _, c in nonfinite)} values; every output of those layers is NaN or inf")


def _inspect_onnx(path) -> dict:
    """An exported graph on its own: each norm found, its form, eps and where that came from,
    its gain (with any offset the graph adds), and the dtype it computes in."""
    from parity_cli.check.layer import running_summary
    from parity_cli.model.onnx_layers import TRAINING_WORDS
    from parity_cli.sources.onnx_graph import find_norms, load_model, reduced_words

    path = Path(path)
    model = load_model(path)
    norms = find_norms(model, path)
    if not norms:
        raise InputError(f"{path}: no norm found in the graph")
    layers = []
    for n in norms:
        layers.append(_graph_layer(n, warnings=[reduced_words(n.reduced)] if n.reduced else []))
        if n.kind == "group_norm" and getattr(n, "groups", None):
            layers[-1]["groups"] = n.groups
        if n.kind == "batch_norm" and getattr(n, "running_var", None) is not None:
            layers[-1]["statistics"] = running_summary(n, n.eps)
            if getattr(n, "training", False):
                layers[-1]["warnings"].append(TRAINING_WORDS)
    return _graph_inspection(path, "onnx", "onnx graph", [path.name], norms, layers)


def _graph_layer(n, **extra) -> dict:
    """One norm of an exported graph as inspect shows it (ONNX, OpenVINO IR)."""
    import math

    from parity_cli.check.layer import weight_stats

    stats = weight_stats(n.weight)
    gain = None if stats["min"] is None else {"min": n.offset + stats["min"], "max": n.offset + stats["max"]}
    return {"name": n.name, "kind": n.kind, "dim": n.dim, "shape": list(n.weight.shape), "order": n.form,
            "bias": n.bias is not None, "eps": {"value": n.eps, "source": n.eps_source},
            "weight": stats, "gain": gain, "gain_offset": n.offset, "form": n.form, "dtype": n.dtype,
            "rms_1pct": math.sqrt(ONE_PERCENT_Q_OVER_EPS * n.eps), **extra}


def _graph_inspection(path: Path, fmt: str, family: str, files: list, norms, layers: list) -> dict:
    """inspect's answer for a graph: no config, so the eps shown is the most common of its norms."""
    from collections import Counter

    eps = Counter(n.eps for n in norms).most_common(1)[0][0]
    forms = Counter(n.form for n in norms)
    distinct = len(set(n.eps for n in norms))
    nonfinite = [(layer["name"], layer["weight"]["nonfinite"]) for layer in layers if layer["weight"]["nonfinite"]]
    return {
        "schema_version": 1,
        "tool": {"name": "parity-cli", "version": __version__},
        "checkpoint": {"path": str(path), "format": fmt, "family": family,
                       "model_type": ", ".join(f"{k} x{v}" for k, v in forms.items()), "files": files,
                       "unmatched": []},
        "eps": {"value": eps, "source": "the most common eps of its norms"},
        "layers": layers,
        "warnings": [_nonfinite_words(nonfinite, [layer["name"] for layer in layers])] if nonfinite else [],
        "notes": [f"{distinct} distinct eps values across {len(norms)} norms"] if distinct > 1 else [],
    }


def _inspect_openvino(path) -> dict:
    """An OpenVINO IR on its own: each norm found, its form, eps and where that came from (the
    element type a compressed IR stores it in), its gain, and the type it computes in."""
    from parity_cli.model.openvino_layers import graph_findings
    from parity_cli.sources.openvino_ir import find_norms, read_model

    path = Path(path)
    model, ops = read_model(path)
    norms = find_norms(model, ops, path)
    if not norms:
        raise InputError(f"{path}: no norm found in the IR")
    layers = [_graph_layer(n, eps_mode=n.eps_mode, eps_stored_as=n.eps_stored,
                           warnings=[f["message"] for f in graph_findings(n, None)]) for n in norms]
    return _graph_inspection(path, "openvino", "openvino IR", [path.name, path.with_suffix(".bin").name], norms,
                             layers)


def effective(opts: CheckOptions) -> CheckOptions:
    """The candidate when none is named: an exported .onnx copy runs its own subgraphs in ONNX
    Runtime, an OpenVINO IR (.xml) on OpenVINO's plugin; anything else gets torch's fused kernel."""
    import dataclasses

    from parity_cli.sources.onnx_graph import is_onnx
    from parity_cli.sources.openvino_ir import is_openvino_ir

    if opts.candidate:
        return opts
    onnx_copy = opts.candidate_checkpoint and is_onnx(opts.candidate_checkpoint)
    ir_copy = opts.candidate_checkpoint and is_openvino_ir(opts.candidate_checkpoint)
    return dataclasses.replace(opts, candidate="onnxruntime" if onnx_copy else "openvino" if ir_copy else "torch")


MAX_REPORT_LAYERS = 10_000  # the schema's maxItems for a report's layers


def _runtime_info(opts, layers, device: str, dtype: str, cand_args: dict, warnings: list) -> tuple:
    """A registered runtime (parity_cli.backends.registered): every layer's kind, width and dtype
    checked against what it builds before anything runs (one line, exit 2), and (the report's key,
    what it states of itself); its notes (OpenVINO's precision) join the warnings."""
    from parity_cli.backends import call_with, runtime
    from parity_cli.backends import implementations as impls

    module = runtime(opts.candidate or "")
    if module is None:
        return None, None
    impls.precheck(opts.candidate, cand_args)  # its arguments first, in their words
    check_layer = getattr(module, "check_layer", None)
    for layer in layers if check_layer else ():  # at the dtype the probes will have, with its arguments
        call_with(check_layer, layer, dtype, device=device, **cand_args)
    describe = getattr(module, "describe", None)
    info = call_with(describe, device, **cand_args) if describe else None
    notes = getattr(module, "notes", None)
    warnings.extend(notes(info) if notes and info else [])
    return module.RUNTIME.header, info


def _forward_of(ckpt, layers, copy_layers) -> dict | None:
    """The model's forward order of its norms, asked only of a copy paired by value (its graph's
    order is then what says which layer a gain belongs to)."""
    from parity_cli.model.pairing import BY_VALUE

    if ckpt.format == "gguf" or not any(BY_VALUE in layer.warnings for layer in copy_layers):
        return None
    from parity_cli.model.installed import forward_order

    return forward_order(ckpt.model_type, ckpt.config, [layer.name for layer in layers], str(ckpt.path / "config.json"))


def _unread_not_missing(pairing, conversion: dict, found):
    """A checkpoint layer the copy lacks, where the copy's graph has normalisation nodes the reader
    cannot take as norms (an unknown decomposition, another op's form), may be one of those nodes:
    it is not checked (a verdict counts it), never said missing. None left to check is one line."""
    unread = (conversion.get("onnx") or conversion.get("openvino") or {}).get("unread")
    if not unread:
        return found
    gone = [name for name, items in pairing.layer_findings.items()
            if [item["code"] for item in items] == ["checkpoint_layer_missing"] and not items[0].get("folded")]
    if not gone:
        return found
    ops = ", ".join(f"{count} {op}" for op, count in sorted(unread.items()))
    why = (f"the copy's graph has normalisation nodes parity cannot read as a norm ({ops}): this layer may be "
           "one of them, so it is not checked there")
    if len(gone) == len(found.layers):
        raise InputError(f"{conversion['path']}: no norm of the checkpoint could be read in the copy ({ops} not "
                         "read as norms); nothing to check")
    for name in gone:
        del pairing.layer_findings[name]
    conversion["unchecked"] = [{"name": name, "why": why} for name in gone]
    return dataclasses.replace(found, layers=[layer for layer in found.layers if layer.name not in set(gone)])


def converted(opts: CheckOptions, reference_layers, model=None) -> tuple:
    """--candidate-checkpoint: (its layers under the reference's names, the report's description
    of it, the dtype its norms compute in or None). GGUF and HF copies go through discovery like
    the reference; an .onnx graph through model.onnx_layers."""
    import fnmatch

    from parity_cli.model.layers import discover_layers
    from parity_cli.model.onnx_layers import candidate_layers
    from parity_cli.sources.gguf import MMPROJ
    from parity_cli.sources.huggingface import written_by
    from parity_cli.sources.onnx_graph import is_onnx
    from parity_cli.sources.openvino_ir import is_openvino_ir
    from parity_cli.sources.tflite_graph import is_tflite

    if opts.runtime_capture:  # what a runtime's own graph used and computed (probes.runtime_capture)
        layers, described, dtype = _runtime_copy(opts, reference_layers)
    elif is_onnx(opts.candidate_checkpoint):
        layers, info = candidate_layers(opts.candidate_checkpoint, reference_layers)
        described = {"path": recorded_path(opts.candidate_checkpoint), "format": "onnx",
                     "family": reference_layers[0].family if reference_layers else None, "model_type": None,
                     "eps": info["eps"], "layers": len(layers), "unmatched": [], "onnx": info}
        if info.get("producer"):  # the tool the graph says wrote it: onnxruntime-genai's builder, pytorch, ...
            described["exporter"] = info["producer"]
        dtype = info["dtype"]
    elif is_openvino_ir(opts.candidate_checkpoint):  # model.openvino_layers: the IR's norms and subgraphs
        from parity_cli.model.openvino_layers import candidate_layers as ir_layers

        layers, info = ir_layers(opts.candidate_checkpoint, reference_layers)
        if opts.candidate != "openvino":  # another candidate runs its own kernel with the IR's eps and gains
            layers = [dataclasses.replace(layer, program=None) for layer in layers]
        described = {"path": recorded_path(opts.candidate_checkpoint), "format": "openvino",
                     "family": reference_layers[0].family if reference_layers else None, "model_type": None,
                     "eps": info["eps"], "layers": len(layers), "unmatched": [], "openvino": info}
        if info.get("producer"):  # the IR's rt_info: optimum-intel and its transformers, or OpenVINO's converter
            described["exporter"] = info["producer"]
        dtype = info["dtype"]
    elif is_tflite(opts.candidate_checkpoint):  # model.tflite_layers: the flatbuffer's norm patterns
        from parity_cli.model.tflite_layers import candidate_layers as tflite_layers

        layers, info = tflite_layers(opts.candidate_checkpoint, reference_layers)
        described = {"path": recorded_path(opts.candidate_checkpoint), "format": "tflite",
                     "family": reference_layers[0].family if reference_layers else None, "model_type": None,
                     "eps": info["eps"], "layers": len(layers), "unmatched": [], "tflite": info,
                     "exporter": f"a TFLite converter ({info['producer'] or 'no description'}, schema "
                                 f"{info['schema_version']})"}
        dtype = info["dtype"]
    else:
        ckpt2, fam2, eps2 = load(opts.candidate_checkpoint, model=model, classes=uses_transformers(opts))
        found2 = discover_layers(ckpt2, fam2, eps2)
        layers = found2.layers
        described = {**checkpoint_where(ckpt2), "format": ckpt2.format, "family": fam2.name,
                     "model_type": ckpt2.model_type, "eps": {"value": eps2.value, "source": eps2.source},
                     "layers": len(found2.layers), "unmatched": found2.unmatched}
        if getattr(ckpt2, "architecture", None) == MMPROJ:
            described["mmproj"] = True  # the model's towers only: its language model is another file
        exporter = written_by(ckpt2.files[0]) if ckpt2.format.startswith("safetensors") and ckpt2.files else (
            f"CTranslate2's converter ({ckpt2.spec})" if ckpt2.format == "ctranslate2" else None)
        if exporter:
            described["exporter"] = exporter
        if ckpt2.format in ("gguf", "ctranslate2"):  # named as the runtime's loader read the model
            layers = _as_named(layers, reference_layers, fam2)
        dtype = None
    if opts.layers:  # a --layers run compares those layers, and reports no others as extra
        layers = [l for l in layers if fnmatch.fnmatchcase(l.name, opts.layers)]
    return layers, described, dtype


RUNTIME_CAPTURE = "runtime-capture"
_NODE_KEYS = ("node", "op", "chain", "gain_tensor", "bias_tensor", "rows_seen", "rows", "dtype", "recorded_as",
              "paired_by", "sum_output", "rows_in")


def _runtime_copy(opts: CheckOptions, reference_layers) -> tuple:
    """--runtime-capture as converted() gives a copy: (the capture's norms under the reference's
    names, the report's description of the capture and its runtime, the dtype the runtime computed
    in: where its nodes computed in several, float32, and the report says so)."""
    from collections import Counter

    from parity_cli.probes import runtime_capture

    layers, meta = runtime_capture.load(opts.runtime_capture, reference_layers)
    eps_values = Counter(layer.eps.value for layer in layers).most_common()
    computes = sorted({meta["nodes"][layer.name]["dtype"] for layer in layers}) or ["float32"]
    runtime = {"name": meta.get("runtime"), "version": meta.get("version"), "model": meta.get("model"),
               "tokens": meta.get("tokens"), "computes_in": meta.get("computes_in"), "backend": meta.get("backend"),
               "precision": meta.get("precision"), "unmapped": meta.get("unmapped", []), "nonfinite_only": meta.get("nonfinite_only", []),
               "nodes": {layer.name: {k: meta["nodes"][layer.name].get(k) for k in _NODE_KEYS} for layer in layers}}
    if len(computes) > 1:
        runtime["mixed_dtypes"] = (f"the runtime's nodes computed in {', '.join(computes)}: all are checked at "
                                   "float32's tolerance, so a half-precision node may fail by its own rounding")
    described = {"path": recorded_path(opts.runtime_capture), "format": RUNTIME_CAPTURE,
                 "family": reference_layers[0].family if reference_layers else None, "model_type": None,
                 "eps": {"value": eps_values[0][0] if eps_values else 0.0,
                         "source": f"{meta.get('runtime')}'s own nodes" + (
                             "" if len(eps_values) == 1 else f" ({len(eps_values)} values: per layer)")},
                 "layers": len(layers), "unmatched": [], "runtime": runtime}
    return layers, described, computes[0] if len(computes) == 1 else "float32"


def runtime_capture_options(opts: CheckOptions) -> CheckOptions:
    """--runtime-capture: the capture is the candidate (its rows replayed, its eps and gains the
    copy's), so every option that would choose another candidate, other probes or another dtype is
    refused in one line; it runs here, on one worker."""
    if not opts.runtime_capture:
        return opts
    given = [flag for flag, value in (("--candidate", opts.candidate), ("--candidate-checkpoint",
                                      opts.candidate_checkpoint), ("--candidate-eps", opts.candidate_eps),
                                      ("--candidate-arg", opts.candidate_args), ("--activations", opts.activations),
                                      ("--strata", opts.strata), ("--dtype", opts.dtype), ("--grad", opts.grad),
                                      ("--exact", opts.exact)) if value]
    if given:
        raise InputError(f"--runtime-capture: the capture is the candidate (the runtime's own rows, eps and gains, at "
                         f"the dtype it computed in); {', '.join(given)} cannot be used with it")
    return dataclasses.replace(opts, candidate=RUNTIME_CAPTURE, candidate_checkpoint=opts.runtime_capture,
                               isolation="none", jobs=1)


def _recorded_rows(opts, pairing, conversion: dict, found):
    """The capture's rows as each paired layer's probes; a checkpoint layer no node of the runtime
    ran is not checked (the runtime may never run it: a tower it does not load), never missing."""
    import torch

    captured = {name: layer.recorded[0].to(torch.float64) for name, layer in pairing.candidate_layers.items()}
    gone = [name for name, items in pairing.layer_findings.items()
            if [item["code"] for item in items] == ["checkpoint_layer_missing"]]
    if len(gone) == len(found.layers):
        raise InputError(f"{conversion['path']}: no node of the runtime is a norm layer of this checkpoint; nothing "
                         "to check (a capture of another model?)")
    for name in gone:
        del pairing.layer_findings[name]
    blind = set(conversion["runtime"].get("nonfinite_only") or [])
    conversion["unchecked"] = [{"name": name, "why": f"every input row {conversion['runtime']['name']} gave this norm "
                                                     "was NaN or inf" if name in blind else
                                f"no norm node of {conversion['runtime']['name']} ran with this layer's gain in the "
                                "capture"} for name in gone]
    found = dataclasses.replace(found, layers=[layer for layer in found.layers if layer.name not in set(gone)])
    return dataclasses.replace(opts, captured=captured), found


def _as_named(layers, reference_layers, family):
    """A GGUF copy's layers under the reference's names where only the layout differs: gguf-py
    maps back to the published names (vision_tower.vision_model.encoder.layers.0.layer_norm1), a
    checkpoint saved by transformers 5.x has others (vision_tower.encoder.layers.0.layer_norm1).
    Two names are one layer when the same norm pattern claims both, with the same indices."""
    from parity_cli.model.families import layout_lookup

    names = {layer.name for layer in reference_layers}
    find = layout_lookup(names, family)
    taken = {layer.name for layer in layers}  # a name the copy has already is never given twice
    out = []
    for layer in layers:
        same = find(layer.name) if layer.name not in names else None
        if same is not None and same not in taken:
            taken.add(same)
            layer = dataclasses.replace(layer, name=same)
        out.append(layer)
    return out


# what `parity capture` writes in a capture's metadata, and so what a report repeats of it
CAPTURE_KEYS = ("fingerprint", "checkpoint", "model_class", "tokens", "rows_per_layer", "sampling", "seed", "device",
                "not_seen", "rows", "match", "norms_match")


def with_captured(opts: CheckOptions, layers, everything, family=None):
    """(opts with the --activations rows of `layers`, the capture's metadata), or (opts, None)
    without --activations; `everything()` gives the whole model's layers (the fingerprint's).
    check() and the explain ladder both probe with the same rows."""
    if not opts.activations or opts.captured is not None:
        return opts, None
    import dataclasses

    from parity_cli.probes import capture

    rows, meta = capture.load(opts.activations, layers, everything(), family)
    return dataclasses.replace(opts, captured=rows), meta


def _paired_copy(opts: CheckOptions, found, ckpt, fam, whole: list) -> tuple:
    """--candidate-checkpoint (or --runtime-capture): (opts, the reference's layers to check, the
    pairing, the report's description of the copy, the dtype the copy computes in or None). A copy
    of another model is bad input; layers the copy cannot be said to lack are not checked. The
    copy's norms are named against the whole model (`whole`), --layers or not: matched against the
    one layer a glob picks, every LayerNorm of a BERT graph took its name (`#2..#13`)."""
    from parity_cli.model.pairing import pair

    copy_layers, conversion, copy_dtype = converted(opts, whole, (fam, ckpt.model_type))
    if conversion.get("mmproj"):  # compared with the towers it holds, not the language model
        held = {layer.name for layer in copy_layers}
        found = dataclasses.replace(found, layers=[layer for layer in found.layers
                                                   if layer.tower not in ("language", "main") or layer.name in held])
    if conversion["format"] == "onnx" and opts.candidate == "onnxruntime":
        # the graph's own subgraphs run: its eps, its form, its dtype; nothing here would change them
        for flag, given in (("--candidate-eps", opts.candidate_eps is not None),
                            ("--candidate-arg", bool(candidate_args(opts)))):
            if given:
                raise InputError(f"{flag}: an exported .onnx copy runs its own subgraphs, with the eps and form "
                                 "it has; edit the graph, or check another candidate against its weights")
    if conversion["format"] == "openvino" and opts.candidate == "openvino":
        # the IR's own subgraphs run with their eps and form; only the plugin's precision is the run's
        ignored = sorted(set(candidate_args(opts)) - {"precision"})
        for flag, given in (("--candidate-eps", opts.candidate_eps is not None),
                            (f"--candidate-arg {', '.join(ignored)}", bool(ignored))):
            if given:
                raise InputError(f"{flag}: an OpenVINO IR runs its own subgraphs, with the eps and form it has "
                                 "(--candidate-arg precision= still sets the plugin's precision); edit the IR, "
                                 "or check another candidate against its weights")
    pairing = pair(found.layers, copy_layers, conversion["path"], _forward_of(ckpt, found.layers, copy_layers))
    other = next((f for f in pairing.report_findings if f["code"] == "checkpoint_model_mismatch"), None)
    if other is not None:  # a copy of another model is bad input, not a verdict on a conversion
        raise InputError(other["message"] + ("; refused (--runtime-capture takes a capture of this model)"
                                              if opts.runtime_capture else
                                              "; refused (--candidate-checkpoint takes a copy of this model)"))
    folded = conversion.get("onnx", {}).get("batch_norm_folded")
    if folded:  # each BatchNorm the exporter folded into its Conv says so where it is missing
        kinds = {l.name: l.kind for l in found.layers}
        for name, items in pairing.layer_findings.items():
            for item in items:
                if item["code"] == "checkpoint_layer_missing" and kinds.get(name) == "batch_norm":
                    item["message"] += f" ({folded['message']})"
                    item["folded"] = True
    found = _unread_not_missing(pairing, conversion, found)
    if conversion["format"] == RUNTIME_CAPTURE:
        opts, found = _recorded_rows(opts, pairing, conversion, found)
    conversion["findings"] = sum(len(v) for v in pairing.layer_findings.values()) + len(pairing.report_findings)
    return opts, found, pairing, conversion, copy_dtype


def _open_candidate(opts, cand_args: dict, device: str, timeout, memory, workers: int, sharded: bool, conversion,
                    progress) -> tuple:
    """(the candidate's implementation, its runners): none here where whole layers go to worker
    processes; a runtime capture's rows replayed in this process; else the runners isolation asks."""
    from parity_cli.backends import implementations as impls
    from parity_cli.isolation import supervisor

    if sharded:  # whole layers in worker processes: our own code end to end (parity_cli.check.parallel)
        return impls.resolve(opts.candidate, cand_args), []
    if opts.runtime_capture:  # the rows the runtime's own nodes gave, replayed here
        from parity_cli.backends import recorded
        from parity_cli.isolation.runners import InProcessRunner

        runtime = conversion["runtime"]["name"]  # the description names it in each cause
        impl = impls.Implementation(recorded.NAME, f"recorded inside {runtime}", recorded.prepare, runtime)
        return impl, [InProcessRunner(impl)]
    if supervisor.supervised(opts.candidate, opts.device, opts.isolation):
        _say(progress, f"starting the candidate's worker process{'es' if workers > 1 else ''}")
    return supervisor.open_runners(opts.candidate, cand_args, device, opts.isolation, timeout, memory, workers,
                                   threads=opts.threads)


def _checkpoint_header(opts, ckpt, found, fam, conversion, whole=None) -> dict:
    """`whole`: every norm layer of the model (the fingerprint's, whatever --layers picked: a baseline
    of the whole model gates a run of some of its layers)."""
    return {
        **checkpoint_where(ckpt),
        "fingerprint": fingerprint(whole if whole is not None else found.layers),
        "format": ckpt.format,
        "family": fam.name,
        "family_source": fam.source_line,
        "family_forced": bool(opts.family),
        "family_from": family_choice(opts.family, fam, ckpt.model_type, ckpt.format,
                                         getattr(ckpt, "architecture", None)),
        "model_type": ckpt.model_type,
        "files": [f.name for f in ckpt.files],
        "unmatched": found.unmatched,
        "unchecked": unchecked(ckpt, found, fam) + list((conversion or {}).get("unchecked", [])),
    }


def basis(ckpt, fam, eps, family: str | None, forced: str | None) -> dict:
    """What a verdict's semantics rest on, as every command's report holds it (report.gate's tails read
    it): the family and how it was chosen, a contradiction --family-force accepted, what the installed
    transformers computes otherwise, the eps and where it came from."""
    return {"checkpoint": {"family": fam.name, "model_type": ckpt.model_type, "family_forced": bool(family),
                           **({"family_contradiction": forced} if forced else {}),
                           **({"family_moved": {"transformers": installed_version(), "what": list(fam.moved)}}
                              if fam.moved else {})},
            "eps": _eps_dict(eps)}


def _tolerance_header(opts, tol, grad_tol) -> dict:
    from parity_cli.comparison import ZERO_REFERENCE_RULE

    return {"atol": tol.atol, "rtol": tol.rtol, "source": tol.source, "mean_rounding": tol.mean_rounding,
            "max_violation_fraction": opts.max_violation_fraction, "zero_reference": ZERO_REFERENCE_RULE,
            "nonfinite": "a non-finite candidate value where the reference is finite is always a violation",
            "exact": opts.exact,
            "grad": None if grad_tol is None else {"rtol": grad_tol.rtol, "row_atol": grad_tol.row_atol,
                                                   "source": grad_tol.source}}


def _probes_header(opts, strata, captured_meta, cand_dtype_name: str) -> dict:
    from parity_cli.probes.strata import load_strata

    return {
        "seed": opts.seed,
        "strata": [s.name for s in strata] + (["captured"] if captured_meta or opts.runtime_capture else []),
        "not_covered": [n for n in load_strata() if n not in {s.name for s in strata}],
        "descriptions": {s.name: s.description for s in strata},
        "rounding": f"probes are rounded to {cand_dtype_name}; the reference sees the rounded values",
        "grad": opts.grad,
        "layers": opts.layers,
        "activations": None if captured_meta is None else {
            **{k: captured_meta[k] for k in CAPTURE_KEYS if k in captured_meta},  # only what we wrote
            "path": recorded_path(opts.activations), "layers": sorted(opts.captured)},
    }


def check(path: str | Path, options: CheckOptions | None = None, progress=None, torch_baseline=None, **kwargs):
    """Runs the whole check and returns a Report; raises InputError for bad input.

    `progress(done, total, layer_name)` is called before each layer (the CLI's progress bar);
    `torch_baseline`: the same check's Report with torch as the candidate, where the caller has
    it (`parity runtimes`), for a runtime candidate's severity (computed here otherwise)."""
    opts = effective(runtime_capture_options(options or CheckOptions(**kwargs)))
    from parity_cli.isolation import supervisor

    if supervisor.supervised(opts.candidate, opts.device, opts.isolation) or (
            parallel.resolve_jobs(opts.jobs) > 1 and not opts.candidate_checkpoint):
        supervisor.warm()  # the fork server imports torch while this process does
    with supervisor.deferred_interrupt():
        import torch

    from parity_cli.backends import implementations as impls
    from parity_cli.check.layer import Side, run_layers, setup_failure
    from parity_cli.check.results import Report
    from parity_cli.comparison import (
        grad_tolerance_for,
        tolerance_for,
    )
    from parity_cli.isolation.supervisor import close_runners, open_reference, parse_memory, printed_note
    from parity_cli.model.layers import discover_layers
    from parity_cli.probes.strata import select_strata

    _check_numbers(opts)
    strata = [] if opts.runtime_capture else select_strata(opts.strata)  # a capture's rows are its probes
    device = check_device(opts.device)
    ref_device = reference_device(opts.reference_device, device, is_oracle(opts))
    if opts.reference_dtype is not None:  # a wrong name is refused before the checkpoint is read
        dtype_name(opts.reference_dtype)
    cand_args = candidate_args(opts)
    memory = parse_memory(opts.candidate_memory)
    # a plugin reference is loaded in its own supervised process (below), never here
    ref_plugin = supervisor.reference_supervised(opts.reference, opts.isolation)
    ref_impl = impls.precheck(opts.reference) if ref_plugin else impls.resolve(opts.reference)

    _say(progress, f"reading {path}")
    ckpt, fam, eps = load(path, opts.family, opts.eps, classes=uses_transformers(opts))
    forced = _forced_family(opts, ckpt, fam, eps)
    found = discover_layers(ckpt, fam, eps, opts.layers)
    _say(progress, f"{len(found.layers)} norm layers read; preparing the candidate")
    if not found.layers:
        raise no_layer(ckpt, found)
    if len(found.layers) > MAX_REPORT_LAYERS:  # what a saved report may hold, so that reading one is bounded
        raise InputError(f"{ckpt.path}: {len(found.layers):,} norm layers, over the {MAX_REPORT_LAYERS:,} one report "
                         "holds (a 405B model has 253); check them in parts with --layers")
    # the fingerprint covers the whole model, whatever --layers picked
    whole = discover_layers(ckpt, fam, eps).layers if opts.layers else found.layers
    opts, captured_meta = with_captured(opts, found.layers, lambda: whole, fam)
    pairing, conversion, copy_dtype = None, None, None
    if opts.candidate_checkpoint:
        opts, found, pairing, conversion, copy_dtype = _paired_copy(opts, found, ckpt, fam, whole)
    # an exported graph computes in its own input type (float32 for most exports): probe it there
    cand_dtype_name = dtype_name(opts.dtype) if opts.dtype else (copy_dtype or stored_dtype(found.layers))
    tol = tolerance_for(cand_dtype_name, opts.atol, opts.rtol, exact=opts.exact)
    grad_tol = grad_tolerance_for(cand_dtype_name, exact=opts.exact) if opts.grad else None
    # float64, or the candidate's dtype under --exact against an implementation; --jobs workers get it resolved
    ref_dtype_name, ref_dtype_source = reference_dtype_for(opts, cand_dtype_name)
    opts = dataclasses.replace(opts, reference_dtype=ref_dtype_name)

    warnings = _read_warnings(ckpt, fam, eps, found) + ([forced] if forced else [])

    runtime_key, runtime_info = _runtime_info(opts, found.layers, device, cand_dtype_name, cand_args, warnings)
    workers = max(1, min(resolve_jobs(opts.jobs), len(found.layers)))
    timeout = supervisor.timeout_of(opts)
    if opts.candidate_memory is None and memory is not None:
        memory //= workers * (2 if ref_plugin else 1)  # the default is half of RAM for all the children together
    sharded = workers > 1 and parallel.shardable(opts, device)
    cand_impl, runners = _open_candidate(opts, cand_args, device, timeout, memory, workers, sharded, conversion,
                                         progress)
    ref_runner = None
    if ref_plugin:  # supervised exactly as the candidate: its exit, hang or memory is the user's input
        try:
            ref_impl, ref_runner = open_reference(opts.reference, ref_device, timeout, memory, max(1, len(runners)),
                                                  opts.threads)
        except BaseException:
            close_runners(runners)
            raise
    reference = Side(ref_impl, opts.reference, getattr(torch, ref_dtype_name), ref_device, runner=ref_runner)
    isolated = any(getattr(r, "isolated", False) for r in runners)
    threads = torch.get_num_threads()
    try:
        # One intra-op thread per process unless asked: on tensors of 8K-82K elements a second
        # thread gains 1.03-1.19x idle, and on a loaded CI box the pool spins against the load
        # (213 s against 14.7 s measured, BENCHMARKS.md). Parallelism comes from --jobs.
        torch.set_num_threads(opts.threads)
        if sharded:
            _say(progress, f"starting {workers} worker processes")
            plan = parallel.Plan(ckpt.remote.pinned if ckpt.remote else str(path), opts, cand_dtype_name, tol, grad_tol,
                                 tuple(strata), timeout, fam, ckpt.remote.environment() if ckpt.remote else ())
            results = parallel.check_shards(plan, [layer.name for layer in found.layers], workers, progress)
        else:
            candidates = [Side(cand_impl, opts.candidate, getattr(torch, cand_dtype_name), device, opts.candidate_eps,
                               r) for r in runners]
            results = run_layers(found.layers, pairing, reference, candidates, strata, tol, opts, grad_tol, progress)
        note = printed_note(runners)
        if opts.runtime_capture:  # which node of the runtime's graph each layer's rows came from
            for result in results:
                result.runtime_node = conversion["runtime"]["nodes"].get(result.name)
    finally:
        torch.set_num_threads(threads)
        close_runners(runners + ([ref_runner] if ref_runner else []))
    setup = setup_failure(results, opts.candidate)
    if setup:  # the same InputError from every layer's build, no output anywhere: exit 2, not a verdict
        raise InputError(setup)
    if note:
        warnings.append(note)
    if conversion and (conversion.get("runtime") or {}).get("mixed_dtypes"):
        warnings.append(conversion["runtime"]["mixed_dtypes"])

    header = {
        "tool": {"name": "parity-cli", "version": __version__},
        "environment": environment(device, threads=opts.threads, jobs=workers),
        "checkpoint": {**_checkpoint_header(opts, ckpt, found, fam, conversion, whole),
                       **basis(ckpt, fam, eps, opts.family, forced)["checkpoint"]},
        "eps": _eps_dict(eps),
        "reference": {"impl": ref_impl.name, "source": ref_impl.source, "dtype": ref_dtype_name,
                      "dtype_source": ref_dtype_source,
                      "device": ref_device, "eps": eps.value},
        "candidate": {"impl": recorded_spec(cand_impl.name), "source": cand_impl.source, "dtype": cand_dtype_name,
                      "device": device, "args": cand_args, **_candidate_eps(opts, conversion, eps),
                      "checkpoint": conversion,
                      "timeout": timeout, "isolation": opts.isolation, "isolated": isolated,
                      "memory_cap": memory if isolated else None, "workers": workers,
                      "threads": opts.threads, **({runtime_key: runtime_info} if runtime_info else {})},
        "tolerance": _tolerance_header(opts, tol, grad_tol),
        "probes": _probes_header(opts, strata, captured_meta, cand_dtype_name),
    }
    report = Report(header=header, layers=results, warnings=warnings,
                    findings=pairing.report_findings if pairing else [])
    if severity_wanted(opts):  # a runtime's red is read against torch, and a suspect one against its own path
        with_severity(report, torch_baseline or _torch_twin(path, opts, cand_dtype_name), cand_dtype_name)
        disagreement = self_check(path, opts, report)
        if disagreement:
            raise AdapterError(disagreement)
    return report


def _forced_family(opts: CheckOptions, ckpt, fam, eps) -> str | None:
    """A --family the checkpoint's own model type contradicts is refused in one line unless
    --family-force confirms it; confirmed, the contradiction is a warning the report keeps."""
    if not opts.family:
        return None
    from parity_cli.model.load import forced_contradiction

    said = forced_contradiction(ckpt, fam, eps, opts.family)
    if said and not opts.family_force:
        raise InputError(f"{said}: both sides would compute {fam.name}'s norm, so a PASS would say nothing about "
                         "this model; --family-force checks it so anyway")
    return None if not said else f"{said} (forced: --family-force)"


def no_layer(ckpt, found) -> InputError:
    """A checkpoint with no layer to check, in one line every command gives: why, for the first
    norm, and how many more."""
    why = found.warnings
    more = f"; +{len(why) - 1} more" if len(why) > 1 else ""
    return InputError(f"{ckpt.path}: no checkable norm layer ({why[0] if why else 'none matched'}{more})")


def _check_numbers(opts: CheckOptions) -> None:
    """The numeric options, each refused in one line before anything is read."""
    if not 0.0 <= opts.max_violation_fraction <= 1.0:
        raise InputError("--max-violation-fraction must be between 0 and 1")
    for flag, value in (("--eps", opts.eps), ("--candidate-eps", opts.candidate_eps),
                        ("--atol", opts.atol), ("--rtol", opts.rtol)):
        if value is not None and not (value >= 0 and value != float("inf")):
            raise InputError(f"{flag} must be a finite number >= 0, got {value}")
    if opts.timeout is not None and not opts.timeout > 0:
        raise InputError(f"--timeout must be > 0 seconds (inf: no limit), got {opts.timeout}")
    if not (isinstance(opts.threads, int) and opts.threads >= 1):
        raise InputError(f"--threads must be a whole number >= 1, got {opts.threads}")


def _read_warnings(ckpt, fam, eps, found) -> list:
    """What reading the checkpoint found worth saying: a defaulted eps, tensors no pattern claims."""
    warnings = list(found.warnings)
    if eps.source == "family-default":
        warnings.append(f"eps is not in {_config_name(ckpt)} (looked for {_eps_keys(ckpt, fam)}); "
                        f"using the family default {_g(eps.value)}")
    if found.unmatched:
        warnings.append(f"{len(found.unmatched)} norm-like tensor(s) match no pattern of family "
                        f"'{fam.name}' and were not checked: {', '.join(found.unmatched[:10])}")
    return warnings


def _candidate_eps(opts: CheckOptions, conversion, eps) -> dict:
    """The candidate's eps and where it came from: the option, the converted copy, or the checkpoint."""
    if opts.candidate_eps is not None:
        return {"eps": opts.candidate_eps, "eps_source": "option:--candidate-eps"}
    if conversion:
        return {"eps": conversion["eps"]["value"], "eps_source": conversion["eps"]["source"]}
    return {"eps": eps.value, "eps_source": eps.source}


SUSPECT_TIMES_ALLOWED = 1e3  # a failure this far past its allowance is checked against the runtime's own path


def suspect(report):
    """The first failing layer a red cell must not be trusted on without a second look: one that
    raised, went non-finite, missed by more than 1e3x its allowance, or that no cause explains."""
    from parity_cli.check.severity import layer_error

    for layer in report.layers:
        if layer.passed:
            continue
        worst = max((abs(s.worst.candidate - s.worst.reference) / s.worst.allowed for s in layer.strata
                     if s.worst is not None and s.worst.allowed), default=0.0)
        errored = layer.error is not None or any(s.status == "error" for s in layer.strata)
        if (errored or layer_error(layer)[1] or not worst < SUSPECT_TIMES_ALLOWED
                or any(d.code == "unexplained" for d in layer.diagnoses)):
            return layer
    return None


def _layer_words(layer) -> str:
    from parity_cli.check.severity import layer_error

    error = layer.error or next((f"{s.name}: {s.error}" for s in layer.strata if s.error), None)
    if error is not None:
        return f"an error ({error[:120]})"
    codes = [d.code for d in layer.diagnoses]
    nonfinite = ", non-finite" if layer_error(layer)[1] else ""
    return layer.status + (f" ({', '.join(codes)}{nonfinite})" if codes else nonfinite)


def self_check(path, opts: CheckOptions, report) -> str | None:
    """A suspect failure of a runtime candidate rerun through the runtime's own public path
    (NAME@public: what a deployment runs, built apart from parity's adapter) on that one layer and
    the same probes. None where the two agree (the failure is the runtime's) or there is nothing to
    rerun; else the line that says parity's adapter is wrong."""
    from parity_cli.backends import runtime
    from parity_cli.backends.implementations import BUILTIN_ARGS, BUILTINS, PUBLIC

    module = runtime(opts.candidate or "")
    public = f"{opts.candidate}{PUBLIC}"
    args = candidate_args(opts)
    if module is None or public not in BUILTINS:
        return None
    # a deviation the user asked the adapter to simulate (OpenVINO's eps_mode=outside_sqrt) fails as asked:
    # the public path has no such knob, and no twin to compare with
    if any(args.get(k, choices[0]) != choices[0] for k, choices in module.RUNTIME.args.items()
           if k in module.RUNTIME.deviations):
        return None
    layer = suspect(report)
    if layer is None:
        return None
    shared = {k: v for k, v in args.items() if k in BUILTIN_ARGS.get(public, {})}  # OpenVINO's precision
    exact = "".join(f"[{c}]" if c in "*?[]" else c for c in layer.name)  # --layers is a glob: this name alone
    try:
        twin = check(path, dataclasses.replace(opts, candidate=public, candidate_args=shared or None, layers=exact,
                                               jobs=1))
    except InputError:  # the public path cannot build this layer: no second opinion to give
        return None
    theirs = next((t for t in twin.layers if t.name == layer.name), None)
    if theirs is None or _agree(layer, theirs):
        return None
    return (f"parity's {opts.candidate} adapter disagrees with {module.RUNTIME.public} on {layer.name}: the adapter "
            f"gives {_layer_words(layer)}, the runtime's own path {_layer_words(theirs)}; the fault is parity's, not "
            f"{opts.candidate}'s")


def _agree(ours, theirs) -> bool:
    from parity_cli.check.severity import layer_error

    def said(layer):
        errored = layer.error is not None or any(s.status == "error" for s in layer.strata)
        return (layer.status, errored, layer_error(layer)[1], sorted(d.code for d in layer.diagnoses))

    return said(ours) == said(theirs)


def _torch_twin(path, opts: CheckOptions, dtype: str):
    """The same check with torch eager as the candidate, or None where torch cannot run it."""
    try:
        return check(path, torch_options(opts, dtype))
    except InputError:
        return None


def severity_wanted(opts: CheckOptions) -> bool:
    """A runtime (a registered one, or the family's transformers class) on the checkpoint's own norms
    and the stratified probes: a converted copy or a capture has no torch twin on the same rows."""
    from parity_cli.backends import runtime

    return ((opts.candidate == "transformers" or runtime(opts.candidate or "") is not None)
            and not opts.candidate_checkpoint and not opts.runtime_capture and not opts.activations)


def torch_options(opts: CheckOptions, dtype: str) -> CheckOptions:
    """The same check with torch eager as the candidate: the same layers, probes, eps and tolerance."""
    return dataclasses.replace(opts, candidate="torch", candidate_args=None, dtype=dtype, jobs=1, grad=False,
                               isolation="none", candidate_memory=None)


def with_severity(report, baseline, dtype: str) -> None:
    """Each layer's worst error over torch's at the same dtype (every layer: a passing one's ratio
    is what a reviewer compares a failing one's with), and the run's, in the candidate's header."""
    from parity_cli.check import severity

    if baseline is None:
        report.header["candidate"]["vs_torch_same_dtype"] = None
        return
    found = severity.per_layer(report.layers, baseline.layers)
    for layer in report.layers:
        if layer.name in found:
            layer.vs_torch = found[layer.name].as_dict(dtype)
    whole = severity.overall(found)
    report.header["candidate"]["vs_torch_same_dtype"] = None if whole is None else whole.as_dict(dtype)


def _say(progress, text: str) -> None:
    """A status line for the CLI's display while nothing is counted yet (torch, the files, the
    worker's start); a plain progress callable has none."""
    status = getattr(progress, "status", None)
    if status is not None:
        status(text)


@dataclasses.dataclass
class FusedReport:
    """`parity check --fused add`: each RMSNorm/LayerNorm layer as a fused residual add + norm, both
    outputs (normed, new residual) against the oracle of the sum (check.fused)."""

    checkpoint: str
    candidate: dict
    layers: list
    form: str = "add"  # add | quant
    unchecked: list = dataclasses.field(default_factory=list)  # the checkpoint's norms no layer here checks
    basis: dict = dataclasses.field(default_factory=dict)  # what the semantics rest on (basis())

    @property
    def passed(self) -> bool:
        return all(layer.passed for layer in self.layers)

    @property
    def exit_code(self) -> int:
        from parity_cli.report.gate import fused_verdict

        return fused_verdict(self.to_dict()).exit_code

    def to_dict(self) -> dict:
        failed = [layer.name for layer in self.layers if not layer.passed]
        return {"tool": "parity-cli", "version": __version__, "fused": self.form, "checkpoint": self.checkpoint,
                "unchecked": list(self.unchecked), "basis": self.basis, "candidate": self.candidate,
                "verdict": "pass" if self.passed else "fail",
                "summary": {"layers": len(self.layers), "failed": len(failed), "unchecked": len(self.unchecked)},
                "layers": [layer.as_dict() for layer in self.layers]}


def check_fused(path: str | Path, candidate: str = "torch", dtype: str | None = None, layers: str | None = None,
                candidate_args: dict | None = None, isolation: str = "auto", device: str = "cpu", seed: int = 0,
                timeout: float | None = None, eps: float | None = None, candidate_eps: float | None = None,
                family: str | None = None, quant: str | None = None,
                candidate_checkpoint: str | None = None, family_force: bool = False) -> FusedReport:
    """The fused form of every RMSNorm and LayerNorm layer, run supervised like every candidate: a
    probe row is [x | residual] and the candidate's rows [normed | new residual]; with `quant`
    (static | dynamic) the norm + int8 quantize instead, rows x -> [q | scale]."""
    import torch

    from parity_cli.backends import fused as fused_backends
    from parity_cli.backends.implementations import BUILTINS
    from parity_cli.check.results import weight_faults
    from parity_cli.comparison import tolerance_for
    from parity_cli.isolation.supervisor import DEFAULT_TIMEOUT, close_runners, open_runners
    from parity_cli.model.layers import discover_layers

    if candidate_checkpoint and quant:
        raise InputError(f"--candidate-checkpoint {candidate_checkpoint}: the fused check runs an exported graph's "
                         "Skip*LayerNormalization nodes (a residual add + norm), without --quant")
    if candidate_checkpoint and candidate == "torch":  # as check: an .onnx copy runs in ONNX Runtime
        candidate = "onnxruntime"
    if quant not in (None, "static", "dynamic"):
        raise InputError(f"--quant {quant}: static (a calibrated scale given to the kernel) or dynamic (per token)")
    if quant and candidate in BUILTINS and candidate != "vllm":
        raise InputError(f"--candidate {candidate}: no norm + int8 quantize here; built-in: vllm (RMSNorm), or a "
                         "plugin fn(x, weight, eps, scale=None) -> (q, scale)")
    if candidate in BUILTINS and candidate not in (*fused_backends.BUILTINS, "hf", "oracle"):
        raise InputError(f"--candidate {candidate}: no fused add + norm here; built-ins: "
                         f"{', '.join(fused_backends.BUILTINS)}, or a plugin fn(x, residual, weight, eps)")
    name = dtype_name(dtype or "bfloat16")
    device = check_device(device)
    ckpt, fam, resolved = load(path, family, eps)
    forced = _forced_family(CheckOptions(family=family, family_force=family_force), ckpt, fam, resolved)  # as check
    discovery = discover_layers(ckpt, fam, resolved, layers)
    if not discovery.layers:  # as check says it
        raise no_layer(ckpt, discovery)
    found = [layer for layer in discovery.layers if layer.kind in ("rms_norm", "layer_norm") and layer.weight.dim() == 1]
    hidden = max((layer.dim for layer in found), default=0)
    found = [layer for layer in found if layer.dim == hidden]  # a q/k norm of a head's width never meets the residual
    copies = {}
    if candidate_checkpoint:  # an exported graph's own Skip*LayerNormalization nodes, run as they are
        copies, graph_dtype = _skip_nodes(candidate_checkpoint, found, candidate, quant)
        found = [layer for layer in found if layer.name in copies]
        name = dtype_name(dtype or graph_dtype)  # probed in the graph's own input type, as check does
    torch_dtype = getattr(torch, name)
    if not found:
        raise InputError(f"{ckpt.path}: no RMSNorm or LayerNorm layer to check as a fused add + norm"
                         + (f" (--layers {layers})" if layers else ""))
    tol = tolerance_for(name)
    impl, runners = open_runners(candidate, dict(candidate_args or {}), device, isolation,
                                 DEFAULT_TIMEOUT if timeout is None else timeout)
    out = []
    try:
        for layer in found:
            if quant:
                out.append(_quant_layer(layer, runners[0], torch_dtype, tol, device, seed, quant, candidate_eps))
                continue
            out.append(_add_layer(layer, copies.get(layer.name, layer), runners[0], torch_dtype, tol, device, seed,
                                  candidate_eps))
    finally:
        close_runners(runners)
    for layer, result in zip(found, out):  # a stored gain's own faults fail the layer, as in check
        result.findings = weight_faults(layer, int((~torch.isfinite(layer.weight)).sum()))
    cand = {"impl": impl.name, "source": impl.source, "dtype": name, "device": device,
            "eps": None if candidate_eps is None else candidate_eps, "args": dict(candidate_args or {})}
    return FusedReport(str(path), cand, out, "quant" if quant else "add", unchecked(ckpt, discovery, fam),
                       basis(ckpt, fam, resolved, family, forced))


def _skip_nodes(path: str, layers, candidate: str, quant) -> dict:
    """Reference layer name -> the copy's layer holding its Skip op (fused_program), for an .onnx copy."""
    from parity_cli.model.onnx_layers import candidate_layers
    from parity_cli.sources.onnx_graph import is_onnx

    if not is_onnx(path) or quant or candidate != "onnxruntime":
        raise InputError(f"--candidate-checkpoint {path}: the fused check runs an exported .onnx graph's own "
                         "Skip*LayerNormalization nodes, with --candidate onnxruntime and without --quant")
    copy_layers, info = candidate_layers(path, layers)
    found = {layer.name: layer for layer in copy_layers if layer.fused_program}
    if not found:
        raise InputError(f"{path}: no SkipSimplifiedLayerNormalization or SkipLayerNormalization node (with its gain "
                         "stored) to check as a fused add + norm; ONNX Runtime's transformer optimizer emits them")
    return found, info.get("dtype") or "float32"


def _outputs(runner, job, dim: int) -> list:
    """The job's outputs split at `dim` ([normed | residual], [q | scale]), or each one's error words; a
    candidate that says it cannot take the layer at all is one line."""
    runner.submit(job)
    run = runner.collect()
    if run.setup and run.error:
        raise InputError(run.error.partition("InputError: ")[2] or run.error)
    outs = []
    for k in range(len(job.inputs)):
        o = run.output(k)
        outs.append(o.error if o.error else (o.value[..., :dim], o.value[..., dim:]))
    return outs


def _add_layer(layer, copy, runner, dtype, tol, device: str, seed: int, candidate_eps):
    """One layer's fused add + norm through the runner: rows [x | residual] -> [normed | new residual]
    (`copy`: the exported graph's layer holding its Skip node, else the layer itself)."""
    import torch

    from parity_cli.check.fused import check_add_norm
    from parity_cli.isolation.runners import CandidateJob

    fused = dataclasses.replace(copy, fused="add")
    job = dict(layer=fused, weight=layer.weight.to(dtype, copy=True), device=device,
               bias=None if layer.bias is None else layer.bias.to(dtype, copy=True),
               eps=layer.eps.value if candidate_eps is None else candidate_eps)

    def run_all(inputs):
        return _outputs(runner, CandidateJob(**job, inputs=[torch.cat([x, r], -1) for x, r in inputs]), layer.dim)

    return check_add_norm(layer, run_all, dtype, tol, seed)


def _quant_layer(layer, runner, dtype, tol, device: str, seed: int, mode: str, candidate_eps):
    """One layer's norm + int8 quantize through the runner: rows x -> [q | scale]."""

    from parity_cli.check.fused import check_norm_quant, static_scale
    from parity_cli.isolation.runners import CandidateJob

    scale = static_scale(layer, dtype, seed) if mode == "static" else None
    fused = dataclasses.replace(layer, fused="quant", quant=(mode, scale))

    def run_all(inputs):
        return _outputs(runner, CandidateJob(layer=fused, weight=layer.weight.to(dtype, copy=True),
                                             bias=None if layer.bias is None else layer.bias.to(dtype, copy=True),
                                             eps=layer.eps.value if candidate_eps is None else candidate_eps,
                                             device=device, inputs=list(inputs)), layer.dim)

    return check_norm_quant(layer, run_all, dtype, tol, seed, mode, scale)
