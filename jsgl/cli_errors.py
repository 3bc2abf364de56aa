"""How a `jsgl` command ends when it fails: a refusal jsgl raises on purpose (``jsgl.errors.RefusedError``: an
unsupported model, options that do not fit together or not this machine, a missing model, an optional package not
installed) is one line on stderr, ``jsgl COMMAND: what is wrong and what to do``, and exit status 2, as argparse's
own refusals; Ctrl-C is exit status 130; anything else is a bug: its traceback, a line saying so, exit status 1.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

from jsgl.errors import RefusedError

REFUSED_STATUS = 2  # argparse's status for a bad command line: a refusal is the same kind of mistake
BUG_STATUS = 1
INTERRUPTED_STATUS = 130  # 128 + SIGINT, what a shell reports for a process Ctrl-C ended
BUG_LINE = "jsgl: this is a bug in jsgl; please report it with the traceback above"


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (a message of several lines joined with '; ')."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def run_reporting(command: str, handler: Callable[[], int]) -> int:
    """``handler()``'s exit status, or the status of the way it failed, said on stderr as the module says."""
    try:
        return handler()
    except RefusedError as exc:
        sys.stdout.flush()  # what the command printed before it was refused comes first
        print(f"jsgl {command}: {one_line(exc)}", file=sys.stderr)
        return REFUSED_STATUS
    except KeyboardInterrupt:
        return INTERRUPTED_STATUS
    except Exception:
        sys.stdout.flush()
        traceback.print_exc()
        print(BUG_LINE, file=sys.stderr)
        return BUG_STATUS
