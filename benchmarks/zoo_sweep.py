"""The model zoo sweep (issue 25): for every model type transformers builds offline, a tiny
random-weight checkpoint (norm gains randomised, so that a gain convention matters), then
`parity inspect` and `parity check --candidate transformers` on it, compared with the model's own
norm modules. Writes COVERAGE.md (one row per type, the totals first) and zoo_sweep.json.

    python benchmarks/zoo_sweep.py                    # every type, 2 workers (~20-30 min here)
    python benchmarks/zoo_sweep.py --sample 12 --seed 0   # the most deployed types + 12 more

Per type: the norms in the model (plain RMSNorm/LayerNorm modules, BatchNorm modules, and all
norm modules), those parity checks (found under their stored names), eps agreement (each layer's
eps equals the module's own), and the verdict of the model's own classes against parity's float64 oracle,
at float32 and at float64 with float32's tolerance (most classes upcast to float32 whatever the input;
the oracle disagreeing with a class there is a wrong family: a wrong eps, gain or form is orders of
magnitude above it)."""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the most deployed LLM/VLM types (issue 25), then a few encoders, vision and audio models
MOST_DEPLOYED = [
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
    "qwen3_next", "gemma", "gemma2", "gemma3", "gemma3n", "phi", "phi3", "gpt_oss", "llama4", "mistral3",
    "ministral", "deepseek_v2", "deepseek_v3", "granite", "granitemoe", "olmo2", "olmoe", "olmo3", "cohere",
    "cohere2", "glm4", "glm4_moe", "starcoder2", "smollm3", "falcon", "gpt_neox", "gpt2", "llava", "idefics3",
    "paligemma",
]
# resnet: BatchNorm2d; fastspeech2_conformer: BatchNorm1d in an audio conformer (issue 26's batch_norm)
OTHERS = ["bert", "roberta", "t5", "bart", "whisper", "vit", "clip", "siglip", "resnet", "fastspeech2_conformer"]
# every other norm kind, for --sample runs (tools/compat_sweep.py): gated RMSNorm with its gate before the
# statistic (Mamba2) and after it (Falcon-H1), GroupNorm (wav2vec2's feature extractor), a weightless LayerNorm
# (OLMo); the suite's zoo sample leaves them to tests/test_other_kinds.py
KINDS = ["mamba2", "falcon_h1", "wav2vec2", "olmo"]

STRATA = ["zero", "tiny", "normal", "large"]


def _line(exc: BaseException, n: int = 200) -> str:
    return (type(exc).__name__ + ": " + " ".join(str(exc).split()))[:n]


def sweep_one(model_type: str, tmp: str) -> dict:
    """One type: its tiny checkpoint written in `tmp` by its own classes, then inspect and check
    (the model's own class as the candidate) compared with its norm modules."""
    from parity_cli import api
    from parity_cli.model.derive import write_tiny_checkpoint

    row = {"model_type": model_type}
    try:
        truth = write_tiny_checkpoint(model_type, tmp)
    except Exception as exc:
        return {**row, "outcome": "does not build offline", "error": _line(exc)}
    row["class"] = truth["class"]
    norms = truth["norms"]
    plain = [n for n in norms if n["plain"] and n["stored"]]
    # what parity can express (a weight of its own: RMSNorm/LayerNorm with gain w or 1 + w, an inference
    # BatchNorm, a GroupNorm, a gated RMSNorm; or no parameter at all, found under its module's name);
    # the rest, counted by why, are kinds parity cannot express yet
    for n in norms:
        n["name"] = (n["stored"].removesuffix(".weight") if n["stored"] else
                     n["module"] if n.get("weightless") and not n["unsupported"] else None)
    expressible = [n for n in norms if n["name"] and not n["unsupported"]]
    batch = [n for n in norms if n.get("batch_norm")]
    row.update(norm_modules=len(norms), plain=len(plain), expressible=len(expressible), batch_norm=len(batch),
               frozen_batch_norm=sum(1 for n in batch if n.get("frozen")),
               **{f"kind_{k}": sum(1 for n in expressible if _kind(n) == k) for k in OTHER_KINDS},
               other_kinds=sorted({n["unsupported"].split(" (")[0].split(":")[0] for n in norms if n["unsupported"]})[:4])
    try:
        info = api.inspect(tmp)
    except Exception as exc:  # the temporary directory's name out, so that a rerun writes the same file
        return {**row, "outcome": "not recognised", "error": " ".join(str(exc).replace(tmp, "CKPT").split())[:200]}
    row["family"] = info["checkpoint"]["family"]
    layers = {layer["name"]: layer for layer in info["layers"]}
    stored = {n["name"]: n for n in expressible}
    found = [name for name in stored if name in layers]
    for k in OTHER_KINDS:  # each kind found as itself (a weightless norm: found at all)
        row[f"found_{k}"] = sum(1 for name in found if _kind(stored[name]) == k and (
            k == "weightless" or layers[name]["kind"] == k))
    row["found"] = len(found)
    row["found_plain"] = sum(1 for n in plain if n["stored"].removesuffix(".weight") in layers)
    # a BatchNorm counts where it is checked as one: found under its stored name, as kind batch_norm
    row["found_batch_norm"] = sum(1 for n in batch if n["stored"] and layers.get(
        n["stored"].removesuffix(".weight"), {}).get("kind") == "batch_norm")
    row["found_frozen"] = sum(1 for n in batch if n.get("frozen") and n["stored"] and layers.get(
        n["stored"].removesuffix(".weight"), {}).get("kind") == "batch_norm")
    row["missed"] = sorted(set(stored) - set(found))[:8]
    row["eps_wrong"] = sorted(name for name in found if stored[name]["eps"] is not None
                              and layers[name]["eps"]["value"] != stored[name]["eps"])[:8]
    for dtype in ("float32", "float64"):
        # in this process (transformers is loaded here already); at float64 with float32's tolerance,
        # since most classes upcast to float32 whatever the input: a wrong eps, gain or form is orders of
        # magnitude above it
        tol = {"atol": 1e-5, "rtol": 1.3e-6} if dtype == "float64" else {}
        try:
            report = api.check(tmp, candidate="transformers", dtype=dtype, strata=STRATA, isolation="none", **tol)
            row[f"pass_{dtype}"] = report.passed
            # the committed family as the installed transformers bore on it (validated, derived again at run time)
            row["family_source"] = report.header["checkpoint"]["family_source"]
            # a layer whose verdict is fail is a disagreement between the oracle and the class; one whose
            # candidate raised (the class could not be built or run) is not, and is said apart
            failing = [layer.name for layer in report.layers if layer.status == "fail"]
            errored = [layer for layer in report.layers if layer.status == "error"]
            if failing:
                row[f"failing_{dtype}"] = failing[:5]
            if errored:
                row[f"errored_{dtype}"] = len(errored)
                row[f"errored_layers_{dtype}"] = [layer.name for layer in errored][:5]
                row[f"candidate_error_{dtype}"] = " ".join(str(errored[0].error or "a stratum errored").split())[:200]
        except Exception as exc:
            row[f"pass_{dtype}"] = False
            row[f"error_{dtype}"] = " ".join(str(exc).replace(tmp, "CKPT").split())[:200]
    row["outcome"] = "checked"
    return row


OTHER_KINDS = ("group_norm", "gated_rms_norm", "weightless")


def _kind(n) -> str | None:
    return "weightless" if n.get("weightless") else n.get("kind")


def sweep_type(model_type: str) -> dict:
    """sweep_one in a directory of its own (tools/per_type.py runs it in a child)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return sweep_one(model_type, tmp)


def fully_correct(row) -> bool:
    """Every norm parity can express found under its stored name, each with the module's own eps,
    and the model's own class passing against the oracle."""
    return (row.get("outcome") == "checked" and row.get("expressible", 0) > 0
            and row["found"] == row["expressible"] and not row["eps_wrong"]
            and row.get("pass_float32") is True and row.get("pass_float64") is True)


def coverage(rows: list[dict], transformers_version: str) -> str:
    built = [r for r in rows if r.get("outcome") not in ("does not build offline", "timeout", "error")]
    scope = [r for r in built if r.get("expressible", 0) > 0]
    recognised = [r for r in scope if r.get("outcome") == "checked"]
    correct = [r for r in scope if fully_correct(r)]
    expressible = sum(r["expressible"] for r in scope)
    checked = sum(r.get("found", 0) for r in scope)
    plain_total = sum(r.get("plain", 0) for r in scope)
    plain_checked = sum(r.get("found_plain", 0) for r in scope)
    all_norms = sum(r.get("norm_modules", 0) for r in built)
    other = sum(r.get("norm_modules", 0) - r.get("expressible", 0) for r in built)
    only_other = [r for r in built if r.get("norm_modules", 0) and not r.get("expressible")]
    # a disagreement: a layer the class and the oracle part on (status fail), at either dtype
    disagree = [r["model_type"] for r in recognised if r.get("failing_float64") or r.get("failing_float32")]
    batch_total = sum(r.get("batch_norm", 0) for r in built)
    batch_checked = sum(r.get("found_batch_norm", 0) for r in scope)
    frozen_total = sum(r.get("frozen_batch_norm", 0) for r in built)
    frozen_checked = sum(r.get("found_frozen", 0) for r in scope)
    batch_types = [r for r in built if r.get("batch_norm")]
    batch_correct = [r for r in batch_types if fully_correct(r) and r.get("found_batch_norm") == r["batch_norm"]]
    errored = [r["model_type"] for r in recognised if r.get("errored_float32") or r.get("errored_float64")
               or "error_float32" in r or "error_float64" in r]
    top = {r["model_type"]: r for r in rows if r["model_type"] in MOST_DEPLOYED}
    top_ok = [t for t in MOST_DEPLOYED if t in top and fully_correct(top[t])]
    kinds = Counter(k for r in built for k in r.get("other_kinds", []))

    def pct(a, b):
        return f"{100 * a / b:.1f} %" if b else "n/a"

    lines = [
        "# Coverage: the transformers model zoo",
        "",
        f"Measured by `python benchmarks/zoo_sweep.py` with {transformers_version}, on tiny random-weight",
        "checkpoints written by each type's own classes (norm gains and biases randomised). A type is fully",
        "correct when every norm module parity can express (RMSNorm or LayerNorm with gain w or 1 + w, an",
        "inference BatchNorm, (x - running_mean) / sqrt(running_var + eps) * w + b, a GroupNorm, a gated",
        "RMSNorm with its gate before or after the statistic, or any of these without a parameter, as the",
        "module itself computes in float64) is found under its stored name (a weightless one under its",
        "module's), each layer's eps equals the module's own, and `--candidate transformers` (the model's own",
        "class) passes against the float64 oracle at float32, and at float64 with float32's tolerance (most",
        "classes upcast to float32 whatever the input; a wrong eps, gain or form is orders of magnitude above",
        "it). A BatchNorm's running statistics are randomised too (variances from 1e-6 to 10, some channels",
        "near eps).",
        "",
        f"- model types swept: {len(rows)} (all transformers ships); built offline: {len(built)}; with a norm "
        f"parity can express: {len(scope)}; with norms of other kinds only: {len(only_other)}",
        f"- recognised (a family file, hand-written or generated, or derived at run time): {len(recognised)} of "
        f"{len(scope)} ({pct(len(recognised), len(scope))})",
        f"- fully correct: {len(correct)} of {len(scope)} ({pct(len(correct), len(scope))})",
        f"- expressible norm modules checked: {checked} of {expressible} ({pct(checked, expressible)}); "
        f"plain RMSNorm/LayerNorm modules (by class name) checked: {plain_checked} of {plain_total} "
        f"({pct(plain_checked, plain_total)})",
        f"- BatchNorm modules (torch's BatchNorm1d/2d/3d, and frozen copies that keep gain, bias and statistics "
        f"as buffers) checked as batch_norm: {batch_checked} of {batch_total} ({pct(batch_checked, batch_total)}); "
        f"of them frozen: {frozen_checked} of {frozen_total}; types with a BatchNorm fully correct with every "
        f"BatchNorm checked: {len(batch_correct)} of {len(batch_types)}",
        "- other kinds checked as themselves: " + "; ".join(
            f"{words} {sum(r.get(f'found_{k}', 0) for r in scope)} of {sum(r.get(f'kind_{k}', 0) for r in built)} "
            f"(in {sum(1 for r in built if r.get(f'kind_{k}'))} types)"
            for k, words in (("group_norm", "GroupNorm"), ("gated_rms_norm", "gated RMSNorm"),
                             ("weightless", "weightless norms (no parameter, found by their module)"))),
        f"- norm modules of kinds parity cannot express yet, not checked: {other} of {all_norms} in the built types"
        + (f"; by kind: {', '.join(f'{k} {n}' for k, n in kinds.most_common(8))} (types)" if kinds else ""),
        f"- types where parity's oracle disagrees with the model's own class: {len(disagree)}"
        + (f" ({', '.join(disagree)})" if disagree else "")
        + (f"; the class could not be run: {', '.join(errored)}" if errored else ""),
        f"- the most deployed LLM/VLM types fully correct: {len(top_ok)} of {len([t for t in MOST_DEPLOYED if t in top])}"
        + (f"; not: {', '.join(f'{t} ({_why(top[t])})' for t in MOST_DEPLOYED if t in top and t not in top_ok)}"
           if len(top_ok) < len(top) else ""),
        "",
        "| type | class | family | expressible | found | plain | BatchNorm | eps wrong | fp32 | fp64 | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["model_type"]):
        note = _why(r) if not fully_correct(r) else ""
        yes = {True: "pass", False: "FAIL", None: ""}
        lines.append(f"| {r['model_type']} | {r.get('class', '')} | {r.get('family', '')} | {r.get('expressible', '')} | "
                     f"{r.get('found', '')} | {r.get('plain', '')} | {_batch(r)} | {len(r.get('eps_wrong', [])) or ''} | "
                     f"{yes[r.get('pass_float32')]} | {yes[r.get('pass_float64')]} | {note} |")
    return "\n".join(lines) + "\n"


def _batch(r) -> str:
    """The BatchNorm cell: checked of all (frozen ones said), empty where the type has none."""
    if not r.get("batch_norm"):
        return ""
    frozen = f" ({r['frozen_batch_norm']} frozen)" if r.get("frozen_batch_norm") else ""
    return f"{r.get('found_batch_norm', 0)} of {r['batch_norm']}{frozen}"


def _why(r) -> str:
    """A row's note: why it is not fully correct (or what else it holds)."""
    if r.get("error"):
        text = r["error"]
    elif r.get("outcome") == "checked" and not r.get("expressible"):
        text = "other kinds only: " + ", ".join(r.get("other_kinds", []))
    elif r.get("missed"):
        text = "missed " + ", ".join(r["missed"][:2])
    elif r.get("eps_wrong"):
        text = "eps differs on " + ", ".join(r["eps_wrong"][:2])
    elif r.get("failing_float64") or r.get("failing_float32"):
        text = "disagrees on " + ", ".join((r.get("failing_float64") or r.get("failing_float32"))[:2])
    elif r.get("candidate_error_float32") or r.get("candidate_error_float64"):
        text = "the class could not be run: " + (r.get("candidate_error_float32") or r.get("candidate_error_float64"))
    else:
        text = r.get("error_float32") or r.get("error_float64") or ""
    return " ".join(str(text).split()).replace("|", "/")[:100]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="The transformers model zoo through parity")
    ap.add_argument("types", nargs="*")
    ap.add_argument("--sample", type=int, help="the most deployed types plus N others, seeded")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=90.0)
    ap.add_argument("--out", default=str(ROOT / "COVERAGE.md"))
    args = ap.parse_args(argv)
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    types = args.types or sorted(CONFIG_MAPPING_NAMES)
    if args.sample is not None:
        rest = sorted(set(types) - set(MOST_DEPLOYED) - set(OTHERS) - set(KINDS))
        types = [t for t in MOST_DEPLOYED + OTHERS + KINDS if t in CONFIG_MAPPING_NAMES] + \
            random.Random(args.seed).sample(rest, min(args.sample, len(rest)))
    sys.path.insert(0, str(ROOT / "tools"))
    from per_type import run

    rows = []
    for row in run(__file__, "sweep_type", types, args.timeout, args.jobs, chunk=25):
        rows.append(row)
        if len(rows) % 25 == 0 or len(rows) == len(types):
            print(f"{len(rows)}/{len(types)}", flush=True)
    Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    Path(args.out).write_text(coverage(rows, f"transformers {transformers.__version__}"))
    print(Path(args.out).read_text().split("\n| type")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
