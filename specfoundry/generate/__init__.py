"""sf-regen: regenerate a conversation dataset's assistant turns with the target itself.

The stage (regen.py; a conversation's turns, turns.py; Magpie prompts, synth.py; tool calls,
tools.py; reasoning, reasoning.py; loop trimming, repetition.py; the command, cli.py) over the
generation backends of backends/ (the interface, the registry, hf with its slot engine, the openai
fleet, sglang), which import nothing of the stage but tools.py's call parser.
"""
