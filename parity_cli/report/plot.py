"""--plot: candidate error against q/eps, the picture that shows where eps dominates.

matplotlib is optional (`pip install matplotlib`, or the `plot` extra from a checkout:
`pip install -e '.[plot]'`); it is imported only here."""

from __future__ import annotations

import math
from pathlib import Path

from parity_cli.errors import InputError

SUFFIXES = (".svg", ".png")


def check_target(path: str) -> None:
    """Before the run: a wrong suffix or a missing matplotlib must not cost a whole check."""
    if Path(path).suffix.lower() not in SUFFIXES:
        raise InputError(f"--plot {path}: the file must end in .svg or .png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install matplotlib") from None


def write_plot(report, path: str) -> None:
    """The plot alone, written as the report set is (all or nothing, through a link)."""
    from parity_cli.outputs import write_files

    write_files({path: render_plot(report, path)}, "plot")


def render_plot(report, path: str) -> bytes:
    """The image file's bytes, in the format `path`'s suffix names, so that the check's whole
    set of outputs (json, junit, markdown, plot) is written at once or not at all.

    Every probe row of every layer: x = q/eps (log), y = max|cand - ref| / max|ref| in the row
    (log), coloured by stratum; the relative tolerance as a band; the attenuation
    A = sqrt(q/(q+eps)) and the error of an eps-free norm, 1 - A, as curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tol = report.header["tolerance"]
    fig, ax = plt.subplots(figsize=(10, 6))
    floor = 1e-9
    by_stratum: dict[str, tuple[list, list]] = {}
    skipped = 0
    for layer in report.layers:
        for s in layer.strata:
            if not s.row_q_over_eps:
                continue
            xs, ys = by_stratum.setdefault(s.name, ([], []))
            for q, e in zip(s.row_q_over_eps, s.row_error):
                if not (q > 0 and math.isfinite(q)):
                    skipped += 1  # zero rows have q/eps = 0: no place on a log axis
                    continue
                xs.append(q)
                ys.append(1e3 if math.isinf(e) else max(e, floor))
    for name, (xs, ys) in sorted(by_stratum.items()):
        if name == "captured":  # real rows (--activations): marked apart, drawn on top
            ax.scatter(xs, ys, s=28, marker="x", color="black", zorder=5, label="captured (real rows)")
        else:
            ax.scatter(xs, ys, s=9, alpha=0.6, label=name)
    lo = min((min(xs) for xs, _ in by_stratum.values() if xs), default=1e-3)
    hi = max((max(xs) for xs, _ in by_stratum.values() if xs), default=1e9)
    grid = [10 ** (math.log10(lo / 3) + k * (math.log10(hi * 3) - math.log10(lo / 3)) / 400) for k in range(401)]
    ax.axhspan(floor, max(tol["rtol"], floor), color="green", alpha=0.08,
               label=f"within rtol {tol['rtol']:g} (atol {tol['atol']:g} adds near zero)")
    ax.axhline(max(tol["rtol"], floor), color="green", lw=1)
    ax.plot(grid, [max(1 - 1 / math.sqrt(1 + 1 / r), floor) for r in grid], "k--", lw=1,
            label="1 - A: error of an eps-free norm")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("q / eps of the probe row (q = mean of squares)")
    ax.set_ylabel("max |cand - ref| / max |ref| in the row")
    ax2 = ax.twinx()
    ax2.plot(grid, [1 / math.sqrt(1 + 1 / r) for r in grid], color="tab:purple", lw=1.5)
    ax2.set_ylabel("attenuation A = sqrt(q / (q + eps))", color="tab:purple")
    ax2.set_ylim(0, 1.05)
    for q, a in ((0.01, 0.099504), (1, 0.707107), (100, 0.995037)):
        ax2.annotate(f"{a:g}", (q, a), textcoords="offset points", xytext=(4, -10), fontsize=7, color="tab:purple")
    cand = report.header["candidate"]
    ax.set_title(f"{Path(report.header['checkpoint']['path']).name}: {cand['impl']} {cand['dtype']} vs "
                 f"{report.header['reference']['impl']} ({len(report.layers)} layers"
                 + (f", {skipped} zero rows not shown" if skipped else "") + ")", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=5)
    fig.tight_layout()
    import io

    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format=Path(path).suffix.lower().lstrip("."))
    finally:
        plt.close(fig)
    return buffer.getvalue()
