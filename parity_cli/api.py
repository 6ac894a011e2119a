"""The library API (interim: the stages moved to parity_cli.pipeline; this commit only moves)."""

from parity_cli.pipeline import *  # noqa: F401,F403
from parity_cli.pipeline import explain  # noqa: F401
