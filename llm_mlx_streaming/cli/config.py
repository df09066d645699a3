"""`llm mlxs config`: show, set and unset settings."""

from __future__ import annotations

import json
import shutil
import textwrap

import click

from typing import Optional

from ..options import registry
from ..errors import MlxStreamError, SettingsError
from ..options.knobs import BUNDLED_NAME, grouped
from ..options.settings import CONFIG_KEYS, Settings, budget_bytes, check_setting_name, explicit_keys, load_settings, set_value, settings_path, unset_value

from .group import mlxs
from ..sizes import format_size
from ..client.client import running_server


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "(unset)" if value is None else str(value)


def _shown(key: str, value) -> str:
    """A setting's value as `config` lists it ("auto" budgets with their size here)."""
    if key == "memory_budget" and value == "auto":
        try:
            return f"auto ({format_size(budget_bytes(value))})"
        except SettingsError:
            return "auto (unknown memory size)"
    return _fmt(value)


@mlxs.command(context_settings={"ignore_unknown_options": True})
@click.argument("key", required=False)
@click.argument("value", required=False)
@click.option("--unset", "unset_key", metavar="KEY", help="Reset KEY to its default")
@click.option("-m", "--model", help="Apply KEY VALUE (or --unset KEY) to this model on the running server alone "
              "(the settings file keeps every model's value)")
@click.option("--long", "long_", is_flag=True, help="Each setting's whole description")
@click.option("json_", "--json", is_flag=True, help="Output as JSON")
def config(key, value, unset_key, model, long_, json_):
    """Show or change settings.

    \b
    llm mlxs config                 every setting: its value and what it does, in brief
    llm mlxs config --long          ... and the whole description of each
    llm mlxs config KEY             one setting's value (its description on stderr)
    llm mlxs config KEY VALUE       validate and save
    llm mlxs config --unset KEY     back to the default
    llm mlxs config KEY VALUE -m M  on the running server, for model M alone

    A running server takes a change of an engine option at once: every loaded model
    (each within its share of the memory budget), or with --model that model alone
    (`/api/ps` shows each model's slots and options).
    """
    if model:
        _model_change(unset_key or key, None if unset_key else value, model)
        return
    if unset_key:
        if key or value:
            raise click.UsageError("--unset takes only the KEY")
        unset_value(unset_key)
        click.echo(f"{unset_key} reset to its default", err=True)
        _push_to_server(unset_key, None)
        return
    if key and value is not None:
        check_setting_name(key)
        settings = load_settings()
        if key == "default_model":
            value = registry.canonical_name(value, settings)
            if value != BUNDLED_NAME:
                registry.checkpoint_for(value, settings)  # its directory must still be there
        settings = set_value(key, value, settings)
        click.echo(f"{key} = {_fmt(getattr(settings, key))}", err=True)
        _push_to_server(key, getattr(settings, key))
        return
    settings = load_settings()
    explicit = explicit_keys()
    if key:
        check_setting_name(key)
        click.echo(_fmt(getattr(settings, key)))
        state = "set" if key in explicit else "the default"
        click.echo(f"{key} ({state}): {Settings.model_fields[key].description}", err=True)
        return
    rows = [
        {
            "key": k,
            "value": getattr(settings, k),
            "default": k not in explicit,
            "description": Settings.model_fields[k].description,
        }
        for k in CONFIG_KEYS
    ]
    if json_:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"Settings file: {settings_path()}  (* set there; the others are defaults)")
    _settings_table(rows, long_)


VALUE_WIDTH = 18  # the value column: a longer value (a list of hosts) is cut; `config KEY` shows it whole


def _settings_table(rows: list[dict], long_: bool) -> None:
    """The settings under their groups (knobs.GROUPS): a mark for those set, the name, the
    value and the description, cut to the terminal's width (`long_`: whole, wrapped)."""
    width = shutil.get_terminal_size((100, 24)).columns
    by_key = {r["key"]: r for r in rows}
    name_width = max(len(k) for k in by_key)
    shown = {k: _cut(_shown(k, r["value"]), VALUE_WIDTH) for k, r in by_key.items()}
    room = width - (2 + name_width + 2 + VALUE_WIDTH + 2)
    for title, keys in grouped(by_key):
        click.echo(f"\n{title}")
        for k in keys:
            mark = " " if by_key[k]["default"] else "*"
            text = by_key[k]["description"] or ""
            head = f"{mark} {k:<{name_width}}  {shown[k]:<{VALUE_WIDTH}}  "
            if not long_:
                click.echo((head + _cut(text, max(room, 20))).rstrip())
                continue
            click.echo(head.rstrip())
            for line in textwrap.wrap(text, width=max(width - 6, 40)):
                click.echo(f"      {line}")


def _cut(text: str, width: int) -> str:
    """`text` in at most `width` characters, its end replaced by "..." when it is longer."""
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


# -- a running server takes the change too ---------------------------------
def _model_change(key: Optional[str], value, model: str) -> None:
    """Apply `key` to `model` on the running server alone; nothing is saved."""
    from ..server.fields import engine_option_names

    if not key or (value is None and key not in engine_option_names()):
        raise click.UsageError("--model takes KEY VALUE, or --unset KEY")
    check_setting_name(key)
    if key not in engine_option_names():
        raise click.UsageError(f"{key} is the server's, not a model's: set it without --model")
    server = running_server(None, load_settings())
    if server is None:
        raise MlxStreamError("--model applies a change to a running server's model, and no server runs "
                             "for this llm user dir (`llm mlxs serve`)")
    model_id = registry.model_id_for(model)
    shown = server.configure({key: value}, model=model_id)
    click.echo(f"{key} = {_fmt(shown.get(key))} applied to {model_id} on the server at {server.url}", err=True)


def _push_to_server(key: str, value) -> None:
    """Apply a setting to a running `llm mlxs serve` at once (one of its runtime
    options); every other setting it reads from the file at its next request."""
    from ..server.fields import engine_option_names

    server = running_server(None, load_settings())
    if server is None:
        return
    if key not in engine_option_names():
        click.echo(f"The server at {server.url} uses it from its next request", err=True)
        return
    server.configure({key: value})
    click.echo(f"{key} applied to the server at {server.url}", err=True)
