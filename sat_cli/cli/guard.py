"""How a `sat` command runs: its errors become one ``sat: error:`` paragraph and an exit code by
exception type (docs/reliability.md, "Exit codes"); library log noise is quieted; its options
and arguments are declared with a typed spec of :mod:`sat_cli.util.options` (``opt``, ``arg``)
and a usage error is one line too (``SatGroup``)."""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup

from sat_cli.util.options import Spec


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``message`` as the ``sat: error:`` paragraph (secrets masked: an error may quote an
    input, e.g. an override or a URL) and exit with ``code``."""
    from sat_cli.tracking.params import redact_text
    from sat_cli.tracking.remote_text import escape_controls

    try:  # control characters escaped: a message may quote a server's or a plug-in's text
        typer.echo(f"sat: error: {escape_controls(redact_text(message), keep=chr(10))}", err=True)
    except OSError:  # no terminal any more (SIGHUP)
        pass
    raise typer.Exit(code)


def exit_with(fn) -> NoReturn:
    """``guard(fn(env))``, then exit with its code; ``env``: the environment before ``guard``
    sets sat's own defaults (MLflow telemetry off in-process), for a server's subprocess."""
    import os

    env, code = dict(os.environ), [0]
    guard(lambda: code.__setitem__(0, fn(env)))
    raise typer.Exit(code[0])


def guard(fn) -> None:
    """Run a command body: user errors → message + exit 2; runtime faults (a dead or failing
    trainer or engine, a failed checkpoint write) → message + exit 1; Ctrl-C → exit 130. By
    exception type; the library modules that define them import no heavy library."""
    from sat_cli.util.quiet import quiet_libraries

    quiet_libraries()
    from sat_cli.checkpoints.state import CheckpointError
    from sat_cli.config import ConfigError
    from sat_cli.engines.base import EngineError
    from sat_cli.errors import RunFailed, UserError, as_failure, without_tracebacks
    from sat_cli.tasks.datafiles import DataError
    from sat_cli.tracking.store import TrackingError

    try:
        fn()
    except (UserError, ConfigError, DataError, TrackingError, CheckpointError) as exc:
        fail(str(exc), getattr(exc, "code", 2))
    except (RunFailed, EngineError) as exc:  # TrainerError (MegatronWorkerError, R3Error) included
        fail(without_tracebacks(str(exc)), getattr(exc, "code", 1))
    except Exception as exc:  # a path, disk or memory problem no layer below named (OSError,
        err = as_failure(exc)  # safetensors' "No space left on device", MemoryError): 1 line
        if err is None:
            raise
        fail(str(err), err.code)
    except KeyboardInterrupt as exc:
        code = getattr(exc, "code", 130)
        name = getattr(exc, "signame", None)
        try:
            typer.echo("sat: interrupted" + (f" ({name})" if name else ""), err=True)
        except OSError:  # the terminal is gone (SIGHUP)
            pass
        raise typer.Exit(code) from None


def opt(spec: Spec, default: Any, *decls: str, help: str | None = None, **kw: Any) -> Any:
    """A typer option whose values ``spec`` parses (the declaration that covers it)."""
    return typer.Option(default, *decls, help=help, parser=spec, **kw)


def arg(spec: Spec, default: Any, help: str | None = None) -> Any:
    """A typer argument whose values ``spec`` parses."""
    return typer.Argument(default, help=help, parser=spec)


class SatGroup(TyperGroup):
    """A usage error (an unknown option, a bad value, a missing argument) is one
    ``sat: error:`` line and exit 2, like every other refusal, not click's usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        from typer._click.exceptions import BadParameter, ClickException, NoArgsIsHelpError
        from typer.exceptions import Abort

        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except NoArgsIsHelpError as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            path = ctx.command_path if ctx is not None else "sat"
            line = " ".join(exc.format_message().split())
            param = getattr(exc, "param", None)
            if isinstance(exc, BadParameter) and param is not None and exc.message:
                name = param.opts[0] if param.param_type_name == "option" else param.name.upper()
                line = f"{name}: {' '.join(exc.message.split())}"
            from sat_cli.tracking.params import redact_text
            from sat_cli.tracking.remote_text import escape_controls

            line = escape_controls(redact_text(line))
            try:
                sys.stderr.write(f"sat: error: {line} (see `{path} --help`)\n")
            except OSError:
                pass
            sys.exit(exc.exit_code)
        except Abort:
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)
