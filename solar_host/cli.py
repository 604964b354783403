"""The `solar-host` command: serve (default) and client subcommands against a running host."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="solar-host", description="solar-host agent")
    p.add_argument("--host", help="bind address (overrides HOST)")
    p.add_argument("--port", type=int, help="port (overrides PORT)")
    p.add_argument("--env-file", default=".env", help="settings file (default: ./.env)")
    return p


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from solar_host.app import create_app
    from solar_host.logging_setup import configure_logging
    from solar_host.settings import SettingsError, load_settings

    overrides = {}
    if args.host:
        overrides["host"] = args.host
    if args.port:
        overrides["port"] = args.port
    try:
        settings = load_settings(args.env_file, **overrides)
    except SettingsError as err:
        print(f"solar-host: {err}", file=sys.stderr)
        return 2
    configure_logging(settings)
    app = create_app(settings)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_config=None, access_log=False
    )
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return serve(args)
