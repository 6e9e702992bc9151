"""Job specs from a Megatron launch and from Hugging Face configs (harness/plan/importers), the vocabulary padded
as Megatron pads it, the new presets' sizes against their published parameter counts, and the refusals (exit 2,
naming the argument) through `python -m harness spec`."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.published import SETS, megatron_arguments, read_runs
from harness.commands.cli import main as harness_main
from harness.common.errors import SpecError, UserError
from harness.plan.events import build_plan
from harness.plan.importers.hf import from_hf
from harness.plan.importers.megatron import from_megatron
from harness.plan.layers import describe_builtin
from harness.plan.spec import MODEL_PRESETS, loads_spec, parse_spec, vocab_padding_note

DATA = Path(__file__).parent / "data"
VTRAIN = Path(__file__).parents[2] / "shared" / "data" / "vtrain"
GPT3_175B = DATA / "megatron" / "train_gpt3_175b_distributed.sh"
LLAMA3_SLURM = DATA / "megatron" / "llama3_8b_slurm.sh"


def _one_gpu(model: dict, seq_len: int | None = None) -> dict:
    return {"model": {**model, **({"seq_len": seq_len} if seq_len else {})}, "batch": {"global": 1, "micro": 1},
            "strategy": {}, "cluster": {}}


def _params(model) -> int:
    return sum(layer.params for layer in describe_builtin(model, 1, tokens=model.seq_len))


# ----- presets: the published configs' sizes -----

@pytest.mark.parametrize("name, published", [
    ("llama3-8b", 8_030_261_248),  # Meta-Llama-3-8B: its safetensors' parameter count
    ("llama3-70b", 70_553_706_496),  # Meta-Llama-3-70B
    ("mixtral-8x7b", 46_702_792_704),  # Mixtral-8x7B-v0.1 (the router's gate included)
])
def test_a_preset_has_its_published_parameter_count(name, published):
    assert _params(parse_spec(_one_gpu({"name": name})).model) == published


def test_every_new_preset_is_a_valid_model():
    for name in ("llama3-8b", "llama3-70b", "llama3-405b", "qwen2.5-7b", "mixtral-8x22b", "deepseek-v3"):
        model = parse_spec(_one_gpu({"name": name})).model
        assert model.vocab == MODEL_PRESETS[name]["vocab"] and model.layers == MODEL_PRESETS[name]["layers"]
    # Llama 3.1 405B: 405.9 billion, Mixtral 8x22B: 140.6 billion (their model cards); a block's share is
    # exactly counted, so the totals land within a part in a thousand
    assert _params(parse_spec(_one_gpu({"name": "llama3-405b"})).model) == pytest.approx(405.85e9, rel=1e-3)
    assert _params(parse_spec(_one_gpu({"name": "mixtral-8x22b"})).model) == pytest.approx(140.6e9, rel=1e-3)


# ----- Hugging Face configs -----

@pytest.mark.parametrize("config, preset, seq_len", [
    ("gpt2.json", "gpt2-small", None), ("bert-base-uncased.json", "bert-base", None),
    ("Meta-Llama-3-8B.json", "llama3-8b", None), ("Mixtral-8x7B-v0.1.json", "mixtral-8x7b", 4096),
    ("Qwen2.5-7B.json", "qwen2.5-7b", 4096),
])
def test_a_hugging_face_config_gives_its_presets_model(config, preset, seq_len):
    imported = from_hf(str(DATA / "hf" / config), seq_len=seq_len)
    expected = parse_spec(_one_gpu({"name": preset}, seq_len)).model
    got = imported.spec.model
    sizes = ("family", "layers", "hidden", "heads", "kv_heads", "ffn", "seq_len", "vocab", "experts", "top_k",
             "expert_ffn", "shared_experts")
    assert {k: getattr(got, k) for k in sizes} == {k: getattr(expected, k) for k in sizes}
    assert f"the model has the sizes of the built-in {preset}" in imported.notes


def test_a_hugging_face_config_keeps_ties_dtype_and_says_what_it_leaves_out():
    gpt2 = from_hf(str(DATA / "hf" / "gpt2.json"))
    assert gpt2.spec.model.tie_embeddings and gpt2.spec.model.dtype == "float32"
    assert any(line.startswith("dropout (attn_pdrop 0.1") for line in gpt2.not_modelled)
    llama = from_hf(str(DATA / "hf" / "Meta-Llama-3-8B.json"), gpus=16, micro=2)
    assert not llama.spec.model.tie_embeddings and llama.spec.model.dtype == "bfloat16"
    assert llama.spec.optimizer.master_weights
    assert (llama.spec.strategy.dp, llama.spec.cluster.nodes, llama.spec.batch.global_size) == (16, 2, 32)
    qwen = from_hf(str(DATA / "hf" / "Qwen2.5-7B.json"))
    assert qwen.spec.model.seq_len == 131072 and any("seq_len = the maximum positions" in n for n in qwen.notes)
    assert any("QKV projections' biases" in line for line in qwen.not_modelled)
    assert not any("sliding" in line for line in qwen.not_modelled)  # use_sliding_window false: full attention


def test_a_sequence_past_the_positions_is_refused_for_learned_ones_and_said_for_rotary():
    """GPT-2's 1,024 learned positions are a table of that many rows (Megatron refuses a longer --seq-length too);
    Llama 3's 8,192 are rotary: a longer sequence runs, past the context it was trained for."""
    with pytest.raises(UserError, match=r"--seq-len 2048: is past .*gpt2.json's maximum positions \(1,024\)"):
        from_hf(str(DATA / "hf" / "gpt2.json"), seq_len=2048)
    llama = from_hf(str(DATA / "hf" / "Meta-Llama-3-8B.json"), seq_len=16384)
    assert llama.spec.model.seq_len == 16384
    assert any("seq_len 16,384 is past the config's 8,192 positions (rotary" in note for note in llama.notes)


def test_deepseek_v3_like_configs_map_their_experts_and_name_what_is_left_out(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, '
                      '"num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432, '
                      '"moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8, '
                      '"n_shared_experts": 1, "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536, '
                      '"num_nextn_predict_layers": 1, "max_position_embeddings": 163840, "vocab_size": 129280, '
                      '"tie_word_embeddings": false, "torch_dtype": "bfloat16"}')
    imported = from_hf(str(config), seq_len=4096)
    assert "the model has the sizes of the built-in deepseek-v3" in imported.notes
    left_out = " ".join(imported.not_modelled)
    for what in ("latent attention", "dense first blocks", "multi-token prediction"):
        assert what in left_out


def test_a_spec_is_written_as_toml_only(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        harness_main(["spec", "--from-hf", str(DATA / "hf" / "gpt2.json"), "-o", str(tmp_path / "job.json")])
    assert exit.value.code == 2 and "a job spec is written as FILE.toml" in capsys.readouterr().err
    assert not (tmp_path / "job.json").exists()


def test_a_config_without_its_sizes_is_refused_not_guessed(tmp_path):
    """Only GPT-2's missing n_inner means 4 x hidden; another family's intermediate_size must be stated. An expert
    count of 0 is a dense model; one that is not a positive integer is refused."""
    llama = json.loads((DATA / "hf" / "Meta-Llama-3-8B.json").read_text())
    del llama["intermediate_size"]
    config = tmp_path / "config.json"
    config.write_text(json.dumps(llama))
    with pytest.raises(UserError, match="intermediate_size is missing; a llama config states it"):
        from_hf(str(config))
    for experts, dense in ((0, True), ({}, False), ("", False)):
        config.write_text(json.dumps({**llama, "intermediate_size": 14336, "num_local_experts": experts}))
        if dense:
            assert from_hf(str(config)).spec.model.experts in (0, 1)
        else:
            with pytest.raises(UserError, match="num_local_experts must be a positive integer"):
                from_hf(str(config))


# ----- the vocabulary padded -----

def _gpt2_medium(tp: int, extra: str = "") -> str:
    return (f'[model]\nname = "gpt2-medium"\n{extra}[batch]\nglobal = 8\nmicro = 1\n'
            f"[strategy]\ntp = {tp}\n[cluster]\ngpus_per_node = {tp}\n")


def test_gpt2s_vocabulary_at_tp_8_is_padded_to_51200_and_its_rows_are_costed():
    spec = loads_spec(_gpt2_medium(8))
    assert (spec.model.vocab, spec.model.unpadded_vocab) == (51_200, 50_257)
    assert vocab_padding_note(spec) == ("note: vocab 50,257 padded to 51,200 as Megatron-LM pads it (a multiple of "
                                        "128 x tp = 1,024); the 943 padded rows cost their memory and FLOPs")
    head = build_plan(spec).layers[-1]
    assert head.params == 2 * 1024 + 51_200 // 8 * 1024
    assert head.fwd_flops_per_token == 2.0 * 1024 * 6400 + 5.0 * 6400
    assert spec.to_dict()["model"]["vocab"] == 50_257  # the spec states the tokenizer's, and reads back the same
    assert loads_spec(spec.to_toml()) == spec
    # tp = 1 divides any vocabulary: by default nothing is padded; Megatron's divisor pads it always
    assert loads_spec(_gpt2_medium(1)).model.vocab == 50_257 and vocab_padding_note(loads_spec(_gpt2_medium(1))) is None
    assert loads_spec(_gpt2_medium(1, "vocab_divisible_by = 128\n")).model.vocab == 50_304
    assert loads_spec(_gpt2_medium(2, "vocab_divisible_by = 1\n")).model.vocab == 50_258


def test_a_family_as_the_name_needs_every_size_and_a_factory_no_vocabulary_divisor():
    with pytest.raises(SpecError, match=r"\[model.layers\] is required"):
        parse_spec(_one_gpu({"name": "llama", "hidden": 64, "heads": 4, "ffn": 128, "seq_len": 16, "vocab": 100}))
    family = parse_spec(_one_gpu({"name": "bert", "layers": 2, "hidden": 64, "heads": 4, "ffn": 128, "seq_len": 16,
                                  "vocab": 100})).model
    assert (family.name, family.family, family.kv_heads) == ("bert", "bert", 4)
    with pytest.raises(SpecError, match=r"\[model.vocab_divisible_by\] a factory model sizes its own vocabulary"):
        parse_spec(_one_gpu({"factory": "tests.user_model:build", "layers": 3, "seq_len": 16, "vocab": 100,
                             "vocab_divisible_by": 128}), import_factory=False)


def test_the_torch_layers_are_built_at_the_padded_vocabulary():
    """What harness train and harness profile run holds the padded rows the plan costs."""
    from harness.models import build_layer

    spec = loads_spec(_gpt2_medium(4, "layers = 2\nhidden = 64\nheads = 16\nffn = 96\nvocab = 1001\n"))
    assert spec.model.vocab == 1024
    for desc in build_plan(spec).layers[::3]:  # the embedding and the head
        module = build_layer(spec.model, desc.kind, tp=int(dict(desc.signature).get("tp", 1)))
        assert sum(p.numel() for p in module.parameters()) == desc.params


def test_the_harness_events_command_says_the_padding_in_one_line(tmp_path, capsys):
    spec = tmp_path / "job.toml"
    spec.write_text(_gpt2_medium(8))
    assert harness_main(["events", str(spec)]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "padded" in line]
    assert notes == [vocab_padding_note(loads_spec(spec.read_text()))]


# ----- Megatron's arguments -----

def test_megatrons_own_gpt3_175b_example_reads():
    imported = from_megatron(str(GPT3_175B), gpus=1024)
    spec = imported.spec
    m, s = spec.model, spec.strategy
    assert (m.family, m.layers, m.hidden, m.heads, m.ffn, m.seq_len) == ("gpt2", 96, 12288, 96, 4 * 12288, 2048)
    assert (m.vocab, m.unpadded_vocab, m.tie_embeddings, m.dtype) == (51_200, 50_257, True, "float16")
    assert (s.dp, s.tp, s.pp, s.recompute, s.dp_overlap) == (8, 8, 16, "none", False)
    assert (spec.batch.global_size, spec.batch.micro, spec.cluster.nodes, spec.cluster.gpus_per_node) == \
        (1536, 1, 128, 8)
    assert imported.unknown == []
    assert any(line.startswith("--rampup-batch-size 16 16 5859375") for line in imported.not_modelled)
    assert m.dropout == 0.1 and m.attention == "sdpa"  # Megatron's default dropout; today's fused attention
    assert not any("dropout" in line for line in imported.not_modelled)
    assert "data: --data-path, --split" in imported.ignored
    # as shipped it launches one node of 8 GPUs, fewer than its tp x pp = 128: taken as one replica, said so
    as_shipped = from_megatron(str(GPT3_175B))
    assert as_shipped.spec.strategy.world == 128 and as_shipped.spec.strategy.dp == 1
    assert any("--nnodes 1 x --nproc_per_node 8 = 8 GPUs is fewer than one model replica" in n
               for n in as_shipped.notes)


def test_a_slurm_script_with_torchrun_under_srun_reads_every_feature():
    imported = from_megatron(str(LLAMA3_SLURM))
    spec = imported.spec
    m, s = spec.model, spec.strategy
    assert (m.family, m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.seq_len, m.vocab) == \
        ("llama", 32, 4096, 32, 8, 14336, 8192, 128_256)
    assert not m.tie_embeddings and m.dtype == "bfloat16" and spec.optimizer.master_weights
    # 4 nodes (#SBATCH and torchrun) x torchrun's 8 a node, not srun's one task a node
    assert (spec.cluster.nodes, spec.cluster.gpus_per_node, s.dp, s.tp, s.pp) == (4, 8, 8, 2, 2)
    assert (s.schedule, s.chunks, s.sp, s.recompute, s.dp_overlap) == ("interleaved-1f1b", 4, True, "full", True)
    assert (spec.batch.global_size, spec.batch.micro) == (128, 1)
    assert s.zero == 0 and any(line.startswith("--use-distributed-optimizer / --zero-stage as ZeRO: zero = 1 with "
                                               "tensor parallelism") for line in imported.not_modelled)
    assert "the model has the sizes of the built-in llama3-8b" in imported.notes
    assert imported.unknown == []


def test_the_shell_reader_expands_as_bash_would():
    from harness.plan.importers.megatron import split_launch

    script = ("#SBATCH -N 2\nA=(--x 1) # a comment (with parentheses)\nB=$((2 * 3))\nD=(\n  --w $((B*2)) # (c)\n"
              "  --v \"a b\"\n)\necho python not_this.py --q 1\nsrun python pretrain_gpt.py ${A[@]} ${D[@]} \\\n"
              "  --y $B --z ${C:-7} --u=$UNSET")
    launcher, arguments, sbatch, script_name = split_launch(script)
    assert (launcher, sbatch, script_name) == (["srun", "python"], ["-N", "2"], "pretrain_gpt.py")
    assert arguments == ["--x", "1", "--w", "12", "--v", "a b", "--y", "6", "--z", "7", "--u="]


def test_mixture_of_experts_arguments_map_to_the_experts():
    imported = from_megatron("--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 "
                             "--vocab-size 32000 --swiglu --normalization RMSNorm --position-embedding-type rope "
                             "--disable-bias-linear --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 512 "
                             "--moe-shared-expert-intermediate-size 1024 --expert-model-parallel-size 4 "
                             "--moe-layer-freq 2 --moe-grouped-gemm --micro-batch-size 2 --bf16 --mystery-flag",
                             gpus=8)
    m = imported.spec.model
    assert (m.experts, m.top_k, m.expert_ffn, m.shared_experts, m.moe_every, m.ffn) == (8, 2, 512, 2, 2, 2688)
    # ffn: Megatron's SwiGLU default, int(4 x hidden x 2 / 3 / 64) x 64
    assert imported.spec.strategy.ep == 4 and imported.spec.batch.global_size == 16
    assert imported.unknown == ["--mystery-flag"]
    assert any(line.startswith("--moe-grouped-gemm") for line in imported.not_modelled)
    assert not any("the llama family" in line for line in imported.not_modelled)  # every llama feature given


def test_a_megatron_deepspeed_launch_reads_its_launcher_zero_and_token_dropping():
    command = ("deepspeed --num_nodes 2 --num_gpus 8 pretrain_gpt.py --num-layers 8 --hidden-size 1024 "
               "--num-attention-heads 16 --seq-length 2048 --vocab-file v.json --merge-file m.txt --fp16 "
               "--micro-batch-size 4 --global-batch-size 256 --checkpoint-activations "
               "--deepspeed-activation-checkpointing --deepspeed --deepspeed_config ds.json --zero-stage 1 "
               "--untie-embeddings-and-output-weights")
    imported = from_megatron(command)
    s = imported.spec.strategy
    assert (imported.spec.cluster.nodes, imported.spec.cluster.gpus_per_node, s.dp, s.zero, s.recompute) == \
        (2, 8, 16, 1, "full")
    assert imported.unknown == [] and "paths and checkpoints: --deepspeed_config" in imported.ignored
    moe = from_megatron(command + " --num-experts 16 --moe-expert-parallel-size 8 --topk 1")
    m = moe.spec.model
    # DeepSpeed-MoE drops tokens past a capacity factor of 1 unless told not to; ZeRO with experts is not built
    assert (m.experts, m.top_k, m.capacity_factor, moe.spec.strategy.ep, moe.spec.strategy.zero) == (16, 1, 1.0, 8, 0)
    assert any("--zero-stage as ZeRO: Mixture-of-Experts blocks with zero = 1 are not built" in line
               for line in moe.not_modelled)
    dropless = from_megatron(command + " --num-experts 16 --disable-moe-token-dropping").spec.model
    assert dropless.capacity_factor == 0.0


@pytest.mark.skipif(not VTRAIN.is_dir(), reason="the shared vTrain data is not beside the project")
def test_the_published_vtrain_runs_round_trip_through_megatrons_arguments():
    """Each run as vTrain's README states it (Megatron-DeepSpeed's GPT, vocabulary 50,257 padded, fp16, full
    recompute, 1F1B, the all-reduce after the backward, gradient accumulation fused (Megatron's default), 8 GPUs a
    node, dropout 0.1; its attention materialised: no --use-flash-attn) written as Megatron arguments
    (bench/published.py's, what its predictions start from) reads back as the spec written directly."""
    rows = 0
    for run in (run for name in SETS for run in read_runs(name, VTRAIN)):
        expected = parse_spec({
            "model": {"name": "gpt2", "layers": run.layers, "hidden": run.hidden, "heads": run.heads,
                      "ffn": 4 * run.hidden, "seq_len": run.seq, "vocab": 50257, "vocab_divisible_by": 128,
                      "tie_embeddings": True, "dtype": "float16", "attention": "materialized",
                      "cross_entropy": "megatron", "dropout": 0.1},
            "batch": {"global": run.global_batch, "micro": run.micro},
            "strategy": {"dp": run.dp, "tp": run.tp, "pp": run.pp, "recompute": "full", "dp_overlap": False,
                         "grad_accumulation_fusion": True},
            "cluster": {"nodes": max(1, run.gpus // 8), "gpus_per_node": min(run.gpus, 8)},
            "optimizer": {"master_weights": True}})
        imported = from_megatron(megatron_arguments(run), gpus=run.gpus)
        assert imported.spec == expected, run.label
        assert imported.unknown == []
        rows += 1
    assert rows == 1440 + 109


# ----- refusals: one message naming the argument, exit 2 -----

@pytest.mark.parametrize("arguments, gpus, words", [
    ("--num-layers abc --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 1000", 8,
     "--num-layers must be an integer of at least 1, got 'abc'"),
    ("--num-layers 24 --hidden-size 1000 --num-attention-heads 16 --seq-length 1024 --vocab-size 1000", 8,
     "--hidden-size: hidden (1000) must be divisible by heads (16)"),
    ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 1000 "
     "--tensor-model-parallel-size 3", 8, "--tensor-model-parallel-size x --pipeline-model-parallel-size x "
     "--context-parallel-size = 3 x 1 x 1 does not divide the 8 GPUs"),
    ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 1000 "
     "--pipeline-model-parallel-size 5", 10, "--num-layers: layers (24) must be divisible by pp = 5"),
    ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --fp16 --bf16 "
     "--vocab-size 1000", 8, "--fp16 and --bf16 together"),
    ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
     "--tokenizer-type HuggingFaceTokenizer", 8, "add --vocab-size N"),
    ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 1000", None,
     "no GPU count"),
    ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 1000 "
     "--recompute-granularity some", 8, "--recompute-granularity must be one of full, selective, got 'some'"),
    ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 1000 "
     "--hidden-dropout nan", 8, "--hidden-dropout must be a number of 0 or more, got 'nan'"),
    ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 1000 "
     "--zero-stage 7", 8, "--zero-stage must be 0, 1, 2 or 3"),
    ("--num-layers " + "9" * 5000 + " --hidden-size 1024 --num-attention-heads 16 --seq-length 1024", 8,
     "--num-layers 99999999999999999999... (5000 characters) is far beyond any model's (5000 digits)"),
    ("L=$(echo 24)\npython pretrain_gpt.py --num-layers $L --hidden-size 1024 --num-attention-heads 16 "
     "--seq-length 1024 --vocab-size 1000", 8, "--num-layers takes one value, got none (a shell variable it reads "
     "unset, or set by a command this reader does not run, such as $(...))"),
    ("torchrun --nproc-per-node=\u00b2 pretrain_gpt.py --num-layers 24 --hidden-size 1024 --num-attention-heads 16 "
     "--seq-length 1024 --vocab-size 1000", None, "the launcher's --nproc-per-node is"),
    ("", None, "nothing given"),
])
def test_bad_megatron_arguments_exit_2_naming_the_argument(arguments, gpus, words, capsys):
    argv = ["spec", "--from-megatron", arguments] + (["--gpus", str(gpus)] if gpus else [])
    assert harness_main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("arguments, expected", [
    ("--recompute-granularity selective", ("selective", 1, "uniform")),
    ("--recompute-activations", ("selective", 1, "uniform")),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2", ("full", 2, "uniform")),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 3", ("full", 3, "block")),
    ("--checkpoint-activations --checkpoint-num-layers 2", ("full", 2, "uniform")),
    ("--recompute-granularity full", ("full", 1, "uniform")),
    ("", ("none", 1, "uniform")),
])
def test_megatron_recompute_arguments_become_the_specs(arguments, expected):
    """Selective recompute and Megatron-LM's partial full recompute (method and layers) are modelled, so read."""
    base = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 1024 "
            "--pipeline-model-parallel-size 2 ")
    imported = from_megatron(base + arguments, gpus=8)
    s = imported.spec.strategy
    assert (s.recompute, s.recompute_layers, s.recompute_method) == expected
    assert not [line for line in imported.not_modelled if "recompute" in line]


def test_megatron_recompute_layers_beyond_a_stage_exit_2_naming_the_argument(capsys):
    arguments = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 1024 "
                 "--pipeline-model-parallel-size 2 --recompute-granularity full --recompute-method block "
                 "--recompute-num-layers 13")
    assert harness_main(["spec", "--from-megatron", arguments, "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "--recompute-num-layers" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("content, words", [
    ('{"model_type": "t5", "d_model": 512}', "model_type 't5' is not one of the families built in"),
    ('{"model_type": "llama", "hidden_size": 4096}', "num_hidden_layers is missing"),
    ('{"model_type": "gpt2", "n_embd": -1, "n_layer": 2, "n_head": 2}', "n_embd must be a positive integer"),
    ("not json", "cannot read"),
    ('{"model_type": ["gpt2"]}', "model_type ['gpt2'] is not one of the families built in"),
    ('{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64, "vocab_size": 100, '
     '"torch_dtype": ["x"]}', "torch_dtype must be a dtype's name"),
    ('{"model_type": "gpt2", "n_layer": ' + "9" * 5000 + "}", "cannot read"),
    ("[" * 100000, "cannot read"),  # nested past Python's recursion
    # an MoE field out of range is refused, never dropped
    ('{"model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, '
     '"intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 64, "num_experts": 4, '
     '"decoder_sparse_step": 0}', "decoder_sparse_step must be an integer of at least 1, got 0"),
    ('{"model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, '
     '"intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 64, "num_experts": 4, '
     '"shared_expert_intermediate_size": "big"}', "shared_expert_intermediate_size must be an integer"),
    ('{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, '
     '"intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 64, "head_dim": 0}',
     "head_dim must be an integer of at least 1, got 0"),
])
def test_bad_hugging_face_configs_exit_2(tmp_path, content, words, capsys):
    config = tmp_path / "config.json"
    config.write_text(content)
    assert harness_main(["spec", "--from-hf", str(config)]) == 2
    assert words in capsys.readouterr().err


def test_the_command_writes_a_spec_that_loads_back(tmp_path, project_env):
    """The whole command in a process of its own: the TOML it writes is the spec it describes."""
    out = tmp_path / "job.toml"
    result = subprocess.run([sys.executable, "-m", "harness", "spec", "--from-megatron", str(GPT3_175B), "--gpus",
                             "1024", "-o", str(out)], capture_output=True, text=True, env=project_env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {out}: gpt2 96 layers x 12288, dp x tp x pp = 8 x 8 x 16")
    assert "vocab 50,257 padded to 51,200" in result.stdout
    assert loads_spec(out.read_text()) == from_megatron(str(GPT3_175B), gpus=1024).spec
    hf = tmp_path / "hf.toml"
    assert harness_main(["spec", "--from-hf", str(DATA / "hf" / "gpt2.json"), "--gpus", "4", "--strategy",
                         "tp=4,dp=1", "-o", str(hf)]) == 0
    spec = loads_spec(hf.read_text())
    assert (spec.strategy.tp, spec.model.vocab, spec.model.unpadded_vocab) == (4, 50_688, 50_257)
    assert harness_main(["spec", "--from-hf", str(DATA / "hf" / "Meta-Llama-3-8B.json"), "--gpus", "8",
                         "--strategy", "tp=8,dp=1", "-o", str(hf)]) == 0
    assert loads_spec(hf.read_text()).model.vocab == 128_256  # tp divides it: by default not padded


def test_the_distributed_optimizer_gives_way_to_the_tied_embedding():
    """The spec refuses a tied embedding under ZeRO; Megatron's distributed optimizer (ZeRO-1 here) is what is
    dropped, with a note, not the model's tie."""
    imported = from_megatron("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
                             "--vocab-size 1024 --use-distributed-optimizer", gpus=8)
    assert imported.spec.model.tie_embeddings and imported.spec.strategy.zero == 0
    assert [line for line in imported.not_modelled if line.startswith("--use-distributed-optimizer")]


def test_a_megatron_refusal_drops_the_feature_it_names_and_nothing_else():
    """Context parallelism refuses dropout (not the tied embedding): the import drops dropout, with a note, and keeps
    the tie."""
    imported = from_megatron("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
                             "--vocab-size 1024 --context-parallel-size 2", gpus=2)
    assert imported.spec.model.tie_embeddings and imported.spec.model.dropout == 0.0
    assert [line for line in imported.not_modelled if line.startswith("dropout")]
    assert not [line for line in imported.not_modelled if "tied" in line]


@pytest.mark.parametrize("launch, extra, layout", [
    ("#SBATCH -N2\nsrun --ntasks-per-node=8 python pretrain_gpt.py", {}, (2, 8)),
    ("srun -N 2 -n 16 python pretrain_gpt.py", {}, (2, 8)),
    ("mpirun -n 4 python pretrain_gpt.py", {}, (1, 4)),
    ("torchrun --nproc-per-node 8 pretrain_gpt.py", {"gpus_per_node": 4}, (2, 4)),
    ('ARGS=(--global-batch-size 64)\ntorchrun --nproc-per-node 8 pretrain_gpt.py "${ARGS[@]}" "${UNSET[@]}"', {},
     (1, 8)),
    ("mpirun -N 8 -n 16 python pretrain_gpt.py", {}, (2, 8)),
    ("nice -n 10 torchrun --nnodes 2 --nproc-per-node 4 pretrain_gpt.py", {}, (2, 4)),
])
def test_the_launchers_gpu_count_reads_as_slurm_and_bash_would(tmp_path, launch, extra, layout):
    """sbatch's attached -N2, srun's tasks in all over its nodes, a quoted array an element a word, and
    --gpus-per-node a new node size for the launcher's GPUs (not a new count)."""
    script = tmp_path / "run.sh"
    script.write_text(launch + " --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
                      "--vocab-size 1024 --micro-batch-size 1\n")
    cluster = from_megatron(str(script), **extra).spec.cluster
    assert (cluster.nodes, cluster.gpus_per_node) == layout


@pytest.mark.parametrize("source, words", [
    ("FOLDER", "is a folder; give the launch script in it"),
    ("BINARY", "is not a text file"),
])
def test_a_megatron_source_that_is_no_script_exits_2(tmp_path, source, words, capsys):
    binary = tmp_path / "run.bin"
    binary.write_bytes(bytes(range(128, 256)))
    path = {"FOLDER": tmp_path, "BINARY": binary}[source]
    assert harness_main(["spec", "--from-megatron", str(path), "--gpus", "8"]) == 2
    assert words in capsys.readouterr().err


def test_gpus_per_node_that_does_not_divide_the_gpus_exits_2(capsys):
    arguments = "--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 1024"
    assert harness_main(["spec", "--from-megatron", arguments, "--gpus", "8", "--gpus-per-node", "3"]) == 2
    assert "8 GPUs do not fill nodes of --gpus-per-node 3" in capsys.readouterr().err


def test_a_hugging_face_dtype_this_tool_does_not_model_is_said(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64, '
                      '"vocab_size": 100, "torch_dtype": "float64"}')
    imported = from_hf(str(config))
    assert imported.spec.model.dtype == "float32"
    assert any("torch_dtype float64" in note for note in imported.notes)


def test_the_command_keeps_the_gpus_it_is_given_and_refuses_options_of_the_other_importer(capsys):
    """--gpus N with --strategy tp=4: dp follows (N / 4), not the node count; a dp that breaks N is refused; the
    Hugging Face batch options are refused beside --from-megatron, not dropped."""
    config = str(DATA / "hf" / "gpt2.json")
    assert harness_main(["spec", "--from-hf", config, "--gpus", "4", "--strategy", "tp=4"]) == 0
    out = capsys.readouterr().out
    assert "dp = 1" in out and "tp = 4" in out and "gpus_per_node = 4" in out and "nodes = 1" in out
    assert harness_main(["spec", "--from-hf", config, "--gpus", "4", "--strategy", "tp=4,dp=2"]) == 2
    assert "is 8 GPUs, not the --gpus 4" in capsys.readouterr().err
    arguments = "--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --vocab-size 1024"
    assert harness_main(["spec", "--from-megatron", arguments, "--gpus", "8", "--seq-len", "5"]) == 2
    assert "--seq-len: for --from-hf only" in capsys.readouterr().err


def test_megatrons_gradient_accumulation_fusion_is_its_default():
    command = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
               "--micro-batch-size 1 --global-batch-size 8 --vocab-size 512")
    assert from_megatron(command, gpus=1).spec.strategy.grad_accumulation_fusion
    unfused = from_megatron(command + " --no-gradient-accumulation-fusion", gpus=1)
    assert not unfused.spec.strategy.grad_accumulation_fusion
    assert not any("accumulation" in line for line in unfused.not_modelled)


@pytest.mark.parametrize("flags,reduce_dtype", [
    ("--bf16", "float32"),  # Megatron forces fp32 gradient accumulation and all-reduce with bf16
    ("--bf16 --grad-reduce-in-bf16", "bfloat16"),
    ("--bf16 --main-grads-dtype bf16", "bfloat16"),  # Megatron-Core's precision-aware optimizer
    ("--fp16", "float16"),
    ("--fp16 --accumulate-allreduce-grads-in-fp32", "float32"),
    ("", "float32")])
def test_megatrons_gradient_reductions_take_its_main_gradients_dtype(flags, reduce_dtype):
    command = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
               f"--micro-batch-size 1 --global-batch-size 8 --vocab-size 512 {flags}")
    imported = from_megatron(command, gpus=2)
    assert imported.spec.reduce_dtype == reduce_dtype
    assert imported.unknown == [] and not any("fp32" in line or "bf16" in line for line in imported.not_modelled)


@pytest.mark.parametrize("flags,said", [
    ("--tensor-model-parallel-size 2", "the asynchronous tensor-parallel all-reduce"),
    ("--tensor-model-parallel-size 2 --no-async-tensor-model-parallel-allreduce", None),
    ("--tensor-model-parallel-size 2 --deepspeed", None),  # Megatron-DeepSpeed turns it off with DeepSpeed
    ("--tensor-model-parallel-size 2 --sequence-parallel", "sequence parallelism's backward overlap"),
    ("", None)])
def test_megatrons_overlapped_tensor_parallel_collectives_are_said_not_modelled(flags, said):
    command = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
               f"--micro-batch-size 1 --global-batch-size 8 --vocab-size 512 --fp16 {flags}")
    imported = from_megatron(command, gpus=2)
    overlap = [line for line in imported.not_modelled if "overlap" in line or "asynchronous" in line]
    assert overlap == ([] if said is None else [next(line for line in overlap if line.startswith(said))])
    assert imported.unknown == []


def test_a_megatron_launch_on_a_named_device_and_network_is_enough_to_simulate(tmp_path, capsys):
    """--device and --network write [cluster] device and another spec's tiers: the spec alone then predicts."""
    from analysis.cli import main as analysis_main

    jobs = Path(__file__).parents[1] / "harness" / "jobs"
    out = tmp_path / "gpt3.toml"
    assert harness_main(["spec", "--from-megatron", str(GPT3_175B), "--gpus", "1024", "--device", "a100-80gb",
                         "--network", str(jobs / "dgx-a100.toml"), "-o", str(out)]) == 0
    spec = loads_spec(out.read_text())
    assert spec.cluster.device == "a100-80gb" and spec.cluster.device_memory_gb == 80
    nvlink, ib = loads_spec((jobs / "dgx-a100.toml").read_text()).cluster.network
    assert spec.cluster.network == (dataclasses.replace(nvlink, memory_gbs=2039.0), ib)  # the 80GB's HBM
    assert "the nvlink tier's memory_gbs is a100-80gb's 2,039 GB/s" in capsys.readouterr().out
    assert spec.model == from_megatron(str(GPT3_175B), gpus=1024).spec.model
    capsys.readouterr()
    assert analysis_main(["simulate", str(out), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["batch_time_s"] > 0
    assert set(document["sources"]["compute"]) == {"device"} and set(document["sources"]["communication"]) == {
        "network"}


@pytest.mark.parametrize("flag,value,gpus,words", [
    ("--device", "no-such-gpu", 1024, "--device no-such-gpu: [cluster.device] unknown device 'no-such-gpu'"),
    ("--network", "demo.toml", 1024, "has no [[cluster.network]] to take the tiers from"),
    ("--network", "no-such.toml", 1024, "--network no-such.toml: no-such.toml: spec file not found"),
    ("--network", "dgx-a100.toml", 4096, "its tiers do not hold this job's 4,096 GPUs: [cluster.network] the "
                                         "cluster's 4096 GPUs do not fit in the outermost tier 'ib' (size 2048)")])
def test_a_target_that_cannot_be_read_exits_2_naming_it(flag, value, gpus, words, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).parents[1] / "harness" / "jobs")
    assert harness_main(["spec", "--from-megatron", str(GPT3_175B), "--gpus", str(gpus), flag, value]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and "'bandwidth_gbs'" not in err


@pytest.mark.parametrize("flags,bucket_mb", [("--bf16", 40.0), ("--fp16", 20.0),
                                             ("--fp16 --accumulate-allreduce-grads-in-fp32", 40.0)])
def test_a_ddp_bucket_holds_elements_of_megatrons_main_gradients(flags, bucket_mb):
    """--ddp-bucket-size counts elements of the main-gradient buffer: 4 bytes each where it is fp32, 2 in fp16."""
    command = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
               f"--micro-batch-size 1 --global-batch-size 8 --vocab-size 512 --ddp-bucket-size 10485760 {flags}")
    assert from_megatron(command, gpus=2).spec.strategy.bucket_mb == bucket_mb
