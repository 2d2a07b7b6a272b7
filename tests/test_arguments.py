"""Argument checks of mxdelay's public functions (issue 6, "bad input").

What is tested: every public function and method of mxdelay refuses a value of the wrong
type with ``TypeError`` and a value out of range with ``ValueError``, before doing anything
(no step taken, no command sent, no key placed), with a message naming the argument, the
value and the fix; and valid values, numpy scalars and ``os.PathLike`` paths included, keep
working as in ``gluon.Trainer``. The type errors are :class:`kvstore_ext.checks.ArgumentTypeError`,
which is also a ``ValueError`` (what mxdelay 0.1 raised).

Covered: ``kvstore_ext.checks`` itself; ``DelayedTrainer`` (constructor, ``step``,
``set_learning_rate``, ``save_states``, ``load_states``) without a distributed kvstore
(``gluon.Trainer``'s path) and with a real ``DistDelay`` over the in-process native
stand-in (support/native.py; the delayed path); the rule constructors and ``create_rule``;
``DelaySchedule`` and its predicates; ``DistDelay``'s public methods on a store whose
network is never reached (the checks run first; ``_command`` raises if called).
"""
import functools
import os
import re
import pathlib

import numpy as np
import pytest

import mxdelay
import mxnet as mx
from mxnet import autograd, gluon, nd

from kvstore_ext.worker.layout import Tensor
from kvstore_ext.checks import (ArgumentTypeError, check_bool, check_int, check_optional_text,
                            check_path, check_real)
from mxdelay.rules import LocalRule, LocalSGDRule, MirrorRule, create_rule
from mxdelay.schedule import DelaySchedule
from support.model import small_params
from support.native import delay_store, server_optimizer
from support.stores import offline_store

NAN, INF = float('nan'), float('inf')


# -- kvstore_ext.checks -----------------------------------------------------------------------------

def test_argument_type_error_is_a_type_error_and_a_value_error():
    assert issubclass(ArgumentTypeError, TypeError)
    assert issubclass(ArgumentTypeError, ValueError)


@pytest.mark.parametrize('value', [1.0, '3', None, True, np.float32(2), [1]], ids=repr)
def test_check_int_refuses_non_integers(value):
    with pytest.raises(ArgumentTypeError, match=r"n must be an integer >= 0, got %s \(%s\); fix"
                       % (_escaped(value), type(value).__name__)):
        check_int('n', value, 0, 'fix')


def test_check_int_range_and_numpy():
    with pytest.raises(ValueError, match=r"n must be an integer >= 2, got -1; fix") as info:
        check_int('n', -1, 2, 'fix')
    assert not isinstance(info.value, TypeError)
    assert check_int('n', np.int64(5), 2) == 5 and type(check_int('n', np.int32(5))) is int


@pytest.mark.parametrize('value', ['0.1', None, True, [0.1], nd.array([0.1])], ids=repr)
def test_check_real_refuses_non_numbers(value):
    with pytest.raises(ArgumentTypeError, match=r"x must be a finite number >= 0, got .*"):
        check_real('x', value, minimum=0)


@pytest.mark.parametrize('value,kwargs', [
    (NAN, {}), (INF, {}), (-INF, {}), (-0.1, dict(minimum=0)),
    (0, dict(minimum=0, min_inclusive=False)),
    (1.0, dict(maximum=1, max_inclusive=False)), (2, dict(maximum=1)),
], ids=str)
def test_check_real_refuses_out_of_range(value, kwargs):
    with pytest.raises(ValueError, match=r"x must be a finite number.*got %s" % _escaped(value)):
        check_real('x', value, **kwargs)


def test_check_real_accepts_bounds_and_numpy():
    assert check_real('x', 0, minimum=0) == 0.0
    assert check_real('x', np.float32(0.5), minimum=0, maximum=1) == 0.5
    assert check_real('x', np.int64(3)) == 3.0


def test_check_bool_path_text():
    assert check_bool('b', np.bool_(True)) is True
    for bad in (1, 'yes', None):
        with pytest.raises(ArgumentTypeError, match=r"b must be True or False, got"):
            check_bool('b', bad)
    assert check_path('f', pathlib.Path('a/b')) == os.path.join('a', 'b')
    with pytest.raises(ArgumentTypeError, match=r"f must be a file path \(str or os\.PathLike\), "
                                                r"got b'x' \(bytes\); pass e\.g\. f="):
        check_path('f', b'x')
    with pytest.raises(ValueError, match=r"f must be a file path, got an empty string"):
        check_path('f', '')
    assert check_optional_text('e', None) is None and check_optional_text('e', 'm') == 'm'
    with pytest.raises(ArgumentTypeError, match=r"e must be None or a str, got 3 \(int\)"):
        check_optional_text('e', 3)


def _escaped(value):
    return re.escape(repr(value))


# -- DelayedTrainer -----------------------------------------------------------------------------

TYPE_ERRORS = [
    (dict(delay=1.5), r"delay must be an integer >= 1, got 1\.5 \(float\); use delay=1"),
    (dict(warmup_steps='200'), r"warmup_steps must be an integer >= 0, got '200' \(str\)"),
    (dict(slack=4.0), r"slack must be an integer >= 4, got 4\.0 \(float\)"),
    (dict(local_lr='0.1'), r"local_lr must be a finite number >= 0, got '0\.1' \(str\); or None"),
    (dict(local_rule=MirrorRule),
     r"local_rule=<class .*MirrorRule'> is not a rule.*MirrorRule\(\)"),
    (dict(local_rule=None), r"local_rule=None is not a rule"),
    (dict(dc_lambda='0.1'), r"dc_lambda must be a finite number >= 0, got '0\.1' \(str\)"),
    (dict(kvstore=3), r"kvstore must be a str, a KVStore or None, got 3 \(int\); use "
                      r"kvstore='dist_delay'"),
    (dict(update_on_kvstore='yes', kvstore='local'),
     r"update_on_kvstore must be True or False, got 'yes' \(str\); or None"),
]
RANGE_ERRORS = [
    (dict(delay=0), r"delay must be an integer >= 1, got 0; use delay=1"),
    (dict(local_lr=INF), r"local_lr must be a finite number >= 0, got inf"),
    (dict(local_rule='mirrror'), r"local_rule='mirrror' is not a rule: use one of 'mirror'"),
    (dict(dc_lambda=-1.0), r"dc_lambda must be a finite number >= 0, got -1\.0"),
]


@pytest.mark.parametrize('kwargs,message', TYPE_ERRORS, ids=[str(c[0]) for c in TYPE_ERRORS])
def test_trainer_wrong_types_raise_type_error(kwargs, message):
    with pytest.raises(TypeError, match=message):
        mxdelay.DelayedTrainer(small_params(), 'sgd', {'learning_rate': 0.1}, **kwargs)


@pytest.mark.parametrize('kwargs,message', RANGE_ERRORS, ids=[str(c[0]) for c in RANGE_ERRORS])
def test_trainer_out_of_range_raises_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        mxdelay.DelayedTrainer(small_params(), 'sgd', {'learning_rate': 0.1}, **kwargs)
    assert not isinstance(info.value, TypeError)


def trained_net(kvstore, steps=0, batch_size=4):
    """A Dense(2) net, its DelayedTrainer on `kvstore` and one batch with fresh gradients."""
    mx.random.seed(0)
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize(mx.init.Constant(0.5))
    trainer = mxdelay.DelayedTrainer(net.collect_params(), 'sgd',
                                     {'learning_rate': 0.1, 'momentum': 0.9},
                                     kvstore=kvstore, delay=2, warmup_steps=1)
    x = nd.array(np.arange(12).reshape(4, 3) / 10.0)
    for _ in range(steps + 1):
        with autograd.record():
            loss = (net(x) ** 2).sum()
        loss.backward()
        if _ < steps:
            trainer.step(batch_size)
    return net, trainer


KVSTORES = [pytest.param(None, id='gluon-path'), pytest.param('fake', id='delayed-path')]


def kvstore_of(name):
    return delay_store() if name == 'fake' else name


@pytest.mark.parametrize('kvstore', KVSTORES)
@pytest.mark.parametrize('batch_size,error,message', [
    (0, ValueError, r"batch_size must be a finite number > 0, got 0; pass the number of samples"),
    (-4, ValueError, r"batch_size must be a finite number > 0, got -4"),
    (NAN, ValueError, r"batch_size must be a finite number > 0, got nan"),
    (INF, ValueError, r"batch_size must be a finite number > 0, got inf"),
    ('4', TypeError, r"batch_size must be a finite number > 0, got '4' \(str\)"),
    (None, TypeError, r"batch_size must be a finite number > 0, got None \(NoneType\)"),
    (True, TypeError, r"batch_size must be a finite number > 0, got True \(bool\)"),
], ids=str)
def test_step_refuses_bad_batch_size_before_anything(kvstore, batch_size, error, message):
    store = kvstore_of(kvstore)
    net, trainer = trained_net(store)
    before = net.weight.data().asnumpy()
    with pytest.raises(error, match=message):
        trainer.step(batch_size)
    assert trainer.schedule.step == 0
    np.testing.assert_array_equal(net.weight.data().asnumpy(), before)
    if kvstore == 'fake':
        assert store._session.native.calls == []   # nothing was pushed (nor initialised)


@pytest.mark.parametrize('batch_size', [4, np.int64(4), 4.0, np.float32(4)], ids=repr)
def test_step_accepts_numbers_like_gluon_trainer(batch_size):
    net, trainer = trained_net(None)
    trainer.step(batch_size)
    mx.random.seed(0)
    gluon_net = gluon.nn.Dense(2, in_units=3)
    gluon_net.initialize(mx.init.Constant(0.5))
    gluon_trainer = gluon.Trainer(gluon_net.collect_params(), 'sgd',
                                  {'learning_rate': 0.1, 'momentum': 0.9}, kvstore=None)
    x = nd.array(np.arange(12).reshape(4, 3) / 10.0)
    with autograd.record():
        loss = (gluon_net(x) ** 2).sum()
    loss.backward()
    gluon_trainer.step(4)
    np.testing.assert_array_equal(net.weight.data().asnumpy(),
                                  gluon_net.weight.data().asnumpy())


@pytest.mark.parametrize('kvstore', KVSTORES)
@pytest.mark.parametrize('lr,error,message', [
    ('0.1', TypeError, r"lr must be a finite number >= 0, got '0\.1' \(str\); e\.g\. "
                       r"trainer\.set_learning_rate\(0\.01\)"),
    (None, TypeError, r"lr must be a finite number >= 0, got None"),
    (-0.1, ValueError, r"lr must be a finite number >= 0, got -0\.1"),
    (NAN, ValueError, r"lr must be a finite number >= 0, got nan"),
], ids=str)
def test_set_learning_rate_refuses_bad_values(kvstore, lr, error, message):
    _, trainer = trained_net(kvstore_of(kvstore), steps=1)
    with pytest.raises(error, match=message):
        trainer.set_learning_rate(lr)
    assert trainer.learning_rate == 0.1
    if kvstore == 'fake':
        assert server_optimizer(trainer._kvstore).learning_rate == 0.1


@pytest.mark.parametrize('kvstore', KVSTORES)
def test_set_learning_rate_accepts_numbers(kvstore):
    _, trainer = trained_net(kvstore_of(kvstore), steps=1)
    trainer.set_learning_rate(np.float32(0.05))
    assert trainer.learning_rate == pytest.approx(0.05)
    trainer.set_learning_rate(0)
    assert trainer.learning_rate == 0


@pytest.mark.parametrize('kvstore', KVSTORES)
@pytest.mark.parametrize('method', ['save_states', 'load_states'])
@pytest.mark.parametrize('fname,error,message', [
    (None, TypeError, r"fname must be a file path \(str or os\.PathLike\), got None"),
    (3, TypeError, r"fname must be a file path \(str or os\.PathLike\), got 3 \(int\)"),
    (b'ckpt', TypeError, r"fname must be a file path .*got b'ckpt' \(bytes\)"),
    ('', ValueError, r"fname must be a file path, got an empty string"),
], ids=str)
def test_save_and_load_states_refuse_bad_paths(kvstore, method, fname, error, message):
    _, trainer = trained_net(kvstore_of(kvstore), steps=1)
    with pytest.raises(error, match=message):
        getattr(trainer, method)(fname)


@pytest.mark.parametrize('kvstore', KVSTORES)
def test_save_and_load_states_accept_path_objects(tmp_path, kvstore):
    net, trainer = trained_net(kvstore_of(kvstore), steps=2)
    path = tmp_path / 'model.states'
    trainer.save_states(path)
    assert path.exists()
    saved = net.weight.data().asnumpy()
    trainer.step(4)
    trainer.load_states(path)
    if kvstore == 'fake':  # the delayed path restores the weights too
        np.testing.assert_array_equal(net.weight.data().asnumpy(), saved)


# -- rules and schedule -------------------------------------------------------------------------

@pytest.mark.parametrize('make,error,message', [
    (lambda: MirrorRule('0.1'), TypeError, r"dc_lambda must be a finite number >= 0, got '0\.1'"),
    (lambda: MirrorRule(NAN), ValueError, r"dc_lambda must be a finite number >= 0, got nan"),
    (lambda: LocalRule(True), TypeError, r"dc_lambda.*got True \(bool\)"),
    (lambda: LocalSGDRule(adaptive='no'), TypeError, r"adaptive must be True or False, got 'no'"),
    (lambda: LocalSGDRule(ms_momentum=1), ValueError,
     r"ms_momentum must be a finite number >= 0 and < 1, got 1; e\.g\. ms_momentum=0\.95"),
    (lambda: LocalSGDRule(ms_momentum=None), TypeError, r"ms_momentum.*got None"),
    (lambda: create_rule(42), TypeError, r"local_rule=42 is not a rule"),
    (lambda: create_rule('sgd', dc_lambda=[0.1]), TypeError, r"dc_lambda.*got \[0\.1\]"),
    (lambda: create_rule('sgd', dc_lambda=INF), ValueError, r"dc_lambda.*got inf"),
    (lambda: create_rule('SGD'), ValueError, r"local_rule='SGD' is not a rule"),
], ids=['mirror-str', 'mirror-nan', 'bool', 'adaptive', 'ms1', 'msNone', 'create42',
        'create-list', 'create-inf', 'create-case'])
def test_rule_arguments(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_rules_accept_numpy_and_keep_their_values():
    rule = LocalSGDRule(np.float32(0.5), adaptive=np.bool_(True), ms_momentum=np.float64(0.9))
    assert (rule.dc_lambda, rule.adaptive, rule.ms_momentum) == (0.5, True, 0.9)
    assert create_rule('dc', 0).dc_lambda == 0.0


@pytest.mark.parametrize('args,error,message', [
    ((1.5, 0), TypeError, r"delay must be an integer >= 1, got 1\.5"),
    ((0, 0), ValueError, r"delay must be an integer >= 1, got 0"),
    ((2, None), TypeError, r"warmup_steps must be an integer >= 0, got None"),
    ((2, -1), ValueError, r"warmup_steps must be an integer >= 0, got -1"),
    ((2, 0, -3), ValueError, r"step must be an integer >= 0, got -3"),
    ((2, 0, '1'), TypeError, r"step must be an integer >= 0, got '1'"),
], ids=str)
def test_schedule_constructor(args, error, message):
    with pytest.raises(error, match=message):
        DelaySchedule(*args)


@pytest.mark.parametrize('predicate', ['phase', 'is_synchronous', 'issues_pull', 'applies_pull'])
def test_schedule_predicates_check_the_step(predicate):
    schedule = DelaySchedule(3, 2)
    with pytest.raises(ValueError, match=r"t must be an integer >= 0, got -1; t is a step index"):
        getattr(schedule, predicate)(-1)
    with pytest.raises(TypeError, match=r"t must be an integer >= 0, got 1\.0 \(float\)"):
        getattr(schedule, predicate)(1.0)
    assert getattr(schedule, predicate)(np.int64(5)) == getattr(schedule, predicate)(5)


def test_schedule_predicates_unchanged_for_valid_steps():
    schedule = DelaySchedule(3, 2)
    assert [schedule.issues_pull(t) for t in range(10)] == \
        [False, False, False, False, False, True, False, False, True, False]
    assert [schedule.applies_pull(t) for t in range(10)] == \
        [False, False, False, False, False, False, True, False, False, True]


# -- DistDelay ----------------------------------------------------------------------------------

GOOD = nd.zeros((2, 3))
KV_ERRORS = [
    ('settings.configure', dict(slack=0), ValueError, r"slack must be an integer >= 1, "
                                                       r"got 0"),
    ('settings.configure', dict(slack='2'), TypeError, r"slack must be an integer >= 1, "
                                                        r"got '2'"),
    ('settings.configure', dict(chunk_size=10 ** 6), ValueError, r"chunk_size must be an "
                                                                  r"integer in \[1, 1000000\)"),
    ('settings.configure', dict(chunk_size=2.5), TypeError, r"chunk_size must be an "
                                                             r"integer >= 1"),
    ('settings.set_config', dict(rule=object()), TypeError, r"set_config: rule=<object .*> "
                                                            r"\(object\) is not JSON-able"),
    ('set_optimizer', dict(optimizer='sgd'), TypeError, r"optimizer must be an "
                                                        r"mx\.optimizer\.Optimizer, got 'sgd'"),
    ('set_learning_rate', dict(lr='0.1'), TypeError, r"lr must be a finite number >= 0"),
    ('set_learning_rate', dict(lr=-1), ValueError, r"lr must be a finite number >= 0, got -1"),
    ('rounds.scale_gradients', dict(rescale_grad=0), ValueError, r"rescale_grad must be a "
                                                                  r"finite number > 0, got 0; "
                                                                  r"pass 1/batch_size"),
    ('rounds.scale_gradients', dict(rescale_grad=None), TypeError, r"rescale_grad.*got "
                                                                    r"None"),
    ('init', dict(key=1.5, value=GOOD), TypeError, r"key must be an int or a str.*got 1\.5"),
    ('init', dict(key=True, value=GOOD), TypeError, r"key must be an int or a str.*got True"),
    ('init', dict(key=1, value=np.zeros(3)), TypeError, r"value for key 1 must be an NDArray or "
                                                        r"a non-empty list of NDArrays"),
    ('init', dict(key=0, value=GOOD), ValueError, r"key 0 is already initialised"),
    ('init', dict(key=[1, 1], value=[GOOD, GOOD]), ValueError, r"key 1 is already initialised "
                                                               r"or given twice"),
    ('init', dict(key=[1, 2], value=GOOD), ValueError, r"with a list of 2 keys, pass a list of "
                                                       r"as many values as value"),
    ('push', dict(key=0, value=[]), TypeError, r"value for key 0 must be an NDArray or a "
                                               r"non-empty list.*got list of nothing"),
    ('push', dict(key=0, value=[GOOD, 1.0]), TypeError, r"got list of \['NDArray', 'float'\]"),
    ('push', dict(key=0, value=nd.zeros(5)), ValueError, r"value for key 0 has shape \(5,\) "
                                                         r"\(5 elements\), but the key was "
                                                         r"initialised with shape \(2, 3\)"),
    ('push', dict(key=0, value=GOOD, priority=0.5), TypeError, r"priority must be an integer, "
                                                               r"got 0\.5"),
    ('push', dict(key=7, value=GOOD), KeyError, r"key 7 was not initialised"),
    ('pull', dict(key=0), TypeError, r"pull needs out=: the NDArray"),
    ('pull', dict(key=0, out=np.zeros(6)), TypeError, r"out for key 0 must be an NDArray"),
    ('pull', dict(key=0, out=[GOOD, nd.zeros(2)]), ValueError, r"out for key 0 has shape "
                                                               r"\(2,\)"),
    ('pushpull', dict(key=0, value=GOOD, out=nd.zeros(4)), ValueError, r"out for key 0 has "
                                                                       r"shape \(4,\)"),
    ('broadcast', dict(key=1, value=GOOD, out='x'), TypeError, r"out for key 1 must be an "
                                                               r"NDArray"),
    ('is_capable', dict(capability=None), TypeError, r"capability must be a str"),
    ('save_optimizer_states', dict(fname=None), TypeError, r"fname must be a file path"),
    ('load_optimizer_states', dict(fname=''), ValueError, r"fname must be a file path, got an "
                                                          r"empty string"),
    ('checkpoint.check_states', dict(fname='x', error=1), TypeError, r"error must be None or "
                                                                      r"a str, got 1"),
    ('checkpoint.apply_states', dict(state='x'), TypeError, r"state must be the dict that "
                                                            r"check_states returned, got 'x'"),
    ('job.agree', dict(error=ValueError('x')), TypeError, r"error must be None or a str"),
]


@pytest.mark.parametrize('method,kwargs,error,message', KV_ERRORS,
                         ids=['%s-%d' % (c[0], i) for i, c in enumerate(KV_ERRORS)])
def test_dist_delay_checks_arguments_before_any_network_use(method, kwargs, error, message):
    configure = method.endswith('.configure')
    store = offline_store(placed=not configure)
    with pytest.raises(error, match=message):
        # a part's method ('settings.configure') or the face's ('init')
        owner = store.delayed if '.' in method else store
        functools.reduce(getattr, method.split('.'), owner)(**kwargs)
    assert list(store._session.tensors) == ([] if configure else [0])  # nothing placed
    settings = store.delayed.settings
    assert settings.slack == 1 and settings.chunk_size == 1000 and settings.shared == {}


def test_dist_delay_keys_may_be_numpy_integers_and_strings():
    store = offline_store()
    session = store._session
    session.tensors['w'] = Tensor('w', (3,), np.float32, [])
    assert session.checked_lists(np.int64(0), GOOD, 'value', np.int32(1)) == ([0], [GOOD])
    assert session.checked_lists(['w', 0], [nd.zeros(3), [GOOD, GOOD]], 'out', -2)[0] == ['w', 0]
    assert session.checked_lists(0, nd.zeros((3, 2)), 'value', 0)[0] == [0]  # same size: as before
    store.delayed.settings.set_config(delay=4, local_lr=None, local_rule='MirrorRule(dc_lambda=0)')
    assert store.delayed.settings.shared['delay'] == 4
    fresh = offline_store(placed=False).delayed.settings
    fresh.configure(slack=np.int64(3), chunk_size=np.int32(10))
    assert (fresh.slack, fresh.chunk_size) == (3, 10)
    assert type(fresh.slack) is int


@pytest.mark.parametrize('name,suggestion', [('dist_dealy', 'dist_delay'),
                                             ('Dist_Snyc', 'dist_sync')])
def test_misspelt_distributed_kvstore_type_raises(name, suggestion):
    # MXNet alone would create its native dist_sync store for any name containing 'dist'.
    with pytest.raises(ValueError, match=r"kvstore type '%s' is unknown: MXNet would silently "
                                         r"create its native dist_sync store for it; did you "
                                         r"mean '%s'\?" % (name, suggestion)):
        mx.kv.create(name)


def test_other_kvstore_types_are_created_as_before():
    assert mx.kv.create('local').type == 'local'
    assert mx.kv.create('device').type == 'device'
    with pytest.raises(TypeError, match='name must be a string'):
        mx.kv.create(3)
