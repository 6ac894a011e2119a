"""parity-cli: numerical parity checks for normalization layers across implementations.

The library API lives in :mod:`parity_cli.api`; the CLI is a thin shell over it.
Nothing here imports torch, so ``parity --help`` stays instant."""

__version__ = "0.1.0"
