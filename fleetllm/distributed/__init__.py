from fleetllm.distributed.parallel_state import (
    get_pp_group,
    get_tp_group,
    init_distributed,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

__all__ = ["get_pp_group", "get_tp_group", "init_distributed",
           "tensor_model_parallel_all_gather", "tensor_model_parallel_all_reduce"]
