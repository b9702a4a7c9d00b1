"""The regen stage as a library function: conversations in, parquet shards + manifest out.

Layout of the output folder:
  manifest.json            settings, target identity, counts, the list of finished shards
  README.md                a dataset card, so `datasets.load_dataset(folder)` finds the shards
  data/shard-00000.parquet one row per kept conversation (ROW_SCHEMA, conversations/regen_format.py)

Work is split into fixed shards of the (deterministically ordered) input, written and resumed
through common/shards.py (regen_config.json, data/<shard>.done.json marks). Every conversation
goes turn by turn, and the turns of different conversations stream through the backend together
(backend.serve), over a group of shards at a time (group_size) that keeps the batch full. Every
request derives its seed from (seed, shard, conversation, turn), and a resumed run generates a
partly written group whole again, so it writes byte-identical shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from jinja2 import TemplateError

from specfoundry.common.files import atomic_write_bytes, atomic_write_json
from specfoundry.common.placement import Placement, Ranks
from specfoundry.common.progress import Progress
from specfoundry.common.settings import (
    MAX_TOKENS,
    TEMPLATE_KWARGS_HELP,
    Range,
    Settings,
    parse_template_kwargs,
    setting,
    shared,
)
from specfoundry.common.shards import ShardedOutput, check_output_folder, output_inside_source, record_config
from specfoundry.common.target import EMBEDDED_DEFAULT
from specfoundry.conversations.records import (
    REASONING,
    BadInput,
    Conversation,
    ConversationFormatError,
    Message,
    records_sha256,
)
from specfoundry.conversations.regen_format import (
    DATASET_CARD,
    check_resumable_format,
    regen_manifest,
    shard_path,
    write_shard,
)
from specfoundry.conversations.sources import data_files, load_conversations
from specfoundry.conversations.templates import (
    template_bad_input,
    tools_template_problem,
    unread_template_kwargs,
)
from specfoundry.generate.backends.hf import ENGINES
from specfoundry.generate.backends.interface import (
    Backend,
    Generation,
    Request,
    SamplingConfig,
    derive_seed,
    serve,
)
from specfoundry.generate.backends.registry import BACKENDS, make_backend
from specfoundry.generate.synth import DEFAULT_STARTERS, read_starters, starter_for, user_turn_prefix
from specfoundry.generate.turns import ConversationState, ShardCounts, record_turn, shard_rows

SYNTH_PHASE = 1_000_000  # seed part that keeps prompt synthesis apart from turn generation
GROUP_BATCHES = 4  # a group of shards holds this many batches of conversations (Regenerator.group_size)
ON_EMPTY = ("drop", "flag")  # what --on-empty may do with an empty answer
ON_TRUNCATED = ("drop", "flag", "trim")  # what --on-truncated may do with an answer cut at the cap
ON_TOOL_MISMATCH = ("recorded", "drop")  # what --on-tool-mismatch does when the target's calls differ

class RegenError(ValueError):
    """A user-facing problem with a regen run (bad settings, mismatching output folder)."""


def parse_starters(spec) -> tuple[str, ...]:
    """--prompt-starters as given on the command line or in a recipe: a name, a file, or a list."""
    if isinstance(spec, str):
        return read_starters(spec)
    if not isinstance(spec, list | tuple) or not all(isinstance(x, str) and x.strip() for x in spec):
        raise ValueError(f"{spec!r} is neither 'default', 'none', a file nor a list of openings (texts)")
    return tuple(spec)


@dataclass(frozen=True, kw_only=True)
class RegenConfig(Settings):
    """Settings of one sf-regen run (recorded in regen_config.json beside its output)."""

    # what is answered: the command line's, over the recipe's; both given are judged by value in run_regen
    # (--synthesize 0 beside a SOURCE reads the SOURCE), so no refusal here
    DECIDED_TOGETHER: ClassVar = {("source", "synthesize"): None}

    source: str | None = setting(None, argument=True, help="Conversation file or folder (jsonl/json/parquet, "
                                 "ShareGPT or OpenAI shaped); none when prompts are synthesised.")
    output: str = shared("output", resume=False)
    target: str = shared("target", EMBEDDED_DEFAULT)
    chat_template: str | None = shared("chat_template", None)
    chat_template_kwargs: dict | None = setting(
        None, parse=parse_template_kwargs, shown="each conversation's recorded mode, else the template's defaults",
        help=TEMPLATE_KWARGS_HELP)
    reasoning: str = setting("keep", choices=REASONING, before="keep",
                             help="A reasoning target's <think> block (or a server's reasoning_content): keep it in "
                                  "the answer or drop it (docs/stages.md, \"Reasoning targets\").")
    backend: str = setting("hf", choices=BACKENDS, help="hf: transformers in this process; openai: "
                           "OpenAI-compatible servers; sglang: offline sglang.Engine.")
    synthesize: int = setting(0, valid=Range(0, MAX_TOKENS, zero="read SOURCE"),
                              help="No dataset: synthesise this many user prompts from the target (Magpie), each "
                              "within --max-new-tokens (one unfinished there is dropped).")
    prompt_temperature: float | None = setting(
        None, shown="--temperature, or 1.0 when greedy", valid=Range(0, min_open=True),
        help="Temperature of synthesised prompts (greedy prompts would all be the same text).")
    prompt_starters: tuple[str, ...] = setting(
        DEFAULT_STARTERS, parse=parse_starters, shown="default",
        help=f"Openings that seed the synthesised prompts in turn: 'default' ({len(DEFAULT_STARTERS)} built-in), "
             "'none' (plain Magpie), or a text file of one opening per line.")
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    batch_size: int = setting(32, valid=Range(1, 1 << 16),
                              help="Sequences generated together (hf, sglang); the hf backend's KV cache holds this "
                                   "many.")
    hf_engine: str = setting(
        "auto", choices=ENGINES,
        help="The hf backend's engine: slots (continuous batching), generate (model.generate, turn by turn) or "
             "auto; docs/stages.md, \"sf-regen run\".")
    shard_size: int = setting(128, valid=Range(1), help="Conversations per output shard (the unit of resumption).")
    max_prompt_tokens: int = setting(2048, valid=Range(1, MAX_TOKENS),
                                     help="A conversation whose prompt before an assistant turn is longer is reported "
                                          "as bad input.")
    on_empty: str = setting("drop", choices=ON_EMPTY, help="Drop a conversation with an empty regenerated "
                            "answer, or keep it flagged.")
    on_tool_mismatch: str = setting(
        "recorded", choices=ON_TOOL_MISMATCH,
        help="A turn whose tool calls differ from the recorded ones: keep the recorded exchange or drop the "
             "conversation (docs/stages.md, \"Conversations with tools\").")
    on_truncated: str = setting(
        "flag", choices=ON_TRUNCATED,
        help="An answer cut at --max-new-tokens: drop its conversation, keep it flagged, or trim the repetition "
             "loop it ends in (docs/stages.md, \"sf-regen run\").")
    strict: bool = shared("strict", False)
    limit: int | None = shared("limit", None)
    device: str | None = shared("device", None, resume=False)
    placement: Placement = Placement()  # hf backend
    openai_url: tuple[str, ...] = setting(
        (), resume=False, repeatable=True, shown="none",
        help="Base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:30000/v1; repeat it for a fleet, "
             "over which requests are spread (openai backend).")
    openai_urls_file: str | None = setting(
        None, resume=False, shown="none",
        help="A text file of server URLs, one per line (# comments), added to --openai-url (openai backend).")
    openai_model: str | None = setting(None, shown="none",
                                       help="Model name sent to the server, if it needs one (openai backend).")
    concurrency: int = setting(16, resume=False, valid=Range(1, 4096),
                               help="Requests in flight at once per server (openai backend).")
    retries: int = setting(4, resume=False, valid=Range(0, 100, zero="a failed request stops the run"),
                           help="Retries per request, on another server where one is up, after a backoff (openai "
                                "backend).")
    request_timeout: float = setting(600.0, resume=False, valid=Range(0, 1e6, min_open=True),
                                     help="Seconds a server may take for one request before it counts as stalled and "
                                          "the request is retried elsewhere (openai backend).")

    def __post_init__(self):
        super().__post_init__()
        problem = output_inside_source(self.source, self.output)
        if problem:
            raise ValueError(problem)

    def prompt_sampling(self) -> SamplingConfig:
        """How synthesised user prompts are sampled: always at a temperature above 0."""
        temperature = self.prompt_temperature
        if temperature is None:
            temperature = 1.0 if self.sampling.greedy else self.sampling.temperature
        if temperature <= 0:
            raise RegenError("--prompt-temperature must be > 0: greedy prompts would all be the same text")
        return replace(self.sampling, temperature=temperature)



def over_long_prompt(conv: Conversation, tokenizer, max_tokens: int, template_kwargs: dict | None = None
                     ) -> BadInput | None:
    """Over-long prompt check on the original conversation, turn by turn (the open last turn too),
    rendered in the mode it will be generated in."""
    history = []
    extra = {**(conv.template_kwargs if template_kwargs is None else template_kwargs),
             **({"tools": list(conv.tools)} if conv.tools else {})}
    for m in [*conv.messages, None] if conv.ends_open else conv.messages:
        if m is None or m.role == "assistant":
            ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True, **extra)
            n = len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            if n > max_tokens:
                return BadInput(conv.location, "over_long_prompt", f"prompt has {n} tokens > {max_tokens}")
        if m is not None:
            history.append(m.to_dict())
    return None


class Regenerator:
    def __init__(self, cfg: RegenConfig, backend: Backend, silent: bool = False):
        self.cfg = cfg
        self.backend = backend
        self.silent = silent
        self.out = Path(cfg.output)
        self.shards = ShardedOutput(self.out)

    # ---- planning -------------------------------------------------------------------------

    def plan(self) -> tuple[list[Conversation] | None, list[BadInput], int]:
        """(conversations or None when synthesising, bad inputs, number of shards)."""
        cfg = self.cfg
        if cfg.synthesize:
            if cfg.source:
                raise RegenError("give either a source or --synthesize N, not both")
            self.check_synthesis()
            return None, [], math.ceil(cfg.synthesize / cfg.shard_size)
        if not cfg.source:
            raise RegenError("no source given: pass a conversation file/folder or --synthesize N")
        try:
            loaded = load_conversations(cfg.source, strict=cfg.strict, answer_open=True)  # prompt lists too
        except (ConversationFormatError, FileNotFoundError) as e:
            raise RegenError(str(e)) from e
        conversations, bad = [], list(loaded.bad)
        tokenizer = self.backend.tokenizer
        problem = (tokenizer and unread_template_kwargs(tokenizer, cfg.chat_template_kwargs)
                   or tools_template_problem(loaded.conversations, tokenizer))
        if problem:
            raise RegenError(problem)
        for conv in loaded.conversations:
            try:
                problem = tokenizer and over_long_prompt(conv, tokenizer, cfg.max_prompt_tokens,
                                                         cfg.chat_template_kwargs)
            except TemplateError as e:  # the template's raise_exception for this record ("roles must alternate")
                problem = template_bad_input(conv, e)
            if problem:
                if cfg.strict:
                    raise RegenError(str(problem))
                bad.append(problem)
            elif cfg.limit is None or len(conversations) < cfg.limit:
                conversations.append(conv)
        num_shards = math.ceil(len(conversations) / cfg.shard_size)
        self.shards.made_from, self.shards.source = self.made_from(conversations, num_shards), cfg.source
        return conversations, bad, num_shards

    def check_synthesis(self) -> None:
        """What prompt synthesis needs, checked before anything is written (so the corrected command
        runs into the same folder): the target's tokenizer, a chat template with a user turn, and
        chat-template arguments that the template reads (the answers are rendered with them)."""
        tokenizer = self.backend.tokenizer
        if tokenizer is None:
            raise RegenError("--synthesize needs the target's tokenizer (pass --target)")
        try:
            user_turn_prefix(tokenizer)
        except ValueError as e:
            raise RegenError(str(e)) from e
        problem = unread_template_kwargs(tokenizer, self.cfg.chat_template_kwargs)
        if problem:
            raise RegenError(problem)

    def made_from(self, conversations: list[Conversation], num_shards: int) -> dict[str, str]:
        """Per shard, the hash of the records of its whole group: what a shard holds depends on the
        requests generated beside it, so a changed record has its group written again."""
        size, per_group = self.cfg.shard_size, self.group_size()
        out = {}
        for start in range(0, num_shards, per_group):
            group = range(start, min(start + per_group, num_shards))
            digest = records_sha256(conversations[start * size : (group[-1] + 1) * size])
            out.update({shard_path(i): digest for i in group})
        return out

    def mode_of(self, conv: Conversation) -> dict:
        """The mode a conversation is generated in: --chat-template-kwargs where given, else the
        one its record carries (a source of sf-regen's rows), and --reasoning."""
        kwargs = self.cfg.chat_template_kwargs
        return {"chat_template_kwargs": dict(conv.template_kwargs if kwargs is None else kwargs),
                "reasoning": self.cfg.reasoning}

    # ---- one shard ------------------------------------------------------------------------

    def synthesise(self, shards: list[int], counts: dict[int, ShardCounts]) -> dict[int, list[Conversation]]:
        """The synthesised prompts of `shards`, written by the target in one call."""
        cfg = self.cfg
        prefix = user_turn_prefix(self.backend.tokenizer)  # (check_synthesis made sure there is one)
        index = [(shard, i) for shard in shards
                 for i in range(min(cfg.shard_size, cfg.synthesize - shard * cfg.shard_size))]
        starters = [starter_for(cfg.prompt_starters, shard * cfg.shard_size + i) for shard, i in index]
        requests = [Request(tag=k, seed=derive_seed(cfg.sampling.seed, shard, SYNTH_PHASE, i), text=prefix + starter)
                    for k, ((shard, i), starter) in enumerate(zip(index, starters, strict=True))]
        gens = self.backend.generate(requests, cfg.prompt_sampling())
        convs: dict[int, list[Conversation]] = {shard: [] for shard in shards}
        for (shard, i), starter, g in zip(index, starters, gens, strict=True):
            # the opening and its continuation are one text: no space is added or removed between them
            text = (starter + g.text).strip()
            if g.finish_reason != "stop" or not g.text.strip():
                counts[shard].synthetic_prompts_empty += 1  # an unfinished or empty question is no prompt
                continue
            n = shard * cfg.shard_size + i
            messages = (Message("user", text), Message("assistant", ""))
            convs[shard].append(Conversation(f"synth-{n}", messages, f"synthetic:{n}"))
        return convs

    def regenerate(self, convs: dict[int, list[Conversation]], counts: dict[int, ShardCounts], progress: Progress,
                   shard_done) -> None:
        """Every conversation of the shards `convs`, turn by turn, the turns of all of them
        interleaved; `shard_done(shard, rows, counts)` as each shard is complete, in shard order."""
        seed = self.cfg.sampling.seed
        states = {shard: [ConversationState(c, i, mode=self.mode_of(c)) for i, c in enumerate(cs)]
                  for shard, cs in convs.items()}
        left = {shard: len(cs) for shard, cs in states.items()}
        order = sorted(states)
        flat = [(shard, s) for shard in order for s in states[shard]]

        def flush() -> None:
            while order and left[order[0]] == 0:  # shards complete in order, whatever finished first
                done = order.pop(0)
                shard_done(done, shard_rows(states[done], counts[done]), counts[done])

        def on_done(request: Request, g: Generation) -> list[Request]:
            shard, s = flat[request.tag]
            record_turn(self.cfg, self.backend.tokenizer, s, g, counts[shard])
            progress.update(0, g.num_tokens)
            following = s.next_request(shard, seed, request.tag)
            if following is not None:
                return [following]
            left[shard] -= 1
            progress.update(1)
            flush()
            return []

        first = [s.next_request(shard, seed, k) for k, (shard, s) in enumerate(flat)]
        flush()  # shards without conversations (every prompt synthesis failed) at the front
        serve(self.backend, first, self.cfg.sampling, on_done)
        assert not order, "every shard of the group completed"

    # ---- the run --------------------------------------------------------------------------

    def group_size(self) -> int:
        """Shards generated together: enough conversations to keep `GROUP_BATCHES` batches in
        flight, so the backend's batch stays full however small the shards are."""
        return max(1, math.ceil(GROUP_BATCHES * self.cfg.batch_size / self.cfg.shard_size))

    def run(self) -> dict:
        """Generate every pending shard. Under torchrun the target's copies (common/placement.py)
        take whole groups of shards in turn (group k of the run to copy k mod G), each copy's
        first rank writing; rank 0 records the run and writes the final manifest."""
        ranks: Ranks = getattr(self.backend, "ranks", None) or Ranks()
        conversations, bad, num_shards = self.plan()
        if ranks.rank == 0:
            placed = getattr(self.backend, "target", None)  # the hf backend's placement as it runs
            record_config(self.out, "regen", self.cfg if placed is None else
                          replace(self.cfg, placement=placed.placement))
            atomic_write_bytes(self.out / "README.md", DATASET_CARD.encode())
            self.shards.pending([shard_path(i) for i in range(num_shards)])  # drops stale marks
            atomic_write_json(self.out / "manifest.json", regen_manifest(self.cfg, self.shards, self.backend.identity(), bad, num_shards))
        ranks.barrier()  # nothing is written before rank 0 has checked the folder and recorded the run
        size, per_group = self.cfg.shard_size, self.group_size()
        groups = [list(range(start, min(start + per_group, num_shards))) for start in range(0, num_shards, per_group)]
        mine = groups[ranks.group :: ranks.groups]
        pending = None
        if ranks.is_writer:
            pending = set(self.shards.pending([shard_path(i) for group in mine for i in group]))
        pending = ranks.from_writer(pending)  # the group's other ranks generate the same requests
        total = self.cfg.synthesize or len(conversations or [])
        shards_total = sum(min(total, (g[-1] + 1) * size) - g[0] * size for g in mine)

        def commit(i: int, rows: list[dict], counts: ShardCounts) -> None:
            if ranks.is_writer and shard_path(i) in pending:  # a finished shard of a resumed group is not rewritten
                write_shard(self.shards, i, rows, counts)
                atomic_write_json(self.out / "manifest.json", regen_manifest(self.cfg, self.shards, self.backend.identity(), bad, num_shards))

        with Progress(shards_total, "conv", "sf-regen", self.silent or not ranks.is_writer,
                      status=getattr(self.backend, "status", None)) as progress:
            for group in mine:
                start = group[0]
                if not any(shard_path(i) in pending for i in group):
                    progress.update(min(total, (group[-1] + 1) * size) - start * size)
                    continue
                # A group is generated whole, its finished shards too: what a shard holds depends
                # on the requests generated beside it (batch composition), so only the same group
                # gives the same bytes.
                counts = {i: ShardCounts() for i in group}
                if conversations is None:
                    convs = self.synthesise(group, counts)
                    progress.update(sum(c.synthetic_prompts_empty for c in counts.values()))
                else:
                    convs = {i: conversations[i * size : (i + 1) * size] for i in group}
                self.regenerate(convs, counts, progress, commit)
        ranks.barrier()  # every copy's shards are marked before rank 0 lists them
        manifest = regen_manifest(self.cfg, self.shards, self.backend.identity(), bad, num_shards)
        if ranks.rank == 0:
            self.shards.remove_partials("data")
            atomic_write_json(self.out / "manifest.json", manifest)
            if manifest["complete"]:  # an earlier run of a longer source left shards past the new ones
                self.shards.remove_unlisted("data", [entry["path"] for entry in manifest["shards"]])
        return manifest


def may_hold_records(path: Path) -> bool:
    """Whether a data file may hold a record: not an empty file, nor a .jsonl of blank lines only (read
    until its first other line). Other formats are read whole only by the run itself."""
    if path.stat().st_size == 0:
        return False
    if path.suffix != ".jsonl":
        return True
    with path.open("rb") as f:
        return any(line.strip() for line in f)


def run_regen(cfg: RegenConfig, backend: Backend | None = None, silent: bool = False) -> dict:
    """Run (or resume) a regen into cfg.output and return the final manifest. `backend`: an
    already built backend (tests, the gate); by default the one cfg names is loaded."""
    if cfg.on_empty not in ON_EMPTY or cfg.on_truncated not in ON_TRUNCATED or cfg.on_tool_mismatch not in ON_TOOL_MISMATCH:
        raise RegenError(f"--on-empty takes one of {', '.join(ON_EMPTY)}; --on-truncated one of {', '.join(ON_TRUNCATED)}; "
                         f"--on-tool-mismatch one of {', '.join(ON_TOOL_MISMATCH)}")
    if bool(cfg.synthesize) == bool(cfg.source):
        raise RegenError("give either a source or --synthesize N, not both" if cfg.source else
                         "no source given: pass a conversation file/folder or --synthesize N")
    check_output_folder(Path(cfg.output), "regen", cfg)  # before loading the target
    check_resumable_format(Path(cfg.output))
    if cfg.source:  # the source too: loading a large target takes minutes
        try:
            files = data_files(cfg.source)
        except (ConversationFormatError, FileNotFoundError) as e:
            raise RegenError(str(e)) from e
        if not any(may_hold_records(f) for f in files):  # else an empty output marked complete, then an error
            raise RegenError(f"{cfg.source}: {'empty' if len(files) == 1 else 'every file empty'}: no conversation "
                             "to regenerate")
    if backend is None:
        try:
            backend = make_backend(cfg)
        except ValueError as e:  # a setting that names no usable backend (target, servers, engine)
            raise RegenError(str(e)) from e
    return Regenerator(cfg, backend, silent).run()
