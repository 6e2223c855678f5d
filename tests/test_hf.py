"""transformers integration: generation with attnplan equals generation with SDPA (same tokens, logits within the
fp32 tolerance) with a DynamicCache and a StaticCache; the decode steps are attnplan's and the prefill SDPA's;
the StaticCache decode step traces under torch.compile with no graph break; compiled generation on a GPU."""

import statistics
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnplan.hf  # noqa: E402
from attnplan.testing import TOLERANCES  # noqa: E402

from conftest import HAS_CUDA  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
#: a tiny Llama: 2 layers, hidden 64, 4 query / 2 KV heads (GQA group 2), head_dim 16
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def _model(cfg_kwargs, device, dtype, attn):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**cfg_kwargs)
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _generate(model, ids, n, cache=None, mask=None, compile_=False):
    """Greedy ``n`` new tokens: ``(tokens [batch, n], logits [batch, n, vocab])``."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             use_cache=True, pad_token_id=0, eos_token_id=None, cache_implementation=cache,
                             disable_compile=not compile_, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def _ids(vocab, shape, gen):
    return torch.randint(1, vocab, shape, generator=gen).to(DEVICE)


def _assert_logits_close(got, ref, dtype=torch.float32):
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)


class _Counter:
    """Counts the calls of ``attnplan.hf._mask_lengths`` that returned device lengths (the StaticCache path)."""

    def __init__(self, monkeypatch):
        self.n, real = 0, attnplan.hf._mask_lengths

        def counting(*a):
            lens = real(*a)
            self.n += lens is not None
            return lens

        monkeypatch.setattr(attnplan.hf, "_mask_lengths", counting)


def test_stats_cleared_count_again(gen):
    """``attnplan.hf.STATS`` is a user's to read and reset: after ``STATS.clear()`` the next forward counts from 0
    (before, every later attention call raised ``KeyError`` in the counter, so the model stopped working)."""
    attnplan.hf.register()
    m = _model(TINY, DEVICE, torch.float32, attnplan.hf.NAME)
    attnplan.hf.STATS.clear()
    assert dict(attnplan.hf.STATS) == {"attnplan": 0, "sdpa_fallback": 0, "eager_fallback": 0}
    with torch.no_grad():
        m(_ids(TINY["vocab_size"], (1, 5), gen))  # a prefill: SDPA serves every layer
    assert dict(attnplan.hf.STATS) == {"attnplan": 0, "sdpa_fallback": TINY["num_hidden_layers"], "eager_fallback": 0}
    del attnplan.hf.STATS["sdpa_fallback"]  # a key deleted by hand counts from 0 again
    with torch.no_grad():
        m(_ids(TINY["vocab_size"], (1, 5), gen))
    assert dict(attnplan.hf.STATS) == {"attnplan": 0, "sdpa_fallback": TINY["num_hidden_layers"], "eager_fallback": 0}


@pytest.mark.parametrize("prompt_len", [9, 23])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_equals_sdpa_and_decode_steps_are_attnplans(cache, prompt_len, gen, monkeypatch):
    """Greedy generation, eager: attnplan's tokens equal SDPA's and its logits agree within the fp32 tolerance;
    every decode step of every layer is served by attnplan (with a StaticCache through the lengths read from the
    mask on the device) and the prefill by SDPA. (Reading the whole StaticCache as valid, as the integration once
    did, put the logits 0.04 off.)"""
    attnplan.hf.register()
    n_new, layers = 12, TINY["num_hidden_layers"]
    ids = _ids(TINY["vocab_size"], (1, prompt_len), gen)
    impl = None if cache == "dynamic" else "static"
    ref_tokens, ref_logits = _generate(_model(TINY, DEVICE, torch.float32, "sdpa"), ids, n_new, impl)
    masked = _Counter(monkeypatch)
    before = dict(attnplan.hf.STATS)
    tokens, logits = _generate(_model(TINY, DEVICE, torch.float32, attnplan.hf.NAME), ids, n_new, impl)
    served = attnplan.hf.STATS["attnplan"] - before["attnplan"]
    fell_back = attnplan.hf.STATS["sdpa_fallback"] - before["sdpa_fallback"]
    assert (served, fell_back) == ((n_new - 1) * layers, layers), attnplan.hf.STATS
    assert masked.n == (served if cache == "static" else 0)
    assert torch.equal(tokens, ref_tokens), (tokens, ref_tokens)
    _assert_logits_close(logits, ref_logits)


def test_output_attentions_warns_and_returns_no_weights(gen):
    """``output_attentions=True`` on a decode step attnplan serves: a ``UserWarning`` naming the eager implementation,
    no weights in the output (as transformers' SDPA), and the step's logits still SDPA's. A prefill (which goes to
    SDPA) gets SDPA's handling, without attnplan's warning."""
    from transformers import DynamicCache

    attnplan.hf.register()
    ids = _ids(TINY["vocab_size"], (1, 10), gen)
    logits = {}
    for attn in ("sdpa", attnplan.hf.NAME):
        model = _model(TINY, DEVICE, torch.float32, attn)
        cache = DynamicCache(config=model.config)
        with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model(ids[:, :9], cache=cache, output_attentions=True)
            assert not [w for w in seen if "attnplan attention" in str(w.message)], [str(w.message) for w in seen]
            before = attnplan.hf.STATS["attnplan"]
            if attn == "sdpa":
                out = model(ids[:, 9:], cache=cache, output_attentions=True)
            else:
                weights = "does not return attention weights .* attn_implementation='eager'"
                with pytest.warns(UserWarning, match=weights):
                    out = model(ids[:, 9:], cache=cache, output_attentions=True)
                assert attnplan.hf.STATS["attnplan"] - before == TINY["num_hidden_layers"]
        assert not out.attentions or all(a is None for a in out.attentions)
        logits[attn] = out.logits
    _assert_logits_close(logits[attnplan.hf.NAME], logits["sdpa"])


def test_dynamic_cache_plans_once_per_step_and_misses_once_per_length_bucket(gen, monkeypatch):
    """Eager generation over a DynamicCache (key / value tensors one token longer every step): the first layer of
    a step plans, the others run on its plan; the steps' plans come from the plan cache except once per
    power-of-two length bucket (a live plan is made for its capacity's bucket, not for every length)."""
    from attnplan.problem import len_bucket

    attnplan.hf.register()
    n_new, layers, prompt = 12, TINY["num_hidden_layers"], 9
    plans = []
    real = attnplan.DecodeWrapper.plan

    def counting(self, *a, **kw):
        plans.append(a[1].shape[1])  # the cache's length (k is [b, kv_len, kv_heads, d])
        return real(self, *a, **kw)

    monkeypatch.setattr(attnplan.DecodeWrapper, "plan", counting)
    ids = _ids(TINY["vocab_size"], (1, prompt), gen)
    model = _model(TINY, DEVICE, torch.float32, attnplan.hf.NAME)
    _generate(model, ids[:, :4], 2)  # this thread's wrapper exists (planned for 5 tokens)
    w = attnplan.hf._STEP.last.wrapper
    assert w.ctx.config.split.merge == "fused"  # host-bound eager steps: one launch per layer (the default is auto)
    misses = w.ctx.cache.stats.misses
    plans.clear()
    _generate(model, ids, n_new)
    lengths = list(range(prompt + 1, prompt + n_new))
    assert plans == lengths, "a plan per step, on its first layer"
    assert w.ctx.cache.stats.misses - misses <= len({len_bucket(n) for n in lengths}) < len(lengths)
    assert layers > 1


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_verification_step_of_several_tokens_equals_sdpa(cache, gen):
    """A forward of 4 new tokens over a cache of 20 (speculative verification): the mask comes with it, so the
    lengths are read from its last row and query i sees the positions before it and itself."""
    from transformers import DynamicCache, StaticCache

    attnplan.hf.register()
    ids = _ids(TINY["vocab_size"], (1, 24), gen)
    logits = {}
    for attn in ("sdpa", attnplan.hf.NAME):
        m = _model(TINY, DEVICE, torch.float32, attn)
        kv = DynamicCache(config=m.config) if cache == "dynamic" else StaticCache(config=m.config, max_cache_len=64)
        with torch.no_grad():
            m(ids[:, :20], cache=kv, use_cache=True)
            before = attnplan.hf.STATS["attnplan"]
            logits[attn] = m(ids[:, 20:], cache=kv, use_cache=True).logits
            served = attnplan.hf.STATS["attnplan"] - before
    assert served == TINY["num_hidden_layers"], served  # attnplan served the 4-token step in every layer
    _assert_logits_close(logits[attnplan.hf.NAME], logits["sdpa"])


def test_padded_batch_falls_back_and_unpadded_batch_is_served(gen):
    """Batch 2, left-padded: the mask may hold padding, so SDPA serves every call (the tokens equal SDPA's);
    batch 2 without padding: no mask at decode, attnplan serves the decode steps."""
    attnplan.hf.register()
    ids = _ids(TINY["vocab_size"], (2, 11), gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # the second sequence is 7 tokens, left-padded
    ref, _ = _generate(_model(TINY, DEVICE, torch.float32, "sdpa"), ids, 6, mask=mask)
    before = dict(attnplan.hf.STATS)
    got, _ = _generate(_model(TINY, DEVICE, torch.float32, attnplan.hf.NAME), ids, 6, mask=mask)
    assert torch.equal(got, ref)
    assert attnplan.hf.STATS["attnplan"] == before["attnplan"]
    ref, ref_logits = _generate(_model(TINY, DEVICE, torch.float32, "sdpa"), ids, 6)
    before = dict(attnplan.hf.STATS)
    got, logits = _generate(_model(TINY, DEVICE, torch.float32, attnplan.hf.NAME), ids, 6)
    assert torch.equal(got, ref) and attnplan.hf.STATS["attnplan"] - before["attnplan"] == 5 * 2
    _assert_logits_close(logits, ref_logits)


class _Attn(torch.nn.Module):
    """What transformers' attention functions read of the attention module (a GQA group of 2)."""

    is_causal = True
    num_key_value_groups = 2

    def __init__(self, layer_idx=0):
        super().__init__()
        self.layer_idx = layer_idx
        self.eval()


def _prefix_mask(q_len, kv_len, length):
    """The causal-prefix mask ``[1, 1, q_len, kv_len]`` of ``length``: query i sees ``j < length - q_len + i + 1``."""
    stop = length - q_len + 1 + torch.arange(q_len).view(-1, 1)
    return (torch.arange(kv_len) < stop).view(1, 1, q_len, kv_len).to(DEVICE)


def _left_pad(m):
    m[..., :5] = False  # a batch-1 prompt whose first 5 tokens are padding


def _hole(m):
    m[..., 10] = False  # one masked token in the middle


def _tree(m):
    m[0, 0, 2, 22] = False  # speculative tree: draft 2 does not see draft 1 (L = 24, q_len 3: drafts at 21, 22, 23)


@pytest.mark.parametrize("q_len,change,served", [
    (1, None, True), (3, None, True),  # the causal prefix of the last row's count: attnplan's
    (1, _left_pad, False), (1, _hole, False), (3, _tree, False),  # anything else: SDPA's
])
def test_batch1_mask_is_served_only_when_it_is_the_causal_prefix(q_len, change, served, gen):
    """A batch-1 boolean mask is served by attnplan only if it equals the causal-prefix mask of its last row's count;
    any other (left padding, a hole, a tree mask at q_len 3) goes to SDPA, so the result equals SDPA's. (Taking every
    batch-1 mask for a prefix put these 1.04, 0.23 and 1.2 off.)"""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attnplan.hf.register()
    mask = _prefix_mask(q_len, 32, 24)
    if change is not None:
        change(mask)
    q = torch.randn(1, 4, q_len, 32, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, 2, 32, 32, generator=gen).to(DEVICE) for _ in range(2))
    before = dict(attnplan.hf.STATS)
    got, _ = attnplan.hf.attnplan_attention_forward(_Attn(), q, k, v, mask)
    assert attnplan.hf.STATS["attnplan"] - before["attnplan"] == int(served)
    assert attnplan.hf.STATS["sdpa_fallback"] - before["sdpa_fallback"] == int(not served)
    ref, _ = sdpa_attention_forward(_Attn(), q, k, v, mask)
    _assert_logits_close(got, ref)


@pytest.mark.parametrize("kv_len", [8, 64])
def test_a_prefill_with_a_mask_goes_to_sdpa(kv_len, gen):
    """A batch-1 prefill into an empty cache that comes with a boolean causal mask (models that always build one,
    e.g. Falcon) goes to SDPA, as an unmasked prefill does: a DynamicCache's key of the prompt's length (8) and a
    StaticCache's of its capacity (64), the mask's last row counting the prompt's 8 tokens; only steps over a cache
    that holds earlier tokens are attnplan's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attnplan.hf.register()
    q = torch.randn(1, 4, 8, 32, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, 2, kv_len, 32, generator=gen).to(DEVICE) for _ in range(2))
    mask = _prefix_mask(8, kv_len, 8)
    before = dict(attnplan.hf.STATS)
    got, _ = attnplan.hf.attnplan_attention_forward(_Attn(), q, k, v, mask)
    assert attnplan.hf.STATS["attnplan"] == before["attnplan"]
    assert attnplan.hf.STATS["sdpa_fallback"] - before["sdpa_fallback"] == 1
    _assert_logits_close(got, sdpa_attention_forward(_Attn(), q, k, v, mask)[0])


def test_each_stream_of_a_thread_has_its_own_wrapper(gen, monkeypatch):
    """Eager steps of one thread on two streams (a draft and a target model, unsynchronized) run two wrappers with
    two workspaces, each planned once; switching back reuses the stream's own, and every output equals SDPA's."""
    attnplan.hf.register()
    attnplan.hf._STEP.__dict__.clear()
    streams = iter([111, 222, 111, 222])
    monkeypatch.setattr(attnplan.hf, "_stream_of", lambda dev: next(streams))
    monkeypatch.setattr(attnplan.hf, "_repeat", lambda *a: None)  # every call takes the stream's wrapper
    plans = []
    real = attnplan.DecodeWrapper.plan
    monkeypatch.setattr(attnplan.DecodeWrapper, "plan", lambda self, *a, **kw: plans.append(id(self)) or real(
        self, *a, **kw))
    used = []
    for _ in range(4):
        q, k, v = _layer_tensors(gen)
        _assert_logits_close(_eager_layer(q, k, v), _sdpa_ref(q, k, v))
        used.append(attnplan.hf._STEP.last.wrapper)
    assert used[0] is used[2] and used[1] is used[3] and used[0] is not used[1]
    assert used[0].workspace is not used[1].workspace
    assert plans == [id(used[0]), id(used[1])]
    # a thread cycling through more streams keeps the wrappers of the last STREAM_STEPS only
    streams = iter(range(1000, 1000 + attnplan.hf.STREAM_STEPS + 3))
    for _ in range(attnplan.hf.STREAM_STEPS + 3):
        q, k, v = _layer_tensors(gen)
        _eager_layer(q, k, v)
    assert len(attnplan.hf._STEP.by_stream) == attnplan.hf.STREAM_STEPS


class _SlidingClass(_Attn):
    sliding_window = 8


class _SlidingProperty(_Attn):
    @property
    def sliding_window(self):
        return 8


class _NoWindowProperty(_Attn):
    @property
    def sliding_window(self):
        return None


def _sliding_instance():
    m = _Attn()
    m.sliding_window = 8
    return m


def _not_causal_instance():
    m = _Attn()
    m.is_causal = False
    return m


@pytest.mark.parametrize("make,served", [
    (_Attn, True), (_NoWindowProperty, True),
    (_SlidingClass, False), (_SlidingProperty, False), (_sliding_instance, False), (_not_causal_instance, False),
])
def test_module_attributes_are_read_wherever_they_are_defined(make, served, gen):
    """The attention module's ``sliding_window`` and ``is_causal`` are read from the instance, its class or a
    property: a sliding window or a non-causal module goes to SDPA, anything else is attnplan's (an unmasked decode
    call)."""
    attnplan.hf.register()
    q = torch.randn(1, 4, 1, 32, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, 2, 20, 32, generator=gen).to(DEVICE) for _ in range(2))
    before = dict(attnplan.hf.STATS)
    attnplan.hf.attnplan_attention_forward(make(), q, k, v, None)
    assert attnplan.hf.STATS["attnplan"] - before["attnplan"] == int(served)
    assert attnplan.hf.STATS["sdpa_fallback"] - before["sdpa_fallback"] == int(not served)


def _layer_tensors(gen, kv=20, dtype=torch.float32, q_offset=0, kv_room=0):
    """One layer's attention inputs as transformers makes them: query ``[1, 4, 1, 32]`` a transposed view of the
    projection's ``[1, 1, 4, 32]`` (starting ``q_offset`` elements into its storage), key and value ``[1, 2, kv, 32]``
    (a DynamicCache's tensors; ``kv_room`` > 0: key alone a view of a longer buffer, of other strides)."""
    raw = torch.randn(q_offset + 4 * 32, generator=gen, dtype=dtype).to(DEVICE)
    q = raw[q_offset:].view(1, 1, 4, 32).transpose(1, 2)
    k = torch.randn(1, 2, kv + kv_room, 32, generator=gen, dtype=dtype).to(DEVICE)[:, :, :kv]
    v = torch.randn(1, 2, kv, 32, generator=gen, dtype=dtype).to(DEVICE)
    return q, k, v


def _sdpa_ref(q, k, v, scaling=None):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(_Attn(), q, k, v, None, scaling=scaling)[0]


class _DirectSpy:
    """Records every ``launch_direct`` of the eager step's bound launches as ``(route, data pointers, out's shape,
    strides and dtype, lse)``, route ``"repeat"`` from :func:`attnplan.hf._repeat` and ``"verified"`` from
    ``run()`` / ``try_run()``. A repeat answers ``repeat_answer`` without launching where it is given (the
    interpreter has no direct launches); every other call goes to the real method."""

    def __init__(self, monkeypatch, launcher, repeat_answer=None):
        self.calls, real, real_repeat = [], type(launcher).launch_direct, attnplan.hf._repeat
        inside = []

        def spy(bl, ptrs, out, lse):
            route = "repeat" if inside else "verified"
            self.calls.append((route, ptrs, tuple(out.shape), out.stride(), out.dtype, lse))
            if inside and repeat_answer is not None:
                return repeat_answer
            return real(bl, ptrs, out, lse)

        def repeat(*a):
            inside.append(1)
            try:
                return real_repeat(*a)
            finally:
                inside.pop()

        monkeypatch.setattr(type(launcher), "launch_direct", spy)
        monkeypatch.setattr(attnplan.hf, "_repeat", repeat)

    def routes(self):
        return [c[0] for c in self.calls]


def _eager_layer(q, k, v, scaling=None):
    out, _ = attnplan.hf.attnplan_attention_forward(_Attn(), q, k, v, None, scaling=scaling)
    return out


@pytest.mark.parametrize("change", ["none", "key strides", "query alignment", "scale", "dtype", "negated key"])
def test_a_layer_repeating_the_verified_signature_launches_the_same_arguments(change, gen, monkeypatch):
    """An eager decode layer whose query, key and value repeat the raw shapes, strides, dtype, device and alignment of
    the last verified call (and its scale) launches through the bound launch's direct path with exactly the arguments
    the verified path (``try_run()``) gives the same tensors: the data pointers of query, key, value, the step's
    lengths and no table, a fresh contiguous ``[1, 1, 4, 32]`` output, no lse, and no ``try_run()``. A layer that
    differs in any of them takes the verified path (``try_run()``, else ``plan()``) and equals SDPA; one whose key
    is a lazily negated view of the same signature goes to SDPA."""
    attnplan.hf.register()
    attnplan.hf._STEP.__dict__.clear()
    q, k, v = _layer_tensors(gen)
    _assert_logits_close(_eager_layer(q, k, v), _sdpa_ref(q, k, v))  # plans; the launch is prepared
    w = attnplan.hf._STEP.last.wrapper
    spy = _DirectSpy(monkeypatch, w._launcher, repeat_answer=True)
    tried = []  # the verified path: try_run(), or plan() where the scale changed
    for name in ("try_run", "plan"):
        real_method = getattr(attnplan.DecodeWrapper, name)
        monkeypatch.setattr(attnplan.DecodeWrapper, name, lambda self, *a, _m=real_method, _n=name, **kw: tried.append(
            _n) or _m(self, *a, **kw))
    kw = {}
    if change == "none":
        q2, k2, v2 = _layer_tensors(gen)
    elif change == "key strides":
        q2, k2, v2 = _layer_tensors(gen, kv_room=8)
    elif change == "query alignment":
        q2, k2, v2 = _layer_tensors(gen, q_offset=1)
    elif change == "scale":
        q2, k2, v2 = _layer_tensors(gen)
        kw = {"scaling": 0.3}
    elif change == "negated key":  # the raw signature of the last call, but a pending negation
        q2, k2, v2 = _layer_tensors(gen)
        k2 = torch._neg_view(k2)
    else:
        q2, k2, v2 = _layer_tensors(gen, dtype=torch.float16)
    got = _eager_layer(q2, k2, v2, **kw)
    lens = attnplan.hf._STEP.last.seq_lens
    if change == "none":
        assert not tried and spy.routes() == ["repeat"]
        assert spy.calls[0][1:] == ((q2.data_ptr(), k2.data_ptr(), v2.data_ptr(), lens.data_ptr(), 0), (1, 1, 4, 32),
                                    (128, 128, 32, 1), torch.float32, None)
        # the verified path, given the same tensors, hands the bound launch the same arguments
        spy.calls.clear()
        w.try_run(q2.transpose(1, 2), k2.transpose(1, 2), v2.transpose(1, 2), lens, None,
                  out=torch.empty(1, 1, 4, 32, device=DEVICE))
        assert spy.routes() == ["verified"] and spy.calls[0][1:] == (
            (q2.data_ptr(), k2.data_ptr(), v2.data_ptr(), lens.data_ptr(), 0), (1, 1, 4, 32), (128, 128, 32, 1),
            torch.float32, None)
    elif change == "negated key":  # SDPA serves it (the kernels would read the memory without the negation)
        assert not spy.routes() and not tried, (spy.routes(), tried)
        _assert_logits_close(got, _sdpa_ref(q2, k2.resolve_neg(), v2), q2.dtype)
    else:
        assert "repeat" not in spy.routes() and tried, spy.routes()
        _assert_logits_close(got, _sdpa_ref(q2, k2, v2, kw.get("scaling")), q2.dtype)


def test_a_direct_launch_that_is_not_ready_takes_the_verified_path(gen, monkeypatch):
    """Where the bound launch has no direct launch for the output (it answers ``False``: nothing launched), the
    layer goes through ``try_run()`` and its result equals SDPA's."""
    attnplan.hf.register()
    attnplan.hf._STEP.__dict__.clear()
    q, k, v = _layer_tensors(gen)
    _eager_layer(q, k, v)
    spy = _DirectSpy(monkeypatch, attnplan.hf._STEP.last.wrapper._launcher, repeat_answer=False)
    q2, k2, v2 = _layer_tensors(gen)
    got = _eager_layer(q2, k2, v2)
    assert spy.routes()[0] == "repeat", "the repeat was tried first"
    _assert_logits_close(got, _sdpa_ref(q2, k2, v2))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_repeated_layers_launch_directly_and_equal_sdpa_gpu(dtype, gen, monkeypatch):
    """On the GPU the layers after the first of a step really launch through the direct path (counted), and each
    result equals SDPA's within the dtype's tolerance."""
    attnplan.hf.register()
    attnplan.hf._STEP.__dict__.clear()
    q, k, v = _layer_tensors(gen, kv=300, dtype=dtype)
    _eager_layer(q, k, v)
    spy = _DirectSpy(monkeypatch, attnplan.hf._STEP.last.wrapper._launcher)
    for _ in range(3):
        q2, k2, v2 = _layer_tensors(gen, kv=300, dtype=dtype)
        _assert_logits_close(_eager_layer(q2, k2, v2), _sdpa_ref(q2, k2, v2), dtype)
    assert spy.routes() == ["repeat"] * 3


def test_calls_that_need_gradients_go_to_sdpa(gen):
    """attnplan computes no gradients: a decode call with grad mode on and a query that requires grad (a model
    trained with a cache) goes to SDPA, whose result carries the gradient; the same call under ``torch.no_grad()``
    is attnplan's."""
    attnplan.hf.register()
    q, k, v = _layer_tensors(gen)
    q = q.detach().requires_grad_()
    before = dict(attnplan.hf.STATS)
    got = _eager_layer(q, k, v)
    assert attnplan.hf.STATS["sdpa_fallback"] - before["sdpa_fallback"] == 1 and got.grad_fn is not None
    got.sum().backward()
    assert q.grad is not None
    with torch.no_grad():
        _eager_layer(q, k, v)
    assert attnplan.hf.STATS["attnplan"] - before["attnplan"] == 1


def test_float64_models_and_uneven_head_counts_go_to_sdpa(gen, monkeypatch):
    """What attnplan's kernels do not take goes to SDPA, as any call it does not serve: a float64 model (no kernel
    takes a float64 query) gets SDPA's result, and query heads that are not a whole multiple of the KV heads are
    handed to SDPA (whose own rules decide), never to a plan() that raises."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attnplan.hf.register()
    q = torch.randn(1, 4, 1, 32, generator=gen, dtype=torch.float64).to(DEVICE)
    k, v = (torch.randn(1, 2, 20, 32, generator=gen, dtype=torch.float64).to(DEVICE) for _ in range(2))
    before = dict(attnplan.hf.STATS)
    got, _ = attnplan.hf.attnplan_attention_forward(_Attn(), q, k, v, None)
    assert attnplan.hf.STATS["sdpa_fallback"] - before["sdpa_fallback"] == 1
    assert attnplan.hf.STATS["attnplan"] == before["attnplan"]
    torch.testing.assert_close(got, sdpa_attention_forward(_Attn(), q, k, v, None)[0], atol=0, rtol=0)

    handed = []
    monkeypatch.setattr(attnplan.hf, "_sdpa", lambda: lambda module, query, *a, **kw: handed.append(query.shape))
    q3 = torch.randn(1, 3, 1, 32, generator=gen).to(DEVICE)
    k2, v2 = (torch.randn(1, 2, 20, 32, generator=gen).to(DEVICE) for _ in range(2))
    attnplan.hf.attnplan_attention_forward(_Attn(), q3, k2, v2, None)
    assert handed == [q3.shape]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_batch1_left_padded_generate_equals_sdpa(cache, gen):
    """Greedy generation of one left-padded prompt: the decode steps' masks are not causal prefixes, so SDPA serves
    them (the tokens and logits equal SDPA's)."""
    attnplan.hf.register()
    ids = _ids(TINY["vocab_size"], (1, 15), gen)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    impl = None if cache == "dynamic" else "static"
    ref, ref_logits = _generate(_model(TINY, DEVICE, torch.float32, "sdpa"), ids, 6, impl, mask=mask)
    got, logits = _generate(_model(TINY, DEVICE, torch.float32, attnplan.hf.NAME), ids, 6, impl, mask=mask)
    assert torch.equal(got, ref)
    _assert_logits_close(logits, ref_logits)


class _Checks:
    """Counts the mask checks (``attnplan.hf._is_causal_prefix``: one device-to-host sync each)."""

    def __init__(self, monkeypatch):
        self.n, real = 0, attnplan.hf._is_causal_prefix

        def counting(*a):
            self.n += 1
            return real(*a)

        monkeypatch.setattr(attnplan.hf, "_is_causal_prefix", counting)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_mask_is_checked_once_per_forward_not_per_layer(mode, gen, monkeypatch):
    """StaticCache generation: transformers builds one mask per forward and hands it to every layer, so the check
    (a sync) runs once per decode step, whatever the number of layers (also for inference-mode tensors, which have
    no version counter: their verdict holds while the layer index rises)."""
    attnplan.hf.register()
    cfg = {**TINY, "num_hidden_layers": 3}
    ids = _ids(cfg["vocab_size"], (1, 9), gen)
    model = _model(cfg, DEVICE, torch.float32, attnplan.hf.NAME)
    checks, masked = _Checks(monkeypatch), _Counter(monkeypatch)
    with getattr(torch, mode)():
        _generate(model, ids, 6, "static")
    assert masked.n == 5 * 3 and checks.n == 5


@pytest.mark.parametrize("inference", [False, True])
def test_mask_changed_in_place_is_checked_again(inference, gen, monkeypatch):
    """The verdict is kept per mask tensor and its in-place version: a mask edited in place (a caller's buffer
    updated between steps) is checked again; an inference tensor (no version counter) is checked again when the
    layer index does not rise (a new forward)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attnplan.hf.register()
    checks = _Checks(monkeypatch)
    q = torch.randn(1, 4, 1, 32, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, 2, 32, 32, generator=gen).to(DEVICE) for _ in range(2))
    with torch.inference_mode(inference):
        mask = _prefix_mask(1, 32, 24)
        for layer in (0, 1):
            attnplan.hf.attnplan_attention_forward(_Attn(layer), q, k, v, mask)
        assert checks.n == 1
        _hole(mask)  # the same tensor, edited in place: no longer a prefix
        before = dict(attnplan.hf.STATS)
        got, _ = attnplan.hf.attnplan_attention_forward(_Attn(0), q, k, v, mask)
    assert checks.n == 2 and attnplan.hf.STATS["sdpa_fallback"] == before["sdpa_fallback"] + 1
    ref, _ = sdpa_attention_forward(_Attn(), q, k, v, mask)
    _assert_logits_close(got, ref)


@pytest.mark.parametrize("scaling", [0.0, -0.1, None])
def test_mask_path_honours_every_finite_scaling(scaling, gen):
    """The mask path (torch.ops.attnplan.decode) computes with the scaling it is given, 0 and negative ones included
    (the op once read ``<= 0`` as the default: 0.88 and 1.04 off SDPA); ``None`` is ``1/sqrt(head_dim)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attnplan.hf.register()
    mask = _prefix_mask(1, 32, 24)
    q = 4 * torch.randn(1, 4, 1, 32, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, 2, 32, 32, generator=gen).to(DEVICE) for _ in range(2))
    before = attnplan.hf.STATS["attnplan"]
    got, _ = attnplan.hf.attnplan_attention_forward(_Attn(), q, k, v, mask, scaling=scaling)
    assert attnplan.hf.STATS["attnplan"] == before + 1
    ref, _ = sdpa_attention_forward(_Attn(), q, k, v, mask, scaling=scaling)
    _assert_logits_close(got, ref)


def _static_forced(model, ids, tokens, forward=None):
    """Prefill ``ids`` eagerly into a StaticCache, then feed ``tokens`` ``[1, n]`` one per decode step through
    ``forward`` (default the model's own; teacher forcing, so runs in other dtypes see the same context): the
    decode steps' logits ``[n, vocab]`` fp32."""
    from transformers import StaticCache

    forward = forward or model.forward
    kv = StaticCache(config=model.config, max_cache_len=ids.shape[1] + tokens.shape[1] + 4)
    out = []
    with torch.no_grad():
        model(ids, cache=kv, use_cache=True)
        for i in range(tokens.shape[1]):
            pos = torch.tensor([[ids.shape[1] + i]], device=ids.device)
            out.append(forward(input_ids=tokens[:, i:i + 1], position_ids=pos, cache=kv, use_cache=True)
                       .logits[:, -1].float().clone())
    return torch.cat(out)


def test_static_cache_decode_step_traces_without_graph_breaks(gen):
    """The StaticCache decode step of the whole model under dynamo: one graph, no break, one attnplan op per layer;
    compiled with fullgraph=True (aot_eager), its decode steps' logits agree with eager SDPA's."""
    from transformers import StaticCache

    attnplan.hf.register()
    ids = _ids(TINY["vocab_size"], (1, 13), gen)
    m = _model(TINY, DEVICE, torch.float32, attnplan.hf.NAME)
    kv = StaticCache(config=m.config, max_cache_len=32)
    torch._dynamo.reset()
    with torch.no_grad():
        nxt = m(ids, cache=kv, use_cache=True).logits[:, -1:].argmax(-1)
        ex = torch._dynamo.explain(m.forward)(input_ids=nxt, position_ids=torch.tensor([[13]], device=DEVICE),
                                              cache=kv, use_cache=True)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
    ops = [n for g in ex.graphs for n in g.graph.nodes
           if n.op == "call_function" and n.target in (torch.ops.attnplan.decode, torch.ops.attnplan.decode.default)]
    assert len(ops) == TINY["num_hidden_layers"]

    torch._dynamo.reset()
    compiled = torch.compile(m.forward, fullgraph=True, backend="aot_eager")
    tokens = _ids(TINY["vocab_size"], (1, 5), gen)
    got = _static_forced(m, ids, tokens, compiled)
    ref = _static_forced(_model(TINY, DEVICE, torch.float32, "sdpa"), ids, tokens)
    _assert_logits_close(got, ref)
    torch._dynamo.reset()


@pytest.mark.gpu
def test_larger_llama_long_prompt_gpu(gen):
    cfg = dict(vocab_size=1000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=16,
               num_key_value_heads=4, head_dim=64, max_position_embeddings=8192)
    attnplan.hf.register()
    ids = _ids(cfg["vocab_size"], (1, 3000), gen)
    for cache in (None, "static"):
        ref, ref_logits = _generate(_model(cfg, "cuda", torch.float32, "sdpa"), ids, 16, cache)
        got, logits = _generate(_model(cfg, "cuda", torch.float32, attnplan.hf.NAME), ids, 16, cache)
        assert torch.equal(got, ref), cache
        torch.testing.assert_close(logits, ref_logits, atol=1e-3, rtol=1e-3)


GPU_CFG = dict(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, head_dim=64, max_position_embeddings=8192)


@pytest.mark.gpu
def test_compiled_static_generate_gpu(gen):
    """generate(cache_implementation="static") compiles the forward (mode="reduce-overhead") on a GPU: in fp32 its
    tokens with attnplan equal eager SDPA's, logits within 1e-3."""
    attnplan.hf.register()
    ids = _ids(GPU_CFG["vocab_size"], (1, 1500), gen)
    ref, ref_logits = _generate(_model(GPU_CFG, "cuda", torch.float32, "sdpa"), ids, 12, "static")
    torch._dynamo.reset()
    m = _model(GPU_CFG, "cuda", torch.float32, attnplan.hf.NAME)
    got, logits = _generate(m, ids, 12, "static", compile_=True)
    assert hasattr(m, "_compiled_call"), "generate did not compile the forward"
    torch._dynamo.reset()
    assert torch.equal(got, ref)
    torch.testing.assert_close(logits, ref_logits, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
def test_compiled_bf16_decode_logits_within_sdpa_noise_gpu(gen):
    """StaticCache decode steps compiled with fullgraph=True, mode="reduce-overhead", bf16, teacher-forced: attnplan's
    max |logits - fp32 SDPA logits| is at most twice compiled bf16 SDPA's (the measure the benchmark reports)."""
    attnplan.hf.register()
    ids = _ids(GPU_CFG["vocab_size"], (1, 1500), gen)
    tokens = _ids(GPU_CFG["vocab_size"], (1, 8), gen)
    fp32 = _static_forced(_model(GPU_CFG, "cuda", torch.float32, "sdpa"), ids, tokens)
    err = {}
    for attn in ("sdpa", attnplan.hf.NAME):
        torch._dynamo.reset()
        m = _model(GPU_CFG, "cuda", torch.bfloat16, attn)
        f = torch.compile(m.forward, fullgraph=True, mode="reduce-overhead")
        err[attn] = (_static_forced(m, ids, tokens, f) - fp32).abs().max().item()
    torch._dynamo.reset()
    assert err[attnplan.hf.NAME] <= 2 * err["sdpa"] + 1e-2, err


def _bench_hf():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_hf

    return bench_hf


@pytest.mark.skipif(HAS_CUDA, reason="the CPU exit")
def test_bench_hf_exits_on_the_cpu(capsys, tmp_path):
    out = tmp_path / "hf.json"
    assert _bench_hf().main(["--out", str(out)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err and not out.exists()


def test_bench_hf_table_shows_speedups_errors_and_the_op_check():
    """The printed summary from a results dict as the benchmark builds it: speedups sdpa / attnplan, the logits
    errors, the op check's ratio and worst error, and each failure's message."""
    res = {"points": {"1024": {"prompt": 1024, "eager_sdpa": {"median_ms": 51.5, "logits_err": 0.031},
                               "eager_attnplan": {"median_ms": 28.8, "logits_err": 0.029},
                               "compiled_sdpa": {"median_ms": 4.0, "logits_err": 0.03},
                               "compiled_attnplan": {"error": "RuntimeError: boom"}}},
           "op_check": {"1024": {"wrapper_us": 8.0, "op_graph_us": 8.1, "op_compiled_us": 8.2,
                                 "op_compiled_over_wrapper": 1.025, "sdpa_compiled_over_graph": 1.5,
                                 "op_compiled_host_us": 12.0, "sdpa_compiled_host_us": 11.0,
                                 "wrapper_chain_us": 7.5, "op_compiled_chain_us": 7.6,
                                 "op_compiled_chain_over_wrapper": 1.013,
                                 "max_err_at_other_lengths": {"wrapper": 0.004, "op_graph": 0.004,
                                                              "op_compiled": 0.006, "op_compiled_chain": 0.0}}}}
    text = _bench_hf().table(res)
    assert "| 1,024 | 51.50 | 28.80 | 1.79x | 4.00 | - | - |" in text
    assert "| 1,024 | 0.031 | 0.029 | 0.03 | - |" in text
    assert "| 1,024 | 8.00 | 8.10 | 8.20 | 1.025 | 1.500 | 12.00 / 11.00 | 7.50 | 7.60 | 1.013 | 0.006 |" in text
    assert "1024 compiled_attnplan: RuntimeError: boom" in text


def test_bench_hf_alternates_the_implementations_token_by_token(monkeypatch):
    """The benchmark's eager runs of a tiny model on the CPU: both implementations time every token, in an order
    swapped each token (so a change in the host's load moves both), each on its own model copy and cache; the
    speedup is the median of the per-token ratios; the logits error is against the fp32 reference; the table shows
    the median with its range."""
    import argparse

    b = _bench_hf()
    monkeypatch.setattr(b, "DEVICE", "cpu")
    monkeypatch.setattr(b, "MODEL", {**TINY, "max_position_embeddings": 64})
    attnplan.hf.register()
    calls = []
    real = b.prefill

    def counting_prefill(model, ids, cache, chunk=None):
        calls.append(("prefill", model.config._attn_implementation, id(model), id(cache)))
        return real(model, ids, cache, chunk)

    monkeypatch.setattr(b, "prefill", counting_prefill)
    fp32, bf16 = b.build_models(TINY["num_hidden_layers"])
    args = argparse.Namespace(warmup=1, keep=2, new_tokens=4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, TINY["vocab_size"], (1, 9), generator=gen)
    tokens = torch.randint(1, TINY["vocab_size"], (1, 5), generator=gen)
    order = []
    real_forward = type(bf16).forward

    def logged_forward(self, *a, **kw):
        order.append(self.config._attn_implementation)
        return real_forward(self, *a, **kw)

    monkeypatch.setattr(type(bf16), "forward", logged_forward)
    pt: dict = {}
    ref = torch.zeros(2, TINY["vocab_size"])
    against = []
    real_err = b.max_err
    monkeypatch.setattr(b, "max_err", lambda got, want: against.append(want) or real_err(got, want))
    b.paired_steps(args, bf16, ids, tokens, 9, ref, pt, compiled=False)
    assert len(against) == len(b.IMPLS) and all(w is ref for w in against)  # each error is against the reference
    # the two prefills, then five tokens in alternating order
    assert order == ["sdpa", "attnplan"] + ["sdpa", "attnplan", "attnplan", "sdpa"] * 2 + ["sdpa", "attnplan"]
    assert len({c[2] for c in calls}) == 2 and len({c[3] for c in calls}) == 2  # own model and cache each
    for impl in b.IMPLS:
        r = pt[f"eager_{impl}"]
        assert len(r["step_ms"]) == 4 and r["median_ms"] > 0 and r["logits_err"] > 0
    sp = pt["eager_speedup"]
    ratios = [x / y for x, y in zip(pt["eager_sdpa"]["step_ms"], pt["eager_attnplan"]["step_ms"])]
    assert sp["tokens"] == 4 and sp["min"] == min(ratios) and sp["max"] == max(ratios)
    assert sp["median"] == statistics.median(ratios)
    for impl in b.IMPLS:
        assert pt[f"eager_{impl}"]["median_ms"] == statistics.median(pt[f"eager_{impl}"]["step_ms"])
    for impl in b.IMPLS:  # every layer's attention call of the timed tokens, timed on the host
        h = pt[f"eager_{impl}"]["attn_host_us"]
        assert h["calls"] == 4 * TINY["num_hidden_layers"] and h["median_call"] > 0 and h["per_token"] > 0
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    assert ALL_ATTENTION_FUNCTIONS[attnplan.hf.NAME] is attnplan.hf.attnplan_attention_forward  # restored
    text = b.table({"points": {"9": pt}, "op_check": {}})
    assert f"{sp['median']:.3f}x ({sp['min']:.2f}-{sp['max']:.2f})" in text
    h = pt["eager_attnplan"]["attn_host_us"]
    assert f"| {h['median_call']:.1f} |" in text and f"| {h['per_token']:.0f} |" in text
    del fp32


def test_register_without_transformers_names_the_extra(monkeypatch):
    """``register()`` with transformers missing: an ImportError that says which extra to install."""
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes ``from transformers import ...`` fail
    with pytest.raises(ImportError, match=r"pip install 'attnplan\[hf\]'"):
        attnplan.hf.register()


def _generate_both(model, ids, n, cache=None):
    """Greedy ``n`` tokens with the model's eager attention, then with attnplan's: both ``(tokens, logits)`` and the
    change in :data:`attnplan.hf.STATS` over the second run."""
    model.config._attn_implementation = "eager"
    ref = _generate(model, ids, n, cache=cache)
    model.config._attn_implementation = "attnplan"
    before = dict(attnplan.hf.STATS)
    got = _generate(model, ids, n, cache=cache)
    return ref, got, {k: attnplan.hf.STATS[k] - before[k] for k in before}


@pytest.mark.parametrize("cache", [None, "static"])
def test_soft_capped_model_generates_as_its_eager_attention(cache, gen):
    """A Gemma-2-style model passes ``softcap=``, which SDPA refuses (it raised ValueError at the first forward).
    With a DynamicCache its full-attention layers' decode steps are attnplan's, with the soft cap; every other call
    (prefill, the sliding-window layers, a StaticCache's masked steps) goes to the model's own eager attention, with
    the boolean mask SDPA's mask function gives turned additive (and SDPA's implicit causal mask built where it gives
    none: a StaticCache prefill). Generation equals the eager model's: the same tokens, the logits within fp32
    rounding (exactly, where every call is eager)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    attnplan.hf.register()
    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                       sliding_window=8, attn_logit_softcapping=0.05, final_logit_softcapping=None)
    model = Gemma2ForCausalLM(cfg).to(DEVICE).eval()
    ids = _ids(128, (1, 20), gen)
    (ref, ref_logits), (got, got_logits), stats = _generate_both(model, ids, 4, cache)
    assert torch.equal(got, ref)
    if cache is None:  # layer 1 (full attention) serves the 3 decode steps
        _assert_logits_close(got_logits, ref_logits)
        assert stats == {"attnplan": 3, "sdpa_fallback": 0, "eager_fallback": 4 * 2 - 3}
    else:
        assert torch.equal(got_logits, ref_logits)
        assert stats == {"attnplan": 0, "sdpa_fallback": 0, "eager_fallback": 4 * 2}


def test_soft_capped_decode_call_is_attnplans_with_the_cap(gen):
    """An eager decode call with ``softcap=`` (no mask: a DynamicCache step) runs attnplan with that soft cap, the
    scores large enough that the cap changes the result: it equals Gemma-2's eager attention with the cap and is far
    from the result without it; repeated layers (the launch repeated without the check) keep the cap apart from a
    call with another cap."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    attnplan.hf.register()
    q = (4 * torch.randn(1, 4, 1, 32, generator=gen)).to(DEVICE)
    k, v = (torch.randn(1, 2, 20, 32, generator=gen).to(DEVICE) for _ in range(2))
    mod = _Attn()
    for cap in (1.0, 1.0, 3.0):
        before = attnplan.hf.STATS["attnplan"]
        got, _ = attnplan.hf.attnplan_attention_forward(mod, q, k, v, None, scaling=0.5, softcap=cap)
        assert attnplan.hf.STATS["attnplan"] == before + 1
        ref, _ = eager_attention_forward(mod, q, k, v, None, scaling=0.5, softcap=cap)
        _assert_logits_close(got, ref)
        uncapped, _ = eager_attention_forward(mod, q, k, v, None, scaling=0.5)
        assert (got - uncapped).abs().max() > 0.05
    # a cap attnplan does not take (a bool, a tensor, 0) goes to the module's eager attention; this test module has
    # none, so the call is refused by name
    before = dict(attnplan.hf.STATS)
    for bad in (True, torch.tensor(1.0), 0.0):
        with pytest.raises(NotImplementedError, match="softcap=.*no eager_attention_forward"):
            attnplan.hf.attnplan_attention_forward(mod, q, k, v, None, scaling=0.5, softcap=bad)
    assert attnplan.hf.STATS["attnplan"] == before["attnplan"]


def test_model_with_attention_sinks_runs_its_own_eager_attention(gen):
    """gpt-oss passes its sink logits as ``s_aux=``, which SDPA ignores silently (logits 0.23 off): the calls go to
    the model's eager attention and generation equals its eager generation exactly."""
    from transformers import GptOssConfig, GptOssForCausalLM

    attnplan.hf.register()
    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, max_position_embeddings=256, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"],
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = GptOssForCausalLM(cfg).to(DEVICE).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(generator=None)
    ids = _ids(128, (1, 12), gen)
    (ref, ref_logits), (got, got_logits), stats = _generate_both(model, ids, 3)
    assert torch.equal(got, ref) and torch.equal(got_logits, ref_logits)
    assert stats == {"attnplan": 0, "sdpa_fallback": 0, "eager_fallback": 3 * 2}


@pytest.mark.parametrize("name", ["indices", "block_indices"])
def test_sparse_attention_calls_are_refused_naming_the_argument(name, gen):
    """Sparse attention over selected positions (DeepSeek-V3.2-style top-k ``indices=``) is computed by neither
    attnplan nor SDPA (dense attention instead put logits 0.3-0.4 off): the call raises, naming the argument."""
    attnplan.hf.register()
    q = torch.randn(1, 4, 1, 32, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, 2, 20, 32, generator=gen).to(DEVICE) for _ in range(2))
    with pytest.raises(NotImplementedError, match=f"{name}="):
        attnplan.hf.attnplan_attention_forward(_Attn(), q, k, v, None, **{name: torch.zeros(1, 1, 4, dtype=torch.long)})
    attnplan.hf.attnplan_attention_forward(_Attn(), q, k, v, None, **{name: None})  # None: plain attention


def test_a_strided_head_dim_goes_to_sdpa(gen):
    """A key whose head_dim is strided goes to SDPA (it raised attnplan's argument error, naming attnplan's
    ``k_cache`` rather than anything of the model's)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attnplan.hf.register()
    q = torch.randn(1, 4, 1, 32, generator=gen).to(DEVICE)
    k = torch.randn(1, 2, 20, 64, generator=gen).to(DEVICE)[..., ::2]
    v = torch.randn(1, 2, 20, 32, generator=gen).to(DEVICE)
    before = dict(attnplan.hf.STATS)
    got, _ = attnplan.hf.attnplan_attention_forward(_Attn(), q, k, v, None)
    assert attnplan.hf.STATS["sdpa_fallback"] - before["sdpa_fallback"] == 1
    ref, _ = sdpa_attention_forward(_Attn(), q, k, v, None)
    _assert_logits_close(got, ref)


@pytest.mark.parametrize("arch, served", [
    ("llama", [True, True]), ("qwen2", [True, True]), ("llama4-chunked", [False, True]), ("phimoe", [False, False])])
def test_layers_sliding_or_chunked_by_their_config_are_not_served(arch, served):
    """A layer whose window or chunk lives only in the config and the mask (Llama-4's chunked layers, PhiMoE's sliding
    window: their attention modules carry no ``sliding_window``) goes to SDPA: under ``torch.compile`` attnplan takes
    a batch-1 mask to be a causal prefix, which theirs is not (measured on CPU, a 2-layer model of each compiled with
    aot_eager: logits 0.44 / 0.17 from SDPA's before, within 1e-7 after). Full-attention layers stay served."""
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.llama4.modeling_llama4 as llama4
    import transformers.models.phimoe.modeling_phimoe as phimoe
    import transformers.models.qwen2.modeling_qwen2 as qwen2

    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2)
    cls, cfg = {
        "llama": (llama.LlamaAttention, transformers.LlamaConfig(**small)),
        "qwen2": (qwen2.Qwen2Attention, transformers.Qwen2Config(**small)),
        "llama4-chunked": (llama4.Llama4TextAttention, transformers.Llama4TextConfig(
            **small, attention_chunk_size=4, layer_types=["chunked_attention", "full_attention"],
            no_rope_layers=[1, 0])),
        "phimoe": (phimoe.PhimoeAttention, transformers.PhimoeConfig(**small, sliding_window=6)),
    }[arch]
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 9, 16)
    for idx, want in enumerate(served):
        module = cls(cfg, idx).eval()
        assert getattr(module, "sliding_window", None) is None  # the module alone does not say so
        assert attnplan.hf._serves(module, q, k, k, 0.0, {}) is want, (arch, idx)


@pytest.mark.parametrize("bad,error", [(True, TypeError), (torch.tensor(1.0), TypeError),
                                       (torch.tensor([1.0, 1.0]), TypeError), (float("nan"), ValueError),
                                       (1e-45, ValueError)])
def test_a_bad_scaling_is_refused_after_a_served_call_of_the_same_value_and_not_counted(bad, error, gen):
    """A scaling the op refuses is refused whatever the thread's last call was: the eager step remembers the last
    call's scale and compares by value, where ``True == 1.0`` and ``tensor(1.) == 1.0``. A refused call is not
    counted in ``STATS``; an int scaling is served as its float."""
    attnplan.hf.register()
    q, k, v = _layer_tensors(gen)
    with torch.no_grad():
        ref = _eager_layer(q, k, v, scaling=1.0)  # warm: the step's memo now holds the scale 1.0
        before = dict(attnplan.hf.STATS)
        with pytest.raises(error):
            _eager_layer(q, k, v, scaling=bad)
        assert dict(attnplan.hf.STATS) == before
        assert torch.equal(_eager_layer(q, k, v, scaling=1), ref)
        assert attnplan.hf.STATS["attnplan"] - before["attnplan"] == 1
