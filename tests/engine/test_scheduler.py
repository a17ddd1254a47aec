"""Scheduler policy without a model: budgets, chunking, FCFS admission and newest-first preemption."""

from __future__ import annotations

from pagedserve.server.core.kv_cache_manager import KVCacheManager
from pagedserve.server.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.server.outputs import RequestMetrics
from pagedserve.server.request import Request, RequestStatus
from pagedserve.server.sampling_params import SamplingParams

BLOCK = 4


def make_request(request_id: str, num_prompt: int, first_token: int = 0) -> Request:
    return Request(request_id=request_id,
                   prompt_token_ids=list(range(first_token, first_token + num_prompt)),
                   params=SamplingParams(), max_tokens=100, eos_token_ids=frozenset(),
                   metrics=RequestMetrics(0.0))


def advance(plan: SchedulerOutput) -> None:
    """What the engine does after a forward: progress, and a sampled token for completed sequences."""
    for item in plan.scheduled:
        completes = item.completes_sequence
        item.request.num_computed_tokens += item.num_new_tokens
        if completes:
            item.request.output_token_ids.append(7)


def test_chunks_prompts_and_puts_decodes_first() -> None:
    kv = KVCacheManager(64, BLOCK, enable_caching=False, hash_seed="m")
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = make_request("a", 6), make_request("b", 12, first_token=100)
    scheduler.add(a)
    scheduler.add(b)
    plan = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 6), ("b", 4)]
    assert plan.scheduled[0].completes_sequence and not plan.scheduled[1].completes_sequence
    advance(plan)
    plan = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 1), ("b", 8)]
    assert plan.num_batched_tokens == 9


def test_respects_max_num_seqs_and_fcfs() -> None:
    kv = KVCacheManager(64, BLOCK, enable_caching=False, hash_seed="m")
    scheduler = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=100)
    requests = [make_request(str(i), 3, first_token=10 * i) for i in range(4)]
    for r in requests:
        scheduler.add(r)
    plan = scheduler.schedule()
    assert [s.request.request_id for s in plan.scheduled] == ["0", "1"]
    assert list(scheduler.waiting) == requests[2:]


def test_preempts_newest_and_resumes_it_first() -> None:
    kv = KVCacheManager(5, BLOCK, enable_caching=False, hash_seed="m")  # 20 tokens of room
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    old, new = make_request("old", 8), make_request("new", 8, first_token=50)
    scheduler.add(old)
    scheduler.add(new)
    advance(scheduler.schedule())  # both prefilled: 2 + 2 blocks, 1 free
    for _ in range(4):  # old grows into the free block, then needs new's
        plan = scheduler.schedule()
        advance(plan)
        if plan.preempted:
            break
    assert plan.preempted == [new] and new.status is RequestStatus.PREEMPTED
    assert new.num_computed_tokens == 0 and new.output_token_ids  # outputs kept for recompute
    assert scheduler.waiting[0] is new and scheduler.num_preemptions == 1
    scheduler.finish(old, RequestStatus.FINISHED_LENGTH)
    plan = scheduler.schedule()
    assert plan.scheduled[0].request is new and plan.scheduled[0].num_new_tokens == new.num_tokens
    scheduler.finish(new, RequestStatus.FINISHED_ABORTED)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


class RefusingGrammar:
    """A grammar that refuses every token (a bug the mask should never let through)."""

    finished = False
    error = "refused"

    def accept(self, token_id: int) -> bool:
        return False


def test_update_from_output_appends_stops_and_fails_a_row_alone() -> None:
    """After a step: tokens appended through the stops, a finished request gone with its blocks, a row
    whose token the grammar refuses aborted alone, the token counters advanced."""
    from pagedserve.server.outputs import SampledToken

    kv = KVCacheManager(16, BLOCK, enable_caching=False, hash_seed="m")
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    short, long_, refused = make_request("short", 3), make_request("long", 5), make_request("refused", 2)
    short.max_tokens = 1
    refused.grammar = RefusingGrammar()  # type: ignore[assignment]
    for request in (short, long_, refused):
        scheduler.add(request)
    plan = scheduler.schedule()
    update = scheduler.update_from_output(plan, [(r, [SampledToken(9)]) for r in (short, long_, refused)])
    assert [(r.request_id, [t.token_id for t in tokens]) for r, tokens in update.appended] == [
        ("short", [9]), ("long", [9])]
    assert list(update.failed) == ["refused"] and "refused" in str(update.failed["refused"])
    assert short.status is RequestStatus.FINISHED_LENGTH and long_.status is RequestStatus.RUNNING
    assert refused.status is RequestStatus.FINISHED_ABORTED
    assert set(scheduler.requests) == {"long"} and scheduler.running == [long_]
    assert kv.pool.num_free_blocks == 16 - 2  # only "long"'s 5 + 1 tokens hold blocks
    assert (scheduler.prompt_tokens, scheduler.generation_tokens) == (8, 2)
