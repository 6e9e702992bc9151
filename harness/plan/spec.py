"""The job spec: a TOML file validated into typed, frozen objects (format in docs/spec.md).

Pure Python (stdlib tomllib): the analysis imports this module without MPI, torch or a GPU.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.common.errors import SpecError
from harness.common.toml_text import toml_value
from harness.plan.device import load_device
from harness.plan.network import NetworkTier, check_tiers, parse_network
from harness.plan.schedules import INTERLEAVED, SCHEDULES, SPLIT_BACKWARD, default_chunks, zero_bubble_rounds

SPEC_VERSION = 1
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
# activation recompute: keep every saved activation; the attention core's recomputed (Megatron-LM's selective); or
# each block's input only (full)
RECOMPUTE = ("none", "selective", "full")
# [model] attention: sdpa (fused: flash / memory-efficient, the scores never in HBM) or materialized (the scores
# in HBM: baddbmm, softmax, bmm, as Megatron-LM's local attention without flash attention)
ATTENTION_KINDS = ("sdpa", "materialized")
# [model] cross_entropy: the loss over a head's whole vocabulary, torch's cross_entropy (a log-softmax) or
# Megatron-LM's vocab_parallel_cross_entropy (max, exponential, sum, division in float32), which a head split by
# vocabulary always runs
CROSS_ENTROPY_KINDS = ("torch", "megatron")
RECOMPUTE_METHODS = ("uniform", "block")  # full recompute of a part of a stage's blocks (Megatron-LM's meanings)
ZERO_STAGES = (0, 1, 2, 3)  # ZeRO: nothing sharded; the optimizer state; and the gradients; and the weights
BACKENDS = ("torch", "mpi4py")
CP_COMMS = ("ring", "allgather")  # how context parallelism's attention gets the other ranks' keys and values
VOCAB_PAD = 128  # Megatron-LM pads the vocabulary to a multiple of this x tp (make-vocab-size-divisible-by)
FAMILIES = ("gpt2", "bert", "llama")  # a family's name as [model] name: every size given in [model]

# Built-in model presets: (family, layers, hidden, heads, kv_heads, ffn, seq_len, vocab); sources in docs/spec.md.
_LLAMA3 = dict(family="llama", kv_heads=8, seq_len=8192, vocab=128256)
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-small": dict(family="gpt2", layers=12, hidden=768, heads=12, ffn=3072, seq_len=1024, vocab=50257),
    "gpt2-medium": dict(family="gpt2", layers=24, hidden=1024, heads=16, ffn=4096, seq_len=1024, vocab=50257),
    "gpt2-large": dict(family="gpt2", layers=36, hidden=1280, heads=20, ffn=5120, seq_len=1024, vocab=50257),
    "gpt2-xl": dict(family="gpt2", layers=48, hidden=1600, heads=25, ffn=6400, seq_len=1024, vocab=50257),
    "bert-base": dict(family="bert", layers=12, hidden=768, heads=12, ffn=3072, seq_len=512, vocab=30522),
    "bert-large": dict(family="bert", layers=24, hidden=1024, heads=16, ffn=4096, seq_len=512, vocab=30522),
    # The 48-layer BERT of the DistSim paper's evaluation.
    "bert-exlarge": dict(family="bert", layers=48, hidden=1024, heads=16, ffn=4096, seq_len=512, vocab=30522),
    "llama-1b": dict(family="llama", layers=22, hidden=2048, heads=32, kv_heads=4, ffn=5632, seq_len=2048,
                     vocab=32000),
    "llama-7b": dict(family="llama", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, seq_len=2048,
                     vocab=32000),
    "llama-13b": dict(family="llama", layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, seq_len=2048,
                      vocab=32000),
    "llama3-8b": dict(_LLAMA3, layers=32, hidden=4096, heads=32, ffn=14336),
    "llama3-70b": dict(_LLAMA3, layers=80, hidden=8192, heads=64, ffn=28672),
    "llama3-405b": dict(_LLAMA3, layers=126, hidden=16384, heads=128, ffn=53248),
    # Qwen2.5 7B: its attention's QKV biases are left out (the llama family has none)
    "qwen2.5-7b": dict(family="llama", layers=28, hidden=3584, heads=28, kv_heads=4, ffn=18944, seq_len=4096,
                       vocab=152064),
    # Mixture-of-Experts: Mixtral 8x7B's sizes (8 experts, top-2), DeepSeek-MoE 16B's (64 fine-grained experts,
    # top-6, 2 shared ones; its first block dense, here every block MoE)
    "mixtral-8x7b": dict(family="llama", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq_len=4096,
                         vocab=32000, experts=8, top_k=2, expert_ffn=14336),
    "mixtral-8x22b": dict(family="llama", layers=56, hidden=6144, heads=48, kv_heads=8, ffn=16384, seq_len=4096,
                          vocab=32768, experts=8, top_k=2, expert_ffn=16384),
    "deepseek-moe-16b": dict(family="llama", layers=28, hidden=2048, heads=16, kv_heads=16, ffn=10944, seq_len=4096,
                             vocab=102400, experts=64, top_k=6, expert_ffn=1408, shared_experts=2),
    # DeepSeek-V3's sizes as far as the llama family's MoE goes: 256 routed experts of 2048 (top-8) and 1 shared in
    # every block; its multi-head latent attention, its first 3 dense blocks and its multi-token prediction are not
    # modelled (docs/spec.md)
    "deepseek-v3": dict(family="llama", layers=61, hidden=7168, heads=128, kv_heads=128, ffn=18432, seq_len=4096,
                        vocab=129280, experts=256, top_k=8, expert_ffn=2048, shared_experts=1),
}

_SECTIONS = {
    "spec_version": None,
    "model": {"name", "factory", "family", "layers", "hidden", "heads", "kv_heads", "ffn", "seq_len", "vocab", "dtype",
              "tie_embeddings", "experts", "top_k", "expert_ffn", "shared_experts", "moe_every", "capacity_factor",
              "routing", "expert_histogram", "vocab_divisible_by", "dropout", "attention", "cross_entropy"},
    "batch": {"global", "micro"},
    "strategy": {"dp", "tp", "pp", "schedule", "chunks", "dp_overlap", "bucket_mb", "recompute", "zero",
                 "vocab_parallel", "sp", "cp", "cp_comm", "ep", "recompute_layers", "recompute_method",
                 "grad_accumulation_fusion"},
    "cluster": {"nodes", "gpus_per_node", "device_memory_gb", "device", "network"},
    "optimizer": {"name", "momentum", "master_weights", "reduce_dtype"},
    "profile": {"warmup", "repeats", "backend", "timeout_s", "device", "precision", "budget_s"},
    "search": {"dp", "tp", "pp", "micro", "schedule", "chunks", "gpus", "recompute", "zero", "sp", "cp", "ep", "auto"},
}
TABLES = tuple(name for name in _SECTIONS if name != "spec_version")  # a spec's tables, as a spec file holds them
OPTIMIZERS = ("adam", "sgd")


@dataclass(frozen=True)
class ModelSpec:
    """What to train: a built-in family with sizes, or a user's factory ("module:function")."""

    name: str
    family: str  # gpt2 | bert | llama | user
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    seq_len: int
    vocab: int  # the embedding's and the head's rows: the tokenizer's vocabulary padded (pad_vocab)
    dtype: str = "float32"
    factory: str | None = None
    # Megatron-LM's make-vocab-size-divisible-by: the vocabulary padded to a multiple of this x tp; 0: padded to
    # VOCAB_PAD x tp only where tp does not divide it and the embedding is split by vocabulary
    vocab_divisible_by: int = 0
    unpadded_vocab: int = 0  # the tokenizer's vocabulary, when padding changed it (0: vocab)
    # the head's projection is the embedding's token table: one weight on one device, or with the two on
    # different pipeline stages a copy on each, their gradients all-reduced between them (Megatron-LM)
    tie_embeddings: bool = False
    # Mixture-of-Experts (experts > 0): each MoE block's MLP is `experts` FFNs of `expert_ffn`, each token routed
    # to `top_k` of them, plus `shared_experts` always-on ones; every `moe_every`-th block is MoE; an expert takes
    # at most capacity_factor x its even share of a micro-batch's routed tokens (0: dropless); `routing` how the
    # tokens spread over the experts (harness.plan.routing): "uniform", "zipf:S" or "file:PATH", whose histogram the
    # spec then keeps (`expert_histogram`: per MoE layer, tokens per expert)
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    moe_every: int = 1
    capacity_factor: float = 0.0
    routing: str = "uniform"
    expert_histogram: tuple[tuple[float, ...], ...] = ()
    # Megatron-LM's hidden and attention dropout: the probabilities after attention's softmax, each sub-layer's
    # output before its residual add and the embedding's output dropped with this probability (built-ins only)
    dropout: float = 0.0
    attention: str = "sdpa"  # ATTENTION_KINDS: how the built-in blocks run their attention core
    cross_entropy: str = "torch"  # CROSS_ENTROPY_KINDS: the built-in head's loss where its vocabulary is whole

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.dtype]

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def is_moe_block(self, block: int) -> bool:
        """Whether block `block` (1 = the first) is a Mixture-of-Experts one: every moe_every-th."""
        return self.moe and block % self.moe_every == 0

    @property
    def moe_layers(self) -> int:
        return self.layers // self.moe_every if self.moe else 0


@dataclass(frozen=True)
class BatchSpec:
    global_size: int
    micro: int


@dataclass(frozen=True)
class StrategySpec:
    """Hybrid parallelism. Ranks are ordered tp fastest, then cp, then dp, then pp (Megatron-Core's order)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    chunks: int = 1  # model chunks per pipeline device (interleaved schedules only)
    dp_overlap: bool = True  # all-reduce gradient buckets during the backward, as DDP does
    bucket_mb: float = 25.0  # DDP's default bucket size
    # full: each block's forward is run again before its backward (harness.plan.layers.recompute_groups);
    # selective: each block's attention core (Megatron-LM's --recompute-granularity selective)
    recompute: str = "none"
    # full recompute, Megatron-LM's --recompute-num-layers and --recompute-method: uniform, a stage's blocks in
    # chunks of recompute_layers, each chunk's input kept and the chunk run again; block, its first
    # recompute_layers blocks run again (each its own), the rest keep what they save
    recompute_layers: int = 1
    recompute_method: str = "uniform"
    zero: int = 0  # ZeRO stage over the data-parallel replicas: 1 optimizer, 2 and gradients, 3 and weights (FSDP2)
    # tp > 1: the embedding and the head sharded over the tp group by vocabulary, the cross-entropy computed
    # vocabulary-parallel (Megatron-LM); false: both replicated on every tp rank
    vocab_parallel: bool = True
    # tp > 1: Megatron-LM's sequence parallelism (Korthikanti et al. 2022): the norms and residuals between the
    # tensor-parallel regions hold seq / tp tokens, each all-reduce becomes a reduce-scatter and an all-gather
    sp: bool = False
    # context parallelism: the sequence split over cp ranks in 2 cp chunks (zigzag), attention over the whole of
    # it with the keys and values passed round a ring (cp_comm "ring") or all-gathered first ("allgather")
    cp: int = 1
    cp_comm: str = "ring"
    # expert parallelism: each MoE block's experts sharded over ep ranks carved out of the dp group
    # (Megatron-Core); the experts' gradients are all-reduced over the dp / ep ranks holding the same ones
    ep: int = 1
    # Megatron-LM's gradient accumulation fusion (its default; APEX's fused weight-gradient GEMM adds into the
    # main gradient): no add a micro-batch; false: each layer's backward adds its parameters' gradients into those
    # of the step's earlier micro-batches, as PyTorch (and harness train) accumulates them
    grad_accumulation_fusion: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    @property
    def layout(self) -> str:
        """'dp x tp x pp' (with cp > 1 'dp x tp x cp x pp') and its numbers: how a message names the layout."""
        if self.cp > 1:
            return f"dp x tp x cp x pp = {self.dp} x {self.tp} x {self.cp} x {self.pp}"
        return f"dp x tp x pp = {self.dp} x {self.tp} x {self.pp}"

    @property
    def gradient_replicas(self) -> int:
        """The ranks that hold the same parameters and average their gradients: dp x cp (Megatron-Core)."""
        return self.dp * self.cp

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.chunks

    @property
    def vocab_sharded(self) -> bool:
        """Whether the embedding and the head are split by vocabulary (vocab_parallel with tp > 1)."""
        return self.vocab_parallel and self.tp > 1

    @property
    def split_backward(self) -> bool:
        """Whether the schedule splits each backward into an input-gradient (B) and a weight-gradient (W) step."""
        return self.schedule in SPLIT_BACKWARD


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int = 1
    gpus_per_node: int = 1
    device_memory_gb: float | None = None  # each device's memory (GB = 1e9 bytes); None: not limited
    # the device's description (harness.plan.device): a shipped name or a TOML file's path; None: none given
    device: str | None = None
    # the target's network, innermost tier first (harness.plan.network); empty: calibrated from the profile
    network: tuple[NetworkTier, ...] = ()

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class ProfileSpec:
    warmup: int = 3
    repeats: int = 10
    backend: str = "torch"  # communication backend: torch (torch.distributed) or mpi4py
    timeout_s: float = 600.0  # per phase
    device: str = "auto"  # auto | cpu | cuda
    precision: float = 0.02  # sample each event until its statistic's 95% interval is within this fraction of it
    budget_s: float = 60.0  # ... or until this many seconds of sampling beyond `repeats` (per phase) are spent


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer the job trains with, for the memory model (and harness train): Adam keeps two states per
    parameter, SGD one with momentum and none without; master weights keep an fp32 copy of 16-bit ones."""

    name: str = "adam"  # adam | sgd
    momentum: float = 0.9  # sgd only
    master_weights: bool = False  # fp32 master weights (and fp32 states) beside 16-bit model weights
    # the dtype the gradients' reductions carry (data-parallel all-reduce or ZeRO reduce-scatter, the tied
    # embedding's, sequence parallelism's and the experts' all-reduces) and, with master weights, Megatron's main
    # gradients are held in; None: JobSpec.reduce_dtype's default. float32 with 16-bit weights is Megatron's
    # (bf16, or --accumulate-allreduce-grads-in-fp32), so it needs master_weights
    reduce_dtype: str | None = None


def gradient_reduce_dtype(model_dtype: str, master_weights: bool, reduce_dtype: str | None = None) -> str:
    """The dtype of the gradients' reductions: [optimizer] reduce_dtype where given, else as Megatron-LM reduces
    its main gradients: float32 for bfloat16 weights with master weights, else the model's dtype."""
    if reduce_dtype:
        return reduce_dtype
    return "float32" if master_weights and model_dtype == "bfloat16" else model_dtype


@dataclass(frozen=True)
class SearchSpec:
    """Candidate values for a strategy search (harness.plan.candidates expands them)."""

    dp: tuple[int, ...] = ()
    tp: tuple[int, ...] = ()
    pp: tuple[int, ...] = ()
    micro: tuple[int, ...] = ()
    schedule: tuple[str, ...] = ()
    chunks: tuple[int, ...] = ()
    gpus: tuple[int, ...] = ()
    recompute: tuple[str, ...] = ()
    zero: tuple[int, ...] = ()
    sp: tuple[bool, ...] = ()
    cp: tuple[int, ...] = ()
    ep: tuple[int, ...] = ()
    auto: bool = False  # every valid value of each field the grid does not list (harness.plan.candidates)

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in dataclasses.fields(self))


@dataclass(frozen=True)
class JobSpec:
    model: ModelSpec
    batch: BatchSpec
    strategy: StrategySpec
    cluster: ClusterSpec
    profile: ProfileSpec = field(default_factory=ProfileSpec)
    search: SearchSpec = field(default_factory=SearchSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    source: str = field(default="<spec>", compare=False)  # where it was read from, not what it says
    # False when read offline (the analysis): a factory's "module:function" form is checked, not imported.
    import_factory: bool = field(default=True, compare=False)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per pipeline per iteration: global / (dp x micro)."""
        return self.batch.global_size // (self.strategy.dp * self.batch.micro)

    @property
    def reduce_dtype(self) -> str:
        """The dtype of the gradients' reductions (gradient_reduce_dtype)."""
        return gradient_reduce_dtype(self.model.dtype, self.optimizer.master_weights, self.optimizer.reduce_dtype)

    @property
    def reduce_bytes(self) -> int:
        return DTYPES[self.reduce_dtype]

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain data (round-trips through parse_spec)."""
        m = dataclasses.asdict(self.model)
        if m["factory"] is None:
            del m["factory"]
        if m.pop("unpadded_vocab"):  # the spec states the tokenizer's vocabulary; parsing pads it again
            m["vocab"] = self.model.unpadded_vocab
        if not m["vocab_divisible_by"]:
            del m["vocab_divisible_by"]
        if not m["dropout"]:
            del m["dropout"]
        if m["attention"] == "sdpa":
            del m["attention"]
        if m["cross_entropy"] == "torch":
            del m["cross_entropy"]
        if not self.model.moe:  # a dense model's spec names no Mixture-of-Experts field
            for key in ("experts", "top_k", "expert_ffn", "shared_experts", "moe_every", "capacity_factor", "routing",
                        "expert_histogram"):
                del m[key]
        elif not m["expert_histogram"]:
            del m["expert_histogram"]
        s = dataclasses.asdict(self.strategy)
        if (s["recompute_layers"], s["recompute_method"]) == (1, "uniform"):  # every block, as without them
            del s["recompute_layers"], s["recompute_method"]
        if not s["grad_accumulation_fusion"]:  # the default, left out as before the field
            del s["grad_accumulation_fusion"]
        search = {k: v if isinstance(v, bool) else list(v) for k, v in dataclasses.asdict(self.search).items() if v}
        out = {
            "spec_version": SPEC_VERSION,
            "model": m,
            "batch": {"global": self.batch.global_size, "micro": self.batch.micro},
            "strategy": s,
            "cluster": {k: v for k, v in dataclasses.asdict(self.cluster).items() if v is not None and k != "network"},
            "optimizer": {k: v for k, v in dataclasses.asdict(self.optimizer).items()
                          if not (k == "reduce_dtype" and v is None)},  # the default: left out, as before the field
            "profile": dataclasses.asdict(self.profile),
        }
        if self.cluster.network:
            out["cluster"]["network"] = [tier.to_dict() for tier in self.cluster.network]
        if search:
            out["search"] = search
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def to_toml(self, header: str = "", search: bool = False) -> str:
        """The spec as a TOML file that loads back into the same spec (its [search] grid only with `search`);
        `header` becomes comment lines at the top."""
        data = self.to_dict()
        if not search:
            data.pop("search", None)
        lines = [f"# {line}" for line in header.splitlines()]
        lines.append(f"spec_version = {data.pop('spec_version')}")
        for section, values in data.items():
            tables = values.pop("network", []) if section == "cluster" else []
            lines += ["", f"[{section}]"]
            lines += [f"{key} = {toml_value(value)}" for key, value in values.items() if value is not None]
            for table in tables:  # arrays of tables after their parent's keys, as TOML requires
                lines += ["", f"[[{section}.network]]"]
                lines += [f"{key} = {toml_value(value)}" for key, value in table.items()]
        return "\n".join(lines) + "\n"

    def with_changes(self, **changes: Any) -> JobSpec:
        """A new validated spec with strategy/batch/cluster fields replaced (e.g. dp=4, micro=2)."""
        data = self.to_dict()
        for key, value in changes.items():
            section = next((name for name in ("strategy", "batch", "cluster", "profile", "optimizer")
                            if key in _SECTIONS[name]), None)
            if section is None:
                known = sorted(_SECTIONS["strategy"] | _SECTIONS["batch"] | _SECTIONS["cluster"])
                raise SpecError(f"unknown field {key!r}; expected one of {', '.join(known)}", source="--strategy")
            data[section][key] = value
        if changes.get("recompute", "full") != "full":  # which blocks full recompute runs again: none then
            for key in ("recompute_layers", "recompute_method"):
                if key not in changes:
                    data["strategy"].pop(key, None)
        if "schedule" in changes and "chunks" not in changes:  # the schedule's default, as in a TOML spec
            data["strategy"]["chunks"] = default_chunks(changes["schedule"])
        degrees = [data["strategy"].get(key, 1) for key in ("dp", "tp", "pp", "cp")]
        if not {"nodes", "gpus_per_node"} & set(changes) and all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in degrees):
            # Another strategy usually means another device count: keep the node size, change the node count
            # (a degree that is not a positive whole number is left to parse_spec, which names it).
            layout = node_layout(math.prod(degrees), data["cluster"]["gpus_per_node"])
            if layout:  # else parse_spec says the strategy does not match the cluster
                data["cluster"].update(nodes=layout[0], gpus_per_node=layout[1])
        given = ",".join(f"{key}={value}" for key, value in changes.items())  # as the options that asked for them
        return parse_spec(data, source=f"{self.source} with {given}", import_factory=self.import_factory)

    def with_strategy(self, strategy: StrategySpec, micro: int, source: str | None = None) -> JobSpec:
        """This job under `strategy` at micro-batch size `micro`, without a [search] grid, on the device count the
        strategy takes (nodes of the spec's size; one node of fewer devices where it takes less than one; else a
        SpecError), held to parse_spec's rules without parsing the spec again: the search's candidates. The
        vocabulary is padded for the new strategy; `source` names it (default: the spec's)."""
        world, source = strategy.world, source or self.source
        try:
            layout = node_layout(world, self.cluster.gpus_per_node)
            if layout is None:
                raise SpecError(f"{world} devices do not fill whole nodes of {self.cluster.gpus_per_node}")
            nodes, per_node = layout
            c = self.cluster
            if c.network:
                _check_tiers_once(c.network, nodes * per_node)
            check_strategy(self.model, strategy)
            # Constructors, not dataclasses.replace: a search builds hundreds of thousands of these.
            cluster = c if (c.nodes, c.gpus_per_node) == (nodes, per_node) else ClusterSpec(
                nodes=nodes, gpus_per_node=per_node, device_memory_gb=c.device_memory_gb, device=c.device,
                network=c.network)
            batch = self.batch if micro == self.batch.micro else BatchSpec(self.batch.global_size, micro)
            spec = JobSpec(model=_padded_model(self.model, vocab_multiple(self.model, strategy)), batch=batch,
                           strategy=strategy, cluster=cluster, profile=self.profile, search=SearchSpec(),
                           optimizer=self.optimizer, source=source, import_factory=self.import_factory)
            _check_job(spec, given={})
        except SpecError as exc:
            if exc.source is None:
                located = SpecError(str(exc), source=source)
                located.field = exc.field
                raise located from None
            raise
        return spec


def node_layout(world: int, gpus_per_node: int) -> tuple[int, int] | None:
    """(nodes, GPUs a node) for `world` devices on nodes of `gpus_per_node`: whole nodes, or one node of fewer where
    `world` is less than one; None where it fills no whole number of nodes."""
    if world % gpus_per_node == 0:
        return world // gpus_per_node, gpus_per_node
    return (1, world) if world < gpus_per_node else None



MAX_SPEC_BYTES = 16 << 20  # a spec is a page or two of TOML; its largest, a routing histogram, is a separate file


def load_spec(path: str | Path, import_factory: bool = True) -> JobSpec:
    """Read and validate a TOML job spec; raises SpecError with the file, field and line."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)  # at most: /dev/zero or a stream without end is not read forever
        if len(raw) > MAX_SPEC_BYTES:
            raise SpecError(f"is over {MAX_SPEC_BYTES // (1 << 20)} MiB, far beyond any job spec; give the path to a "
                            "TOML job spec (see docs/spec.md)", source=str(path))
        text = raw.decode()
    except FileNotFoundError:
        raise SpecError("spec file not found; give the path to a TOML job spec (see docs/spec.md)",
                        source=str(path)) from None
    except IsADirectoryError:
        raise SpecError("is a folder; give the path to a TOML job spec in it (see docs/spec.md)",
                        source=str(path)) from None
    except OSError as exc:
        raise SpecError(f"cannot read spec: {exc.strerror}", source=str(path)) from None
    except UnicodeDecodeError:
        raise SpecError("is not UTF-8 text; a spec is a TOML file (see docs/spec.md)", source=str(path)) from None
    return loads_spec(text, source=str(path), import_factory=import_factory)


def loads_spec(text: str, source: str = "<spec>", import_factory: bool = True) -> JobSpec:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"malformed TOML: {exc}", source=source) from None
    except (ValueError, RecursionError):  # an integer past Python's 4,300 digits; tables nested past its recursion
        raise SpecError("malformed TOML: a number thousands of digits long, or tables nested thousands deep",
                        source=source) from None
    return parse_spec(data, source=source, import_factory=import_factory)


# Sizes beyond any real job: what events, profiles and timelines are made of grows with them, so a value past
# these (a typo, a million layers) is refused at once instead of running for hours.
LIMITS = {
    "model.layers": (100_000, "the largest models have a few hundred layers"),
    "model.hidden": (1_000_000, "the largest models' hidden size is tens of thousands"),
    "model.ffn": (10_000_000, "the largest models' feed-forward size is a few hundred thousand"),
    "model.heads": (100_000, "the largest models have a few hundred heads"),
    "model.kv_heads": (100_000, "the largest models have a few hundred heads"),
    "model.seq_len": (10_000_000, "the longest contexts trained are a few million tokens"),
    "model.vocab": (100_000_000, "the largest vocabularies have a few hundred thousand tokens"),
    "model.vocab_divisible_by": (65_536, "Megatron-LM pads to a multiple of 128 by default"),
    "batch.global": (1_000_000_000, "no job trains on a billion samples per iteration"),
    "batch.micro": (1_000_000, "a micro-batch is a few to a few thousand samples"),
    "strategy.dp": (1_048_576, "2^20 devices are more than any cluster has"),
    "strategy.tp": (1_024, "tensor parallelism spans a node or a few"),
    "strategy.cp": (1_024, "context parallelism spans a few hundred ranks at most"),
    "model.experts": (100_000, "the largest models have a few hundred experts a block"),
    "model.expert_ffn": (10_000_000, "an expert's feed-forward size is at most the dense model's"),
    "strategy.pp": (65_536, "a pipeline stage needs at least one layer"),
    "strategy.chunks": (1_024, "interleaved schedules use a few chunks per device"),
    "cluster.nodes": (1_048_576, "2^20 nodes are more than any cluster has"),
    "cluster.gpus_per_node": (4_096, "a node holds a few to a few hundred devices"),
    "profile.repeats": (1_000_000, "a profile takes tens to thousands of samples an event"),
    "profile.warmup": (100_000, "a few warm-up runs an event settle it"),
}
MAX_DEVICES = 1_048_576
MAX_MICRO_BATCHES = 100_000  # per pipeline per iteration: the timeline simulates each one


def _int(section: dict, key: str, where: str, default: Any = None, minimum: int = 1) -> int:
    value = section.get(key, default)
    field = f"{where}.{key}"
    if value is None:
        raise SpecError("is required", field=field)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"must be an integer, got {value!r}", field=field)
    if value < minimum:
        raise SpecError(f"must be >= {minimum}, got {value}", field=field)
    if field in LIMITS and value > LIMITS[field][0]:
        limit, why = LIMITS[field]
        raise SpecError(f"{value:,} is more than this tool models (at most {limit:,}: {why}); give the job's real "
                        "size", field=field)
    return value


def _number(section: dict, key: str, where: str, default: float, maximum: float = math.inf,
            minimum: float = 0.0) -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise SpecError(f"must be a positive, finite number, got {value!r}", field=f"{where}.{key}")
    if not minimum <= value <= maximum:
        raise SpecError(f"must be from {minimum:g} to {maximum:g}, got {value!r}", field=f"{where}.{key}")
    return float(value)


# a communication timeout's bounds: torch's process groups and Python's waits take it as a C integer of
# milliseconds and a platform time, and a week is past any phase; below a second the ranks cannot even meet
MAX_TIMEOUT_S = 7 * 86400.0
MIN_TIMEOUT_S = 1.0


MAX_PRECISION = 0.5


def _precision(value: Any, field: str) -> float:
    """A precision: a fraction above 0 and at most MAX_PRECISION (0.02 is 2%)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_PRECISION:
        raise SpecError(f"must be a fraction above 0 and at most {MAX_PRECISION:g} (0.02 is 2%), got {value!r}",
                        field=field)
    return float(value)


def _choice(section: dict, key: str, where: str, default: str, choices) -> str:
    value = section.get(key, default)
    if value not in choices:
        raise SpecError(f"unknown value {value!r}; expected one of {', '.join(choices)}", field=f"{where}.{key}")
    return value


def _recompute(value: Any, field: str) -> str:
    return _choice({"recompute": value}, "recompute", field.rsplit(".", 1)[0], "none", RECOMPUTE)


def _dropout(m: dict, family: str) -> float:
    """[model] dropout: a probability in [0, 1), for the built-in families."""
    value = m.get("dropout", 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise SpecError(f"must be a probability from 0 up to 1 (Megatron-LM's --hidden-dropout and "
                        f"--attention-dropout, 0.1 by default there), got {value!r}", field="model.dropout")
    if value and family == "user":
        raise SpecError("a factory model applies its own dropout; dropout is for the built-in families",
                        field="model.dropout")
    return float(value)


def _check_recompute(model: ModelSpec, strategy: StrategySpec, given: dict) -> None:
    """What selective and partial full recompute need (one SpecError each)."""
    partial = [key for key in ("recompute_layers", "recompute_method") if key in given]
    if partial and strategy.recompute != "full":
        raise SpecError(f"{partial[0]} chooses which blocks full recompute runs again, and recompute is "
                        f"{strategy.recompute!r}: set recompute = 'full', or drop {' and '.join(partial)}",
                        field=f"strategy.{partial[0]}")
    stage_blocks = -(-model.layers // strategy.virtual_stages)
    if strategy.recompute_layers > stage_blocks:
        raise SpecError(f"recompute_layers = {strategy.recompute_layers} is more than a pipeline stage's "
                        f"{stage_blocks} blocks (layers / (pp x chunks)); set it from 1 to {stage_blocks}",
                        field="strategy.recompute_layers")
    if strategy.recompute_method == "uniform" and strategy.recompute_layers > 1 and strategy.zero == 3:
        raise SpecError(f"recompute_layers = {strategy.recompute_layers} (uniform) with zero = 3 is not built "
                        "(FSDP2 gathering a chunk of blocks to run them again); set zero < 3, recompute_layers "
                        "= 1, or recompute_method = 'block'", field="strategy.recompute_layers")
    if strategy.recompute == "selective":
        if model.family == "user":
            raise SpecError("selective recompute runs the attention core again, and a factory model's attention "
                            "is its own code; use recompute = 'full' or 'none'", field="strategy.recompute")
        if strategy.cp > 1:
            raise SpecError(f"selective recompute with cp = {strategy.cp} is not built (the ring's exchanges run "
                            "again in the backward); use recompute = 'full' or 'none', or cp = 1",
                            field="strategy.recompute")
    if model.dropout and strategy.cp > 1:
        raise SpecError(f"dropout with cp = {strategy.cp} is not built (the attention dropout across a "
                        "context-parallel ring); set dropout = 0, or cp = 1", field="model.dropout")
    if model.attention == "materialized" and strategy.cp > 1:
        raise SpecError(f"materialized attention with cp = {strategy.cp} is not built (the context-parallel ring "
                        "runs fused attention over its chunks); set attention = 'sdpa', or cp = 1",
                        field="model.attention")


def _flag(section: dict, key: str, where: str, default: bool) -> bool:
    value = section.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(f"must be true or false, got {value!r}", field=f"{where}.{key}")
    return value


def _zero(value: Any, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value not in ZERO_STAGES:
        raise SpecError(f"must be a ZeRO stage, one of {', '.join(map(str, ZERO_STAGES))} (0: no sharding; 1: the "
                        f"optimizer state; 2: and the gradients; 3: and the weights), got {value!r}", field=field)
    return int(value)


def _check_keys(data: dict) -> None:
    if "format" in data and "datasheet" in data and "model" not in data:
        raise SpecError("this is a device description (docs/devices.md), not a job spec: name it in a spec's "
                        "[cluster] device = \"PATH.toml\"", field="format")
    for section, value in data.items():
        if section not in _SECTIONS:
            sections = ", ".join(k for k in _SECTIONS if k != "spec_version")
            raise SpecError(f"unknown section; expected one of {sections}", field=section)
        if section == "spec_version":
            if value != SPEC_VERSION:
                raise SpecError(f"unsupported spec_version {value!r}; this harness reads version {SPEC_VERSION}",
                                field="spec_version")
            continue
        if not isinstance(value, dict):
            raise SpecError("must be a table", field=section)
        unknown = set(value) - _SECTIONS[section]
        if unknown:
            raise SpecError(f"unknown key {sorted(unknown)[0]!r}; expected one of "
                            f"{', '.join(sorted(_SECTIONS[section]))}", field=section)


def check_factory(factory: str, import_it: bool = True) -> None:
    """Check a "module:function" factory and (unless import_it is False) import it; SpecError if it fails."""
    module_name, _, func_name = factory.partition(":")
    if not module_name or not func_name:
        raise SpecError(f"factory {factory!r} must look like 'package.module:function'", field="model.factory")
    if not import_it:
        return
    try:
        module = importlib.import_module(module_name)
    except SystemExit as exc:  # a module that exits as it is imported would end the run without a word
        raise SpecError(f"cannot import factory module {module_name!r}: it called sys.exit({exc.code!r}) as it was "
                        "imported; keep a script's main code under `if __name__ == \"__main__\":`",
                        field="model.factory") from None
    except Exception as exc:  # an ImportError or any error raised while importing the user's module
        raise SpecError(f"cannot import factory module {module_name!r}: {exc}", field="model.factory") from None
    if not callable(getattr(module, func_name, None)):
        raise SpecError(f"module {module_name!r} has no callable {func_name!r}", field="model.factory")


def _parse_model(m: dict, import_factory: bool) -> ModelSpec:
    factory = m.get("factory")
    name = m.get("name")
    if factory is not None:
        if not isinstance(factory, str):
            raise SpecError("must be a string 'module:function'", field="model.factory")
        check_factory(factory, import_factory)
        base: dict[str, Any] = dict(family="user", layers=m.get("layers"), hidden=m.get("hidden", 0),
                                    heads=m.get("heads", 1), ffn=m.get("ffn", 0), seq_len=m.get("seq_len"),
                                    vocab=m.get("vocab"))
        if name is not None and not isinstance(name, str):
            raise SpecError(f"must be a string, got {name!r}", field="model.name")
        name = name or factory
    else:
        if not isinstance(name, str):
            raise SpecError(f"give a built-in model name ({', '.join(MODEL_PRESETS)}), a family ("
                            f"{', '.join(FAMILIES)}) with every size, or a factory", field="model.name")
        if name not in MODEL_PRESETS and name not in FAMILIES:
            raise SpecError(f"unknown model {name!r}; built-ins are {', '.join(MODEL_PRESETS)}, the families "
                            f"{', '.join(FAMILIES)} with every size given, or use factory = 'module:function'",
                            field="model.name")
        base = dict(MODEL_PRESETS[name]) if name in MODEL_PRESETS else dict(family=name)
        if "family" in m and m["family"] != base["family"]:
            raise SpecError(f"{name} is a {base['family']} model; drop 'family' or use a factory", field="model.family")
    merged = {**base, **{k: v for k, v in m.items() if k not in ("name", "factory", "family", "dtype")}}
    if "kv_heads" not in m:
        base_heads, base_kv = base.get("heads"), base.get("kv_heads", base.get("heads"))
        heads = merged.get("heads")
        # Shrinking a preset keeps its grouped-query ratio where it divides, else plain multi-head attention.
        ratio = (base_heads // base_kv) if base_heads and base_kv else 1
        merged["kv_heads"] = heads // ratio if isinstance(heads, int) and heads % ratio == 0 else heads
    ints = {}
    for key in ("layers", "heads", "kv_heads", "seq_len", "vocab"):
        ints[key] = _int(merged, key, "model")
    for key in ("hidden", "ffn"):
        ints[key] = _int(merged, key, "model", minimum=0 if merged["family"] == "user" else 1)
    dtype = _choice(m, "dtype", "model", "float32", tuple(DTYPES))
    tie = _flag(m, "tie_embeddings", "model", False)
    if tie and merged["family"] == "user":
        raise SpecError("a factory model ties its own weights; tie_embeddings is for the built-in models",
                        field="model.tie_embeddings")
    if merged["family"] != "user":
        if ints["hidden"] % ints["heads"]:
            raise SpecError(f"hidden ({ints['hidden']}) must be divisible by heads ({ints['heads']})",
                            field="model.hidden")
        if ints["heads"] % ints["kv_heads"]:
            raise SpecError(f"heads ({ints['heads']}) must be divisible by kv_heads ({ints['kv_heads']})",
                            field="model.kv_heads")
    divisible_by = _int(m, "vocab_divisible_by", "model", 0, minimum=0)
    if divisible_by and merged["family"] == "user":
        raise SpecError("a factory model sizes its own vocabulary; vocab_divisible_by is for the built-in models",
                        field="model.vocab_divisible_by")
    attention = _choice(m, "attention", "model", "sdpa", ATTENTION_KINDS)
    if "attention" in m and merged["family"] == "user":
        raise SpecError("a factory model's attention is its own code; attention is for the built-in families",
                        field="model.attention")
    cross_entropy = _choice(m, "cross_entropy", "model", "torch", CROSS_ENTROPY_KINDS)
    if "cross_entropy" in m and merged["family"] == "user":
        raise SpecError("a factory model's loss is its own code; cross_entropy is for the built-in families",
                        field="model.cross_entropy")
    return ModelSpec(name=name, family=merged["family"], dtype=dtype, factory=factory, tie_embeddings=tie,
                     vocab_divisible_by=divisible_by, dropout=_dropout(m, merged["family"]), attention=attention,
                     cross_entropy=cross_entropy,
                     **ints,
                     **_parse_experts(merged, ints, m))


def _parse_experts(merged: dict, ints: dict, given_fields: dict) -> dict[str, Any]:
    """The Mixture-of-Experts fields of [model] (ModelSpec), checked; none of them given without experts (a MoE
    preset with experts = 0 is its dense form)."""
    from harness.plan.routing import parse_routing

    keys = ("top_k", "expert_ffn", "shared_experts", "moe_every", "capacity_factor", "routing", "expert_histogram")
    experts = _int(merged, "experts", "model", 0, minimum=0)
    if not experts:
        given = [k for k in keys if k in given_fields]
        if given:
            raise SpecError(f"{', '.join(given)} describe Mixture-of-Experts blocks; set experts > 0 (the experts per "
                            "MoE block), or drop them", field=f"model.{given[0]}")
        return {}
    if merged["family"] == "user":
        raise SpecError("a factory model builds its own layers; experts are for the built-in families",
                        field="model.experts")
    top_k = _int(merged, "top_k", "model", 2 if experts >= 2 else 1)
    if top_k > experts:
        raise SpecError(f"top_k ({top_k}) routes each token to that many experts, more than the {experts} there are; "
                        f"set top_k between 1 and {experts}", field="model.top_k")
    moe_every = _int(merged, "moe_every", "model", 1)
    if moe_every > ints["layers"]:
        raise SpecError(f"moe_every = {moe_every} makes every {moe_every}-th block a Mixture-of-Experts one, and the "
                        f"model has {ints['layers']} blocks: none would be; set moe_every <= layers",
                        field="model.moe_every")
    capacity = merged.get("capacity_factor", 0.0)
    if isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or not math.isfinite(capacity) \
            or capacity < 0:
        raise SpecError(f"must be a number of 0 or more (0: dropless; 1.25: an expert takes at most 1.25 x its even "
                        f"share of the tokens), got {capacity!r}", field="model.capacity_factor")
    routing = merged.get("routing", "uniform")
    if not isinstance(routing, str):
        raise SpecError(f"must be a string: uniform, zipf:S or file:PATH, got {routing!r}", field="model.routing")
    if "expert_histogram" in merged and not routing.startswith("file:"):
        raise SpecError(f"expert_histogram is a measured routing's, and routing is {routing!r}: set routing = "
                        "'file:PATH' (the spec then keeps its histogram), or drop expert_histogram",
                        field="model.expert_histogram")
    histogram = parse_routing(routing, experts, ints["layers"] // moe_every, merged.get("expert_histogram"))
    return {"experts": experts, "top_k": top_k,
            "expert_ffn": _int(merged, "expert_ffn", "model", ints["ffn"]),
            "shared_experts": _int(merged, "shared_experts", "model", 0, minimum=0), "moe_every": moe_every,
            "capacity_factor": float(capacity), "routing": routing, "expert_histogram": histogram}


def _parse_search(s: dict) -> SearchSpec:
    values = {}
    for key in _SECTIONS["search"]:
        if key not in s:
            continue
        if key == "auto":
            values[key] = _flag(s, key, "search", False)
            continue
        items = s[key]
        if not isinstance(items, list) or not items:
            raise SpecError("must be a non-empty list of candidates", field=f"search.{key}")
        for item in items:
            if key == "schedule":
                _choice({key: item}, key, "search", "1f1b", SCHEDULES)
            elif key == "recompute":
                _recompute(item, "search.recompute")
            elif key == "zero":
                _zero(item, "search.zero")
            elif key == "sp":
                _flag({key: item}, key, "search", False)
            else:
                value = _int({key: item}, key, "search")
                if key == "gpus" and value > MAX_DEVICES:
                    raise SpecError(f"{value:,} devices is more than the {MAX_DEVICES:,} a spec may describe",
                                    field="search.gpus")
        values[key] = tuple(items)
    return SearchSpec(**values)


def parse_spec(data: dict, source: str = "<spec>", import_factory: bool = True) -> JobSpec:
    """Validate plain data (as read from TOML) into a JobSpec; every error names its field.

    import_factory=False checks a factory model's "module:function" form without importing it (offline use).
    """
    try:
        spec = _parse_spec(data, import_factory)
    except SpecError as exc:
        if exc.source is None:
            located = SpecError(str(exc), source=source)
            located.field = exc.field  # still the field's, for a caller that maps it back (the importers)
            raise located from None
        raise
    return dataclasses.replace(spec, source=source)


def _parse_spec(data: dict, import_factory: bool) -> JobSpec:
    _check_keys(data)
    for section in ("model", "batch", "strategy", "cluster"):
        if section not in data:
            raise SpecError("section is missing (see docs/spec.md)", field=section)
    model = _parse_model(data["model"], import_factory)
    b = data["batch"]
    batch = BatchSpec(global_size=_int(b, "global", "batch"), micro=_int(b, "micro", "batch"))
    s = data["strategy"]
    schedule = _choice(s, "schedule", "strategy", "1f1b", SCHEDULES)
    chunks = _int(s, "chunks", "strategy", default=default_chunks(schedule))
    dp_overlap = _flag(s, "dp_overlap", "strategy", True)
    strategy = StrategySpec(dp=_int(s, "dp", "strategy", 1), tp=_int(s, "tp", "strategy", 1),
                            pp=_int(s, "pp", "strategy", 1), schedule=schedule, chunks=chunks,
                            dp_overlap=dp_overlap, bucket_mb=_number(s, "bucket_mb", "strategy", 25.0),
                            recompute=_recompute(s.get("recompute", "none"), "strategy.recompute"),
                            zero=_zero(s.get("zero", 0), "strategy.zero"),
                            vocab_parallel=_flag(s, "vocab_parallel", "strategy", True),
                            sp=_flag(s, "sp", "strategy", False), cp=_int(s, "cp", "strategy", 1),
                            cp_comm=_choice(s, "cp_comm", "strategy", "ring", CP_COMMS),
                            ep=_int(s, "ep", "strategy", 1),
                            recompute_layers=_int(s, "recompute_layers", "strategy", 1),
                            recompute_method=_choice(s, "recompute_method", "strategy", "uniform", RECOMPUTE_METHODS),
                            grad_accumulation_fusion=_flag(s, "grad_accumulation_fusion", "strategy", False))
    model = pad_vocab(model, strategy)
    c = data["cluster"]
    memory = c.get("device_memory_gb")
    device = None if c.get("device") is None else load_device(c["device"])  # validated here; its memory by default
    cluster = ClusterSpec(nodes=_int(c, "nodes", "cluster", 1), gpus_per_node=_int(c, "gpus_per_node", "cluster", 1),
                          device_memory_gb=(device and device.memory_gb) if memory is None
                          else _number(c, "device_memory_gb", "cluster", 1.0), device=c.get("device"))
    if "network" in c:
        cluster = dataclasses.replace(cluster, network=parse_network(c["network"], cluster.devices))
    o = data.get("optimizer", {})
    master = _flag(o, "master_weights", "optimizer", False)
    momentum = o.get("momentum", 0.9)
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise SpecError(f"must be a number from 0 up to 1, got {momentum!r}", field="optimizer.momentum")
    reduce_dtype = o.get("reduce_dtype")
    if reduce_dtype is not None:
        reduce_dtype = _choice(o, "reduce_dtype", "optimizer", None, tuple(DTYPES))
    optimizer = OptimizerSpec(name=_choice(o, "name", "optimizer", "adam", OPTIMIZERS), momentum=float(momentum),
                              master_weights=master, reduce_dtype=reduce_dtype)
    p = data.get("profile", {})
    profile = ProfileSpec(warmup=_int(p, "warmup", "profile", 3, minimum=0), repeats=_int(p, "repeats", "profile", 10),
                          backend=_choice(p, "backend", "profile", "torch", BACKENDS),
                          timeout_s=_number(p, "timeout_s", "profile", 600.0, MAX_TIMEOUT_S, MIN_TIMEOUT_S),
                          device=_choice(p, "device", "profile", "auto", ("auto", "cpu", "cuda")),
                          precision=_precision(p.get("precision", 0.02), "profile.precision"),
                          budget_s=_number(p, "budget_s", "profile", 60.0))
    search = _parse_search(data.get("search", {}))
    spec = JobSpec(model=model, batch=batch, strategy=strategy, cluster=cluster, profile=profile, search=search,
                   optimizer=optimizer, import_factory=import_factory)
    _check_job(spec, given=s)
    return spec


def check_strategy(model: ModelSpec, strategy: StrategySpec) -> None:
    """The rules between a strategy's fields and the model's shape (one SpecError naming the field); none depends
    on the vocabulary's padding, the batch or the cluster, so a search checks them before building a candidate."""
    schedule, chunks = strategy.schedule, strategy.chunks
    if strategy.zero and strategy.dp == 1:
        raise SpecError(f"zero = {strategy.zero} shards over the data-parallel replicas, and dp = 1 has one: set "
                        "zero = 0, or dp > 1", field="strategy.zero")
    if strategy.zero and strategy.tp > 1:
        raise SpecError(f"zero = {strategy.zero} with tensor parallelism (tp > 1) is not built (FSDP over "
                        "tensor-parallel shards); set tp = 1 or zero = 0", field="strategy.zero")
    if model.tie_embeddings and strategy.zero:
        raise SpecError(f"tie_embeddings with zero = {strategy.zero} is not built (FSDP2 units sharing a weight); "
                        "set zero = 0, or tie_embeddings = false", field="model.tie_embeddings")
    if model.tie_embeddings and strategy.split_backward:
        raise SpecError(f"tie_embeddings with {schedule} is not built (a split backward of a shared weight); use "
                        "schedule = '1f1b', or tie_embeddings = false", field="model.tie_embeddings")
    if schedule not in INTERLEAVED and chunks != 1:
        raise SpecError(f"chunks = {chunks} needs an interleaved schedule ({' or '.join(INTERLEAVED)}); "
                        f"{schedule} runs one chunk per device", field="strategy.chunks")
    if strategy.split_backward:  # what a split backward does not run with yet
        for name, value, off, what in (("tp", strategy.tp, 1, "tensor-parallel all-reduces"),
                                       ("zero", strategy.zero, 0, "FSDP2"),
                                       ("recompute", strategy.recompute, "none", "torch.utils.checkpoint")):
            if value != off:
                raise SpecError(f"{schedule} with {name} = {value!r} is not built (a backward split into input and "
                                f"weight gradients, with {what}); set {name} = {off!r}, or schedule = '1f1b'",
                                field=f"strategy.{name}")
    if model.layers % strategy.virtual_stages:
        what = f"pp x chunks = {strategy.pp} x {chunks}" if chunks > 1 else f"pp = {strategy.pp}"
        raise SpecError(f"layers ({model.layers}) must be divisible by {what}", field="model.layers")
    if strategy.tp > 1:
        if model.family == "user":
            raise SpecError("tensor parallelism (tp > 1) is supported for the built-in models only; "
                            "set tp = 1 for a factory model", field="strategy.tp")
        for key in ("heads", "kv_heads", "hidden", "ffn"):
            if getattr(model, key) % strategy.tp:
                raise SpecError(f"{key} ({getattr(model, key)}) must be divisible by tp ({strategy.tp})",
                                field=f"model.{key}")
    if strategy.sp:
        if strategy.tp == 1:
            raise SpecError("sp = true splits the sequence over the tensor-parallel group, and tp = 1 has none: set "
                            "tp > 1, or sp = false", field="strategy.sp")
        if not strategy.vocab_parallel:
            raise SpecError("sp = true with vocab_parallel = false is not built (Megatron-LM's sequence parallelism "
                            "reduce-scatters the vocabulary-parallel embedding's output); set vocab_parallel = true, "
                            "or sp = false", field="strategy.sp")
        if model.seq_len % strategy.tp:
            raise SpecError(f"seq_len ({model.seq_len}) must be divisible by tp ({strategy.tp}) to split the sequence "
                            "(sp = true)", field="model.seq_len")


def _check_job(spec: JobSpec, given: dict) -> None:
    """The rules across a parsed spec's sections (one SpecError naming the field); `given`: the strategy table as
    written, for the rules on what it names."""
    model, batch, strategy, cluster = spec.model, spec.batch, spec.strategy, spec.cluster
    profile, optimizer, schedule = spec.profile, spec.optimizer, spec.strategy.schedule
    if strategy.world != cluster.devices:
        raise SpecError(f"{strategy.layout} = {strategy.world} must equal "
                        f"nodes x gpus_per_node = {cluster.nodes} x {cluster.gpus_per_node} = {cluster.devices}",
                        field="strategy")
    check_strategy(model, strategy)
    if strategy.cp > 1:
        _check_context_parallel(model, strategy)
    _check_recompute(model, strategy, given)
    if model.moe or strategy.ep > 1:
        _check_experts(model, strategy)
    if profile.backend == "mpi4py" and model.dtype == "bfloat16":
        raise SpecError("the mpi4py backend cannot send bfloat16 (numpy has no such type); use backend = 'torch' "
                        "or dtype float16/float32", field="profile.backend")
    if batch.global_size % (strategy.dp * batch.micro):
        raise SpecError(f"global ({batch.global_size}) must be divisible by dp x micro = "
                        f"{strategy.dp} x {batch.micro} = {strategy.dp * batch.micro}", field="batch.global")
    micro_batches = batch.global_size // (strategy.dp * batch.micro)
    if strategy.world > MAX_DEVICES:
        raise SpecError(f"{strategy.layout.split(' = ')[0]} = {strategy.world:,} devices is more than this tool models "
                        f"(at most {MAX_DEVICES:,})", field="strategy")
    if micro_batches > MAX_MICRO_BATCHES:
        raise SpecError(f"{micro_batches:,} micro-batches per pipeline (global / (dp x micro)) is more than the "
                        f"timeline simulates (at most {MAX_MICRO_BATCHES:,}); raise batch.micro or dp",
                        field="batch.global")
    rounds = zero_bubble_rounds(micro_batches, strategy.pp)
    if strategy.split_backward and micro_batches % rounds:
        raise SpecError(f"{schedule} runs the micro-batches in rounds of micro-batches // pp ({rounds}); the "
                        f"micro-batch count ({micro_batches} = global / (dp x micro)) must be a multiple of it",
                        field="batch.global")
    if schedule == "interleaved-1f1b" and micro_batches % strategy.pp:
        raise SpecError(f"interleaved-1f1b needs the micro-batch count ({micro_batches} = global / (dp x micro)) "
                        f"to be a multiple of pp ({strategy.pp})", field="batch.global")
    if optimizer.master_weights and model.dtype == "float32":
        raise SpecError("master weights keep an fp32 copy of 16-bit weights; with dtype float32 set "
                        "master_weights = false", field="optimizer.master_weights")
    if optimizer.reduce_dtype not in (None, model.dtype) and not (optimizer.reduce_dtype == "float32"
                                                                   and optimizer.master_weights):
        raise SpecError(f"gradients are reduced in the model's dtype ({model.dtype}), or in float32 where "
                        "master_weights = true keeps float32 main gradients (Megatron); got "
                        f"{optimizer.reduce_dtype!r}", field="optimizer.reduce_dtype")


@functools.lru_cache(maxsize=64)
def _padded_model(model: ModelSpec, multiple: int) -> ModelSpec:
    """`model` with its tokenizer's vocabulary padded to a multiple of `multiple` (pad_vocab), once per pair."""
    vocab = model.unpadded_vocab or model.vocab
    padded = -(-vocab // multiple) * multiple
    if padded == model.vocab:
        return model
    return dataclasses.replace(model, vocab=padded, unpadded_vocab=vocab if padded != vocab else 0)


@functools.lru_cache(maxsize=64)
def _check_tiers_once(network: tuple[NetworkTier, ...], devices: int) -> None:
    """check_tiers, once per network and device count (an error is raised again each time)."""
    check_tiers(network, devices)


def vocab_multiple(model: ModelSpec, strategy: StrategySpec) -> int:
    """What the vocabulary is padded to a multiple of (1: not padded), as Megatron-LM pads it: its
    make-vocab-size-divisible-by x tp; by default (vocab_divisible_by = 0) VOCAB_PAD x tp, and only where tp does
    not divide the vocabulary and the embedding is split by it. A factory model's vocabulary is its own."""
    if model.family == "user":
        return 1
    if model.vocab_divisible_by:
        return model.vocab_divisible_by * strategy.tp
    vocab = model.unpadded_vocab or model.vocab
    return VOCAB_PAD * strategy.tp if strategy.vocab_sharded and vocab % strategy.tp else 1


def pad_vocab(model: ModelSpec, strategy: StrategySpec) -> ModelSpec:
    """The model with its vocabulary padded for `strategy` (vocab_multiple): the padded rows are built, stored and
    computed as the others are; unpadded_vocab keeps the tokenizer's."""
    return _padded_model(model, vocab_multiple(model, strategy))


def vocab_padding_note(spec: JobSpec) -> str | None:
    """One line saying how the vocabulary was padded, or None where it was not."""
    model = spec.model
    if not model.unpadded_vocab:
        return None
    multiple = vocab_multiple(model, spec.strategy)
    divisor = model.vocab_divisible_by or VOCAB_PAD
    return (f"note: vocab {model.unpadded_vocab:,} padded to {model.vocab:,} as Megatron-LM pads it (a multiple of "
            f"{divisor} x tp = {multiple:,}); the {model.vocab - model.unpadded_vocab:,} padded rows cost their "
            "memory and FLOPs")


def _check_experts(model: ModelSpec, strategy: StrategySpec) -> None:
    """What expert parallelism and Mixture-of-Experts blocks need of the other strategies (one SpecError each)."""
    ep = strategy.ep
    if not model.moe:
        raise SpecError(f"ep = {ep} shards a Mixture-of-Experts block's experts, and the model has none; set "
                        "[model] experts, or ep = 1", field="strategy.ep")
    if model.experts % ep:
        raise SpecError(f"ep ({ep}) must divide the experts ({model.experts}): each ep rank holds experts / ep",
                        field="strategy.ep")
    if strategy.dp % ep:
        raise SpecError(f"ep ({ep}) must divide dp ({strategy.dp}): the ep ranks are carved out of the data-parallel "
                        "ones", field="strategy.ep")
    for name, value, off, what in (("tp", strategy.tp, 1, "experts beside tensor-parallel shards"),
                                   ("cp", strategy.cp, 1, "routing a context-parallel rank's tokens"),
                                   ("zero", strategy.zero, 0, "FSDP2 over expert shards"),
                                   ("schedule", strategy.schedule if strategy.split_backward else "1f1b", "1f1b",
                                    "a split backward through the all-to-alls")):
        if value != off:
            raise SpecError(f"Mixture-of-Experts blocks with {name} = {value!r} are not built ({what}); set "
                            f"{name} = {off!r}", field=f"strategy.{name}")


def _check_context_parallel(model: ModelSpec, strategy: StrategySpec) -> None:
    """What context parallelism needs of the model and the other strategies (one SpecError each)."""
    cp = strategy.cp
    if model.family == "user":
        raise SpecError(f"cp = {cp} splits attention over a ring of ranks, and a factory model's attention is its "
                        "own code, which the tool cannot split; set cp = 1, or describe the model as a built-in "
                        "family", field="strategy.cp")
    if model.seq_len % (2 * cp):
        raise SpecError(f"cp = {cp} must divide seq_len / 2 ({model.seq_len} / 2): the sequence is cut into 2 x cp "
                        "equal chunks, two a rank (zigzag)", field="strategy.cp")
    if strategy.sp and (model.seq_len // cp) % strategy.tp:
        raise SpecError(f"seq_len / cp ({model.seq_len // cp}) must be divisible by tp ({strategy.tp}) for sequence "
                        "parallelism within each context-parallel rank", field="model.seq_len")
    for name, value, off, what in (("zero", strategy.zero, 0, "FSDP2 over the data- and context-parallel ranks"),
                                   ("schedule", strategy.schedule if strategy.split_backward else "1f1b", "1f1b",
                                    "a backward split into input and weight gradients"),
                                   ("tie_embeddings", model.tie_embeddings and strategy.pp > 1, False,
                                    "the tied copies' all-reduce")):
        if value != off:
            raise SpecError(f"cp = {cp} with {name} = {value!r} is not built ({what} with context parallelism); set "
                            f"{name} = {off!r}, or cp = 1", field=f"strategy.{name}" if name != "tie_embeddings"
                            else "model.tie_embeddings")


def parse_strategy_overrides(text: str) -> dict[str, Any]:
    """Parse "dp=4,tp=2,schedule=gpipe" into typed overrides for JobSpec.with_changes."""
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise SpecError(f"expected key=value, got {item!r}", source="--strategy")
        key = key.strip()
        value = value.strip()
        if key in out:
            raise SpecError(f"{key} is given twice ({text!r}); give each field once", source="--strategy")
        if key == "network":  # with_changes takes the tiers as a list of tables, which key=value cannot write
            raise SpecError("network is a table of tiers, not a value; give --network SPEC (a spec's "
                            "[[cluster.network]]) or --network TIER.FIELD=VALUE", source="--strategy")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
        else:
            try:
                out[key] = int(value)
            except ValueError:
                try:
                    out[key] = float(value)
                except ValueError:
                    out[key] = value
    return out
