"""The low-communication frontier: SparseLoCo, DeMo, eager DiLoCo and NoLoCo. The piece that defines each,
checked against a direct computation on small tensors; their bytes, exact; each trains the digits job; NoLoCo
survives a killed worker."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.fft
import torch

import fast
from fast.codecs import ErrorFeedback
from fast.codecs.chunked import ChunkTopK, DctTopK
from fast.errors import ConfigError
from fast.jobs.models import build_model
from fast.runtime.launch import WorkerFailed
from fast.strategies.diloco import eager_outer_gradient, eager_rest
from fast.strategies.noloco import noloco_step
from tests.outputs import assert_same_model
from tests.test_resume import JOB as RESUMABLE
from tests.test_resume import _crash_once

JOB = {"data__name": "digits", "model__name": "mlp", "run__workers": 2, "run__epochs": 4, "run__batch_size": 32,
       "run__eval_every": 0, "run__threads_per_worker": 1}  # fmt: skip
SHAPES = [tuple(p.shape) for p in build_model("mlp", (1, 8, 8), 10).parameters()]


def _top_k_of_blocks(blocks: np.ndarray, k: int) -> np.ndarray:
    """Each row of `blocks` with all but its k largest magnitudes zeroed (no ties in random data)."""
    kept = np.zeros_like(blocks)
    for row, values in enumerate(blocks):
        best = np.argsort(-np.abs(values))[:k]
        kept[row, best] = values[best]
    return kept


def test_chunk_topk_keeps_each_blocks_largest_two_bit_quantised_and_error_feedback_keeps_the_rest():
    """SparseLoCo's compressor on a 128 x 96 matrix: 64 x 48 blocks, round(3072 / 32) = 96 entries kept in each;
    the kept values in 4 bins of 1.5σ around their mean, each decoded as its bin's mean; e ← β e + Δ − sent."""
    generator = torch.Generator().manual_seed(0)
    delta, memory = torch.randn(128, 96, generator=generator), torch.randn(128, 96, generator=generator)
    beta = 0.9
    codec = ErrorFeedback(ChunkTopK(), decay=beta)
    codec.compensate("w", memory)  # the memory holds `memory` before this round (residual 0, decayed, + memory)
    before = codec.residual("w").clone()
    frame, sent = codec.encode_and_decode(delta, "w")

    compensated = (beta * before + delta).numpy().astype(np.float64)
    blocks = compensated.reshape(2, 64, 2, 48).transpose(0, 2, 1, 3).reshape(4, 64 * 48)
    kept = _top_k_of_blocks(blocks, 96)
    values = kept[kept != 0]
    shift = values.mean()
    centred = values - shift
    scale = 6 * centred.std(ddof=1) / 4
    codes = np.clip(np.round(centred / scale + 2), 0, 3)
    means = {b: centred[codes == b].mean() for b in np.unique(codes)}
    decoded = kept.copy()
    decoded[kept != 0] = [means[b] + shift for b in codes]
    expected = decoded.reshape(2, 2, 64, 48).transpose(0, 2, 1, 3).reshape(128, 96)

    np.testing.assert_allclose(sent.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert len(np.unique(sent.numpy()[sent.numpy() != 0])) <= 4  # two bits
    torch.testing.assert_close(sent + codec.residual("w"), beta * before + delta)  # nothing is lost
    assert torch.equal(ChunkTopK().decode(frame), sent)  # what a receiver decodes
    indices, codes_bytes = 4 * 96 * 12 // 8, 4 * 96 * 2 // 8
    assert frame.numel() == (16 + 8 * 2) + (4 + 4 * 4 + indices + codes_bytes) + 4  # header, body, checksum


def test_dct_topk_sends_the_largest_dct_coefficients_of_each_block_and_decodes_their_inverse():
    """DeMo's extraction: the orthonormal 2-D DCT-II of each 64 x 64 block, its k largest coefficients, and the
    inverse DCT of those; with every coefficient kept it is the identity."""
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(1))
    sent = DctTopK(k=32).compress(x)
    expected = np.zeros((128, 64))
    for top in (0, 64):
        block = x[top : top + 64].numpy().astype(np.float64)
        coefficients = scipy.fft.dctn(block, norm="ortho")
        kept = _top_k_of_blocks(coefficients.reshape(1, -1), 32).reshape(64, 64)
        expected[top : top + 64] = scipy.fft.idctn(kept, norm="ortho")
    np.testing.assert_allclose(sent.numpy(), expected, atol=1e-5)
    torch.testing.assert_close(DctTopK(k=64 * 64).compress(x), x, atol=1e-5, rtol=1e-5)
    for size, chunks, side in [(100, 2, 50), (67, 2, 64)]:  # vectors: chunks of a divisor, or of 64 padded
        vector = torch.randn(size, generator=torch.Generator().manual_seed(size))
        padded = np.concatenate([vector.numpy(), np.zeros(chunks * side - size)]).reshape(chunks, side)
        kept = _top_k_of_blocks(scipy.fft.dct(padded.astype(np.float64), norm="ortho", axis=1), 8)
        expected_vector = scipy.fft.idct(kept, norm="ortho", axis=1).reshape(-1)[:size]
        np.testing.assert_allclose(DctTopK(k=8).compress(vector).numpy(), expected_vector, atol=1e-5)


def test_eager_outer_gradient_is_the_blocking_mean_with_the_others_one_round_late():
    """Worker m's outer gradient at round t: (1/M) Δ_m(t) + (1/M) Σ_{m' ≠ m} Δ_m'(t − 1)."""
    generator = torch.Generator().manual_seed(2)
    workers = 4
    before, now = torch.randn(workers, 10, generator=generator), torch.randn(workers, 10, generator=generator)
    for m in range(workers):
        direct = (now[m] + sum(before[j] for j in range(workers) if j != m)) / workers
        torch.testing.assert_close(eager_outer_gradient(before.mean(0), now[m], before[m], workers), direct)


def test_eager_outer_gradients_and_the_rest_at_the_end_sum_to_the_blocking_means():
    """Over a run, worker m's eager outer gradients plus the rest it takes when the last mean lands are the sum of
    the blocking run's means: every pseudo-gradient counted once (so with no momentum the workers end on one θ)."""
    generator = torch.Generator().manual_seed(3)
    workers, rounds = 3, 5
    deltas = torch.randn(rounds, workers, 7, generator=generator)
    means = deltas.mean(1)
    for m in range(workers):
        taken = torch.zeros(7)
        for t in range(rounds):
            mean_before, mine_before = (means[t - 1], deltas[t - 1, m]) if t else (torch.zeros(7), torch.zeros(7))
            taken += eager_outer_gradient(mean_before, deltas[t, m], mine_before, workers)
        taken += eager_rest(means[-1], deltas[-1, m], workers)
        torch.testing.assert_close(taken, means.sum(0))


def test_eager_diloco_on_one_worker_is_blocking_diloco(tmp_path, no_orphans):
    """With one worker the mean is its own pseudo-gradient, so eager's outer step is the blocking one: the same
    weights (to rounding: Δ(t−1) + (Δ(t) − Δ(t−1)) is Δ(t) in exact arithmetic), through the background all-reduce
    and its landing a round later."""
    job = {**JOB, "run__workers": 1, "run__epochs": 1, "strategy__name": "diloco", "strategy__period": 8}
    runs = {eager: tmp_path / str(eager) for eager in (False, True)}
    for eager, out in runs.items():
        fast.train(None, out=str(out), strategy__eager=eager, **job)
    blocking, eager = (torch.load(runs[e] / "model.pt", weights_only=True) for e in (False, True))
    for name in blocking:
        # 6 rounds: 4e-7 apart. Longer runs amplify the rounding (11 rounds at period 16: 5e-5 to 3e-3 apart).
        torch.testing.assert_close(eager[name], blocking[name], rtol=0, atol=1e-5)


def test_noloco_step_is_the_modified_nesterov_step_on_the_pairs_means():
    generator = torch.Generator().manual_seed(3)
    phi, moved, momentum, phi_j, moved_j = (torch.randn(6, generator=generator) for _ in range(5))
    lr, mu = 0.7, 0.5
    expected_momentum = mu * momentum + lr * (moved + moved_j) / 2 - lr * (phi - (phi + phi_j) / 2)
    expected_phi = phi + expected_momentum
    new = noloco_step(phi.clone(), moved, m := momentum.clone(), (phi_j, moved_j), lr, mu)
    torch.testing.assert_close(new, expected_phi)
    torch.testing.assert_close(m, expected_momentum)
    alone = noloco_step(phi.clone(), moved, momentum.clone(), None, lr, mu)
    torch.testing.assert_close(alone, phi + mu * momentum + lr * moved)


# -- real runs: bytes and the bar ------------------------------------------------------------------------------
def _gathered(frames: int, workers: int = 2) -> int:
    """What one worker sends in an all-gather of frames: its length (int64) and payload to each other worker."""
    return (workers - 1) * (8 + frames)


def test_sparseloco_trains_and_sends_each_round_its_frames_alone(tmp_path, no_orphans):
    summary = fast.train(None, out=str(tmp_path), strategy__name="sparseloco", strategy__period=16, **JOB)
    assert summary["final_test_accuracy"] > 0.9  # dense diloco: 0.96 on this run; chance 0.1
    codec = ChunkTopK()
    per_round = _gathered(sum(codec.encoded_size(shape) for shape in SHAPES))
    assert summary["bytes_sent"] == 2 * summary["outer_rounds"] * per_round
    assert summary["bytes_sent_uncompressed"] / summary["bytes_sent"] > 20


def test_demo_trains_and_sends_each_step_its_frames_alone(tmp_path, no_orphans):
    summary = fast.train(None, out=str(tmp_path), strategy__name="demo", strategy__bucket_mb=64.0,
                         optimizer__name="SGD", optimizer__lr=0.001, **JOB)  # fmt: skip
    assert summary["final_test_accuracy"] > 0.9
    codec = DctTopK()
    per_step = _gathered(sum(codec.encoded_size(shape) for shape in SHAPES))  # one bucket: the whole model
    assert summary["bytes_sent"] == 2 * summary["steps_per_worker"] * per_step


def test_demo_takes_the_jobs_learning_rate_made_for_gradients_and_steps_its_sign_by_its_own(tmp_path, no_orphans):
    """A sign moves every weight by the whole learning rate: at the job's 0.05 (SGD, momentum 0.9) demo read 0.14 here
    before it brought its own step (strategy.sign_lr)."""
    summary = fast.train(None, out=str(tmp_path), strategy__name="demo", optimizer__lr=0.05, **JOB)
    assert summary["final_test_accuracy"] > 0.8


@pytest.mark.parametrize("eager", [False, True], ids=["blocking", "eager"])
def test_eager_diloco_trains_and_sends_a_round_a_period_and_one_mean_of_theta(tmp_path, no_orphans, eager):
    summary = fast.train(None, out=str(tmp_path), strategy__name="diloco", strategy__period=16,
                         strategy__eager=eager, **JOB)  # fmt: skip
    assert summary["final_test_accuracy"] > 0.9
    model = 4 * sum(math.prod(shape) for shape in SHAPES)
    # 2 workers: an all-reduce sends each worker's whole tensor; blocking rounds count the workers that moved
    # (one more float), eager ones do not but end on the mean of the workers' θ
    per_round = model if eager else model + 4
    assert summary["bytes_sent"] == 2 * (summary["outer_rounds"] * per_round + eager * model)


def test_noloco_trains_with_a_message_to_one_partner_a_round_and_survives_a_killed_worker(tmp_path, monkeypatch,
                                                                                           no_orphans):  # fmt: skip
    summary = fast.train(None, out=str(tmp_path / "whole"), strategy__name="noloco", strategy__period=16, **JOB)
    assert summary["final_test_accuracy"] > 0.9
    model = 4 * sum(math.prod(shape) for shape in SHAPES)
    assert summary["bytes_sent"] == 2 * summary["outer_rounds"] * (2 * model)  # φ and θ − φ
    job = {**JOB, "run__workers": 4, "run__deadline_s": 2.0}
    monkeypatch.setenv("CRASH_AT", "20")  # worker 1 exits at its 20th step
    summary = fast.train(None, out=str(tmp_path / "killed"), step_fn=_crash_once,
                         strategy__name="noloco", strategy__period=4, **job)  # fmt: skip
    assert [f["worker"] for f in summary["failures"]] == [1]
    assert summary["final_test_accuracy"] > 0.85


def test_a_streaming_run_evaluates_mid_run_the_model_it_would_report_if_it_stopped_there(tmp_path, no_orphans):
    """The evaluation at step 11 (mid-round, a fragment in flight) equals the final one of the same run stopped at
    step 11: the rounds in flight land and every fragment's last round folds in its steps since."""
    job = {**JOB, "run__epochs": 2, "run__eval_every": 0.5, "schedule__name": "constant",
           "strategy__name": "streaming-diloco", "strategy__period": 8, "strategy__fragments": 2,
           "strategy__delay": 2}  # fmt: skip
    whole = fast.train(None, out=str(tmp_path / "whole"), **job)
    first = whole["evaluations"][0]
    stopped = fast.train(None, out=str(tmp_path / "stopped"), **{**job, "run__max_steps": first["step"]})
    assert first["step"] % 8 not in (0, 4)  # between rounds: not what a plain θ would read
    assert stopped["evaluations"][-1]["test_loss"] == pytest.approx(first["test_loss"], rel=1e-5)


@pytest.mark.parametrize(
    "strategy",
    [
        {"strategy__name": "sparseloco", "strategy__period": 4},
        {"strategy__name": "demo", "optimizer__lr": 0.001, "optimizer__momentum": 0.0},
        {"strategy__name": "diloco", "strategy__period": 4, "strategy__eager": True},
        {"strategy__name": "noloco", "strategy__period": 4},
    ],
    ids=["sparseloco", "demo", "diloco-eager", "noloco"],
)
def test_an_interrupted_run_resumes_to_exactly_the_uninterrupted_weights(tmp_path, monkeypatch, no_orphans,
                                                                          strategy):  # fmt: skip
    """Their state (error feedback, momenta, the mean in flight, φ) is in the checkpoint of step 15."""
    job = {**RESUMABLE, **strategy}
    whole = fast.train(None, out=str(tmp_path / "whole"), **job)
    monkeypatch.setenv("CRASH_AT", "17")
    monkeypatch.setenv("CRASH_RANK", "0")  # (noloco survives any other worker's death)
    with pytest.raises(WorkerFailed, match="worker 0 exited with code 9"):
        fast.train(None, out=str(tmp_path / "cut"), step_fn=_crash_once, **job)
    monkeypatch.delenv("CRASH_AT")
    resumed = fast.train(resume=str(tmp_path / "cut"))
    assert_same_model(tmp_path / "whole", tmp_path / "cut")
    assert resumed["bytes_sent"] == whole["bytes_sent"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"strategy__name": "demo", "optimizer__clip_norm": 1.0}, r"`optimizer.clip_norm` = 1 with demo"),
        ({"strategy__name": "demo", "codec__name": "topk"}, r"`codec.name` = 'topk' does not work with strategy"),
        ({"strategy__name": "diloco", "strategy__eager": True, "run__membership": "live"}, r"`strategy.eager` with"),
        ({"strategy__name": "streaming-diloco", "strategy__eager": True}, r"`strategy.eager` with streaming-diloco"),
    ],
)
def test_what_a_method_cannot_take_is_refused_in_one_line(options, message):
    with pytest.raises(ConfigError, match=message):
        fast.train(None, **{**JOB, **options})


@pytest.mark.parametrize(
    ("options", "exchanges"),
    [
        ({"strategy": {"name": "demo"}, "optimizer": {"clip_norm": None}}, 1.0),
        ({"strategy": {"name": "sparseloco", "period": 4}}, 0.25),
        ({"strategy": {"name": "sync"}, "codec": {"name": "topk"}}, 1.0),
        ({"strategy": {"name": "sync"}, "codec": {"name": "fp16"}}, 0.0),  # summed on the way: no frames to decode
        ({"strategy": {"name": "diloco", "period": 4}}, 0.0),
    ],
)
def test_a_gathered_codecs_work_is_priced_once_per_exchange(options, exchanges):
    from fast.assemble import load_config
    from fast.pricing import codec_work_s, message_bytes, price

    config = load_config({**options, "run": {"workers": 4}, "network": {"bandwidth": "20Mbit", "latency": "20ms"}})
    model = build_model("lenet", (1, 28, 28), 10)
    nbytes = message_bytes(config, model)
    plain = price(config, nbytes, 0.05)
    priced = price(config, nbytes, 0.05, codec_s=0.1)
    assert priced.time_s - plain.time_s == pytest.approx(0.1 * exchanges)
    assert priced.comm_s - plain.comm_s == pytest.approx(0.1 * exchanges)
    assert priced.bytes_per_worker == plain.bytes_per_worker
    assert (codec_work_s(config, model, repeats=1) > 0) == (exchanges > 0)
