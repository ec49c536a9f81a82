"""Codecs: shapes and dtypes survive, byte counts match their formulas, and each codec does what its paper says."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fast.codecs import CODECS, DGC, ErrorFeedback, PowerSGD, Sign, build_codec, codec_options
from fast.codecs.frame import CODEC_IDS, unpack_frame
from fast.codecs.sparsify import largest_magnitudes, random_indices
from fast.errors import ConfigError

PROPERTY = settings(max_examples=25, deadline=None)
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
LOSSY_WITH_ERROR_FEEDBACK = ["uint8", "qsgd", "terngrad", "sign", "topk", "randomk", "threshold", "fp16", "powersgd"]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1.3e-6, atol: float = 1e-5) -> None:
    """Like torch.testing.assert_close (whose first call imports torch.distributed, seconds), for tensors."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual, expected)
    assert torch.allclose(actual, expected, rtol=rtol, atol=atol), (actual - expected).abs().max()


def header(ndim: int) -> int:
    return 16 + 8 * ndim  # magic, version, codec, dtype, ndim, shape, body length


def crc() -> int:
    return 4


def index_bytes(numel: int) -> int:
    return 1 if numel <= 2**8 else 2 if numel <= 2**16 else 4


def random_tensor(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@PROPERTY
@given(
    name=st.sampled_from(CODECS),
    dtype=st.sampled_from(FLOATS),
    shape=st.lists(st.integers(0, 9), max_size=4).map(tuple),
    seed=st.integers(0, 1000),
)
def test_decode_of_encode_has_the_input_shape_and_dtype(name, dtype, shape, seed):
    codec = build_codec(name)
    x = random_tensor(shape, dtype, seed)
    for _ in range(2):  # the second step exercises the state of stateful codecs
        decoded = codec.decode(codec.encode(x, key="w"))
        assert decoded.shape == x.shape and decoded.dtype == x.dtype
        assert bool(torch.isfinite(decoded).all())


@pytest.mark.parametrize("name", CODECS)
def test_compress_is_what_the_receiver_decodes(name):
    sender = build_codec(name, seed=3)
    receiver = build_codec(name, seed=99)
    x = random_tensor((30, 20), seed=1)
    for step in range(3):
        frame, seen = sender.encode_and_decode(x + step, key="w")
        assert torch.equal(receiver.decode(frame), seen)


@pytest.mark.parametrize("name", CODECS)
def test_strided_inputs_encode_like_their_contiguous_copies(name):
    x = random_tensor((20, 30)).T
    assert not x.is_contiguous()
    strided, contiguous = build_codec(name, seed=4), build_codec(name, seed=4)
    for _ in range(2):
        assert torch.equal(strided.encode(x, key="w"), contiguous.encode(x.contiguous(), key="w"))


def expected_frame_bytes(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Each codec's byte formula, written out independently of the codecs."""
    n = math.prod(shape)
    size = dtype.itemsize
    k = max(1, math.ceil(0.01 * n))
    body = {
        "none": n * size,
        "fp16": 2 * n,
        "bf16": 2 * n,
        "uint8": 4 + 4 + n,
        "qsgd": 4 * math.ceil(n / 512) + math.ceil(4 * n / 8),  # 7 levels: 3 bits and a sign bit
        "terngrad": 4 + math.ceil(2 * n / 8),
        "sign": 4 + math.ceil(n / 8),
        "ef-sign": 4 + math.ceil(n / 8),
        "signum": math.ceil(n / 8),
        "topk": 8 + k * (size + index_bytes(n)),
        "randomk": 8 + k * size,
        "dgc": 8 + max(1, math.ceil(0.25 * n)) * (size + index_bytes(n)),  # epoch 0 of the warm-up
    }.get(name)
    if name == "powersgd":
        rows, columns = shape[0], n // shape[0]
        body = 4 * (rows + columns) * 1 if len(shape) >= 2 and rows + columns < rows * columns else n * size
    if name in ("chunk-topk", "dct-topk"):
        blocks, size_of_block = chunked_blocks(shape)
        kept = blocks * min(size_of_block, max(1, round(size_of_block / 32)) if name == "chunk-topk" else 32)
        indices = bits_in_bytes(kept, max(1, (size_of_block - 1).bit_length()))
        body = 4 + 4 * 4 + indices + math.ceil(2 * kept / 8) if name == "chunk-topk" else 4 * kept + indices
    return header(len(shape)) + body + crc()


def chunked_blocks(shape: tuple[int, ...], chunk: int = 64) -> tuple[int, int]:
    """How many blocks a chunked codec cuts a tensor into, and their size: the tensor as (first dim, the rest);
    a side up to `chunk` whole, else in pieces of its largest divisor up to `chunk` if at least chunk / 2, else
    of `chunk` (padded)."""
    rows, cols = (1, math.prod(shape)) if len(shape) <= 1 else (shape[0], math.prod(shape[1:]))

    def side(s: int) -> int:
        divisor = max(d for d in range(1, min(s, chunk) + 1) if s % d == 0)
        return s if s <= chunk else divisor if 2 * divisor >= chunk else chunk

    return math.ceil(rows / side(rows)) * math.ceil(cols / side(cols)), side(rows) * side(cols)


def bits_in_bytes(count: int, width: int) -> int:
    """Bytes of `count` codes of `width` bits, stored in planes of 8, 4, 2 and 1 bits (12 = 8 + 4)."""
    planes = [plane for plane in (8, 4, 2, 1) if width & plane] if width <= 15 else [8, 8]
    return sum(math.ceil(count * plane / 8) for plane in planes)


SIZES = [(1,), (7,), (8,), (255,), (256,), (257,), (1000,), (65536,), (65537,), (100_000,), (3, 5), (64, 3, 5, 5)]


@pytest.mark.parametrize("name", [name for name in CODECS if name != "threshold"])
def test_byte_count_matches_the_formula(name):
    codec = build_codec(name)
    for shape in SIZES:
        for dtype in (torch.float32, torch.float16):
            frame = codec.encode(random_tensor(shape, dtype), key=f"{shape}{dtype}")
            expected = expected_frame_bytes(name, shape, dtype)
            assert frame.numel() == expected, (shape, dtype)
            assert codec.encoded_size(shape, dtype) == expected, (shape, dtype)


@pytest.mark.parametrize(
    ("levels", "bucket_size", "bytes_per_bucket_and_codes"),
    [
        (1, 0, lambda n: 4 + math.ceil(2 * n / 8)),
        (15, 512, lambda n: 4 * math.ceil(n / 512) + math.ceil(4 * n / 8) + math.ceil(n / 8)),  # 4 + 1 bits
        (127, 100, lambda n: 4 * math.ceil(n / 100) + n),
        (255, 512, lambda n: 4 * math.ceil(n / 512) + n + math.ceil(n / 8)),  # 8 + 1 bits
        (1000, 512, lambda n: 4 * math.ceil(n / 512) + n + math.ceil(2 * n / 8) + math.ceil(n / 8)),  # 8+2+1 bits
    ],
)
def test_qsgd_byte_count_matches_the_formula_for_other_levels(levels, bucket_size, bytes_per_bucket_and_codes):
    codec = build_codec("qsgd", levels=levels, bucket_size=bucket_size)
    for shape in SIZES:
        x = random_tensor(shape)
        frame = codec.encode(x)
        expected = header(len(shape)) + bytes_per_bucket_and_codes(x.numel()) + crc()
        assert frame.numel() == codec.encoded_size(shape) == expected, shape
        decoded = codec.decode(frame)
        assert decoded.shape == x.shape and bool((decoded.abs() <= x.norm() + 1e-3).all())


def test_threshold_byte_count_matches_the_formula():
    codec = build_codec("threshold", value=1.0)
    for shape in SIZES:
        x = random_tensor(shape)
        kept = int((x.abs() > 1.0).sum())
        frame = codec.encode(x)
        assert frame.numel() == header(len(shape)) + 8 + kept * (4 + index_bytes(x.numel())) + crc()
        assert codec.encoded_size(shape, kept=kept) == frame.numel()
    with pytest.raises(ValueError, match="kept"):
        codec.encoded_size((100,))


@PROPERTY
@given(
    values=st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=300),
    ratio=st.floats(0.001, 1.0),
)
def test_topk_keeps_exactly_the_k_largest_magnitudes(values, ratio):
    x = torch.tensor(values, dtype=torch.float32)
    k = max(1, math.ceil(ratio * x.numel()))
    codec = build_codec("topk", ratio=ratio)
    body = unpack_frame(codec.encode(x)).body
    assert int(body[:8].view(torch.int64)) == k
    decoded = codec.decode(codec.encode(x))
    kept = decoded != 0
    assert torch.equal(decoded[kept], x[kept])  # sent values are exact
    magnitudes = x.abs()
    kth_largest = magnitudes.sort(descending=True).values[k - 1]
    assert int((magnitudes > kth_largest).sum()) <= int(kept.sum()) <= k
    assert bool((magnitudes[kept] >= kth_largest).all())


@pytest.mark.parametrize("numel", [65_536, 1_000_003])
@pytest.mark.parametrize("layout", ["gaussian", "mostly_zero", "ties", "sorted"])
def test_large_topk_selection_is_exact(numel, layout):
    """The sampled-threshold path must agree with a full torch.topk, including on unfriendly inputs."""
    generator = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=generator)
    if layout == "mostly_zero":
        x[torch.rand(numel, generator=generator) < 0.999] = 0
    elif layout == "ties":
        x = torch.randint(-3, 4, (numel,), generator=generator).float()
    elif layout == "sorted":
        x = torch.linspace(-1, 1, numel) ** 3
    for count in (1, numel // 1000, numel // 20):
        chosen = largest_magnitudes(x, count)
        assert chosen.numel() == count and torch.equal(chosen, chosen.unique())
        reference = torch.topk(x.abs(), count).values
        assert torch.equal(x.abs()[chosen].sort(descending=True).values, reference)


def test_randomk_sends_the_seed_and_the_receiver_redraws_the_indices():
    x = random_tensor((5000,)) + 10  # no zeros, so every kept element is visible
    sender, receiver = build_codec("randomk", ratio=0.02, seed=1), build_codec("randomk", ratio=0.02, seed=2)
    first, second = sender.encode(x), sender.encode(x)
    for frame in (first, second):
        decoded = receiver.decode(frame)
        kept = decoded != 0
        assert int(kept.sum()) == 100 and torch.equal(decoded[kept], x[kept])
        assert frame.numel() == header(1) + 8 + 100 * 4 + crc()
    assert not torch.equal(receiver.decode(first) != 0, receiver.decode(second) != 0)
    assert torch.equal(build_codec("randomk", ratio=0.02, seed=1).encode(x), first)  # seeded


@pytest.mark.parametrize(("numel", "count"), [(50, 5), (50, 40), (1000, 10)])
def test_random_indices_are_distinct_and_uniform(numel, count):
    draws = torch.stack([random_indices(numel, count, seed) for seed in range(600)])
    assert all(row.unique().numel() == count for row in draws)
    hits = torch.bincount(draws.reshape(-1), minlength=numel).double()
    expected = 600 * count / numel
    # chi-square with numel - 1 degrees of freedom: far below its 99.99% quantile for a uniform draw
    chi_square = float(((hits - expected) ** 2 / expected).sum())
    assert chi_square < numel + 6 * math.sqrt(2 * numel)


def unbiased_tolerance(bound: torch.Tensor, draws: int) -> torch.Tensor:
    """6 standard deviations of a mean of `draws` values whose variance is at most bound ** 2 / 4."""
    return 6 * bound / (2 * math.sqrt(draws)) + 1e-6


def mean_of_tiled_decodes(codec, x: torch.Tensor, draws: int) -> torch.Tensor:
    """The mean of `draws` independent decodes of x, from one frame holding x `draws` times.

    Each copy is quantised with its own random numbers and the same scale (qsgd: one bucket per copy,
    terngrad: the same max |x|), so the copies are independent decodes of x; one frame keeps it fast.
    """
    tiled = x.repeat(draws)
    return codec.decode(codec.encode(tiled)).view(draws, x.numel()).mean(0)


@settings(max_examples=20, deadline=None)
@given(
    values=st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=1, max_size=12),
    levels=st.integers(1, 8),
)
def test_qsgd_is_unbiased(values, levels):
    x = torch.tensor(values)
    codec = build_codec("qsgd", levels=levels, bucket_size=x.numel(), seed=len(values))
    draws = 20_000
    mean = mean_of_tiled_decodes(codec, x, draws)
    step = torch.linalg.vector_norm(x) / levels  # the gap between the two levels an element rounds to
    assert bool(((mean - x).abs() <= unbiased_tolerance(step, draws)).all()), (mean, x)


@settings(max_examples=20, deadline=None)
@given(values=st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=1, max_size=12))
def test_terngrad_is_unbiased(values):
    x = torch.tensor(values)
    codec = build_codec("terngrad", seed=len(values))
    draws = 20_000
    scale = x.abs().max()
    assert set(codec.compress(x).tolist()) <= {0.0, float(scale), -float(scale)}
    mean = mean_of_tiled_decodes(codec, x, draws)
    assert bool(((mean - x).abs() <= unbiased_tolerance(scale, draws)).all()), (mean, x)


@pytest.mark.parametrize("name", ["qsgd", "terngrad"])
def test_mean_of_separate_decodes_approaches_the_input(name):
    x = torch.tensor([0.3, -1.7, 0.05, 2.2, -0.6, 0.0])
    codec = build_codec(name, levels=2, bucket_size=0) if name == "qsgd" else build_codec(name)
    draws = 400
    mean = sum(codec.decode(codec.encode(x)) for _ in range(draws)) / draws
    bound = torch.linalg.vector_norm(x) / 2 if name == "qsgd" else x.abs().max()
    assert bool(((mean - x).abs() <= unbiased_tolerance(bound, draws)).all()), mean
    nearest = codec.compress(x)  # one decode alone is far from x: the agreement comes from averaging
    assert float((nearest - x).abs().max()) > float(unbiased_tolerance(bound, draws))


def test_uint8_error_is_at_most_half_a_step():
    x = random_tensor((1000,)) * 5
    decoded = build_codec("uint8").decode(build_codec("uint8").encode(x))
    step = (x.max() - x.min()) / 255
    assert float((decoded - x).abs().max()) <= float(step) / 2 + 1e-5
    constant = torch.full((10,), 3.5)
    assert torch.equal(build_codec("uint8").compress(constant), constant)


def test_casts_match_torch():
    x = random_tensor((100,))
    assert torch.equal(build_codec("fp16").compress(x), x.half().float())
    assert torch.equal(build_codec("bf16").compress(x), x.bfloat16().float())
    assert torch.equal(build_codec("none").compress(x), x)
    integers = torch.arange(10)
    assert torch.equal(build_codec("none").decode(build_codec("none").encode(integers)), integers)
    with pytest.raises(TypeError, match="dtype"):
        build_codec("fp16").encode(integers)
    assert all(build_codec(name).summable for name in ("none", "fp16", "bf16"))
    assert not any(build_codec(name).summable for name in CODECS if name not in ("none", "fp16", "bf16"))


def test_sign_sends_signs_times_the_mean_magnitude():
    x = torch.tensor([-2.0, 0.0, 1.0, 3.0, -1.0])
    assert_close(build_codec("sign").compress(x), torch.tensor([-1.4, 1.4, 1.4, 1.4, -1.4]))


def test_signum_sends_the_sign_of_its_momentum():
    codec = build_codec("signum", momentum=0.5)
    first = codec.compress(torch.tensor([1.0, -1.0]), key="w")  # m = [0.5, -0.5]
    second = codec.compress(torch.tensor([-3.0, 2.0]), key="w")  # m = [-1.25, 0.75]
    assert first.tolist() == [1.0, -1.0] and second.tolist() == [-1.0, 1.0]
    assert torch.allclose(codec.momentum_buffer("w"), torch.tensor([-1.25, 0.75]))
    scaled = build_codec("signum", momentum=0.5, scale=True)
    assert scaled.compress(torch.tensor([2.0, -4.0])).tolist() == [1.5, -1.5]


@pytest.mark.parametrize("name", LOSSY_WITH_ERROR_FEEDBACK)
def test_error_feedback_keeps_what_was_not_sent(name):
    codec = build_codec(name, error_feedback=True, **({"value": 0.8} if name == "threshold" else {}))
    assert isinstance(codec, ErrorFeedback)
    inputs = [random_tensor((24, 10), seed=step) for step in range(5)]
    total_sent = torch.zeros(24, 10)
    for x in inputs:
        old = codec.residual("w").clone() if codec.residual("w") is not None else torch.zeros_like(x)
        sent = codec.decode(codec.encode(x, key="w"))
        new = codec.residual("w")
        assert_close(sent + new, x + old, rtol=1e-5, atol=1e-5)
        total_sent += sent
    assert_close(total_sent + codec.residual("w"), sum(inputs), rtol=1e-4, atol=1e-4)
    assert codec.residual("other") is None


def test_ef_sign_is_sign_plus_a_separate_memory():
    codec = build_codec("ef-sign")
    assert isinstance(codec, ErrorFeedback) and isinstance(codec.codec, Sign)
    x = torch.tensor([0.5, -0.1, 0.0, 0.2])
    frame = codec.encode(x, key="b")
    assert unpack_frame(frame).codec_id == CODEC_IDS["sign"]
    assert_close(codec.residual("b"), x - build_codec("sign").compress(x))
    with pytest.raises(ConfigError, match="use codec 'sign'"):
        build_codec("ef-sign", error_feedback=False)


def test_small_tensors_travel_raw():
    codec = build_codec("sign", min_elements=100)
    small, large = random_tensor((99,)), random_tensor((100,))
    small_frame = codec.encode(small)
    assert unpack_frame(small_frame).codec_id == CODEC_IDS["none"]
    assert torch.equal(codec.decode(small_frame), small)
    assert unpack_frame(codec.encode(large)).codec_id == CODEC_IDS["sign"]
    assert codec.encoded_size((99,)) == header(1) + 99 * 4 + crc()
    bias = random_tensor((50,))
    assert torch.equal(build_codec("powersgd").decode(build_codec("powersgd").encode(bias)), bias)


def test_registry_rejects_unknown_names_options_and_values():
    with pytest.raises(ConfigError, match="choose one of .*topk"):
        build_codec("zip")
    with pytest.raises(ConfigError, match="valid options are ratio"):
        build_codec("topk", rank=2)
    for name, options in [
        ("topk", {"ratio": 0}),
        ("topk", {"ratio": 1.5}),
        ("qsgd", {"levels": 0}),
        ("powersgd", {"rank": 1.5}),
        ("dgc", {"momentum": 1.0}),
        ("threshold", {"value": -1}),
        ("sign", {"min_elements": -1}),
        ("dgc", {"error_feedback": True}),
        ("sign", {"error_feedback": "yes"}),
    ]:
        with pytest.raises(ConfigError):
            build_codec(name, **options)
    assert "levels" in codec_options("qsgd") and "error_feedback" in codec_options("none")


@pytest.mark.parametrize("name", ["qsgd", "terngrad", "randomk", "powersgd"])
def test_stochastic_codecs_are_determined_by_their_seed(name):
    options = {"warm_start": False} if name == "powersgd" else {}
    x = random_tensor((40, 30))
    same = [build_codec(name, seed=5, **options).encode(x) for _ in range(2)]
    other = build_codec(name, seed=6, **options).encode(x)
    assert torch.equal(same[0], same[1]) and not torch.equal(same[0], other)


@pytest.mark.parametrize("name", ["signum", "dgc", "powersgd", "randomk", "qsgd", "ef-sign"])
def test_state_dict_resumes_exactly(name):
    inputs = [random_tensor((30, 20), seed=step) for step in range(4)]
    original = build_codec(name, seed=1)
    for x in inputs[:2]:
        original.encode(x, key="w")
    state = original.state_dict()
    resumed = build_codec(name, seed=1)
    resumed.load_state_dict(state)
    for x in inputs[2:]:
        assert torch.equal(original.encode(x, key="w"), resumed.encode(x, key="w"))


def reference_dgc(gradients, ratio, momentum, clip_norm):
    """DGC written out element by element, as in Lin et al. 2018, Algorithm 1 (one worker)."""
    u = [0.0] * len(gradients[0])
    v = [0.0] * len(gradients[0])
    sent_per_step = []
    for g in gradients:
        norm = math.sqrt(sum(value * value for value in g))
        factor = min(1.0, clip_norm / (norm + 1e-12)) if clip_norm else 1.0
        for i, value in enumerate(g):
            u[i] = momentum * u[i] + value * factor
            v[i] = v[i] + u[i]
        k = max(1, math.ceil(ratio * len(g)))
        chosen = sorted(range(len(g)), key=lambda i: -abs(v[i]))[:k]
        sent = [0.0] * len(g)
        for i in chosen:
            sent[i] = v[i]
            u[i] = v[i] = 0.0
        sent_per_step.append(sent)
    return sent_per_step


@pytest.mark.parametrize("clip_norm", [None, 0.5])
def test_dgc_matches_the_paper_step_by_step(clip_norm):
    gradients = [random_tensor((40,), torch.float64, seed=step).tolist() for step in range(6)]
    codec = DGC(ratio=0.1, momentum=0.9, clip_norm=clip_norm, warmup_epochs=0)
    expected = reference_dgc(gradients, 0.1, 0.9, clip_norm)
    for g, sent in zip(gradients, expected, strict=True):
        got = codec.decode(codec.encode(torch.tensor(g, dtype=torch.float64), key="w"))
        assert_close(got, torch.tensor(sent, dtype=torch.float64))
    masked = codec.accumulated("w") == 0  # momentum factor masking: u is zero wherever v was just sent
    assert bool((codec.velocity("w")[masked] == 0).all())


def test_dgc_warms_up_its_sparsity_exponentially():
    codec = DGC(ratio=0.001, warmup_epochs=4)
    densities = []
    for epoch in range(6):
        codec.set_epoch(epoch)
        densities.append(codec.density)
    assert densities == [0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001]
    codec.set_epoch(1)
    x = random_tensor((1000,))
    assert int((codec.decode(codec.encode(x, key="w")) != 0).sum()) == 63


def test_powersgd_is_exact_on_low_rank_matrices():
    generator = torch.Generator().manual_seed(0)
    low_rank = torch.randn(30, 2, generator=generator) @ torch.randn(2, 4, 5, generator=generator).reshape(2, 20)
    codec = PowerSGD(rank=2)
    assert_close(codec.compress(low_rank.reshape(30, 4, 5), key="w"), low_rank.reshape(30, 4, 5))


def test_powersgd_warm_start_converges_to_the_best_rank_one_approximation():
    matrix = random_tensor((40, 25)) + torch.outer(random_tensor((40,), seed=1), random_tensor((25,), seed=2))
    u, s, vh = torch.linalg.svd(matrix)
    best = s[0] * torch.outer(u[:, 0], vh[0])
    codec = PowerSGD(rank=1)
    for _ in range(30):  # the same matrix each step: warm start turns steps into power iterations
        approximation = codec.compress(matrix, key="w")
    assert_close(approximation, best, rtol=1e-3, atol=1e-3)
    cold = PowerSGD(rank=1, warm_start=False).compress(matrix, key="w")
    assert float((cold - best).norm()) > float((approximation - best).norm())


def test_powersgd_halves_summed_across_workers_compress_the_sum():
    """compute_p / all-reduce / compute_q / all-reduce / decompress equals compressing the summed matrix."""
    matrices = [random_tensor((12, 9), seed=worker) for worker in range(3)]
    workers = [PowerSGD(rank=2, seed=7) for _ in matrices]
    single = PowerSGD(rank=2, seed=7)  # its warm start Q is the sum of the workers' Q halves
    for _ in range(3):
        p_sum = sum(w.compute_p("w", m) for w, m in zip(workers, matrices, strict=True))
        halves = [w.compute_q("w", m, p_sum) for w, m in zip(workers, matrices, strict=True)]
        q_sum = sum(q for _, q in halves)
        results = [w.decompress("w", p, q_sum) for w, (p, _) in zip(workers, halves, strict=True)]
        expected = single.compress(sum(matrices), key="w")
        for result in results:
            assert_close(result, expected, rtol=1e-4, atol=1e-4)
