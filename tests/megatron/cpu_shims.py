"""CPU + gloo shims for running megatron-core / megatron.training 0.19.2 without a GPU.

Usage (before anything touches CUDA; importing megatron first is fine):

    import cpu_shims
    cpu_shims.apply()
    ...
    with cpu_shims.fake_cuda_device_count():
        initialize_megatron(allow_no_cuda=True)

What is patched, and why (all idempotent, process-wide):

1. ``torch.cuda`` runtime calls that raise "Found no NVIDIA driver":
   - ``current_device`` -> 0 (megatron passes it as ``device=``; remapped by 2.)
   - ``synchronize`` / ``set_device`` -> no-op
   - ``get_device_capability`` / ``get_device_properties`` -> a fake sm_90 device
     (validate_args calls get_device_arch_version() when TP>1).
   - ``Stream`` / ``current_stream`` / ``default_stream`` / ``stream(ctx)`` / ``Event``
     -> dummies (DDP creates a communication stream; get_model wraps DDP init in a
     side stream; async checkpointing records events).
   - ``get_rng_state`` / ``set_rng_state`` / ``manual_seed`` (and the same names in
     ``torch.cuda.random``) -> the CPU default generator. Megatron's
     ``CudaRNGStatesTracker`` (seeded by ``model_parallel_cuda_manual_seed``) then
     really forks the RNG that CPU dropout uses, and ``get_rng_state()`` in
     checkpointing.py gets a real ``cuda_rng_state`` tensor to save/restore.
2. A global ``TorchFunctionMode`` that maps CUDA devices to CPU:
   - any ``device=`` kwarg that is ``"cuda"``, ``"cuda:N"``, ``torch.device('cuda')``
     or an int (``torch.cuda.current_device()``) becomes ``"cpu"``; same for the
     positional device of ``Tensor.to``;
   - ``Tensor.cuda()`` returns the tensor itself (so ``nn.Module.cuda()`` is a no-op);
   - ``Tensor.type()`` (no-arg form, a *string*) reports ``torch.cuda.XTensor`` for
     CPU tensors, because Megatron's optimizers type-check params with
     ``param.type() == 'torch.cuda.FloatTensor'`` (optimizer.py:1028,
     distrib_optimizer.py:466) and raise otherwise.
   Hard-coded ``device="cuda"`` sites this covers include schedules.py:749/2292,
   clip_grads.py:96-231, optimizer.py:690-702, param_and_grad_buffer.py:1145-1186,
   checkpointing.py:375 (read_metadata), exchange_utils.py, state_dict_saver.py.
   Torch function modes are thread-local: the mode is entered on the main thread
   (and in ``fork``ed children, which copy it); threads started later do not see it.
3. Megatron internals:
   - ``tensor_parallel.random._set_cuda_rng_state`` -> CPU ``torch.set_rng_state``
     (the original uses ``torch.cuda._lazy_call``, which never runs without CUDA).
   - ``megatron.core.datasets.utils.compile_helpers`` -> no-op (initialize_megatron
     runs ``make`` on the dataset C++ helpers; we use synthetic data).
   - ``token_dispatcher.maybe_move_tensor_to_cpu``: also turn CPU split-size tensors into
     numpy (MoE ``alltoall`` dispatcher, EP>1).
   - ``DistributedOptimizer._set_main_param_and_optimizer_states``: tolerate the torch-Adam
     ``'step'`` state and run under ``no_grad`` (see ``_patch_distopt_legacy_load``);
     only matters for ``--use-distributed-optimizer --ckpt-format torch`` load.
   - ``DistributedOptimizer.sharded_state_dict(is_loading=True)`` of an optimizer that never
     stepped: give it dummy states first (see ``_patch_distopt_fresh_load``); only matters for
     ``--use-distributed-optimizer --ckpt-format torch_dist`` load into a fresh optimizer.
   - ``PersistentAsyncCaller.async_loop`` (Megatron's persistent checkpoint worker, ``--async-save
     --use-persistent-ckpt-worker``): run inside ``fake_cuda_device_count()`` (it calls
     ``torch.cuda.set_device(rank % torch.cuda.device_count())``). Only a worker started with
     ``mp_mode='fork'`` inherits this (and the other shims); ``initialize_megatron`` starts it with
     ``forkserver``, so start it yourself: ``init_persistent_async_worker(rank, 'fork')``.
   - ``megatron.training.training.initialize_megatron`` (the name ``pretrain()`` calls): run with
     ``allow_no_cuda=True`` inside ``fake_cuda_device_count()`` (see 4.); only ``pretrain()`` uses it.
4. ``fake_cuda_device_count()`` context manager: ``initialize_megatron`` only calls
   ``mpu.initialize_model_parallel`` and ``model_parallel_cuda_manual_seed`` when
   ``torch.cuda.device_count() > 0`` (initialize.py:358, :447). Use it only around
   ``initialize_megatron``; pass ``--distributed-backend gloo``.
"""

import contextlib
import types

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
_MODE = None


# --------------------------------------------------------------------------- 1. torch.cuda
class _DummyStream:
    """Stands in for torch.cuda.Stream; all work is synchronous on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event if event is not None else _DummyEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _DummyEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _patch_torch_cuda():
    c = torch.cuda
    c.current_device = lambda: 0
    c.synchronize = lambda *a, **k: None
    c.set_device = lambda *a, **k: None
    c.Stream = _DummyStream
    c.Event = _DummyEvent
    c.current_stream = lambda *a, **k: _DummyStream()
    c.default_stream = lambda *a, **k: _DummyStream()
    c.stream = lambda *a, **k: contextlib.nullcontext()
    # validate_args() asks for the GPU arch (arguments.py:1414 get_device_arch_version).
    # Pretend to be a Hopper (sm_90) so no Blackwell-only branch is taken.
    c.get_device_capability = lambda *a, **k: (9, 0)
    c.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        major=9, minor=0, name='cpu-shim', total_memory=0, multi_processor_count=1
    )

    # "CUDA" RNG == CPU default generator.
    def get_rng_state(device='cuda'):
        return torch.get_rng_state()

    def set_rng_state(new_state, device='cuda'):
        torch.set_rng_state(new_state)

    def manual_seed(seed):
        # not torch.manual_seed(): that calls torch.cuda.manual_seed_all -> recursion
        torch.default_generator.manual_seed(int(seed))

    for mod in (c, c.random):
        mod.get_rng_state = get_rng_state
        mod.set_rng_state = set_rng_state
        mod.manual_seed = manual_seed  # manual_seed_all stays the lazy no-op original


# --------------------------------------------------------------------------- 2. device remap
def _is_cuda_device(d):
    if isinstance(d, bool):
        return False
    if isinstance(d, int):
        return True
    if isinstance(d, str):
        return d.startswith('cuda')
    if isinstance(d, torch.device):
        return d.type == 'cuda'
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Redirect every CUDA device request to CPU (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            s = func(*args)
            if s.startswith('torch.') and not s.startswith('torch.cuda.'):
                s = 'torch.cuda.' + s[len('torch.'):]
            return s
        if 'device' in kwargs and _is_cuda_device(kwargs['device']):
            kwargs['device'] = 'cpu'
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], 'cpu') + tuple(args[2:])
        return func(*args, **kwargs)


def _enable_device_remap():
    global _MODE
    _MODE = CudaToCpuMode()
    _MODE.__enter__()  # stays active for the rest of the (main-thread) program


# --------------------------------------------------------------------------- 3. megatron
def _patch_megatron():
    from megatron.core.tensor_parallel import random as mcore_random

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mcore_random._set_cuda_rng_state = _set_cuda_rng_state

    import megatron.core.datasets.utils as ds_utils

    ds_utils.compile_helpers = lambda: None

    # MoE alltoall dispatcher: split sizes must reach all_to_all_single as numpy/ints.
    # moe_utils.maybe_move_tensor_to_cpu only converts ``tensor.is_cuda`` tensors
    # (moe_utils.py:1184), so on CPU they stay tensors -> "all_to_all_single():
    # incompatible function arguments" (mappings.py:460).
    from megatron.core.transformer.moe import token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    _patch_distopt_legacy_load()
    _patch_distopt_fresh_load()
    _patch_persistent_worker()
    _patch_pretrain()


def _patch_persistent_worker():
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    orig = PersistentAsyncCaller.async_loop
    if getattr(orig, '_cpu_shim', False):
        return

    def async_loop(*args, **kwargs):
        with fake_cuda_device_count():
            return orig(*args, **kwargs)

    async_loop._cpu_shim = True
    PersistentAsyncCaller.async_loop = staticmethod(async_loop)


def _patch_pretrain():
    """What ``megatron.training.pretrain()`` needs beyond what the hand-written loops need."""
    from megatron.training import training

    if getattr(training.initialize_megatron, '_cpu_shim', False):
        return
    orig_initialize = training.initialize_megatron

    # pretrain() calls initialize_megatron() without allow_no_cuda (-> "Megatron requires CUDA.") and
    # outside fake_cuda_device_count() (-> no model-parallel groups, no RNG tracker): supply both.
    def initialize_megatron(*args, **kwargs):
        kwargs['allow_no_cuda'] = True
        with fake_cuda_device_count():
            return orig_initialize(*args, **kwargs)

    initialize_megatron._cpu_shim = True
    training.initialize_megatron = initialize_megatron


def _patch_distopt_legacy_load():
    """Fix DistributedOptimizer legacy (``--ckpt-format torch``) load with torch Adam.

    Without TE/Apex (always the case on CPU) Megatron falls back to ``torch.optim.AdamW``,
    whose per-param state has a tensor ``'step'``. ``load_parameter_state_from_dp_zero``
    (distrib_optimizer.py:2356) -> ``_set_main_param_and_optimizer_states`` (:1193) then
    (a) does ``tensors['step']`` -> ``KeyError: 'step'`` (distrib_optim.pt only holds
    param/exp_avg/exp_avg_sq; 'step' is restored from the param_groups by load_state_dict,
    distrib_optimizer.py:1024-1032), and
    (b) with fp32 params the main param is a view of the model param (a leaf requiring
    grad) and ``copy_`` runs outside ``no_grad`` -> ``RuntimeError: a view of a leaf
    Variable that requires grad is being used in an in-place operation``.
    With ``--ckpt-format torch_dist`` (``dp_reshardable``) the tensors do hold a ``'step'``: the
    load request's own, a ``LocalNonpersistentObject`` (distrib_optimizer.py:1953) of the
    optimizer that built the request, so (c) the checkpoint's step, which ``load_state_dict``
    put into the state from the param groups, would be overwritten with a placeholder.
    Neither is CPU specific, but both are hit by every CPU run with the distributed optimizer.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    orig = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(orig, '_cpu_shim', False):
        return

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]['params'][group_order]
        state = self.optimizer.state.get(main_param, {})
        missing = {k: v for k, v in state.items() if torch.is_tensor(v) and k not in tensors}
        # 'step' is the state's own: load_state_dict set it from the checkpoint's param groups. (A
        # torch_dist load passes the 'step' of the optimizer it built its request from, a placeholder.)
        own_step = {'step': state['step']} if torch.is_tensor(state.get('step')) else {}
        with torch.no_grad():
            orig(self, model_param, {**missing, **tensors, **own_step})  # 'step' -> copy onto itself

    _set_main_param_and_optimizer_states._cpu_shim = True
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states

    # Without Apex/TE, DistributedOptimizer.load_state_dict (distrib_optimizer.py:1024-1032) gives every
    # parameter's state the *same* 'step' tensor; torch Adam increments it in place once per parameter,
    # so the first step after a load uses wrong bias corrections. Give each parameter its own copy.
    orig_load = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        orig_load(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get('step')):
                state['step'] = state['step'].clone()

    DistributedOptimizer.load_state_dict = load_state_dict


def _patch_distopt_fresh_load():
    """Let a ``torch_dist`` load build the sharded state of a DistributedOptimizer that never stepped.

    Without TE/Apex, ``DistributedOptimizer.state_dict()`` (distrib_optimizer.py:838) reads the torch-Adam
    ``'step'`` of every parameter's state and asserts there is exactly one value; a fresh optimizer has no
    state, so ``sharded_state_dict(is_loading=True)`` (:1532, called by ``load_checkpoint`` to build what to
    load) fails with a bare ``AssertionError``. Megatron's own ``_init_optimizer_states_with_dummy_values``
    (used for its FSDP path) gives the states placeholders that the load then overwrites.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    orig = DistributedOptimizer.sharded_state_dict
    if getattr(orig, '_cpu_shim', False):
        return

    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, *args, **kwargs):
        if is_loading and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return orig(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    sharded_state_dict._cpu_shim = True
    DistributedOptimizer.sharded_state_dict = sharded_state_dict


def apply():
    """Apply all shims (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    _patch_torch_cuda()
    _enable_device_remap()
    _patch_megatron()
    _APPLIED = True


@contextlib.contextmanager
def fake_cuda_device_count(n=1):
    """Make torch.cuda.device_count() return ``n`` inside the block (for initialize_megatron)."""
    orig = torch.cuda.device_count
    torch.cuda.device_count = lambda: n
    try:
        yield
    finally:
        torch.cuda.device_count = orig
