"""A Megatron-LM / Megatron-Core / Megatron-DeepSpeed launch as a job spec (docs/spec.md, "From Megatron's
arguments"): a shell script (its variables, arrays and #SBATCH lines expanded as bash would) or the arguments as
one string. Pure Python.

Rules: the model's shape, the batch, the parallelism, recompute, precision and the data-parallel overlap map to
the spec's fields; the GPU count comes from the launcher's line (torchrun, python -m torch.distributed.run or
.launch, deepspeed, srun, sbatch) or from `gpus`; what the spec cannot express is listed as not modelled, data,
path, logging and training-schedule arguments as ignored, anything else as unknown. A value the spec or Megatron
would refuse stops with one message naming the argument (UserError, exit 2).
"""
from __future__ import annotations

import ast
import math
import operator
import re
import shlex
from pathlib import Path

from harness.common.errors import SpecError, UserError
from harness.plan.importers import ImportedSpec, same_preset
from harness.plan.spec import DTYPES, VOCAB_PAD, gradient_reduce_dtype, parse_spec

GPT2_VOCAB = 50257  # GPT-2's BPE tokenizer (--vocab-file and --merge-file, Megatron's GPT2BPETokenizer)
DEFAULT_DROPOUT = 0.1  # Megatron's --hidden-dropout and --attention-dropout when not given

# Arguments that take no value (store_true in Megatron's argparse).
FLAGS = {
    "--swiglu", "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights", "--fp16", "--bf16",
    "--group-query-attention", "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce",
    "--overlap-param-gather", "--tp-comm-overlap", "--overlap-p2p-communication", "--recompute-activations",
    "--checkpoint-activations", "--distribute-saved-activations", "--disable-bias-linear", "--add-bias-linear",
    "--moe-grouped-gemm", "--use-flash-attn", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--apply-query-key-layer-scaling", "--no-query-key-layer-scaling",
    "--use-mcore-models", "--use-legacy-models", "--qk-layernorm", "--apply-layernorm-1p", "--no-position-embedding",
    "--deepspeed", "--deepspeed-activation-checkpointing", "--no-pipeline-parallel", "--no-load-optim",
    "--no-load-rng", "--finetune", "--log-num-zeros-in-grad", "--log-params-norm", "--log-throughput",
    "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard",
    "--log-world-size-to-tensorboard", "--log-batch-size-to-tensorboard", "--use-checkpoint-args",
    "--use-dist-ckpt", "--async-save", "--mock-data", "--bert-no-binary-head",
    "--no-async-tensor-model-parallel-allreduce", "--use-cpu-initialization", "--manual-gc", "--moe-router-pre-softmax",
    "--no-rope-fusion", "--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler",
    "--defer-embedding-wgrad-compute", "--align-grad-reduce", "--cpu-optimizer", "--zero-bubble-v-schedule",
    "--disable-moe-token-dropping", "--create-moe-param-group", "--partition-activations", "--checkpoint-in-cpu",
    "--contigious-checkpointing", "--fp32-residual-connection", "--bert-binary-head", "--use-flash-attn-v1",
    "--use-flash-attn-v2", "--use-flash-attn-triton", "--use-flash-attn-builder", "--fp16-lm-cross-entropy",
    "--grad-reduce-in-bf16",
}
# Attention's kernels (_attention): flash attention's flags (Megatron-LM's, Megatron-DeepSpeed's versions); the
# arguments only Megatron-DeepSpeed and the older Megatron-LM take, whose attention was local (materialised)
FLASH_FLAGS = ("--use-flash-attn", "--use-flash-attn-v1", "--use-flash-attn-v2", "--use-flash-attn-triton",
               "--use-flash-attn-builder")
LOCAL_ATTENTION_ERA = ("--deepspeed", "--deepspeed_config", "--deepspeed-config", "--checkpoint-activations",
                       "--deepspeed-activation-checkpointing", "--DDP-impl", "--use-legacy-models")

# Known arguments with no bearing on an iteration's cost, by what they are.
_IGNORED = {
    "data": ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path", "--data-cache-path",
             "--split", "--data-impl", "--mmap-warmup", "--num-workers", "--mock-data", "--dataloader-type"),
    "tokenizer": ("--vocab-file", "--merge-file", "--tokenizer-type", "--tokenizer-model", "--vocab-extra-ids"),
    "paths and checkpoints": ("--save", "--load", "--save-interval", "--no-load-optim", "--no-load-rng",
                              "--finetune", "--use-checkpoint-args", "--use-dist-ckpt", "--ckpt-format",
                              "--async-save", "--deepspeed_config", "--deepspeed-config", "--pretrained-checkpoint",
                              "--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler"),
    "logging and evaluation": ("--log-interval", "--eval-interval", "--eval-iters", "--tensorboard-dir",
                               "--tensorboard-log-interval", "--tensorboard-queue-size", "--timing-log-level",
                               "--timing-log-option", "--wandb-project", "--wandb-exp-name", "--wandb-save-dir",
                               "--log-num-zeros-in-grad", "--log-params-norm", "--log-throughput",
                               "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                               "--log-memory-to-tensorboard", "--log-world-size-to-tensorboard",
                               "--log-batch-size-to-tensorboard", "--exit-interval", "--exit-duration-in-mins"),
    "training schedule and numerics": (
        "--train-iters", "--train-samples", "--lr", "--min-lr", "--lr-decay-style", "--lr-decay-iters",
        "--lr-decay-samples", "--lr-warmup-fraction", "--lr-warmup-iters", "--lr-warmup-samples", "--weight-decay",
        "--adam-beta1", "--adam-beta2", "--adam-eps", "--clip-grad", "--seed", "--init-method-std", "--loss-scale",
        "--initial-loss-scale", "--min-loss-scale", "--loss-scale-window", "--hysteresis", "--norm-epsilon",
        "--layernorm-epsilon", "--rotary-base", "--rotary-percent", "--attention-softmax-in-fp32",
        "--apply-query-key-layer-scaling", "--no-query-key-layer-scaling", "--apply-layernorm-1p",
        "--moe-aux-loss-coeff", "--moe-z-loss-coeff", "--moe-router-load-balancing-type",
        "--moe-router-pre-softmax", "--bert-no-binary-head", "--use-cpu-initialization", "--moe-loss-coeff",
        "--moe-eval-capacity-factor", "--create-moe-param-group", "--bert-binary-head"),
    "launch": ("--distributed-backend", "--distributed-timeout-minutes", "--local_rank", "--local-rank",
               "--deepspeed", "--no-pipeline-parallel", "--use-mcore-models", "--use-legacy-models",
               "--empty-unused-memory-level", "--manual-gc"),
}
IGNORED = {name: what for what, names in _IGNORED.items() for name in names}

# Known arguments the spec cannot express (their cost is left out); the value says what is lost.
NOT_MODELLED = {
    "--overlap-param-gather": "the distributed optimizer's parameter all-gather overlapped with the forward",
    "--tp-comm-overlap": "tensor-parallel communication overlapped with the GEMMs",
    "--overlap-p2p-communication": "pipeline sends overlapped with compute",
    "--distribute-saved-activations": "recompute's saved inputs split over the tp group",
    "--moe-grouped-gemm": "the experts' GEMMs grouped into one kernel",
    "--moe-token-dispatcher-type": "the all-to-all dispatcher's kind",
    "--moe-router-topk-scaling-factor": "scaled routing weights",
    "--no-masked-softmax-fusion": "an unfused softmax", "--no-bias-gelu-fusion": "an unfused bias and GELU",
    "--no-bias-dropout-fusion": "an unfused bias and dropout", "--no-rope-fusion": "unfused rotary embeddings",
    "--rampup-batch-size": "a batch size that ramps up (the spec's is the final one)",
    "--qk-layernorm": "query and key norms", "--no-position-embedding": "no position embedding",
    "--fp8-format": "fp8 GEMMs", "--fp8": "fp8 GEMMs",
    "--decoder-first-pipeline-num-layers": "an uneven first pipeline stage",
    "--decoder-last-pipeline-num-layers": "an uneven last pipeline stage",
    "--account-for-embedding-in-pipeline-split": "the embedding counted as a layer in the pipeline split",
    "--account-for-loss-in-pipeline-split": "the loss counted as a layer in the pipeline split",
    "--pipeline-model-parallel-split-rank": "an encoder-decoder split", "--cpu-optimizer": "an optimizer on the CPU",
    "--defer-embedding-wgrad-compute": "the embedding's weight gradient deferred",
    "--align-grad-reduce": "gradient reductions aligned over pipeline stages",
    "--recompute-modules": "recompute of chosen modules", "--zero-bubble-v-schedule": "the ZB-V schedule",
    "--expert-tensor-parallel-size": "tensor parallelism inside the experts",
    "--moe-layer-freq": "a pattern of MoE and dense blocks other than every N-th",
    "--kv-channels": "a head size other than hidden / heads",
    "--moe-min-capacity": "a least capacity an expert takes", "--mlp-type": "residual (PR-)MoE blocks",
    "--partition-activations": "DeepSpeed's saved activations split over the tp group",
    "--checkpoint-in-cpu": "saved activations kept in host memory",
    "--contigious-checkpointing": "saved activations in one buffer", "--fp32-residual-connection": "fp32 residuals",
    "--fp16-lm-cross-entropy": "the loss on 16-bit logits (costed on float32 ones)",
}

# The spec field a SpecError names -> the argument that set it (a refusal names the argument).
FIELD_ARGUMENT = {
    "model.layers": "--num-layers", "model.hidden": "--hidden-size", "model.heads": "--num-attention-heads",
    "model.kv_heads": "--num-query-groups", "model.ffn": "--ffn-hidden-size", "model.seq_len": "--seq-length",
    "model.vocab": "--vocab-size", "model.vocab_divisible_by": "--make-vocab-size-divisible-by",
    "model.experts": "--num-experts", "model.top_k": "--moe-router-topk", "model.expert_ffn": "--moe-ffn-hidden-size",
    "model.shared_experts": "--moe-shared-expert-intermediate-size", "model.moe_every": "--moe-layer-freq",
    "model.capacity_factor": "--moe-expert-capacity-factor", "model.dropout": "--attention-dropout",
    "batch.global": "--global-batch-size",
    "batch.micro": "--micro-batch-size", "strategy.tp": "--tensor-model-parallel-size",
    "strategy.pp": "--pipeline-model-parallel-size", "strategy.chunks": "--num-layers-per-virtual-pipeline-stage",
    "strategy.sp": "--sequence-parallel", "strategy.cp": "--context-parallel-size",
    "strategy.ep": "--expert-model-parallel-size", "strategy.recompute": "--recompute-granularity",
    "strategy.recompute_layers": "--recompute-num-layers", "strategy.recompute_method": "--recompute-method",
    "strategy.bucket_mb": "--ddp-bucket-size", "optimizer.momentum": "--sgd-momentum",
}

def read_source(source: str) -> tuple[str, str]:
    """(text, where): a script's text, or `source` itself when it is the arguments (it starts with '-' or holds
    ' --'); anything else that is not a readable file is refused."""
    path = Path(source)
    if not source.strip():
        raise UserError("--from-megatron: nothing given; give a launch script or the arguments in quotes")
    if source.lstrip().startswith("-") or " --" in source:
        return source, "the arguments"
    try:
        return path.read_text(), str(path)
    except FileNotFoundError:
        raise UserError(f"--from-megatron: {source!r} is neither a file nor Megatron arguments (they start with "
                        "'--'); give a launch script or the arguments in quotes") from None
    except IsADirectoryError:
        raise UserError(f"--from-megatron: {source} is a folder; give the launch script in it") from None
    except UnicodeDecodeError:
        raise UserError(f"--from-megatron: {source} is not a text file; give a launch script (a shell script) or "
                        "the arguments in quotes") from None
    except OSError as exc:
        raise UserError(f"--from-megatron: cannot read {source} ({exc.strerror}); give a readable launch "
                        "script") from None


# ----- the shell: variables, arrays, continuations, comments -----

_ARRAY = re.compile(r"^\s*(?:export\s+|declare\s+-a\s+|local\s+)?([A-Za-z_]\w*)=\((.*)$")
_ASSIGN = re.compile(r"^([A-Za-z_]\w*)=(.*)$")
_ARITH = re.compile(r"\$\(\((.*?)\)\)")
_QUOTED_ARRAY = re.compile(r'"\$\{([A-Za-z_]\w*)\[@\]\}"')
_VAR = re.compile(r"\$\{([A-Za-z_]\w*)\[[@*]\]\}|\$\{#?([A-Za-z_]\w*)(?::?-([^}]*))?\}|\$([A-Za-z_]\w*|[0-9#@*?])")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Div: operator.floordiv, ast.Mod: operator.mod}


def _arithmetic(expr: str, names: dict[str, str]) -> str:
    """bash's $(( )) over integers (+ - * / %) and variables (bare or $-named, already expanded), or the text
    unchanged where it is something else."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and names.get(node.id, "0").lstrip("-").isdigit():
            return int(names.get(node.id, "0"))  # an unset variable is 0, as in bash
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(expr)
    try:
        return str(value(ast.parse(expr.replace("/", "//").replace("////", "//"), mode="eval").body))
    except (ValueError, SyntaxError, ZeroDivisionError):
        return f"$(({expr}))"


class _Shell:
    """Just enough of bash to read a launch script: assignments, arrays, expansion, #SBATCH lines."""

    def __init__(self) -> None:
        self.scalars: dict[str, str] = {}
        self.arrays: dict[str, list[str]] = {}
        self.commands: list[list[str]] = []
        self.sbatch: list[str] = []

    def elements(self, name: str) -> list[str]:
        """"${NAME[@]}"'s words: an array's elements, a scalar's one value, none where NAME is unset (as bash)."""
        if name in self.arrays:
            return self.arrays[name]
        return [self.scalars[name]] if name in self.scalars else []

    def expand(self, text: str) -> str:
        # "${ARGS[@]}" in quotes is still one word an element, as bash expands it
        text = _QUOTED_ARRAY.sub(lambda m: shlex.join(self.elements(m.group(1))), text)

        def variable(match: re.Match) -> str:
            array, name, default, plain = match.groups()
            if array:
                return shlex.join(self.elements(array))
            name = name or plain
            if name in self.arrays:
                return shlex.quote(self.arrays[name][0]) if self.arrays[name] else ""
            value = self.scalars.get(name, "")
            return value if value or default is None else default
        text = _VAR.sub(variable, text)
        return _ARITH.sub(lambda m: _arithmetic(m.group(1), self.scalars), text)

    def split(self, text: str) -> list[str]:
        try:
            return shlex.split(self.expand(text), comments=True)
        except ValueError:  # an unbalanced quote: the script is not one we can read
            raise UserError(f"--from-megatron: cannot split the shell line {text.strip()[:80]!r} (an unbalanced "
                            "quote?)") from None

    def run(self, text: str) -> None:
        lines = text.replace("\\\r\n", " ").replace("\\\n", " ").splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            i += 1
            if line.lstrip().startswith("#SBATCH"):
                self.sbatch += self.split(line.lstrip()[len("#SBATCH"):])
                continue
            array = _ARRAY.match(line)
            if array:
                body = array.group(2)
                while self._array_words(body) is None and i < len(lines):
                    body += "\n" + lines[i]
                    i += 1
                self.arrays[array.group(1)] = self._array_words(body) or []
                continue
            for command in re.split(r"\s(?:&&|\|\||;|\|)\s|;$", line):
                self._command(self.split(command))

    def _array_words(self, body: str) -> list[str] | None:
        """An array's words up to its closing parenthesis (outside quotes and comments), or None while its text
        (after the opening one) does not hold it yet."""
        try:
            words = shlex.split(self.expand(body).replace(")", " ) "), comments=True)
        except ValueError:  # a quote still open: more lines to come
            return None
        return words[:words.index(")")] if ")" in words else None

    def _command(self, words: list[str]) -> None:
        while words and words[0] in ("export", "local", "readonly"):
            words = words[1:]
        assignments = []
        while words and _ASSIGN.match(words[0]):
            assignments.append(_ASSIGN.match(words[0]).groups())
            words = words[1:]
        if not words:  # NAME=value lines set the shell's variables
            self.scalars.update(assignments)
        elif words[0] not in ("echo", "printf", "set", "if", "then", "else", "elif", "fi", "for", "do", "done",
                              "while", "mkdir", "cd", "source", ".", "exit"):
            self.commands.append(words)


def split_launch(text: str) -> tuple[list[str], list[str], list[str], str]:
    """(launcher words, Megatron arguments, #SBATCH words, training script) of a script or an argument string:
    the command that runs a training script (the last word ending in .py before `--` arguments), split there."""
    shell = _Shell()
    shell.run(text)
    for words in reversed(shell.commands):
        script = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
        if script is not None and any(w.startswith("--") for w in words[script + 1:]):
            return words[:script], words[script + 1:], shell.sbatch, words[script]
    for words in reversed(shell.commands):
        if words and words[0].startswith("--"):
            return [], words, shell.sbatch, ""
    raise UserError("--from-megatron: no training command found: expected a line running a Megatron training "
                    "script (e.g. torchrun ... pretrain_gpt.py --num-layers ...) or the arguments themselves")


def parse_arguments(words: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Megatron's command line as {argument: values} (`--a=b` and `--a b c` alike; the last of a repeated
    argument wins, as argparse) and the words that belong to no argument."""
    values: dict[str, list[str]] = {}
    stray: list[str] = []
    current = None
    for word in words:
        if word.startswith("--"):
            name, eq, value = word.partition("=")
            values[name] = [value] if eq else []
            current = None if eq or name in FLAGS else name
        elif current is not None:
            values[current].append(word)
        else:
            stray.append(word)
    return values, stray


# ----- the launcher: how many GPUs -----

_NODES = ("--nnodes", "--num_nodes", "--num-nodes", "--nodes")
_PER_NODE = ("--nproc-per-node", "--nproc_per_node", "--num_gpus", "--num-gpus", "--ntasks-per-node",
             "--gpus-per-node")
# short options mean a count only to the launcher that owns them (nice -n, numactl -N are not counts)
_SLURM_NODES, _SLURM_TASKS = ("-N",), ("-n", "--ntasks")  # srun / salloc / sbatch: nodes; tasks in all
_MPI_PER_NODE, _MPI_TASKS = ("-N", "-npernode", "--npernode", "-ppn"), ("-n", "-np")  # mpirun / mpiexec


def _option(words: list[str], names: tuple[str, ...]) -> tuple[str, str] | None:
    """The last of `names` in `words` as (name, value): `--a=b`, `--a b`, and a short option's `-N2` alike."""
    found = None
    for i, word in enumerate(words):
        name, eq, value = word.partition("=")
        short = next((n for n in names if len(n) == 2 and word.startswith(n) and re.fullmatch(r"[0-9]+", word[2:])),
                     None)
        if short:  # srun / sbatch's -N2
            found = (short, word[2:])
        elif name in names:
            if eq:
                found = (name, value)
            elif i + 1 < len(words):
                found = (name, words[i + 1])
            else:
                found = (name, "")
    return found


def _count(option: tuple[str, str]) -> int:
    name, value = option
    upper = value.split(":")[-1]  # torchrun's elastic MIN:MAX: the most nodes
    if not re.fullmatch(r"[0-9]{1,9}", upper) or int(upper) < 1:
        raise UserError(f"--from-megatron: the launcher's {name} is {value!r}, not a number of nodes or GPUs (a "
                        "variable the script does not set?); give the GPU count with --gpus N")
    return int(upper)


def _from(words: list[str], commands: tuple[str, ...]) -> list[str]:
    """`words` from the first of `commands` on (none where it is not there)."""
    at = next((i for i, w in enumerate(words) if Path(w).name in commands), None)
    return words[at:] if at is not None else []


def launcher_gpus(launcher: list[str], sbatch: list[str]) -> tuple[int, int, str] | None:
    """(nodes, GPUs per node, where they were read) from the launcher's words (torchrun / deepspeed ahead of srun,
    srun ahead of #SBATCH; mpirun's -n and -N), or None where none says."""
    # torchrun's or deepspeed's own count comes first: an srun around them starts one task per node
    inner = next((i for i, w in enumerate(launcher) if w in ("torchrun", "deepspeed") or "torch.distributed" in w),
                 None)
    slurm = _from(launcher, ("srun", "salloc")) + sbatch
    mpi = _from(launcher, ("mpirun", "mpiexec"))
    per_node = nodes = tasks = None
    for words in ([launcher[inner:]] if inner is not None else []) + [launcher, sbatch]:
        per_node = per_node or _option(words, _PER_NODE)
        nodes = nodes or _option(words, _NODES)
    nodes = nodes or _option(slurm, _SLURM_NODES)
    tasks = _option(slurm, _SLURM_TASKS)
    per_node = per_node or _option(mpi, _MPI_PER_NODE)
    tasks = tasks or _option(mpi, _MPI_TASKS)
    if per_node is None and nodes is None and tasks is None:
        return None
    if per_node is not None and nodes is None and tasks is not None:  # mpirun -N 8 -n 16: the nodes follow
        total, size = _count(tasks), _count(per_node)
        if total % size:
            raise UserError(f"--from-megatron: the launcher's {tasks[0]} {tasks[1]} ranks do not fill nodes of "
                            f"{per_node[0]} {per_node[1]}; give the GPU count with --gpus N")
        return total // size, size, f"{tasks[0]} {tasks[1]} / {per_node[0]} {per_node[1]}"
    nodes_n = _count(nodes) if nodes else 1
    if per_node is None and tasks is not None:  # srun -N 2 -n 16: the tasks of all nodes, one a GPU
        total = _count(tasks)
        if total % nodes_n:
            raise UserError(f"--from-megatron: the launcher's {tasks[0]} {tasks[1]} tasks do not split evenly over "
                            f"{nodes_n} nodes; give the GPU count with --gpus N")
        where = " x ".join(f"{option[0]} {option[1]}" for option in (nodes, tasks) if option)
        return nodes_n, total // nodes_n, where
    per_node_n = _count(per_node) if per_node else 1
    where = " x ".join(f"{option[0]} {option[1]}" for option in (nodes, per_node) if option)
    return nodes_n, per_node_n, where


# ----- the arguments: a spec -----

class _Reader:
    """The arguments, each read at most once into the spec; refusals name the argument."""

    def __init__(self, values: dict[str, list[str]]):
        self.values = values
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        self.used.add(name)
        return name in self.values

    def text(self, name: str, default: str | None = None) -> str | None:
        if not self.has(name):
            return default
        given = self.values[name]
        if name in FLAGS:
            return ""
        if not given:
            raise UserError(f"--from-megatron: {name} takes one value, got none (a shell variable it reads unset, or "
                            "set by a command this reader does not run, such as $(...)); write the value in the "
                            "script or pass the arguments as a string")
        if len(given) != 1:
            raise UserError(f"--from-megatron: {name} takes one value, got {len(given)}: {' '.join(given)}")
        return given[0]

    def integer(self, name: str, default: int | None = None, minimum: int = 1) -> int | None:
        value = self.text(name)
        if value is None:
            return default
        shown = value if len(value) <= 40 else f"{value[:20]}... ({len(value)} characters)"
        if re.fullmatch(r"[0-9]{19,}", value):
            raise UserError(f"--from-megatron: {name} {shown} is far beyond any model's ({len(value)} digits); check "
                            "the value")
        if not re.fullmatch(r"-?[0-9]{1,18}", value) or int(value) < minimum:
            raise UserError(f"--from-megatron: {name} must be an integer of at least {minimum}, got {shown!r}")
        return int(value)

    def number(self, name: str, default: float | None = None) -> float | None:
        value = self.text(name)
        if value is None:
            return default
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not math.isfinite(number) or number < 0:
            raise UserError(f"--from-megatron: {name} must be a number of 0 or more, got {value!r}")
        return number

    def choice(self, name: str, choices: tuple[str, ...], default: str | None = None) -> str | None:
        value = self.text(name, default)
        if value is not None and value not in choices:
            raise UserError(f"--from-megatron: {name} must be one of {', '.join(choices)}, got {value!r}")
        return value

    def required(self, name: str, what: str) -> int:
        value = self.integer(name)
        if value is None:
            raise UserError(f"--from-megatron: {name} is missing; Megatron needs {what}")
        return value


def from_megatron(source: str, gpus: int | None = None, gpus_per_node: int | None = None) -> ImportedSpec:
    """The spec of a Megatron launch: `source` is a script's path or the arguments; `gpus` (and `gpus_per_node`)
    replace the launcher's count."""
    text, where = read_source(source)
    launcher, words, sbatch, script = split_launch(text)
    values, stray = parse_arguments(words)
    args = _Reader(values)
    result = ImportedSpec(spec=None, source=where)  # type: ignore[arg-type]  # the spec is set once validated
    if stray:
        result.unknown.append(f"words outside any argument: {' '.join(stray)}")
    family = _family(script, args, result)
    model = _model(args, family, result)
    tp = args.integer("--tensor-model-parallel-size", 1)
    pp = args.integer("--pipeline-model-parallel-size", 1)
    cp = args.integer("--context-parallel-size", 1)
    model["attention"] = _attention(args, cp, result)
    model["dropout"] = _dropout(args, result)
    model["cross_entropy"] = "megatron"  # vocab_parallel_cross_entropy, whatever tp is
    nodes, per_node = _gpus(launcher, sbatch, gpus, gpus_per_node, tp * pp * cp, result)
    world = nodes * per_node
    if world % (tp * pp * cp):
        raise UserError(f"--from-megatron: --tensor-model-parallel-size x --pipeline-model-parallel-size x "
                        f"--context-parallel-size = {tp} x {pp} x {cp} does not divide the {world} GPUs; Megatron "
                        "refuses it too: change one, or the GPU count (--gpus N)")
    dp = world // (tp * pp * cp)
    strategy = _strategy(args, model, tp, pp, cp, dp, result)
    micro = args.integer("--micro-batch-size") or args.integer("--batch-size", 1)
    batch = {"global": args.integer("--global-batch-size", micro * dp), "micro": micro}
    dtype = _dtype(args)
    model["dtype"] = dtype
    optimizer = _optimizer(args, dtype)
    if "bucket_mb" in strategy:  # --ddp-bucket-size's elements, each a main gradient
        strategy["bucket_mb"] *= DTYPES[gradient_reduce_dtype(dtype, optimizer["master_weights"],
                                                              optimizer.get("reduce_dtype"))]
    data = {"model": model, "batch": batch, "strategy": strategy,
            "cluster": {"nodes": nodes, "gpus_per_node": per_node}, "optimizer": optimizer}
    _not_modelled(args, family, result)
    _overlapped_collectives(args, strategy, result)
    _leftovers(args, result)
    result.spec = _validate(data, where, result)
    preset = same_preset(model)
    if preset:
        result.notes.append(f"the model has the sizes of the built-in {preset}")
    return result


def _family(script: str, args: _Reader, result: ImportedSpec) -> str:
    """gpt2 (LayerNorm, GELU, learned positions), llama (RMSNorm, SwiGLU, rotary) or bert (pretrain_bert.py)."""
    name = Path(script).name
    if name and not re.match(r"pretrain_(gpt|bert|llama)\w*\.py$", name):
        if re.match(r"pretrain_\w+\.py$", name):
            raise UserError(f"--from-megatron: {name} trains a model this tool does not describe (GPT, BERT and "
                            "LLaMA-like ones are built in)")
        result.notes.append(f"{name} read as a GPT-like training script")
    positions = args.choice("--position-embedding-type", ("learned_absolute", "rope", "relative", "none"))
    rotary = positions == "rope" or args.has("--use-rotary-position-embeddings")
    rms = args.choice("--normalization", ("LayerNorm", "RMSNorm")) == "RMSNorm"
    swiglu = args.has("--swiglu")
    if name.startswith("pretrain_bert"):
        return "bert"
    return "llama" if swiglu or rotary or rms else "gpt2"


def _model(args: _Reader, family: str, result: ImportedSpec) -> dict:
    hidden = args.required("--hidden-size", "the hidden size")
    heads = args.required("--num-attention-heads", "the attention heads")
    layers = args.required("--num-layers", "the layer count")
    default_ffn = int(4 * hidden * 2 / 3 / 64) * 64 if args.has("--swiglu") else 4 * hidden  # Megatron's defaults
    ffn = args.integer("--ffn-hidden-size", default_ffn)
    groups = args.integer("--num-query-groups")
    kv_heads = (groups or 1) if args.has("--group-query-attention") else heads
    if groups is not None and kv_heads == heads and groups != heads:
        result.not_modelled.append(f"--num-query-groups {groups} without --group-query-attention (Megatron then "
                                   "ignores it: every head its own keys and values)")
    seq = args.required("--seq-length", "the sequence length")
    max_positions = args.integer("--max-position-embeddings", seq)
    if max_positions < seq and family != "llama":
        raise UserError(f"--from-megatron: --max-position-embeddings ({max_positions}) is below --seq-length ({seq}): "
                        "learned positions need a row per position")
    vocab = args.integer("--vocab-size")
    if vocab is None:
        tokenizer = args.text("--tokenizer-type")
        if tokenizer == "GPT2BPETokenizer" or (tokenizer is None and args.has("--vocab-file")
                                               and args.has("--merge-file")):
            vocab = GPT2_VOCAB
            result.notes.append(f"vocab {GPT2_VOCAB:,}: GPT-2's BPE tokenizer (--vocab-file and --merge-file)")
        else:
            raise UserError("--from-megatron: the vocabulary is the tokenizer's, and the arguments do not state its "
                            f"size ({tokenizer or 'no --tokenizer-type'}): add --vocab-size N")
    model = {"name": family, "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "ffn": ffn,
             "seq_len": seq, "vocab": vocab,
             "vocab_divisible_by": args.integer("--make-vocab-size-divisible-by", VOCAB_PAD),
             "tie_embeddings": not args.has("--untie-embeddings-and-output-weights")}
    if max_positions > seq and family != "llama":
        result.not_modelled.append(f"--max-position-embeddings {max_positions}: a position table of that many rows "
                                   f"(the spec's has --seq-length's {seq})")
    experts = args.integer("--num-experts", 0, minimum=0)
    if experts:
        model.update(experts=experts, top_k=args.integer("--moe-router-topk") or args.integer("--topk", 2))
        expert_ffn = args.integer("--moe-ffn-hidden-size", ffn)
        model["expert_ffn"] = expert_ffn
        shared = args.integer("--moe-shared-expert-intermediate-size", 0, minimum=0)
        if shared % expert_ffn:
            raise UserError(f"--from-megatron: --moe-shared-expert-intermediate-size ({shared}) must be a multiple of "
                            f"the experts' size ({expert_ffn}): the spec's shared experts are that many of them")
        if shared:
            model["shared_experts"] = shared // expert_ffn
        every = args.text("--moe-layer-freq") or args.text("--expert-interval")
        if every is not None and every.isdigit():
            model["moe_every"] = int(every)
        elif every is not None:
            result.not_modelled.append(f"--moe-layer-freq {every}: {NOT_MODELLED['--moe-layer-freq']} (every block "
                                       "MoE here)")
        capacity = args.number("--moe-expert-capacity-factor")
        if capacity is None and args.has("--deepspeed") and not args.has("--disable-moe-token-dropping"):
            capacity = args.number("--moe-train-capacity-factor", 1.0)  # DeepSpeed-MoE drops tokens by default
        if capacity is not None:
            model["capacity_factor"] = capacity
    return model


def _attention(args: _Reader, cp: int, result: ImportedSpec) -> str:
    """sdpa (fused) or materialized, as Megatron would run it: flash attention's flag, a fused or flash
    --attention-backend, Transformer Engine's layers or context parallelism (which needs them) are fused; a local
    or unfused backend, local layers, or without any of those Megatron-DeepSpeed's and the older Megatron-LM's
    arguments (their attention was local: baddbmm, softmax, bmm) are materialised; otherwise today's Megatron-LM's
    default, Transformer Engine's fused attention. The choice is a note where no argument named it."""
    flash = [name for name in FLASH_FLAGS if args.has(name)]
    backend = args.choice("--attention-backend", ("flash", "fused", "unfused", "local", "auto"))
    impl = args.choice("--transformer-impl", ("local", "transformer_engine"))
    if flash or backend in ("flash", "fused", "auto") or cp > 1:
        return "sdpa"
    if backend in ("unfused", "local"):
        return "materialized"
    if impl is not None:
        return "materialized" if impl == "local" else "sdpa"
    era = [name for name in LOCAL_ATTENTION_ERA if name in args.values]
    if era:
        result.notes.append(f"attention materialized (Megatron-DeepSpeed's and the older Megatron-LM's local "
                            f"attention, as {era[0]} says these arguments are theirs, without --use-flash-attn)")
        return "materialized"
    result.notes.append("attention fused (sdpa): today's Megatron-LM runs Transformer Engine's fused attention "
                        "where no argument says otherwise")
    return "sdpa"


def _strategy(args: _Reader, model: dict, tp: int, pp: int, cp: int, dp: int, result: ImportedSpec) -> dict:
    strategy = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "schedule": "1f1b",
                "sp": args.has("--sequence-parallel"), "ep": args.integer("--expert-model-parallel-size")
                or args.integer("--moe-expert-parallel-size", 1),
                "dp_overlap": args.has("--overlap-grad-reduce"),
                # Megatron's default: the weight-gradient GEMM adds into the main gradient (APEX)
                "grad_accumulation_fusion": not args.has("--no-gradient-accumulation-fusion")}
    per_stage = args.integer("--num-layers-per-virtual-pipeline-stage")
    chunks = args.integer("--num-virtual-stages-per-pipeline-rank")
    if per_stage is not None:
        if model["layers"] % (pp * per_stage):
            raise UserError(f"--from-megatron: --num-layers-per-virtual-pipeline-stage ({per_stage}) x "
                            f"--pipeline-model-parallel-size ({pp}) must divide --num-layers ({model['layers']})")
        chunks = model["layers"] // (pp * per_stage)
    if chunks is not None and chunks > 1:
        strategy.update(schedule="interleaved-1f1b", chunks=chunks)
    impl = args.choice("--DDP-impl", ("local", "torch"))
    if impl == "torch":  # old Megatron: torch's DDP all-reduces buckets during the backward
        strategy["dp_overlap"] = True
    bucket = args.integer("--ddp-bucket-size")
    if bucket is not None:  # elements of the main-gradient buffer; from_megatron makes them bytes of its dtype
        strategy["bucket_mb"] = bucket / 2**20
    comm = args.choice("--cp-comm-type", ("p2p", "all_gather", "a2a", "a2a+p2p"))
    if comm in ("p2p", "all_gather"):
        strategy["cp_comm"] = "ring" if comm == "p2p" else "allgather"
    elif comm is not None:
        result.not_modelled.append(f"--cp-comm-type {comm}: the all-to-all context parallelism (the ring here)")
    strategy.update(_recompute(args))
    zero = args.integer("--zero-stage", 0, minimum=0)
    if zero > 3:
        raise UserError(f"--from-megatron: --zero-stage must be 0, 1, 2 or 3 (DeepSpeed's ZeRO stages), got {zero}")
    if args.has("--use-distributed-optimizer"):
        zero = max(zero, 1)  # the optimizer state sharded over the data-parallel ranks: ZeRO-1
    if zero:
        strategy["zero"] = zero
    return strategy


def _recompute(args: _Reader) -> dict:
    """The strategy's recompute fields: none, selective (the attention core), or full, with Megatron-LM's
    --recompute-method and --recompute-num-layers (uniform groups of N blocks, or the first N blocks of a stage)."""
    granularity = args.choice("--recompute-granularity", ("full", "selective"))
    deepspeed = args.has("--deepspeed-activation-checkpointing")  # DeepSpeed's implementation of the same
    if args.has("--checkpoint-activations") or deepspeed:  # the older spelling of full recompute
        granularity = granularity or "full"
    if args.has("--recompute-activations"):  # the older spelling of selective
        granularity = granularity or "selective"
    if granularity != "full":
        return {"recompute": granularity or "none"}
    method = args.choice("--recompute-method", ("uniform", "block")) or "uniform"
    layers = args.integer("--recompute-num-layers") or args.integer("--checkpoint-num-layers", 1)
    return {"recompute": "full", **({"recompute_method": method, "recompute_layers": layers}
                                    if (method, layers) != ("uniform", 1) else {})}


def _dtype(args: _Reader) -> str:
    fp16, bf16 = args.has("--fp16"), args.has("--bf16")
    if fp16 and bf16:
        raise UserError("--from-megatron: --fp16 and --bf16 together; Megatron takes one")
    return "float16" if fp16 else "bfloat16" if bf16 else "float32"


def _optimizer(args: _Reader, dtype: str) -> dict:
    """Adam or SGD; with 16-bit weights Megatron's fp32 main weights, and its main gradients in the dtype it
    reduces them in: the spec's default (fp32 with bf16, fp16 with fp16) but with --grad-reduce-in-bf16 or
    --main-grads-dtype bf16 (bf16) or fp16's --accumulate-allreduce-grads-in-fp32 (fp32)."""
    name = args.choice("--optimizer", ("adam", "sgd"), "adam")
    optimizer = {"name": name, "master_weights": dtype != "float32"}  # Megatron keeps fp32 main weights
    in_fp32, in_bf16 = args.has("--accumulate-allreduce-grads-in-fp32"), args.has("--grad-reduce-in-bf16")
    in_bf16 = args.choice("--main-grads-dtype", ("fp32", "bf16")) == "bf16" or in_bf16  # the precision-aware one
    if dtype == "bfloat16" and in_bf16:
        optimizer["reduce_dtype"] = "bfloat16"
    elif dtype == "float16" and in_fp32:
        optimizer["reduce_dtype"] = "float32"
    if name == "sgd":
        optimizer["momentum"] = args.number("--sgd-momentum", 0.9)
    return optimizer


def _gpus(launcher: list[str], sbatch: list[str], gpus: int | None, gpus_per_node: int | None, replica: int,
          result: ImportedSpec) -> tuple[int, int]:
    """(nodes, GPUs per node): --gpus N, else the launcher's count; on nodes of --gpus-per-node where given (it must
    divide a count above it), else of the launcher's node size where it divides N, else of 8; fewer GPUs than a node
    are one node of them. A launcher with fewer GPUs than one model replica (an example left at one node) gives way
    to the replica's, with a note."""
    launched = launcher_gpus(launcher, sbatch)
    if gpus is None and launched is None:
        raise UserError("--from-megatron: no GPU count: no torchrun, deepspeed, srun or #SBATCH line says it; give "
                        "--gpus N")
    if gpus is None:
        nodes, per_node, where = launched
        if nodes * per_node < replica:
            result.notes.append(f"the launcher's {where} = {nodes * per_node} GPUs is fewer than one model replica "
                                f"(tp x pp x cp = {replica}): the spec takes {replica} (dp = 1); give --gpus N for "
                                "the real count")
            gpus = replica
        elif gpus_per_node is None:
            return nodes, per_node
        else:
            gpus = nodes * per_node  # the launcher's count, on nodes of --gpus-per-node (checked below)
    if gpus_per_node is not None and gpus > gpus_per_node and gpus % gpus_per_node:
        raise UserError(f"--from-megatron: {gpus} GPUs do not fill nodes of --gpus-per-node {gpus_per_node}; give a "
                        "node size that divides the GPU count")
    per_node = gpus_per_node or (launched[1] if launched else 8)
    if gpus % per_node:
        per_node = gpus if gpus < 8 or gpus % 8 else 8
    return gpus // per_node, per_node


def _dropout(args: _Reader, result: ImportedSpec) -> float:
    """The spec's one dropout probability: --hidden-dropout and --attention-dropout (Megatron's 0.1 where not
    given) where they agree; where they differ the attention's (its s x s mask costs the most), the hidden one
    listed as not modelled."""
    hidden = args.number("--hidden-dropout", DEFAULT_DROPOUT)
    attention = args.number("--attention-dropout", DEFAULT_DROPOUT)
    for name, value in (("--hidden-dropout", hidden), ("--attention-dropout", attention)):
        if value >= 1:
            raise UserError(f"--from-megatron: {name} must be a probability below 1, got {value:g}")
    if hidden != attention:
        result.not_modelled.append(f"--hidden-dropout {hidden:g}: the spec has one dropout, the attention's "
                                   f"{attention:g}")
    return attention


def _not_modelled(args: _Reader, family: str, result: ImportedSpec) -> None:
    if family == "llama":
        missing = [what for what, present in (
            ("SwiGLU", args.has("--swiglu")),
            ("RMSNorm", args.text("--normalization") == "RMSNorm"),
            ("rotary positions", args.text("--position-embedding-type") == "rope"
             or args.has("--use-rotary-position-embeddings")),
            ("no linear biases", args.has("--disable-bias-linear"))) if not present]
        if missing:
            result.not_modelled.append(f"the llama family has SwiGLU, RMSNorm, rotary positions and no linear "
                                       f"biases; these arguments lack {', '.join(missing)}")
    elif args.has("--disable-bias-linear"):
        result.not_modelled.append(f"--disable-bias-linear: the {family} family's linears have biases")
    for name in ("--kv-channels",):
        if args.has(name):
            result.not_modelled.append(f"{name} {args.text(name)}: {NOT_MODELLED[name]}")


def _overlapped_collectives(args: _Reader, strategy: dict, result: ImportedSpec) -> None:
    """Megatron's backward overlaps a column-parallel linear's tensor-parallel collectives with its GEMMs (its
    LinearWithGradAccumulationAndAsyncCommunication); the model runs every collective after its layer's compute,
    as --no-async-tensor-model-parallel-allreduce does without sequence parallelism (and Megatron-DeepSpeed with
    --deepspeed, which turns the asynchronous all-reduce off)."""
    synchronous = args.has("--no-async-tensor-model-parallel-allreduce") or "--deepspeed" in args.values
    if strategy["tp"] <= 1:
        return
    if strategy["sp"]:
        result.not_modelled.append("sequence parallelism's backward overlap: Megatron runs each column-parallel "
                                   "linear's all-gather beside its input gradient and its reduce-scatter beside its "
                                   "weight gradient; the model runs them after the layer's compute")
    elif not synchronous:
        result.not_modelled.append("the asynchronous tensor-parallel all-reduce (Megatron-LM's default; "
                                   "--no-async-tensor-model-parallel-allreduce turns it off): each column-parallel "
                                   "linear's input-gradient all-reduce beside its weight gradient; the model runs it "
                                   "after the layer's compute")


def _leftovers(args: _Reader, result: ImportedSpec) -> None:
    """Every argument not read into the spec: not modelled, ignored (with what it is) or unknown."""
    ignored: dict[str, list[str]] = {}
    for name, given in args.values.items():
        if name in args.used:
            continue
        shown = " ".join([name, *given])
        if name in NOT_MODELLED:
            result.not_modelled.append(f"{shown}: {NOT_MODELLED[name]}")
        elif name in IGNORED:
            ignored.setdefault(IGNORED[name], []).append(name)
        else:
            result.unknown.append(shown)
    result.ignored += [f"{what}: {', '.join(names)}" for what, names in ignored.items()]


# Features Megatron has that the spec refuses in some layouts: dropped (with a note) in this order until the spec
# takes the rest. The distributed optimizer (ZeRO-1 here) goes before the tied embeddings (the model's shape).
_DROPPABLE = (("strategy", "zero", 0, "--use-distributed-optimizer / --zero-stage as ZeRO"),
              ("model", "tie_embeddings", False, "the tied embedding and head (Megatron's default)"),
              ("model", "dropout", 0.0, "dropout (--hidden-dropout, --attention-dropout)"))


def _validate(data: dict, where: str, result: ImportedSpec):
    """parse_spec of the imported data; a refusal names the argument behind the field it names."""
    while True:
        try:
            return parse_spec(data, source=where, import_factory=False)
        except SpecError as exc:
            # a feature the refusal is about (its field, or named in its message: "tie_embeddings with zero = 1"),
            # where the import set it, in _DROPPABLE's order
            droppable = [d for d in _DROPPABLE if data[d[0]].get(d[1], d[2]) != d[2]
                         and (f"{d[0]}.{d[1]}" == exc.field or f"{d[1]} =" in str(exc))]
            if droppable:
                section, key, off, what = droppable[0]
                data[section][key] = off
                result.not_modelled.append(f"{what}: {str(exc).split('] ', 1)[-1]}")  # the message, not the place
                continue
            argument = FIELD_ARGUMENT.get(exc.field or "", "the arguments")
            raise UserError(f"--from-megatron: {argument}: {str(exc).split('] ', 1)[-1]} (the spec's "
                            f"{exc.field})") from None
