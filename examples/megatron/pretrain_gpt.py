"""Megatron-LM's own ``pretrain()`` loop with flash checkpoints: a tiny GPT on 2 data-parallel ranks, mock data.

    torchrun --nproc-per-node 2 examples/megatron/pretrain_gpt.py --ckpt-dir /tmp/ckpt \
        --train-iters 12 [--snapshot-interval 2] [--persist-interval 4] [--kill-at 6] [-- MEGATRON FLAGS...]

Flash checkpoints are one import and one call (see ``main``)::

    from flashckpt_integrations.adapters import megatron as flash_megatron
    flash = flash_megatron.patch()

Everything else is stock Megatron, on the flags of a production run: its default checkpoint
format (``torch_dist``, with ``--ckpt-fully-parallel-save``), the distributed optimizer, and
``--async-save --use-persistent-ckpt-worker`` (under the patch the copy into shared memory
overlaps the next iteration, and the saver, not Megatron's worker, writes the files).
``--non-persistent-save-interval`` (our ``--snapshot-interval``) saves go to shared memory only,
``--save-interval`` (our ``--persist-interval``) saves go to shared memory and are written to
``--ckpt-dir`` by a background saver, as Megatron's own
``iter_XXXXXXX/{__0_0.distcp,__1_0.distcp,.metadata,metadata.json}``. At start, ``load_checkpoint``
(run by ``pretrain()``) resumes from shared memory when it holds a newer complete snapshot than
the disk. ``-- --ckpt-format torch`` runs the same on Megatron's legacy format.

``--kill-at ITER`` SIGKILLs every rank right after the snapshot of iteration ITER is in shared
memory (once every rank has it), to simulate a crash. Rank 0 prints ``[pretrain_gpt] ...`` lines: where it resumed
from at start, and the final iteration and loss at the end.

Without a GPU it runs on CPU with gloo, using the test shims in ``tests/megatron/cpu_shims.py``.
Anything after ``--`` goes to Megatron's own argument parser (and overrides the defaults below).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU = not torch.cuda.is_available()
if CPU:  # make megatron-core run on CPU + gloo (test-only monkeypatches; before anything touches CUDA)
    sys.path.insert(0, REPO)
    from tests.megatron import cpu_shims

    cpu_shims.apply()

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.training import get_args, get_tokenizer, pretrain  # noqa: E402
from megatron.training import training as megatron_training  # noqa: E402
from megatron.training.argument_utils import core_transformer_config_from_args, pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402

from flashckpt_integrations.adapters import megatron as flash_megatron  # noqa: E402

TAG = "[pretrain_gpt]"


def say(message: str) -> None:
    """One line on stdout in one write (the ranks share torchrun's stdout)."""
    sys.stdout.write(f"{TAG} {message}\n")
    sys.stdout.flush()


# A tiny GPT: 2 layers, hidden 64, 4 heads, vocab 128, sequences of 32 tokens; 2 micro-batches of 2 per rank.
MODEL_FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--optimizer", "adam", "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--use-distributed-optimizer", "--async-save", "--use-persistent-ckpt-worker",
    "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1", "--num-workers", "0",
]
# Megatron's own layers, no fused kernels: what runs without Transformer Engine or Apex.
LOCAL_FLAGS = [
    "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
]
CPU_FLAGS = ["--use-cpu-initialization", "--distributed-backend", "gloo"]


def parse_our_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt-dir", required=True, help="Megatron's --save and --load")
    parser.add_argument("--train-iters", type=int, default=12)
    parser.add_argument("--snapshot-interval", type=int, default=2,
                        help="memory-only snapshot every K iterations (Megatron's --non-persistent-save-interval)")
    parser.add_argument("--persist-interval", type=int, default=4,
                        help="snapshot + write to --ckpt-dir every P iterations (Megatron's --save-interval)")
    parser.add_argument("--kill-at", type=int, default=None, help="SIGKILL every rank after the save of ITER")
    parser.add_argument("megatron_args", nargs="*", help="after --: more Megatron flags")
    ours = parser.parse_args()
    megatron_argv = [
        *MODEL_FLAGS, *LOCAL_FLAGS, *(CPU_FLAGS if CPU else []),
        "--save", ours.ckpt_dir, "--load", ours.ckpt_dir, "--train-iters", str(ours.train_iters),
        "--save-interval", str(ours.persist_interval), "--non-persistent-save-interval", str(ours.snapshot_interval),
        *ours.megatron_args,
    ]
    return ours, megatron_argv


# --- what every Megatron GPT script has: model, data, forward step ------------------------------


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    args = get_args()
    return GPTModel(
        config=core_transformer_config_from_args(args), transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, pg_collection=pg_collection, vp_stage=vp_stage,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's MockGPTDataset (synthetic documents, nothing downloaded), built on every rank."""
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, tokenizer=get_tokenizer(),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
    )
    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples, lambda: True, config).build()


train_valid_test_datasets_provider.is_distributed = True  # every rank builds the (mock) dataset itself

LOSSES: dict[int, list[float]] = {}
"""Iteration -> the per-token loss of each micro-batch (for the summary at the end)."""


def forward_step(data_iterator, model):
    batch = {key: value.cuda(non_blocking=True) for key, value in next(data_iterator).items()}  # (CPU: no-op)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        mask = batch["loss_mask"].view(-1).float()
        loss = (output_tensor.float().view(-1) * mask).sum()
        tokens = mask.sum().to(torch.int)
        LOSSES.setdefault(get_args().curr_iteration + 1, []).append(loss.item() / max(tokens.item(), 1))
        return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}

    return output, loss_func


# --- the crash, and the messages ----------------------------------------------------------------


def install_hooks(flash: flash_megatron.MegatronFlash, kill_at: int | None, rank: int) -> None:
    """Wrap the (already flash-patched) save/load that pretrain() calls: report the load, crash after a save."""
    load, save = megatron_training.load_checkpoint, megatron_training.save_checkpoint

    @functools.wraps(load)
    def load_and_report(*args, **kwargs):
        result = load(*args, **kwargs)
        if rank == 0:
            if flash.last_load is None:
                say("no checkpoint in memory or on disk: training from scratch")
            else:
                iteration, source = flash.last_load
                say(f"resumed from iteration {iteration} ({source})")
        return result

    @functools.wraps(save)
    def save_then_maybe_die(iteration, *args, **kwargs):
        save(iteration, *args, **kwargs)
        if rank == 0 and (result := flash.last_save) is not None:
            say(f"saved iteration {iteration}: {result.status.value} (training held {1000 * result.blocking_s:.1f} ms)")
        if iteration == kill_at:
            flash.wait_for_snapshot()  # with --async-save the copy overlaps training: let it finish
            torch.distributed.barrier()  # every rank's snapshot of `iteration` is in shared memory
            if rank == 0:
                say(f"SIGKILL after the save of iteration {iteration}")
            os.kill(os.getpid(), signal.SIGKILL)

    megatron_training.load_checkpoint = load_and_report
    megatron_training.save_checkpoint = save_then_maybe_die


def main() -> int:
    ours, megatron_argv = parse_our_args()
    sys.argv[1:] = megatron_argv  # Megatron parses sys.argv itself
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = parse_and_validate_args()
    rank = args.rank

    # Flash checkpoints. Megatron's --save-interval saves are persisted (persist_interval=1: all of them), its
    # --non-persistent-save-interval saves stay in shared memory only.
    flash = flash_megatron.patch()
    install_hooks(flash, ours.kill_at, rank)

    pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)

    outcome = flash.wait()  # the last persisting save is committed
    flash.close()  # frees the shared memory: a normal end leaves nothing behind
    if rank == 0:
        last = max(LOSSES) if LOSSES else args.iteration  # (nothing trained: the loaded iteration)
        loss = f"{sum(LOSSES[last]) / len(LOSSES[last]):.6f}" if LOSSES else "n/a"
        if outcome is None:
            committed = "nothing persisted"
        elif outcome.committed:
            committed = f"iteration {outcome.step} committed to {ours.ckpt_dir}"
        else:
            committed = f"persisting iteration {outcome.step} FAILED: {outcome.error}"
        say(f"done: final iteration {last}, lm loss {loss}; {committed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
