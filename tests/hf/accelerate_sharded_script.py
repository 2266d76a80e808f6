"""An accelerate loop on a tiny GPT-2 under FSDP or DeepSpeed, launched by ``accelerate launch`` with an FSDP or
DeepSpeed config file (2 processes, or 4 with ``--num_processes 4``; run by test_accelerate.py).

    accelerate launch --config_file CONFIG.yaml tests/hf/accelerate_sharded_script.py --out DIR
        [--crash-at S] [--plain --resume-from FOLDER] [--params-out FILE]

On a machine without GPUs accelerate does not set FSDP or DeepSpeed up from the config file (each
process then runs alone, undistributed): this script builds its Accelerator with gloo, and turns on
the FSDP plugin that the launcher's environment describes before ``prepare`` (test-only; the package
never does this).

Flash mode (default): ``enable(accelerator, DIR)``, ``load_state()`` at start (the newest of memory
and storage), ``save_state(DIR/step_<N>)`` every 4 steps, a memory-only snapshot every 3; with
``--crash-at S`` rank 0 SIGKILLs itself right after the snapshot of step S. ``--plain``: the stock
accelerate alone (this process never imports flashckpt_integrations), resuming from ``--resume-from``
with the stock ``load_state`` and the folder name's step. Each step's batch depends only on the step
and the rank. Rank 0 prints one JSON line and saves the final full parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import sys

PLAIN = "--plain" in sys.argv
if PLAIN:
    sys.modules["flashckpt_integrations"] = None  # the stock code alone
else:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import PartialState  # noqa: E402
from accelerate.utils import (  # noqa: E402
    DistributedType,
    FullyShardedDataParallelPlugin,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    set_seed,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

SEQ_LEN, BATCH = 16, 4


def batch_for(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randint(0, 256, (BATCH, SEQ_LEN), generator=g)


def cpu_accelerator(project_dir: str) -> Accelerator:
    """A distributed Accelerator on gloo; under FSDP, with the plugin the launcher's environment describes."""
    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
                              project_config=ProjectConfiguration(project_dir))
    if os.environ.get("ACCELERATE_USE_FSDP") == "true" and accelerator.distributed_type != DistributedType.FSDP:
        options = {}
        if os.environ.get("FSDP_VERSION", "1") == "1":
            options = {"use_orig_params": True, "sync_module_states": False}
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**options)  # the rest from FSDP_* variables
        accelerator.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return accelerator


def full_parameters(model: torch.nn.Module, kind: DistributedType) -> dict[str, torch.Tensor]:
    """The full fp32 parameters on every rank (collective)."""
    if kind == DistributedType.DEEPSPEED:
        from deepspeed.utils import safe_get_full_fp32_param

        return {name: safe_get_full_fp32_param(p) for name, p in model.module.named_parameters()}
    # (accelerate's get_state_dict offloads to the CPU, which crashes FSDP1 on parameters already there)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--resume-from")
    parser.add_argument("--params-out")
    opts = parser.parse_args()
    accelerator = cpu_accelerator(opts.out)
    kind = accelerator.distributed_type
    assert kind in (DistributedType.FSDP, DistributedType.DEEPSPEED) and accelerator.num_processes in (2, 4), kind
    if kind == DistributedType.DEEPSPEED:  # (no dataloader is prepared to tell it)
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = BATCH
    set_seed(7)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=SEQ_LEN,
                                       bos_token_id=0, eos_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.05 * s))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    flash, resumed = None, None
    if opts.plain:
        if opts.resume_from:
            if kind == DistributedType.FSDP and accelerator.state.fsdp_plugin.fsdp_version == 1:  # else FSDP1
                from torch.distributed.checkpoint.state_dict import _init_optim_state  # restores no optimizer


                _init_optim_state(optimizer.optimizer)  # state into one that never stepped
            accelerator.load_state(opts.resume_from)
            resumed = [int(re.search(r"(\d+)$", opts.resume_from).group(1)), "storage"]
    else:
        from flashckpt_integrations.adapters.accelerate import enable

        flash = enable(accelerator, opts.out)
        resumed = accelerator.load_state()
    start = resumed[0] + 1 if resumed else 1
    for step in range(start, opts.steps + 1):
        ids = batch_for(step, accelerator.process_index)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if flash is not None and step % 4 == 0:
            accelerator.save_state(os.path.join(opts.out, f"step_{step}"))
        elif flash is not None and step % 3 == 0:
            flash.save_state(step, persist=False)
        if step == opts.crash_at:
            flash.wait()  # what is on storage at the crash does not depend on the machine's speed
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                print(json.dumps({"crashing_at": step}), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    if flash is not None:
        flash.close()
    params = full_parameters(model, kind)
    if accelerator.is_main_process:
        params = {k: v.detach().cpu().clone() for k, v in params.items()}
        if opts.params_out:
            torch.save(params, opts.params_out)
        digest = hashlib.sha256(b"".join(params[k].numpy().tobytes() for k in sorted(params))).hexdigest()[:16]
        print(json.dumps({"final_step": opts.steps, "resumed_from": list(resumed) if resumed else None,
                          "params_sha256": digest, "flash": "flashckpt_integrations" in sys.modules
                          and sys.modules["flashckpt_integrations"] is not None}), flush=True)
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo threads can abort the interpreter's teardown


if __name__ == "__main__":
    main()
