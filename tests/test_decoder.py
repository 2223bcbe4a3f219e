"""PPD greedy output equals autoregressive greedy output, token for token, on tiny random models."""

import random

import pytest
import torch

from ppd import DecodeConfig, Decoder, PromptTooLongError, Tree, TreeSet
from tests.conftest import random_prompt_tokens, random_tree_set, tiny_model


def hf_greedy(model, prompt, max_new_tokens, eos=None):
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_captured_equals_eager_and_generate(decoder, model, prompts, capture: str, max_new_tokens: int = 24):
    """The decoder's ``capture`` step gives its eager step's greedy tokens, and those are transformers'."""
    settings = dict(max_new_tokens=max_new_tokens, stop_on_eos=False)
    eager = decoder.generate(prompts, DecodeConfig(capture="eager", **settings))
    captured = decoder.generate(prompts, DecodeConfig(capture=capture, **settings))
    assert [o.token_ids for o in captured] == [o.token_ids for o in eager]
    for prompt, out in zip(prompts, eager):
        assert out.token_ids == hf_greedy(model, prompt, max_new_tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_ppd_equals_baseline_and_hf_over_random_prompts_and_trees(arch):
    model = tiny_model(arch, seed=11)
    vocab = model.config.vocab_size
    rng = random.Random(arch)
    accepted = 0
    for trial in range(12):
        V = rng.choice([1, 2])
        attention = rng.choice(["ensemble", "decoder", "encoder"])
        decoder = Decoder(model, random_prompt_tokens(model, 3, V, attention, seed=trial),
                          random_tree_set(seed=100 + trial, size=rng.randint(1, 16)))
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
        n = rng.randint(1, 48)
        ppd = decoder.generate(prompt, DecodeConfig(method="ppd", max_new_tokens=n, stop_on_eos=False))
        base = decoder.generate(prompt, DecodeConfig(method="baseline", max_new_tokens=n, stop_on_eos=False))
        assert ppd.token_ids == base.token_ids, (trial, prompt)
        assert ppd.token_ids == hf_greedy(model, prompt, n), (trial, prompt)
        assert len(ppd.token_ids) == n and ppd.finish_reason == "length"
        assert sum(ppd.step_tokens) == n - 1  # the prefill emits the first token
        accepted += n - 1 - ppd.steps
    assert accepted > 0, "no guess was ever accepted: the test would not exercise the tree"


def test_batched_ppd_equals_single_prompts():
    model = tiny_model(seed=3)
    decoder = Decoder(model, random_prompt_tokens(model, 3, 2, seed=3), random_tree_set(seed=7, size=12))
    rng = random.Random(5)
    prompts = [[rng.randrange(24) for _ in range(rng.randint(1, 15))] for _ in range(4)]
    config = DecodeConfig(max_new_tokens=30, stop_on_eos=False)
    seen = []
    batched = decoder.generate(prompts, config, on_report=seen.append)
    assert seen == list(range(1 + max(o.steps for o in batched)))  # the prefill's report, then one a pass
    for prompt, out in zip(prompts, batched):
        assert out.token_ids == decoder.generate(prompt, config).token_ids
        assert out.token_ids == hf_greedy(model, prompt, 30)
        # when each of the batch's reports reached the host: one per pass of the batch, after the prefill's
        assert len(out.report_times_s) == max(o.steps for o in batched)


@pytest.mark.parametrize("capture", ["eager", "compile"])
def test_the_cache_grows_with_the_lengths_decoded_and_decodes_the_same(capture):
    """A decoder sized for 2,048 positions allocates 512 cache slots at first and grows them as requests need
    (at a prefill, mid-decoding), never to the whole capacity here; PPD greedy stays transformers' greedy, and
    the compiled step, whose cache size is symbolic, is not compiled again when the cache grows."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from ppd.decoder import INITIAL_SLOTS
    from ppd.decoding.step import decode_step

    model = tiny_model(seed=4, max_positions=2048)
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=4), random_tree_set(seed=2, size=12))
    rng = random.Random(9)
    prompts = [[rng.randrange(24) for _ in range(480)], [rng.randrange(24) for _ in range(20)]]
    config = DecodeConfig(max_new_tokens=60, stop_on_eos=False, capture=capture)

    def variants() -> int:
        return len(_debug_get_cache_entry_list(decode_step.__code__))

    before = variants()
    out = decoder.generate(prompts, config)  # the first row's steps pass slot 512
    assert variants() - before == (capture == "compile"), "a grown cache must not compile the step again"
    state = decoder.states.allocated[-1]
    assert INITIAL_SLOTS < state.kv.reserved < state.capacity
    # One spare slot past the reserved ones: no width a step attends over is the whole buffer.
    assert all(buffer.shape[2] == state.kv.reserved + 1 for buffer in state.kv.buffers())
    assert [o.token_ids for o in out] == [hf_greedy(model, p, 60) for p in prompts]
    long_prompt = [rng.randrange(24) for _ in range(900)]  # a new state of one row grows at its prefill
    assert decoder.generate(long_prompt, config).token_ids == hf_greedy(model, long_prompt, 60)
    assert max(s.kv.reserved for s in decoder.states.allocated) < decoder.states.allocated[0].capacity


def test_eos_stops_like_autoregressive_decoding():
    model = tiny_model(seed=4)
    prompt = [1, 2, 3, 4]
    reference = hf_greedy(model, prompt, 40)
    eos = reference[7]  # a token the model emits: decoding must stop right after its first occurrence
    decoder = Decoder(model, random_prompt_tokens(model, seed=4), random_tree_set(seed=2), eos_token_ids=[eos])
    for method in ("ppd", "baseline"):
        out = decoder.generate(prompt, DecodeConfig(method=method, max_new_tokens=40))
        assert out.token_ids == reference[: reference.index(eos) + 1]
        assert out.finish_reason == "eos"


def test_context_window_limits():
    model = tiny_model(max_positions=32, seed=6)
    decoder = Decoder(model, random_prompt_tokens(model, seed=6), random_tree_set(seed=6, size=14))
    with pytest.raises(PromptTooLongError, match="context window is 32"):
        decoder.generate(list(range(20)) + list(range(12)), DecodeConfig(max_new_tokens=4))
    prompt = [5] * 20
    out = decoder.generate(prompt, DecodeConfig(max_new_tokens=100, stop_on_eos=False))
    assert len(out.token_ids) == 12 and out.finish_reason == "max_length"
    assert out.token_ids == hf_greedy(model, prompt, 12)


def test_sampling_is_seeded_and_runs_both_methods():
    model = tiny_model(seed=8)
    decoder = Decoder(model, random_prompt_tokens(model, seed=8), random_tree_set(seed=8))
    for method in ("ppd", "baseline"):
        config = DecodeConfig(method=method, temperature=0.8, top_p=0.9, seed=123, max_new_tokens=25,
                              stop_on_eos=False)
        first, second = decoder.generate([1, 2, 3], config), decoder.generate([1, 2, 3], config)
        assert first.token_ids == second.token_ids and len(first.token_ids) == 25


def test_stream_yields_the_same_tokens_as_generate():
    model = tiny_model(seed=9)
    decoder = Decoder(model, random_prompt_tokens(model, seed=9), random_tree_set(seed=9, size=12))
    config = DecodeConfig(max_new_tokens=20, stop_on_eos=False)
    steps = list(decoder.stream([4, 5, 6], config))
    streamed = [t for step in steps for t in step.tokens[0]]
    assert streamed == decoder.generate([4, 5, 6], config).token_ids
    assert steps[0].step == 0 and steps[-1].finished == [True]
    assert steps[0].finish_reason == [None] and steps[-1].finish_reason == ["length"]
    assert all(step.guessed[0] < max(len(step.tokens[0]), 1) for step in steps)


def test_a_stream_resumed_on_other_threads_decodes_the_same_tokens():
    # A web server iterates a generator on whichever worker thread is free; inference mode is thread-local.
    from concurrent.futures import ThreadPoolExecutor

    model = tiny_model(seed=10)
    decoder = Decoder(model, random_prompt_tokens(model, seed=10), random_tree_set(seed=10, size=12))
    config = DecodeConfig(max_new_tokens=20, stop_on_eos=False)
    steps = decoder.stream([4, 5, 6], config)
    tokens = []
    with ThreadPoolExecutor(max_workers=1) as first, ThreadPoolExecutor(max_workers=1) as second:
        for i in range(1000):
            step = (first if i % 2 else second).submit(next, steps, None).result()
            if step is None:
                break
            tokens.extend(step.tokens[0])
    assert tokens == decoder.generate([4, 5, 6], config).token_ids


@pytest.mark.parametrize("method", ["ppd", "baseline"])
def test_running_ahead_decodes_what_reading_each_step_first_does(monkeypatch, method):
    """With ``$PPD_RUN_AHEAD=1`` each step is queued before the last one's report is read, its width and tree
    chosen for the longest a row may have grown to: the same tokens, steps, reasons and streamed progress as the
    loop that reads every report first, for rows of other lengths that stop at other steps (EOS, their token
    limit, the context window, where the tree gives way to one row a step), greedy and sampled; at most one
    step is queued past the last report read, and the state serves the next request as before."""
    from ppd.decoding import loop

    model = tiny_model(max_positions=64, seed=12)
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=12), random_tree_set(seed=12, size=14),
                      eos_token_ids=[hf_greedy(model, [7, 8, 9], 30)[11]])
    rng = random.Random(12)
    prompts = [[7, 8, 9]] + [[rng.randrange(24) for _ in range(rng.randint(2, 40))] for _ in range(4)]
    queued = []
    real_queue = loop.queue_step
    monkeypatch.setattr(loop, "queue_step", lambda *args, **kwargs: queued.append(1) or real_queue(*args, **kwargs))

    def run(ahead: str, **settings):
        monkeypatch.setenv(loop.RUN_AHEAD_ENV, ahead)
        queued.clear()
        config = DecodeConfig(method=method, max_new_tokens=30, **settings)
        outs = decoder.generate(prompts, config)
        progress = [(p.step, p.tokens, p.finish_reason) for p in decoder.stream(prompts[1], config)]
        return [(o.token_ids, o.step_tokens, o.steps, o.finish_reason) for o in outs], progress, len(queued)

    for settings in ({}, {"temperature": 0.9, "top_p": 0.95, "seed": 7}):
        read_first, stream_first, steps = run("0", **settings)
        ahead, stream_ahead, queued_ahead = run("1", **settings)
        assert ahead == read_first and stream_ahead == stream_first, settings
        assert steps < queued_ahead <= steps + 2  # one step more at most, for each of the two calls
    assert {out[3] for out in read_first} >= {"eos", "length"} and any(len(p) > 30 for p in prompts)
    greedy = decoder.generate(prompts, DecodeConfig(method=method, max_new_tokens=30))
    assert [o.token_ids for o in greedy] == [hf_greedy(model, p, min(30, 64 - len(p)), sorted(decoder.eos_token_ids))
                                             for p in prompts]


def test_ppd_without_prompt_tokens_is_a_clear_error():
    model = tiny_model()
    with pytest.raises(ValueError, match="needs prompt tokens"):
        Decoder(model).generate([1, 2], DecodeConfig(method="ppd"))
    assert len(Decoder(model).generate([1, 2], DecodeConfig(method="baseline", max_new_tokens=5,
                                                          stop_on_eos=False)).token_ids) == 5


def test_tree_set_must_match_the_adapter():
    model = tiny_model()
    with pytest.raises(ValueError, match="N=3 prompt tokens, the adapter has N=2"):
        Decoder(model, random_prompt_tokens(model, n=2), random_tree_set(seed=0))


@pytest.mark.parametrize("settings, message", [
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(temperature=-0.5), "temperature must be a finite number"),
    (dict(top_p=float("nan")), "top_p must be in"),
    (dict(posterior_threshold=-0.1), "posterior_threshold must be in"),
    (dict(posterior_threshold=float("nan")), "posterior_threshold must be in"),
    (dict(posterior_alpha=-1.0), "posterior_alpha must be a finite number > 0"),
    (dict(posterior_alpha=0.0), "posterior_alpha must be a finite number > 0"),
])
def test_impossible_decoding_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        DecodeConfig(**settings)


def test_a_tree_guessing_past_the_vocabulary_is_refused_at_construction():
    model = tiny_model()  # a vocabulary of 24 tokens
    tree = Tree(paths=((0,), (29,)), prompt_tokens=(1, 1), root_prompt_tokens=1)
    trees = TreeSet(num_prompt_tokens=1, top_k=30, trees={1: tree})
    with pytest.raises(ValueError, match="top-30 tokens, more than the model's vocabulary of 24"):
        Decoder(model, random_prompt_tokens(model, n=1), trees)


def assert_same_cache_rows(state, expected, batch, prompt_rows: int) -> None:
    """Two states' caches hold the same keys and values in each row's own slots (its tokens, then its prompt
    rows); a padding slot's contents are never read and may differ."""
    for a, b in zip(expected.kv.buffers(), state.kv.buffers()):
        for row, ids in enumerate(batch):
            torch.testing.assert_close(b[row, :, :len(ids) + prompt_rows], a[row, :, :len(ids) + prompt_rows])


def test_a_compiled_prefill_leaves_the_state_the_eager_one_does(monkeypatch):
    """With ``PPD_COMPILED_PREFILL=1`` CUDA's compiled modes prefill through one compiled forward: the state it
    leaves (cache, lengths, roots, guesses) is the eager prefill's, for one row and for rows of different
    lengths, deep prompt tokens with maps included; one compilation serves every length and batch of two or
    more rows."""
    from torch._dynamo.utils import counters

    from ppd.config import CaptureMode
    from ppd.decoding.graphs import COMPILED_PREFILL_ENV, compiles_prefill
    from ppd.decoding.loop import prefill, reset_rows
    from ppd.decoding.step import StepKind

    cuda = torch.device("cuda")  # (only named: nothing runs there)
    monkeypatch.delenv(COMPILED_PREFILL_ENV, raising=False)
    assert not compiles_prefill(CaptureMode.COMPILED_GRAPH, cuda)  # off by default
    monkeypatch.setenv(COMPILED_PREFILL_ENV, "1")
    assert compiles_prefill(CaptureMode.COMPILED_GRAPH, cuda) and not compiles_prefill(CaptureMode.GRAPH, cuda)
    assert not compiles_prefill(CaptureMode.COMPILE, torch.device("cpu"))

    model = tiny_model("llama", seed=4)
    # Without packed weights, as on CUDA (a CPU's packs are looked up by row count, a size compiled in).
    tokens = random_prompt_tokens(model, n=3, v=2, seed=4, deep=True, rank=2)
    decoder = Decoder(model, tokens, random_tree_set(3, size=6), packed_weights=False)
    batches = [[[5, 9, 2, 7]], [[5, 9, 2, 7, 7, 1, 4, 4], [3, 8, 1]],
               [[1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [8, 9]]]
    config = DecodeConfig(max_new_tokens=8)
    # PPD at every batch (its third a length and batch size that compile nothing), the baseline (no prompt rows,
    # a variant of its own) at one.
    for i, (use_ppd, batch) in enumerate([(True, b) for b in batches] + [(False, batches[1])]):
        graphs = counters["stats"]["unique_graphs"]
        states = []
        for compiled in (False, True):
            state = decoder.states.acquire(len(batch))
            with torch.no_grad():
                if compiled:  # a first forward allocates the cache, eagerly: other prompts, overwritten
                    reset_rows(decoder, state, [3] * len(batch), config)
                    prefill(decoder, [[20, 21, 22]] * len(batch), state, use_ppd, StepKind(tree=False))
                reset_rows(decoder, state, [len(x) for x in batch], config)
                prefill(decoder, batch, state, use_ppd, StepKind(tree=False), compiled)
            states.append(state)
        eager, compiled = states
        assert_same_cache_rows(compiled, eager, batch, 6 if use_ppd else 0)
        for name in ("lengths", "root", "key", "report"):
            assert torch.equal(getattr(compiled, name), getattr(eager, name)), name
        if use_ppd:
            assert torch.equal(compiled.guesses, eager.guesses)
        if i == 2:
            assert counters["stats"]["unique_graphs"] == graphs
        for state in states:
            decoder.states.release(state)


def test_a_prefill_padded_for_its_graph_leaves_the_state_the_eager_one_does(monkeypatch):
    """The prefill that a CUDA graph replays (``ppd/decoding/prefill_graphs.py``), run here without capture: its
    prompt padded to the bucket's width, its tokens, lengths and read slots copied into the graph's buffers, the
    layout made from them. It leaves the state of the exact-width eager prefill (cache, lengths, roots, guesses,
    report), deep prompt tokens with maps included, for one row and rows of different lengths, each buffer set
    reused by later prompts of its bucket; a state's first prefill, which allocates its cache, and a prefill too
    wide for the buckets run eagerly; decoding after it gives transformers' greedy tokens."""
    from ppd.decoding import prefill_graphs
    from ppd.decoding.loop import prefill, reset_rows
    from ppd.decoding.prefill_graphs import PrefillGraphs, bucket_width
    from ppd.decoding.step import StepKind

    assert bucket_width(3, 1, 2048) == 64 and bucket_width(65, 1, 2048) == 128 and bucket_width(900, 2, 2048) == 1024
    assert bucket_width(900, 2, 1000) == 1000 and bucket_width(1001, 1, 1000) is None
    assert bucket_width(2000, 16, 4096) is None  # 16 x 2048 slots: eager

    from ppd.config import CaptureMode

    model = tiny_model("llama", seed=4)
    tokens = random_prompt_tokens(model, n=3, v=2, seed=4, deep=True, rank=2)
    # One decoder prefills exactly, the other through the graphs' buffers (each its own states).
    eager, padded = (Decoder(model, tokens, random_tree_set(3, size=6), packed_weights=False) for _ in range(2))
    rng = random.Random(4)
    batches = [[[5, 9, 2, 7]], [[5, 9, 2, 7, 7, 1, 4, 4], [3, 8, 1]], [[1, 2], [3] * 70, [8, 9]],
               [[rng.randrange(24) for _ in range(60)]], [[4, 4, 1]]]
    config = DecodeConfig(max_new_tokens=8)
    graphs = PrefillGraphs(capture=False)

    def prefilled(decoder, batch, use_ppd, through=None):
        state = decoder.states.acquire(len(batch))
        with torch.no_grad():
            reset_rows(decoder, state, [len(x) for x in batch], config)
            prefill(decoder, batch, state, use_ppd, StepKind(tree=False), graphs=through)
        decoder.states.release(state)
        return state

    for rows in (1, 2, 3):
        prefilled(padded, [[1]] * rows, True, graphs)  # a state's first prefill allocates its cache: eagerly
    assert not graphs._graphs
    for use_ppd, batch in [(True, b) for b in batches] + [(False, batches[1]), (False, batches[4])]:
        exact, through = prefilled(eager, batch, use_ppd), prefilled(padded, batch, use_ppd, graphs)
        assert_same_cache_rows(through, exact, batch, 6 if use_ppd else 0)
        for name in ("lengths", "root", "key", "report", "guesses"):
            assert torch.equal(getattr(through, name), getattr(exact, name)), name
    # Buffers by (state, rows, width, prompt tokens or not): the second one-row PPD prompt of 64 slots reused the
    # first's; the 3-row batch of 76 slots took a width of 128.
    assert sorted(key[1:3] + (key[-1],) for key in graphs._graphs) == [
        (1, 64, False), (1, 64, True), (1, 128, False), (2, 64, False), (2, 64, True), (3, 128, False)]
    assert all(found.graph is None for found in graphs._graphs.values())

    padded.runner(CaptureMode.EAGER).prefill_graphs = graphs  # as a captured runner on a GPU has them
    prompts = [[rng.randrange(24) for _ in range(n)] for n in (5, 40, 17)]
    outs = padded.generate(prompts, DecodeConfig(max_new_tokens=12, stop_on_eos=False, capture="eager"))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 12) for p in prompts]
    assert (3, 64, False) in [key[1:3] + (key[-1],) for key in graphs._graphs]  # its prefill went through them
    wide = [rng.randrange(24) for _ in range(400)]
    before = len(graphs._graphs)
    with monkeypatch.context() as patch:
        patch.setattr(prefill_graphs, "MAX_TOKENS", 256)  # too wide to capture: the exact eager prefill
        assert padded.generate(wide, DecodeConfig(max_new_tokens=6, stop_on_eos=False, capture="eager")
                               ).token_ids == hf_greedy(model, wide, 6)
    assert len(graphs._graphs) == before


def test_prefill_runs_without_cudnn_attention_and_steps_with_it():
    """The eager prefill leaves cuDNN's SDPA out (a plan per new shape: a prefill's shape is new for nearly
    every request); the steps that follow run with the backends as they were."""
    model = tiny_model("llama", seed=5)
    decoder = Decoder(model, random_prompt_tokens(model, n=3, v=2, seed=5), random_tree_set(3, size=6))
    seen = []
    handle = model.model.layers[0].register_forward_pre_hook(
        lambda module, args: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    try:
        assert torch.backends.cuda.cudnn_sdp_enabled()
        decoder.generate([3, 1, 4, 1, 5, 9, 2, 6], DecodeConfig(max_new_tokens=4, stop_on_eos=False, capture="eager"))
    finally:
        handle.remove()
    assert seen[0] is False and len(seen) > 1 and all(seen[1:])  # the prefill, then every step
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_prefill_rounds_its_width_to_sixteen_slots_only_where_the_cache_has_room(monkeypatch):
    from ppd.decoding import loop
    from ppd.decoding.loop import PREFILL_WIDTH_MULTIPLE, prefill_width_multiple

    assert PREFILL_WIDTH_MULTIPLE == 16
    assert prefill_width_multiple([[1] * 29, [1] * 7], prompt_rows=3, capacity=300) == 16  # 32 slots fit
    assert prefill_width_multiple([[1] * 29], prompt_rows=3, capacity=32) == 16
    assert prefill_width_multiple([[1] * 30], prompt_rows=3, capacity=40) == 1  # 48 would pass the cache's end
    # Rounded prefills (padding slots past each row's prompt rows) decode as transformers does, up to the longest
    # prompt the decoder takes.
    chosen = []
    monkeypatch.setattr(loop, "prefill_width_multiple",
                        lambda *args: chosen.append(prefill_width_multiple(*args)) or chosen[-1])
    model = tiny_model(seed=4)
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=4), random_tree_set(4), max_seq_len=64)
    for length in (20, 57):
        prompt = [random.Random(length).randrange(1, model.config.vocab_size) for _ in range(length)]
        out = decoder.generate(prompt, DecodeConfig(max_new_tokens=6, stop_on_eos=False))
        assert chosen[-1] == 16 and out.token_ids == hf_greedy(model, prompt, 6)
