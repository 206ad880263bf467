"""torchtitan 0.3.0's own trainer (`torchtitan.train.main`) on CPU with gloo, for tests.

    torchrun --nproc-per-node 2 tests/torchtitan03_cpu_train.py \\
        --module dtcp.integrations.torchtitan.configs --config llama3_debug_dtcp [torchtitan args]

torchtitan 0.3.0 does not train on a CPU-only machine as shipped: torchtitan.tools.utils picks
device_type "cuda" when no accelerator exists (so Trainer.__init__ calls torch.cuda.set_device
and init_distributed picks NCCL), the metrics' memory monitor calls CUDA-only device functions,
and FSDP's gradient reduction with gradient_divide_factor=1.0 uses ReduceOp.PREMUL_SUM, which
gloo lacks. This launcher points those at the CPU (a plain SUM times 1.0 is the same reduction)
and then runs the unmodified trainer. Test-only: none of it is part of dtcp's integration.
"""

import types

import torch

import torchtitan.components.metrics as metrics  # noqa: E402
import torchtitan.distributed.fsdp as tt_fsdp  # noqa: E402
import torchtitan.distributed.parallel_dims as parallel_dims  # noqa: E402
import torchtitan.distributed.utils as dist_utils  # noqa: E402
import torchtitan.tools.utils as tt_utils  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

cpu_module = types.SimpleNamespace(
    set_device=lambda device=None: None,
    device_count=lambda: 1,
    get_device_name=lambda device=None: "cpu",
    current_device=lambda: 0,
    get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=2**34),
    memory_stats=lambda device=None: {
        "active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0, "num_alloc_retries": 0, "num_ooms": 0,
    },
    reset_peak_memory_stats=lambda device=None: None,
    empty_cache=lambda: None,
    synchronize=lambda device=None: None,
    is_available=lambda: False,
)
tt_utils.device_type, tt_utils.device_module = "cpu", cpu_module
parallel_dims.device_type = "cpu"
metrics.device_type, metrics.device_module = "cpu", cpu_module
dist_utils.device_type, dist_utils.device_module = "cpu", cpu_module
if hasattr(dist_utils, "set_pg_timeouts"):
    dist_utils.set_pg_timeouts = lambda *args, **kwargs: None


def _sum_gradients(model):
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


tt_fsdp.disable_fsdp_gradient_division = _sum_gradients


def _print_loss(self, values, step):
    # The console line rounds the loss to 5 decimals; the tests compare the full float.
    if "loss_metrics/global_avg_loss" in values:
        print(f"DTCP_LOSS {step} {float(values['loss_metrics/global_avg_loss'])!r}", flush=True)


metrics.BaseLogger.log = _print_loss  # the metric logger when tensorboard and wandb are off (the default)

if __name__ == "__main__":
    import torchtitan.train

    torchtitan.train.main()
