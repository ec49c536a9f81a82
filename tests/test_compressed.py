"""Compressed communication: sums, messages and exchanges through codecs, their exact bytes, and compressed sync."""

import math

import pytest
import torch

import fast
from fast.assemble import load_config
from fast.codecs import build_codec
from fast.codecs.parts import decode_parts, split_frames
from fast.comm import Comm
from fast.errors import ConfigError, FrameError
from fast.exchange.allreduce import CompressedAllReduce, worker_codec
from fast.exchange.encoded import recv_compressed, send_compressed
from fast.exchange.neighbours import exchange_compressed
from fast.jobs.models import build_model
from fast.strategies.sync import MomentumCorrection

N = 1000
SITS_OUT = 2  # the rank that contributes nothing to the "topk" sum
TOPK = {"ratio": 0.1, "error_feedback": True}
POWERSGD_SHAPES = [(8, 6), (8,), (4, 5)]
SPLIT = [600, 400]  # two tensors packed in one flat one: a vector and a 5 x 80 matrix
SPLIT_SHAPES = [(600,), (5, 80)]


def _values(rank: int, numel: int = N) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank))


def _rank_one(rank: int) -> torch.Tensor:
    """Rank-1 matrices with a common column space (and a bias): PowerSGD at rank 1 sums them exactly."""
    g = torch.Generator().manual_seed(100 + rank)
    u = torch.arange(1.0, 9.0)
    parts = [torch.outer(u, torch.randn(6, generator=g)), torch.randn(8, generator=g)]
    parts.append(torch.outer(torch.arange(1.0, 5.0), torch.randn(5, generator=g)))
    return torch.cat([p.reshape(-1) for p in parts])


def _counted(comm: Comm, action) -> tuple[object, int, int]:
    counter = comm.counter
    sent, dense = counter.bytes_sent, counter.sent_uncompressed
    out = action()
    return out, counter.bytes_sent - sent, counter.sent_uncompressed - dense


def _exchanges(comm: Comm) -> dict[str, object]:
    rank, out = comm.rank, {}

    def reduce(name, tensor, options=None, background=False, **kwargs):
        reducer = CompressedAllReduce(comm, worker_codec(name, options or {}, rank), background=background)
        result, sent, dense = _counted(comm, lambda: reducer.start(tensor, "t", **kwargs).wait())
        reducer.close()
        return {"sum": tensor, "contributors": result, "sent": sent, "dense": dense, "reducer": reducer}

    out["fp16"] = reduce("fp16", _values(rank))
    count = torch.tensor([0.0 if rank == SITS_OUT else 1.0])
    topk = reduce("topk", _values(rank), TOPK, count=count)
    topk["count"] = float(count)
    topk["residual"] = topk.pop("reducer").codec.residual("t.0")  # the one tensor of key "t"
    out["topk"] = topk
    out["ef-sign"] = reduce("ef-sign", _values(rank), background=True, shapes=SPLIT_SHAPES)
    out["qsgd"] = reduce("qsgd", _values(rank), shapes=SPLIT_SHAPES)
    out["powersgd"] = reduce("powersgd", _rank_one(rank), {"rank": 1}, shapes=POWERSGD_SHAPES)
    for result in out.values():
        result.pop("reducer", None)

    codec = worker_codec("topk", TOPK, rank)
    if rank == 0:
        _, out["p2p_sent"], out["p2p_dense"] = _counted(comm, lambda: send_compressed(comm, _values(0), 1, codec))
    elif rank == 1:
        out["p2p_from"], out["p2p_received"] = recv_compressed(comm, codec)
    right, left = (rank + 1) % comm.size, (rank - 1) % comm.size
    (mine, inbox), out["ring_sent"], out["ring_dense"] = _counted(
        comm, lambda: exchange_compressed(comm, _values(rank), codec, "ring", [right], [left])
    )
    out["ring_mine"], out["ring_inbox"] = mine, inbox
    return out


def _decoded(name: str, rank: int, values: torch.Tensor, options: dict | None = None, split=None) -> torch.Tensor:
    """What a worker's codec makes of `values` (the parts of `split` encoded on their own, in order)."""
    codec = worker_codec(name, options or {}, rank)
    if split is None:
        return codec.compress(values, "t")
    parts = zip(values.split(split), SPLIT_SHAPES, strict=True)
    return torch.cat([codec.compress(part.view(shape), f"t.{i}").reshape(-1) for i, (part, shape) in enumerate(parts)])


def test_compressed_sums_messages_and_their_exact_bytes():
    from tests.distributed import run_distributed

    workers = 3
    out = run_distributed(_exchanges, workers)
    ring_share = 2 * (workers - 1) / workers

    def frame(name: str, options: dict | None = None, shape: tuple[int, ...] = (N,)) -> int:
        return build_codec(name, **(options or {})).encoded_size(shape)

    for rank, got in out.items():
        fp16 = got["fp16"]
        expected = sum(_values(r).half().float() for r in range(workers))
        torch.testing.assert_close(fp16["sum"], expected, atol=1e-2, rtol=1e-3)
        assert fp16["contributors"] == workers
        assert fp16["sent"] == round(2 * (N + 1) * ring_share)
        assert fp16["dense"] == round(4 * (N + 1) * ring_share)

        topk = got["topk"]
        expected = _decoded("topk", 0, _values(0), TOPK) + _decoded("topk", 1, _values(1), TOPK)
        assert torch.equal(topk["sum"], expected)  # the same bits on every worker
        assert topk["contributors"] == topk["count"] == 2
        assert topk["sent"] == (workers - 1) * (8 + frame("topk", TOPK))  # lengths, then padded frames
        assert topk["dense"] == (workers - 1) * 4 * (N + 1)
        if rank == SITS_OUT:
            assert topk["residual"] is None  # sitting out leaves the error feedback untouched
        else:
            mine = _values(rank)
            torch.testing.assert_close(topk["residual"], mine - _decoded("topk", rank, mine, TOPK))
            assert int((topk["residual"] == 0).sum()) == math.ceil(0.1 * N)

        for name in ("ef-sign", "qsgd"):
            expected = torch.zeros(N)
            for r in range(workers):
                expected += _decoded(name, r, _values(r), split=SPLIT)
            assert torch.equal(got[name]["sum"], expected), name
            frames = sum(frame(name, shape=shape) for shape in SPLIT_SHAPES)  # a frame per tensor, in one payload
            assert got[name]["sent"] == (workers - 1) * (8 + frames), name
            assert got[name]["dense"] == (workers - 1) * 4 * (N + 1), name

        powersgd = got["powersgd"]
        torch.testing.assert_close(powersgd["sum"], sum(_rank_one(r) for r in range(workers)), atol=1e-4, rtol=1e-4)
        p_and_raw = 8 + 4 + 8 + 1  # P of each matrix, the bias, the count
        q = 6 + 5
        assert powersgd["sent"] == round(4 * p_and_raw * ring_share) + round(4 * q * ring_share)
        assert powersgd["dense"] == round(4 * (48 + 8 + 20 + 1) * ring_share)

        ring_frame = frame("topk", TOPK)
        assert (got["ring_sent"], got["ring_dense"]) == (ring_frame, 4 * N)
        left = (rank - 1) % workers
        assert list(got["ring_inbox"]) == [left]
        torch.testing.assert_close(got["ring_inbox"][left], _decoded("topk", left, _values(left), TOPK))
        torch.testing.assert_close(got["ring_mine"], _decoded("topk", rank, _values(rank), TOPK))

    assert (out[0]["p2p_sent"], out[0]["p2p_dense"]) == (8 + frame("topk", TOPK), 4 * N)
    assert out[1]["p2p_from"] == 0
    torch.testing.assert_close(out[1]["p2p_received"], _decoded("topk", 0, _values(0), TOPK))


def _buckets(bucket_mb: float) -> list[list[tuple[int, ...]]]:
    """The shapes of the tensors in each of sync's gradient buckets for the digits MLP (the rule of
    Sync._make_buckets: in backward order, a bucket closes when it reaches bucket_mb)."""
    params = list(build_model("mlp", (1, 8, 8), 10).parameters())
    cap, buckets, current = bucket_mb * 2**20 / 4, [], []
    for p in reversed(params):
        current.append(tuple(p.shape))
        if sum(math.prod(shape) for shape in current) >= cap:
            buckets, current = buckets + [current], []
    return buckets + ([current] if current else [])


@pytest.mark.parametrize(("codec", "options"), [("ef-sign", {}), ("topk", {"ratio": 0.01, "error_feedback": True})])
def test_compressed_sync_converges_and_counts_exact_bytes(tmp_path, codec, options):
    workers, bucket_mb = 2, 0.05
    overrides = {f"codec__{key}": value for key, value in options.items()}
    summary = fast.train(
        {},
        out=tmp_path / codec,
        data__name="digits",
        model__name="mlp",
        run__workers=workers,
        run__epochs=3,
        run__threads_per_worker=1,
        strategy__name="sync",
        strategy__bucket_mb=bucket_mb,
        codec__name=codec,
        **overrides,
    )
    assert summary["final_test_accuracy"] >= 0.85  # dense sync reaches 0.94 on this run, chance is 0.10
    buckets = _buckets(bucket_mb)
    assert len(buckets) == 2
    codec_obj = build_codec(codec, **options)

    def frames(bucket: list[tuple[int, ...]]) -> int:  # sign: a frame per tensor; top-k: a global one per bucket
        shapes = [(sum(math.prod(shape) for shape in bucket),)] if codec == "topk" else bucket
        return sum(codec_obj.encoded_size(shape) for shape in shapes)

    per_step = sum((workers - 1) * (8 + frames(bucket)) for bucket in buckets)
    dense_per_step = sum((workers - 1) * 4 * (sum(math.prod(shape) for shape in bucket) + 1) for bucket in buckets)
    steps = summary["steps_per_worker"] * workers
    assert summary["bytes_sent"] == steps * per_step
    assert summary["bytes_sent_uncompressed"] == steps * dense_per_step
    assert summary["compression_ratio"] == pytest.approx(dense_per_step / per_step)
    assert summary["compression_ratio"] > 25


@pytest.mark.parametrize(
    ("strategy", "codec", "accuracy", "ratio"),
    [
        # dense on this run: gossip 0.94, local-sgd 0.94, async-ps 0.86 (whose pulls stay dense)
        ({"name": "gossip", "topology": "ring"}, {"name": "sign"}, 0.9, 25),
        ({"name": "local-sgd", "period": 4}, {"name": "topk", "ratio": 0.05, "error_feedback": True}, 0.8, 10),
        ({"name": "async-ps"}, {"name": "ef-sign"}, 0.75, 1.5),
    ],
)
def test_strategies_train_with_compressed_messages(tmp_path, strategy, codec, accuracy, ratio):
    summary = fast.train(
        {"strategy": strategy, "codec": codec},
        out=tmp_path / strategy["name"],
        data__name="digits",
        model__name="mlp",
        run__workers=2,
        run__epochs=3,
        run__threads_per_worker=1,
    )
    assert summary["final_test_accuracy"] >= accuracy
    assert summary["compression_ratio"] >= ratio
    assert summary["compression_ratio"] == pytest.approx(summary["bytes_sent_uncompressed"] / summary["bytes_sent"])
    if strategy["name"] == "gossip":  # CHOCO: every step, a frame per tensor to the one neighbour, nothing else
        shapes = [p.shape for p in build_model("mlp", (1, 8, 8), 10).parameters()]
        per_step = sum(build_codec(codec["name"]).encoded_size(tuple(shape)) for shape in shapes)
        steps = 2 * summary["steps_per_worker"]
        assert summary["bytes_sent"] == steps * per_step
        assert summary["bytes_sent_uncompressed"] == steps * 4 * sum(math.prod(shape) for shape in shapes)


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_correction_is_the_optimizers_own_sgd_when_nothing_is_lost(nesterov):
    torch.manual_seed(0)
    reference, corrected = build_model("mlp", (1, 8, 8), 10), build_model("mlp", (1, 8, 8), 10)
    corrected.load_state_dict(reference.state_dict())
    initial = [p.detach().clone() for p in reference.parameters()]
    settings = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "nesterov": nesterov}
    optimizers = [torch.optim.SGD(m.parameters(), **settings) for m in (reference, corrected)]
    correction = MomentumCorrection(optimizers[1])
    assert (optimizers[1].param_groups[0]["momentum"], optimizers[1].param_groups[0]["weight_decay"]) == (0, 0)
    x, y = torch.randn(4, 16, 1, 8, 8), torch.randint(0, 10, (4, 16))
    for step in range(4):
        for model, optimizer in zip((reference, corrected), optimizers, strict=True):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[step]), y[step]).backward()
        params = list(corrected.parameters())
        correction.apply(params, [p.grad for p in params])
        for optimizer in optimizers:
            optimizer.step()
    for a, b in zip(reference.parameters(), corrected.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.equal(initial[0], next(reference.parameters()))  # it did train


def test_frames_laid_end_to_end_split_at_their_headers():
    codec = build_codec("topk", ratio=0.5)
    frames = [codec.encode(torch.randn(shape)) for shape in [(10,), (3, 4), (1,)]]
    payload = torch.cat(frames)
    assert [f.numel() for f in split_frames(payload, 3)] == [f.numel() for f in frames]
    with pytest.raises(FrameError, match="exactly 2 frames"):
        split_frames(payload, 2)
    with pytest.raises(FrameError):
        decode_parts(codec, payload[:-3], 3)  # the last frame is cut short


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"codec__name": "zip"}, "`codec.name`"),
        ({"codec__name": "topk", "codec__k": 5}, "`codec.k`"),
        ({"codec__name": "topk", "codec__ratio": 1.5}, "`codec.ratio`"),
        ({"codec__name": "ef-sign", "codec__error_feedback": False}, "`codec.error_feedback`"),
        ({"codec__name": "topk", "strategy__name": "ssp"}, "`codec.name`"),
        ({"codec__name": "topk", "strategy__hierarchical": 2}, "`strategy.hierarchical`"),
        ({"codec__name": "dgc", "codec__error_feedback": False}, "optimizer.momentum"),
        ({"codec__name": "qsgd", "strategy__name": "gossip"}, "`codec.name`"),
        ({"codec__name": "ef-sign", "strategy__name": "gossip"}, "`codec.error_feedback`"),
        ({"codec__name": "sign", "strategy__name": "gossip", "strategy__send_probability": 0.5}, "send_probability"),
        ({"codec__name": "threshold", "strategy__name": "async-ps", "strategy__servers": 1}, "`codec.name`"),
    ],
)
def test_codec_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, **overrides)
    valid = load_config(None, codec__name="topk", codec__ratio=0.01, codec__error_feedback=True)
    assert valid.codec.options() == {"ratio": 0.01, "error_feedback": True}
