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
