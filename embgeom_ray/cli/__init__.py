"""The command line: ``embgeom COMMAND [options]``, one module per command.

=============  ==========================================================================
command        what it does
=============  ==========================================================================
``analyze``    measure a model's embeddings over a corpus into a run directory
``merge``      merge complete runs over disjoint corpora into the run over their union
``compare``    compare complete runs layer by layer
``report``     (re)draw a run's plots and ``report.html``
``reanalyze``  keep a watch list of models analysed over a corpus (cron, KubeRay)
=============  ==========================================================================

Each command's module has ``build_parser(prog)`` and ``main(argv, prog) -> exit status``; the
same parsers serve ``embgeom COMMAND`` (the console command the package installs),
``python -m embgeom_ray COMMAND`` (anywhere the package is importable) and, in a checkout,
``python -m jobs.COMMAND`` (what ``ray job submit --working-dir .`` runs). Those entry points
end their process with :func:`exit_process`.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

from .. import sigterm
from ..storage import as_user_error
from ..version import __version__

#: the commands, in the order ``embgeom --help`` lists them, with their one-line summaries
COMMANDS: dict[str, str] = {
    "analyze": "measure a model's embeddings over a corpus into a run directory",
    "merge": "merge complete runs over disjoint corpora into the run over their union",
    "compare": "compare complete runs layer by layer",
    "report": "(re)draw a run's plots and report.html",
    "reanalyze": "keep a watch list of models analysed over a corpus",
}

def configure_logging(verbose: bool) -> None:
    """A command's logging: INFO with ``-v/--verbose``, else WARNING, one line a record."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )



#: the exit status of a command interrupted by Ctrl-C (SIGINT): 128 + 2, as shells report it
INTERRUPTED = 130
#: the exit status of a command ended by SIGTERM (``ray job stop``, a pod deleted, ``kill``):
#: 128 + 15. The signal is ``SystemExit(15)``, or whatever Ray's ``ray.get``/``ray.wait`` made
#: of it (:mod:`embgeom_ray.sigterm`)
TERMINATED = 143
#: the signal each of those statuses ends the process by (:func:`exit_process`)
_SIGNALS = {INTERRUPTED: signal.SIGINT, TERMINATED: signal.SIGTERM}


_AGAIN = (
    "the same command run again resumes from the last checkpoint (a merge or comparison "
    "starts over)"
)


def exit_status(run: Callable[[], object]) -> int:
    """A command's exit status: 0 when ``run()`` returns; a user error's status (2) after its
    message as one line on stderr (:func:`~embgeom_ray.storage.as_user_error`);
    :data:`INTERRUPTED` after one line for Ctrl-C, :data:`TERMINATED` for SIGTERM, whatever
    exception it became on its way out (:mod:`embgeom_ray.sigterm`: ``SystemExit(1)`` out of
    ``ray.wait``, an error of a cleanup it interrupted); anything else keeps its traceback."""
    with sigterm.installed():
        try:
            run()
        except KeyboardInterrupt:
            if sigterm.received():
                return _terminated()
            print(f"interrupted: {_AGAIN}", file=sys.stderr)
            return INTERRUPTED
        except SystemExit as exc:
            if exc.code != signal.SIGTERM and not sigterm.received():
                raise
            return _terminated()
        except Exception as exc:
            if sigterm.received():
                return _terminated()
            error = as_user_error(exc)
            if error is None:
                raise
            print(f"error: {error}", file=sys.stderr)
            return error.exit_code
    return 0


def _terminated() -> int:
    print(f"terminated (SIGTERM): {_AGAIN}", file=sys.stderr)
    return TERMINATED


def exit_process(code: int) -> NoReturn:
    """End a command's own process with exit status ``code``, skipping Python's finalisation.

    What the interpreter's exit does that matters is done first: Ray shut down where this
    process started or joined one (a private local Ray is stopped, as Ray's own ``atexit``
    hook would), logging's handlers flushed and closed, stdout and stderr flushed. What is
    left, tearing down every module and collecting torch's, transformers' and Ray's objects,
    took ~2 s of CPU and ~1.8 s of wall time after a MiniLM job on a private Ray, and nothing
    a command writes waits for it: every output is written and renamed into place before
    ``main`` returns. For the commands' entry points only (their ``__main__`` and the console
    command), never where ``main`` is called from Python; a traceback (exit status 1) leaves
    through Python's own exit, and so does a process under a profiler or tracer
    (``python -m cProfile``, ``trace``, coverage), whose results its ``atexit`` writes.
    :data:`INTERRUPTED` and :data:`TERMINATED` end the process by SIGINT or SIGTERM itself, as
    an uncaught ``KeyboardInterrupt`` does, so that a shell running it sees the signal (its
    loop or script stops instead of going on); its status reads 130 or 143 there."""
    if sys.getprofile() is not None or sys.gettrace() is not None or "coverage" in sys.modules:
        sys.exit(code)
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        from ..distributed.cluster import shutdown_ray

        shutdown_ray()  # a private local Ray's monitor first: 1 s less (its docstring)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing left to say
            pass
    if code in _SIGNALS:
        # end by the signal itself, as an uncaught KeyboardInterrupt does: a shell running
        # the command in a loop or a script then stops too, instead of going on to the next
        signal.signal(_SIGNALS[code], signal.SIG_DFL)
        os.kill(os.getpid(), _SIGNALS[code])
    os._exit(code)


def console() -> NoReturn:
    """The ``embgeom`` console command: :func:`main`, then :func:`exit_process`."""
    exit_process(main())


USAGE = "usage: embgeom {" + ",".join(COMMANDS) + "} [options]   (embgeom COMMAND --help)"


def _help() -> str:
    rows = "\n".join(f"  {name:<10} {summary}" for name, summary in COMMANDS.items())
    return (
        f"{USAGE}\n\nembgeom_ray {__version__}: exact corpus-scale geometry of transformer "
        f"contextual embeddings, on Ray.\n\ncommands:\n{rows}\n"
    )


def main(argv: list[str] | None = None) -> int:
    """``embgeom COMMAND [options]``: the command's ``main`` with the rest of ``argv``."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(_help(), end="", file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "--version":
        print(f"embgeom_ray {__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"{USAGE}\nembgeom: error: unknown command {command!r}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"{__name__}.{command}")
    return module.main(rest, prog=f"embgeom {command}")
