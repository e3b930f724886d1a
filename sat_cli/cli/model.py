"""`sat model fetch`: download a Hugging Face model into the cache every run reads hub ids from
(or into a folder), before a run on nodes without the network (docs/cluster.md). Registered on
the app by :mod:`sat_cli.cli`."""

from __future__ import annotations

import typer

from sat_cli.cli.guard import SatGroup, arg, guard, opt
from sat_cli.util.options import PATH, Text

model_app = typer.Typer(
    name="model",
    cls=SatGroup,
    help="Models from the Hugging Face hub: fetch one before a run (docs/cluster.md).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@model_app.command("fetch")
def fetch_cmd(
    hub_id: str = arg(Text("name", max_len=200), ..., help="a hub id, e.g. Qwen/Qwen3-0.6B-Base"),
    to: str = opt(PATH, None, "--to", help="a folder to download into (default: the HF cache)"),
    revision: str = opt(
        Text("name", max_len=200), None, "--revision", help="branch, tag or commit (default main)"
    ),
) -> None:
    """Download HUB_ID (resumable, with a progress bar) into the Hugging Face cache ($HF_HOME),
    where `sat train model.path=HUB_ID` finds it offline, or into --to DIR; prints the folder
    and the commit it is pinned to."""
    from sat_cli.errors import UserError
    from sat_cli.models import hub

    def body() -> None:
        if not hub.is_hub_id(hub_id):
            raise UserError(f"{hub_id!r} is not a hub id (org/name)")
        if hub.offline():
            raise UserError("HF_HUB_OFFLINE is set: `sat model fetch` needs the network")
        try:
            snap = hub.fetch(hub_id, revision, to)
        except (OSError, ValueError) as exc:
            reason = " ".join(str(exc).split())[:300]
            raise UserError(f"could not fetch {hub_id}: {reason}") from None
        typer.echo(f"{snap.hub_id} at revision {snap.revision}: {snap.path}")

    guard(body)
