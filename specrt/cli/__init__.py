"""The `specrt` command: parse flags into config dataclasses, call the library, print. No logic here.

One module per command; what they share (bad input as `Error:` and exit code 2, --device, loading a
pair, the draft-length parsers) is in common.py. Heavy imports happen inside the commands.
"""
from __future__ import annotations

import click

from specrt.cli import batch, bench, build_engines, check, export, fetch, generate, info, serve, tune

COMMANDS = (export.export, build_engines.build_engines, fetch.fetch, generate.generate, bench.bench, tune.tune,
            info.info, check.check, batch.batch, serve.serve)


class _Main(click.Group):
    def parse_args(self, ctx, args):
        ctx.meta["specrt.argv"] = ["specrt", *args]  # as typed: reports print the command that made them
        return super().parse_args(ctx, args)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="specrt")
def main():
    """Lossless speculative decoding: export a draft/target pair, then generate with it."""


for _command in COMMANDS:
    main.add_command(_command)
