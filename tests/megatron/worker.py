"""A tiny Megatron GPT on 2 CPU ranks, trained with Megatron-LM's real checkpointing (patched or stock).

    torchrun --nproc-per-node 2 tests/megatron/worker.py --layout tp2 --ckpt DIR --out DIR --mode roundtrip

Modes (each writes ``<out>/rank-<r>.json``):

* ``roundtrip``: a reference run of 6 iterations; then, from the same seed, 4 iterations saved
  through the patch (memory every iteration, persisted every 2nd); unpatch; a fresh model loads
  the newest commit with Megatron's *stock* ``load_checkpoint`` and trains 2 more iterations. The
  record holds the saved / loaded / final parameters and optimizer states (as checksums).
* ``crash``: 6 iterations snapshotted every iteration (persisted every 4th), then 2 more without
  saving (the reference), then SIGKILL of every rank.
* ``resume``: the patched ``load_checkpoint`` after ``crash``, then 2 iterations.
* ``load``: the patched ``load_checkpoint`` only (the error, if any, goes into the record).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
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
from megatron.core.rerun_state_machine import RerunDataIterator  # noqa: E402
from megatron.core.utils import get_model_config, unwrap_model  # noqa: E402
from megatron.training import checkpointing, get_args  # noqa: E402
from megatron.training.argument_utils import core_transformer_config_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.initialize import _set_random_seed, initialize_megatron  # noqa: E402
from megatron.training.training import (  # noqa: E402
    get_megatron_optimizer_config,
    get_model,
    get_optimizer_param_scheduler,
    train_step,
)

from flashckpt_integrations.adapters import megatron as flash_megatron  # noqa: E402

LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2": ["--use-distributed-optimizer"],
    "dp2plain": [],
    "ep2": ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
            "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.01"],
}


def megatron_argv(layout: str, ckpt: str, *, layers: int = 2, hidden: int = 64, vocab: int = 128) -> list[str]:
    return [
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", "4",
        "--ffn-hidden-size", str(2 * hidden), "--seq-length", "32", "--max-position-embeddings", "32",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab), "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "100", "--lr", "1e-3",
        "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--optimizer", "adam",
        "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
        "--transformer-impl", "local", "--use-cpu-initialization", "--distributed-backend", "gloo",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion", "--no-persist-layer-norm",
        "--save", ckpt, "--load", ckpt, "--ckpt-format", "torch", "--save-interval", "1",
        *LAYOUTS[layout],
    ]


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


def _hash(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=sorted(MODES), required=True)
    opts = parser.parse_args()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    sys.argv = [sys.argv[0], *megatron_argv(opts.layout, opts.ckpt)]
    parse_and_validate_args()
    with cpu_shims.fake_cuda_device_count():
        initialize_megatron(allow_no_cuda=True)
    rank = torch.distributed.get_rank()
    record: dict = {"rank": rank, "dp_rank": mpu.get_data_parallel_rank()}
    try:
        MODES[opts.mode](record)
    except Exception as exc:  # the test reads what went wrong from the record
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, f"rank-{rank}.json"), "w") as f:
        json.dump(record, f)
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


def roundtrip(record: dict) -> None:
    model, optimizer, scheduler = build(seed=7)
    train(model, optimizer, scheduler, 1, 6)
    record["reference"] = digest(model, optimizer)

    stock = os.environ.get("STOCK_SAVE") == "1"
    flash = None if stock else flash_megatron.patch(persist_interval=2)
    model, optimizer, scheduler = build(seed=7)
    saved = {}

    def save(iteration: int) -> None:
        checkpointing.save_checkpoint(iteration, model, optimizer, scheduler, 100 * iteration)
        saved[iteration] = digest(model, optimizer)
        if flash is not None:
            record.setdefault("status", {})[iteration] = flash.last_save.status.value
            record.setdefault("blocking_s", []).append(flash.last_save.blocking_s)

    fault = os.environ.pop("SAVER_FAULT", "")
    if fault:  # armed in the saver that the first save starts, not in the ones restarted after it dies
        os.environ["FLASHCKPT_FAULT"] = fault
        train(model, optimizer, scheduler, 1, 1, save)
        ck = flash.checkpointer(get_args().save)
        while not (os.path.exists(os.path.join(ck.run_dir, "saver.log")) or ck._client.connected):
            time.sleep(0.005)
        os.environ.pop("FLASHCKPT_FAULT")
    train(model, optimizer, scheduler, 2 if fault else 1, 4, save)
    if flash is not None:
        outcome = flash.wait()
        record["committed"] = [outcome.step, outcome.committed, outcome.error]
        flash_megatron.unpatch()  # everything below is stock Megatron
    record["saved"] = saved[4]

    model, optimizer, scheduler = build(seed=99)
    iteration, flops = checkpointing.load_checkpoint(model, optimizer, scheduler)
    record["loaded_iteration"], record["loaded_flops"] = iteration, flops
    record["loaded"] = digest(model, optimizer)
    train(model, optimizer, scheduler, iteration + 1, 6)
    record["final"] = digest(model, optimizer)


def crash(record: dict) -> None:
    # overlapped snapshots: the copy runs while the next iteration's forward and backward do
    flash = flash_megatron.patch(persist_interval=4, config={"async_snapshot": True})
    model, optimizer, scheduler = build(seed=7)

    def save(iteration: int) -> None:
        checkpointing.save_checkpoint(iteration, model, optimizer, scheduler, 100 * iteration)

    train(model, optimizer, scheduler, 1, 6, save)
    flash.wait()  # iteration 4 is committed; 5 and 6 are in memory only
    record["saved"] = digest(model, optimizer)
    train(model, optimizer, scheduler, 7, 8)
    record["reference"] = digest(model, optimizer)
    path = os.path.join(sys.argv[sys.argv.index("--save") + 1], f"crash-{torch.distributed.get_rank()}.json")
    with open(path, "w") as f:
        json.dump(record, f)
    torch.distributed.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def resume(record: dict) -> None:
    flash = flash_megatron.patch(persist_interval=4)
    model, optimizer, scheduler = build(seed=99)
    started = time.perf_counter()
    iteration, flops = checkpointing.load_checkpoint(model, optimizer, scheduler)
    record["load_s"] = time.perf_counter() - started
    record["loaded_iteration"], record["loaded_flops"] = iteration, flops
    record["source"] = flash.last_load
    record["loaded"] = digest(model, optimizer)
    train(model, optimizer, scheduler, iteration + 1, 8)
    record["final"] = digest(model, optimizer)
    flash_megatron.unpatch()


def load(record: dict) -> None:
    flash_megatron.patch()
    model, optimizer, scheduler = build(seed=99)
    try:
        record["loaded_iteration"] = checkpointing.load_checkpoint(model, optimizer, scheduler)[0]
    finally:
        flash_megatron.unpatch()


def dist(record: dict) -> None:
    """megatron-core dist_checkpointing through the flash strategy, read back with the stock loader."""
    from megatron.core import dist_checkpointing

    from flashckpt_integrations.adapters.megatron_core import FlashTorchDistSaveStrategy

    model, optimizer, scheduler = build(seed=7)
    train(model, optimizer, scheduler, 1, 2)
    strategy = FlashTorchDistSaveStrategy()
    directory = os.path.join(get_args().save, "iter_0000002")
    if torch.distributed.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    started = time.perf_counter()
    dist_checkpointing.save({"model": unwrap_model(model[0]).sharded_state_dict()}, directory,
                            sharded_strategy=strategy)
    record["blocking_s"] = time.perf_counter() - started
    outcome = strategy.last_save.wait()
    record["committed"] = [outcome.step, outcome.committed, outcome.error]
    record["saved"] = digest(model, optimizer)
    strategy.close()

    fresh, fresh_optimizer, _ = build(seed=99)
    target = unwrap_model(fresh[0])
    loaded = dist_checkpointing.load({"model": target.sharded_state_dict()}, directory)  # stock
    target.load_state_dict(loaded["model"])
    record["loaded"] = {k: v for k, v in digest(fresh, fresh_optimizer).items() if k.startswith("model")}
    record["saved"] = {k: v for k, v in record["saved"].items() if k.startswith("model")}
    record["files"] = sorted(os.listdir(directory))


MODES = {"roundtrip": roundtrip, "crash": crash, "resume": resume, "load": load, "dist": dist}

if __name__ == "__main__":
    sys.exit(main())
