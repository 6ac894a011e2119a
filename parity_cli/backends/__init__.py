"""Stage 4: what computes a norm: the float64 oracle, the built-in candidates and user plugins."""


def distribution_version(*names: str) -> str | None:
    """"NAME VERSION" of the first of these distributions that is installed, read from its metadata
    (nothing imported): what a runtime built-in and `parity runtimes` state of the package."""
    from importlib.metadata import PackageNotFoundError, version

    for name in names:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return None


# --- the runtime protocol ---------------------------------------------------------------------------
# A runtime is one file under parity_cli/backends/ that declares `RUNTIME = Runtime(...)` and defines
# the functions below; `registered()` finds it (as Polygraphy keeps backend/<runtime>/runner.py behind
# one BaseRunner), so adding a runtime touches no other file.
#   prepare(layer, weight, bias, eps, **args) -> (x -> y)      required: the norm in the runtime
#   check_layer(layer, dtype)                                   what it cannot build: one InputError line
#   describe(device, **args) -> dict                            what the report states (version, computes_in)
#   public_path(layer, weight, bias, eps) -> (x -> y)           the norm through the runtime's own public
#                                                               path (a deployment's), apart from prepare:
#                                                               the other side of its differential test
#   computes_in(dtype, described) -> str                        what it really computes in ("f32")
#   notes(described) -> list[str]                               warnings of what describe() found

from dataclasses import dataclass, field  # noqa: E402


@dataclass(frozen=True)
class Runtime:
    name: str  # --candidate NAME, a row of `parity runtimes`
    summary: str  # what it runs, in a line (`parity runtimes`, `parity implementations`)
    package: str  # the module whose presence says it is installed (find_spec: nothing imported)
    install: str  # the line that installs it
    distributions: tuple = ()  # where its version is read (default: the package's own name)
    requires: tuple = ()  # the modules --candidate NAME needs (default: the package)
    extra: str | None = None  # pyproject's extra that installs it, where it has one
    needs: str = ""  # "vLLM's kernels": how a missing install is said
    args: dict = field(default_factory=dict)  # --candidate-arg KEY -> the values it takes, the default first
    deviations: tuple = ()  # args that simulate a deployment's deviation: its failure is asked for, not checked
    public: str = ""  # its public path, in its own words ("ov.convert_model of the module")
    header: str = "runtime"  # the report's candidate key for describe()'s dict
    order: int = 50  # where its row sits in `parity runtimes`
    start_seconds: float = 0.0  # what a process pays before its first cell (imports, a first compile): the
    # table starts the costliest runtimes first, so that they do not end the run alone


_FOUND: dict = {}


def refuse_unbuilt(who: str, layer, kinds: tuple, built: str) -> None:
    """The one line a runtime file says for a layer it does not build: a kind outside `kinds`, a
    per-channel kind (BatchNorm, GroupNorm, a gated norm) with a gain of more than one axis, channels
    that do not split evenly into the layer's groups. `built`: what the runtime builds ("graph", "model")."""
    from parity_cli.errors import InputError

    if layer.kind not in kinds:
        raise InputError(f"{who}: has no {layer.kind} {built} here ({', '.join(kinds)} are built); {layer.name} is a "
                         f"{layer.kind}")
    if layer.kind in ("batch_norm", "group_norm", "gated_rms_norm") and layer.weight is not None \
            and layer.weight.dim() > 1:
        raise InputError(f"{who}: {layer.name} is a {layer.kind} with a {layer.weight.dim()}-D gain; its {built} "
                         "takes one value a channel")
    if layer.kind in ("group_norm", "gated_rms_norm") and (layer.groups < 1 or layer.dim % layer.groups):
        raise InputError(f"{who}: {layer.name} has {layer.dim} channels in {layer.groups} groups; its {built} "
                         "splits the channels evenly")


def registered() -> dict:
    """{name: module} of every runtime file of this package, in table order (imported once: each
    file imports its runtime lazily, so this costs no torch, no runtime)."""
    if not _FOUND:
        import importlib
        import pkgutil

        found = []
        for info in pkgutil.iter_modules(__path__):
            module = importlib.import_module(f"{__name__}.{info.name}")
            runtime = getattr(module, "RUNTIME", None)
            if isinstance(runtime, Runtime):
                found.append((runtime.order, runtime.name, module))
        _FOUND.update({name: module for _, name, module in sorted(found, key=lambda t: (t[0], t[1]))})
    return _FOUND


def runtime(name: str):
    """The module of a registered runtime, or None."""
    return registered().get(name)


def hook(name: str, what: str):
    """A registered runtime's function `what` (prepare, check_layer, describe, public_path, ...), or None."""
    module = runtime(name)
    return None if module is None else getattr(module, what, None)


def call_with(fn, *args, **options):
    """fn(*args, **the options its signature takes): describe(device, precision=...) is given the
    --candidate-arg values it names, and no others."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(*args)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn(*args, **options)
    return fn(*args, **{k: v for k, v in options.items() if k in params})
