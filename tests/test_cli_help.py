"""Every command and every option of every console script carries help text."""

from __future__ import annotations

import click
import pytest

from specfoundry.capture.cli import main as capture_main
from specfoundry.eval.cli import main as eval_main
from specfoundry.generate.cli import main as regen_main
from specfoundry.train.cli import main as train_main

COMMANDS = {"sf-regen": regen_main, "sf-capture": capture_main, "sf-train": train_main, "sf-eval": eval_main}


def walk(cmd: click.Command, path: str):
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from walk(sub, f"{path} {name}")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_has_help(name):
    for path, cmd in walk(COMMANDS[name], name):
        assert cmd.help, f"{path} has no help text"
        for param in cmd.params:
            if isinstance(param, click.Option):
                assert param.help, f"{path} {param.opts[0]} has no help text"
