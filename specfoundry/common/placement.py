"""Where the target runs: one device, accelerate's device map, or tensor / expert parallel groups.

    placement            for                                        how
    one device           the embedded default, tests, a target      plain
                         that fits one GPU
    --device-map auto    one process over several GPUs, or a        accelerate's big-model dispatch; --max-memory
                         target larger than the GPU                 caps each device, the rest in CPU memory (disk
                                                                    where that is full)
    --tp N / --ep N      70B dense, 235B MoE within a node          transformers' tensor / expert parallelism
                                                                    (DistributedConfig) under torchrun

Placement decides how the target is run, never what a stage writes: it is not a setting of the
output, so a rerun may change it (the fields are resume=False).

A launch of W processes (`torchrun --nproc-per-node W`) with --tp N holds W/N copies of the
target, "groups" of N ranks: ranks gN .. gN+N-1 form group g. Every rank of a group runs the same
inputs in lockstep (the collectives inside the model need it), its forward hooks see the full
residual stream, and only the group's first rank writes. Groups split the work as data-parallel
ranks: group g takes shards g, g+G, g+2G, ... of the stage's sharded output.

Why each group gets a default process group of its own: transformers builds its tensor-parallel
mesh over the whole default group (its world must be tp_size), and asking it for data
parallelism beside TP (fsdp_size) wraps every layer in FSDP2, whose collectives would then span
groups that run different batches. So a group initialises the default process group over its
own N ranks, on a prefix of the launch's rendezvous store, and the launch-wide barriers go
through that store.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

from specfoundry.common.settings import Range, Settings, config_dict, setting

DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
FUSED_EXPERTS = "sf_fused"
EXPERTS_IMPLEMENTATIONS = ("auto", "eager", "grouped_mm", "batched_mm", FUSED_EXPERTS)  # common/experts.py


class PlacementError(ValueError):
    """The target cannot be placed as asked (a launch that does not fit --tp, a plan the
    architecture lacks, ...)."""


def parse_max_memory(spec) -> dict | None:
    """--max-memory: comma-separated DEVICE=SIZE (a recipe may give a mapping). Devices are GPU
    indices of this machine, 'cpu' or 'disk'; sizes as accelerate reads them (a byte count, or a
    number with a unit such as GiB or MB), returned in bytes. Anything else is a ValueError naming it."""
    import torch
    from accelerate.utils import convert_file_size_to_int

    if spec is None:
        return None
    items = spec.items() if isinstance(spec, dict) else [p.split("=", 1) for p in str(spec).split(",") if p.strip()]
    out = {}
    for item in items:
        if len(item) != 2 or not str(item[1]).strip():
            raise ValueError(f"{spec!r} is not DEVICE=SIZE[,DEVICE=SIZE...] (e.g. 0=70GiB,cpu=200GiB)")
        device, size = str(item[0]).strip(), str(item[1]).strip()
        if not (device.isdigit() or device in ("cpu", "disk")):
            raise ValueError(f"--max-memory device {device!r} is neither a GPU index, 'cpu' nor 'disk'")
        if device.isdigit() and int(device) >= torch.cuda.device_count():
            raise ValueError(f"{device}={size}: this machine has no GPU {device} "
                             f"({torch.cuda.device_count()} visible)")
        try:
            amount = convert_file_size_to_int(int(size) if size.isdigit() else size)
        except ValueError:
            amount = 0
        if amount <= 0:
            raise ValueError(f"{device}={size}: {size!r} is not a size (a byte count, or a number with a "
                             "unit: 70GiB, 500MB)")
        out[int(device) if device.isdigit() else device] = amount
    return out


MAX_RANKS = 1024  # ranks per copy of the target, at most


@dataclass(frozen=True, kw_only=True)
class Placement(Settings):
    """How the target's weights are spread (docs/scaling.md)."""

    tp: int = setting(1, resume=False, valid=Range(1, MAX_RANKS), help="Tensor parallelism: N ranks under torchrun share one copy of "
                      "the target, each holding 1/N of every sharded layer (docs/scaling.md, \"--tp N / --ep N\").")
    ep: int = setting(1, resume=False, valid=Range(1, MAX_RANKS), help="Expert parallelism for MoE targets: the experts spread over N "
                      "ranks, the dense layers tensor-parallel over the same N (with --tp, give both equal).")
    device_map: str | None = setting(None, resume=False, choices=DEVICE_MAPS, shown="off: the whole target on "
                                     "--device", help="Spread the layers over the visible GPUs in one process, the "
                                     "rest in CPU memory (accelerate's big-model dispatch; docs/scaling.md).")
    max_memory: dict | None = setting(None, resume=False, parse=parse_max_memory, shown="what each device has",
                                      help="With --device-map: memory per device, DEVICE=SIZE,... (e.g. "
                                           "0=70GiB,cpu=200GiB); what does not fit the GPUs goes to CPU memory, "
                                           "then disk.")
    experts_implementation: str = setting(
        "auto", resume=False, choices=EXPERTS_IMPLEMENTATIONS, shown="auto: sf_fused on one GPU where it runs, else grouped_mm; eager on CPU",
        help="How an MoE target's routed experts run (a dense target ignores it); docs/scaling.md, \"MoE targets: "
             "how the experts run\".")

    def __post_init__(self):
        super().__post_init__()
        if self.tp > 1 and self.ep > 1 and self.tp != self.ep:
            raise ValueError(f"--tp {self.tp} and --ep {self.ep}: expert parallelism runs over the tensor-parallel "
                             "ranks, so give one size (or both equal)")
        if self.device_map and self.copy_size > 1:
            raise ValueError("--device-map and --tp/--ep are two ways to spread the target: choose one")
        if self.max_memory is not None and not self.device_map:
            raise ValueError("--max-memory caps the devices of --device-map: give --device-map auto too")

    @property
    def copy_size(self) -> int:
        """Ranks that hold one copy of the target."""
        return max(self.tp, self.ep)


@dataclass
class Ranks:
    """This process's place in the launch: `group` is its copy of the target (the data-parallel
    rank), `group_rank` its rank inside that copy."""

    rank: int = 0
    world: int = 1
    group_size: int = 1
    store: object | None = field(default=None, repr=False)  # the launch's store, when groups have their own
    barriers: int = 0
    compared: int = 0  # check_same calls so far (each exchanges under its own keys)

    @property
    def group(self) -> int:
        return self.rank // self.group_size

    @property
    def groups(self) -> int:
        return self.world // self.group_size

    @property
    def group_rank(self) -> int:
        return self.rank % self.group_size

    @property
    def is_writer(self) -> bool:
        """The first rank of each group writes; the others run the same inputs and write nothing."""
        return self.group_rank == 0

    def barrier(self) -> None:
        """Wait for every rank of the launch."""
        if self.world == 1:
            return
        import torch.distributed as dist

        if self.store is None:
            dist.barrier()
            return
        self.barriers += 1
        key = f"specfoundry/barrier/{self.barriers}"
        self.store.add(key, 1)
        deadline = time.monotonic() + BARRIER_TIMEOUT_S
        while int(self.store.add(key, 0)) < self.world:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {self.rank}: the other ranks did not reach barrier {self.barriers} within "
                                   f"{BARRIER_TIMEOUT_S} s")
            time.sleep(0.02)

    def check_same(self, record: dict, must: str) -> None:
        """Every rank's `record` (what it read: its input's content hash) equal to rank 0's, else one
        PlacementError naming the first difference, the same on every rank (check_one_launch)."""
        if self.world == 1:
            return
        if self.store is None:
            records = gathered(record)
        else:
            self.compared += 1
            records = exchange(self.store, self.rank, self.world, record, f"compare-{self.compared}")
        check_one_launch(records, must)

    def from_writer(self, obj):
        """The group's first rank's `obj`, on every rank of the group (the others pass anything):
        what only the writer reads from the output folder, the rest of the group runs too."""
        if self.group_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)  # the default group is this group (join_launch)
        return box[0]

    def group_barrier(self) -> None:
        """Wait for every rank of this process's group."""
        if self.group_size > 1:
            import torch.distributed as dist

            dist.barrier()


BARRIER_TIMEOUT_S = 4 * 3600  # a rank may wait on another's long shard


def launch_env() -> tuple[int, int, int]:
    """(rank, world, local rank) from torchrun's / accelerate's environment; (0, 1, 0) alone."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def join_launch(placement: Placement, device: str | None, command: str = "the command",
                record: dict | None = None) -> tuple[Ranks, str | None]:
    """Initialise the process groups this launch needs (module docstring) and pick the device:
    (this rank's Ranks, the device, cuda:LOCAL_RANK on a GPU machine when none is given). First,
    the ranks of a launch compare what each runs (its placement and `record`: the command's
    settings, the target's identity) through the launch's store: a difference is the same one-line
    PlacementError on every rank (check_one_launch), before any of them builds a group or loads."""
    import torch

    rank, world, local = launch_env()
    store = None
    if world > 1 and not is_initialized():
        store = launch_store(rank, world)
        check_one_launch(exchange(store, rank, world, {"command": command, "placement": config_dict(placement),
                                                       **(record or {})}))
    elif world > 1:  # a caller (a test, accelerate) set the groups up already: their collective
        check_one_launch(gathered({"command": command, "placement": config_dict(placement), **(record or {})}))
    n = placement.copy_size
    if n > 1 and world == 1:
        raise PlacementError(f"--tp/--ep {n} runs one rank per shard of the target: launch it as "
                             f"`torchrun --nproc-per-node {n} {command} ...`")
    if world % n:
        raise PlacementError(f"{world} processes do not split into copies of the target of {n} ranks (--tp/--ep "
                             f"{n}): launch a multiple of {n}")
    if device is None and torch.cuda.is_available() and world > 1:
        device = f"cuda:{local}"
    ranks = Ranks(rank, world, n)
    if world == 1:
        return ranks, device
    import torch.distributed as dist

    cuda = (device or "").startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device))
    backend = "nccl" if cuda else "gloo"
    if store is None:  # a caller (a test, accelerate) set the groups up already
        return ranks, device
    if n in (1, world):
        dist.init_process_group(backend, store=dist.PrefixStore("specfoundry/all/", store), rank=rank,
                                world_size=world)
        atexit.register(leave_launch, ranks)
        return ranks, device
    dist.init_process_group(backend, store=dist.PrefixStore(f"specfoundry/group{ranks.group}/", store),
                            rank=ranks.group_rank, world_size=n)
    ranks.store = store
    atexit.register(leave_launch, ranks)
    return ranks, device


def is_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def launch_store(rank: int, world: int):
    """The launch's TCPStore (torchrun's agent hosts it, or rank 0 does), which every group and the
    ranks' comparison are built on."""
    import torch.distributed as dist

    env = os.environ
    hosts_store = env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0  # else torchrun's agent does
    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=hosts_store,
                         timeout=timedelta(minutes=30))


LAUNCH_CHECK_S = 600
"""How long a rank waits for the others' records before it says which did not come."""


def exchange(store, rank: int, world: int, record: dict, name: str = "launch") -> list[dict]:
    """Every rank's record, in rank order, through the store (each rank writes its own under
    specfoundry/<name>/<rank>, then reads all)."""
    store.set(f"specfoundry/{name}/{rank}", json.dumps(record, sort_keys=True, default=str))
    keys = [f"specfoundry/{name}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=LAUNCH_CHECK_S))
    except RuntimeError:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise PlacementError(f"rank {rank}: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did "
                             f"not join the launch within {LAUNCH_CHECK_S} s (their own output says why)") from None
    return [json.loads(store.get(k)) for k in keys]


def gathered(record: dict) -> list[dict]:
    """Every rank's record over the process group already set up (accelerate's, a test's)."""
    import torch.distributed as dist

    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, json.loads(json.dumps(record, sort_keys=True, default=str)))
    return records


SAME_LAUNCH = "every rank of a launch must run the same command, settings and target weights"


def check_one_launch(records: list[dict], must: str = SAME_LAUNCH) -> None:
    """The ranks of one launch run one command on one target over one input: the first field where
    a rank's record differs from rank 0's is a PlacementError naming the rank and the field, and
    `must`, the same on every rank (so every rank stops, none waits on another in a collective)."""
    first = flat(records[0])
    for rank, record in enumerate(records[1:], start=1):
        mine = flat(record)
        for key in sorted(set(first) | set(mine)):
            if first.get(key) != mine.get(key):
                raise PlacementError(f"rank {rank} runs with {key} {mine.get(key)!r}, rank 0 with {first.get(key)!r}: "
                                     f"{must}")


def flat(record: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def leave_launch(ranks: Ranks) -> None:
    """At exit: the group's process group and the store connection closed before the interpreter
    tears down their threads (which otherwise can abort the process after its work is done)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    ranks.store = None


# ---- transformers' tensor / expert parallel plans ----------------------------------------------

REPLICATED = "replicated_with_grad_allreduce"  # transformers' style for a weight kept whole on every rank


def distributed_config(config, placement: Placement):
    """transformers' DistributedConfig for `placement` over a model of `config`, after checking
    that its plans can split it so. What transformers would refuse late, or split wrongly, is a
    one-line PlacementError here, before any weight is read:
    - no tensor-parallel plan for the decoder layers: --device-map, or --ep where it has experts
      (gpt-oss's plan splits only the embedding);
    - attention heads that N does not divide (transformers never replicates KV heads: Qwen3-235B's
      4 KV heads would cap it at --tp 4): the attention projections are kept whole on every rank
      instead, and only the MLP / experts are split;
    - an MLP width or an expert count that N does not divide: named, with the sizes that work."""
    from transformers.distributed import DistributedConfig

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = placement.copy_size
    arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    tp_plan = dict(getattr(text, "base_model_tp_plan", None) or {})
    ep_plan = dict(getattr(text, "base_model_ep_plan", None) or {})
    layer_rules = {rule: style for rule, style in tp_plan.items() if rule.startswith("layers.")}
    if placement.ep > 1:
        if not ep_plan:
            raise PlacementError(f"{arch} has no expert-parallel plan in transformers (no experts it can spread): "
                                 f"use --tp {n}, or --device-map auto")
        experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or getattr(
            text, "n_routed_experts", None)
        if experts and experts % n:
            raise PlacementError(f"--ep {n} does not divide {arch}'s {experts} experts: use one of "
                                 f"{divisors(experts, n)}")
    elif not layer_rules:
        if ep_plan:
            raise PlacementError(f"{arch}'s tensor-parallel plan splits none of its decoder layers (only "
                                 f"{', '.join(sorted(tp_plan)) or 'nothing'}): spread its experts with --ep {n}")
        raise PlacementError(f"{arch} has no tensor-parallel plan in transformers: spread it over the GPUs of one "
                             "process with --device-map auto instead of --tp")
    check_width(arch, "MLP width (intermediate_size)", getattr(text, "intermediate_size", None), n,
                any(".mlp." in r and not r.startswith("layers.*.mlp.experts") for r in layer_rules))
    if placement.ep == 1:
        check_width(arch, "expert MLP width (moe_intermediate_size)", getattr(text, "moe_intermediate_size", None),
                    n, any(r.startswith("layers.*.mlp.experts") for r in layer_rules))
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    kwargs: dict = {"tp_size": n}
    if heads % n or kv_heads % n:
        # keep q/k/v/o whole on every rank: each rank computes the whole attention (its weights are
        # replicated), and the layers' MLPs / experts stay split
        prefix = base_model_prefix(config)
        attention = {f"{prefix}{rule}": REPLICATED for rule, style in layer_rules.items()
                     if ".self_attn." in rule and style in ("colwise", "rowwise")}
        if attention and not supports_style(REPLICATED):
            raise PlacementError(f"--tp {n} does not divide {arch}'s {heads} attention / {kv_heads} KV heads, and this "
                                 f"transformers cannot keep attention whole: use one of {divisors(kv_heads, n)}")
        kwargs["tp_plan"] = attention or None
    if placement.ep > 1:
        fields = DistributedConfig.__dataclass_fields__
        kwargs.update({"ep_size": n} if "ep_size" in fields else {"enable_expert_parallel": True})
    return DistributedConfig(**kwargs)


def base_model_prefix(config) -> str:
    """How the causal LM names its base model's modules ('model.'), which a plan override's keys
    start with."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        prefix = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].base_model_prefix
    except KeyError:
        prefix = "model"
    return f"{prefix}." if prefix else ""


def check_width(arch: str, what: str, size: int | None, n: int, split: bool) -> None:
    if split and size and size % n:
        raise PlacementError(f"--tp {n} does not divide {arch}'s {what} {size}: use one of {divisors(size, n)}")


def divisors(size: int, below: int) -> str:
    return ", ".join(str(d) for d in range(1, below) if size % d == 0)


def supports_style(style: str) -> bool:
    try:
        from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES
    except ImportError:
        return False
    return style in ALL_PARALLEL_STYLES
