"""Fast, single-process tests of AMP's pieces (docs/design.md §11): the server's skip of a
non-finite round (RoundKeeper), the finish counter's ring of overflow marks, and the loss
scale's rule against MXNet's own LossScaler. All comparisons are exact (bit-equal)."""
import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.contrib.amp.loss_scaler import LossScaler

from kvstore_ext.server.rounds import RoundKeeper, store_counter
from mxdelay.loss_scaling import GlobalOverflows, advance, restore_scaler, scaler_state
import reference

SHAPE = (5,)


def _keeper(skip):
    keeper = RoundKeeper(slots=2)
    keeper.updates.install(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01))
    keeper.updates.set_skip_nonfinite(skip)
    return keeper


def _round(keeper, rnd, grad, stored):
    keeper.on_round(0, rnd % 2, nd.array(grad), stored[rnd % 2])


def test_round_keeper_skips_a_non_finite_round_entirely():
    rs = np.random.RandomState(0)
    init = rs.randn(*SHAPE).astype(np.float32)
    grads = [rs.randn(*SHAPE).astype(np.float32) for _ in range(3)]
    bad = grads[1].copy()
    bad[1:] = np.inf                  # the first element decides, but all are inf/nan
    bad[0] = np.nan
    keeper = _keeper(skip=True)
    stored = [nd.array(init), nd.array(init)]
    _round(keeper, 0, grads[0], stored)
    after0 = keeper.weight(0).asnumpy()
    momentum0 = keeper.updates.updater.states[0].asnumpy()
    _round(keeper, 1, bad, stored)
    # Weights, momentum and update count unchanged; the round counts; pulls of its slot
    # return the unchanged weights.
    np.testing.assert_array_equal(keeper.weight(0).asnumpy(), after0)
    np.testing.assert_array_equal(keeper.updates.updater.states[0].asnumpy(), momentum0)
    assert keeper.updates.optimizer._index_update_count[0] == 1
    assert keeper.applied_rounds(0) == 2 and keeper.updates.skipped_rounds(0) == 1
    np.testing.assert_array_equal(stored[1].asnumpy(), after0)
    _round(keeper, 2, grads[2], stored)
    # = an updater that never saw round 1, bit for bit.
    plain = _keeper(skip=True)
    plain_stored = [nd.array(init), nd.array(init)]
    _round(plain, 0, grads[0], plain_stored)
    _round(plain, 1, grads[2], plain_stored)
    np.testing.assert_array_equal(keeper.weight(0).asnumpy(), plain.weight(0).asnumpy())


def test_round_keeper_without_amp_applies_a_non_finite_round_as_stock():
    keeper = _keeper(skip=False)
    stored = [nd.zeros(SHAPE), nd.zeros(SHAPE)]
    _round(keeper, 0, np.full(SHAPE, np.inf, np.float32), stored)
    assert not np.isfinite(keeper.weight(0).asnumpy()).any()
    assert keeper.updates.skipped_rounds(0) == 0


def test_counter_keeps_vote_sums_and_a_ring_of_marks():
    counter = nd.zeros(3 + 3)
    store_counter(nd.array([1, 0, 1, 0, 2 + 1, 0]), counter)  # round 1 of N = 2: one overflow
    store_counter(nd.array([0, 0, 0, 0, 0, 2]), counter)      # round 2: none
    np.testing.assert_array_equal(counter.asnumpy(), [0, 0, 0, 0, 3, 2])
    store_counter(nd.array([2, 1, 0, 2, 0, 0]), counter)      # round 3 (= 0 mod 3)
    np.testing.assert_array_equal(counter.asnumpy(), [2, 1, 0, 2, 3, 2])


def _gluon_sequence(flags, window):
    """MXNet's LossScaler.has_overflow on real gradients, finite or not."""
    param = gluon.Parameter('w', shape=(3,))
    param.initialize()
    scaler = LossScaler()
    scaler._scale_seq_len = window
    states = []
    for overflow in flags:
        with autograd.record():
            loss = (param.data() * (np.inf if overflow else 1.0)).sum()
        loss.backward()
        assert scaler.has_overflow([param]) == overflow
        states.append(scaler_state(scaler))
    return states


def test_advance_follows_gluons_loss_scaler():
    rs = np.random.RandomState(1)
    flags = [bool(f) for f in rs.rand(60) < 0.15] + [True, True, True] + [False] * 10
    window = 4
    scaler = LossScaler()
    scaler._scale_seq_len = window
    ours = []
    for overflow in flags:
        advance(scaler, overflow)
        ours.append(scaler_state(scaler))
    assert ours == _gluon_sequence(flags, window)
    # ... and the reference's LossScale is the same rule.
    ref = reference.LossScale(window)
    for overflow, state in zip(flags, ours):
        ref.advance(overflow)
        assert (ref.scale, ref.next, ref.count) == (state['loss_scale'],
                                                    state['next_loss_scale'],
                                                    state['unskipped'])
    assert len({s['loss_scale'] for s in ours}) >= 4


def test_scaler_state_round_trip():
    scaler = LossScaler()
    advance(scaler, True)
    advance(scaler, False)
    other = LossScaler()
    restore_scaler(other, scaler_state(scaler))
    assert scaler_state(other) == scaler_state(scaler)


class _Marks(object):
    def __init__(self, counts):
        self.counts = counts

    def overflows(self, rounds):
        return [self.counts[r] for r in rounds]


def test_global_overflows_apply_each_round_once_in_order():
    scaler, expected = LossScaler(), LossScaler()
    seen = GlobalOverflows()
    counts = [0, 2, 0, 0, 1, 0]
    seen.apply(scaler, _Marks(counts), 0)
    seen.apply(scaler, _Marks(counts), 3)
    seen.apply(scaler, _Marks(counts), 3)       # nothing new
    seen.apply(scaler, _Marks(counts), 5)
    for count in counts:
        advance(expected, count > 0)
    assert scaler_state(scaler) == scaler_state(expected)
    assert seen.state_dict() == {'applied': 6, 'skipped': 2}


def test_amp_init_trainer_after_the_store_was_created_is_refused():
    # amp.init_trainer sets trainer._amp_loss_scaler; set directly here, because amp.init
    # would change every later test's NDArray functions in this process.
    import mxdelay  # pylint: disable=import-outside-toplevel
    from support.native import delay_store  # pylint: disable=import-outside-toplevel
    from scripts import mlp_model  # pylint: disable=import-outside-toplevel
    net, _ = mlp_model.build()
    trainer = mxdelay.DelayedTrainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                                     kvstore=delay_store(), delay=2, warmup_steps=1)
    assert trainer.rank == 0                       # creates the store, without AMP
    trainer._amp_loss_scaler = LossScaler()
    trainer._amp_original_scale = trainer._scale
    x, y = mlp_model.batch(0, 0, 4)
    with autograd.record():
        loss = gluon.loss.L2Loss()(net(nd.array(x)), nd.array(y))
    loss.backward()
    try:
        trainer.step(4)
    except ValueError as err:
        assert 'amp.init_trainer(trainer)' in str(err) and 'right after' in str(err)
    else:
        raise AssertionError('a late amp.init_trainer was accepted')


def test_amp_with_compression_is_refused():
    # 2bit would quantize an overflowed gradient to finite values (inf -> +t, nan -> 0 with a
    # nan residual): the servers would apply the round. fp16: the push's cast can overflow a
    # loss-scaled gradient that the workers' flags (computed before the cast) call finite.
    import mxdelay  # pylint: disable=import-outside-toplevel
    from support.native import delay_store  # pylint: disable=import-outside-toplevel
    from scripts import mlp_model  # pylint: disable=import-outside-toplevel
    for params in ({'type': '2bit', 'threshold': 0.5}, {'type': 'fp16'}, None):
        net, _ = mlp_model.build()
        trainer = mxdelay.DelayedTrainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                                         kvstore=delay_store(), compression_params=params,
                                         delay=2, warmup_steps=1)
        trainer._amp_loss_scaler = LossScaler()    # what amp.init_trainer sets (see above)
        trainer._amp_original_scale = trainer._scale
        try:
            trainer._init_kvstore()
        except ValueError as err:
            assert params is not None, err
            assert "AMP's dynamic loss scaling cannot be combined" in str(err)
            assert repr(params['type']) in str(err) and 'compression_params=None' in str(err)
        else:
            assert params is None, 'AMP with %r was accepted' % (params,)

