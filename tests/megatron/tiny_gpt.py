"""A tiny Megatron GPT on CPU ranks (gloo): arguments, model, data, Megatron's own train_step, checksums.

Shared by the Megatron test workers and the benchmark. Importing it applies the CPU shims and
imports Megatron, never flashckpt_integrations (the stock-loader checks rely on that).
:func:`start` (re)initialises Megatron for a layout, so that one process can run several layouts
one after another.
"""

from __future__ import annotations

import hashlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import cpu_shims  # noqa: E402

cpu_shims.apply()

import torch  # noqa: E402
from megatron.core import mpu  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.rerun_state_machine import RerunDataIterator, destroy_rerun_state_machine  # noqa: E402
from megatron.core.utils import get_model_config, unwrap_model  # noqa: E402
from megatron.training import get_args  # noqa: E402
from megatron.training.argument_utils import core_transformer_config_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.global_vars import unset_global_variables  # noqa: E402
from megatron.training.initialize import _set_random_seed, initialize_megatron  # noqa: E402
from megatron.training.training import (  # noqa: E402
    get_megatron_optimizer_config,
    get_model,
    get_optimizer_param_scheduler,
    train_step,
)

LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp1": [],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "pp1": [],
    "dp2": ["--use-distributed-optimizer"],
    "dp2plain": [],
    "dp": [],  # data parallel over every rank, plain optimizer
    "distopt": ["--use-distributed-optimizer"],  # the same with the distributed optimizer
    "ep2": ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
            "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.01"],
}


def megatron_argv(layout: str, ckpt: str, *, layers: int = 2, hidden: int = 64, vocab: int = 128,
                  ckpt_format: str = "torch") -> list[str]:
    return [
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", "4",
        "--ffn-hidden-size", str(2 * hidden), "--seq-length", "32", "--max-position-embeddings", "32",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab), "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0", "--make-vocab-size-divisible-by", "64",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "100", "--lr", "1e-3",
        "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--optimizer", "adam",
        "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
        "--transformer-impl", "local", "--use-cpu-initialization", "--distributed-backend", "gloo",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion", "--no-persist-layer-norm",
        "--save", ckpt, "--load", ckpt, "--ckpt-format", ckpt_format, "--save-interval", "1",
        *LAYOUTS[layout],
    ]


_started = False


def start(argv: list[str]) -> None:
    """Parse ``argv`` as Megatron's arguments and initialise Megatron (again, after an earlier layout)."""
    global _started
    if _started:
        stop()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    saved, sys.argv = sys.argv, [sys.argv[0], *argv]
    try:
        parse_and_validate_args()
    finally:
        sys.argv = saved
    with cpu_shims.fake_cuda_device_count():
        initialize_megatron(allow_no_cuda=True)
    _started = True


def stop() -> None:
    """Forget Megatron's global state (arguments, parallel groups), keeping torch.distributed."""
    global _started
    mpu.destroy_model_parallel()
    destroy_rerun_state_machine()
    unset_global_variables()
    _started = False


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    args = get_args()
    cfg = core_transformer_config_from_args(args)
    spec = (get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, vp_stage=vp_stage) if args.num_experts
            else get_gpt_layer_local_spec())
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, pg_collection=pg_collection,
                    vp_stage=vp_stage)


def build(seed: int):
    """Model, optimizer and scheduler as ``setup_model_and_optimizer`` builds them (without its load)."""
    with cpu_shims.fake_cuda_device_count():  # seeds the model-parallel RNG tracker too
        _set_random_seed(seed)
    args = get_args()
    model = get_model(model_provider, ModelType.encoder_or_decoder, wrap_with_ddp=True)
    opt_config, overrides = get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(opt_config, model, config_overrides=overrides,
                                       use_gloo_process_groups=args.use_gloo_process_groups)
    # what megatron.training.train() sets up: without it gradients are never reduced across
    # data-parallel ranks, nor the tied embeddings across pipeline stages
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    if config.finalize_model_grads_func is None:
        config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer, get_optimizer_param_scheduler(optimizer)


def batches(iteration: int):
    """The micro-batches of one iteration: a function of the iteration and the data-parallel rank only."""
    args = get_args()
    g = torch.Generator().manual_seed(1000 * iteration + mpu.get_data_parallel_rank())
    while True:
        yield torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=g)


def forward_step(data_iterator, model):
    args = get_args()
    data = next(data_iterator)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    position_ids = torch.arange(args.seq_length).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, None, labels=labels)

    def loss_func(output_tensor):
        loss = output_tensor.float().sum()
        n = torch.tensor(output_tensor.numel(), dtype=torch.int)
        return loss, n, {"lm loss": torch.stack([loss.detach(), n.float()])}

    return output, loss_func


def train(model, optimizer, scheduler, first: int, last: int, save=None) -> None:
    """Iterations ``first``..``last`` with Megatron's own ``train_step``; ``save(iteration)`` after each one."""
    args = get_args()
    fwd_bwd = get_forward_backward_func()
    config = get_model_config(model[0])
    for iteration in range(first, last + 1):
        data = RerunDataIterator(batches(iteration))  # as train() wraps its iterator
        _, skipped, *_ = train_step(forward_step, [data] if len(model) > 1 else data, model, optimizer, scheduler,
                                    config, fwd_bwd, iteration=iteration)
        if skipped:
            raise RuntimeError(f"iteration {iteration} was skipped")
        args.consumed_train_samples = getattr(args, "consumed_train_samples", 0) + args.global_batch_size
        if save is not None:
            save(iteration)


def digest(model, optimizer) -> dict[str, str]:
    """A checksum per parameter and per optimizer state tensor (bit-exact comparisons across runs)."""
    out = {}
    for i, m in enumerate(model):
        for name, p in unwrap_model(m).named_parameters():
            out[f"model{i}.{name}"] = _hash(p)
    for oi, opt in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = opt.optimizer
        for gi, group in enumerate(inner.param_groups):
            # (Megatron's distributed-optimizer load adds a 'step' to the groups; torch's Adam never reads it)
            out[f"opt{oi}.g{gi}"] = repr({k: v for k, v in sorted(group.items()) if k not in ("params", "step")})
            for pi, p in enumerate(group["params"]):
                out[f"opt{oi}.g{gi}.p{pi}"] = _hash(p)
                for key, value in sorted(inner.state.get(p, {}).items()):
                    out[f"opt{oi}.g{gi}.p{pi}.{key}"] = _hash(value) if torch.is_tensor(value) else repr(value)
    return out


def global_digest(model, optimizer=None) -> dict[str, str]:
    """A checksum per parameter of the whole model, whatever the tensor and pipeline split: each
    tensor-parallel parameter gathered along its partition dimension, layers named by their global
    index. With a (non-distributed) optimizer, its Adam moments the same way. Collective; every rank
    returns the same dict."""
    args = get_args()
    per_stage = args.num_layers // args.pipeline_model_parallel_size
    offset = mpu.get_pipeline_model_parallel_rank() * per_stage
    states = {}
    if optimizer is not None:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            states.update({id(p): s for p, s in opt.optimizer.state.items()})
    mine = {}
    last_stage = mpu.is_pipeline_last_stage() and not mpu.is_pipeline_first_stage()
    for m in model:
        for name, p in unwrap_model(m).named_parameters():
            if last_stage and name == "output_layer.weight" and not args.untie_embeddings_and_output_weights:
                continue  # the last stage's copy of the tied embedding
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + offset)
            key = ".".join(parts)
            tensors = {"": p, **{f".{k}": v for k, v in sorted(states.get(id(p), {}).items()) if k != "step"}}
            for suffix, t in tensors.items():
                mine[key + suffix] = _hash(_gather_tp(p, t.detach()))
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    out = {}
    for rank_view in gathered:
        out.update(rank_view)
    return dict(sorted(out.items()))


def rng_digest() -> dict[str, str]:
    """Checksums of this rank's RNG states that a checkpoint holds: torch's and the model-parallel tracker's."""
    from megatron.core import tensor_parallel

    states = tensor_parallel.get_cuda_rng_tracker().get_states()
    return {"torch": _hash(torch.get_rng_state()), **{k: _hash(v) for k, v in sorted(states.items())}}


def _gather_tp(param, tensor):
    if not getattr(param, "tensor_model_parallel", False) or mpu.get_tensor_model_parallel_world_size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(mpu.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=param.partition_dim)


def _hash(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]


def distributed_optimizer_digest(model, optimizer) -> dict[str, str]:
    """A checksum per parameter of the distributed optimizer's Adam moments, whatever the
    data-parallel split: each rank's flattened range of a parameter gathered into the whole
    (flattened) tensor. Tensor and pipeline parallel size 1 only. Collective; every rank returns
    the same dict."""
    names = {id(p): f"model{i}.{n}" for i, m in enumerate(model) for n, p in unwrap_model(m).named_parameters()}
    mine = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for model_group, shard_group in zip(opt.model_fp32_groups, opt.shard_fp32_groups):
            for param, shard in zip(model_group, shard_group):
                gbuf, dtype, bucket = opt.model_param_gbuf_map[param]
                start = opt.gbuf_ranges[gbuf][dtype][bucket]["param_map"][param]["param"].start
                for key, value in sorted(opt.optimizer.state.get(shard, {}).items()):
                    if key != "step":
                        mine.append((f"{names[id(param)]}.{key}", param.numel(), start, value.detach().float().clone()))
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    whole: dict[str, torch.Tensor] = {}
    for rank_view in gathered:
        for key, numel, start, piece in rank_view:
            whole.setdefault(key, torch.full((numel,), float("nan")))[start:start + piece.numel()] = piece
    return {key: _hash(t) for key, t in sorted(whole.items())}
