from fleetllm.executor.abstract import Executor, ExecutorBase

__all__ = ["Executor", "ExecutorBase"]
