"""Greedy decode passes run back to back: multi-step decoding's lean path (MultiStepWorker).

What: a multi-step call's passes for a batch that needs only each row's argmax
(fast_paths.plain_argmax) on a single rank: no sampler, no SamplerOutput, no token ids back in
Python per pass. How: all passes' inputs (positions, KV slots, context lengths, block tables)
are built once; on the CPU, where the fused layers apply, the passes run in one C call
(fused.run_passes: cpu_kernels.greedy_passes), each argmax feeding the next; elsewhere a
Python loop of ModelRunner.forward_tokens and argmax. The tokens come back in one list.
What fails: the tokens equal the generic pass's (tests/worker/test_multi_step.py). An interrupt
ends the call after the pass under way (the C call reads StepInterrupts without the GIL), as
does every row having drawn a stop token; an error in any pass fails the whole call, which
the engine recomputes.
"""

from __future__ import annotations

import torch

from fleetllm.attention.backend import AttentionMetadata, DecodeBatch
from fleetllm.model import fused
from fleetllm.sequence import SequenceGroupMetadata
from fleetllm.worker import sampler
from fleetllm.worker.model_runner import ModelRunner
from fleetllm.worker.worker_base import StepInterrupts


def run(runner: ModelRunner, kv_caches: list[torch.Tensor], groups: list[SequenceGroupMetadata],
        passes: int, interrupts: StepInterrupts, interrupts_before: int,
        finished_ids: list[str] = ()) -> list[list[int]]:
    """Up to `passes` greedy passes over the groups' sequences (in their order; each group's
    block tables must hold the slots of all of them). Returns the tokens of each pass done:
    it stops early after a pass where the interrupts' count is no longer interrupts_before,
    and (the C call) after the pass in which the last row still going drew a stop token.
    finished_ids: the requests whose state the runner drops first, as its execute_model
    would."""
    runner.drop_requests(finished_ids)
    bs, dev = runner.block_size, runner.device
    # Two tensors a call (built from cold caches, each torch path costs tens of us): int64
    # ids, then each pass's positions and slots; int32 each pass's context lengths, then the
    # block tables and where each row's starts.
    ids: list[int] = []
    positions: list[list[int]] = [[] for _ in range(passes)]
    slots: list[list[int]] = [[] for _ in range(passes)]
    tables: list[int] = []
    table_start: list[int] = []
    stops: list[list[int]] = []  # each row's stop token ids (EOS unless ignored)
    for group in groups:
        stop_ids = group.sampling_params.min_tokens_stop_ids
        for seq_id, data in group.seq_data.items():
            stops.append(stop_ids)
            first = data.get_len() - 1  # the position of its last token, not in the cache yet
            table = group.block_tables[seq_id]
            ids.append(data.token_at(first))
            table_start.append(len(tables))
            tables += table[: (first + passes - 1 + bs) // bs]
            for i in range(passes):
                p = first + i
                positions[i].append(p)
                slots[i].append(table[p // bs] * bs + p % bs)
    rows = len(ids)
    longs = torch.tensor([ids, *positions, *slots], device=dev)
    ints = torch.tensor([c + 1 for pos in positions for c in pos] + tables + table_start,
                        dtype=torch.int32, device=dev)
    pos_t, slots_t = longs[1: 1 + passes], longs[1 + passes:]
    ctx_t = ints[: passes * rows].view(passes, rows)
    tables_t, start_t = ints[passes * rows: -rows], ints[-rows:]
    with torch._C._InferenceMode(True):
        if dev.type == "cpu":  # all passes in one C call, where it applies
            most = max(map(len, stops))
            stops_t = torch.tensor([s + [-1] * (most - len(s)) for s in stops],
                                   dtype=torch.long).view(rows, most)
            done = fused.run_passes(runner.model, longs[0], pos_t, slots_t, ctx_t, tables_t,
                                    start_t, kv_caches, stops_t,
                                    torch.frombuffer(interrupts.buffer(), dtype=torch.int64),
                                    interrupts_before)
            if done is not None:
                return done.tolist()
        x, out, logits_rows = longs[0], [], list(range(rows))
        for i in range(passes):
            meta = AttentionMetadata(slots_t[i], [], DecodeBatch(tables_t, start_t, ctx_t[i]))
            x = sampler.argmax(runner.forward_tokens(x, pos_t[i], meta, kv_caches, logits_rows))
            out.append(x)
            if interrupts.count != interrupts_before:
                break
    return torch.stack(out).tolist()
