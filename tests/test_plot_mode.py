"""--plot writes its file as every other output does: mode 0666 & ~umask (not mkstemp's 0600),
atomically (a temp file in the same directory, then os.replace), nothing left on failure."""

import os
import stat

import pytest

pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the plot extra)")


@pytest.fixture(scope="module")
def report():
    from parity_cli import api
    from parity_cli.resources import demo_checkpoint

    return api.check(demo_checkpoint(), layers="model.norm")


@pytest.fixture
def umask():
    """umask(value) sets the process umask for one test; the old one is restored after."""
    saved = os.umask(0o022)
    yield os.umask
    os.umask(saved)


@pytest.mark.parametrize("suffix", [".svg", ".png"])
def test_plot_mode_follows_umask_like_other_outputs(report, tmp_path, umask, suffix):
    from parity_cli.report.plot import write_plot

    umask(0o022)
    out = tmp_path / f"errors{suffix}"
    write_plot(report, str(out))
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert out.stat().st_size > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no temp file left


def test_plot_mode_with_a_stricter_umask(report, tmp_path, umask):
    from parity_cli.report.plot import write_plot

    umask(0o027)
    out = tmp_path / "errors.svg"
    write_plot(report, str(out))
    assert stat.S_IMODE(out.stat().st_mode) == 0o640


def test_plot_replaces_an_existing_file(report, tmp_path, umask):
    from parity_cli.report.plot import write_plot

    umask(0o022)
    out = tmp_path / "errors.svg"
    out.write_text("old")
    write_plot(report, str(out))
    assert out.read_text().lstrip().startswith("<?xml") and stat.S_IMODE(out.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_failed_plot_leaves_no_partial_file(report, tmp_path, monkeypatch):
    """savefig dies half way: the old file is untouched and no temp file remains."""
    from matplotlib.figure import Figure

    from parity_cli.report.plot import write_plot

    out = tmp_path / "errors.svg"
    out.write_text("old")

    def half_then_fail(self, fh, *args, **kwargs):
        fh.write(b"<svg partial")
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(Figure, "savefig", half_then_fail)
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_plot(report, str(out))
    assert out.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_unwritable_directory_is_an_input_error(report, tmp_path):
    from parity_cli.errors import InputError
    from parity_cli.report.plot import write_plot

    (tmp_path / "a-file").write_text("x")  # a missing directory is made; one under a file cannot be
    with pytest.raises(InputError):
        write_plot(report, str(tmp_path / "a-file" / "errors.svg"))
