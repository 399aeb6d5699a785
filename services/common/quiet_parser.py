"""An argparse parser that raises instead of printing and exiting, for the layout prechecks.

A precheck reads a few flags of a command line its command's own parser reads again; on any
problem it must stay silent and leave the report to that parser.
"""

from __future__ import annotations

import argparse
from typing import NoReturn


class QuietParser(argparse.ArgumentParser):
    """Parses known flags; `error` raises ValueError rather than printing usage and exiting."""

    def __init__(self) -> None:
        super().__init__(add_help=False, allow_abbrev=False)

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)
