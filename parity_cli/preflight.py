"""Input checks that run before torch is imported: a mistyped path, option or plugin spec is
refused in milliseconds, not after the seconds torch's import takes (issue 15).

Imports only the standard library and torch-free parts of parity_cli (tests/test_preflight.py
runs it with torch and numpy made unimportable). Each message is one line naming the file or
option, worded as the later stage words the same fault, so that the two do not disagree."""

from __future__ import annotations

import errno
import importlib.machinery
import importlib.util
import os
import re
import stat
from pathlib import Path

from parity_cli.errors import InputError

# what torch.device accepts among what check_device supports; torch refuses a leading zero
_DEVICE = re.compile(r"(?:cpu|cuda)(?::(?:0|[1-9][0-9]*))?")
_MISSING = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)  # what Path.exists() reads as "not there"


def check_inputs(checkpoint, *, candidate="torch", reference="oracle", candidate_checkpoint=None, dtype=None,
                 reference_dtype=None, device="cpu", reference_device="cpu", family=None, strata=None,
                 baseline=None, options: dict | None = None) -> None:
    """Everything `parity check` can refuse without torch (outputs are cli.py's to check);
    `options` the numeric and free-form ones (option_values)."""
    option_values(**(options or {}))
    _not_a_copy(checkpoint)
    checkpoint_input(checkpoint, family)
    if candidate_checkpoint:
        from parity_cli.sources.onnx_graph import is_onnx
        from parity_cli.sources.openvino_ir import is_openvino_ir
        from parity_cli.sources.tflite_graph import is_tflite

        if is_onnx(candidate_checkpoint):
            onnx_input(candidate_checkpoint)
            candidate = candidate or "onnxruntime"
        elif is_openvino_ir(candidate_checkpoint):
            openvino_input(candidate_checkpoint)
            candidate = candidate or "openvino"
        elif is_tflite(candidate_checkpoint):
            tflite_input(candidate_checkpoint)
        else:
            checkpoint_input(candidate_checkpoint)
    candidate = candidate or "torch"
    if dtype is not None:
        dtype_input(dtype, "--dtype")
    if reference_dtype is not None:  # None: float64, or the candidate's under --exact (options.reference_dtype_for)
        dtype_input(reference_dtype, "--reference-dtype")
    device_input(device, "--device")
    if reference_device != "auto":
        device_input(reference_device, "--reference-device")
    if strata:
        from parity_cli.probes.strata import select_strata

        select_strata([s.strip() for s in strata.split(",") if s.strip()] if isinstance(strata, str) else list(strata))
    implementation_input(candidate, "--candidate")
    implementation_input(reference, "--reference")
    if baseline:
        report_input(baseline, "the baseline")


def inspect_inputs(checkpoint, family=None) -> None:
    from parity_cli.sources.onnx_graph import is_onnx
    from parity_cli.sources.openvino_ir import is_openvino_ir

    if is_onnx(checkpoint):
        return onnx_input(checkpoint)
    if is_openvino_ir(checkpoint):
        return openvino_input(checkpoint)
    from parity_cli.sources.tflite_graph import is_tflite

    if is_tflite(checkpoint):  # run by `parity capture --runtime litert`
        return tflite_input(checkpoint)
    _not_a_copy(checkpoint)
    return _inspect_inputs(checkpoint, family)


def _not_a_copy(path) -> None:
    """A CTranslate2 directory records no model type (its config.json has the eps and the tokens): it
    is checked as the copy of the model it was converted from."""
    from parity_cli.sources.ctranslate2 import is_ctranslate2
    from parity_cli.sources.remote import is_url

    if not is_url(path) and is_ctranslate2(Path(path)):
        raise InputError(f"{path}: a CTranslate2 model records no model type to check against; check the model it "
                         f"was converted from with --candidate-checkpoint {path}")


def _inspect_inputs(checkpoint, family=None) -> None:
    """`parity inspect`: the checkpoint and --family."""
    checkpoint_input(checkpoint, family)


def report_input(path, what: str = "the report") -> None:
    """A saved report (`parity report`, `parity explain`) or a --baseline: there, a regular
    file, under the size cap. Worded as jsonfile.load words it; the JSON is read later."""
    from parity_cli.sources.jsonfile import MAX_BYTES, regular_file

    cap = MAX_BYTES["report"]
    regular_file(Path(path), what, cap, f"over the {cap >> 20} MiB a report may have")


def checkpoint_input(path, family=None) -> None:
    """A directory is opened as `check` opens it (config, shard index, safetensors header: no
    tensor bytes), so every layout open_checkpoint refuses is refused here in its words. A GGUF
    file is only recognised: reading its metadata needs gguf, which imports numpy."""
    from parity_cli.model.load import open_checkpoint
    from parity_cli.sources.gguf import is_gguf
    from parity_cli.sources.onnx_graph import is_onnx
    from parity_cli.sources.remote import is_url

    if is_url(path):  # read where it lives: config, index and headers now, the norms' bytes with them
        ckpt = open_checkpoint(path)
        _family_input(ckpt, ckpt.path, family, ckpt.format == "gguf")
        return
    path = Path(path)
    st = _stat(path)
    if st is None:
        raise InputError(f"{path}: no such file or directory")
    if is_onnx(path):
        raise InputError(f"{path}: an exported ONNX graph has no config to check against; check the model it was "
                         f"exported from with --candidate-checkpoint {path} (or: parity inspect {path})")
    from parity_cli.sources.openvino_ir import is_openvino_ir

    if is_openvino_ir(path):
        raise InputError(f"{path}: an OpenVINO IR has no config to check against; check the model it was converted "
                         f"from with --candidate-checkpoint {path} (or: parity inspect {path})")
    from parity_cli.sources.tflite_graph import is_tflite

    if is_tflite(path):
        raise InputError(f"{path}: a TFLite model has no config to check against; check the model it was converted "
                         f"from with --candidate-checkpoint {path}")
    gguf_file, ckpt = stat.S_ISREG(st.st_mode) and is_gguf(path), None
    if gguf_file:  # its model type is in metadata only gguf can read
        if not _findable("gguf"):
            raise InputError(f"{path}: reading GGUF needs the gguf package: pip install gguf "
                             "(from a checkout: pip install -e '.[gguf]')")
    else:
        ckpt = open_checkpoint(path)  # refuses any other file, and a directory of a wrong layout
    _family_input(ckpt, path, family, gguf_file)


def _family_input(ckpt, path, family, gguf_file: bool) -> None:
    """--family names one, or a family file claims the model type, or the installed transformers
    can derive one (a GGUF's type is in metadata only gguf reads: checked later)."""
    from parity_cli.model.families import family_by_name, family_for_model_type

    if family:
        family_by_name(family)
        return
    if gguf_file or getattr(ckpt, "format", None) == "ctranslate2":  # the reference's model type is the copy's
        return
    try:
        family_for_model_type(ckpt.model_type, str(path / "config.json"))
    except InputError:
        # no family file: the family is derived from the model's own transformers classes
        # (model.derive) after torch loads; without transformers that cannot happen, said now
        if not isinstance(ckpt.model_type, str) or not ckpt.model_type:
            raise
        if not _findable("transformers"):
            from parity_cli.model.derive import needs_transformers

            raise InputError(needs_transformers(ckpt.model_type, str(path / "config.json"))) from None
        if ckpt.config.get("auto_map"):
            raise InputError(f"{path / 'config.json'}: model_type '{ckpt.model_type}' has no family file and "
                             "asks for remote code (auto_map), which parity never runs; force a family with "
                             "--family") from None


def onnx_input(path) -> None:
    """An .onnx file: a regular file within protobuf's size, and onnx + onnxruntime installed."""
    from parity_cli.sources.jsonfile import regular_file
    from parity_cli.sources.onnx_graph import MAX_ONNX_BYTES

    path = Path(path)
    if _stat(path) is None:
        raise InputError(f"{path}: no such file or directory")
    regular_file(path, "the ONNX model", MAX_ONNX_BYTES, "more than an ONNX protobuf can hold; refused")
    for module in ("onnx", "onnxruntime"):
        if not _findable(module):
            raise InputError(f"{path}: reading ONNX needs the {module} package: pip install onnx onnxruntime "
                             "(from a checkout: pip install -e '.[onnx]')")


def tflite_input(path) -> None:
    """A .tflite file: a regular file within its cap (its flatbuffer is read by sources.tflite_graph)."""
    from parity_cli.sources.jsonfile import regular_file
    from parity_cli.sources.tflite_graph import MAX_TFLITE_BYTES

    path = Path(path)
    if _stat(path) is None:
        raise InputError(f"{path}: no such file or directory")
    regular_file(path, "the TFLite model", MAX_TFLITE_BYTES, "more than a TFLite model holds; refused")


def openvino_input(path) -> None:
    """An OpenVINO IR: the .xml and its .bin regular files within their caps, and openvino installed."""
    from parity_cli.sources.openvino_ir import check_files

    path = Path(path)
    if _stat(path) is None:
        raise InputError(f"{path}: no such file or directory")
    check_files(path)
    if not _findable("openvino"):
        raise InputError(f"{path}: reading an OpenVINO IR needs the openvino package: pip install openvino "
                         "(from a checkout: pip install -e '.[openvino]')")


def dtype_input(name, option: str = "--dtype") -> None:
    """api.dtype_name's rule (case, a 'torch.' prefix), with the option that gave the name."""
    from parity_cli.options import DTYPES

    if str(name).lower().removeprefix("torch.") not in DTYPES:
        raise InputError(f"{option}: unknown dtype '{name}'; use float32, bfloat16, float16 or float64")


def device_input(device, option: str = "--device") -> None:
    """Syntax only: whether CUDA is there is torch's to say, later."""
    if not _DEVICE.fullmatch(str(device)):
        raise InputError(f"{option}: '{device}' is not a device (cpu, cuda, cuda:N)")


def implementation_input(spec, option: str = "--candidate") -> None:
    """What can be said of an IMPL without running any of its code: a built-in's package is
    installed, a plain name is a built-in or an installed entry point, FILE.py exists, MODULE
    can be found. A plugin whose own imports fail is found out only by importing it."""
    from parity_cli.backends import implementations as impls

    spec = str(spec)
    if spec in impls.BUILTINS:
        impls.require(spec, option)
        return
    impls.precheck(spec)
    target = spec.rpartition(":")[0]
    if ":" in spec and not impls.is_file_target(target):
        top = target.split(".")[0]
        if top and not _findable(top):  # '.rel' is left to the import, which says what is wrong
            raise InputError(f"implementation '{spec}': cannot import module '{target}': "
                             f"ModuleNotFoundError: No module named '{top}'")


def _stat(path: Path):
    """os.stat, None where Path.exists() would say False; any other failure is one line."""
    try:
        return os.stat(path)
    except OSError as exc:
        if exc.errno in _MISSING:
            return None
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError:  # an embedded NUL
        return None


def _findable(top: str) -> bool:
    """Whether a top-level module can be imported, without importing it. The working directory
    counts: implementations._load_attr puts it on sys.path for MODULE:ATTR."""
    try:
        if importlib.util.find_spec(top) is not None:
            return True
    except (ImportError, ValueError):  # a finder that fails, or imported without a spec: let import decide
        return True
    return importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) is not None


def option_values(eps=None, candidate_eps=None, atol=None, rtol=None, timeout=None, max_violation_fraction=None,
                  candidate_memory=None, candidate_args=None, jobs=None) -> None:
    """The same rules api.check applies, said before torch loads."""
    if jobs is not None:
        from parity_cli.check.parallel import resolve_jobs

        resolve_jobs(jobs)
    for flag, value in (("--eps", eps), ("--candidate-eps", candidate_eps), ("--atol", atol), ("--rtol", rtol)):
        if value is not None and not (value >= 0 and value != float("inf")):
            raise InputError(f"{flag} must be a finite number >= 0, got {value}")
    if timeout is not None and not timeout > 0:
        raise InputError(f"--timeout must be > 0 seconds (inf: no limit), got {timeout}")
    if max_violation_fraction is not None and not 0.0 <= max_violation_fraction <= 1.0:
        raise InputError("--max-violation-fraction must be between 0 and 1")
    if candidate_memory is not None:
        from parity_cli.isolation.supervisor import parse_memory

        parse_memory(candidate_memory)
    if candidate_args:
        from parity_cli.options import parse_args

        parse_args(candidate_args)
