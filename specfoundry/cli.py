"""Every command group, one per console script (pyproject.toml's [project.scripts] point here).

Each stage keeps its own commands in its <stage>/cli.py (the gate's in gate.py); this module only
puts them together, so no module adds commands to another's group. sf-eval is eval/cli.py's run and
sweep beside the gate, which drives every stage. Where no console script can be launched (torchrun -m),
`python -m specfoundry.cli TOOL ...` runs the same group as the console script TOOL.
"""

from __future__ import annotations

from specfoundry.capture.cli import main as sf_capture
from specfoundry.common.cli import CONTEXT, ToolGroup
from specfoundry.eval.cli import run as eval_run
from specfoundry.eval.cli import sweep as eval_sweep
from specfoundry.gate import gate
from specfoundry.generate.cli import main as sf_regen
from specfoundry.train.cli import export_main as sf_export
from specfoundry.train.cli import main as sf_train

sf_eval = ToolGroup("sf-eval", commands=[eval_run, eval_sweep, gate], context_settings=CONTEXT,
                      help="Evaluate drafts against their target by real speculative decoding.")

TOOLS = {"sf-regen": sf_regen, "sf-capture": sf_capture, "sf-train": sf_train, "sf-export": sf_export,
         "sf-eval": sf_eval}
"""The console scripts by name, as pyproject.toml declares them."""

if __name__ == "__main__":
    ToolGroup("python -m specfoundry.cli", commands=TOOLS, context_settings=CONTEXT)()
