"""Argument parsing shared by the ``mokgen`` command and ``mokgen tune``: a usage error is one line
``mokgen: error: ...`` with exit status 2, like every other error of the command line. No imports beyond the
standard library, so neither command's start pays for the other's modules."""

from __future__ import annotations

import argparse
import sys

EXIT_ERROR = 2


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line ``mokgen: error: ...`` (exit 2) like every other error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"mokgen: error: {message} (see {self.prog} --help)", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_ERROR)


def positive_int(what: str = ""):
    """An argparse ``type`` accepting integers >= 1; ``what`` (e.g. "parallel compiles") goes into the message."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"must be a positive integer{f' ({what})' if what else ''}, "
                                             f"got {text!r}")
        return n

    parse.__name__ = "positive_int"
    return parse
