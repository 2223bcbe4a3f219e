"""Continuous batching: requests that join and leave a running batch decode exactly what they decode alone."""

import random
from dataclasses import replace

import pytest
import torch

from ppd import DecodeConfig, Decoder
from ppd.decoding import graphs
from ppd.policy import BatchPolicy
from ppd.serving import BatcherConfig, ContinuousBatcher, QueueFullError
from tests.conftest import random_prompt_tokens, random_tree_set, tiny_model


@pytest.fixture(scope="module")
def decoder():
    model = tiny_model(seed=3)
    return Decoder(model, random_prompt_tokens(model, 3, 1, seed=3), random_tree_set(seed=7, size=12),
                   eos_token_ids=[5])


def requests(seed: int, count: int):
    rng = random.Random(seed)
    return [([rng.randrange(24) for _ in range(rng.randint(1, 15))], rng.randint(1, 40)) for _ in range(count)]


def chunks_of(stream):
    return [(chunk.tokens, chunk.finish_reason) for chunk in stream]


def decode_a_mix_with_a_cancel(batcher, alone_decoder, seed: int) -> None:
    """Through ``batcher``: a long request, cancelled after its first chunk, and 14 greedy and seeded sampled requests,
    PPD and the baseline, which must decode what they decode alone on ``alone_decoder``."""
    reqs = requests(seed, 14)
    configs = [DecodeConfig(method="baseline" if i % 5 == 2 else "ppd", max_new_tokens=n, seed=i,
                            temperature=0.8 if i % 3 == 0 else 0.0) for i, (_, n) in enumerate(reqs)]
    with batcher:
        doomed = batcher.submit(reqs[0][0], DecodeConfig(max_new_tokens=200, stop_on_eos=False))
        streams = [batcher.submit(ids, config) for (ids, _), config in zip(reqs, configs)]
        next(iter(doomed))
        doomed.cancel()
        results = [s.result(timeout=120) for s in streams]
        assert doomed.result(timeout=120).finish_reason == "cancelled"
        assert batcher.running == 0 and batcher.waiting == 0
    for (ids, _), config, result in zip(reqs, configs, results):
        alone = alone_decoder.generate(ids, config)
        assert (result.token_ids, result.finish_reason) == (alone.token_ids, alone.finish_reason)


@pytest.mark.parametrize("method", ["ppd", "baseline"])
def test_requests_joining_and_leaving_decode_what_they_decode_alone(decoder, method):
    reqs = requests(1, 9)
    with ContinuousBatcher(decoder, BatcherConfig(max_batch=3)) as batcher:  # 9 requests through 3 rows
        streams = [batcher.submit(ids, DecodeConfig(method=method, max_new_tokens=n)) for ids, n in reqs]
        results = [s.result(timeout=120) for s in streams]
        assert batcher.running == 0 and batcher.waiting == 0
    for (ids, n), result in zip(reqs, results):
        alone = decoder.generate(ids, DecodeConfig(method=method, max_new_tokens=n))
        assert result.token_ids == alone.token_ids
        assert result.finish_reason == alone.finish_reason
        if method == "ppd":
            assert result.steps == alone.steps  # each step verifies the same tree as alone
    assert any(r.accept_length > 1 for r in results)


def test_requests_prefilled_in_the_staging_row_decode_what_they_decode_alone():
    """Where prefills replay CUDA graphs (here their padded buffers, run without capture on the CPU), a joining
    request is prefilled alone into a one-row staging state and its row copied into the batch: requests joining
    and leaving, greedy and seeded sampled, PPD and the baseline, decode what they decode alone on a decoder that
    prefills them exactly; every admission went through the staging rows' buffers (one row, a width bucket)."""
    from ppd.decoding.prefill_graphs import PrefillGraphs

    model = tiny_model(seed=3)
    tokens, trees = random_prompt_tokens(model, 3, 1, seed=3), random_tree_set(seed=7, size=12)
    staged, exact = (Decoder(model, tokens, trees, eos_token_ids=[5]) for _ in range(2))
    reqs = requests(5, 10) + [([7] * 70, 12)]  # (a prompt past the first width bucket)
    configs = [DecodeConfig(method="baseline" if i % 4 == 1 else "ppd", max_new_tokens=n, seed=i,
                            temperature=0.9 if i % 3 == 0 else 0.0) for i, (_, n) in enumerate(reqs)]
    graphs = PrefillGraphs(capture=False)
    batcher = ContinuousBatcher(staged, BatcherConfig(max_batch=3))
    batcher._runner.prefill_graphs = graphs  # as a captured runner on a GPU has them
    with batcher:
        streams = [batcher.submit(ids, config) for (ids, _), config in zip(reqs, configs)]
        results = [s.result(timeout=120) for s in streams]
    for (ids, _), config, result in zip(reqs, configs, results):
        alone = exact.generate(ids, config)
        assert (result.token_ids, result.finish_reason) == (alone.token_ids, alone.finish_reason)
    lanes = list(batcher._lanes.values())
    assert len(lanes) == 2 and all(len(lane.staging) == 1 for lane in lanes)
    assert {key[0] for key in graphs._graphs} == {id(lane.staging[0]) for lane in lanes}
    assert {key[1:3] for key in graphs._graphs} == {(1, 64), (1, 128)}


@pytest.mark.parametrize("admissions", ["after_step", "before_step"])
def test_requests_join_through_the_staging_row_while_the_batch_runs_ahead(monkeypatch, admissions):
    """On a GPU a joining request's prefill runs in the staging row beside the running rows' steps, and its row is
    copied into the batch only once that prefill has run. Here (run ahead forced, the staging row's padded prefill
    run without capture) a prefill reads as not run yet two times in three: rows are stepped, finish, are cancelled
    and move while a request waits in the staging row, and every request still decodes what it decodes alone."""
    from ppd.decoding.prefill_graphs import PrefillGraphs
    from ppd.serving import batcher as batching

    monkeypatch.setenv("PPD_RUN_AHEAD", "1")
    polls = iter(range(10**6))
    monkeypatch.setattr(batching.Download, "ready", lambda self: next(polls) % 3 == 2)
    pending_at_read = []
    read_step = batching._Lane._read_step

    def recorded(lane):
        pending_at_read.append(bool(lane.flights))
        read_step(lane)

    monkeypatch.setattr(batching._Lane, "_read_step", recorded)
    model = tiny_model(seed=3)
    tokens, trees = random_prompt_tokens(model, 3, 1, seed=3), random_tree_set(seed=7, size=12)
    staged, exact = (Decoder(model, tokens, trees, eos_token_ids=[5]) for _ in range(2))
    batcher = ContinuousBatcher(staged, BatcherConfig(max_batch=4, admissions=admissions))
    batcher._runner.prefill_graphs = PrefillGraphs(capture=False)
    decode_a_mix_with_a_cancel(batcher, exact, seed=6)
    assert all(lane.staging is not None for lane in batcher._lanes.values())
    assert sum(pending_at_read) >= 5  # steps ran while a request was being prefilled
    # Every request joined through the staging row; prefills read as not run yet kept some in flight for steps.
    stats = batcher.admission_steps
    assert stats.admissions == 15 and stats.in_flight >= 1 and stats.waiting >= 1


def through_a_staging_row(monkeypatch, switch: str, value: str, reqs, config: DecodeConfig, max_batch: int):
    """Decode ``reqs`` (prompt, max_new_tokens) through a batcher whose admissions go through a staging row as on a
    GPU (run ahead forced; prefills through uncaptured graphs, each run when it returns), with the environment's
    ``switch`` (which the batcher's config reads for its default) set to ``value``: the answers and the batcher."""
    from ppd.decoding.prefill_graphs import PrefillGraphs

    monkeypatch.setenv("PPD_RUN_AHEAD", "1")
    monkeypatch.setenv(switch, value)
    model = tiny_model(seed=3)
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=3), random_tree_set(seed=7, size=12),
                      eos_token_ids=[5])
    batcher = ContinuousBatcher(decoder, BatcherConfig(max_batch=max_batch))
    batcher._runner.prefill_graphs = PrefillGraphs(capture=False)
    with batcher:
        streams = [batcher.submit(ids, replace(config, max_new_tokens=n)) for ids, n in reqs]
        return [s.result(timeout=120).token_ids for s in streams], batcher


def test_admitting_before_the_step_joins_each_request_a_step_sooner(monkeypatch):
    """With every prefill read as run at once, a request taken from the queue is prefilled and joins after its
    lane's next step is queued when admissions follow the step, and before it when they come first: one step
    sooner; the tokens are the same."""
    reqs = requests(4, 10)
    answers, steps = {}, {}
    for admissions in ("after_step", "before_step"):
        answers[admissions], batcher = through_a_staging_row(monkeypatch, "PPD_ADMISSIONS", admissions, reqs,
                                                             DecodeConfig(), max_batch=3)
        assert batcher.config.admissions == admissions
        stats = batcher.admission_steps
        assert stats.admissions == len(reqs)
        steps[admissions] = (stats.waiting + stats.in_flight) / stats.admissions
    assert answers["before_step"] == answers["after_step"]
    assert steps["before_step"] < steps["after_step"]
    monkeypatch.setenv("PPD_ADMISSIONS", "sometimes")
    with pytest.raises(ValueError, match="PPD_ADMISSIONS must be after_step or before_step"):
        BatcherConfig()


def test_a_backlog_waited_for_joins_while_fewer_rows_run_than_requests_join(monkeypatch):
    """With ``backlog="waited"`` the batcher waits for a joining request's prefill while its lane runs fewer rows than
    requests are joining; past that it joins prefills a later step finds done. Here no prefill is ever found done
    (``Download.ready`` is False), so with ``beside`` a request joins only once every row has stopped, and with
    ``waited`` half a burst of six joins at once: fewer steps, the same tokens."""
    from ppd.downloads import Download

    monkeypatch.setattr(Download, "ready", lambda self: False)
    reqs = [(ids, 12) for ids, _ in requests(6, 6)]
    answers, steps = {}, {}
    for backlog in ("beside", "waited"):
        answers[backlog], batcher = through_a_staging_row(
            monkeypatch, "PPD_BACKLOG", backlog, reqs, DecodeConfig(method="baseline", stop_on_eos=False), max_batch=6)
        assert batcher.config.backlog == backlog
        steps[backlog] = batcher.batch_steps
    assert answers["waited"] == answers["beside"]
    assert all(len(a) == 12 for a in answers["waited"])
    # beside: six requests one after another, 11 steps each (and a step queued past each one's end); waited: the
    # first three join at once (1 < 5, 2 < 4 rows running), the others once those three have stopped
    assert steps["beside"] >= 6 * 11 and steps["waited"] <= 3 * 13
    monkeypatch.setenv("PPD_BACKLOG", "sometimes")
    with pytest.raises(ValueError, match="PPD_BACKLOG must be beside or waited"):
        BatcherConfig()


def test_more_staging_rows_keep_more_prefills_under_way_for_the_same_tokens(monkeypatch):
    """With ``staging_rows`` N a lane starts up to N joining requests' prefills at once, one staging row each, and
    joins them in the order they started. Here a prefill reads as run one poll in three: with three staging rows
    requests wait fewer steps for a free one and more are under way at once than with one; the tokens are those
    of one staging row (every request's as alone), and every staging row is free at the end."""
    from ppd.downloads import Download
    from ppd.serving import batcher as batching

    polls = iter(range(10**6))
    monkeypatch.setattr(Download, "ready", lambda self: next(polls) % 3 == 2)
    launch, most = batching._Lane._launch, []

    def counted(lane, pending, slot):
        assert slot in range(len(lane.staging)) and all(f.slot != slot for f in lane.flights)
        most.append(len(lane.flights) + 1)
        return launch(lane, pending, slot)

    monkeypatch.setattr(batching._Lane, "_launch", counted)
    reqs = requests(8, 12)
    answers, waiting, under_way = {}, {}, {}
    for rows in (1, 3):
        most.clear()
        answers[rows], batcher = through_a_staging_row(monkeypatch, "PPD_STAGING_ROWS", str(rows), reqs,
                                                       DecodeConfig(), max_batch=4)
        lane, = batcher._lanes.values()
        assert batcher.config.staging_rows == rows and len(lane.staging) == rows
        assert lane.free_staging_row() == 0 and not lane.flights
        stats = batcher.admission_steps
        assert stats.admissions == len(reqs)
        waiting[rows], under_way[rows] = stats.waiting / stats.admissions, max(most)
    assert answers[3] == answers[1] == [batcher.decoder.generate(ids, DecodeConfig(max_new_tokens=n)).token_ids
                                        for ids, n in reqs]
    assert under_way[1] == 1 and under_way[3] == 3
    assert waiting[3] < waiting[1]
    monkeypatch.setenv("PPD_STAGING_ROWS", "0")
    with pytest.raises(ValueError, match="PPD_STAGING_ROWS must be a whole number of at least 1, got '0'"):
        BatcherConfig()
    monkeypatch.delenv("PPD_STAGING_ROWS")
    with pytest.raises(ValueError, match="staging_rows must be >= 1"):
        BatcherConfig(staging_rows=0)


def test_prefilling_ahead_fills_freed_rows_sooner_for_the_same_tokens(monkeypatch):
    """With ``prefill_ahead`` a lane takes joining requests from the queue while every row runs, one per staging
    row, and prefills them there, so that each joins as soon as a row frees. Here (two staging rows, three rows, a
    prefill read as run once two of the lane's steps have been queued after it, as a GPU would run it beside them)
    prefills start while all three rows run, the batch runs fuller (fewer steps for the same requests), no more than
    three rows ever run, and every request decodes what it does alone."""
    from ppd.downloads import Download
    from ppd.serving import batcher as batching

    clock, made = [0], Download.__init__

    def stamped(self, tensor):
        made(self, tensor)
        self.queued_at = clock[0]

    monkeypatch.setattr(Download, "__init__", stamped)
    monkeypatch.setattr(Download, "ready", lambda self: clock[0] - self.queued_at >= 2)
    launch, full, most = batching._Lane._launch, [], []

    def counted(lane, pending, slot):
        full.append(len(lane.rows) == lane.batcher.config.max_batch)
        return launch(lane, pending, slot)

    step = batching._Lane.step

    def watched(lane):
        most.append(len(lane.rows))
        clock[0] += 1
        step(lane)

    monkeypatch.setattr(batching._Lane, "_launch", counted)
    monkeypatch.setattr(batching._Lane, "step", watched)
    monkeypatch.setenv("PPD_STAGING_ROWS", "2")
    reqs = [(ids, 6 + n % 9) for ids, n in requests(9, 12)]
    answers, steps, ahead = {}, {}, {}
    for value in ("0", "1"):
        full.clear()
        answers[value], batcher = through_a_staging_row(monkeypatch, "PPD_PREFILL_AHEAD", value, reqs,
                                                        DecodeConfig(stop_on_eos=False), max_batch=3)
        assert batcher.config.prefill_ahead == (value == "1")
        lane, = batcher._lanes.values()
        assert lane.holds == 3 + 2 * (value == "1") and not lane.flights and lane.free_staging_row() == 0
        steps[value], ahead[value] = batcher.batch_steps, any(full)
    assert answers["1"] == answers["0"] == [batcher.decoder.generate(ids, DecodeConfig(
        max_new_tokens=n, stop_on_eos=False)).token_ids for ids, n in reqs]
    assert ahead == {"0": False, "1": True} and max(most) == 3
    assert steps["1"] < steps["0"]
    monkeypatch.setenv("PPD_PREFILL_AHEAD", "yes")
    with pytest.raises(ValueError, match="PPD_PREFILL_AHEAD must be 0 or 1"):
        BatcherConfig()


def test_a_request_cancelled_while_prefilled_ahead_frees_its_staging_row_at_once(monkeypatch):
    """A request cancelled while its prefill waits for a row of the batch (prefilled ahead, every row running) ends
    there, once its prefill has run, instead of holding its staging row until a row frees and joining only to be
    dropped: it never joins, and the requests around it decode what they do alone."""
    from ppd.serving import batcher as batching

    launch, full = batching._Lane._launch, []

    def cancelling(lane, pending, slot):
        flight = launch(lane, pending, slot)
        if pending.ids == doomed_ids:
            full.append(len(lane.rows) == lane.batcher.config.max_batch)
            pending.stream.cancel()  # after its prefill was queued, as a client going away then would
        return flight

    monkeypatch.setattr(batching._Lane, "_launch", cancelling)
    monkeypatch.setenv("PPD_STAGING_ROWS", "2")
    # Two rows, two staging rows: the first two requests join, the third waits prefilled in a staging row, and
    # the fourth, prefilled in the other while both rows run, is cancelled.
    reqs = [(ids, 40) for ids, _ in requests(11, 3)]
    doomed_ids = list(range(3, 12))
    reqs += [(doomed_ids, 40), ([7, 8, 9, 10], 5)]
    answers, batcher = through_a_staging_row(monkeypatch, "PPD_PREFILL_AHEAD", "1", reqs,
                                             DecodeConfig(stop_on_eos=False), max_batch=2)
    lane, = batcher._lanes.values()
    assert full == [True]  # it was prefilled ahead, while both rows ran
    assert answers[3] == []  # cancelled with no token: it never joined
    assert batcher.admission_steps.admissions == len(reqs) - 1
    assert not lane.flights and lane.free_staging_row() == 0
    kept = [r for i, r in enumerate(reqs) if i != 3]
    assert [a for i, a in enumerate(answers) if i != 3] == [batcher.decoder.generate(ids, DecodeConfig(
        max_new_tokens=n, stop_on_eos=False)).token_ids for ids, n in kept]


def test_the_side_streams_priority_comes_from_the_environment_and_a_wrong_one_is_refused(monkeypatch):
    assert BatcherConfig().prefill_priority == "normal"
    monkeypatch.setenv("PPD_PREFILL_PRIORITY", "high")
    assert BatcherConfig().prefill_priority == "high"
    monkeypatch.setenv("PPD_PREFILL_PRIORITY", "urgent")
    with pytest.raises(ValueError, match="PPD_PREFILL_PRIORITY must be normal or high"):
        BatcherConfig()
    monkeypatch.delenv("PPD_PREFILL_PRIORITY")
    with pytest.raises(ValueError, match="prefill_priority must be one of normal, high"):
        BatcherConfig(prefill_priority="low")


def test_a_whole_row_copy_grouped_by_dtype_leaves_what_the_sliced_copy_leaves(decoder, monkeypatch):
    """A GPU copies a row (a joining request's from the staging state, or a row moved into a freed one) whole, in
    one foreach copy per dtype, from views made once per row. Here (the same code on the CPU) it leaves every
    per-row buffer and every layer's first ``length`` slots as the row-by-row copy of those slots does, into a
    state of several rows and within it, and the views follow the cache when it grows."""
    from ppd.decoding.loop import prefill, reset_rows
    from ppd.decoding.step import StepKind

    def filled(rows: int, prompts):
        state = decoder._new_state(rows)
        reset_rows(decoder, state, [len(p) for p in prompts], DecodeConfig(max_new_tokens=9, seed=4))
        prefill(decoder, prompts, state, True, StepKind(tree=False))
        return state

    prompts = [[3, 9, 4, 1, 7], [8, 2, 6]]
    source = filled(2, prompts)
    sliced, whole = filled(3, [[5] * 4] * 3), filled(3, [[5] * 4] * 3)
    sliced.copy_row_from(source, 1, 2, 3)
    sliced.move_row(2, 0, 3)
    monkeypatch.setattr(whole, "device", torch.device("cuda"))  # the GPU's path (its tensors stay on the CPU)
    copies = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda into, out_of: (copies.append(len(into)), real(into, out_of)))
    whole.copy_row_from(source, 1, 2, 3)
    whole.move_row(2, 0, 3)
    assert copies and sum(copies) == 2 * (len(whole.row_names()) + len(whole.kv.buffers()))
    for name in whole.row_names():
        assert torch.equal(getattr(whole, name), getattr(sliced, name)), name
    for a, b in zip(whole.kv.buffers(), sliced.kv.buffers()):
        assert torch.equal(a[[0, 2], :, :3], b[[0, 2], :, :3]) and torch.equal(a[1], b[1])
    whole.kv.reserve(whole.capacity)  # the cache grows: new buffers, new views
    views, layers = whole._row_views(2), whole.kv.buffers()
    assert all(v.data_ptr() == b[2].data_ptr() and v.shape == b[2].shape for v, b in zip(views[-len(layers):], layers))


def test_greedy_and_seeded_sampled_requests_share_a_batch(decoder):
    reqs = requests(2, 6)
    configs = [DecodeConfig(max_new_tokens=n, temperature=0.0 if i % 2 else 0.9, top_p=1.0 if i % 3 else 0.8,
                            seed=i) for i, (_, n) in enumerate(reqs)]
    with ContinuousBatcher(decoder, BatcherConfig(max_batch=4)) as batcher:
        streams = [batcher.submit(ids, c) for (ids, _), c in zip(reqs, configs)]
        results = [s.result(timeout=120) for s in streams]
    for (ids, _), config, result in zip(reqs, configs, results):
        assert result.token_ids == decoder.generate(ids, config).token_ids


def test_streamed_chunks_rebuild_the_answer_and_a_cancelled_request_frees_its_row(decoder):
    reqs = requests(3, 4)
    long_prompt = reqs[0][0]
    with ContinuousBatcher(decoder, BatcherConfig(max_batch=4)) as batcher:
        doomed = batcher.submit(long_prompt, DecodeConfig(max_new_tokens=200, stop_on_eos=False))
        others = [batcher.submit(ids, DecodeConfig(max_new_tokens=n)) for ids, n in reqs[1:]]
        first = next(iter(doomed))
        doomed.cancel()
        rest = chunks_of(doomed)
        assert rest[-1][1] == "cancelled"
        assert doomed.completion.new_tokens < 200 and len(first.tokens) >= 1
        for (ids, n), stream in zip(reqs[1:], others):
            got = chunks_of(stream)
            tokens = [t for chunk, _ in got for t in chunk]
            assert tokens == decoder.generate(ids, DecodeConfig(max_new_tokens=n)).token_ids
            assert got[-1][1] in ("eos", "length")
        assert batcher.running == 0


def test_a_batcher_that_runs_ahead_decodes_what_requests_decode_alone(decoder, monkeypatch):
    """Run ahead (the GPU's default; forced here on the CPU): each step is queued before the last one's report is
    read, while rows finish, are cancelled, move into freed rows and new requests join; greedy and seeded sampled
    requests, PPD and the baseline, still decode exactly what they decode alone."""
    from ppd.serving import batcher as batching

    monkeypatch.setenv("PPD_RUN_AHEAD", "1")
    depths = []
    read_step = batching._Lane._read_step

    def recorded(lane):
        depths.append(len(lane.queued))
        read_step(lane)

    monkeypatch.setattr(batching._Lane, "_read_step", recorded)
    decode_a_mix_with_a_cancel(ContinuousBatcher(decoder, BatcherConfig(max_batch=4)), decoder, seed=4)
    assert max(depths) == 2  # a step was queued while the one before it had not been read


def test_a_compiled_step_over_the_first_rows_of_the_batch_reads_only_their_cache(monkeypatch):
    """A continuous batch steps the first rows of a state of ``max_batch`` rows. The compiled step gets the
    cache slices of those rows as its inputs: had it taken them from the whole state's buffers itself, Inductor
    would copy each layer's slice out and back every step (1.1 ms a step on an H200 at 64 rows)."""
    torch._dynamo.reset()
    inputs = []

    def record(gm, example_inputs):
        inputs.extend(x for x in example_inputs if isinstance(x, torch.Tensor))
        return gm.forward

    monkeypatch.setitem(graphs._COMPILED, None, torch.compile(graphs.decode_step, backend=record, fullgraph=True))
    model = tiny_model(seed=3)
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=3), random_tree_set(seed=7, size=12),
                      max_seq_len=120, packed_weights=False)
    ids = [3, 9, 4, 12, 7, 7, 1]
    with ContinuousBatcher(decoder, BatcherConfig(max_batch=8, capture="compile")) as batcher:
        results = {m: batcher.submit(ids, DecodeConfig(method=m, max_new_tokens=20, stop_on_eos=False)).result(60)
                   for m in ("ppd", "baseline")}
    caches = [x for x in inputs if x.dim() == 4]
    assert caches and all(x.shape[0] == 1 for x in caches), sorted({tuple(x.shape) for x in caches})
    for method, result in results.items():
        alone = decoder.generate(ids, DecodeConfig(method=method, max_new_tokens=20, stop_on_eos=False,
                                                   capture="eager"))
        assert result.token_ids == alone.token_ids
    torch._dynamo.reset()


def test_a_full_queue_refuses_more_requests():
    model = tiny_model(seed=3)
    decoder = Decoder(model)
    batcher = ContinuousBatcher(decoder, BatcherConfig(max_batch=1, max_queue=2))  # not started: nothing leaves
    config = DecodeConfig(method="baseline", max_new_tokens=4)
    batcher.submit([1, 2], config)
    batcher.submit([3], config)
    with pytest.raises(QueueFullError, match="max_queue 2"):
        batcher.submit([4], config)
    with pytest.raises(ValueError, match="at least one token"):
        batcher.submit([], config)
    with pytest.raises(ValueError, match="needs prompt tokens"):
        batcher.submit([1], DecodeConfig(method="ppd"))
    batcher.start()
    batcher.close()


def test_the_batch_policy_switches_trees_as_the_batch_crosses_a_bucket(monkeypatch):
    model = tiny_model(seed=3)
    big, small = random_tree_set(seed=7, size=12), random_tree_set(seed=8, size=3)
    policy = BatchPolicy((1, 2, 8), (big, None, small))
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=3), policy=policy)
    assert decoder.tables_for(1) is decoder.tables
    assert decoder.tables_for(2) is None
    assert decoder.tables_for(3) is decoder.tables_for(64) is not decoder.tables
    assert decoder.tables_for(3).num_rows < decoder.tables.num_rows
    # Two rows run the one-row step (one token a step); alone, the survivor goes back to the tree.
    prompt = [1, 2, 3, 4]
    alone = decoder.generate(prompt, DecodeConfig(max_new_tokens=60, stop_on_eos=False))
    assert max(alone.step_tokens) > 1
    assert all(t == 1 for t in decoder.generate([prompt, prompt], DecodeConfig(
        max_new_tokens=60, stop_on_eos=False))[0].step_tokens)
    # Without a tree PPD's prefill leaves the prompt tokens out as well: the baseline's forwards, the same tokens.
    from ppd.decoding import loop

    seen = []
    real = loop.prefill

    def prefill(decoder, batch, state, use_ppd, *args, **kwargs):
        seen.append(use_ppd)
        return real(decoder, batch, state, use_ppd, *args, **kwargs)

    monkeypatch.setattr(loop, "prefill", prefill)
    pair = [[5, 1, 7], [2, 9, 9, 4, 1]]
    ppd, baseline = (decoder.generate(pair, DecodeConfig(method=m, max_new_tokens=20, stop_on_eos=False))
                     for m in ("ppd", "baseline"))
    assert [o.token_ids for o in ppd] == [o.token_ids for o in baseline]
    decoder.generate(prompt, DecodeConfig(max_new_tokens=5))
    assert seen == [False, False, True]
    monkeypatch.undo()
    with ContinuousBatcher(decoder, BatcherConfig(max_batch=4)) as batcher:
        short = batcher.submit([7, 8], DecodeConfig(max_new_tokens=10, stop_on_eos=False))
        long = batcher.submit(prompt, DecodeConfig(max_new_tokens=60, stop_on_eos=False))
        assert short.result(timeout=60).new_tokens == 10
        result = long.result(timeout=60)
    assert result.token_ids == alone.token_ids
    # While the short request ran, the long one took one token a step; after it left, the tree came back.
    assert result.step_tokens[:8] == [1] * 8
    assert max(result.step_tokens[10:]) > 1


def test_policy_round_trips_through_json(tmp_path):
    policy = BatchPolicy((1, 16, 128), (random_tree_set(seed=1), random_tree_set(seed=2, size=4), None),
                         {"device": "cpu"}, static_trees={16: None, 128: random_tree_set(seed=3, size=2)})
    policy.save(tmp_path / "policy_cpu_float32.json")
    loaded = BatchPolicy.load(BatchPolicy.adapter_file(tmp_path, "cpu", "float32"))
    assert loaded == policy
    assert loaded.for_batch(9) is not None and loaded.for_batch(9, static=True) is None
    assert loaded.for_batch(1, static=True) == loaded.for_batch(1) == policy.trees[0]
    assert loaded.for_batch(500) is None and loaded.for_batch(500, static=True) == policy.static_trees[128]
    assert "(static batches: -)" in loaded.describe()
    # a policy without static tree sets writes none, and reads back the same
    plain = BatchPolicy((1, 8), (random_tree_set(seed=1), None))
    assert all("static_trees" not in e for e in plain.to_json()["buckets"])
    assert BatchPolicy.from_json(plain.to_json()) == plain
    with pytest.raises(ValueError, match="increasing"):
        BatchPolicy((4, 2), (None, None))
    with pytest.raises(ValueError, match=r"buckets \[4\]"):
        BatchPolicy((1, 8), (None, None), static_trees={4: None})


def test_static_batches_follow_the_policys_static_tree_sets(monkeypatch):
    """A bucket whose static batches run the one-row step: ``generate`` over a list of prompts there runs the
    baseline's forwards (its prefill without the prompt tokens, one token a step, the same tokens), while the
    serving engine's batcher, continuously refilled, keeps the bucket's tree and still decodes what each request
    decodes alone. A static tree set replaced by the policy's ``each`` stays a static one."""
    from ppd.decoding import loop

    model = tiny_model(seed=3)
    trees = random_tree_set(seed=7, size=12)
    policy = BatchPolicy((1, 4), (trees, trees), static_trees={4: None})
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=3), policy=policy)
    assert decoder.tables_for(3) is decoder.tables_for(3, static=False) is decoder.tables
    assert decoder.tables_for(3, static=True) is None and decoder.tables_for(1, static=True) is decoder.tables
    assert decoder.tables_for_batch(3, "eager") is None
    assert decoder.tables_for_batch(3, "eager", static=False) is decoder.tables
    edited = policy.each(lambda t: t.with_lookup(4))
    assert edited.static_trees == {4: None} and edited.trees[0].lookup == 4

    seen = []
    real = loop.prefill

    def prefill(decoder, batch, state, use_ppd, *args, **kwargs):
        seen.append((len(batch), use_ppd))
        return real(decoder, batch, state, use_ppd, *args, **kwargs)

    monkeypatch.setattr(loop, "prefill", prefill)
    prompts = [[1, 2, 3, 4], [5, 1, 7], [2, 9, 9, 4, 1]]
    config = DecodeConfig(max_new_tokens=40, stop_on_eos=False)
    static = decoder.generate(prompts, config)
    baseline = decoder.generate(prompts, DecodeConfig(method="baseline", max_new_tokens=40, stop_on_eos=False))
    assert [o.token_ids for o in static] == [o.token_ids for o in baseline]
    assert all(t == 1 for o in static for t in o.step_tokens)
    assert seen[0] == (3, False)  # PPD's static batch prefilled as the baseline's does
    monkeypatch.undo()
    alone = [decoder.generate(p, config) for p in prompts]
    assert any(max(o.step_tokens) > 1 for o in alone)  # batch 1 runs the tree
    with ContinuousBatcher(decoder, BatcherConfig(max_batch=4)) as batcher:
        streams = [batcher.submit(p, config) for p in prompts]
        results = [s.result(timeout=60) for s in streams]
    assert [r.token_ids for r in results] == [o.token_ids for o in alone]
    # three rows at once (bucket 4) took tree steps: more than a token in some step
    assert any(max(r.step_tokens) > 1 for r in results)
    assert sum(r.steps for r in results) < sum(o.steps for o in static)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", ["graph", "compiled_graph"])
def test_captured_continuous_batch_equals_alone_on_the_gpu(mode):
    """Rows joining and leaving captured buckets (views of one state) decode what they decode alone, and
    a batch policy's switch between trees and the one-row step holds under capture. (Sampled rows share the
    batch; with typical acceptance their text depends on the tree, which the policy changes with the batch,
    so only the greedy rows are compared.)"""
    model = tiny_model(seed=3).cuda()
    policy = BatchPolicy((1, 2, 8), (random_tree_set(seed=7, size=12), None, random_tree_set(seed=8, size=3)))
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=3), policy=policy, eos_token_ids=[5],
                      max_seq_len=300)
    reqs = requests(4, 12)
    configs = [DecodeConfig(max_new_tokens=n, temperature=0.0 if i % 3 else 0.8, seed=i, capture=mode)
               for i, (_, n) in enumerate(reqs)]
    with ContinuousBatcher(decoder, BatcherConfig(max_batch=5, capture=mode)) as batcher:
        batcher.warmup()
        streams = [batcher.submit(ids, c) for (ids, _), c in zip(reqs, configs)]
        results = [s.result(timeout=300) for s in streams]
    for (ids, n), config, result in zip(reqs, configs, results):
        if config.greedy:
            assert result.token_ids == decoder.generate(ids, config).token_ids
        else:
            assert 1 <= result.new_tokens <= n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("beside, staging_rows", [(True, 1), (False, 1), (True, 4), (False, 4)])
def test_a_joining_requests_prefill_never_waits_for_the_device_on_the_gpu(monkeypatch, beside, staging_rows):
    """The staging rows' prefills are queued on the side stream while the running rows step (or, with
    ``prefill_beside`` off, on their stream between two steps): reset, uploads, the graph's replay, the first token
    and guesses, the prompt's lookup history, the report's download. Had any of it
    waited for the device (a copy from ordinary host memory, a read back), the batcher's thread would stall the
    running rows for the whole prefill; torch's sync debug mode, set to raise, finds any such wait. Requests joining
    a running batch (a lookup chain in the trees, so the history is written) still decode what they do alone, with
    one staging row and with four (several prefills under way beside the steps: h100/v34 found a request decoding
    wrongly there, beside, when the prefill graphs still shared the steps' capture stream, and so their cuBLAS
    workspace; now no two of ppd's streams are one, ``decoding.streams``)."""
    from ppd.serving import batcher as batching

    launch = batching._Lane._launch
    launches = []

    def checked(lane, pending, slot):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(lane, pending, slot)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            launches.append(bool(lane.rows))

    monkeypatch.setattr(batching._Lane, "_launch", checked)
    model = tiny_model(seed=3).cuda()
    chained = replace(random_tree_set(seed=7, size=12), lookup=4)
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=3), chained, eos_token_ids=[5], max_seq_len=300)
    reqs = requests(7, 10)
    config = BatcherConfig(max_batch=4, capture="graph", prefill_beside=beside, staging_rows=staging_rows)
    with ContinuousBatcher(decoder, config) as batcher:
        lane = batcher._lane(batching.DecodeMethod.PPD)
        assert (lane.side is not None) == beside
        batcher.warmup()
        # The staging graphs are made for the stream that replays them: captured on the side stream itself, or
        # without it on a stream of their own, never on the steps' capture stream (whose cuBLAS workspace they would
        # share while they run beside the steps). Each lane (ppd's, the baseline's) has a side stream of its own.
        replayers = batcher._runner.prefill_graphs._replayers
        replaying = lane.side if beside else torch.cuda.current_stream()
        sides = {other.side.cuda_stream for other in batcher._lanes.values()} if beside else {replaying.cuda_stream}
        assert set(replayers) == sides
        captures = [found.capture.cuda_stream for found in replayers.values()]
        assert len(set(captures)) == len(captures)
        capture = replayers[replaying.cuda_stream].capture
        assert capture.cuda_stream not in (batcher._runner._capture_stream.cuda_stream,
                                           torch.cuda.default_stream().cuda_stream)
        assert (capture == lane.side) == beside
        streams = [batcher.submit(ids, DecodeConfig(max_new_tokens=n, capture="graph")) for ids, n in reqs]
        results = [s.result(timeout=300) for s in streams]
    for (ids, n), result in zip(reqs, results):
        assert result.token_ids == decoder.generate(ids, DecodeConfig(max_new_tokens=n, capture="graph")).token_ids
    assert any(launches)  # a prefill was launched while rows ran


def test_a_tree_runs_only_within_the_policys_widest_attention(monkeypatch):
    """Past a bucket's max_width the decoder runs the one-row step, with the same greedy tokens; warm-up
    prepares the tree up to that width and the one-row step past it."""
    from ppd.decoding import graphs
    from ppd.decoding.loop import steps_to_prepare

    model = tiny_model(seed=3)
    trees = random_tree_set(seed=7, size=12)
    tokens = random_prompt_tokens(model, 3, 1, seed=3)
    prompt, config = [1, 2, 3, 4], DecodeConfig(max_new_tokens=60, stop_on_eos=False)
    free = Decoder(model, tokens, policy=BatchPolicy((1,), (trees,))).generate(prompt, config)
    rows = Decoder(model, tokens, trees).tables.num_rows
    limit = len(prompt) + rows + 20
    policy = BatchPolicy((1, 8), (trees, None), max_widths=(limit, None))
    decoder = Decoder(model, tokens, policy=policy)
    calls = []
    original = graphs.decode_step

    def spy(lm, tables, prompt_embeds, state, kind, slot_ids):
        calls.append((tables is not None, int(state.lengths.max())))
        return original(lm, tables, prompt_embeds, state, kind, slot_ids)

    monkeypatch.setattr(graphs, "decode_step", spy)
    limited = decoder.generate(prompt, config)
    assert limited.token_ids == free.token_ids
    assert any(tree for tree, _ in calls) and not all(tree for tree, _ in calls)
    assert all((length + rows <= limit) == tree for tree, length in calls)
    assert max(free.step_tokens[len(calls) // 2:]) > 1  # the tree would still have paid there
    # Warm-up's plan: the tree's widths up to the limit (none under 256 slots), the one-row step's everywhere.
    assert policy.max_width_for(1) == limit and policy.max_width_for(64) is None
    assert steps_to_prepare(decoder, decoder.tables, 1, 4096, whole=False) == [(False, [256, 512, 1024, 2048, 4096])]
    wide = Decoder(model, tokens, policy=BatchPolicy((1, 8), (trees, None), max_widths=(1024, None)))
    plan = steps_to_prepare(wide, wide.tables, 1, 4096, whole=False)
    assert plan == [(True, [256, 512, 1024]), (False, [256, 512, 1024, 2048, 4096])]
    # Within the limit, the one-row step only from the model's context window (512 positions) on.
    assert steps_to_prepare(wide, wide.tables, 1, 1024, whole=False) == [(True, [256, 512, 1024]), (False, [512, 1024])]
    assert steps_to_prepare(wide, wide.tables, 1, 4096, whole=True) == [(True, [4096]), (False, [4096])]
    assert steps_to_prepare(wide, wide.tables, 1, 1024, whole=True) == [(True, [1024]), (False, [1024])]
    assert steps_to_prepare(wide, wide.tables, 1, 256, whole=False) == [(True, [256])]
    assert steps_to_prepare(wide, None, 8, 512, whole=False, one_row=True) == [(False, [256, 512])]
    assert "(to width" in policy.describe()


def test_warm_up_plans_the_one_row_steps_at_the_end_of_the_context_window(monkeypatch):
    """A decoding that runs into the model's context window leaves the tree for one row a step there: warm-up's
    plan holds every one of those steps (with graphs, one missing from it was captured inside the generation),
    and none where the window is out of reach."""
    from ppd.decoding import loop

    model = tiny_model(seed=5, max_positions=600)
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=5), random_tree_set(seed=9, size=12))
    tables = decoder.tables
    assert decoder.capacity == 600
    ran = []
    original = graphs.StepRunner.run

    def spy(self, step_tables, prompt_embeds, state, kind, width):
        ran.append((step_tables is not None, width))
        return original(self, step_tables, prompt_embeds, state, kind, width)

    monkeypatch.setattr(graphs.StepRunner, "run", spy)
    monkeypatch.setattr(loop, "captures_graphs", lambda mode: True)  # widths padded as where graphs replay
    monkeypatch.setenv("PPD_RUN_AHEAD", "1")  # lengths read a step behind, as on a GPU
    rng = random.Random(5)
    prompt = [rng.randrange(1, 24) for _ in range(520)]
    out = decoder.generate(prompt, DecodeConfig(max_new_tokens=200, stop_on_eos=False, capture="eager"))
    assert len(out.token_ids) == 600 - 520
    one_row = {width for tree, width in ran if not tree}
    assert one_row and any(tree for tree, _ in ran)
    slots = _state_slots(decoder)
    plan = dict(loop.steps_to_prepare(decoder, tables, 1, slots, whole=False))
    assert one_row <= set(plan[False]) and {w for tree, w in ran if tree} <= set(plan[True])
    assert loop.window_widths(decoder, tables, slots, whole=True) == [slots]
    # A decoder that stops well before the window (its rows' lengths, read a step late, never reach it) prepares the
    # tree alone, over all of its state's slots.
    short = Decoder(model, random_prompt_tokens(model, 3, 1, seed=5), random_tree_set(seed=9, size=12),
                    max_seq_len=600 - tables.max_offset - 2 * tables.most_emitted - 1)
    assert [tree for tree, _ in loop.steps_to_prepare(short, short.tables, 1, _state_slots(short), whole=False)] \
        == [True]


def _state_slots(decoder: Decoder) -> int:
    """Warm-up's widest step: a state's slots, past the decoder's capacity by a step's rows."""
    state = decoder.states.acquire(1)
    decoder.states.release(state)
    return state.capacity


def test_policy_widths_round_trip_and_are_checked(tmp_path):
    policy = BatchPolicy((1, 4, 16), (random_tree_set(seed=1), random_tree_set(seed=2, size=4), None),
                         max_widths=(2048, 1024, None))
    policy.save(tmp_path / "p.json")
    assert BatchPolicy.load(tmp_path / "p.json") == policy
    assert "max_width" not in str(BatchPolicy((1,), (None,)).to_json())  # no limit, no key: older readers agree
    with pytest.raises(ValueError, match="one max_width"):
        BatchPolicy((1, 4), (None, None), max_widths=(512,))
    with pytest.raises(ValueError, match="one max_width"):
        BatchPolicy((1,), (None,), max_widths=(0,))
