"""The engine around the device step: compiled and captured steps give the eager step's tokens, rows of a
batch stop on the device at their own steps, and a decoder's caches carry nothing from one request to the
next. CUDA-only modes run where a GPU is present (the device machine), and are skipped here otherwise."""

import random

import pytest
import torch

from ppd import CaptureMode, DecodeConfig, Decoder, Tree, TreeSet
from ppd.decoding.tables import TreeTables
from ppd.decoding.step import decode_step
from tests.conftest import random_prompt_tokens, random_tree_set, tiny_model
from tests.test_decoder import hf_greedy

CUDA = torch.cuda.is_available()


def _compiled_variants() -> int:
    """How many compiled variants of the step function torch holds (one per step kind, not per width)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(decode_step.__code__))


def _requests(vocab: int, seed: int, count: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(1, 40))], rng.randint(1, 40)) for _ in range(count)]


def _outputs(decoder, requests, **config):
    results = []
    for prompt, n in requests:
        out = decoder.generate(prompt, DecodeConfig(max_new_tokens=n, stop_on_eos=False, **config))
        results.append((out.token_ids, out.steps, out.finish_reason))
    return results


def test_compiled_step_equals_eager_step_without_graph_breaks_or_recompiles():
    """torch.compile(fullgraph=True) of the step on this CPU: the same tokens and steps as the eager step,
    greedy and sampled, and one compiled variant per step kind whatever the attention width."""
    torch._dynamo.reset()
    model = tiny_model(seed=21)
    decoder = Decoder(model, random_prompt_tokens(model, 3, 2, seed=21), random_tree_set(seed=21, size=14),
                      max_seq_len=200)
    requests = _requests(model.config.vocab_size, 21, 4)
    for method in ("ppd", "baseline"):
        eager = _outputs(decoder, requests, method=method, capture="eager")
        assert _outputs(decoder, requests, method=method, capture="compile") == eager
    assert _compiled_variants() == 2  # tree step and one-row step, every width and prompt length
    # Ahead-of-time preparation, also for a decoder without prompt tokens (which can only run the baseline).
    baseline_only = Decoder(model, max_seq_len=200)
    assert baseline_only.warmup(methods=["baseline"], capture="compile") > 0 and len(baseline_only.captures) == 1
    assert _outputs(baseline_only, requests, method="baseline", capture="compile") == eager
    sampled = dict(method="ppd", temperature=0.8, top_p=0.9, seed=5)
    assert _outputs(decoder, requests[:2], capture="compile", **sampled) == _outputs(decoder, requests[:2], **sampled)


def test_one_compiled_tree_step_serves_tree_sets_of_every_size():
    """Tree tables pad every dimension to at least 2, so a tree set of one path, one candidate and one prompt
    row compiles no step of its own (torch specialises size-1 dimensions): on a GPU that was a second
    compilation of minutes, and Inductor's cached code of one set could not serve another."""
    torch._dynamo.reset()
    model = tiny_model(seed=22)
    tokens = random_prompt_tokens(model, 3, 1, seed=22)
    single = TreeSet(3, 6, {key: Tree(((0,),), (1,), 1) for key in (1, 2, 3)})
    tables = TreeTables.build(single, 1, "ensemble")
    assert min(tables.num_candidates, tables.retrieve_indices.shape[1], tables.prompt_index.shape[1]) == 2
    requests = _requests(model.config.vocab_size, 22, 3)
    for trees in (random_tree_set(seed=22, size=14), single):
        # Unpacked weights, as on a GPU (MKL's packed weights serve one row count, so a CPU float32 step
        # compiles per tree size whatever the padding).
        decoder = Decoder(model, tokens, trees, max_seq_len=200, packed_weights=False)
        assert _outputs(decoder, requests, capture="compile") == _outputs(decoder, requests, capture="eager")
    assert _compiled_variants() == 1


def test_static_tree_shapes_compile_a_step_per_tree_set_and_keep_the_batch_symbolic(monkeypatch):
    """``PPD_TREE_SHAPES=static`` (the default on CUDA): each tree set compiles a tree step of its own, with its
    sizes as constants (a second set does not turn them symbolic, which would bring back the copies
    ``symbolic_tree_sizes`` describes), while batches of 2, 3 and 5 rows still share one step; every step gives the
    eager step's tokens and steps, deep prompt tokens and a lookup chain included."""
    monkeypatch.setenv("PPD_TREE_SHAPES", "static")
    torch._dynamo.reset()
    model = tiny_model(seed=25)
    tokens = random_prompt_tokens(model, 3, 1, seed=25, deep=True)
    rng = random.Random(25)
    sets = (random_tree_set(seed=25, size=14), random_tree_set(seed=26, size=9).with_lookup(4))
    for index, trees in enumerate(sets):
        decoder = Decoder(model, tokens, trees, max_seq_len=200, packed_weights=False)
        for size in (2, 3, 5):
            prompts = [[rng.randrange(model.config.vocab_size) for _ in range(rng.randint(2, 30))] for _ in range(size)]
            outputs = {}
            for capture in ("eager", "compile"):
                config = DecodeConfig(max_new_tokens=12, stop_on_eos=False, capture=capture)
                outputs[capture] = [(o.token_ids, o.steps) for o in decoder.generate(prompts, config)]
            assert outputs["compile"] == outputs["eager"], (index, size)
        assert _compiled_variants() == index + 1


def test_tree_shapes_follow_the_device_unless_told(monkeypatch):
    from ppd.decoding.graphs import symbolic_tree_sizes

    monkeypatch.delenv("PPD_TREE_SHAPES", raising=False)
    assert symbolic_tree_sizes(torch.device("cpu")) and not symbolic_tree_sizes(torch.device("cuda"))
    for value, expected in (("static", False), ("symbolic", True)):
        monkeypatch.setenv("PPD_TREE_SHAPES", value)
        assert symbolic_tree_sizes(torch.device("cpu")) is expected is symbolic_tree_sizes(torch.device("cuda"))
    monkeypatch.setenv("PPD_TREE_SHAPES", "dynamic")
    with pytest.raises(ValueError, match="PPD_TREE_SHAPES must be auto, static or symbolic"):
        symbolic_tree_sizes(torch.device("cpu"))


def test_every_batch_of_two_rows_or_more_shares_the_first_compiled_step():
    """The batch dimension is symbolic from the first compilation: batches of 2, 3 and 5 rows run one compiled
    variant per step kind (torch used to compile the first size as it was and recompile at the second, on a
    GPU 36-110 s more per step kind), and a batch of one row, whose size torch specialises, one more. Every
    batch gives the eager step's tokens and steps."""
    torch._dynamo.reset()
    model = tiny_model(seed=24)
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=24, deep=True), random_tree_set(seed=24, size=14),
                      max_seq_len=200, packed_weights=False)
    rng = random.Random(24)
    for sizes, variants in (((2, 3, 5), 2), ((1,), 4)):
        for size in sizes:
            prompts = [[rng.randrange(model.config.vocab_size) for _ in range(rng.randint(2, 30))] for _ in range(size)]
            for method in ("ppd", "baseline"):
                outputs = {}
                for capture in ("eager", "compile"):
                    config = DecodeConfig(method=method, max_new_tokens=12, stop_on_eos=False, capture=capture)
                    outputs[capture] = [(o.token_ids, o.steps) for o in decoder.generate(prompts, config)]
                assert outputs["compile"] == outputs["eager"], (size, method)
        assert _compiled_variants() == variants, sizes


def test_rows_of_a_batch_stop_on_the_device_at_their_own_steps():
    model = tiny_model(seed=22)
    rng = random.Random(22)
    prompts = [[rng.randrange(24) for _ in range(rng.randint(2, 12))] for _ in range(5)]
    references = [hf_greedy(model, p, 30) for p in prompts]
    eos = references[0][5]  # a token some rows emit early and others late or never
    decoder = Decoder(model, random_prompt_tokens(model, 3, 1, seed=22), random_tree_set(seed=22, size=12),
                      eos_token_ids=[eos])
    limits = [30, 3, 17, 30, 9]
    outs = decoder.generate(prompts, DecodeConfig(max_new_tokens=30))
    for prompt, reference, out, limit in zip(prompts, references, outs, limits):
        expected = reference[: reference.index(eos) + 1] if eos in reference else reference
        assert out.token_ids == expected
        assert out.finish_reason == ("eos" if eos in reference else "length")
    # Per-row limits come from each row's room in the context window: a batch mixing long and short prompts.
    small = Decoder(model, random_prompt_tokens(model, 3, 1, seed=22), random_tree_set(seed=22, size=12),
                    max_seq_len=40)
    batch = [[1] * 35, [2] * 5]
    long_row, short_row = small.generate(batch, DecodeConfig(max_new_tokens=20, stop_on_eos=False))
    assert long_row.token_ids == hf_greedy(model, batch[0], 5) and long_row.finish_reason == "max_length"
    assert short_row.token_ids == hf_greedy(model, batch[1], 20) and short_row.finish_reason == "length"
    assert limits  # (the limits above are only the shape of the test's expectation)


def test_cache_is_allocated_once_and_reset_between_requests():
    """Two different requests in a row give what each gives alone, on the same buffers."""
    model = tiny_model(seed=23)
    pt, trees = random_prompt_tokens(model, 3, 2, seed=23), random_tree_set(seed=23, size=12)
    shared = Decoder(model, pt, trees)
    requests = _requests(model.config.vocab_size, 23, 6)
    configs = [dict(method="ppd"), dict(method="baseline"), dict(method="ppd", temperature=0.7, seed=3)]
    results = []
    for (prompt, n), extra in zip(requests, configs * 2):
        results.append(shared.generate(prompt, DecodeConfig(max_new_tokens=n, stop_on_eos=False, **extra)).token_ids)
    assert len(shared.states.allocated) == 1
    address = shared.states.allocated[0].kv.keys[0].data_ptr()
    for (prompt, n), extra, result in zip(requests, configs * 2, results):
        alone = Decoder(model, pt, trees).generate(prompt, DecodeConfig(max_new_tokens=n, stop_on_eos=False, **extra))
        assert alone.token_ids == result
    shared.generate(requests[0][0], DecodeConfig(max_new_tokens=4))
    assert shared.states.allocated[0].kv.keys[0].data_ptr() == address and len(shared.states.allocated) == 1


def test_interleaved_streams_get_caches_of_their_own():
    model = tiny_model(seed=24)
    decoder = Decoder(model, random_prompt_tokens(model, seed=24), random_tree_set(seed=24, size=10))
    config = DecodeConfig(max_new_tokens=25, stop_on_eos=False)
    streams = {(1, 2, 3): decoder.stream([1, 2, 3], config), (7, 7, 9, 4): decoder.stream([7, 7, 9, 4], config)}
    tokens = {prompt: [] for prompt in streams}
    while streams:
        for prompt, stream in list(streams.items()):  # one step of each in turn
            step = next(stream, None)
            if step is None:
                del streams[prompt]
            else:
                tokens[prompt] += step.tokens[0]
    for prompt, got in tokens.items():
        assert got == hf_greedy(model, list(prompt), 25)
    assert len(decoder.states.allocated) == 2


def test_cuda_only_modes_are_refused_clearly_on_cpu():
    if CUDA:
        pytest.skip("this machine has a GPU")
    model = tiny_model()
    decoder = Decoder(model, random_prompt_tokens(model), random_tree_set(seed=0))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        decoder.generate([1, 2], DecodeConfig(capture="compiled_graph"))
    assert decoder.warmup() == 0.0  # nothing to capture on a CPU


def test_autotune_switch_names_inductor_options_and_refuses_unknown_values(monkeypatch):
    """``$PPD_AUTOTUNE`` turns Inductor's autotuning on for every compilation ppd makes (the step's and the
    prefill's), adds nothing where it is off, and refuses a value it does not know, naming the variable."""
    from ppd.decoding.graphs import AUTOTUNE_ENV, inductor_options

    monkeypatch.delenv(AUTOTUNE_ENV, raising=False)
    assert not {"max_autotune_gemm", "max_autotune_pointwise", "coordinate_descent_tuning"} & set(inductor_options())
    monkeypatch.setenv(AUTOTUNE_ENV, "gemm")
    assert inductor_options()["max_autotune_gemm"] is True and "coordinate_descent_tuning" not in inductor_options()
    assert inductor_options(cudagraphs=True)["triton.cudagraphs"] is True
    monkeypatch.setenv(AUTOTUNE_ENV, "full")
    assert {"max_autotune_gemm", "max_autotune_pointwise", "coordinate_descent_tuning"} <= set(inductor_options())
    monkeypatch.setenv(AUTOTUNE_ENV, "fastest")
    with pytest.raises(ValueError, match=r"\$PPD_AUTOTUNE must be off, gemm or full, got 'fastest'"):
        inductor_options()


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", [CaptureMode.GRAPH, CaptureMode.COMPILED_GRAPH])
def test_captured_step_equals_eager_step_on_the_gpu(mode, monkeypatch):
    from ppd.decoding.graphs import PREFILL_GRAPHS_ENV

    monkeypatch.setenv(PREFILL_GRAPHS_ENV, "0")  # the exact eager prefill: the steps alone are compared
    model = tiny_model(seed=25).cuda()
    decoder = Decoder(model, random_prompt_tokens(model, 3, 2, seed=25), random_tree_set(seed=25, size=14),
                      max_seq_len=300)
    requests = _requests(model.config.vocab_size, 25, 6)
    for method in ("ppd", "baseline"):
        assert _outputs(decoder, requests, method=method, capture=mode) == _outputs(decoder, requests,
                                                                                    method=method, capture="eager")
    sampled = dict(method="ppd", temperature=0.8, top_p=0.9, seed=5)
    captured = _outputs(decoder, requests, capture=mode, **sampled)
    assert captured == _outputs(decoder, requests, capture=mode, **sampled)  # seeded: the same text again
    if mode is CaptureMode.GRAPH:  # the eager step's own kernels, replayed: the very same numbers
        assert captured == _outputs(decoder, requests, capture="eager", **sampled)
    batch = [p for p, _ in requests[:3]]
    for mode_outs in zip(decoder.generate(batch, DecodeConfig(max_new_tokens=30, capture=mode)),
                         decoder.generate(batch, DecodeConfig(max_new_tokens=30, capture="eager"))):
        assert mode_outs[0].token_ids == mode_outs[1].token_ids
    captured = len(decoder.captures)
    _outputs(decoder, requests, method="ppd", capture=mode)
    assert len(decoder.captures) == captured  # later requests replay what is captured


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_captured_prefills_decode_what_eager_prefills_do_on_the_gpu():
    """Where steps replay graphs, prefills do too (``ppd/decoding/prefill_graphs.py``): one graph per rows and
    width bucket, captured at its first prompt and replayed for later ones; the tokens are the eager decoder's,
    deep prompt tokens with maps, one row and several, PPD and the baseline."""
    model = tiny_model(seed=26).cuda()
    tokens = random_prompt_tokens(model, 3, 2, seed=26, deep=True, rank=2)
    decoder = Decoder(model, tokens, random_tree_set(seed=26, size=14), max_seq_len=300)
    requests = _requests(model.config.vocab_size, 26, 6)
    for method in ("ppd", "baseline"):
        assert _outputs(decoder, requests, method=method, capture="compiled_graph") == _outputs(
            decoder, requests, method=method, capture="eager")
    graphs = decoder.runner(CaptureMode.COMPILED_GRAPH).prefill_graphs
    # One row (after the state's first prefill, eager: it allocates the cache): a graph for each method, at the
    # width of 64 that prompts of at most 40 tokens and 6 prompt rows take.
    assert [(rows, width) for rows, width, _ in graphs.captures] == [(1, 64), (1, 64)]
    batch = [p for p, _ in requests[:3]]
    for _ in range(2):  # three rows: a state of four, first prefilled eagerly, then through a graph of its own
        captured = decoder.generate(batch, DecodeConfig(max_new_tokens=30, capture="compiled_graph"))
    assert [o.token_ids for o in captured] == [o.token_ids for o in decoder.generate(
        batch, DecodeConfig(max_new_tokens=30, capture="eager"))]
    assert [(rows, width) for rows, width, _ in graphs.captures][2:] == [(3, 64)]
    again = len(graphs.captures)
    _outputs(decoder, requests, method="ppd", capture="compiled_graph")
    assert len(graphs.captures) == again  # later prompts replay them
    # A warm-up captures every width bucket of its batch sizes ahead (the state's 384 slots, 300 and the tree's
    # rows rounded up to whole blocks: 64, 128, 256 and 384, for each method), so that requests capture nothing.
    warm = Decoder(model, tokens, random_tree_set(seed=26, size=14), max_seq_len=300)
    warm.warmup(batch_sizes=[1], capture="compiled_graph")
    graphs = warm.runner(CaptureMode.COMPILED_GRAPH).prefill_graphs
    assert sorted(width for _, width, _ in graphs.captures) == [64, 64, 128, 128, 256, 256, 384, 384]
    for method in ("ppd", "baseline"):
        _outputs(warm, requests, method=method, capture="compiled_graph")
        warm.generate([1] * 290, DecodeConfig(method=method, max_new_tokens=4))  # the widest bucket
    assert len(graphs.captures) == 8


def test_the_head_takes_a_steps_node_rows_as_one_matrix():
    """A step's node logits come from ``hidden[:, :C]``, a view that is not contiguous. The head gets its rows as
    one matrix product, eager and compiled: ``F.linear`` on such a view runs a batched product over the batch
    rows with the head's weight broadcast, which on a GPU reads the whole weight once per row of the batch."""
    from torch._inductor.utils import run_and_get_code
    from torch.profiler import profile

    from ppd.decoding.step import LanguageModel

    lm = LanguageModel.of(tiny_model(seed=4))
    hidden = torch.randn(6, 9, lm.embed.weight.shape[1])
    nodes = hidden[:, :4]
    assert not nodes.is_contiguous()
    expected = lm.head(nodes.contiguous())
    with profile() as run:
        got = lm.logits(nodes)
    products = {e.name for e in run.events() if e.name in ("aten::mm", "aten::bmm")}
    assert products == {"aten::mm"}
    torch.testing.assert_close(got, expected)
    torch._dynamo.reset()
    compiled, code = run_and_get_code(torch.compile(lm.logits, fullgraph=True), nodes)
    assert "bmm" not in "\n".join(code)
    torch.testing.assert_close(compiled, expected)
