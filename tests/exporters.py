"""The exporters the tests run as their users do (issue 51), where the call itself needs care."""

import sys


def ort_genai_build(*args) -> None:
    """`python -m onnxruntime_genai.models.builder ARGS`, run as `python -m` runs it (runpy, as
    __main__) in this process, where torch, transformers and onnx are imported already: the build of
    a tiny model takes a tenth of a second, a fresh interpreter's imports about six."""
    import contextlib
    import io
    import runpy
    import warnings

    saved = sys.argv
    sys.argv = ["onnxruntime_genai.models.builder", *map(str, args)]
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=False)
    finally:
        sys.argv = saved
