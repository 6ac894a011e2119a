"""Stage 8: the `parity` command line, a thin shell over parity_cli.api.

Imports nothing heavy at module level: `parity --help` must not load torch. Every error the
input causes is one line on stderr and exit code 2; Ctrl-C is 130; no partial report."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from parity_cli import __version__
from parity_cli.errors import InputError
from parity_cli.text import printable, quiet_third_party

EXIT_PASS, EXIT_FAIL, EXIT_INPUT, EXIT_INTERRUPT, EXIT_TERMINATED = 0, 1, 2, 130, 143


def escape(text) -> str:
    """Paths, names and messages are data, never rich markup ('[/]' in a path is not a tag) nor
    terminal control (an ESC sequence is shown as '\\x1b')."""
    from rich.markup import escape as markup_escape

    return markup_escape(printable(text))


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that every finally block (children killed,
    staged outputs removed) runs before the exit."""


def _on_sigterm(signum, frame):
    raise Terminated()


def _console(stderr: bool = False):
    from parity_cli.report.layout import console

    return console(stderr=stderr)


def _check_output_target(path: str | None, inputs: list) -> Path | None:
    """Fail before the run, not after it, when a report cannot be written or would land on one
    of `inputs` (as _check_outputs reads them)."""
    if path == "-":
        raise InputError("--json -: only 'parity check' writes its report to stdout; name a file")
    return _check_outputs({"--json": path}, inputs).get("--json")


def _output_path(raw: str, flag: str) -> Path:
    """An output as an absolute path, checked before the run: it is a regular file or a new one,
    never a link (outputs.output_target), not in /proc, a device, FIFO, terminal or directory
    ('--json -' is stdout), and the directory it lands in exists and is writable, or can be made
    (outputs.new_directories: made only when the run writes, so a run refused leaves none behind)."""
    import os

    from parity_cli.outputs import new_directories, output_target

    path = Path(raw).expanduser().absolute()  # now: a candidate may chdir later
    new = new_directories(path, flag)  # a file on the way, a link to nothing, /proc, /sys, /dev: refused
    parent = output_target(path, flag).parent  # the staged file and the rename happen beside the target
    if new:
        return path
    if not parent.is_dir():
        raise InputError(f"{raw}: {flag}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{raw}: {flag}: directory {parent} is not writable")
    return path


MAX_SCANNED = 10_000  # directory entries looked at per input directory


def _inputs(items: list, wanted: set) -> set:
    """Which of the `wanted` resolved paths a run reads: each input file, every file of a
    checkpoint directory, the source of a FILE.py:ATTR plugin (`impl:` prefixed items), and the
    external data an .onnx graph names (a file in its directory whose name the graph holds)."""
    from parity_cli.backends.implementations import is_file_target

    found = set()
    for item in items:
        if item is None:
            continue
        item = str(item)
        if item.startswith("impl:"):
            target, sep, _ = item[5:].rpartition(":")
            if not (sep and target and is_file_target(target)):
                continue
            item = target
        p = Path(item).expanduser()
        try:
            if p.is_dir():
                found |= {f for f in _files(p) if f in wanted}
            elif p.is_file():
                found |= {p.resolve()} & wanted
                if p.suffix.lower() == ".onnx":
                    found |= _onnx_external(p, wanted)
                elif p.suffix.lower() == ".xml":  # an OpenVINO IR reads its weights from NAME.bin beside it
                    weights = p.with_suffix(".bin")
                    if weights.exists():
                        found |= {weights.resolve()} & wanted
        except (OSError, ValueError):
            continue  # not readable here: the run itself says so
    return found


def _files(root: Path):
    """The resolved paths of the files under `root`, links to files followed (a Hugging Face
    cache links each into its blobs), at most MAX_SCANNED entries."""
    import os

    n = 0
    for top, _dirs, files in os.walk(root):
        for name in files:
            n += 1
            if n > MAX_SCANNED:
                return
            yield Path(top, name).resolve()


def _onnx_external(path: Path, wanted: set) -> set:
    """Which of `wanted` an .onnx graph may read as external data: a file inside its directory
    whose name the graph holds as a string (its location). Found without parsing the graph."""
    import mmap
    import os

    out = set()
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            n = 0
            for top, _dirs, files in os.walk(path.parent.resolve()):
                for name in files:
                    n += 1
                    if n > MAX_SCANNED:
                        return out
                    full = Path(top, name).resolve()
                    if full in wanted and mm.find(os.fsencode(name)) >= 0:
                        out.add(full)
    except (OSError, ValueError):  # an empty file cannot be mapped; no external data then
        pass
    return out


def _check_outputs(named: dict, inputs: list) -> dict:
    """Every output distinct, none an input of the run (a report written over config.json, the
    plugin's source, the baseline, an .onnx graph's external data): compared by where each lands
    once its links are followed."""
    from parity_cli.outputs import output_target

    taken: dict = {}
    out = {}
    for flag, raw in named.items():
        if not raw:
            continue
        if raw == "-":
            if flag != "--json":
                raise InputError(f"{flag} -: only --json can go to stdout")
            out[flag] = "-"
            continue
        path = _output_path(raw, flag)
        key = output_target(path, flag)
        if key in taken:
            raise InputError(f"{raw}: given to both {taken[key]} and {flag}")
        taken[key] = flag
        out[flag] = path
    overwritten = _inputs(inputs, set(taken)) if taken else set()
    for key, flag in taken.items():
        if key in overwritten:
            raise InputError(f"{named[flag]}: {flag} would overwrite an input of this run; refused")
    return out


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="parity")
def cli():
    """Check that a model's norm layers (RMSNorm, LayerNorm) compute the same thing in a new
    implementation as in the checkpoint's own semantics. Exit 0 parity, 1 violated, 2 bad input."""


def family_options(command):
    """--family and --family-force, one wording for every command that judges a checkpoint."""
    command = click.option("--family-force", is_flag=True, help=(
        "Check with a --family the checkpoint's own model type contradicts (kept as a warning, and said on the "
        "verdict line)."))(command)
    return click.option("--family", default=None, help=(
        "Force a model family instead of the checkpoint's model_type: a family's name (layer_norm) or a model type, "
        "read as the family that lists it (bert: layer_norm) or its derived family. One whose norm kind, gain offset "
        "or eps the model type contradicts is refused without --family-force."))(command)


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--candidate", default=None,
              help="Implementation under test: a built-in (oracle, torch, hf, transformers, onnxruntime, openvino; the "
                   "runtimes' own kernels: vllm, llama.cpp, mlx, torch.compile, executorch), an installed "
                   "plugin name ('parity implementations'), MODULE:ATTR or FILE.py:ATTR [default: torch; onnxruntime "
                   "with an .onnx --candidate-checkpoint, openvino with an .xml one].")
@click.option("--candidate-arg", "candidate_args", multiple=True, metavar="KEY=VALUE",
              help="Keyword for the candidate's constructor or function (repeatable; VALUE parsed as JSON if it parses).")
@click.option("--candidate-checkpoint", default=None, type=click.Path(),
              help="A converted copy (HF, GGUF, an exported .onnx graph or an OpenVINO IR .xml): compare its eps and "
                   "weights with CHECKPOINT's, then probe the candidate with them (a graph: its own norm subgraphs).")
@click.option("--reference", default="oracle", show_default=True, help="Implementation to compare against (any IMPL form).")
@click.option("--reference-dtype", default=None,
              help="dtype the reference runs at [default: float64; with --exact and a --reference other than the "
                   "oracle, the candidate's dtype].")
@click.option("--reference-device", default="auto", show_default=True,
              help="Device the reference runs on (auto: the candidate's GPU if it has fast float64, else cpu).")
@click.option("--exact", is_flag=True, help="Bitwise parity: --atol 0 --rtol 0, no allowance.")
@click.option("--grad", is_flag=True, help="Backward parity too: dx and dweight against the reference's autograd.")
@click.option("--timeout", type=float, default=None,
              help="Seconds per layer before the candidate's process is killed and the layer fails "
                   "[default: 120; inf: no limit].")
@click.option("--candidate-memory", default=None, metavar="SIZE",
              help="Kill the candidate's process past this resident memory, a finding (8G, 512M, none) "
                   "[default: half of RAM].")
@click.option("--isolation", type=click.Choice(["auto", "process", "none"]), default="auto", show_default=True,
              help="Where the candidate runs: auto (plugins and GPU runs in a supervised process, the "
                   "built-ins oracle/torch/hf here), process (always supervised), none (here; for debugging).")
@click.option("--jobs", "-j", default="1", show_default=True, metavar="N|auto",
              help="Workers over layers (auto: one per CPU this process may use).")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="torch intra-op threads per process; parallelism comes from --jobs.")
@click.option("--explain", is_flag=True,
              help="For each failing layer, change one factor at a time (dtype, kernel, eps) and show which carries the error.")
@click.option("--dtype", default=None, help="Candidate input/weight dtype (float32, bfloat16, float16, float64); default: as stored.")
@click.option("--device", default="cpu", show_default=True, help="Candidate device: cpu, cuda, cuda:N.")
@family_options
@click.option("--eps", type=float, default=None, help="Override the checkpoint's eps (both sides).")
@click.option("--candidate-eps", type=float, default=None, help="eps the candidate is built with (simulates a deployment config).")
@click.option("--atol", type=float, default=None, help="Absolute tolerance (default: the dtype's profile).")
@click.option("--rtol", type=float, default=None, help="Relative tolerance (default: the dtype's profile).")
@click.option("--strata", default=None, help="Comma-separated probe strata (default: all default strata; 'extreme' is opt-in).")
@click.option("--seed", type=int, default=0, show_default=True, help="Probe seed.")
@click.option("--layers", "layers_glob", default=None, help="Only layers whose name matches this glob.")
@click.option("--max-violation-fraction", type=float, default=0.0, show_default=True,
              help="Share of elements allowed outside tolerance before a stratum fails.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False, allow_dash=True),
              help="Write the JSON report here ('-': stdout; the table then goes to stderr).")
@click.option("--junit", "junit_path", default=None, type=click.Path(dir_okay=False), help="Write JUnit XML here.")
@click.option("--markdown", "markdown_path", default=None, type=click.Path(dir_okay=False),
              help="Write a Markdown summary here (PR comment, CI job summary).")
@click.option("--baseline", "baseline_path", default=None, type=click.Path(dir_okay=False),
              help="A previous JSON report: its findings are accepted, only new ones fail.")
@click.option("--baseline-any", is_flag=True,
              help="Gate on a --baseline from another checkpoint, dtype or candidate (refused without it).")
@click.option("--fail-on", type=click.Choice(["fail", "unchecked", "warn"]), default="fail", show_default=True,
              help="'unchecked' also fails where a norm of the checkpoint was not checked; 'warn' on that and on "
                   "warnings such as a defaulted eps.")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Write error against q/eps with the attenuation curve (.svg or .png; needs matplotlib).")
@click.option("--activations", default=None, type=click.Path(dir_okay=False),
              help="A `parity capture` file: real rows as a `captured` stratum per layer, their q/eps and what "
                   "each fault does to them.")
@click.option("--runtime-capture", default=None, type=click.Path(dir_okay=False),
              help="A `parity capture --runtime` file: each norm node's input and output rows as the runtime computed "
                   "them, judged against this checkpoint's oracle on the runtime's own input; the runtime's eps and "
                   "gains compared with this checkpoint's.")
@click.option("--quiet", "-q", is_flag=True, help="One line: the verdict, the counts and, on failure, the largest group.")
@click.option("--verbose", "-v", is_flag=True, help="Every layer: the table, each diagnosis and every group.")
def check(checkpoint, candidate, candidate_args, candidate_checkpoint, reference, reference_dtype, reference_device,
          exact, grad, timeout, candidate_memory, isolation, jobs, threads, explain, dtype, device, family, family_force,
          eps, candidate_eps, atol, rtol, strata,
          seed, layers_glob, max_violation_fraction, json_path, junit_path, markdown_path, baseline_path, baseline_any,
          fail_on, plot_path, activations, runtime_capture, quiet, verbose):
    """Replay stratified probes through the reference and the candidate, layer by layer."""
    from parity_cli import preflight
    from parity_cli.options import parse_args

    args = parse_args(list(candidate_args))
    if "fused" in args:  # --candidate-arg fused=add|quant: the fused check (`parity fused`), its own report
        form = args.pop("fused")
        if form not in ("add", "quant"):
            raise InputError(f"--candidate-arg fused={form}: add (a residual add + norm) or quant (a norm + int8 "
                             "quantize, with scale=static|dynamic)")
        quant = args.pop("scale", "static") if form == "quant" else None
        others = [flag for flag, given in (("--junit", junit_path), ("--markdown", markdown_path),
                                           ("--baseline", baseline_path), ("--plot", plot_path), ("--grad", grad),
                                           ("--exact", exact), ("--activations", activations)) if given]
        if others:
            raise InputError(f"--candidate-arg fused={form}: the fused check writes its table and --json, not "
                             f"{', '.join(others)}")
        return _run_fused(checkpoint, candidate or "torch", args, dtype, layers_glob, candidate_eps, isolation, quant,
                          candidate_checkpoint, json_path, family, family_force)

    if runtime_capture and explain:
        raise InputError("--runtime-capture: --explain reruns a candidate one factor at a time; a capture's rows are "
                         "recorded, and its causes are read from the eps and gains the runtime used")
    # everything that can be refused without torch is refused before it loads (1.5-4 s)
    preflight.check_inputs(checkpoint, candidate=candidate, reference=reference,
                           candidate_checkpoint=candidate_checkpoint, dtype=dtype, reference_dtype=reference_dtype,
                           device=device, reference_device=reference_device, family=family, strata=strata,
                           baseline=baseline_path,
                           options=dict(eps=eps, candidate_eps=candidate_eps, atol=atol, rtol=rtol, timeout=timeout,
                                        max_violation_fraction=max_violation_fraction,
                                        candidate_memory=candidate_memory, candidate_args=list(candidate_args),
                                        jobs=jobs))
    outputs = _check_outputs({"--json": json_path, "--junit": junit_path, "--markdown": markdown_path,
                              "--plot": plot_path},
                             [p for p in (checkpoint, candidate_checkpoint, baseline_path, activations,
                                          runtime_capture) if p]
                             + [f"impl:{spec}" for spec in (candidate, reference) if spec])
    json_path, junit_path, markdown_path, plot_path = (
        None if outputs.get(f) is None else str(outputs[f]) for f in ("--json", "--junit", "--markdown", "--plot"))
    if plot_path:
        from parity_cli.report.plot import check_target

        check_target(plot_path)
    from parity_cli.api import CheckOptions
    from parity_cli.api import check as run_check
    from parity_cli.report.gate import gate, load_baseline

    baseline = load_baseline(baseline_path) if baseline_path else None
    options = CheckOptions(
        candidate=candidate, reference=reference, dtype=dtype, device=device, family=family,
        family_force=family_force, eps=eps, candidate_eps=candidate_eps, atol=atol, rtol=rtol,
        strata=[s.strip() for s in strata.split(",") if s.strip()] if strata else None,
        seed=seed, layers=layers_glob, max_violation_fraction=max_violation_fraction,
        reference_dtype=reference_dtype, reference_device=reference_device, exact=exact,
        candidate_args=list(candidate_args), candidate_checkpoint=candidate_checkpoint, grad=grad, timeout=timeout,
        candidate_memory=candidate_memory, isolation=isolation, jobs=jobs, threads=threads,
        activations=activations, runtime_capture=runtime_capture,
    )
    with _progress(quiet) as progress:
        report = run_check(checkpoint, options, progress=progress)
    data = _shown(report.to_dict())
    if explain and not report.passed:
        from parity_cli.explain import explain_groups

        data["explain"] = _plain(explain_groups(checkpoint, options, data))
        for layer in data["layers"]:
            if layer["name"] in data["explain"]["layers"]:
                layer["conclusion"] = data["explain"]["layers"][layer["name"]]
    data["gate"] = gate(data, fail_on, baseline, baseline_path)
    mismatch = (data["gate"].get("baseline") or {}).get("mismatch")
    if mismatch and not baseline_any:  # its accepted findings would say nothing of this run: no output, exit 2
        raise InputError(f"{baseline_path}: the baseline is from another run ({'; '.join(mismatch)}); it gates "
                         "only a run of the same checkpoint, dtype and candidate (--baseline-any to use it anyway)")
    verdicts(data)
    to_stdout = json_path == "-"
    _write_outputs(data, None if to_stdout else json_path, junit_path, markdown_path, plot=(report, plot_path))
    from parity_cli.report import terminal

    console = _console(stderr=to_stdout)  # with the JSON on stdout, the human output goes to stderr
    if mismatch:  # --baseline-any: first, since every accepted finding below rests on it
        said = f"the baseline {baseline_path} is from another run: " + "; ".join(mismatch)
        console.print(f"[yellow]warning:[/] {escape(said)}", soft_wrap=True)
    written = [str(p) for p in (json_path if not to_stdout else None, junit_path, markdown_path, plot_path) if p]
    if quiet:
        console.print(terminal.quiet_line(data, console.width), soft_wrap=True, markup=False)
    else:
        terminal.render(data, console, verbose=verbose, written=written)
        worse = [f for f in data["gate"]["new_findings"] if "worse" in f]
        if worse:  # "new" above: these the baseline had, at a smaller size
            f = worse[0]
            said = (f"worse than the baseline: {len(worse)} finding(s) it accepted at a smaller size; "
                    f"{f['layer']} {f['stratum']} {f['code']}: {f['worse']}")
            console.print(f"[yellow]{escape(said)}[/]", soft_wrap=True)
    if to_stdout:
        from parity_cli.outputs import json_text

        click.echo(json_text(data), nl=False)
    return data["gate"]["exit_code"]


def verdicts(data: dict) -> None:
    """One verdict a reader cannot mistake: the top-level `verdict` is the gate's (what the exit code
    says, after --baseline and --fail-on); summary.verdict is the comparison's alone, and says so."""
    data["verdict"] = data["gate"]["verdict"]
    data["summary"]["verdict_is"] = ("the comparison's alone, before --baseline and --fail-on; the run's verdict "
                                     "is the top-level verdict (gate.verdict)")


class _progress:
    """What the run is doing, on stderr, from its first second: a status line while torch loads,
    the checkpoint is read and the candidate's worker starts, then a bar that counts layers as
    they finish. Only on a terminal, so CI logs and pipes get no control characters; transient,
    so nothing of it stays on the screen (--quiet too: its one line is all that is left)."""

    def __init__(self, quiet: bool = False):
        self.console = None
        console = _console(stderr=True)
        if console.is_terminal:
            self.console = console
        self.spinner = self.bar = self.task = None

    def __enter__(self):
        if self.console is None:
            return None
        self.spinner = self.console.status("loading torch")
        self.spinner.start()
        return self

    def status(self, text: str) -> None:
        if self.spinner is not None:
            self.spinner.update(escape(text))

    def __call__(self, done: int, total: int, name: str) -> None:
        if self.bar is None and done == 0:  # the first layer also pays the worker's start
            self.status(f"checking {total} layers" if name.endswith(" layers") else f"layer 1 of {total}: {name}")
            return
        if self.bar is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.spinner.stop()
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=self.console, transient=True)
            self.bar.start()
            self.task = self.bar.add_task("layers", total=total)
        self.bar.update(self.task, completed=done, description=escape(name))  # a name is no markup

    def __exit__(self, *exc):
        for live in (self.spinner, self.bar):
            if live is not None:
                live.stop()
        return False


def _write_outputs(data: dict, json_path, junit_path, markdown_path, plot=(None, None)) -> None:
    """The whole set, plot included, or none of it (Ctrl-C or a full disk during the plot left
    the JSON and JUnit without it)."""
    from parity_cli.outputs import json_text, write_files
    from parity_cli.report.formats import to_junit, to_markdown

    outputs = {}
    report, plot_path = plot
    if plot_path:
        from parity_cli.report.plot import render_plot

        outputs[plot_path] = render_plot(report, plot_path)
    if json_path:
        outputs[json_path] = json_text(data)
    if junit_path:
        outputs[junit_path] = to_junit(data)
    if markdown_path:
        outputs[markdown_path] = to_markdown(data)
    write_files(outputs)


@cli.command()
@click.argument("report_path", metavar="REPORT.json", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["table", "markdown", "junit", "json"]), default="table",
              show_default=True)
@click.option("--verbose", "-v", is_flag=True, help="Table format: every layer, each diagnosis and every group.")
@click.option("--quiet", "-q", is_flag=True, help="Table format: one line, the verdict and what failed it.")
def report(report_path, fmt, verbose, quiet):
    """Re-render a saved JSON report without rerunning anything."""
    from parity_cli.outputs import json_text
    from parity_cli.report.formats import to_junit, to_markdown
    from parity_cli.report.gate import load_report
    from parity_cli.report.terminal import quiet_line, render

    data = load_report(report_path)
    if fmt == "table" and quiet:
        console = _console()
        console.print(quiet_line(data, console.width), soft_wrap=True, markup=False)
    elif fmt == "table":
        render(data, _console(), verbose=verbose)
    elif fmt == "markdown":
        click.echo(to_markdown(data), nl=False)
    elif fmt == "junit":
        click.echo(to_junit(data), nl=False)
    else:
        click.echo(json_text(data), nl=False)
    return EXIT_PASS


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--candidate", default="torch", show_default=True,
              help="A fused residual add + norm: torch (transformers' unfused composition, the baseline), vllm "
                   "(its fused_add_rms_norm kernel), or a plugin FILE.py:ATTR / MODULE:ATTR fn(x, residual, weight, "
                   "eps) returning (normed, new_residual) or writing both in place.")
@click.option("--candidate-arg", "candidate_args", multiple=True, metavar="KEY=VALUE",
              help="Keyword for the plugin function (repeatable).")
@click.option("--dtype", default=None, help="float32, bfloat16 or float16 [default: bfloat16; an .onnx copy's own].")
@click.option("--layers", default=None, help="Only the layers whose name matches this glob.")
@click.option("--candidate-eps", type=float, default=None, help="Run the candidate with this eps.")
@click.option("--isolation", type=click.Choice(["auto", "process", "none"]), default="auto", show_default=True,
              help="Where the candidate runs (as for check).")
@click.option("--quant", type=click.Choice(["static", "dynamic"]), default=None,
              help="Check the norm + int8 quantize instead: a static calibrated scale given to the kernel, or its "
                   "own per-token scale; compared after dequantizing, half a step allowed, saturation counted apart.")
@click.option("--candidate-checkpoint", default=None, type=click.Path(),
              help="An exported .onnx graph: its own SkipSimplifiedLayerNormalization / SkipLayerNormalization "
                   "nodes (ORT's optimizer fuses the residual add into them) run as they are, both outputs checked.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="Write the report as JSON.")
@family_options
def fused(checkpoint, candidate, candidate_args, dtype, layers, candidate_eps, isolation, quant, candidate_checkpoint,
          json_path, family, family_force):
    """The residual add + norm as serving runtimes fuse it: each RMSNorm/LayerNorm of the hidden width
    run as fused(x, residual), both outputs (normed, new residual) against the float64 oracle of the
    sum, on strata of the sum (cancellation, residual >> x, a float16 overflow, a grown stream)."""
    from parity_cli.options import parse_args

    return _run_fused(checkpoint, candidate, parse_args(list(candidate_args)), dtype, layers, candidate_eps, isolation,
                      quant, candidate_checkpoint, json_path, family, family_force)


def _run_fused(checkpoint, candidate, args: dict, dtype, layers, candidate_eps, isolation, quant, candidate_checkpoint,
               json_path, family=None, family_force=False) -> int:
    """`parity fused`, and `parity check --candidate-arg fused=add|quant` (the same check)."""
    json_path = _check_output_target(json_path, [checkpoint])
    from parity_cli.outputs import json_text, write_files
    from parity_cli.pipeline import check_fused
    from parity_cli.report.terminal import render_fused

    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise InputError(f"--dtype {dtype}: a fused add + norm is checked at float32, bfloat16 or float16")
    report = check_fused(checkpoint, candidate=candidate, dtype=dtype, layers=layers, candidate_args=args,
                         isolation=isolation, candidate_eps=candidate_eps, quant=quant,
                         candidate_checkpoint=candidate_checkpoint, family=family, family_force=family_force)
    data = report.to_dict()
    if json_path:
        write_files({json_path: json_text(data)})
    render_fused(data, _console())
    return report.exit_code


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--runtimes", "names", default=None,
              help="Comma-separated runtimes (default: torch, transformers, onnxruntime, openvino, vllm, llama.cpp, "
                   "mlx, torch.compile, executorch).")
@click.option("--dtypes", default=None, help="Comma-separated dtypes (default: float32, bfloat16, float16).")
@click.option("--layers", default=None, help="Only the layers whose name matches this glob.")
@click.option("--candidate-eps", type=float, default=None,
              help="Run every runtime with this eps instead of the checkpoint's (a deployment's config).")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="Write the table as JSON.")
@click.option("--markdown", "markdown_path", default=None, type=click.Path(dir_okay=False),
              help="Write the table as Markdown (a deployment review's page).")
@click.option("--isolation", type=click.Choice(["auto", "process", "none"]), default="auto", show_default=True,
              help="Where each runtime runs, as for `parity check`: auto (its own supervised process where it is "
                   "not torch), process, or none (in this process).")
@click.option("--quiet", "-q", is_flag=True, help="Only the verdict line (and the progress lines on stderr).")
@family_options
def runtimes(checkpoint, names, dtypes, layers, candidate_eps, json_path, markdown_path, isolation, quiet, family,
             family_force):
    """One table across every installed runtime: runtime x dtype -> verdict, worst/allowed, and the
    worst error over torch eager's at the same dtype (about 1x: rounding order; 1000x: a broken
    kernel). Each cell is `parity check --candidate RUNTIME --dtype DTYPE`; a line a cell on stderr
    as it ends; exit 1 where any cell fails, 2 where none could run or where parity's adapter of a
    runtime disagrees with the runtime's own public path (an `adapter` cell: parity's fault)."""
    json_path = _check_output_target(json_path, [checkpoint])
    markdown_path = _check_output_target(markdown_path, [checkpoint])
    from parity_cli.outputs import json_text, write_files
    from parity_cli.report.formats import runtimes_markdown
    from parity_cli.report.terminal import render_runtimes, runtime_progress
    from parity_cli.runtimes import table

    def progress(cell, done, total):
        click.echo(runtime_progress(cell, done, total), err=True)

    split = (lambda v: [p.strip() for p in v.split(",") if p.strip()] if v else None)
    result = table(checkpoint, split(names), split(dtypes), progress=progress, layers=layers,
                   candidate_eps=candidate_eps, isolation=isolation,
                   **({"family": family, "family_force": family_force} if family else {}))
    data = result.as_dict()
    outputs = {}
    if json_path:
        outputs[json_path] = json_text(data)
    if markdown_path:
        outputs[markdown_path] = runtimes_markdown(data)
    if outputs:
        write_files(outputs)
    render_runtimes(data, _console(), quiet=quiet)
    return result.verdict().exit_code  # report.gate's: an adapter cell (parity's fault) is 2


@cli.command()
@click.argument("checkpoint", type=click.Path())
@click.option("--family", default=None,
              help="Force a model family instead of the checkpoint's model_type: a family's name (layer_norm) or a "
                   "model type, read as the family that lists it (bert: layer_norm) or its derived family.")
@click.option("--eps", type=float, default=None, help="Override the checkpoint's eps.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="Write the result as JSON.")
def inspect(checkpoint, family, eps, json_path):
    """Family, eps and its source, and every norm layer's weight, without running anything."""
    from parity_cli import preflight

    json_path = _check_output_target(json_path, [checkpoint])
    preflight.inspect_inputs(checkpoint, family)
    from parity_cli.api import inspect as run_inspect
    from parity_cli.outputs import write_json

    info = _shown(run_inspect(checkpoint, family, eps))
    if json_path:
        write_json(info, json_path)
    from parity_cli.report.terminal import render_inspect

    render_inspect(info, _console())
    return EXIT_PASS


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
@click.option("--all", "every", is_flag=True,
              help="Also the families derived from transformers classes (configs/families/derived/, hundreds).")
def families(as_json, every):
    """Supported model families and the semantics the reference reproduces for each."""
    import json

    from parity_cli.model.families import derived_count, load_families, written_families

    listed = load_families() if every else written_families()
    rows = []
    for fam in listed.values():
        exceptions = sorted({p.name for p in fam.norms if p.semantics != fam.semantics})
        rows.append({
            "family": fam.name, "model_types": list(fam.model_types), "kind": fam.kind, "order": fam.order,
            "gain": "w" if not fam.gain_offset else f"{fam.gain_offset:g} + w", "inverse_sqrt": fam.semantics.inverse_sqrt,
            "eps_keys": list(fam.eps_keys), "eps_default": fam.eps_default,
            "eps_defaults": fam.eps_defaults, "norms": [p.name for p in fam.norms], "exceptions": exceptions,
            "description": fam.description, "source": fam.source, "derived_from": fam.derived_from,
        })
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return EXIT_PASS
    from parity_cli.report.layout import Column, table

    columns = [Column("family"), Column("kind", with_name=True), Column("model types", "types"),
               Column("numerics", "numerics"), Column("gain", "gain"), Column("eps key -> default", "eps"),
               Column("norms", "norms")]
    cells = []
    for r in rows:
        defaults = ", ".join(f"{k} {v:g}" for k, v in r["eps_defaults"].items())
        cells.append([r["family"], r["kind"], ", ".join(r["model_types"]),
                      f"{r['order']} order" + ("" if r["inverse_sqrt"] == "rsqrt" else ", pow(., -0.5)"),
                      r["gain"], f"{' | '.join(r['eps_keys'])} -> {r['eps_default']:g}" + (f" ({defaults})" if defaults else ""),
                      str(len(r["norms"])) + (f", {len(r['exceptions'])} with their own semantics" if r["exceptions"] else "")])
    console = _console()
    for line in table(columns, cells, console.width):
        console.print(line, soft_wrap=True)
    derived = derived_count()
    if derived and not every:
        console.print(f"and {derived} families derived from the model types' own transformers classes "
                      "(configs/families/derived/): parity families --all", soft_wrap=True)
    return EXIT_PASS


@cli.command()
def demo():
    """Check the bundled tiny checkpoint twice: a matching candidate, then a planted eps fault."""
    from parity_cli.api import CheckOptions
    from parity_cli.api import check as run_check
    from parity_cli.report.grouping import g
    from parity_cli.report.terminal import heading, render
    from parity_cli.resources import demo_checkpoint

    console = _console()
    path = demo_checkpoint()
    heading(console, "1. torch's fused rms_norm with the checkpoint's eps")
    good = run_check(path, CheckOptions(candidate="torch"))
    render(good.to_dict(), console)
    eps = good.header["eps"]["value"]
    heading(console, f"2. the same kernel built with eps 1e-6 instead of {g(eps)} (llama.cpp #2373)")
    bad = run_check(path, CheckOptions(candidate="torch", candidate_eps=1e-6))
    render(bad.to_dict(), console)
    console.print(
        "\nWhy: RMSNorm computes y = x / sqrt(q + eps) * g with q = mean(x^2). Against the eps-free "
        "result every component is scaled by A = sqrt(q / (q + eps)), so what matters is q/eps: "
        "A = 0.995 at q/eps = 100, 0.707 at 1, 0.0995 at 0.01. Normal activations have q/eps ~ 1e5 "
        "and hide a wrong eps; the 'tiny' stratum puts q/eps at 0.01..100 and exposes it."
    )
    ok = good.passed and not bad.passed
    return EXIT_PASS if ok else EXIT_FAIL


@cli.command("explain")
@click.argument("report_path", metavar="REPORT.json", type=click.Path())
@click.option("--checkpoint", "checkpoint", default=None, type=click.Path(),
              help="This machine's copy of the report's checkpoint (a CI artifact replayed elsewhere); its norm "
                   "tensors must match the report's fingerprint.")
@click.option("--candidate", default=None, help="The candidate to replay with. A plugin the report names "
                                                "(FILE.py:ATTR, MODULE:ATTR) runs only when named here again, or "
                                                "under --trust-report; built-ins run as recorded.")
@click.option("--reference", default=None, help="The reference to replay with; a plugin the report names runs only "
                                                "when named here again, or under --trust-report.")
@click.option("--trust-report", is_flag=True,
              help="Run the plugin code the report names (its candidate and reference). A report is data: "
                   "without this, replay never imports code a report names.")
@click.option("--candidate-checkpoint", default=None, type=click.Path(),
              help="This machine's copy of the report's --candidate-checkpoint.")
@click.option("--timeout", type=float, default=None,
              help="Seconds per layer before the candidate's process is killed [default: 120; inf: no limit]; "
                   "never taken from the report.")
@click.option("--isolation", type=click.Choice(["auto", "process", "none"]), default="auto", show_default=True,
              help="Where the candidate runs, as for check; never taken from the report.")
@click.option("--layers", "layer_names", multiple=True, help="Layers to explain (default: every failing layer).")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="Write the ladders as JSON.")
def explain_cmd(report_path, checkpoint, candidate, reference, trust_report, candidate_checkpoint, timeout, isolation,
                layer_names, json_path):
    """Rerun a saved report's failing layers one factor at a time (dtype, kernel, eps): one ladder
    per group of layers that fail the same way, each with its conclusion. The report is data: the
    plugin code it names runs only when named again (--candidate, --reference) or under
    --trust-report, and how the candidate is supervised (--isolation, --timeout) is never the file's."""
    from parity_cli import preflight
    from parity_cli.outputs import json_text, write_files
    from parity_cli.report.gate import load_report
    from parity_cli.report.replay import options_from_report, verify_fingerprint

    _check_output_target(json_path, [report_path])
    preflight.option_values(timeout=timeout)
    data = load_report(report_path)
    path, options = options_from_report(data, report_path, checkpoint, candidate, candidate_checkpoint,
                                        reference=reference, trust=trust_report, timeout=timeout, isolation=isolation)
    json_path = _check_output_target(json_path, [report_path, path, options.candidate_checkpoint, options.activations,
                                                 f"impl:{options.candidate}", f"impl:{options.reference}"])
    preflight.check_inputs(path, candidate=options.candidate, reference=options.reference,
                           candidate_checkpoint=options.candidate_checkpoint, dtype=options.dtype,
                           reference_dtype=options.reference_dtype, device=options.device,
                           reference_device=options.reference_device, family=options.family, strata=options.strata)
    names = list(layer_names) or [l["name"] for l in data["layers"] if l["status"] != "pass" and l["strata"]]
    if not names:
        click.echo(f"{report_path}: no failing layer to explain")
        return EXIT_PASS
    warning = verify_fingerprint(data, path, options, report_path)
    console = _console()
    if warning:
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    from parity_cli.explain import explain_groups
    from parity_cli.report.terminal import render_explain

    ladders = explain_groups(path, options, data, names)
    if json_path:
        write_files({json_path: json_text(_plain(ladders))})
    render_explain(ladders, console)
    return EXIT_PASS


def _plain(value):
    """Non-finite floats as the report writes them ("inf", "nan")."""
    from parity_cli.check.results import _jsonable

    return _jsonable(value)


@cli.command()
@click.argument("model", type=click.Path())
@click.option("--text", "text_path", default=None, type=click.Path(dir_okay=False), help="A text file to run.")
@click.option("--prompt", default=None, help="A text to run (instead of --text).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Tokens run, from the start of the text.")
@click.option("--rows-per-layer", type=click.IntRange(min=3, max=4096), default=96, show_default=True,
              help="Rows kept per layer: a third the smallest q, a third the largest, a third uniform.")
@click.option("--device", default="cpu", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--runtime", default="transformers", show_default=True,
              type=click.Choice(["transformers", "llama.cpp", "onnxruntime", "openvino", "mlx-lm", "litert"]),
              help="Where the model runs: transformers (the rows each norm layer's module sees), or inside a "
                   "deployed runtime (every norm node's input and output rows, and the eps and gains it used; "
                   "`parity check REFERENCE --runtime-capture FILE` judges them).")
@click.option("--tokens", "tokens_path", default=None, type=click.Path(dir_okay=False),
              help="Token ids to run (whitespace-separated integers) instead of --text/--prompt (--runtime only).")
@click.option("--precision", default=None, type=click.Choice(["f32", "bf16", "f16"]),
              help="--runtime openvino: the CPU plugin's inference precision (default: what the plugin runs on this "
                   "CPU, bf16 where it has avx512_bf16/AMX). The precision it really ran is stated and recorded; the "
                   "rows are judged at it.")
@click.option("-o", "--output", "out_path", required=True, type=click.Path(dir_okay=False),
              help="The safetensors file to write.")
def capture(model, text_path, prompt, max_tokens, rows_per_layer, device, seed, runtime, tokens_path, precision,
            out_path):
    """Run MODEL on real text and keep, per norm layer, a bounded sample of the rows it sees.

    MODEL is an HF model directory (full weights) or a llama.cpp .gguf file (F32, F16, BF16 or
    quantized tensors, an architecture transformers reads from GGUF): parity dequantizes the
    tensors the forward needs up to the last norm layer itself, and says when transformers' loader
    has to load the whole file instead. `parity check MODEL --activations FILE` probes with the
    rows, as does a check of another copy of the same model, GGUF or HF (the same norm layers, by
    name or by pattern where the layout differs, values equal within their storage dtypes' rounding;
    towers the copy lacks get no rows: the report states the match)."""
    from parity_cli import preflight
    from parity_cli.sources.remote import is_url

    if is_url(model):
        raise InputError(f"{model}: parity capture runs the model, which needs all of its weights on this machine; "
                         "download it first (hf download ORG/NAME --revision REV --local-dir DIR) and capture DIR")
    preflight.inspect_inputs(model)
    preflight.device_input(device)
    given = [p for p in (text_path, prompt, tokens_path) if p is not None]
    if len(given) != 1 or (tokens_path and runtime == "transformers"):
        raise InputError("parity capture: give --text FILE or --prompt TEXT (one of them)" + (
            "" if runtime == "transformers" else ", or --tokens FILE"))
    if runtime != "transformers" and device != "cpu":
        raise InputError(f"parity capture --runtime {runtime}: runs the runtime's CPU backend; --device is for "
                         "transformers")
    if precision is not None and runtime != "openvino":
        raise InputError(f"parity capture --precision: for --runtime openvino (its CPU plugin's inference precision); "
                         f"{runtime} computes in the model's own dtypes")
    outputs = _check_outputs({"-o": out_path}, [model] + [p for p in (text_path, tokens_path) if p])
    text = _read_text(text_path, max_tokens) if text_path else prompt
    tokens = _read_tokens(tokens_path, max_tokens) if tokens_path else None
    if runtime == "transformers":
        from parity_cli.probes.capture import capture as run
        from parity_cli.probes.capture import summary, write

        def record(stage):
            return run(model, text, max_tokens=max_tokens, rows_per_layer=rows_per_layer, device=device, seed=seed,
                       stage=stage)
    else:
        from parity_cli.probes.runtime_capture import record as run_inside
        from parity_cli.probes.runtime_capture import summary, write

        def record(stage):
            return run_inside(model, runtime, text=text, tokens=tokens, max_tokens=max_tokens,
                              rows_per_layer=rows_per_layer, seed=seed, stage=stage, precision=precision)
    with _stages() as stage:
        tensors, meta = record(stage)
        stage(f"writing {outputs['-o']}")
        write(tensors, meta, outputs["-o"])
    from parity_cli.report.layout import terminal_width, wrap

    console, width = _console(), terminal_width()
    lines = summary(out_path, tensors, meta)
    head = f"{out_path}: "
    if len(lines[-1]) > width and lines[-1].startswith(head):  # the last line what was captured, whole
        lines[-1:] = [f"wrote {out_path}", lines[-1][len(head):]]
    for line in lines:  # wrapped at spaces to the width (COLUMNS where not a terminal)
        for piece in wrap(escape(line), width, hanging=0):
            console.print(piece, soft_wrap=True, highlight=False)
    return EXIT_PASS


def _read_text(path, max_tokens: int) -> str:
    """At most what --max-tokens can use of a text file (64 bytes a token)."""
    from parity_cli.sources.jsonfile import regular_file

    regular_file(path, "the text", 1 << 30, "over the 1 GiB a text may have")
    try:
        with open(path, "rb") as fh:
            return fh.read(64 * max_tokens).decode("utf-8", errors="replace")
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror}") from None


def _read_tokens(path, max_tokens: int) -> list[int]:
    """The first max_tokens whitespace-separated integers of a token file (a number the bounded read
    cut in two is dropped, not taken as a smaller one)."""
    from parity_cli.sources.jsonfile import regular_file

    regular_file(path, "the token file", 1 << 30, "over the 1 GiB a token file may have")
    try:
        with open(path, "rb") as fh:
            data = fh.read(24 * max_tokens + 4096)
            whole = not fh.read(1)
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror}") from None
    words = data.decode("ascii", errors="replace").split()
    if not whole and data and not data[-1:].isspace():
        words = words[:-1]
    try:
        tokens = [int(w) for w in words[:max_tokens]]
    except ValueError:
        raise InputError(f"{path}: token ids are whitespace-separated integers") from None
    if not tokens:
        raise InputError(f"{path}: no token ids")
    return tokens


class _stages:
    """What a long command is doing: a transient status line on stderr where it is a terminal; where
    it is a pipe or a file, one line a stage (`parity capture: loading the model`), wrapped to the
    width, so a CI log shows where a run spent its minutes. An error is still one line, the last."""

    def __init__(self, command: str = "capture"):
        self.command = command

    def __enter__(self):
        self.console = _console(stderr=True)
        self.spinner = self.console.status("starting") if self.console.is_terminal else None
        if self.spinner is not None:
            self.spinner.start()
        return self

    def __call__(self, text: str) -> None:
        if self.spinner is not None:
            self.spinner.update(escape(text))
            return
        from parity_cli.report.layout import terminal_width, wrap

        for piece in wrap(escape(f"parity {self.command}: {text}"), terminal_width(stderr=True)):
            self.console.print(piece, soft_wrap=True, highlight=False)

    def __exit__(self, *exc):
        if self.spinner is not None:
            self.spinner.stop()
        return False


@cli.group()
def cache():
    """The cache of checkpoints read where they live (hf://, s3://, ...): the byte ranges fetched,
    keyed by commit and ETag, beside huggingface_hub's cache (PARITY_CACHE to move it)."""


@cache.command("info")
@click.option("--json", "as_json", is_flag=True, help="Print it as JSON.")
def cache_info(as_json):
    """Where the cache is, and per repository its snapshots and the bytes held."""
    import json

    from parity_cli.sources.remote import cache_info as info
    from parity_cli.sources.remote import human

    data = info()
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return EXIT_PASS
    click.echo(f"{data['path']}: {human(data['bytes_fetched'])} fetched, {human(data['bytes_on_disk'])} on disk")
    for s in data["stores"]:
        click.echo(f"  {s['store']}: {len(s['snapshots'])} snapshot(s), {s['files']} file(s), "
                   f"{human(s['bytes_fetched'])} fetched")
    return EXIT_PASS


@cache.command("verify")
def cache_verify():
    """Hash every cached range against the digest recorded when it was fetched (and every Hub file held
    whole against its ETag); a range that differs loses its claim and is fetched again when next read.
    Exit 1 where any did."""
    from parity_cli.sources.remote import cache_verify as verify

    data = verify()
    for blob, bad in data["dropped"]:
        click.echo(f"{data['path']}/{blob}: {bad} range(s) differ from what was fetched; dropped, fetched again "
                   "when next read")
    click.echo(f"{data['path']}: {data['ranges']} range(s) of {data['blobs']} file(s) checked, "
               f"{sum(bad for _, bad in data['dropped'])} dropped")
    return EXIT_FAIL if data["dropped"] else EXIT_PASS


@cache.command("clear")
def cache_clear():
    """Remove everything parity cached (huggingface_hub's own cache is left alone)."""
    from parity_cli.sources.remote import cache_clear as clear
    from parity_cli.sources.remote import cache_root, human

    freed = clear()
    click.echo(f"{cache_root()}: cleared ({human(freed)} on disk freed)")
    return EXIT_PASS


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
def implementations(as_json):
    """Built-in implementations and those installed packages register (entry point group
    parity_cli.backends.implementations), with where each comes from."""
    import json

    from parity_cli.backends.implementations import available

    rows = available()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return EXIT_PASS
    from rich.table import Table

    table = Table(show_edge=False, header_style="bold")
    for col in ("name", "source", "description"):
        table.add_column(col, no_wrap=col == "name", overflow="fold")
    for r in rows:
        table.add_row(escape(r["name"]), escape(r["source"]), escape(r["description"]))
    _console().print(table)
    return EXIT_PASS


@cli.command()
def schema():
    """Print the JSON Schema of the check report."""
    from parity_cli.resources import schema_path

    click.echo(schema_path().read_text(), nl=False)
    return EXIT_PASS


def main(argv: list[str] | None = None) -> None:
    import signal

    quiet_third_party()
    if argv is None:  # the real command line: what parity's children leave behind is parity's to end
        from parity_cli.lifetime import adopt_orphans

        adopt_orphans()

    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread (an embedding caller): its signals are its own
        pass
    try:
        code = cli.main(args=argv, prog_name="parity", standalone_mode=False)
    except InputError as exc:  # one line, even for a path with a newline or an ESC in it
        click.echo(f"parity: error: {printable(_shown(str(exc)))}", err=True)  # a cache path shown as its URL
        code = EXIT_INPUT
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except click.ClickException as exc:
        click.echo(f"parity: error: {printable(' '.join(exc.format_message().split()))}", err=True)
        code = EXIT_INPUT
    except (KeyboardInterrupt, click.exceptions.Abort):
        code = _signal_exit("interrupted", EXIT_INTERRUPT, hard=argv is None)
    except Terminated:
        code = _signal_exit("terminated", EXIT_TERMINATED, hard=argv is None)
    except Exception as exc:  # a bug or an input no check anticipated: still one line, still exit 2
        import os

        if os.environ.get("PARITY_DEBUG"):
            raise
        first = printable((f"{type(exc).__name__}: {exc}".splitlines() or [""])[0])[:300]
        click.echo(f"parity: internal error: {first} (rerun with PARITY_DEBUG=1 for the traceback)", err=True)
        code = EXIT_INPUT
    if argv is None:
        _end_leftovers()
    sys.exit(code if isinstance(code, int) else 0)


def _end_leftovers() -> None:
    """The real command line, at its end: every supervised child killed, then whatever parity adopted
    (lifetime.adopt_orphans: a candidate's process whose parent died by itself) and its tree. The fork
    server and the resource tracker end by themselves when parity exits; nothing else of parity's may
    outlive it (issue 48)."""
    import os

    supervisor = sys.modules.get("parity_cli.isolation.supervisor")
    if supervisor is None:
        return
    supervisor.kill_all()
    from parity_cli.isolation.tree import children, kill_tree

    keep = set(supervisor.helpers())
    for pid in children(os.getpid()):
        if pid not in keep:
            kill_tree(pid)


def _shown(data):
    """A report as written and printed: a remote checkpoint's cache paths as its URL."""
    remote = sys.modules.get("parity_cli.sources.remote")
    return remote.shown_in(data) if remote else data


def _signal_exit(word: str, code: int, hard: bool) -> int:
    """After Ctrl-C or SIGTERM: children killed, one line, and out at once. The interpreter's
    normal shutdown is skipped on purpose: torch's static destructors can abort (SIGABRT,
    'terminate called without an active exception') when a run is cut short mid-layer, and
    nothing is left to flush: outputs are written all-or-nothing and temporary files are gone.
    `hard` only for the real command line: a caller of main(argv) keeps its process."""
    import os

    if "parity_cli.isolation.supervisor" in sys.modules:
        sys.modules["parity_cli.isolation.supervisor"].kill_all()
    click.echo(f"parity: {word}", err=True)
    if not hard:
        return code
    _end_leftovers()
    _remove_multiprocessing_dir()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _remove_multiprocessing_dir() -> None:
    """multiprocessing's temporary directory (/tmp/pymp-*: the fork server's socket), which its own
    exit handler removes and the hard exit skips: one was left behind by every interrupted run."""
    process = sys.modules.get("multiprocessing.process")
    tempdir = getattr(process.current_process(), "_config", {}).get("tempdir") if process else None
    if tempdir:
        import shutil

        shutil.rmtree(tempdir, ignore_errors=True)


if __name__ == "__main__":
    main()
