"""parity-cli: numerical parity checks for normalization layers across implementations.

The library API lives in :mod:`parity_cli.api`; the CLI is a thin shell over it. The stages are
packages, and imports run one way down the data flow (README, Layout; pyproject.toml's
[tool.importlinter]). An import inside a function is there for start-up time only: torch,
transformers, onnx and the stages that need them load when a command needs them, so that
``parity --help`` stays instant (tests/test_cli.py)."""

__version__ = "0.1.0"
