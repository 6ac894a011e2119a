"""Issue 46, item 1, shared by tests/test_truth_*.py: one runtime cell (a norm kind at a dtype)
checked twice on the same layer, probes and tolerance, through parity's adapter (the built-in
NAME) and through the runtime's own public path (the built-in NAME@public, each adapter's
public_path). The verdicts must be equal, cause included; where they are not, parity's adapter
is wrong."""

import pytest
from conftest import slow_unless

from parity_cli import api
from parity_cli.sources.synthetic import write_checkpoint

# kind -> (model type of a synthetic checkpoint, the one layer checked, width, eps): one layer a kind
LAYERS = {
    "rms_norm/llama": ("llama", "model.norm", 64, 1e-6),  # x32 normalised, cast, then times w
    "rms_norm/gemma": ("gemma3_text", "model.norm", 64, 1e-6),  # times (1 + w) in float32, cast last
    "layer_norm": ("bert", "bert.embeddings.LayerNorm", 64, 1e-12),  # nn.LayerNorm with a bias, BERT's eps
    "layer_norm/256": ("bert", "bert.embeddings.LayerNorm", 256, 1e-12),
    "group_norm": ("mask2former", "model.pixel_level_module.decoder.input_projections.0.1", 64, None),
    "batch_norm": ("resnet", "embedder.embedder.normalization", 64, None),
    "gated_rms_norm": ("mamba2", "backbone.layers.0.mixer.norm", 64, 1e-6),  # RMSNorm(x * silu(z)), 4 groups
}
KIND = {"rms_norm/llama": "rms_norm", "rms_norm/gemma": "rms_norm", "layer_norm/256": "layer_norm"}


# the one cell of each runtime's matrix in the default run (issue 49): the rest run in `--tier slow`
KEPT = ("rms_norm/llama", "float32")


def cases(expected) -> list:
    """The (kind, dtype) cells of a matrix as parameters, each but KEPT marked slow."""
    return [pytest.param(kind, dtype, marks=slow_unless((kind, dtype) == KEPT)) for kind, dtype in expected]


class Cells:
    """Checkpoints written once (a module- or session-scoped fixture holds this)."""

    def __init__(self, directory):
        self.directory, self.written, self.reports = directory, {}, {}

    def checkpoint(self, kind: str):
        model_type, _, width, eps = LAYERS[kind]
        if (model_type, width) not in self.written:
            self.written[model_type, width] = write_checkpoint(self.directory / f"{model_type}-{width}", model_type,
                                                               layers=1, hidden=width, heads=4, eps=eps)
        return self.written[model_type, width]

    def report(self, kind: str, candidate: str, dtype: str, strata: tuple | None = None):
        """The cell's check, run once (a test of its details reads the one the verdict came from);
        `strata`: others than the default ones."""
        key = (kind, candidate, dtype, strata)
        if key not in self.reports:
            self.reports[key] = api.check(self.checkpoint(kind), candidate=candidate, dtype=dtype,
                                          layers=LAYERS[kind][1], isolation="none",
                                          **({"strata": list(strata)} if strata else {}))
        return self.reports[key]

    def verdict(self, kind: str, candidate: str, dtype: str, strata: tuple | None = None) -> tuple:
        """(the layer's kind, pass|fail|error, its diagnoses' codes): what the cell says, and why."""
        (layer,) = self.report(kind, candidate, dtype, strata).layers
        assert layer.error is None, (candidate, dtype, layer.error)
        return layer.kind, layer.status, sorted(d.code for d in layer.diagnoses)


def passes(kind: str) -> tuple:
    return KIND.get(kind, kind), "pass", []


def fails(kind: str, *codes: str) -> tuple:
    return KIND.get(kind, kind), "fail", sorted(codes)
