"""Data the tool reads (families, tolerances, probe strata).

A package only so that an installed wheel carries it as ``parity_cli.configs``."""
