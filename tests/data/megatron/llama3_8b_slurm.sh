#!/bin/bash
# A Megatron-Core Llama-3-8B-like launch written for the importer's tests (not from a repository): Slurm's
# #SBATCH lines, torchrun under srun, --arg=value forms, ${VAR:-default} and $(( )) as real scripts use them.
#SBATCH --job-name=llama3-8b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8

NNODES=${SLURM_NNODES:-4}
GPUS_PER_NODE=8
TP=2
PP=2
VP_LAYERS=$((32 / PP / 4))   # 4 model chunks a pipeline rank

MODEL_ARGS="--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
    --group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 \
    --swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 500000 \
    --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0"

srun --nodes=$NNODES --ntasks-per-node=1 torchrun --nnodes=$NNODES --nproc-per-node=$GPUS_PER_NODE \
    --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500 \
    pretrain_gpt.py \
    $MODEL_ARGS \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Meta-Llama-3-8B --vocab-size 128256 \
    --micro-batch-size=1 --global-batch-size=128 \
    --tensor-model-parallel-size $TP --pipeline-model-parallel-size $PP \
    --num-layers-per-virtual-pipeline-stage $VP_LAYERS --sequence-parallel \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
    --lr 3e-4 --train-iters 1000 --data-path /data/tokens_text_document --save /ckpt --log-interval 10 \
    --use-flash-attn
