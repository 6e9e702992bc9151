"""A Hugging Face `config.json` as a job spec's model (docs/spec.md, "From a Hugging Face config"). Pure Python.

Families: gpt2 (GPT-2), bert (BERT), and llama for LLaMA, Mistral, Mixtral, Qwen2, Qwen2-MoE and DeepSeek-V3-like
configs (RMSNorm, SwiGLU, rotary). Mapped: hidden, layers, heads, kv heads, intermediate size, vocab, max
positions (the sequence length unless one is given), experts and top-k, shared experts, tied embeddings, dtype.
What a config says that the family does not build is listed as not modelled; the job around the model (batch,
GPUs) comes from the caller, one GPU and a micro-batch of 1 by default.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.common.errors import SpecError, UserError
from harness.plan.importers import ImportedSpec, same_preset
from harness.plan.spec import DTYPES, parse_spec

# model_type -> family; the llama family stands for every RMSNorm + SwiGLU + rotary decoder
FAMILY = {"gpt2": "gpt2", "bert": "bert", "llama": "llama", "mistral": "llama", "mixtral": "llama",
          "qwen2": "llama", "qwen2_moe": "llama", "deepseek_v3": "llama"}
# each family's field names, in the order the first present one is taken
_NAMES = {
    "gpt2": {"hidden": ("n_embd",), "layers": ("n_layer",), "heads": ("n_head",), "ffn": ("n_inner",),
             "seq_len": ("n_positions", "n_ctx")},
    "bert": {"hidden": ("hidden_size",), "layers": ("num_hidden_layers",), "heads": ("num_attention_heads",),
             "ffn": ("intermediate_size",), "seq_len": ("max_position_embeddings",)},
}
_NAMES["llama"] = {**_NAMES["bert"], "kv_heads": ("num_key_value_heads",)}
# what a config may say that the spec's family does not build (field -> what is lost when it is set)
_NOT_MODELLED = {
    "sliding_window": "sliding-window attention (full attention here)",
    "attention_bias": "biases in the attention's projections",
    "q_lora_rank": "multi-head latent attention's low-rank queries",
    "kv_lora_rank": "multi-head latent attention's compressed keys and values (plain attention here)",
    "first_k_dense_replace": "dense first blocks (every block MoE here)",
    "num_nextn_predict_layers": "multi-token prediction modules",
    "n_group": "node-limited (grouped) routing",
    "rope_scaling": "scaled rotary positions (no cost of its own)",
}
_DROPOUT = ("attn_pdrop", "embd_pdrop", "resid_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob",
            "attention_dropout")
_TIED_DEFAULT = {"gpt2": True, "bert": True, "llama": False}  # transformers' defaults per model_type family


def read_config(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"--from-hf: {path} not found; give a Hugging Face model's config.json") from None
    except IsADirectoryError:
        raise UserError(f"--from-hf: {path} is a folder; give the config.json file in it") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:  # bad JSON, an integer past the
        # limit, nesting deeper than Python's recursion
        raise UserError(f"--from-hf: cannot read {path} as JSON ({str(exc)[:200] or type(exc).__name__}); give a "
                        "Hugging Face model's config.json") from None
    if not isinstance(data, dict):
        raise UserError(f"--from-hf: {path} is not a JSON object (a config.json is one)")
    return data


def _integer(config: dict, names: tuple[str, ...], path: str, default: int | None = None) -> int:
    for name in names:
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"--from-hf: {path}: {name} must be a positive integer, got {value!r}")
        return value
    if default is None:
        raise UserError(f"--from-hf: {path}: {' or '.join(names)} is missing; a {config.get('model_type')} config "
                        "states it")
    return default


def _optional_count(config: dict, name: str, path: str, least: int) -> int | None:
    """An optional whole-number field of at least `least`, None where absent; bad values are refused, never
    dropped."""
    value = config.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UserError(f"--from-hf: {path}: {name} must be an integer of at least {least}, got {value!r}")
    return value


def from_hf(path: str, gpus: int = 1, gpus_per_node: int | None = None, micro: int = 1,
            global_batch: int | None = None, seq_len: int | None = None) -> ImportedSpec:
    """The spec of a config.json's model trained data-parallel on `gpus` GPUs (the caller's strategy applies
    after); `seq_len` replaces the config's maximum positions."""
    config = read_config(path)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILY:
        raise UserError(f"--from-hf: {path}: model_type {model_type!r} is not one of the families built in "
                        f"({', '.join(FAMILY)})")
    family = FAMILY[model_type]
    names = _NAMES[family]
    result = ImportedSpec(spec=None, source=path)  # type: ignore[arg-type]  # the spec is set once validated
    model: dict[str, Any] = {"name": family}
    for key in ("hidden", "layers", "heads"):
        model[key] = _integer(config, names[key], path)
    model["kv_heads"] = _integer(config, names.get("kv_heads", ()), path, model["heads"])
    # GPT-2's n_inner null means 4 x hidden; the other families' configs state their intermediate size
    model["ffn"] = _integer(config, names["ffn"], path, 4 * model["hidden"] if family == "gpt2" else None)
    positions = _integer(config, names["seq_len"], path)
    model["seq_len"] = seq_len or positions
    if seq_len is not None and seq_len > positions:
        if family != "llama":  # learned absolute positions: a table of `positions` rows, as Megatron refuses too
            raise UserError(f"--seq-len {seq_len}: is past {path}'s maximum positions ({positions:,}), the rows of "
                            f"{family}'s learned position table; give --seq-len {positions:,} or less")
        result.notes.append(f"seq_len {seq_len:,} is past the config's {positions:,} positions (rotary: the model "
                            "runs at that length, past the context it was trained for)")
    if seq_len is None:
        result.notes.append(f"seq_len = the maximum positions ({positions:,}); give --seq-len N for the training "
                            "length")
    model["vocab"] = _integer(config, ("vocab_size",), path)
    tied = config.get("tie_word_embeddings", _TIED_DEFAULT[family])
    if not isinstance(tied, bool):
        raise UserError(f"--from-hf: {path}: tie_word_embeddings must be true or false, got {tied!r}")
    model["tie_embeddings"] = tied
    dtype = config.get("torch_dtype")
    if dtype is not None and not isinstance(dtype, str):
        raise UserError(f"--from-hf: {path}: torch_dtype must be a dtype's name, got {dtype!r}")
    if dtype in DTYPES:
        model["dtype"] = dtype
    elif dtype is not None:
        result.notes.append(f"torch_dtype {dtype} is not one this tool models ({', '.join(DTYPES)}): float32")
    _experts(config, model, path, result)
    for name, what in _NOT_MODELLED.items():
        if config.get(name) not in (None, False, 0) and not (
                name == "sliding_window" and config.get("use_sliding_window") is False):
            result.not_modelled.append(f"{name} {config[name]}: {what}")
    head_dim = _optional_count(config, "head_dim", path, 1)
    if head_dim and head_dim != model["hidden"] // model["heads"]:
        result.not_modelled.append(f"head_dim {head_dim}: heads of other than hidden / heads = "
                                   f"{model['hidden'] // model['heads']} (that size here)")
    dropout = {name: config[name] for name in _DROPOUT if config.get(name)}
    if dropout:
        result.not_modelled.append("dropout (" + ", ".join(f"{name} {value}" for name, value in dropout.items()) + ")")
    if model_type == "qwen2" or model_type == "qwen2_moe":
        result.not_modelled.append("the QKV projections' biases of Qwen2")
    if family == "gpt2" and config.get("activation_function", "gelu_new") not in ("gelu", "gelu_new"):
        result.not_modelled.append(f"activation_function {config['activation_function']} (GELU here)")
    dp = gpus
    per_node = gpus_per_node or (gpus if gpus < 8 or gpus % 8 else 8)
    if gpus % per_node:
        raise UserError(f"--gpus-per-node ({per_node}) must divide --gpus ({gpus})")
    data = {"model": model, "batch": {"global": global_batch or micro * dp, "micro": micro},
            "strategy": {"dp": dp}, "cluster": {"nodes": gpus // per_node, "gpus_per_node": per_node},
            "optimizer": {"master_weights": model.get("dtype", "float32") != "float32"}}
    try:
        result.spec = parse_spec(data, source=path, import_factory=False)
    except SpecError as exc:
        raise UserError(f"--from-hf: {exc}") from None
    preset = same_preset(model)
    if preset:
        result.notes.append(f"the model has the sizes of the built-in {preset}")
    return result


def _experts(config: dict, model: dict, path: str, result: ImportedSpec) -> None:
    """Mixtral's num_local_experts, Qwen2-MoE's num_experts, DeepSeek's n_routed_experts, with their top-k,
    expert size and shared experts."""
    names = ("num_local_experts", "num_experts", "n_routed_experts")
    if all(config.get(name) in (None, 0) for name in names):  # a dense model (a count of 0 says so too)
        return
    experts = _integer(config, names, path)
    expert_ffn = _integer(config, ("moe_intermediate_size",), path, model["ffn"])
    model.update(experts=experts, top_k=_integer(config, ("num_experts_per_tok",), path, 2), expert_ffn=expert_ffn)
    shared = _optional_count(config, "n_shared_experts", path, 0)
    shared_size = _optional_count(config, "shared_expert_intermediate_size", path, 0)
    if shared:
        model["shared_experts"] = shared
    elif shared_size:
        if shared_size % expert_ffn:
            result.not_modelled.append(f"shared_expert_intermediate_size {shared_size}: a shared expert not a "
                                       f"multiple of the experts' {expert_ffn} (left out)")
        else:
            model["shared_experts"] = shared_size // expert_ffn
    step = _optional_count(config, "decoder_sparse_step", path, 1)
    if step and step > 1:
        model["moe_every"] = step

